//! Catch-up phase, node side (Remus mode): write-set capture on the source.
//!
//! Every shard table carries an AFTER ROW trigger, `remus_capture` (its function is
//! `remus.capture_write`), created with the table
//! (`catalog::shard_ddl::capture_trigger_ddl`; creating it at migration time would queue every
//! writer behind the longest running one). It returns at once unless the shard's migration
//! captures writes (`remus.migration_capture`); then it records the row change, in the replay
//! worker's wire format, in this backend's write set. A rolled-back subtransaction drops its
//! changes. The write set is validated at commit by dual execution (`migration::dual`).
//!
//! Capture starts with the copy although only a commit in sync mode (dual execution) uses the
//! write set: a transaction that writes before the sync barrier and commits after it is
//! validated with everything it wrote, and the barrier waits only for the transactions that
//! were writing before capture started (the coordinator's "pre-capture writers"). Its memory is
//! bounded by `remus.max_write_set_bytes` (review F10): past it, a transaction in dual execution
//! fails the statement with 54000; one whose migration is still before the barrier stops
//! capturing for that migration and drops what it captured (it will most likely commit before
//! the barrier, unvalidated, as usual; if it commits after, its COMMIT fails with 54000 because
//! its write set is incomplete). Nothing is spilled to disk: a write set that large would also
//! hold its rows locked on the destination for as long as it takes to validate.

use std::cell::RefCell;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::rc::Rc;

use pgrx::pg_sys;
use pgrx::prelude::*;
use remus_proto::v1::{column_value, row_change, ColumnValue, RowChange};

use crate::error::RemusError;
use crate::migration::state::{
    active, count_migration_abort, migration_of, require_superuser, ENDPOINT_BYTES, STATE,
};

/// Columns of a shard table as the write set ships them.
struct RelMeta {
    schema: String,
    table: String,
    columns: Vec<String>,
    key: Vec<bool>,
    /// Per column: attribute number and output function.
    attrs: Vec<(usize, pg_sys::Oid)>,
}

struct Captured {
    migration_id: i64,
    subxact: pg_sys::SubTransactionId,
    /// What `change` takes in this backend's heap (see [`heap_bytes`]).
    bytes: usize,
    change: RowChange,
}

/// This transaction's write sets.
#[derive(Default)]
struct WriteSet {
    changes: Vec<Captured>,
    /// Per migration: heap bytes of its captured changes.
    bytes: Vec<(i64, usize)>,
    /// Migrations whose write set outgrew `remus.max_write_set_bytes` before dual execution:
    /// dropped and no longer captured in this transaction (incomplete; unusable in sync mode).
    overflowed: Vec<i64>,
}

impl WriteSet {
    fn bytes_of(&mut self, migration_id: i64) -> &mut usize {
        let i = match self.bytes.iter().position(|(m, _)| *m == migration_id) {
            Some(i) => i,
            None => {
                self.bytes.push((migration_id, 0));
                self.bytes.len() - 1
            }
        };
        &mut self.bytes[i].1
    }

    fn recount(&mut self) {
        self.bytes.clear();
        for i in 0..self.changes.len() {
            let (m, b) = (self.changes[i].migration_id, self.changes[i].bytes);
            *self.bytes_of(m) += b;
        }
    }
}

thread_local! {
    static REL_META: RefCell<HashMap<pg_sys::Oid, Rc<RelMeta>>> = RefCell::new(HashMap::new());
    static WRITE_SET: RefCell<WriteSet> = RefCell::new(WriteSet::default());
}

/// What a captured change takes in the heap: its strings and vectors as allocated, each with
/// the allocator's overhead, plus the entry itself. (Counted rather than the encoded size: the
/// column names are repeated per row and every value is its own allocation, so the heap is
/// several times the wire size. Measured: 1.5M changes of a 3-column, ~100-byte row took
/// 1.5 GB of backend RSS, about what this counts.)
fn heap_bytes(c: &RowChange) -> usize {
    use std::mem::size_of;
    // malloc's per-allocation header and rounding, roughly.
    const ALLOCATION: usize = 16;
    let string = |s: &String| s.capacity() + ALLOCATION;
    let values = |v: &Vec<ColumnValue>| {
        v.capacity() * size_of::<ColumnValue>()
            + ALLOCATION
            + v.iter()
                .map(|x| match &x.value {
                    Some(column_value::Value::Text(t)) => string(t),
                    _ => 0,
                })
                .sum::<usize>()
    };
    size_of::<Captured>()
        + string(&c.schema)
        + string(&c.table)
        + c.columns.capacity() * size_of::<String>()
        + ALLOCATION
        + c.columns.iter().map(string).sum::<usize>()
        + c.key.capacity()
        + ALLOCATION
        + values(&c.old_values)
        + values(&c.new_values)
}

/// `remus.max_write_set_bytes` in bytes.
fn max_write_set_bytes() -> usize {
    (crate::guc::MAX_WRITE_SET_KB.get().max(1) as usize).saturating_mul(1024)
}

/// Is `migration_id` in sync mode (dual execution) on this node?
fn in_sync_mode(migration_id: i64) -> bool {
    STATE
        .share()
        .migrations
        .iter()
        .any(|m| m.migration_id == migration_id && m.capture && m.sync)
}

fn rel_meta(rel: pg_sys::Relation) -> Result<Rc<RelMeta>, RemusError> {
    // SAFETY: the trigger's relation is open and locked for the duration of the call.
    let relid = unsafe { (*rel).rd_id };
    if let Some(m) = REL_META.with(|c| c.borrow().get(&relid).cloned()) {
        return Ok(m);
    }
    // Once per table per backend: names, key columns (the primary key) and output functions.
    // STORED generated columns are left out, as pgoutput and COPY leave them out: the
    // destination computes them, and an INSERT or UPDATE naming one fails there (428C9), which
    // would refuse every write of such a table in dual execution (review finding F8).
    let rows: Vec<(String, String, String, i16, bool, pg_sys::Oid)> =
        crate::pg::spi::connect(|c| {
            c.select(
                "SELECT n.nspname::text, cl.relname::text, a.attname::text, a.attnum,
                    coalesce(a.attnum = ANY(i.indkey::int2[]), false), a.atttypid
               FROM pg_class cl
               JOIN pg_namespace n ON n.oid = cl.relnamespace
               JOIN pg_attribute a ON a.attrelid = cl.oid AND a.attnum > 0 AND NOT a.attisdropped
                                   AND a.attgenerated = ''
               LEFT JOIN pg_index i ON i.indrelid = cl.oid AND i.indisprimary
              WHERE cl.oid = $1
              ORDER BY a.attnum",
                None,
                &[relid.into()],
            )?
            .map(|r| {
                Ok((
                    r.get::<String>(1)?.unwrap_or_default(),
                    r.get::<String>(2)?.unwrap_or_default(),
                    r.get::<String>(3)?.unwrap_or_default(),
                    r.get::<i16>(4)?.unwrap_or_default(),
                    r.get::<bool>(5)?.unwrap_or_default(),
                    r.get::<pg_sys::Oid>(6)?.unwrap_or(pg_sys::InvalidOid),
                ))
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()
        })?;
    let Some((schema, table, ..)) = rows.first().cloned() else {
        return Err(RemusError::NoColumns { relid });
    };
    let mut meta = RelMeta {
        schema,
        table,
        columns: Vec::new(),
        key: Vec::new(),
        attrs: Vec::new(),
    };
    for (_, _, column, attnum, key, typid) in rows {
        let mut output = pg_sys::InvalidOid;
        let mut varlena = false;
        // SAFETY: catalog lookup of a type that exists (the column has it).
        unsafe { pg_sys::getTypeOutputInfo(typid, &mut output, &mut varlena) };
        meta.columns.push(column);
        meta.key.push(key);
        meta.attrs.push((attnum as usize, output));
    }
    let meta = Rc::new(meta);
    REL_META.with(|c| c.borrow_mut().insert(relid, meta.clone()));
    Ok(meta)
}

/// Every column of `tuple` in the output format (what pgoutput sends).
///
/// # Safety
/// `tuple` and `tupdesc` must be the trigger's valid tuple and its relation's descriptor.
unsafe fn row_values(
    meta: &RelMeta,
    tuple: pg_sys::HeapTuple,
    tupdesc: pg_sys::TupleDesc,
) -> Vec<ColumnValue> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        meta.attrs
            .iter()
            .map(|&(attnum, output)| {
                let value = match NonZeroUsize::new(attnum)
                    .and_then(|a| pgrx::heap_getattr_raw(tuple, a, tupdesc))
                {
                    None => column_value::Value::Null(true),
                    Some(datum) => {
                        let text = pg_sys::OidOutputFunctionCall(output, datum);
                        let s = std::ffi::CStr::from_ptr(text)
                            .to_string_lossy()
                            .into_owned();
                        pg_sys::pfree(text.cast());
                        column_value::Value::Text(s)
                    }
                };
                ColumnValue { value: Some(value) }
            })
            .collect()
    }
}

fn shard_of(trigger: &PgTrigger<'_>) -> Option<i64> {
    trigger.extra_args().ok()?.first()?.parse().ok()
}

fn capture(trigger: &PgTrigger<'_>, migration_id: i64) -> Result<(), RemusError> {
    if WRITE_SET.with(|w| w.borrow().overflowed.contains(&migration_id)) {
        // Incomplete already: the COMMIT fails if it comes in sync mode (see the module).
        return if in_sync_mode(migration_id) {
            count_migration_abort(migration_id);
            Err(write_set_too_large(migration_id))
        } else {
            Ok(())
        };
    }
    let data = trigger.trigger_data();
    let rel = data.tg_relation;
    let meta = rel_meta(rel)?;
    let event = data.tg_event;
    // SAFETY: the relation is open; its descriptor lives as long as the call.
    let tupdesc = unsafe { (*rel).rd_att };
    let op = event & pg_sys::TRIGGER_EVENT_OPMASK;
    let (kind, old, new) = if op == pg_sys::TRIGGER_EVENT_INSERT {
        (row_change::Kind::Insert, None, Some(data.tg_trigtuple))
    } else if op == pg_sys::TRIGGER_EVENT_UPDATE {
        (
            row_change::Kind::Update,
            Some(data.tg_trigtuple),
            Some(data.tg_newtuple),
        )
    } else if op == pg_sys::TRIGGER_EVENT_DELETE {
        (row_change::Kind::Delete, Some(data.tg_trigtuple), None)
    } else {
        return Ok(());
    };
    // SAFETY: row triggers get valid tuples for their event (checked above).
    let (old_values, new_values) = unsafe {
        (
            old.map(|t| row_values(&meta, t, tupdesc))
                .unwrap_or_default(),
            new.map(|t| row_values(&meta, t, tupdesc))
                .unwrap_or_default(),
        )
    };
    let change = RowChange {
        kind: kind as i32,
        schema: meta.schema.clone(),
        table: meta.table.clone(),
        columns: meta.columns.clone(),
        key: meta.key.clone(),
        old_values,
        new_values,
        truncate_tables: Vec::new(),
    };
    // SAFETY: plain read of the current subtransaction id.
    let subxact = unsafe { pg_sys::GetCurrentSubTransactionId() };
    let bytes = heap_bytes(&change);
    let limit = max_write_set_bytes();
    WRITE_SET.with(|w| {
        let mut w = w.borrow_mut();
        let total = *w.bytes_of(migration_id) + bytes;
        if total > limit {
            if in_sync_mode(migration_id) {
                count_migration_abort(migration_id);
                return Err(write_set_too_large(migration_id));
            }
            // Before the barrier: the write set is most likely never used; free it rather
            // than fail a transaction that commits in async mode.
            w.changes.retain(|c| c.migration_id != migration_id);
            w.overflowed.push(migration_id);
            w.recount();
            pgrx::debug1!(
                "pg_remus: write set of shard migration {migration_id} passed remus.max_write_set_bytes before dual execution; no longer captured in this transaction"
            );
            return Ok(());
        }
        *w.bytes_of(migration_id) = total;
        w.changes.push(Captured {
            migration_id,
            subxact,
            bytes,
            change,
        });
        Ok(())
    })
}

/// The error of a write set past `remus.max_write_set_bytes` in sync mode.
pub(crate) fn write_set_too_large(migration_id: i64) -> RemusError {
    RemusError::WriteSetTooLarge {
        migration_id,
        limit_kb: crate::guc::MAX_WRITE_SET_KB.get().max(1) as i64,
    }
}

/// The migration capturing writes on `shard_id`, if any (the write-set trigger's question).
pub(crate) fn capturing_migration(shard_id: i64) -> Option<i64> {
    if !active() {
        return None;
    }
    let s = STATE.share();
    let migration_id = migration_of(&s, shard_id)?;
    s.migrations
        .iter()
        .any(|m| m.migration_id == migration_id && m.capture)
        .then_some(migration_id)
}

/// Row changes captured so far in this transaction (for the tests).
#[cfg(any(test, feature = "pg_test"))]
pub(crate) fn captured_changes() -> usize {
    WRITE_SET.with(|w| w.borrow().changes.len())
}

/// A subtransaction rolled back: its changes (and its children's) leave the write set.
pub(crate) fn subxact_aborted(subxact: pg_sys::SubTransactionId) {
    WRITE_SET.with(|w| {
        let mut w = w.borrow_mut();
        w.changes.retain(|c| c.subxact < subxact);
        w.recount();
    });
}

/// Takes this transaction's write set: (migration, row change), in capture order, and the
/// migrations whose write set overflowed before dual execution (incomplete, not in the list).
pub(crate) fn take_write_set() -> (Vec<(i64, RowChange)>, Vec<i64>) {
    WRITE_SET.with(|w| {
        let w = std::mem::take(&mut *w.borrow_mut());
        (
            w.changes
                .into_iter()
                .map(|c| (c.migration_id, c.change))
                .collect(),
            w.overflowed,
        )
    })
}

/// The transaction ended: its write set goes.
pub(crate) fn clear_write_set() {
    WRITE_SET.with(|w| *w.borrow_mut() = WriteSet::default());
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::catchup::*;

    /// AFTER INSERT OR UPDATE OR DELETE … FOR EACH ROW on every shard table, with the shard id as
    /// its argument. Costs one atomic load unless a migration captures the shard.
    #[pg_trigger]
    fn capture_write<'a>(
        trigger: &'a pgrx::PgTrigger<'a>,
    ) -> Result<Option<PgHeapTuple<'a, impl WhoAllocated>>, PgHeapTupleError> {
        if !active() {
            return Ok(None::<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>);
        }
        let Some(migration_id) = shard_of(trigger).and_then(capturing_migration) else {
            return Ok(None);
        };
        if crate::guc::MIGRATION_SESSION.get() {
            // The migration's own sessions (the shadow side) never write a source shard.
            return Ok(None);
        }
        if let Err(e) = capture(trigger, migration_id) {
            e.raise();
        }
        Ok(None)
    }

    /// Remus mode: from now on writes on the migration's shard tables on this node are
    /// captured as write sets, to be validated through the replay worker at `endpoint` once the
    /// sync barrier is set. The migration must be registered. Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_capture(migration_id: i64, endpoint: &str) {
        require_superuser("remus.migration_capture");
        if endpoint.is_empty() || endpoint.len() >= ENDPOINT_BYTES {
            RemusError::LengthOutOfRange {
                what: "replay worker endpoint",
                max: ENDPOINT_BYTES - 1,
            }
            .raise();
        }
        let mut s = STATE.exclusive();
        match s
            .migrations
            .iter_mut()
            .find(|m| m.migration_id == migration_id)
        {
            Some(m) => {
                m.capture = true;
                m.endpoint = [0; ENDPOINT_BYTES];
                m.endpoint[..endpoint.len()].copy_from_slice(endpoint.as_bytes());
            }
            None => {
                drop(s);
                RemusError::MigrationNotRegistered { migration_id }.raise()
            }
        }
        crate::migration::durable::sync_after(s, migration_id);
    }
}
