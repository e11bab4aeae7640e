//! The interruptible sleep of every polling wait (admission gate, sync barrier).

use pgrx::pg_sys;
use pgrx::prelude::*;

/// Sleeps on this backend's latch for at most `ms` milliseconds (less if the latch is set),
/// then serves interrupts: a cancel, a statement timeout or a terminate raises here.
pub(crate) fn wait_ms(ms: i64) {
    // SAFETY: waiting on this backend's own latch with a timeout, as PostgreSQL's own waits
    // do; interrupts are processed right after.
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            ms as _,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    check_for_interrupts!();
}
