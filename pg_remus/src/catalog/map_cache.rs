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
//! A transaction whose snapshot predates the last bump reads the map as it was (right for that
//! transaction) but must not cache it as the current generation: every later transaction of
//! the backend would route to the old owner. The bump therefore records its own transaction id
//! (`LAST_BUMP_XID`), and placements are cached only when read with a snapshot in which that
//! transaction is no longer running, that is, one taken after the map change had committed on
//! this node. (The paper, section 3.5.1: a process refreshes its cache after its current
//! transaction.)
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
static LAST_BUMP_XID: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_map_bump_xid") };
// SAFETY: as for MAP_GENERATION: set up by `init_shmem` before any backend reads it.
static READ_THROUGH: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_map_read_through") };

thread_local! {
    static CACHE: RefCell<HashMap<u32, (u64, Vec<ShardPlacement>)>> = RefCell::new(HashMap::new());
}

/// Reserves the shared memory; must run while the library is preloaded.
pub fn init_shmem() {
    pg_shmem_init!(MAP_GENERATION);
    pg_shmem_init!(LAST_BUMP_XID);
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
    if read_through() || !snapshot_sees_last_bump() {
        return;
    }
    CACHE.with(|c| c.borrow_mut().insert(relid, (gen, placements)));
}

/// Was the active snapshot (the one the map was just read with) taken after the last bump's
/// transaction had started, so after the map change it announces had committed here? No
/// active snapshot, or one in which the bump still runs or lies in the future: no.
fn snapshot_sees_last_bump() -> bool {
    let bump = LAST_BUMP_XID.get().load(Ordering::Acquire);
    if bump == 0 {
        return true;
    }
    // SAFETY: reads the backend's own active-snapshot stack; the snapshot pointer is valid
    // while it is active, and XidInMVCCSnapshot only reads it (and pg_subtrans).
    unsafe {
        pg_sys::ActiveSnapshotSet()
            && !pg_sys::XidInMVCCSnapshot(
                pg_sys::TransactionId::from(bump),
                pg_sys::GetActiveSnapshot(),
            )
    }
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
    /// committed, in a transaction of its own). Returns the new generation. The bump's
    /// transaction id is recorded first, so a backend that sees the new generation also sees
    /// (at least) this id: a snapshot older than it reads the map but does not cache it.
    #[pg_extern(volatile, parallel_unsafe)]
    fn bump_map_generation() -> i64 {
        // SAFETY: assigns (or returns) this transaction's xid; any backend may call it.
        let xid = unsafe { pgrx::pg_sys::GetTopTransactionId() };
        super::LAST_BUMP_XID
            .get()
            .store(u32::from(xid), Ordering::Release);
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
