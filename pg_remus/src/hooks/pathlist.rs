//! `set_rel_pathlist_hook`: a scan of a distributed table's shell becomes a `RemusShardScan`.

use pgrx::pg_sys;
use pgrx::prelude::*;

static mut PREV_PATHLIST: pg_sys::set_rel_pathlist_hook_type = None;

/// Registers the `RemusShardScan` methods, then installs the hook.
pub(super) fn install() {
    crate::router::scan::register_methods();
    // SAFETY: process-global hook set once at preload, previous value chained.
    unsafe {
        PREV_PATHLIST = pg_sys::set_rel_pathlist_hook;
        pg_sys::set_rel_pathlist_hook = Some(pathlist_hook);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn pathlist_hook(
    root: *mut pg_sys::PlannerInfo,
    rel: *mut pg_sys::RelOptInfo,
    rti: pg_sys::Index,
    rte: *mut pg_sys::RangeTblEntry,
) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        if let Some(prev) = PREV_PATHLIST {
            prev(root, rel, rti, rte);
        }
        crate::router::scan::add_path(rel, rte);
    }
}
