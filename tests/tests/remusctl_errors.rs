//! Wrong calls of `remusctl`, each refused with a clear message on stderr and its exit status
//! (1: refused, 2: a malformed command line) and without changing anything: every shard keeps
//! its owner, no migration is recorded, the cluster's processes are the ones that were running,
//! and no cluster directory appears where a refused `cluster up` pointed. Refusals that come from
//! the coordinator carry its SQLSTATE, as the SQL functions raise it (sql/regress/api_errors.sql
//! is the SQL side).
//!
//! - unknown: shard, target node, mode, `cluster env --node`, a directory without a cluster, a
//!   subcommand;
//! - out of range / malformed: `--nodes 0`, `--base-port 80`, `--shard abc`, a missing
//!   `--shard` or `--to`;
//! - wrong node: the shard is already on the target, shards of several nodes in one call;
//! - wrong kind: a reference table's shard;
//! - duplicate / wrong state: `cluster up` on a running cluster, `start-coordinator` while it
//!   runs, a second migration of a shard that a (paused) migration is moving.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use coordinator::failpoint::COPY_SNAPSHOT_EXPORTED;
use remus_test_support::cluster::{bin_dir, remusctl, stderr, stdout, TestCluster};

/// What a refused call must leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    /// `(shard_id, owner)` of every shard, `*` for a reference table's.
    owners: Vec<(i64, String)>,
    /// `(id, status)` of every migration the coordinator knows.
    migrations: Vec<(i64, String)>,
    /// `(component, pid)` of every process of the cluster that runs.
    processes: Vec<(String, u32)>,
}

fn snapshot(c: &TestCluster) -> Snapshot {
    let mut db = c.connect("n1").unwrap();
    let owners = db
        .query(
            "SELECT s.shard_id, coalesce(m.node_name, '*')
               FROM remus.shards s LEFT JOIN remus.shard_map m USING (shard_id) ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let migrations = db
        .query(
            "SELECT migration_id, status FROM remus_migrations ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let processes = c.state().unwrap().running();
    Snapshot {
        owners,
        migrations,
        processes,
    }
}

/// Asserts that `out` is a refusal: exit status `code`, `wanted` on stderr, nothing on stdout.
fn refused(what: &str, out: &Output, code: i32, wanted: &str) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: exit status; stdout {} stderr {}",
        stdout(out),
        stderr(out)
    );
    assert!(
        stderr(out).contains(wanted),
        "{what}: stderr does not say {wanted:?}: {}",
        stderr(out)
    );
    assert!(
        stdout(out).trim().is_empty(),
        "{what}: refused, yet printed {}",
        stdout(out)
    );
}

#[test]
fn wrong_calls_are_refused_with_their_sqlstate_and_change_nothing() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut db = c.connect("n1").unwrap();
    db.batch_execute(
        "CREATE TABLE ctl_t (id int PRIMARY KEY, v int);
         INSERT INTO ctl_t SELECT g, g FROM generate_series(1, 100) g;
         SELECT remus_create_distributed_table('ctl_t', 'id', shard_count => 2);
         CREATE TABLE ctl_ref (id int PRIMARY KEY);
         SELECT remus_create_reference_table('ctl_ref');",
    )
    .unwrap();
    let shards = integration::shards::owners(&c, "ctl_t");
    let (s1, o1) = shards[0].clone();
    let (s2, o2) = shards[1].clone();
    assert_ne!(o1, o2, "two shards over three nodes land on two nodes");
    let away = c
        .node_names()
        .into_iter()
        .find(|n| *n != o1 && *n != o2)
        .unwrap();
    let reference: i64 = db
        .query_one(
            "SELECT shard_id FROM remus_shards WHERE table_name = 'ctl_ref'",
            &[],
        )
        .unwrap()
        .get(0);
    let before = snapshot(&c);
    assert!(before.migrations.is_empty());
    let (s1, s2, reference) = (s1.to_string(), s2.to_string(), reference.to_string());

    // Refused by the coordinator: the message and SQLSTATE of the SQL functions.
    let coordinator_refusals: [(&str, Vec<&str>, &str); 6] = [
        (
            "unknown shard",
            vec!["--shard", "999999", "--to", &away],
            "migration refused: shard 999999 does not exist (SQLSTATE 42704)",
        ),
        (
            "unknown target node",
            vec!["--shard", &s1, "--to", "nosuch"],
            "migration refused: node \"nosuch\" does not exist (nodes: n1, n2, n3) (SQLSTATE 42704)",
        ),
        (
            "unknown mode",
            vec!["--shard", &s1, "--to", &away, "--mode", "bogus"],
            "migration refused: invalid migration mode \"bogus\" (expected remus | lock_abort | wait_remaster | squall | albatross) (SQLSTATE 22023)",
        ),
        (
            "already on the target",
            vec!["--shard", &s1, "--to", &o1],
            &format!("migration refused: shard {s1} is already on node {o1} (SQLSTATE 22023)"),
        ),
        (
            "shards of several nodes",
            vec!["--shard", &s1, "--shard", &s2, "--to", &away],
            &format!("migration refused: shards of one migration must be on one node: shard {s2} is on {o2}, others on {o1} (SQLSTATE 22023)"),
        ),
        (
            "a reference table's shard",
            vec!["--shard", &reference, "--to", &away],
            &format!("migration refused: shard {reference} belongs to a reference table, which is on every node and is not migrated (SQLSTATE 22023)"),
        ),
    ];
    for (what, args, wanted) in &coordinator_refusals {
        let mut all = vec!["migrate"];
        all.extend(args.iter().copied());
        refused(what, &c.ctl(&all), 1, wanted);
    }

    // Malformed command lines: clap's usage error, status 2.
    for (what, args, wanted) in [
        (
            "no --shard",
            vec!["migrate", "--to", "n2"],
            "the following required arguments were not provided",
        ),
        (
            "no --to",
            vec!["migrate", "--shard", "1"],
            "the following required arguments were not provided",
        ),
        (
            "a shard id that is no number",
            vec!["migrate", "--shard", "abc", "--to", "n2"],
            "invalid value 'abc' for '--shard <SHARDS>'",
        ),
    ] {
        refused(what, &c.ctl(&args), 2, wanted);
    }
    refused(
        "unknown subcommand",
        &remusctl(&["bogus"]),
        2,
        "unrecognized subcommand 'bogus'",
    );

    // The cluster itself: unknown node, duplicate start, a coordinator that already runs.
    refused(
        "unknown node for env",
        &c.ctl(&["cluster", "env", "--node", "n9"]),
        1,
        "no node n9 in this cluster (nodes: n1, n2, n3)",
    );
    refused(
        "cluster up on a running cluster",
        &c.ctl(&[
            "cluster",
            "up",
            "--nodes",
            "3",
            "--base-port",
            &c.base_port.to_string(),
        ]),
        1,
        &format!("a cluster is already running in {}", c.dir_str()),
    );
    refused(
        "start-coordinator while it runs",
        &c.ctl(&["cluster", "start-coordinator"]),
        1,
        &format!("the coordinator of {} is running (pid", c.dir_str()),
    );
    assert_eq!(snapshot(&c), before, "a refused call changed the cluster");

    // Out of range, and directories without a cluster: refused before anything is created.
    let scratch = tempfile::tempdir().unwrap();
    let fresh = scratch.path().join("cluster");
    let fresh = fresh.to_str().unwrap();
    for (what, args, wanted) in [
        (
            "--nodes 0",
            vec!["cluster", "up", "--dir", fresh, "--nodes", "0"],
            "--nodes must be between 1 and 99",
        ),
        (
            "--base-port 80",
            vec!["cluster", "up", "--dir", fresh, "--base-port", "80"],
            // The span after P grows with the daemons (remus_proto::names::ports::MAX_OFFSET).
            "--base-port must leave room for ports P..P+",
        ),
        (
            "migrations without a cluster",
            vec!["migrations", "--dir", fresh],
            &format!("no cluster in {fresh}"),
        ),
        (
            "nodes without a cluster",
            vec!["nodes", "--dir", fresh],
            &format!("no cluster in {fresh}"),
        ),
        (
            "down without a cluster",
            vec!["cluster", "down", "--dir", fresh],
            &format!("no cluster in {fresh}"),
        ),
    ] {
        refused(what, &remusctl(&args), 1, wanted);
        assert!(
            !std::path::Path::new(fresh).exists(),
            "{what}: created {fresh}"
        );
    }

    // Wrong state: a shard that a migration is moving (paused in its copy) cannot be moved
    // again; the first migration is untouched and then completes.
    c.arm_pause(COPY_SNAPSHOT_EXPORTED).unwrap();
    let dir = c.dir_str();
    let first = Command::new(bin_dir().join("remusctl"))
        .args(["migrate", "--dir", &dir, "--shard", &s1, "--to", &away])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let id = c
        .wait_paused_at(COPY_SNAPSHOT_EXPORTED, Duration::from_secs(120))
        .unwrap();
    let paused = snapshot(&c);
    assert_eq!(paused.migrations, vec![(id, "running".to_string())]);
    assert_eq!(paused.owners, before.owners);
    refused(
        "a shard that is being migrated",
        &c.ctl(&["migrate", "--shard", &s1, "--to", &o2]),
        1,
        &format!("migration refused: shard {s1} is already being migrated by migration {id}"),
    );
    refused(
        "a shard that is being migrated (SQLSTATE)",
        &c.ctl(&["migrate", "--shard", &s1, "--to", &o2]),
        1,
        "(SQLSTATE 55006)",
    );
    assert_eq!(
        snapshot(&c),
        paused,
        "the refused migration changed the cluster"
    );
    c.release_failpoint(COPY_SNAPSHOT_EXPORTED).unwrap();
    let out = first.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the paused migration completes: {}{}",
        stdout(&out),
        stderr(&out)
    );
    let after = snapshot(&c);
    assert_eq!(after.migrations, vec![(id, "succeeded".to_string())]);
    let moved = after
        .owners
        .iter()
        .find(|(s, _)| s.to_string() == s1)
        .map(|(_, o)| o.clone());
    assert_eq!(moved.as_deref(), Some(away.as_str()));
}
