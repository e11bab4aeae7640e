//! The operator's consolidation script, `scripts/drain-node.sh` (issue 20 item 4), under pgbench
//! TPC-B on n1 and n2: it drains n3 two co-location groups per migration; killed (with its
//! psql) while its first migration is paused in the copy, it is run again and finishes the
//! drain: it waits for the migration its first run left running instead of starting a
//! conflicting one. Afterwards n3 owns nothing, no migration runs, nothing is left on any node,
//! the balances equal the history row by row, and pgbench failed exactly the transactions the
//! migrations say they aborted (none, in mode remus). Bad input exits 2.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use coordinator::failpoint::COPY_SNAPSHOT_EXPORTED;
use integration::consistency::assert_tpcb_consistent;
use integration::pgbench::{finish, init_tpcb, start_tpcb, wait_committing};
use integration::shards::owners;
use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

/// `bash scripts/drain-node.sh <args>` with libpq pointed at `via`, in a process group of its
/// own (so that killing the group takes its psql too).
fn drain(c: &TestCluster, via: &str, args: &[&str]) -> Command {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/drain-node.sh");
    let mut cmd = c.libpq_command(via, "bash");
    cmd.arg(script)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    cmd
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_node_is_drained_by_the_script_run_again_after_an_interruption() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);

    // Bad input: exit 2, nothing started.
    for args in [
        &["nosuch"][..],
        &["n3", "--per-migration", "0"],
        &["n3", "--bogus"],
    ] {
        let out = drain(&c, "n1", args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    }

    // Long enough to cover the drain (pgbench prints its counts only when its time is up).
    let loads = [start_tpcb(&c, "n1", 2, 40), start_tpcb(&c, "n2", 2, 40)];
    wait_committing(&c, "n1", 100);
    let groups_on_n3 = owners(&c, "pgbench_accounts")
        .iter()
        .filter(|(_, o)| o == "n3")
        .count();
    assert!(groups_on_n3 >= 2, "n3 holds {groups_on_n3} account shards");

    // The first run, killed with its psql while its first migration is paused in the copy.
    c.arm_pause(COPY_SNAPSHOT_EXPORTED).unwrap();
    let mut first = drain(&c, "n1", &["n3", "--per-migration", "2"])
        .spawn()
        .unwrap();
    let paused = c
        .wait_paused_at(COPY_SNAPSHOT_EXPORTED, Duration::from_secs(120))
        .unwrap();
    let group = -(first.id() as i32);
    Command::new("kill")
        .args(["-KILL", "--", &group.to_string()])
        .status()
        .unwrap();
    let _ = first.wait();

    // Run again while the first run's migration is still paused: it waits for it (it says so)
    // instead of starting another, then finishes the drain.
    let log_path = std::path::Path::new(&c.dir_str()).join("drain-second-run.log");
    let mut second = drain(&c, "n2", &["n3", "--per-migration", "2"])
        .stdout(std::fs::File::create(&log_path).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || {
            std::fs::read_to_string(&log_path)
                .is_ok_and(|l| l.contains("waiting for running migration(s) from n3"))
        },
        || {
            format!(
                "the second run did not wait for migration {paused}: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            )
        },
    );
    c.release_failpoint(COPY_SNAPSHOT_EXPORTED).unwrap();
    let status = second.wait().unwrap();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(status.success(), "second run: {log}\n{}", c.daemon_logs(30));
    assert!(log.contains("drained: n3 owns no shard"), "{log}");

    let mut committed = 0;
    let mut failed = 0;
    for load in loads {
        let r = finish(load);
        committed += r.processed;
        failed += r.failed;
    }
    let mut db = c.connect("n1").unwrap();
    let on_n3: i64 = db
        .query_one(
            "SELECT count(*) FROM remus_shards WHERE node_name = 'n3'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(on_n3, 0, "{log}");
    let (running, aborted, succeeded_first): (i64, i64, bool) = {
        let r = db
            .query_one(
                "SELECT count(*) FILTER (WHERE status = 'running'),
                        coalesce(sum(aborted_by_migration), 0)::bigint,
                        bool_or(migration_id = $1 AND status IN ('succeeded', 'rolled_back'))
                   FROM remus_migrations",
                &[&paused],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(running, 0);
    assert!(
        succeeded_first,
        "the interrupted run's migration {paused} ended"
    );
    assert_eq!(
        failed as i64, aborted,
        "pgbench failures = aborted_by_migration"
    );
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || c.migration_artifacts().is_empty(),
        || format!("left behind: {:?}", c.migration_artifacts()),
    );
    assert_tpcb_consistent(&c, "n1", committed, "after the drain");
}
