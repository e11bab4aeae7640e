//! wait_remaster handover, node side: the admission gate. Client transactions that start after
//! the gate closed wait at their next statement (until it opens, or its timeout passes);
//! transactions already running, and 2PC participants working for them, are never held.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::migration::state::{recount, require_superuser, Gate, STATE};

/// How long a gated backend sleeps between looks at the gate.
const GATE_POLL_MS: i64 = 2;

/// Waits while the gate is closed for this transaction (the first half of
/// [`super::admit_statement`]).
pub(crate) fn wait_at_gate() {
    // SAFETY: reading process globals of this backend.
    let client = unsafe { pg_sys::MyBackendType == pg_sys::BackendType::B_BACKEND };
    if !client || crate::guc::FORWARDED.get() {
        return;
    }
    // SAFETY: we are inside a transaction whenever a statement runs.
    let xact_start = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
    // The migration this statement waited for, if it waited.
    let mut waited_for = None;
    loop {
        let gate = STATE.share().gate;
        if gate.migration_id == 0 || xact_start < gate.closed_at {
            if let Some(migration_id) = waited_for {
                refuse_old_snapshot(migration_id);
            }
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
            if waited_for.is_some() {
                refuse_old_snapshot(gate.migration_id);
            }
            return;
        }
        waited_for = Some(gate.migration_id);
        crate::pg::latch::wait_ms(GATE_POLL_MS);
    }
}

/// After a wait at the gate, a transaction that keeps one snapshot for its whole life
/// (REPEATABLE READ, SERIALIZABLE) and has taken it already (the statement that waited took it
/// before planning) would read the shard map as it was before the ownership change it waited
/// for, route to the old owner and write its copy after Tm: a write no baseline handover
/// carries to the new owner (review finding F20). Such a transaction has done nothing through
/// the gate yet (it waited at its first statement after the gate closed), so failing it with
/// 40001 is safe and its retry starts after the gate opened, with a snapshot that sees the
/// change. A READ COMMITTED statement routes by the latest map and takes a new snapshot to run,
/// so it goes on. Any wait counts, also one that ended by the gate's timeout or a rollback: the
/// snapshot's age is what matters, not what the migration did.
fn refuse_old_snapshot(migration_id: i64) {
    // SAFETY: reads a process global of this backend.
    let snapshot_taken = unsafe { pg_sys::FirstSnapshotSet };
    if snapshot_taken && !crate::pg::isolation::routes_at_latest() {
        RemusError::GateWaitedWithOldSnapshot { migration_id }.raise();
    }
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::handover::wait_remaster::*;

    /// wait_remaster: client transactions that start from now on wait at their next statement
    /// until `open_gate` or `timeout_ms` pass. Returns when the gate closed.
    #[pg_extern(volatile, parallel_unsafe)]
    fn close_gate(migration_id: i64, timeout_ms: i32) -> TimestampWithTimeZone {
        require_superuser("remus.close_gate");
        // SAFETY: plain clock read.
        let now = unsafe { pg_sys::GetCurrentTimestamp() };
        let mut s = STATE.exclusive();
        if s.gate.migration_id != 0 && s.gate.migration_id != migration_id && now < s.gate.deadline
        {
            let other = s.gate.migration_id;
            drop(s);
            RemusError::GateHeld {
                migration_id: other,
            }
            .raise();
        }
        s.gate = Gate {
            migration_id,
            closed_at: now,
            deadline: now + i64::from(timeout_ms.max(0)) * 1000,
        };
        recount(&s);
        TimestampWithTimeZone::try_from(now)
            .unwrap_or_else(|_| TimestampWithTimeZone::positive_infinity())
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
