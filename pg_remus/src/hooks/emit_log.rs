//! `emit_log_hook`: a lock_abort victim's cancel becomes a counted 40001, then a SQLSTATE that
//! pgrx cannot name is put back.

use pgrx::pg_sys;

static mut PREV_EMIT_LOG_HOOK: pg_sys::emit_log_hook_type = None;

pub(super) fn install() {
    // SAFETY: process-global hook set once at preload, previous value chained.
    unsafe {
        PREV_EMIT_LOG_HOOK = pg_sys::emit_log_hook;
        pg_sys::emit_log_hook = Some(emit_log);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn emit_log(edata: *mut pg_sys::ErrorData) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        crate::migration::handover::lock_abort::rewrite_cancel(edata);
        crate::error::report::restore_sqlstate(edata);
        if let Some(prev) = PREV_EMIT_LOG_HOOK {
            prev(edata);
        }
    }
}
