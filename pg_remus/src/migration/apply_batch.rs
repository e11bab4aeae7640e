//! Catch-up's apply on the target, inside the server: `remus.apply_batch` commits a batch of
//! shadow transactions, each its own transaction with the source's commit time and origin
//! position, and runs every change through a plan kept for its shape (decision 0035, third
//! amendment). The replay worker's apply sessions call it when the node has it; on a node
//! without it (a catalog of an earlier release) they create their own PL/pgSQL procedure.
//!
//! - `remus.apply_shape(name, statement)`: keeps a plan of `statement` for this session, with
//!   the parameter types `PREPARE` inferred for the session's SQL-level prepared statement
//!   `name` of the same text (so both paths read a value the same way), and each type's input
//!   function.
//! - `CALL remus.apply_batch(lsns, times_us, change_txn, change_stmt, change_guarded, param_at,
//!   params)`: for each transaction of the batch, its origin position and the source's commit
//!   time (what `pg_replication_origin_xact_setup` sets), its changes in order, each value read
//!   by its parameter type's input function (as PostgreSQL reads a parameter sent in text
//!   format), every guarded change checked to have touched exactly one row, then COMMIT; the
//!   commit position of the last transaction committed is what `remus.apply_batch_done()`
//!   answers afterwards, also when a later transaction of the call failed.
//!
//! What the PL/pgSQL procedure pays per transaction and this does not: the re-initialisation of
//! its expressions in every new transaction, a `setval` (a WAL record) for the progress, and the
//! casts and array subscripts of each value.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::FromDatum;

use crate::error::RemusError;
use crate::pg::list::is_tag;

/// One shape's kept plan and how its parameters are read.
struct Shape {
    plan: pg_sys::SPIPlanPtr,
    /// Per parameter: its type's input function and the I/O parameter to pass it.
    inputs: Vec<(pg_sys::FmgrInfo, pg_sys::Oid)>,
}

/// Shapes a session keeps; past that, those whose prepared statement is gone are forgotten.
/// The replay worker keeps at most 512 prepared statements per session.
const MAX_SHAPES: usize = 1024;

thread_local! {
    /// This backend's kept shapes, by the name of their SQL-level prepared statement. Boxed:
    /// the input functions' `FmgrInfo` must not move (a function may cache in `fn_extra`).
    static SHAPES: RefCell<HashMap<String, Box<Shape>>> = RefCell::new(HashMap::new());
    /// The commit position of the last transaction `remus.apply_batch` committed.
    static LAST_COMMITTED: Cell<i64> = const { Cell::new(0) };
}

#[pg_schema]
mod remus {
    use super::*;

    /// Keeps this session's plan of `statement` under the name of the SQL-level prepared
    /// statement `name` of the same text, for `remus.apply_batch`. Superuser only.
    #[pg_extern(volatile, parallel_unsafe)]
    fn apply_shape(name: &str, statement: &str) {
        crate::migration::state::require_superuser("remus.apply_shape");
        if let Err(e) = keep_shape(name, statement) {
            e.raise();
        }
    }

    /// The commit position (bytes past 0/0) of the last transaction `remus.apply_batch`
    /// committed in this session; 0 before any.
    #[pg_extern(volatile, parallel_unsafe)]
    fn apply_batch_done() -> i64 {
        LAST_COMMITTED.with(Cell::get)
    }
}

fn keep_shape(name: &str, statement: &str) -> Result<(), RemusError> {
    let cname = CString::new(name).map_err(|_| RemusError::ApplyShapeUnknown {
        name: name.to_string(),
    })?;
    let csql = CString::new(statement).map_err(|_| RemusError::ApplyBatchInvalid {
        detail: "a statement holds a NUL byte".into(),
    })?;
    // SAFETY: looks a prepared statement up by a NUL-terminated name; NULL when there is none.
    let prepared = unsafe { pg_sys::FetchPreparedStatement(cname.as_ptr(), false) };
    if prepared.is_null() {
        return Err(RemusError::ApplyShapeUnknown {
            name: name.to_string(),
        });
    }
    // SAFETY: a prepared statement always has its plan source; its parameter types are an
    // array of `num_params` OIDs in the plan cache's memory, read before anything can free it.
    let mut types: Vec<pg_sys::Oid> = unsafe {
        let source = (*prepared).plansource;
        let n = (*source).num_params as usize;
        if n == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts((*source).param_types, n).to_vec()
        }
    };
    forget_gone_shapes();
    let mut inputs = Vec::with_capacity(types.len());
    for ty in &types {
        let mut func: pg_sys::Oid = pg_sys::InvalidOid;
        let mut ioparam: pg_sys::Oid = pg_sys::InvalidOid;
        // SAFETY: catalog lookups inside the caller's transaction; `finfo` is filled in and
        // its memory is TopMemoryContext's, which outlives the session's shapes.
        let finfo = unsafe {
            pg_sys::getTypeInputInfo(*ty, &mut func, &mut ioparam);
            let mut finfo: pg_sys::FmgrInfo = std::mem::zeroed();
            pg_sys::fmgr_info_cxt(func, &mut finfo, pg_sys::TopMemoryContext);
            finfo
        };
        inputs.push((finfo, ioparam));
    }
    // SAFETY: SPI connected and finished around the prepare; the kept plan lives in its own
    // context under CacheMemoryContext until `SPI_freeplan`.
    let plan = unsafe {
        pg_sys::SPI_connect();
        let plan = pg_sys::SPI_prepare(csql.as_ptr(), types.len() as i32, types.as_mut_ptr());
        if plan.is_null() {
            let code = pg_sys::SPI_result;
            pg_sys::SPI_finish();
            return Err(RemusError::ApplyBatchInvalid {
                detail: format!("statement of {name} not prepared (SPI code {code})"),
            });
        }
        pg_sys::SPI_keepplan(plan);
        pg_sys::SPI_finish();
        plan
    };
    let old = SHAPES.with(|s| {
        s.borrow_mut()
            .insert(name.to_string(), Box::new(Shape { plan, inputs }))
    });
    if let Some(old) = old {
        // SAFETY: a kept plan of this module, no longer reachable.
        unsafe { pg_sys::SPI_freeplan(old.plan) };
    }
    Ok(())
}

/// Past [`MAX_SHAPES`], frees the plans of shapes whose prepared statement the session has
/// deallocated (the replay worker never reuses a name).
fn forget_gone_shapes() {
    SHAPES.with(|s| {
        let mut shapes = s.borrow_mut();
        if shapes.len() < MAX_SHAPES {
            return;
        }
        shapes.retain(|name, shape| {
            let Ok(cname) = CString::new(name.as_str()) else {
                return false;
            };
            // SAFETY: as in `keep_shape`.
            let alive = !unsafe { pg_sys::FetchPreparedStatement(cname.as_ptr(), false) }.is_null();
            if !alive {
                // SAFETY: a kept plan of this module, removed from the map here.
                unsafe { pg_sys::SPI_freeplan(shape.plan) };
            }
            alive
        });
    });
}

/// The batch, read from the procedure's arguments (see the module doc).
struct Batch {
    lsns: Vec<i64>,
    times_us: Vec<i64>,
    change_txn: Vec<i32>,
    change_stmt: Vec<String>,
    change_guarded: Vec<bool>,
    param_at: Vec<i32>,
    params: Vec<Option<CString>>,
}

/// `CALL remus.apply_batch(...)`: see the module doc.
#[pg_guard]
#[no_mangle]
pub unsafe extern "C-unwind" fn remus_apply_batch(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    // SAFETY: called by the function manager with a valid fcinfo for the procedure's seven
    // arguments.
    unsafe {
        if let Err(e) = apply_batch(fcinfo) {
            e.raise();
        }
    }
    pg_sys::Datum::from(0usize)
}

/// Version-1 calling convention marker for [`remus_apply_batch`].
#[no_mangle]
pub extern "C" fn pg_finfo_remus_apply_batch() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

unsafe fn array_arg<T>(
    fcinfo: pg_sys::FunctionCallInfo,
    i: usize,
    what: &str,
) -> Result<Vec<Option<T>>, RemusError>
where
    for<'arr> T: pgrx::datum::UnboxDatum<As<'arr> = T> + 'arr,
{
    // SAFETY: the caller's fcinfo has seven arguments; a non-null one is an array of the
    // declared element type, read (and copied) by pgrx.
    let arg = unsafe { (*fcinfo).args.as_slice(7)[i] };
    let values = if arg.isnull {
        None
    } else {
        // SAFETY: as above: a non-null array datum of the declared element type.
        unsafe { Vec::<Option<T>>::from_datum(arg.value, false) }
    };
    values.ok_or_else(|| RemusError::ApplyBatchInvalid {
        detail: format!("{what} is NULL"),
    })
}

fn no_nulls<T>(v: Vec<Option<T>>, what: &str) -> Result<Vec<T>, RemusError> {
    v.into_iter()
        .collect::<Option<Vec<T>>>()
        .ok_or_else(|| RemusError::ApplyBatchInvalid {
            detail: format!("{what} holds a NULL"),
        })
}

unsafe fn read_batch(fcinfo: pg_sys::FunctionCallInfo) -> Result<Batch, RemusError> {
    // SAFETY: see `array_arg`.
    unsafe {
        let batch = Batch {
            lsns: no_nulls(array_arg(fcinfo, 0, "lsns")?, "lsns")?,
            times_us: no_nulls(array_arg(fcinfo, 1, "times_us")?, "times_us")?,
            change_txn: no_nulls(array_arg(fcinfo, 2, "change_txn")?, "change_txn")?,
            change_stmt: no_nulls(array_arg(fcinfo, 3, "change_stmt")?, "change_stmt")?,
            change_guarded: no_nulls(array_arg(fcinfo, 4, "change_guarded")?, "change_guarded")?,
            param_at: no_nulls(array_arg(fcinfo, 5, "param_at")?, "param_at")?,
            params: array_arg::<String>(fcinfo, 6, "params")?
                .into_iter()
                .map(|p| p.map(|s| CString::new(s).unwrap_or_default()))
                .collect(),
        };
        let changes = batch.change_txn.len();
        if batch.times_us.len() != batch.lsns.len()
            || batch.change_stmt.len() != changes
            || batch.change_guarded.len() != changes
            || batch.param_at.len() != changes
        {
            return Err(RemusError::ApplyBatchInvalid {
                detail: "arrays of different lengths".into(),
            });
        }
        Ok(batch)
    }
}

unsafe fn apply_batch(fcinfo: pg_sys::FunctionCallInfo) -> Result<(), RemusError> {
    // SAFETY: `context` is the CallContext node of a CALL (or NULL, or another node, for a
    // plain function call, which the procedure's catalog entry does not allow).
    let nonatomic = unsafe {
        let context = (*fcinfo).context;
        !context.is_null()
            && is_tag(context, pg_sys::NodeTag::T_CallContext)
            && !(*(context as *mut pg_sys::CallContext)).atomic
    };
    if !nonatomic {
        return Err(RemusError::ApplyBatchNotInCall);
    }
    crate::migration::state::require_superuser("remus.apply_batch");
    // SAFETY: a backend-global of origin.c, read.
    if unsafe { pg_sys::replorigin_session_origin } == pg_sys::InvalidRepOriginId as u16 {
        return Err(RemusError::ApplyBatchNoOrigin);
    }
    // SAFETY: see `read_batch`.
    let batch = unsafe { read_batch(fcinfo)? };

    // SAFETY: a non-atomic SPI connection of a procedure, finished below on success; an
    // ERROR unwinds it with the transaction. Its memory (`procCxt`, under the portal's) and
    // the kept plans survive each commit.
    unsafe { pg_sys::SPI_connect_ext(pg_sys::SPI_OPT_NONATOMIC as i32) };
    // A context for each change's values, reset after each one.
    // SAFETY: created under the SPI procedure context, which lives until SPI_finish.
    let values_cxt = unsafe {
        pg_sys::AllocSetContextCreateExtended(
            pg_sys::CurrentMemoryContext,
            c"remus apply_batch values".as_ptr(),
            pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
            pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
        )
    };
    let mut c = 0usize;
    let changes = batch.change_txn.len();
    for (t, (&lsn, &time_us)) in batch.lsns.iter().zip(&batch.times_us).enumerate() {
        // SAFETY: backend-globals of origin.c that the next commit reads, as
        // pg_replication_origin_xact_setup sets them.
        unsafe {
            pg_sys::replorigin_session_origin_lsn = lsn as u64;
            pg_sys::replorigin_session_origin_timestamp = time_us;
        }
        while c < changes && batch.change_txn[c] == t as i32 + 1 {
            // SAFETY: inside the SPI connection above, with the context made for values.
            let rows = unsafe { run_change(&batch, c, values_cxt)? };
            if batch.change_guarded[c] && rows != 1 {
                return Err(RemusError::ShadowChangeRowCount {
                    change: c + 1,
                    txn: t + 1,
                    rows,
                });
            }
            c += 1;
        }
        // SAFETY: commits the transaction and starts the next (PostgreSQL 15's SPI_commit).
        unsafe { pg_sys::SPI_commit() };
        LAST_COMMITTED.with(|l| l.set(lsn));
    }
    if c != changes {
        return Err(RemusError::ApplyBatchInvalid {
            detail: format!(
                "change {} names no transaction of the batch in order",
                c + 1
            ),
        });
    }
    // SAFETY: the context made above; then the SPI connection of this call.
    unsafe {
        pg_sys::MemoryContextDelete(values_cxt);
        pg_sys::SPI_finish();
    }
    Ok(())
}

/// Runs change `c` of `batch` with its shape's kept plan; returns the rows it touched (for a
/// `RETURNING` or a `SELECT … FOR UPDATE`, the rows it returned).
unsafe fn run_change(
    batch: &Batch,
    c: usize,
    values_cxt: pg_sys::MemoryContext,
) -> Result<u64, RemusError> {
    let name = &batch.change_stmt[c];
    // A raw pointer: the map is not borrowed while PostgreSQL runs (an ERROR unwinds through
    // here), and a shape's box stays where it is until `keep_shape` replaces it, which cannot
    // happen during this call.
    let shape: *mut Shape = SHAPES
        .with(|s| s.borrow_mut().get_mut(name).map(|b| &mut **b as *mut Shape))
        .ok_or_else(|| RemusError::ApplyShapeUnknown { name: name.clone() })?;
    // SAFETY: `shape` points into a live box (above); the values are built in `values_cxt`,
    // reset below, and only read by the executor during SPI_execute_plan.
    unsafe {
        let nargs = (*shape).inputs.len();
        let at = usize::try_from(batch.param_at[c]).unwrap_or(usize::MAX);
        let Some(params) = at
            .checked_add(nargs)
            .and_then(|end| batch.params.get(at..end))
        else {
            return Err(RemusError::ApplyBatchInvalid {
                detail: format!(
                    "change {} has fewer values than its statement's {nargs}",
                    c + 1
                ),
            });
        };
        let old = pg_sys::MemoryContextSwitchTo(values_cxt);
        let mut values = Vec::with_capacity(nargs);
        let mut nulls = Vec::with_capacity(nargs);
        for (p, (finfo, ioparam)) in params.iter().zip((*shape).inputs.iter_mut()) {
            let text: *mut c_char = p
                .as_ref()
                .map_or(std::ptr::null_mut(), |s| s.as_ptr().cast_mut());
            // An input function is called for NULL too (domains check their constraints).
            values.push(pg_sys::InputFunctionCall(finfo, text, *ioparam, -1));
            nulls.push(if p.is_some() {
                b' ' as c_char
            } else {
                b'n' as c_char
            });
        }
        pg_sys::MemoryContextSwitchTo(old);
        let rc =
            pg_sys::SPI_execute_plan((*shape).plan, values.as_mut_ptr(), nulls.as_ptr(), false, 0);
        let rows = pg_sys::SPI_processed;
        pg_sys::SPI_freetuptable(pg_sys::SPI_tuptable);
        pg_sys::MemoryContextReset(values_cxt);
        if rc < 0 {
            return Err(RemusError::ApplyBatchInvalid {
                detail: format!("change {} failed with SPI code {rc}", c + 1),
            });
        }
        Ok(rows)
    }
}

pgrx::extension_sql!(
    r#"
CREATE PROCEDURE remus.apply_batch(
    lsns bigint[], times_us bigint[], change_txn integer[], change_stmt text[],
    change_guarded boolean[], param_at integer[], params text[])
    LANGUAGE c AS 'MODULE_PATHNAME', 'remus_apply_batch';
COMMENT ON PROCEDURE remus.apply_batch(bigint[], bigint[], integer[], text[], boolean[], integer[], text[]) IS
    'Catch-up: commits a batch of shadow transactions, each with its source commit time and origin position (used by the replay worker; see migration/apply_batch.rs)';
"#,
    name = "apply_batch_procedure",
    requires = ["distribution_catalog"]
);
