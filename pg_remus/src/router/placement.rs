//! The routing decision API: which relations are shells of distributed tables (cached per
//! backend, cleared by relcache invalidation), and the shard map as this transaction uses it.
//!
//! A transaction's routing decision for a shard is made once, at its first use, with the
//! snapshot of that statement, and pinned until the transaction ends ([`pinned_owner`]). So a
//! transaction never sees a shard move under it, whatever the shard map says later.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use pgrx::pg_sys;

use crate::catalog::{self, map_cache, DistTable, ShardPlacement};
use crate::error::RemusError;
use crate::migration::handover;
use crate::pg::list::list_ptrs;

thread_local! {
    /// relid → distribution (None: not distributed). Cleared by relcache invalidation.
    static DIST_CACHE: RefCell<HashMap<u32, Option<DistTable>>> = RefCell::new(HashMap::new());
    /// Set while the cache itself is being filled (its SPI queries are planned too).
    static IN_LOOKUP: Cell<bool> = const { Cell::new(false) };
    static PINS: RefCell<HashMap<i64, String>> = RefCell::new(HashMap::new());
}

/// Runs `f`, a catalog query of the router, with the lookups of the queries it plans turned off.
pub(crate) fn looking_up<R>(f: impl FnOnce() -> R) -> R {
    IN_LOOKUP.with(|l| l.set(true));
    let r = f();
    IN_LOOKUP.with(|l| l.set(false));
    r
}

/// A relcache invalidation of `relid` (`InvalidOid`: of everything): its cached distribution and
/// placements go.
pub(crate) fn forget_relation(relid: pg_sys::Oid) {
    DIST_CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if relid == pg_sys::InvalidOid {
            c.clear();
            map_cache::clear();
        } else {
            c.remove(&relid.to_u32());
            map_cache::forget(relid.to_u32());
        }
    });
}

/// The distribution of `relid`, if it is the shell of a distributed table.
pub(crate) fn dist_table(relid: pg_sys::Oid) -> Result<Option<DistTable>, RemusError> {
    if relid.to_u32() < pg_sys::FirstNormalObjectId
        || IN_LOOKUP.with(|f| f.get())
        || !crate::pg::extension::extension_present()
    {
        return Ok(None);
    }
    if let Some(hit) = DIST_CACHE.with(|c| c.borrow().get(&relid.to_u32()).cloned()) {
        return Ok(hit);
    }
    IN_LOOKUP.with(|f| f.set(true));
    let found = catalog::dist_table(relid);
    IN_LOOKUP.with(|f| f.set(false));
    let found = found?;
    DIST_CACHE.with(|c| c.borrow_mut().insert(relid.to_u32(), found.clone()));
    Ok(found)
}

/// Placements as this transaction uses them: read with the current statement's snapshot, and
/// pinned per shard at first use until the transaction ends.
pub(crate) fn placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    let reference = matches!(dist_table(relid), Ok(Some(t)) if t.kind == 'r');
    let mut r = match map_cache::get(relid.to_u32()) {
        Some(hit) => hit,
        None => {
            let gen = map_cache::generation();
            IN_LOOKUP.with(|f| f.set(true));
            let r = if reference {
                catalog::reference_placements(relid)
            } else {
                catalog::placements(relid)
            };
            IN_LOOKUP.with(|f| f.set(false));
            let r = r?;
            map_cache::put(relid.to_u32(), gen, r.clone());
            r
        }
    };
    // While a Tm runs (read-through on, so nothing above came from the cache), a READ
    // COMMITTED transaction routing these shards for the first time waits for a Tm prepared
    // here (it may be committed elsewhere already), then reads the map with a snapshot taken
    // after that: a Tm that committed here since the statement's snapshot counts too.
    if !reference
        && map_cache::read_through()
        && handover::routes_at_latest()
        && r.iter().any(|p| !is_pinned(p.shard_id))
    {
        IN_LOOKUP.with(|f| f.set(true));
        let waited = handover::wait_for_in_doubt_flip(relid);
        IN_LOOKUP.with(|f| f.set(false));
        waited?;
        // SAFETY: a snapshot taken now, active only for the map read; push and pop pair (an
        // ERROR in between aborts the transaction, which resets the stack).
        unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
        IN_LOOKUP.with(|f| f.set(true));
        let again = catalog::placements(relid);
        IN_LOOKUP.with(|f| f.set(false));
        // SAFETY: pairs the push above.
        unsafe { pg_sys::PopActiveSnapshot() };
        r = again?;
    }
    // A reference table's shard is on every node: there is no owner to pin.
    if !reference {
        for p in &mut r {
            p.node_name = pinned_owner(p.shard_id, &p.node_name);
        }
    }
    Ok(r)
}

/// Shells referenced anywhere in the top level of a query's range table.
///
/// # Safety
/// `parse` must be a valid Query.
pub(crate) unsafe fn shells_in(
    parse: *mut pg_sys::Query,
) -> Result<Vec<(usize, DistTable)>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let mut out = Vec::new();
        for (i, rte) in list_ptrs::<pg_sys::RangeTblEntry>((*parse).rtable)
            .into_iter()
            .enumerate()
        {
            if (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION {
                if let Some(t) = dist_table((*rte).relid)? {
                    out.push((i + 1, t));
                }
            }
        }
        Ok(out)
    }
}

/// The owner this transaction uses for `shard_id`: the pinned one, or `seen` (which becomes
/// the pin).
pub(crate) fn pinned_owner(shard_id: i64, seen: &str) -> String {
    PINS.with(|p| {
        p.borrow_mut()
            .entry(shard_id)
            .or_insert_with(|| seen.to_string())
            .clone()
    })
}

/// Has this transaction already routed `shard_id`?
pub(crate) fn is_pinned(shard_id: i64) -> bool {
    PINS.with(|p| p.borrow().contains_key(&shard_id))
}

/// The transaction ended: its pins go.
pub(crate) fn end_of_transaction() {
    PINS.with(|p| p.borrow_mut().clear());
}
