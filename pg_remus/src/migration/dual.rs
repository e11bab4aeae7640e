//! Dual execution, node side (Remus mode): validate-then-commit of the source transactions that
//! wrote a migrating shard. (The MOCC conflict check itself runs on the destination, in the
//! replay worker's `validate`.)
//!
//! - Commit: at pre-commit (and pre-prepare, so 2PC participants validate inside their
//!   PREPARE), a transaction with a captured write set (`migration::catchup`) reads its
//!   migration's mode under the handover lock (`migration::barrier::enter_commit`). Async: it
//!   commits as usual, marked "in async commit" for the sync barrier until it ends. Sync: it
//!   ships the write set with L_T (its WAL insert position, flushed) to the replay worker's
//!   `Validate`; the destination applies it in a prepared shadow transaction after its stream
//!   passed L_T, or refuses it on a write-write conflict, which fails this transaction with
//!   40001. Once validated, a transactional logical message "remus" carrying the shadow's gid
//!   tells the stream not to apply the transaction again, and synchronous_commit is forced on
//!   (the shadow must not outlive a lost commit record).
//! - After the commit, the backend asks the replay worker to commit the shadow with this
//!   transaction's commit time and waits for it before the client gets its COMMIT, so a client
//!   that commits here and reads on the destination sees its write. This wait cannot raise (the
//!   transaction is committed): it is bounded by `remus.resolve_timeout`, a failure is a
//!   WARNING, and the coordinator's periodic resolver (or the stream) finishes the shadow.
//!   An abort after validation rolls the shadow back the same way; a shadow whose source died
//!   in between is resolved by the coordinator from the source transaction's status.
//! - A 2PC participant's shadows wait for its COMMIT / ROLLBACK PREPARED, which may run in
//!   another session: noted in shared memory under its xid, they are resolved by that session
//!   before the statement returns.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::time::Duration;

use pgrx::pg_sys;
use pgrx::prelude::*;
use remus_proto::names;
use remus_proto::v1::{ResolveRequest, RowChange, ValidateRequest};
use remus_proto::Message;

use crate::cluster::rpc::{block_on, client_for, forget_client};
use crate::error::RemusError;
use crate::migration::barrier::{enter_commit, leave_commit, CommitMode};
use crate::migration::catchup::{clear_write_set, take_write_set, write_set_too_large};
use crate::migration::state::{
    active, count_migration_abort, PreparedShadow, MAX_PREPARED_SHADOWS, STATE,
};
use crate::pg::ffi::LogLogicalMessage;

/// A write set the destination accepted: its prepared shadow awaits this transaction's fate.
struct Validated {
    migration_id: i64,
    gid: String,
    endpoint: String,
    /// The source transaction's top xid (what pg_prepared_xacts shows if it is prepared).
    xid: u32,
}

thread_local! {
    static VALIDATED: RefCell<Vec<Validated>> = const { RefCell::new(Vec::new()) };
    static MARKED: Cell<bool> = const { Cell::new(false) };
}

/// Pre-commit / pre-prepare: validates the captured write sets of migrations in sync mode.
pub(crate) fn pre_commit() -> Result<(), RemusError> {
    let mut by_migration: Vec<(i64, Vec<RowChange>)> = Vec::new();
    let (write_set, overflowed) = take_write_set();
    for (migration_id, change) in write_set {
        match by_migration.iter_mut().find(|(m, _)| *m == migration_id) {
            Some((_, changes)) => changes.push(change),
            None => by_migration.push((migration_id, vec![change])),
        }
    }
    // A write set dropped for its size before dual execution still needs its mode: async
    // commits as usual, sync cannot be validated.
    for &migration_id in &overflowed {
        if !by_migration.iter().any(|(m, _)| *m == migration_id) {
            by_migration.push((migration_id, Vec::new()));
        }
    }
    if by_migration.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = by_migration.iter().map(|(m, _)| *m).collect();
    let modes = enter_commit(&ids)?;
    if modes.iter().any(|(_, m)| *m == CommitMode::Async) {
        MARKED.with(|m| m.set(true));
    }
    for ((migration_id, changes), (_, mode)) in by_migration.into_iter().zip(modes) {
        if let CommitMode::Sync {
            endpoint,
            barrier_lsn,
        } = mode
        {
            if overflowed.contains(&migration_id) {
                count_migration_abort(migration_id);
                return Err(write_set_too_large(migration_id));
            }
            validate(migration_id, &endpoint, barrier_lsn, changes)?;
        }
    }
    Ok(())
}

/// The gid of the shadow of source transaction `fxid` (what the replay worker and the
/// coordinator's cleanup expect).
/// (Registered migration ids are positive.)
fn shadow_gid(migration_id: i64, fxid: u64) -> String {
    names::shadow_gid(migration_id as u64, fxid)
}

/// The destination waits until its stream has passed this transaction's WAL position, L_T; once
/// the sync barrier's sync point is applied there (`barrier_lsn`, [`super::barrier`]'s
/// `migration_barrier_applied`), only until it has passed that point.
fn validate(
    migration_id: i64,
    endpoint: &str,
    barrier_lsn: Option<u64>,
    changes: Vec<RowChange>,
) -> Result<(), RemusError> {
    // SAFETY: the transaction wrote, so it has an xid.
    let fxid = unsafe { pg_sys::GetTopFullTransactionId().value };
    let wait_lsn = if let Some(lsn) = barrier_lsn {
        // Long flushed and, unless the replay restarted, applied: nothing to flush or mark.
        lsn
    } else {
        // The insert position may lie just past the header of a page no record has reached
        // yet; flushing up to there fails ("xlog flush request … is not satisfied"), so both
        // the flush and L_T stop at the end of the last record.
        // SAFETY: a plain read of the shared insert position, then a flush up to a written
        // record.
        unsafe {
            let lsn = end_of_last_record(pg_sys::GetXLogInsertRecPtr());
            // The destination waits until its stream has passed L_T. A transaction's changes
            // are sent at its commit, and one that publishes nothing sends nothing, so with
            // every writer of the shards waiting in its validation the stream would not pass
            // L_T before some later commit (Tm's, in the anchors' E1: 60-100 ms). A
            // non-transactional message is sent as soon as it is decoded, and the propagator
            // takes its position as the stream's (decision 0036).
            let mark = LogLogicalMessage(
                names::STREAM_MARK_MESSAGE_PREFIX_C.as_ptr(),
                c"".as_ptr(),
                0,
                false,
            );
            // The walsender only decodes flushed WAL: flush now rather than wait for the WAL
            // writer.
            pg_sys::XLogFlush(mark.max(lsn));
            lsn
        }
    };
    let gid = shadow_gid(migration_id, fxid);
    let request = chunked(
        ValidateRequest {
            migration_id: migration_id as u64,
            gid: gid.clone(),
            wait_lsn,
            changes: Vec::new(),
            lock_timeout_ms: 0,
        },
        changes,
        (crate::guc::WRITE_SET_CHUNK_KB.get().max(1) as usize).saturating_mul(1024),
    );
    // Bounded (remus.validation_timeout): a destination that stops answering (partition,
    // SIGSTOP, I/O hang) fails this commit with 40001 instead of holding it, and its row locks,
    // forever (review finding F11). The deadline also travels as grpc-timeout, so the replay
    // worker drops the validation (and its destination session) when it passes.
    let deadline = Duration::from_millis(crate::guc::VALIDATION_TIMEOUT_MS.get().max(1) as u64);
    let mut request = tonic::Request::new(tonic::codegen::tokio_stream::iter(request));
    request.set_timeout(deadline);
    // Noted before asking (review F6): if the answer never arrives here (a cancel served
    // during the wait, a lost reply, the deadline) the shadow may still be prepared; the
    // abort then asks the replay worker to roll it back, which it also does to one that a
    // still-running validation prepares later.
    VALIDATED.with(|v| {
        v.borrow_mut().push(Validated {
            migration_id,
            gid: gid.clone(),
            endpoint: endpoint.to_string(),
            xid: fxid as u32,
        })
    });
    // The channel is made inside the runtime: tonic spawns its connection task there.
    let reply = block_on(async move {
        let mut client = client_for(endpoint)?;
        Ok::<_, RemusError>(tokio::time::timeout(deadline, client.validate(request)).await)
    });
    let reply = match reply {
        Err(e) | Ok(Err(e)) => {
            // Nothing was sent (no runtime, no channel): nothing to roll back.
            VALIDATED.with(|v| v.borrow_mut().retain(|x| x.gid != gid));
            count_migration_abort(migration_id);
            return Err(e);
        }
        Ok(Ok(Err(_))) => {
            forget_client(endpoint);
            count_migration_abort(migration_id);
            return Err(RemusError::SyncValidation {
                migration_id,
                endpoint: endpoint.to_string(),
                message: format!(
                    "no answer within {} ms (remus.validation_timeout)",
                    deadline.as_millis()
                ),
            });
        }
        Ok(Ok(Ok(Err(status)))) => {
            forget_client(endpoint);
            // Aborted by the migration as much as a conflict is (review F19: these were not
            // counted in aborted_by_migration).
            count_migration_abort(migration_id);
            return Err(RemusError::SyncValidation {
                migration_id,
                endpoint: endpoint.to_string(),
                message: status.message().to_string(),
            });
        }
        Ok(Ok(Ok(Ok(reply)))) => reply.into_inner(),
    };
    if !reply.ok {
        // Refused: the replay worker left nothing prepared.
        VALIDATED.with(|v| v.borrow_mut().retain(|x| x.gid != gid));
        count_migration_abort(migration_id);
        return Err(RemusError::MigrationConflict {
            migration_id,
            conflict: reply.conflict,
        });
    }
    let content = CString::new(gid).expect("gid has no NUL");
    // SAFETY: transactional message inside this transaction; the strings outlive the call.
    unsafe {
        LogLogicalMessage(
            names::MESSAGE_PREFIX_C.as_ptr(),
            content.as_ptr(),
            content.as_bytes().len(),
            true,
        );
    }
    force_synchronous_commit();
    Ok(())
}

/// The Validate messages of a write set: `header` with the first chunk, then one message per
/// further chunk, each about `chunk_bytes` encoded (at least one change). Chunked so that a
/// write set has no size limit (review F10: one message was capped at 256 MiB) and the replay
/// worker holds and runs one chunk at a time; `remus.write_set_chunk_bytes` (1 MB by default)
/// is far above per-message overhead and far below any message limit. Lazy: a chunk is made
/// when the call sends it, from changes moved out of the write set (nothing is copied).
fn chunked(
    header: ValidateRequest,
    changes: Vec<RowChange>,
    chunk_bytes: usize,
) -> impl Iterator<Item = ValidateRequest> + Send + 'static {
    let mut header = Some(header);
    let mut changes = changes.into_iter().peekable();
    std::iter::from_fn(move || {
        let mut message = match header.take() {
            Some(h) => h,
            None if changes.peek().is_none() => return None,
            None => ValidateRequest::default(),
        };
        let mut bytes = 0;
        while let Some(change) = changes
            .next_if(|c| message.changes.is_empty() || bytes + c.encoded_len() <= chunk_bytes)
        {
            bytes += change.encoded_len();
            message.changes.push(change);
        }
        Some(message)
    })
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

/// Raises this transaction's synchronous_commit to `on`, never lowers it: a session's
/// `remote_apply` stays (review F19: forcing `on` weakened it).
fn force_synchronous_commit() {
    // SAFETY: plain read of this backend's setting.
    let level = unsafe { pg_sys::synchronous_commit } as pg_sys::SyncCommitLevel::Type;
    if level >= pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_REMOTE_FLUSH {
        return;
    }
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
pub(crate) fn end_of_transaction(committed: bool) {
    clear_write_set();
    if MARKED.with(|m| m.replace(false)) {
        leave_commit();
    }
    let validated = VALIDATED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    if validated.is_empty() {
        return;
    }
    // SAFETY: plain reads of this (ended) transaction's commit time and end of commit record.
    let (commit_time_us, commit_lsn) = unsafe {
        (
            pg_sys::GetCurrentTransactionStopTimestamp(),
            pg_sys::XactLastCommitEnd,
        )
    };
    for v in validated {
        resolve(&v, committed, commit_time_us, commit_lsn);
    }
}

/// The transaction was prepared (a 2PC participant): its shadows stay prepared, noted in
/// shared memory under its xid so that the session running its COMMIT / ROLLBACK PREPARED
/// finishes them too ([`prepared_finished`]). The stream (on the source's commit) and the
/// migration's cleanup (by the source's fate) cover a note that is lost.
pub(crate) fn prepared() {
    clear_write_set();
    if MARKED.with(|m| m.replace(false)) {
        leave_commit();
    }
    let validated = VALIDATED.with(|v| std::mem::take(&mut *v.borrow_mut()));
    if let Some(first) = validated.first() {
        let migrations: Vec<i64> = validated.iter().map(|v| v.migration_id).collect();
        note_prepared_shadows(first.xid, &migrations);
    }
}

/// A transaction validated for `migrations` was prepared as `xid` (a 2PC participant). With no
/// free slot it is not noted: the stream and the migration's cleanup finish its shadows then.
fn note_prepared_shadows(xid: u32, migrations: &[i64]) {
    let mut s = STATE.exclusive();
    for &migration_id in migrations {
        if let Some(slot) = s.prepared_shadows.iter_mut().find(|p| p.migration_id == 0) {
            *slot = PreparedShadow { migration_id, xid };
        }
    }
}

/// Is any prepared transaction noted by [`note_prepared_shadows`]? (Cheap enough per COMMIT
/// PREPARED: only taken while a migration is registered here.)
fn any_prepared_shadows() -> bool {
    active()
        && STATE
            .share()
            .prepared_shadows
            .iter()
            .any(|p| p.migration_id != 0)
}

/// Removes the notes of prepared transaction `xid`; returns, per migration still in sync mode,
/// its replay worker endpoint.
fn take_prepared_shadows(xid: u32) -> Vec<(i64, String)> {
    let mut s = STATE.exclusive();
    let mut taken = Vec::new();
    for i in 0..MAX_PREPARED_SHADOWS {
        let p = s.prepared_shadows[i];
        if p.migration_id == 0 || p.xid != xid {
            continue;
        }
        s.prepared_shadows[i] = PreparedShadow::default();
        if let Some(m) = s
            .migrations
            .iter()
            .find(|m| m.migration_id == p.migration_id && m.capture)
        {
            taken.push((p.migration_id, m.endpoint()));
        }
    }
    taken
}

/// COMMIT / ROLLBACK PREPARED of a transaction whose Remus shadows are noted on this node:
/// its xid and whether it commits (asked by the ProcessUtility hook before the statement runs,
/// while the gid still exists).
///
/// # Safety
/// `pstmt` must be the utility statement about to run.
pub(crate) unsafe fn finishing_prepared(pstmt: *mut pg_sys::PlannedStmt) -> Option<(u32, bool)> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null() || (*stmt).type_ != pg_sys::NodeTag::T_TransactionStmt {
            return None;
        }
        let t = stmt as *mut pg_sys::TransactionStmt;
        let commit = match (*t).kind {
            pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED => true,
            pg_sys::TransactionStmtKind::TRANS_STMT_ROLLBACK_PREPARED => false,
            _ => return None,
        };
        if (*t).gid.is_null() {
            return None;
        }
        let gid = std::ffi::CStr::from_ptr((*t).gid).to_string_lossy();
        prepared_xid(&gid).map(|xid| (xid, commit))
    }
}

/// The xid of prepared transaction `gid`, if its shadows are noted here (looked up before
/// COMMIT / ROLLBACK PREPARED runs, while the gid still exists).
fn prepared_xid(gid: &str) -> Option<u32> {
    if !any_prepared_shadows() {
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
    let xid = crate::pg::spi::as_extension_owner(|| {
        Spi::get_one_with_args::<i64>(
            "SELECT transaction::text::bigint FROM pg_catalog.pg_prepared_xacts WHERE gid = $1",
            &[gid.into()],
        )
    });
    if pushed {
        // SAFETY: pairs the push above (the query cannot leave another snapshot pushed).
        unsafe { pg_sys::PopActiveSnapshot() };
    }
    xid.ok().flatten().map(|x| x as u32)
}

/// COMMIT / ROLLBACK PREPARED of a validated 2PC participant finished in this session: its
/// shadows follow before the statement returns, so the transaction's coordinator (and its
/// client) sees COMMIT only once the destination has the writes. Never raises.
pub(crate) fn prepared_finished(xid: u32, commit: bool) {
    let shadows = take_prepared_shadows(xid);
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
            pg_sys::TransactionIdGetCommitTsData(
                pg_sys::TransactionId::from(xid),
                &mut ts,
                std::ptr::null_mut(),
            );
        }
        (
            (epoch << 32) | u64::from(xid),
            ts,
            pg_sys::GetXLogInsertRecPtr(),
        )
    };
    // SAFETY: the prepared transaction is finished; like the post-commit path, the wait for the
    // destination must not be turned into an ERROR by a cancel (the statement succeeded).
    unsafe { pg_sys::InterruptHoldoffCount += 1 };
    for (migration_id, endpoint) in shadows {
        let v = Validated {
            migration_id,
            gid: shadow_gid(migration_id, fxid),
            endpoint,
            xid,
        };
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
    // Interrupts are held here (the transaction is over): a bounded wait
    // (remus.resolve_timeout), never an ERROR. Past it the coordinator's periodic resolver
    // finishes the shadow by this transaction's fate (review F6).
    let timeout = Duration::from_millis(crate::guc::RESOLVE_TIMEOUT_MS.get().max(1) as u64);
    let outcome = block_on(async move {
        let mut client = client_for(&endpoint)?;
        Ok::<_, RemusError>(tokio::time::timeout(timeout, client.resolve(request)).await)
    });
    let failure = match outcome {
        Ok(Ok(Ok(Ok(_)))) => None,
        Ok(Ok(Ok(Err(status)))) => Some(status.message().to_string()),
        Ok(Ok(Err(_))) => Some(format!(
            "no answer within {} ms (remus.resolve_timeout)",
            timeout.as_millis()
        )),
        Ok(Err(e)) | Err(e) => Some(e.to_string()),
    };
    if let Some(why) = failure {
        forget_client(&v.endpoint);
        let what = if commit { "committed" } else { "rolled back" };
        warning!(
            "pg_remus: shadow transaction {} of shard migration {} could not be {what} on the destination yet ({why}); the migration's periodic resolver finishes it by this transaction's fate",
            v.gid,
            v.migration_id
        );
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn synchronous_commit() -> String {
        Spi::get_one::<String>("SHOW synchronous_commit")
            .unwrap()
            .unwrap()
    }

    /// Validation forces synchronous_commit on for the transaction, but never below what the
    /// session asked for (review F19).
    #[pg_test]
    fn forcing_synchronous_commit_never_weakens_it() {
        for (set, forced) in [
            ("off", "on"),
            ("local", "on"),
            ("on", "on"),
            ("remote_apply", "remote_apply"),
        ] {
            Spi::run(&format!("SET LOCAL synchronous_commit = {set}")).unwrap();
            super::force_synchronous_commit();
            assert_eq!(synchronous_commit(), forced, "from {set}");
        }
    }
}
