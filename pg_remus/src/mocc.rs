//! The source half of Remus dual execution (MOCC) on a node that owns a migrating shard.
//!
//! - Write-set capture: every shard table carries an AFTER ROW trigger, `remus.capture_write`,
//!   created with the table (creating it at migration time would queue every writer behind the
//!   longest running one). It returns at once unless the shard's migration captures writes
//!   (`remus.migration_capture`); then it records the row change, in the replay worker's wire
//!   format, in this backend's write set. A rolled-back subtransaction drops its changes.
//! - Commit: at pre-commit (and pre-prepare, so 2PC participants validate inside their
//!   PREPARE), a transaction with a captured write set reads its migration's mode under the
//!   handover lock. Async: it commits as usual, marked "in async commit" for the sync barrier
//!   until it ends. Sync: it ships the write set with L_T (its WAL insert position, flushed) to
//!   the replay worker's `Validate`; the destination applies it in a prepared shadow transaction
//!   after its stream passed L_T, or refuses it on a write-write conflict, which fails this
//!   transaction with 40001. Once validated, a transactional logical message "remus" carrying
//!   the shadow's gid tells the stream not to apply the transaction again, and
//!   synchronous_commit is forced on (the shadow must not outlive a lost commit record).
//! - After the commit, the backend asks the replay worker to commit the shadow with this
//!   transaction's commit time and waits for it before the client gets its COMMIT, so a client
//!   that commits here and reads on the destination sees its write. This wait cannot raise (the
//!   transaction is committed): a failure is a WARNING, and the stream commits the shadow later.
//!   An abort after validation rolls the shadow back the same way; a shadow whose source died
//!   in between is resolved by the coordinator from the source transaction's status.
//! - A 2PC participant's shadows wait for its COMMIT / ROLLBACK PREPARED, which may run in
//!   another session: noted in shared memory under its xid, they are resolved by that session
//!   before the statement returns.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::CString;
use std::num::NonZeroUsize;
use std::rc::Rc;
use std::time::Duration;

use pgrx::prelude::*;
use pgrx::{pg_sys, WhoAllocated};
use remus_proto::v1::replay_worker_client::ReplayWorkerClient;
use remus_proto::v1::{column_value, row_change, ColumnValue, ResolveRequest, RowChange, ValidateRequest};

use crate::error::RemusError;
use crate::handover::{self, CommitMode};

/// Logical message prefix marking a validated transaction in the WAL stream (the propagator's
/// `REMUS_MESSAGE_PREFIX`).
const MESSAGE_PREFIX: &std::ffi::CStr = c"remus";
/// Longest wait of the post-commit shadow commit (the client's COMMIT waits for it).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

extern "C" {
    /// replication/message.h: writes a logical decoding message into WAL.
    fn LogLogicalMessage(
        prefix: *const std::os::raw::c_char,
        message: *const std::os::raw::c_char,
        size: usize,
        transactional: bool,
    ) -> pg_sys::XLogRecPtr;
}

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
    change: RowChange,
}

/// A write set the destination accepted: its prepared shadow awaits this transaction's fate.
struct Validated {
    migration_id: i64,
    gid: String,
    endpoint: String,
    /// The source transaction's top xid (what pg_prepared_xacts shows if it is prepared).
    xid: u32,
}

thread_local! {
    static REL_META: RefCell<HashMap<pg_sys::Oid, Rc<RelMeta>>> = RefCell::new(HashMap::new());
    static WRITE_SET: RefCell<Vec<Captured>> = const { RefCell::new(Vec::new()) };
    static VALIDATED: RefCell<Vec<Validated>> = const { RefCell::new(Vec::new()) };
    static MARKED: Cell<bool> = const { Cell::new(false) };
    static CLIENTS: RefCell<HashMap<String, ReplayWorkerClient<tonic::transport::Channel>>> = RefCell::new(HashMap::new());
}

fn rel_meta(rel: pg_sys::Relation) -> Result<Rc<RelMeta>, RemusError> {
    // SAFETY: the trigger's relation is open and locked for the duration of the call.
    let relid = unsafe { (*rel).rd_id };
    if let Some(m) = REL_META.with(|c| c.borrow().get(&relid).cloned()) {
        return Ok(m);
    }
    // Once per table per backend: names, key columns (the primary key) and output functions.
    let rows: Vec<(String, String, String, i16, bool, pg_sys::Oid)> = Spi::connect(|c| {
        c.select(
            "SELECT n.nspname::text, cl.relname::text, a.attname::text, a.attnum,
                    coalesce(a.attnum = ANY(i.indkey::int2[]), false), a.atttypid
               FROM pg_class cl
               JOIN pg_namespace n ON n.oid = cl.relnamespace
               JOIN pg_attribute a ON a.attrelid = cl.oid AND a.attnum > 0 AND NOT a.attisdropped
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
        return Err(RemusError::InvalidArgument(format!("relation {relid:?} has no columns")));
    };
    let mut meta = RelMeta { schema, table, columns: Vec::new(), key: Vec::new(), attrs: Vec::new() };
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
unsafe fn row_values(meta: &RelMeta, tuple: pg_sys::HeapTuple, tupdesc: pg_sys::TupleDesc) -> Vec<ColumnValue> {
    meta.attrs
        .iter()
        .map(|&(attnum, output)| {
            let value = match NonZeroUsize::new(attnum).and_then(|a| pgrx::heap_getattr_raw(tuple, a, tupdesc)) {
                None => column_value::Value::Null(true),
                Some(datum) => {
                    let text = pg_sys::OidOutputFunctionCall(output, datum);
                    let s = std::ffi::CStr::from_ptr(text).to_string_lossy().into_owned();
                    pg_sys::pfree(text.cast());
                    column_value::Value::Text(s)
                }
            };
            ColumnValue { value: Some(value) }
        })
        .collect()
}

fn shard_of(trigger: &PgTrigger<'_>) -> Option<i64> {
    trigger.extra_args().ok()?.first()?.parse().ok()
}

fn capture(trigger: &PgTrigger<'_>, migration_id: i64) -> Result<(), RemusError> {
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
        (row_change::Kind::Update, Some(data.tg_trigtuple), Some(data.tg_newtuple))
    } else if op == pg_sys::TRIGGER_EVENT_DELETE {
        (row_change::Kind::Delete, Some(data.tg_trigtuple), None)
    } else {
        return Ok(());
    };
    // SAFETY: row triggers get valid tuples for their event (checked above).
    let (old_values, new_values) = unsafe {
        (
            old.map(|t| row_values(&meta, t, tupdesc)).unwrap_or_default(),
            new.map(|t| row_values(&meta, t, tupdesc)).unwrap_or_default(),
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
    WRITE_SET.with(|w| w.borrow_mut().push(Captured { migration_id, subxact, change }));
    Ok(())
}

#[pg_schema]
mod remus {
    use super::*;

    /// AFTER INSERT OR UPDATE OR DELETE … FOR EACH ROW on every shard table, with the shard id as
    /// its argument. Costs one atomic load unless a migration captures the shard.
    #[pg_trigger]
    fn capture_write<'a>(
        trigger: &'a pgrx::PgTrigger<'a>,
    ) -> Result<Option<PgHeapTuple<'a, impl WhoAllocated>>, PgHeapTupleError> {
        if !handover::active() {
            return Ok(None::<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>);
        }
        let Some(migration_id) = shard_of(trigger).and_then(handover::capturing_migration) else {
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
}

/// The trigger every shard table carries (created with the table).
pub fn capture_trigger_ddl(shard_table: &str, shard_id: i64) -> String {
    format!(
        "CREATE TRIGGER remus_capture AFTER INSERT OR UPDATE OR DELETE ON {shard_table} \
         FOR EACH ROW EXECUTE FUNCTION remus.capture_write('{shard_id}');\n"
    )
}

/// Row changes captured so far in this transaction.
pub fn captured_changes() -> usize {
    WRITE_SET.with(|w| w.borrow().len())
}

/// A subtransaction rolled back: its changes (and its children's) leave the write set.
pub fn subxact_aborted(subxact: pg_sys::SubTransactionId) {
    WRITE_SET.with(|w| w.borrow_mut().retain(|c| c.subxact < subxact));
}

fn client_for(endpoint: &str) -> Result<ReplayWorkerClient<tonic::transport::Channel>, RemusError> {
    if let Some(c) = CLIENTS.with(|c| c.borrow().get(endpoint).cloned()) {
        return Ok(c);
    }
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| RemusError::InvalidArgument(format!("bad replay worker endpoint {endpoint}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    let client = ReplayWorkerClient::new(channel)
        .max_decoding_message_size(256 * 1024 * 1024)
        .max_encoding_message_size(256 * 1024 * 1024);
    CLIENTS.with(|c| c.borrow_mut().insert(endpoint.to_string(), client.clone()));
    Ok(client)
}

fn forget_client(endpoint: &str) {
    CLIENTS.with(|c| c.borrow_mut().remove(endpoint));
}

/// Pre-commit / pre-prepare: validates the captured write sets of migrations in sync mode.
pub fn pre_commit() -> Result<(), RemusError> {
    let mut by_migration: Vec<(i64, Vec<RowChange>)> = Vec::new();
    WRITE_SET.with(|w| {
        for c in w.borrow_mut().drain(..) {
            match by_migration.iter_mut().find(|(m, _)| *m == c.migration_id) {
                Some((_, changes)) => changes.push(c.change),
                None => by_migration.push((c.migration_id, vec![c.change])),
            }
        }
    });
    if by_migration.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = by_migration.iter().map(|(m, _)| *m).collect();
    let modes = handover::enter_commit(&ids);
    if modes.iter().any(|(_, m)| *m == CommitMode::Async) {
        MARKED.with(|m| m.set(true));
    }
    for ((migration_id, changes), (_, mode)) in by_migration.into_iter().zip(modes) {
        if let CommitMode::Sync { endpoint } = mode {
            validate(migration_id, &endpoint, changes)?;
        }
    }
    Ok(())
}

/// The gid of the shadow of source transaction `fxid` (what the replay worker and the
/// coordinator's cleanup expect).
fn shadow_gid(migration_id: i64, fxid: u64) -> String {
    format!("remus:{migration_id}:{fxid}")
}

fn validate(migration_id: i64, endpoint: &str, changes: Vec<RowChange>) -> Result<(), RemusError> {
    // SAFETY: the transaction wrote, so it has an xid; plain reads of WAL positions.
    let (fxid, wait_lsn) = unsafe {
        let fxid = pg_sys::GetTopFullTransactionId().value;
        // The insert position may lie just past the header of a page no record has reached
        // yet; flushing up to there fails ("xlog flush request … is not satisfied"), so both
        // the flush and L_T stop at the end of the last record.
        let lsn = end_of_last_record(pg_sys::GetXLogInsertRecPtr());
        // The destination waits until its stream has passed L_T; the walsender only decodes
        // flushed WAL, so flush now rather than wait for the WAL writer.
        pg_sys::XLogFlush(lsn);
        (fxid, lsn)
    };
    let gid = shadow_gid(migration_id, fxid);
    let request = ValidateRequest {
        migration_id: migration_id as u64,
        gid: gid.clone(),
        wait_lsn,
        changes,
        lock_timeout_ms: 0,
    };
    // The channel is made inside the runtime: tonic spawns its connection task there.
    let reply = crate::migrate::block_on(async move {
        let mut client = client_for(endpoint)?;
        Ok::<_, RemusError>(client.validate(request).await)
    });
    let reply = match reply {
        Err(e) | Ok(Err(e)) => return Err(e),
        Ok(Ok(Err(status))) => {
            forget_client(endpoint);
            return Err(RemusError::SyncValidation {
                migration_id,
                message: format!("replay worker {endpoint}: {}", status.message()),
            });
        }
        Ok(Ok(Ok(reply))) => reply.into_inner(),
    };
    if !reply.ok {
        handover::count_migration_abort(migration_id);
        return Err(RemusError::MigrationConflict { migration_id, conflict: reply.conflict });
    }
    VALIDATED.with(|v| {
        v.borrow_mut().push(Validated { migration_id, gid: gid.clone(), endpoint: endpoint.to_string(), xid: fxid as u32 })
    });
    let content = CString::new(gid).expect("gid has no NUL");
    // SAFETY: transactional message inside this transaction; the strings outlive the call.
    unsafe {
        LogLogicalMessage(MESSAGE_PREFIX.as_ptr(), content.as_ptr(), content.as_bytes().len(), true);
    }
    force_synchronous_commit();
    Ok(())
}

/// The insert position just past a page header is where the next record starts, but the
/// walsender reports the end of the last record read, which stops before that header: step back
/// over it so an idle stream can reach L_T.
fn end_of_last_record(insert: u64) -> u64 {
    const XLOG_BLCKSZ: u64 = pg_sys::XLOG_BLCKSZ as u64;
    const SHORT_HEADER: u64 = 24;
    const LONG_HEADER: u64 = 40;
    // SAFETY: read-only global set at startup.
    let segment = unsafe { pg_sys::wal_segment_size } as u64;
    if segment > 0 && insert % segment == LONG_HEADER {
        insert - LONG_HEADER
    } else if insert % XLOG_BLCKSZ == SHORT_HEADER {
        insert - SHORT_HEADER
    } else {
        insert
    }
}

fn force_synchronous_commit() {
    // SAFETY: transaction-local GUC change, reverted at transaction end (after the commit
    // record is flushed), exactly as SET LOCAL does.
    unsafe {
        pg_sys::set_config_option(
            c"synchronous_commit".as_ptr(),
            c"on".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_LOCAL,
            true,
            0,
            false,
        );
    }
}

/// The transaction ended (commit or abort; for PREPARE, see [`prepared`]). Commits or rolls
/// back the validated shadows, waiting for the answer, and clears this backend's state.
pub fn end_of_transaction(committed: bool) {
    WRITE_SET.with(|w| w.borrow_mut().clear());
    if MARKED.with(|m| m.replace(false)) {
        handover::leave_commit();
    }
    let validated = VALIDATED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    if validated.is_empty() {
        return;
    }
    // SAFETY: plain reads of this (ended) transaction's commit time and end of commit record.
    let (commit_time_us, commit_lsn) = unsafe { (pg_sys::GetCurrentTransactionStopTimestamp(), pg_sys::XactLastCommitEnd) };
    for v in validated {
        resolve(&v, committed, commit_time_us, commit_lsn);
    }
}

/// The transaction was prepared (a 2PC participant): its shadows stay prepared, noted in
/// shared memory under its xid so that the session running its COMMIT / ROLLBACK PREPARED
/// finishes them too ([`prepared_finished`]). The stream (on the source's commit) and the
/// migration's cleanup (by the source's fate) cover a note that is lost.
pub fn prepared() {
    WRITE_SET.with(|w| w.borrow_mut().clear());
    if MARKED.with(|m| m.replace(false)) {
        handover::leave_commit();
    }
    let validated = VALIDATED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    if let Some(first) = validated.first() {
        let migrations: Vec<i64> = validated.iter().map(|v| v.migration_id).collect();
        handover::note_prepared_shadows(first.xid, &migrations);
    }
}

/// The xid of prepared transaction `gid`, if its shadows are noted here (looked up before
/// COMMIT / ROLLBACK PREPARED runs, while the gid still exists).
pub fn prepared_xid(gid: &str) -> Option<u32> {
    if !handover::any_prepared_shadows() {
        return None;
    }
    // SAFETY: a transaction statement runs without an active snapshot; SPI's read-only
    // queries need one. Pushed and popped around the one query.
    let pushed = unsafe {
        if pg_sys::ActiveSnapshotSet() {
            false
        } else {
            pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
            true
        }
    };
    let xid = Spi::get_one_with_args::<i64>(
        "SELECT transaction::text::bigint FROM pg_catalog.pg_prepared_xacts WHERE gid = $1",
        &[gid.into()],
    );
    if pushed {
        // SAFETY: pairs the push above (the query cannot leave another snapshot pushed).
        unsafe { pg_sys::PopActiveSnapshot() };
    }
    xid.ok().flatten().map(|x| x as u32)
}

/// COMMIT / ROLLBACK PREPARED of a validated 2PC participant finished in this session: its
/// shadows follow before the statement returns, so the transaction's coordinator (and its
/// client) sees COMMIT only once the destination has the writes. Never raises.
pub fn prepared_finished(xid: u32, commit: bool) {
    let shadows = handover::take_prepared_shadows(xid);
    if shadows.is_empty() {
        return;
    }
    // SAFETY: plain reads: the next xid's epoch (to rebuild the full xid the gid carries), the
    // commit timestamp of a transaction that just committed, and the WAL insert position.
    let (fxid, commit_time_us, lsn) = unsafe {
        let next = pg_sys::ReadNextFullTransactionId().value;
        let mut epoch = next >> 32;
        if xid > next as u32 {
            epoch -= 1;
        }
        let mut ts: pg_sys::TimestampTz = 0;
        if commit {
            pg_sys::TransactionIdGetCommitTsData(pg_sys::TransactionId::from(xid), &mut ts, std::ptr::null_mut());
        }
        ((epoch << 32) | u64::from(xid), ts, pg_sys::GetXLogInsertRecPtr())
    };
    // SAFETY: the prepared transaction is finished; like the post-commit path, the wait for the
    // destination must not be turned into an ERROR by a cancel (the statement succeeded).
    unsafe { pg_sys::InterruptHoldoffCount += 1 };
    for (migration_id, endpoint) in shadows {
        let v = Validated { migration_id, gid: shadow_gid(migration_id, fxid), endpoint, xid };
        resolve(&v, commit, commit_time_us, lsn);
    }
    // SAFETY: pairs the increment above.
    unsafe { pg_sys::InterruptHoldoffCount -= 1 };
}

fn resolve(v: &Validated, commit: bool, commit_time_us: i64, commit_lsn: u64) {
    let endpoint = v.endpoint.clone();
    let request = ResolveRequest {
        migration_id: v.migration_id as u64,
        gid: v.gid.clone(),
        commit,
        commit_time_us,
        commit_lsn,
    };
    // Interrupts are held here (the transaction is over): a bounded wait, never an ERROR.
    let outcome = crate::migrate::block_on(async move {
        let mut client = client_for(&endpoint)?;
        Ok::<_, RemusError>(tokio::time::timeout(RESOLVE_TIMEOUT, client.resolve(request)).await)
    });
    let failure = match outcome {
        Ok(Ok(Ok(Ok(_)))) => None,
        Ok(Ok(Ok(Err(status)))) => Some(status.message().to_string()),
        Ok(Ok(Err(_))) => Some(format!("no answer within {} s", RESOLVE_TIMEOUT.as_secs())),
        Ok(Err(e)) | Err(e) => Some(e.to_string()),
    };
    if let Some(why) = failure {
        forget_client(&v.endpoint);
        let what = if commit { "committed" } else { "rolled back" };
        warning!(
            "pg_remus: shadow transaction {} of shard migration {} could not be {what} on the destination yet ({why}); the migration resolves it",
            v.gid,
            v.migration_id
        );
    }
}
