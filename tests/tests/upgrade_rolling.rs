//! A rolling upgrade from the previous release under load (issue 18 item 5, decision 0020).
//! Opt-in (`#[ignore]`): it needs the previous release built and installed, which
//! `scripts/upgrade-test.sh` does (it builds the previous tag in a worktree, installs it, runs
//! this test, and puts the working tree's build back); see docs/testing.md.
//!
//! Environment (set by the script): `REMUS_BIN_DIR`, the previous release's binaries (the
//! cluster is started by its `remusctl`, with its coordinator and replay worker);
//! `REMUS_UPGRADE_FROM`, its version; `REMUS_UPGRADE_NEW_PKG`, the new build's `cargo pgrx
//! package` tree (plus the earlier releases' scripts); `REMUS_UPGRADE_NEW_BIN`, the new
//! binaries.
//!
//! - `a_previous_release_cluster_upgrades_node_by_node_under_load`: 3 nodes of the previous
//!   release; TPC-B tables (distributed), a distributed table and a reference table with
//!   known contents; pgbench rounds through every node that is up, throughout. The new library
//!   and SQL files are installed under the running servers by rename(2): each old postmaster
//!   keeps its mapped (now deleted) library and still serves new connections. Then node by
//!   node: stop it; the other two serve (reads and writes of the shards they own, reads of the
//!   reference table); start it (new library, old catalog: it answers, and pgbench runs
//!   through it for 3 s); `ALTER EXTENSION pg_remus UPDATE` there; its catalog equals a fresh CREATE EXTENSION's on the same node
//!   (`tests/upgrade/catalog.sql`). Then the coordinator and the replay worker are replaced by
//!   the new binaries. At the end: no prepared transaction left, every TPC-B balance equals its
//!   history deltas row by row, a history row for every transaction pgbench saw commit, the
//!   untouched tables as they were loaded, and a shard migration (Remus mode) succeeds under
//!   pgbench, with the balances still consistent.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use integration::consistency::rows_off_their_history;
use integration::pgbench::{finish, init_tpcb, prepared_everywhere, start_tpcb};
use integration::shards::owners_everywhere;
use postgres::{Client, NoTls};
use remus_test_support::cluster::{bin_dir, stderr, stdout, TestCluster};
use remus_test_support::wait_until;

const CATALOG_SQL: &str = include_str!("../upgrade/catalog.sql");
const NEW_VERSION: &str = env!("CARGO_PKG_VERSION");

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run scripts/upgrade-test.sh"))
}

/// Installs every file of package tree `pkg` (`usr/...`) at its place under `/`, each written
/// to a temporary file in the destination's directory and renamed over the old one: a running
/// postmaster keeps the library it mapped (the old inode), as `install(1)` would leave it.
fn install_package(pkg: &Path) {
    fn walk(root: &Path, dir: &Path, files: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, files);
            } else {
                files.push(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut files = Vec::new();
    walk(pkg, pkg, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("pg_remus.so")),
        "no pg_remus.so in {}",
        pkg.display()
    );
    for rel in files {
        let dest = Path::new("/").join(&rel);
        let tmp = dest.with_file_name(format!(
            ".{}.upgrade-{}",
            dest.file_name().unwrap().to_string_lossy(),
            std::process::id()
        ));
        fs::copy(pkg.join(&rel), &tmp).unwrap_or_else(|e| panic!("copy to {}: {e}", tmp.display()));
        let mode = if rel.extension().is_some_and(|e| e == "so") {
            0o755
        } else {
            0o644
        };
        fs::set_permissions(&tmp, fs::Permissions::from_mode(mode)).unwrap();
        fs::rename(&tmp, &dest).unwrap_or_else(|e| panic!("rename to {}: {e}", dest.display()));
        println!("installed {}", dest.display());
    }
}

/// The pg_remus library lines of process `pid`'s memory map.
fn mapped_library(pid: u32) -> Vec<String> {
    fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("pg_remus.so"))
        .map(|l| l.split_whitespace().skip(5).collect::<Vec<_>>().join(" "))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect()
}

fn postmaster_pid(c: &TestCluster, node: &str) -> u32 {
    c.state()
        .unwrap()
        .node(node)
        .unwrap()
        .postmaster_pid()
        .unwrap_or_else(|| panic!("{node} is not running"))
}

fn connect_db(c: &TestCluster, node: &str, db: &str) -> Client {
    let state = c.state().unwrap();
    let conninfo = state
        .node(node)
        .unwrap()
        .conninfo(&state.password().unwrap())
        .replace("dbname=postgres", &format!("dbname={db}"));
    Client::connect(&conninfo, NoTls).unwrap_or_else(|e| panic!("connect to {node}/{db}: {e}"))
}

fn extversion(db: &mut Client) -> String {
    db.query_one(
        "SELECT extversion FROM pg_extension WHERE extname = 'pg_remus'",
        &[],
    )
    .unwrap()
    .get(0)
}

fn catalog(db: &mut Client) -> Vec<String> {
    db.query(CATALOG_SQL, &[])
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect()
}

/// Node `node`'s catalog against a fresh CREATE EXTENSION in a scratch database of the same
/// server: the lines only one of them has (`-` updated, `+` fresh).
fn catalog_difference(c: &TestCluster, node: &str) -> Vec<String> {
    let updated = catalog(&mut c.connect(node).unwrap());
    let mut admin = c.connect(node).unwrap();
    // Two statements: CREATE / DROP DATABASE cannot run in a transaction block.
    admin
        .batch_execute("DROP DATABASE IF EXISTS remus_upgrade_fresh")
        .unwrap();
    admin
        .batch_execute("CREATE DATABASE remus_upgrade_fresh")
        .unwrap();
    let fresh = {
        let mut db = connect_db(c, node, "remus_upgrade_fresh");
        db.batch_execute("CREATE EXTENSION pg_remus").unwrap();
        catalog(&mut db)
    };
    admin
        .batch_execute("DROP DATABASE remus_upgrade_fresh WITH (FORCE)")
        .unwrap();
    let mut count: BTreeMap<String, i64> = BTreeMap::new();
    for l in updated {
        *count.entry(l).or_default() += 1;
    }
    for l in fresh {
        *count.entry(l).or_default() -= 1;
    }
    count
        .into_iter()
        .filter(|(_, n)| *n != 0)
        .map(|(l, n)| format!("{} {l}", if n > 0 { '-' } else { '+' }))
        .collect()
}

/// Accounts whose, tellers' and branches' balance differs from the sum of their history
/// deltas (0 each when nothing committed was lost or doubled), and the history's row count.
fn tpcb_state(db: &mut Client) -> (Vec<(String, i64)>, i64) {
    let off = [
        ("pgbench_accounts", "aid", "abalance"),
        ("pgbench_tellers", "tid", "tbalance"),
        ("pgbench_branches", "bid", "bbalance"),
    ]
    .into_iter()
    .map(|(table, key, balance)| {
        (
            table.to_string(),
            rows_off_their_history(db, table, key, balance),
        )
    })
    .collect();
    let history = db
        .query_one("SELECT count(*) FROM pgbench_history", &[])
        .unwrap()
        .get(0);
    (off, history)
}

/// An account id whose shard node `owner` holds.
fn account_on(db: &mut Client, owner: &str) -> i32 {
    db.query_one(
        "SELECT aid FROM generate_series(1, 100000) aid
          WHERE (SELECT node_name FROM remus.shard_map
                  WHERE shard_id = remus_shard_id_for('pgbench_accounts', aid)) = $1
          LIMIT 1",
        &[&owner],
    )
    .unwrap()
    .get(0)
}

/// Sets the flag when dropped, also while a panic unwinds.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Workload {
    committed: u64,
    failed_or_aborted_runs: u64,
    rounds: u64,
}

#[test]
#[ignore = "opt-in: scripts/upgrade-test.sh builds and installs the previous release first"]
fn a_previous_release_cluster_upgrades_node_by_node_under_load() {
    let from = env("REMUS_UPGRADE_FROM");
    let new_pkg = PathBuf::from(env("REMUS_UPGRADE_NEW_PKG"));
    let new_bin = PathBuf::from(env("REMUS_UPGRADE_NEW_BIN"));
    assert_ne!(from, NEW_VERSION, "upgrading to the version it runs");

    let c = TestCluster::start(3).expect("cluster up (previous release)");
    let nodes = c.node_names();
    for n in &nodes {
        assert_eq!(
            extversion(&mut c.connect(n).unwrap()),
            from,
            "{n} runs {from}"
        );
    }

    // Data: TPC-B (distributed, the workload's), a distributed and a reference table that
    // only the checks read.
    init_tpcb(&c, 4);
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE upg_kv (k bigint PRIMARY KEY, v bigint NOT NULL);
         INSERT INTO upg_kv SELECT g, g * 3 FROM generate_series(1, 5000) g;
         SELECT remus_create_distributed_table('upg_kv', 'k');
         CREATE TABLE upg_ref (id int PRIMARY KEY, name text NOT NULL);
         INSERT INTO upg_ref SELECT g, 'item ' || g FROM generate_series(1, 200) g;
         SELECT remus_create_reference_table('upg_ref');",
    )
    .unwrap();
    let kv_expected = (5000_i64, (1..=5000_i64).map(|g| g * 3).sum::<i64>());
    let kv = |db: &mut Client| -> (i64, i64) {
        let r = db
            .query_one("SELECT count(*), sum(v)::bigint FROM upg_kv", &[])
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(kv(&mut n1), kv_expected);
    let probe: BTreeMap<String, i32> = nodes
        .iter()
        .map(|n| (n.clone(), account_on(&mut n1, n)))
        .collect();
    drop(n1);

    // The workload: pgbench rounds (4 clients, 3 s) through every node that is up.
    let down: Mutex<HashSet<String>> = Mutex::new(HashSet::new());
    let stop = AtomicBool::new(false);
    let totals: Mutex<Workload> = Mutex::new(Workload::default());
    std::thread::scope(|s| {
        // A failing check stops the workload, or the scope would wait for it forever.
        let _stop_on_exit = StopOnDrop(&stop);
        for n in &nodes {
            let (c, down, stop, totals) = (&c, &down, &stop, &totals);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if down.lock().unwrap().contains(n) {
                        std::thread::sleep(Duration::from_millis(200));
                        continue;
                    }
                    let r = finish(start_tpcb(c, n, 4, 3));
                    let mut t = totals.lock().unwrap();
                    t.committed += r.processed;
                    t.rounds += 1;
                    if r.failed > 0 || r.aborted_clients > 0 {
                        t.failed_or_aborted_runs += 1;
                    }
                }
            });
        }

        std::thread::sleep(Duration::from_secs(5));

        // The new build, under the running servers.
        let old_pids: BTreeMap<String, u32> = nodes
            .iter()
            .map(|n| (n.clone(), postmaster_pid(&c, n)))
            .collect();
        install_package(&new_pkg);
        for (n, pid) in &old_pids {
            let maps = mapped_library(*pid);
            println!("{n} postmaster {pid} maps: {maps:?}");
            assert!(
                !maps.is_empty() && maps.iter().all(|m| m.ends_with("(deleted)")),
                "{n}'s postmaster should still map the replaced (deleted) library: {maps:?}"
            );
            // A new backend of the old postmaster: the old library, the old catalog, working.
            let mut db = c.connect(n).unwrap();
            assert_eq!(extversion(&mut db), from);
            let backend: i32 = db.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
            let bmaps = mapped_library(backend as u32);
            assert!(
                bmaps.iter().all(|m| m.ends_with("(deleted)")),
                "{n}: a new backend maps {bmaps:?}"
            );
            let branches: i64 = db
                .query_one("SELECT count(*) FROM pgbench_branches", &[])
                .unwrap()
                .get(0);
            assert_eq!(branches, 4);
        }

        for n in &nodes {
            println!("upgrading {n}");
            down.lock().unwrap().insert(n.clone());
            c.stop_node(n).unwrap();

            // The other nodes serve: their own shards (read and write), the reference table.
            let others: Vec<&String> = nodes.iter().filter(|o| *o != n).collect();
            for (i, via) in others.iter().enumerate() {
                let mut db = c.connect(via).unwrap();
                // A row an in-doubt transaction of the stopped node holds would wait for it.
                db.batch_execute("SET statement_timeout = '20s'").unwrap();
                let owner = others[(i + 1) % others.len()];
                let aid = probe[owner.as_str()];
                db.query_one(
                    "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
                    &[&aid],
                )
                .unwrap_or_else(|e| {
                    panic!("{via} reading account {aid} on {owner} while {n} is down: {e}")
                });
                // A zero-delta TPC-B step by hand: the balances stay equal to the history.
                let mut tx = db.transaction().unwrap();
                tx.execute(
                    "UPDATE pgbench_accounts SET abalance = abalance + 0 WHERE aid = $1",
                    &[&aid],
                )
                .unwrap_or_else(|e| {
                    panic!("{via} writing account {aid} on {owner} while {n} is down: {e}")
                });
                tx.commit().unwrap();
                let refs: i64 = db
                    .query_one("SELECT count(*) FROM upg_ref", &[])
                    .unwrap()
                    .get(0);
                assert_eq!(
                    refs, 200,
                    "{via} reads the reference table while {n} is down"
                );
            }

            c.start_node(n).unwrap();
            let pid = postmaster_pid(&c, n);
            let maps = mapped_library(pid);
            assert!(
                !maps.is_empty() && maps.iter().all(|m| !m.ends_with("(deleted)")),
                "{n} restarted on the new library: {maps:?}"
            );
            // The workload goes through it again: the new library on the old catalog.
            down.lock().unwrap().remove(n);
            std::thread::sleep(Duration::from_secs(3));
            let mut db = c.connect(n).unwrap();
            // The new library on the old catalog, before the update: it answers.
            assert_eq!(extversion(&mut db), from);
            let name: String = db
                .query_one("SELECT remus_local_node()", &[])
                .unwrap()
                .get(0);
            assert_eq!(&name, n);
            let refs: i64 = db
                .query_one("SELECT count(*) FROM upg_ref", &[])
                .unwrap()
                .get(0);
            assert_eq!(refs, 200);
            db.batch_execute("ALTER EXTENSION pg_remus UPDATE").unwrap();
            assert_eq!(
                extversion(&mut db),
                NEW_VERSION,
                "{n} after ALTER EXTENSION UPDATE"
            );
            let diff = catalog_difference(&c, n);
            assert!(
                diff.is_empty(),
                "{n}: the updated catalog differs from a fresh {NEW_VERSION} (- updated, + fresh):\n{}",
                diff.join("\n")
            );
            std::thread::sleep(Duration::from_secs(4));
        }

        // The daemons: the new coordinator and replay worker, once every node runs the new
        // release.
        c.kill_coordinator().unwrap();
        let out = std::process::Command::new(new_bin.join("remusctl"))
            .args(["cluster", "start-coordinator", "--dir", &c.dir_str()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "new coordinator: {}{}",
            stdout(&out),
            stderr(&out)
        );
        c.kill_replay_worker().unwrap();
        // start_replay_worker_again starts the replay worker of REMUS_BIN_DIR (the workload
        // threads read no environment variable).
        std::env::set_var("REMUS_BIN_DIR", &new_bin);
        assert_eq!(bin_dir(), new_bin);
        c.start_replay_worker_again().unwrap();

        std::thread::sleep(Duration::from_secs(4));
        stop.store(true, Ordering::Relaxed);
    });
    let t = totals.into_inner().unwrap();
    println!(
        "workload: {} pgbench rounds, {} transactions committed, {} rounds with failed or aborted clients",
        t.rounds, t.committed, t.failed_or_aborted_runs
    );
    assert!(t.committed > 0);

    wait_until(
        Duration::from_secs(90),
        Duration::from_millis(500),
        || prepared_everywhere(&c) == 0,
        || "prepared transactions left 90 s after the upgrade".into(),
    );
    for n in &nodes {
        let mut db = c.connect(n).unwrap();
        assert_eq!(extversion(&mut db), NEW_VERSION, "{n}");
        let (off, history) = tpcb_state(&mut db);
        assert!(
            off.iter().all(|(_, k)| *k == 0),
            "through {n}: balances off their history: {off:?}"
        );
        assert!(
            history as u64 >= t.committed,
            "through {n}: {history} history rows, but pgbench saw {} commits",
            t.committed
        );
        assert_eq!(kv(&mut db), kv_expected, "upg_kv through {n}");
        let refs: i64 = db
            .query_one("SELECT count(*) FROM upg_ref", &[])
            .unwrap()
            .get(0);
        assert_eq!(refs, 200, "upg_ref through {n}");
    }

    // A shard migration on the upgraded cluster (new coordinator, replay worker, nodes), under
    // pgbench.
    let mut n2 = c.connect("n2").unwrap();
    let shard: i64 = n2
        .query_one(
            "SELECT shard_id FROM remus.shard_map WHERE node_name = 'n1'
              AND shard_id IN (SELECT shard_id FROM remus.shards
                                WHERE logicalrelid = 'pgbench_accounts'::regclass)
              ORDER BY shard_id LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    let runs: Vec<_> = nodes.iter().map(|n| start_tpcb(&c, n, 4, 10)).collect();
    std::thread::sleep(Duration::from_secs(2));
    let status: String = n2
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n3')",
            &[&shard],
        )
        .unwrap()
        .get(0);
    let (mut committed_during, mut failed_during) = (0, 0);
    for r in runs.into_iter().map(finish) {
        committed_during += r.processed;
        failed_during += r.failed + r.aborted_clients as u64;
    }
    assert_eq!(status, "succeeded", "{}", c.daemon_logs(40));
    assert_eq!(owners_everywhere(&c, shard), vec!["n3"; 3]);
    assert_eq!(prepared_everywhere(&c), 0);
    let (off, history) = tpcb_state(&mut n2);
    assert!(
        off.iter().all(|(_, k)| *k == 0),
        "after the migration: {off:?}"
    );
    assert!(history as u64 >= t.committed + committed_during);
    assert_eq!(kv(&mut n2), kv_expected);
    println!(
        "migration of shard {shard} n1 -> n3: {status}; pgbench during it: {committed_during} \
         committed, {failed_during} failed or aborted"
    );
}
