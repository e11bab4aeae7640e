//! `ExecutorStart_hook`: the ownership check (RM001) and the handover's checks; a single-shard
//! SELECT or write routed to this node swapped for its local plan
//! (`router::modify::local_plan_on_top`);
//! then the previous executor start.

use pgrx::pg_sys;
use pgrx::prelude::*;

static mut PREV_EXECUTOR_START: pg_sys::ExecutorStart_hook_type = None;

pub(super) fn install() {
    // SAFETY: process-global hook set once at preload, previous value chained.
    unsafe {
        PREV_EXECUTOR_START = pg_sys::ExecutorStart_hook;
        pg_sys::ExecutorStart_hook = Some(executor_start);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn executor_start(query_desc: *mut pg_sys::QueryDesc, eflags: i32) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        crate::cluster::forwarded_role::enter();
        // A plan from a kept statement shape: its values become the statement's parameters.
        crate::router::shapes::bind(query_desc);
        if let Err(e) = crate::router::ownership::check(query_desc)
            .and_then(|()| crate::router::modify::local_plan_on_top(query_desc, eflags))
        {
            e.raise();
        }
        match PREV_EXECUTOR_START {
            Some(prev) => prev(query_desc, eflags),
            None => pg_sys::standard_ExecutorStart(query_desc, eflags),
        }
    }
}
