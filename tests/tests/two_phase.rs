//! Cross-node transactions: 2PC commit, all-or-nothing on failure, in-doubt recovery, and
//! errors / cancels reaching the participants. Real 3-node cluster.

use std::time::{Duration, Instant};

use remus_test_support::cluster::TestCluster;
use remus_test_support::{sqlstate, wait_until};

fn count(db: &mut postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[]).unwrap().get(0)
}

/// A trigger function for a deferred constraint trigger that holds a COMMIT (or a PREPARE
/// TRANSACTION) under way until a cancel arrives. By default it sleeps, and the cancel aborts the
/// commit. Once `swallow.on_cancel` is set it raises the transaction's synchronous_commit
/// instead, so the commit, its WAL record written, waits for a synchronous standby that never
/// connects ([`wait_for_a_standby_that_never_connects`]): PostgreSQL ends that wait on a cancel
/// with a WARNING and the commit stands, as any commit already under way when a cancel arrives.
/// (Catching `query_canceled` in PL/pgSQL instead was racy: one cancel request arrives as two
/// SIGINTs, to the backend and to its process group, and a second one landing between the catch
/// and the next protected block, e.g. at the CHECK_FOR_INTERRUPTS that starts every PL/pgSQL
/// statement, aborted the commit. Two SIGINTs 100-400 µs apart did it by hand.)
const SLOW_COMMIT: &str = "CREATE TABLE public.swallow (on_cancel bool);
     INSERT INTO public.swallow VALUES (false);
     CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
     BEGIN
         IF (SELECT on_cancel FROM public.swallow) THEN
             PERFORM set_config('synchronous_commit', 'on', true);
         ELSE
             PERFORM pg_sleep(30);
         END IF;
         RETURN NULL;
     END $$;";

/// `pg_stat_activity` rows of a commit held by `slow_commit()`, in either of its ways.
const HELD_AT_COMMIT: &str = "wait_event IN ('PgSleep', 'SyncRep')";

/// Names a synchronous standby that never connects on `node`, for [`SLOW_COMMIT`], and
/// restarts it so that every process (the checkpointer publishes the setting to committing
/// backends) has read it. Commits there do not wait unless their transaction asks for it:
/// synchronous_commit is `local` by default.
fn wait_for_a_standby_that_never_connects(c: &TestCluster, node: &str) {
    let mut db = c.connect(node).unwrap();
    db.batch_execute("ALTER SYSTEM SET synchronous_standby_names = 'never_connects'")
        .unwrap();
    db.batch_execute("ALTER SYSTEM SET synchronous_commit = local")
        .unwrap();
    drop(db);
    c.stop_node(node).unwrap();
    c.start_node(node).unwrap();
}

/// Runs `sql` in a new session on n1, cancels that session once `under_way` (a count on n2)
/// finds a row, and returns how `sql` ended.
fn cancel_once_under_way(
    c: &TestCluster,
    sql: &str,
    under_way: &str,
    never: &str,
) -> Result<(), postgres::Error> {
    let mut session = c.connect("n1").unwrap();
    let pid: i32 = session
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    let sql = sql.to_string();
    let running = std::thread::spawn(move || session.batch_execute(&sql));
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(20),
        || count(&mut n2, under_way) > 0,
        || never.to_string(),
    );
    let cancelled: bool = n1
        .query_one("SELECT pg_cancel_backend($1)", &[&pid])
        .unwrap()
        .get(0);
    assert!(cancelled);
    running.join().unwrap()
}

#[test]
fn cross_node_transactions_are_atomic() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    for db in [&mut n1, &mut n2] {
        db.batch_execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
            .unwrap();
    }
    n2.batch_execute(
        "CREATE TABLE d (id int, CONSTRAINT d_u UNIQUE (id) DEFERRABLE INITIALLY DEFERRED);
         INSERT INTO d VALUES (1);",
    )
    .unwrap();

    // Commit: writes on n1 and n2 both land, through PREPARE / COMMIT PREPARED.
    n1.batch_execute(
        "BEGIN; INSERT INTO t VALUES (1, 'local');
         SELECT remus_run_on_node('n2', 'INSERT INTO public.t VALUES (2, ''remote'')');
         COMMIT;",
    )
    .unwrap();
    assert_eq!(count(&mut n1, "SELECT count(*) FROM t WHERE id = 1"), 1);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM t WHERE id = 2"), 1);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts"), 0);

    // The remote count of affected rows comes back.
    let affected: i64 = n1
        .query_one(
            "SELECT remus_run_on_node('n2', 'UPDATE public.t SET v = ''x''')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(affected, 1);

    // A participant that fails at PREPARE (deferred unique violation) aborts everything.
    let err = n1
        .batch_execute(
            "BEGIN; INSERT INTO t VALUES (3, 'local');
             SELECT remus_run_on_node('n2', 'INSERT INTO public.d VALUES (1)');
             COMMIT;",
        )
        .unwrap_err();
    assert_eq!(sqlstate(&err), "23505", "{err:?}");
    assert!(format!("{err:?}").contains("raised on node n2"), "{err:?}");
    let _ = n1.batch_execute("ROLLBACK");
    assert_eq!(count(&mut n1, "SELECT count(*) FROM t WHERE id = 3"), 0);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM d"), 1);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts"), 0);

    // ROLLBACK reaches the participant.
    n1.batch_execute(
        "BEGIN; INSERT INTO t VALUES (4, 'local');
         SELECT remus_run_on_node('n2', 'INSERT INTO public.t VALUES (4, ''remote'')');
         ROLLBACK;",
    )
    .unwrap();
    assert_eq!(count(&mut n1, "SELECT count(*) FROM t WHERE id = 4"), 0);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM t WHERE id = 4"), 0);

    // Remote errors keep their SQLSTATE; bad input is refused with its own.
    let e = n1
        .query_one("SELECT remus_run_on_node('n2', 'SELECT 1/0')", &[])
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22012");
    let e = n1
        .query_one("SELECT remus_run_on_node('n1', 'SELECT 1')", &[])
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22023");
    let e = n1
        .query_one("SELECT remus_run_on_node('n9', 'SELECT 1')", &[])
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42704");

    // A statement timeout cancels the remote command too.
    n1.batch_execute("SET statement_timeout = '500ms'").unwrap();
    let t0 = Instant::now();
    let e = n1
        .query_one("SELECT remus_run_on_node('n2', 'SELECT pg_sleep(60)')", &[])
        .unwrap_err();
    assert_eq!(sqlstate(&e), "57014");
    assert!(t0.elapsed() < Duration::from_secs(30));
    n1.batch_execute("RESET statement_timeout").unwrap();
    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            count(&mut n2, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(60)%' AND state = 'active' AND pid <> pg_backend_pid()") == 0
        },
        || "remote pg_sleep was not cancelled".into(),
    );
}

#[test]
fn in_doubt_transactions_follow_the_recorded_decision() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute("CREATE TABLE r (id int PRIMARY KEY)")
        .unwrap();
    // Two transactions left prepared on n2 as if n1 had crashed between PREPARE and COMMIT
    // PREPARED: one whose decision n1 recorded (commit), one without a record (roll back).
    // Their xids are finished transactions of n1.
    let xid_commit: String = n1
        .query_one("SELECT txid_current()::text", &[])
        .unwrap()
        .get(0);
    let xid_abort: String = n1
        .query_one("SELECT txid_current()::text", &[])
        .unwrap()
        .get(0);
    let gid_commit = format!("remus_n1_{xid_commit}_n2");
    let gid_abort = format!("remus_n1_{xid_abort}_n2");
    n2.batch_execute(&format!(
        "BEGIN; INSERT INTO r VALUES (1); PREPARE TRANSACTION '{gid_commit}'"
    ))
    .unwrap();
    n2.batch_execute(&format!(
        "BEGIN; INSERT INTO r VALUES (2); PREPARE TRANSACTION '{gid_abort}'"
    ))
    .unwrap();
    n1.execute(
        "INSERT INTO remus.commit_decisions (gid, participant) VALUES ($1, 'n2')",
        &[&gid_commit],
    )
    .unwrap();

    // n1's recovery worker resolves both by its recorded decisions, without being asked.
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts") == 0,
        || "in-doubt transactions not resolved within a minute".into(),
    );
    let ids: Vec<i32> = n2
        .query("SELECT id FROM r", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec![1]);
    // Nothing is left for a manual round.
    let row = n1
        .query_one(
            "SELECT committed, rolled_back, in_progress FROM remus_recover_prepared()",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2)
        ),
        (0, 0, 0)
    );
    // Decision rows of finished work are cleaned up.
    assert_eq!(
        count(&mut n1, "SELECT count(*) FROM remus.commit_decisions"),
        0
    );
}

/// A client that disappears mid-transaction does not leave its remote work holding locks.
#[test]
fn a_vanished_client_releases_remote_locks() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute("CREATE TABLE k (id int PRIMARY KEY, v int); SELECT remus_create_distributed_table('k', 'id', 3); INSERT INTO k VALUES (1, 0), (2, 0), (3, 0);").unwrap();
    // A key owned by another node than n1.
    let id: i32 = n1
        .query_one("SELECT min(id) FROM k WHERE (SELECT node_name FROM remus_shards s WHERE s.shard_id = remus_shard_id_for('k', k.id)) <> 'n1'", &[])
        .unwrap()
        .get(0);
    {
        let mut doomed = c.connect("n1").unwrap();
        doomed
            .batch_execute(&format!("BEGIN; UPDATE k SET v = 1 WHERE id = {id};"))
            .unwrap();
        // Dropped without COMMIT or ROLLBACK: the connection just closes.
    }
    let mut other = c.connect("n2").unwrap();
    other.batch_execute("SET lock_timeout = '20s'").unwrap();
    let t0 = Instant::now();
    assert_eq!(
        other
            .execute(&format!("UPDATE k SET v = 2 WHERE id = {id}"), &[])
            .unwrap(),
        1
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
    let v: i32 = other
        .query_one(&format!("SELECT v FROM k WHERE id = {id}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(v, 2, "the vanished client's update must not have committed");
}

/// Savepoints and PL/pgSQL exception blocks roll back remote work too.
#[test]
fn subtransactions_reach_the_participants() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute("CREATE TABLE s (id int PRIMARY KEY, v int); SELECT remus_create_distributed_table('s', 'id', 3);").unwrap();
    n1.batch_execute("INSERT INTO s VALUES (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0)")
        .unwrap();
    let remote: Vec<i32> = n1
        .query("SELECT id FROM s WHERE (SELECT node_name FROM remus_shards r WHERE r.shard_id = remus_shard_id_for('s', s.id)) <> 'n1' ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        remote.len() >= 2,
        "need two keys owned by other nodes: {remote:?}"
    );
    let (a, b) = (remote[0], remote[1]);
    let v = |db: &mut postgres::Client, id: i32| -> i32 {
        db.query_one("SELECT v FROM s WHERE id = $1", &[&id])
            .unwrap()
            .get(0)
    };

    // ROLLBACK TO SAVEPOINT undoes the remote update made after it, keeps the one before.
    n1.batch_execute(&format!(
        "BEGIN; UPDATE s SET v = 1 WHERE id = {a}; SAVEPOINT p; UPDATE s SET v = 2 WHERE id = {a}; ROLLBACK TO SAVEPOINT p; COMMIT;"
    ))
    .unwrap();
    assert_eq!(v(&mut n1, a), 1);

    // A participant first used inside a savepoint gets the savepoint too.
    n1.batch_execute(&format!(
        "BEGIN; SAVEPOINT p; UPDATE s SET v = 7 WHERE id = {b}; ROLLBACK TO SAVEPOINT p; UPDATE s SET v = 3 WHERE id = {a}; COMMIT;"
    ))
    .unwrap();
    assert_eq!((v(&mut n1, a), v(&mut n1, b)), (3, 0));

    // PL/pgSQL exception blocks are subtransactions.
    n1.batch_execute(&format!(
        "DO $$ BEGIN
             UPDATE s SET v = 5 WHERE id = {a};
             BEGIN
                 UPDATE s SET v = 6 WHERE id = {a};
                 UPDATE s SET v = 6 WHERE id = {b};
                 PERFORM 1 / 0;
             EXCEPTION WHEN division_by_zero THEN NULL;
             END;
         END $$;"
    ))
    .unwrap();
    assert_eq!((v(&mut n1, a), v(&mut n1, b)), (5, 0));
    let mut n2 = c.connect("n2").unwrap();
    assert_eq!(
        (v(&mut n2, a), v(&mut n2, b)),
        (5, 0),
        "seen through another node"
    );
}

/// A participant that is down while the coordinator's recovery runs keeps its in-doubt
/// transaction's decision: after it comes back, the transaction commits.
#[test]
fn decisions_survive_an_unreachable_participant() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute("CREATE TABLE r (id int PRIMARY KEY)")
        .unwrap();
    let xid: String = n1
        .query_one("SELECT txid_current()::text", &[])
        .unwrap()
        .get(0);
    let gid = format!("remus_n1_{xid}_n2");
    n2.batch_execute(&format!(
        "BEGIN; INSERT INTO r VALUES (7); PREPARE TRANSACTION '{gid}'"
    ))
    .unwrap();
    drop(n2);
    c.stop_node("n2").unwrap();
    n1.execute(
        "INSERT INTO remus.commit_decisions (gid, participant) VALUES ($1, 'n2')",
        &[&gid],
    )
    .unwrap();
    // Several recovery rounds (every 2 s) pass while n2 is unreachable.
    std::thread::sleep(Duration::from_secs(7));
    let kept: i64 = n1
        .query_one(
            "SELECT count(*) FROM remus.commit_decisions WHERE gid = $1",
            &[&gid],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        kept, 1,
        "the decision of an unreachable participant was dropped"
    );
    c.start_node("n2").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts") == 0,
        || "not resolved within a minute".into(),
    );
    assert_eq!(
        count(&mut n2, "SELECT count(*) FROM r WHERE id = 7"),
        1,
        "the decided commit was rolled back"
    );
}

/// A COMMIT interrupted while a participant is still running its PREPARE (a cancel, a
/// statement_timeout, a lock_abort migration aborting the coordinator) must roll back the
/// participant even when that PREPARE completes anyway: an orphan prepared transaction would
/// hold its row locks until recovery's grace period (5 s) and stall every writer of those rows.
#[test]
fn a_commit_interrupted_during_prepare_leaves_nothing_prepared() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .unwrap();
    // On n2 the PREPARE runs a deferred trigger that makes it wait for a synchronous standby
    // that never connects (see SLOW_COMMIT): a cancel ends that wait and the PREPARE stands, so
    // it completes even after the coordinator's abort path has cancelled it.
    wait_for_a_standby_that_never_connects(&c, "n2");
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY);
         CREATE FUNCTION slow_prepare() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM set_config('synchronous_commit', 'on', true);
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW EXECUTE FUNCTION slow_prepare();",
    )
    .unwrap();
    let err = cancel_once_under_way(
        &c,
        "BEGIN; INSERT INTO t VALUES (1);
         SELECT remus_run_on_node('n2', 'INSERT INTO public.t VALUES (1)');
         COMMIT;",
        "SELECT count(*) FROM pg_stat_activity
          WHERE query LIKE 'PREPARE TRANSACTION%' AND wait_event = 'SyncRep'",
        "the participant never started its PREPARE",
    )
    .unwrap_err();
    assert_eq!(sqlstate(&err), "57014", "{err:?}");
    // The coordinator's session has finished its abort processing when the error reaches the
    // client (ReadyForQuery follows it), well inside recovery's grace period.
    assert_eq!(
        count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts"),
        0,
        "an orphan prepared transaction was left on n2"
    );
    assert_eq!(count(&mut n1, "SELECT count(*) FROM t"), 0);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM t"), 0);
}

/// A lone remote writer commits with a plain COMMIT, and that COMMIT decides the transaction.
/// A cancel arriving during it goes to the participant, and the client hears what the
/// participant did: "canceled" only when nothing committed, success when its COMMIT went
/// through anyway. Raising the cancel locally instead told the client "canceled" for a
/// transaction whose write was committed on the participant.
#[test]
fn a_cancel_during_a_lone_remote_commit_reports_what_the_participant_did() {
    let c = TestCluster::start(2).expect("cluster up");
    wait_for_a_standby_that_never_connects(&c, "n2");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    n1.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .unwrap();
    // n2's COMMIT runs a deferred trigger that holds it; `swallow` decides whether it survives
    // the cancel (then the COMMIT completes) or lets it abort the COMMIT.
    n2.batch_execute(&format!(
        "CREATE TABLE t (id int PRIMARY KEY);
         {SLOW_COMMIT}
         CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW EXECUTE FUNCTION slow_commit();"
    ))
    .unwrap();

    let commit_cancelled = |id: i32| {
        cancel_once_under_way(
            &c,
            &format!("BEGIN; SELECT remus_run_on_node('n2', 'INSERT INTO public.t VALUES ({id})'); COMMIT;"),
            &format!("SELECT count(*) FROM pg_stat_activity WHERE query = 'COMMIT' AND {HELD_AT_COMMIT}"),
            "the participant never started its COMMIT",
        )
    };

    // The participant's COMMIT fails on the cancel: the client gets the cancel, nothing is kept.
    let err = commit_cancelled(1).expect_err("the COMMIT was cancelled on the participant");
    assert_eq!(sqlstate(&err), "57014", "{err:?}");
    assert_eq!(count(&mut n2, "SELECT count(*) FROM t"), 0);

    // The participant's COMMIT survives the cancel: the client is told it committed.
    n2.batch_execute("UPDATE swallow SET on_cancel = true")
        .unwrap();
    commit_cancelled(2).expect("the participant committed, so the client must hear COMMIT succeed");
    assert_eq!(count(&mut n2, "SELECT count(*) FROM t WHERE id = 2"), 1);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts"), 0);
    assert_eq!(count(&mut n1, "SELECT count(*) FROM t"), 0);
}

/// An autocommit write through a node that does not own its shard is the owner's transaction
/// of its own (one round trip: no remote BEGIN, no COMMIT). A cancel that reaches the entry
/// while it runs is forwarded, and the client hears what the owner did: the cancel when the
/// owner rolled the write back, success when the owner committed it anyway (its commit was
/// under way). The owner's shard table has a deferred trigger that sleeps at commit and
/// either survives a cancel or not.
#[test]
fn a_cancelled_autocommit_write_through_a_non_owner_reports_what_the_owner_did() {
    let c = TestCluster::start(2).expect("cluster up");
    wait_for_a_standby_that_never_connects(&c, "n2");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    let rows: Vec<String> = (1..=20).map(|id| format!("({id}, 0)")).collect();
    n1.batch_execute(&format!(
        "CREATE TABLE w (id int PRIMARY KEY, v int);
         SELECT remus_create_distributed_table('w', 'id', 2);
         INSERT INTO w VALUES {};",
        rows.join(", ")
    ))
    .unwrap();
    let r = n1
        .query_one(
            "SELECT g, s.shard_id FROM generate_series(1, 20) g
               JOIN remus_shards s ON s.shard_id = remus_shard_id_for('w', g)
              WHERE s.node_name = 'n2' ORDER BY g LIMIT 1",
            &[],
        )
        .unwrap();
    let (id, shard): (i32, i64) = (r.get(0), r.get(1));
    n2.batch_execute(&format!(
        "{SLOW_COMMIT}
         CREATE CONSTRAINT TRIGGER slow AFTER UPDATE ON remus_shards.w_{shard}
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();"
    ))
    .unwrap();
    let value = |n2: &mut postgres::Client| {
        n2.query_one(
            &format!("SELECT v FROM remus_shards.w_{shard} WHERE id = $1"),
            &[&id],
        )
        .unwrap()
        .get::<_, i32>(0)
    };
    let update_cancelled = || {
        cancel_once_under_way(
            &c,
            &format!("UPDATE w SET v = v + 1 WHERE id = {id}"),
            &format!("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%UPDATE%' AND {HELD_AT_COMMIT}"),
            "the owner never reached the write's commit",
        )
    };

    // The owner's commit fails on the cancel: the client gets the cancel, nothing is kept.
    let err = update_cancelled().expect_err("the write was cancelled on its owner");
    assert_eq!(sqlstate(&err), "57014", "{err:?}");
    assert_eq!(value(&mut n2), 0, "the cancelled write was rolled back");

    // The owner's commit survives the cancel: the client is told the write succeeded.
    n2.batch_execute("UPDATE swallow SET on_cancel = true")
        .unwrap();
    update_cancelled().expect("the owner committed, so the client must hear the write succeed");
    assert_eq!(value(&mut n2), 1, "the write the owner committed");
    // The entry's session goes on: the cancel was spent on the write.
    assert_eq!(count(&mut n1, "SELECT count(*) FROM w WHERE v = 1"), 1);
    assert_eq!(count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts"), 0);
}

/// A participant prepared for a transaction its coordinator never assigned: after a crash that
/// lost the coordinating transaction's only WAL (decision rows never flushed, no commit
/// record), its xid lies ahead of the restarted coordinator's counter. The coordinator's
/// recovery rolls it back; it used to take the xid for a running one (PostgreSQL's
/// `TransactionIdIsInProgress` says so for an xid past the latest completed one) and leave it
/// prepared, with its row locks, until the node assigned xids past it (a node without writes:
/// forever; `pgbench_tpcb::a_killed_node_loses_nothing…` hung on it in a CI run). The state is
/// made directly: a transaction prepared on n2 under a gid naming an xid far ahead of n1's.
#[test]
fn a_participant_of_a_coordinating_xid_lost_in_a_crash_is_rolled_back() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .unwrap();
    let ahead: i64 = n1
        .query_one("SELECT (txid_current() % 4294967296) + 100000", &[])
        .unwrap()
        .get(0);
    n2.batch_execute(&format!(
        "BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION 'remus_n1_{ahead}_n2'"
    ))
    .unwrap();
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(500),
        || count(&mut n2, "SELECT count(*) FROM pg_prepared_xacts") == 0,
        || format!("remus_n1_{ahead}_n2 is still prepared on n2 after a minute"),
    );
    assert_eq!(
        count(&mut n2, "SELECT count(*) FROM t"),
        0,
        "rolled back, not committed"
    );
}
