//! The squall mode (issue 19, decision 0025) under TPC-B: pgbench runs against all three nodes
//! (no retries) while account shards move one after another and then every shard of n3 moves to
//! n1 and n2, each with ownership first and the data pulled afterwards in chunks (the coordinator
//! runs with 64 kB chunks so that a shard has several). Afterwards every balance equals its
//! history deltas row by row, n3 owns nothing, nothing of the migrations is left on any node
//! (the chunk catalog included), every moved shard has all its rows, and pgbench's failures are
//! exactly the transactions the migrations say they aborted.
//!
//! A second test checks the reactive pull: with the background pullers paused for a minute
//! between pulls (failpoint `squall.slow_pull`), a keyed read on the new owner of a shard whose
//! chunks are not all pulled returns the right row at once: the read asks for the pull of the
//! chunk that holds its key and waits for that chunk only (other chunks are still not pulled
//! after it). A REPEATABLE READ transaction whose snapshot predates that pull gets 40001 for the
//! same read; one that begins after it reads the row. A read of the whole shard table then waits
//! for every remaining chunk and sees all the shard's rows, and the migration completes.

use std::time::{Duration, Instant};

use coordinator::failpoint::SQUALL_SLOW_PULL;
use integration::consistency::assert_tpcb_consistent;
use integration::migrations::wait_ended;
use integration::pgbench::{finish, init_tpcb, prepared_everywhere, wait_committing};
use integration::shards::{assert_owns_no_shard, owners, TPCB_TABLES};
use remus_test_support::cluster::TestCluster;

/// Chunks of 64 kB: an account shard of the test's scale has several.
const CHUNK_BYTES: &str = "65536";

struct Moved {
    migration_id: i64,
    aborted: i64,
    status: String,
    rows_pulled: i64,
}

fn cluster() -> TestCluster {
    // Read by the coordinator that `cluster up` starts.
    std::env::set_var("REMUS_SQUALL_CHUNK_BYTES", CHUNK_BYTES);
    std::env::set_var("REMUS_SQUALL_PACE_MS", "20");
    TestCluster::start(3).expect("cluster up")
}

/// Rows of the shard tables of `shard` (all co-located tables) on `node`.
fn rows_on(c: &TestCluster, node: &str, table: &str, shard: i64) -> i64 {
    let mut db = c.connect(node).unwrap();
    db.query_one(
        &format!("SELECT count(*) FROM remus_shards.{table}_{shard}"),
        &[],
    )
    .unwrap()
    .get(0)
}

fn migrate(c: &TestCluster, via: &str, shard: i64, target: &str) -> Moved {
    let mut db = c.connect(via).unwrap();
    let row = db
        .query_one(
            "SELECT migration_id, status, aborted_by_migration, rows_copied, bytes_copied,
                    copy_ms, handover_ms, cleanup_ms, total_ms
               FROM remus_migrate_shard($1, $2, 'squall')",
            &[&shard, &target],
        )
        .unwrap_or_else(|e| panic!("migrating shard {shard} to {target} (squall): {e:?}"));
    let id: i64 = row.get(0);
    let unavailable: Option<i64> = db
        .query_one(
            "SELECT unavailable_ms FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert!(
        unavailable.is_some(),
        "squall records its unavailability window"
    );
    let m = Moved {
        migration_id: row.get(0),
        status: row.get(1),
        aborted: row.get(2),
        rows_pulled: row.get(3),
    };
    println!(
        "migration {} shard {shard} -> {target} (squall): {} plan {} ms, handover {} ms, pull+cleanup {} ms, total {} ms, unavailable {:?} ms, pulled {} rows / {} bytes, aborted {}",
        m.migration_id,
        m.status,
        row.get::<_, i64>(5),
        row.get::<_, i64>(6),
        row.get::<_, i64>(7),
        row.get::<_, i64>(8),
        unavailable,
        m.rows_pulled,
        row.get::<_, i64>(4),
        m.aborted
    );
    m
}

fn no_chunks_left(c: &TestCluster) {
    for n in c.node_names() {
        let left: i64 = c
            .connect(&n)
            .unwrap()
            .query_one("SELECT count(*) FROM remus.squall_chunks", &[])
            .unwrap()
            .get(0);
        assert_eq!(left, 0, "chunk catalog rows left on {n}");
    }
}

#[test]
fn squall_moves_and_consolidates_under_tpcb() {
    let c = cluster();
    init_tpcb(&c, 2);
    let before = owners(&c, "pgbench_accounts");
    assert!(before.len() >= 8, "{before:?}");

    let loads: Vec<_> = c
        .node_names()
        .iter()
        .map(|n| {
            c.pgbench(
                n,
                &["-n", "-c", "3", "-j", "1", "-T", "50", "--max-tries=1"],
            )
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    wait_committing(&c, "n1", 100);

    let mut moved = Vec::new();
    // Two account shards, each to the next node, through different nodes; all their rows
    // arrive (pgbench does not insert accounts: the count on the new owner is the old one).
    for (i, (shard, owner)) in before.iter().take(2).enumerate() {
        let target = match owner.as_str() {
            "n1" => "n2",
            "n2" => "n3",
            _ => "n1",
        };
        let accounts = rows_on(&c, owner, "pgbench_accounts", *shard);
        let via = format!("n{}", i % 3 + 1);
        let m = migrate(&c, &via, *shard, target);
        assert_eq!(m.status, "succeeded", "migration {}", m.migration_id);
        assert_eq!(
            rows_on(&c, target, "pgbench_accounts", *shard),
            accounts,
            "shard {shard} on {target}"
        );
        assert!(m.rows_pulled >= accounts, "{} < {accounts}", m.rows_pulled);
        moved.push(m);
    }
    // Consolidation: every shard of n3 (all tables) to n1 and n2, alternating.
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
    println!(
        "squall: {} migrations, pgbench {processed} committed, {failed} failed; aborted_by_migration {aborted}",
        moved.len()
    );
    for r in &results {
        assert_eq!(r.aborted_clients, 0, "a pgbench client died: {}", r.output);
        assert!(r.processed > 0, "{}", r.output);
    }
    assert_eq!(
        failed as i64, aborted,
        "pgbench failures must be exactly the migrations' aborts"
    );
    assert_tpcb_consistent(&c, "n1", processed, "after the squall migrations");
    assert_owns_no_shard(&c, "n3", &TPCB_TABLES);
    let accounts: i64 = c
        .connect("n3")
        .unwrap()
        .query_one("SELECT count(*) FROM pgbench_accounts", &[])
        .unwrap()
        .get(0);
    assert_eq!(accounts, 200_000, "every account is somewhere, once");
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(prepared_everywhere(&c), 0);
    no_chunks_left(&c);
    let shard_tables_on_n3: i64 = c
        .connect("n3")
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'remus_shards'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(shard_tables_on_n3, 0, "n3's copies are dropped");
    let mut n3 = c.connect("n3").unwrap();
    let listed: i64 = n3
        .query_one(
            "SELECT count(*) FROM remus_migrations WHERE status = 'succeeded' AND mode = 'squall'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(listed as usize, moved.len());
}

#[test]
fn a_keyed_read_pulls_its_chunk_before_the_background_puller() {
    let c = cluster();
    init_tpcb(&c, 1);
    let dir = c.state().unwrap().failpoint_dir();
    std::fs::create_dir_all(&dir).unwrap();
    // A minute between background pulls: the shard is not pulled by the test's end unless a
    // transaction asks for it.
    std::fs::write(dir.join(SQUALL_SLOW_PULL), "delay 60000").unwrap();
    let (shard, owner) = owners(&c, "pgbench_accounts")[0].clone();
    let target = if owner == "n1" { "n2" } else { "n1" };
    let mut db = c.connect(target).unwrap();
    // An account of that shard and its balance, and the shard's rows, read before the move.
    let (aid, balance, shard_rows): (i32, i32, i64) = {
        let mut src = c.connect(&owner).unwrap();
        let r = src
            .query_one(
                &format!(
                    "SELECT aid, abalance, (SELECT count(*) FROM remus_shards.pgbench_accounts_{shard})
                       FROM remus_shards.pgbench_accounts_{shard} ORDER BY aid DESC LIMIT 1"
                ),
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    db.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + 7 WHERE aid = $1",
        &[&aid],
    )
    .unwrap();
    let mut via = c.connect("n3").unwrap();
    let call = std::thread::spawn(move || {
        via.query_one(
            "SELECT migration_id FROM remus_migrate_shard($1, $2, 'squall')",
            &[&shard, &target.to_string()],
        )
        .map(|r| r.get::<_, i64>(0))
    });
    // Wait until ownership has passed and chunks remain to pull.
    let id: i64 = remus_test_support::wait_for(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            db.query_one(
                "SELECT migration_id, count(*) FILTER (WHERE pulled), count(*)
                   FROM remus.squall_chunks GROUP BY migration_id",
                &[],
            )
            .ok()
            .filter(|r| r.get::<_, i64>(1) >= 1 && r.get::<_, i64>(2) > r.get::<_, i64>(1))
            .map(|r| r.get::<_, i64>(0))
        },
        || format!("no partly pulled shard\n{}", c.daemon_logs(40)),
    );
    let left_before: i64 = db
        .query_one(
            "SELECT count(*) FROM remus.squall_chunks WHERE migration_id = $1 AND NOT pulled",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert!(left_before > 0);
    // A REPEATABLE READ transaction on the target whose snapshot is older than the pull.
    let mut old_snapshot = c.connect(target).unwrap();
    old_snapshot
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .unwrap();
    // The shard belongs to the target already: the keyed read runs there, asks for the pull,
    // and sees the row as it was (not an empty result).
    let started = Instant::now();
    let read: i32 = c
        .connect(target)
        .unwrap()
        .query_one(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            &[&aid],
        )
        .unwrap()
        .get(0);
    let waited = started.elapsed();
    assert_eq!(read, balance + 7, "the row of account {aid} after the pull");
    // Its chunk was pulled for it, and not the whole shard: the puller went back to its
    // minute-long pause with chunks left.
    let (key_chunk_pulled, left_after): (bool, i64) = {
        let r = db
            .query_one(
                "SELECT bool_or(pulled) FILTER (WHERE remus.key_hash($2::int4) BETWEEN hash_lo AND hash_hi),
                        count(*) FILTER (WHERE NOT pulled)
                   FROM remus.squall_chunks WHERE migration_id = $1",
                &[&id, &aid],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert!(key_chunk_pulled, "the chunk of account {aid} is pulled");
    assert!(
        left_after > 0,
        "a keyed read waits for its chunk, not the shard ({left_before} chunks were left)"
    );
    println!(
        "reactive read of account {aid} on {target}: {} ms ({left_before} chunks were left, {left_after} after)",
        waited.as_millis()
    );
    // The pull is not in the older snapshot: that transaction cannot read the account (40001,
    // retryable); one that starts after the pull reads it (its snapshot sees the pull).
    let err = old_snapshot
        .query_one(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            &[&aid],
        )
        .expect_err("a snapshot older than the pull does not read the pulled chunk");
    assert_eq!(
        err.code(),
        Some(&postgres::error::SqlState::T_R_SERIALIZATION_FAILURE),
        "{err:?}"
    );
    let mut new_snapshot = c.connect(target).unwrap();
    let mut tx = new_snapshot
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .start()
        .unwrap();
    let again: i32 = tx
        .query_one(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            &[&aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(again, balance + 7);
    tx.commit().unwrap();
    // A read of the whole shard (no key) asks for the rest: the puller stops pausing (the
    // failpoint gone, its later pauses are the cluster's 20 ms) and the read sees every row.
    std::fs::remove_file(dir.join(SQUALL_SLOW_PULL)).unwrap();
    let all: i64 = c
        .connect(target)
        .unwrap()
        .query_one(
            &format!("SELECT count(*) FROM remus_shards.pgbench_accounts_{shard}"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(all, shard_rows, "every row of shard {shard} after the pull");
    let (status, error) = wait_ended(&c, "n2", id, Duration::from_secs(60));
    assert_eq!(status, "succeeded", "{error:?}");
    call.join().unwrap().unwrap();
    no_chunks_left(&c);
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
}
