//! The squall mode's crash behaviour (issue 19 item 4, decision 0025 "Failure"): before the
//! ownership flip a failure rolls back completely, after it the migration only goes forward;
//! either way nothing is left behind. The coordinator runs with 64 kB chunks so that an account
//! shard has several.
//!
//! - `squall_coordinator_killed_before_the_flip_rolls_back`: under light TPC-B on every node,
//!   the coordinator is killed while Tm is prepared and not decided (failpoint
//!   `handover.tm_prepared`: the chunk catalog planned, the target's tables made, the gates
//!   closed, the source fenced). Started again, it rolls the migration back: the shard is on the
//!   source on every node with all its accounts, the target has neither its tables nor chunk
//!   rows, no node holds any state of the migration (registration, gate, fence, durable file,
//!   prepared Tm). A second squall migration of the same shard then succeeds with every account
//!   on the target. pgbench's failures are exactly the migrations' aborts, and every balance
//!   equals its history.
//! - `squall_coordinator_killed_during_the_pulls_finishes_forward`: with the background puller
//!   held between pulls (failpoint `squall.slow_pull`), the coordinator is killed after the Tm
//!   decision while some chunks are pulled and others are not. Started again, it finishes the
//!   migration: succeeded, the shard's rows on the target are exactly the source's before the
//!   move (count and digest), `rows_copied` counts the chunks pulled before the kill too, the
//!   source's copy is dropped, nothing is left behind. Without load: a transaction on the shard
//!   would ask for its chunks and cut the puller's pause short (no chunks left at the kill), and
//!   one waiting through the restart is the case of the next test.
//! - `squall_a_read_waiting_through_the_restart_gets_every_row`: as the previous test, with a
//!   read of the whole shard on the new owner started while the coordinator is down (it asks
//!   for the pull and waits); once the coordinator is back the read returns every row and the
//!   migration aborts nothing (the restarted coordinator pulls before it drains, as `cleanup`
//!   does; it drained first and terminated the waiting read).

use std::time::Duration;

use coordinator::failpoint::{HANDOVER_TM_PREPARED, SQUALL_SLOW_PULL};
use integration::consistency::assert_tpcb_consistent;
use integration::migrations::wait_ended;
use integration::pgbench::{finish, init_tpcb, start_tpcb, wait_committing};
use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;

/// Chunks of 64 kB: an account shard of scale 1 has several.
const CHUNK_BYTES: &str = "65536";

fn cluster() -> TestCluster {
    // Read by the coordinator that `cluster up` starts, and by the one started again (remusctl
    // passes its environment on).
    std::env::set_var("REMUS_SQUALL_CHUNK_BYTES", CHUNK_BYTES);
    std::env::set_var("REMUS_SQUALL_PACE_MS", "20");
    TestCluster::start(3).expect("cluster up")
}

/// An account shard on n1 (the source of both tests).
fn shard_on_n1(c: &TestCluster) -> i64 {
    owners(c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .map(|(s, _)| s)
        .expect("n1 holds an account shard")
}

/// `(rows, digest)` of `remus_shards.pgbench_accounts_<shard>` on `node`, read directly.
fn accounts_on(c: &TestCluster, node: &str, shard: i64) -> (i64, String) {
    let r = c
        .connect(node)
        .unwrap()
        .query_one(
            &format!(
                "SELECT count(*), coalesce(md5(string_agg(x::text, ',' ORDER BY aid)), '')
                   FROM remus_shards.pgbench_accounts_{shard} x"
            ),
            &[],
        )
        .unwrap();
    (r.get(0), r.get(1))
}

/// The tables of a shard group on a node (`$1`: the pattern `%\_<shard id>`).
const SHARD_TABLES: &str =
    "SELECT count(*) FROM pg_tables WHERE schemaname = 'remus_shards' AND tablename LIKE $1";

/// The tables of shard group `shard` (`remus_shards.*_<shard>`) on `node`.
fn shard_tables_on(c: &TestCluster, node: &str, shard: i64) -> i64 {
    c.connect(node)
        .unwrap()
        .query_one(SHARD_TABLES, &[&format!("%\\_{shard}")])
        .unwrap()
        .get(0)
}

/// Rows of `remus.squall_chunks` on every node, by node.
fn chunk_rows(c: &TestCluster) -> Vec<(String, i64)> {
    c.node_names()
        .into_iter()
        .map(|n| {
            let rows: i64 = c
                .connect(&n)
                .unwrap()
                .query_one("SELECT count(*) FROM remus.squall_chunks", &[])
                .unwrap()
                .get(0);
            (n, rows)
        })
        .collect()
}

/// What a migration can leave behind anywhere: the harness's list (slots, publications,
/// origins, prepared transactions), the migration machinery's entries in each node's shared
/// memory and durable state files (registration, fence, gate: `remus.handover_state()`; a
/// backend's async-commit mark belongs to no migration and is not counted), and chunk rows.
fn leftovers(c: &TestCluster) -> Vec<String> {
    let mut left = c.migration_artifacts();
    for n in c.node_names() {
        left.extend(
            c.handover_state(&n)
                .into_iter()
                .filter(|e| !e.contains(": async_commit ")),
        );
    }
    for (n, rows) in chunk_rows(c) {
        if rows > 0 {
            left.push(format!("{n}: {rows} rows of remus.squall_chunks"));
        }
    }
    left
}

/// `remus_migrate_shard(shard, target, 'squall')` through `via` in a thread: its status.
fn start_squall(
    c: &TestCluster,
    via: &str,
    shard: i64,
    target: &str,
) -> std::thread::JoinHandle<Result<String, postgres::Error>> {
    let mut db = c.connect(via).unwrap();
    let target = target.to_string();
    std::thread::spawn(move || {
        db.query_one(
            "SELECT status FROM remus_migrate_shard($1, $2, 'squall')",
            &[&shard, &target],
        )
        .map(|r| r.get::<_, String>(0))
    })
}

/// `(status, error, aborted_by_migration, rows_copied)` of migration `id`.
fn migration_row(c: &TestCluster, id: i64) -> (String, Option<String>, i64, i64) {
    let r = c
        .connect("n1")
        .unwrap()
        .query_one(
            "SELECT status, error, aborted_by_migration, rows_copied
               FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

/// Moves `shard` to `target` (squall, through n3) with the background puller held ten minutes
/// between pulls (failpoint `squall.slow_pull`; no transaction here asks for the shard to cut
/// the pause short), and kills the coordinator once a chunk is pulled and others are not:
/// `(migration id, chunks pulled at the kill, chunks)`. Checks that the kill comes after the Tm
/// decision (the target owns the shard on every node) and with chunks left.
fn kill_while_pulling(c: &TestCluster, shard: i64, target: &str) -> (i64, i64, i64) {
    let dir = c.state().unwrap().failpoint_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(SQUALL_SLOW_PULL), "delay 600000").unwrap();
    let call = start_squall(c, "n3", shard, target);
    let mut on_target = c.connect(target).unwrap();
    let id: i64 = remus_test_support::wait_for(
        Duration::from_secs(120),
        Duration::from_millis(20),
        || {
            on_target
                .query_one(
                    "SELECT migration_id FROM remus.squall_chunks
                      GROUP BY migration_id HAVING bool_or(pulled)",
                    &[],
                )
                .ok()
                .map(|r| r.get(0))
        },
        || format!("no chunk pulled\n{}", c.daemon_logs(40)),
    );
    assert_eq!(owners_everywhere(c, shard), vec![target.to_string(); 3]);
    c.kill_coordinator().unwrap();
    // The caller's call ends with the coordinator it waited on.
    assert!(call.join().unwrap().is_err());
    // Nothing pulls without a coordinator: what is pulled now is what the restart finds.
    let r = on_target
        .query_one(
            "SELECT count(*) FILTER (WHERE pulled), count(*)
               FROM remus.squall_chunks WHERE migration_id = $1",
            &[&id],
        )
        .unwrap();
    let (pulled, chunks): (i64, i64) = (r.get(0), r.get(1));
    assert!(
        pulled < chunks,
        "{pulled} of {chunks} chunks pulled at the kill: none left for the restart"
    );
    (id, pulled, chunks)
}

/// Background pulls at the cluster's pace again (`kill_while_pulling` held them).
fn release_slow_pull(c: &TestCluster) {
    std::fs::remove_file(c.state().unwrap().failpoint_dir().join(SQUALL_SLOW_PULL)).unwrap();
}

#[test]
fn squall_coordinator_killed_before_the_flip_rolls_back() {
    let c = cluster();
    init_tpcb(&c, 1);
    let shard = shard_on_n1(&c);
    let (source, target) = ("n1", "n2");
    // pgbench updates accounts but never inserts or deletes one: the count is fixed.
    let (accounts, _) = accounts_on(&c, source, shard);
    assert!(accounts > 0);

    let loads: Vec<_> = c
        .node_names()
        .iter()
        .map(|n| start_tpcb(&c, n, 2, 45))
        .collect();
    wait_committing(&c, "n1", 100);

    c.arm_pause(HANDOVER_TM_PREPARED).unwrap();
    let call = start_squall(&c, "n3", shard, target);
    let id = c
        .wait_paused_at(HANDOVER_TM_PREPARED, Duration::from_secs(120))
        .unwrap();
    // What the rollback must undo is there: the target's tables, the chunk catalog (several
    // chunks), the gate and the registration on every node, Tm prepared everywhere. Read in
    // sessions of the migration machinery: any other statement waits at the closed gate.
    let planned: i64 = c
        .connect_migration_session(target)
        .unwrap()
        .query_one(
            "SELECT count(*) FROM remus.squall_chunks WHERE migration_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert!(planned > 1, "{planned} chunks planned");
    let target_tables: i64 = c
        .connect_migration_session(target)
        .unwrap()
        .query_one(SHARD_TABLES, &[&format!("%\\_{shard}")])
        .unwrap()
        .get(0);
    assert!(target_tables > 0);
    for n in c.node_names() {
        let (gate, tm): (i64, i64) = {
            let r = c
                .connect_migration_session(&n)
                .unwrap()
                .query_one(
                    "SELECT (SELECT count(*) FROM remus.handover_state()
                              WHERE kind = 'gate' AND migration_id = $1),
                            (SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE $2)",
                    &[&id, &format!("remus\\_tm:{id}:%")],
                )
                .unwrap();
            (r.get(0), r.get(1))
        };
        assert_eq!((gate, tm), (1, 1), "{n}: the gate closed, Tm prepared");
    }

    c.kill_coordinator().unwrap();
    // The caller's call ends with the coordinator it waited on.
    assert!(call.join().unwrap().is_err());
    c.release_failpoint(HANDOVER_TM_PREPARED).unwrap();
    c.start_coordinator_again().unwrap();
    let (status, error) = wait_ended(&c, "n1", id, Duration::from_secs(180));
    println!("migration {id}: {status} ({error:?})");
    assert_eq!(status, "rolled_back");
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("rolled back when it restarted")),
        "{error:?}"
    );

    assert_eq!(
        owners_everywhere(&c, shard),
        vec![source.to_string(); 3],
        "the shard stays on the source on every node"
    );
    assert_eq!(accounts_on(&c, source, shard).0, accounts);
    assert_eq!(
        shard_tables_on(&c, target, shard),
        0,
        "the target's copy is gone"
    );
    // The load still runs: its own two-phase commits (`remus_<node>_<xid>_<participant>`) may
    // be prepared for a moment; the migration's Tm (`remus_tm:…`) may not.
    let left: Vec<String> = leftovers(&c)
        .into_iter()
        .filter(|e| !e.contains(": prepared remus_n"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // The same shard moves with squall afterwards.
    let second = start_squall(&c, "n2", shard, target)
        .join()
        .unwrap()
        .expect("the second squall migration");
    assert_eq!(second, "succeeded");
    let second_id: i64 = c
        .connect("n1")
        .unwrap()
        .query_one("SELECT max(migration_id) FROM remus_migrations", &[])
        .unwrap()
        .get(0);
    assert!(second_id > id);
    assert_eq!(owners_everywhere(&c, shard), vec![target.to_string(); 3]);
    assert_eq!(accounts_on(&c, target, shard).0, accounts);
    assert_eq!(
        shard_tables_on(&c, source, shard),
        0,
        "the source's copy is dropped"
    );

    let results: Vec<_> = loads.into_iter().map(finish).collect();
    let (_, _, aborted_first, _) = migration_row(&c, id);
    let (_, _, aborted_second, _) = migration_row(&c, second_id);
    let failed: u64 = results.iter().map(|r| r.failed).sum();
    let processed: u64 = results.iter().map(|r| r.processed).sum();
    println!(
        "pgbench {processed} committed, {failed} failed; aborted_by_migration {aborted_first} (rolled back) + {aborted_second}"
    );
    for r in &results {
        assert_eq!(r.aborted_clients, 0, "a pgbench client died: {}", r.output);
        assert!(r.processed > 0, "{}", r.output);
    }
    assert_eq!(
        aborted_first, 0,
        "the rolled-back migration aborted nothing"
    );
    assert_eq!(
        failed as i64,
        aborted_first + aborted_second,
        "pgbench failures must be exactly the migrations' aborts"
    );
    assert_tpcb_consistent(
        &c,
        "n1",
        processed,
        "after the rollback and the second move",
    );
    let left = leftovers(&c);
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn squall_coordinator_killed_during_the_pulls_finishes_forward() {
    let c = cluster();
    init_tpcb(&c, 1);
    let shard = shard_on_n1(&c);
    let (source, target) = ("n1", "n2");
    let before = accounts_on(&c, source, shard);
    assert!(before.0 > 0);
    let (id, pulled_at_kill, chunks) = kill_while_pulling(&c, shard, target);
    assert!(shard_tables_on(&c, source, shard) > 0);
    // The coordinator started again pulls at the cluster's pace.
    release_slow_pull(&c);
    c.start_coordinator_again().unwrap();
    let (status, error) = wait_ended(&c, "n1", id, Duration::from_secs(180));
    println!(
        "migration {id}: {status} ({error:?}); {pulled_at_kill} of {chunks} chunks pulled at the kill"
    );
    assert_eq!(status, "succeeded", "{error:?}");

    assert_eq!(
        accounts_on(&c, target, shard),
        before,
        "every account of shard {shard}, as it was, on the target"
    );
    let (_, _, aborted, rows_copied) = migration_row(&c, id);
    assert_eq!(aborted, 0);
    assert_eq!(
        rows_copied, before.0,
        "rows_copied counts the chunks pulled before the kill and after it (history is empty)"
    );
    assert_eq!(owners_everywhere(&c, shard), vec![target.to_string(); 3]);
    assert_eq!(
        shard_tables_on(&c, source, shard),
        0,
        "the source's copy is dropped"
    );
    let left = leftovers(&c);
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A statement on the new owner that waits for the pulls while the coordinator is down: once
/// the coordinator is back it gets every row of the shard, and the migration succeeds without
/// aborting it. (`remus.cleanup_drain_timeout` is lowered to 20 s so that a restarted
/// coordinator that drains before it pulls again, which this statement would keep waiting,
/// shows as the statement terminated rather than as a five-minute wait.)
#[test]
fn squall_a_read_waiting_through_the_restart_gets_every_row() {
    let c = cluster();
    init_tpcb(&c, 1);
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        db.batch_execute("ALTER SYSTEM SET remus.cleanup_drain_timeout = '20s'")
            .unwrap();
        db.batch_execute("SELECT pg_reload_conf()").unwrap();
    }
    let shard = shard_on_n1(&c);
    let (source, target) = ("n1", "n2");
    let before = accounts_on(&c, source, shard);
    let (id, _, _) = kill_while_pulling(&c, shard, target);
    // A read of the whole shard table on the new owner: it waits for every chunk left.
    let reader = {
        let mut db = c.connect(target).unwrap();
        std::thread::spawn(move || {
            db.query_one(
                &format!(
                    "SELECT count(*), coalesce(md5(string_agg(x::text, ',' ORDER BY aid)), '')
                       FROM remus_shards.pgbench_accounts_{shard} x"
                ),
                &[],
            )
            .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1)))
        })
    };
    // It waits on the target, asking for the pull (no coordinator pulls).
    let mut watcher = c.connect(target).unwrap();
    remus_test_support::wait_for(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let waiting: i64 = watcher
                .query_one(
                    // Its request for the shard's pull (`migration::squall::ask`).
                    "SELECT count(*) FROM pg_locks
                      WHERE locktype = 'advisory' AND objsubid = 2 AND granted
                        AND classid = ($1::bigint % 2147483647)::oid
                        AND objid >= 2147483648::oid",
                    &[&shard],
                )
                .ok()?
                .get(0);
            (waiting > 0).then_some(())
        },
        || "the read did not ask for the shard's pull on the target".to_string(),
    );
    release_slow_pull(&c);
    c.start_coordinator_again().unwrap();
    let (status, error) = wait_ended(&c, "n1", id, Duration::from_secs(180));
    let (_, _, aborted, _) = migration_row(&c, id);
    let read = reader.join().unwrap();
    println!("migration {id}: {status} ({error:?}), aborted {aborted}; the read: {read:?}");
    assert_eq!(status, "succeeded", "{error:?}");
    assert_eq!(
        read.expect("the read that waited through the restart"),
        before,
        "every account of shard {shard}, as it was"
    );
    assert_eq!(aborted, 0);
    let left = leftovers(&c);
    assert!(left.is_empty(), "left behind: {left:?}");
}
