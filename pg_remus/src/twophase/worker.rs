//! Background worker that resolves in-doubt two-phase commits after any crash.
//!
//! One per node. Every `remus.recovery_interval` it runs [`super::recovery::recover`] in its own
//! transaction: prepared transactions this node coordinated are committed on their participants
//! when this node recorded a commit decision, and rolled back otherwise. A failed round (a peer
//! down, say) is logged and retried on the next tick; the worker itself is restarted by the
//! postmaster if it dies.

use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;

pub fn register() {
    BackgroundWorkerBuilder::new("pg_remus 2PC recovery")
        .set_function("remus_recovery_worker_main")
        .set_library("pg_remus")
        .enable_spi_access()
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn remus_recovery_worker_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let db = crate::guc::database();
    BackgroundWorker::connect_worker_to_spi(Some(&db), None);
    let interval = Duration::from_millis(crate::guc::RECOVERY_INTERVAL_MS.get().max(100) as u64);
    while BackgroundWorker::wait_latch(Some(interval)) {
        if BackgroundWorker::sigterm_received() {
            break;
        }
        BackgroundWorker::transaction(|| {
            // SAFETY: a fresh transaction; SPI below needs an active snapshot, popped at the end.
            unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
            if crate::pg::extension::extension_present() {
                match super::recovery::recover() {
                    Ok(s) if s.committed + s.rolled_back > 0 => pgrx::log!(
                        "pg_remus recovery: committed {} and rolled back {} in-doubt transactions",
                        s.committed,
                        s.rolled_back
                    ),
                    Ok(_) => {}
                    Err(e) => pgrx::log!("pg_remus recovery: {e}"),
                }
            }
            // SAFETY: pairs the push above.
            unsafe { pg_sys::PopActiveSnapshot() };
        });
    }
}
