//! Shared-memory state of the migrations registered on this node, read by every backend at
//! its next statement. Each phase module owns the SQL functions that change its part; the
//! tables and the cheap "anything registered?" check live here.

use std::sync::atomic::{AtomicU32, Ordering};

use pgrx::{pg_sys, PGRXSharedMemory, PgAtomic, PgLwLock};

use crate::error::RemusError;

/// Shards registered by migrations on this node at once.
pub(crate) const MAX_MIGRATING_SHARDS: usize = 512;
pub(crate) const MAX_MIGRATIONS: usize = 64;
pub(crate) const MAX_VICTIMS: usize = 512;

#[derive(Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct ShardEntry {
    /// 0: free.
    pub(crate) migration_id: i64,
    pub(crate) shard_id: i64,
}

/// Longest replay worker endpoint kept in shared memory (e.g. `http://127.0.0.1:16104`).
pub(crate) const ENDPOINT_BYTES: usize = 128;
/// Backends tracked by the sync barrier's "in async commit" marks, by `pgprocno`.
pub(crate) const MAX_PROCS: usize = 2048;

#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct MigrationEntry {
    /// 0: free.
    pub(crate) migration_id: i64,
    pub(crate) fenced: bool,
    pub(crate) aborts: u64,
    /// Remus mode: writes on the migration's shard tables are captured (write sets for MOCC).
    pub(crate) capture: bool,
    /// Remus mode: the sync barrier is set; commits that wrote the shards validate on the
    /// destination first (dual execution).
    pub(crate) sync: bool,
    /// Remus mode: the sync barrier's sync point, once the destination has applied the stream
    /// up to it (`remus.migration_barrier_applied`); 0 before. Every source commit on the
    /// shards after it is validated, so a validation waits for the stream only up to there,
    /// which it has passed unless the replay restarted ([`super::dual`]).
    pub(crate) barrier_lsn: u64,
    /// The replay worker that validates this migration's sync commits (NUL-padded).
    pub(crate) endpoint: [u8; ENDPOINT_BYTES],
    /// Remus mode, from Tm until the migration ends: the node the shards left (NUL-padded).
    /// A write routed to them elsewhere first waits there for the row's older writers.
    pub(crate) drain_source: [u8; NODE_NAME_BYTES],
    /// Put back from its durable copy when this shared memory was created (`super::durable`):
    /// the node restarted during the migration, so its stream and read-through are gone and
    /// `handover::restart` still guards the shards it may be moving away.
    pub(crate) restored: bool,
}

/// Longest node name kept in shared memory.
pub(crate) const NODE_NAME_BYTES: usize = 64;

fn padded_text(bytes: &[u8]) -> String {
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

impl MigrationEntry {
    pub(crate) fn endpoint(&self) -> String {
        padded_text(&self.endpoint)
    }

    pub(crate) fn drain_source(&self) -> Option<String> {
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
            barrier_lsn: 0,
            endpoint: [0; ENDPOINT_BYTES],
            drain_source: [0; NODE_NAME_BYTES],
            restored: false,
        }
    }
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct Victim {
    /// 0: free.
    pub(crate) migration_id: i64,
    pub(crate) pid: i32,
    pub(crate) backend_id: i32,
    pub(crate) lxid: u32,
    /// The marked transaction ended before its cancel took effect; the cancel may still reach
    /// the backend's next transaction (signals are asynchronous), where it is rewritten too.
    pub(crate) stray: bool,
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct Gate {
    /// 0: open.
    pub(crate) migration_id: i64,
    pub(crate) closed_at: pg_sys::TimestampTz,
    pub(crate) deadline: pg_sys::TimestampTz,
}

/// Prepared source transactions (2PC participants) whose shadows are prepared on a destination,
/// so the session that finishes one can finish its shadows too (read-your-writes).
pub(crate) const MAX_PREPARED_SHADOWS: usize = 256;

#[derive(Clone, Copy, Default)]
#[repr(C)]
pub(crate) struct PreparedShadow {
    /// 0: free.
    pub(crate) migration_id: i64,
    pub(crate) xid: u32,
}

#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct HandoverState {
    pub(crate) shards: [ShardEntry; MAX_MIGRATING_SHARDS],
    pub(crate) migrations: [MigrationEntry; MAX_MIGRATIONS],
    pub(crate) victims: [Victim; MAX_VICTIMS],
    pub(crate) gate: Gate,
    /// Sync barrier marks, by pgprocno: non-zero (a per-backend sequence number) while that
    /// backend commits a transaction that wrote a capturing shard in async mode. The barrier
    /// waits for the marks it saw when it set sync mode to change (TS_unsync drained).
    pub(crate) async_commit: [u64; MAX_PROCS],
    pub(crate) prepared_shadows: [PreparedShadow; MAX_PREPARED_SHADOWS],
}

impl Default for HandoverState {
    fn default() -> Self {
        Self {
            shards: [ShardEntry::default(); MAX_MIGRATING_SHARDS],
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

// SAFETY: set up by `durable::init_shmem` (pg_shmem_init!, with the restored migrations) while
// the library is preloaded, before any backend takes the lock.
pub(crate) static STATE: PgLwLock<HandoverState> =
    unsafe { PgLwLock::new(c"remus_handover_state") };
/// Non-zero while anything above is in use: the per-statement checks then take the lock; when
/// zero (the normal case) they cost one atomic load.
// SAFETY: as STATE: set up by `durable::init_shmem` before any backend reads it.
pub(crate) static ACTIVE: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_handover_active") };

/// Recomputes the "anything registered?" word after a change of `s`.
pub(crate) fn recount(s: &HandoverState) {
    let n = s.migrations.iter().filter(|m| m.migration_id != 0).count()
        + s.victims.iter().filter(|v| v.migration_id != 0).count()
        + usize::from(s.gate.migration_id != 0);
    ACTIVE.get().store(n as u32, Ordering::Release);
}

/// Is any migration, victim or gate registered on this node? (One atomic load.)
pub(crate) fn active() -> bool {
    ACTIVE.get().load(Ordering::Acquire) != 0
}

/// A session of the migration machinery: exempt from every restriction a migration puts up.
pub(crate) fn exempt() -> bool {
    crate::guc::MIGRATION_SESSION.get()
}

/// Counts a transaction the migration aborted on this node.
pub(crate) fn count_abort(s: &mut HandoverState, migration_id: i64) {
    if let Some(m) = s
        .migrations
        .iter_mut()
        .find(|m| m.migration_id == migration_id)
    {
        m.aborts += 1;
    }
}

/// Counts a transaction the migration aborted on this node (a MOCC conflict).
pub(crate) fn count_migration_abort(migration_id: i64) {
    count_abort(&mut STATE.exclusive(), migration_id);
}

/// This backend's (backend id, local transaction id).
pub(crate) fn my_vxid() -> (i32, u32) {
    // SAFETY: MyProc is this backend's own PGPROC, set up before any statement runs.
    unsafe {
        if pg_sys::MyProc.is_null() {
            return (-1, 0);
        }
        ((*pg_sys::MyProc).backendId, (*pg_sys::MyProc).lxid)
    }
}

/// This backend's pid.
pub(crate) fn my_pid() -> i32 {
    // SAFETY: process global set at backend start.
    unsafe { pg_sys::MyProcPid }
}

/// The handover functions are the migration machinery's: superuser only (whatever the grants).
pub(crate) fn require_superuser(function: &str) {
    // SAFETY: catalog lookup for the current user, inside a transaction.
    if !unsafe { pg_sys::superuser() } {
        RemusError::SuperuserRequired {
            function: function.to_string(),
        }
        .raise();
    }
}

/// The registered migration of `shard_id`, if any.
pub(crate) fn migration_of(s: &HandoverState, shard_id: i64) -> Option<i64> {
    s.shards
        .iter()
        .find(|e| e.migration_id != 0 && e.shard_id == shard_id)
        .map(|e| e.migration_id)
}
