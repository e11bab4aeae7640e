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
//! - [`relation`]: a `RangeVar`'s relation id; the `RangeVar` of a shard table.
//! - [`fast_map`]: the hash map of the per-backend caches on the statement path.

pub(crate) mod custom_scan;
pub(crate) mod datum;
pub(crate) mod extension;
pub(crate) mod ffi;
pub(crate) mod isolation;
pub(crate) mod latch;
pub(crate) mod list;
pub(crate) mod query_tree;
pub(crate) mod relation;
pub(crate) mod spi;
pub(crate) mod sql;

pub(crate) mod fast_map {
    //! The hash map of the per-backend caches on the statement and commit path.
    //!
    //! Their keys are OIDs, shard ids and plan-node addresses that the backend itself
    //! computes, never a value a client chooses, so the standard library's DoS-resistant
    //! SipHash buys nothing there, and it was a visible share of the router's own time in a
    //! profile of pgbench select-only on the owner (issue 16). FxHash (rustc-hash) hashes an
    //! integer key in a multiply.

    use std::collections::HashMap;

    pub(crate) use rustc_hash::FxBuildHasher;

    /// A `HashMap` with FxHash, for keys the backend computes (OIDs, shard ids, addresses).
    pub(crate) type FastMap<K, V> = HashMap<K, V, FxBuildHasher>;

    /// An empty [`FastMap`]; `const`, so a `thread_local!` holding one needs no lazy
    /// initialisation.
    pub(crate) const fn fast_map<K, V>() -> FastMap<K, V> {
        HashMap::with_hasher(FxBuildHasher)
    }
}
