//! The SQL text a statement is sent to its shard as.

use std::ffi::CStr;

use pgrx::pg_sys;

/// Deparses a Query to SQL text that any node reads the same way: schema-qualified names and
/// locale-independent literals.
///
/// # Safety
/// `query` must be a valid, rewritten Query.
pub unsafe fn deparse(query: *mut pg_sys::Query) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    portable(|| unsafe { pg_sys::pg_get_querydef(query, false) })
}

/// Deparses `expr`, an expression over the columns of relation `relid` alone, as a shard of it
/// reads it (`SELECT … FROM <shell> WHERE <expr>`): unqualified column names, otherwise as
/// [`deparse`].
///
/// # Safety
/// `expr` must be a valid expression whose Vars are all of range-table entry 1 (or of the
/// relation's own entry: their varno is not printed when there is one relation).
pub unsafe fn deparse_filter(
    expr: *mut pg_sys::Node,
    relid: pg_sys::Oid,
    rel_name: &str,
) -> String {
    let name = std::ffi::CString::new(rel_name).unwrap_or_default();
    // SAFETY: the caller upholds this function's `# Safety` contract; a one-relation deparse
    // context for an existing relation.
    portable(|| unsafe {
        let cx = pg_sys::deparse_context_for(name.as_ptr(), relid);
        pg_sys::deparse_expression(expr, cx, false, false)
    })
}

/// Runs `f` (which returns palloc'd text) with the settings under which text reads the same on
/// every node.
fn portable(f: impl FnOnce() -> *mut std::ffi::c_char) -> String {
    // SAFETY: GUCs set at a new nest level and restored right after, around `f`.
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
        let text = f();
        pg_sys::AtEOXact_GUC(true, nest);
        CStr::from_ptr(text).to_string_lossy().into_owned()
    }
}
