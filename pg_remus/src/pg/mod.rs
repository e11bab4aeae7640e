//! PostgreSQL glue: thin wrappers over `pg_sys` that the feature modules share, so the raw
//! pointer work behind them is written (and justified) once.
//!
//! - [`list`]: walking `List`s and checking node tags.
//! - [`datum`]: datums to and from text, copying them between memory contexts.
//! - [`spi`]: the extension's own catalog queries, run as its owner.
//! - [`sql`]: quoting for SQL text sent to this or another node.
//! - [`extension`]: is pg_remus created in this database?
//! - [`latch`]: the interruptible sleep of every wait loop.
//! - [`isolation`]: the transaction's isolation level, as routing asks it.
//! - [`ffi`]: the C functions pgrx does not bind.
//! - [`custom_scan`]: filling and registering a CustomScan's method tables.
//! - [`query_tree`]: every Query of a statement (WITH queries, subqueries, sublinks).

pub(crate) mod custom_scan;
pub(crate) mod datum;
pub(crate) mod extension;
pub(crate) mod ffi;
pub(crate) mod isolation;
pub(crate) mod latch;
pub(crate) mod list;
pub(crate) mod query_tree;
pub(crate) mod spi;
pub(crate) mod sql;
