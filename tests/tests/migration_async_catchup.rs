//! Asynchronous commit of catch-up shadows (issue 17 item 1, decision 0018): the replay worker
//! commits the stream's shadow transactions with `synchronous_commit = off`, and the source's
//! slot is confirmed only up to what the target has flushed.
//!
//! - A shard written by a steady writer (one transaction at a time: a new row and a counter
//!   row's increment, through the source) is moving; the migration is held in catch-up (the
//!   `catchup.running` failpoint: the stream goes on, the driver waits) and the target
//!   PostgreSQL is killed (SIGKILL of every process: async commits not yet flushed are lost).
//!   Every writer transaction that ended at or before the slot's `confirmed_flush_lsn` (read
//!   after the kill) is on the target once it has restarted: the slot never confirmed what the
//!   target could lose. Then the migration goes on; the code's recovery rolls it back (or, once
//!   the stream resumes in place, completes it), it is retried until it succeeds, and the shard
//!   on its new owner holds every committed write exactly once: the same rows as the writer's
//!   record (count, sum and an md5 over the ordered rows) and the counter equal to the number of
//!   committed transactions.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use coordinator::failpoint::CATCHUP_RUNNING;
use integration::migrations::{start_paused, wait_ended};
use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

/// Generous bounds of the waits (not timing assertions: a loaded machine only makes them
/// slower).
const LIMIT: Duration = Duration::from_secs(180);

/// `X/Y` as PostgreSQL prints an LSN, as a number.
fn lsn(s: &str) -> u64 {
    let (hi, lo) = s.split_once('/').expect("an LSN");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// What the writer did.
#[derive(Default, Debug)]
struct Record {
    /// Committed transactions: their row's seq and an upper bound of their commit's end LSN
    /// on the source (the insert position right after COMMIT returned).
    committed: Vec<(i64, u64)>,
    /// Transactions whose COMMIT lost its answer with the connection: present or not.
    unknown: Vec<i64>,
    /// Errors with a SQLSTATE (the transaction rolled back): what they were.
    refused: Vec<String>,
}

fn value(seq: i64) -> String {
    format!("v{seq}-{}", seq * 7919 % 1000)
}

/// Transactions `INSERT (seq) + counter += 1` on the moving shard through `node`, one at a
/// time, until `stop`.
fn writer(
    c: &TestCluster,
    node: &str,
    stop: Arc<AtomicBool>,
    record: Arc<Mutex<Record>>,
) -> thread::JoinHandle<()> {
    let state = c.state().unwrap();
    let password = state.password().unwrap();
    let conninfo = state.node(node).unwrap().conninfo(&password);
    thread::spawn(move || {
        let mut db: Option<postgres::Client> = None;
        let mut seq = 0i64;
        while !stop.load(Ordering::Acquire) {
            let Some(conn) = db.as_mut() else {
                match postgres::Client::connect(&conninfo, postgres::NoTls) {
                    Ok(conn) => db = Some(conn),
                    Err(_) => thread::sleep(Duration::from_millis(50)),
                }
                continue;
            };
            seq += 1;
            let work = conn.batch_execute("BEGIN").and_then(|_| {
                conn.execute(
                    "INSERT INTO t (id, n, v) VALUES ($1, 0, $2)",
                    &[&seq, &value(seq)],
                )?;
                conn.execute("UPDATE t SET n = n + 1 WHERE id = 0", &[])
            });
            if let Err(e) = work {
                let mut r = record.lock().unwrap();
                match e.code() {
                    Some(code) => {
                        r.refused.push(code.code().to_string());
                        let _ = conn.batch_execute("ROLLBACK");
                    }
                    None => db = None,
                }
                continue;
            }
            match conn.batch_execute("COMMIT") {
                Ok(()) => {
                    let end = conn
                        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
                        .map(|r| lsn(&r.get::<_, String>(0)))
                        // The source is not the node that crashes; should it fail, the bound
                        // is unknown and the transaction is not checked against the slot.
                        .unwrap_or(u64::MAX);
                    record.lock().unwrap().committed.push((seq, end));
                }
                Err(e) if e.code().is_none() => {
                    record.lock().unwrap().unknown.push(seq);
                    db = None;
                }
                Err(e) => record
                    .lock()
                    .unwrap()
                    .refused
                    .push(e.code().unwrap().code().to_string()),
            }
        }
    })
}

/// A session on `node` that may read the shard's own table there, whoever owns it.
fn shard_session(c: &TestCluster, node: &str) -> postgres::Client {
    let mut db = c.connect(node).unwrap();
    db.batch_execute("SET remus.migration_session = on")
        .unwrap();
    db
}

/// The seqs of the writer's rows in `node`'s copy of the shard (row 0 is the counter).
fn seqs_on(c: &TestCluster, node: &str, shard: i64) -> Vec<i64> {
    shard_session(c, node)
        .query(
            &format!("SELECT id FROM remus_shards.t_{shard} WHERE id > 0 ORDER BY id"),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Count, sum of ids, the counter, and an md5 over the ordered rows of `node`'s copy.
fn digest_on(c: &TestCluster, node: &str, shard: i64) -> (i64, i64, i64, String) {
    let r = shard_session(c, node)
        .query_one(
            &format!(
                "SELECT count(*), coalesce(sum(id), 0)::bigint,
                        coalesce(max(n) FILTER (WHERE id = 0), -1)::bigint,
                        md5(string_agg(id || ':' || n || ':' || v, ',' ORDER BY id))
                   FROM remus_shards.t_{shard}"
            ),
            &[],
        )
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

#[test]
fn a_target_crash_during_async_catch_up_loses_nothing_and_applies_nothing_twice() {
    let c = TestCluster::start(2).expect("cluster up");
    // One shard, so that every write is a local statement on the source.
    c.connect("n1")
        .unwrap()
        .batch_execute(
            "CREATE TABLE t (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
             INSERT INTO t VALUES (0, 0, 'counter');
             SELECT remus_create_distributed_table('t', 'id', 1);",
        )
        .unwrap();
    let (shard, source) = owners(&c, "t").into_iter().next().expect("one shard");
    let target = if source == "n1" { "n2" } else { "n1" }.to_string();

    let stop = Arc::new(AtomicBool::new(false));
    let record = Arc::new(Mutex::new(Record::default()));
    let writing = writer(&c, &source, stop.clone(), record.clone());
    let committed = || record.lock().unwrap().committed.len();
    wait_until(
        LIMIT,
        Duration::from_millis(20),
        || committed() >= 50,
        || "the writer commits nothing".into(),
    );

    // Held in catch-up: the stream applies the writer's transactions on the target.
    let (id, call) = start_paused(&c, &source, shard, &target, CATCHUP_RUNNING);
    let copied = seqs_on(&c, &target, shard).len();
    wait_until(
        LIMIT,
        Duration::from_millis(50),
        || seqs_on(&c, &target, shard).len() >= copied + 200,
        || format!("catch-up applies nothing\n{}", c.daemon_logs(40)),
    );
    let mut src = c.connect(&source).unwrap();
    let slot_position = |src: &mut postgres::Client| -> u64 {
        src.query_one(
            "SELECT coalesce(max(confirmed_flush_lsn), '0/0')::text FROM pg_replication_slots
              WHERE slot_name LIKE 'remus\\_m%'",
            &[],
        )
        .map(|r| lsn(&r.get::<_, String>(0)))
        .unwrap()
    };
    // The slot has been confirmed past some of the writer's catch-up transactions.
    let first_caught_up = {
        let r = record.lock().unwrap();
        r.committed[r.committed.len() - 1].1
    };
    wait_until(
        LIMIT,
        Duration::from_millis(50),
        || slot_position(&mut src) >= first_caught_up,
        || format!("the slot is never confirmed\n{}", c.daemon_logs(40)),
    );

    c.kill_node(&target).unwrap();
    // Nothing the target lost can be confirmed from now on; what was confirmed was flushed.
    let confirmed = slot_position(&mut src);
    c.start_node(&target).unwrap();
    let on_target: std::collections::BTreeSet<i64> =
        seqs_on(&c, &target, shard).into_iter().collect();
    let must_be_there: Vec<i64> = record
        .lock()
        .unwrap()
        .committed
        .iter()
        .filter(|(_, end)| *end <= confirmed)
        .map(|(seq, _)| *seq)
        .collect();
    let missing: Vec<i64> = must_be_there
        .iter()
        .filter(|s| !on_target.contains(s))
        .copied()
        .collect();
    println!(
        "after the target's crash: slot confirmed at {confirmed:#X}, {} writer transactions \
         ended before it, {} rows of the writer on the restarted target",
        must_be_there.len(),
        on_target.len()
    );
    assert!(
        missing.is_empty(),
        "confirmed to the source's slot but lost by the target's crash: {missing:?}"
    );
    assert!(
        !must_be_there.is_empty(),
        "the check covered no transaction"
    );

    // The migration goes on; then retried until it has moved the shard.
    c.release_failpoint(CATCHUP_RUNNING).unwrap();
    let (status, error) = wait_ended(&c, &source, id, LIMIT);
    println!("migration {id} after the target's crash: {status} ({error:?})");
    let _ = call.join();
    assert!(
        status == "rolled_back" || status == "succeeded",
        "migration {id} ended {status}: {error:?}\n{}",
        c.daemon_logs(40)
    );
    let mut attempts = 0;
    let mut moved = status == "succeeded";
    while !moved {
        attempts += 1;
        assert!(attempts <= 3, "the migration never succeeds");
        let status: String = c
            .connect(&source)
            .unwrap()
            .query_one(
                "SELECT status FROM remus_migrate_shard($1, $2)",
                &[&shard, &target],
            )
            .unwrap_or_else(|e| panic!("retrying the migration: {e:?}\n{}", c.daemon_logs(40)))
            .get(0);
        println!("retry {attempts}: {status}");
        moved = status == "succeeded";
    }
    // More writes through the source node, now routed to the new owner.
    let after = committed();
    wait_until(
        LIMIT,
        Duration::from_millis(20),
        || committed() >= after + 20,
        || "the writer commits nothing after the move".into(),
    );
    stop.store(true, Ordering::Release);
    writing.join().unwrap();

    assert_eq!(
        owners_everywhere(&c, shard),
        vec![target.clone(), target.clone()]
    );
    let gone: bool = shard_session(&c, &source)
        .query_one(
            &format!("SELECT to_regclass('remus_shards.t_{shard}') IS NULL"),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(gone, "the source still has its copy");

    // The writer's record, with the outcome of lost COMMIT answers read from the new owner.
    let record = record.lock().unwrap();
    println!(
        "writer: {} committed, {} outcomes unknown, {} refused ({:?})",
        record.committed.len(),
        record.unknown.len(),
        record.refused.len(),
        record
            .refused
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
    );
    let present: std::collections::BTreeSet<i64> =
        seqs_on(&c, &target, shard).into_iter().collect();
    let mut expected: Vec<i64> = record.committed.iter().map(|(s, _)| *s).collect();
    expected.extend(record.unknown.iter().filter(|s| present.contains(s)));
    expected.sort_unstable();
    let rows: Vec<String> =
        std::iter::once("0:".to_string() + &expected.len().to_string() + ":counter")
            .chain(expected.iter().map(|s| format!("{s}:0:{}", value(*s))))
            .collect();
    let md5: String = c
        .connect(&target)
        .unwrap()
        .query_one("SELECT md5($1)", &[&rows.join(",")])
        .unwrap()
        .get(0);
    let want = (
        expected.len() as i64 + 1,
        expected.iter().sum::<i64>(),
        expected.len() as i64,
        md5,
    );
    let got = digest_on(&c, &target, shard);
    if got != want {
        let extra: Vec<_> = present
            .iter()
            .filter(|s| expected.binary_search(s).is_err())
            .collect();
        let lost: Vec<_> = expected.iter().filter(|s| !present.contains(s)).collect();
        panic!(
            "the moved shard differs from the committed writes: (count, sum, counter, md5) \
             {got:?}, expected {want:?}; lost {lost:?}, not committed but present {extra:?}"
        );
    }
    println!(
        "the moved shard: {} rows, counter {}, equal to the committed writes",
        got.0, got.2
    );
}
