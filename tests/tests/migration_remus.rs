//! Remus mode (sync barrier, MOCC dual execution, ordered diversion) on a real 3-node cluster.
//!
//! - Under pgbench TPC-B against all three nodes with no retries, four account shards move and
//!   then n3 is consolidated onto n1 and n2: no transaction fails except counted write-write
//!   conflicts on a hot row across Tm (see the test), every balance equals the sum
//!   of its history deltas (row by row, so a lost or doubled write anywhere shows), and nothing
//!   of the migrations is left behind.
//! - Transactions spanning the handover: a writer that began during the copy (the migration is
//!   paused there by a failpoint) and stays open 20 s, across Tm, commits afterwards on the source and its write is on the destination; a long
//!   read-only transaction is never blocked; a writer that was already writing when the
//!   migration started is waited for (the migration says so), never aborted; a transaction
//!   that begins after Tm runs on the destination.
//! - A forced write-write conflict under REPEATABLE READ: the source transaction gets 40001 and
//!   the destination keeps the winner's write.
//! - Rows written through the stream and through validated shadows carry the source's commit
//!   timestamps.
//! - COMMIT inside a procedure and 2PC participants (COMMIT / ROLLBACK PREPARED) in dual
//!   execution: the destination has the outcome before the statement returns.
//! - A stream or destination failure during dual execution: source commits get an error, not a
//!   hang; the migration rolls back before Tm and completes from the prepared shadows after it,
//!   waiting for a destination that is down.
//! - The coordinator killed (SIGKILL) in dual execution or right after the Tm decision: its
//!   successor (`remusctl cluster start-coordinator`) rolls the migration back or completes it.
//! - A REPEATABLE READ snapshot older than Tm that first reads a moved table after Tm leaves no
//!   stale owner in its backend's shard-map cache: the backend's later transactions run on
//!   the new owner.

use std::thread;
use std::time::{Duration, Instant};

use coordinator::failpoint::{COPY_SNAPSHOT_EXPORTED, DUAL_STARTED, HANDOVER_DECIDED};
use integration::pgbench::{balances, finish, init_tpcb, prepared_everywhere};
use integration::shards::{assert_owns_no_shard, owners, owners_everywhere, TPCB_TABLES};
use remus_test_support::cluster::TestCluster;
use remus_test_support::{wait_for, wait_until};

struct Moved {
    migration_id: i64,
    status: String,
    aborted: i64,
}

fn migrate(c: &TestCluster, via: &str, shard: i64, target: &str) -> Moved {
    let mut db = c.connect(via).unwrap();
    let row = db
        .query_one(
            "SELECT migration_id, status, aborted_by_migration, copy_ms, catchup_ms, handover_ms,
                    cleanup_ms, total_ms, txns_replayed
               FROM remus_migrate_shard($1, $2)",
            &[&shard, &target],
        )
        .unwrap_or_else(|e| panic!("migrating shard {shard} to {target}: {e:?}"));
    let m = Moved {
        migration_id: row.get(0),
        status: row.get(1),
        aborted: row.get(2),
    };
    println!(
        "migration {} shard {shard} -> {target}: {} copy {} ms, catchup {} ms, handover {} ms, cleanup {} ms, total {} ms, replayed {}, aborted {}",
        m.migration_id,
        m.status,
        row.get::<_, i64>(3),
        row.get::<_, i64>(4),
        row.get::<_, i64>(5),
        row.get::<_, i64>(6),
        row.get::<_, i64>(7),
        row.get::<_, i64>(8),
        m.aborted
    );
    m
}

fn owner_of(c: &TestCluster, shard: i64) -> String {
    let mut db = c.connect("n1").unwrap();
    db.query_one(
        "SELECT node_name FROM remus_shards WHERE shard_id = $1",
        &[&shard],
    )
    .unwrap()
    .get(0)
}

/// Rows of `table` whose balance differs from the sum of its history deltas.
fn balance_mismatches(c: &TestCluster, table: &str, key: &str, balance: &str) -> i64 {
    let mut db = c.connect("n2").unwrap();
    db.query_one(
        &format!(
            "SELECT count(*) FROM (SELECT {key}, {balance} FROM {table}) t
               FULL JOIN (SELECT {key}, sum(delta) AS d FROM pgbench_history GROUP BY {key}) h USING ({key})
              WHERE coalesce(t.{balance}, 0) <> coalesce(h.d, 0) OR t.{key} IS NULL"
        ),
        &[],
    )
    .unwrap()
    .get(0)
}

#[test]
fn remus_moves_and_consolidates_under_tpcb_without_failures() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 4);
    let before = owners(&c, "pgbench_accounts");
    assert!(before.len() >= 8, "{before:?}");

    let loads: Vec<_> = c
        .node_names()
        .iter()
        .map(|n| {
            c.pgbench(
                n,
                &[
                    "-n",
                    "-c",
                    "4",
                    "-j",
                    "2",
                    "-T",
                    "120",
                    "--max-tries=1",
                    "--verbose-errors",
                ],
            )
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    thread::sleep(Duration::from_secs(3));

    let mut moved = Vec::new();
    for (i, (shard, owner)) in before.iter().take(4).enumerate() {
        let target = match owner.as_str() {
            "n1" => "n2",
            "n2" => "n3",
            _ => "n1",
        };
        moved.push(migrate(&c, &format!("n{}", i % 3 + 1), *shard, target));
    }
    let mut k = 0;
    for table in ["pgbench_accounts", "pgbench_branches", "pgbench_tellers"] {
        for (shard, owner) in owners(&c, table) {
            if owner == "n3" {
                let target = if k % 2 == 0 { "n1" } else { "n2" };
                k += 1;
                moved.push(migrate(&c, "n2", shard, target));
            }
        }
    }
    let results: Vec<_> = loads.into_iter().map(finish).collect();

    for m in &moved {
        assert_eq!(m.status, "succeeded", "migration {}", m.migration_id);
    }
    let failed: u64 = results.iter().map(|r| r.failed).sum();
    let processed: u64 = results.iter().map(|r| r.processed).sum();
    let aborted: i64 = moved.iter().map(|m| m.aborted).sum();
    println!("remus: {} migrations, pgbench {processed} committed, {failed} failed; aborted_by_migration {aborted}", moved.len());
    for r in &results {
        assert_eq!(r.aborted_clients, 0, "a pgbench client died: {}", r.output);
        assert!(r.processed > 0, "{}", r.output);
    }
    // No transaction fails: under READ COMMITTED a destination writer that follows Tm waits
    // on the source for the row's older writers (the holder and the ones queued behind it:
    // the branch rows are hot), and a transaction that routes a shard while
    // its node's Tm is in doubt waits for the outcome, so no source transaction meets a newer
    // version on the destination (migration::handover::remus).
    let outputs: Vec<_> = results.iter().map(|r| &r.output).collect();
    assert_eq!(
        failed as i64, aborted,
        "every pgbench failure must be a counted write-write conflict: {outputs:?}"
    );
    assert_eq!(failed, 0, "{outputs:?}");

    let (a, b, t, h) = balances(&c, "n1");
    assert_eq!((a, b, t), (h, h, h), "balances diverge from the history");
    let history: i64 = c
        .connect("n3")
        .unwrap()
        .query_one("SELECT count(*) FROM pgbench_history", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        history as u64, processed,
        "one history row per committed transaction"
    );
    // Row by row: every moved account, teller and branch holds exactly its history.
    assert_eq!(
        balance_mismatches(&c, "pgbench_accounts", "aid", "abalance"),
        0
    );
    assert_eq!(
        balance_mismatches(&c, "pgbench_tellers", "tid", "tbalance"),
        0
    );
    assert_eq!(
        balance_mismatches(&c, "pgbench_branches", "bid", "bbalance"),
        0
    );
    assert_owns_no_shard(&c, "n3", &TPCB_TABLES);
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(prepared_everywhere(&c), 0);
}

/// The first account id of `shard` (accounts exist for every shard at scale 1).
fn an_account_of(c: &TestCluster, shard: i64, skip: i64) -> i32 {
    let owner = owner_of(c, shard);
    let mut on_owner = c.connect(&owner).unwrap();
    let table = format!("remus_shards.pgbench_accounts_{shard}");
    on_owner
        .query_one(
            &format!("SELECT aid FROM {table} ORDER BY aid OFFSET $1 LIMIT 1"),
            &[&skip],
        )
        .unwrap()
        .get(0)
}

fn phase_of(
    db: &mut postgres::Client,
    migration: Option<i64>,
) -> Option<(i64, String, Option<String>)> {
    let rows = db
        .query(
            "SELECT migration_id, phase, waiting_on FROM remus_migrations
              WHERE status = 'running' AND ($1::bigint IS NULL OR migration_id = $1) ORDER BY migration_id DESC LIMIT 1",
            &[&migration],
        )
        .unwrap();
    rows.first().map(|r| (r.get(0), r.get(1), r.get(2)))
}

fn wait_for_phase(
    c: &TestCluster,
    phases: &[&str],
    limit: Duration,
) -> (i64, String, Option<String>) {
    let mut db = c.connect("n1").unwrap();
    wait_for(
        limit,
        Duration::from_millis(20),
        || phase_of(&mut db, None).filter(|p| phases.contains(&p.1.as_str())),
        || format!("no migration reached {phases:?}"),
    )
}

/// An open transaction holding a write lock (ROW EXCLUSIVE, what a writer holds) on the
/// accounts shard table, without an xid (so the slot creation does not wait for it), from
/// before the migration: the sync barrier waits for it, which holds the migration there while a
/// test sets the scene.
fn hold_barrier(c: &TestCluster, source: &str, shard: i64) -> postgres::Client {
    let mut db = c.connect(source).unwrap();
    db.batch_execute(&format!(
        "BEGIN; LOCK TABLE remus_shards.pgbench_accounts_{shard} IN ROW EXCLUSIVE MODE"
    ))
    .unwrap();
    db
}

/// Waits until node `via` sees `target` as the owner of `shard` (Tm committed there: the
/// phase moves to cleanup at the decision, before the nodes commit).
fn wait_owner(c: &TestCluster, via: &str, shard: i64, target: &str) {
    let mut db = c.connect(via).unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(10),
        || {
            let owner: String = db
                .query_one(
                    "SELECT node_name FROM remus_shards WHERE shard_id = $1",
                    &[&shard],
                )
                .unwrap()
                .get(0);
            owner == target
        },
        || format!("{via} never saw {target} owning shard {shard}"),
    );
}

type MigrationCall = thread::JoinHandle<Result<(String, i64), postgres::Error>>;

/// `remus_migrate_shard(shard, 'n2')` through n3, in a thread.
fn start_migration(c: &TestCluster, shard: i64) -> MigrationCall {
    let mut db = c.connect("n3").unwrap();
    thread::spawn(move || {
        db.query_one(
            "SELECT status, aborted_by_migration FROM remus_migrate_shard($1, 'n2')",
            &[&shard],
        )
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
    })
}

/// A 3-node TPC-B cluster (scale 1) moving one of n1's account shards to n2, held at its sync
/// barrier by an open write lock: the cluster, the shard, its source, the migration call and
/// the holder (commit it to let the migration go on).
fn held_at_barrier() -> (TestCluster, i64, String, MigrationCall, postgres::Client) {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let holder = hold_barrier(&c, &source, shard);
    let mover = start_migration(&c, shard);
    wait_for_phase(&c, &["barrier"], Duration::from_secs(60));
    (c, shard, source, mover, holder)
}

/// How long the spanning writer stays open in all (from inside the copy to past Tm).
const SPANNING_OPEN: Duration = Duration::from_secs(20);

#[test]
fn transactions_spanning_the_handover_are_never_blocked_or_aborted() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let target = "n2";
    let early_aid = an_account_of(&c, shard, 0);
    let span_aid = an_account_of(&c, shard, 1);
    let new_aid = an_account_of(&c, shard, 2);

    // Already writing the shard when the migration starts (it holds an xid: the slot's
    // creation waits for it, and the sync barrier would too).
    let mut early = c.connect(&source).unwrap();
    early.batch_execute("BEGIN").unwrap();
    early
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 7 WHERE aid = $1",
            &[&early_aid],
        )
        .unwrap();

    // The migration stops inside its copy (snapshot exported, no row copied yet) so that the
    // spanning writer below provably begins while the copy is under way.
    c.arm_pause(COPY_SNAPSHOT_EXPORTED).unwrap();
    let mover = start_migration(&c, shard);

    // The migration waits for the early writer, and says so in remus_migrations.
    let mut n1 = c.connect("n1").unwrap();
    let said = wait_for(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || phase_of(&mut n1, None).and_then(|(_, _, w)| w),
        || "remus_migrations never said what the migration waits for".into(),
    );
    assert!(said.contains("waits for transactions"), "{said}");
    // The early writer is not blocked: it keeps working and commits.
    early
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = $1",
            &[&early_aid],
        )
        .unwrap();
    early
        .batch_execute("COMMIT")
        .expect("a writer from before the migration commits");

    // The copy is under way: a writer begins now and stays open across Tm.
    let migration = c
        .wait_paused_at(COPY_SNAPSHOT_EXPORTED, Duration::from_secs(120))
        .unwrap();
    let (id, phase, _) = phase_of(&mut n1, Some(migration)).expect("the paused migration runs");
    assert_eq!((id, phase.as_str()), (migration, "copy"));
    let mut spanning = c.connect(&source).unwrap();
    spanning.batch_execute("BEGIN").unwrap();
    let spanning_began = Instant::now();
    spanning
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 11 WHERE aid = $1",
            &[&span_aid],
        )
        .unwrap();
    // A long read-only transaction with a snapshot from before Tm, through another node.
    let mut reader = c.connect("n3").unwrap();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    let sum_before: i64 = reader
        .query_one(
            "SELECT sum(abalance)::bigint FROM pgbench_accounts WHERE aid = $1",
            &[&span_aid],
        )
        .unwrap()
        .get(0);
    c.release_failpoint(COPY_SNAPSHOT_EXPORTED).unwrap();

    // Catch-up, the sync barrier, dual execution and Tm all happen while `spanning` is open:
    // the migration reaches cleanup (draining it).
    let (_, phase, _) = wait_for_phase(&c, &["cleanup"], Duration::from_secs(120));
    assert_eq!(phase, "cleanup");
    wait_owner(&c, "n3", shard, target);

    // A transaction that begins after Tm, through any node, runs on the destination: its
    // write lands in the destination's shard table (the source's is still there, draining).
    let mut n3 = c.connect("n3").unwrap();
    n3.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = $1",
        &[&new_aid],
    )
    .unwrap();
    let mut dest = c.connect(target).unwrap();
    dest.batch_execute("SET remus.migration_session = on")
        .unwrap();
    let on_dest: i32 = dest
        .query_one(
            &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&new_aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(on_dest, 5);

    // The long reader is never blocked and keeps its snapshot.
    let again: i64 = reader
        .query_one(
            "SELECT sum(abalance)::bigint FROM pgbench_accounts WHERE aid = $1",
            &[&span_aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(again, sum_before);
    reader.batch_execute("COMMIT").unwrap();

    // The spanning writer stays open well past Tm, writes once more on the source and commits;
    // then its write is on the destination. The migration is still draining it meanwhile.
    thread::sleep(
        SPANNING_OPEN
            .saturating_sub(spanning_began.elapsed())
            .max(Duration::from_secs(2)),
    );
    let (_, phase, _) =
        phase_of(&mut n1, Some(migration)).expect("the migration waits for the spanning writer");
    assert_eq!(phase, "cleanup");
    spanning
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 100 WHERE aid = $1",
            &[&span_aid],
        )
        .unwrap();
    spanning
        .batch_execute("COMMIT")
        .expect("a transaction spanning Tm commits");
    println!(
        "the spanning writer was open {:?}, from the copy to after Tm",
        spanning_began.elapsed()
    );

    let (status, aborted) = mover.join().unwrap().expect("migration call");
    assert_eq!((status.as_str(), aborted), ("succeeded", 0));
    let v: i32 = dest
        .query_one(
            &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&span_aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(v, 111);
    let v: i32 = dest
        .query_one(
            &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&early_aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(v, 8);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

#[test]
fn write_write_conflict_across_the_handover_aborts_exactly_one() {
    // Held at the barrier while the test sets the scene.
    let (c, shard, source, mover, mut holder) = held_at_barrier();
    let aid = an_account_of(&c, shard, 0);
    let stamped_aid = an_account_of(&c, shard, 1);
    let pin_aid = an_account_of(&c, shard, 2);
    // The loser: a REPEATABLE READ transaction on the source that uses the shard before Tm
    // (so it stays there) and writes the contested row only after the winner committed it.
    let mut loser = c.connect(&source).unwrap();
    loser
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    loser
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = $1",
            &[&pin_aid],
        )
        .unwrap();
    // A row written (autocommit) through the source while the stream carries changes: its
    // commit time is checked on the destination afterwards.
    let mut src = c.connect(&source).unwrap();
    src.execute(
        "UPDATE pgbench_accounts SET abalance = 42 WHERE aid = $1",
        &[&stamped_aid],
    )
    .unwrap();
    let mut src_shadow = c.connect(&source).unwrap();
    src_shadow
        .batch_execute("SET remus.migration_session = on")
        .unwrap();
    let source_ts: String = src_shadow
        .query_one(
            &format!("SELECT pg_xact_commit_timestamp(xmin)::text FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&stamped_aid],
        )
        .unwrap()
        .get(0);
    holder.batch_execute("COMMIT").unwrap();

    // After Tm, the winner writes the same row on the destination (through n3) and commits.
    wait_for_phase(&c, &["cleanup"], Duration::from_secs(120));
    wait_owner(&c, "n3", shard, "n2");
    let mut winner = c.connect("n3").unwrap();
    winner
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 1000 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    // On the source the row is as the loser's snapshot has it; the destination has a newer
    // version, written by a transaction that is not the loser's shadow.
    loser
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();

    let err = loser
        .batch_execute("COMMIT")
        .expect_err("the source transaction loses the write-write conflict");
    assert_eq!(err.code().map(|c| c.code()), Some("40001"), "{err:?}");
    assert_eq!(mover.join().unwrap().expect("migration").0, "succeeded");

    let mut dest = c.connect("n2").unwrap();
    dest.batch_execute("SET remus.migration_session = on")
        .unwrap();
    let v: i32 = dest
        .query_one(
            &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(v, 1000, "the destination holds the winner's write");
    let v: i32 = dest
        .query_one(
            &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&pin_aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(v, 0, "nothing of the loser reached the destination");
    // Shadow rows carry the source's commit timestamps.
    let dest_ts: String = dest
        .query_one(
            &format!("SELECT pg_xact_commit_timestamp(xmin)::text FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&stamped_aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(dest_ts, source_ts);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

#[test]
fn a_validated_commit_is_readable_on_the_destination_when_the_client_gets_it() {
    let (c, shard, source, mover, mut holder) = held_at_barrier();
    let aid = an_account_of(&c, shard, 0);
    // A transaction open across Tm (so it commits in sync mode, after the flip), committed on
    // the source; the very next read, on the destination, sees it. A read-only transaction on
    // the source keeps the drain (and the source table) alive meanwhile.
    let mut t = c.connect(&source).unwrap();
    t.batch_execute("BEGIN").unwrap();
    t.execute(
        "UPDATE pgbench_accounts SET abalance = 777 WHERE aid = $1",
        &[&aid],
    )
    .unwrap();
    let mut old_reader = c.connect(&source).unwrap();
    old_reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .unwrap();
    holder.batch_execute("COMMIT").unwrap();
    wait_for_phase(&c, &["cleanup"], Duration::from_secs(120));
    wait_owner(&c, "n1", shard, "n2");
    t.batch_execute("COMMIT").unwrap();
    let mut dest = c.connect("n2").unwrap();
    dest.batch_execute("SET remus.migration_session = on")
        .unwrap();
    let row = dest
        .query_one(
            &format!("SELECT abalance, pg_xact_commit_timestamp(xmin)::text FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&aid],
        )
        .unwrap();
    assert_eq!(
        row.get::<_, i32>(0),
        777,
        "read-your-writes across the move"
    );
    // The validated shadow committed with the source transaction's commit time.
    let mut src = c.connect(&source).unwrap();
    src.batch_execute("SET remus.migration_session = on")
        .unwrap();
    let source_ts: String = src
        .query_one(
            &format!("SELECT pg_xact_commit_timestamp(xmin)::text FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(row.get::<_, String>(1), source_ts);
    old_reader.batch_execute("COMMIT").unwrap();
    let (status, aborted) = mover.join().unwrap().expect("migration");
    assert_eq!((status.as_str(), aborted), ("succeeded", 0));
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// Holds Tm on `node`: Tm's UPDATE of the shard's map row there waits for this lock, so the
/// migration stays in dual execution while a test sets the scene.
fn hold_tm(c: &TestCluster, node: &str, shard: i64) -> postgres::Client {
    let mut db = c.connect(node).unwrap();
    db.batch_execute("BEGIN").unwrap();
    db.execute(
        "SELECT 1 FROM remus.shard_map WHERE shard_id = $1 FOR UPDATE",
        &[&shard],
    )
    .unwrap();
    db
}

/// Waits until a session on `node` waits for a lock on the shard map (Tm is held there).
fn wait_tm_blocked(c: &TestCluster, node: &str) {
    let mut db = c.connect(node).unwrap();
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(20),
        || {
            let n: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE '%shard_map%'",
                    &[],
                )
                .unwrap()
                .get(0);
            n > 0
        },
        || format!("Tm never reached the shard map on {node}"),
    );
}

fn balance_on(db: &mut postgres::Client, shard: i64, aid: i32) -> i32 {
    db.batch_execute("SET remus.migration_session = on")
        .unwrap();
    db.query_one(
        &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
        &[&aid],
    )
    .unwrap()
    .get(0)
}

/// The commit time (text) of the version of account `aid` in the shard table on this node.
fn row_commit_time(db: &mut postgres::Client, shard: i64, aid: i32) -> String {
    db.batch_execute("SET remus.migration_session = on")
        .unwrap();
    db.query_one(
        &format!("SELECT pg_xact_commit_timestamp(xmin)::text FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
        &[&aid],
    )
    .unwrap()
    .get(0)
}

/// The commit time (text) of transaction `xid` (a `txid_current()` value) on this node.
fn xact_commit_time(db: &mut postgres::Client, xid: i64) -> String {
    db.query_one(
        "SELECT pg_xact_commit_timestamp(($1 % 4294967296)::text::xid)::text",
        &[&xid],
    )
    .unwrap()
    .get(0)
}

/// A user 2PC transaction on n1 that adds `delta` to account `aid` and is prepared as `gid`:
/// its session and its xid.
fn prepared_update(c: &TestCluster, aid: i32, delta: i32, gid: &str) -> (postgres::Client, i64) {
    let mut db = c.connect("n1").unwrap();
    db.batch_execute("BEGIN").unwrap();
    let xid: i64 = db.query_one("SELECT txid_current()", &[]).unwrap().get(0);
    db.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + $2 WHERE aid = $1",
        &[&aid, &delta],
    )
    .unwrap();
    db.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .unwrap();
    (db, xid)
}

/// Paper section 3.7 on a real cluster, both sides of the decision:
/// - after Tm the propagator's stream fails (its walsender is terminated): a source
///   transaction still to commit gets an error (not a hang), the migration completes from the
///   prepared shadows, and a shadow whose source transaction (a user 2PC transaction) commits
///   only after the failure is committed by that fate, with the source's commit time;
/// - before Tm the destination's replay worker dies: source commits get an error, the
///   migration rolls back completely, and the source keeps everything its transactions wrote,
///   including a transaction validated (prepared) on the destination before the failure.
#[test]
fn a_stream_or_destination_failure_during_dual_execution() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let n1_shards: Vec<i64> = owners(&c, "pgbench_accounts")
        .into_iter()
        .filter(|(_, o)| o == "n1")
        .map(|(s, _)| s)
        .collect();
    assert!(
        n1_shards.len() >= 2,
        "n1 owns two account shards: {n1_shards:?}"
    );

    // ---- after Tm: the stream fails; the migration completes from the shadows ----
    let shard = n1_shards[0];
    let (prepared_aid, committed_aid, failing_aid) = (
        an_account_of(&c, shard, 0),
        an_account_of(&c, shard, 1),
        an_account_of(&c, shard, 2),
    );
    let mut n1 = c.connect("n1").unwrap();
    let (rows_before, sum_before): (i64, i64) = {
        let mut direct = c.connect("n1").unwrap();
        direct
            .batch_execute("SET remus.migration_session = on")
            .unwrap();
        let r = direct
            .query_one(&format!("SELECT count(*), sum(abalance)::bigint FROM remus_shards.pgbench_accounts_{shard}"), &[])
            .unwrap();
        (r.get(0), r.get(1))
    };
    let mut tm_holder = hold_tm(&c, "n2", shard);
    let mover = start_migration(&c, shard);
    wait_for_phase(&c, &["handover"], Duration::from_secs(120));
    wait_tm_blocked(&c, "n2");
    // In dual execution: a user 2PC transaction validated at its PREPARE, an autocommit write
    // (validated and committed on both sides), and a writer left open across Tm.
    let (mut x, x_xid) = prepared_update(&c, prepared_aid, 3, "remus_it_x");
    n1.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 17 WHERE aid = $1",
        &[&committed_aid],
    )
    .unwrap();
    let mut w = c.connect("n1").unwrap();
    w.batch_execute("BEGIN").unwrap();
    w.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 13 WHERE aid = $1",
        &[&failing_aid],
    )
    .unwrap();
    tm_holder.batch_execute("COMMIT").unwrap();
    let (migration_id, _, _) = wait_for_phase(&c, &["cleanup"], Duration::from_secs(120));
    wait_owner(&c, "n3", shard, "n2");

    // The stream fails: its walsender on the source is terminated.
    let killed: i64 = n1
        .query_one(
            "SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots
              WHERE slot_name = 'remus_m' || $1::bigint AND active_pid IS NOT NULL",
            &[&migration_id],
        )
        .unwrap()
        .get(0);
    assert_eq!(killed, 1, "the migration's walsender was running");
    let started = Instant::now();
    loop {
        let said = phase_of(&mut n1, Some(migration_id))
            .and_then(|p| p.2)
            .unwrap_or_default();
        if said.contains("stream failed") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "remus_migrations never reported the failure: {said:?}\n{}",
            c.daemon_logs(60)
        );
        thread::sleep(Duration::from_millis(20));
    }
    // The open writer either cannot be validated any more (40001, its write not applied) or
    // was validated before the replay worker let go of the migration (its write then reaches
    // the destination with the rest): never a hang, never a write lost.
    let w_committed = match w.batch_execute("COMMIT") {
        Ok(()) => {
            println!(
                "the writer was still validated after the stream failed\n{}",
                c.daemon_logs(40)
            );
            true
        }
        Err(e) => {
            assert_eq!(e.code().map(|c| c.code()), Some("40001"), "{e:?}");
            assert!(format!("{e:?}").contains("could not be validated"), "{e:?}");
            false
        }
    };
    // The prepared source transaction commits after the failure; its shadow follows.
    x.batch_execute("COMMIT PREPARED 'remus_it_x'").unwrap();
    let x_committed_at = xact_commit_time(&mut n1, x_xid);
    let (status, _) = mover
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("the migration completes: {e:?}\n{}", c.daemon_logs(60)));
    assert_eq!(status, "succeeded");
    assert_eq!(owner_of(&c, shard), "n2");
    let mut n2 = c.connect("n2").unwrap();
    assert_eq!(balance_on(&mut n2, shard, prepared_aid), 3);
    assert_eq!(balance_on(&mut n2, shard, committed_aid), 17);
    let w_delta = if w_committed { 13 } else { 0 };
    assert_eq!(balance_on(&mut n2, shard, failing_aid), w_delta);
    let shadow_committed_at = row_commit_time(&mut n2, shard, prepared_aid);
    assert_eq!(
        shadow_committed_at, x_committed_at,
        "the resolved shadow carries the source's commit time"
    );
    let (rows_after, sum_after): (i64, i64) = {
        let r = n2
            .query_one(&format!("SELECT count(*), sum(abalance)::bigint FROM remus_shards.pgbench_accounts_{shard}"), &[])
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (rows_after, sum_after),
        (rows_before, sum_before + 20 + i64::from(w_delta))
    );
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );

    // ---- before Tm: the replay worker dies; the migration rolls back ----
    let shard = n1_shards[1];
    let (prepared_aid, failing_aid, later_aid) = (
        an_account_of(&c, shard, 0),
        an_account_of(&c, shard, 1),
        an_account_of(&c, shard, 2),
    );
    let mut tm_holder = hold_tm(&c, "n2", shard);
    let mover = start_migration(&c, shard);
    let (migration_id, _, _) = wait_for_phase(&c, &["handover"], Duration::from_secs(120));
    wait_tm_blocked(&c, "n2");
    let (mut v, _) = prepared_update(&c, prepared_aid, 19, "remus_it_v");
    let mut u = c.connect("n1").unwrap();
    u.batch_execute("BEGIN").unwrap();
    u.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 23 WHERE aid = $1",
        &[&failing_aid],
    )
    .unwrap();
    let worker = c
        .state()
        .unwrap()
        .replay_worker
        .live_pid()
        .expect("replay worker runs");
    // SAFETY: SIGKILL to the replay worker this test's cluster started.
    unsafe { libc::kill(worker as i32, libc::SIGKILL) };
    let e = u
        .batch_execute("COMMIT")
        .expect_err("no destination to validate on");
    assert_eq!(e.code().map(|c| c.code()), Some("40001"), "{e:?}");
    tm_holder.batch_execute("COMMIT").unwrap();
    let e = mover.join().unwrap().expect_err("the migration rolls back");
    assert!(format!("{e:?}").contains("rolled_back"), "{e:?}");
    let (status, error): (String, Option<String>) = {
        let r = n1
            .query_one(
                "SELECT status, error FROM remus_migrations WHERE migration_id = $1",
                &[&migration_id],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(status, "rolled_back");
    assert!(
        error.unwrap_or_default().contains("replay worker"),
        "remus_migrations says why"
    );
    // The validated transaction commits on the source, which still owns the shard; the source
    // takes writes again.
    v.batch_execute("COMMIT PREPARED 'remus_it_v'").unwrap();
    assert_eq!(owner_of(&c, shard), "n1");
    n1.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 29 WHERE aid = $1",
        &[&later_aid],
    )
    .unwrap();
    let mut src = c.connect("n1").unwrap();
    assert_eq!(balance_on(&mut src, shard, prepared_aid), 19);
    assert_eq!(balance_on(&mut src, shard, failing_aid), 0);
    assert_eq!(balance_on(&mut src, shard, later_aid), 29);
    let on_target: bool = n2
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("remus_shards.pgbench_accounts_{shard}")],
        )
        .unwrap()
        .get(0);
    assert!(!on_target, "the destination's copy is dropped");
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// Commits that are not a plain COMMIT, in dual execution:
/// - COMMIT inside a procedure: each one validates, and its write is on the destination when
///   the CALL returns;
/// - a source transaction that is a 2PC participant validates at its PREPARE; the session that
///   runs its COMMIT PREPARED (or ROLLBACK PREPARED) finishes the prepared shadow before it
///   returns, so whoever coordinated it reads its write on the destination next. The stream is
///   stalled (its walsender stopped) to show the shadow does not wait for it.
#[test]
fn procedure_commits_and_2pc_participants_in_dual_execution() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, _) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let (committed_aid, rolled_back_aid) =
        (an_account_of(&c, shard, 0), an_account_of(&c, shard, 1));
    let (proc_a, proc_b) = (an_account_of(&c, shard, 2), an_account_of(&c, shard, 3));
    let mut tm_holder = hold_tm(&c, "n2", shard);
    let mover = start_migration(&c, shard);
    let (migration_id, _, _) = wait_for_phase(&c, &["handover"], Duration::from_secs(120));
    wait_tm_blocked(&c, "n2");

    let mut caller = c.connect("n1").unwrap();
    caller
        .batch_execute(
            "CREATE PROCEDURE remus_it_two_commits(a int, b int) LANGUAGE plpgsql AS $$
             BEGIN
               UPDATE pgbench_accounts SET abalance = abalance + 31 WHERE aid = a;
               COMMIT;
               UPDATE pgbench_accounts SET abalance = abalance + 37 WHERE aid = b;
               COMMIT;
             END $$",
        )
        .unwrap();
    caller
        .execute("CALL remus_it_two_commits($1, $2)", &[&proc_a, &proc_b])
        .unwrap();
    let mut on_dest = c.connect("n2").unwrap();
    assert_eq!(
        (
            balance_on(&mut on_dest, shard, proc_a),
            balance_on(&mut on_dest, shard, proc_b)
        ),
        (31, 37),
        "both commits of the procedure are on the destination when CALL returns"
    );

    let (_p, p_xid) = prepared_update(&c, committed_aid, 5, "remus_it_p");
    let (_r, _) = prepared_update(&c, rolled_back_aid, 7, "remus_it_r");
    let mut n2 = c.connect("n2").unwrap();
    let shadows = |db: &mut postgres::Client| -> i64 {
        db.query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'remus:%'",
            &[],
        )
        .unwrap()
        .get(0)
    };
    assert_eq!(
        shadows(&mut n2),
        2,
        "both participants validated at PREPARE"
    );

    let mut n1 = c.connect("n1").unwrap();
    let walsender: i32 = n1
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'remus_m' || $1::bigint",
            &[&migration_id],
        )
        .unwrap()
        .get(0);
    // SAFETY: stops (and below resumes) the walsender of this test's migration.
    unsafe { libc::kill(walsender, libc::SIGSTOP) };
    let finished = n1
        .batch_execute("COMMIT PREPARED 'remus_it_p'")
        .and_then(|_| n1.batch_execute("ROLLBACK PREPARED 'remus_it_r'"));
    let left = shadows(&mut n2);
    let committed = balance_on(&mut n2, shard, committed_aid);
    let rolled_back = balance_on(&mut n2, shard, rolled_back_aid);
    // SAFETY: as above.
    unsafe { libc::kill(walsender, libc::SIGCONT) };
    finished.unwrap();
    assert_eq!(
        left, 0,
        "the shadows were finished with their source transactions"
    );
    assert_eq!((committed, rolled_back), (5, 0));
    let source_ts = xact_commit_time(&mut n1, p_xid);
    let dest_ts = row_commit_time(&mut n2, shard, committed_aid);
    assert_eq!(
        dest_ts, source_ts,
        "the shadow carries the source's commit time"
    );

    tm_holder.batch_execute("COMMIT").unwrap();
    let (status, aborted) = mover.join().unwrap().expect("migration");
    assert_eq!((status.as_str(), aborted), ("succeeded", 0));
    assert_eq!(balance_on(&mut n2, shard, committed_aid), 5);
    assert_eq!(balance_on(&mut n2, shard, rolled_back_aid), 0);
    assert_eq!(
        (
            balance_on(&mut n2, shard, proc_a),
            balance_on(&mut n2, shard, proc_b)
        ),
        (31, 37)
    );
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// The destination's PostgreSQL goes down after Tm (paper section 3.7): a source transaction
/// still to commit gets an error, the migration waits for the target (and says so) instead of
/// failing, and once the target is back it completes: the prepared shadow of a source
/// transaction that committed while the target was down is committed by that fate.
#[test]
fn a_destination_down_after_tm_is_waited_for_and_the_migration_completes() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, _) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let (prepared_aid, committed_aid, failing_aid) = (
        an_account_of(&c, shard, 0),
        an_account_of(&c, shard, 1),
        an_account_of(&c, shard, 2),
    );
    let mut tm_holder = hold_tm(&c, "n2", shard);
    let mover = start_migration(&c, shard);
    let (migration_id, _, _) = wait_for_phase(&c, &["handover"], Duration::from_secs(120));
    wait_tm_blocked(&c, "n2");
    let (mut x, x_xid) = prepared_update(&c, prepared_aid, 3, "remus_it_x");
    let mut n1 = c.connect("n1").unwrap();
    n1.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 17 WHERE aid = $1",
        &[&committed_aid],
    )
    .unwrap();
    let mut w = c.connect("n1").unwrap();
    w.batch_execute("BEGIN").unwrap();
    w.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 13 WHERE aid = $1",
        &[&failing_aid],
    )
    .unwrap();
    tm_holder.batch_execute("COMMIT").unwrap();
    drop(tm_holder);
    // Down right at the decision: the target may not even have committed Tm yet (its prepared
    // Tm and shadows survive the restart).
    wait_for_phase(&c, &["cleanup"], Duration::from_secs(120));
    c.stop_node("n2").unwrap();
    let e = w
        .batch_execute("COMMIT")
        .expect_err("no destination to validate on");
    assert_eq!(e.code().map(|c| c.code()), Some("40001"), "{e:?}");
    x.batch_execute("COMMIT PREPARED 'remus_it_x'").unwrap();
    let x_committed_at = xact_commit_time(&mut n1, x_xid);
    // The migration waits for n2 (and says so) rather than fail; give it a moment to get there.
    let started = Instant::now();
    let mut said = String::new();
    while started.elapsed() < Duration::from_secs(30) && !said.contains("n2 is unreachable") {
        said = phase_of(&mut n1, Some(migration_id))
            .and_then(|p| p.2)
            .unwrap_or_default();
        thread::sleep(Duration::from_millis(50));
    }
    println!("remus_migrations.waiting_on while n2 was down: {said:?}");
    c.start_node("n2").unwrap();

    let (status, _) = mover.join().unwrap().unwrap_or_else(|e| {
        panic!(
            "the migration completes once the target is back: {e:?}\n{}",
            c.daemon_logs(80)
        )
    });
    assert_eq!(status, "succeeded");
    assert_eq!(owner_of(&c, shard), "n2");
    let mut n2 = c.connect("n2").unwrap();
    assert_eq!(balance_on(&mut n2, shard, prepared_aid), 3);
    assert_eq!(balance_on(&mut n2, shard, committed_aid), 17);
    assert_eq!(balance_on(&mut n2, shard, failing_aid), 0);
    let shadow_committed_at = row_commit_time(&mut n2, shard, prepared_aid);
    assert_eq!(shadow_committed_at, x_committed_at);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// Paper section 3.7, the destination PostgreSQL itself down before the Tm decision: the
/// migration rolls back, and the source serves the shard again at once, while the rollback
/// still waits for the destination to remove its copy and shadows (a destination that stays
/// down must not keep the source in sync mode, where every write would fail to validate).
/// What the source's transactions wrote is all there, the destination has nothing left.
#[test]
fn a_destination_down_before_tm_rolls_back_and_the_source_keeps_serving() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, _) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let (validated_aid, open_aid, later_aid) = (
        an_account_of(&c, shard, 0),
        an_account_of(&c, shard, 1),
        an_account_of(&c, shard, 2),
    );
    let tm_holder = hold_tm(&c, "n2", shard);
    let mover = start_migration(&c, shard);
    let (migration_id, _, _) = wait_for_phase(&c, &["handover"], Duration::from_secs(120));
    wait_tm_blocked(&c, "n2");
    // In dual execution: a write validated on the destination (its shadow is prepared there)
    // and a writer still open when the destination goes down.
    let mut n1 = c.connect("n1").unwrap();
    n1.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 17 WHERE aid = $1",
        &[&validated_aid],
    )
    .unwrap();
    let mut w = c.connect("n1").unwrap();
    w.batch_execute("BEGIN").unwrap();
    w.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 13 WHERE aid = $1",
        &[&open_aid],
    )
    .unwrap();

    // The destination stops: Tm's session there fails before any decision.
    c.stop_node("n2").unwrap();
    drop(tm_holder);
    let started = Instant::now();
    let mut said = String::new();
    while !said.contains("n2 is unreachable") {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the rollback never waited for n2; said {said:?}\n{}",
            c.daemon_logs(60)
        );
        said = phase_of(&mut n1, Some(migration_id))
            .and_then(|p| p.2)
            .unwrap_or_default();
        thread::sleep(Duration::from_millis(50));
    }
    println!("remus_migrations.waiting_on while n2 was down: {said:?}");
    // The rollback is waiting for n2, and the source takes writes to the shard again: the open
    // writer commits, and so does a new one.
    w.batch_execute("COMMIT")
        .expect("the open writer commits on the source");
    n1.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 29 WHERE aid = $1",
        &[&later_aid],
    )
    .expect("a new write on the source while the destination is down");
    assert_eq!(owner_of(&c, shard), "n1");

    c.start_node("n2").unwrap();
    let e = mover.join().unwrap().expect_err("the migration rolls back");
    assert!(
        format!("{e:?}").contains("rolled_back"),
        "{e:?}\n{}",
        c.daemon_logs(60)
    );
    let status: String = n1
        .query_one(
            "SELECT status FROM remus_migrations WHERE migration_id = $1",
            &[&migration_id],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "rolled_back");
    assert_eq!(owner_of(&c, shard), "n1");
    let mut src = c.connect("n1").unwrap();
    assert_eq!(balance_on(&mut src, shard, validated_aid), 17);
    assert_eq!(balance_on(&mut src, shard, open_aid), 13);
    assert_eq!(balance_on(&mut src, shard, later_aid), 29);
    let on_target: bool = c
        .connect("n2")
        .unwrap()
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("remus_shards.pgbench_accounts_{shard}")],
        )
        .unwrap()
        .get(0);
    assert!(!on_target, "the destination's copy is dropped");
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
    assert_eq!(prepared_everywhere(&c), 0);
}

/// Waits until a session on `node` waits for a lock (`wait_event_type` Lock) running a
/// statement that contains `query_part`.
fn wait_lock_waiter(c: &TestCluster, node: &str, query_part: &str) {
    let mut db = c.connect(node).unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let n: i64 = db
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0",
                    &[&query_part],
                )
                .unwrap()
                .get(0);
            n > 0
        },
        || {
            format!(
                "no session on {node} waits for a lock in {query_part:?}\n{}",
                c.daemon_logs(40)
            )
        },
    );
}

/// READ COMMITTED across Tm, one hot row: a transaction that began before Tm wrote the row on
/// the source and is still open; a transaction that begins after Tm (through another node)
/// writes the same row. As on a single node, the newer one waits for the older one (on the
/// source, for its row lock) and then applies its change on top; neither is aborted, and the
/// destination ends up with both changes.
#[test]
fn a_newer_writer_of_a_hot_row_waits_for_the_older_one_across_tm() {
    let (c, shard, source, mover, mut holder) = held_at_barrier();
    let aid = an_account_of(&c, shard, 0);
    let mut older = c.connect(&source).unwrap();
    older.batch_execute("BEGIN").unwrap();
    older
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    holder.batch_execute("COMMIT").unwrap();
    wait_for_phase(&c, &["cleanup"], Duration::from_secs(120));
    wait_owner(&c, "n3", shard, "n2");

    let mut n3 = c.connect("n3").unwrap();
    let newer = thread::spawn(move || {
        n3.execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 1000 WHERE aid = $1",
            &[&aid],
        )
    });
    // The newer writer waits on the source for the older one's row lock.
    wait_lock_waiter(&c, &source, "FOR SHARE");
    assert!(
        !newer.is_finished(),
        "the newer writer went ahead of the older one"
    );
    older
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 10 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    older
        .batch_execute("COMMIT")
        .expect("the older writer commits");
    assert_eq!(newer.join().unwrap().expect("the newer writer commits"), 1);

    let (status, aborted) = mover.join().unwrap().expect("migration call");
    assert_eq!((status.as_str(), aborted), ("succeeded", 0));
    let mut n2 = c.connect("n2").unwrap();
    assert_eq!(
        balance_on(&mut n2, shard, aid),
        1011,
        "both writes, the newer on top of the older"
    );
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// READ COMMITTED, first use of a shard while this node's Tm is prepared but not committed
/// (held up on another node): the transaction waits for Tm's outcome instead of starting a
/// new writer on the source, then runs on the destination.
#[test]
fn a_new_transaction_waits_for_an_in_doubt_tm_and_runs_on_the_destination() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, _) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let aid = an_account_of(&c, shard, 0);
    // Tm prepares on the target (n2) first and is held on n3.
    let mut tm_holder = hold_tm(&c, "n3", shard);
    let mover = start_migration(&c, shard);
    wait_for_phase(&c, &["handover"], Duration::from_secs(120));
    wait_tm_blocked(&c, "n3");
    let mut n2 = c.connect("n2").unwrap();
    let prepared: i64 = n2
        .query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'remus_tm:%'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(prepared, 1, "Tm is prepared on the target");

    let mut via_n2 = c.connect("n2").unwrap();
    let writer = thread::spawn(move || {
        via_n2.execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 7 WHERE aid = $1",
            &[&aid],
        )
    });
    // The in-doubt wait polls on its latch (bounded by remus.in_doubt_wait_timeout, review F5):
    // wait event Extension.
    let mut watcher = c.connect("n2").unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE wait_event_type = 'Extension' AND strpos(query, 'UPDATE pgbench_accounts') > 0",
                    &[],
                )
                .unwrap()
                .get::<_, i64>(0)
                > 0
        },
        || "the writer on n2 does not wait for the in-doubt Tm".to_string(),
    );
    assert!(
        !writer.is_finished(),
        "the writer routed while Tm was in doubt"
    );
    tm_holder.batch_execute("COMMIT").unwrap();
    assert_eq!(writer.join().unwrap().expect("the writer commits"), 1);
    let (status, _) = mover.join().unwrap().expect("migration call");
    assert_eq!(status, "succeeded");

    // Written on the destination by the transaction itself: no Remus origin on the version.
    assert_eq!(balance_on(&mut n2, shard, aid), 7);
    let origin: Option<String> = n2
        .query_one(
            &format!(
                "SELECT o.roname FROM remus_shards.pgbench_accounts_{shard} t
                   LEFT JOIN LATERAL pg_xact_commit_timestamp_origin(t.xmin) x ON true
                   LEFT JOIN pg_replication_origin o ON o.roident = x.roident
                  WHERE t.aid = $1"
            ),
            &[&aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        origin, None,
        "the write ran on the destination, not as a shadow of a source transaction"
    );
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// Waits until migration `id` has ended; its status and error.
fn wait_ended(c: &TestCluster, id: i64, limit: Duration) -> (String, Option<String>) {
    let mut db = c.connect("n1").unwrap();
    wait_for(
        limit,
        Duration::from_millis(50),
        || {
            let row = db
                .query_one(
                    "SELECT status, error FROM remus_migrations WHERE migration_id = $1",
                    &[&id],
                )
                .unwrap_or_else(|e| panic!("reading migration {id}: {e:?}"));
            let status: String = row.get(0);
            (status != "running").then(|| (status, row.get(1)))
        },
        || {
            format!(
                "migration {id} did not end within {limit:?}\n{}",
                c.daemon_logs(40)
            )
        },
    )
}

/// A source writer open in dual execution when the coordinator dies: its COMMIT either fails
/// with 40001 (its validation found no stream) or, validated in the instant before the replay
/// worker noticed, commits. Never a hang, never another error. True when it committed.
fn commit_across_coordinator_death(writer: &mut postgres::Client) -> bool {
    let committed = match writer.batch_execute("COMMIT") {
        Ok(()) => true,
        Err(e) => {
            assert_eq!(e.code().map(|c| c.code()), Some("40001"), "{e:?}");
            false
        }
    };
    println!(
        "the writer open when the coordinator died: {}",
        if committed { "committed" } else { "40001" }
    );
    committed
}

/// The coordinator is killed (SIGKILL) in dual execution, before Tm: its successor rolls the
/// migration back, the source keeps the shard and takes writes again without validation,
/// nothing is left on the target, and the shard can be moved again.
#[test]
fn a_coordinator_killed_before_tm_is_rolled_back_by_its_successor() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let (aid, validated_aid) = (an_account_of(&c, shard, 0), an_account_of(&c, shard, 1));
    c.arm_pause(DUAL_STARTED).unwrap();
    let mover = start_migration(&c, shard);
    let migration = c
        .wait_paused_at(DUAL_STARTED, Duration::from_secs(120))
        .unwrap();

    let mut writer = c.connect(&source).unwrap();
    writer.batch_execute("BEGIN").unwrap();
    writer
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 3 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    // Validated on the target and committed on the source while the coordinator lives.
    let mut n3 = c.connect("n3").unwrap();
    n3.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = $1",
        &[&validated_aid],
    )
    .unwrap();

    c.kill_coordinator().unwrap();
    // Disarmed, or the next migration of the shard would stop there too.
    c.release_failpoint(DUAL_STARTED).unwrap();
    assert!(
        mover.join().unwrap().is_err(),
        "the migration call must fail with its coordinator"
    );
    let committed = commit_across_coordinator_death(&mut writer);

    c.start_coordinator_again().unwrap();
    let (status, error) = wait_ended(&c, migration, Duration::from_secs(180));
    assert_eq!(status, "rolled_back", "{error:?}\n{}", c.daemon_logs(40));
    let error = error.unwrap_or_default();
    assert!(
        error.contains("coordinator stopped during phase dual"),
        "{error}"
    );

    assert_eq!(owners_everywhere(&c, shard), vec![source.clone(); 3]);
    // The source takes writes on the shard again, with no validation to fail.
    n3.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = $1",
        &[&validated_aid],
    )
    .expect("a write after the rollback");
    assert_eq!(
        balance_on(&mut c.connect(&source).unwrap(), shard, validated_aid),
        6
    );
    assert_eq!(
        balance_on(&mut c.connect(&source).unwrap(), shard, aid),
        if committed { 3 } else { 0 }
    );
    let gone: bool = c
        .connect("n2")
        .unwrap()
        .query_one(
            &format!("SELECT to_regclass('remus_shards.pgbench_accounts_{shard}') IS NULL"),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(gone, "the target's copy must be dropped");
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );

    // Nothing of it is in the way of the next migration of the same shard (refused with 57P03
    // only while the new coordinator is still finishing its recovery).
    let mut db = c.connect("n3").unwrap();
    let started = Instant::now();
    let status: String = loop {
        match db.query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n2')",
            &[&shard],
        ) {
            Ok(row) => break row.get(0),
            Err(e)
                if e.code().map(|c| c.code()) == Some("57P03")
                    && started.elapsed() < Duration::from_secs(60) =>
            {
                thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("moving shard {shard} again: {e:?}"),
        }
    };
    assert_eq!(status, "succeeded");
    assert_eq!(owners_everywhere(&c, shard), vec!["n2".to_string(); 3]);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// The coordinator is killed right after the Tm decision, before any node committed Tm: its
/// successor commits Tm everywhere, drains, resolves the shadows by their source transactions'
/// fate and drops the source copy; every committed write is on the target.
#[test]
fn a_coordinator_killed_after_the_tm_decision_is_completed_by_its_successor() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let (aid, validated_aid) = (an_account_of(&c, shard, 0), an_account_of(&c, shard, 1));
    c.arm_pause(DUAL_STARTED).unwrap();
    c.arm_pause(HANDOVER_DECIDED).unwrap();
    let mover = start_migration(&c, shard);
    c.wait_paused_at(DUAL_STARTED, Duration::from_secs(120))
        .unwrap();
    // A writer whose view predates Tm, open when the coordinator dies.
    let mut writer = c.connect(&source).unwrap();
    writer.batch_execute("BEGIN").unwrap();
    writer
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 3 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    let mut n3 = c.connect("n3").unwrap();
    n3.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = $1",
        &[&validated_aid],
    )
    .unwrap();
    c.release_failpoint(DUAL_STARTED).unwrap();
    let migration = c
        .wait_paused_at(HANDOVER_DECIDED, Duration::from_secs(120))
        .unwrap();

    c.kill_coordinator().unwrap();
    c.release_failpoint(HANDOVER_DECIDED).unwrap();
    assert!(
        mover.join().unwrap().is_err(),
        "the migration call must fail with its coordinator"
    );
    let committed = commit_across_coordinator_death(&mut writer);

    c.start_coordinator_again().unwrap();
    let (status, error) = wait_ended(&c, migration, Duration::from_secs(180));
    assert_eq!(status, "succeeded", "{error:?}\n{}", c.daemon_logs(40));

    assert_eq!(owners_everywhere(&c, shard), vec!["n2".to_string(); 3]);
    let mut dest = c.connect("n2").unwrap();
    assert_eq!(
        balance_on(&mut dest, shard, validated_aid),
        1,
        "a write validated before the crash is on the target"
    );
    assert_eq!(
        balance_on(&mut dest, shard, aid),
        if committed { 3 } else { 0 },
        "the writer's fate decides its shadow"
    );
    // New writes, through any node, go to the target.
    n3.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = $1",
        &[&validated_aid],
    )
    .unwrap();
    assert_eq!(balance_on(&mut dest, shard, validated_aid), 6);
    let gone: bool = c
        .connect(&source)
        .unwrap()
        .query_one(
            &format!("SELECT to_regclass('remus_shards.pgbench_accounts_{shard}') IS NULL"),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(gone, "the source's copy must be dropped");
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
    let twice = c
        .start_coordinator_again()
        .expect_err("a running coordinator is not started twice");
    assert!(twice.to_string().contains("is running"), "{twice}");
}

/// Review finding F2: a REPEATABLE READ transaction whose snapshot predates Tm reads the shard
/// map after the generation bump on its node. What it reads (the old owner, right for its
/// snapshot) must not be cached as current: the backend's next transactions must route to the
/// new owner, also after the source's copy is gone (before the fix: RM001).
#[test]
fn a_snapshot_older_than_tm_does_not_leave_the_old_owner_cached() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, _) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let aid = an_account_of(&c, shard, 0);
    // The snapshot is taken before the migration starts; the session has not touched
    // pgbench_accounts yet, so nothing of it is cached.
    let mut rr = c.connect("n3").unwrap();
    rr.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .unwrap();
    let mover = start_migration(&c, shard);
    // Tm committed on every node, the generation bumped and read-through ended: cleanup's drain
    // now waits for this old transaction.
    let mut n1 = c.connect("n1").unwrap();
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(20),
        || {
            phase_of(&mut n1, None)
                .is_some_and(|(_, phase, waiting)| phase == "cleanup" && waiting.is_some())
        },
        || "the migration never waited in cleanup for the old transaction".to_string(),
    );
    wait_owner(&c, "n3", shard, "n2");
    // First touch of the table in this backend, with the pre-Tm snapshot: the old owner.
    let before: i32 = rr
        .query_one(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            &[&aid],
        )
        .unwrap()
        .get(0);
    rr.batch_execute("COMMIT").unwrap();
    let (status, _) = mover.join().unwrap().expect("migration call");
    assert_eq!(status, "succeeded");

    // The same backend, new transactions: the new owner, with the source's copy dropped.
    let updated = rr
        .execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = $1",
            &[&aid],
        )
        .unwrap_or_else(|e| panic!("update after the migration: {e:?}"));
    assert_eq!(updated, 1);
    let mut n2 = c.connect("n2").unwrap();
    assert_eq!(balance_on(&mut n2, shard, aid), before + 5);
}
