//! albatross handover, node side: the per-shard suspension (decision 0024).
//!
//! While an albatross handover runs, every node holds a *suspension* of the migrating shards
//! (`remus.albatross_suspend` / `remus.albatross_resume`): a client transaction that routes one of
//! them for the first time waits at that routing decision (`router::placement`) until the
//! suspension is lifted, then routes with the map as it is then: after Tm, to the new owner.
//! Nothing else on the node waits: other shards, and the shards' transactions that had routed
//! one of the suspended shards before the suspension (they are in flight and the coordinator
//! drains them on the source, reading `remus.albatross_waiting` to leave the suspended ones out
//! of that drain).
//!
//! - A transaction that has already routed any shard of the suspension is in flight: it is not
//!   held (holding it would keep the drain waiting for it until the drain's bound).
//! - After a wait, a READ COMMITTED statement reads the map with a snapshot taken after the wait
//!   (`router::placement`); a REPEATABLE READ / SERIALIZABLE transaction whose snapshot still
//!   names the old owner fails with 40001 (counted in `aborted_by_migration`): it would
//!   otherwise write the source's copy after the handover, as wait_remaster's gate refuses it
//!   (review finding F20).
//! - A suspension lifts itself past its deadline (a coordinator that stopped mid-handover):
//!   the first backend to see it clears it, with a WARNING.
//! - Sessions of other nodes (`remus.forwarded`), of the migration machinery and replication
//!   apply sessions are never held: they execute a routing decision made elsewhere.
//!
//! The state is in shared memory of its own (at most [`MAX_SUSPENSIONS`] suspensions of
//! [`MAX_SUSPENDED_SHARDS`] shards each); a restart loses it, which is a rollback's outcome
//! anyway (the coordinator fails a handover whose node restarted before Tm).

use std::sync::atomic::{AtomicU32, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, pg_sys, PGRXSharedMemory, PgAtomic, PgLwLock};

use crate::error::RemusError;
use crate::migration::state::{count_migration_abort, my_pid, require_superuser};

/// Suspensions held on a node at once (one per running albatross handover).
pub(crate) const MAX_SUSPENSIONS: usize = 16;
/// Shards (a migration's shards with their co-located ones) one suspension holds.
pub(crate) const MAX_SUSPENDED_SHARDS: usize = 128;
/// Backends tracked as waiting at a suspension.
const MAX_WAITERS: usize = 1024;
/// How long a suspended backend sleeps between looks at the suspension.
const POLL_MS: i64 = 2;

#[derive(Clone, Copy)]
#[repr(C)]
struct Suspension {
    /// 0: free.
    migration_id: i64,
    since: pg_sys::TimestampTz,
    deadline: pg_sys::TimestampTz,
    count: u32,
    shards: [i64; MAX_SUSPENDED_SHARDS],
}

impl Default for Suspension {
    fn default() -> Self {
        Self {
            migration_id: 0,
            since: 0,
            deadline: 0,
            count: 0,
            shards: [0; MAX_SUSPENDED_SHARDS],
        }
    }
}

impl Suspension {
    fn shards(&self) -> &[i64] {
        &self.shards[..(self.count as usize).min(MAX_SUSPENDED_SHARDS)]
    }
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Waiter {
    /// 0: free.
    migration_id: i64,
    pid: i32,
}

#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct Suspensions {
    entries: [Suspension; MAX_SUSPENSIONS],
    waiters: [Waiter; MAX_WAITERS],
}

impl Default for Suspensions {
    fn default() -> Self {
        Self {
            entries: [Suspension::default(); MAX_SUSPENSIONS],
            waiters: [Waiter::default(); MAX_WAITERS],
        }
    }
}

// SAFETY: plain-old-data (integers), no pointers: valid in every process.
unsafe impl PGRXSharedMemory for Suspensions {}

// SAFETY: set up by `init_shmem` (pg_shmem_init!) while the library is preloaded, before any
// backend takes the lock.
static SUSPENSIONS: PgLwLock<Suspensions> =
    unsafe { PgLwLock::new(c"remus_albatross_suspensions") };
/// Suspensions held on this node: when 0 (the normal case) a routing decision costs one load.
// SAFETY: as SUSPENSIONS.
static HELD: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_albatross_held") };

pub(crate) fn init_shmem() {
    pg_shmem_init!(SUSPENSIONS);
    pg_shmem_init!(HELD);
}

fn recount(s: &Suspensions) {
    let n = s.entries.iter().filter(|e| e.migration_id != 0).count();
    HELD.get().store(n as u32, Ordering::Release);
}

/// Is this session one a suspension may hold (a client's own, not another node's, not the
/// migration machinery's, not a replication apply)?
fn may_hold() -> bool {
    // SAFETY: reads process globals of this backend.
    let client = unsafe {
        pg_sys::MyBackendType == pg_sys::BackendType::B_BACKEND
            && pg_sys::replorigin_session_origin == 0
    };
    client && !crate::guc::FORWARDED.get() && !crate::guc::MIGRATION_SESSION.get()
}

/// Removes this backend from the waiters when the wait ends, also by an ERROR (cancel,
/// statement_timeout) unwinding through it.
struct WaiterGuard(i32);

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let mut s = SUSPENSIONS.exclusive();
        for w in s.waiters.iter_mut().filter(|w| w.pid == self.0) {
            *w = Waiter::default();
        }
    }
}

/// Before this transaction routes `shard_id` for the first time: waits while a suspension
/// holds it, unless the transaction has routed a shard of that suspension already
/// (`routed`: has this transaction pinned that shard?). Returns the migration it waited for.
pub(crate) fn wait_if_suspended(shard_id: i64, routed: impl Fn(i64) -> bool) -> Option<i64> {
    if HELD.get().load(Ordering::Acquire) == 0 || !may_hold() {
        return None;
    }
    let pid = my_pid();
    let mut guard: Option<WaiterGuard> = None;
    let mut waited = None;
    loop {
        let s = SUSPENSIONS.share();
        let Some(e) = s
            .entries
            .iter()
            .find(|e| e.migration_id != 0 && e.shards().contains(&shard_id))
            .copied()
        else {
            break;
        };
        drop(s);
        if waited.is_none() && e.shards().iter().any(|id| routed(*id)) {
            // In flight on the shards: drained on the source by the coordinator.
            break;
        }
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        if now >= e.deadline {
            {
                let mut s = SUSPENSIONS.exclusive();
                for x in s
                    .entries
                    .iter_mut()
                    .filter(|x| x.migration_id == e.migration_id && x.since == e.since)
                {
                    *x = Suspension::default();
                }
                recount(&s);
            }
            warning!(
                "the suspension of shards by shard migration {} (albatross) lasted past its timeout; going on",
                e.migration_id
            );
            break;
        }
        if guard.is_none() {
            let mut s = SUSPENSIONS.exclusive();
            if let Some(w) = s.waiters.iter_mut().find(|w| w.migration_id == 0) {
                *w = Waiter {
                    migration_id: e.migration_id,
                    pid,
                };
            }
            drop(s);
            guard = Some(WaiterGuard(pid));
            pgrx::debug1!(
                "shard {shard_id} is suspended by shard migration {} (albatross); waiting",
                e.migration_id
            );
        }
        waited = Some(e.migration_id);
        crate::pg::latch::wait_ms(POLL_MS);
    }
    drop(guard);
    if waited.is_some() {
        // SAFETY: reads the start time of the current statement (a backend global).
        let statement = unsafe { pg_sys::GetCurrentStatementStartTimestamp() };
        WAITED_IN.with(|w| w.set(Some(statement)));
    }
    waited
}

thread_local! {
    /// The start (`statement_timestamp`) of the last statement that waited at a suspension.
    static WAITED_IN: std::cell::Cell<Option<pg_sys::TimestampTz>> =
        const { std::cell::Cell::new(None) };
}

/// Did the current statement wait at a suspension? Its snapshot then predates the wait, and
/// with it the last delta's commits on the new owner: a READ COMMITTED statement that goes on
/// to run a local plan there takes a snapshot after the wait (`migration::squall::
/// wait_for_pulls`, which replaces the snapshot of every local plan start), or it could read
/// rows as they were before the last delta.
pub(crate) fn statement_waited() -> bool {
    // SAFETY: reads the start time of the current statement (a backend global).
    let statement = unsafe { pg_sys::GetCurrentStatementStartTimestamp() };
    WAITED_IN.with(|w| w.get()) == Some(statement)
}

/// After a wait at a suspension: the transaction's snapshot still names the shard's old owner
/// and it cannot route at the latest map (REPEATABLE READ, SERIALIZABLE). Counted as aborted
/// by the migration; 40001.
pub(crate) fn refuse_old_snapshot(shard_id: i64, migration_id: i64) -> RemusError {
    count_migration_abort(migration_id);
    RemusError::ShardMoved {
        shard_id,
        migration_id,
    }
}

/// Clears `migration_id`'s suspension on this node (its end: `remus.migration_end`).
pub(crate) fn forget(migration_id: i64) {
    if HELD.get().load(Ordering::Acquire) == 0 {
        return;
    }
    let mut s = SUSPENSIONS.exclusive();
    for e in s
        .entries
        .iter_mut()
        .filter(|e| e.migration_id == migration_id)
    {
        *e = Suspension::default();
    }
    recount(&s);
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::handover::albatross::*;

    /// albatross: from now on, client transactions that route one of `shard_ids` for the first
    /// time wait until `albatross_resume` or `timeout_ms` pass. Returns when the suspension
    /// began (transactions older than it may be in flight on the shards). Idempotent per
    /// migration (a retry replaces the shards and keeps nothing else).
    #[pg_extern(volatile, parallel_unsafe)]
    fn albatross_suspend(
        migration_id: i64,
        shard_ids: Vec<i64>,
        timeout_ms: i32,
    ) -> TimestampWithTimeZone {
        require_superuser("remus.albatross_suspend");
        if shard_ids.len() > MAX_SUSPENDED_SHARDS {
            RemusError::TooManyMigratingShards {
                max: MAX_SUSPENDED_SHARDS,
            }
            .raise();
        }
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let mut s = SUSPENSIONS.exclusive();
        let slot = match s
            .entries
            .iter()
            .position(|e| e.migration_id == migration_id)
            .or_else(|| s.entries.iter().position(|e| e.migration_id == 0))
        {
            Some(i) => i,
            None => {
                drop(s);
                RemusError::TooManyMigrations {
                    max: MAX_SUSPENSIONS,
                }
                .raise();
            }
        };
        let mut e = Suspension {
            migration_id,
            since: now,
            deadline: now + i64::from(timeout_ms.max(0)) * 1000,
            count: shard_ids.len() as u32,
            ..Suspension::default()
        };
        e.shards[..shard_ids.len()].copy_from_slice(&shard_ids);
        s.entries[slot] = e;
        recount(&s);
        TimestampWithTimeZone::try_from(now)
            .unwrap_or_else(|_| TimestampWithTimeZone::positive_infinity())
    }

    /// albatross: lifts `migration_id`'s suspension; the transactions waiting at it go on.
    #[pg_extern(volatile, parallel_unsafe)]
    fn albatross_resume(migration_id: i64) {
        require_superuser("remus.albatross_resume");
        forget(migration_id);
    }

    /// albatross: the pids of the backends waiting at `migration_id`'s suspension (not in
    /// flight on its shards: the coordinator's drain leaves them out).
    #[pg_extern(volatile, parallel_unsafe)]
    fn albatross_waiting(migration_id: i64) -> Vec<i32> {
        require_superuser("remus.albatross_waiting");
        SUSPENSIONS
            .share()
            .waiters
            .iter()
            .filter(|w| w.migration_id == migration_id && w.pid != 0)
            .map(|w| w.pid)
            .collect()
    }
}
