//! The albatross mode (issue 19 item 2, decision 0024): iterative copy, then a short handover in
//! which the migrating shards' new transactions wait (suspended, not aborted), the ones in
//! flight drain on the source, the last delta is applied, ownership flips and the suspended
//! work goes on at the target.
//!
//! - `albatross_moves_and_consolidates_under_tpcb`: pgbench TPC-B on all three nodes (no
//!   retries) while two account shards move and then every shard of n3 moves to n1 and n2.
//!   Afterwards every balance equals its history deltas row by row, one history row per
//!   committed transaction, every migration succeeded with its unavailability window recorded,
//!   n3 owns nothing, nothing of the migrations is left on any node, and pgbench's failures are
//!   exactly the sum of the migrations' `aborted_by_migration` (0 expected: a READ COMMITTED
//!   transaction that waited routes by the new map).
//! - `albatross_rolls_back_when_the_drain_bound_passes`: a transaction held open on the shard
//!   (a row written, not committed) keeps the drain waiting past `remus.gate_drain_timeout`:
//!   the migration is rolled back, the shard stays on the source with nothing left behind, the
//!   held transaction commits, and a new transaction on the shard that arrived during the
//!   suspension waited and then committed on the source (nothing aborted).
//! - `albatross_coordinator_killed_before_the_flip_rolls_back`: the coordinator killed while
//!   the shards are suspended and drained (before the last delta and Tm); started again, it
//!   rolls the migration back, and a transaction that waited at the suspension through the
//!   restart commits on the source; nothing left, nothing aborted.
//! - `albatross_waiters_route_to_the_new_owner_or_fail_with_40001`: paused after the drain, a
//!   READ COMMITTED and a REPEATABLE READ transaction (snapshot taken) wait at the suspension;
//!   after the flip the first commits on the new owner, the second fails with 40001 and is
//!   counted in `aborted_by_migration`.
//! - `a_read_that_waited_on_the_new_owner_sees_the_last_delta`: a write in flight on the shard
//!   commits during the drain and reaches the target only with the last delta (the replay slowed
//!   by `catchup.slow_replay`); a READ COMMITTED read of that row on the target, which took its
//!   snapshot before the last delta and waited at the suspension, runs on the target after the
//!   flip and returns the row as written (its local plan takes a snapshot after the wait).

use std::time::{Duration, Instant};

use coordinator::failpoint::{CATCHUP_SLOW_REPLAY, HANDOVER_ALBATROSS_DRAINED};
use integration::consistency::assert_tpcb_consistent;
use integration::pgbench::{finish, init_tpcb, prepared_everywhere, start_tpcb, wait_committing};
use integration::shards::{assert_owns_no_shard, owners, TPCB_TABLES};
use remus_test_support::cluster::TestCluster;

struct Moved {
    migration_id: i64,
    status: String,
    aborted: i64,
    unavailable_ms: Option<i64>,
    error: Option<String>,
}

fn migrate(c: &TestCluster, via: &str, shard: i64, target: &str) -> Moved {
    let mut db = c.connect(via).unwrap();
    let row = db
        .query_one(
            "SELECT migration_id, status, aborted_by_migration, handover_ms, total_ms
               FROM remus_migrate_shard($1, $2, 'albatross')",
            &[&shard, &target],
        )
        .unwrap_or_else(|e| panic!("migrating shard {shard} to {target} (albatross): {e:?}"));
    let id: i64 = row.get(0);
    let listed = db
        .query_one(
            "SELECT unavailable_ms, error FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap();
    let m = Moved {
        migration_id: id,
        status: row.get(1),
        aborted: row.get(2),
        unavailable_ms: listed.get(0),
        error: listed.get(1),
    };
    println!(
        "migration {id} shard {shard} -> {target} (albatross): {} handover {} ms, total {} ms, unavailable {:?} ms, aborted {}",
        m.status,
        row.get::<_, i64>(3),
        row.get::<_, i64>(4),
        m.unavailable_ms,
        m.aborted
    );
    m
}

#[test]
fn albatross_moves_and_consolidates_under_tpcb() {
    let started = Instant::now();
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 2);
    let before = owners(&c, "pgbench_accounts");
    assert!(before.len() >= 6, "{before:?}");

    let loads: Vec<_> = c
        .node_names()
        .iter()
        .map(|n| start_tpcb(&c, n, 4, 45))
        .collect();
    wait_committing(&c, "n1", 200);

    let mut moved = Vec::new();
    // Two account shards (with their co-located history), each to the next node, through
    // different nodes.
    for (i, (shard, owner)) in before.iter().take(2).enumerate() {
        let target = match owner.as_str() {
            "n1" => "n2",
            "n2" => "n3",
            _ => "n1",
        };
        moved.push(migrate(&c, &format!("n{}", i % 3 + 1), *shard, target));
    }
    // Consolidation: every shard of n3 (all tables) to n1 and n2, alternating.
    let mut k = 0;
    for table in ["pgbench_accounts", "pgbench_branches", "pgbench_tellers"] {
        for (shard, owner) in owners(&c, table) {
            if owner == "n3" {
                let target = if k % 2 == 0 { "n1" } else { "n2" };
                k += 1;
                moved.push(migrate(&c, "n2", shard, target));
            }
        }
    }
    let migrations_done = started.elapsed();
    let results: Vec<_> = loads.into_iter().map(finish).collect();

    for m in &moved {
        assert_eq!(
            m.status, "succeeded",
            "migration {}: {:?}",
            m.migration_id, m.error
        );
        assert!(
            m.unavailable_ms.is_some(),
            "migration {} recorded no unavailability window",
            m.migration_id
        );
    }
    let failed: u64 = results.iter().map(|r| r.failed).sum();
    let processed: u64 = results.iter().map(|r| r.processed).sum();
    let aborted: i64 = moved.iter().map(|m| m.aborted).sum();
    let windows: Vec<i64> = moved.iter().filter_map(|m| m.unavailable_ms).collect();
    println!(
        "albatross: {} migrations (done after {} s), pgbench {processed} committed, {failed} failed; aborted_by_migration {aborted}; unavailable ms: max {}, sum {}",
        moved.len(),
        migrations_done.as_secs(),
        windows.iter().max().copied().unwrap_or(0),
        windows.iter().sum::<i64>()
    );
    for r in &results {
        assert_eq!(r.aborted_clients, 0, "a pgbench client died: {}", r.output);
        assert!(r.processed > 0, "{}", r.output);
    }
    assert_eq!(
        failed as i64, aborted,
        "pgbench failures must be exactly the migrations' aborts"
    );

    assert_tpcb_consistent(&c, "n1", processed, "after albatross migrations");
    assert_owns_no_shard(&c, "n3", &TPCB_TABLES);
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(prepared_everywhere(&c), 0);
}

#[test]
fn albatross_rolls_back_when_the_drain_bound_passes() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    drain_timeout(&c, "1500ms");
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .expect("n1 holds an account shard");
    let target = "n2";
    let mut on_source = c.connect(&source).unwrap();
    let aids: Vec<i32> = on_source
        .query(
            &format!("SELECT aid FROM remus_shards.pgbench_accounts_{shard} ORDER BY aid LIMIT 2"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (held_aid, new_aid) = (aids[0], aids[1]);

    // The migration pauses in its first copy round (a transaction holding an xid when the slot
    // is made would hold up the copy, not the handover).
    c.arm_pause("catchup.running").unwrap();
    let call = {
        let mut db = c.connect("n2").unwrap();
        std::thread::spawn(move || {
            db.query_one(
                "SELECT status FROM remus_migrate_shard($1, $2, 'albatross')",
                &[&shard, &target],
            )
            .map(|r| r.get::<_, String>(0))
        })
    };
    let id = c
        .wait_paused_at("catchup.running", Duration::from_secs(60))
        .unwrap();
    // In flight on the shard: a row written through n3 (so the source runs it for n3's
    // transaction), not committed.
    let mut held = c.connect("n3").unwrap();
    held.batch_execute(&format!(
        "BEGIN; UPDATE pgbench_accounts SET abalance = abalance + 7 WHERE aid = {held_aid}"
    ))
    .unwrap();
    c.release_failpoint("catchup.running").unwrap();
    // Once the shard is suspended (the handover waits for the held transaction), a new
    // transaction on the shard through n3 waits too.
    let mut watcher = c.connect("n1").unwrap();
    wait_for_drain_of_in_flight(
        &mut watcher,
        id,
        "the handover did not wait for the held transaction",
    );
    let newcomer = {
        let mut db = c.connect("n3").unwrap();
        std::thread::spawn(move || {
            let t = Instant::now();
            let r = db.batch_execute(&format!(
                "BEGIN; UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = {new_aid};
                 INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, {new_aid}, 5, now());
                 COMMIT"
            ));
            (r, t.elapsed())
        })
    };
    // It waits at the suspension (n3's list of waiting backends names it) while the
    // migration still runs.
    let mut n3 = c.connect("n3").unwrap();
    let seen_waiting = remus_test_support::wait_for(
        Duration::from_secs(30),
        Duration::from_millis(10),
        || {
            let waiting = waiting_at_suspension(&mut n3, id)?;
            let running: bool = watcher
                .query_one(
                    "SELECT status = 'running' FROM remus_migrations WHERE migration_id = $1",
                    &[&id],
                )
                .ok()?
                .get(0);
            (waiting > 0 || !running).then_some(waiting > 0 && running)
        },
        || "neither a waiting backend nor the migration's end was seen".to_string(),
    );
    assert!(
        seen_waiting,
        "the new transaction on the suspended shard did not wait"
    );

    let refused = call
        .join()
        .unwrap()
        .expect_err("the migration must not succeed");
    assert!(
        format!("{refused:?}").contains("rolled_back"),
        "{refused:?}"
    );
    let (new_result, waited) = newcomer.join().unwrap();
    let mut n1 = c.connect("n1").unwrap();
    let row = n1
        .query_one(
            "SELECT migration_id, status, error, aborted_by_migration, unavailable_ms
               FROM remus_migrations ORDER BY migration_id DESC LIMIT 1",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), id);
    let status: String = row.get(1);
    let error: Option<String> = row.get(2);
    let aborted: i64 = row.get(3);
    let unavailable: Option<i64> = row.get(4);
    println!(
        "migration {id}: {status}, error {error:?}; aborted {aborted}; unavailable {unavailable:?} ms; the new transaction waited {waited:?}"
    );
    assert_eq!(status, "rolled_back");
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("albatross: transactions in flight")),
        "{error:?}"
    );
    assert_eq!(aborted, 0);
    assert!(unavailable.is_some_and(|ms| ms >= 1500), "{unavailable:?}");
    new_result.expect("the suspended transaction commits once the suspension lifts");

    // The held transaction was never aborted; it commits on the source.
    held.batch_execute("COMMIT").unwrap();
    assert_eq!(
        owners(&c, "pgbench_accounts")
            .into_iter()
            .find(|(s, _)| *s == shard)
            .map(|(_, o)| o),
        Some(source.clone())
    );
    let balances: Vec<(i32, i32)> = n1
        .query(
            "SELECT aid, abalance FROM pgbench_accounts WHERE aid = ANY($1) ORDER BY aid",
            &[&vec![held_aid, new_aid]],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(balances, vec![(held_aid, 7), (new_aid, 5)]);
    let target_tables: i64 = c
        .connect(target)
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'remus_shards' AND tablename LIKE $1",
            &[&format!("%\\_{shard}")],
        )
        .unwrap()
        .get(0);
    assert_eq!(target_tables, 0, "the target's copy is gone");
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(prepared_everywhere(&c), 0);
}

/// The coordinator killed while the shards are suspended and drained (failpoint
/// `handover.albatross_drained`, before the last delta and Tm): the coordinator started again
/// rolls the migration back; a transaction that waited at the suspension through the restart
/// goes on and commits on the source; nothing is left and nothing was aborted.
#[test]
fn albatross_coordinator_killed_before_the_flip_rolls_back() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .expect("n1 holds an account shard");
    let aid: i32 = c
        .connect(&source)
        .unwrap()
        .query_one(
            &format!("SELECT min(aid) FROM remus_shards.pgbench_accounts_{shard}"),
            &[],
        )
        .unwrap()
        .get(0);
    let failpoint = "handover.albatross_drained";
    c.arm_pause(failpoint).unwrap();
    let call = {
        let mut db = c.connect("n2").unwrap();
        std::thread::spawn(move || {
            db.query_one(
                "SELECT status FROM remus_migrate_shard($1, 'n3', 'albatross')",
                &[&shard],
            )
            .map(|r| r.get::<_, String>(0))
        })
    };
    let id = c
        .wait_paused_at(failpoint, Duration::from_secs(60))
        .unwrap();
    let newcomer = {
        let mut db = c.connect("n2").unwrap();
        std::thread::spawn(move || {
            db.batch_execute(&format!(
                "BEGIN; UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = {aid};
                 INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, {aid}, 5, now());
                 COMMIT"
            ))
        })
    };
    let mut n2 = c.connect("n2").unwrap();
    wait_for_waiters(
        &mut n2,
        id,
        |n| n > 0,
        "the new transaction did not wait at the suspension",
    );

    c.kill_coordinator().unwrap();
    // The caller's call ends with the coordinator it waited on.
    assert!(call.join().unwrap().is_err());
    c.release_failpoint(failpoint).unwrap();
    let started = Instant::now();
    while let Err(e) = c.start_coordinator_again() {
        assert!(
            e.to_string().contains("in use") && started.elapsed() < Duration::from_secs(30),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, error) =
        integration::migrations::wait_ended(&c, "n1", id, Duration::from_secs(120));
    println!("migration {id}: {status} ({error:?})");
    assert_eq!(status, "rolled_back");
    newcomer
        .join()
        .unwrap()
        .expect("the suspended transaction commits after the rollback");

    let mut n1 = c.connect("n1").unwrap();
    let row = n1
        .query_one(
            "SELECT aborted_by_migration FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 0);
    assert_eq!(
        integration::shards::owners_everywhere(&c, shard),
        vec![source.clone(); 3],
        "the shard stays on the source on every node"
    );
    let balance: i32 = n1
        .query_one(
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            &[&aid],
        )
        .unwrap()
        .get(0);
    assert_eq!(balance, 5);
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(prepared_everywhere(&c), 0);
}

/// Isolation after the wait (decision 0024 item 5): with the shards suspended and drained
/// (paused at `handover.albatross_drained`), a READ COMMITTED transaction and a REPEATABLE READ
/// one that has taken its snapshot each route the moving shard for the first time and wait.
/// After the flip the READ COMMITTED one runs on the new owner and commits; the REPEATABLE READ
/// one, whose snapshot still names the old owner, fails with 40001 and is the one transaction
/// the migration counts as aborted.
#[test]
fn albatross_waiters_route_to_the_new_owner_or_fail_with_40001() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .expect("n1 holds an account shard");
    let aids: Vec<i32> = c
        .connect(&source)
        .unwrap()
        .query(
            &format!("SELECT aid FROM remus_shards.pgbench_accounts_{shard} ORDER BY aid LIMIT 2"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let failpoint = "handover.albatross_drained";
    c.arm_pause(failpoint).unwrap();
    let call = {
        let mut db = c.connect("n2").unwrap();
        std::thread::spawn(move || {
            db.query_one(
                "SELECT status, aborted_by_migration FROM remus_migrate_shard($1, 'n3', 'albatross')",
                &[&shard],
            )
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        })
    };
    let id = c
        .wait_paused_at(failpoint, Duration::from_secs(60))
        .unwrap();
    let waiter = |isolation: &'static str, aid: i32| {
        let mut db = c.connect("n2").unwrap();
        std::thread::spawn(move || {
            db.batch_execute(&format!(
                "BEGIN ISOLATION LEVEL {isolation};
                 SELECT count(*) FROM pgbench_branches;
                 UPDATE pgbench_accounts SET abalance = abalance + 3 WHERE aid = {aid};
                 COMMIT"
            ))
        })
    };
    let read_committed = waiter("READ COMMITTED", aids[0]);
    let repeatable_read = waiter("REPEATABLE READ", aids[1]);
    let mut n2 = c.connect("n2").unwrap();
    wait_for_waiters(
        &mut n2,
        id,
        |n| n == 2,
        "the two transactions did not wait at the suspension",
    );
    c.release_failpoint(failpoint).unwrap();
    let (status, aborted) = call.join().unwrap().expect("the migration succeeds");
    assert_eq!(status, "succeeded");
    read_committed
        .join()
        .unwrap()
        .expect("READ COMMITTED routes to the new owner after the wait");
    let e = repeatable_read
        .join()
        .unwrap()
        .expect_err("REPEATABLE READ with a snapshot from before the flip");
    assert_eq!(remus_test_support::sqlstate(&e), "40001", "{e:?}");
    assert_eq!(aborted, 1, "the REPEATABLE READ transaction is counted");
    let balances: Vec<(i32, i32)> = c
        .connect("n3")
        .unwrap()
        .query(
            &format!("SELECT aid, abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = ANY($1) ORDER BY aid"),
            &[&aids],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        balances,
        vec![(aids[0], 3), (aids[1], 0)],
        "on the new owner"
    );
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// How many backends of `db`'s node wait at migration `id`'s suspension; `None` when the node
/// does not answer.
fn waiting_at_suspension(db: &mut postgres::Client, id: i64) -> Option<i32> {
    Some(
        db.query_one(
            &format!("SELECT cardinality(remus.albatross_waiting({id}))"),
            &[],
        )
        .ok()?
        .get::<_, Option<i32>>(0)
        .unwrap_or(0),
    )
}

/// Waits (30 s at most) until the number of backends of `db`'s node waiting at migration `id`'s
/// suspension satisfies `enough`; panics with `what` otherwise.
fn wait_for_waiters(db: &mut postgres::Client, id: i64, enough: impl Fn(i32) -> bool, what: &str) {
    remus_test_support::wait_for(
        Duration::from_secs(30),
        Duration::from_millis(10),
        || {
            waiting_at_suspension(db, id)
                .filter(|n| enough(*n))
                .map(|_| ())
        },
        || what.to_string(),
    );
}

/// Waits (60 s at most) until migration `id`'s handover waits for the transactions in flight on
/// its suspended shards, as `watcher`'s node reports it; panics with `what` otherwise.
fn wait_for_drain_of_in_flight(watcher: &mut postgres::Client, id: i64, what: &str) {
    remus_test_support::wait_for(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let w: Option<String> = watcher
                .query_one(
                    "SELECT waiting_on FROM remus_migrations WHERE migration_id = $1",
                    &[&id],
                )
                .ok()?
                .get(0);
            w.filter(|w| w.contains("in flight on the suspended shards"))
        },
        || what.to_string(),
    );
}

/// Sets `remus.gate_drain_timeout` on every node (reloaded).
fn drain_timeout(c: &TestCluster, value: &str) {
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        db.simple_query(&format!(
            "ALTER SYSTEM SET remus.gate_drain_timeout = '{value}'"
        ))
        .unwrap();
        db.simple_query("SELECT pg_reload_conf()").unwrap();
    }
}

#[test]
fn a_read_that_waited_on_the_new_owner_sees_the_last_delta() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    // The drain waits for the two writes below as long as the test needs.
    drain_timeout(&c, "5min");
    let (shard, source) = owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .expect("n1 holds an account shard");
    let target = "n3";
    let aids: Vec<i32> = c
        .connect(&source)
        .unwrap()
        .query(
            &format!("SELECT aid FROM remus_shards.pgbench_accounts_{shard} ORDER BY aid LIMIT 2"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (first_aid, aid) = (aids[0], aids[1]);

    // Two writes in flight on the shard, opened during catch-up (an xid held when the slot is
    // made would hold up the copy), committed during the drain.
    c.arm_pause("catchup.running").unwrap();
    c.arm_pause(HANDOVER_ALBATROSS_DRAINED).unwrap();
    let call = {
        let mut db = c.connect("n2").unwrap();
        std::thread::spawn(move || {
            db.query_one(
                "SELECT status, aborted_by_migration FROM remus_migrate_shard($1, $2, 'albatross')",
                &[&shard, &target],
            )
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        })
    };
    let id = c
        .wait_paused_at("catchup.running", Duration::from_secs(60))
        .unwrap();
    let mut first = c.connect(&source).unwrap();
    first
        .batch_execute(&format!(
            "BEGIN; UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = {first_aid}"
        ))
        .unwrap();
    let mut last = c.connect(&source).unwrap();
    last.batch_execute(&format!(
        "BEGIN; UPDATE pgbench_accounts SET abalance = abalance + 5 WHERE aid = {aid}"
    ))
    .unwrap();
    c.release_failpoint("catchup.running").unwrap();
    let mut watcher = c.connect("n1").unwrap();
    wait_for_drain_of_in_flight(
        &mut watcher,
        id,
        "the handover did not wait for the writes in flight",
    );
    // The replay waits 20 s after shipping the first commit: the second, committed next, is
    // still not on the target when the drain is over.
    let fp = c.state().unwrap().failpoint_dir();
    std::fs::write(fp.join(CATCHUP_SLOW_REPLAY), "delay 20000").unwrap();
    // The propagator looks at the failpoint at most twice a second, when it ships something.
    std::thread::sleep(Duration::from_secs(1));
    first.batch_execute("COMMIT").unwrap();
    last.batch_execute("COMMIT").unwrap();
    c.wait_paused_at(HANDOVER_ALBATROSS_DRAINED, Duration::from_secs(60))
        .unwrap();
    let on_target = |c: &TestCluster| -> i32 {
        let mut db = c.connect(target).unwrap();
        db.batch_execute("SET remus.migration_session = on")
            .unwrap();
        db.query_one(
            &format!("SELECT abalance FROM remus_shards.pgbench_accounts_{shard} WHERE aid = $1"),
            &[&aid],
        )
        .unwrap()
        .get(0)
    };
    // A read of that row through the target: its snapshot is taken now, it waits at the
    // suspension.
    let reader = {
        let mut db = c.connect(target).unwrap();
        std::thread::spawn(move || {
            db.query_one(
                "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
                &[&aid],
            )
            .map(|r| r.get::<_, i32>(0))
        })
    };
    let mut n3 = c.connect(target).unwrap();
    wait_for_waiters(
        &mut n3,
        id,
        |n| n == 1,
        "the read did not wait at the suspension",
    );
    // What the test is about: the last write is not on the target yet, so the waiting read's
    // snapshot (older than this check) does not see it there.
    assert_eq!(
        on_target(&c),
        0,
        "the second write is still to come with the last delta"
    );
    std::fs::remove_file(fp.join(CATCHUP_SLOW_REPLAY)).unwrap();
    c.release_failpoint(HANDOVER_ALBATROSS_DRAINED).unwrap();
    let (status, aborted) = call.join().unwrap().expect("the migration succeeds");
    assert_eq!((status.as_str(), aborted), ("succeeded", 0));
    assert_eq!(
        owners(&c, "pgbench_accounts")
            .iter()
            .find(|(s, _)| *s == shard)
            .map(|(_, o)| o.as_str()),
        Some(target)
    );
    let read = reader
        .join()
        .unwrap()
        .expect("the read goes on after the flip");
    assert_eq!(
        read, 5,
        "the read on the new owner sees the write that came with the last delta"
    );
    assert_eq!(on_target(&c), 5);
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
}
