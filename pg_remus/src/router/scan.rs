//! `RemusShardScan`: the scan of a distributed table's shell, reading its shards.
//!
//! Planned through `set_rel_pathlist_hook` (`hooks::pathlist` calls [`add_path`]) as the only path of the shell's base relation, so
//! PostgreSQL plans everything above it (joins, aggregates, sorts, limits) exactly as for a
//! local table and computes the same answers. A `key = <constant or parameter>` restriction
//! prunes the scan to one shard and is shipped with it; every restriction is also rechecked
//! locally by `ExecScan`, so shipping is an optimisation, never a source of truth.
//!
//! Each shard is sent `SELECT <columns read> FROM <shell> [WHERE <shipped filter>]`
//! ([`shipped`]) and, when the scan is its query level's whole FROM under `ORDER BY … LIMIT`
//! and nothing between the scan and the Limit can drop, add or merge rows, `ORDER BY <the same
//! keys> LIMIT <limit + offset>` ([`top_n`], decision 0015): each shard returns at most its first
//! limit + offset rows, a superset of the rows the query's own Sort and Limit above keep. The
//! rule is conservative: any restriction not shipped, any sort key a shard cannot evaluate as
//! here (mutable function, parameter, another relation), a USING operator, a non-default
//! collation, WITH TIES, grouping, aggregates, windows, DISTINCT, SRFs, row locks, joins, or a
//! LIMIT that is neither a constant nor a statement parameter, and nothing is pushed. LIMIT and
//! OFFSET parameters are read when the scan starts (a generic plan's `LIMIT $1`). EXPLAIN
//! VERBOSE shows `Shard Order By` and `Shard Limit`.

use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::pg::custom_scan;
use crate::pg::list::list_ptrs;
use crate::router::execute::{Join, Params};

/// Method tables must have stable addresses for PostgreSQL; they are filled once at preload.
// SAFETY: all-zero is a valid value of this C struct (NULL name, no callbacks); it is filled in
// at preload, before PostgreSQL can see it.
static mut PATH_METHODS: pg_sys::CustomPathMethods = unsafe { std::mem::zeroed() };
// SAFETY: all-zero is a valid value of this C struct (NULL name, no callbacks); it is filled in
// at preload, before PostgreSQL can see it.
static mut SCAN_METHODS: pg_sys::CustomScanMethods = unsafe { std::mem::zeroed() };
// SAFETY: all-zero is a valid value of this C struct (NULL name, no callbacks); it is filled in
// at preload, before PostgreSQL can see it.
static mut EXEC_METHODS: pg_sys::CustomExecMethods = unsafe { std::mem::zeroed() };
const NAME: &CStr = c"RemusShardScan";

#[repr(C)]
struct ShardScanState {
    css: pg_sys::CustomScanState,
    tstore: *mut pg_sys::Tuplestorestate,
    /// Tuplestores hand out minimal tuples; the scan slot of a CustomScan is not of that kind.
    store_slot: *mut pg_sys::TupleTableSlot,
    key_expr: *mut pg_sys::Expr,
    /// The pushed top-N's LIMIT and OFFSET ([`top_n`]); NULL when none is pushed.
    limit_expr: *mut pg_sys::Expr,
    offset_expr: *mut pg_sys::Expr,
    fetched: bool,
}

/// Fills and registers the method tables; must run while the library is preloaded.
pub(crate) fn register_methods() {
    // SAFETY: one-time initialisation of process-global tables at preload.
    unsafe {
        PATH_METHODS.CustomName = NAME.as_ptr();
        PATH_METHODS.PlanCustomPath = Some(plan_custom_path);
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

/// After the other paths of a base relation are set: a shell gets our path as its only one.
///
/// # Safety
/// `rel` and `rte` must be the planner's base relation and its range-table entry.
pub(crate) unsafe fn add_path(rel: *mut pg_sys::RelOptInfo, rte: *mut pg_sys::RangeTblEntry) {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        // A base relation, or a member of an append relation: the branches of a UNION ALL
        // that PostgreSQL flattened into one Append are member relations, and each shell
        // there is read from its shards like any other (its own heap is empty).
        if (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION
            || !matches!(
                (*rel).reloptkind,
                pg_sys::RelOptKind::RELOPT_BASEREL | pg_sys::RelOptKind::RELOPT_OTHER_MEMBER_REL
            )
        {
            return;
        }
        match super::placement::dist_table((*rte).relid) {
            Ok(Some(_)) => {}
            Ok(None) => return,
            Err(e) => e.raise(),
        }
        let path =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::CustomPath>()) as *mut pg_sys::CustomPath;
        (*path).path.type_ = pg_sys::NodeTag::T_CustomPath;
        (*path).path.pathtype = pg_sys::NodeTag::T_CustomScan;
        (*path).path.parent = rel;
        (*path).path.pathtarget = (*rel).reltarget;
        (*path).path.rows = (*rel).rows.max(1.0);
        // Remote work is expensive; the numbers only need to rank our single path sensibly.
        (*path).path.startup_cost = 100.0;
        (*path).path.total_cost = 100.0 + (*path).path.rows;
        (*path).methods = &raw const PATH_METHODS;
        // Ours is the only way to read a shell: its heap is empty by construction.
        (*rel).pathlist = std::ptr::null_mut();
        (*rel).partial_pathlist = std::ptr::null_mut();
        pg_sys::add_path(rel, path as *mut pg_sys::Path);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn plan_custom_path(
    root: *mut pg_sys::PlannerInfo,
    rel: *mut pg_sys::RelOptInfo,
    _best_path: *mut pg_sys::CustomPath,
    tlist: *mut pg_sys::List,
    clauses: *mut pg_sys::List,
    _custom_plans: *mut pg_sys::List,
) -> *mut pg_sys::Plan {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let cscan =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::CustomScan>()) as *mut pg_sys::CustomScan;
        (*cscan).scan.plan.type_ = pg_sys::NodeTag::T_CustomScan;
        (*cscan).scan.plan.targetlist = tlist;
        (*cscan).scan.plan.qual = pg_sys::extract_actual_clauses(clauses, false);
        (*cscan).scan.scanrelid = (*rel).relid;
        (*cscan).methods = &raw const SCAN_METHODS;
        // custom_exprs: the top-N's limit and offset when one is pushed ([`top_n`]), then the
        // routable `key = value` restriction's value, if any.
        let rte = pg_sys::planner_rt_fetch((*rel).relid, root);
        (*cscan).custom_private = shipped((*rel).relid, (*rte).relid, rel, clauses);
        let order_by = match top_n(root, (*rel).relid, (*rte).relid, clauses) {
            Some(t) => {
                (*cscan).custom_exprs = pg_sys::lappend(
                    pg_sys::lappend(std::ptr::null_mut(), t.limit as *mut std::ffi::c_void),
                    t.offset as *mut std::ffi::c_void,
                );
                text_const(Some(&t.order_by))
            }
            None => text_const(None),
        };
        (*cscan).custom_private =
            pg_sys::lappend((*cscan).custom_private, order_by as *mut std::ffi::c_void);
        if let Ok(Some(table)) = super::placement::dist_table((*rte).relid) {
            if let Ok(attno) = super::key::key_attno(&table) {
                for rinfo in list_ptrs::<pg_sys::RestrictInfo>(clauses) {
                    if let Some(v) = super::key::key_equality_value(
                        (*rinfo).clause as *mut _,
                        (*rel).relid as i32,
                        attno,
                    ) {
                        (*cscan).custom_exprs =
                            pg_sys::lappend((*cscan).custom_exprs, v as *mut std::ffi::c_void);
                        break;
                    }
                }
            }
        }
        cscan as *mut pg_sys::Plan
    }
}

/// What the scan ships to each shard besides the key filter ([`fetch`]): the start of its
/// private list, `[filter, columns]`, the WHERE text of the clauses a shard can evaluate itself
/// (a NULL Const when none), and the attribute numbers the plan above reads (`[0]`: all of
/// them); `plan_custom_path` appends the top-N's ORDER BY text ([`top_n`]).
///
/// A clause is shipped when a shard evaluates it exactly as here: no mutable function, no
/// parameter, no subplan, only this table's own columns. The clauses stay in the plan's qual
/// as well (rechecked here, at the cost of evaluating them twice on the rows that pass).
unsafe fn shipped(
    rti: pg_sys::Index,
    relid: pg_sys::Oid,
    rel: *mut pg_sys::RelOptInfo,
    clauses: *mut pg_sys::List,
) -> *mut pg_sys::List {
    // SAFETY: the planner's live RelOptInfo and its restriction clauses.
    unsafe {
        let rel_name = rel_name(relid);
        let mut filters = Vec::new();
        for rinfo in list_ptrs::<pg_sys::RestrictInfo>(clauses) {
            let clause = (*rinfo).clause as *mut pg_sys::Node;
            if (*rinfo).pseudoconstant || !evaluable_on_shard(clause, rti) {
                continue;
            }
            let copy =
                pg_sys::copyObjectImpl(clause as *const std::ffi::c_void) as *mut pg_sys::Node;
            pg_sys::ChangeVarNodes(copy, rti as i32, 1, 0);
            // Printed fully parenthesized (not pretty): safe to join with AND.
            filters.push(super::deparse::deparse_filter(copy, relid, &rel_name));
        }
        let filter = text_const(
            (!filters.is_empty())
                .then(|| filters.join(" AND "))
                .as_deref(),
        );
        // The columns read above the scan or by its clauses; a whole-row reference reads all.
        let mut used: *mut pg_sys::Bitmapset = std::ptr::null_mut();
        pg_sys::pull_varattnos(
            (*(*rel).reltarget).exprs as *mut pg_sys::Node,
            rti,
            &mut used,
        );
        let actual = pg_sys::extract_actual_clauses(clauses, false);
        pg_sys::pull_varattnos(actual as *mut pg_sys::Node, rti, &mut used);
        let pseudo = pg_sys::extract_actual_clauses(clauses, true);
        pg_sys::pull_varattnos(pseudo as *mut pg_sys::Node, rti, &mut used);
        let offset = pg_sys::FirstLowInvalidHeapAttributeNumber;
        let mut columns: *mut pg_sys::List = std::ptr::null_mut();
        let mut whole_row = false;
        let mut member = -1;
        loop {
            member = pg_sys::bms_next_member(used, member);
            if member < 0 {
                break;
            }
            let attno = member + offset;
            if attno == 0 {
                whole_row = true;
            } else if attno > 0 {
                columns = pg_sys::lappend_int(columns, attno);
            }
        }
        if whole_row {
            // 0: every column.
            columns = pg_sys::lappend_int(std::ptr::null_mut(), 0);
        }
        let mut private = pg_sys::lappend(std::ptr::null_mut(), filter as *mut std::ffi::c_void);
        private = pg_sys::lappend(private, columns as *mut std::ffi::c_void);
        private
    }
}

/// The relation's name ("" if it has gone).
unsafe fn rel_name(relid: pg_sys::Oid) -> String {
    // SAFETY: a catalog lookup; NULL when there is no such relation.
    unsafe {
        let n = pg_sys::get_rel_name(relid);
        if n.is_null() {
            String::new()
        } else {
            CStr::from_ptr(n).to_string_lossy().into_owned()
        }
    }
}

/// A text Const holding `text`, or a NULL one: how the plan's private list carries text.
unsafe fn text_const(text: Option<&str>) -> *mut pg_sys::Node {
    // SAFETY: palloc'd nodes in the planner's current memory context.
    unsafe {
        match text {
            None => {
                pg_sys::makeNullConst(pg_sys::TEXTOID, -1, pg_sys::InvalidOid) as *mut pg_sys::Node
            }
            Some(t) => {
                let t = std::ffi::CString::new(t).unwrap_or_default();
                pg_sys::makeConst(
                    pg_sys::TEXTOID,
                    -1,
                    pg_sys::InvalidOid,
                    -1,
                    pg_sys::Datum::from(pg_sys::cstring_to_text(t.as_ptr())),
                    false,
                    false,
                ) as *mut pg_sys::Node
            }
        }
    }
}

/// What an expression may read and still be computed away from the rows' own plan.
struct Reads {
    /// Columns (attno > 0) of this range-table entry; 0: no Var at all.
    rti: pg_sys::Index,
    /// The statement's external parameters (`$n`), fixed for the whole execution.
    extern_params: bool,
}

/// Does `expr` read nothing but what `reads` allows, with no mutable function (so that it has
/// one value per row, or per execution, wherever it is computed)?
unsafe fn reads_only(expr: *mut pg_sys::Node, reads: &Reads) -> bool {
    #[pg_guard]
    unsafe extern "C-unwind" fn foreign(
        node: *mut pg_sys::Node,
        reads: *mut std::ffi::c_void,
    ) -> bool {
        // SAFETY: called by expression_tree_walker with nodes of the expression it walks and
        // the `Reads` that `reads_only` passed.
        unsafe {
            if node.is_null() {
                return false;
            }
            let r = &*(reads as *const Reads);
            use pg_sys::NodeTag::*;
            match (*node).type_ {
                T_Var => {
                    let v = node as *mut pg_sys::Var;
                    r.rti == 0
                        || (*v).varno as usize != r.rti as usize
                        || (*v).varlevelsup != 0
                        || (*v).varattno <= 0
                }
                T_Param => {
                    !r.extern_params
                        || (*(node as *mut pg_sys::Param)).paramkind
                            != pg_sys::ParamKind::PARAM_EXTERN
                }
                T_SubLink | T_SubPlan | T_AlternativeSubPlan | T_Aggref | T_WindowFunc
                | T_PlaceHolderVar | T_CurrentOfExpr | T_GroupingFunc => true,
                _ => pg_sys::expression_tree_walker(node, Some(foreign), reads),
            }
        }
    }
    // SAFETY: a valid expression of the planner; the walker only reads it.
    unsafe {
        !pg_sys::contain_mutable_functions(expr)
            && !foreign(expr, reads as *const Reads as *mut std::ffi::c_void)
    }
}

/// Can a shard evaluate `clause` itself, with the same result? ([`shipped`])
unsafe fn evaluable_on_shard(clause: *mut pg_sys::Node, rti: pg_sys::Index) -> bool {
    let reads = Reads {
        rti,
        extern_params: false,
    };
    // SAFETY: a valid clause of the planner.
    unsafe { reads_only(clause, &reads) }
}

/// A top-N each shard can compute for the scan ([`top_n`]).
struct TopN {
    /// `<expr> ASC|DESC NULLS FIRST|LAST, …` as the shard reads it.
    order_by: String,
    /// The query's LIMIT and OFFSET (a `0` Const when it has none): Consts or expressions of
    /// the statement's parameters, read at execution.
    limit: *mut pg_sys::Node,
    offset: *mut pg_sys::Node,
}

/// The query level's `ORDER BY … LIMIT`, when each shard may return only its first
/// limit + offset rows in that order and the rows above still be the same: the scan is the
/// level's whole FROM; the level only filters, sorts, limits and projects (no grouping,
/// aggregate, window, DISTINCT, set operation, SRF, row lock, WITH TIES, volatile output); every
/// restriction is shipped (a clause checked only here could drop rows a shard counted in its
/// top-N); each sort key is an expression a shard evaluates as here, with the type's default
/// ordering (no USING) and the default collation (or none), of a built-in type through built-in
/// functions only; LIMIT and OFFSET are constants or
/// parameters of the statement. None otherwise (the scan reads every matching row, as before).
///
/// `root->parse` is the query level this relation belongs to (a subquery is planned with its
/// own root), so its clauses are the ones applied right above this scan.
unsafe fn top_n(
    root: *mut pg_sys::PlannerInfo,
    rti: pg_sys::Index,
    relid: pg_sys::Oid,
    clauses: *mut pg_sys::List,
) -> Option<TopN> {
    // SAFETY: the planner's live PlannerInfo and this relation's restriction clauses; nodes are
    // only read, or copied before they are changed.
    unsafe {
        let q = (*root).parse;
        if q.is_null()
            || (*q).commandType != pg_sys::CmdType::CMD_SELECT
            || (*q).sortClause.is_null()
            || (*q).limitCount.is_null()
            || (*q).limitOption != pg_sys::LimitOption::LIMIT_OPTION_COUNT
            || !(*q).groupClause.is_null()
            || !(*q).groupingSets.is_null()
            || (*q).hasAggs
            || !(*q).havingQual.is_null()
            || (*root).hasHavingQual
            || (*q).hasWindowFuncs
            || !(*q).distinctClause.is_null()
            || (*q).hasDistinctOn
            || !(*q).setOperations.is_null()
            || (*q).hasTargetSRFs
            || (*q).hasForUpdate
            || !(*q).rowMarks.is_null()
            || !(*root).rowMarks.is_null()
            || pg_sys::contain_volatile_functions((*q).targetList as *mut pg_sys::Node)
        {
            return None;
        }
        // This relation is the level's only base relation: no join, above or below the sort.
        if !pg_sys::bms_equal((*root).all_baserels, pg_sys::bms_make_singleton(rti as i32)) {
            return None;
        }
        // Every restriction is evaluated by the shard (pseudoconstant ones gate the whole scan,
        // not single rows).
        for rinfo in list_ptrs::<pg_sys::RestrictInfo>(clauses) {
            if !(*rinfo).pseudoconstant
                && !evaluable_on_shard((*rinfo).clause as *mut pg_sys::Node, rti)
            {
                return None;
            }
        }
        let name = rel_name(relid);
        let mut keys = Vec::new();
        for sort in list_ptrs::<pg_sys::SortGroupClause>((*q).sortClause) {
            let tle = pg_sys::get_sortgroupclause_tle(sort, (*q).targetList);
            let expr = (*tle).expr as *mut pg_sys::Node;
            // A sort key with no column is constant here, but printed as an integer it would
            // name an output column on the shard: not pushed.
            if !evaluable_on_shard(expr, rti)
                || !pg_sys::contain_var_clause(expr)
                || !built_in(expr)
            {
                return None;
            }
            let collation = pg_sys::exprCollation(expr);
            if collation != pg_sys::InvalidOid && collation != pg_sys::DEFAULT_COLLATION_OID {
                return None;
            }
            let ty = pg_sys::lookup_type_cache(
                pg_sys::exprType(expr),
                (pg_sys::TYPECACHE_LT_OPR | pg_sys::TYPECACHE_GT_OPR) as i32,
            );
            let direction = if (*sort).sortop == (*ty).lt_opr {
                "ASC"
            } else if (*sort).sortop == (*ty).gt_opr {
                "DESC"
            } else {
                // ORDER BY … USING another operator.
                return None;
            };
            let nulls = if (*sort).nulls_first {
                "NULLS FIRST"
            } else {
                "NULLS LAST"
            };
            let copy = pg_sys::copyObjectImpl(expr as *const std::ffi::c_void) as *mut pg_sys::Node;
            pg_sys::ChangeVarNodes(copy, rti as i32, 1, 0);
            keys.push(format!(
                "{} {direction} {nulls}",
                super::deparse::deparse_filter(copy, relid, &name)
            ));
        }
        let limit = known_at_execution((*q).limitCount)?;
        let offset = if (*q).limitOffset.is_null() {
            pg_sys::makeConst(
                pg_sys::INT8OID,
                -1,
                pg_sys::InvalidOid,
                8,
                pg_sys::Datum::from(0i64),
                false,
                true,
            ) as *mut pg_sys::Node
        } else {
            known_at_execution((*q).limitOffset)?
        };
        Some(TopN {
            order_by: keys.join(", "),
            limit,
            offset,
        })
    }
}

/// Are `expr`'s type and every function it calls built in (so the same on every node, whatever
/// was created on each)?
unsafe fn built_in(expr: *mut pg_sys::Node) -> bool {
    #[pg_guard]
    unsafe extern "C-unwind" fn user_function(
        func: pg_sys::Oid,
        _cx: *mut std::ffi::c_void,
    ) -> bool {
        u32::from(func) >= pg_sys::FirstNormalObjectId
    }
    #[pg_guard]
    unsafe extern "C-unwind" fn calls_user_function(
        node: *mut pg_sys::Node,
        cx: *mut std::ffi::c_void,
    ) -> bool {
        // SAFETY: called by expression_tree_walker with nodes of the expression it walks.
        unsafe {
            !node.is_null()
                && (pg_sys::check_functions_in_node(node, Some(user_function), cx)
                    || pg_sys::expression_tree_walker(node, Some(calls_user_function), cx))
        }
    }
    // SAFETY: a valid expression of the planner, only read.
    unsafe {
        u32::from(pg_sys::exprType(expr)) < pg_sys::FirstNormalObjectId
            && !calls_user_function(expr, std::ptr::null_mut())
    }
}

/// `expr` (a LIMIT or OFFSET), if its value is known when the scan starts: a non-NULL
/// constant, or an expression of the statement's parameters (a generic plan's `LIMIT $1`).
unsafe fn known_at_execution(expr: *mut pg_sys::Node) -> Option<*mut pg_sys::Node> {
    // SAFETY: a valid expression of the planner, only read.
    unsafe {
        if pg_sys::exprType(expr) != pg_sys::INT8OID {
            return None;
        }
        if (*expr).type_ == pg_sys::NodeTag::T_Const {
            // LIMIT ALL / LIMIT NULL: nothing to push.
            return (!(*(expr as *mut pg_sys::Const)).constisnull).then_some(expr);
        }
        let reads = Reads {
            rti: 0,
            extern_params: true,
        };
        reads_only(expr, &reads).then_some(expr)
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn create_state(cscan: *mut pg_sys::CustomScan) -> *mut pg_sys::Node {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = pg_sys::palloc0(std::mem::size_of::<ShardScanState>()) as *mut ShardScanState;
        (*s).css.ss.ps.type_ = pg_sys::NodeTag::T_CustomScanState;
        (*s).css.methods = &raw const EXEC_METHODS;
        let exprs = list_ptrs::<pg_sys::Expr>((*cscan).custom_exprs);
        // [limit, offset] first when a top-N is pushed, then the key's value if any.
        let first_key = if order_by_of(cscan).is_some() && exprs.len() >= 2 {
            (*s).limit_expr = exprs[0];
            (*s).offset_expr = exprs[1];
            2
        } else {
            0
        };
        (*s).key_expr = exprs
            .get(first_key)
            .copied()
            .unwrap_or(std::ptr::null_mut());
        s as *mut pg_sys::Node
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn begin(
    node: *mut pg_sys::CustomScanState,
    estate: *mut pg_sys::EState,
    _eflags: i32,
) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        // No I/O here: Begin also runs for EXPLAIN and at Bind time.
        let s = node as *mut ShardScanState;
        let desc = (*(*node).ss.ss_ScanTupleSlot).tts_tupleDescriptor;
        (*s).store_slot =
            pg_sys::ExecInitExtraTupleSlot(estate, desc, &raw const pg_sys::TTSOpsMinimalTuple);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn exec(
    node: *mut pg_sys::CustomScanState,
) -> *mut pg_sys::TupleTableSlot {
    // SAFETY: the executor calls ExecCustomScan with this scan's live state node.
    unsafe { pg_sys::ExecScan(&mut (*node).ss, Some(next_tuple), Some(recheck)) }
}

#[pg_guard]
unsafe extern "C-unwind" fn recheck(
    _node: *mut pg_sys::ScanState,
    _slot: *mut pg_sys::TupleTableSlot,
) -> bool {
    true
}

#[pg_guard]
unsafe extern "C-unwind" fn next_tuple(ss: *mut pg_sys::ScanState) -> *mut pg_sys::TupleTableSlot {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = ss as *mut ShardScanState;
        if !(*s).fetched {
            if let Err(e) = fetch(s) {
                e.raise();
            }
            (*s).fetched = true;
        }
        super::execute::next_from_store((*s).tstore, (*s).store_slot, (*ss).ss_ScanTupleSlot)
    }
}

/// The filter text and the columns [`shipped`] put in the plan (None: no filter; all columns,
/// also for a plan made before this was shipped).
unsafe fn shipped_of(cscan: *mut pg_sys::CustomScan) -> (Option<String>, Option<Vec<i32>>) {
    // SAFETY: `cscan` is this module's plan node; its private list is what `shipped` made.
    unsafe {
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        if private.len() < 2 {
            return (None, None);
        }
        let filter = private_text(cscan, 0);
        let columns = private[1] as *mut pg_sys::List;
        let wanted: Vec<i32> = if columns.is_null() {
            Vec::new()
        } else {
            (0..(*columns).length as usize)
                .map(|i| (*(*columns).elements.add(i)).int_value)
                .collect()
        };
        (filter, (!wanted.contains(&0)).then_some(wanted))
    }
}

/// Text Const `i` of the plan's private list (None: NULL, or not there in an older plan).
unsafe fn private_text(cscan: *mut pg_sys::CustomScan, i: usize) -> Option<String> {
    // SAFETY: `cscan` is this module's plan node; its private list is what `plan_custom_path`
    // made, text Consts at the positions asked for.
    unsafe {
        let private = list_ptrs::<pg_sys::Node>((*cscan).custom_private);
        let c = *private.get(i)? as *mut pg_sys::Const;
        (!(*c).constisnull).then(|| {
            let t = pg_sys::text_to_cstring((*c).constvalue.cast_mut_ptr());
            CStr::from_ptr(t).to_string_lossy().into_owned()
        })
    }
}

/// The pushed top-N's ORDER BY list ([`top_n`]), if one is pushed.
unsafe fn order_by_of(cscan: *mut pg_sys::CustomScan) -> Option<String> {
    // SAFETY: as `private_text`.
    unsafe { private_text(cscan, 2) }
}

/// ` ORDER BY … LIMIT <limit + offset>` for the shard statement, with this execution's LIMIT
/// and OFFSET; "" when none is pushed or its values rule it out (LIMIT NULL, a negative value
/// PostgreSQL's Limit refuses, an overflow).
unsafe fn top_n_suffix(s: *mut ShardScanState) -> String {
    // SAFETY: the scan's live state; its expressions are the plan's Consts or parameter
    // expressions, evaluated in its context.
    unsafe {
        if (*s).limit_expr.is_null() || (*s).offset_expr.is_null() {
            return String::new();
        }
        let Some(order_by) = order_by_of((*s).css.ss.ps.plan as *mut pg_sys::CustomScan) else {
            return String::new();
        };
        let ps = &raw mut (*s).css.ss.ps;
        let int8 = |e: *mut pg_sys::Expr| {
            let (d, isnull, ty) = super::execute::eval_expr(e, ps);
            (ty == pg_sys::INT8OID).then_some((!isnull).then(|| d.value() as i64))
        };
        let (Some(limit), Some(offset)) = (int8((*s).limit_expr), int8((*s).offset_expr)) else {
            return String::new();
        };
        // OFFSET NULL is OFFSET 0 to PostgreSQL's Limit; LIMIT NULL is no limit.
        let Some(limit) = limit else {
            return String::new();
        };
        let offset = offset.unwrap_or(0);
        if limit < 0 || offset < 0 {
            return String::new();
        }
        match limit.checked_add(offset) {
            Some(n) => format!(" ORDER BY {order_by} LIMIT {n}"),
            None => String::new(),
        }
    }
}

/// Reads the rows of every shard this scan needs into a tuplestore.
unsafe fn fetch(s: *mut ShardScanState) -> Result<(), RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let ss = &mut (*s).css.ss;
        let estate = ss.ps.state;
        let relid = (*ss.ss_currentRelation).rd_id;
        let table =
            super::placement::dist_table(relid)?.ok_or(RemusError::TableDisappearedDuringScan)?;
        // By key: only the chosen shard waits for an ownership change in doubt (F5).
        let all = if (*s).key_expr.is_null() {
            super::placement::placements(relid)?
        } else {
            super::placement::placements_for_key(relid)?
        };

        let desc = (*ss.ss_ScanTupleSlot).tts_tupleDescriptor;
        let natts = (*desc).natts as usize;
        let old = pg_sys::MemoryContextSwitchTo((*estate).es_query_cxt);
        (*s).tstore = pg_sys::tuplestore_begin_heap(true, false, pg_sys::work_mem);
        pg_sys::MemoryContextSwitchTo(old);

        let (targets, params, filter) = if table.kind == 'r' {
            // Every node holds the whole table: read the local copy.
            (
                all.into_iter()
                    .filter(|p| crate::guc::is_this_node(&p.node_name))
                    .collect(),
                Params::none(),
                String::new(),
            )
        } else if (*s).key_expr.is_null() {
            (all, Params::none(), String::new())
        } else {
            let (value, isnull, ty) = super::execute::eval_expr((*s).key_expr, &mut ss.ps);
            if isnull {
                // `key = NULL` is never true.
                return Ok(());
            }
            let target = super::key::placement_for(&table, &all, value, ty)?;
            let key_value = crate::pg::datum::coerce_via_text(value, ty, table.key_type);
            let key = crate::pg::sql::quote_ident(table.shard_key.as_deref().unwrap_or_default());
            (
                vec![target],
                Params {
                    types: vec![table.key_type],
                    values: vec![key_value],
                    nulls: vec![false],
                },
                format!(" WHERE {key} = $1"),
            )
        };

        let (shipped_filter, wanted) = shipped_of(ss.ps.plan as *mut pg_sys::CustomScan);
        let filter = match shipped_filter {
            Some(f) if filter.is_empty() => format!(" WHERE {f}"),
            Some(f) => format!("{filter} AND {f}"),
            None => filter,
        };
        // The live columns of the shell the plan reads, in order; the others stay NULL in the
        // scan tuple.
        let mut cols = Vec::new();
        let mut positions = Vec::new();
        let mut types = Vec::new();
        for i in 0..natts {
            let attr = (*desc).attrs.as_ptr().add(i);
            if (*attr).attisdropped
                || wanted
                    .as_ref()
                    .is_some_and(|w| !w.contains(&((i + 1) as i32)))
            {
                continue;
            }
            let name = CStr::from_ptr((*attr).attname.data.as_ptr()).to_string_lossy();
            cols.push(crate::pg::sql::quote_ident(&name));
            positions.push(i);
            types.push(((*attr).atttypid, (*attr).atttypmod));
        }
        let select_list = if cols.is_empty() {
            "NULL".to_string()
        } else {
            cols.join(", ")
        };
        let top_n = top_n_suffix(s);
        let sql = format!(
            "SELECT {select_list} FROM {}{filter}{top_n}",
            table.qualified_name
        );

        let mut values = vec![pg_sys::Datum::from(0usize); natts];
        let mut nulls = vec![true; natts];
        let tstore = (*s).tstore;
        let mut store = |rows: Vec<Vec<Option<pg_sys::Datum>>>| {
            for row in rows {
                for (j, v) in row.into_iter().enumerate().take(positions.len()) {
                    let pos = positions[j];
                    match v {
                        Some(d) => {
                            values[pos] = d;
                            nulls[pos] = false;
                        }
                        None => nulls[pos] = true,
                    }
                }
                // A tuplestore of this scan, `desc` its tuple's type, `natts` values each.
                pg_sys::tuplestore_putvalues(tstore, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            }
            Ok(())
        };
        if params.values.is_empty() && targets.len() > 1 {
            // Every shard: those of other nodes queried concurrently (item 6 of issue 16).
            return super::execute::read_every_shard(&targets, &sql, &types, store);
        }
        for p in &targets {
            let r =
                super::execute::run_on_shard(p, &sql, &params, &types, false, Join::Transaction)?;
            store(r.rows)?;
        }
        Ok(())
    }
}

/// EXPLAIN: what each shard is asked for, with VERBOSE.
#[pg_guard]
unsafe extern "C-unwind" fn explain(
    node: *mut pg_sys::CustomScanState,
    _ancestors: *mut pg_sys::List,
    es: *mut pg_sys::ExplainState,
) {
    // SAFETY: PostgreSQL calls this hook with the scan's live state and its ExplainState.
    unsafe {
        if !(*es).verbose {
            return;
        }
        let (filter, wanted) = shipped_of((*node).ss.ps.plan as *mut pg_sys::CustomScan);
        if let Some(f) = filter {
            let f = std::ffi::CString::new(f).unwrap_or_default();
            pg_sys::ExplainPropertyText(c"Shard Filter".as_ptr(), f.as_ptr(), es);
        }
        let columns = match wanted {
            None => "all".to_string(),
            Some(w) => w.iter().map(i32::to_string).collect::<Vec<_>>().join(", "),
        };
        let columns = std::ffi::CString::new(columns).unwrap_or_default();
        pg_sys::ExplainPropertyText(c"Shard Columns".as_ptr(), columns.as_ptr(), es);
        let s = node as *mut ShardScanState;
        if let Some(order_by) = order_by_of((*node).ss.ps.plan as *mut pg_sys::CustomScan) {
            if !(*s).limit_expr.is_null() && !(*s).offset_expr.is_null() {
                let order_by = std::ffi::CString::new(order_by).unwrap_or_default();
                pg_sys::ExplainPropertyText(c"Shard Order By".as_ptr(), order_by.as_ptr(), es);
                let limit = std::ffi::CString::new(shown_limit((*s).limit_expr, (*s).offset_expr))
                    .unwrap_or_default();
                pg_sys::ExplainPropertyText(c"Shard Limit".as_ptr(), limit.as_ptr(), es);
            }
        }
    }
}

/// The pushed shard LIMIT as EXPLAIN shows it: limit + offset when both are constants, else
/// the expressions (`$1 + $2`; the offset left out when it is 0).
unsafe fn shown_limit(limit: *mut pg_sys::Expr, offset: *mut pg_sys::Expr) -> String {
    // SAFETY: the plan's int8 Consts or parameter expressions, only read.
    unsafe {
        let value = |e: *mut pg_sys::Expr| {
            let node = e as *mut pg_sys::Node;
            ((*node).type_ == pg_sys::NodeTag::T_Const
                && !(*(node as *mut pg_sys::Const)).constisnull)
                .then(|| (*(node as *mut pg_sys::Const)).constvalue.value() as i64)
        };
        let text = |e: *mut pg_sys::Expr| match value(e) {
            Some(v) => v.to_string(),
            None => {
                let t = pg_sys::deparse_expression(e as *mut _, std::ptr::null_mut(), false, false);
                CStr::from_ptr(t).to_string_lossy().into_owned()
            }
        };
        match (value(limit), value(offset)) {
            (Some(l), Some(o)) if l.checked_add(o).is_some() => (l + o).to_string(),
            (_, Some(0)) => text(limit),
            _ => format!("{} + {}", text(limit), text(offset)),
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn end(node: *mut pg_sys::CustomScanState) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        let s = node as *mut ShardScanState;
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
        let s = node as *mut ShardScanState;
        // The routing key is a constant or external parameter, fixed for the whole execution, so
        // the rows already read are still the right ones.
        if !(*s).tstore.is_null() {
            pg_sys::tuplestore_rescan((*s).tstore);
        }
        pg_sys::ExecScanReScan(&mut (*node).ss);
    }
}
