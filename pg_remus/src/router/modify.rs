//! INSERT / UPDATE / DELETE on distributed tables, and SELECTs that read a single shard group
//! of co-located tables.
//!
//! The plan is a single `RemusRouter` CustomScan carrying the rewritten Query. At execution it
//! finds the shard(s) the statement touches, deparses the statement (the full original text:
//! RETURNING, ON CONFLICT, defaults already expanded by the rewriter), and runs it per shard
//! where the shard lives, inside the current transaction. Remote writers join two-phase commit.
//! A statement on one shard whose local plan was made at plan time has that plan under the
//! node instead, run in this executor when execution decides the shard is here
//! ([`build_spliced_stmt`], decision 0014).

use std::collections::BTreeMap;
use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::catalog::{DistTable, ShardPlacement};
use crate::error::RemusError;
use crate::pg::custom_scan;
use crate::pg::list::{is_tag, list_ptrs};
use crate::router::execute::{Join, Params};
use crate::router::local::PlanContext;

mod fence;
mod on_top;

pub(crate) use on_top::local_plan_on_top;

// SAFETY: all-zero is a valid value of this C struct (NULL name, no callbacks); it is filled in
// at preload, before PostgreSQL can see it.
static mut SCAN_METHODS: pg_sys::CustomScanMethods = unsafe { std::mem::zeroed() };
// SAFETY: all-zero is a valid value of this C struct (NULL name, no callbacks); it is filled in
// at preload, before PostgreSQL can see it.
static mut EXEC_METHODS: pg_sys::CustomExecMethods = unsafe { std::mem::zeroed() };
const NAME: &CStr = c"RemusRouter";

#[repr(C)]
struct ModifyState {
    css: pg_sys::CustomScanState,
    tstore: *mut pg_sys::Tuplestorestate,
    /// Tuplestores hand out minimal tuples; the scan slot of a CustomScan is not of that kind.
    store_slot: *mut pg_sys::TupleTableSlot,
    done: bool,
    /// A SELECT's local plan, started ([`super::local`]); NULL: rows come from `tstore`.
    local: *mut pg_sys::QueryDesc,
    /// A spliced local plan (a SELECT's or a write's), started in this executor
    /// ([`spliced_of`]); NULL: not (yet) chosen.
    child: *mut pg_sys::PlanState,
    /// The executor flags this node was started with, for starting `child` later.
    eflags: i32,
    /// How the statement ran, for EXPLAIN ANALYZE.
    ran: Ran,
}

/// How a `RemusRouter` statement ran.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Ran {
    /// Not yet (or it touched no shard).
    NotYet,
    /// Its local plan, on this node's shard tables.
    LocalPlan,
    /// Deparsed and sent to each shard's owner (this node included).
    Routed,
}

/// Fills and registers the method tables; must run while the library is preloaded.
pub(crate) fn register_methods() {
    // SAFETY: one-time initialisation at preload.
    unsafe {
        custom_scan::register(
            &raw mut SCAN_METHODS,
            &raw mut EXEC_METHODS,
            &custom_scan::Methods {
                name: NAME,
                create_state,
                begin,
                exec,
                end,
                rescan,
                explain: Some(explain),
            },
        );
    }
}

fn unsupported(what: &'static str) -> RemusError {
    RemusError::UnsupportedOnDistributed { what }
}

/// Checks that the statement is a form we run correctly, and builds its plan.
///
/// # Safety
/// `parse` must be a valid rewritten Query whose result relation is `table`'s shell.
pub unsafe fn plan(
    parse: *mut pg_sys::Query,
    table: &DistTable,
    ctx: &PlanContext,
) -> Result<*mut pg_sys::PlannedStmt, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let q = &*parse;
        // WITH, subqueries, INSERT … SELECT, UPDATE … FROM and DELETE … USING run whole on the
        // shard group they are tied to; not tied to one, they are refused below.
        if table.kind == 'h' && reads_beyond_its_target(q) {
            if let Some((_, value)) = super::colocated::colocated_anchor(parse)? {
                return plan_group_write(parse, table, value, ctx);
            }
        }
        if !q.cteList.is_null() {
            return Err(unsupported(
                "WITH in INSERT/UPDATE/DELETE outside the statement's shard group",
            ));
        }
        if q.hasSubLinks {
            return Err(unsupported(
                "a subquery in INSERT/UPDATE/DELETE outside the statement's shard group",
            ));
        }
        if q.hasTargetSRFs {
            return Err(unsupported(
                "a set-returning function in INSERT/UPDATE/DELETE",
            ));
        }
        // Reference tables have no key; 0 never matches a column.
        let key_attno = if table.kind == 'r' {
            0
        } else {
            super::key::key_attno(table)?
        };
        if table.kind == 'r' {
            // Every node evaluates the statement for its own copy: a volatile expression (now(),
            // random(), a gen_random_uuid() default) would give each copy a different value.
            let mut exprs = q.targetList as *mut pg_sys::Node;
            if pg_sys::contain_volatile_functions(exprs) {
                return Err(unsupported("a volatile expression (such as now(), random() or a gen_random_uuid() default) in a write to a reference table"));
            }
            exprs = q.returningList as *mut pg_sys::Node;
            let quals = if q.jointree.is_null() {
                std::ptr::null_mut()
            } else {
                (*q.jointree).quals
            };
            if pg_sys::contain_volatile_functions(exprs)
                || pg_sys::contain_volatile_functions(quals)
            {
                return Err(unsupported(
                    "a volatile expression in a write to a reference table",
                ));
            }
            for rte in list_ptrs::<pg_sys::RangeTblEntry>(q.rtable) {
                if (*rte).rtekind == pg_sys::RTEKind::RTE_VALUES
                    && pg_sys::contain_volatile_functions((*rte).values_lists as *mut pg_sys::Node)
                {
                    return Err(unsupported(
                        "a volatile expression in a write to a reference table",
                    ));
                }
            }
        }
        let rtes = list_ptrs::<pg_sys::RangeTblEntry>(q.rtable);
        match q.commandType {
            pg_sys::CmdType::CMD_INSERT => {
                let excluded = if q.onConflict.is_null() {
                    0
                } else {
                    (*q.onConflict).exclRelIndex as usize
                };
                for (i, rte) in rtes.iter().enumerate() {
                    // ON CONFLICT DO UPDATE adds the `excluded` pseudo-relation.
                    if i + 1 != q.resultRelation as usize
                        && i + 1 != excluded
                        && (**rte).rtekind != pg_sys::RTEKind::RTE_VALUES
                    {
                        return Err(unsupported(
                            "INSERT … SELECT other than within the target's shard group",
                        ));
                    }
                }
            }
            _ => {
                if rtes.len() != 1 {
                    return Err(unsupported(
                        "UPDATE … FROM / DELETE … USING other than within the target's shard group",
                    ));
                }
            }
        }
        keeps_the_key(q, key_attno)?;

        let returning = list_ptrs::<pg_sys::TargetEntry>(q.returningList);
        let private = pg_sys::lappend(
            std::ptr::null_mut(),
            pg_sys::copyObjectImpl(parse as *const std::ffi::c_void),
        );
        let key = if table.kind == 'r' {
            None
        } else {
            single_shard_key(parse, key_attno)
        };
        let local = local_plan_for(parse, table, key, ctx)?;
        if let Some(local) = local {
            if let Some(stmt) =
                build_spliced_stmt(parse, &returning, &[table.relid], private, local)
            {
                return Ok(stmt);
            }
        }
        Ok(build_stmt(
            parse,
            &returning,
            &[table.relid],
            private,
            local,
        ))
    }
}

/// Refuses a write that would move a row to another shard: an UPDATE of the key, an ON
/// CONFLICT DO UPDATE of it, and ON CONFLICT ON CONSTRAINT (whose arbiter the drain fence
/// cannot ship).
unsafe fn keeps_the_key(q: &pg_sys::Query, key_attno: i16) -> Result<(), RemusError> {
    // SAFETY: `q` is the planner's valid Query.
    unsafe {
        if q.commandType == pg_sys::CmdType::CMD_UPDATE {
            for te in list_ptrs::<pg_sys::TargetEntry>(q.targetList) {
                if (*te).resno == key_attno && !(*te).resjunk {
                    return Err(unsupported("UPDATE of the shard key"));
                }
            }
        }
        if !q.onConflict.is_null() {
            let oc = q.onConflict;
            if (*oc).constraint != pg_sys::InvalidOid {
                return Err(unsupported(
                    "ON CONFLICT ON CONSTRAINT (name the conflict columns instead)",
                ));
            }
            for te in list_ptrs::<pg_sys::TargetEntry>((*oc).onConflictSet) {
                if (*te).resno == key_attno {
                    return Err(unsupported("ON CONFLICT DO UPDATE of the shard key"));
                }
            }
        }
        Ok(())
    }
}

/// Does a write read more than its target and its own values: WITH, a sublink, INSERT …
/// SELECT, UPDATE … FROM, DELETE … USING?
unsafe fn reads_beyond_its_target(q: &pg_sys::Query) -> bool {
    // SAFETY: `q` is the planner's valid Query.
    unsafe {
        let rtes = list_ptrs::<pg_sys::RangeTblEntry>(q.rtable);
        !q.cteList.is_null()
            || q.hasSubLinks
            || match q.commandType {
                pg_sys::CmdType::CMD_INSERT => rtes
                    .iter()
                    .any(|r| (**r).rtekind == pg_sys::RTEKind::RTE_SUBQUERY),
                _ => rtes.len() > 1,
            }
    }
}

/// A write within one shard group (`super::colocated`): one statement on the group's owner,
/// which `value` (a constant or parameter) picks at execution.
///
/// # Safety
/// `parse` must be a valid rewritten INSERT, UPDATE or DELETE whose target is `table`'s shell
/// and whose distributed tables are all tied to `value`.
unsafe fn plan_group_write(
    parse: *mut pg_sys::Query,
    table: &DistTable,
    value: *mut pg_sys::Expr,
    ctx: &PlanContext,
) -> Result<*mut pg_sys::PlannedStmt, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let q = &*parse;
        if q.hasTargetSRFs {
            return Err(unsupported(
                "a set-returning function in INSERT/UPDATE/DELETE",
            ));
        }
        keeps_the_key(q, super::key::key_attno(table)?)?;
        let returning = list_ptrs::<pg_sys::TargetEntry>(q.returningList);
        let private = group_private(parse, table, value);
        let local = local_plan_for(parse, table, Some(value), ctx)?;
        Ok(build_stmt(
            parse,
            &returning,
            &relids_anywhere(parse)?,
            private,
            local,
        ))
    }
}

/// The private data of a statement on one shard group: the Query, the value that picks the
/// group, and the table it picks it for ([`group_of`] reads the last two back).
///
/// Not copies: the planner's Query is not changed after planning (only the local plan's copy is
/// planned), it lives as long as the plan, and a cached plan is copied whole into its own
/// context.
unsafe fn group_private(
    parse: *mut pg_sys::Query,
    anchor: &DistTable,
    value: *mut pg_sys::Expr,
) -> *mut pg_sys::List {
    // SAFETY: `parse` and `value` are valid trees of the statement being planned.
    unsafe {
        let mut private = pg_sys::lappend(std::ptr::null_mut(), parse as *mut std::ffi::c_void);
        private = pg_sys::lappend(private, value as *mut std::ffi::c_void);
        let anchor_const = pg_sys::makeConst(
            pg_sys::OIDOID,
            -1,
            pg_sys::InvalidOid,
            4,
            pg_sys::Datum::from(anchor.relid.to_u32() as usize),
            false,
            true,
        );
        pg_sys::lappend(private, anchor_const as *mut std::ffi::c_void)
    }
}

/// The group value and anchor table of a statement on one shard group, from its private data;
/// None for a write planned per shard (its list is the Query and perhaps a local plan).
unsafe fn group_of(private: &[*mut pg_sys::Node]) -> Option<(*mut pg_sys::Expr, pg_sys::Oid)> {
    // SAFETY: `private` is a `RemusRouter`'s private list as this module builds it.
    unsafe {
        if private.len() < 3 || !is_tag(private[2], pg_sys::NodeTag::T_Const) {
            return None;
        }
        let anchor =
            pg_sys::Oid::from((*(private[2] as *mut pg_sys::Const)).constvalue.value() as u32);
        Some((private[1] as *mut pg_sys::Expr, anchor))
    }
}

/// Every shell the statement names, at any depth: a change to one invalidates its plan.
unsafe fn relids_anywhere(parse: *mut pg_sys::Query) -> Result<Vec<pg_sys::Oid>, RemusError> {
    // SAFETY: `parse` is the planner's valid Query.
    unsafe {
        Ok(super::placement::shells_anywhere(parse)?
            .into_iter()
            .map(|(_, t)| t.relid)
            .collect())
    }
}

/// The expression that picks the one shard of a single-shard write: `key = value` in the WHERE
/// of an UPDATE / DELETE, the key of a one-row INSERT. None: several shards, or not known.
unsafe fn single_shard_key(parse: *mut pg_sys::Query, key_attno: i16) -> Option<*mut pg_sys::Expr> {
    // SAFETY: `parse` is the planner's valid Query.
    unsafe {
        let q = &*parse;
        if q.commandType == pg_sys::CmdType::CMD_INSERT {
            let values = list_ptrs::<pg_sys::RangeTblEntry>(q.rtable)
                .into_iter()
                .any(|r| (*r).rtekind == pg_sys::RTEKind::RTE_VALUES);
            if values {
                return None;
            }
            return list_ptrs::<pg_sys::TargetEntry>(q.targetList)
                .into_iter()
                .find(|te| (**te).resno == key_attno)
                .map(|te| (*te).expr);
        }
        if q.jointree.is_null() {
            return None;
        }
        top_level_conjuncts((*q.jointree).quals)
            .into_iter()
            .find_map(|c| super::key::key_equality_value(c, q.resultRelation, key_attno))
    }
}

/// The conjuncts of a WHERE clause: the arguments of a top-level AND, or the clause itself.
///
/// # Safety
/// `quals` must be NULL or a valid expression.
unsafe fn top_level_conjuncts(quals: *mut pg_sys::Node) -> Vec<*mut pg_sys::Node> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if is_tag(quals, pg_sys::NodeTag::T_BoolExpr)
            && (*(quals as *mut pg_sys::BoolExpr)).boolop == pg_sys::BoolExprType::AND_EXPR
        {
            list_ptrs::<pg_sys::Node>((*(quals as *mut pg_sys::BoolExpr)).args)
        } else {
            vec![quals]
        }
    }
}

/// A local plan for a single-shard statement whose shard this node is expected to own and whose
/// key value is known at plan time ([`super::local`]).
unsafe fn local_plan_for(
    parse: *mut pg_sys::Query,
    anchor: &DistTable,
    key: Option<*mut pg_sys::Expr>,
    ctx: &PlanContext,
) -> Result<Option<*mut pg_sys::List>, RemusError> {
    // SAFETY: the caller passes the planner's Query and its key expression.
    unsafe {
        match key.and_then(|k| super::local::value_at_plan_time(k, ctx.bound_params)) {
            Some((value, ty)) => super::local::plan_on_local_shards(parse, anchor, value, ty, ctx),
            None => Ok(None),
        }
    }
}

/// Cost of a routed plan (only ever compared with another plan of the same statement).
const ROUTED_PLAN_COST: f64 = 100.0;

/// A SELECT that reads one shard group of co-located tables runs there as one statement. The
/// anchor value (a constant or parameter) picks the group at execution time.
///
/// # Safety
/// `parse` must be a valid rewritten SELECT over tables co-located with `anchor`.
pub unsafe fn plan_single_shard_select(
    parse: *mut pg_sys::Query,
    anchor: &DistTable,
    value: *mut pg_sys::Expr,
    ctx: &PlanContext,
) -> Result<*mut pg_sys::PlannedStmt, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let q = &*parse;
        let outputs: Vec<*mut pg_sys::TargetEntry> = list_ptrs::<pg_sys::TargetEntry>(q.targetList)
            .into_iter()
            .filter(|te| !(**te).resjunk)
            .collect();
        let relids = relids_anywhere(parse)?;
        let private = group_private(parse, anchor, value);
        let local = local_plan_for(parse, anchor, Some(value), ctx)?;
        let scroll = ctx.cursor_options & pg_sys::CURSOR_OPT_SCROLL as i32 != 0;
        if let Some(local) = local.filter(|_| !scroll) {
            let all = list_ptrs::<pg_sys::TargetEntry>(q.targetList);
            if let Some(stmt) = build_spliced_stmt(parse, &all, &relids, private, local) {
                return Ok(stmt);
            }
        }
        let stmt = build_stmt(parse, &outputs, &relids, private, local);
        if scroll {
            // The router node reads forward only: a scrollable cursor gets its rows through a
            // Material node, as PostgreSQL's planner gives a plan that cannot scan backward.
            (*stmt).planTree = materialized((*stmt).planTree);
        }
        Ok(stmt)
    }
}

/// `plan` under a Material node whose target list reads `plan`'s output by position (so that
/// EXPLAIN VERBOSE resolves it through the router node's own scan target list).
unsafe fn materialized(plan: *mut pg_sys::Plan) -> *mut pg_sys::Plan {
    // SAFETY: `plan` is a finished plan of the statement being planned; nodes palloc'd in the
    // planner's memory context.
    unsafe {
        let mat = pg_sys::materialize_finished_plan(plan);
        let entries = list_ptrs::<pg_sys::TargetEntry>((*plan).targetlist);
        (*mat).targetlist = by_position(&entries, pg_sys::OUTER_VAR);
        mat
    }
}

/// A single-shard statement whose local plan was made at plan time, spliced: the statement's
/// own plan is the local plan (its range table names the local shard tables) under a
/// `RemusRouter` node that decides at execution, as for every routed statement, whether the
/// shard is still this node's. If it is, the local plan runs in this very executor, its rows
/// (a SELECT's, or a write's RETURNING rows) passed through untouched: no second executor, no
/// copy of a row. If not (the shard moved since planning), the node routes the statement as
/// [`build_stmt`]'s plan would. `outputs`: what the statement returns (a SELECT's target list,
/// a write's RETURNING list).
///
/// None (use [`build_stmt`]): the statement locks rows (the drain fence and the row-mark
/// columns belong to the general path) or its target list has junk columns (the routed
/// fallback returns the output columns only).
unsafe fn build_spliced_stmt(
    parse: *mut pg_sys::Query,
    outputs: &[*mut pg_sys::TargetEntry],
    relids: &[pg_sys::Oid],
    mut private: *mut pg_sys::List,
    local: *mut pg_sys::List,
) -> Option<*mut pg_sys::PlannedStmt> {
    // SAFETY: `parse` is the planner's Query and `local` the list `plan_on_local_shards` made
    // for it; every node built here is palloc'd in the planner's memory context.
    unsafe {
        let q = &*parse;
        let (stmt, shard) = super::local::local_plan_of(&[local as *mut pg_sys::Node])?;
        let child = (*stmt).planTree;
        if !q.rowMarks.is_null()
            || !(*stmt).rowMarks.is_null()
            || outputs.iter().any(|te| (**te).resjunk)
            || child.is_null()
            || pg_sys::list_length((*child).targetlist) as usize != outputs.len()
        {
            return None;
        }
        let cscan =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::CustomScan>()) as *mut pg_sys::CustomScan;
        (*cscan).scan.plan.type_ = pg_sys::NodeTag::T_CustomScan;
        (*cscan).scan.plan.plan_rows = (*child).plan_rows;
        (*cscan).scan.plan.plan_width = (*child).plan_width;
        // As for every routed plan: the plan cache compares this cost with the generic plan's
        // (which has no local plan), and must keep choosing the generic one.
        (*cscan).scan.plan.total_cost = ROUTED_PLAN_COST;
        (*cscan).scan.scanrelid = 0;
        (*cscan).methods = &raw const SCAN_METHODS;
        let (scan_tlist, tlist) = output_tlists(outputs);
        (*cscan).custom_scan_tlist = scan_tlist;
        (*cscan).scan.plan.targetlist = tlist;
        (*cscan).custom_plans =
            pg_sys::lappend(std::ptr::null_mut(), child as *mut std::ffi::c_void);
        let shard = super::local::shard_const(shard);
        private = pg_sys::lappend(
            private,
            pg_sys::lappend(std::ptr::null_mut(), shard as *mut std::ffi::c_void)
                as *mut std::ffi::c_void,
        );
        (*cscan).custom_private = private;
        (*stmt).planTree = cscan as *mut pg_sys::Plan;
        (*stmt).queryId = q.queryId;
        (*stmt).canSetTag = q.canSetTag;
        (*stmt).stmt_location = q.stmt_location;
        (*stmt).stmt_len = q.stmt_len;
        // A change to a shell (distribution, DDL) invalidates cached plans of this statement,
        // as does one to a shard table (already in the local plan's list).
        for relid in relids {
            (*stmt).relationOids = pg_sys::lappend_oid((*stmt).relationOids, *relid);
        }
        Some(stmt)
    }
}

/// The spliced local plan of a `RemusRouter` node ([`build_spliced_stmt`]) and the shard (of
/// the anchor table) it was made for.
///
/// # Safety
/// `cscan` must be a `RemusRouter` plan node.
unsafe fn spliced_of(cscan: *mut pg_sys::CustomScan) -> Option<(*mut pg_sys::Plan, i64)> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let plans = list_ptrs::<pg_sys::Plan>((*cscan).custom_plans);
        let child = *plans.first()?;
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        let items = super::local::trailing_list(&private)?;
        if items.len() != 1 || !is_tag(items[0], pg_sys::NodeTag::T_Const) {
            return None;
        }
        Some((
            child,
            (*(items[0] as *mut pg_sys::Const)).constvalue.value() as i64,
        ))
    }
}

/// Is `stmt` a `RemusRouter` plan? The ownership check has nothing to look at in one: its range
/// table names the shells, or, spliced ([`build_spliced_stmt`]), shard tables whose ownership
/// is the router's decision at execution, not the check's.
///
/// # Safety
/// `stmt` must be a valid PlannedStmt.
pub(crate) unsafe fn is_router_plan(stmt: *mut pg_sys::PlannedStmt) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let top = (*stmt).planTree as *mut pg_sys::Node;
        !top.is_null()
            && is_tag(top, pg_sys::NodeTag::T_CustomScan)
            && std::ptr::eq(
                (*(top as *mut pg_sys::CustomScan)).methods,
                &raw const SCAN_METHODS,
            )
    }
}

/// The scan target list (the output expressions, for EXPLAIN and the scan tuple's type) and
/// the plan's target list (reading the scan tuple back by position, INDEX_VAR, so no
/// projection happens) of a `RemusRouter` returning `outputs`.
unsafe fn output_tlists(
    outputs: &[*mut pg_sys::TargetEntry],
) -> (*mut pg_sys::List, *mut pg_sys::List) {
    // SAFETY: `outputs` are valid target entries of the statement being planned.
    unsafe {
        let mut scan_tlist: *mut pg_sys::List = std::ptr::null_mut();
        for (i, te) in outputs.iter().enumerate() {
            let st = pg_sys::makeTargetEntry((**te).expr, (i + 1) as i16, (**te).resname, false);
            scan_tlist = pg_sys::lappend(scan_tlist, st as *mut std::ffi::c_void);
        }
        (scan_tlist, by_position(outputs, pg_sys::INDEX_VAR))
    }
}

/// A target list that reads `entries`' columns back by position from tuple `varno` (INDEX_VAR:
/// the node's scan tuple, OUTER_VAR: its child's output), keeping their names, types and junk
/// marks.
unsafe fn by_position(entries: &[*mut pg_sys::TargetEntry], varno: i32) -> *mut pg_sys::List {
    // SAFETY: `entries` are valid target entries of the statement being planned.
    unsafe {
        let mut tlist: *mut pg_sys::List = std::ptr::null_mut();
        for (i, te) in entries.iter().enumerate() {
            let resno = (i + 1) as i16;
            let expr = (**te).expr as *mut pg_sys::Node;
            let var = pg_sys::makeVar(
                varno,
                resno,
                pg_sys::exprType(expr),
                pg_sys::exprTypmod(expr),
                pg_sys::exprCollation(expr),
                0,
            );
            let out = pg_sys::makeTargetEntry(
                var as *mut pg_sys::Expr,
                resno,
                (**te).resname,
                (**te).resjunk,
            );
            tlist = pg_sys::lappend(tlist, out as *mut std::ffi::c_void);
        }
        tlist
    }
}

/// A PlannedStmt whose whole plan is one CustomScan returning `outputs` (by position).
unsafe fn build_stmt(
    parse: *mut pg_sys::Query,
    outputs: &[*mut pg_sys::TargetEntry],
    relids: &[pg_sys::Oid],
    mut private: *mut pg_sys::List,
    local: Option<*mut pg_sys::List>,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let q = &*parse;
        let cscan =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::CustomScan>()) as *mut pg_sys::CustomScan;
        (*cscan).scan.plan.type_ = pg_sys::NodeTag::T_CustomScan;
        (*cscan).scan.plan.plan_rows = 1.0;
        (*cscan).scan.plan.total_cost = ROUTED_PLAN_COST;
        (*cscan).scan.scanrelid = 0;
        (*cscan).methods = &raw const SCAN_METHODS;
        // The scan tuple has the output columns; the plan's target list reads them back by
        // position (INDEX_VAR), so no projection happens.
        let (scan_tlist, tlist) = output_tlists(outputs);
        (*cscan).custom_scan_tlist = scan_tlist;
        (*cscan).scan.plan.targetlist = tlist;
        // The local plan rides last ([`super::local::local_plan_of`]); what invalidates it
        // invalidates a cached copy of this plan: its shard tables, the functions the planner
        // inlined into it or read (invalItems), a role change when row security shaped it.
        let mut local_stmt: Option<*mut pg_sys::PlannedStmt> = None;
        if let Some(local) = local {
            private = pg_sys::lappend(private, local as *mut std::ffi::c_void);
            local_stmt = super::local::local_plan_of(&[local as *mut pg_sys::Node]).map(|(s, _)| s);
        }
        (*cscan).custom_private = private;

        let stmt =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::PlannedStmt>()) as *mut pg_sys::PlannedStmt;
        (*stmt).type_ = pg_sys::NodeTag::T_PlannedStmt;
        (*stmt).commandType = q.commandType;
        (*stmt).queryId = q.queryId;
        (*stmt).hasReturning = !q.returningList.is_null();
        (*stmt).canSetTag = q.canSetTag;
        (*stmt).planTree = cscan as *mut pg_sys::Plan;
        // Kept for permission checks on the shells, at every level of the statement; no relation
        // of it is scanned here.
        (*stmt).rtable = super::privileges::range_table_for_checks(parse);
        // A change to a shell (distribution, DDL) invalidates cached plans of this statement.
        for relid in relids {
            (*stmt).relationOids = pg_sys::lappend_oid((*stmt).relationOids, *relid);
        }
        if let Some(local) = local_stmt {
            (*stmt).relationOids = pg_sys::list_concat((*stmt).relationOids, (*local).relationOids);
            (*stmt).invalItems = pg_sys::list_concat((*stmt).invalItems, (*local).invalItems);
            (*stmt).dependsOnRole |= (*local).dependsOnRole;
            (*stmt).transientPlan |= (*local).transientPlan;
        }
        (*stmt).stmt_location = q.stmt_location;
        (*stmt).stmt_len = q.stmt_len;
        stmt
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn create_state(_cscan: *mut pg_sys::CustomScan) -> *mut pg_sys::Node {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = pg_sys::palloc0(std::mem::size_of::<ModifyState>()) as *mut ModifyState;
        (*s).css.ss.ps.type_ = pg_sys::NodeTag::T_CustomScanState;
        (*s).css.methods = &raw const EXEC_METHODS;
        (*s).ran = Ran::NotYet;
        s as *mut pg_sys::Node
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn begin(
    node: *mut pg_sys::CustomScanState,
    estate: *mut pg_sys::EState,
    eflags: i32,
) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = node as *mut ModifyState;
        let desc = (*(*node).ss.ss_ScanTupleSlot).tts_tupleDescriptor;
        (*s).store_slot =
            pg_sys::ExecInitExtraTupleSlot(estate, desc, &raw const pg_sys::TTSOpsMinimalTuple);
        (*s).eflags = eflags;
        // EXPLAIN without ANALYZE shows the spliced local plan; executing it is decided at
        // the first row (`run_select`).
        if eflags & pg_sys::EXEC_FLAG_EXPLAIN_ONLY as i32 != 0 {
            if let Some((child, _)) = spliced_of((*node).ss.ps.plan as *mut pg_sys::CustomScan) {
                start_child(s, child);
            }
        }
    }
}

/// Starts the spliced local plan `child` in this node's executor.
unsafe fn start_child(s: *mut ModifyState, child: *mut pg_sys::Plan) {
    // SAFETY: `s` is a live node of an executing plan whose PlannedStmt holds `child`.
    unsafe {
        let estate = (*s).css.ss.ps.state;
        let old = pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
        let ps = pg_sys::ExecInitNode(child, estate, (*s).eflags);
        (*s).css.custom_ps = pg_sys::lappend(std::ptr::null_mut(), ps as *mut std::ffi::c_void);
        pg_sys::MemoryContextSwitchTo(old);
        (*s).child = ps;
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn exec(
    node: *mut pg_sys::CustomScanState,
) -> *mut pg_sys::TupleTableSlot {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = node as *mut ModifyState;
        if !(*s).done {
            (*s).done = true;
            if let Err(e) = run(s) {
                e.raise();
            }
        }
        if !(*s).child.is_null() {
            let child = (*s).child;
            let exec = (*child).ExecProcNode.expect("an initialised plan node");
            return exec(child);
        }
        if !(*s).local.is_null() {
            return super::local::next_row((*s).local, (*node).ss.ss_ScanTupleSlot);
        }
        super::execute::next_from_store((*s).tstore, (*s).store_slot, (*node).ss.ss_ScanTupleSlot)
    }
}

/// One statement per target shard.
struct ShardWork {
    placement: ShardPlacement,
    query: *mut pg_sys::Query,
    /// The drain fence's lock query for the rows this statement writes ([`fence`]), for the
    /// wait on a draining shard's source; None: no wait.
    fence: Option<String>,
}

unsafe fn run(s: *mut ModifyState) -> Result<(), RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let ps = &mut (*s).css.ss.ps;
        let estate = ps.state;
        let cscan = ps.plan as *mut pg_sys::CustomScan;
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        let query = private[0] as *mut pg_sys::Query;
        let group = group_of(&private);
        if (*query).commandType == pg_sys::CmdType::CMD_SELECT {
            let (value, anchor) = group.ok_or(RemusError::TableDisappeared)?;
            return run_select(s, query, value, anchor);
        }
        let rt = (*query).resultRelation as usize;
        let shell = (*list_ptrs::<pg_sys::RangeTblEntry>((*query).rtable)[rt - 1]).relid;
        let table = super::placement::dist_table(shell)?.ok_or(RemusError::TableDisappeared)?;
        let reference = table.kind == 'r';
        let work = if let Some((value, _)) = group {
            match group_target(query, &table, value, ps)? {
                Some(w) => vec![w],
                None => return Ok(()),
            }
        } else if reference {
            let all = super::placement::placements(shell)?;
            // One copy per node, all in this transaction (2PC).
            all.iter()
                .map(|p| ShardWork {
                    placement: p.clone(),
                    query,
                    fence: None,
                })
                .collect()
        } else {
            let key_attno = super::key::key_attno(&table)?;
            targets(query, &table, key_attno, ps)?
        };

        let params = Params::from_list((*estate).es_param_list_info);
        let mut text_params = None;
        // The statement's one shard, when execution chose this node's: a local plan (spliced,
        // made at plan time, or made now) serves it.
        let mine = match work.as_slice() {
            [w] if w.query == query
                && !reference
                && crate::guc::is_this_node(&w.placement.node_name) =>
            {
                Some(w)
            }
            _ => None,
        };
        // The spliced local plan runs in this executor when execution chose its very shard;
        // the executor then counts what it changes and returns its RETURNING rows.
        if let Some(w) = mine {
            if let Some((child, shard)) =
                spliced_of(cscan).filter(|(_, shard)| *shard == w.placement.shard_id)
            {
                // squall: the chunks of a shard still being pulled here are waited for first
                // (a local plan run in a nested executor waits in its ExecutorStart).
                crate::migration::squall::wait_for_pulls_in(estate, (*estate).es_plannedstmt)?;
                wait_for_the_fence(&table, w, &params, &mut text_params)?;
                // The handover's checks that ExecutorStart runs for a nested write (the
                // ownership check leaves a router plan to the router): the fence of a moved
                // shard, and the guard of a copy a migration lost in a restart moves away.
                crate::migration::handover::lock_abort::check_write(&[shard])?;
                crate::migration::handover::restart::check_write(&[shard])?;
                start_child(s, child);
                (*s).ran = Ran::LocalPlan;
                return Ok(());
            }
        }
        let out_types: Vec<(pg_sys::Oid, i32)> =
            list_ptrs::<pg_sys::TargetEntry>((*query).returningList)
                .into_iter()
                .map(|te| {
                    let e = (*te).expr as *const pg_sys::Node;
                    (pg_sys::exprType(e), pg_sys::exprTypmod(e))
                })
                .collect();
        let desc = (*(*s).css.ss.ss_ScanTupleSlot).tts_tupleDescriptor;
        if !out_types.is_empty() {
            let old = pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
            (*s).tstore = pg_sys::tuplestore_begin_heap(false, false, pg_sys::work_mem);
            pg_sys::MemoryContextSwitchTo(old);
        }
        let mut affected = 0u64;
        // A local plan serves only the one shard it was made for, decided here to be this
        // node's (`super::local`); without one made at plan time, one is made now.
        let local = match mine {
            Some(w) => super::local::local_plan_for_shard(
                cscan,
                query,
                &table,
                &w.placement,
                (*estate).es_sourceText,
            )?,
            None => None,
        };
        // An autocommit write on one other node is that node's transaction of its own: one
        // round trip, no BEGIN or COMMIT (its outcome is the participant's answer).
        let join = if work.len() == 1
            && !reference
            && !crate::guc::is_this_node(&work[0].placement.node_name)
            && super::execute::whole_transaction(estate, query)
            && pg_sys::GetTopTransactionIdIfAny() == pg_sys::InvalidTransactionId
        {
            Join::Alone
        } else {
            Join::Transaction
        };
        for w in work {
            wait_for_the_fence(&table, &w, &params, &mut text_params)?;
            if let Some(stmt) = local {
                if let Some(changed) = super::local::run_modify(stmt, estate, (*s).tstore) {
                    affected += changed;
                    (*s).ran = Ran::LocalPlan;
                    continue;
                }
            }
            (*s).ran = Ran::Routed;
            // Cached only for the plan's own Query: a multi-row INSERT's per-shard copies are
            // new at every execution.
            let (sql, lifted) = super::local::statement_for(
                cscan,
                w.query,
                !params.values.is_empty() && w.query == query,
                &w.placement,
                &params,
            );
            let r = super::execute::run_on_shard(
                &w.placement,
                &sql,
                lifted.as_ref().unwrap_or(&params),
                &out_types,
                true,
                join,
            )?;
            // A reference table's copies all change alike: report (and return) one of them.
            if reference && !crate::guc::is_this_node(&w.placement.node_name) {
                continue;
            }
            affected += r.affected;
            store_rows((*s).tstore, desc, r.rows, out_types.len());
        }
        // The executor counts only SELECT rows itself; DML reports what the shards changed.
        (*estate).es_processed += affected;
        Ok(())
    }
}

/// A write on a draining shard's new owner waits for the older writers of its rows on the
/// source (the drain fence); `text_params`: the statement's parameters as the fence sends
/// them, made at the first wait.
///
/// # Safety
/// `params` must be the executing statement's parameters.
unsafe fn wait_for_the_fence(
    table: &DistTable,
    w: &ShardWork,
    params: &Params,
    text_params: &mut Option<(Vec<Option<String>>, Vec<u32>)>,
) -> Result<(), RemusError> {
    let Some(lock_rows) = &w.fence else {
        return Ok(());
    };
    // SAFETY: the caller upholds this function's `# Safety` contract.
    let (values, types) = text_params.get_or_insert_with(|| unsafe { params.as_text() });
    crate::migration::handover::remus::wait_for_older_writers(
        table,
        &w.placement,
        lock_rows,
        values,
        types,
    )
}

/// The one shard of a write within a shard group (`plan_group_write`): the target's shard the
/// group value picks, checked to be where this transaction routes every other table of the
/// group, with the drain fence's lock query when it is draining. None: the value is NULL, so
/// the statement writes nothing.
unsafe fn group_target(
    query: *mut pg_sys::Query,
    table: &DistTable,
    value: *mut pg_sys::Expr,
    ps: *mut pg_sys::PlanState,
) -> Result<Option<ShardWork>, RemusError> {
    // SAFETY: the caller passes the plan's own Query and value and its live PlanState.
    unsafe {
        let (v, isnull, ty) = super::execute::eval_expr(value, ps);
        if isnull {
            // An INSERT whose key is this NULL value has no shard; otherwise `key = NULL`
            // selects nothing, so nothing is written.
            let key_attno = super::key::key_attno(table)?;
            let key_is_value = (*query).commandType == pg_sys::CmdType::CMD_INSERT
                && list_ptrs::<pg_sys::TargetEntry>((*query).targetList)
                    .into_iter()
                    .any(|te| {
                        (*te).resno == key_attno
                            && super::key::is_routable_value((*te).expr as *mut pg_sys::Node)
                    });
            if key_is_value {
                return Err(null_key(table));
            }
            return Ok(None);
        }
        let placement = super::key::placement_by_key(table, v, ty)?;
        same_node_for_every_table(query, table.relid, &placement, v, ty)?;
        let fence = if !draining(&placement) {
            None
        } else if (*query).commandType == pg_sys::CmdType::CMD_INSERT {
            fence::rows_upserted(query, table, 0, &[], ps)
        } else {
            Some(fence::rows_written_by(query))
        };
        Ok(Some(ShardWork {
            placement,
            query,
            fence,
        }))
    }
}

/// A co-located single-shard-group SELECT: one statement on the group's owner.
unsafe fn run_select(
    s: *mut ModifyState,
    query: *mut pg_sys::Query,
    value: *mut pg_sys::Expr,
    anchor_relid: pg_sys::Oid,
) -> Result<(), RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let ps = &mut (*s).css.ss.ps;
        let estate = ps.state;
        let table =
            super::placement::dist_table(anchor_relid)?.ok_or(RemusError::TableDisappeared)?;
        let (v, isnull, ty) = super::execute::eval_expr(value, ps);
        if isnull {
            // `key = NULL` selects nothing.
            return Ok(());
        }
        let placement = super::key::placement_by_key(&table, v, ty)?;
        same_node_for_every_table(query, anchor_relid, &placement, v, ty)?;
        // Row locks on a draining shard's new owner wait, like writes, for the older writers of
        // those rows on its source (the drain fence).
        if !(*query).rowMarks.is_null() && draining(&placement) {
            let (values, types) = params_for_fence(estate);
            crate::migration::handover::remus::wait_for_older_writers(
                &table,
                &placement,
                &fence::rows_locked_by(query),
                &values,
                &types,
            )?;
        }
        if crate::guc::is_this_node(&placement.node_name) {
            // squall: the chunks of a shard still being pulled here are waited for before a
            // local plan starts in this executor (one run in a nested executor waits in its
            // ExecutorStart).
            if let Some((child, _)) = spliced_of(ps.plan as *mut pg_sys::CustomScan)
                .filter(|(_, shard)| *shard == placement.shard_id)
            {
                crate::migration::squall::wait_for_pulls_in(estate, (*estate).es_plannedstmt)?;
                start_child(s, child);
                (*s).ran = Ran::LocalPlan;
                return Ok(());
            }
            let stmt = super::local::local_plan_for_shard(
                ps.plan as *mut pg_sys::CustomScan,
                query,
                &table,
                &placement,
                (*estate).es_sourceText,
            )?;
            let outputs = pg_sys::list_length((*ps.plan).targetlist) as usize;
            if let Some(stmt) = stmt {
                crate::migration::squall::wait_for_pulls_in(estate, stmt)?;
            }
            if let Some(child) =
                stmt.and_then(|stmt| super::local::spliced_at_execution(stmt, estate, outputs))
            {
                start_child(s, child);
                (*s).ran = Ran::LocalPlan;
                return Ok(());
            }
            if let Some(qd) = stmt.and_then(|stmt| super::local::start_select(stmt, estate)) {
                (*s).local = qd;
                (*s).ran = Ran::LocalPlan;
                return Ok(());
            }
        }
        let out_types: Vec<(pg_sys::Oid, i32)> =
            list_ptrs::<pg_sys::TargetEntry>((*query).targetList)
                .into_iter()
                .filter(|te| !(**te).resjunk)
                .map(|te| {
                    let e = (*te).expr as *const pg_sys::Node;
                    (pg_sys::exprType(e), pg_sys::exprTypmod(e))
                })
                .collect();
        let params = Params::from_list((*estate).es_param_list_info);
        let (sql, lifted) = super::local::statement_for(
            ps.plan as *mut pg_sys::CustomScan,
            query,
            !params.values.is_empty(),
            &placement,
            &params,
        );
        let params = lifted.unwrap_or(params);
        (*s).ran = Ran::Routed;
        // Row locks are writes for the commit: the participant holding them commits with the
        // others (2PC), never ahead of them, and never as a transaction of its own.
        let locks = !(*query).rowMarks.is_null();
        let join = if !locks && super::execute::whole_transaction(estate, query) {
            Join::Alone
        } else {
            Join::Transaction
        };
        let r = super::execute::run_on_shard(&placement, &sql, &params, &out_types, locks, join)?;
        let desc = (*(*s).css.ss.ss_ScanTupleSlot).tts_tupleDescriptor;
        let old = pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
        (*s).tstore = pg_sys::tuplestore_begin_heap(false, false, pg_sys::work_mem);
        pg_sys::MemoryContextSwitchTo(old);
        store_rows((*s).tstore, desc, r.rows, out_types.len());
        Ok(())
    }
}

/// The statement runs on the anchor's node, and that node reads every table of the join from
/// its own co-located shard (`marker::pin_to_local_shard`). So each table's shard must be
/// where this transaction routes it: its own pin, not the anchor's. They differ when the
/// transaction used a table before an ownership change (Tm) and another table of the group
/// first after it, under READ COMMITTED: reading both on one node would miss the transaction's
/// own uncommitted writes on the other, or read a copy that no longer takes writes (review
/// finding F12). Neither node has the whole truth for this transaction, so it fails with 40001;
/// its retry pins the whole group on the new owner.
///
/// # Safety
/// `query` must be a valid Query whose relations are co-located with `anchor_relid`; `value`
/// of type `value_type` is the anchor's key value.
unsafe fn same_node_for_every_table(
    query: *mut pg_sys::Query,
    anchor_relid: pg_sys::Oid,
    anchor: &ShardPlacement,
    value: pg_sys::Datum,
    value_type: pg_sys::Oid,
) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        // One relation and nothing nested: the anchor is the only table.
        let q = &*query;
        if pg_sys::list_length(q.rtable) == 1 && q.cteList.is_null() && !q.hasSubLinks {
            return Ok(());
        }
        for (_, other) in super::placement::shells_anywhere(query)? {
            // A reference table is read from the owner's own copy.
            if other.relid == anchor_relid || other.kind != 'h' {
                continue;
            }
            let theirs = super::key::placement_by_key(&other, value, value_type)?;
            if theirs.node_name != anchor.node_name {
                return Err(RemusError::ColocatedShardsApart {
                    shard_id: anchor.shard_id,
                    node: anchor.node_name.clone(),
                    other_shard_id: theirs.shard_id,
                    other_node: theirs.node_name,
                });
            }
        }
        Ok(())
    }
}

/// The statement's parameters as the drain fence sends them.
unsafe fn params_for_fence(estate: *mut pg_sys::EState) -> (Vec<Option<String>>, Vec<u32>) {
    // SAFETY: `estate` is the executing statement's live EState.
    unsafe { Params::from_list((*estate).es_param_list_info).as_text() }
}

/// Appends shard result rows (padded or cut to `n` columns) to the node's tuplestore.
pub(crate) unsafe fn store_rows(
    store: *mut pg_sys::Tuplestorestate,
    desc: pg_sys::TupleDesc,
    rows: Vec<Vec<Option<pg_sys::Datum>>>,
    n: usize,
) {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        if store.is_null() {
            return;
        }
        for row in rows {
            let mut values: Vec<pg_sys::Datum> = row
                .iter()
                .map(|v| v.unwrap_or(pg_sys::Datum::from(0usize)))
                .collect();
            let mut nulls: Vec<bool> = row.iter().map(|v| v.is_none()).collect();
            values.resize(n, pg_sys::Datum::from(0usize));
            nulls.resize(n, true);
            pg_sys::tuplestore_putvalues(store, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
        }
    }
}

/// The shards a statement touches, each with the (sub)statement to run there.
unsafe fn targets(
    query: *mut pg_sys::Query,
    table: &DistTable,
    key_attno: i16,
    ps: *mut pg_sys::PlanState,
) -> Result<Vec<ShardWork>, RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let rt = (*query).resultRelation;
        if (*query).commandType != pg_sys::CmdType::CMD_INSERT {
            let conjuncts = top_level_conjuncts((*(*query).jointree).quals);
            // The fence's lock query is the whole WHERE, not only its key conjunct: it waits
            // for the holders of the rows the statement writes, on every moving shard it
            // touches. Built only when a shard it goes to is draining: a deparse per statement
            // otherwise.
            for c in conjuncts {
                if let Some(v) = super::key::key_equality_value(c, rt, key_attno) {
                    let (value, isnull, ty) = super::execute::eval_expr(v, ps);
                    if isnull {
                        return Ok(vec![]);
                    }
                    // By key: only this shard is pinned, and waited for if in doubt (F5).
                    let p = super::key::placement_by_key(table, value, ty)?;
                    return Ok(vec![ShardWork {
                        fence: draining(&p).then(|| fence::rows_written_by(query)),
                        placement: p,
                        query,
                    }]);
                }
            }
            // No key filter: every shard, in the same transaction.
            let all = super::placement::placements(table.relid)?;
            let lock_rows = all
                .iter()
                .any(draining)
                .then(|| fence::rows_written_by(query));
            return Ok(all
                .iter()
                .map(|p| ShardWork {
                    placement: p.clone(),
                    query,
                    fence: lock_rows.clone().filter(|_| draining(p)),
                })
                .collect());
        }

        // INSERT: the key's target entry is either the value itself (one row) or a column of a
        // VALUES list (several rows), which is then split by shard.
        let parts = |q: *mut pg_sys::Query| {
            let key_te = list_ptrs::<pg_sys::TargetEntry>((*q).targetList)
                .into_iter()
                .find(|te| (**te).resno == key_attno)
                .ok_or_else(|| null_key(table));
            let values_rte = list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)
                .into_iter()
                .enumerate()
                .find(|(_, r)| (**r).rtekind == pg_sys::RTEKind::RTE_VALUES);
            key_te.map(|te| (te, values_rte))
        };
        // A key drawn from a sequence (its bigserial default) is drawn once, here, and the
        // statement routed and sent with the value (decision 0019).
        // So are identity values, the key's or not (the shard tables have no identity).
        let query = with_identities_drawn(query, ps);
        let (key_te, values_rte) = parts(query)?;
        let query = with_key_drawn(query, key_te, values_rte, ps, is_nextval);
        let (key_te, values_rte) = parts(query)?;
        let expr = (*key_te).expr as *mut pg_sys::Node;
        let stripped = fence::strip(expr);
        match values_rte {
            None => {
                if !super::key::is_routable_value(expr) {
                    return Err(RemusError::InsertKeyNotConstant {
                        table: table.qualified_name.to_string(),
                    });
                }
                let (value, isnull, ty) = super::execute::eval_expr(expr as *mut pg_sys::Expr, ps);
                if isnull {
                    return Err(null_key(table));
                }
                let p = super::key::placement_by_key(table, value, ty)?;
                Ok(vec![ShardWork {
                    fence: if draining(&p) {
                        fence::rows_upserted(query, table, 0, &[], ps)
                    } else {
                        None
                    },
                    placement: p,
                    query,
                }])
            }
            Some((vidx, vrte)) => {
                if !is_tag(stripped, pg_sys::NodeTag::T_Var)
                    || (*(stripped as *mut pg_sys::Var)).varno as usize != vidx + 1
                {
                    return Err(RemusError::Unsupported(
                    "the shard key of a multi-row INSERT must come straight from its VALUES list",
                ));
                }
                let col = (*(stripped as *mut pg_sys::Var)).varattno as usize - 1;
                let mut groups: BTreeMap<
                    i64,
                    (ShardPlacement, *mut pg_sys::List, Vec<*mut pg_sys::List>),
                > = BTreeMap::new();
                for row in list_ptrs::<pg_sys::List>((*vrte).values_lists) {
                    let cell = list_ptrs::<pg_sys::Node>(row)[col];
                    if !super::key::is_routable_value(cell) {
                        return Err(RemusError::Unsupported(
                        "shard key values of a multi-row INSERT must be constants or parameters",
                    ));
                    }
                    let (value, isnull, ty) =
                        super::execute::eval_expr(cell as *mut pg_sys::Expr, ps);
                    if isnull {
                        return Err(null_key(table));
                    }
                    let p = super::key::placement_by_key(table, value, ty)?;
                    let entry =
                        groups
                            .entry(p.shard_id)
                            .or_insert((p, std::ptr::null_mut(), Vec::new()));
                    entry.1 = pg_sys::lappend(entry.1, row as *mut std::ffi::c_void);
                    entry.2.push(row);
                }
                let mut out = Vec::new();
                for (_, (placement, rows, row_list)) in groups {
                    // From the original statement, whose target list still names every column.
                    let lock_rows = if draining(&placement) {
                        fence::rows_upserted(query, table, vidx + 1, &row_list, ps)
                    } else {
                        None
                    };
                    let q = pg_sys::copyObjectImpl(query as *const std::ffi::c_void)
                        as *mut pg_sys::Query;
                    let r = list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)[vidx];
                    (*r).values_lists = rows;
                    // The rewriter added the defaults of unlisted columns to the target list, which
                    // ruleutils cannot print next to a VALUES list; the shard fills them in itself.
                    let mut kept: *mut pg_sys::List = std::ptr::null_mut();
                    for te in list_ptrs::<pg_sys::TargetEntry>((*q).targetList) {
                        let mut e = (*te).expr as *mut pg_sys::Node;
                        while is_tag(e, pg_sys::NodeTag::T_RelabelType) {
                            e = (*(e as *mut pg_sys::RelabelType)).arg as *mut _;
                        }
                        if is_tag(e, pg_sys::NodeTag::T_Var)
                            && (*(e as *mut pg_sys::Var)).varno as usize == vidx + 1
                        {
                            kept = pg_sys::lappend(kept, te as *mut std::ffi::c_void);
                        }
                    }
                    // In the VALUES list's column order, which is the order ruleutils prints the
                    // values in (a key drawn here is the list's last column).
                    let mut kept = list_ptrs::<pg_sys::TargetEntry>(kept);
                    kept.sort_by_key(|te| {
                        (*(fence::strip((**te).expr as *mut pg_sys::Node) as *mut pg_sys::Var))
                            .varattno
                    });
                    drop_unread_values_columns(r, &kept);
                    (*q).targetList = kept.into_iter().fold(std::ptr::null_mut(), |l, te| {
                        pg_sys::lappend(l, te as *mut std::ffi::c_void)
                    });
                    out.push(ShardWork {
                        placement,
                        query: q,
                        fence: lock_rows,
                    });
                }
                Ok(out)
            }
        }
    }
}

/// Is `node` `nextval(<constant>)`, a sequence default (possibly behind a relabeling)?
///
/// # Safety
/// `node` must be NULL or a valid expression node.
unsafe fn is_nextval(node: *mut pg_sys::Node) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let node = fence::strip(node);
        if !is_tag(node, pg_sys::NodeTag::T_FuncExpr) {
            return false;
        }
        let f = node as *mut pg_sys::FuncExpr;
        let args = list_ptrs::<pg_sys::Node>((*f).args);
        (*f).funcid == pg_sys::Oid::from(pg_sys::F_NEXTVAL)
            && args.len() == 1
            && super::key::is_routable_value(args[0])
    }
}

/// `expr` evaluated now, as a constant of its type (a by-value type: `nextval`'s bigint).
///
/// # Safety
/// `expr` must be a valid expression of the executing statement; `ps` its live PlanState.
unsafe fn drawn(expr: *mut pg_sys::Node, ps: *mut pg_sys::PlanState) -> *mut pg_sys::Node {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let (value, isnull, ty) = super::execute::eval_expr(expr as *mut pg_sys::Expr, ps);
        let mut len = 0i16;
        let mut byval = false;
        pg_sys::get_typlenbyval(ty, &mut len, &mut byval);
        pg_sys::makeConst(
            ty,
            pg_sys::exprTypmod(expr),
            pg_sys::exprCollation(expr),
            len as i32,
            value,
            isnull,
            byval,
        ) as *mut pg_sys::Node
    }
}

/// Is `node` a `NextValueExpr`, the value the rewriter puts in for an identity column?
///
/// # Safety
/// `node` must be NULL or a valid expression node.
unsafe fn is_identity_value(node: *mut pg_sys::Node) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe { is_tag(fence::strip(node), pg_sys::NodeTag::T_NextValueExpr) }
}

/// An INSERT into a table with identity columns: a copy of `query` with every identity value
/// the rewriter put in (the column omitted, written DEFAULT, or replaced by OVERRIDING USER
/// VALUE) drawn once, here, from this node's copy of the shell's identity sequence, as
/// [`with_key_drawn`] draws a key (decision 0019): the shard tables have no identity, and a
/// `NextValueExpr` deparsed would be a `nextval` on the owner, which needs USAGE on the
/// sequence where PostgreSQL's identity does not. The copy says OVERRIDING SYSTEM VALUE, so
/// that the owner's shell takes the drawn values of a GENERATED ALWAYS column (an explicit
/// value was refused here already, 428C9, unless the statement said so itself). `query` itself
/// when it draws no identity value.
///
/// # Safety
/// `query` must be the executing INSERT and `ps` the statement's live PlanState.
unsafe fn with_identities_drawn(
    query: *mut pg_sys::Query,
    ps: *mut pg_sys::PlanState,
) -> *mut pg_sys::Query {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let values_of = |q: *mut pg_sys::Query| {
            list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)
                .into_iter()
                .enumerate()
                .find(|(_, r)| (**r).rtekind == pg_sys::RTEKind::RTE_VALUES)
        };
        let values = values_of(query);
        let resnos: Vec<i16> = list_ptrs::<pg_sys::TargetEntry>((*query).targetList)
            .into_iter()
            .filter(|te| {
                let e = fence::strip((**te).expr as *mut pg_sys::Node);
                if is_identity_value(e) {
                    return true;
                }
                match values {
                    Some((vidx, rte))
                        if is_tag(e, pg_sys::NodeTag::T_Var)
                            && (*(e as *mut pg_sys::Var)).varno as usize == vidx + 1 =>
                    {
                        let col = (*(e as *mut pg_sys::Var)).varattno as usize - 1;
                        list_ptrs::<pg_sys::List>((*rte).values_lists)
                            .iter()
                            .any(|row| {
                                list_ptrs::<pg_sys::Node>(*row)
                                    .get(col)
                                    .is_some_and(|c| is_identity_value(*c))
                            })
                    }
                    _ => false,
                }
            })
            .map(|te| (*te).resno)
            .collect();
        if resnos.is_empty() {
            return query;
        }
        let mut q = query;
        for resno in resnos {
            let Some(te) = list_ptrs::<pg_sys::TargetEntry>((*q).targetList)
                .into_iter()
                .find(|te| (**te).resno == resno)
            else {
                continue;
            };
            q = with_key_drawn(q, te, values_of(q), ps, is_identity_value);
        }
        if q == query {
            q = pg_sys::copyObjectImpl(query as *const std::ffi::c_void) as *mut pg_sys::Query;
        }
        (*q).override_ = pg_sys::OverridingKind::OVERRIDING_SYSTEM_VALUE;
        q
    }
}

/// Leaves out of the VALUES list `r` (a per-shard copy's) the columns no target entry of
/// `kept` (its target list, Vars of `r` in column order) reads, renumbering them: ruleutils
/// prints every column of the list, so each must have its target column. The rewriter leaves
/// such a column (NULLs) where it put an identity's or generated column's default in the target
/// list instead (every value DEFAULT, or OVERRIDING USER VALUE).
///
/// # Safety
/// `r` must be a VALUES range-table entry of a Query copy this module owns, `kept` that copy's
/// target entries, each a Var of `r` (possibly relabeled), sorted by column.
unsafe fn drop_unread_values_columns(
    r: *mut pg_sys::RangeTblEntry,
    kept: &[*mut pg_sys::TargetEntry],
) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let var_of = |te: *mut pg_sys::TargetEntry| {
            fence::strip((*te).expr as *mut pg_sys::Node) as *mut pg_sys::Var
        };
        let read: Vec<usize> = kept
            .iter()
            .map(|te| (*var_of(*te)).varattno as usize - 1)
            .collect();
        let rows = list_ptrs::<pg_sys::List>((*r).values_lists);
        let ncols = rows
            .first()
            .map_or(0, |row| pg_sys::list_length(*row) as usize);
        if read.len() == ncols {
            return;
        }
        let pick_list = |l: *mut pg_sys::List| {
            let cells = list_ptrs::<std::ffi::c_void>(l);
            read.iter().fold(std::ptr::null_mut(), |out, i| {
                pg_sys::lappend(out, cells[*i])
            })
        };
        let pick_oids = |l: *mut pg_sys::List| {
            read.iter().fold(std::ptr::null_mut(), |out, i| {
                pg_sys::lappend_oid(out, pg_sys::list_nth_oid(l, *i as i32))
            })
        };
        (*r).values_lists = rows.iter().fold(std::ptr::null_mut(), |out, row| {
            pg_sys::lappend(out, pick_list(*row) as *mut std::ffi::c_void)
        });
        (*r).coltypes = pick_oids((*r).coltypes);
        (*r).colcollations = pick_oids((*r).colcollations);
        (*r).coltypmods = read.iter().fold(std::ptr::null_mut(), |out, i| {
            pg_sys::lappend_int(out, pg_sys::list_nth_int((*r).coltypmods, *i as i32))
        });
        if !(*r).eref.is_null() && pg_sys::list_length((*(*r).eref).colnames) as usize == ncols {
            (*(*r).eref).colnames = pick_list((*(*r).eref).colnames);
        }
        for (i, te) in kept.iter().enumerate() {
            (*var_of(*te)).varattno = (i + 1) as i16;
            (*var_of(*te)).varattnosyn = (i + 1) as i16;
        }
    }
}

/// An INSERT whose shard key is a sequence default (the key column omitted, or DEFAULT, or an
/// explicit `nextval(…)`; `draws` tells such an expression): a copy of `query` with each such
/// key drawn once, on this node, as a constant; `query` itself otherwise (the plan's Query is never changed). One row: the key's
/// target entry becomes the value. Several (VALUES): a cell that is the default becomes its
/// value; a key omitted from the column list becomes a new last column of the VALUES list, one
/// value per row, and the key's target entry a reference to it.
///
/// # Safety
/// `query` must be the executing INSERT, `key_te` its key's target entry, `values` its VALUES
/// range-table entry (0-based index) if any, and `ps` the statement's live PlanState.
unsafe fn with_key_drawn(
    query: *mut pg_sys::Query,
    key_te: *mut pg_sys::TargetEntry,
    values: Option<(usize, *mut pg_sys::RangeTblEntry)>,
    ps: *mut pg_sys::PlanState,
    draws: unsafe fn(*mut pg_sys::Node) -> bool,
) -> *mut pg_sys::Query {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let expr = (*key_te).expr as *mut pg_sys::Node;
        let resno = (*key_te).resno;
        let copy_with = |edit: &dyn Fn(*mut pg_sys::Query)| {
            let q = pg_sys::copyObjectImpl(query as *const std::ffi::c_void) as *mut pg_sys::Query;
            edit(q);
            q
        };
        let te_of = |q: *mut pg_sys::Query| {
            list_ptrs::<pg_sys::TargetEntry>((*q).targetList)
                .into_iter()
                .find(|te| (**te).resno == resno)
        };
        match values {
            None if draws(expr) => {
                let value = drawn(expr, ps);
                copy_with(&|q| {
                    if let Some(te) = te_of(q) {
                        (*te).expr = value as *mut pg_sys::Expr;
                    }
                })
            }
            None => query,
            Some((vidx, rte)) if draws(expr) => {
                // The key is not in the column list: one value per row, as a new column.
                let rows = list_ptrs::<pg_sys::List>((*rte).values_lists);
                let mut drawn_rows: *mut pg_sys::List = std::ptr::null_mut();
                for row in &rows {
                    let row = pg_sys::list_copy(*row);
                    let row = pg_sys::lappend(row, drawn(expr, ps) as *mut std::ffi::c_void);
                    drawn_rows = pg_sys::lappend(drawn_rows, row as *mut std::ffi::c_void);
                }
                let ncols = rows.first().map_or(0, |r| pg_sys::list_length(*r));
                let ty = pg_sys::exprType(expr);
                let typmod = pg_sys::exprTypmod(expr);
                let coll = pg_sys::exprCollation(expr);
                copy_with(&|q| {
                    let r = list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)[vidx];
                    (*r).values_lists = drawn_rows;
                    (*r).coltypes = pg_sys::lappend_oid((*r).coltypes, ty);
                    (*r).coltypmods = pg_sys::lappend_int((*r).coltypmods, typmod);
                    (*r).colcollations = pg_sys::lappend_oid((*r).colcollations, coll);
                    if !(*r).eref.is_null() {
                        (*(*r).eref).colnames = pg_sys::lappend(
                            (*(*r).eref).colnames,
                            pg_sys::makeString(pg_sys::pstrdup(c"remus_key".as_ptr()))
                                as *mut std::ffi::c_void,
                        );
                    }
                    if let Some(te) = te_of(q) {
                        (*te).expr = pg_sys::makeVar(
                            (vidx + 1) as i32,
                            (ncols + 1) as i16,
                            ty,
                            typmod,
                            coll,
                            0,
                        ) as *mut pg_sys::Expr;
                    }
                })
            }
            Some((vidx, rte)) => {
                // DEFAULT in the key's column of some rows: each such cell drawn.
                let stripped = fence::strip(expr);
                if !is_tag(stripped, pg_sys::NodeTag::T_Var)
                    || (*(stripped as *mut pg_sys::Var)).varno as usize != vidx + 1
                {
                    return query;
                }
                let col = (*(stripped as *mut pg_sys::Var)).varattno as usize - 1;
                let rows = list_ptrs::<pg_sys::List>((*rte).values_lists);
                if !rows.iter().any(|row| {
                    list_ptrs::<pg_sys::Node>(*row)
                        .get(col)
                        .is_some_and(|c| draws(*c))
                }) {
                    return query;
                }
                let mut drawn_rows: *mut pg_sys::List = std::ptr::null_mut();
                for row in &rows {
                    let mut cells: *mut pg_sys::List = std::ptr::null_mut();
                    for (i, cell) in list_ptrs::<pg_sys::Node>(*row).into_iter().enumerate() {
                        let cell = if i == col && draws(cell) {
                            drawn(cell, ps)
                        } else {
                            cell
                        };
                        cells = pg_sys::lappend(cells, cell as *mut std::ffi::c_void);
                    }
                    drawn_rows = pg_sys::lappend(drawn_rows, cells as *mut std::ffi::c_void);
                }
                copy_with(&|q| {
                    let r = list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)[vidx];
                    (*r).values_lists = drawn_rows;
                })
            }
        }
    }
}

/// Whether a write to `p` must first wait on the shard's drain source (`fence`).
fn draining(p: &ShardPlacement) -> bool {
    crate::migration::handover::remus::drain_source_of(p.shard_id).is_some_and(|s| s != p.node_name)
}

fn null_key(table: &DistTable) -> RemusError {
    RemusError::NullShardKey {
        column: table.shard_key.as_deref().unwrap_or_default().to_string(),
        table: table.qualified_name.to_string(),
    }
}

/// EXPLAIN: the shard a local plan was made for; with ANALYZE, how the statement ran.
#[pg_guard]
unsafe extern "C-unwind" fn explain(
    node: *mut pg_sys::CustomScanState,
    _ancestors: *mut pg_sys::List,
    es: *mut pg_sys::ExplainState,
) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call.
    unsafe {
        let s = node as *mut ModifyState;
        let cscan = (*node).ss.ps.plan as *mut pg_sys::CustomScan;
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        let shard = super::local::local_plan_of(&private)
            .map(|(_, shard)| shard)
            .or_else(|| spliced_of(cscan).map(|(_, shard)| shard));
        if let Some(shard) = shard {
            pg_sys::ExplainPropertyInteger(
                c"Local Plan For Shard".as_ptr(),
                std::ptr::null(),
                shard,
                es,
            );
        }
        if (*es).analyze {
            let ran = match (*s).ran {
                Ran::NotYet => c"no shard",
                Ran::LocalPlan => c"local plan",
                Ran::Routed => c"routed",
            };
            pg_sys::ExplainPropertyText(c"Ran".as_ptr(), ran.as_ptr(), es);
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn end(node: *mut pg_sys::CustomScanState) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = node as *mut ModifyState;
        if !(*s).child.is_null() {
            pg_sys::ExecEndNode((*s).child);
            (*s).child = std::ptr::null_mut();
        }
        if !(*s).local.is_null() {
            super::local::end((*s).local);
            (*s).local = std::ptr::null_mut();
        }
        if !(*s).tstore.is_null() {
            pg_sys::tuplestore_end((*s).tstore);
            (*s).tstore = std::ptr::null_mut();
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn rescan(node: *mut pg_sys::CustomScanState) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        // Never re-run DML: rewind what it returned.
        let s = node as *mut ModifyState;
        if !(*s).child.is_null() {
            pg_sys::ExecReScan((*s).child);
        }
        if !(*s).local.is_null() {
            super::local::rescan((*s).local);
        }
        if !(*s).tstore.is_null() {
            pg_sys::tuplestore_rescan((*s).tstore);
        }
    }
}
