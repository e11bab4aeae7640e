//! Recovery of a migration whose coordinator lost etcd or stopped at the worst moments, and
//! the bounds of the cleanup drain, on a real 3-node cluster (review findings F3, F9).
//!
//! - The Tm decision (the record's move to `cleanup`) is written to etcd but the driver is told
//!   the write failed, and the migration's end is not recorded either (failpoints
//!   `handover.decision_unacknowledged`, `handover.decision_unreadable`, `end.unrecorded`). A
//!   restarted coordinator finds the record in `cleanup`: it must decide by Tm's state on the
//!   nodes, never drop the source's copy of a shard whose Tm was rolled back, and end with the
//!   rows and the owner where they were (rolled back) or consistently moved (succeeded).

use std::thread;
use std::time::{Duration, Instant};

use coordinator::failpoint::{
    END_UNRECORDED, HANDOVER_DECISION_UNACKNOWLEDGED, HANDOVER_DECISION_UNREADABLE,
};
use integration::pgbench::init_tpcb;
use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;
use remus_test_support::{sqlstate, wait_for};

/// Arms failpoint `name` with `error` (see `coordinator::failpoint`).
fn arm_error(c: &TestCluster, name: &str) {
    let dir = c.state().unwrap().failpoint_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let _ = std::fs::remove_file(dir.join(format!("{name}.reached")));
    std::fs::write(dir.join(name), "error").unwrap();
}

type Call = thread::JoinHandle<Result<String, postgres::Error>>;

/// `remus_migrate_shard(shard, target)` through n3, in a thread.
fn start_migration(c: &TestCluster, shard: i64, target: &str) -> Call {
    let mut db = c.connect("n3").unwrap();
    let target = target.to_string();
    thread::spawn(move || {
        let r = db
            .query_one(
                "SELECT status FROM remus_migrate_shard($1, $2)",
                &[&shard, &target],
            )
            .map(|r| r.get(0));
        println!("migration call of shard {shard}: {r:?}");
        r
    })
}

/// The migration id in failpoint `name`'s reached marker, if it was reached.
fn reached(c: &TestCluster, name: &str) -> Option<i64> {
    let marker = c
        .state()
        .unwrap()
        .failpoint_dir()
        .join(format!("{name}.reached"));
    std::fs::read_to_string(marker).ok()?.trim().parse().ok()
}

/// Starts migrating `shard` to `target` and waits until a migration reached failpoint `name`;
/// retried while a restarted coordinator refuses new migrations (57P03) because it is still
/// resuming. Returns the migration id and the call.
fn migrate_until(c: &TestCluster, shard: i64, target: &str, name: &str) -> (i64, Call) {
    let started = Instant::now();
    loop {
        let call = start_migration(c, shard, target);
        let got = wait_for(
            Duration::from_secs(180),
            Duration::from_millis(50),
            || match reached(c, name) {
                Some(id) => Some(Some(id)),
                None => call.is_finished().then_some(None),
            },
            || format!("no migration reached {name}\n{}", c.daemon_logs(60)),
        );
        if let Some(id) = got {
            return (id, call);
        }
        let e = call
            .join()
            .unwrap()
            .expect_err("ended without reaching the failpoint");
        assert!(
            sqlstate(&e) == "57P03" && started.elapsed() < Duration::from_secs(120),
            "migrating shard {shard}: {e:?}"
        );
        thread::sleep(Duration::from_millis(200));
    }
}

/// Row count and sum of balances of the accounts shard table on `node` (None if it is not
/// there).
fn shard_content(c: &TestCluster, node: &str, shard: i64) -> Option<(i64, i64)> {
    let mut db = c.connect(node).unwrap();
    db.batch_execute("SET remus.migration_session = on")
        .unwrap();
    let table = format!("remus_shards.pgbench_accounts_{shard}");
    let exists: bool = db
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .unwrap()
        .get(0);
    exists.then(|| {
        let r = db
            .query_one(
                &format!("SELECT count(*), coalesce(sum(abalance), 0)::bigint FROM {table}"),
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    })
}

/// The status, phase and error of migration `id`; an error while the coordinator is not up.
fn try_migration_state(
    c: &TestCluster,
    id: i64,
) -> Result<(String, String, Option<String>), postgres::Error> {
    let r = c.connect("n1").unwrap().query_one(
        "SELECT status, phase, error FROM remus_migrations WHERE migration_id = $1",
        &[&id],
    )?;
    Ok((r.get(0), r.get(1), r.get(2)))
}

fn migration_state(c: &TestCluster, id: i64) -> (String, String, Option<String>) {
    try_migration_state(c, id).unwrap()
}

/// Waits until migration `id` has ended; its status and error.
fn wait_ended(c: &TestCluster, id: i64, limit: Duration) -> (String, Option<String>) {
    wait_for(
        limit,
        Duration::from_millis(100),
        || {
            // The coordinator may still be starting (08006).
            let (status, _, error) = try_migration_state(c, id).ok()?;
            (status != "running").then_some((status, error))
        },
        || {
            format!(
                "migration {id} did not end within {limit:?}\n{}",
                c.daemon_logs(60)
            )
        },
    )
}

/// The coordinator killed and started again, with every failpoint of `armed` disarmed between.
fn restart_coordinator(c: &TestCluster, armed: &[&str]) {
    c.kill_coordinator().unwrap();
    for name in armed {
        c.release_failpoint(name).unwrap();
    }
    c.start_coordinator_again().unwrap();
}

/// Adds `delta` to one account of `shard` through n3 (routed to its owner), retrying while
/// a restarted coordinator still refuses work or the router waits for a flip.
fn touch_account(c: &TestCluster, shard: i64, delta: i32) {
    let mut db = c.connect("n3").unwrap();
    let owner: String = owners_everywhere(c, shard).remove(0);
    let aid: i32 = {
        let mut o = c.connect(&owner).unwrap();
        o.query_one(
            &format!("SELECT min(aid) FROM remus_shards.pgbench_accounts_{shard}"),
            &[],
        )
        .unwrap()
        .get(0)
    };
    db.execute(
        "UPDATE pgbench_accounts SET abalance = abalance + $2 WHERE aid = $1",
        &[&aid, &delta],
    )
    .unwrap_or_else(|e| panic!("updating account {aid}: {e:?}"));
}

/// Review finding F3. Two ambiguous decisions, each followed by a lost end and a coordinator
/// restart:
///
/// 1. Decision written, its answer lost, and etcd unreadable afterwards: the driver cannot know
///    and rolls back (Tm rolled back everywhere, the target's copy dropped). The record still
///    says `cleanup`. The successor must see on the nodes that Tm was rolled back and roll the
///    migration back: the source keeps its rows and the shard. Before the fix it "completed"
///    and dropped the source's copy, the only one.
/// 2. Decision written, its answer lost, etcd readable again: the driver reads the record
///    back, sees `cleanup` and goes on; the successor completes consistently (succeeded, the
///    target owns the shard with every row). Before the fix the driver rolled back, and the
///    successor then dropped the source's copy too.
#[test]
fn an_ambiguous_tm_decision_never_drops_the_only_copy() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let mut on_n1: Vec<i64> = owners(&c, "pgbench_accounts")
        .into_iter()
        .filter(|(_, o)| o == "n1")
        .map(|(s, _)| s)
        .collect();
    let (first, second) = (on_n1.remove(0), on_n1.remove(0));

    // 1. Unknowable decision: rolled back now, rolled back again by the successor.
    touch_account(&c, first, 7);
    let before = shard_content(&c, "n1", first).expect("the source holds the shard");
    let armed = [
        HANDOVER_DECISION_UNACKNOWLEDGED,
        HANDOVER_DECISION_UNREADABLE,
        END_UNRECORDED,
    ];
    for name in armed {
        arm_error(&c, name);
    }
    let (id, call) = migrate_until(&c, first, "n2", END_UNRECORDED);
    let (status, phase, _) = migration_state(&c, id);
    assert_eq!(
        (status.as_str(), phase.as_str()),
        ("running", "cleanup"),
        "the scene: etcd says decided, the end was not recorded"
    );
    assert_eq!(
        shard_content(&c, "n2", first),
        None,
        "the driver rolled back"
    );
    restart_coordinator(&c, &armed);
    let _ = call.join().unwrap();
    let (status, error) = wait_ended(&c, id, Duration::from_secs(180));
    assert_eq!(status, "rolled_back", "{error:?}\n{}", c.daemon_logs(60));
    assert!(
        error
            .as_deref()
            .unwrap_or_default()
            .contains("Tm rolled back"),
        "{error:?}"
    );
    assert_eq!(owners_everywhere(&c, first), vec!["n1".to_string(); 3]);
    assert_eq!(
        shard_content(&c, "n1", first),
        Some(before),
        "the source's copy is intact"
    );
    assert_eq!(shard_content(&c, "n2", first), None);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );

    // 2. Decision read back: completed, by the driver and again by the successor.
    touch_account(&c, second, 11);
    let before = shard_content(&c, "n1", second).expect("the source holds the shard");
    let armed = [HANDOVER_DECISION_UNACKNOWLEDGED, END_UNRECORDED];
    for name in armed {
        arm_error(&c, name);
    }
    let (id, call) = migrate_until(&c, second, "n2", END_UNRECORDED);
    assert_eq!(migration_state(&c, id).0, "running");
    restart_coordinator(&c, &armed);
    let _ = call.join().unwrap();
    let (status, error) = wait_ended(&c, id, Duration::from_secs(180));
    assert_eq!(status, "succeeded", "{error:?}\n{}", c.daemon_logs(60));
    assert_eq!(owners_everywhere(&c, second), vec!["n2".to_string(); 3]);
    assert_eq!(
        shard_content(&c, "n2", second),
        Some(before),
        "every row is on the target"
    );
    assert_eq!(shard_content(&c, "n1", second), None);
    touch_account(&c, second, 1);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}
