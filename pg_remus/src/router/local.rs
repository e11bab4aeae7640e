//! The local fast path: a statement on one shard group that this node owns runs on its local
//! shard tables as PostgreSQL's own plan, in the same executor: no SPI statement, no deparse, no
//! second parse or plan, no catalog query.
//!
//! - Plan time only guesses. When the key value is known at plan time (a constant, or a
//!   parameter bound for a custom plan) and the backend's shard-map cache (or this
//!   transaction's pin) says this node owns the shard, the statement is also planned on the
//!   local shard tables (the relid swap of `marker::pin_to_local_shard`, then the next planner)
//!   and that plan rides along in the `RemusRouter` CustomScan. Nothing is pinned at plan time.
//! - Execution decides, as for every routed statement: with the statement's snapshot, pinned for
//!   the (transaction, shard), after the handover's waits and fences (`modify::run`). Only when
//!   that decision is this node and the very shard the plan was made for does the local plan
//!   run; otherwise (a migration moved the shard since, a cached plan outlived it, the table
//!   was dropped and made again) the statement takes the general path, which deparses it and
//!   runs it where the shard now lives.
//! - A local plan made at plan time for a SELECT or a single-shard write is spliced: it is the
//!   statement's own plan, under the `RemusRouter` node, and runs in the statement's executor
//!   (`modify::build_spliced_stmt`, decision 0014). So is a SELECT's local plan made at
//!   execution whose range table matches the statement's entry for entry
//!   ([`spliced_at_execution`]). Other local SELECT plans (made at execution, or locking
//!   rows) are started by a nested executor and their rows handed up one
//!   by one (no tuplestore); other writes run to completion in a nested executor, RETURNING rows
//!   collected for the CustomScan to return. The nested `ExecutorStart` runs the handover's
//!   write checks (a spliced write runs them before it starts); the RM001 ownership check is
//!   skipped for it (`decided`) and for a spliced plan, since the router's own decision is what
//!   it would check.
//! - A statement whose plan carries no local plan for the shard execution chose here (a generic
//!   plan, whose key is a parameter; a backend whose map cache was empty at plan time) gets one
//!   made at execution, kept with the plan per shard ([`local_plan_at_execution`]): a prepared
//!   statement is planned once per shard, as PostgreSQL plans it once.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::catalog::{map_cache, DistTable};
use crate::error::RemusError;
use crate::pg::fast_map::{fast_map, FastMap};
use crate::pg::list::{is_tag, list_ptrs};
use crate::router::placement::{
    lock_existing, lock_local_shard, pinned_here, shard_at, shells_anywhere,
};
use crate::router::privileges::{move_to_shell, Check};

/// The planner a local plan is made by: the next `planner_hook` of the chain, or PostgreSQL's.
pub(crate) type NextPlanner = unsafe fn(
    *mut pg_sys::Query,
    *const c_char,
    c_int,
    pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt;

/// What the planner hook was called with, for planning a statement on local shards.
#[derive(Clone, Copy)]
pub(crate) struct PlanContext {
    pub next: NextPlanner,
    pub query_string: *const c_char,
    pub cursor_options: c_int,
    pub bound_params: pg_sys::ParamListInfo,
}

thread_local! {
    /// Set while a plan the router decided to run here is started (`ExecutorStart`).
    static DECIDED: Cell<u32> = const { Cell::new(0) };
    /// Local plans made at execution ([`local_plan_at_execution`]), per routed plan node.
    static MADE_AT_EXECUTION: RefCell<FastMap<usize, ExecutionPlans>> = const { RefCell::new(fast_map()) };
    /// Bumped by every relcache invalidation: a local plan made at execution before it may
    /// name an index or a shard table that changed since, and is made again.
    static EPOCH: Cell<u64> = const { Cell::new(0) };
}

/// The local plans made at execution for one `RemusRouter` plan node (keyed by its private
/// list, [`node_key`]), by shard, in a memory context that is a child of the plan's own: they live as long as the (cached) plan, and the
/// context's reset callback drops this entry when the plan goes.
struct ExecutionPlans {
    cxt: pg_sys::MemoryContext,
    epoch: u64,
    plans: FastMap<i64, *mut pg_sys::PlannedStmt>,
    /// The node's statement as deparsed for its owner ([`deparsed`]), by Query.
    texts: FastMap<usize, std::rc::Rc<str>>,
}

/// A relcache invalidation arrived: local plans made at execution are made again.
pub(crate) fn relcache_changed() {
    EPOCH.with(|e| e.set(e.get() + 1));
}

/// How many relcache invalidations (and function changes) this backend has seen: plans kept
/// across statements are made again when it moves (`super::shapes`).
pub(crate) fn epoch() -> u64 {
    EPOCH.with(|e| e.get())
}

/// The key of what is kept for plan node `cscan`: its private list, which every copy of the
/// node's header shares (a statement planned from a kept shape runs a copy, `super::shapes`),
/// and which lives in the plan's memory context.
unsafe fn node_key(cscan: *mut pg_sys::CustomScan) -> usize {
    // SAFETY: `cscan` is a live RemusRouter plan node.
    unsafe { (*cscan).custom_private as usize }
}

/// Is this backend starting a local plan of the router (which needs no RM001 check)?
pub(crate) fn decided() -> bool {
    DECIDED.with(|d| d.get()) > 0
}

struct Decided;

impl Decided {
    fn enter() -> Self {
        DECIDED.with(|d| d.set(d.get() + 1));
        Decided
    }
}

impl Drop for Decided {
    fn drop(&mut self) {
        DECIDED.with(|d| d.set(d.get() - 1));
    }
}

/// The value of a key expression known at plan time: a constant, a parameter bound for a custom
/// plan (`PARAM_FLAG_CONST`), or a cast of a constant that folds to one. None otherwise.
///
/// # Safety
/// `expr` must be a valid expression; `bound` NULL or the planner's bound parameters.
pub(crate) unsafe fn value_at_plan_time(
    expr: *mut pg_sys::Expr,
    bound: pg_sys::ParamListInfo,
) -> Option<(pg_sys::Datum, pg_sys::Oid)> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let node = expr as *mut pg_sys::Node;
        if is_tag(node, pg_sys::NodeTag::T_Param) {
            let prm = super::execute::extern_param(bound, node as *mut pg_sys::Param, true)?;
            if prm.isnull || prm.pflags & pg_sys::PARAM_FLAG_CONST as u16 == 0 {
                return None;
            }
            return Some((prm.value, prm.ptype));
        }
        let folded = if is_tag(node, pg_sys::NodeTag::T_Const) {
            node
        } else {
            let copy = pg_sys::copyObjectImpl(node as *const std::ffi::c_void) as *mut pg_sys::Node;
            pg_sys::eval_const_expressions(std::ptr::null_mut(), copy)
        };
        if !is_tag(folded, pg_sys::NodeTag::T_Const) {
            return None;
        }
        let c = folded as *mut pg_sys::Const;
        if (*c).constisnull {
            return None;
        }
        Some(((*c).constvalue, (*c).consttype))
    }
}

/// The shard at index `index` of `table`, if this backend expects this node to own it: by this
/// transaction's pin, else by the cached map. None: another node, or not known without reading
/// the catalog (a guess only; nothing is pinned or cached).
fn expected_here(table: &DistTable, index: usize) -> Option<i64> {
    let cached = map_cache::shared(table.relid.to_u32())?;
    let p = cached.iter().find(|p| p.shard_index as usize == index)?;
    let here = pinned_here(p.shard_id).unwrap_or_else(|| crate::guc::is_this_node(&p.node_name));
    here.then_some(p.shard_id)
}

/// If this node is expected to own the shard group that `value` (of type `value_type`) picks
/// for `anchor`, plans `parse` on the local shard tables of that group. Returns the list to
/// append to the `RemusRouter`'s private data ([`local_plan_of`] reads it back), or None.
///
/// # Safety
/// `parse` must be the planner's Query, every distributed table of which is `anchor` or
/// co-located with it; `value` a valid datum of `value_type`.
pub(crate) unsafe fn plan_on_local_shards(
    parse: *mut pg_sys::Query,
    anchor: &DistTable,
    value: pg_sys::Datum,
    value_type: pg_sys::Oid,
    ctx: &PlanContext,
) -> Result<Option<*mut pg_sys::List>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if anchor.kind != 'h' {
            return Ok(None);
        }
        let index = super::key::shard_index_of(anchor, value, value_type)?;
        let Some(anchor_shard) = expected_here(anchor, index) else {
            return Ok(None);
        };
        for (_, table) in shells_anywhere(parse)? {
            // A reference table: every node has a copy.
            if table.kind != 'r' && expected_here(&table, index).is_none() {
                return Ok(None);
            }
        }
        let local = pg_sys::copyObjectImpl(parse as *const std::ffi::c_void) as *mut pg_sys::Query;
        if !on_local_shards(local, anchor, index, Check::OnShell)? {
            return Ok(None);
        }
        // No parallel plan: the nested executor does not enter parallel mode.
        let options = ctx.cursor_options & !(pg_sys::CURSOR_OPT_PARALLEL_OK as c_int);
        let stmt = (ctx.next)(local, ctx.query_string, options, ctx.bound_params);
        let mut list = pg_sys::lappend(std::ptr::null_mut(), stmt as *mut std::ffi::c_void);
        list = pg_sys::lappend(list, shard_const(anchor_shard) as *mut std::ffi::c_void);
        Ok(Some(list))
    }
}

/// A shard id as a plan node can carry it in its private data (an int8 Const).
///
/// # Safety
/// Allocates in the current memory context.
pub(crate) unsafe fn shard_const(shard: i64) -> *mut pg_sys::Const {
    // SAFETY: a by-value int8 Const, palloc'd in the current context.
    unsafe {
        pg_sys::makeConst(
            pg_sys::INT8OID,
            -1,
            pg_sys::InvalidOid,
            8,
            pg_sys::Datum::from(shard),
            false,
            true,
        )
    }
}

/// Points every distributed table of `query` (a copy, edited in place), at any depth, at its
/// local shard of index `index` (a reference table at its local copy), locked. False: a table
/// is not co-located with `anchor`, or a shard is not here.
unsafe fn on_local_shards(
    query: *mut pg_sys::Query,
    anchor: &DistTable,
    index: usize,
    check: Check,
) -> Result<bool, RemusError> {
    // SAFETY: `query` is a valid Query of our own; catalog lookups and locks by OID.
    unsafe {
        for (rte, table) in shells_anywhere(query)? {
            if table.kind == 'h' && table.colocation_id != anchor.colocation_id {
                return Ok(false);
            }
            let Some(sid) = shard_at(&table, index)? else {
                return Ok(false);
            };
            let Some(shard_relid) = lock_local_shard(&table.rel_name, sid, (*rte).rellockmode)
            else {
                return Ok(false);
            };
            move_to_shell(query, rte, check);
            (*rte).relid = shard_relid;
        }
        Ok(true)
    }
}

/// The items of the list that ends a `RemusRouter`'s private data (a local plan and its shard,
/// or a spliced plan's shard), if it ends in one.
///
/// # Safety
/// `private` must be the CustomScan's private list as `modify` builds it.
pub(crate) unsafe fn trailing_list(
    private: &[*mut pg_sys::Node],
) -> Option<Vec<*mut pg_sys::Node>> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let last = *private.last()?;
        is_tag(last, pg_sys::NodeTag::T_List)
            .then(|| list_ptrs::<pg_sys::Node>(last as *mut pg_sys::List))
    }
}

/// The local plan in a `RemusRouter`'s private data, and the shard (of the anchor table) it was
/// made for.
///
/// # Safety
/// `private` must be the CustomScan's private list as `modify` builds it.
pub(crate) unsafe fn local_plan_of(
    private: &[*mut pg_sys::Node],
) -> Option<(*mut pg_sys::PlannedStmt, i64)> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let items = trailing_list(private)?;
        if items.len() != 2 || !is_tag(items[0], pg_sys::NodeTag::T_PlannedStmt) {
            return None;
        }
        let shard = (*(items[1] as *mut pg_sys::Const)).constvalue.value() as i64;
        Some((items[0] as *mut pg_sys::PlannedStmt, shard))
    }
}

/// Locks every relation of a local plan and checks that it still exists. False: the plan is
/// stale (a shard dropped since it was made), take the general path.
pub(crate) unsafe fn relations_here(stmt: *mut pg_sys::PlannedStmt) -> bool {
    // SAFETY: the plan is a valid PlannedStmt; locks and syscache probes by OID.
    unsafe {
        for rte in list_ptrs::<pg_sys::RangeTblEntry>((*stmt).rtable) {
            if (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION
                && !lock_existing((*rte).relid, (*rte).rellockmode)
            {
                return false;
            }
        }
        true
    }
}

/// A local SELECT plan made at execution, readied to run in the statement's own executor
/// instead of a nested one (decision 0014): its plan tree, once the executor's range table is
/// the local plan's (the same entries, with the shard tables, locked and checked to exist, in
/// the shells' places). None, the executor untouched: the plan needs what the
/// statement's executor was not started with (subplans, executor parameters, row marks, a
/// range table that is not the statement's one for one) or returns other columns than the
/// `outputs` of the statement, or a shard table is gone; start it nested
/// ([`start_select`]).
///
/// The statement's permissions were checked on the shells by its own `ExecutorStart`; the
/// swap happens after that, for this execution's state only (the cached plans are not
/// changed). EXPLAIN names the plan's relations from the statement's range table: the shells.
///
/// # Safety
/// `stmt` must be a local plan made at execution for this statement, which has not started a
/// plan node yet; `estate` the statement's live EState.
pub(crate) unsafe fn spliced_at_execution(
    stmt: *mut pg_sys::PlannedStmt,
    estate: *mut pg_sys::EState,
    outputs: usize,
) -> Option<*mut pg_sys::Plan> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the executor's range
    // table array has `es_range_table_size` entries (ExecInitRangeTable).
    unsafe {
        let plan = (*stmt).planTree;
        if !runs_spliced(stmt, plan, outputs) {
            return None;
        }
        let mine = list_ptrs::<pg_sys::RangeTblEntry>((*stmt).rtable);
        let size = (*estate).es_range_table_size as usize;
        if mine.len() != size || size == 0 {
            return None;
        }
        let theirs = list_ptrs::<pg_sys::RangeTblEntry>((*estate).es_range_table);
        let opened = std::slice::from_raw_parts((*estate).es_relations, size);
        // Entry for entry the statement's range table (the planner appends what it pulls up,
        // so an equal length means nothing was), none of it opened yet.
        if theirs.len() != size
            || mine
                .iter()
                .zip(theirs.iter())
                .zip(opened)
                .any(|((m, t), rel)| (**m).rtekind != (**t).rtekind || !rel.is_null())
        {
            return None;
        }
        if !relations_here(stmt) {
            return None;
        }
        // The executor reads its range table through this list (exec_rt_fetch).
        (*estate).es_range_table = (*stmt).rtable;
        Some(plan)
    }
}

/// Can plan tree `plan` of local plan `stmt` run in place of a `RemusRouter` node returning
/// `outputs` columns, in an executor started for another statement (spliced at execution)?
/// (`modify::on_top`, which starts the executor on the local plan's own header, has its own
/// test, [`runs_on_top`].) Not when it needs what such an executor is not started with:
/// subplans, executor parameters, row marks, parallel workers; nor when it returns other
/// columns than the router's (junk columns, another count).
///
/// # Safety
/// `stmt` must be a valid PlannedStmt and `plan` NULL or its plan tree.
pub(crate) unsafe fn runs_spliced(
    stmt: *mut pg_sys::PlannedStmt,
    plan: *mut pg_sys::Plan,
    outputs: usize,
) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        runs_on_top(stmt, plan, outputs)
            && (*stmt).subplans.is_null()
            && (*stmt).paramExecTypes.is_null()
    }
}

/// Can plan tree `plan` of local plan `stmt` run as the statement's plan, in place of a
/// `RemusRouter` node returning `outputs` columns? The executor is started on `stmt`'s own
/// header (`modify::on_top`), so its subplans and executor parameters come with it (every
/// ModifyTable has one, its EvalPlanQual parameter), unlike a plan spliced under the router
/// node ([`runs_spliced`]). Not a plan that locks rows (the drain fence is the router's)
/// or wants parallel workers, nor one that returns other columns than the router's (junk
/// columns, another count), which the portal's row description was made from.
///
/// # Safety
/// `stmt` must be a valid PlannedStmt and `plan` NULL or its plan tree.
pub(crate) unsafe fn runs_on_top(
    stmt: *mut pg_sys::PlannedStmt,
    plan: *mut pg_sys::Plan,
    outputs: usize,
) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        !plan.is_null()
            && (*stmt).rowMarks.is_null()
            && !(*stmt).parallelModeNeeded
            && pg_sys::list_length((*plan).targetlist) as usize == outputs
            && !list_ptrs::<pg_sys::TargetEntry>((*plan).targetlist)
                .iter()
                .any(|te| (**te).resjunk)
    }
}

/// Starts a local SELECT plan in a nested executor with the statement's snapshot and
/// parameters. None: stale, take the general path.
///
/// # Safety
/// `stmt` must be a local plan of this statement; `estate` the statement's live EState.
pub(crate) unsafe fn start_select(
    stmt: *mut pg_sys::PlannedStmt,
    estate: *mut pg_sys::EState,
) -> Option<*mut pg_sys::QueryDesc> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if !relations_here(stmt) {
            return None;
        }
        let old = pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
        let qd = pg_sys::CreateQueryDesc(
            stmt,
            (*estate).es_sourceText,
            pg_sys::GetActiveSnapshot(),
            std::ptr::null_mut(),
            pg_sys::None_Receiver,
            (*estate).es_param_list_info,
            (*estate).es_queryEnv,
            0,
        );
        {
            let _decided = Decided::enter();
            pg_sys::ExecutorStart(qd, 0);
        }
        pg_sys::MemoryContextSwitchTo(old);
        Some(qd)
    }
}

/// The next row of a started local SELECT, in `scan_slot` (its first `natts` columns; an empty
/// slot at the end).
///
/// # Safety
/// `qd` must come from [`start_select`]; `scan_slot` is the CustomScan's scan slot.
pub(crate) unsafe fn next_row(
    qd: *mut pg_sys::QueryDesc,
    scan_slot: *mut pg_sys::TupleTableSlot,
) -> *mut pg_sys::TupleTableSlot {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let ps = (*qd).planstate;
        let old = pg_sys::MemoryContextSwitchTo((*(*qd).estate).es_query_cxt);
        let exec = (*ps).ExecProcNode.expect("an initialised plan node");
        let slot = exec(ps);
        pg_sys::MemoryContextSwitchTo(old);
        pg_sys::ExecClearTuple(scan_slot);
        if slot.is_null() || (*slot).tts_flags & pg_sys::TTS_FLAG_EMPTY as u16 != 0 {
            return scan_slot;
        }
        // The local plan's top target list may end in junk columns (sort keys): the scan slot
        // has the statement's output columns only. The values stay valid until the next call,
        // as the child's own slot keeps its tuple until then.
        let natts = (*(*scan_slot).tts_tupleDescriptor).natts;
        pg_sys::slot_getsomeattrs(slot, natts);
        for i in 0..natts as usize {
            *(*scan_slot).tts_values.add(i) = *(*slot).tts_values.add(i);
            *(*scan_slot).tts_isnull.add(i) = *(*slot).tts_isnull.add(i);
        }
        pg_sys::ExecStoreVirtualTuple(scan_slot)
    }
}

/// Rewinds a started local SELECT.
///
/// # Safety
/// `qd` must come from [`start_select`].
pub(crate) unsafe fn rescan(qd: *mut pg_sys::QueryDesc) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe { pg_sys::ExecReScan((*qd).planstate) }
}

/// Ends a started local SELECT.
///
/// # Safety
/// `qd` must come from [`start_select`] and not be ended yet.
pub(crate) unsafe fn end(qd: *mut pg_sys::QueryDesc) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        pg_sys::ExecutorFinish(qd);
        pg_sys::ExecutorEnd(qd);
        pg_sys::FreeQueryDesc(qd);
    }
}

/// A DestReceiver that appends every row to a tuplestore (RETURNING rows of a local write).
#[repr(C)]
struct StoreReceiver {
    dest: pg_sys::DestReceiver,
    store: *mut pg_sys::Tuplestorestate,
}

#[pg_guard]
unsafe extern "C-unwind" fn store_row(
    slot: *mut pg_sys::TupleTableSlot,
    dest: *mut pg_sys::DestReceiver,
) -> bool {
    // SAFETY: PostgreSQL passes the receiver made by `run_modify` and a live slot.
    unsafe { pg_sys::tuplestore_puttupleslot((*(dest as *mut StoreReceiver)).store, slot) };
    true
}

#[pg_guard]
unsafe extern "C-unwind" fn store_startup(
    _dest: *mut pg_sys::DestReceiver,
    _operation: c_int,
    _typeinfo: pg_sys::TupleDesc,
) {
}

#[pg_guard]
unsafe extern "C-unwind" fn store_nothing(_dest: *mut pg_sys::DestReceiver) {}

/// Runs a local INSERT / UPDATE / DELETE plan to completion in a nested executor, with the
/// statement's snapshot and parameters; RETURNING rows go to `store` (NULL: none). Returns the
/// rows it changed, or None when the plan is stale (take the general path).
///
/// # Safety
/// `stmt` must be a local plan of this statement; `estate` the statement's live EState;
/// `store` NULL or a tuplestore of the RETURNING row type.
pub(crate) unsafe fn run_modify(
    stmt: *mut pg_sys::PlannedStmt,
    estate: *mut pg_sys::EState,
    store: *mut pg_sys::Tuplestorestate,
) -> Option<u64> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if !relations_here(stmt) {
            return None;
        }
        let dest = if store.is_null() {
            pg_sys::None_Receiver
        } else {
            let r = pg_sys::palloc0(std::mem::size_of::<StoreReceiver>()) as *mut StoreReceiver;
            (*r).dest.receiveSlot = Some(store_row);
            (*r).dest.rStartup = Some(store_startup);
            (*r).dest.rShutdown = Some(store_nothing);
            (*r).dest.rDestroy = Some(store_nothing);
            (*r).dest.mydest = pg_sys::CommandDest::DestTuplestore;
            (*r).store = store;
            r as *mut pg_sys::DestReceiver
        };
        let qd = pg_sys::CreateQueryDesc(
            stmt,
            (*estate).es_sourceText,
            pg_sys::GetActiveSnapshot(),
            std::ptr::null_mut(),
            dest,
            (*estate).es_param_list_info,
            (*estate).es_queryEnv,
            0,
        );
        {
            let _decided = Decided::enter();
            pg_sys::ExecutorStart(qd, 0);
        }
        pg_sys::ExecutorRun(qd, pg_sys::ScanDirection::ForwardScanDirection, 0, true);
        pg_sys::ExecutorFinish(qd);
        let changed = (*(*qd).estate).es_processed;
        pg_sys::ExecutorEnd(qd);
        pg_sys::FreeQueryDesc(qd);
        Some(changed)
    }
}

/// A local plan for `query` (the statement a `RemusRouter` plan node `cscan` carries) on this
/// node's shards of index `index` (`shard`: the anchor table's), made at execution: kept with the
/// plan node for later executions, made again after any relcache invalidation. None: a shard of
/// the group is not here (take the general path).
///
/// # Safety
/// `cscan` must be the executing plan node and `query` its Query; inside a transaction.
unsafe fn local_plan_at_execution(
    cscan: *mut pg_sys::CustomScan,
    query: *mut pg_sys::Query,
    anchor: &DistTable,
    index: usize,
    shard: i64,
    source_text: *const c_char,
) -> Result<Option<*mut pg_sys::PlannedStmt>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract; memory contexts are
    // PostgreSQL's, switched and restored around the allocation.
    unsafe {
        let key = node_key(cscan);
        let epoch = EPOCH.with(|e| e.get());
        let kept = MADE_AT_EXECUTION.with(|m| {
            m.borrow()
                .get(&key)
                .filter(|e| e.epoch == epoch)
                .and_then(|e| e.plans.get(&shard).copied())
        });
        if let Some(plan) = kept {
            return Ok(Some(plan));
        }
        let cxt = node_cache(cscan);
        let old = pg_sys::MemoryContextSwitchTo(cxt);
        let local = pg_sys::copyObjectImpl(query as *const std::ffi::c_void) as *mut pg_sys::Query;
        let here = on_local_shards(local, anchor, index, Check::Done);
        let plan = match here {
            Ok(true) => Some(pg_sys::planner(local, source_text, 0, std::ptr::null_mut())),
            _ => None,
        };
        pg_sys::MemoryContextSwitchTo(old);
        here?;
        if let Some(p) = plan {
            MADE_AT_EXECUTION.with(|m| {
                if let Some(e) = m.borrow_mut().get_mut(&key) {
                    e.plans.insert(shard, p);
                }
            });
        }
        Ok(plan)
    }
}

/// The local plan that serves `placement` (the shard execution chose on this node) for plan
/// node `cscan` carrying `query`: the one made at plan time when it is for that very shard,
/// otherwise one made at execution ([`local_plan_at_execution`]). None: a shard of the group
/// is not here (take the general path).
///
/// # Safety
/// `cscan` must be the executing `RemusRouter` plan node and `query` its Query; inside a
/// transaction.
pub(crate) unsafe fn local_plan_for_shard(
    cscan: *mut pg_sys::CustomScan,
    query: *mut pg_sys::Query,
    table: &DistTable,
    placement: &crate::catalog::ShardPlacement,
    source_text: *const c_char,
) -> Result<Option<*mut pg_sys::PlannedStmt>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        match local_plan_of(&private).filter(|(_, shard)| *shard == placement.shard_id) {
            Some((stmt, _)) => Ok(Some(stmt)),
            None => local_plan_at_execution(
                cscan,
                query,
                table,
                placement.shard_index as usize,
                placement.shard_id,
                source_text,
            ),
        }
    }
}

/// The cache entry of plan node `cscan`, current (made, or emptied if older than the last
/// relcache invalidation); returns its memory context.
unsafe fn node_cache(cscan: *mut pg_sys::CustomScan) -> pg_sys::MemoryContext {
    // SAFETY: `cscan` is a live plan node, allocated by PostgreSQL in its plan's context.
    unsafe {
        let key = node_key(cscan);
        let epoch = EPOCH.with(|e| e.get());
        let known = MADE_AT_EXECUTION.with(|m| m.borrow().get(&key).map(|e| (e.cxt, e.epoch)));
        match known {
            Some((cxt, e)) if e == epoch => cxt,
            Some((cxt, _)) => {
                // Stale: drop what this node kept (the reset callback forgets the entry).
                pg_sys::MemoryContextReset(cxt);
                remember(key, cxt, epoch);
                cxt
            }
            None => {
                // The private list's context is the plan's (for a copied node, the shape's).
                let parent =
                    pg_sys::GetMemoryChunkContext((*cscan).custom_private as *mut std::ffi::c_void);
                let cxt = pg_sys::AllocSetContextCreateInternal(
                    parent,
                    c"pg_remus plan node cache".as_ptr(),
                    0,
                    1024,
                    8 * 1024 * 1024,
                );
                remember(key, cxt, epoch);
                cxt
            }
        }
    }
}

/// The text `query` (carried by plan node `cscan`) goes to `placement`'s node as, and the
/// parameters it then goes with when they are not the statement's own `params`: its constants
/// lifted into parameters when it goes to another node with no parameters of its own
/// (`super::deparse::lifted_for`, design note 0002), otherwise [`deparsed`].
///
/// # Safety
/// As [`deparsed`]; `params` are the executing statement's.
pub(crate) unsafe fn statement_for(
    cscan: *mut pg_sys::CustomScan,
    query: *mut pg_sys::Query,
    cacheable: bool,
    placement: &crate::catalog::ShardPlacement,
    params: &super::execute::Params,
) -> (std::rc::Rc<str>, Option<super::execute::Params>) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        match super::deparse::lifted_for(placement, query, params) {
            Some((sql, lifted)) => (sql.into(), Some(lifted)),
            None => (deparsed(cscan, query, cacheable), None),
        }
    }
}

/// `query` (carried by plan node `cscan`) deparsed for its owner. A statement with parameters
/// (`cacheable`: a prepared or extended-protocol statement, whose text does not change between
/// executions) is deparsed once per plan node; others each time.
///
/// # Safety
/// `cscan` must be the executing plan node and `query` one of its Queries.
pub(crate) unsafe fn deparsed(
    cscan: *mut pg_sys::CustomScan,
    query: *mut pg_sys::Query,
    cacheable: bool,
) -> std::rc::Rc<str> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if !cacheable {
            return super::deparse::deparse(query).into();
        }
        let key = node_key(cscan);
        let epoch = EPOCH.with(|e| e.get());
        let hit = MADE_AT_EXECUTION.with(|m| {
            m.borrow()
                .get(&key)
                .filter(|e| e.epoch == epoch)
                .and_then(|e| e.texts.get(&(query as usize)).cloned())
        });
        if let Some(text) = hit {
            return text;
        }
        node_cache(cscan);
        let text: std::rc::Rc<str> = super::deparse::deparse(query).into();
        MADE_AT_EXECUTION.with(|m| {
            if let Some(e) = m.borrow_mut().get_mut(&key) {
                e.texts.insert(query as usize, text.clone());
            }
        });
        text
    }
}

/// Registers a fresh entry for plan node `key` whose plans live in `cxt`, and the callback that
/// forgets it when `cxt` is reset or deleted.
unsafe fn remember(key: usize, cxt: pg_sys::MemoryContext, epoch: u64) {
    // SAFETY: the callback struct lives in `cxt`, as long as the registration.
    unsafe {
        let cb =
            pg_sys::MemoryContextAlloc(cxt, std::mem::size_of::<pg_sys::MemoryContextCallback>())
                as *mut pg_sys::MemoryContextCallback;
        (*cb).func = Some(forget_plans);
        (*cb).arg = key as *mut std::ffi::c_void;
        (*cb).next = std::ptr::null_mut();
        pg_sys::MemoryContextRegisterResetCallback(cxt, cb);
    }
    MADE_AT_EXECUTION.with(|m| {
        m.borrow_mut().insert(
            key,
            ExecutionPlans {
                cxt,
                epoch,
                plans: fast_map(),
                texts: fast_map(),
            },
        )
    });
}

#[pg_guard]
unsafe extern "C-unwind" fn forget_plans(arg: *mut std::ffi::c_void) {
    let _ = MADE_AT_EXECUTION.try_with(|m| m.borrow_mut().remove(&(arg as usize)));
}
