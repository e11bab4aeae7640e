//! The Remus drain fence (review F7): between Tm and the end of a migration, a write routed to a
//! moved shard's new owner first waits on the source only for the source transactions older
//! than Tm that hold the rows the statement itself writes.
//!
//! Scene (TPC-C's stock, distributed by warehouse): `stock(w, i, q)` keyed by `(w, i)` and
//! sharded by `w`. The migration of w = 1's shard is held at its sync barrier while a source
//! transaction updates the row (1, 1) and stays open; then the migration passes Tm and sits in
//! its cleanup drain (waiting for that transaction). With `remus.drain_wait_timeout` at 10 min:
//! - an UPDATE of another row of the same warehouse, (1, 2), through a third node completes
//!   while the older transaction is still open (the fence locked every row of w = 1 before);
//! - an upsert of (1, 1), and an UPDATE without shard key (sent to every shard), through a
//!   third node wait for the older transaction, which then commits (no 40001), and the newer
//!   write applies on top of it (neither was fenced before); a connection the fence opened to
//!   the source for itself (`application_name` `pg_remus drain`, when the backend had no idle
//!   one there) ends at the session's first transaction end after the fence, not with the
//!   session (F19);
//! - a newer transaction that holds a row on the source (a `warehouse` row, another table) that
//!   the older one then waits for is not held back by that older writer: the older one cannot
//!   go on before the newer one ends (a cycle PostgreSQL's deadlock detector does not see, which
//!   lasted until `remus.drain_wait_timeout`);
//! - an older writer still running its UPDATE of (1, 2) (held inside it, before it locks the
//!   row) holds back a newer UPDATE of (1, 2): the fence's share lock alone would let the newer
//!   one go first and leave the older one a 40001.

use std::thread;
use std::time::Duration;

use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

/// The cluster, mid-cleanup of the migration of w = 1's shard, and what the tests need of it.
struct Drain {
    c: TestCluster,
    /// The node w = 1 leaves (where the older transaction runs).
    source: String,
    /// A node that is neither source nor target: the newer writers enter through it.
    third: String,
    /// The node w = 1 moves to.
    target: String,
    shard: i64,
    /// On the source: open, it has updated (1, 1) before Tm (q 1 -> 11).
    older: postgres::Client,
    /// On the source, when asked for: open, it has read w = 1 before Tm; it holds the
    /// cleanup's drain (and so the fence) after `older` ends.
    reader: Option<postgres::Client>,
    mover: thread::JoinHandle<Result<(String, i64), postgres::Error>>,
}

fn drain_with_an_older_writer_of_1_1() -> Drain {
    drain_scene(false)
}

/// The scene; with `reader`, an older reader of w = 1 too.
fn drain_scene(reader: bool) -> Drain {
    let c = TestCluster::start(3).expect("cluster up");
    c.connect("n1")
        .unwrap()
        .batch_execute(
            "CREATE TABLE stock (w int, i int, q int, PRIMARY KEY (w, i));
             INSERT INTO stock SELECT w, i, 1 FROM generate_series(1, 8) w, generate_series(1, 50) i;
             SELECT remus_create_distributed_table('stock', 'w', 4);
             CREATE TABLE warehouse (w int PRIMARY KEY, ytd int);
             INSERT INTO warehouse SELECT w, 0 FROM generate_series(1, 60) w;
             SELECT remus_create_distributed_table('warehouse', 'w', 6);",
        )
        .unwrap();
    let (shard, source) = owners(&c, "stock")
        .into_iter()
        .find(|(s, o)| {
            let n: i64 = c
                .connect(o)
                .unwrap()
                .query_one(
                    &format!("SELECT count(*) FROM remus_shards.stock_{s} WHERE w = 1"),
                    &[],
                )
                .unwrap()
                .get(0);
            n > 0
        })
        .expect("a shard holds w = 1");
    let others: Vec<String> = c
        .node_names()
        .into_iter()
        .filter(|n| *n != source)
        .collect();
    let (target, third) = (others[0].clone(), others[1].clone());

    // Holds the migration at its sync barrier (a write lock without an xid, see migration_remus).
    let mut barrier = c.connect(&source).unwrap();
    barrier
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE remus_shards.stock_{shard} IN ROW EXCLUSIVE MODE"
        ))
        .unwrap();
    let mut db = c.connect(&source).unwrap();
    let to = target.clone();
    let mover = thread::spawn(move || {
        db.query_one(
            "SELECT status, aborted_by_migration FROM remus_migrate_shard($1, $2)",
            &[&shard, &to],
        )
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
    });
    wait_phase(&c, "barrier");

    let mut older = c.connect(&source).unwrap();
    older
        .batch_execute("BEGIN; UPDATE stock SET q = q + 10 WHERE w = 1 AND i = 1")
        .unwrap();
    let reader = reader.then(|| {
        let mut r = c.connect(&source).unwrap();
        r.batch_execute("BEGIN; SELECT count(*) FROM stock WHERE w = 1")
            .unwrap();
        r
    });
    barrier.batch_execute("COMMIT").unwrap();
    // Tm passes; the cleanup drain then waits for `older`.
    wait_phase(&c, "cleanup");
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(10),
        || owners_everywhere(&c, shard).iter().all(|o| *o == target),
        || format!("Tm never committed on every node for shard {shard}"),
    );
    Drain {
        c,
        source,
        third,
        target,
        shard,
        older,
        reader,
        mover,
    }
}

fn wait_phase(c: &TestCluster, phase: &str) {
    let mut db = c.connect("n1").unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            db.query(
                "SELECT 1 FROM remus_migrations WHERE status = 'running' AND phase = $1",
                &[&phase],
            )
            .unwrap()
            .len()
                == 1
        },
        || format!("the migration never reached {phase}\n{}", c.daemon_logs(40)),
    );
}

/// A session through `node` whose drain fence waits as long as the test runs.
fn patient(c: &TestCluster, node: &str) -> postgres::Client {
    let mut db = c.connect(node).unwrap();
    db.batch_execute("SET remus.drain_wait_timeout = '10min'")
        .unwrap();
    db
}

fn q_on(c: &TestCluster, node: &str, shard: i64, i: i32) -> i32 {
    c.connect(node)
        .unwrap()
        .query_one(
            &format!("SELECT q FROM remus_shards.stock_{shard} WHERE w = 1 AND i = $1"),
            &[&i],
        )
        .unwrap()
        .get(0)
}

fn count(db: &mut postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[]).unwrap().get(0)
}

/// Runs `sql` in `db` on a thread of its own; the session comes back with the outcome.
fn in_background(
    mut db: postgres::Client,
    sql: impl Into<String>,
) -> thread::JoinHandle<(postgres::Client, Result<u64, postgres::Error>)> {
    let sql = sql.into();
    thread::spawn(move || {
        let r = db.execute(&sql, &[]);
        (db, r)
    })
}

/// Waits until a session on `node` waits for a lock with `predicate` (over pg_stat_activity).
fn until_lock_wait(c: &TestCluster, node: &str, predicate: &str, never: impl Fn() -> String) {
    let mut db = c.connect(node).unwrap();
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND {predicate}"
    );
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || count(&mut db, &sql) > 0,
        never,
    );
}

fn finish(d: Drain) -> (TestCluster, String, i64) {
    let (status, aborted) = d.mover.join().unwrap().expect("migration call");
    assert_eq!((status.as_str(), aborted), ("succeeded", 0));
    assert!(
        d.c.migration_artifacts().is_empty(),
        "{:?}",
        d.c.migration_artifacts()
    );
    (d.c, d.target, d.shard)
}

#[test]
fn a_newer_write_of_another_row_of_the_shard_key_does_not_wait_for_an_older_writer() {
    let mut d = drain_with_an_older_writer_of_1_1();
    let mut newer = patient(&d.c, &d.third);
    let update = thread::spawn(move || {
        newer.execute("UPDATE stock SET q = q + 1 WHERE w = 1 AND i = 2", &[])
    });
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || update.is_finished(),
        || {
            format!(
                "the UPDATE of (1, 2) through {} still waits on {} for the older writer of (1, 1)",
                d.third, d.source
            )
        },
    );
    assert_eq!(update.join().unwrap().expect("the newer UPDATE"), 1);
    d.older
        .batch_execute("COMMIT")
        .expect("the older writer commits");
    let (c, target, shard) = finish(d);
    assert_eq!(q_on(&c, &target, shard, 1), 11);
    assert_eq!(q_on(&c, &target, shard, 2), 2);
}

/// Once no older writer is left on the source (only an older reader, which keeps the cleanup's
/// drain, and so the fence, on, and a maintenance lock such as autovacuum's), a fenced write
/// asks the source's lock table instead of waiting there: entered on the source itself, it
/// opens no session to it (the fence's own `pg_remus drain` connection). While the older writer
/// still holds the shard, the same write entered on the source takes the fence's long way, in a
/// session of its own. Entered on the third node, the question goes over its connection to the
/// source; each write applies.
#[test]
fn a_newer_write_asks_the_source_lock_table_once_no_older_writer_is_left() {
    let mut d = drain_scene(true);
    let mut on_source = d.c.connect(&d.source).unwrap();
    let drains = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pg_remus drain'";
    assert_eq!(count(&mut on_source, drains), 0);
    // The session outlives its write, so its fence connection stays while the fence is on (F19).
    let mut first = patient(&d.c, &d.source);
    assert_eq!(
        first
            .execute("UPDATE stock SET q = q + 100 WHERE w = 1 AND i = 2", &[])
            .expect("a newer write of another row while the older writer is open"),
        1
    );
    assert_eq!(
        count(&mut on_source, drains),
        1,
        "with an older writer open, a write entered on the source fences in a session of its own"
    );
    d.older
        .batch_execute("COMMIT")
        .expect("the older writer commits");
    // Maintenance on the source's copy (autovacuum's lock) is no older writer.
    let mut maintenance = d.c.connect(&d.source).unwrap();
    maintenance
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE remus_shards.stock_{} IN SHARE UPDATE EXCLUSIVE MODE",
            d.shard
        ))
        .unwrap();
    let mut second = patient(&d.c, &d.source);
    assert_eq!(
        second
            .execute("UPDATE stock SET q = q + 100 WHERE w = 1 AND i = 3", &[])
            .expect("a newer write once only the older reader is left"),
        1
    );
    let mut phase = d.c.connect(&d.source).unwrap();
    assert_eq!(
        count(
            &mut phase,
            "SELECT count(*) FROM remus_migrations WHERE status = 'running' AND phase = 'cleanup'"
        ),
        1,
        "the older reader holds the cleanup's drain, so the fence was still on"
    );
    assert_eq!(
        count(&mut on_source, drains),
        1,
        "no older writer left (a vacuum's lock only): \
         the write entered on the source asked its own lock table"
    );
    maintenance.batch_execute("COMMIT").unwrap();
    let mut through_third = patient(&d.c, &d.third);
    assert_eq!(
        through_third
            .execute("UPDATE stock SET q = q + 100 WHERE w = 1 AND i = 4", &[])
            .expect("a newer write through the third node"),
        1
    );
    d.reader
        .take()
        .expect("the scene's reader")
        .batch_execute("COMMIT")
        .expect("the older reader ends");
    drop((first, second, through_third));
    let (c, target, shard) = finish(d);
    assert_eq!(q_on(&c, &target, shard, 1), 11);
    for i in 2..=4 {
        assert_eq!(q_on(&c, &target, shard, i), 101, "row (1, {i})");
    }
}

/// Runs `sql` (which doubles q of (1, 1) and changes `rows` rows) through the third node: its
/// fence must wait on the source for the older writer of (1, 1); that one then commits (no
/// 40001), and `sql` applies on top of it.
fn waits_for_the_older_writer(mut d: Drain, sql: &'static str, rows: u64) {
    // The session outlives its write: the fence's connection must not (F19).
    let write = in_background(patient(&d.c, &d.third), sql);
    until_lock_wait(
        &d.c,
        &d.source,
        // On the backend's own connection to the source when it has an idle one, else on one
        // the fence opens for itself.
        "strpos(query, 'FOR SHARE') > 0 AND application_name IN ('pg_remus drain', 'pg_remus')",
        || format!("{sql:?} did not wait on {} for the older writer", d.source),
    );
    let mut on_source = d.c.connect(&d.source).unwrap();
    assert!(
        !write.is_finished(),
        "{sql:?} went ahead of the older writer"
    );
    d.older
        .batch_execute("COMMIT")
        .expect("the older writer commits (no 40001)");
    let (mut newer, written) = write.join().unwrap();
    assert_eq!(written.expect(sql), rows);
    let (c, target, shard) = finish(d);
    // F19: a connection the fence opened to the source for itself ends at the session's first
    // transaction end after the fence ended (here with the migration), although the session
    // that fenced is still open.
    newer
        .batch_execute("SELECT 1")
        .expect("a statement after the migration");
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(20),
        || {
            count(
                &mut on_source,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pg_remus drain'",
            ) == 0
        },
        || {
            "a drain fence connection to the source outlived the fence and its session's next transaction".to_string()
        },
    );
    drop(newer);
    assert_eq!(
        q_on(&c, &target, shard, 1),
        22,
        "the older write (1 + 10), then {sql:?} on top of it (* 2)"
    );
}

#[test]
fn an_upsert_of_a_row_an_older_writer_holds_waits_for_it() {
    waits_for_the_older_writer(
        drain_with_an_older_writer_of_1_1(),
        "INSERT INTO stock VALUES (1, 1, 100) ON CONFLICT (w, i) DO UPDATE SET q = stock.q * 2",
        1,
    );
}

#[test]
fn an_update_of_every_shard_waits_for_an_older_writer_of_a_moving_one() {
    // No shard key: sent to every shard (8 warehouses), the moved one included.
    waits_for_the_older_writer(
        drain_with_an_older_writer_of_1_1(),
        "UPDATE stock SET q = q * 2 WHERE i = 1",
        8,
    );
}

#[test]
fn a_newer_writer_is_not_held_back_by_an_older_one_that_waits_for_it() {
    not_held_back_by_an_older_writer_waiting_for_it(false);
}

/// The same with the newer transaction entered on the source itself, where the fence first
/// asks the source's own lock table while an older writer is at work (`waited_here`): the
/// older writer waiting for this very backend must not count as at work.
#[test]
fn a_newer_writer_on_the_source_is_not_held_back_by_an_older_one_that_waits_for_it() {
    not_held_back_by_an_older_writer_waiting_for_it(true);
}

fn not_held_back_by_an_older_writer_waiting_for_it(on_source: bool) {
    let mut d = drain_with_an_older_writer_of_1_1();
    // A warehouse (another table, not moving) whose row lives on the source.
    let x: i32 = owners(&d.c, "warehouse")
        .into_iter()
        .filter(|(_, o)| *o == d.source)
        .find_map(|(s, o)| {
            d.c.connect(&o)
                .unwrap()
                .query_one(
                    &format!("SELECT min(w) FROM remus_shards.warehouse_{s}"),
                    &[],
                )
                .unwrap()
                .get::<_, Option<i32>>(0)
        })
        .expect("the source owns a warehouse shard with rows");
    // The newer transaction, through the third node (or the source), first holds warehouse x
    // on the source.
    let mut newer = patient(&d.c, if on_source { &d.source } else { &d.third });
    newer
        .batch_execute(&format!(
            "BEGIN; UPDATE warehouse SET ytd = ytd + 1 WHERE w = {x}"
        ))
        .unwrap();
    // The older one (it holds (1, 1) of the moved shard) now waits for warehouse x, running.
    let older_waits = in_background(
        d.older,
        format!("UPDATE warehouse SET ytd = ytd + 10 WHERE w = {x}"),
    );
    until_lock_wait(&d.c, &d.source, "strpos(query, 'ytd + 10') > 0", || {
        "the older writer never waited for warehouse x".to_string()
    });
    // The newer transaction's write of the moved shard: its fence must not wait for the older
    // writer, which waits for this very transaction.
    let update = in_background(newer, "UPDATE stock SET q = q + 1 WHERE w = 1 AND i = 2");
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || update.is_finished(),
        || {
            format!(
                "the fence of the newer UPDATE of (1, 2) waits on {} for the older writer, \
                 which waits for the newer transaction",
                d.source
            )
        },
    );
    let (mut newer, r) = update.join().unwrap();
    assert_eq!(r.expect("the newer UPDATE"), 1);
    newer.batch_execute("COMMIT").expect("the newer commits");
    let (mut older, r) = older_waits.join().unwrap();
    assert_eq!(r.expect("the older UPDATE of warehouse x"), 1);
    older
        .batch_execute("COMMIT")
        .expect("the older writer commits (no 40001)");
    d.older = older;
    let ytd: i32 =
        d.c.connect(&d.third)
            .unwrap()
            .query_one("SELECT ytd FROM warehouse WHERE w = $1", &[&x])
            .unwrap()
            .get(0);
    assert_eq!(ytd, 11);
    let (c, target, shard) = finish(d);
    assert_eq!(q_on(&c, &target, shard, 1), 11);
    assert_eq!(q_on(&c, &target, shard, 2), 2);
}

/// The fence's recheck: an older writer that is running a statement on the moved shard but
/// does not hold the newer statement's rows yet (here it is blocked, inside its UPDATE of
/// (1, 2), on a lock the test holds) is waited for; the newer write of (1, 2) then follows it.
/// Going ahead at once instead (a recheck that fails, or that skips every blocked writer) lets
/// the older transaction's COMMIT fail with 40001 on the destination.
#[test]
fn a_newer_write_waits_for_an_older_writer_still_running_its_statement() {
    let d = drain_with_an_older_writer_of_1_1();
    // The older transaction's next statement, held inside its scan of (1, 2) before it locks
    // the row: its filter waits for an advisory lock the controller holds.
    let mut controller = d.c.connect(&d.source).unwrap();
    controller
        .batch_execute(
            "CREATE FUNCTION wait_for_controller() RETURNS boolean LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN true; END $$;
             SELECT pg_advisory_lock(4242);",
        )
        .unwrap();
    let older_statement = in_background(
        d.older,
        "UPDATE stock SET q = q + 1 WHERE w = 1 AND i = 2 AND wait_for_controller()",
    );
    until_lock_wait(&d.c, &d.source, "wait_event = 'advisory'", || {
        "the older UPDATE of (1, 2) never waited for the controller's lock".to_string()
    });
    let newer = in_background(
        patient(&d.c, &d.third),
        "UPDATE stock SET q = q + 1 WHERE w = 1 AND i = 2",
    );
    // Its fence's share lock on (1, 2) is granted at once; the recheck must hold it back.
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !newer.is_finished(),
        "the newer UPDATE of (1, 2) went ahead of an older writer still running its statement: {:?}",
        newer.join().unwrap().1
    );
    controller
        .batch_execute("SELECT pg_advisory_unlock(4242)")
        .unwrap();
    let (mut older, r) = older_statement.join().unwrap();
    assert_eq!(r.expect("the older UPDATE of (1, 2)"), 1);
    older
        .batch_execute("COMMIT")
        .expect("the older writer commits (no 40001)");
    let (_newer, r) = newer.join().unwrap();
    assert_eq!(r.expect("the newer UPDATE of (1, 2)"), 1);
    let d = Drain { older, ..d };
    let (c, target, shard) = finish(d);
    assert_eq!(q_on(&c, &target, shard, 1), 11);
    assert_eq!(
        q_on(&c, &target, shard, 2),
        3,
        "1, then the older + 1, then the newer + 1"
    );
}
