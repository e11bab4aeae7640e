//! The statement router: distributed tables used as if they were local, from any node.
//!
//! - SELECT: every scan of a distributed table's shell becomes a [`shard_scan`] CustomScan that
//!   reads the shards it needs (one, when the query has `key = <value>`; all otherwise) and
//!   hands their rows to PostgreSQL, which then does joins, aggregates, sorting and limits
//!   itself. Results are therefore exactly PostgreSQL's own.
//! - INSERT / UPDATE / DELETE: [`modify`] replaces the plan with a CustomScan that sends the
//!   statement to the shard(s) it touches: one shard for `key = <value>` or a single-row
//!   INSERT, each row's shard for a multi-row INSERT, every shard otherwise.
//! - Shard work is always a statement on the shell's name carrying a `/*remus:shard=N*/`
//!   marker. A node honours the marker only in a session opened by another node
//!   (`remus.forwarded`) or in its own nested local execution, by planning the statement
//!   against the local shard table (relid swap) — so the decision where a shard lives is made
//!   once, by the coordinating backend, and the executing node never routes again.
//! - Routing decisions read the shard map at execution time, never at plan time: cached plans
//!   outlive migrations.

pub mod drain_fence;
pub mod map_cache;
pub mod modify;
pub mod ownership;
pub mod shard_scan;
pub mod utility;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::catalog::{self, DistTable, ShardPlacement};
use crate::error::RemusError;

static mut PREV_PLANNER: pg_sys::planner_hook_type = None;

thread_local! {
    /// relid → distribution (None: not distributed). Cleared by relcache invalidation.
    static DIST_CACHE: RefCell<HashMap<u32, Option<DistTable>>> = RefCell::new(HashMap::new());
    /// Set while this backend runs a marked shard statement locally.
    static LOCAL_SHARD_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Set while the cache itself is being filled (its SPI queries are planned too).
    static IN_LOOKUP: Cell<bool> = const { Cell::new(false) };
    static EXTENSION_OID: Cell<u32> = const { Cell::new(0) };
}

pub fn install_hooks() {
    // SAFETY: hooks are process globals set once while the library is preloaded; the previous
    // values are kept and chained.
    unsafe {
        PREV_PLANNER = pg_sys::planner_hook;
        pg_sys::planner_hook = Some(remus_planner);
        pg_sys::CacheRegisterRelcacheCallback(Some(relcache_callback), pg_sys::Datum::from(0usize));
    }
    shard_scan::install();
    modify::register_methods();
    ownership::install();
    utility::install();
}

#[pg_guard]
unsafe extern "C-unwind" fn relcache_callback(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    DIST_CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if relid == pg_sys::InvalidOid {
            c.clear();
            map_cache::clear();
        } else {
            c.remove(&relid.to_u32());
            map_cache::forget(relid.to_u32());
        }
    });
    EXTENSION_OID.with(|e| e.set(0));
}

/// Is pg_remus created in this database?
pub fn extension_present() -> bool {
    extension_ready()
}

/// Is pg_remus created in this database (and not being created right now)?
fn extension_ready() -> bool {
    // SAFETY: catalog lookup by name; `true` makes a missing extension return InvalidOid.
    unsafe {
        if pg_sys::creating_extension {
            return false;
        }
        let cached = EXTENSION_OID.with(|e| e.get());
        if cached != 0 {
            return true;
        }
        let oid = pg_sys::get_extension_oid(c"pg_remus".as_ptr(), true);
        if oid == pg_sys::InvalidOid {
            return false;
        }
        EXTENSION_OID.with(|e| e.set(oid.to_u32()));
        true
    }
}

/// The distribution of `relid`, if it is the shell of a distributed table.
pub fn dist_table(relid: pg_sys::Oid) -> Result<Option<DistTable>, RemusError> {
    if relid.to_u32() < pg_sys::FirstNormalObjectId || IN_LOOKUP.with(|f| f.get()) || !extension_ready() {
        return Ok(None);
    }
    if let Some(hit) = DIST_CACHE.with(|c| c.borrow().get(&relid.to_u32()).cloned()) {
        return Ok(hit);
    }
    IN_LOOKUP.with(|f| f.set(true));
    let found = catalog::dist_table(relid);
    IN_LOOKUP.with(|f| f.set(false));
    let found = found?;
    DIST_CACHE.with(|c| c.borrow_mut().insert(relid.to_u32(), found.clone()));
    Ok(found)
}

/// Placements as this transaction uses them: read with the current statement's snapshot, and
/// pinned per shard at first use until the transaction ends.
pub fn placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    let reference = matches!(dist_table(relid), Ok(Some(t)) if t.kind == 'r');
    let mut r = match map_cache::get(relid.to_u32()) {
        Some(hit) => hit,
        None => {
            let gen = map_cache::generation();
            IN_LOOKUP.with(|f| f.set(true));
            let r = if reference { catalog::reference_placements(relid) } else { catalog::placements(relid) };
            IN_LOOKUP.with(|f| f.set(false));
            let r = r?;
            map_cache::put(relid.to_u32(), gen, r.clone());
            r
        }
    };
    // While a Tm runs (read-through on, so nothing above came from the cache), a READ
    // COMMITTED transaction routing these shards for the first time waits for a Tm prepared
    // here (it may be committed elsewhere already), then reads the map with a snapshot taken
    // after that: a Tm that committed here since the statement's snapshot counts too.
    if !reference
        && map_cache::read_through()
        && drain_fence::routes_at_latest()
        && r.iter().any(|p| !ownership::is_pinned(p.shard_id))
    {
        IN_LOOKUP.with(|f| f.set(true));
        let waited = drain_fence::wait_for_in_doubt_flip(relid);
        IN_LOOKUP.with(|f| f.set(false));
        waited?;
        // SAFETY: a snapshot taken now, active only for the map read; push and pop pair (an
        // ERROR in between aborts the transaction, which resets the stack).
        unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
        IN_LOOKUP.with(|f| f.set(true));
        let again = catalog::placements(relid);
        IN_LOOKUP.with(|f| f.set(false));
        unsafe { pg_sys::PopActiveSnapshot() };
        r = again?;
    }
    // A reference table's shard is on every node: there is no owner to pin.
    if !reference {
        for p in &mut r {
            p.node_name = ownership::pinned_owner(p.shard_id, &p.node_name);
        }
    }
    Ok(r)
}

/// `/*remus:shard=N*/` at the start of the statement text.
pub(crate) fn shard_marker(query_string: *const std::ffi::c_char) -> Option<i64> {
    if query_string.is_null() {
        return None;
    }
    // SAFETY: the planner's query string is NUL-terminated.
    let s = unsafe { CStr::from_ptr(query_string) }.to_str().ok()?;
    let rest = s.trim_start().strip_prefix("/*remus:shard=")?;
    rest[..rest.find("*/")?].parse().ok()
}

pub(crate) fn marker_honoured() -> bool {
    crate::guc::FORWARDED.get() || LOCAL_SHARD_DEPTH.with(|d| d.get()) > 0
}

pub fn marked(shard_id: i64, sql: &str) -> String {
    format!("/*remus:shard={shard_id}*/ {sql}")
}

/// Iterates a PostgreSQL `List` of pointers.
///
/// # Safety
/// `list` must be NIL or a valid pointer List whose cells point at `T`.
pub unsafe fn list_ptrs<T>(list: *mut pg_sys::List) -> Vec<*mut T> {
    if list.is_null() {
        return Vec::new();
    }
    let n = (*list).length as usize;
    (0..n).map(|i| (*(*list).elements.add(i)).ptr_value as *mut T).collect()
}

unsafe fn is_tag(node: *const pg_sys::Node, tag: pg_sys::NodeTag) -> bool {
    !node.is_null() && (*node).type_ == tag
}

#[pg_guard]
unsafe extern "C-unwind" fn remus_planner(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
    cursor_options: std::ffi::c_int,
    bound_params: pg_sys::ParamListInfo,
) -> *mut pg_sys::PlannedStmt {
    // A gated transaction waits before its statement is routed, so that the routing decision
    // is taken after the gate opens.
    if let Err(e) = crate::handover::admit_statement() {
        e.raise();
    }
    match route(parse, query_string) {
        Ok(Some(stmt)) => return stmt,
        Ok(None) => {}
        Err(e) => e.raise(),
    }
    match PREV_PLANNER {
        Some(prev) => prev(parse, query_string, cursor_options, bound_params),
        None => pg_sys::standard_planner(parse, query_string, cursor_options, bound_params),
    }
}

/// Shells referenced anywhere in the top level of a query's range table.
unsafe fn shells_in(parse: *mut pg_sys::Query) -> Result<Vec<(usize, DistTable)>, RemusError> {
    let mut out = Vec::new();
    for (i, rte) in list_ptrs::<pg_sys::RangeTblEntry>((*parse).rtable).into_iter().enumerate() {
        if (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION {
            if let Some(t) = dist_table((*rte).relid)? {
                out.push((i + 1, t));
            }
        }
    }
    Ok(out)
}

/// Decides how a statement is planned. `Ok(None)`: by PostgreSQL (the scan hook may still
/// replace shell scans).
unsafe fn route(
    parse: *mut pg_sys::Query,
    query_string: *const std::ffi::c_char,
) -> Result<Option<*mut pg_sys::PlannedStmt>, RemusError> {
    if parse.is_null() || (*parse).commandType == pg_sys::CmdType::CMD_UTILITY || !extension_ready() {
        return Ok(None);
    }
    if marker_honoured() {
        if let Some(shard_id) = shard_marker(query_string) {
            pin_to_local_shard(parse, shard_id)?;
            return Ok(None);
        }
    }
    let cmd = (*parse).commandType;
    if cmd == pg_sys::CmdType::CMD_INSERT || cmd == pg_sys::CmdType::CMD_UPDATE || cmd == pg_sys::CmdType::CMD_DELETE {
        let rt = (*parse).resultRelation as usize;
        let shells = shells_in(parse)?;
        if let Some((_, t)) = shells.iter().find(|(i, _)| *i == rt) {
            return modify::plan(parse, t).map(Some);
        }
        if !shells.is_empty() {
            return Err(RemusError::FeatureNotSupported(
                "a statement that modifies a local table cannot read distributed tables yet".into(),
            ));
        }
        return Ok(None);
    }
    if cmd == pg_sys::CmdType::CMD_MERGE && !shells_in(parse)?.is_empty() {
        return Err(RemusError::FeatureNotSupported("MERGE on distributed tables is not supported".into()));
    }
    if cmd == pg_sys::CmdType::CMD_SELECT && !(*parse).rowMarks.is_null() && !shells_in(parse)?.is_empty() {
        return Err(RemusError::FeatureNotSupported(
            "SELECT … FOR UPDATE/SHARE on distributed tables is not supported yet".into(),
        ));
    }
    if cmd == pg_sys::CmdType::CMD_SELECT {
        if let Some((anchor_table, anchor_value)) = colocated_anchor(parse)? {
            return modify::plan_single_shard_select(parse, &anchor_table, anchor_value).map(Some);
        }
    }
    Ok(None)
}

/// Rewrites the shell reference of a marked statement to the local shard table. The shard
/// must be here: the coordinating node decided it is.
unsafe fn pin_to_local_shard(parse: *mut pg_sys::Query, shard_id: i64) -> Result<(), RemusError> {
    let shells = shells_in(parse)?;
    if shells.is_empty() {
        return Err(RemusError::FeatureNotSupported(format!(
            "a statement for shard {shard_id} must reference its distributed table"
        )));
    }
    // The marker names one shard; every distributed table of the statement uses the shard with
    // the same index in the same co-location group (the same table twice for ON CONFLICT's
    // `excluded`).
    IN_LOOKUP.with(|f| f.set(true));
    let index = crate::catalog::read_one::<i32>("SELECT max(shard_index) FROM remus.shards WHERE shard_id = $1", &[shard_id.into()]);
    IN_LOOKUP.with(|f| f.set(false));
    let index = index?.ok_or_else(|| RemusError::NotShardOwner {
        shard_id,
        node: crate::guc::node_name().unwrap_or_default(),
    })?;
    let single_table = shells.iter().all(|(_, t)| t.relid == shells[0].1.relid);
    let colocation = shells[0].1.colocation_id;
    if !single_table && shells.iter().any(|(_, t)| t.colocation_id != colocation || t.kind != 'h') {
        return Err(RemusError::FeatureNotSupported(format!(
            "a statement for shard {shard_id} may only reference tables co-located with it"
        )));
    }
    let nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), false);
    let rtes = list_ptrs::<pg_sys::RangeTblEntry>((*parse).rtable);
    for (rti, table) in &shells {
        let sid = if single_table {
            shard_id
        } else {
            IN_LOOKUP.with(|f| f.set(true));
            let sid = crate::catalog::read_one::<i64>(
                "SELECT max(shard_id) FROM remus.shards WHERE logicalrelid = $1 AND shard_index = $2",
                &[table.relid.into(), index.into()],
            );
            IN_LOOKUP.with(|f| f.set(false));
            sid?.unwrap_or(shard_id)
        };
        let shard_name = CString::new(format!("{}_{sid}", table.rel_name)).expect("no NUL in names");
        let shard_relid = pg_sys::get_relname_relid(shard_name.as_ptr(), nsp);
        if shard_relid == pg_sys::InvalidOid {
            return Err(RemusError::NotShardOwner {
                shard_id: sid,
                node: crate::guc::node_name().unwrap_or_default(),
            });
        }
        let rte = rtes[rti - 1];
        // The parser locked the shell, not the shard; the executor expects its relations locked.
        pg_sys::LockRelationOid(shard_relid, (*rte).rellockmode);
        // The lock may have been granted only because a migration's cleanup dropped the shard
        // meanwhile: then it is not here any more.
        if !pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(shard_relid),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        ) {
            return Err(RemusError::NotShardOwner {
                shard_id: sid,
                node: crate::guc::node_name().unwrap_or_default(),
            });
        }
        (*rte).relid = shard_relid;
    }
    Ok(())
}

/// Collects the conjuncts of a query's WHERE and of its inner joins' ON clauses; `None` when
/// the FROM clause holds anything but plain relations and inner joins.
unsafe fn inner_conjuncts(node: *mut pg_sys::Node, out: &mut Vec<*mut pg_sys::Node>) -> bool {
    if node.is_null() {
        return true;
    }
    match (*node).type_ {
        pg_sys::NodeTag::T_RangeTblRef => true,
        pg_sys::NodeTag::T_FromExpr => {
            let f = node as *mut pg_sys::FromExpr;
            for item in list_ptrs::<pg_sys::Node>((*f).fromlist) {
                if !inner_conjuncts(item, out) {
                    return false;
                }
            }
            flatten_and((*f).quals, out);
            true
        }
        pg_sys::NodeTag::T_JoinExpr => {
            let j = node as *mut pg_sys::JoinExpr;
            if (*j).jointype != pg_sys::JoinType::JOIN_INNER {
                return false;
            }
            if !inner_conjuncts((*j).larg, out) || !inner_conjuncts((*j).rarg, out) {
                return false;
            }
            flatten_and((*j).quals, out);
            true
        }
        _ => false,
    }
}

unsafe fn flatten_and(node: *mut pg_sys::Node, out: &mut Vec<*mut pg_sys::Node>) {
    if node.is_null() {
        return;
    }
    if is_tag(node, pg_sys::NodeTag::T_BoolExpr) && (*(node as *mut pg_sys::BoolExpr)).boolop == pg_sys::BoolExprType::AND_EXPR {
        for a in list_ptrs::<pg_sys::Node>((*(node as *mut pg_sys::BoolExpr)).args) {
            flatten_and(a, out);
        }
    } else if !is_tag(node, pg_sys::NodeTag::T_List) {
        out.push(node);
    } else {
        for a in list_ptrs::<pg_sys::Node>(node as *mut pg_sys::List) {
            flatten_and(a, out);
        }
    }
}

/// A SELECT over two or more co-located distributed tables whose shard keys are all tied
/// together by equalities and to one routable value: it reads a single shard group, so it can
/// run there as one statement. Returns the table and value that pick the group.
unsafe fn colocated_anchor(parse: *mut pg_sys::Query) -> Result<Option<(DistTable, *mut pg_sys::Expr)>, RemusError> {
    let q = &*parse;
    if !q.cteList.is_null() || q.hasSubLinks || !q.setOperations.is_null() || q.hasTargetSRFs {
        return Ok(None);
    }
    let mut rels = Vec::new();
    for (i, rte) in list_ptrs::<pg_sys::RangeTblEntry>(q.rtable).into_iter().enumerate() {
        match (*rte).rtekind {
            pg_sys::RTEKind::RTE_JOIN => {}
            pg_sys::RTEKind::RTE_RELATION => match dist_table((*rte).relid)? {
                Some(t) if t.kind == 'h' => rels.push((i + 1, t)),
                _ => return Ok(None),
            },
            _ => return Ok(None),
        }
    }
    if rels.len() < 2 || rels.iter().any(|(_, t)| t.colocation_id != rels[0].1.colocation_id) {
        return Ok(None);
    }
    let mut quals = Vec::new();
    if !inner_conjuncts(q.jointree as *mut pg_sys::Node, &mut quals) {
        return Ok(None);
    }
    let keys: Vec<(usize, i16)> = rels.iter().map(|(rti, t)| Ok((*rti, key_attno(t)?))).collect::<Result<_, RemusError>>()?;
    // Union-find over the tables' shard keys.
    let mut parent: Vec<usize> = (0..rels.len()).collect();
    fn find(p: &mut [usize], i: usize) -> usize {
        if p[i] == i { i } else { let r = find(p, p[i]); p[i] = r; r }
    }
    let key_of = |var: *mut pg_sys::Var| -> Option<usize> {
        keys.iter().position(|(rti, attno)| (*var).varno as usize == *rti && (*var).varattno == *attno && (*var).varlevelsup == 0)
    };
    let mut anchor = None;
    for c in quals {
        for (i, (rti, attno)) in keys.iter().enumerate() {
            if anchor.is_none() {
                if let Some(v) = key_equality_value(c, *rti as i32, *attno) {
                    anchor = Some((i, v));
                }
            }
        }
        if !is_tag(c, pg_sys::NodeTag::T_OpExpr) {
            continue;
        }
        let op = c as *mut pg_sys::OpExpr;
        let args = list_ptrs::<pg_sys::Node>((*op).args);
        if args.len() != 2 || (*op).opno.to_u32() >= pg_sys::FirstNormalObjectId {
            continue;
        }
        let name = pg_sys::get_opname((*op).opno);
        if name.is_null() || CStr::from_ptr(name).to_bytes() != b"=" {
            continue;
        }
        let (a, b) = (strip_relabel(args[0]), strip_relabel(args[1]));
        if is_tag(a, pg_sys::NodeTag::T_Var) && is_tag(b, pg_sys::NodeTag::T_Var) {
            if let (Some(x), Some(y)) = (key_of(a as *mut _), key_of(b as *mut _)) {
                let (rx, ry) = (find(&mut parent, x), find(&mut parent, y));
                parent[rx] = ry;
            }
        }
    }
    let Some((i, value)) = anchor else { return Ok(None) };
    let root = find(&mut parent, 0);
    if (0..rels.len()).any(|k| find(&mut parent, k) != root) {
        return Ok(None);
    }
    Ok(Some((rels[i].1.clone(), value)))
}

/// Where a statement for one shard runs, and what it returns.
pub struct ShardResult {
    /// Rows as datums in the order of the statement's output columns.
    pub rows: Vec<Vec<Option<pg_sys::Datum>>>,
    pub affected: u64,
}

/// A statement's `$n` parameters: datums for local execution, text for remote execution.
pub struct Params {
    pub types: Vec<pg_sys::Oid>,
    pub values: Vec<pg_sys::Datum>,
    pub nulls: Vec<bool>,
}

impl Params {
    pub fn none() -> Self {
        Params { types: vec![], values: vec![], nulls: vec![] }
    }

    /// Collects the executor's external parameters (fetching lazily supplied ones).
    ///
    /// # Safety
    /// `list` must be NULL or the estate's live ParamListInfo.
    pub unsafe fn from_list(list: pg_sys::ParamListInfo) -> Self {
        let mut p = Params::none();
        if list.is_null() {
            return p;
        }
        let n = (*list).numParams as usize;
        for i in 0..n {
            let mut workspace: pg_sys::ParamExternData = std::mem::zeroed();
            let prm: *mut pg_sys::ParamExternData = match (*list).paramFetch {
                Some(fetch) => fetch(list, (i + 1) as i32, false, &mut workspace),
                None => (*list).params.as_mut_ptr().add(i),
            };
            let ty = if prm.is_null() || (*prm).ptype == pg_sys::InvalidOid {
                pg_sys::TEXTOID
            } else {
                (*prm).ptype
            };
            p.types.push(ty);
            p.values.push(if prm.is_null() { pg_sys::Datum::from(0usize) } else { (*prm).value });
            p.nulls.push(prm.is_null() || (*prm).isnull);
        }
        p
    }

    unsafe fn as_text(&self) -> (Vec<Option<String>>, Vec<u32>) {
        let mut vals = Vec::with_capacity(self.values.len());
        let mut types = Vec::with_capacity(self.values.len());
        for i in 0..self.values.len() {
            vals.push(if self.nulls[i] { None } else { Some(datum_to_text(self.values[i], self.types[i])) });
            // User types have a different OID on every node: let the remote infer them.
            types.push(if self.types[i].to_u32() < pg_sys::FirstNormalObjectId { self.types[i].to_u32() } else { 0 });
        }
        (vals, types)
    }
}

/// Text form of a datum, through its type's output function.
///
/// # Safety
/// `value` must be a valid datum of type `ty`.
pub unsafe fn datum_to_text(value: pg_sys::Datum, ty: pg_sys::Oid) -> String {
    let mut out_fn = pg_sys::InvalidOid;
    let mut varlena = false;
    pg_sys::getTypeOutputInfo(ty, &mut out_fn, &mut varlena);
    let c = pg_sys::OidOutputFunctionCall(out_fn, value);
    CStr::from_ptr(c).to_string_lossy().into_owned()
}

/// Runs one marked statement for `placement` where the shard lives. `out_types` are the
/// statement's output column types (for converting remote text rows).
///
/// # Safety
/// `params` must hold valid datums; must run inside a transaction with an active snapshot.
pub unsafe fn run_on_shard(
    placement: &ShardPlacement,
    sql: &str,
    params: &Params,
    out_types: &[(pg_sys::Oid, i32)],
    writes: bool,
) -> Result<ShardResult, RemusError> {
    let sql = marked(placement.shard_id, sql);
    if crate::guc::node_name().as_deref() == Some(placement.node_name.as_str()) {
        return run_local(&sql, params, out_types.len(), !writes);
    }
    let addr = crate::nodes::lookup(&placement.node_name)?;
    let (vals, types) = params.as_text();
    let r = crate::twophase::exec_params_in_transaction(&addr, &sql, &vals, &types, writes)?;
    let mut rows = Vec::with_capacity(r.rows.len());
    for row in r.rows {
        let mut out = Vec::with_capacity(out_types.len());
        for (i, v) in row.into_iter().enumerate().take(out_types.len()) {
            out.push(match v {
                None => None,
                Some(text) => {
                    let (ty, typmod) = out_types[i];
                    let mut in_fn = pg_sys::InvalidOid;
                    let mut ioparam = pg_sys::InvalidOid;
                    pg_sys::getTypeInputInfo(ty, &mut in_fn, &mut ioparam);
                    let c = CString::new(text).map_err(|_| RemusError::InvalidArgument("NUL in remote value".into()))?;
                    Some(pg_sys::OidInputFunctionCall(in_fn, c.as_ptr() as *mut _, ioparam, typmod))
                }
            });
        }
        rows.push(out);
    }
    Ok(ShardResult { rows, affected: r.affected })
}

unsafe fn run_local(sql: &str, params: &Params, ncols: usize, read_only: bool) -> Result<ShardResult, RemusError> {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            LOCAL_SHARD_DEPTH.with(|d| d.set(d.get() - 1));
        }
    }
    let c = CString::new(sql).map_err(|_| RemusError::InvalidArgument("NUL in statement".into()))?;
    // Datums copied out of SPI memory must survive SPI_finish: copy them in the caller's context.
    let caller_cxt = pg_sys::CurrentMemoryContext;
    pg_sys::SPI_connect();
    LOCAL_SHARD_DEPTH.with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    let nulls: Vec<std::ffi::c_char> = params.nulls.iter().map(|n| if *n { b'n' as _ } else { b' ' as _ }).collect();
    let mut types = params.types.clone();
    let mut values = params.values.clone();
    let rc = pg_sys::SPI_execute_with_args(
        c.as_ptr(),
        types.len() as i32,
        types.as_mut_ptr(),
        values.as_mut_ptr(),
        if nulls.is_empty() { std::ptr::null() } else { nulls.as_ptr() },
        read_only,
        0,
    );
    if rc < 0 {
        pg_sys::SPI_finish();
        return Err(RemusError::InvalidArgument(format!("local shard statement failed (SPI code {rc})")));
    }
    let processed = pg_sys::SPI_processed;
    let mut rows = Vec::new();
    let tt = pg_sys::SPI_tuptable;
    if !tt.is_null() && ncols > 0 {
        let desc = (*tt).tupdesc;
        for i in 0..processed as usize {
            let tuple = *(*tt).vals.add(i);
            let mut row = Vec::with_capacity(ncols);
            for col in 0..ncols {
                let mut isnull = false;
                let d = pg_sys::SPI_getbinval(tuple, desc, (col + 1) as i32, &mut isnull);
                if isnull {
                    row.push(None);
                } else {
                    let attr = (*desc).attrs.as_ptr().add(col);
                    let old = pg_sys::MemoryContextSwitchTo(caller_cxt);
                    let copied = copy_datum(d, (*attr).attbyval, (*attr).attlen);
                    pg_sys::MemoryContextSwitchTo(old);
                    row.push(Some(copied));
                }
            }
            rows.push(row);
        }
    }
    pg_sys::SPI_finish();
    Ok(ShardResult { rows, affected: processed })
}

/// Next row of a tuplestore, in the scan slot. Expressions above a CustomScan are compiled for
/// the scan slot's own type, so rows are copied into it rather than returned in the
/// minimal-tuple slot the tuplestore needs.
///
/// # Safety
/// Slots and store must be live; `store_slot` must be a minimal-tuple slot of the same shape.
pub unsafe fn next_from_store(
    store: *mut pg_sys::Tuplestorestate,
    store_slot: *mut pg_sys::TupleTableSlot,
    scan_slot: *mut pg_sys::TupleTableSlot,
) -> *mut pg_sys::TupleTableSlot {
    if store.is_null() || !pg_sys::tuplestore_gettupleslot(store, true, false, store_slot) {
        pg_sys::ExecClearTuple(scan_slot);
        return scan_slot;
    }
    // ExecCopySlot is a static inline in tuptable.h: call the slot type's copyslot directly.
    let copy = (*(*scan_slot).tts_ops).copyslot.expect("every slot type can copy");
    copy(scan_slot, store_slot);
    scan_slot
}

/// A copy of a datum in the current memory context (PostgreSQL's datumCopy is not exported to
/// extensions through pgrx's bindings).
unsafe fn copy_datum(d: pg_sys::Datum, byval: bool, len: i16) -> pg_sys::Datum {
    if byval {
        return d;
    }
    let src = d.cast_mut_ptr::<u8>();
    match len {
        -1 => pg_sys::Datum::from(pg_sys::pg_detoast_datum_copy(src as *mut pg_sys::varlena)),
        -2 => pg_sys::Datum::from(pg_sys::pstrdup(src as *const std::ffi::c_char)),
        n => {
            let dst = pg_sys::palloc(n as usize) as *mut u8;
            std::ptr::copy_nonoverlapping(src, dst, n as usize);
            pg_sys::Datum::from(dst)
        }
    }
}

/// Deparses a Query to SQL text that any node reads the same way: schema-qualified names and
/// locale-independent literals.
///
/// # Safety
/// `query` must be a valid, rewritten Query.
pub unsafe fn deparse(query: *mut pg_sys::Query) -> String {
    let nest = pg_sys::NewGUCNestLevel();
    for (name, value) in [
        (c"search_path", c"pg_catalog"),
        (c"datestyle", c"ISO"),
        (c"intervalstyle", c"postgres"),
        (c"extra_float_digits", c"3"),
    ] {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
    }
    let text = pg_sys::pg_get_querydef(query, false);
    pg_sys::AtEOXact_GUC(true, nest);
    CStr::from_ptr(text).to_string_lossy().into_owned()
}

/// Evaluates a Var-free expression (Const, Param, casts of those) in the node's context.
///
/// # Safety
/// `expr` must be a valid expression; `ps` a live PlanState with an ExprContext.
pub unsafe fn eval_expr(expr: *mut pg_sys::Expr, ps: *mut pg_sys::PlanState) -> (pg_sys::Datum, bool, pg_sys::Oid) {
    let state = pg_sys::ExecInitExpr(expr, ps);
    let mut isnull = false;
    let econtext = (*ps).ps_ExprContext;
    let old = pg_sys::MemoryContextSwitchTo((*econtext).ecxt_per_query_memory);
    let d = pg_sys::ExecEvalExprSwitchContext(state, econtext, &mut isnull);
    pg_sys::MemoryContextSwitchTo(old);
    (d, isnull, pg_sys::exprType(expr as *const pg_sys::Node))
}

/// The placement that a key value (of any type convertible to the key type) maps to.
///
/// # Safety
/// `value` must be a valid datum of type `value_type`.
pub unsafe fn placement_for(
    table: &DistTable,
    placements: &[ShardPlacement],
    value: pg_sys::Datum,
    value_type: pg_sys::Oid,
) -> Result<ShardPlacement, RemusError> {
    let d = crate::distribute::coerce_via_text(value, value_type, table.key_type);
    let hash = crate::hashing::hash_datum(d, table.key_type, pg_sys::InvalidOid)?;
    let idx = crate::hashing::shard_index(hash, table.shard_count as u32) as i32;
    placements
        .iter()
        .find(|p| p.shard_index == idx)
        .cloned()
        .ok_or_else(|| RemusError::InvalidArgument(format!("no shard {idx} in the shard map of {}", table.qualified_name)))
}

/// A value usable for routing: constants, external parameters, and casts of those.
///
/// # Safety
/// `node` must be NULL or a valid expression node.
pub unsafe fn is_routable_value(node: *mut pg_sys::Node) -> bool {
    use pg_sys::NodeTag::*;
    if node.is_null() {
        return false;
    }
    match (*node).type_ {
        T_Const => true,
        T_Param => (*(node as *mut pg_sys::Param)).paramkind == pg_sys::ParamKind::PARAM_EXTERN,
        T_RelabelType => is_routable_value((*(node as *mut pg_sys::RelabelType)).arg as *mut _),
        T_CoerceViaIO => is_routable_value((*(node as *mut pg_sys::CoerceViaIO)).arg as *mut _),
        T_FuncExpr => {
            let f = node as *mut pg_sys::FuncExpr;
            let args = list_ptrs::<pg_sys::Node>((*f).args);
            matches!(
                (*f).funcformat,
                pg_sys::CoercionForm::COERCE_IMPLICIT_CAST | pg_sys::CoercionForm::COERCE_EXPLICIT_CAST
            ) && args.len() == 1
                && is_routable_value(args[0])
        }
        _ => false,
    }
}

unsafe fn strip_relabel(mut node: *mut pg_sys::Node) -> *mut pg_sys::Node {
    while is_tag(node, pg_sys::NodeTag::T_RelabelType) {
        node = (*(node as *mut pg_sys::RelabelType)).arg as *mut _;
    }
    node
}

/// If `clause` is `key = value` (either order) on range-table entry `varno`, the value side.
///
/// # Safety
/// `clause` must be a valid expression node.
pub unsafe fn key_equality_value(
    clause: *mut pg_sys::Node,
    varno: i32,
    key_attno: i16,
) -> Option<*mut pg_sys::Expr> {
    if !is_tag(clause, pg_sys::NodeTag::T_OpExpr) {
        return None;
    }
    let op = clause as *mut pg_sys::OpExpr;
    let args = list_ptrs::<pg_sys::Node>((*op).args);
    if args.len() != 2 || (*op).opno.to_u32() >= pg_sys::FirstNormalObjectId {
        return None;
    }
    let name = pg_sys::get_opname((*op).opno);
    if name.is_null() || CStr::from_ptr(name).to_bytes() != b"=" {
        return None;
    }
    for (a, b) in [(args[0], args[1]), (args[1], args[0])] {
        let v = strip_relabel(a);
        if is_tag(v, pg_sys::NodeTag::T_Var) {
            let var = v as *mut pg_sys::Var;
            if (*var).varno == varno && (*var).varattno == key_attno && (*var).varlevelsup == 0 && is_routable_value(b) {
                return Some(b as *mut pg_sys::Expr);
            }
        }
    }
    None
}

/// The key's attribute number in the shell.
pub fn key_attno(table: &DistTable) -> Result<i16, RemusError> {
    let key = table.shard_key.clone().unwrap_or_default();
    let c = CString::new(key.clone()).map_err(|_| RemusError::InvalidArgument("bad key".into()))?;
    // SAFETY: catalog lookup of an attribute by name in an existing relation.
    let n = unsafe { pg_sys::get_attnum(table.relid, c.as_ptr()) };
    if n <= 0 {
        return Err(RemusError::UndefinedColumn(format!("shard key \"{key}\" of {} is gone", table.qualified_name)));
    }
    Ok(n)
}
