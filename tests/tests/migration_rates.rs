//! A migration's rates, lag and copy progress, and catch-up that does not converge (issue 17
//! items 2, 3 and 6; decision 0022). TPC-B load (pgbench) on the source while an account shard
//! moves; the replay is slowed by the test-only failpoint `catchup.slow_replay` (the propagator
//! waits after each transaction it ships), and the coordinators of this file run with a short
//! convergence limit (`REMUS_CATCHUP_CONVERGE_LIMIT_MS`, inherited through `remusctl cluster up`).
//!
//! - remus, through `remusctl migrate` (stdout not a terminal): while catch-up runs,
//!   `remus_migrations` shows the copy's total, the source's and the replay's rates and the lag;
//!   the catch-up that does not converge says so in `waiting_on`, naming both rates, and hands
//!   over (dual execution paces the source's writers); with the replay back to speed the
//!   migration succeeds, its final values consistent (bytes copied at most the tables' size,
//!   rows copied the shard's rows at the snapshot, at least one); `remusctl migrate` printed
//!   `progress:` lines for copy and catch-up, one per line.
//! - lock_abort: the same slow replay makes the migration fail with an error that names both
//!   rates; it is rolled back: nothing left on the nodes, the shard still on its source.

use std::process::Child;
use std::sync::Once;
use std::time::Duration;

use coordinator::failpoint::{CATCHUP_SLOW_REPLAY, COPY_SNAPSHOT_EXPORTED};
use integration::migrations::wait_ended;
use integration::pgbench::{init_tpcb, start_tpcb, wait_committing};
use integration::shards::owners;
use remus_test_support::cluster::{stdout, TestCluster};
use remus_test_support::wait_for;

/// Generous bounds of the waits (not timing assertions).
const LIMIT: Duration = Duration::from_secs(240);

/// Every coordinator this file starts gives up on catch-up after 3 s without a smaller lag.
fn short_convergence_limit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("REMUS_CATCHUP_CONVERGE_LIMIT_MS", "3000"));
}

/// Two nodes with the TPC-B tables; an account shard of n1; pgbench on n1 for `seconds`.
fn loaded_cluster(seconds: u32) -> (TestCluster, i64, Child) {
    short_convergence_limit();
    let c = TestCluster::start(2).expect("cluster up");
    init_tpcb(&c, 1);
    let shard = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .map(|(s, _)| s)
        .expect("n1 holds an account shard");
    let bench = start_tpcb(&c, "n1", 4, seconds);
    // The load is committing before the migration starts: the first catch-up round of the CI
    // run of a2fbc76 found an empty stream (pgbench not yet committing) and went to the barrier.
    wait_committing(&c, "n1", 200);
    (c, shard, bench)
}

/// Holds the migration just after its copy's snapshot is exported and commits `n` transactions,
/// each an update of one account row of `shard` (balance unchanged), through n1: the stream then
/// holds at least `n` transactions of the shard whatever pgbench's pace, so the first catch-up
/// round cannot be short. (The CI run of af35203 found no write of the shard between the
/// snapshot and the first sync point: the round took 53 ms and went to the barrier.)
fn writes_after_snapshot(c: &TestCluster, shard: i64, n: i64) {
    c.wait_paused_at(COPY_SNAPSHOT_EXPORTED, LIMIT)
        .expect("the copy exports its snapshot");
    let mut db = c.connect("n1").unwrap();
    let aids: Vec<i32> = db
        .query(
            &format!("SELECT aid FROM remus_shards.pgbench_accounts_{shard} ORDER BY aid LIMIT $1"),
            &[&n],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(aids.len() as i64, n, "shard {shard} has {n} rows");
    for aid in aids {
        db.execute(
            "UPDATE pgbench_accounts SET abalance = abalance + 0 WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    }
    c.release_failpoint(COPY_SNAPSHOT_EXPORTED).unwrap();
}

fn slow_replay(c: &TestCluster, ms_per_txn: u32) {
    let dir = c.state().unwrap().failpoint_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(CATCHUP_SLOW_REPLAY), format!("delay {ms_per_txn}")).unwrap();
}

/// One read of the migration's row: phase, status, waiting_on and the numbers.
#[derive(Debug, Clone)]
struct Seen {
    phase: String,
    status: String,
    waiting_on: Option<String>,
    rows_copied: i64,
    bytes_copied: i64,
    copy_total_bytes: Option<i64>,
    copy_rate: Option<i64>,
    source_rate: Option<i64>,
    replay_rate: Option<i64>,
    replay_txns: Option<i64>,
    lag_bytes: Option<i64>,
    lag_ms: Option<i64>,
}

fn read(db: &mut postgres::Client, id: Option<i64>) -> Option<Seen> {
    let row = db
        .query_opt(
            "SELECT phase, status, waiting_on, rows_copied, bytes_copied, copy_total_bytes,
                    copy_bytes_per_sec, source_wal_bytes_per_sec, replay_bytes_per_sec,
                    replay_txns_per_sec, lag_bytes, lag_ms
               FROM remus_migrations
              WHERE migration_id = coalesce($1, (SELECT max(migration_id) FROM remus_migrations))",
            &[&id],
        )
        .ok()??;
    Some(Seen {
        phase: row.get(0),
        status: row.get(1),
        waiting_on: row.get(2),
        rows_copied: row.get(3),
        bytes_copied: row.get(4),
        copy_total_bytes: row.get(5),
        copy_rate: row.get(6),
        source_rate: row.get(7),
        replay_rate: row.get(8),
        replay_txns: row.get(9),
        lag_bytes: row.get(10),
        lag_ms: row.get(11),
    })
}

#[test]
fn remus_reports_rates_and_hands_over_when_catch_up_does_not_converge() {
    let (c, shard, mut bench) = loaded_cluster(600);
    slow_replay(&c, 2000);
    c.arm_pause(COPY_SNAPSHOT_EXPORTED).unwrap();
    let dir = c.dir_str();
    let shard_arg = shard.to_string();
    let ctl = std::thread::spawn(move || {
        remus_test_support::cluster::remusctl(&[
            "migrate", "--shard", &shard_arg, "--to", "n2", "--mode", "remus", "--dir", &dir,
        ])
    });

    writes_after_snapshot(&c, shard, 10);

    // Catch-up, measured, and declared not converging (the replay is slow).
    let mut db = c.connect("n1").unwrap();
    let stalled = wait_for(
        LIMIT,
        Duration::from_millis(200),
        || {
            read(&mut db, None).filter(|s| {
                s.waiting_on
                    .as_deref()
                    .is_some_and(|w| w.contains("not converging"))
            })
        },
        || {
            format!(
                "catch-up never said it does not converge\n{}",
                c.daemon_logs(40)
            )
        },
    );
    assert_eq!(stalled.status, "running", "{stalled:?}");
    let w = stalled.waiting_on.clone().unwrap();
    assert!(
        w.contains("source writes") && w.contains("target replays") && w.contains("paces"),
        "{w}"
    );
    for (what, v) in [
        ("copy_total_bytes", stalled.copy_total_bytes),
        ("copy_bytes_per_sec", stalled.copy_rate),
        ("source_wal_bytes_per_sec", stalled.source_rate),
        ("replay_bytes_per_sec", stalled.replay_rate),
        ("replay_txns_per_sec", stalled.replay_txns),
        ("lag_bytes", stalled.lag_bytes),
        ("lag_ms", stalled.lag_ms),
    ] {
        assert!(
            v.is_some(),
            "{what} is null while catch-up runs: {stalled:?}"
        );
    }
    // The stream is behind: the source has written more than the target applied.
    assert!(stalled.lag_bytes.unwrap() > 0, "{stalled:?}");

    // The replay back at full speed: the handover completes.
    c.release_failpoint(CATCHUP_SLOW_REPLAY).unwrap();
    let out = ctl.join().unwrap();
    let _ = bench.kill();
    let _ = bench.wait();
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "remusctl migrate: {text}\n{}",
        c.daemon_logs(40)
    );

    let last = read(&mut db, None).unwrap();
    assert_eq!(last.status, "succeeded", "{last:?}");
    let total = last.copy_total_bytes.expect("copy total kept");
    assert!(total > 0, "{last:?}");
    assert!(
        last.bytes_copied > 0 && last.bytes_copied <= total,
        "{last:?}"
    );
    assert!(last.rows_copied > 0, "{last:?}");
    assert!(
        last.lag_bytes.is_some() && last.source_rate.is_some(),
        "{last:?}"
    );

    // Not a terminal: the live line is printed as lines of their own, per phase.
    let lines: Vec<&str> = text.lines().collect();
    let progress = |phase: &str| {
        lines
            .iter()
            .filter(|l| l.starts_with(&format!("progress: {phase} ")))
            .count()
    };
    assert!(progress("copy") >= 1, "{text}");
    assert!(progress("catchup") >= 1, "{text}");
    assert!(
        lines.iter().any(|l| l.starts_with("progress: catchup ")
            && l.contains("lag ")
            && l.contains("source ")),
        "{text}"
    );
    assert!(
        !text.contains('\r'),
        "no redraw when not a terminal: {text:?}"
    );
}

#[test]
fn lock_abort_rolls_back_when_catch_up_does_not_converge() {
    let (c, shard, mut bench) = loaded_cluster(600);
    slow_replay(&c, 2000);
    c.arm_pause(COPY_SNAPSHOT_EXPORTED).unwrap();
    let mut db = c.connect("n1").unwrap();
    let call = std::thread::spawn(move || {
        db.query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n2', 'lock_abort')",
            &[&shard],
        )
        .map(|r| r.get::<_, String>(0))
    });
    writes_after_snapshot(&c, shard, 10);
    let err = call.join().unwrap();
    let mut db = c.connect("n1").unwrap();
    let _ = bench.kill();
    let _ = bench.wait();
    let seen = read(&mut db, None).expect("the migration is recorded");
    let id: i64 = db
        .query_one("SELECT max(migration_id) FROM remus_migrations", &[])
        .unwrap()
        .get(0);
    let (status, error) = wait_ended(&c, "n1", id, LIMIT);
    let error = error.unwrap_or_default();
    assert!(
        !matches!(err.as_deref(), Ok("succeeded")),
        "the call: {err:?}"
    );
    assert_ne!(status, "succeeded", "{seen:?}");
    assert!(
        error.contains("not converging")
            && error.contains("the source writes")
            && error.contains("the target replays"),
        "error: {error}\n{}",
        c.daemon_logs(40)
    );
    assert_eq!(seen.phase, "catchup", "failed in catch-up: {seen:?}");
    c.release_failpoint(CATCHUP_SLOW_REPLAY).unwrap();
    // Rolled back: nothing of the migration on any node, the shard where it was.
    remus_test_support::wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || c.migration_artifacts().is_empty(),
        || format!("left behind: {:?}", c.migration_artifacts()),
    );
    assert_eq!(c.migration_artifacts(), Vec::<String>::new());
    let owner = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(s, _)| *s == shard)
        .map(|(_, o)| o);
    assert_eq!(owner.as_deref(), Some("n1"));
}
