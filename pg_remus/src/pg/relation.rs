//! Naming relations from C: a `RangeVar`'s relation id, and the `RangeVar` of a shard table.

use std::ffi::CString;

use pgrx::pg_sys;

/// `rv`'s relation id, or InvalidOid if there is none (the statement's own missing-object
/// handling then applies).
///
/// # Safety
/// `rv` must be NULL or a valid RangeVar.
pub(crate) unsafe fn relid_of(rv: *mut pg_sys::RangeVar) -> pg_sys::Oid {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if rv.is_null() {
            return pg_sys::InvalidOid;
        }
        pg_sys::RangeVarGetRelidExtended(
            rv,
            pg_sys::NoLock as i32,
            pg_sys::RVROption::RVR_MISSING_OK,
            None,
            std::ptr::null_mut(),
        )
    }
}

/// A palloc'd RangeVar naming `remus_shards.<name>`.
pub(crate) fn shard_range_var(name: &str) -> *mut pg_sys::RangeVar {
    let nsp = CString::new("remus_shards").expect("no NUL");
    let rel = CString::new(name).expect("no NUL in names");
    // SAFETY: pstrdup copies the strings into the current memory context, where makeRangeVar
    // allocates the node; both outlive the statement.
    unsafe {
        pg_sys::makeRangeVar(
            pg_sys::pstrdup(nsp.as_ptr()),
            pg_sys::pstrdup(rel.as_ptr()),
            -1,
        )
    }
}
