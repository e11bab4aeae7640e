//! The routing decision API: which relations are shells of distributed tables (cached per
//! backend, cleared by relcache invalidation), and the shard map as this transaction uses it.
//!
//! A transaction's routing decision for a shard is made once, at its first use, with the
//! snapshot of that statement, and pinned until the transaction ends ([`pinned_owner`]). So a
//! transaction never sees a shard move under it, whatever the shard map says later.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use pgrx::pg_sys;

use crate::catalog::{self, map_cache, DistTable, ShardPlacement};
use crate::error::RemusError;
use crate::migration::handover;
use crate::pg::fast_map::{fast_map, FastMap};
use crate::pg::list::list_ptrs;

thread_local! {
    /// relid → distribution (None: not distributed). Cleared by relcache invalidation.
    static DIST_CACHE: RefCell<FastMap<u32, Option<DistTable>>> = const { RefCell::new(fast_map()) };
    /// relid → its shard ids by shard index. A table's shards never change while it stays
    /// distributed (a migration moves a shard, it keeps its id), so only a relcache
    /// invalidation of the shell clears it: the marker's receiving side and the local fast
    /// path find shards with no catalog query.
    static SHARD_IDS: RefCell<FastMap<u32, Rc<[i64]>>> = const { RefCell::new(fast_map()) };
    /// Shard id → the OID of its table here (`remus_shards.<table>_<shard_id>`), for the local
    /// fast path; every relcache invalidation clears it (a shard table dropped or made again
    /// sends one for itself, not for its shell).
    static SHARD_RELIDS: RefCell<FastMap<i64, pg_sys::Oid>> = const { RefCell::new(fast_map()) };
    /// Set while the cache itself is being filled (its SPI queries are planned too).
    static IN_LOOKUP: Cell<bool> = const { Cell::new(false) };
    static PINS: RefCell<FastMap<i64, String>> = const { RefCell::new(fast_map()) };
    /// Shards [`placements_for_key`] left unpinned because their Tm is in doubt here.
    static DEFERRED: RefCell<FastMap<i64, handover::InDoubt>> = const { RefCell::new(fast_map()) };
}

/// Runs `f`, a catalog query of the router, with the lookups of the queries it plans turned off.
pub(crate) fn looking_up<R>(f: impl FnOnce() -> R) -> R {
    let _lookup = Lookup::enter();
    f()
}

/// While alive, the router's own catalog queries are running: the queries they plan are not
/// routed. Dropping it restores the previous state, also when an ERROR raised in the lookup
/// (a serialization failure under SERIALIZABLE, a lock or statement timeout, a cancel) unwinds
/// through it. Set and cleared by hand, such an ERROR left the flag on for the rest of the
/// session: no shell was recognised any more, so a forwarded session refused every marked
/// statement with `MarkerWithoutTable` and a client session ran its statements on the empty
/// local shells.
struct Lookup(bool);

impl Lookup {
    fn enter() -> Self {
        Lookup(IN_LOOKUP.with(|l| l.replace(true)))
    }
}

impl Drop for Lookup {
    fn drop(&mut self) {
        IN_LOOKUP.with(|l| l.set(self.0));
    }
}

/// A relcache invalidation of `relid` (`InvalidOid`: of everything): its cached distribution and
/// placements go.
pub(crate) fn forget_relation(relid: pg_sys::Oid) {
    SHARD_RELIDS.with(|s| s.borrow_mut().clear());
    DIST_CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if relid == pg_sys::InvalidOid {
            c.clear();
            crate::cluster::remote::forget_prepared_statements();
            map_cache::clear();
            SHARD_IDS.with(|s| s.borrow_mut().clear());
        } else {
            // A distributed table's definition may have changed (distributed DDL): statements
            // prepared on other nodes for it may now return other types.
            if matches!(c.remove(&relid.to_u32()), Some(Some(_))) {
                crate::cluster::remote::forget_prepared_statements();
            }
            map_cache::forget(relid.to_u32());
            SHARD_IDS.with(|s| s.borrow_mut().remove(&relid.to_u32()));
        }
    });
}

/// The shard ids of hash-distributed table `relid`, indexed by shard index (cached per backend).
pub(crate) fn shard_ids(relid: pg_sys::Oid) -> Result<Rc<[i64]>, RemusError> {
    if let Some(hit) = SHARD_IDS.with(|s| s.borrow().get(&relid.to_u32()).cloned()) {
        return Ok(hit);
    }
    let rows = looking_up(|| catalog::shard_ids(relid))?;
    let mut ids = vec![0i64; rows.iter().map(|(i, _)| *i as usize + 1).max().unwrap_or(0)];
    for (index, id) in rows {
        ids[index as usize] = id;
    }
    let ids: Rc<[i64]> = ids.into();
    SHARD_IDS.with(|s| s.borrow_mut().insert(relid.to_u32(), ids.clone()));
    Ok(ids)
}

/// The shard of `table` a statement on shard index `index` of its co-location group uses: the
/// one at that index, or for a reference table its only shard (every node holds it).
pub(crate) fn shard_at(table: &DistTable, index: usize) -> Result<Option<i64>, RemusError> {
    let ids = shard_ids(table.relid)?;
    Ok(if table.kind == 'r' {
        ids.first().copied()
    } else {
        ids.get(index).copied()
    })
}

/// Locks shard table `remus_shards.<rel_name>_<shard_id>` and returns its OID, if it is here.
///
/// # Safety
/// Must run inside a transaction.
pub(crate) unsafe fn lock_local_shard(
    rel_name: &str,
    shard_id: i64,
    lockmode: std::ffi::c_int,
) -> Option<pg_sys::Oid> {
    // SAFETY: catalog lookups and a lock by OID; the caller is in a transaction.
    unsafe {
        let known = SHARD_RELIDS.with(|s| s.borrow().get(&shard_id).copied());
        if let Some(relid) = known {
            if lock_known(relid, lockmode) {
                return Some(relid);
            }
            // Dropped since (its invalidation not yet processed): look the name up again.
            SHARD_RELIDS.with(|s| s.borrow_mut().remove(&shard_id));
        }
        let nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return None;
        }
        let name = std::ffi::CString::new(format!("{rel_name}_{shard_id}")).ok()?;
        let relid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
        if relid == pg_sys::InvalidOid || !lock_known(relid, lockmode) {
            return None;
        }
        SHARD_RELIDS.with(|s| s.borrow_mut().insert(shard_id, relid));
        Some(relid)
    }
}

/// [`lock_existing`] for a relation known to exist as of the last invalidation this backend
/// processed (just looked up by name, or in `SHARD_RELIDS`, which every relcache invalidation
/// empties). If taking the lock processed no invalidation, nothing dropped it since: a drop
/// holds its lock until it has committed and sent its invalidations, which a newly granted
/// lock reads before returning, and a lock already held keeps any drop out. So the syscache is
/// probed only when an invalidation arrived, as `RangeVarGetRelidExtended` does.
///
/// # Safety
/// Must run inside a transaction.
unsafe fn lock_known(relid: pg_sys::Oid, lockmode: std::ffi::c_int) -> bool {
    // SAFETY: reads a backend-local counter, then as `lock_existing`.
    unsafe {
        let seen = pg_sys::SharedInvalidMessageCounter;
        pg_sys::LockRelationOid(relid, lockmode);
        pg_sys::SharedInvalidMessageCounter == seen || relation_exists(relid)
    }
}

/// Takes `lockmode` on `relid`; false if the relation is gone once the lock is granted (a
/// migration's cleanup dropped it meanwhile).
///
/// # Safety
/// Must run inside a transaction.
pub(crate) unsafe fn lock_existing(relid: pg_sys::Oid, lockmode: std::ffi::c_int) -> bool {
    // SAFETY: a lock by OID and a syscache probe; the caller is in a transaction.
    unsafe {
        pg_sys::LockRelationOid(relid, lockmode);
        relation_exists(relid)
    }
}

/// Is `relid` in `pg_class` (a syscache probe)?
///
/// # Safety
/// Must run inside a transaction.
unsafe fn relation_exists(relid: pg_sys::Oid) -> bool {
    // SAFETY: a syscache probe by OID; the caller is in a transaction.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(relid),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
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
    let found = looking_up(|| catalog::dist_table(relid))?;
    DIST_CACHE.with(|c| c.borrow_mut().insert(relid.to_u32(), found.clone()));
    Ok(found)
}

/// Placements as this transaction uses them: read with the current statement's snapshot, and
/// pinned per shard at first use until the transaction ends. A READ COMMITTED transaction
/// first waits (bounded) for every shard of the table whose ownership change is in doubt on
/// this node: for callers that may use any shard.
pub(crate) fn placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    read_placements(relid, false)
}

/// [`placements`] for a caller that uses one shard, chosen by key and passed through
/// [`settle`] (`router::key::placement_for` does): a shard in doubt is left unpinned here and
/// waited for only if it is the one chosen, so a statement on another shard of the same table
/// does not wait for a migration it does not touch (review finding F5).
pub(crate) fn placements_for_key(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    read_placements(relid, true)
}

/// The placement of shard index `index` of hash-distributed `table`, as [`placements_for_key`]
/// and [`settle`] give it, without copying every shard's placement when the cached map serves
/// and no ownership change can be in doubt here (no read-through, the node settled after its
/// start): the per-statement path of a single-shard statement.
pub(crate) fn placement_at_index(
    table: &DistTable,
    index: usize,
) -> Result<ShardPlacement, RemusError> {
    if table.kind == 'h' && !map_cache::read_through() && looking_up(handover::restart::settled)? {
        if let Some(cached) = map_cache::shared(table.relid.to_u32()) {
            if let Some(p) = cached.iter().find(|p| p.shard_index as usize == index) {
                return settle(p.clone());
            }
        }
    }
    placement_in(table, &placements_for_key(table.relid)?, index)
}

/// The placement of shard index `index` among `placements` of `table` (from
/// [`placements_for_key`]), pinned ([`settle`]).
pub(crate) fn placement_in(
    table: &DistTable,
    placements: &[ShardPlacement],
    index: usize,
) -> Result<ShardPlacement, RemusError> {
    let p = placements
        .iter()
        .find(|p| p.shard_index as usize == index)
        .cloned()
        .ok_or_else(|| RemusError::NoShardAtIndex {
            index: index as i32,
            table: table.qualified_name.to_string(),
        })?;
    // The chosen shard's ownership change, if in doubt here, is waited for now (F5).
    settle(p)
}

/// Is this node the owner this transaction has pinned for `shard_id`? None: not pinned yet.
pub(crate) fn pinned_here(shard_id: i64) -> Option<bool> {
    PINS.with(|p| {
        p.borrow()
            .get(&shard_id)
            .map(|n| crate::guc::is_this_node(n))
    })
}

fn read_placements(relid: pg_sys::Oid, defer: bool) -> Result<Vec<ShardPlacement>, RemusError> {
    let reference = matches!(dist_table(relid), Ok(Some(t)) if t.kind == 'r');
    let (mut r, read_at) = match map_cache::get(relid.to_u32()) {
        Some(hit) => (hit, None),
        None => {
            let gen = map_cache::generation();
            let r = looking_up(|| {
                if reference {
                    catalog::reference_placements(relid)
                } else {
                    catalog::placements(relid)
                }
            })?;
            (r, Some(gen))
        }
    };
    // Shards of this table whose map row a Tm prepared here holds: looked for while a Tm runs
    // (read-through on), and, since a restart loses read-through, until the node has settled
    // after its start (`handover::restart`), from the catalog alone.
    let look =
        !reference && (map_cache::read_through() || !looking_up(handover::restart::settled)?);
    let doubt = if look {
        looking_up(|| handover::in_doubt(Some(relid), None))?
    } else {
        Vec::new()
    };
    // A map read while a row is in doubt is what this statement sees, not the map to cache.
    if let Some(gen) = read_at.filter(|_| doubt.is_empty()) {
        map_cache::put(relid.to_u32(), gen, r.clone());
    }
    // A READ COMMITTED transaction routing these shards for the first time waits (bounded) for
    // a Tm prepared here (it may be committed elsewhere already), then reads the map with a
    // snapshot taken after that: a Tm that committed here since the statement's snapshot
    // counts too.
    let mut deferred = Vec::new();
    if look && handover::routes_at_latest() && r.iter().any(|p| !is_pinned(p.shard_id)) {
        let pending: Vec<_> = doubt
            .into_iter()
            .filter(|d| !is_pinned(d.shard_id))
            .collect();
        if defer {
            deferred = pending;
        } else {
            looking_up(|| handover::wait_decided(&pending))?;
        }
        r = looking_up(|| with_latest_snapshot(|| catalog::placements(relid)))?;
    }
    // A reference table's shard is on every node: there is no owner to pin. A caller by key
    // pins only the shard it chooses ([`settle`]): a transaction's owner is pinned per
    // (transaction, shard) at first use, not for shards it never touched.
    if !reference {
        for p in &mut r {
            if let Some(d) = deferred.iter().find(|d| d.shard_id == p.shard_id) {
                DEFERRED.with(|m| m.borrow_mut().insert(p.shard_id, *d));
            } else if !defer {
                wait_if_suspended(p)?;
                p.node_name = pinned_owner(p.shard_id, &p.node_name);
            }
        }
    }
    Ok(r)
}

/// The placement a statement is about to use, chosen from [`placements_for_key`], pinned: if
/// its shard was left in doubt there, first waits (bounded) for that Tm's decision on this
/// node and reads the owner with a snapshot taken after it.
pub(crate) fn settle(mut p: ShardPlacement) -> Result<ShardPlacement, RemusError> {
    let Some(d) = DEFERRED.with(|m| m.borrow_mut().remove(&p.shard_id)) else {
        wait_if_suspended(&mut p)?;
        p.node_name = pinned_owner(p.shard_id, &p.node_name);
        return Ok(p);
    };
    if !is_pinned(p.shard_id) {
        looking_up(|| handover::wait_decided(&[d]))?;
        let now = looking_up(|| with_latest_snapshot(|| catalog::placements(relid_of(&d)?)))?;
        if let Some(owner) = now.into_iter().find(|q| q.shard_id == p.shard_id) {
            p.node_name = owner.node_name;
        }
    }
    p.node_name = pinned_owner(p.shard_id, &p.node_name);
    Ok(p)
}

/// albatross (`migration::handover::albatross`, decision 0024): before this transaction routes
/// `p`'s shard for the first time, waits while a handover suspends it. After a wait a READ
/// COMMITTED transaction routes by the map as a snapshot taken now reads it (after Tm: the new
/// owner); one that keeps its snapshot (REPEATABLE READ, SERIALIZABLE) and would still route
/// to the old owner fails with 40001, as after wait_remaster's gate.
fn wait_if_suspended(p: &mut ShardPlacement) -> Result<(), RemusError> {
    if is_pinned(p.shard_id) {
        return Ok(());
    }
    let Some(migration_id) = handover::albatross::wait_if_suspended(p.shard_id, is_pinned) else {
        return Ok(());
    };
    let now = looking_up(|| {
        with_latest_snapshot(|| {
            crate::pg::spi::read_one::<String>(
                "SELECT max(node_name) FROM remus.shard_map WHERE shard_id = $1",
                &[p.shard_id.into()],
            )
        })
    })?;
    if let Some(owner) = now {
        if handover::routes_at_latest() {
            p.node_name = owner;
        } else if owner != p.node_name {
            return Err(handover::albatross::refuse_old_snapshot(
                p.shard_id,
                migration_id,
            ));
        }
    }
    Ok(())
}

/// The distributed table whose shard `d` is.
fn relid_of(d: &handover::InDoubt) -> Result<pg_sys::Oid, RemusError> {
    crate::pg::spi::read_one::<pg_sys::Oid>(
        "SELECT min(logicalrelid::oid) FROM remus.shards WHERE shard_id = $1",
        &[d.shard_id.into()],
    )?
    .ok_or(RemusError::TableDisappeared)
}

/// Runs `f`, a catalog read, with a snapshot taken now as the active one.
fn with_latest_snapshot<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: a snapshot taken now, active only for `f`; push and pop pair (an ERROR in between
    // aborts the transaction, which resets the stack).
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let r = f();
    // SAFETY: pairs the push above.
    unsafe { pg_sys::PopActiveSnapshot() };
    r
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

/// Shells referenced anywhere in a statement: its own range table, its WITH queries, FROM
/// subqueries and sublinks (`pg::query_tree`), each with its range-table entry.
///
/// # Safety
/// `parse` must be a valid Query, not yet planned.
pub(crate) unsafe fn shells_anywhere(
    parse: *mut pg_sys::Query,
) -> Result<Vec<(*mut pg_sys::RangeTblEntry, DistTable)>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let mut out = Vec::new();
        for level in crate::pg::query_tree::levels(parse) {
            for rte in list_ptrs::<pg_sys::RangeTblEntry>((*level.query).rtable) {
                if (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION {
                    if let Some(t) = dist_table((*rte).relid)? {
                        out.push((rte, t));
                    }
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
    // No lookup spans a transaction's end: whatever ended it, none is running any more.
    IN_LOOKUP.with(|l| l.set(false));
    PINS.with(|p| p.borrow_mut().clear());
    DEFERRED.with(|d| d.borrow_mut().clear());
}
