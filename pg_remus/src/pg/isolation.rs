//! The backend's transaction isolation level, as routing and the handover primitives ask it.

use pgrx::pg_sys;

/// Does this transaction route by the latest map (READ COMMITTED)? One that keeps a snapshot
/// for the whole transaction (REPEATABLE READ, SERIALIZABLE) routes by that snapshot: whatever
/// it waited for, it would route as an older transaction.
pub(crate) fn routes_at_latest() -> bool {
    // SAFETY: reads the backend's isolation level, a process global of this backend.
    (unsafe { pg_sys::XactIsoLevel } as u32) < pg_sys::XACT_REPEATABLE_READ
}
