//! The relcache invalidation callback: the router's caches and the extension's presence.

use pgrx::pg_sys;
use pgrx::prelude::*;

pub(super) fn install() {
    // SAFETY: registering a static callback once, while the library is preloaded.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(Some(relcache_callback), pg_sys::Datum::from(0usize));
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn relcache_callback(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    crate::router::placement::forget_relation(relid);
    crate::cluster::nodes::forget_relation(relid);
    crate::router::local::relcache_changed();
    crate::pg::extension::forget();
}
