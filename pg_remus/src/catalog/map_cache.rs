//! Per-backend cache of the shard map, with a cluster-wide way to invalidate or bypass it.
//!
//! Reading `remus.shard_map` for every routed statement costs a catalog query; the cache keeps
//! each table's placements per backend. Two shared-memory words keep it honest:
//! - `MAP_GENERATION`: bumped (`remus.bump_map_generation()`) after any change of the map has
//!   committed; a cached entry from an older generation is re-read.
//! - read-through: while any migration holds it (`remus.begin_read_through(id)` …
//!   `remus.end_read_through(id)`, around its ownership flip) the cache is not used at all and
//!   every transaction reads the map with its own snapshot. This closes the window in which the
//!   flip is visible to new snapshots but a backend has not yet seen the generation bump. It is
//!   a set of migration ids (`READ_THROUGH_SET`), not a counter (review finding F13): beginning
//!   and ending are idempotent per migration, so a rollback that ends read-through on a node its
//!   Tm never reached, or a retried end, cannot switch off another migration's read-through.
//!   `READ_THROUGH` counts the set's members (written under its lock) plus the anonymous holds
//!   of the id-less `begin_read_through()`, for the per-statement check.
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
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgAtomic, PgLwLock};

use super::ShardPlacement;
use crate::pg::fast_map::{fast_map, FastMap};

// SAFETY: the atomic is set up by `init_shmem` (pg_shmem_init!) while the library is
// preloaded, before any backend reads it.
static MAP_GENERATION: PgAtomic<AtomicU64> = unsafe { PgAtomic::new(c"remus_map_generation") };
// SAFETY: as for MAP_GENERATION: set up by `init_shmem` before any backend reads it.
static LAST_BUMP_XID: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_map_bump_xid") };
// SAFETY: as for MAP_GENERATION: set up by `init_shmem` before any backend reads it.
static READ_THROUGH: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_map_read_through") };

/// Most migrations that can hold read-through on one node at once.
const MAX_READ_THROUGH: usize = 64;

/// The migrations holding read-through on this node (0 = free slot).
#[derive(Clone, Copy)]
pub struct ReadThroughSet {
    ids: [i64; MAX_READ_THROUGH],
    /// Holds of the id-less `begin_read_through()` (older coordinators).
    anonymous: u32,
}

impl Default for ReadThroughSet {
    fn default() -> Self {
        ReadThroughSet {
            ids: [0; MAX_READ_THROUGH],
            anonymous: 0,
        }
    }
}

impl ReadThroughSet {
    fn holders(&self) -> u32 {
        self.ids.iter().filter(|i| **i != 0).count() as u32 + self.anonymous
    }
}

// SAFETY: plain old data (integers only), no pointers: valid in shared memory in every backend.
unsafe impl PGRXSharedMemory for ReadThroughSet {}

// SAFETY: set up by `init_shmem` (pg_shmem_init!) while the library is preloaded, before any
// backend uses it.
static READ_THROUGH_SET: PgLwLock<ReadThroughSet> =
    unsafe { PgLwLock::new(c"remus_map_read_through_set") };

/// A table's placements and the map generation they were read under.
type CachedMap = (u64, Rc<Vec<ShardPlacement>>);

thread_local! {
    static CACHE: RefCell<FastMap<u32, CachedMap>> = const { RefCell::new(fast_map()) };
}

/// Reserves the shared memory; must run while the library is preloaded.
pub fn init_shmem() {
    pg_shmem_init!(MAP_GENERATION);
    pg_shmem_init!(LAST_BUMP_XID);
    pg_shmem_init!(READ_THROUGH);
    pg_shmem_init!(READ_THROUGH_SET);
}

/// Changes the read-through set under its lock and publishes how many hold it.
fn change_read_through(f: impl FnOnce(&mut ReadThroughSet)) -> u32 {
    let mut set = READ_THROUGH_SET.exclusive();
    f(&mut set);
    let holders = set.holders();
    READ_THROUGH.get().store(holders, Ordering::Release);
    holders
}

/// Adds `migration_id` to the holders of read-through (no change if it holds it already).
pub fn begin_read_through_for(migration_id: i64) -> Result<u32, crate::error::RemusError> {
    if migration_id <= 0 {
        return Err(crate::error::RemusError::InvalidMigrationId { migration_id });
    }
    let mut full = false;
    let holders = change_read_through(|set| {
        if set.ids.contains(&migration_id) {
            return;
        }
        match set.ids.iter_mut().find(|i| **i == 0) {
            Some(slot) => *slot = migration_id,
            None => full = true,
        }
    });
    if full {
        return Err(crate::error::RemusError::TooManyMigrations {
            max: MAX_READ_THROUGH,
        });
    }
    Ok(holders)
}

/// Removes `migration_id` from the holders (no change if it does not hold it).
pub fn end_read_through_for(migration_id: i64) -> u32 {
    change_read_through(|set| {
        for slot in set.ids.iter_mut().filter(|i| **i == migration_id) {
            *slot = 0;
        }
    })
}

pub fn generation() -> u64 {
    MAP_GENERATION.get().load(Ordering::Acquire)
}

pub fn read_through() -> bool {
    READ_THROUGH.get().load(Ordering::Acquire) > 0
}

pub fn get(relid: u32) -> Option<Vec<ShardPlacement>> {
    shared(relid).map(|p| (*p).clone())
}

/// [`get`] without a copy of the placements, for a caller that only looks.
pub fn shared(relid: u32) -> Option<Rc<Vec<ShardPlacement>>> {
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
    CACHE.with(|c| c.borrow_mut().insert(relid, (gen, Rc::new(placements))));
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
    /// caches, until a matching `end_read_through()`. Nests. For coordinators that do not name
    /// their migration; see `begin_read_through(migration_id)`.
    #[pg_extern(volatile, parallel_unsafe)]
    fn begin_read_through() -> i32 {
        super::change_read_through(|set| set.anonymous += 1) as i32
    }

    /// Ends one id-less hold, or, with none left, every hold of this node (what a restarted
    /// coordinator does once none of its migrations can be in Tm). Returns the holders left.
    #[pg_extern(volatile, parallel_unsafe)]
    fn end_read_through() -> i32 {
        super::change_read_through(|set| {
            if set.anonymous > 0 {
                set.anonymous -= 1;
            } else {
                *set = super::ReadThroughSet::default();
            }
        }) as i32
    }

    /// Read-through held by migration `migration_id` (idempotent); returns how many hold it.
    #[pg_extern(name = "begin_read_through", volatile, parallel_unsafe)]
    fn begin_read_through_of(migration_id: i64) -> i32 {
        match super::begin_read_through_for(migration_id) {
            Ok(n) => n as i32,
            Err(e) => e.raise(),
        }
    }

    /// Migration `migration_id` no longer holds read-through (idempotent: a node it never
    /// reached, or a second call, changes nothing); returns how many still hold it.
    #[pg_extern(name = "end_read_through", volatile, parallel_unsafe)]
    fn end_read_through_of(migration_id: i64) -> i32 {
        super::end_read_through_for(migration_id) as i32
    }
}
