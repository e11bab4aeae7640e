//! `planner_hook`: the admission gate, then a kept statement shape or the router's decision, then
//! the previous planner.

use pgrx::pg_sys;
use pgrx::prelude::*;

static mut PREV_PLANNER: pg_sys::planner_hook_type = None;

pub(super) fn install() {
    // SAFETY: process-global hook set once at preload, previous value chained.
    unsafe {
        PREV_PLANNER = pg_sys::planner_hook;
        pg_sys::planner_hook = Some(remus_planner);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn remus_planner(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound_params: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        crate::cluster::forwarded_role::enter();
        // A gated transaction waits before its statement is routed, so that the routing decision
        // is taken after the gate opens.
        if let Err(e) = crate::migration::handover::admit_statement() {
            e.raise();
        }
        let ctx = crate::router::local::PlanContext {
            next: next_planner,
            query_string,
            cursor_options,
            bound_params,
        };
        // A statement with constants whose shape was routed before reuses that plan.
        if let Some(stmt) = crate::router::shapes::planned(parse, &ctx) {
            return stmt;
        }
        match crate::router::planner::route(parse, &ctx) {
            Ok(Some(stmt)) => return stmt,
            Ok(None) => {}
            Err(e) => e.raise(),
        }
        next_planner(parse, query_string, cursor_options, bound_params)
    }
}

/// The planner after this hook: the previous hook of the chain, or PostgreSQL's.
///
/// # Safety
/// As for a `planner_hook`: the planner's Query, its text, options and bound parameters.
unsafe fn next_planner(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound_params: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: the caller upholds this function's `# Safety` contract; PREV_PLANNER is set once
    // at preload.
    unsafe {
        match PREV_PLANNER {
            Some(prev) => prev(parse, query_string, cursor_options, bound_params),
            None => pg_sys::standard_planner(parse, query_string, cursor_options, bound_params),
        }
    }
}
