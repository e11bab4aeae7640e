//! Orphan prepared shadows and the waits of a migration that clients can run into (issue 15,
//! review finding F6 and requirement 4). One file, each test under 30 s.
//!
//! - A shadow whose source transaction's fate never reached the destination (here: the
//!   post-commit Resolve times out, `remus.resolve_timeout`, because the replay worker is
//!   stopped) is finished by the coordinator's periodic resolver by that fate, while the
//!   migration is still in dual execution: committed on the source → the row is on the target,
//!   rolled back → it is not, and later source writes of the rows commit. Without the resolver
//!   (checked against a build with it switched off) the shadows stay prepared until cleanup.
//!   The orphans come from 2PC participants: their Resolve is sent by the session running
//!   COMMIT / ROLLBACK PREPARED, so the worker can be stopped between validation and Resolve
//!   without a race. (The review's other recipe, a COMMIT cancelled during its validation, no
//!   longer leaves an orphan since the source records the gid before it asks: see
//!   migration_dual.rs.)
//! - wait_remaster's gate drain: named with its bound in `waiting_on`, and past
//!   `remus.gate_drain_timeout` the handover rolls back instead of waiting for an idle
//!   transaction (without the bound it waited for it as long as it stayed open).
//! - A Tm prepared and not yet decided: `waiting_on` names the nodes that have it prepared, where
//!   statements on the moved shards wait (`remus.in_doubt_wait_timeout`).

use std::time::Duration;

use coordinator::failpoint::{DUAL_STARTED, HANDOVER_TM_PREPARED};
use integration::shards::owners;
use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

/// A two-node cluster with table `name(id, a)` distributed over 4 shards (rows 1..=100,
/// a = 0): the cluster and a shard of it that n1 owns.
fn two_nodes_with_table(name: &str) -> (TestCluster, i64) {
    let c = TestCluster::start(2).expect("cluster up");
    c.connect("n1")
        .unwrap()
        .batch_execute(&format!(
            "CREATE TABLE {name} (id int PRIMARY KEY, a int NOT NULL);
             INSERT INTO {name} SELECT g, 0 FROM generate_series(1, 100) g;
             SELECT remus_create_distributed_table('{name}', 'id', 4);"
        ))
        .unwrap();
    let shard = owners(&c, name)
        .into_iter()
        .find_map(|(s, o)| (o == "n1").then_some(s))
        .expect("n1 owns a shard");
    (c, shard)
}

/// A two-node cluster with `t(id, a)` over 4 shards (rows 1..=100, a = 0) and a remus
/// migration of one of n1's shards to n2 held in dual execution: the cluster, the shard, the
/// migration id and the `remus_migrate_shard` call.
fn held_in_dual_execution() -> (
    TestCluster,
    i64,
    i64,
    std::thread::JoinHandle<Result<String, postgres::Error>>,
) {
    let (c, shard) = two_nodes_with_table("t");
    c.arm_pause(DUAL_STARTED).unwrap();
    let mut caller = c.connect("n1").unwrap();
    let call = std::thread::spawn(move || {
        caller
            .query_one(
                "SELECT status FROM remus_migrate_shard($1, 'n2')",
                &[&shard],
            )
            .map(|r| r.get(0))
    });
    let id = c
        .wait_paused_at(DUAL_STARTED, Duration::from_secs(120))
        .unwrap();
    (c, shard, id, call)
}

/// `a` of row `id` in the shard table on `node` (read there directly, not routed, as the
/// migration's own sessions may).
fn a_on(c: &TestCluster, node: &str, shard: i64, id: i32) -> i32 {
    let mut db = c.connect(node).unwrap();
    db.batch_execute("SET remus.migration_session = on")
        .unwrap();
    db.query_one(
        &format!("SELECT a FROM remus_shards.t_{shard} WHERE id = $1"),
        &[&id],
    )
    .unwrap()
    .get(0)
}

/// Prepared `remus:` shadows on `node`.
fn shadows(c: &TestCluster, node: &str) -> i64 {
    c.connect(node)
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'remus:%'",
            &[],
        )
        .unwrap()
        .get(0)
}

/// Phase of migration `id` as `remus_migrations` shows it.
fn phase(c: &TestCluster, id: i64) -> String {
    c.connect("n1")
        .unwrap()
        .query_one(
            "SELECT phase FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0)
}

/// A process stopped with SIGSTOP, continued when dropped (also when the test fails).
struct Frozen(i32);

impl Frozen {
    fn new(pid: i32) -> Frozen {
        // SAFETY: kill(2) of a process of this test's own cluster.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

#[test]
fn orphan_shadows_follow_their_source_fate_during_dual_execution() {
    let (c, shard, id, call) = held_in_dual_execution();
    let rows: Vec<i32> = c
        .connect("n1")
        .unwrap()
        .query(
            &format!("SELECT id FROM remus_shards.t_{shard} ORDER BY id LIMIT 2"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (committed, rolled_back) = (rows[0], rows[1]);
    // Two 2PC participants on the source validate at PREPARE: a shadow of each is prepared on
    // the target.
    let mut n1 = c.connect("n1").unwrap();
    for (row, gid) in [(committed, "orphan_c"), (rolled_back, "orphan_r")] {
        n1.batch_execute(&format!(
            "BEGIN; UPDATE t SET a = a + 100 WHERE id = {row}; PREPARE TRANSACTION '{gid}'"
        ))
        .unwrap();
    }
    assert_eq!(shadows(&c, "n2"), 2, "both participants validated");
    // The replay worker stops answering: the Resolve of each finish times out (WARNING) and
    // nothing but the coordinator can finish the shadows while it is stopped.
    let worker = c.state().unwrap().replay_worker.live_pid().unwrap() as i32;
    let frozen = Frozen::new(worker);
    for sql in [
        "SET remus.resolve_timeout = '1s'",
        "COMMIT PREPARED 'orphan_c'",
        "ROLLBACK PREPARED 'orphan_r'",
    ] {
        n1.batch_execute(sql).unwrap();
    }
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || shadows(&c, "n2") == 0,
        || format!("orphan shadows stay prepared on n2\n{}", c.daemon_logs(40)),
    );
    assert_eq!(phase(&c, id), "dual", "still held in dual execution");
    assert_eq!(
        (
            a_on(&c, "n2", shard, committed),
            a_on(&c, "n2", shard, rolled_back)
        ),
        (100, 0),
        "each shadow followed its source transaction's fate"
    );
    drop(frozen);
    // Later source writes of both rows validate and commit (an orphan would hold the rows and
    // fail them with 40001 after the worker's lock timeout).
    for row in [committed, rolled_back] {
        n1.execute("UPDATE t SET a = a + 1 WHERE id = $1", &[&row])
            .unwrap_or_else(|e| panic!("a later source write of row {row}: {e:?}"));
    }
    c.release_failpoint(DUAL_STARTED).unwrap();
    let status = call.join().unwrap().expect("migration call");
    assert_eq!(status, "succeeded", "{}", c.daemon_logs(40));
    assert_eq!(
        (
            a_on(&c, "n2", shard, committed),
            a_on(&c, "n2", shard, rolled_back)
        ),
        (101, 1)
    );
    assert_eq!(shadows(&c, "n2"), 0);
}

/// Requirement 4, wait_remaster: once the admission gate closed, the handover waits for the
/// transactions admitted before it, says so in `remus_migrations.waiting_on` with its bound,
/// and past `remus.gate_drain_timeout` rolls back (the gate reopens) instead of waiting for an
/// idle transaction for ever.
#[test]
fn a_gate_drain_is_bounded_and_named_in_waiting_on() {
    let (c, shard) = two_nodes_with_table("g");
    let mut n1 = c.connect("n1").unwrap();
    for node in ["n1", "n2"] {
        let mut db = c.connect(node).unwrap();
        for sql in [
            "ALTER SYSTEM SET remus.gate_drain_timeout = '3s'",
            "SELECT pg_reload_conf()",
        ] {
            db.batch_execute(sql).unwrap();
        }
    }
    // An idle transaction that touched no shard, open before the gate closes.
    let mut idle = c.connect("n1").unwrap();
    idle.batch_execute("BEGIN; SELECT 1").unwrap();
    // The test's observer is a migration session, which the closed gate does not hold; set
    // before the gate closes.
    let mut watcher = c.connect("n2").unwrap();
    watcher
        .batch_execute("SET remus.migration_session = on")
        .unwrap();
    let call = std::thread::spawn(move || {
        n1.query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n2', 'wait_remaster')",
            &[&shard],
        )
        .map(|r| r.get::<_, String>(0))
        .map_err(|e| format!("{e:?}"))
    });
    let seen = std::cell::RefCell::new(String::new());
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let now: String = watcher
                .query_one(
                    "SELECT coalesce(string_agg(waiting_on, '; '), '') FROM remus_migrations WHERE status = 'running'",
                    &[],
                )
                .unwrap()
                .get(0);
            let ok = now.contains("in flight when the gate closed")
                && now.contains("remus.gate_drain_timeout");
            *seen.borrow_mut() = now;
            ok
        },
        || {
            format!(
                "the gate drain is not named with its bound in waiting_on (last: {:?})",
                seen.borrow()
            )
        },
    );
    // The bound ends the wait although the idle transaction is still open.
    let outcome = call.join().unwrap();
    let (status, error): (String, Option<String>) = {
        let row = c
            .connect("n2")
            .unwrap()
            .query_one(
                "SELECT status, error FROM remus_migrations ORDER BY migration_id DESC LIMIT 1",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(status, "rolled_back", "call: {outcome:?}");
    assert!(
        error
            .as_deref()
            .unwrap_or_default()
            .contains("remus.gate_drain_timeout"),
        "{error:?}"
    );
    assert!(outcome.is_err(), "{outcome:?}");
    // Nothing moved and the gate is open: new transactions run, the idle one can go on.
    assert_eq!(
        owners(&c, "g")
            .into_iter()
            .find(|(s, _)| *s == shard)
            .unwrap()
            .1,
        "n1"
    );
    idle.batch_execute("COMMIT").unwrap();
    c.connect("n1")
        .unwrap()
        .execute("UPDATE g SET a = a + 1 WHERE id = 1", &[])
        .unwrap();
}

/// Requirement 4, the in-doubt Tm: while the ownership change is prepared on the nodes and not
/// yet decided, statements on the moved shards there wait (`remus.in_doubt_wait_timeout`);
/// `remus_migrations.waiting_on` says so and names the nodes that have it prepared.
#[test]
fn a_prepared_undecided_tm_is_named_in_waiting_on() {
    let (c, shard) = two_nodes_with_table("d");
    c.arm_pause(HANDOVER_TM_PREPARED).unwrap();
    let mut n1 = c.connect("n1").unwrap();
    let call = std::thread::spawn(move || {
        n1.query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n2')",
            &[&shard],
        )
        .map(|r| r.get::<_, String>(0))
    });
    let id = c
        .wait_paused_at(HANDOVER_TM_PREPARED, Duration::from_secs(120))
        .unwrap();
    let waiting_on: Option<String> = c
        .connect("n2")
        .unwrap()
        .query_one(
            "SELECT waiting_on FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    let text = waiting_on.unwrap_or_default();
    for part in [
        "Tm",
        "prepared on",
        "n1",
        "n2",
        "remus.in_doubt_wait_timeout",
    ] {
        assert!(text.contains(part), "waiting_on {text:?} lacks {part:?}");
    }
    c.release_failpoint(HANDOVER_TM_PREPARED).unwrap();
    assert_eq!(call.join().unwrap().expect("migration call"), "succeeded");
}
