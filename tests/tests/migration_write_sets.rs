//! Write sets of big transactions in dual execution (review finding F10). A transaction that
//! writes a migrating shard in dual execution ships its write set to the destination's replay
//! worker for validation. It used to be one gRPC message capped at 256 MiB (a bigger one failed
//! with 40001 on every retry) and to grow without bound in the backend (an allocation failure
//! aborts the backend and crash-restarts the node).
//!
//! - A transaction whose write set spans hundreds of chunks (`remus.write_set_chunk_bytes` set
//!   to its minimum) commits in dual execution, and every row is right on the new owner.
//! - Past `remus.max_write_set_bytes`, a write in dual execution fails with 54000 naming the
//!   setting; the migration goes on and a smaller transaction commits.
//! - Before dual execution a write set past the setting is dropped instead: the transaction
//!   commits (unvalidated, as every commit before the sync barrier does), and one still open at
//!   the barrier fails its COMMIT with 54000.
//! - `#[ignore]`d, opt-in: a 1.5M-row UPDATE (a write set of about 370 MB encoded) commits in
//!   dual execution.

use std::time::{Duration, Instant};

use coordinator::failpoint::{CATCHUP_RUNNING, DUAL_STARTED};
use integration::migrations::{aborted_by, start_paused, MigrationCall};
use integration::shards::owners;
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

/// A two-node cluster with `t(id, v, pad)` in ONE shard (so a plain `UPDATE t` is one local
/// statement on the source) holding rows 1..=`rows`; returns the cluster, the shard, its
/// owner (the source) and the other node (the target).
fn one_shard_table(rows: i64) -> (TestCluster, i64, String, String) {
    let c = TestCluster::start(2).expect("cluster up");
    c.connect("n1")
        .unwrap()
        .batch_execute(&format!(
            "CREATE TABLE t (id bigint PRIMARY KEY, v bigint NOT NULL, pad text NOT NULL);
             INSERT INTO t SELECT g, g, repeat('p', 80) FROM generate_series(1, {rows}) g;
             SELECT remus_create_distributed_table('t', 'id', 1);"
        ))
        .unwrap();
    let (shard, source) = owners(&c, "t").into_iter().next().expect("one shard");
    let target = if source == "n1" { "n2" } else { "n1" }.to_string();
    (c, shard, source, target)
}

/// Waits for the migration call of [`start_paused`] to succeed; how many transactions it
/// aborted.
fn succeeded(c: &TestCluster, id: i64, call: MigrationCall) -> i64 {
    let status = call
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("migration: {e:?}\n{}", c.daemon_logs(40)));
    assert_eq!(status, "succeeded", "{}", c.daemon_logs(40));
    aborted_by(c, id)
}

/// Rows of the shard on `node`'s own copy that differ from `expected` (a SQL expression over
/// `id` giving `(v, pad)`), and the row count there.
fn wrong_rows(c: &TestCluster, node: &str, shard: i64, expected: &str) -> (i64, i64) {
    let r = c
        .connect(node)
        .unwrap()
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE (v, pad) IS DISTINCT FROM {expected}), count(*)
                   FROM remus_shards.t_{shard}"
            ),
            &[],
        )
        .unwrap();
    (r.get(0), r.get(1))
}

#[test]
fn a_write_set_of_hundreds_of_chunks_commits_in_dual_execution() {
    let (c, shard, source, target) = one_shard_table(2000);
    let (id, mover) = start_paused(&c, &target, shard, &target, DUAL_STARTED);
    let mut db = c.connect(&source).unwrap();
    // 1 kB chunks: each holds about three row changes, so the ~2500 changes below take
    // hundreds of Validate messages.
    db.batch_execute("SET remus.write_set_chunk_bytes = '1kB'")
        .unwrap();
    // (INSERT … SELECT is not routed: the new rows are a VALUES list.)
    let values: Vec<String> = (2001..=2500)
        .map(|g| format!("({g}, {}, 'u{g}')", g * 10))
        .collect();
    let mut tx = db.transaction().unwrap();
    tx.batch_execute(&format!(
        "UPDATE t SET v = v * 10, pad = 'u' || id;
         SAVEPOINT s;
         UPDATE t SET v = -1 WHERE id = 7;
         ROLLBACK TO SAVEPOINT s;
         DELETE FROM t WHERE id = 5;
         INSERT INTO t VALUES {};",
        values.join(", ")
    ))
    .unwrap();
    tx.commit()
        .unwrap_or_else(|e| panic!("COMMIT in dual execution: {e:?}\n{}", c.daemon_logs(40)));
    c.release_failpoint(DUAL_STARTED).unwrap();
    assert_eq!(succeeded(&c, id, mover), 0, "nothing was aborted");
    assert_eq!(owners(&c, "t")[0].1, target);
    assert_eq!(
        wrong_rows(&c, &target, shard, "(id * 10, 'u' || id)"),
        (0, 2499),
        "every row on the new owner carries the transaction's write"
    );
}

#[test]
fn a_write_set_past_its_limit_fails_with_54000_and_the_migration_goes_on() {
    let (c, shard, source, target) = one_shard_table(2000);
    let (id, mover) = start_paused(&c, &target, shard, &target, CATCHUP_RUNNING);
    let limit = "SET remus.max_write_set_bytes = '64kB'";
    // Before the barrier (catch-up), past the limit: the write set is dropped, not the
    // transaction. One commits before the barrier; one stays open across it.
    let mut early = c.connect(&source).unwrap();
    early.batch_execute(limit).unwrap();
    early
        .batch_execute("BEGIN; UPDATE t SET v = v + 1 WHERE id > 1000; COMMIT")
        .unwrap_or_else(|e| panic!("a big commit before the barrier: {e:?}"));
    let mut straddling = c.connect(&source).unwrap();
    straddling.batch_execute(limit).unwrap();
    straddling
        .batch_execute("BEGIN; UPDATE t SET pad = 'lost' WHERE id <= 1000")
        .unwrap();
    c.arm_pause(DUAL_STARTED).unwrap();
    c.release_failpoint(CATCHUP_RUNNING).unwrap();
    c.wait_paused_at(DUAL_STARTED, Duration::from_secs(120))
        .unwrap();
    // Its write set is incomplete: it cannot be validated.
    let e = straddling
        .batch_execute("COMMIT")
        .expect_err("an incomplete write set committed in dual execution");
    assert_eq!(sqlstate(&e), "54000", "{e:?}");
    // In dual execution the statement that passes the limit fails.
    let mut db = c.connect(&source).unwrap();
    db.batch_execute(limit).unwrap();
    db.batch_execute("BEGIN").unwrap();
    let e = db
        .batch_execute("UPDATE t SET pad = 'big' || id")
        .expect_err("a write set past remus.max_write_set_bytes");
    assert_eq!(sqlstate(&e), "54000", "{e:?}");
    let message = e.as_db_error().map(|d| d.message().to_string());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("remus.max_write_set_bytes")),
        "{message:?}"
    );
    db.batch_execute("ROLLBACK").unwrap();
    // A transaction within the limit still validates and commits.
    db.batch_execute("UPDATE t SET v = 0 WHERE id <= 10")
        .unwrap_or_else(|e| panic!("a small commit in dual execution: {e:?}"));
    c.release_failpoint(DUAL_STARTED).unwrap();
    assert_eq!(
        succeeded(&c, id, mover),
        2,
        "the two 54000s count as aborted"
    );
    assert_eq!(owners(&c, "t")[0].1, target);
    assert_eq!(
        wrong_rows(
            &c,
            &target,
            shard,
            "(CASE WHEN id <= 10 THEN 0 WHEN id > 1000 THEN id + 1 ELSE id END, repeat('p', 80))"
        ),
        (0, 2000)
    );
}

/// Opt-in (`cargo test --release -p integration --test migration_write_sets -- --ignored`):
/// one UPDATE of 1.5M rows of ~100 bytes in dual execution. Its write set (old and new row per
/// change, about 250 bytes encoded) is about 370 MB, past the 256 MiB that one Validate message
/// was limited to: before the fix its COMMIT failed with 40001. Measured on 2 shared cores
/// (2026-11-25): UPDATE 15 s (source backend at 1.5 GB RSS), COMMIT with its validation 530 s
/// (about 2,800 rows/s: the destination's per-row statements, CPU bound), whole test 9.7 min.
#[test]
#[ignore = "opt-in: a 1.5M-row transaction takes minutes"]
fn a_write_set_over_256_mib_commits_in_dual_execution() {
    const ROWS: i64 = 1_500_000;
    let started = Instant::now();
    let (c, shard, source, target) = one_shard_table(ROWS);
    let (id, mover) = start_paused(&c, &target, shard, &target, DUAL_STARTED);
    eprintln!("set up and in dual execution after {:?}", started.elapsed());
    let mut db = c.connect(&source).unwrap();
    // The write set takes about 1.5 GB of backend memory, and its validation longer than the
    // default minute.
    db.batch_execute(
        "SET remus.max_write_set_bytes = '8GB'; SET remus.validation_timeout = '30min'",
    )
    .unwrap();
    let t = Instant::now();
    db.batch_execute("BEGIN; UPDATE t SET v = v + 1, pad = repeat('q', 80)")
        .unwrap();
    eprintln!("UPDATE of {ROWS} rows took {:?}", t.elapsed());
    let t = Instant::now();
    db.batch_execute("COMMIT")
        .unwrap_or_else(|e| panic!("COMMIT in dual execution: {e:?}\n{}", c.daemon_logs(40)));
    eprintln!("COMMIT (validation) took {:?}", t.elapsed());
    c.release_failpoint(DUAL_STARTED).unwrap();
    assert_eq!(succeeded(&c, id, mover), 0);
    assert_eq!(
        wrong_rows(&c, &target, shard, "(id + 1, repeat('q', 80))"),
        (0, ROWS)
    );
    eprintln!("whole test {:?}", started.elapsed());
}
