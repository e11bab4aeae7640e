//! Every PostgreSQL hook and callback pg_remus installs, in one place. Each one dispatches down
//! to the features in a fixed order; no feature module imports `hooks`.
//!
//! - [`emit_log`]: `emit_log_hook` (SQLSTATEs pgrx cannot name, lock_abort's cancels).
//! - [`xact`]: the transaction and subtransaction callbacks (dual execution, 2PC, the
//!   end-of-transaction bookkeeping of the router and the handover).
//! - [`planner`]: `planner_hook`; [`pathlist`]: `set_rel_pathlist_hook`;
//!   [`executor_start`]: `ExecutorStart_hook`; [`process_utility`]: `ProcessUtility_hook`.
//! - [`relcache`]: the relcache invalidation callback.

mod emit_log;
mod executor_start;
mod pathlist;
mod planner;
mod process_utility;
mod relcache;
mod xact;

/// Installs every hook and callback (chaining the previous hooks), and registers the
/// CustomScan methods; must run while the library is preloaded.
pub(crate) fn install() {
    emit_log::install();
    xact::install();
    planner::install();
    relcache::install();
    pathlist::install();
    crate::router::modify::register_methods();
    executor_start::install();
    process_utility::install();
}
