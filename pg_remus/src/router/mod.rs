//! The statement router: distributed tables used as if they were local, from any node.
//!
//! - SELECT on one shard group (every distributed table tied to one key value, at any depth:
//!   [`colocated`]): one statement there. Aggregates over one table: per shard and combined
//!   ([`fanout`]). Otherwise every scan of a distributed table's shell becomes a [`scan`]
//!   CustomScan that reads the shards it needs (one, when the query has `key = <value>`; all
//!   otherwise), shipping the clauses a shard can evaluate and only the columns read, and hands
//!   their rows to PostgreSQL, which then does joins, aggregates, sorting and limits itself.
//!   Results are therefore exactly PostgreSQL's own.
//! - INSERT / UPDATE / DELETE: [`modify`] replaces the plan with a CustomScan that sends the
//!   statement to the shard(s) it touches: one shard for `key = <value>` or a single-row
//!   INSERT, each row's shard for a multi-row INSERT, every shard otherwise; with WITH,
//!   subqueries, `INSERT … SELECT`, `UPDATE … FROM` or `DELETE … USING`, only within one shard
//!   group ([`colocated`]).
//! - Shard work is always a statement on the shell's name carrying a `/*remus:shard=N*/`
//!   marker. A node honours the marker only in a session opened by another node
//!   (`remus.forwarded`) or in its own nested local execution, by planning the statement
//!   against the local shard table (relid swap) — so the decision where a shard lives is made
//!   once, by the coordinating backend, and the executing node never routes again.
//! - Routing decisions read the shard map at execution time, never at plan time: cached plans
//!   outlive migrations.

//!
//! Modules:
//! - [`placement`]: the routing decision API: which relations are shells, and the shard map as
//!   this transaction uses it (pinned per shard at first use).
//! - [`planner`]: the planner hook's decision; [`marker`]: when the shard marker is honoured,
//!   and the relid swap that executes it.
//! - [`key`]: the shard-key value of a statement and the placement it maps to;
//!   [`colocated`]: statements whose distributed tables all read one shard group.
//! - [`scan`] (`RemusShardScan`) and [`modify`] (`RemusRouter`): the two CustomScans.
//! - [`local`]: the fast path, a statement on one shard group this node owns planned on the
//!   local shard tables and run in the statement's own executor (a SELECT planned so at plan
//!   time) or a nested one (no SPI, no deparse).
//! - [`fanout`]: count / sum / min / max / avg over every shard of a table, computed per shard
//!   and combined.
//! - [`execute`]: running one marked statement where its shard lives; [`deparse`]: the text
//!   sent there.
//! - [`utility`]: COPY FROM, TRUNCATE and the refused utility statements; [`grant`]: GRANT and
//!   REVOKE on distributed tables, on every node.
//! - [`shapes`]: a statement sent as text with its constants, planned once per shape as a
//!   prepared statement would be (its key and written values bound as parameters).
//! - [`ownership`]: the RM001 check of statements on shard tables; [`privileges`]: the shell's
//!   privileges checked for a plan on shard tables.

pub(crate) mod colocated;
pub(crate) mod deparse;
pub(crate) mod execute;
pub(crate) mod fanout;
pub(crate) mod grant;
pub(crate) mod key;
pub(crate) mod local;
pub(crate) mod marker;
pub(crate) mod modify;
pub(crate) mod ownership;
pub(crate) mod placement;
pub(crate) mod planner;
pub(crate) mod privileges;
pub(crate) mod scan;
pub(crate) mod shapes;
pub(crate) mod utility;
