//! squall mode, node side (issue 19 item 1, decision 0025): ownership passes to the destination
//! before the data, which the destination then pulls in chunks (the coordinator's pullers,
//! `coordinator/src/driver/squall.rs`). Here: the chunk catalog `remus.squall_chunks` (on the
//! destination: one row per hash sub-range of a moving shard, marked pulled in the transaction
//! that inserted its rows) and the per-statement wait of a destination transaction that touches
//! a shard whose chunks are not all pulled yet.
//!
//! The wait, per shard the statement reads or writes and that a migration registered here:
//! 1. it asks for the pull (a transaction-level shared advisory lock `(shard_id % 2^31-1, -1)`: the
//!    shard's puller sees it in `pg_locks` and stops pacing, pulling the remaining chunks one
//!    after another at once);
//! 2. it waits on the range lock of the next unpulled chunk (`(shard_id, chunk)`, held
//!    exclusively by the puller's transaction while it inserts that chunk), then reads the
//!    catalog again with the latest snapshot, until no chunk of the shard is left;
//! 3. a READ COMMITTED statement then runs with a snapshot taken after the wait (it sees every
//!    pulled row, as if it had started then); a REPEATABLE READ / SERIALIZABLE transaction,
//!    whose snapshot predates the pull, fails with 40001 (counted as aborted by the migration).
//!    The first statement of a backend that finds a shard complete counts as one that waited:
//!    the last pull may have committed after its snapshot was taken.
//!
//! The statement cannot be narrowed to a chunk here (the ExecutorStart hook sees the shard
//! tables, not the key), so every statement waits for all remaining chunks of the shards it
//! touches: the reactive pull fetches the rest of the shard, not one chunk (decision 0025).

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::migration::state::{active, count_migration_abort, exempt, migration_of, STATE};

pgrx::extension_sql!(
    r#"
-- squall mode (decision 0025): the chunks of the shards a migration pulls to this node, one row
-- per hash sub-range [hash_lo, hash_hi] of a shard's key; `pulled` is set in the transaction
-- that inserted the chunk's rows. Written by the coordinator only; empty when no squall
-- migration runs.
CREATE TABLE remus.squall_chunks (
    migration_id bigint NOT NULL,
    shard_id     bigint NOT NULL,
    chunk        int    NOT NULL,
    hash_lo      int    NOT NULL,
    hash_hi      int    NOT NULL,
    pulled       bool   NOT NULL DEFAULT false,
    rows_pulled  bigint NOT NULL DEFAULT 0,
    bytes_pulled bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (migration_id, shard_id, chunk),
    CHECK (hash_lo <= hash_hi)
);
COMMENT ON TABLE remus.squall_chunks IS 'squall migrations: the chunks of each shard being pulled to this node, and whether each is pulled';
"#,
    name = "squall_chunks",
    requires = ["distribution_catalog"]
);

/// How long a waiting statement sleeps between looks at the catalog when the puller has not
/// taken the next chunk yet.
const POLL_MS: i64 = 1;

/// Waits until every chunk of the squall-pulled shards among `shards` is on this node, then
/// gives the statement a snapshot that sees them (see the module comment): `query_desc`'s, for
/// the ExecutorStart hook.
///
/// # Safety
/// `query_desc` must be the QueryDesc that ExecutorStart is starting.
pub(crate) unsafe fn wait_for_pulls(
    query_desc: *mut pg_sys::QueryDesc,
    shards: &[i64],
    nested: bool,
) -> Result<(), RemusError> {
    if wait(shards, nested)? {
        // SAFETY: the QueryDesc's snapshot was registered by CreateQueryDesc and is
        // unregistered by FreeQueryDesc: the old one is unregistered here and a registered one
        // put in its place, before standard_ExecutorStart copies it into the EState.
        unsafe {
            let old = (*query_desc).snapshot;
            (*query_desc).snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
            pg_sys::UnregisterSnapshot(old);
        }
    }
    Ok(())
}

/// [`wait_for_pulls`] for a plan the router runs in a started executor (a spliced local plan,
/// `router::modify`): the executor's snapshot is replaced, before the local plan's nodes are
/// initialised.
///
/// # Safety
/// `estate` must be the EState of the executing statement, whose local plan is not started yet.
pub(crate) unsafe fn wait_for_pulls_in(
    estate: *mut pg_sys::EState,
    shards: &[i64],
) -> Result<(), RemusError> {
    if wait(shards, false)? {
        // SAFETY: standard_ExecutorStart registered es_snapshot and standard_ExecutorEnd
        // unregisters it: the old one is unregistered here and a registered one put in place.
        unsafe {
            let old = (*estate).es_snapshot;
            (*estate).es_snapshot = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
            pg_sys::UnregisterSnapshot(old);
        }
    }
    Ok(())
}

/// The wait itself; true when the statement waited (and may go on with a new snapshot).
/// `nested`: a local plan the router starts in a nested executor with the statement's active
/// snapshot, older than the one [`wait_for_pulls_in`] gave the router's executor after a
/// wait: a READ COMMITTED one on a pulled squall shard always takes a new snapshot.
fn wait(shards: &[i64], nested: bool) -> Result<bool, RemusError> {
    if !active() || exempt() || shards.is_empty() {
        return Ok(false);
    }
    let registered: Vec<(i64, i64)> = {
        let s = STATE.share();
        shards
            .iter()
            .filter_map(|&id| migration_of(&s, id).map(|m| (m, id)))
            .collect()
    };
    if registered.is_empty() || !catalog_present() {
        return Ok(false);
    }
    let mut waited = None;
    for (migration_id, shard_id) in registered {
        if PULLED.with(|p| p.borrow().contains(&(migration_id, shard_id))) {
            if nested && crate::pg::isolation::routes_at_latest() {
                waited = Some((migration_id, shard_id));
            }
            continue;
        }
        let mut asked = false;
        while let Some(chunk) = next_unpulled(migration_id, shard_id)? {
            waited = Some((migration_id, shard_id));
            if !asked {
                ask(shard_id)?;
                asked = true;
            }
            // Blocks while the puller's transaction holds the chunk's range lock.
            crate::pg::spi::read_one::<bool>(
                "SELECT pg_catalog.pg_advisory_unlock_shared(($1::bigint % 2147483647)::int4, $2)
                   FROM (SELECT pg_catalog.pg_advisory_lock_shared(($1::bigint % 2147483647)::int4, $2)) l",
                &[shard_id.into(), chunk.into()],
            )?;
            crate::pg::latch::wait_ms(POLL_MS);
        }
        // A squall shard seen complete for the first time by this backend: the pull may have
        // committed after the statement took its snapshot (no wait, yet rows it cannot see),
        // so the statement is treated as one that waited.
        if waited.is_none() && PULLED.with(|p| p.borrow().contains(&(migration_id, shard_id))) {
            waited = Some((migration_id, shard_id));
        }
    }
    let Some((migration_id, shard_id)) = waited else {
        return Ok(false);
    };
    if !crate::pg::isolation::routes_at_latest() {
        count_migration_abort(migration_id);
        return Err(RemusError::PulledAfterSnapshot {
            shard_id,
            migration_id,
        });
    }
    Ok(true)
}

thread_local! {
    /// (migration, shard) pairs this backend saw completely pulled: a pulled chunk never
    /// becomes unpulled, so their statements no longer read the catalog.
    static PULLED: std::cell::RefCell<std::collections::HashSet<(i64, i64)>> =
        std::cell::RefCell::new(std::collections::HashSet::new());
}

/// Does `remus.squall_chunks` exist? (Not before `ALTER EXTENSION pg_remus UPDATE` on a node
/// that runs the new library with the old catalog.)
fn catalog_present() -> bool {
    // SAFETY: catalog lookups by name inside a transaction.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"remus".as_ptr(), true);
        nsp != pg_sys::InvalidOid
            && pg_sys::get_relname_relid(c"squall_chunks".as_ptr(), nsp) != pg_sys::InvalidOid
    }
}

/// The first chunk of `shard_id` not pulled yet, read with the latest snapshot (the pulls
/// commit while the statement waits). A shard with chunks, all pulled, is remembered in
/// [`PULLED`].
fn next_unpulled(migration_id: i64, shard_id: i64) -> Result<Option<i32>, RemusError> {
    // SAFETY: a snapshot pushed and popped around one catalog read, inside a transaction.
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let read = crate::pg::spi::connect(|c| {
        let row = c
            .select(
                "SELECT min(chunk) FILTER (WHERE NOT pulled), count(*) FROM remus.squall_chunks
                  WHERE migration_id = $1 AND shard_id = $2",
                Some(1),
                &[migration_id.into(), shard_id.into()],
            )?
            .first();
        Ok::<_, pgrx::spi::Error>((row.get::<i32>(1)?, row.get::<i64>(2)?.unwrap_or(0)))
    });
    // SAFETY: pops the snapshot pushed above (an error aborts the transaction, which clears
    // the stack).
    unsafe { pg_sys::PopActiveSnapshot() };
    let (chunk, chunks) = read?;
    if chunk.is_none() && chunks > 0 {
        PULLED.with(|p| p.borrow_mut().insert((migration_id, shard_id)));
    }
    Ok(chunk)
}

/// Asks the shard's puller to pull now: a shared advisory lock `(shard_id, -1)` held until the
/// transaction ends, which the puller looks for in `pg_locks`.
fn ask(shard_id: i64) -> Result<(), RemusError> {
    crate::pg::spi::read_one::<bool>(
        "SELECT (SELECT pg_catalog.pg_advisory_xact_lock_shared(($1::bigint % 2147483647)::int4, -1)) IS NULL",
        &[shard_id.into()],
    )?;
    Ok(())
}
