//! The migration pipeline's acceptance with the two baseline handovers: pgbench TPC-B runs
//! against all three nodes (no retries) while four account shards move one after another and
//! then every shard of n3 moves to n1 and n2. Afterwards the balances match the history, n3 owns
//! nothing, nothing of the migrations is left on any node, and pgbench's failures are exactly
//! the transactions the migrations say they aborted.
//!
//! The coordinator runs with REMUS_VERIFY_HANDOVER=true: before each ownership flip it compares
//! every moved shard table on source and target (row count and a digest over all columns) while
//! the source is quiet, and fails the migration on a difference; the test counts those
//! verifications in the coordinator's log.

use std::time::Duration;

use integration::pgbench::{balances, finish, init_tpcb, prepared_everywhere};
use integration::shards::{assert_owns_no_shard, owners, TPCB_TABLES};
use remus_test_support::cluster::TestCluster;

struct Moved {
    migration_id: i64,
    aborted: i64,
    status: String,
    tables: usize,
}

fn migrate(c: &TestCluster, via: &str, shard: i64, target: &str, mode: &str) -> Moved {
    let mut db = c.connect(via).unwrap();
    let row = db
        .query_one(
            "SELECT migration_id, status, aborted_by_migration, cardinality(shard_ids),
                    copy_ms, catchup_ms, handover_ms, cleanup_ms, total_ms, rows_copied, txns_replayed
               FROM remus_migrate_shard($1, $2, $3)",
            &[&shard, &target, &mode],
        )
        .unwrap_or_else(|e| panic!("migrating shard {shard} to {target} ({mode}): {e:?}"));
    let m = Moved {
        migration_id: row.get(0),
        status: row.get(1),
        aborted: row.get(2),
        tables: row.get::<_, i32>(3) as usize,
    };
    println!(
        "migration {} shard {shard} -> {target} ({mode}): {} copy {} ms, catchup {} ms, handover {} ms, cleanup {} ms, total {} ms, rows {}, replayed {}, aborted {}",
        m.migration_id,
        m.status,
        row.get::<_, i64>(4),
        row.get::<_, i64>(5),
        row.get::<_, i64>(6),
        row.get::<_, i64>(7),
        row.get::<_, i64>(8),
        row.get::<_, i64>(9),
        row.get::<_, i64>(10),
        m.aborted
    );
    m
}

fn run(mode: &str) {
    // Read by the coordinator that `cluster up` starts.
    std::env::set_var("REMUS_VERIFY_HANDOVER", "true");
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 4);
    let before = owners(&c, "pgbench_accounts");
    assert!(before.len() >= 8, "{before:?}");

    let seconds = 150;
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
                    &seconds.to_string(),
                    "--max-tries=1",
                ],
            )
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));

    let mut moved = Vec::new();
    // Four account shards, one after another, each to the next node; through different nodes.
    for (i, (shard, owner)) in before.iter().take(4).enumerate() {
        let target = match owner.as_str() {
            "n1" => "n2",
            "n2" => "n3",
            _ => "n1",
        };
        let via = format!("n{}", i % 3 + 1);
        moved.push(migrate(&c, &via, *shard, target, mode));
    }
    // Consolidation: every shard of n3 (all tables) to n1 and n2, alternating.
    let mut k = 0;
    for table in ["pgbench_accounts", "pgbench_branches", "pgbench_tellers"] {
        for (shard, owner) in owners(&c, table) {
            if owner == "n3" {
                let target = if k % 2 == 0 { "n1" } else { "n2" };
                k += 1;
                moved.push(migrate(&c, "n2", shard, target, mode));
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
    println!("{mode}: {} migrations, pgbench {processed} committed, {failed} failed; aborted_by_migration {aborted}", moved.len());
    for r in &results {
        assert_eq!(r.aborted_clients, 0, "a pgbench client died: {}", r.output);
        assert!(r.processed > 0, "{}", r.output);
    }
    assert_eq!(
        failed as i64, aborted,
        "pgbench failures must be exactly the migrations' aborts"
    );
    if mode == "wait_remaster" {
        assert_eq!(aborted, 0, "wait_remaster aborts nothing");
    }

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
    assert_owns_no_shard(&c, "n3", &TPCB_TABLES);
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(prepared_everywhere(&c), 0);

    // Every moved table was compared on source and target before its flip.
    let state = c.state().unwrap();
    let log = std::fs::read_to_string(&state.coordinator.log).unwrap();
    let verified = log
        .lines()
        .filter(|l| l.contains("handover verified"))
        .count();
    let tables: usize = moved.iter().map(|m| m.tables).sum();
    assert_eq!(verified, tables, "verified tables vs moved tables");

    // The migrations are listed, on any node.
    let mut n3 = c.connect("n3").unwrap();
    let listed: i64 = n3
        .query_one(
            "SELECT count(*) FROM remus_migrations WHERE status = 'succeeded'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(listed as usize, moved.len());
}

#[test]
fn lock_abort_moves_and_consolidates_under_tpcb() {
    run("lock_abort");
}

#[test]
fn wait_remaster_moves_and_consolidates_under_tpcb() {
    run("wait_remaster");
}
