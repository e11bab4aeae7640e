//! A single-shard SELECT that execution routes to this node runs as its local plan alone, with
//! no `RemusRouter` node above it (decision 0034).
//!
//! The router node decides at its first row, inside the started executor; then it starts the
//! local plan under itself and hands every row up. For a prepared statement that is a custom
//! scan's state, slots, a callback per row and its own start and end, around an index scan
//! that costs about as much. This module makes the same decision one step earlier, in
//! `ExecutorStart` before the executor is built, and when it is "this node, this shard" starts
//! the executor on a copy of the local plan's `PlannedStmt` instead of the router's: the
//! plan PostgreSQL would run on the shard table by itself.
//!
//! The decision is the router's (`run_select`): the anchor's key value, the placement by key
//! read with the statement's snapshot and pinned for the (transaction, shard), every table of
//! the group routed to the same node. The local plan is the one the router would run: the
//! spliced plan made at plan time, or the one made at execution and kept per shard
//! (`local::local_plan_for_shard`). The statement's privileges are checked on the shells
//! first, as the router plan's `ExecutorStart` would check them (a local plan made at
//! execution names shard tables and checks nothing). Then squall's wait for pulls sees the
//! shard tables, and replaces the statement's snapshot if it must.
//!
//! Anything else keeps the router node, which decides again at its first row (the pin makes
//! that the same answer): EXPLAIN and instrumented runs (they show the router node and how it
//! ran), cursors that scroll or rewind, row locks (the drain fence), a key that is not a
//! constant or a parameter, a node that is not the owner, a local plan that needs what a
//! spliced one may not have (subplans, executor parameters, junk columns).

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::pg::list::list_ptrs;
use crate::router::execute::constant_or_param;
use crate::router::local::{local_plan_for_shard, runs_spliced};
use crate::router::placement::dist_table;

use super::{group_of, is_router_plan, same_node_for_every_table, spliced_of};

/// Executor flags under which the router node stays: EXPLAIN shows it; a local plan is made
/// for reading forward once.
const KEEPS_ROUTER: u32 = pg_sys::EXEC_FLAG_EXPLAIN_ONLY
    | pg_sys::EXEC_FLAG_BACKWARD
    | pg_sys::EXEC_FLAG_MARK
    | pg_sys::EXEC_FLAG_REWIND;

/// Replaces the `RemusRouter` plan `query_desc` is about to start by its local plan, when
/// execution routes the statement to this node's shard (see the module comment); otherwise
/// leaves it as it is. Errors are the router's own, raised at start instead of at the first
/// row.
///
/// # Safety
/// `query_desc` must be the QueryDesc that ExecutorStart is starting, its executor not built.
pub(crate) unsafe fn local_plan_on_top(
    query_desc: *mut pg_sys::QueryDesc,
    eflags: i32,
) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the plan, its private
    // list and the parameters are live for the statement's execution.
    unsafe {
        let stmt = (*query_desc).plannedstmt;
        if !crate::guc::LOCAL_PLAN_ON_TOP.get()
            || eflags as u32 & KEEPS_ROUTER != 0
            || (*query_desc).instrument_options != 0
            || (*query_desc).operation != pg_sys::CmdType::CMD_SELECT
            || stmt.is_null()
            || !is_router_plan(stmt)
        {
            return Ok(());
        }
        let cscan = (*stmt).planTree as *mut pg_sys::CustomScan;
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        let query = private[0] as *mut pg_sys::Query;
        if (*query).commandType != pg_sys::CmdType::CMD_SELECT || !(*query).rowMarks.is_null() {
            return Ok(());
        }
        let Some((value, anchor)) = group_of(&private) else {
            return Ok(());
        };
        // A constant or a parameter of the statement (a prepared statement's key); `key =
        // NULL` selects nothing, and the router returns no row without routing.
        let Some((datum, false, value_type)) = constant_or_param(value, (*query_desc).params)
        else {
            return Ok(());
        };
        let Some(table) = dist_table(anchor)? else {
            return Ok(());
        };
        let placement = with_statement_snapshot((*query_desc).snapshot, || {
            let p = crate::router::key::placement_by_key(&table, datum, value_type)?;
            same_node_for_every_table(query, anchor, &p, datum, value_type)?;
            Ok(p)
        })?;
        if !crate::guc::is_this_node(&placement.node_name) {
            return Ok(());
        }
        let outputs = pg_sys::list_length((*cscan).scan.plan.targetlist) as usize;
        let top = if let Some((child, shard)) = spliced_of(cscan) {
            // Spliced at plan time: the statement's own range table already names the shard
            // tables, with the shells' privileges kept on it.
            if shard != placement.shard_id || !runs_spliced(stmt, child, outputs) {
                return Ok(());
            }
            flat_copy(stmt, stmt, child)
        } else {
            let local =
                local_plan_for_shard(cscan, query, &table, &placement, (*query_desc).sourceText)?;
            let Some(local) = local.filter(|l| runs_spliced(*l, (**l).planTree, outputs)) else {
                return Ok(());
            };
            if !crate::router::local::relations_here(local) {
                return Ok(());
            }
            // The local plan's entries name shard tables and require nothing: the statement's
            // privileges are the shells', checked here as its own ExecutorStart would.
            pg_sys::ExecCheckRTPerms((*stmt).rtable, true);
            flat_copy(local, stmt, (*local).planTree)
        };
        (*query_desc).plannedstmt = top;
        // squall: the shard tables now in the plan are waited for, as a local plan the router
        // starts waits for them.
        crate::migration::squall::wait_for_pulls(query_desc)
    }
}

/// Runs `f` with `snapshot` as the active snapshot, as the router's decision at its first row
/// runs (the portal pushes the QueryDesc's snapshot): squall's wait may have replaced it.
fn with_statement_snapshot<R>(
    snapshot: pg_sys::Snapshot,
    f: impl FnOnce() -> Result<R, RemusError>,
) -> Result<R, RemusError> {
    // SAFETY: reading and pushing the active snapshot inside a transaction; the snapshot is
    // the QueryDesc's, registered for as long as the statement runs, and popped below before
    // any return (an ERROR raised inside `f` unwinds the stack at abort).
    let pushed = unsafe {
        let push = !snapshot.is_null() && pg_sys::GetActiveSnapshot() != snapshot;
        if push {
            pg_sys::PushActiveSnapshot(snapshot);
        }
        push
    };
    let r = f();
    if pushed {
        // SAFETY: pops the snapshot pushed above.
        unsafe { pg_sys::PopActiveSnapshot() };
    }
    r
}

/// A copy of `src` (the statement header, not its tree) whose plan tree is `tree`, carrying
/// what identifies the statement `orig` (its query id for pg_stat_statements, its text's
/// location, whether it sets the command tag), in the current memory context: the
/// executor's state of one execution. The cached plans are not changed.
///
/// # Safety
/// `src` and `orig` must be valid PlannedStmts and `tree` a plan over `src`'s range table.
unsafe fn flat_copy(
    src: *mut pg_sys::PlannedStmt,
    orig: *mut pg_sys::PlannedStmt,
    tree: *mut pg_sys::Plan,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: the caller upholds this function's `# Safety` contract; a bitwise copy of a
    // node struct shares its lists with the original, which the executor only reads.
    unsafe {
        let copy =
            pg_sys::palloc(std::mem::size_of::<pg_sys::PlannedStmt>()) as *mut pg_sys::PlannedStmt;
        copy.write(src.read());
        (*copy).planTree = tree;
        (*copy).queryId = (*orig).queryId;
        (*copy).canSetTag = (*orig).canSetTag;
        (*copy).stmt_location = (*orig).stmt_location;
        (*copy).stmt_len = (*orig).stmt_len;
        copy
    }
}
