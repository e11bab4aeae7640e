//! A short run of each workload of the benchmark driver `remus-bench` (bench/remus-bench)
//! against a 3-node cluster, through its command line as an operator runs it: tiny data, a few
//! seconds each, no timing thresholds. YCSB (uniform and zipfian), hybrid A (YCSB plus COPY
//! batches) and hybrid B (YCSB plus the duplicate-key query) with a Remus migration of one
//! shard during the run, TPC-C with its consistency conditions. Every run must commit, none may
//! fail a transaction (Remus moves shards without aborts), the duplicate-key query must answer 0
//! every time, the migration must show up as a window with Table 2 / Table 3 rows, and the
//! outputs (series CSV, summary, tables, plot) must be written.

use std::path::Path;
use std::process::Command;

use remus_test_support::cluster::{bin_dir, TestCluster};
use serde_json::Value;

/// Runs `remus-bench --cluster-dir <c> <args>`; its stdout, asserting it exited 0.
fn bench(c: &TestCluster, args: &[&str]) -> String {
    let bin = bin_dir().join("remus-bench");
    let out = Command::new(&bin)
        .arg("--cluster-dir")
        .arg(c.dir.path())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {} (cargo build --release): {e}", bin.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "remus-bench {args:?} exited {}:\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `run <workload>` for `secs` seconds with `extra` options; its summary.json.
fn run(c: &TestCluster, out: &Path, workload: &str, secs: &str, extra: &[&str]) -> Value {
    let dir = out.join(workload);
    let dir_s = dir.to_string_lossy().into_owned();
    let mut args = vec![
        "run",
        workload,
        "--seconds",
        secs,
        "--clients",
        "3",
        "--out",
        &dir_s,
    ];
    args.extend_from_slice(extra);
    let stdout = bench(c, &args);
    assert!(stdout.contains("RESULT: ok"), "{stdout}");
    for f in ["series.csv", "summary.json", "tables.md", "throughput.png"] {
        let len = std::fs::metadata(dir.join(f))
            .unwrap_or_else(|e| panic!("{workload}: {f}: {e}"))
            .len();
        assert!(len > 0, "{workload}: {f} is empty");
    }
    let csv = std::fs::read_to_string(dir.join("series.csv")).unwrap();
    assert!(csv.lines().count() > 10, "{workload}: series.csv:\n{csv}");
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Each workload's summary: it committed, and nothing failed or was aborted.
fn assert_clean(s: &Value, workloads: &[&str]) {
    let sums = s["summaries"].as_array().expect("summaries");
    let names: Vec<&str> = sums
        .iter()
        .map(|w| w["workload"].as_str().unwrap())
        .collect();
    assert_eq!(names, workloads, "{s:#}");
    for w in sums {
        assert!(w["commits"].as_u64().unwrap() > 0, "{w:#}");
        assert_eq!(w["failed"], 0, "{w:#}\n{:#}", s["error_samples"]);
        assert_eq!(w["aborts"], 0, "{w:#}\n{:#}", s["error_samples"]);
    }
    assert_eq!(s["ok"], true, "{s:#}");
}

/// One Remus migration of shard `shard` to `to`, `at` seconds into a run.
fn migrate_at(at: &str, shard: i64, to: &str) -> String {
    format!("{at}:SELECT * FROM remus_migrate_shards(ARRAY[{shard}::bigint], '{to}', 'remus')")
}

/// A shard of usertable and a node that does not own it.
fn shard_and_other_node(c: &TestCluster) -> (i64, String) {
    let mut n1 = c.connect("n1").unwrap();
    let r = n1
        .query_one(
            "SELECT shard_id, node_name FROM remus_shards WHERE table_name = 'usertable' \
             ORDER BY shard_id LIMIT 1",
            &[],
        )
        .unwrap();
    let (shard, owner): (i64, String) = (r.get(0), r.get(1));
    let to = c
        .node_names()
        .into_iter()
        .find(|n| *n != owner)
        .expect("another node");
    (shard, to)
}

#[test]
fn every_workload_commits_without_failures_and_checks_out() {
    let c = TestCluster::start(3).expect("cluster up");
    let out = tempfile::tempdir().unwrap();

    let loaded = bench(&c, &["load", "ycsb", "--records", "2000", "--shards", "4"]);
    assert!(loaded.contains("2000 rows"), "{loaded}");
    let mut n2 = c.connect("n2").unwrap();
    let rows: i64 = n2
        .query_one("SELECT count(*) FROM usertable", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 2000);

    let s = run(
        &c,
        out.path(),
        "ycsb",
        "3",
        &["--dist", "zipfian", "--no-cluster-windows"],
    );
    assert_clean(&s, &["ycsb"]);
    assert_eq!(s["key_distribution"], "zipfian");

    // Hybrid A with a migration: the window, and Table 2 and Table 3 rows for it.
    let (shard, to) = shard_and_other_node(&c);
    let m = migrate_at("1", shard, &to);
    let s = run(
        &c,
        out.path(),
        "hybrid-a",
        "4",
        &["--batch-rows", "200", "--at", &m],
    );
    assert_clean(&s, &["ycsb", "ingest"]);
    assert!(
        s["at_results"][0].as_str().unwrap().contains(": ok after"),
        "{:#}",
        s["at_results"]
    );
    let windows = s["migrations"].as_array().unwrap();
    assert!(
        windows
            .iter()
            .any(|w| w["label"].as_str().unwrap().contains("(remus, succeeded)")),
        "{windows:?}"
    );
    assert_eq!(s["table2"].as_array().unwrap().len(), windows.len());
    assert_eq!(s["table3"].as_array().unwrap().len(), windows.len());
    let ingested = s["summaries"][1]["units"].as_i64().unwrap();
    let rows: i64 = n2
        .query_one("SELECT count(*) FROM usertable", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        rows,
        2000 + ingested,
        "every committed COPY batch is in the table"
    );

    // Hybrid B with the shard moved on: every duplicate-key answer 0 (checked by the driver,
    // which fails the run otherwise; and here).
    let (again, to2) = shard_and_other_node(&c);
    assert_eq!(again, shard);
    assert_ne!(to2, to, "hybrid A's migration moved shard {shard} to {to}");
    let m = migrate_at("1", shard, &to2);
    let s = run(&c, out.path(), "hybrid-b", "4", &["--at", &m]);
    assert_clean(&s, &["ycsb", "analytic"]);
    assert_eq!(s["duplicate_answers_not_zero"].as_array().unwrap().len(), 0);

    // TPC-C: two warehouses, so remote NewOrders and Payments run (2PC).
    let loaded = bench(&c, &["load", "tpcc", "--warehouses", "2", "--shards", "4"]);
    assert!(loaded.contains("2 warehouses"), "{loaded}");
    let dir = out.path().join("tpcc");
    let dir_s = dir.to_string_lossy().into_owned();
    let stdout = bench(
        &c,
        &[
            "run",
            "tpcc",
            "--seconds",
            "4",
            "--clients",
            "3",
            "--out",
            &dir_s,
        ],
    );
    assert!(
        stdout.contains("TPC-C consistency (conditions 1-4, cross-warehouse sums): holds"),
        "{stdout}"
    );
    let s: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    // Deadlocks and serialization failures are retried (and counted as aborts); nothing else may fail.
    let t = &s["summaries"][0];
    assert!(t["commits"].as_u64().unwrap() > 0, "{t:#}");
    assert_eq!(t["failed"], 0, "{t:#}\n{:#}", s["error_samples"]);
    assert_eq!(s["consistency_violations"].as_array().unwrap().len(), 0);
    let committed: Vec<u64> = s["tpcc"]["committed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(
        committed[0] > 0 && committed[1] > 0,
        "NewOrder and Payment committed: {committed:?}"
    );
    // A run that finds a broken invariant fails: the driver exits 1 and says why.
    n2.batch_execute("UPDATE warehouse SET w_ytd = w_ytd + 1 WHERE w_id = 1")
        .unwrap();
    let bin = bin_dir().join("remus-bench");
    let broken = Command::new(&bin)
        .arg("--cluster-dir")
        .arg(c.dir.path())
        .args([
            "run",
            "tpcc",
            "--seconds",
            "1",
            "--clients",
            "1",
            "--no-plot",
            "--out",
            &dir_s,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&broken.stdout);
    assert_eq!(broken.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("RESULT: FAILED: TPC-C consistency"),
        "{stdout}"
    );
    assert!(stdout.contains("condition 1, warehouse 1"), "{stdout}");
}
