//! The SQL text a statement is sent to its shard as.

use std::ffi::CStr;

use pgrx::pg_sys;

/// Deparses a Query to SQL text that any node reads the same way: schema-qualified names and
/// locale-independent literals.
///
/// # Safety
/// `query` must be a valid, rewritten Query.
pub unsafe fn deparse(query: *mut pg_sys::Query) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let nest = pg_sys::NewGUCNestLevel();
        for (name, value) in [
            (c"search_path", c"pg_catalog"),
            (c"datestyle", c"ISO"),
            (c"intervalstyle", c"postgres"),
            (c"extra_float_digits", c"3"),
        ] {
            pg_sys::set_config_option(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                0,
                false,
            );
        }
        let text = pg_sys::pg_get_querydef(query, false);
        pg_sys::AtEOXact_GUC(true, nest);
        CStr::from_ptr(text).to_string_lossy().into_owned()
    }
}
