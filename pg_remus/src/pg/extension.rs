//! Is pg_remus created in this database? Every hook asks before it looks at a catalog table.

use std::cell::Cell;

use pgrx::pg_sys;

thread_local! {
    static EXTENSION_OID: Cell<u32> = const { Cell::new(0) };
}

/// Is pg_remus created in this database (and not being created right now)?
pub(crate) fn extension_present() -> bool {
    // SAFETY: catalog lookup by name; `true` makes a missing extension return InvalidOid.
    unsafe {
        if pg_sys::creating_extension {
            return false;
        }
        let cached = EXTENSION_OID.with(|e| e.get());
        if cached != 0 {
            return true;
        }
        let oid = pg_sys::get_extension_oid(c"pg_remus".as_ptr(), true);
        if oid == pg_sys::InvalidOid {
            return false;
        }
        EXTENSION_OID.with(|e| e.set(oid.to_u32()));
        true
    }
}

/// Forgets the cached answer (a relcache invalidation: the extension may have been dropped).
pub(crate) fn forget() {
    EXTENSION_OID.with(|e| e.set(0));
}
