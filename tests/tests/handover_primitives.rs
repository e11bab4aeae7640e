//! The node-side handover primitives a migration driver uses, exercised by hand on a real
//! 3-node cluster (no migration runs): the admission gate (wait_remaster), writer abort
//! (lock_abort) with its 40001 on active, idle and 2PC-participant victims, the write fence, and
//! the DDL refusal of a registered migration. Every wait below waits for a state to be reached
//! (a backend seen waiting, a thread finished), never for a duration.

use std::thread;
use std::time::Duration;

use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

fn message(e: &postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_else(|| e.to_string())
}

fn pid(db: &mut postgres::Client) -> i32 {
    db.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0)
}

/// Polls `cond` until it holds; fails the test after two minutes (a hang, not a slow run).
fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    remus_test_support::wait_until(
        Duration::from_secs(120),
        Duration::from_millis(20),
        cond,
        || format!("timed out waiting until {what}"),
    );
}

/// (wait_event_type, wait_event, state, query) of backend `pid`, seen from `db`.
fn activity(
    db: &mut postgres::Client,
    pid: i32,
) -> (Option<String>, Option<String>, Option<String>, String) {
    let r = db
        .query_one(
            "SELECT wait_event_type, wait_event, state, coalesce(query, '') FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

fn waits_at_gate(db: &mut postgres::Client, pid: i32) -> bool {
    let (kind, event, _, _) = activity(db, pid);
    kind.as_deref() == Some("Extension") && event.as_deref() == Some("Extension")
}

fn value(db: &mut postgres::Client, id: i32) -> i32 {
    db.query_one("SELECT v FROM hp WHERE id = $1", &[&id])
        .unwrap()
        .get(0)
}

fn aborts(db: &mut postgres::Client, migration_id: i64) -> i64 {
    db.query_one("SELECT remus.migration_aborts($1)", &[&migration_id])
        .unwrap()
        .get(0)
}

#[test]
fn handover_primitives_on_a_real_cluster() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE hp (id int PRIMARY KEY, v int NOT NULL);
         INSERT INTO hp SELECT i, 0 FROM generate_series(1, 300) i;
         SELECT remus_create_distributed_table('hp', 'id', shard_count => 3);",
    )
    .unwrap();
    // A key whose shard n1 owns, and one whose shard n2 owns.
    let key_on = |db: &mut postgres::Client, node: &str| -> (i32, i64) {
        let r = db
            .query_one(
                "SELECT h.id, s.shard_id FROM generate_series(1, 300) h(id)
                   JOIN remus_shards s ON s.shard_id = remus_shard_id_for('hp', h.id)
                  WHERE s.node_name = $1 ORDER BY h.id LIMIT 1",
                &[&node],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    let (k, sid) = key_on(&mut n1, "n1");
    let (k2, _) = key_on(&mut n1, "n2");
    let (k3, _) = key_on(&mut n1, "n3");
    let shard_table = format!("remus_shards.hp_{sid}");
    let shard_array = format!("ARRAY['{shard_table}'::regclass]");

    // The driver's session on n1: a migration session (exempt from everything below).
    let mut drv = c.connect("n1").unwrap();
    drv.batch_execute("SET remus.migration_session = on")
        .unwrap();

    // ---- Admission gate (wait_remaster) ----
    // In flight: started on n2 before the gate closes on n1; its write to n1's shard arrives
    // afterwards through a forwarded 2PC participant session, which the gate must not hold.
    let mut inflight = c.connect("n2").unwrap();
    inflight.batch_execute("BEGIN; SELECT 1").unwrap();
    // In flight on n1 itself: a client transaction that started before the gate closed.
    let mut inflight1 = c.connect("n1").unwrap();
    inflight1.batch_execute("BEGIN; SELECT 1").unwrap();
    let mut late = c.connect("n1").unwrap();
    let late_pid = pid(&mut late);

    let closed_at: String = drv
        .query_one("SELECT remus.close_gate(101, 600000)::text", &[])
        .unwrap()
        .get(0);
    // The driver counts the in-flight transactions itself.
    let in_flight: i64 = drv
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE backend_type = 'client backend' AND xact_start < $1::text::timestamptz
                AND pid <> pg_backend_pid() AND pid IN ($2, $3)",
            &[&closed_at, &pid(&mut inflight1), &late_pid],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        in_flight, 1,
        "only the transaction begun before closed_at is in flight"
    );

    let late_thread = thread::spawn(move || {
        let r = late.batch_execute(&format!(
            "BEGIN; UPDATE hp SET v = v + 100 WHERE id = {k3}; COMMIT"
        ));
        (late, r)
    });
    wait_until("the new transaction waits at the gate", || {
        waits_at_gate(&mut drv, late_pid)
    });

    // In-flight transactions go on and commit while the gate is closed.
    inflight
        .execute("UPDATE hp SET v = v + 1 WHERE id = $1", &[&k])
        .unwrap();
    inflight
        .execute("UPDATE hp SET v = v + 1 WHERE id = $1", &[&k2])
        .unwrap();
    inflight.batch_execute("COMMIT").unwrap();
    inflight1
        .execute("UPDATE hp SET v = v + 1 WHERE id = $1", &[&k])
        .unwrap();
    inflight1.batch_execute("COMMIT").unwrap();
    assert!(
        waits_at_gate(&mut drv, late_pid),
        "the late transaction is still held after the in-flight ones committed"
    );
    assert!(!late_thread.is_finished());
    assert_eq!(value(&mut drv, k), 2);
    assert_eq!(
        value(&mut drv, k3),
        0,
        "nothing of the held transaction ran"
    );

    // Opening the gate releases it.
    drv.batch_execute("SELECT remus.open_gate(101)").unwrap();
    let (mut late, r) = late_thread.join().unwrap();
    r.expect("the held transaction runs once the gate opens");
    assert_eq!(value(&mut drv, k3), 100);
    late.batch_execute("SELECT 1").unwrap();

    // ---- Writer abort (lock_abort) ----
    drv.batch_execute(&format!(
        "SELECT remus.migration_begin(102, ARRAY[{sid}]::bigint[])"
    ))
    .unwrap();
    let before = value(&mut drv, k);

    // A reader is not a writer: not signalled.
    let mut reader = c.connect("n1").unwrap();
    reader.batch_execute("BEGIN").unwrap();
    reader
        .query_one("SELECT v FROM hp WHERE id = $1", &[&k])
        .unwrap();
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "a reader holds no write lock");
    reader.batch_execute("COMMIT").unwrap();

    // 1. Active statement: the writer sleeps after its UPDATE; its cancel becomes 40001.
    let mut active = c.connect("n1").unwrap();
    let active_pid = pid(&mut active);
    active.batch_execute("BEGIN").unwrap();
    active
        .execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k])
        .unwrap();
    let active_thread = thread::spawn(move || {
        let r = active.batch_execute("SELECT pg_sleep(600)");
        (active, r)
    });
    wait_until("the writer sleeps", || {
        let (_, _, state, query) = activity(&mut drv, active_pid);
        state.as_deref() == Some("active") && query.contains("pg_sleep")
    });
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let (mut active, r) = active_thread.join().unwrap();
    let e = r.expect_err("the sleeping writer is aborted");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert_eq!(
        message(&e),
        "transaction aborted by shard migration 102 (lock_abort); retry the transaction"
    );
    active.batch_execute("ROLLBACK").unwrap();
    assert_eq!(aborts(&mut drv, 102), 1);
    // The mark was for that transaction only.
    active.batch_execute("BEGIN; SELECT 1; COMMIT").unwrap();

    // 2. Idle in transaction: the cancel is ignored, the next statement fails.
    let mut idle = c.connect("n1").unwrap();
    idle.batch_execute("BEGIN").unwrap();
    idle.execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k])
        .unwrap();
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let e = idle
        .batch_execute("SELECT 1")
        .expect_err("the idle victim's next statement fails");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert!(
        message(&e).contains("shard migration 102 (lock_abort)"),
        "{e:?}"
    );
    idle.batch_execute("ROLLBACK").unwrap();
    assert_eq!(aborts(&mut drv, 102), 2);
    idle.batch_execute("BEGIN; SELECT 1; COMMIT").unwrap();

    // 3. Idle, then COMMIT: the commit fails, nothing is written.
    idle.batch_execute("BEGIN").unwrap();
    idle.execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k])
        .unwrap();
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let e = idle
        .batch_execute("COMMIT")
        .expect_err("the victim's COMMIT fails");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    idle.batch_execute("ROLLBACK").unwrap();
    assert_eq!(aborts(&mut drv, 102), 3);

    // 4. A 2PC participant: the transaction is coordinated by n2 and writes n2 and n1's shard;
    // the participant on n1 is the victim, it fails at PREPARE TRANSACTION, and the client of
    // n2 sees 40001.
    let mut coord = c.connect("n2").unwrap();
    coord.batch_execute("BEGIN").unwrap();
    coord
        .execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k])
        .unwrap();
    coord
        .execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k2])
        .unwrap();
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        n, 1,
        "the forwarded participant session holds the lock on n1"
    );
    let e = coord
        .batch_execute("COMMIT")
        .expect_err("the coordinated commit fails");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert!(
        message(&e).contains("shard migration 102 (lock_abort)"),
        "{e:?}"
    );
    assert_eq!(aborts(&mut drv, 102), 4);
    // Nothing committed anywhere, no prepared transaction left, and n2's session still works.
    assert_eq!(value(&mut drv, k), before);
    let k2_before = value(&mut drv, k2);
    coord
        .execute("UPDATE hp SET v = v + 1 WHERE id = $1", &[&k2])
        .unwrap();
    assert_eq!(value(&mut drv, k2), k2_before + 1);
    wait_until("no prepared transaction is left", || {
        c.node_names().iter().all(|n| {
            let mut db = c.connect(n).unwrap();
            db.query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
                .unwrap()
                .get::<_, i64>(0)
                == 0
        })
    });

    // 5. A participant busy in a statement: n2 coordinates, its UPDATE on n1's shard waits
    // for a row lock there. The row lock's holder only holds RowShareLock on the table (a
    // reader for abort_shard_writers); the waiting participant holds RowExclusiveLock and is
    // the one victim; its cancel reaches n2's client as 40001.
    let mut holder = c.connect("n1").unwrap();
    holder
        .batch_execute("SET remus.migration_session = on; BEGIN")
        .unwrap();
    holder
        .execute(
            &format!("SELECT 1 FROM {shard_table} WHERE id = $1 FOR UPDATE"),
            &[&k],
        )
        .unwrap();
    let mut coord = c.connect("n2").unwrap();
    coord.batch_execute("BEGIN").unwrap();
    coord
        .execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k2])
        .unwrap();
    let coord_thread = thread::spawn(move || {
        let r = coord.execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k]);
        (coord, r)
    });
    wait_until("the participant waits for the row lock", || {
        drv.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%UPDATE%hp%'",
            &[],
        )
        .unwrap()
        .get::<_, i64>(0)
            == 1
    });
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "only the blocked participant is a writer");
    let (mut coord, r) = coord_thread.join().unwrap();
    let e = r.expect_err("the blocked participant is aborted");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert!(
        message(&e).contains("shard migration 102 (lock_abort)"),
        "{e:?}"
    );
    coord.batch_execute("ROLLBACK").unwrap();
    holder.batch_execute("ROLLBACK").unwrap();
    assert_eq!(value(&mut drv, k), before);

    // 6. A participant marked while idle inside a savepoint: the coordinator's RELEASE
    // SAVEPOINT is refused there, and the transaction's COMMIT on n2 fails with that 40001
    // (not a generic 25P02).
    let mut coord = c.connect("n2").unwrap();
    coord.batch_execute("BEGIN").unwrap();
    coord
        .execute("UPDATE hp SET v = v + 1000 WHERE id = $1", &[&k])
        .unwrap();
    coord.batch_execute("SAVEPOINT a").unwrap();
    let n: i32 = drv
        .query_one(
            &format!("SELECT remus.abort_shard_writers(102, {shard_array})"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
    let released = coord.batch_execute("RELEASE SAVEPOINT a");
    let e = match released {
        Err(e) => e,
        Ok(()) => coord
            .batch_execute("COMMIT")
            .expect_err("the transaction cannot commit"),
    };
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert!(
        message(&e).contains("shard migration 102 (lock_abort)"),
        "{e:?}"
    );
    let _ = coord.batch_execute("ROLLBACK");
    assert_eq!(value(&mut drv, k), before);

    assert_eq!(aborts(&mut drv, 102), 6, "every victim was counted once");
    let ended: i64 = drv
        .query_one("SELECT remus.migration_end(102)", &[])
        .unwrap()
        .get(0);
    assert_eq!(ended, 6);
    assert_eq!(aborts(&mut drv, 102), 0);
    assert_eq!(
        drv.query_one("SELECT remus.migration_end(102)", &[])
            .unwrap()
            .get::<_, i64>(0),
        0,
        "idempotent"
    );

    // ---- Write fence ----
    drv.batch_execute(&format!("SELECT remus.migration_begin(103, ARRAY[{sid}]::bigint[]); SELECT remus.migration_fence(103)"))
        .unwrap();
    let mut w1 = c.connect("n1").unwrap();
    let e = w1
        .execute("UPDATE hp SET v = v + 1 WHERE id = $1", &[&k])
        .unwrap_err();
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert_eq!(
        message(&e),
        format!("shard {sid} was moved by shard migration 103; retry the transaction")
    );
    // Through another node: the forwarded statement reaches the fenced shard on n1.
    let mut w2 = c.connect("n2").unwrap();
    let e = w2
        .execute("DELETE FROM hp WHERE id = $1", &[&k])
        .unwrap_err();
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    assert!(
        message(&e).contains("was moved by shard migration 103"),
        "{e:?}"
    );
    // COPY FROM straight into the fenced shard table.
    let copy_sql = format!("COPY {shard_table} FROM STDIN");
    // (on its own connection: the client library's protocol state after a refused COPY is not
    // reusable)
    let mut wc = c.connect("n1").unwrap();
    let e = wc
        .copy_in(copy_sql.as_str())
        .map(|_| ())
        .expect_err("COPY into a fenced shard fails");
    assert_eq!(sqlstate(&e), "40001", "{e:?}");
    drop(wc);
    // A non-fenced shard takes writes.
    w1.execute("UPDATE hp SET v = v WHERE id = $1", &[&k2])
        .unwrap();
    // Reads are not fenced.
    assert_eq!(value(&mut w1, k), before);
    assert_eq!(aborts(&mut drv, 103), 3);
    assert_eq!(
        drv.query_one("SELECT remus.migration_end(103)", &[])
            .unwrap()
            .get::<_, i64>(0),
        3
    );
    w1.execute("UPDATE hp SET v = v + 1 WHERE id = $1", &[&k])
        .unwrap();
    assert_eq!(value(&mut drv, k), before + 1);

    // ---- DDL refused while registered ----
    drv.batch_execute(&format!(
        "SELECT remus.migration_begin(104, ARRAY[{sid}]::bigint[])"
    ))
    .unwrap();
    for ddl in [
        format!("ALTER TABLE {shard_table} ADD COLUMN z int"),
        format!("CREATE INDEX ON {shard_table} (v)"),
        format!("TRUNCATE {shard_table}"),
        format!("ALTER TABLE {shard_table} RENAME TO hp_renamed"),
        format!("DROP TABLE {shard_table}"),
        "TRUNCATE hp".to_string(),
        "ALTER TABLE hp ADD COLUMN z int".to_string(),
    ] {
        let e = n1.batch_execute(&ddl).expect_err(&ddl);
        assert_eq!(sqlstate(&e), "55006", "{ddl}: {e:?}");
        assert!(
            message(&e).contains("is being migrated by shard migration 104"),
            "{ddl}: {e:?}"
        );
    }
    // The machinery's own sessions are exempt.
    drv.batch_execute(&format!(
        "CREATE INDEX hp_v_idx ON {shard_table} (v); DROP INDEX remus_shards.hp_v_idx"
    ))
    .unwrap();
    assert_eq!(
        drv.query_one("SELECT remus.migration_end(104)", &[])
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    n1.batch_execute(&format!(
        "CREATE INDEX hp_v_idx ON {shard_table} (v); DROP INDEX remus_shards.hp_v_idx"
    ))
    .unwrap();
    n1.batch_execute("TRUNCATE hp").unwrap();
    assert_eq!(value_count(&mut n1), 0);
}

fn value_count(db: &mut postgres::Client) -> i64 {
    db.query_one("SELECT count(*) FROM hp", &[]).unwrap().get(0)
}
