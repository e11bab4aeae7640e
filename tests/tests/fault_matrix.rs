//! Fault matrix (issue 15, requirement 5): kill -9 of each process of the cluster (coordinator,
//! replay worker, source PostgreSQL, target PostgreSQL, etcd) at each step of a Remus migration
//! (copy, catch-up, barrier, dual execution, Tm prepared, Tm decided, cleanup), under TPC-B load
//! on every node, driven by the coordinator's pause failpoints (`coordinator::failpoint`).
//!
//! One cell: a 3-node cluster with TPC-B (scale 1) distributed, pgbench on every node in short
//! bursts (so that load goes on across a crash, the way clients reconnect), and a client on a
//! shard of the uninvolved node n2 (a table of its own, through n2). A Remus migration of one of
//! n3's accounts shards to n1 is started through n2 and stops at the cell's failpoint; the cell's
//! process is killed with SIGKILL, the failpoint released, and the process started again the way
//! an operator would (`pg_ctl start`, `remusctl cluster start-coordinator`, the replay worker or
//! etcd on their ports and data). Then, after a bounded wait:
//!
//! - the migration ended succeeded or rolled_back, and every node has the shard where that
//!   outcome puts it (the target, or the source); the other copy is gone;
//! - every account, teller and branch balance equals its history deltas, row by row, and the
//!   history has one row per transaction pgbench reported committed, plus at most one per
//!   client that died with its transaction's outcome unknown (its node crashed under it);
//! - nothing is left behind on any node: replication slot, origin, publication, prepared
//!   transaction, or entry of the migration machinery in shared memory
//!   (`remus.handover_state()`);
//! - the client on n2's shard never saw an error, and its counter equals its commits.
//!
//! `cargo test` runs a subset of cells ([`ci_subset`]) that keeps the suite within its budget;
//! `REMUS_FAULT_MATRIX=full` with `--ignored` runs all 35 cells in [`full_matrix`] (`#[ignore]`d;
//! the variable makes the subset skip itself under `--include-ignored`), prints
//! the outcome table and fails if any cell did not end succeeded or rolled back consistently.
//! The measured table is in bench/README.md.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use coordinator::failpoint::{
    BARRIER_SET, CATCHUP_RUNNING, CLEANUP_STARTED, COPY_SNAPSHOT_EXPORTED, DUAL_STARTED,
    HANDOVER_DECIDED, HANDOVER_TM_PREPARED,
};
use integration::pgbench::{finish, init_tpcb};
use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;

/// The process a cell kills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Victim {
    Coordinator,
    ReplayWorker,
    Source,
    Target,
    Etcd,
}

const VICTIMS: [Victim; 5] = [
    Victim::Coordinator,
    Victim::ReplayWorker,
    Victim::Source,
    Victim::Target,
    Victim::Etcd,
];

/// The steps of a Remus migration, as the failpoints that stop it there.
const STEPS: [&str; 7] = [
    COPY_SNAPSHOT_EXPORTED,
    CATCHUP_RUNNING,
    BARRIER_SET,
    DUAL_STARTED,
    HANDOVER_TM_PREPARED,
    HANDOVER_DECIDED,
    CLEANUP_STARTED,
];

/// The migration moves one of the source's accounts shards to the target; n2 is neither, and
/// carries the migration call and the client on an uninvolved shard.
const SOURCE: &str = "n3";
const TARGET: &str = "n1";
const BYSTANDER: &str = "n2";

/// Bounds of the waits of one cell.
const REACH_LIMIT: Duration = Duration::from_secs(120);
const END_LIMIT: Duration = Duration::from_secs(180);
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

/// How a cell ended.
#[derive(Debug)]
enum Outcome {
    /// The migration ended with this status (succeeded or rolled_back) and every check held.
    Ended(String),
    /// The migration did not end within [`END_LIMIT`] after the restart.
    Hung(String),
    /// It ended, but a check failed (or it ended `failed`).
    Inconsistent(String),
}

impl Outcome {
    fn passed(&self) -> bool {
        matches!(self, Outcome::Ended(_))
    }

    fn cell_text(&self) -> String {
        match self {
            Outcome::Ended(s) => s.clone(),
            Outcome::Hung(_) => "hung".into(),
            Outcome::Inconsistent(_) => "inconsistent".into(),
        }
    }

    /// The outcome with what was found.
    fn detail(&self) -> String {
        match self {
            Outcome::Ended(s) => s.clone(),
            Outcome::Hung(d) => format!("hung: {d}"),
            Outcome::Inconsistent(d) => format!("inconsistent: {d}"),
        }
    }
}

/// pgbench TPC-B on one node in bursts of a few seconds until stopped: a crashed node makes a
/// burst end (its clients abort) and the next one reconnects once the node is back.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<(u64, u64)>>,
}

const BURST: &str = "3";

fn start_load(c: &TestCluster) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let state = c.state().unwrap();
    let threads = c
        .node_names()
        .into_iter()
        .map(|node| {
            let stop = stop.clone();
            let n = state.node(&node).unwrap().clone();
            let pgpass = state.pgpass.clone();
            thread::spawn(move || {
                let (mut committed, mut unknown) = (0u64, 0u64);
                while !stop.load(Ordering::Acquire) {
                    // As `TestCluster::pgbench`, which cannot cross threads.
                    let child = std::process::Command::new("pgbench")
                        .args(["-n", "-c", "2", "-j", "1", "-T", BURST, "--max-tries=1"])
                        .env("PGHOST", &n.host)
                        .env("PGPORT", n.port.to_string())
                        .env("PGUSER", "postgres")
                        .env("PGDATABASE", "postgres")
                        .env("PGPASSFILE", &pgpass)
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .unwrap();
                    let r = finish(child);
                    committed += r.processed;
                    // A client that died (its node crashed) may have had a COMMIT in flight
                    // whose outcome it never heard.
                    unknown += r.aborted_clients as u64;
                    if r.processed == 0 {
                        thread::sleep(Duration::from_millis(200));
                    }
                }
                (committed, unknown)
            })
        })
        .collect();
    Load { stop, threads }
}

impl Load {
    /// (transactions reported committed, transactions whose outcome their client never heard).
    fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Release);
        self.threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    }
}

/// A client on a shard of the bystander node, through that node: single-row increments of its
/// own table, none of which may fail whatever happens to the migration.
struct Bystander {
    stop: Arc<AtomicBool>,
    commits: Arc<AtomicU64>,
    thread: thread::JoinHandle<Vec<String>>,
}

fn start_bystander(c: &TestCluster) -> Bystander {
    let mut db = c.connect(BYSTANDER).unwrap();
    db.batch_execute(
        "CREATE TABLE bystander (k int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);
         INSERT INTO bystander SELECT i FROM generate_series(1, 300) i;
         SELECT remus_create_distributed_table('bystander', 'k', shard_count => 3);",
    )
    .unwrap();
    let (sid, _) = owners(c, "bystander")
        .into_iter()
        .find(|(_, o)| o == BYSTANDER)
        .expect("the bystander node owns a shard of the bystander table");
    let keys: Vec<i32> = db
        .query(&format!("SELECT k FROM remus_shards.bystander_{sid}"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!keys.is_empty());
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let (s, n) = (stop.clone(), commits.clone());
    let thread = thread::spawn(move || {
        let mut errors = Vec::new();
        let mut i = 0usize;
        while !s.load(Ordering::Acquire) {
            let k = keys[i % keys.len()];
            i += 1;
            match db.execute("UPDATE bystander SET v = v + 1 WHERE k = $1", &[&k]) {
                Ok(1) => {
                    n.fetch_add(1, Ordering::AcqRel);
                }
                Ok(rows) => errors.push(format!("key {k}: {rows} rows updated")),
                Err(e) => errors.push(format!("key {k}: {e:?}")),
            }
            thread::sleep(Duration::from_millis(5));
        }
        errors
    });
    Bystander {
        stop,
        commits,
        thread,
    }
}

impl Bystander {
    /// The bystander's errors (none expected) and its commits.
    fn finish(self) -> (Vec<String>, u64) {
        self.stop.store(true, Ordering::Release);
        let errors = self.thread.join().unwrap();
        (errors, self.commits.load(Ordering::Acquire))
    }
}

fn kill(c: &TestCluster, victim: Victim) {
    let r = match victim {
        Victim::Coordinator => c.kill_coordinator(),
        Victim::ReplayWorker => c.kill_replay_worker(),
        Victim::Source => c.kill_node(SOURCE),
        Victim::Target => c.kill_node(TARGET),
        Victim::Etcd => c.kill_etcd(),
    };
    r.unwrap_or_else(|e| panic!("killing {victim:?}: {e:#}"))
}

fn restart(c: &TestCluster, victim: Victim) {
    let r = match victim {
        Victim::Coordinator => c.start_coordinator_again(),
        Victim::ReplayWorker => c.start_replay_worker_again(),
        Victim::Source => c.start_node(SOURCE),
        Victim::Target => c.start_node(TARGET),
        Victim::Etcd => c.start_etcd_again(),
    };
    r.unwrap_or_else(|e| panic!("starting {victim:?} again: {e:#}"))
}

/// The status of migration `id` once it is not running, or None after [`END_LIMIT`]. Read
/// through the bystander node; errors while the coordinator or etcd come back are retried.
fn wait_ended(c: &TestCluster, id: i64) -> Option<(String, Option<String>)> {
    let started = Instant::now();
    while started.elapsed() < END_LIMIT {
        let row = c.connect(BYSTANDER).ok().and_then(|mut db| {
            db.query_one(
                "SELECT status, error FROM remus_migrations WHERE migration_id = $1",
                &[&id],
            )
            .ok()
        });
        if let Some(row) = row {
            let status: String = row.get(0);
            if status != "running" {
                return Some((status, row.get(1)));
            }
        }
        thread::sleep(Duration::from_millis(200));
    }
    None
}

/// Rows of `table` whose balance differs from the sum of its history deltas (or history keys
/// with no row).
fn off_their_history(db: &mut postgres::Client, table: &str, key: &str, balance: &str) -> i64 {
    db.query_one(
        &format!(
            "SELECT count(*) FROM (SELECT {key}, {balance} AS b FROM {table}) t
               FULL JOIN (SELECT {key}, sum(delta) AS d FROM pgbench_history GROUP BY {key}) h
               USING ({key})
              WHERE coalesce(t.b, 0) <> coalesce(h.d, 0) OR t.{key} IS NULL"
        ),
        &[],
    )
    .unwrap()
    .get(0)
}

/// What is left on the nodes: the harness's list (slots, publications, origins, prepared
/// transactions) plus the shared-memory entries of the migration machinery.
fn leftovers(c: &TestCluster) -> Vec<String> {
    let mut left = c.migration_artifacts();
    for n in c.node_names() {
        left.extend(c.handover_state(&n));
    }
    left
}

/// One cell of the matrix: kill `victim` while a Remus migration is paused at `step`.
fn cell(victim: Victim, step: &str) -> Outcome {
    let c = TestCluster::start(3).expect("cluster up");
    let outcome =
        catch_unwind(AssertUnwindSafe(|| run_cell(&c, victim, step))).unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Outcome::Inconsistent(format!("panicked: {msg}"))
        });
    if !outcome.passed() {
        eprintln!(
            "cell {victim:?} at {step}: {}\n{}",
            outcome.detail(),
            c.daemon_logs(40)
        );
    }
    outcome
}

fn run_cell(c: &TestCluster, victim: Victim, step: &str) -> Outcome {
    init_tpcb(c, 1);
    let bystander = start_bystander(c);
    let (shard, _) = owners(c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == SOURCE)
        .expect("the source owns an accounts shard");
    let load = start_load(c);

    c.arm_pause(step).unwrap();
    let (done, result) = mpsc::channel();
    let mut caller = c.connect(BYSTANDER).unwrap();
    thread::spawn(move || {
        let r = caller
            .query_one(
                "SELECT status FROM remus_migrate_shard($1, $2)",
                &[&shard, &TARGET],
            )
            .map(|r| r.get::<_, String>(0))
            .map_err(|e| format!("{e:?}"));
        let _ = done.send(r);
    });
    let id = c.wait_paused_at(step, REACH_LIMIT).unwrap();
    kill(c, victim);
    c.release_failpoint(step).unwrap();
    // The migration goes on without the killed process for a moment, as it would while an
    // operator (or a supervisor) notices and starts it again.
    thread::sleep(Duration::from_secs(1));
    restart(c, victim);

    let ended = wait_ended(c, id);
    let call = result.recv_timeout(Duration::from_secs(5));
    println!("cell {victim:?} at {step}: migration {id} {ended:?}; the call returned {call:?}");
    let (committed, unknown) = load.finish();
    let (bystander_errors, bystander_commits) = bystander.finish();
    let Some((status, error)) = ended else {
        return Outcome::Hung(format!("migration {id} still running after {END_LIMIT:?}"));
    };
    let mut problems = Vec::new();
    let owner = match status.as_str() {
        "succeeded" => TARGET,
        "rolled_back" => SOURCE,
        other => {
            return Outcome::Inconsistent(format!("migration {id} ended {other}: {error:?}"));
        }
    };

    // In-doubt 2PC of pgbench transactions whose node crashed are resolved by the nodes'
    // recovery workers; leftovers of the migration must be gone once it ended.
    let started = Instant::now();
    let mut left = leftovers(c);
    while !left.is_empty() && started.elapsed() < SETTLE_LIMIT {
        thread::sleep(Duration::from_millis(500));
        left = leftovers(c);
    }
    if !left.is_empty() {
        problems.push(format!("left behind: {left:?}"));
    }

    for (n, on) in c.node_names().into_iter().zip(owners_everywhere(c, shard)) {
        if on != owner {
            problems.push(format!("{n} has shard {shard} on {on}, not {owner}"));
        }
    }
    let other = if owner == TARGET { SOURCE } else { TARGET };
    let stray: bool = c
        .connect(other)
        .unwrap()
        .query_one(
            &format!("SELECT to_regclass('remus_shards.pgbench_accounts_{shard}') IS NOT NULL"),
            &[],
        )
        .unwrap()
        .get(0);
    if stray {
        problems.push(format!("{other} still has a copy of shard {shard}"));
    }

    let mut db = c.connect(BYSTANDER).unwrap();
    for (table, key, balance) in [
        ("pgbench_accounts", "aid", "abalance"),
        ("pgbench_tellers", "tid", "tbalance"),
        ("pgbench_branches", "bid", "bbalance"),
    ] {
        let off = off_their_history(&mut db, table, key, balance);
        if off != 0 {
            problems.push(format!("{off} rows of {table} differ from their history"));
        }
    }
    let history = db
        .query_one("SELECT count(*) FROM pgbench_history", &[])
        .unwrap()
        .get::<_, i64>(0) as u64;
    println!("  pgbench: {committed} committed, {unknown} outcomes unknown; history {history}");
    if history < committed || history > committed + unknown {
        problems.push(format!(
            "history has {history} rows for {committed} committed transactions and {unknown} of unknown outcome"
        ));
    }
    if committed == 0 {
        problems.push("pgbench committed nothing".into());
    }

    if !bystander_errors.is_empty() {
        problems.push(format!(
            "the client on {BYSTANDER}'s shard saw errors: {bystander_errors:?}"
        ));
    }
    let sum: i64 = db
        .query_one("SELECT sum(v)::bigint FROM bystander", &[])
        .unwrap()
        .get(0);
    if sum as u64 != bystander_commits || bystander_commits == 0 {
        problems.push(format!(
            "the bystander table sums to {sum} after {bystander_commits} commits"
        ));
    }

    if problems.is_empty() {
        Outcome::Ended(status)
    } else {
        Outcome::Inconsistent(format!("{status}: {}", problems.join("; ")))
    }
}

fn full_requested() -> bool {
    std::env::var("REMUS_FAULT_MATRIX").as_deref() == Ok("full")
}

fn assert_cell(victim: Victim, step: &str) {
    if full_requested() {
        println!("REMUS_FAULT_MATRIX=full: this cell runs in full_matrix");
        return;
    }
    let outcome = cell(victim, step);
    assert!(
        outcome.passed(),
        "{victim:?} at {step}: {}",
        outcome.detail()
    );
}

/// The cells `cargo test` runs (each well under a minute); all of them pass.
#[test]
fn ci_subset_coordinator_killed_in_dual_execution() {
    assert_cell(Victim::Coordinator, DUAL_STARTED);
}

#[test]
fn ci_subset_replay_worker_killed_in_catchup() {
    assert_cell(Victim::ReplayWorker, CATCHUP_RUNNING);
}

#[test]
fn ci_subset_source_killed_after_the_decision() {
    assert_cell(Victim::Source, HANDOVER_DECIDED);
}

#[test]
fn ci_subset_target_killed_with_tm_prepared() {
    assert_cell(Victim::Target, HANDOVER_TM_PREPARED);
}

/// All 35 cells, with `REMUS_FAULT_MATRIX=full`: prints the outcome table (markdown, also
/// written to `$REMUS_FAULT_MATRIX_OUT` when set) and fails if any cell did not pass.
#[test]
#[ignore = "35 cells, about 12 minutes: REMUS_FAULT_MATRIX=full cargo test --release -p integration --test fault_matrix -- --ignored --test-threads=1"]
fn full_matrix() {
    let only: Option<String> = std::env::var("REMUS_FAULT_MATRIX_ONLY").ok();
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for victim in VICTIMS {
        let mut row = vec![format!("{victim:?}")];
        for step in STEPS {
            let name = format!("{victim:?}@{step}");
            if only.as_deref().is_some_and(|o| !name.contains(o)) {
                row.push("-".into());
                continue;
            }
            let started = Instant::now();
            let outcome = cell(victim, step);
            println!(
                "MATRIX {name}: {} in {:?}: {}",
                outcome.cell_text(),
                started.elapsed(),
                outcome.detail()
            );
            row.push(outcome.cell_text());
            if !outcome.passed() {
                failed.push(format!("{name}: {}", outcome.detail()));
            }
        }
        rows.push(row);
    }
    let mut table = format!(
        "| process | {} |\n|---|{}\n",
        STEPS.join(" | "),
        "---|".repeat(STEPS.len())
    );
    for row in rows {
        table.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    println!("{table}");
    if let Ok(path) = std::env::var("REMUS_FAULT_MATRIX_OUT") {
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(table.as_bytes()).unwrap();
        f.write_all(failed.join("\n").as_bytes()).unwrap();
    }
    assert!(
        failed.is_empty(),
        "cells that did not pass:\n{}",
        failed.join("\n")
    );
}
