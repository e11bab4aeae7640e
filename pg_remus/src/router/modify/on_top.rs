//! A single-shard SELECT, or a write on one shard, that execution routes to this node runs as
//! its local plan alone, with no `RemusRouter` node above it (decision 0034).
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
//! A write is decided as the router's `run` decides it for one shard (`write_here`): the key of
//! an UPDATE's or DELETE's first `key = value` conjunct or of a single-row INSERT, the
//! placement pinned; when that is this node and the shard is not draining, its local
//! ModifyTable plan becomes the statement's, and the handover's write checks the router runs
//! before a spliced write (the lock_abort fence, the restart guard) run after squall's wait.
//! The executor then counts the rows it changes and returns its RETURNING rows itself.
//!
//! Anything else keeps the router node, which decides again at its first row (the pin makes
//! that the same answer): EXPLAIN and instrumented runs (they show the router node and how it
//! ran), cursors that scroll or rewind, row locks (the drain fence), a key that is not a
//! constant or a parameter (for a write, nor a cast of one), a node that is not the owner, a
//! local plan that locks rows, wants parallel workers or returns junk columns (`runs_on_top`);
//! and for writes, a draining shard (the drain fence waits in the router), a reference table, a
//! write within a shard group, a multi-row INSERT and a key or identity value drawn from a
//! sequence.

use pgrx::pg_sys;

use crate::catalog::{DistTable, ShardPlacement};
use crate::error::RemusError;
use crate::pg::list::list_ptrs;
use crate::router::execute::constant_or_param;
use crate::router::local::{local_plan_for_shard, runs_on_top};
use crate::router::placement::dist_table;

use super::{
    draining, group_of, is_identity_value, is_router_plan, same_node_for_every_table,
    single_shard_key, spliced_of,
};

/// Executor flags under which the router node stays: EXPLAIN shows it; a local plan is made
/// for reading forward once.
const KEEPS_ROUTER: u32 = pg_sys::EXEC_FLAG_EXPLAIN_ONLY
    | pg_sys::EXEC_FLAG_BACKWARD
    | pg_sys::EXEC_FLAG_MARK
    | pg_sys::EXEC_FLAG_REWIND;

/// Replaces the `RemusRouter` plan `query_desc` is about to start by its local plan, when
/// execution routes the statement (a SELECT or a write) to this node's shard (see the module
/// comment); otherwise leaves it as it is. Errors are the router's own, raised at start instead
/// of at the first row.
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
            || stmt.is_null()
            || !is_router_plan(stmt)
        {
            return Ok(());
        }
        let cscan = (*stmt).planTree as *mut pg_sys::CustomScan;
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        let query = private[0] as *mut pg_sys::Query;
        if (*query).commandType != (*query_desc).operation {
            return Ok(());
        }
        let decided = match (*query_desc).operation {
            pg_sys::CmdType::CMD_SELECT => select_here(query_desc, query, &private)?,
            pg_sys::CmdType::CMD_INSERT
            | pg_sys::CmdType::CMD_UPDATE
            | pg_sys::CmdType::CMD_DELETE => write_here(query_desc, query, &private)?,
            _ => None,
        };
        let Some((table, placement)) = decided else {
            return Ok(());
        };
        let outputs = pg_sys::list_length((*cscan).scan.plan.targetlist) as usize;
        let top = if let Some((child, shard)) = spliced_of(cscan) {
            // Spliced at plan time: the statement's own range table already names the shard
            // tables, with the shells' privileges kept on it.
            if shard != placement.shard_id || !runs_on_top(stmt, child, outputs) {
                return Ok(());
            }
            flat_copy(stmt, stmt, child)
        } else {
            let local =
                local_plan_for_shard(cscan, query, &table, &placement, (*query_desc).sourceText)?;
            let Some(local) = local.filter(|l| runs_on_top(*l, (**l).planTree, outputs)) else {
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
        crate::migration::squall::wait_for_pulls(query_desc)?;
        if (*query_desc).operation != pg_sys::CmdType::CMD_SELECT {
            // The handover's checks the router runs before it starts a spliced write (the
            // ownership check leaves a router plan to the router, and saw the shells): the
            // fence of a moved shard, and the guard of a copy a migration lost in a restart
            // moves away.
            crate::migration::handover::lock_abort::check_write(&[placement.shard_id])?;
            crate::migration::handover::restart::check_write(&[placement.shard_id])?;
        }
        Ok(())
    }
}

/// The router's decision for a single-shard-group SELECT whose key is a constant or a
/// parameter, when it is this node: the anchor table and its placement (pinned). None: the
/// router node decides (another node, a computed key, row locks, `key = NULL`).
///
/// # Safety
/// As [`local_plan_on_top`]'s; `query` and `private` are the router plan's.
unsafe fn select_here(
    query_desc: *mut pg_sys::QueryDesc,
    query: *mut pg_sys::Query,
    private: &[*mut pg_sys::Node],
) -> Result<Option<(DistTable, ShardPlacement)>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if !(*query).rowMarks.is_null() {
            return Ok(None);
        }
        let Some((value, anchor)) = group_of(private) else {
            return Ok(None);
        };
        // A constant or a parameter of the statement (a prepared statement's key); `key =
        // NULL` selects nothing, and the router returns no row without routing.
        let Some((datum, false, value_type)) = constant_or_param(value, (*query_desc).params)
        else {
            return Ok(None);
        };
        let Some(table) = dist_table(anchor)? else {
            return Ok(None);
        };
        let placement = with_statement_snapshot((*query_desc).snapshot, || {
            let p = crate::router::key::placement_by_key(&table, datum, value_type)?;
            same_node_for_every_table(query, anchor, &p, datum, value_type)?;
            Ok(p)
        })?;
        Ok(crate::guc::is_this_node(&placement.node_name).then_some((table, placement)))
    }
}

/// The router's decision for a write on one shard of a distributed table, when it is this
/// node and the shard is not draining: the table and its placement (pinned). The shard is the
/// one the router's `targets` finds: an UPDATE's or DELETE's first `key = value` conjunct, a
/// single-row INSERT's key value, each a constant or a parameter. None: the router node
/// decides, for everything it does beyond running the shard's plan: a write within a shard
/// group (checked against the group's other tables), a reference table (every copy), a
/// multi-row INSERT (split by shard), a key or identity value it draws from a sequence, a
/// draining shard (the drain fence), another node.
///
/// # Safety
/// As [`local_plan_on_top`]'s; `query` and `private` are the router plan's.
unsafe fn write_here(
    query_desc: *mut pg_sys::QueryDesc,
    query: *mut pg_sys::Query,
    private: &[*mut pg_sys::Node],
) -> Result<Option<(DistTable, ShardPlacement)>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if group_of(private).is_some() {
            return Ok(None);
        }
        let rtable = list_ptrs::<pg_sys::RangeTblEntry>((*query).rtable);
        let Some(&target) = rtable.get(((*query).resultRelation as usize).wrapping_sub(1)) else {
            return Ok(None);
        };
        let Some(table) = dist_table((*target).relid)? else {
            return Ok(None);
        };
        if table.kind != 'h' || table.key_attno <= 0 {
            return Ok(None);
        }
        // An identity value is drawn on this node by the router, into a copy of the statement.
        if (*query).commandType == pg_sys::CmdType::CMD_INSERT
            && list_ptrs::<pg_sys::TargetEntry>((*query).targetList)
                .iter()
                .any(|te| is_identity_value((**te).expr as *mut pg_sys::Node))
        {
            return Ok(None);
        }
        // The same shard the plan-time local plan was made for: a one-row INSERT's key, an
        // UPDATE's or DELETE's first `key = value` conjunct.
        let Some(key) = single_shard_key(query, table.key_attno) else {
            return Ok(None);
        };
        // `key = NULL` writes nothing and an INSERT of a NULL key is refused: the router's.
        let Some((datum, false, value_type)) = routable_value(key, (*query_desc).params) else {
            return Ok(None);
        };
        let placement = with_statement_snapshot((*query_desc).snapshot, || {
            crate::router::key::placement_by_key(&table, datum, value_type)
        })?;
        if !crate::guc::is_this_node(&placement.node_name) || draining(&placement) {
            return Ok(None);
        }
        Ok(Some((table, placement)))
    }
}

/// The value of a routing key expression at the statement's start: a constant or a parameter
/// as it is, a cast of one (`1::bigint` as the rewriter leaves an integer literal for a bigint
/// column, `$1::bigint`) evaluated here, as the router's `eval_expr` would at its first row.
/// None: not such an expression (the router decides).
///
/// # Safety
/// `expr` must be a valid expression of the starting statement and `params` its parameters.
unsafe fn routable_value(
    expr: *mut pg_sys::Expr,
    params: pg_sys::ParamListInfo,
) -> Option<(pg_sys::Datum, bool, pg_sys::Oid)> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the expression context
    // lives in the current memory context, the statement's, and the value is copied out of
    // its per-tuple memory before it is freed. A cast that fails raises the error the router
    // would raise for it.
    unsafe {
        if let Some(known) = constant_or_param(expr, params) {
            return Some(known);
        }
        if !crate::router::key::is_routable_value(expr as *mut pg_sys::Node) {
            return None;
        }
        let ty = pg_sys::exprType(expr as *const pg_sys::Node);
        let econtext = pg_sys::CreateStandaloneExprContext();
        let state = pg_sys::ExecInitExprWithParams(expr, params);
        let mut isnull = false;
        let value = pg_sys::ExecEvalExprSwitchContext(state, econtext, &mut isnull);
        let value = if isnull {
            value
        } else {
            let (mut len, mut byval) = (0i16, false);
            pg_sys::get_typlenbyval(ty, &mut len, &mut byval);
            crate::pg::datum::copy_datum(value, byval, len)
        };
        pg_sys::FreeExprContext(econtext, true);
        Some((value, isnull, ty))
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
