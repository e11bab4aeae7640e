//! Remus handover, node side: from Tm until the migration ends, the node a shard left (its drain
//! source, `remus.migration_drain_source`), and READ COMMITTED order across Tm: a newer writer
//! waits for the older ones.
//!
//! Between Tm and the end of a migration, a shard has two copies that take writes: the source,
//! where transactions whose view predates Tm keep running, and the destination, where every
//! newer transaction runs. A source transaction ships row images, not statements, so if a
//! destination transaction changes a row first, the source transaction's later validation can
//! only refuse it (40001), where a single node would have let it through by ordering the two
//! writers on the row lock and re-evaluating the second one (EvalPlanQual). Two waits put that
//! order back, both only while a migration is at its handover or drain:
//!
//! - [`wait_for_older_writers`]: before an UPDATE, DELETE or INSERT … ON CONFLICT is sent to a
//!   draining shard's new owner, the coordinating backend takes a share lock on the source's
//!   old copy of the rows the statement writes (its own WHERE, or its conflict values: the
//!   router builds that query, `router::modify::fence`), in a session of its own, and lets go
//!   of it once no other source session is queued for those rows (see
//!   [`wait_until_row_queue_is_empty`]). That waits for every source transaction that holds or
//!   is queued for the rows, and each of them validates before it commits and commits its
//!   shadow before it lets go of its locks; so the rows the destination then locks already
//!   carry their writes, and the newer writer re-evaluates on top of them, as on a single
//!   node. Writers of other rows of the shard (even with the same shard key) are not waited
//!   for (review F7). Once no older writer or row locker is left on the source's copy (the
//!   usual case soon after Tm), the fence only asks the source's lock manager that
//!   ([`source_copy_is_free`]: in the backend itself when this node is the source, else one
//!   query), with no share lock, no transaction and no session of its own.
//! - [`super::wait_decided`]: a READ COMMITTED transaction that routes a shard for the first
//!   time while this node's Tm is prepared (decided elsewhere, perhaps already committed on the
//!   destination) waits for that outcome and reads the map again, rather than start a new
//!   writer on the source while others already write on the destination.
//!
//! The drain wait cannot fail the statement (the in-doubt wait can, past
//! `remus.in_doubt_wait_timeout`, with 55006): a source that does not answer, or holds the row past
//! `remus.drain_wait_timeout`, is logged and the write goes ahead (its older writer may then
//! get the conflict it would have got without the wait).

use std::time::{Duration, Instant};

use pgrx::prelude::*;

use crate::catalog::{DistTable, ShardPlacement};
use crate::cluster::remote::{self, NodeAddr};
use crate::cluster::shard_marker;
use crate::error::RemusError;
use crate::migration::state::{active, migration_of, require_superuser, NODE_NAME_BYTES, STATE};
use crate::pg::sql::quote_literal;
use remus_proto::sqlstate::SqlState;

/// How long a fenced write on the drain source itself asks its own lock table, whatever holds
/// the copy, before it asks only while an older writer is at work there ([`waited_here`]).
const LOCAL_FENCE_POLL: Duration = Duration::from_millis(50);

/// The node `shard_id` is leaving, while its migration (Remus mode) is between Tm and its end:
/// a write routed to the shard on another node waits there first for the row's writers that
/// predate Tm ([`wait_for_older_writers`]).
pub(crate) fn drain_source_of(shard_id: i64) -> Option<String> {
    if !active() {
        return None;
    }
    let s = STATE.share();
    let migration_id = migration_of(&s, shard_id)?;
    s.migrations
        .iter()
        .find(|m| m.migration_id == migration_id)?
        .drain_source()
}

/// Is a drain fence on for any migration registered on this node?
fn any_drain_fence() -> bool {
    active()
        && STATE
            .share()
            .migrations
            .iter()
            .any(|m| m.migration_id != 0 && m.drain_source().is_some())
}

/// Before a write of `table` in `placement`: if the shard is draining from another node, waits
/// there for the older writers (holding or queued) of the rows `lock_rows` selects. `lock_rows`
/// is `SELECT … FROM <table> WHERE … FOR SHARE` over the distributed table's name, with `$n`
/// parameters `params` of type OIDs `types` (0: inferred).
pub(crate) fn wait_for_older_writers(
    table: &DistTable,
    placement: &ShardPlacement,
    lock_rows: &str,
    params: &[Option<String>],
    types: &[u32],
) -> Result<(), RemusError> {
    let Some(source) = drain_source_of(placement.shard_id) else {
        return Ok(());
    };
    // This transaction runs on the source itself (it predates Tm): it is one of the older ones.
    if source == placement.node_name {
        return Ok(());
    }
    let timeout_ms = crate::guc::DRAIN_WAIT_TIMEOUT_MS.get();
    if timeout_ms <= 0 {
        return Ok(());
    }
    // Nobody older left on the source's copy: nothing to wait for, and no session, row lock or
    // WAL flush spent finding that out. This node is the source: asked here, in this backend,
    // for as long as older writers are ending (`waited_here`); the long way would open a
    // session to this very node, which under catchup.sh's load, sixteen backends at once right
    // after Tm, cost each write 0.1-0.2 s.
    let here = crate::guc::node_name().as_deref() == Some(source.as_str());
    let shard_table = crate::catalog::shard_table_name(&table.rel_name, placement.shard_id);
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    if here && waited_here(table, placement, &shard_table, deadline) {
        return Ok(());
    }
    let addr = crate::cluster::nodes::lookup(&source)?;
    // The fence runs as a transaction of its own, outside this one: the share lock is dropped
    // as soon as the row is free and must not join the two-phase commit. When this backend's
    // cached connection to the source is not in this transaction (yet), that transaction runs
    // there, before this one reaches the source; otherwise on a connection kept for fences.
    // A new connection costs the loaded source about 10 ms of CPU: under the anchors' E1 every
    // client backend opened one right after Tm, a burst that slowed every client.
    let own_connection = remote::idle_connection_to(&addr.name);
    let fence = if own_connection {
        addr.clone()
    } else {
        NodeAddr {
            name: format!("{}#drain", addr.name),
            ..addr.clone()
        }
    };
    // This transaction's own sessions on the source (this backend, if this node is the source;
    // its participant session there, if it has one): an older writer queued behind one of them
    // waits for us, so waiting for it would be a cycle no deadlock detector sees (review F7).
    let mut own_pids = Vec::new();
    if here {
        // SAFETY: MyProcPid is set once at backend start and only read here.
        own_pids.push(unsafe { pg_sys::MyProcPid });
    }
    own_pids.extend(remote::in_transaction_backend_pid(&addr.name));
    let lock_row = shard_marker::marked(placement.shard_id, lock_rows);
    let waited = remote::with_connection(&fence, |c| {
        // The lock query and the look at the source's sessions run as the node user: as an
        // application role, pg_stat_activity would hide other roles' writers from it.
        c.act_as_node_user()?;
        // Registered as in a transaction while it waits, so an ERROR here (a cancel, a
        // statement timeout) makes the abort callback cancel the remote wait and roll it back.
        c.in_transaction = true;
        if !own_connection {
            // Fences happen only during a cleanup drain: the connection is closed at the first
            // transaction end after every fence on this node has ended, instead of staying open
            // to the source in every backend that once fenced (F19); until then this backend's
            // next fenced writes reuse it rather than pay a connection each.
            c.needed_while = Some(any_drain_fence);
        }
        // Another node is the source: the same question there, one round trip on this
        // connection, before the fence's own (a source on the previous release lacks the
        // function: the fence then runs as before).
        if !here && asked_free_on(c, &table.rel_name, placement.shard_id) {
            c.in_transaction = false;
            return Ok(true);
        }
        let r = wait_until_row_queue_is_empty(
            c,
            &lock_row,
            params,
            types,
            &shard_table,
            &own_pids,
            deadline,
        );
        if r.is_err() {
            let _ = c.exec("ROLLBACK");
        }
        c.in_transaction = false;
        r
    });
    match waited {
        Ok(true) => {}
        Ok(false) => log!(
            "pg_remus: shard {} of {}: older writers of the row still queued on {source} after \
             remus.drain_wait_timeout ({timeout_ms} ms); the write goes ahead",
            placement.shard_id,
            table.qualified_name
        ),
        // The source shard is already gone (the drain is over): nothing older is left to wait for.
        Err(RemusError::Remote { sqlstate, .. })
            if *sqlstate == SqlState::NOT_SHARD_OWNER || *sqlstate == SqlState::UNDEFINED_TABLE => {
        }
        Err(e) => log!(
            "pg_remus: shard {} of {}: no wait on {source} for older writers of the row: {e}",
            placement.shard_id,
            table.qualified_name
        ),
    }
    Ok(())
}

/// The fence on the source itself, before the long way: true once the source's copy is free
/// ([`source_copy_is_free`]). Asked every 2 ms for `LOCAL_FENCE_POLL` (the older writers end
/// around Tm, other fences hold their share locks for moments), then for as long as an older
/// writer is still running a statement there: the long way would wait for it too
/// ([`wait_until_row_queue_is_empty`]), in a session opened to this very node. False when only
/// writers between statements (or none) hold the copy, or at `deadline`: the long way then
/// waits for the rows' holders alone.
fn waited_here(
    table: &DistTable,
    placement: &ShardPlacement,
    shard_table: &str,
    deadline: Instant,
) -> bool {
    // SAFETY: MyProcPid is set once at backend start and only read here.
    let me = [unsafe { pg_sys::MyProcPid }];
    let look = writers_at_work_sql(shard_table, &me);
    let relid = source_copy_relid(&table.rel_name, placement.shard_id);
    let quick_until = Instant::now() + LOCAL_FENCE_POLL;
    // Each ask is a conditional lock; the dearer looks in `pg_locks` (past a vacuum's lock, and
    // for a writer at work) only every tenth, so that sixteen backends asking at once do not
    // queue on the lock manager's partition locks that the writers they wait for need.
    for ask in 0u64.. {
        let look_closer = ask % 10 == 0;
        if source_copy_is_free(relid, look_closer) {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        if now >= quick_until && look_closer {
            let at_work = crate::pg::spi::read_one::<bool>(&look, &[])
                .ok()
                .flatten()
                .unwrap_or(false);
            if !at_work {
                return false;
            }
        }
        crate::pg::latch::wait_ms(2);
    }
    false
}

/// Is `relid`, the copy of a shard on this node (a drain source, [`source_copy_relid`]), free
/// of every older writer and row locker: does no other transaction hold, or wait for, a lock on
/// it that a write (`RowExclusiveLock`) or a row lock (`RowShareLock`) takes? Then the fence
/// has nothing to wait for. Asked with a conditional `ExclusiveLock`, let go at once: no wait,
/// no row lock, no xid, no WAL (only `AccessExclusiveLock` is logged), and prepared
/// transactions and fast-path holders are seen, as the lock manager sees them. Readers
/// (`AccessShareLock`) do not conflict; when the lock is refused and `look_in_pg_locks`, holders
/// that only read or maintain the table (autovacuum) are told apart in `pg_locks`
/// ([`only_readers_and_maintenance_on`]). Any other holder (another fence's share locks
/// included) sends the caller the long way, [`wait_until_row_queue_is_empty`]. A copy that is
/// gone (the drain ended and cleanup dropped it) is free.
fn source_copy_is_free(relid: pg_sys::Oid, look_in_pg_locks: bool) -> bool {
    if relid == pg_sys::InvalidOid {
        return true;
    }
    // SAFETY: in a transaction (a statement is being routed, or the SQL function runs): a
    // conditional lock, which neither waits nor raises, let go before returning. A relid whose
    // relation was dropped since it was looked up locks nothing anybody holds: free, as gone.
    unsafe {
        if !pg_sys::ConditionalLockRelationOid(relid, pg_sys::ExclusiveLock as i32) {
            return look_in_pg_locks && only_readers_and_maintenance_on(relid);
        }
        pg_sys::UnlockRelationOid(relid, pg_sys::ExclusiveLock as i32);
    }
    true
}

/// The source's copy of shard `shard_id` of table `rel_name` on this node, InvalidOid when it
/// is not there (any more). Looked up once per fence, not at every ask.
fn source_copy_relid(rel_name: &str, shard_id: i64) -> pg_sys::Oid {
    let name = format!("{rel_name}_{shard_id}");
    if name.contains('\0') {
        return pg_sys::InvalidOid;
    }
    // SAFETY: in a transaction: a catalog lookup of a palloc'd RangeVar that outlives it.
    unsafe { crate::pg::relation::relid_of(crate::pg::relation::shard_range_var(&name)) }
}

/// After the conditional lock failed: is every other lock on `relid` a reader's
/// (`AccessShareLock`) or a maintenance one (`ShareUpdateExclusiveLock`: autovacuum, which a
/// busy shard's source copy often has running, ANALYZE)? Then no writer or row locker holds or
/// waits for it either. Read from `pg_locks`, which also lists fast-path locks and prepared
/// transactions' (no pid): dearer than the lock, so asked only when the lock said no.
fn only_readers_and_maintenance_on(relid: pg_sys::Oid) -> bool {
    crate::pg::spi::read_one::<bool>(
        "SELECT NOT EXISTS (
             SELECT FROM pg_catalog.pg_locks
              WHERE locktype = 'relation' AND relation = $1
                AND database = (SELECT oid FROM pg_catalog.pg_database
                                 WHERE datname = pg_catalog.current_database())
                AND mode NOT IN ('AccessShareLock', 'ShareUpdateExclusiveLock')
                AND pid IS DISTINCT FROM pg_catalog.pg_backend_pid())",
        &[relid.into()],
    )
    .ok()
    .flatten()
    .unwrap_or(false)
}

/// [`source_copy_is_free`] asked on the source over `c` (`remus.drain_source_copy_is_free`).
/// False on any error: the caller then runs the whole fence, which is always safe.
fn asked_free_on(c: &mut remote::RemoteConnection, rel_name: &str, shard_id: i64) -> bool {
    let q = format!(
        "SELECT remus.drain_source_copy_is_free({}, {shard_id})",
        quote_literal(rel_name)
    );
    matches!(
        c.exec(&q).map(|r| r.rows.first().and_then(|row| row.first()).cloned().flatten()),
        Ok(Some(v)) if v == "t"
    )
}

/// The fence's look (see [`wait_until_row_queue_is_empty`]): is a session other than this one
/// running a statement while it holds `shard_table`'s write lock, leaving out one whose lock
/// wait leads to `own_pids`? A `shard_table` that is gone has no writer.
fn writers_at_work_sql(shard_table: &str, own_pids: &[i32]) -> String {
    let own = if own_pids.is_empty() {
        "'{}'::int[]".to_string()
    } else {
        format!(
            "ARRAY[{}]::int[]",
            own_pids
                .iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    format!(
        "WITH RECURSIVE writer AS (
             SELECT l.pid FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
              WHERE l.locktype = 'relation' AND l.relation = pg_catalog.to_regclass({table})
                AND l.mode = 'RowExclusiveLock' AND l.granted
                AND a.state = 'active' AND l.pid <> pg_catalog.pg_backend_pid()),
         blocked_by(writer, pid, depth) AS (
             SELECT w.pid, b, 1 FROM writer w, unnest(pg_catalog.pg_blocking_pids(w.pid)) b
                WHERE cardinality({own}) > 0
             UNION
             SELECT bb.writer, b, bb.depth + 1
               FROM blocked_by bb, unnest(pg_catalog.pg_blocking_pids(bb.pid)) b
              WHERE bb.depth < 16 AND bb.pid <> ALL ({own}))
         SELECT EXISTS (SELECT 1 FROM writer w
                         WHERE NOT EXISTS (SELECT 1 FROM blocked_by bb
                                            WHERE bb.writer = w.pid AND bb.pid = ANY ({own})))",
        table = quote_literal(shard_table)
    )
}

/// Why one share lock is not enough: the rows' older writers queue for them, and between two
/// of them a row can be free for an instant (the next one is woken but not yet running, or is
/// following the update chain to the new version), long enough for a share lock to be granted
/// ahead of the rest. So, holding the share locks, the fence also asks whether another session
/// that holds the source shard table's write lock (every writer takes it before it looks for
/// its row, and keeps it until it ends) is running a statement (queued, woken or in flight).
/// If so it lets go, pauses, and tries again, until the rows are free with no such
/// writer. Only source transactions whose view predates Tm write the source copy, so they
/// drain and do not come back.
///
/// Not waited for (review F7): a writer idle between statements that does not hold these rows,
/// and a writer whose lock wait leads (through `pg_blocking_pids`, transitively) to one of
/// `own_pids`, this transaction's own sessions on the source: it cannot go on before this
/// transaction ends, so waiting for it is a cycle through this loop that PostgreSQL's deadlock
/// detector cannot see, and it used to last until `deadline`. Every other writer running a
/// statement is waited for, even one blocked on another row: skipping all blocked writers let
/// TPC-B clients that predate Tm fail with 40001 in the fresh-clone CI of 00ce58e (a writer
/// blocked behind another older writer of the same row is such a writer). A cycle through a
/// session the fencing backend does not know (this transaction's session on the source opened
/// by another node of it, when the statement was forwarded) still lasts until `deadline`
/// (`remus.drain_wait_timeout`). Returns false when writers were still at work at `deadline`.
fn wait_until_row_queue_is_empty(
    c: &mut remote::RemoteConnection,
    lock_row: &str,
    params: &[Option<String>],
    types: &[u32],
    shard_table: &str,
    own_pids: &[i32],
    deadline: Instant,
) -> Result<bool, RemusError> {
    let writers_at_work = writers_at_work_sql(shard_table, own_pids);
    // Two round trips a try, not five: every fenced write pays them while older writers drain
    // (tens of milliseconds after Tm under the anchors' E1). The pause, the transaction's
    // opening and the share locks go in one pipelined flight, the look and the end in one
    // query string. The end is a ROLLBACK: the share locks gave the transaction an xid, and a
    // COMMIT would wait for a WAL flush on the source for nothing (under catchup.sh's load,
    // 60-80 ms on a disk the handover keeps busy).
    let look_and_end = format!("{writers_at_work}; ROLLBACK");
    let mut pause = false;
    loop {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .as_millis();
        if left == 0 {
            return Ok(false);
        }
        let mut opening = Vec::with_capacity(3);
        if pause {
            opening.push("SELECT pg_catalog.pg_sleep(0.002)".to_string());
        }
        opening.push("BEGIN".to_string());
        opening.push(format!("SET LOCAL lock_timeout = {left}"));
        if params.is_empty() {
            // Not prepared: a statement without parameters carries the client's own literals,
            // and preparing each would crowd out this session's prepared statements.
            c.exec_after(&opening, lock_row)?;
        } else {
            c.exec_params_after(&opening, lock_row, params, types)?;
        }
        let busy = c.exec(&look_and_end)?;
        if busy
            .rows
            .first()
            .and_then(|r| r.first())
            .cloned()
            .flatten()
            .as_deref()
            != Some("t")
        {
            return Ok(true);
        }
        pause = true;
    }
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::handover::remus::*;

    /// On a drain source: is its copy of shard `shard_id` of `rel_name` free of every older
    /// writer and row locker (no transaction holds or waits for a write or row lock on it)?
    /// Asked by another node's drain fence before it waits there (`source_copy_is_free`).
    #[pg_extern(volatile, parallel_unsafe)]
    fn drain_source_copy_is_free(rel_name: &str, shard_id: i64) -> bool {
        require_superuser("remus.drain_source_copy_is_free");
        source_copy_is_free(source_copy_relid(rel_name, shard_id), true)
    }

    /// Remus mode, at Tm: from now until `migration_end` (or a call with `source_node` `''`),
    /// a write routed to one of the migration's shards on a node other than `source_node` first
    /// waits on `source_node` for the transactions there that hold the row (they predate Tm),
    /// so it follows them the way a READ COMMITTED writer follows an older one on a single
    /// node, instead of leaving them a write-write conflict. `''` ends that: the coordinator
    /// calls it once every transaction older than Tm has ended, when the fence (a connection
    /// to the source per fenced transaction) could only find nothing. The migration must be
    /// registered. Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_drain_source(migration_id: i64, source_node: &str) {
        require_superuser("remus.migration_drain_source");
        if source_node.len() >= NODE_NAME_BYTES {
            RemusError::LengthOutOfRange {
                what: "node name",
                max: NODE_NAME_BYTES - 1,
            }
            .raise();
        }
        let mut s = STATE.exclusive();
        match s
            .migrations
            .iter_mut()
            .find(|m| m.migration_id == migration_id)
        {
            Some(m) => {
                m.drain_source = [0; NODE_NAME_BYTES];
                m.drain_source[..source_node.len()].copy_from_slice(source_node.as_bytes());
            }
            None => {
                drop(s);
                RemusError::MigrationNotRegistered { migration_id }.raise()
            }
        }
        crate::migration::durable::sync_after(s, migration_id);
    }
}
