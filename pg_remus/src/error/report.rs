//! SQLSTATEs that pgrx cannot name (pg_remus's class RM, a remote node's code passed through):
//! remembered when the error is raised, and written back into the `ErrorData` when PostgreSQL
//! emits it (the `emit_log_hook` in `hooks::emit_log` calls [`restore_sqlstate`]).

use pgrx::{PgLogLevel, PgSqlErrorCode};

thread_local! {
    /// (message, SQLSTATE) of the last error raised with a code pgrx cannot name.
    static PENDING_CODE: std::cell::RefCell<Option<(String, i32)>> = const { std::cell::RefCell::new(None) };
}

/// Remembers the SQLSTATE of the error with `message` that is about to be raised.
pub(crate) fn remember(message: String, code: i32) {
    PENDING_CODE.with(|p| *p.borrow_mut() = Some((message, code)));
}

/// Puts the remembered SQLSTATE back into `edata` if it is the error that was remembered.
///
/// # Safety
/// `edata` must be NULL or the ErrorData being emitted.
pub(crate) unsafe fn restore_sqlstate(edata: *mut pgrx::pg_sys::ErrorData) {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if !edata.is_null()
            && (*edata).elevel >= PgLogLevel::ERROR as i32
            && (*edata).sqlerrcode == PgSqlErrorCode::ERRCODE_INTERNAL_ERROR as i32
            && !(*edata).message.is_null()
        {
            let msg = std::ffi::CStr::from_ptr((*edata).message).to_string_lossy();
            PENDING_CODE.with(|p| {
                let mut p = p.borrow_mut();
                if let Some((m, code)) = p.as_ref() {
                    if *m == msg {
                        (*edata).sqlerrcode = *code;
                        *p = None;
                    }
                }
            });
        }
    }
}

/// Encodes a five-character SQLSTATE the way PostgreSQL's MAKE_SQLSTATE does.
pub(crate) fn sqlstate_code(s: &str) -> i32 {
    let b = s.as_bytes();
    if b.len() != 5 {
        return pgrx::PgSqlErrorCode::ERRCODE_INTERNAL_ERROR as i32;
    }
    b.iter().enumerate().fold(0i32, |acc, (i, c)| {
        acc | ((((*c as i32) - ('0' as i32)) & 0x3F) << (6 * i))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstate_codes_match_pgrx() {
        assert_eq!(
            sqlstate_code("40001"),
            pgrx::PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE as i32
        );
        assert_eq!(
            sqlstate_code("23505"),
            pgrx::PgSqlErrorCode::ERRCODE_UNIQUE_VIOLATION as i32
        );
        assert_eq!(
            sqlstate_code("0A000"),
            pgrx::PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED as i32
        );
    }
}
