//! Running one marked statement where its shard lives (here, through SPI, or on another node
//! inside the current distributed transaction), and handing its rows to a CustomScan.

use std::ffi::CString;

use pgrx::pg_sys;

use crate::catalog::ShardPlacement;
use crate::cluster::shard_marker::marked;
use crate::error::RemusError;
use crate::pg::datum::{copy_datum, datum_to_text};
use crate::pg::list::{is_tag, list_ptrs};
use crate::router::marker::LocalShard;

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
        Params {
            types: vec![],
            values: vec![],
            nulls: vec![],
        }
    }

    /// Collects the executor's external parameters (fetching lazily supplied ones).
    ///
    /// # Safety
    /// `list` must be NULL or the estate's live ParamListInfo.
    pub unsafe fn from_list(list: pg_sys::ParamListInfo) -> Self {
        // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
        // and FFI operations below rely.
        unsafe {
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
                p.values.push(if prm.is_null() {
                    pg_sys::Datum::from(0usize)
                } else {
                    (*prm).value
                });
                p.nulls.push(prm.is_null() || (*prm).isnull);
            }
            p
        }
    }

    /// The values as text and their type OIDs, as a remote node takes them. Values of a type
    /// whose text form follows the session's settings (dates, times, intervals, floats, and
    /// any type not known here) are written under the settings the remote reads them with.
    ///
    /// # Safety
    /// The datums must be valid values of their types.
    pub(crate) unsafe fn as_text(&self) -> (Vec<Option<String>>, Vec<u32>) {
        // SAFETY: the datums are valid values of their types (this function's contract).
        let write = || unsafe {
            let mut vals = Vec::with_capacity(self.values.len());
            let mut types = Vec::with_capacity(self.values.len());
            for i in 0..self.values.len() {
                vals.push(if self.nulls[i] {
                    None
                } else {
                    Some(datum_to_text(self.values[i], self.types[i]))
                });
                // User types have a different OID on every node: let the remote infer them.
                types.push(if self.types[i].to_u32() < pg_sys::FirstNormalObjectId {
                    self.types[i].to_u32()
                } else {
                    0
                });
            }
            (vals, types)
        };
        if self
            .types
            .iter()
            .zip(&self.nulls)
            .any(|(t, null)| !null && !text_is_portable(*t))
        {
            crate::pg::datum::with_portable_settings(write)
        } else {
            write()
        }
    }
}

/// Is the text form of a `ty` value the same under any DateStyle, IntervalStyle and
/// extra_float_digits?
fn text_is_portable(ty: pg_sys::Oid) -> bool {
    matches!(
        ty,
        pg_sys::INT2OID
            | pg_sys::INT4OID
            | pg_sys::INT8OID
            | pg_sys::NUMERICOID
            | pg_sys::TEXTOID
            | pg_sys::VARCHAROID
            | pg_sys::BPCHAROID
            | pg_sys::BOOLOID
            | pg_sys::UUIDOID
            | pg_sys::OIDOID
            | pg_sys::BYTEAOID
            | pg_sys::JSONOID
            | pg_sys::JSONBOID
    )
}

/// How a statement joins the current transaction on another node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// In the distributed transaction (a remote transaction block; a writer joins 2PC).
    Transaction,
    /// As the whole transaction: a remote autocommit statement ([`whole_transaction`]); a
    /// write's outcome is then the participant's answer (`twophase::exec_write_alone`).
    Alone,
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
    join: Join,
) -> Result<ShardResult, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let sql = marked(placement.shard_id, sql);
        if crate::guc::is_this_node(&placement.node_name) {
            return run_local(&sql, params, out_types.len(), !writes);
        }
        let addr = crate::cluster::nodes::lookup(&placement.node_name)?;
        let (vals, types) = params.as_text();
        let r = if join == Join::Alone && !writes {
            crate::twophase::exec_params_alone(&addr, &sql, &vals, &types)?
        } else if join == Join::Alone {
            crate::twophase::exec_write_alone(&addr, &sql, &vals, &types)?
        } else {
            crate::twophase::exec_params_in_transaction(&addr, &sql, &vals, &types, writes)?
        };
        Ok(ShardResult {
            rows: datums_of(r.rows, out_types)?,
            affected: r.affected,
        })
    }
}

/// Runs the read-only `sql` on every shard of `placements` (marked for each), in the local
/// transaction, the shards of other nodes concurrently (one statement per shard, each node's
/// one after another) while this node's own run here, and hands each shard's rows, as datums
/// of `out_types`, to `rows` (this node's first).
///
/// # Safety
/// Inside a transaction with an active snapshot.
pub unsafe fn read_every_shard(
    placements: &[ShardPlacement],
    sql: &str,
    out_types: &[(pg_sys::Oid, i32)],
    mut rows: impl FnMut(Vec<Vec<Option<pg_sys::Datum>>>) -> Result<(), RemusError>,
) -> Result<(), RemusError> {
    let mut local = Vec::new();
    let mut remote: Vec<(crate::cluster::remote::NodeAddr, Vec<String>)> = Vec::new();
    for p in placements {
        if crate::guc::is_this_node(&p.node_name) {
            local.push(p);
            continue;
        }
        let statement = marked(p.shard_id, sql);
        match remote.iter_mut().find(|(a, _)| a.name == p.node_name) {
            Some((_, statements)) => statements.push(statement),
            None => remote.push((
                crate::cluster::nodes::lookup(&p.node_name)?,
                vec![statement],
            )),
        }
    }
    let (remote_results, ()) = crate::twophase::read_on_nodes(&remote, || {
        for p in &local {
            // SAFETY: the caller upholds this function's `# Safety` contract.
            let r = unsafe {
                run_on_shard(p, sql, &Params::none(), out_types, false, Join::Transaction)?
            };
            rows(r.rows)?;
        }
        Ok(())
    })?;
    for r in remote_results.into_iter().flatten() {
        rows(datums_of(r.rows, out_types)?)?;
    }
    Ok(())
}

/// A remote result's rows (text) as datums of `out_types`, in the current memory context.
pub fn datums_of(
    text_rows: Vec<Vec<Option<String>>>,
    out_types: &[(pg_sys::Oid, i32)],
) -> Result<Vec<Vec<Option<pg_sys::Datum>>>, RemusError> {
    let mut rows = Vec::with_capacity(text_rows.len());
    for row in text_rows {
        let mut out = Vec::with_capacity(out_types.len());
        for (i, v) in row.into_iter().enumerate().take(out_types.len()) {
            out.push(match v {
                None => None,
                Some(text) => {
                    let (ty, typmod) = out_types[i];
                    let c = CString::new(text).map_err(|_| RemusError::NulIn {
                        what: "remote value",
                    })?;
                    // SAFETY: a catalog lookup and the type's input function on a
                    // NUL-terminated string; errors are raised as PostgreSQL ERRORs.
                    unsafe {
                        let mut in_fn = pg_sys::InvalidOid;
                        let mut ioparam = pg_sys::InvalidOid;
                        pg_sys::getTypeInputInfo(ty, &mut in_fn, &mut ioparam);
                        Some(pg_sys::OidInputFunctionCall(
                            in_fn,
                            c.as_ptr() as *mut _,
                            ioparam,
                            typmod,
                        ))
                    }
                }
            });
        }
        rows.push(out);
    }
    Ok(rows)
}

/// Is the statement of `estate`, `query`, its transaction's only work, so that a remote owner
/// may run it as a transaction of its own? Only for a top-level statement (the active
/// portal's own query) outside a transaction block, under READ COMMITTED (whose statements
/// each take their own snapshot anyway), with no remote transaction open yet, and with no
/// volatile function (which could write there, or elsewhere through that node). For a
/// write, the caller also checks that it goes to one node and writes nothing here.
///
/// # Safety
/// `estate` must be the executing statement's EState; `query` its Query.
pub unsafe fn whole_transaction(estate: *mut pg_sys::EState, query: *mut pg_sys::Query) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract; the portal and its
    // QueryDesc are live while they are active.
    unsafe {
        let portal = pg_sys::ActivePortal;
        // The portal's one statement is this very plan: not a statement of a function or a
        // rule's companion (a SELECT's portal keeps its QueryDesc; a write's runs through
        // ProcessQuery, whose QueryDesc the portal does not keep, on the same plan).
        pg_sys::XactIsoLevel as u32 <= pg_sys::XACT_READ_COMMITTED
            && !pg_sys::IsTransactionBlock()
            && !portal.is_null()
            && pg_sys::list_length((*portal).stmts) == 1
            && list_ptrs::<pg_sys::PlannedStmt>((*portal).stmts)[0] == (*estate).es_plannedstmt
            && !crate::cluster::remote::any_in_transaction()
            && !pg_sys::contain_volatile_functions(query as *mut pg_sys::Node)
    }
}

unsafe fn run_local(
    sql: &str,
    params: &Params,
    ncols: usize,
    read_only: bool,
) -> Result<ShardResult, RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let c = CString::new(sql).map_err(|_| RemusError::NulIn { what: "statement" })?;
        // Datums copied out of SPI memory must survive SPI_finish: copy them in the caller's context.
        let caller_cxt = pg_sys::CurrentMemoryContext;
        pg_sys::SPI_connect();
        let _depth = LocalShard::enter(c.as_ptr());
        let nulls: Vec<std::ffi::c_char> = params
            .nulls
            .iter()
            .map(|n| if *n { b'n' as _ } else { b' ' as _ })
            .collect();
        let mut types = params.types.clone();
        let mut values = params.values.clone();
        let rc = pg_sys::SPI_execute_with_args(
            c.as_ptr(),
            types.len() as i32,
            types.as_mut_ptr(),
            values.as_mut_ptr(),
            if nulls.is_empty() {
                std::ptr::null()
            } else {
                nulls.as_ptr()
            },
            read_only,
            0,
        );
        if rc < 0 {
            pg_sys::SPI_finish();
            return Err(RemusError::LocalShardStatementFailed { spi_code: rc });
        }
        let processed = pg_sys::SPI_processed;
        let mut rows = Vec::new();
        let tt = pg_sys::SPI_tuptable;
        // A statement with no output column (`SELECT NULL`-like scans of no column) still
        // returns its rows, as the remote path does.
        if !tt.is_null() {
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
        Ok(ShardResult {
            rows,
            affected: processed,
        })
    }
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
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if store.is_null() || !pg_sys::tuplestore_gettupleslot(store, true, false, store_slot) {
            pg_sys::ExecClearTuple(scan_slot);
            return scan_slot;
        }
        // ExecCopySlot is a static inline in tuptable.h: call the slot type's copyslot directly.
        let copy = (*(*scan_slot).tts_ops)
            .copyslot
            .expect("every slot type can copy");
        copy(scan_slot, store_slot);
        scan_slot
    }
}

/// The value of external parameter `param` (`$n` of the statement) in `params`, as the executor
/// reads it (through the list's fetch hook if it has one, PL/pgSQL's; `speculative` as that hook
/// takes it), if it is there with the parameter's own type.
///
/// # Safety
/// `params` must be NULL or a live parameter list; `param` a valid Param node.
pub(crate) unsafe fn extern_param(
    params: pg_sys::ParamListInfo,
    param: *mut pg_sys::Param,
    speculative: bool,
) -> Option<pg_sys::ParamExternData> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the fetched entry is
    // copied out before the workspace it may live in goes.
    unsafe {
        let id = (*param).paramid;
        if (*param).paramkind != pg_sys::ParamKind::PARAM_EXTERN
            || params.is_null()
            || id < 1
            || id > (*params).numParams
        {
            return None;
        }
        let mut workspace: pg_sys::ParamExternData = std::mem::zeroed();
        let prm = match (*params).paramFetch {
            Some(fetch) => fetch(params, id, speculative, &mut workspace),
            None => (*params).params.as_mut_ptr().add(id as usize - 1),
        };
        if prm.is_null() || (*prm).ptype != (*param).paramtype {
            return None;
        }
        Some(*prm)
    }
}

/// The value of `expr` when it is a constant or an external parameter set in `params`: its
/// datum, whether it is NULL, and its type. None: it must be evaluated.
///
/// # Safety
/// `expr` must be a valid expression; `params` NULL or the statement's parameters.
pub(crate) unsafe fn constant_or_param(
    expr: *mut pg_sys::Expr,
    params: pg_sys::ParamListInfo,
) -> Option<(pg_sys::Datum, bool, pg_sys::Oid)> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let node = expr as *mut pg_sys::Node;
        if is_tag(node, pg_sys::NodeTag::T_Const) {
            let c = node as *mut pg_sys::Const;
            return Some(((*c).constvalue, (*c).constisnull, (*c).consttype));
        }
        if is_tag(node, pg_sys::NodeTag::T_Param) {
            let p = node as *mut pg_sys::Param;
            let prm = extern_param(params, p, false)?;
            return Some((prm.value, prm.isnull, (*p).paramtype));
        }
        None
    }
}

/// Evaluates a Var-free expression (Const, Param, casts of those) in the node's context.
///
/// # Safety
/// `expr` must be a valid expression; `ps` a live PlanState with an ExprContext.
pub unsafe fn eval_expr(
    expr: *mut pg_sys::Expr,
    ps: *mut pg_sys::PlanState,
) -> (pg_sys::Datum, bool, pg_sys::Oid) {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        // A constant, or a parameter of the statement (as a prepared statement's key is): no
        // expression state to build for every execution.
        if let Some(known) = constant_or_param(expr, (*(*ps).state).es_param_list_info) {
            return known;
        }
        let state = pg_sys::ExecInitExpr(expr, ps);
        let mut isnull = false;
        let econtext = (*ps).ps_ExprContext;
        let old = pg_sys::MemoryContextSwitchTo((*econtext).ecxt_per_query_memory);
        let d = pg_sys::ExecEvalExprSwitchContext(state, econtext, &mut isnull);
        pg_sys::MemoryContextSwitchTo(old);
        (d, isnull, pg_sys::exprType(expr as *const pg_sys::Node))
    }
}
