//! The relcache invalidation callback: the router's caches and the extension's presence.

use pgrx::pg_sys;
use pgrx::prelude::*;

pub(super) fn install() {
    // SAFETY: registering a static callback once, while the library is preloaded.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(Some(relcache_callback), pg_sys::Datum::from(0usize));
        // A function changed (CREATE OR REPLACE): plans that inlined or call it are made again.
        pg_sys::CacheRegisterSyscacheCallback(
            pg_sys::SysCacheIdentifier::PROCOID as i32,
            Some(function_callback),
            pg_sys::Datum::from(0usize),
        );
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn function_callback(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    crate::router::local::relcache_changed();
}

#[pg_guard]
unsafe extern "C-unwind" fn relcache_callback(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    crate::router::placement::forget_relation(relid);
    crate::cluster::nodes::forget_relation(relid);
    crate::router::local::relcache_changed();
    crate::pg::extension::forget();
}
