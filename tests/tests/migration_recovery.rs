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
    CLEANUP_STARTED, DUAL_STARTED, END_UNRECORDED, HANDOVER_DECISION_UNACKNOWLEDGED,
    HANDOVER_DECISION_UNREADABLE,
};
use integration::pgbench::init_tpcb;
use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;
use remus_test_support::{sqlstate, wait_for, wait_until};

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

/// The running migration `id`'s `waiting_on`, if any.
fn waiting_on(c: &TestCluster, id: i64) -> Option<String> {
    c.connect("n1")
        .unwrap()
        .query_one(
            "SELECT waiting_on FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .ok()?
        .get(0)
}

/// The id of the latest migration of `shard`, once there is one (it may have ended).
fn running_migration_of(c: &TestCluster, shard: i64) -> i64 {
    let mut db = c.connect("n1").unwrap();
    wait_for(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            db.query_opt(
                "SELECT max(migration_id) FROM remus_migrations WHERE $1 = ANY(shard_ids)",
                &[&shard],
            )
            .unwrap()
            .and_then(|r| r.get(0))
        },
        || format!("no migration of shard {shard} started"),
    )
}

/// Waits for a migration call to return (its status), reporting what the migration waits for
/// if it does not.
fn call_result(c: &TestCluster, call: Call, id: i64) -> String {
    wait_until(
        Duration::from_secs(180),
        Duration::from_millis(50),
        || call.is_finished(),
        || {
            format!(
                "migration {id} still running, waiting on {:?}\n{}",
                waiting_on(c, id),
                c.daemon_logs(40)
            )
        },
    );
    call.join()
        .unwrap()
        .unwrap_or_else(|e| panic!("migration {id}: {e:?}"))
}

/// Sets `remus.cleanup_drain_timeout` on every node (None: back to its default).
fn set_drain_timeout(c: &TestCluster, value: Option<&str>) {
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        match value {
            Some(v) => db
                .batch_execute(&format!(
                    "ALTER SYSTEM SET remus.cleanup_drain_timeout = '{v}'"
                ))
                .unwrap(),
            None => db
                .batch_execute("ALTER SYSTEM RESET remus.cleanup_drain_timeout")
                .unwrap(),
        }
        db.batch_execute("SELECT pg_reload_conf()").unwrap();
    }
}

/// Review finding F9 and the two psql sessions. The cleanup drain waits only for what
/// can still use the old placement, and not forever:
///
/// 1. An idle READ COMMITTED `BEGIN; SELECT 1` in the cluster's database on the source and on
///    another node, open since before the migration, does not hold it (before: cleanup waited
///    for it forever); it is not terminated either.
/// 2. Two `remus_migrate_shard` calls from two sessions at once (a tellers and an accounts
///    shard of n3) both complete (before: each waited in cleanup for the other's calling
///    session, forever).
/// 3. A REPEATABLE READ transaction on the source that read the shard before the migration is
///    waited for, named (node and pid) in `waiting_on`; once `remus.cleanup_drain_timeout`
///    (lowered by a reload) has passed it is terminated and the migration completes.
#[test]
fn the_cleanup_drain_waits_only_for_what_can_use_the_old_copy_and_is_bounded() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let accounts = owners(&c, "pgbench_accounts");
    let on = |node: &str| -> Vec<i64> {
        accounts
            .iter()
            .filter(|(_, o)| o == node)
            .map(|(s, _)| *s)
            .collect()
    };
    let (on_n1, on_n3) = (on("n1"), on("n3"));

    // 1. Idle transactions that hold neither a snapshot nor a lock on the moved tables.
    let mut idle: Vec<postgres::Client> = ["n1", "n3"]
        .iter()
        .map(|n| {
            let mut db = c.connect(n).unwrap();
            db.batch_execute("BEGIN; SELECT 1").unwrap();
            db
        })
        .collect();
    let call = start_migration(&c, on_n1[0], "n2");
    let id = running_migration_of(&c, on_n1[0]);
    assert_eq!(call_result(&c, call, id), "succeeded");
    for db in &mut idle {
        db.batch_execute("SELECT 2; COMMIT")
            .expect("an unrelated idle transaction is not terminated");
    }

    // 2. Two calls from two sessions of n3 at once, held together at their sync barriers by
    //    a write lock on both shard tables (taken without an xid), then let go together.
    let tellers = owners(&c, "pgbench_tellers")
        .into_iter()
        .find(|(_, o)| o == "n3")
        .map(|(s, _)| s)
        .unwrap();
    let mut holder = c.connect("n3").unwrap();
    holder
        .batch_execute(&format!(
            "BEGIN;
             LOCK TABLE remus_shards.pgbench_tellers_{tellers} IN ROW EXCLUSIVE MODE;
             LOCK TABLE remus_shards.pgbench_accounts_{} IN ROW EXCLUSIVE MODE",
            on_n3[0]
        ))
        .unwrap();
    let calls = [(tellers, "n1"), (on_n3[0], "n2")].map(|(shard, target)| {
        let call = start_migration(&c, shard, target);
        (call, running_migration_of(&c, shard))
    });
    let mut db = c.connect("n1").unwrap();
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(20),
        || {
            let at_barrier: i64 = db
                .query_one(
                    "SELECT count(*) FROM remus_migrations
                      WHERE status = 'running' AND phase = 'barrier'",
                    &[],
                )
                .unwrap()
                .get(0);
            at_barrier == 2
        },
        || {
            format!(
                "the two migrations never met at the barrier\n{}",
                c.daemon_logs(40)
            )
        },
    );
    holder.batch_execute("COMMIT").unwrap();
    for (call, id) in calls {
        assert_eq!(call_result(&c, call, id), "succeeded");
    }

    // 3. A REPEATABLE READ reader of the shard on the source: waited for, named, terminated
    //    at the bound.
    let shard = on_n1[1];
    let mut reader = c.connect("n1").unwrap();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    let aid: i32 = reader
        .query_one(
            &format!("SELECT min(aid) FROM remus_shards.pgbench_accounts_{shard}"),
            &[],
        )
        .unwrap()
        .get(0);
    reader
        .query_one(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            &[&aid],
        )
        .unwrap();
    let pid: i32 = reader
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    let call = start_migration(&c, shard, "n2");
    let id = running_migration_of(&c, shard);
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(20),
        || waiting_on(&c, id).is_some_and(|w| w.contains(&format!("on n1 (e.g. pid {pid},"))),
        || {
            format!(
                "the drain never named the reader (pid {pid} on n1): {:?}",
                waiting_on(&c, id)
            )
        },
    );
    assert!(!call.is_finished(), "the reader is waited for");
    set_drain_timeout(&c, Some("100ms"));
    let status = call_result(&c, call, id);
    set_drain_timeout(&c, None);
    assert_eq!(status, "succeeded");
    let aborted: i64 = c
        .connect("n1")
        .unwrap()
        .query_one(
            "SELECT aborted_by_migration FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert!(aborted >= 1, "the terminated reader counts as aborted");
    let e = reader
        .batch_execute("SELECT 1")
        .expect_err("the reader was terminated");
    println!("the reader after the bound: {e:?}");
    assert_eq!(owners_everywhere(&c, shard), vec!["n2".to_string(); 3]);
}

/// Review finding F18. Two migrations cut off by a coordinator kill: A (accounts shard of n1)
/// past its Tm (committed, cleanup not begun), B (tellers shard of n3) in dual execution. The
/// successor resumes both; A's drain is held by a REPEATABLE READ transaction open since before the restart
/// (`remus.cleanup_drain_timeout` set to an hour), and B must be rolled back meanwhile, its
/// source out of sync mode (before: resumed one after another, B waited behind A).
#[test]
fn a_resumed_migration_held_in_its_drain_does_not_hold_up_another() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    set_drain_timeout(&c, Some("1h"));
    let a_shard = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .unwrap()
        .0;
    // A tellers shard of n3 that holds a teller (scale 1 has ten, most shards are empty).
    let mut n3 = c.connect("n3").unwrap();
    let b_shard = owners(&c, "pgbench_tellers")
        .into_iter()
        .filter(|(_, o)| o == "n3")
        .map(|(s, _)| s)
        .find(|s| {
            n3.query_one(
                &format!("SELECT count(*) FROM remus_shards.pgbench_tellers_{s}"),
                &[],
            )
            .unwrap()
            .get::<_, i64>(0)
                > 0
        })
        .expect("n3 holds a teller");
    let mut reader = c.connect("n1").unwrap();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .unwrap();

    // A waits after Tm committed (nothing prepared that would hold B's slot creation).
    c.arm_pause(CLEANUP_STARTED).unwrap();
    let a_call = start_migration(&c, a_shard, "n2");
    let a = c
        .wait_paused_at(CLEANUP_STARTED, Duration::from_secs(120))
        .unwrap();
    c.arm_pause(DUAL_STARTED).unwrap();
    let b_call = start_migration(&c, b_shard, "n2");
    let b = c
        .wait_paused_at(DUAL_STARTED, Duration::from_secs(120))
        .unwrap();
    assert!(a < b, "A is resumed first when they run in turn");
    restart_coordinator(&c, &[CLEANUP_STARTED, DUAL_STARTED]);
    let _ = (a_call.join().unwrap(), b_call.join().unwrap());

    let (status, error) = wait_ended(&c, b, Duration::from_secs(180));
    assert_eq!(status, "rolled_back", "{error:?}");
    assert_eq!(owners_everywhere(&c, b_shard), vec!["n3".to_string(); 3]);
    let a_waits = waiting_on(&c, a).unwrap_or_default();
    assert_eq!(migration_state(&c, a).0, "running");
    let pid: i32 = reader
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    assert!(a_waits.contains(&format!("pid {pid}")), "{a_waits}");
    // B's source takes writes on its shard again (no validation against a stream that is gone).
    let tid: i32 = n3
        .query_one(
            &format!("SELECT min(tid) FROM remus_shards.pgbench_tellers_{b_shard}"),
            &[],
        )
        .unwrap()
        .get(0);
    n3.execute(
        "UPDATE pgbench_tellers SET tbalance = tbalance + 1 WHERE tid = $1",
        &[&tid],
    )
    .unwrap_or_else(|e| panic!("a write on B's shard after its rollback: {e:?}"));

    reader.batch_execute("COMMIT").unwrap();
    let (status, error) = wait_ended(&c, a, Duration::from_secs(180));
    assert_eq!(status, "succeeded", "{error:?}");
    assert_eq!(owners_everywhere(&c, a_shard), vec!["n2".to_string(); 3]);
    set_drain_timeout(&c, None);
    assert!(
        c.migration_artifacts().is_empty(),
        "{:?}",
        c.migration_artifacts()
    );
}

/// Review finding F13. Read-through is held per migration and ending it is idempotent: a
/// rollback that ends it on a node its Tm never reached (migration 2 here), or a retried end,
/// must not end another migration's hold (before: one counter per node, decremented by every
/// end, saturating at 0, so 2's rollback switched off 1's read-through in the middle of its
/// flip).
#[test]
fn one_migration_cannot_end_another_ones_read_through() {
    let c = TestCluster::start(1).expect("cluster up");
    let mut db = c.connect("n1").unwrap();
    let mut holders = |q: &str| -> i32 { db.query_one(q, &[]).unwrap().get(0) };
    assert_eq!(holders("SELECT remus.begin_read_through(1)"), 1);
    assert_eq!(
        holders("SELECT remus.begin_read_through(1)"),
        1,
        "idempotent"
    );
    assert_eq!(
        holders("SELECT remus.end_read_through(2)"),
        1,
        "a migration that never began read-through here ends nothing"
    );
    assert_eq!(holders("SELECT remus.begin_read_through(3)"), 2);
    assert_eq!(holders("SELECT remus.end_read_through(3)"), 1);
    assert_eq!(
        holders("SELECT remus.end_read_through(3)"),
        1,
        "a retried end"
    );
    assert_eq!(holders("SELECT remus.end_read_through(1)"), 0);
    assert_eq!(holders("SELECT remus.end_read_through(1)"), 0);
    // The id-less form (a restarted coordinator's "end every hold") still ends everything.
    holders("SELECT remus.begin_read_through(4)");
    assert_eq!(holders("SELECT remus.end_read_through()"), 0);
}
