//! The node-side primitives a migration's handover uses, kept in shared memory so every backend
//! of the node obeys them at its next statement. The coordinator's driver decides when to use
//! them (see docs/ARCHITECTURE.md, "The migration pipeline"); nothing here knows about phases.
//!
//! - Registration (`remus.migration_begin` … `remus.migration_end`): while a migration runs, DDL
//!   on its shard tables and on their distributed tables fails with 55006, because a shard whose
//!   schema changes under the copy and the replay would silently diverge.
//! - Fence (`remus.migration_fence`): once ownership has moved (or is about to), a write that
//!   still reaches the source's shard table was routed with a stale map; it fails with 40001 so
//!   the client retries on the new owner, and is counted as aborted by the migration.
//! - Writer abort (`remus.abort_shard_writers`, lock_abort): the backends holding a write lock on
//!   the shard are cancelled; the cancel they get is turned into 40001 (retryable) and counted.
//!   A victim idle in its transaction ignores a cancel, so its next statement raises instead.
//! - Admission gate (`remus.close_gate` / `remus.open_gate`, wait_remaster): client
//!   transactions that start after the gate closed wait at their next statement; transactions
//!   already running (and 2PC participants working for them) are never held.
//!
//! Every session of the migration machinery (`remus.migration_session`) is exempt from all four.
//! The state lives only in shared memory: a node restart clears it (the coordinator's record in
//! etcd says what was going on).

use std::sync::atomic::{AtomicU32, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, pg_sys, PGRXSharedMemory, PgAtomic, PgLwLock};

use crate::error::RemusError;

const MAX_SHARDS: usize = 512;
const SIGINT: i32 = 2;

extern "C" {
    /// POSIX kill(2).
    fn kill(pid: i32, sig: i32) -> i32;
}
const MAX_MIGRATIONS: usize = 64;
const MAX_VICTIMS: usize = 512;
/// How long a gated backend sleeps between looks at the gate.
const GATE_POLL_MS: i64 = 2;

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct ShardEntry {
    /// 0: free.
    migration_id: i64,
    shard_id: i64,
}

/// Longest replay worker endpoint kept in shared memory (e.g. `http://127.0.0.1:16104`).
const ENDPOINT_BYTES: usize = 128;
/// Backends tracked by the sync barrier's "in async commit" marks, by `pgprocno`.
const MAX_PROCS: usize = 2048;

#[derive(Clone, Copy)]
#[repr(C)]
struct MigrationEntry {
    /// 0: free.
    migration_id: i64,
    fenced: bool,
    aborts: u64,
    /// Remus mode: writes on the migration's shard tables are captured (write sets for MOCC).
    capture: bool,
    /// Remus mode: the sync barrier is set; commits that wrote the shards validate on the
    /// destination first (dual execution).
    sync: bool,
    /// The replay worker that validates this migration's sync commits (NUL-padded).
    endpoint: [u8; ENDPOINT_BYTES],
    /// Remus mode, from Tm until the migration ends: the node the shards left (NUL-padded).
    /// A write routed to them elsewhere first waits there for the row's older writers.
    drain_source: [u8; NODE_NAME_BYTES],
}

/// Longest node name kept in shared memory.
const NODE_NAME_BYTES: usize = 64;

fn padded_text(bytes: &[u8]) -> String {
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

impl MigrationEntry {
    fn endpoint(&self) -> String {
        padded_text(&self.endpoint)
    }

    fn drain_source(&self) -> Option<String> {
        Some(padded_text(&self.drain_source)).filter(|s| !s.is_empty())
    }
}

impl Default for MigrationEntry {
    fn default() -> Self {
        Self {
            migration_id: 0,
            fenced: false,
            aborts: 0,
            capture: false,
            sync: false,
            endpoint: [0; ENDPOINT_BYTES],
            drain_source: [0; NODE_NAME_BYTES],
        }
    }
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Victim {
    /// 0: free.
    migration_id: i64,
    pid: i32,
    backend_id: i32,
    lxid: u32,
    /// The marked transaction ended before its cancel took effect; the cancel may still reach
    /// the backend's next transaction (signals are asynchronous), where it is rewritten too.
    stray: bool,
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Gate {
    /// 0: open.
    migration_id: i64,
    closed_at: pg_sys::TimestampTz,
    deadline: pg_sys::TimestampTz,
}

/// Prepared source transactions (2PC participants) whose shadows are prepared on a destination,
/// so the session that finishes one can finish its shadows too (read-your-writes).
const MAX_PREPARED_SHADOWS: usize = 256;

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct PreparedShadow {
    /// 0: free.
    migration_id: i64,
    xid: u32,
}

#[derive(Clone, Copy)]
#[repr(C)]
struct HandoverState {
    shards: [ShardEntry; MAX_SHARDS],
    migrations: [MigrationEntry; MAX_MIGRATIONS],
    victims: [Victim; MAX_VICTIMS],
    gate: Gate,
    /// Sync barrier marks, by pgprocno: non-zero (a per-backend sequence number) while that
    /// backend commits a transaction that wrote a capturing shard in async mode. The barrier
    /// waits for the marks it saw when it set sync mode to change (TS_unsync drained).
    async_commit: [u64; MAX_PROCS],
    prepared_shadows: [PreparedShadow; MAX_PREPARED_SHADOWS],
}

impl Default for HandoverState {
    fn default() -> Self {
        Self {
            shards: [ShardEntry::default(); MAX_SHARDS],
            migrations: [MigrationEntry::default(); MAX_MIGRATIONS],
            victims: [Victim::default(); MAX_VICTIMS],
            gate: Gate::default(),
            async_commit: [0; MAX_PROCS],
            prepared_shadows: [PreparedShadow::default(); MAX_PREPARED_SHADOWS],
        }
    }
}

// SAFETY: plain-old-data (integers and bools), no pointers: valid in every process.
unsafe impl PGRXSharedMemory for HandoverState {}

static STATE: PgLwLock<HandoverState> = unsafe { PgLwLock::new(c"remus_handover_state") };
/// Non-zero while anything above is in use: the per-statement checks then take the lock; when
/// zero (the normal case) they cost one atomic load.
static ACTIVE: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_handover_active") };

pub fn init_shmem() {
    pg_shmem_init!(STATE);
    pg_shmem_init!(ACTIVE);
}

fn recount(s: &HandoverState) {
    let n = s.migrations.iter().filter(|m| m.migration_id != 0).count()
        + s.victims.iter().filter(|v| v.migration_id != 0).count()
        + usize::from(s.gate.migration_id != 0);
    ACTIVE.get().store(n as u32, Ordering::Release);
}

/// Is any migration, victim or gate registered on this node? (One atomic load.)
pub fn active() -> bool {
    ACTIVE.get().load(Ordering::Acquire) != 0
}

fn exempt() -> bool {
    crate::guc::MIGRATION_SESSION.get()
}

fn count_abort(s: &mut HandoverState, migration_id: i64) {
    if let Some(m) = s.migrations.iter_mut().find(|m| m.migration_id == migration_id) {
        m.aborts += 1;
    }
}

/// This backend's (backend id, local transaction id).
fn my_vxid() -> (i32, u32) {
    // SAFETY: MyProc is this backend's own PGPROC, set up before any statement runs.
    unsafe {
        if pg_sys::MyProc.is_null() {
            return (-1, 0);
        }
        ((*pg_sys::MyProc).backendId, (*pg_sys::MyProc).lxid)
    }
}

fn my_pid() -> i32 {
    // SAFETY: process global set at backend start.
    unsafe { pg_sys::MyProcPid }
}

/// At the start of every statement of a client session (planner, ExecutorStart and utility
/// hooks): waits at a closed gate, and fails a transaction that a lock_abort handover aborted
/// while it was idle.
pub fn admit_statement() -> Result<(), RemusError> {
    if !active() || exempt() {
        return Ok(());
    }
    wait_at_gate();
    let (backend_id, lxid) = my_vxid();
    let pid = my_pid();
    let mine = |v: &Victim| {
        v.migration_id != 0 && !v.stray && v.pid == pid && v.backend_id == backend_id && v.lxid == lxid
    };
    // Every statement of the node passes here while a migration is registered: look under the
    // shared lock, take the exclusive one only to consume this backend's own mark.
    if !STATE.share().victims.iter().any(mine) {
        return Ok(());
    }
    let mut s = STATE.exclusive();
    if let Some(v) = s.victims.iter_mut().find(|v| mine(v)) {
        let migration_id = v.migration_id;
        *v = Victim::default();
        count_abort(&mut s, migration_id);
        recount(&s);
        return Err(RemusError::AbortedByMigration { migration_id });
    }
    Ok(())
}

fn wait_at_gate() {
    // SAFETY: reading process globals of this backend.
    let client = unsafe { pg_sys::MyBackendType == pg_sys::BackendType::B_BACKEND };
    if !client || crate::guc::FORWARDED.get() {
        return;
    }
    // SAFETY: we are inside a transaction whenever a statement runs.
    let xact_start = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
    loop {
        let gate = STATE.share().gate;
        if gate.migration_id == 0 || xact_start < gate.closed_at {
            return;
        }
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        if now >= gate.deadline {
            // The gate reopens by itself: the first backend to see its timeout clears it, so
            // later statements pass without waiting (or warning).
            {
                let mut s = STATE.exclusive();
                if s.gate.migration_id == gate.migration_id && s.gate.closed_at == gate.closed_at {
                    s.gate = Gate::default();
                    recount(&s);
                }
            }
            warning!(
                "the admission gate of shard migration {} stayed closed past its timeout; going on",
                gate.migration_id
            );
            return;
        }
        // SAFETY: waiting on this backend's own latch with a timeout, as PostgreSQL's own
        // waits do; interrupts are processed right after.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                GATE_POLL_MS as _,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        check_for_interrupts!();
    }
}

/// At the end of every transaction (commit, abort, prepare): the marks of this backend's
/// transaction go away; a mark never outlives the transaction it was made for.
pub fn end_of_transaction() {
    if !active() {
        return;
    }
    let pid = my_pid();
    let mut s = STATE.exclusive();
    let mut changed = false;
    for v in s.victims.iter_mut().filter(|v| v.migration_id != 0 && v.pid == pid) {
        changed = true;
        if v.stray {
            // It covered the transaction after the marked one; that one is over too.
            *v = Victim::default();
        } else {
            // The marked transaction ends without having been failed: its cancel was signalled
            // while it was live (see `abort_shard_writers`) and is pending or lost; drop it,
            // and keep a stray mark in case the signal lands only in the next transaction.
            // SAFETY: this backend's own interrupt flag; clearing a cancel of a statement that
            // is over is what PostgreSQL does itself when a cancel arrives while idle.
            unsafe { pg_sys::QueryCancelPending = 0 };
            v.stray = true;
        }
    }
    if changed {
        recount(&s);
    }
}

/// The handover functions are the migration machinery's: superuser only (whatever the grants).
fn require_superuser(function: &str) {
    // SAFETY: catalog lookup for the current user, inside a transaction.
    if !unsafe { pg_sys::superuser() } {
        RemusError::InsufficientPrivilege(format!("permission denied for function {function}: superuser required")).raise();
    }
}

/// The registered migration of `shard_id`, if any.
fn migration_of(s: &HandoverState, shard_id: i64) -> Option<i64> {
    s.shards.iter().find(|e| e.migration_id != 0 && e.shard_id == shard_id).map(|e| e.migration_id)
}

/// Before a write (INSERT/UPDATE/DELETE/COPY FROM) on shard tables `shard_ids` of this node:
/// fails it if one of them is fenced.
pub fn check_write(shard_ids: &[i64]) -> Result<(), RemusError> {
    if !active() || exempt() || shard_ids.is_empty() {
        return Ok(());
    }
    let moved = {
        let s = STATE.share();
        shard_ids.iter().find_map(|&shard_id| {
            let migration_id = migration_of(&s, shard_id)?;
            s.migrations
                .iter()
                .any(|m| m.migration_id == migration_id && m.fenced)
                .then_some((shard_id, migration_id))
        })
    };
    match moved {
        Some((shard_id, migration_id)) => {
            count_abort(&mut STATE.exclusive(), migration_id);
            Err(RemusError::ShardMoved { shard_id, migration_id })
        }
        None => Ok(()),
    }
}

/// Before DDL on a relation: `shard_ids` are the shards the relation is (a shard table) or has
/// (a distributed table). Refused while one of them is migrating.
pub fn check_ddl(table: &str, shard_ids: &[i64]) -> Result<(), RemusError> {
    if !active() || exempt() {
        return Ok(());
    }
    let s = STATE.share();
    for &shard_id in shard_ids {
        if let Some(migration_id) = migration_of(&s, shard_id) {
            return Err(RemusError::ObjectInUse(format!(
                "table {table} is being migrated by shard migration {migration_id} (shard {shard_id}); retry the DDL when it has ended"
            )));
        }
    }
    Ok(())
}

/// emit_log_hook: a query cancel that a lock_abort handover sent becomes a retryable 40001 for
/// the client, and is counted. Returns the migration if `edata` was rewritten.
///
/// # Safety
/// `edata` must be the ErrorData being emitted.
pub unsafe fn rewrite_cancel(edata: *mut pg_sys::ErrorData) -> Option<i64> {
    if edata.is_null() || !active() {
        return None;
    }
    if (*edata).sqlerrcode != PgSqlErrorCode::ERRCODE_QUERY_CANCELED as i32 || (*edata).elevel < PgLogLevel::ERROR as i32 {
        return None;
    }
    let pid = my_pid();
    // Still the victim's transaction: the hook runs before the abort is processed.
    let (backend_id, lxid) = my_vxid();
    let migration_id = {
        // Never re-entered while this backend holds the lock: LWLockAcquire holds off
        // interrupts until the release, so no cancel can be raised in between, and every
        // other error path here drops the guard before raising.
        let mut s = STATE.exclusive();
        let v = s
            .victims
            .iter_mut()
            .find(|v| v.migration_id != 0 && v.pid == pid && (v.stray || (v.backend_id == backend_id && v.lxid == lxid)))?;
        let migration_id = v.migration_id;
        *v = Victim::default();
        count_abort(&mut s, migration_id);
        recount(&s);
        migration_id
    };
    let message = RemusError::AbortedByMigration { migration_id }.to_string();
    let c = std::ffi::CString::new(message).ok()?;
    (*edata).sqlerrcode = PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE as i32;
    (*edata).message = pg_sys::MemoryContextStrdup(pg_sys::ErrorContext, c.as_ptr());
    Some(migration_id)
}

/// The migration capturing writes on `shard_id`, if any (the write-set trigger's question).
pub fn capturing_migration(shard_id: i64) -> Option<i64> {
    if !active() {
        return None;
    }
    let s = STATE.share();
    let migration_id = migration_of(&s, shard_id)?;
    s.migrations.iter().any(|m| m.migration_id == migration_id && m.capture).then_some(migration_id)
}

/// The node `shard_id` is leaving, while its migration (Remus mode) is between Tm and its end:
/// a write routed to the shard on another node waits there first for the row's writers that
/// predate Tm ([`crate::router::drain_fence`]).
pub fn drain_source_of(shard_id: i64) -> Option<String> {
    if !active() {
        return None;
    }
    let s = STATE.share();
    let migration_id = migration_of(&s, shard_id)?;
    s.migrations.iter().find(|m| m.migration_id == migration_id)?.drain_source()
}

/// How a transaction that wrote a capturing shard of a migration commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitMode {
    /// Async mode: commit as usual; the stream carries the change.
    Async,
    /// Sync mode: validate on the destination through this replay worker first.
    Sync { endpoint: String },
    /// The migration is gone (ended or rolled back): nothing to do.
    Gone,
}

/// This backend's pgprocno (index of its PGPROC), for the barrier marks.
fn my_procno() -> Option<usize> {
    // SAFETY: MyProc is this backend's own PGPROC once it runs transactions.
    let procno = unsafe { if pg_sys::MyProc.is_null() { return None } else { (*pg_sys::MyProc).pgprocno } };
    usize::try_from(procno).ok().filter(|&p| p < MAX_PROCS)
}

thread_local! {
    static MARK_SEQ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// At pre-commit (or pre-prepare) of a transaction that wrote capturing shards of
/// `migrations`: reads each one's mode and, when any is async, marks this backend "in async
/// commit" under the same lock, so the barrier either sees the mark or this backend sees sync
/// (the Dekker pairing of the paper's barrier, made trivial by the lock). The mark stays until
/// [`leave_commit`] at the end of the transaction.
pub fn enter_commit(migrations: &[i64]) -> Vec<(i64, CommitMode)> {
    let mut s = STATE.exclusive();
    let mut modes = Vec::with_capacity(migrations.len());
    let mut mark = false;
    for &migration_id in migrations {
        let mode = match s.migrations.iter().find(|m| m.migration_id == migration_id && m.capture) {
            None => CommitMode::Gone,
            Some(m) if m.sync => CommitMode::Sync { endpoint: m.endpoint() },
            Some(_) => {
                mark = true;
                CommitMode::Async
            }
        };
        modes.push((migration_id, mode));
    }
    if mark {
        if let Some(procno) = my_procno() {
            let seq = MARK_SEQ.with(|c| {
                c.set(c.get() + 1);
                c.get()
            });
            s.async_commit[procno] = seq;
        }
    }
    modes
}

/// At the end of the transaction: clears this backend's barrier mark.
pub fn leave_commit() {
    if let Some(procno) = my_procno() {
        if STATE.share().async_commit[procno] != 0 {
            STATE.exclusive().async_commit[procno] = 0;
        }
    }
}

/// A transaction validated for `migrations` was prepared as `xid` (a 2PC participant). With no
/// free slot it is not noted: the stream and the migration's cleanup finish its shadows then.
pub fn note_prepared_shadows(xid: u32, migrations: &[i64]) {
    let mut s = STATE.exclusive();
    for &migration_id in migrations {
        if let Some(slot) = s.prepared_shadows.iter_mut().find(|p| p.migration_id == 0) {
            *slot = PreparedShadow { migration_id, xid };
        }
    }
}

/// Is any prepared transaction noted by [`note_prepared_shadows`]? (Cheap enough per COMMIT
/// PREPARED: only taken while a migration is registered here.)
pub fn any_prepared_shadows() -> bool {
    active() && STATE.share().prepared_shadows.iter().any(|p| p.migration_id != 0)
}

/// Removes the notes of prepared transaction `xid`; returns, per migration still in sync mode,
/// its replay worker endpoint.
pub fn take_prepared_shadows(xid: u32) -> Vec<(i64, String)> {
    let mut s = STATE.exclusive();
    let mut taken = Vec::new();
    for i in 0..MAX_PREPARED_SHADOWS {
        let p = s.prepared_shadows[i];
        if p.migration_id == 0 || p.xid != xid {
            continue;
        }
        s.prepared_shadows[i] = PreparedShadow::default();
        if let Some(m) = s.migrations.iter().find(|m| m.migration_id == p.migration_id && m.capture) {
            taken.push((p.migration_id, m.endpoint()));
        }
    }
    taken
}

/// Counts a transaction the migration aborted on this node (a MOCC conflict).
pub fn count_migration_abort(migration_id: i64) {
    count_abort(&mut STATE.exclusive(), migration_id);
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use super::*;

    /// Remus mode: from now on writes on the migration's shard tables on this node are
    /// captured as write sets, to be validated through the replay worker at `endpoint` once the
    /// sync barrier is set. The migration must be registered. Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_capture(migration_id: i64, endpoint: &str) {
        require_superuser("remus.migration_capture");
        if endpoint.is_empty() || endpoint.len() >= ENDPOINT_BYTES {
            RemusError::InvalidArgument(format!("replay worker endpoint must be 1..{} bytes", ENDPOINT_BYTES - 1)).raise();
        }
        let mut s = STATE.exclusive();
        match s.migrations.iter_mut().find(|m| m.migration_id == migration_id) {
            Some(m) => {
                m.capture = true;
                m.endpoint = [0; ENDPOINT_BYTES];
                m.endpoint[..endpoint.len()].copy_from_slice(endpoint.as_bytes());
            }
            None => {
                drop(s);
                RemusError::InvalidArgument(format!("migration {migration_id} is not registered on this node")).raise()
            }
        }
    }

    /// Remus mode, at Tm: from now until `migration_end`, a write routed to one of the
    /// migration's shards on a node other than `source_node` first waits on `source_node` for
    /// the transactions there that hold the row (they predate Tm), so it follows them the way
    /// a READ COMMITTED writer follows an older one on a single node, instead of leaving them a
    /// write-write conflict. The migration must be registered. Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_drain_source(migration_id: i64, source_node: &str) {
        require_superuser("remus.migration_drain_source");
        if source_node.is_empty() || source_node.len() >= NODE_NAME_BYTES {
            RemusError::InvalidArgument(format!("node name must be 1..{} bytes", NODE_NAME_BYTES - 1)).raise();
        }
        let mut s = STATE.exclusive();
        match s.migrations.iter_mut().find(|m| m.migration_id == migration_id) {
            Some(m) => {
                m.drain_source = [0; NODE_NAME_BYTES];
                m.drain_source[..source_node.len()].copy_from_slice(source_node.as_bytes());
            }
            None => {
                drop(s);
                RemusError::InvalidArgument(format!("migration {migration_id} is not registered on this node")).raise()
            }
        }
    }

    /// The sync barrier (Remus mode): switches the migration to sync mode, then waits until
    /// every transaction that was committing in async mode at that moment (TS_unsync) has
    /// finished, and returns LSN_unsync, the WAL insert position after them (as a bigint). Commits that start
    /// from now on validate on the destination; nothing is blocked while the mode changes.
    #[pg_extern(volatile, parallel_unsafe)]
    fn sync_barrier(migration_id: i64) -> i64 {
        require_superuser("remus.sync_barrier");
        let marked: Vec<(usize, u64)> = {
            let mut s = STATE.exclusive();
            match s.migrations.iter_mut().find(|m| m.migration_id == migration_id && m.capture) {
                Some(m) => m.sync = true,
                None => {
                    drop(s);
                    RemusError::InvalidArgument(format!("migration {migration_id} does not capture writes on this node")).raise()
                }
            }
            s.async_commit.iter().enumerate().filter(|(_, &v)| v != 0).map(|(i, &v)| (i, v)).collect()
        };
        // TS_unsync: each marked backend clears (or renews) its mark when its commit is over.
        let mut waiting = marked;
        while !waiting.is_empty() {
            {
                let s = STATE.share();
                waiting.retain(|&(procno, seq)| s.async_commit[procno] == seq);
            }
            if waiting.is_empty() {
                break;
            }
            // SAFETY: a short sleep on this backend's own latch, interrupts served after.
            unsafe {
                pg_sys::WaitLatch(
                    pg_sys::MyLatch,
                    (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                    1,
                    pg_sys::PG_WAIT_EXTENSION,
                );
                pg_sys::ResetLatch(pg_sys::MyLatch);
            }
            check_for_interrupts!();
        }
        // SAFETY: reads the shared WAL insert position.
        unsafe { pg_sys::GetXLogInsertRecPtr() as i64 }
    }

    /// Registers a migration's shards on this node (DDL on them is refused until
    /// `migration_end`). Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_begin(migration_id: i64, shard_ids: Vec<i64>) {
        require_superuser("remus.migration_begin");
        if migration_id <= 0 {
            RemusError::InvalidArgument(format!("invalid migration id {migration_id}")).raise();
        }
        let mut s = STATE.exclusive();
        // Refuse before changing anything.
        if let Some((shard_id, other)) = shard_ids
            .iter()
            .find_map(|&id| migration_of(&s, id).filter(|&m| m != migration_id).map(|m| (id, m)))
        {
            drop(s);
            RemusError::ObjectInUse(format!("shard {shard_id} is already registered by migration {other}")).raise();
        }
        if !s.migrations.iter().any(|m| m.migration_id == migration_id) {
            let Some(slot) = s.migrations.iter_mut().find(|m| m.migration_id == 0) else {
                drop(s);
                RemusError::ObjectInUse(format!("too many concurrent migrations on this node (at most {MAX_MIGRATIONS})")).raise()
            };
            *slot = MigrationEntry { migration_id, ..MigrationEntry::default() };
        }
        for shard_id in shard_ids {
            if migration_of(&s, shard_id).is_some() {
                continue;
            }
            let Some(slot) = s.shards.iter_mut().find(|e| e.migration_id == 0) else {
                drop(s);
                RemusError::ObjectInUse(format!("too many migrating shards on this node (at most {MAX_SHARDS})")).raise()
            };
            *slot = ShardEntry { migration_id, shard_id };
        }
        recount(&s);
    }

    /// From now on a write that reaches one of the migration's shard tables on this node fails
    /// with 40001 and is counted.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_fence(migration_id: i64) {
        require_superuser("remus.migration_fence");
        let mut s = STATE.exclusive();
        match s.migrations.iter_mut().find(|m| m.migration_id == migration_id) {
            Some(m) => m.fenced = true,
            None => {
                drop(s);
                RemusError::InvalidArgument(format!("migration {migration_id} is not registered on this node")).raise()
            }
        }
    }

    /// Transactions this node counted as aborted by the migration so far.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_aborts(migration_id: i64) -> i64 {
        require_superuser("remus.migration_aborts");
        STATE
            .share()
            .migrations
            .iter()
            .find(|m| m.migration_id == migration_id)
            .map(|m| m.aborts as i64)
            .unwrap_or(0)
    }

    /// Clears everything of the migration on this node; returns its abort count. Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_end(migration_id: i64) -> i64 {
        require_superuser("remus.migration_end");
        let mut s = STATE.exclusive();
        let mut aborts = 0;
        for m in s.migrations.iter_mut().filter(|m| m.migration_id == migration_id) {
            aborts += m.aborts as i64;
            *m = MigrationEntry::default();
        }
        for e in s.shards.iter_mut().filter(|e| e.migration_id == migration_id) {
            *e = ShardEntry::default();
        }
        for v in s.victims.iter_mut().filter(|v| v.migration_id == migration_id) {
            *v = Victim::default();
        }
        for p in s.prepared_shadows.iter_mut().filter(|p| p.migration_id == migration_id) {
            *p = PreparedShadow::default();
        }
        if s.gate.migration_id == migration_id {
            s.gate = Gate::default();
        }
        recount(&s);
        aborts
    }

    /// lock_abort: cancels every other backend holding a write lock (RowExclusiveLock or
    /// stronger) on `relids`, after marking its transaction as a victim of the migration (its
    /// cancel becomes 40001; idle in transaction, its next statement fails). Returns how many
    /// were signalled. Prepared transactions are not backends and are left to finish.
    #[pg_extern(volatile, parallel_unsafe)]
    fn abort_shard_writers(migration_id: i64, relids: Vec<pg_sys::Oid>) -> i32 {
        require_superuser("remus.abort_shard_writers");
        let holders: Vec<(i32, i32, u32)> = Spi::connect(|c| {
            c.select(
                // Client backends only: a prepared transaction has no pid, and autovacuum's
                // ShareUpdateExclusiveLock is no client's write.
                "SELECT DISTINCT l.pid, split_part(l.virtualtransaction, '/', 1)::int,
                        split_part(l.virtualtransaction, '/', 2)::bigint
                   FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                  WHERE l.relation = ANY($1) AND l.granted AND l.pid IS NOT NULL
                    AND l.pid <> pg_backend_pid() AND a.backend_type = 'client backend'
                    AND l.mode NOT IN ('AccessShareLock', 'RowShareLock')",
                None,
                &[relids.into()],
            )?
            .map(|r| Ok((r.get::<i32>(1)?.unwrap_or(0), r.get::<i32>(2)?.unwrap_or(-1), r.get::<i64>(3)?.unwrap_or(0) as u32)))
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()
        })
        .unwrap_or_else(|e| RemusError::from(e).raise());
        // Mark and signal under the lock, and only a transaction still live in its PGPROC: a
        // victim's end-of-transaction bookkeeping (which needs this lock) then always runs after
        // its signal was sent, so a cancel never outlives the transaction it was meant for
        // unnoticed (`end_of_transaction`).
        let mut signalled = 0;
        let mut s = STATE.exclusive();
        for &(pid, backend_id, lxid) in &holders {
            // SAFETY: looks up a PGPROC in the proc array (takes ProcArrayLock itself); the
            // two fields are plain integers, read once.
            let live = unsafe {
                let proc = pg_sys::BackendPidGetProc(pid);
                !proc.is_null() && (*proc).backendId == backend_id && (*proc).lxid == lxid
            };
            if !live || s.victims.iter().any(|v| !v.stray && v.pid == pid && v.backend_id == backend_id && v.lxid == lxid) {
                continue;
            }
            let Some(slot) = s.victims.iter_mut().find(|v| v.migration_id == 0) else { break };
            *slot = Victim { migration_id, pid, backend_id, lxid, stray: false };
            // What pg_cancel_backend() sends (the backend's whole process group), without SPI
            // under the lock. SAFETY: signalling a live backend of this cluster.
            if unsafe { kill(-pid, SIGINT) } == 0 || unsafe { kill(pid, SIGINT) } == 0 {
                signalled += 1;
            }
        }
        recount(&s);
        drop(s);
        signalled
    }

    /// wait_remaster: client transactions that start from now on wait at their next statement
    /// until `open_gate` or `timeout_ms` pass. Returns when the gate closed.
    #[pg_extern(volatile, parallel_unsafe)]
    fn close_gate(migration_id: i64, timeout_ms: i32) -> TimestampWithTimeZone {
        require_superuser("remus.close_gate");
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let mut s = STATE.exclusive();
        if s.gate.migration_id != 0 && s.gate.migration_id != migration_id && now < s.gate.deadline {
            let other = s.gate.migration_id;
            drop(s);
            RemusError::ObjectInUse(format!("the admission gate is held by migration {other}")).raise();
        }
        s.gate = Gate {
            migration_id,
            closed_at: now,
            deadline: now + i64::from(timeout_ms.max(0)) * 1000,
        };
        recount(&s);
        TimestampWithTimeZone::try_from(now).unwrap_or_else(|_| TimestampWithTimeZone::positive_infinity())
    }

    #[pg_extern(volatile, parallel_unsafe)]
    fn open_gate(migration_id: i64) {
        require_superuser("remus.open_gate");
        let mut s = STATE.exclusive();
        if s.gate.migration_id == migration_id {
            s.gate = Gate::default();
        }
        recount(&s);
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// Runs `sql` and returns "ok", or "SQLSTATE: message" of the error it raised (caught in a
    /// subtransaction, so the test goes on).
    fn outcome(sql: &str) -> String {
        Spi::run(
            "CREATE OR REPLACE FUNCTION pg_temp.outcome(q text) RETURNS text LANGUAGE plpgsql AS $$
             BEGIN EXECUTE q; RETURN 'ok';
             EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE || ': ' || SQLERRM; END $$",
        )
        .unwrap();
        Spi::get_one_with_args::<String>("SELECT pg_temp.outcome($1)", &[sql.into()]).unwrap().unwrap()
    }

    fn aborts(migration_id: i64) -> i64 {
        Spi::get_one_with_args::<i64>("SELECT remus.migration_aborts($1)", &[migration_id.into()]).unwrap().unwrap()
    }

    #[pg_test]
    fn registration_is_idempotent_and_end_clears_it() {
        Spi::run("SELECT remus.migration_begin(9001, ARRAY[900101, 900102])").unwrap();
        Spi::run("SELECT remus.migration_begin(9001, ARRAY[900101, 900102])").unwrap();
        assert_eq!(aborts(9001), 0);
        assert!(outcome("SELECT remus.migration_begin(9011, ARRAY[900102])").starts_with("55006: shard 900102 is already registered by migration 9001"));
        assert_eq!(Spi::get_one::<i64>("SELECT remus.migration_end(9001)").unwrap(), Some(0));
        assert_eq!(Spi::get_one::<i64>("SELECT remus.migration_end(9001)").unwrap(), Some(0));
        assert_eq!(Spi::get_one::<i64>("SELECT remus.migration_end(9999)").unwrap(), Some(0));
        // The shards are free again.
        assert_eq!(outcome("SELECT remus.migration_begin(9011, ARRAY[900102])"), "ok");
        Spi::run("SELECT remus.migration_end(9011)").unwrap();
        assert!(outcome("SELECT remus.migration_fence(9001)").starts_with("22023: migration 9001 is not registered"));
    }

    #[pg_test]
    fn capture_needs_registration_and_the_barrier_needs_capture() {
        assert!(outcome("SELECT remus.migration_capture(9101, 'http://127.0.0.1:1')").starts_with("22023: migration 9101 is not registered"));
        Spi::run("SELECT remus.migration_begin(9101, ARRAY[910101])").unwrap();
        assert!(outcome("SELECT remus.sync_barrier(9101)").starts_with("22023: migration 9101 does not capture writes"));
        assert!(outcome("SELECT remus.migration_capture(9101, '')").starts_with("22023: replay worker endpoint must be"));
        Spi::run("SELECT remus.migration_capture(9101, 'http://127.0.0.1:1')").unwrap();
        // Nobody is committing in async mode: the barrier returns the insert position at once.
        let lsn = Spi::get_one::<i64>("SELECT remus.sync_barrier(9101)").unwrap().unwrap();
        let now = Spi::get_one::<i64>("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint").unwrap();
        assert!(lsn > 0 && Some(lsn) <= now, "{lsn} vs {now:?}");
        Spi::run("SELECT remus.migration_end(9101)").unwrap();
    }

    #[pg_test]
    fn drain_source_needs_registration_and_ends_with_the_migration() {
        assert!(outcome("SELECT remus.migration_drain_source(9201, 'n1')").starts_with("22023: migration 9201 is not registered"));
        Spi::run("SELECT remus.migration_begin(9201, ARRAY[920101])").unwrap();
        assert_eq!(super::drain_source_of(920101), None);
        assert!(outcome("SELECT remus.migration_drain_source(9201, '')").starts_with("22023: node name must be"));
        Spi::run("SELECT remus.migration_drain_source(9201, 'n1')").unwrap();
        assert_eq!(super::drain_source_of(920101).as_deref(), Some("n1"));
        assert_eq!(super::drain_source_of(920102), None, "another shard is not draining");
        Spi::run("SELECT remus.migration_end(9201)").unwrap();
        assert_eq!(super::drain_source_of(920101), None);
    }

    #[pg_test]
    fn capture_trigger_is_inert_without_a_capturing_migration() {
        Spi::run("CREATE TABLE remus_shards.cap_910201 (id int PRIMARY KEY, v text)").unwrap();
        Spi::run(&crate::mocc::capture_trigger_ddl("remus_shards.cap_910201", 910201)).unwrap();
        Spi::run("INSERT INTO remus_shards.cap_910201 VALUES (1, 'a')").unwrap();
        Spi::run("UPDATE remus_shards.cap_910201 SET v = 'b'").unwrap();
        Spi::run("DELETE FROM remus_shards.cap_910201").unwrap();
        assert_eq!(crate::mocc::captured_changes(), 0);
        // Registered and capturing: each row change is in this transaction's write set.
        Spi::run("SELECT remus.migration_begin(9102, ARRAY[910201])").unwrap();
        Spi::run("SELECT remus.migration_capture(9102, 'http://127.0.0.1:1')").unwrap();
        Spi::run("INSERT INTO remus_shards.cap_910201 VALUES (2, 'c'), (3, NULL)").unwrap();
        Spi::run("UPDATE remus_shards.cap_910201 SET v = 'd' WHERE id = 2").unwrap();
        assert_eq!(crate::mocc::captured_changes(), 3);
        Spi::run("SELECT remus.migration_end(9102)").unwrap();
    }

    #[pg_test]
    fn fence_fails_writes_with_40001_and_counts_them() {
        Spi::run("CREATE TABLE remus_shards.fenced_900201 (id int PRIMARY KEY, v int)").unwrap();
        Spi::run("INSERT INTO remus_shards.fenced_900201 VALUES (1, 1)").unwrap();
        Spi::run("SELECT remus.migration_begin(9002, ARRAY[900201])").unwrap();
        // Registered but not fenced: writes go on.
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 2"), "ok");
        Spi::run("SELECT remus.migration_fence(9002)").unwrap();
        let moved = "40001: shard 900201 was moved by shard migration 9002; retry the transaction";
        assert_eq!(outcome("INSERT INTO remus_shards.fenced_900201 VALUES (2, 2)"), moved);
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 3"), moved);
        assert_eq!(outcome("DELETE FROM remus_shards.fenced_900201"), moved);
        // Reads are not fenced, and the migration's own sessions are exempt.
        assert_eq!(Spi::get_one::<i32>("SELECT v FROM remus_shards.fenced_900201").unwrap(), Some(2));
        assert_eq!(aborts(9002), 3);
        Spi::run("SET LOCAL remus.migration_session = on").unwrap();
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 4"), "ok");
        Spi::run("SET LOCAL remus.migration_session = off").unwrap();
        assert_eq!(Spi::get_one::<i64>("SELECT remus.migration_end(9002)").unwrap(), Some(3));
        assert_eq!(aborts(9002), 0);
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 5"), "ok");
    }

    #[pg_test]
    fn ddl_on_a_registered_shard_is_refused_until_the_end() {
        Spi::run("CREATE TABLE remus_shards.ddl_900301 (id int PRIMARY KEY, v int)").unwrap();
        Spi::run("SELECT remus.migration_begin(9003, ARRAY[900301])").unwrap();
        for ddl in [
            "ALTER TABLE remus_shards.ddl_900301 ADD COLUMN z int",
            "CREATE INDEX ON remus_shards.ddl_900301 (v)",
            "TRUNCATE remus_shards.ddl_900301",
            "ALTER TABLE remus_shards.ddl_900301 RENAME TO ddl_x",
            "DROP TABLE remus_shards.ddl_900301",
        ] {
            let o = outcome(ddl);
            assert!(
                o.starts_with("55006: table remus_shards.ddl_900301 is being migrated by shard migration 9003"),
                "{ddl}: {o}"
            );
        }
        Spi::run("SELECT remus.migration_end(9003)").unwrap();
        assert_eq!(outcome("ALTER TABLE remus_shards.ddl_900301 ADD COLUMN z int"), "ok");
    }

    #[pg_test]
    fn gate_is_held_by_one_migration_and_spares_running_transactions() {
        let closed_after_start = Spi::get_one::<bool>("SELECT remus.close_gate(9004, 60000) >= now()").unwrap();
        assert_eq!(closed_after_start, Some(true));
        // This transaction started before the gate closed: it is in flight and goes on.
        assert_eq!(Spi::get_one::<i32>("SELECT 1").unwrap(), Some(1));
        assert!(outcome("SELECT remus.close_gate(9005, 1000)").starts_with("55006: the admission gate is held by migration 9004"));
        // Opening it is the holder's business; closing it again is idempotent.
        Spi::run("SELECT remus.open_gate(9005)").unwrap();
        assert!(outcome("SELECT remus.close_gate(9005, 1000)").starts_with("55006"));
        assert_eq!(outcome("SELECT remus.close_gate(9004, 60000)"), "ok");
        Spi::run("SELECT remus.open_gate(9004)").unwrap();
        assert_eq!(outcome("SELECT remus.close_gate(9005, 1000)"), "ok");
        Spi::run("SELECT remus.open_gate(9005)").unwrap();
    }

    #[pg_test]
    fn abort_shard_writers_leaves_its_own_backend_alone() {
        Spi::run("CREATE TABLE remus_shards.own_900601 (id int)").unwrap();
        Spi::run("INSERT INTO remus_shards.own_900601 VALUES (1)").unwrap();
        let n = Spi::get_one::<i32>("SELECT remus.abort_shard_writers(9006, ARRAY['remus_shards.own_900601'::regclass])").unwrap();
        assert_eq!(n, Some(0));
        assert_eq!(Spi::get_one::<i64>("SELECT remus.migration_end(9006)").unwrap(), Some(0));
    }

    #[pg_test]
    fn handover_functions_are_superuser_only() {
        Spi::run("CREATE ROLE remus_handover_nobody").unwrap();
        // With the schema usable, the refusal is the functions' own.
        Spi::run("GRANT USAGE ON SCHEMA remus TO remus_handover_nobody").unwrap();
        Spi::run("SET LOCAL ROLE remus_handover_nobody").unwrap();
        for q in [
            "SELECT remus.migration_begin(9007, ARRAY[1])",
            "SELECT remus.migration_aborts(9007)",
            "SELECT remus.close_gate(9007, 10)",
            "SELECT remus.abort_shard_writers(9007, ARRAY[]::regclass[])",
            "SELECT remus.migration_drain_source(9007, 'n1')",
        ] {
            let o = outcome(q);
            assert!(o.starts_with("42501: permission denied for function remus."), "{q}: {o}");
        }
        assert!(outcome("SET remus.migration_session = on").starts_with("42501"));
        Spi::run("RESET ROLE").unwrap();
    }

    #[pg_test]
    fn migrate_without_a_coordinator_address_is_refused() {
        let o = outcome("SELECT * FROM remus_migrate_shard(1, 'n2')");
        assert!(o.starts_with("55000: remus.coordinator_address is not set"), "{o}");
        let o = outcome("SELECT * FROM remus_migrations");
        assert!(o.starts_with("55000: remus.coordinator_address is not set"), "{o}");
    }
}
