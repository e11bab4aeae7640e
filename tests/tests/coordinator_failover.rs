//! Coordinator failover (issue 15 requirement 6, decision 0010): two coordinators against one
//! etcd, the leader elected by lease; the nodes' `remus.coordinator_address` lists both.
//!
//! Under pgbench TPC-B on every node (clients retry serialization failures only), one cluster
//! goes through two failovers with no operator step:
//! - the leader is killed (SIGKILL) while a Remus migration is in dual execution, before Tm: the
//!   standby wins the election once the dead leader's lease ends, rolls the migration back and
//!   serves; the killed coordinator, started again, waits as the standby;
//! - the new leader is killed right after the Tm decision: the other coordinator takes over and
//!   completes the migration;
//! - after each failover a new `remus_migrate_shard` through a node succeeds (the nodes reach
//!   whichever coordinator leads).
//!
//! Afterwards no client transaction failed, every balance equals its history deltas row by
//! row, and nothing of the migrations is left behind.

use std::process::{Child, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use coordinator::failpoint::{DUAL_STARTED, HANDOVER_DECIDED};
use integration::consistency::assert_tpcb_consistent;
use integration::pgbench::{finish, init_tpcb, prepared_everywhere};
use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;
use remus_test_support::{sqlstate, wait_for};

/// How long the load runs: past the three migrations and both takeovers.
const LOAD_SECONDS: u32 = 150;

/// Bound of every wait for a takeover or a migration's end (a takeover itself takes the
/// lease's TTL, 5 s by default, plus the resume; the time taken is printed).
const LIMIT: Duration = Duration::from_secs(120);

/// TPC-B against `node` until [`LOAD_SECONDS`], retrying serialization failures (40001, what a
/// source commit gets while no stream validates it) and nothing else. A statement that meets a
/// Tm prepared but not yet decided on its node waits for the decision
/// (`remus.in_doubt_wait_timeout`); the decision comes from the next leader, so the wait is set
/// above a takeover's length.
fn start_load(c: &TestCluster, node: &str) -> Child {
    c.pgbench(
        node,
        &[
            "-n",
            "-c",
            "3",
            "-j",
            "1",
            "-T",
            &LOAD_SECONDS.to_string(),
            "--max-tries=1000",
            "--verbose-errors",
        ],
    )
    .env("PGOPTIONS", "-c remus.in_doubt_wait_timeout=120000")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

/// `remus_migrate_shard(shard, target)` through `via`; refused with 57P03 while a new leader
/// still resumes its predecessor's migrations, so tried again then. (status, aborted).
fn migrate(
    c: &TestCluster,
    via: &str,
    shard: i64,
    target: &str,
) -> Result<(String, i64), postgres::Error> {
    let mut db = c.connect(via).unwrap();
    let started = Instant::now();
    loop {
        match db.query_one(
            "SELECT status, aborted_by_migration FROM remus_migrate_shard($1, $2)",
            &[&shard, &target],
        ) {
            Ok(r) => return Ok((r.get(0), r.get(1))),
            Err(e) if sqlstate(&e) == "57P03" && started.elapsed() < LIMIT => {
                thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e),
        }
    }
}

fn migrate_in_thread(
    c: &TestCluster,
    via: &str,
    shard: i64,
    target: &str,
) -> thread::JoinHandle<Result<(String, i64), postgres::Error>> {
    let mut db = c.connect(via).unwrap();
    let target = target.to_string();
    thread::spawn(move || {
        db.query_one(
            "SELECT status, aborted_by_migration FROM remus_migrate_shard($1, $2)",
            &[&shard, &target],
        )
        .map(|r| (r.get(0), r.get(1)))
    })
}

/// Waits until migration `id` has ended, read through node `via` (which reaches whichever
/// coordinator leads; while none does, the read fails with 08006 and is tried again).
fn wait_ended(c: &TestCluster, via: &str, id: i64) -> (String, Option<String>) {
    let mut db = c.connect(via).unwrap();
    wait_for(
        LIMIT,
        Duration::from_millis(100),
        || match db.query_one(
            "SELECT status, error FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        ) {
            Ok(row) => {
                let status: String = row.get(0);
                (status != "running").then(|| (status, row.get(1)))
            }
            Err(e) => {
                assert_eq!(sqlstate(&e), "08006", "reading migration {id}: {e:?}");
                None
            }
        },
        || {
            format!(
                "migration {id} did not end within {LIMIT:?} after its coordinator died\n{}",
                c.daemon_logs(40)
            )
        },
    )
}

/// Pauses the next migration of `shard` to `target` at failpoint `at`, kills the leading
/// coordinator there and waits until the other one has ended the migration. Returns the
/// migration's status, and the port of the coordinator that was killed.
fn kill_leader_at(c: &TestCluster, at: &str, shard: i64, target: &str) -> (String, u16) {
    c.arm_pause(at).unwrap();
    let mover = migrate_in_thread(c, "n3", shard, target);
    let id = c.wait_paused_at(at, LIMIT).unwrap();
    // Some load runs in the paused phase first.
    thread::sleep(Duration::from_secs(2));
    let killed = c.kill_leading_coordinator().unwrap();
    let killed_at = Instant::now();
    // Disarmed, or the next migration of the shard would stop there too.
    c.release_failpoint(at).unwrap();
    assert!(
        mover.join().unwrap().is_err(),
        "the migration call must fail with its coordinator"
    );
    let (status, error) = wait_ended(c, "n1", id);
    println!(
        "migration {id} paused at {at}, coordinator on port {killed} killed: {status} after {:?} ({error:?})",
        killed_at.elapsed()
    );
    (status, killed)
}

#[test]
fn the_standby_coordinator_takes_over_a_migration_when_the_leader_is_killed() {
    let c = TestCluster::start_with_standby(3).expect("cluster up");
    let state = c.state().unwrap();
    let first = state.coordinator.port;
    let standby = state
        .standby_coordinator
        .expect("a standby coordinator")
        .port;
    assert_eq!(c.leading_coordinator_port().unwrap(), Some(first));
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap();
    let loads: Vec<Child> = c.node_names().iter().map(|n| start_load(&c, n)).collect();
    thread::sleep(Duration::from_secs(2));

    // 1. The leader dies in dual execution, before Tm: the standby rolls the migration back.
    let (status, killed) = kill_leader_at(&c, DUAL_STARTED, shard, "n2");
    assert_eq!(killed, first);
    assert_eq!(status, "rolled_back", "{}", c.daemon_logs(40));
    assert_eq!(c.leading_coordinator_port().unwrap(), Some(standby));
    assert_eq!(owners_everywhere(&c, shard), vec![source.clone(); 3]);
    // The killed coordinator comes back as the standby.
    c.start_coordinator_again().unwrap();
    assert_eq!(c.leading_coordinator_port().unwrap(), Some(standby));

    // 2. The new leader dies right after the Tm decision: the other one completes the move.
    let (status, killed) = kill_leader_at(&c, HANDOVER_DECIDED, shard, "n2");
    assert_eq!(killed, standby);
    assert_eq!(status, "succeeded", "{}", c.daemon_logs(40));
    assert_eq!(c.leading_coordinator_port().unwrap(), Some(first));
    assert_eq!(owners_everywhere(&c, shard), vec!["n2".to_string(); 3]);

    // 3. A node reaches the new leader: the shard moves back, through n2.
    let (status, aborted) = migrate(&c, "n2", shard, &source).expect("moving the shard back");
    assert_eq!(status, "succeeded");
    assert_eq!(owners_everywhere(&c, shard), vec![source.clone(); 3]);

    let results: Vec<_> = loads.into_iter().map(finish).collect();
    let processed: u64 = results.iter().map(|r| r.processed).sum();
    let failed: u64 = results.iter().map(|r| r.failed).sum();
    println!("pgbench: {processed} committed, {failed} failed, aborted_by_migration {aborted}");
    for r in &results {
        assert_eq!(r.aborted_clients, 0, "a pgbench client died: {}", r.output);
        assert!(r.processed > 0, "{}", r.output);
    }
    let outputs: Vec<_> = results.iter().map(|r| &r.output).collect();
    assert_eq!(failed, 0, "{outputs:?}");
    assert_tpcb_consistent(&c, "n3", processed, "after two coordinator failovers");
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
    assert_eq!(prepared_everywhere(&c), 0);
}
