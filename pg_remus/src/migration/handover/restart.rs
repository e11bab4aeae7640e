//! What a node enforces after a restart lost the shared-memory state of a running migration
//! (review finding F4; design note `docs/design/notes/0001-migration-state-across-node-restarts.md`).
//!
//! A crash-restart (a backend's segfault or OOM kill is enough) or a stop and start clears
//! everything in [`super::super::state`]. The registration, capture, sync mode, the fence and
//! the drain source come back from their durable copy before any backend runs
//! ([`crate::migration::durable`]), marked restored; read-through, the gate and the stream do
//! not. What else survives is durable: the shard map, the prepared Tm holding
//! the map rows of the moving shards (`remus_tm:<m>:<node>`), and the old owner's copy of the
//! shard. From those alone the node derives the one rule that keeps committed writes safe:
//!
//! - a write that reaches a local shard table whose map row is held by a prepared Tm, or whose
//!   latest committed owner is another node, while no migration registered in this node's
//!   shared memory since its start covers that shard (a restored one does not), is not let
//!   through: it waits (bounded by
//!   `remus.in_doubt_wait_timeout`) for the Tm to be decided here, then fails with 40001 if the
//!   shard moved (the retry runs on the new owner) or goes ahead if the Tm rolled back. Without
//!   shared memory such a write would commit unvalidated on a copy the migration later drops;
//! - READ COMMITTED routing waits for an in-doubt Tm whether or not read-through is on
//!   (`router::placement::placements`), and placements read while a row is in doubt are not
//!   cached.
//!
//! The check costs one atomic load once the node has *settled*: a scan found no local shard
//! table in that state. A state once settled cannot come back in this shared memory's
//! lifetime: a Tm prepared later belongs to a migration registered here first (the coordinator
//! registers every node at the copy), so it is guarded by the registration, not by this rule;
//! and the next restart resets the flag with the rest of shared memory.

use std::sync::atomic::{AtomicU32, Ordering};

use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PgAtomic};

use super::{in_doubt, wait_decided};
use crate::error::RemusError;
use crate::migration::state::{active, migration_of, STATE};

/// 1 once a scan found every local shard table guarded (see the module doc); 0 after a start.
// SAFETY: set up by `init_shmem` (pg_shmem_init!) while the library is preloaded, before any
// backend reads it.
static SETTLED: PgAtomic<AtomicU32> = unsafe { PgAtomic::new(c"remus_restart_settled") };

pub(crate) fn init_shmem() {
    pg_shmem_init!(SETTLED);
}

/// The shards of `shard_ids` that no migration registered on this node covers. A migration
/// restored from its durable copy at this start (`migration::durable`) does not cover them
/// here: it got back its registration, capture, sync mode, fence and drain source, but not
/// its stream, its read-through or the Tm session, so the rule above still holds for its
/// shards until the coordinator ends it.
fn unregistered(shard_ids: &[i64]) -> Vec<i64> {
    if !active() {
        return shard_ids.to_vec();
    }
    let s = STATE.share();
    let covered = |id: i64| {
        migration_of(&s, id).is_some_and(|m| {
            s.migrations
                .iter()
                .any(|e| e.migration_id == m && !e.restored)
        })
    };
    shard_ids
        .iter()
        .copied()
        .filter(|id| !covered(*id))
        .collect()
}

/// Runs `f` with a snapshot taken now as the active one: the latest committed map, whatever
/// the statement's own snapshot.
fn with_latest_snapshot<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: a snapshot taken now, active only for `f`; push and pop pair (an ERROR in between
    // aborts the transaction, which resets the stack).
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let r = f();
    // SAFETY: pairs the push above.
    unsafe { pg_sys::PopActiveSnapshot() };
    r
}

/// Has this node settled since its start: no local shard table whose map row is in doubt or
/// names another node, outside every registered migration? Scans (two catalog queries) until
/// the answer is yes, then costs one atomic load.
pub(crate) fn settled() -> Result<bool, RemusError> {
    if SETTLED.get().load(Ordering::Acquire) == 1 {
        return Ok(true);
    }
    let me = crate::guc::node_name().unwrap_or_default();
    let mut exposed: Vec<i64> = with_latest_snapshot(|| -> Result<Vec<i64>, RemusError> {
        let mut ids: Vec<i64> = in_doubt(None, None)?.iter().map(|d| d.shard_id).collect();
        let foreign = crate::pg::spi::connect(|c| {
            c.select(
                "SELECT m.shard_id
                   FROM remus.shard_map m
                   JOIN remus.shards s USING (shard_id)
                   JOIN pg_catalog.pg_class r ON r.oid = s.logicalrelid
                  WHERE m.node_name <> $1
                    AND to_regclass(format('remus_shards.%I', r.relname || '_' || m.shard_id))
                        IS NOT NULL",
                None,
                &[me.clone().into()],
            )?
            .map(|r| r.get::<i64>(1).map(|v| v.unwrap_or(0)))
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()
        })?;
        ids.extend(foreign);
        Ok(ids)
    })?;
    exposed.sort_unstable();
    exposed.dedup();
    if unregistered(&exposed).is_empty() {
        SETTLED.get().store(1, Ordering::Release);
        return Ok(true);
    }
    Ok(false)
}

/// Before a write on the local shard tables `shard_ids` (ExecutorStart, marked or not): the
/// rule of the module doc.
pub(crate) fn check_write(shard_ids: &[i64]) -> Result<(), RemusError> {
    if SETTLED.get().load(Ordering::Acquire) == 1 {
        return Ok(());
    }
    let unguarded = unregistered(shard_ids);
    if unguarded.is_empty() || settled()? {
        return Ok(());
    }
    let doubt = with_latest_snapshot(|| in_doubt(None, Some(&unguarded)))?;
    if !doubt.is_empty() {
        pgrx::log!(
            "pg_remus: a write on shard {} waits for the decision of migration {}'s Tm, whose state this node lost in a restart",
            doubt[0].shard_id,
            doubt[0].migration_id
        );
    }
    wait_decided(&doubt)?;
    let me = crate::guc::node_name().unwrap_or_default();
    for shard_id in unguarded {
        let owner = with_latest_snapshot(|| {
            crate::pg::spi::read_one::<String>(
                "SELECT max(node_name) FROM remus.shard_map WHERE shard_id = $1",
                &[shard_id.into()],
            )
        })?;
        if let Some(owner) = owner.filter(|o| *o != me) {
            return Err(RemusError::ShardMovedAcrossRestart { shard_id, owner });
        }
    }
    Ok(())
}
