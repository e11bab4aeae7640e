//! Issue 16 item 4 through every protocol: a routed statement keeps the semantics of a statement
//! on one PostgreSQL whichever node it enters and however it is sent (simple query, extended
//! protocol with an unnamed statement, a named prepared statement under a generic plan).
//!
//! - `statement_timeout` and a cancel of a single-shard statement stop it where it runs: on the
//!   owner it is the entry's own local plan; through a non-owner the owner's statement is
//!   cancelled too (it does not run on after the client got its error).
//! - A client that disappears (SIGKILL: no cancel request, no Terminate) while its statement
//!   runs, while it runs in a transaction that wrote the row on the owner, or between two
//!   statements of that transaction, leaves nothing behind: with the client's
//!   `client_connection_check_interval` set (as one PostgreSQL needs to stop a running statement
//!   of a lost client) the entry's backend ends, so does the owner's session that ran the
//!   statement for it, and the row is unlocked with its write rolled back.
//! - A statement on a shard table this node does not own in the statement's snapshot is refused
//!   with RM001 in every protocol; on the owner it runs.
//! - A scrollable cursor over a statement on one shard group fetches backward (a Material node
//!   over the router node, which reads forward only).

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use integration::protocol::{explain, query, Protocol, PROTOCOLS};
use postgres::Client;
use remus_test_support::cluster::TestCluster;
use remus_test_support::{sqlstate, wait_until};

/// Runs `sql` (with `$1` = `key`) on `db` in `protocol`; Ok(number of rows) or the error.
fn run(db: &mut Client, protocol: Protocol, sql: &str, key: i64) -> Result<usize, postgres::Error> {
    query(db, protocol, sql, &[key]).map(|rows| rows.len())
}

/// A 3-node cluster with `kv` over 4 shards holding rows 1..=200, and a key whose shard n1
/// owns, with that shard's id.
fn cluster_and_a_key_on_n1() -> (TestCluster, i64, i64) {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv (k bigint PRIMARY KEY, v text NOT NULL);
         SELECT remus_create_distributed_table('kv', 'k', 4);",
    )
    .unwrap();
    n1.batch_execute(&format!(
        "INSERT INTO kv VALUES {}",
        (1..=200)
            .map(|k| format!("({k}, 'v{k}')"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
    .unwrap();
    let r = n1
        .query_one(
            "SELECT k::bigint, s.shard_id FROM generate_series(1, 10000) k
               JOIN remus_shards s ON s.shard_id = remus_shard_id_for('kv', k)
              WHERE s.node_name = 'n1' ORDER BY k LIMIT 1",
            &[],
        )
        .unwrap();
    (c, r.get(0), r.get(1))
}

/// Sessions on `node` (other than the caller's) whose last statement contains `marker`, in
/// `state` (`active`: running it), or in any state.
fn sessions(c: &TestCluster, node: &str, marker: &str, state: Option<&str>) -> i64 {
    c.connect(node)
        .unwrap()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
              WHERE ($2::text IS NULL OR state = $2) AND pid <> pg_backend_pid()
                AND query LIKE '%' || $1 || '%'",
            &[&marker, &state],
        )
        .unwrap()
        .get(0)
}

/// Sessions on `node` (other than the caller's) running a statement that contains `marker`.
fn running(c: &TestCluster, node: &str, marker: &str) -> i64 {
    sessions(c, node, marker, Some("active"))
}

/// Waits until no session on `node` runs a statement containing `marker`.
fn ends_on(c: &TestCluster, node: &str, marker: &str, what: &str) {
    wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || running(c, node, marker) == 0,
        || format!("{what}: the statement still runs on {node}"),
    );
}

#[test]
fn timeouts_and_cancels_stop_a_routed_statement_where_it_runs() {
    let (c, key, _) = cluster_and_a_key_on_n1();
    for entry in ["n1", "n2"] {
        for protocol in PROTOCOLS {
            let what = format!("through {entry}, {protocol:?}");
            // A marker per case, so that a statement left running by an earlier case cannot
            // pass for (or hide) this one's.
            let tag = format!("{entry}_{protocol:?}").to_lowercase();
            let sql = format!("SELECT pg_sleep(60) AS timeout_{tag} FROM kv WHERE k = $1");

            // statement_timeout.
            let mut db = c.connect(entry).unwrap();
            db.batch_execute("SET statement_timeout = '300ms'").unwrap();
            let t0 = Instant::now();
            let e = run(&mut db, protocol, &sql, key).expect_err(&what);
            assert_eq!(sqlstate(&e), "57014", "statement_timeout {what}: {e}");
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "statement_timeout {what} took {:?}",
                t0.elapsed()
            );
            ends_on(
                &c,
                "n1",
                &format!("timeout_{tag}"),
                &format!("timeout {what}"),
            );
            // The session goes on.
            db.batch_execute("RESET statement_timeout").unwrap();
            assert_eq!(
                run(&mut db, protocol, "SELECT v FROM kv WHERE k = $1", key).unwrap(),
                1,
                "the next statement {what}"
            );

            // A cancel, once the statement runs on the owner.
            let sql = format!("SELECT pg_sleep(60) AS cancel_{tag} FROM kv WHERE k = $1");
            let mut db = c.connect(entry).unwrap();
            let pid: i32 = db.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
            let session = std::thread::spawn(move || run(&mut db, protocol, &sql, key));
            let marker = format!("cancel_{tag}");
            wait_until(
                Duration::from_secs(30),
                Duration::from_millis(20),
                || running(&c, "n1", &marker) > 0,
                || format!("cancel {what}: the statement never ran on n1"),
            );
            let cancelled: bool = c
                .connect(entry)
                .unwrap()
                .query_one("SELECT pg_cancel_backend($1)", &[&pid])
                .unwrap()
                .get(0);
            assert!(cancelled, "cancel {what}: no such backend");
            let e = session.join().unwrap().expect_err(&what);
            assert_eq!(sqlstate(&e), "57014", "cancel {what}: {e}");
            ends_on(&c, "n1", &marker, &format!("cancel {what}"));
        }
    }
}

#[test]
fn a_shard_table_is_refused_where_the_statement_sees_another_owner_in_every_protocol() {
    let (c, key, shard) = cluster_and_a_key_on_n1();
    let sql = format!("SELECT v FROM remus_shards.kv_{shard} WHERE k = $1");
    for protocol in PROTOCOLS {
        let mut db = c.connect("n1").unwrap();
        assert_eq!(
            run(&mut db, protocol, &sql, key).unwrap(),
            1,
            "the shard table on its owner, {protocol:?}"
        );
        // The statement's snapshot names n2 as the owner (an uncommitted change of the map, as
        // a migration's flip would make it): the shard table here is a copy it must not use.
        db.batch_execute(&format!(
            "BEGIN; UPDATE remus.shard_map SET node_name = 'n2' WHERE shard_id = {shard}"
        ))
        .unwrap();
        let e = run(&mut db, protocol, &sql, key).expect_err("a shard n2 owns, read on n1");
        assert_eq!(sqlstate(&e), "RM001", "{protocol:?}: {e}");
        db.batch_execute("ROLLBACK").unwrap();
        assert_eq!(
            run(&mut db, protocol, &sql, key).unwrap(),
            1,
            "after the rollback, {protocol:?}"
        );
    }
}

#[test]
fn a_scrollable_cursor_on_one_shard_group_fetches_backward() {
    let (c, key, _) = cluster_and_a_key_on_n1();
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv_log (k bigint, id int, PRIMARY KEY (k, id));
         SELECT remus_create_distributed_table('kv_log', 'k', 4, colocate_with => 'kv');",
    )
    .unwrap();
    n1.batch_execute(&format!(
        "INSERT INTO kv_log VALUES ({key}, 1), ({key}, 2), ({key}, 3), ({key}, 4)"
    ))
    .unwrap();
    let ids = |db: &mut Client, sql: &str| -> Vec<i32> {
        db.query(sql, &[])
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    for entry in ["n1", "n2"] {
        let mut db = c.connect(entry).unwrap();
        // Twice: the first statement of a backend finds its map cache empty at plan time.
        for _ in 0..2 {
            db.batch_execute(&format!(
                "BEGIN; DECLARE c SCROLL CURSOR FOR SELECT id FROM kv_log WHERE k = {key} ORDER BY id"
            ))
            .unwrap();
            assert_eq!(
                ids(&mut db, "FETCH 3 FROM c"),
                vec![1, 2, 3],
                "through {entry}"
            );
            assert_eq!(
                ids(&mut db, "FETCH BACKWARD 2 FROM c"),
                vec![2, 1],
                "backward through {entry}"
            );
            assert_eq!(
                ids(&mut db, "FETCH LAST FROM c"),
                vec![4],
                "last through {entry}"
            );
            db.batch_execute("COMMIT").unwrap();
        }
        // EXPLAIN VERBOSE resolves the Material node's columns.
        let plan = explain(
            &mut db,
            "VERBOSE, COSTS OFF",
            &format!("DECLARE c SCROLL CURSOR FOR SELECT id FROM kv_log WHERE k = {key}"),
        );
        assert!(plan.contains("Materialize"), "through {entry}:\n{plan}");
    }
}

/// A `psql` client of `node` reading `sql` from its stdin, which stays open: killed with
/// SIGKILL, it leaves without a cancel request or a Terminate message, as a client whose
/// process or machine dies.
fn psql(c: &TestCluster, node: &str, sql: &str) -> Child {
    let state = c.state().unwrap();
    let conninfo = state
        .node(node)
        .unwrap()
        .conninfo(&state.password().unwrap());
    let mut child = Command::new(remusctl::cluster::pg_bindir().join("psql"))
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", &conninfo])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn psql");
    let stdin = child.stdin.as_mut().expect("psql stdin");
    stdin.write_all(sql.as_bytes()).unwrap();
    stdin.flush().unwrap();
    child
}

#[test]
fn a_lost_client_stops_the_statement_on_every_participant() {
    let (c, key, _) = cluster_and_a_key_on_n1();
    // What the client is doing when it disappears: running a statement, running one in a
    // transaction that already wrote the row on the owner (which holds its lock), or waiting
    // between statements of such a transaction.
    let cases = [
        ("running", false, true),
        ("running_in_transaction", true, true),
        ("idle_in_transaction", true, false),
    ];
    for entry in ["n1", "n2"] {
        for (case, in_transaction, running_one) in cases {
            let what = format!("through {entry}, {case}");
            let marker = format!("lost_{entry}_{case}");
            // The client asks for its connection to be checked while a statement runs, as it
            // must on one PostgreSQL for a lost client to stop a running statement: with the
            // default 0 the loss is noticed at the next write to the client.
            let mut sql = "SET client_connection_check_interval = '100ms';\n".to_string();
            if in_transaction {
                // The marker as a function's argument: a constant routed to another node as a
                // SET value would go as a parameter (design note 0002), out of the owner's
                // pg_stat_activity.query that `sessions` reads.
                sql += &format!("BEGIN;\nUPDATE kv SET v = lower('{marker}') WHERE k = {key};\n");
            }
            if running_one {
                sql += &format!("SELECT pg_sleep(60) AS {marker} FROM kv WHERE k = {key};\n");
            }
            let state = if running_one {
                "active"
            } else {
                "idle in transaction"
            };
            let mut client = psql(&c, entry, &sql);
            wait_until(
                Duration::from_secs(30),
                Duration::from_millis(20),
                || {
                    sessions(&c, "n1", &marker, Some(state)) > 0
                        && sessions(&c, entry, &marker, Some(state)) > 0
                },
                || format!("{what}: the client's statement never reached n1"),
            );
            client.kill().unwrap();
            client.wait().unwrap();

            // The entry's backend, and the owner's that ran the statement for it, are gone.
            for node in ["n1", entry] {
                wait_until(
                    Duration::from_secs(30),
                    Duration::from_millis(50),
                    || sessions(&c, node, &marker, None) == 0,
                    || format!("{what}: a session that ran the statement is still on {node}"),
                );
            }
            // The row is not locked (lock_timeout turns a wait into an error), and the lost
            // transaction's write is rolled back.
            let mut n1 = c.connect("n1").unwrap();
            n1.batch_execute("SET lock_timeout = '100ms'").unwrap();
            wait_until(
                Duration::from_secs(30),
                Duration::from_millis(50),
                || {
                    n1.execute("UPDATE kv SET v = v WHERE k = $1", &[&key])
                        .is_ok()
                },
                || format!("{what}: the row stays locked on n1"),
            );
            let v: String = n1
                .query_one("SELECT v FROM kv WHERE k = $1", &[&key])
                .unwrap()
                .get(0);
            assert_eq!(v, format!("v{key}"), "{what}");
        }
    }
}

/// A remote transaction opened by a statement with parameters (an application driver's bind
/// parameters, a prepared statement) opens in the flight of that statement: the BEGIN, the
/// savepoints the local transaction has open, the statement's Parse when the session has not
/// prepared its shape, and its Bind/Execute go to the owner pipelined, ended by one Sync, so
/// that joining a node costs no round trip of its own. The owner's log shows every remote BEGIN
/// arriving as an extended-protocol statement and none as a simple query of its own. The flight
/// does what the statements one by one did: the node's savepoint is rolled back there, an error
/// anywhere in it aborts the transaction and leaves the connection usable, a shape whose first
/// execution failed runs the next time, and a statement_timeout stops the owner's statement.
#[test]
fn a_remote_transaction_opens_in_the_flight_of_its_first_statement_with_parameters() {
    let (c, _, _) = cluster_and_a_key_on_n1();
    let mut n1 = c.connect("n1").unwrap();
    let keys: Vec<i64> = n1
        .query(
            "SELECT k::bigint FROM generate_series(1, 200) k
               JOIN remus_shards s ON s.shard_id = remus_shard_id_for('kv', k)
              WHERE s.node_name = 'n2' ORDER BY k LIMIT 4",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys.len(), 4, "keys on n2: {keys:?}");
    let v = |k: i64| -> String {
        c.connect("n3")
            .unwrap()
            .query_one("SELECT v FROM kv WHERE k = $1", &[&k])
            .unwrap()
            .get(0)
    };
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute("ALTER SYSTEM SET log_statement = 'all'")
        .unwrap();
    n2.batch_execute("SELECT pg_reload_conf()").unwrap();
    wait_until(
        Duration::from_secs(20),
        Duration::from_millis(50),
        || {
            let s: String = c
                .connect("n2")
                .unwrap()
                .query_one("SHOW log_statement", &[])
                .unwrap()
                .get(0);
            s == "all"
        },
        || "log_statement never became 'all' on n2".into(),
    );
    // n1's session connects to n2 from here on, with the new setting.
    let mut n1 = c.connect("n1").unwrap();

    // Two writes in one transaction, the node joined by the first.
    let mut tx = n1.transaction().unwrap();
    for _ in 0..2 {
        let n = tx
            .execute("UPDATE kv SET v = v || '+' WHERE k = $1", &[&keys[0]])
            .unwrap();
        assert_eq!(n, 1);
    }
    tx.commit().unwrap();
    assert_eq!(v(keys[0]), format!("v{}++", keys[0]));

    // Another isolation level travels in the flight too.
    n1.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .unwrap();
    let got: String = n1
        .query_one("SELECT v FROM kv WHERE k = $1", &[&keys[1]])
        .unwrap()
        .get(0);
    assert_eq!(got, format!("v{}", keys[1]));
    n1.batch_execute("COMMIT").unwrap();

    // Joined under a savepoint: rolling back to it undoes the write on the owner.
    n1.batch_execute("BEGIN; SAVEPOINT a").unwrap();
    n1.execute("UPDATE kv SET v = 'gone' WHERE k = $1", &[&keys[1]])
        .unwrap();
    n1.batch_execute("ROLLBACK TO SAVEPOINT a").unwrap();
    n1.execute("UPDATE kv SET v = v || '!' WHERE k = $1", &[&keys[1]])
        .unwrap();
    n1.batch_execute("COMMIT").unwrap();
    assert_eq!(v(keys[1]), format!("v{}!", keys[1]));

    // An error in the flight: the transaction is aborted, the connection goes on.
    n1.batch_execute("BEGIN").unwrap();
    let e = n1
        .execute("INSERT INTO kv VALUES ($1, 'dup')", &[&keys[2]])
        .expect_err("a duplicate key");
    assert_eq!(sqlstate(&e), "23505", "{e}");
    let e = n1
        .execute("UPDATE kv SET v = 'x' WHERE k = $1", &[&keys[2]])
        .expect_err("the transaction is aborted");
    assert_eq!(sqlstate(&e), "25P02", "{e}");
    n1.batch_execute("ROLLBACK").unwrap();
    n1.execute("UPDATE kv SET v = v || '#' WHERE k = $1", &[&keys[2]])
        .unwrap();
    assert_eq!(v(keys[2]), format!("v{}#", keys[2]));

    // A shape prepared in a flight whose execution failed runs the next time.
    let divide = "UPDATE kv SET v = v || (10 / $2::int)::text WHERE k = $1";
    for (d, ok) in [(0, false), (5, true)] {
        let mut tx = n1.transaction().unwrap();
        match tx.execute(divide, &[&keys[3], &d]) {
            Ok(n) => {
                assert!(ok, "10 / 0 ran");
                assert_eq!(n, 1);
                tx.commit().unwrap();
            }
            Err(e) => {
                assert!(!ok, "10 / {d}: {e}");
                assert_eq!(sqlstate(&e), "22012", "{e}");
            }
        }
    }
    assert_eq!(v(keys[3]), format!("v{}2", keys[3]));

    // A statement_timeout stops the owner's statement of a flight.
    n1.batch_execute("BEGIN; SET LOCAL statement_timeout = '300ms'")
        .unwrap();
    let e = n1
        .query(
            "SELECT pg_sleep(60) AS flight_timeout FROM kv WHERE k = $1",
            &[&keys[0]],
        )
        .expect_err("statement_timeout");
    assert_eq!(sqlstate(&e), "57014", "{e}");
    n1.batch_execute("ROLLBACK").unwrap();
    ends_on(&c, "n2", "flight_timeout", "the timed-out flight");
    let mut tx = n1.transaction().unwrap();
    let got: String = tx
        .query_one("SELECT v FROM kv WHERE k = $1", &[&keys[0]])
        .unwrap()
        .get(0);
    assert_eq!(got, format!("v{}++", keys[0]));
    tx.commit().unwrap();

    // How the BEGINs reached n2.
    let log = std::fs::read_to_string(&c.state().unwrap().node("n2").unwrap().log).unwrap();
    let pipelined = |iso: &str| {
        log.lines()
            .filter(|l| l.contains(&format!("execute <unnamed>: BEGIN ISOLATION LEVEL {iso}")))
            .count()
    };
    assert!(
        pipelined("READ COMMITTED") >= 5,
        "remote BEGINs in the flights, read committed: {}\n{log}",
        pipelined("READ COMMITTED")
    );
    assert_eq!(pipelined("REPEATABLE READ"), 1, "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains("execute <unnamed>: SAVEPOINT ")),
        "the savepoint in the flight:\n{log}"
    );
    let alone: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("statement: BEGIN ISOLATION LEVEL"))
        .collect();
    assert!(
        alone.is_empty(),
        "remote BEGINs sent in a round trip of their own: {alone:?}"
    );
}
