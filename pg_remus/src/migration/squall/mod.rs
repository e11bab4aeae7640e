//! squall mode, node side (issue 19 item 1, decision 0025): ownership passes to the destination
//! before the data, which the destination then pulls in chunks (the coordinator's pullers,
//! `coordinator/src/driver/squall.rs`). Here: the chunk catalog `remus.squall_chunks` (on the
//! destination: one row per hash sub-range of a moving shard, marked pulled in the transaction
//! that inserted its rows) and the per-statement wait of a destination transaction that touches
//! a shard whose chunks are not all pulled yet.
//!
//! The wait, per shard table the statement reads or writes that a migration registered here:
//! 1. the chunks it needs: the one chunk holding its key when the plan restricts every access to
//!    the table to one key value ([`statement_key`]), all chunks of the shard otherwise;
//! 2. it asks for the pull (a transaction-level shared advisory lock on the shard's key space:
//!    `(shard_id % 2^31-1, -2 - chunk)` for one chunk, `(…, -1)` for the whole shard). The
//!    shard's puller sees it in `pg_locks`, stops pacing and pulls the chunks asked for first;
//! 3. it waits on the range lock of a missing chunk (`(shard_id, chunk)`, held exclusively by the
//!    puller's transaction while it inserts that chunk), then reads the catalog again with the
//!    latest snapshot, until no chunk it needs is missing;
//! 4. the chunks' pulls must be visible to the statement's snapshot (the xid that marked each
//!    chunk pulled, compared with the snapshot: a pull that committed after the snapshot was
//!    taken inserted rows the statement cannot see). If one is not, a READ COMMITTED statement
//!    runs with a snapshot taken after the wait (as if it had started then); a REPEATABLE READ /
//!    SERIALIZABLE transaction fails with 40001 (counted as aborted by the migration). A
//!    transaction that starts after the pulls it needs sees them and never fails.

mod statement_key;

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
/// taken the chunk it needs yet.
const POLL_MS: i64 = 1;

/// Waits until the chunks of the squall-pulled shards that the statement of `query_desc` needs
/// are on this node, then makes sure its snapshot sees them (see the module comment): the
/// ExecutorStart hook's part, for the QueryDesc being started.
///
/// # Safety
/// `query_desc` must be the QueryDesc that ExecutorStart is starting.
pub(crate) unsafe fn wait_for_pulls(query_desc: *mut pg_sys::QueryDesc) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    let (stmt, params, snapshot) = unsafe {
        (
            (*query_desc).plannedstmt,
            (*query_desc).params,
            (*query_desc).snapshot,
        )
    };
    // SAFETY: the QueryDesc's plan, parameters and snapshot are live while it starts.
    if unsafe { wait(stmt, params, snapshot)? } || waited_at_suspension() {
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

/// [`wait_for_pulls`] for a local plan `stmt` the router runs in a started executor (spliced at
/// plan time, then `stmt` is the executor's own, or at execution, `router::modify`): the
/// executor's snapshot is replaced, before the local plan's nodes are initialised.
///
/// # Safety
/// `estate` must be the EState of the executing statement, whose local plan `stmt` (a valid
/// PlannedStmt) is not started yet.
pub(crate) unsafe fn wait_for_pulls_in(
    estate: *mut pg_sys::EState,
    stmt: *mut pg_sys::PlannedStmt,
) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    let (params, snapshot) = unsafe { ((*estate).es_param_list_info, (*estate).es_snapshot) };
    // SAFETY: the executor's plan, parameters and snapshot are live while it runs.
    if unsafe { wait(stmt, params, snapshot)? } || waited_at_suspension() {
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

/// albatross: a READ COMMITTED statement that waited at a suspension takes a new snapshot for
/// its local plans too (`migration::handover::albatross::statement_waited`; decision 0024).
fn waited_at_suspension() -> bool {
    crate::migration::handover::albatross::statement_waited()
        && crate::pg::isolation::routes_at_latest()
}

/// The wait itself; true when the statement must go on with a new snapshot (it does not see a
/// pull it needs).
///
/// # Safety
/// `stmt`, `params` and `snapshot` must be the live plan, parameters (or NULL) and snapshot (or
/// NULL) of one statement.
unsafe fn wait(
    stmt: *mut pg_sys::PlannedStmt,
    params: pg_sys::ParamListInfo,
    snapshot: pg_sys::Snapshot,
) -> Result<bool, RemusError> {
    if !active() || exempt() || stmt.is_null() {
        return Ok(false);
    }
    // SAFETY: the caller upholds this function's `# Safety` contract.
    let rtes = unsafe { crate::catalog::shard_rtes(stmt) };
    let registered: Vec<(i64, i64, i32, pg_sys::Oid)> = {
        let s = STATE.share();
        rtes.iter()
            .filter_map(|&(rti, relid, shard_id)| {
                migration_of(&s, shard_id).map(|m| (m, shard_id, rti, relid))
            })
            .collect()
    };
    if registered.is_empty() || !catalog_present() {
        return Ok(false);
    }
    let mut rels = Vec::with_capacity(registered.len());
    for &(_, shard_id, rti, relid) in &registered {
        if let Some((key_attno, key_type)) = shard_key(shard_id, relid)? {
            rels.push(statement_key::ShardRel {
                rti,
                key_attno,
                key_type,
            });
        }
    }
    // SAFETY: as above.
    let hashes = unsafe { statement_key::key_hashes(stmt, params, &rels) };
    let mut unseen = None;
    for (migration_id, shard_id, rti, _) in registered {
        let hash = hashes.get(&rti).copied().flatten();
        let pulls = wait_for_chunks(migration_id, shard_id, hash)?;
        // SAFETY: the snapshot is the statement's, live while it runs.
        if !snapshot.is_null() && pulls.iter().any(|&xid| unsafe { !sees(snapshot, xid) }) {
            unseen = Some((migration_id, shard_id));
        }
    }
    let Some((migration_id, shard_id)) = unseen else {
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

/// Does `snapshot` see what transaction `xid` (committed) wrote? A frozen or bootstrap xid is
/// seen by every snapshot.
///
/// # Safety
/// `snapshot` must be a valid MVCC snapshot.
unsafe fn sees(snapshot: pg_sys::Snapshot, xid: u32) -> bool {
    if xid < pg_sys::FirstNormalTransactionId.into_inner() {
        return true;
    }
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe { !pg_sys::XidInMVCCSnapshot(pg_sys::TransactionId::from(xid), snapshot) }
}

/// The shard key's attribute number and type in one shard table.
type ShardKey = (i16, pg_sys::Oid);

/// One chunk of a shard being pulled here, as this backend last read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chunk {
    chunk: i32,
    hash_lo: i32,
    hash_hi: i32,
    /// The transaction that pulled it (marked it pulled), once it is.
    pulled_by: Option<u32>,
}

/// The chunks a statement needs: the one holding `hash`, or all of them (no key, or a hash no
/// chunk holds).
fn needed(chunks: &[Chunk], hash: Option<i32>) -> Vec<Chunk> {
    if let Some(h) = hash {
        if let Some(c) = chunks.iter().find(|c| c.hash_lo <= h && h <= c.hash_hi) {
            return vec![*c];
        }
    }
    chunks.to_vec()
}

thread_local! {
    /// The chunks of each (migration, shard) this backend read, with what it saw pulled: a
    /// pulled chunk never becomes unpulled, so statements on pulled chunks read no catalog.
    /// Only lists that had chunks are kept (the list is written in one transaction).
    static CHUNKS: std::cell::RefCell<std::collections::HashMap<(i64, i64), Vec<Chunk>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());

    /// The shard key's attribute number and type in a shard table, by (shard id, relation).
    static SHARD_KEYS: std::cell::RefCell<std::collections::HashMap<(i64, pg_sys::Oid), Option<ShardKey>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Waits until the chunks of `shard_id` the statement needs ([`needed`]) are pulled, asking the
/// puller for them; the transactions that pulled them.
fn wait_for_chunks(
    migration_id: i64,
    shard_id: i64,
    hash: Option<i32>,
) -> Result<Vec<u32>, RemusError> {
    let key = (migration_id, shard_id);
    let mut asked = false;
    let mut fresh = false;
    loop {
        let cached = CHUNKS.with(|c| c.borrow().get(&key).cloned());
        let chunks = match cached {
            Some(chunks) if !fresh => chunks,
            _ => {
                let chunks = read_chunks(migration_id, shard_id)?;
                if chunks.is_empty() {
                    // No chunk (yet, or any more): nothing to pull, nothing to wait for.
                    return Ok(Vec::new());
                }
                CHUNKS.with(|c| c.borrow_mut().insert(key, chunks.clone()));
                fresh = true;
                chunks
            }
        };
        let need = needed(&chunks, hash);
        let Some(missing) = need.iter().find(|c| c.pulled_by.is_none()) else {
            return Ok(need.iter().filter_map(|c| c.pulled_by).collect());
        };
        if !fresh {
            // What this backend saw may be old: read the catalog before waiting.
            fresh = true;
            continue;
        }
        if !asked {
            ask(shard_id, hash.map(|_| missing.chunk))?;
            asked = true;
        }
        // Blocks while the puller's transaction holds the chunk's range lock.
        crate::pg::spi::read_one::<bool>(
            "SELECT pg_catalog.pg_advisory_unlock_shared(($1::bigint % 2147483647)::int4, $2)
               FROM (SELECT pg_catalog.pg_advisory_lock_shared(($1::bigint % 2147483647)::int4, $2)) l",
            &[shard_id.into(), missing.chunk.into()],
        )?;
        crate::pg::latch::wait_ms(POLL_MS);
    }
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

/// The chunks of `shard_id`, read with the latest snapshot (the pulls commit while statements
/// wait).
fn read_chunks(migration_id: i64, shard_id: i64) -> Result<Vec<Chunk>, RemusError> {
    // SAFETY: a snapshot pushed and popped around one catalog read, inside a transaction.
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let read = crate::pg::spi::connect(|c| {
        c.select(
            "SELECT chunk, hash_lo, hash_hi, CASE WHEN pulled THEN xmin::text::bigint END
               FROM remus.squall_chunks
              WHERE migration_id = $1 AND shard_id = $2 ORDER BY chunk",
            None,
            &[migration_id.into(), shard_id.into()],
        )?
        .map(|r| {
            Ok(Chunk {
                chunk: r.get::<i32>(1)?.unwrap_or_default(),
                hash_lo: r.get::<i32>(2)?.unwrap_or_default(),
                hash_hi: r.get::<i32>(3)?.unwrap_or_default(),
                pulled_by: r.get::<i64>(4)?.map(|x| x as u32),
            })
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    });
    // SAFETY: pops the snapshot pushed above (an error aborts the transaction, which clears
    // the stack).
    unsafe { pg_sys::PopActiveSnapshot() };
    Ok(read?)
}

/// The shard key's attribute number and type in shard table `relid` of `shard_id` (`None`: no
/// key column found), cached per backend.
fn shard_key(shard_id: i64, relid: pg_sys::Oid) -> Result<Option<ShardKey>, RemusError> {
    if let Some(k) = SHARD_KEYS.with(|k| k.borrow().get(&(shard_id, relid)).copied()) {
        return Ok(k);
    }
    let name = crate::pg::spi::read_one::<String>(
        "SELECT max(d.shard_key) FROM remus.shards s JOIN remus.distributed_tables d USING (logicalrelid)
          WHERE s.shard_id = $1",
        &[shard_id.into()],
    )?;
    let key = name.and_then(|name| {
        let name = std::ffi::CString::new(name).ok()?;
        // SAFETY: catalog lookups by relation and column name inside a transaction.
        unsafe {
            let attno = pg_sys::get_attnum(relid, name.as_ptr());
            (attno > 0).then(|| (attno, pg_sys::get_atttype(relid, attno)))
        }
    });
    SHARD_KEYS.with(|k| k.borrow_mut().insert((shard_id, relid), key));
    Ok(key)
}

/// Asks the shard's puller to pull now: chunk `chunk` first, or (`None`) the rest of the shard.
/// A shared advisory lock held until the transaction ends, which the puller looks for in
/// `pg_locks`: `(shard_id % 2^31-1, -2 - chunk)`, or `(…, -1)`.
fn ask(shard_id: i64, chunk: Option<i32>) -> Result<(), RemusError> {
    let request = chunk.map_or(-1, |c| -2 - c);
    crate::pg::spi::read_one::<bool>(
        "SELECT (SELECT pg_catalog.pg_advisory_xact_lock_shared(($1::bigint % 2147483647)::int4, $2)) IS NULL",
        &[shard_id.into(), request.into()],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{needed, Chunk};

    fn chunk(chunk: i32, hash_lo: i32, hash_hi: i32, pulled_by: Option<u32>) -> Chunk {
        Chunk {
            chunk,
            hash_lo,
            hash_hi,
            pulled_by,
        }
    }

    #[test]
    fn a_key_needs_its_chunk_anything_else_the_shard() {
        let chunks = [
            chunk(0, -100, -1, Some(900)),
            chunk(1, 0, 49, None),
            chunk(2, 50, 100, None),
        ];
        assert_eq!(needed(&chunks, Some(-100)), vec![chunks[0]]);
        assert_eq!(needed(&chunks, Some(49)), vec![chunks[1]]);
        assert_eq!(needed(&chunks, Some(50)), vec![chunks[2]]);
        assert_eq!(needed(&chunks, None), chunks.to_vec());
        // A hash outside every chunk (not this shard's): the whole shard, to be safe.
        assert_eq!(needed(&chunks, Some(101)), chunks.to_vec());
    }
}
