//! Per-backend cache of the shard map, with a cluster-wide way to invalidate or bypass it.
//!
//! Reading `remus.shard_map` for every routed statement costs a catalog query; the cache keeps
//! each table's placements per backend. Two shared-memory words keep it honest:
//! - `MAP_GENERATION`: bumped (`remus.bump_map_generation()`) after any change of the map has
//!   committed; a cached entry from an older generation is re-read.
//! - `READ_THROUGH`: while non-zero (`remus.begin_read_through()` … `remus.end_read_through()`,
//!   held by a migration around its ownership flip) the cache is not used at all and every
//!   transaction reads the map with its own snapshot. This closes the window in which the
//!   flip is visible to new snapshots but a backend has not yet seen the generation bump.
//!
//! Relcache invalidation of a shell (its distribution changed) drops its entry too.
//! Whatever the source, the placements a transaction uses are pinned per shard for the rest
//! of that transaction (`ownership::pinned_owner`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PgAtomic};

use super::ShardPlacement;

// SAFETY: the atomic is set up by `init_shmem` (pg_shmem_init!) while the library is
// preloaded, before any backend reads it.
static MAP_GENERATION: PgAtomic<AtomicU64> = unsafe { PgAtomic::new(c"remus_map_generation") };
// SAFETY: as for MAP_GENERATION: set up by `init_shmem` before any backend reads it.
static READ_THROUGH: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_map_read_through") };

thread_local! {
    static CACHE: RefCell<HashMap<u32, (u64, Vec<ShardPlacement>)>> = RefCell::new(HashMap::new());
}

/// Reserves the shared memory; must run while the library is preloaded.
pub fn init_shmem() {
    pg_shmem_init!(MAP_GENERATION);
    pg_shmem_init!(READ_THROUGH);
}

pub fn generation() -> u64 {
    MAP_GENERATION.get().load(Ordering::Acquire)
}

pub fn read_through() -> bool {
    READ_THROUGH.get().load(Ordering::Acquire) > 0
}

pub fn get(relid: u32) -> Option<Vec<ShardPlacement>> {
    if read_through() {
        return None;
    }
    let gen = generation();
    CACHE.with(|c| {
        c.borrow()
            .get(&relid)
            .filter(|(g, _)| *g == gen)
            .map(|(_, p)| p.clone())
    })
}

/// Remembers placements read under generation `gen` (taken before the read, so a bump that
/// races with the read makes the entry stale rather than wrongly fresh).
pub fn put(relid: u32, gen: u64, placements: Vec<ShardPlacement>) {
    if read_through() {
        return;
    }
    CACHE.with(|c| c.borrow_mut().insert(relid, (gen, placements)));
}

pub fn forget(relid: u32) {
    CACHE.with(|c| {
        c.borrow_mut().remove(&relid);
    });
}

pub fn clear() {
    CACHE.with(|c| c.borrow_mut().clear());
}

#[pg_schema]
mod remus {
    use std::sync::atomic::Ordering;

    use pgrx::prelude::*;

    /// Tells every backend of this node that the shard map changed (call after the change
    /// committed). Returns the new generation.
    #[pg_extern(volatile, parallel_unsafe)]
    fn bump_map_generation() -> i64 {
        (super::MAP_GENERATION.get().fetch_add(1, Ordering::AcqRel) + 1) as i64
    }

    /// Makes every backend of this node read the shard map with its own snapshot, bypassing
    /// caches, until a matching `end_read_through`. Nests.
    #[pg_extern(volatile, parallel_unsafe)]
    fn begin_read_through() -> i32 {
        (super::READ_THROUGH.get().fetch_add(1, Ordering::AcqRel) + 1) as i32
    }

    #[pg_extern(volatile, parallel_unsafe)]
    fn end_read_through() -> i32 {
        let prev = super::READ_THROUGH
            .get()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(1))
            })
            .unwrap_or(0);
        prev.saturating_sub(1) as i32
    }
}
