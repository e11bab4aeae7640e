//! CustomScan method tables. PostgreSQL keeps pointers to them, so each CustomScan keeps its
//! tables in statics, filled once at preload by [`register`].

use std::ffi::CStr;

use pgrx::pg_sys;

/// What a CustomScan provides (the optional callbacks pg_remus does not use stay NULL).
pub(crate) struct Methods {
    /// The name EXPLAIN shows and the scan is registered under.
    pub(crate) name: &'static CStr,
    pub(crate) create_state:
        unsafe extern "C-unwind" fn(*mut pg_sys::CustomScan) -> *mut pg_sys::Node,
    pub(crate) begin:
        unsafe extern "C-unwind" fn(*mut pg_sys::CustomScanState, *mut pg_sys::EState, i32),
    pub(crate) exec:
        unsafe extern "C-unwind" fn(*mut pg_sys::CustomScanState) -> *mut pg_sys::TupleTableSlot,
    pub(crate) end: unsafe extern "C-unwind" fn(*mut pg_sys::CustomScanState),
    pub(crate) rescan: unsafe extern "C-unwind" fn(*mut pg_sys::CustomScanState),
    /// Extra lines for EXPLAIN, if any.
    pub(crate) explain: Option<
        unsafe extern "C-unwind" fn(
            *mut pg_sys::CustomScanState,
            *mut pg_sys::List,
            *mut pg_sys::ExplainState,
        ),
    >,
}

/// Fills `scan` and `exec` from `methods`, then registers `scan` under its name.
///
/// # Safety
/// Must run once, while the library is preloaded, with `scan` and `exec` pointing at statics
/// that nothing else reads or writes yet.
pub(crate) unsafe fn register(
    scan: *mut pg_sys::CustomScanMethods,
    exec: *mut pg_sys::CustomExecMethods,
    methods: &Methods,
) {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        (*scan).CustomName = methods.name.as_ptr();
        (*scan).CreateCustomScanState = Some(methods.create_state);
        (*exec).CustomName = methods.name.as_ptr();
        (*exec).BeginCustomScan = Some(methods.begin);
        (*exec).ExecCustomScan = Some(methods.exec);
        (*exec).EndCustomScan = Some(methods.end);
        (*exec).ReScanCustomScan = Some(methods.rescan);
        (*exec).ExplainCustomScan = methods.explain;
        pg_sys::RegisterCustomScanMethods(scan);
    }
}
