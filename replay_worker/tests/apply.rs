//! Against real PostgreSQL 15 servers that each test starts itself (the throwaway servers of
//! `remus_test_support::pg`: initdb as the `postgres` OS user, trust authentication, 127.0.0.1
//! only, reserved ports), stopped with `pg_ctl stop -m immediate` when the test ends. Needs
//! `/usr/lib/postgresql/15/bin`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use remus_proto::v1::replay_worker_client::ReplayWorkerClient;
use remus_proto::v1::{
    apply_request, column_value, row_change, ApplyFinish, ApplyProgress, ApplyRequest, ApplyStart,
    ColumnValue, RowChange, ShadowTxn,
};
use replay_worker::{ApplyConfig, ApplyError, ShadowApplier};
use tokio_postgres::NoTls;

use remus_test_support::pg::PgServer;
use remus_test_support::ports::PortBlock;

/// This suite's servers, and clients of them.
trait Suite: Sized {
    fn start() -> Self;
    async fn client_db(&self, db: &str) -> tokio_postgres::Client;
    async fn client(&self) -> tokio_postgres::Client;
}

impl Suite for PgServer {
    fn start() -> PgServer {
        PgServer::start_with(
            "-c max_replication_slots=40 -c max_connections=60 -c track_commit_timestamp=on",
            "replay-pg-",
        )
    }

    async fn client_db(&self, db: &str) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.conninfo_db(db), NoTls)
            .await
            .expect("connect");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    async fn client(&self) -> tokio_postgres::Client {
        self.client_db("postgres").await
    }
}

/// First column of the first row, as text ("" for NULL or no row).
async fn query_one(c: &tokio_postgres::Client, sql: &str) -> String {
    for m in c
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
    {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            return r.get(0).unwrap_or("").to_string();
        }
    }
    String::new()
}

// ---- ShadowTxn builders ---------------------------------------------------------------------

fn text(s: impl ToString) -> ColumnValue {
    ColumnValue {
        value: Some(column_value::Value::Text(s.to_string())),
    }
}
fn null() -> ColumnValue {
    ColumnValue {
        value: Some(column_value::Value::Null(true)),
    }
}
fn toast() -> ColumnValue {
    ColumnValue {
        value: Some(column_value::Value::UnchangedToast(true)),
    }
}

fn rc(kind: row_change::Kind, table: &str, cols: &[&str]) -> RowChange {
    RowChange {
        kind: kind as i32,
        schema: "public".into(),
        table: table.into(),
        columns: cols.iter().map(|c| c.to_string()).collect(),
        key: cols.iter().enumerate().map(|(i, _)| i == 0).collect(),
        ..RowChange::default()
    }
}

/// Tables of the workloads: `(id int primary key, v text)`.
fn ins(table: &str, id: i64, v: &str) -> RowChange {
    RowChange {
        new_values: vec![text(id), text(v)],
        ..rc(row_change::Kind::Insert, table, &["id", "v"])
    }
}
fn upd(table: &str, old_id: i64, new_id: i64, v: &str) -> RowChange {
    RowChange {
        old_values: if old_id == new_id {
            vec![]
        } else {
            vec![text(old_id), null()]
        },
        new_values: vec![text(new_id), text(v)],
        ..rc(row_change::Kind::Update, table, &["id", "v"])
    }
}
fn del(table: &str, id: i64) -> RowChange {
    RowChange {
        old_values: vec![text(id), null()],
        ..rc(row_change::Kind::Delete, table, &["id", "v"])
    }
}
fn truncate(tables: &[&str]) -> RowChange {
    RowChange {
        kind: row_change::Kind::Truncate as i32,
        truncate_tables: tables
            .iter()
            .map(|t| format!("\"public\".\"{t}\""))
            .collect(),
        ..RowChange::default()
    }
}

const START_LSN: u64 = 0x100_0000;

/// The `i`-th transaction (from 0) of a test stream.
fn stxn(i: u64, changes: Vec<RowChange>) -> ShadowTxn {
    let commit_lsn = START_LSN + (i + 1) * 0x100;
    ShadowTxn {
        xid: 1000 + i as u32,
        commit_lsn,
        end_lsn: commit_lsn + 0x30,
        commit_time_us: 700_000_000_000_000 + i as i64 * 1_000,
        changes,
        shadow_gid: String::new(),
    }
}

fn cfg(dst: &PgServer, db: &str, migration_id: u64, parallelism: usize) -> ApplyConfig {
    ApplyConfig {
        migration_id,
        destination_conninfo: dst.conninfo_db(db),
        parallelism,
        start_lsn: START_LSN,
        batch: 0,
    }
}

/// An applier connected with `cfg` that has applied every one of `txns` (submitted in order,
/// then drained).
async fn apply_all(cfg: ApplyConfig, txns: &[ShadowTxn]) -> ShadowApplier {
    let mut applier = ShadowApplier::connect(cfg).await.unwrap();
    for t in txns {
        applier.submit(t.clone()).await.unwrap();
    }
    applier.drain().await.unwrap();
    applier
}

async fn table_dump(c: &tokio_postgres::Client, table: &str) -> String {
    query_one(
        c,
        &format!("SELECT coalesce(string_agg(id || ':' || coalesce(v, 'NULL'), ',' ORDER BY id), '') FROM {table}"),
    )
    .await
}

async fn origin_names(c: &tokio_postgres::Client) -> String {
    query_one(
        c,
        "SELECT coalesce(string_agg(roname, ',' ORDER BY roname), '') FROM pg_replication_origin",
    )
    .await
}

// ---- (a) commit timestamp and origin ---------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_rows_carry_the_source_commit_time_and_origin() {
    let dst = PgServer::start();
    let c = dst.client().await;
    c.batch_execute(
        "CREATE TABLE typed(id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, n numeric,
                            ts timestamptz, j jsonb, b bool, big text, arr int[])",
    )
    .await
    .unwrap();

    let cols = ["id", "n", "ts", "j", "b", "big", "arr"];
    let insert = RowChange {
        new_values: vec![
            text(1),
            text("12345.678901234567890"),
            text("2021-03-04 05:06:07.123456+00"),
            text(r#"{"quote": "it's", "backslash": "a\\b"}"#),
            text("t"),
            text("it's a \\ backslash and a \"quote\""),
            text("{1,2,3}"),
        ],
        ..rc(row_change::Kind::Insert, "typed", &cols)
    };
    let update = RowChange {
        new_values: vec![
            text(1),
            null(),
            text("2021-03-04 05:06:07.123456+00"),
            text("[]"),
            text("f"),
            toast(),
            text("{}"),
        ],
        ..rc(row_change::Kind::Update, "typed", &cols)
    };
    // 2023-11-14 22:13:20.123456 UTC in microseconds since 2000-01-01.
    let commit_time_us: i64 = 753_315_200_123_456;
    let mut t1 = stxn(0, vec![insert]);
    t1.commit_time_us = commit_time_us;
    let t2 = stxn(1, vec![update]);

    let mut applier = ShadowApplier::connect(cfg(&dst, "postgres", 7, 2))
        .await
        .expect("connect");
    assert_eq!(origin_names(&c).await, "remus_m7_w0,remus_m7_w1");
    applier.submit(t1.clone()).await.unwrap();
    applier.drain().await.unwrap();
    assert_eq!(applier.applied_lsn(), t1.end_lsn);

    let row = query_one(
        &c,
        "SELECT id || '|' || n || '|' || ts || '|' || j || '|' || b || '|' || big || '|' || arr::text
         FROM typed",
    )
    .await;
    assert_eq!(
        row,
        r#"1|12345.678901234567890|2021-03-04 05:06:07.123456+00|{"quote": "it's", "backslash": "a\\b"}|true|it's a \ backslash and a "quote"|{1,2,3}"#
    );
    let ts_us = query_one(
        &c,
        "SELECT ((extract(epoch FROM pg_xact_commit_timestamp(xmin)) - 946684800) * 1000000)::bigint
         FROM typed",
    )
    .await;
    assert_eq!(ts_us, commit_time_us.to_string());
    let origin = query_one(
        &c,
        "SELECT o.roname FROM typed, pg_xact_commit_timestamp_origin(typed.xmin) x
         JOIN pg_replication_origin o ON o.roident = x.roident",
    )
    .await;
    assert!(origin.starts_with("remus_m7_w"), "{origin:?}");
    let remote_lsn = query_one(
        &c,
        &format!(
            "SELECT pg_replication_origin_progress('{origin}', false) = '{}'::pg_lsn",
            replay_worker::apply::format_lsn(t1.commit_lsn)
        ),
    )
    .await;
    assert_eq!(remote_lsn, "t", "the origin records the source commit LSN");
    // Catch-up shadows commit asynchronously; the durable position follows the applied one
    // once the flusher has flushed the destination, and never passes it.
    assert!(applier.durable_lsn() <= applier.applied_lsn());
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while applier.durable_lsn() < t1.end_lsn {
        assert!(
            tokio::time::Instant::now() < deadline,
            "durable position stuck at {:#X}",
            applier.durable_lsn()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    applier.check_durable().unwrap();

    applier.submit(t2.clone()).await.unwrap();
    applier.drain().await.unwrap();
    assert_eq!(
        query_one(
            &c,
            "SELECT (n IS NULL) || '|' || j || '|' || b || '|' || arr::text FROM typed"
        )
        .await,
        "true|[]|false|{}"
    );
    assert_eq!(
        query_one(&c, "SELECT big FROM typed").await,
        "it's a \\ backslash and a \"quote\"",
        "unchanged TOAST column kept"
    );
    let ts_us = query_one(
        &c,
        "SELECT ((extract(epoch FROM pg_xact_commit_timestamp(xmin)) - 946684800) * 1000000)::bigint
         FROM typed",
    )
    .await;
    assert_eq!(ts_us, t2.commit_time_us.to_string());
    assert_eq!(applier.txns_applied(), 2);

    let progress = applier.finish().await.unwrap();
    assert_eq!(
        progress,
        ApplyProgress {
            applied_lsn: t2.end_lsn,
            txns_applied: 2,
            durable_lsn: t2.end_lsn,
        }
    );
    assert_eq!(origin_names(&c).await, "", "finish drops the origins");
}

// ---- (b) parallel apply equals serial apply --------------------------------------------------

struct XorShift(u64);
impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x % n
    }
}

/// A stream of transactions over tables `a` and `b` with heavy key overlap, valid when applied in
/// order, plus the final state it must produce. Every transaction also inserts its own row into
/// `marker`, so the destination shows which transactions committed.
fn workload(n: u64, seed: u64) -> (Vec<ShadowTxn>, [BTreeMap<i64, String>; 2]) {
    let mut rng = XorShift(seed | 1);
    let mut state: [BTreeMap<i64, String>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let names = ["a", "b"];
    let mut txns = Vec::new();
    for i in 0..n {
        let mut changes = vec![ins("marker", i as i64, "m")];
        if i < 4 {
            // Independent start, so every session gets work right away.
            let id = 1000 + i as i64;
            state[0].insert(id, format!("first{i}"));
            changes.push(ins("a", id, &format!("first{i}")));
        } else if rng.below(50) == 0 {
            state[1].clear();
            changes.push(truncate(&["b"]));
        } else {
            for op in 0..1 + rng.below(4) {
                let t = rng.below(2) as usize;
                let id = rng.below(16) as i64;
                let v = format!("t{i}o{op}");
                if state[t].contains_key(&id) {
                    match rng.below(3) {
                        0 => {
                            state[t].remove(&id);
                            changes.push(del(names[t], id));
                        }
                        1 => {
                            let new_id = 16 + rng.below(16) as i64;
                            if state[t].contains_key(&new_id) {
                                state[t].insert(id, v.clone());
                                changes.push(upd(names[t], id, id, &v));
                            } else {
                                state[t].remove(&id);
                                state[t].insert(new_id, v.clone());
                                changes.push(upd(names[t], id, new_id, &v));
                            }
                        }
                        _ => {
                            state[t].insert(id, v.clone());
                            changes.push(upd(names[t], id, id, &v));
                        }
                    }
                } else {
                    state[t].insert(id, v.clone());
                    changes.push(ins(names[t], id, &v));
                }
            }
        }
        txns.push(stxn(i, changes));
    }
    (txns, state)
}

fn expected_dump(m: &BTreeMap<i64, String>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(",")
}

const WORKLOAD_TABLES: &str = "CREATE TABLE a(id int PRIMARY KEY, v text);
     CREATE TABLE b(id int PRIMARY KEY, v text);
     CREATE TABLE marker(id int PRIMARY KEY, v text);";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_apply_matches_serial_apply_and_the_watermark_covers_only_commits() {
    let dst = PgServer::start();
    let admin = dst.client().await;
    admin.batch_execute("CREATE DATABASE par").await.unwrap();
    admin.batch_execute("CREATE DATABASE ser").await.unwrap();
    let par = dst.client_db("par").await;
    let ser = dst.client_db("ser").await;
    par.batch_execute(WORKLOAD_TABLES).await.unwrap();
    ser.batch_execute(WORKLOAD_TABLES).await.unwrap();

    const N: u64 = 200;
    let (txns, expected) = workload(N, 0x5eed);
    assert!(txns.iter().any(|t| t
        .changes
        .iter()
        .any(|c| c.kind == row_change::Kind::Truncate as i32)));

    // Parallel: 4 sessions, everything submitted up front (fits the pending limit), then every
    // advance of the applied position is checked against the destination.
    let mut applier = ShadowApplier::connect(cfg(&dst, "par", 1, 4))
        .await
        .unwrap();
    for t in &txns {
        applier.submit(t.clone()).await.unwrap();
    }
    let mut last = START_LSN;
    let mut advances = 0;
    while applier.outstanding() > 0 {
        let Some(applied) = applier.next_completion().await.unwrap() else {
            continue;
        };
        assert!(applied > last, "applied position went backwards");
        last = applied;
        advances += 1;
        let covered = txns.iter().take_while(|t| t.end_lsn <= applied).count();
        assert_eq!(
            txns[covered - 1].end_lsn,
            applied,
            "applied position is a txn end"
        );
        let committed: usize = query_one(
            &par,
            &format!("SELECT count(*) FROM marker WHERE id < {covered}"),
        )
        .await
        .parse()
        .unwrap();
        assert_eq!(
            committed, covered,
            "applied_lsn {applied:#X} covers uncommitted txns"
        );
    }
    assert!(advances > 0);
    assert_eq!(applier.applied_lsn(), txns.last().unwrap().end_lsn);
    assert_eq!(applier.txns_applied(), N);
    // The first transactions were independent: the two sessions opened at the start were both
    // busy with ready ones waiting, so two more opened, and each of the four committed work.
    let used = query_one(
        &par,
        "SELECT count(*) FROM pg_replication_origin_status WHERE remote_lsn <> '0/0'",
    )
    .await;
    assert_eq!(used, "4");
    applier.finish().await.unwrap();

    // Serial: one session.
    let serial = apply_all(cfg(&dst, "ser", 2, 1), &txns).await;
    serial.finish().await.unwrap();

    for (i, table) in ["a", "b"].into_iter().enumerate() {
        let p = table_dump(&par, table).await;
        assert_eq!(p, expected_dump(&expected[i]), "parallel {table} vs model");
        assert_eq!(
            p,
            table_dump(&ser, table).await,
            "parallel {table} vs serial"
        );
    }
    assert_eq!(
        query_one(&par, "SELECT count(*) FROM marker").await,
        N.to_string()
    );
}

// ---- (c) divergence --------------------------------------------------------------------------

/// Asserts that `err` is a divergence of transaction `xid`, on `table`, by `op`, at `key`.
fn assert_divergence(err: &ApplyError, xid: u32, table: &str, op: &str, key: &str) {
    match err {
        ApplyError::Divergence {
            xid: got_xid,
            table: got_table,
            op: got_op,
            key: got_key,
            ..
        } => assert_eq!(
            (*got_xid, got_table.as_str(), *got_op, got_key.as_str()),
            (xid, table, op, key)
        ),
        other => panic!("expected divergence, got {other:?}"),
    }
}

/// How many sessions of the destination sit idle inside a transaction.
async fn idle_in_transaction(c: &tokio_postgres::Client) -> String {
    query_one(
        c,
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn divergence_fails_loudly_and_commits_nothing_of_the_transaction() {
    let dst = PgServer::start();
    let c = dst.client().await;
    c.batch_execute(WORKLOAD_TABLES).await.unwrap();
    c.batch_execute("INSERT INTO a VALUES (1, 'present')")
        .await
        .unwrap();

    let mut applier = ShadowApplier::connect(cfg(&dst, "postgres", 3, 2))
        .await
        .unwrap();
    let ok = stxn(0, vec![ins("b", 1, "ok")]);
    applier.submit(ok.clone()).await.unwrap();
    applier.drain().await.unwrap();

    let bad = stxn(1, vec![ins("b", 2, "must not stay"), upd("a", 99, 99, "x")]);
    applier.submit(bad.clone()).await.unwrap();
    let err = applier.drain().await.expect_err("update of a missing row");
    assert_divergence(&err, bad.xid, "\"public\".\"a\"", "UPDATE", "id='99'");
    let msg = err.to_string();
    assert!(
        msg.contains("xid 1001") && msg.contains("\"a\"") && msg.contains("id='99'"),
        "{msg}"
    );
    assert_eq!(
        table_dump(&c, "b").await,
        "1:ok",
        "nothing of the failed txn is committed"
    );
    assert_eq!(applier.applied_lsn(), ok.end_lsn);
    assert!(matches!(
        applier.submit(stxn(2, vec![ins("b", 3, "x")])).await,
        Err(ApplyError::Failed(_))
    ));
    applier.abort().await;
    assert_eq!(
        origin_names(&c).await,
        "remus_m3_w0,remus_m3_w1",
        "abort leaves origins"
    );
    assert_eq!(idle_in_transaction(&c).await, "0");

    // DELETE of a missing row and INSERT of an existing one are divergence too.
    for (i, change, op) in [
        (0, del("a", 42), "DELETE"),
        (1, ins("a", 1, "dup"), "INSERT"),
    ] {
        let mut applier = ShadowApplier::connect(cfg(&dst, "postgres", 10 + i, 1))
            .await
            .unwrap();
        applier.submit(stxn(0, vec![change])).await.unwrap();
        match applier.drain().await {
            Err(ApplyError::Divergence { op: got, .. }) => assert_eq!(got, op),
            other => panic!("{op}: expected divergence, got {other:?}"),
        }
        applier.abort().await;
    }
    assert_eq!(table_dump(&c, "a").await, "1:present");
}

// ---- (c') batches (design note 0003) ---------------------------------------------------------

fn batched(dst: &PgServer, db: &str, migration_id: u64, parallelism: usize) -> ApplyConfig {
    ApplyConfig {
        batch: 64,
        ..cfg(dst, db, migration_id, parallelism)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_apply_what_one_at_a_time_applies_with_each_transaction_committed_as_the_source_did(
) {
    let dst = PgServer::start();
    let c = dst.client().await;
    c.batch_execute(WORKLOAD_TABLES).await.unwrap();
    const N: u64 = 300;
    let (txns, expected) = workload(N, 0xba7c);
    // One session: ready transactions pile up behind the one running, so they go in batches.
    let applier = apply_all(batched(&dst, "postgres", 5, 1), &txns).await;
    assert_eq!(applier.applied_lsn(), txns.last().unwrap().end_lsn);
    assert_eq!(applier.txns_applied(), N);
    assert_eq!(applier.batches_failed(), 0);
    assert!(applier.txns_batched() > 0);
    // The workload's shapes (int and text values) run as static statements in batches.
    assert!(applier.static_changes() > 0);
    for (i, table) in ["a", "b"].into_iter().enumerate() {
        assert_eq!(
            table_dump(&c, table).await,
            expected_dump(&expected[i]),
            "{table}"
        );
    }
    // Each transaction committed on its own, with its source commit time: every marker row's
    // commit timestamp is its transaction's, and no two marker rows share a transaction.
    let wrong = query_one(
        &c,
        "SELECT count(*) FROM marker
          WHERE pg_catalog.pg_xact_commit_timestamp(xmin)
                <> '2000-01-01 00:00:00+00'::timestamptz
                   + (700000000000000 + id::bigint * 1000) * interval '1 microsecond'",
    )
    .await;
    assert_eq!(
        wrong, "0",
        "marker rows whose commit time is not their source's"
    );
    assert_eq!(
        query_one(&c, "SELECT count(DISTINCT xmin::text) FROM marker").await,
        N.to_string()
    );
    // The origin is at the last transaction's commit position.
    assert_eq!(
        query_one(
            &c,
            "SELECT pg_catalog.pg_replication_origin_progress('remus_m5_w0', false)::text"
        )
        .await,
        replay_worker::apply::format_lsn(txns.last().unwrap().commit_lsn)
    );
    applier.finish().await.unwrap();
}

/// More row shapes than a session keeps prepared (512): each INSERT leaves NULL the columns of
/// the set bits of its id, so 1,100 of them have 1,024 shapes; every seventh transaction also
/// "updates" its row with only unchanged TOAST values (a `SELECT … FOR UPDATE`). Batches keep
/// applying as the session deallocates statements to prepare new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_keep_applying_past_the_prepared_statements_a_session_keeps() {
    let dst = PgServer::start();
    let c = dst.client().await;
    let cols: Vec<String> = std::iter::once("id".to_string())
        .chain((0..10).map(|j| format!("c{j}")))
        .collect();
    c.batch_execute(
        "CREATE TABLE wide(id int PRIMARY KEY, c0 int, c1 int, c2 int, c3 int, c4 int, \
         c5 int, c6 int, c7 int, c8 int, c9 int)",
    )
    .await
    .unwrap();
    let col_refs: Vec<&str> = cols.iter().map(String::as_str).collect();
    const N: u64 = 1100;
    let txns: Vec<ShadowTxn> = (0..N)
        .map(|i| {
            let mut values = vec![text(i)];
            values.extend((0..10).map(|j| if i >> j & 1 == 1 { null() } else { text(i) }));
            let mut changes = vec![RowChange {
                new_values: values,
                ..rc(row_change::Kind::Insert, "wide", &col_refs)
            }];
            if i % 7 == 0 {
                let mut untouched = vec![text(i)];
                untouched.extend((0..10).map(|_| toast()));
                changes.push(RowChange {
                    new_values: untouched,
                    ..rc(row_change::Kind::Update, "wide", &col_refs)
                });
            }
            stxn(i, changes)
        })
        .collect();
    let applier = apply_all(batched(&dst, "postgres", 8, 1), &txns).await;
    assert_eq!(applier.txns_applied(), N);
    // Batches did the work, and none failed (a failed one is applied again one by one, which
    // would hide it in the tables).
    assert_eq!(applier.batches_failed(), 0);
    // The first 16 shapes are static, the other 1,008 run by EXECUTE: both paths wrote rows.
    assert!(applier.static_changes() > 0);
    assert!(
        applier.txns_batched() > N / 2,
        "{} of {N} in batches",
        applier.txns_batched()
    );
    let wrong = query_one(
        &c,
        "SELECT count(*) FROM wide WHERE EXISTS (
           SELECT FROM generate_series(0, 9) j
            WHERE (pg_catalog.to_jsonb(wide) ->> ('c' || j)) IS DISTINCT FROM
                  CASE WHEN id >> j & 1 = 1 THEN NULL ELSE id::text END)",
    )
    .await;
    assert_eq!(wrong, "0", "rows whose columns are not their INSERT's");
    assert_eq!(
        query_one(&c, "SELECT count(*) FROM wide").await,
        N.to_string()
    );
    applier.finish().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_divergence_inside_a_batch_commits_the_transactions_before_it_and_names_its_change() {
    let dst = PgServer::start();
    let c = dst.client().await;
    c.batch_execute(WORKLOAD_TABLES).await.unwrap();
    c.batch_execute("INSERT INTO a VALUES (1, 'present')")
        .await
        .unwrap();
    let mut applier = ShadowApplier::connect(batched(&dst, "postgres", 6, 1))
        .await
        .unwrap();
    // The first runs alone (the session is idle when it arrives); the next four, independent
    // of each other, wait for it and then go as one batch.
    let first = stxn(0, vec![ins("b", 1, "first")]);
    let before = stxn(1, vec![ins("b", 2, "before")]);
    let bad = stxn(2, vec![ins("b", 3, "must not stay"), upd("a", 99, 99, "x")]);
    let after = stxn(3, vec![ins("b", 4, "after")]);
    for t in [&first, &before, &bad, &after] {
        applier.submit(t.clone()).await.unwrap();
    }
    let err = applier.drain().await.expect_err("update of a missing row");
    assert_divergence(&err, bad.xid, "\"public\".\"a\"", "UPDATE", "id='99'");
    assert_eq!(
        applier.batches_failed(),
        1,
        "the batch of four stopped at the bad one"
    );

    assert_eq!(
        table_dump(&c, "b").await,
        "1:first,2:before",
        "the transactions before the failed one committed, nothing of it or after it"
    );
    assert_eq!(applier.applied_lsn(), before.end_lsn);
    assert_eq!(applier.txns_applied(), 2);
    applier.abort().await;

    // A batch whose first transaction fails commits nothing, although the session's progress
    // still holds the previous batch's last commit: one batch of two, then a lone one, then a
    // batch led by a divergence.
    let mut applier = ShadowApplier::connect(batched(&dst, "postgres", 9, 1))
        .await
        .unwrap();
    let batch1 = [
        stxn(10, vec![ins("b", 10, "x0")]),
        stxn(11, vec![ins("b", 11, "x1")]),
        stxn(12, vec![ins("b", 12, "x2")]),
    ];
    for t in &batch1 {
        applier.submit(t.clone()).await.unwrap();
    }
    applier.drain().await.unwrap();
    let lone = stxn(13, vec![ins("b", 13, "y0")]);
    let leading_bad = stxn(14, vec![del("a", 77)]);
    let behind = stxn(15, vec![ins("b", 15, "y2")]);
    for t in [&lone, &leading_bad, &behind] {
        applier.submit(t.clone()).await.unwrap();
    }
    let err = applier.drain().await.expect_err("delete of a missing row");
    assert_divergence(
        &err,
        leading_bad.xid,
        "\"public\".\"a\"",
        "DELETE",
        "id='77'",
    );
    assert_eq!(
        table_dump(&c, "b").await,
        "1:first,2:before,10:x0,11:x1,12:x2,13:y0"
    );
    assert_eq!(applier.applied_lsn(), lone.end_lsn);
    applier.abort().await;
    assert_eq!(idle_in_transaction(&c).await, "0");
}

// ---- (d) over gRPC ---------------------------------------------------------------------------

async fn start_service() -> (String, tokio::sync::oneshot::Sender<()>) {
    let port = PortBlock::reserve().keep_for_process();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(replay_worker::serve(listener, async {
        let _ = stopped.await;
    }));
    (format!("http://127.0.0.1:{port}"), stop)
}

fn req(msg: apply_request::Msg) -> ApplyRequest {
    ApplyRequest { msg: Some(msg) }
}

fn start_msg(dst: &PgServer, migration_id: u64, parallelism: u32) -> ApplyRequest {
    req(apply_request::Msg::Start(ApplyStart {
        migration_id,
        destination_conninfo: dst.conninfo(),
        parallelism,
        start_lsn: START_LSN,
        validation_sessions: 0,
    }))
}

/// Runs one Apply call with the given requests; returns the progress messages and the final
/// status.
async fn apply_call(
    endpoint: &str,
    requests: Vec<ApplyRequest>,
) -> (Vec<ApplyProgress>, Result<(), tonic::Status>) {
    let mut client = ReplayWorkerClient::connect(endpoint.to_string())
        .await
        .unwrap();
    let outbound = tokio_stream::iter(requests);
    let mut inbound = match client.apply(outbound).await {
        Ok(r) => r.into_inner(),
        Err(status) => return (Vec::new(), Err(status)),
    };
    let mut progress = Vec::new();
    loop {
        match inbound.message().await {
            Ok(Some(p)) => progress.push(p),
            Ok(None) => return (progress, Ok(())),
            Err(status) => return (progress, Err(status)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_apply_streams_progress_and_drops_origins_on_finish() {
    let dst = PgServer::start();
    let c = dst.client().await;
    c.batch_execute(WORKLOAD_TABLES).await.unwrap();
    let (endpoint, _stop) = start_service().await;

    // The first message must be start.
    let (_, status) = apply_call(&endpoint, vec![req(apply_request::Msg::IdleLsn(5))]).await;
    assert_eq!(status.unwrap_err().code(), tonic::Code::InvalidArgument);

    let (mut txns, expected) = workload(120, 77);
    // One transaction larger than tonic's default 4 MiB message limit.
    let big = "x".repeat(5 << 20);
    txns.push(stxn(120, vec![ins("marker", 100_000, &big)]));
    let last_end = txns.last().unwrap().end_lsn;
    let idle = last_end + 0x1000;
    let mut requests = vec![start_msg(&dst, 21, 3)];
    requests.extend(
        txns.iter()
            .cloned()
            .map(|t| req(apply_request::Msg::Txn(t))),
    );
    requests.push(req(apply_request::Msg::IdleLsn(idle)));
    requests.push(req(apply_request::Msg::Finish(ApplyFinish {})));
    let (progress, status) = apply_call(&endpoint, requests).await;
    status.expect("apply call ends OK");
    let last = progress.last().expect("final progress");
    assert_eq!(
        *last,
        ApplyProgress {
            applied_lsn: idle,
            txns_applied: 121,
            durable_lsn: idle,
        }
    );
    assert_eq!(
        query_one(&c, "SELECT length(v) FROM marker WHERE id = 100000").await,
        (5 << 20).to_string()
    );
    for w in progress[..progress.len() - 1].windows(2) {
        assert!(
            w[0].applied_lsn <= w[1].applied_lsn && w[0].durable_lsn <= w[1].durable_lsn,
            "never backwards: {w:?}"
        );
        assert!(
            w[0].applied_lsn < w[1].applied_lsn || w[0].durable_lsn < w[1].durable_lsn,
            "sent only when it advances: {w:?}"
        );
    }
    for p in &progress {
        assert!(
            p.durable_lsn <= p.applied_lsn,
            "durable ahead of applied: {p:?}"
        );
    }
    for w in progress.windows(2) {
        assert!(w[0].txns_applied <= w[1].txns_applied);
    }
    for p in &progress[..progress.len() - 1] {
        assert!(
            p.applied_lsn == idle || txns.iter().any(|t| t.end_lsn == p.applied_lsn),
            "{p:?} is not a transaction end"
        );
    }
    assert_eq!(table_dump(&c, "a").await, expected_dump(&expected[0]));
    assert_eq!(table_dump(&c, "b").await, expected_dump(&expected[1]));
    assert_eq!(origin_names(&c).await, "", "origins dropped at finish");

    // An apply error ends the call with the error; the origins stay for the coordinator.
    let (_, status) = apply_call(
        &endpoint,
        vec![
            start_msg(&dst, 22, 2),
            req(apply_request::Msg::Txn(stxn(500, vec![del("a", 12345)]))),
            req(apply_request::Msg::Finish(ApplyFinish {})),
        ],
    )
    .await;
    let status = status.expect_err("divergence");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains("divergence") && status.message().contains("id='12345'"),
        "{}",
        status.message()
    );
    assert_eq!(origin_names(&c).await, "remus_m22_w0,remus_m22_w1");

    // A client that goes away without finish: the sessions end, the origins stay.
    let (_, status) = apply_call(
        &endpoint,
        vec![
            start_msg(&dst, 23, 2),
            req(apply_request::Msg::Txn(stxn(
                600,
                vec![ins("b", 999, "late")],
            ))),
        ],
    )
    .await;
    assert_eq!(
        status.unwrap_err().code(),
        tonic::Code::Aborted,
        "no finish"
    );
    wait_sessions_gone(&c, 23).await;

    // A client that disappears mid-call (request stream still open): same.
    let mut client = ReplayWorkerClient::connect(endpoint.clone()).await.unwrap();
    let (req_tx, req_rx) = tokio::sync::mpsc::channel(4);
    req_tx.send(start_msg(&dst, 24, 2)).await.unwrap();
    req_tx
        .send(req(apply_request::Msg::Txn(stxn(
            700,
            vec![ins("b", 998, "x")],
        ))))
        .await
        .unwrap();
    let mut inbound = client
        .apply(tokio_stream::wrappers::ReceiverStream::new(req_rx))
        .await
        .unwrap()
        .into_inner();
    let first = inbound.message().await.unwrap().expect("progress");
    assert_eq!(first.txns_applied, 1);
    drop(inbound);
    drop(req_tx);
    drop(client);
    wait_sessions_gone(&c, 24).await;
    assert_eq!(
        origin_names(&c).await,
        "remus_m22_w0,remus_m22_w1,remus_m23_w0,remus_m23_w1,remus_m24_w0,remus_m24_w1"
    );
    assert_eq!(table_dump(&c, "b").await.matches("998:x").count(), 1);
}

/// Waits until the apply sessions of a migration have disconnected.
async fn wait_sessions_gone(c: &tokio_postgres::Client, migration_id: u64) {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'remus-replay m{migration_id} %'"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while query_one(c, &sql).await != "0" {
        assert!(
            Instant::now() < deadline,
            "apply sessions of migration {migration_id} still open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---- (e) real source: pgoutput → ship::shadow_txn → gRPC → destination -----------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_stream_replayed_through_the_service_reproduces_the_tables() {
    use wal_propagator::{
        Assembled, AssemblerConfig, PgOutputMessage, ReplicationConnection, ReplicationMessage,
        TxnAssembler,
    };
    let src = PgServer::start();
    let dst = PgServer::start();
    let schema = "CREATE TABLE t(id int PRIMARY KEY, v text, n numeric, ts timestamptz, big text);
                  CREATE TABLE u(k text PRIMARY KEY, x int);";
    let s = src.client().await;
    let d = dst.client().await;
    s.batch_execute(schema).await.unwrap();
    d.batch_execute(schema).await.unwrap();
    s.batch_execute(
        "ALTER TABLE t ALTER big SET STORAGE EXTERNAL; CREATE PUBLICATION pub FOR TABLE t, u",
    )
    .await
    .unwrap();

    let src_conninfo = src.conninfo();
    let consistent_point = tokio::task::spawn_blocking(move || {
        let mut conn = ReplicationConnection::connect(&src_conninfo).unwrap();
        let slot = conn
            .create_slot_exporting_snapshot("replay_e2e")
            .unwrap()
            .release();
        slot.consistent_point
    })
    .await
    .unwrap();

    // One source transaction per entry (a multi-statement simple query would be one).
    for sql in [
        "INSERT INTO t SELECT g, 'v' || g, g * 1.5, '2020-01-01'::timestamptz + g * interval '1 hour',
                CASE WHEN g = 3 THEN repeat('x', 100000) END
           FROM generate_series(1, 50) g",
        "INSERT INTO u VALUES ('it''s', 1), ('back\\slash', 2)",
        "BEGIN; UPDATE t SET v = 'changed' WHERE id = 3; UPDATE u SET x = x + 10; COMMIT",
        "UPDATE t SET id = 1000 WHERE id = 4",
        "DELETE FROM t WHERE id BETWEEN 10 AND 20",
        "BEGIN; INSERT INTO u VALUES ('tmp', 0); DELETE FROM u WHERE k = 'tmp'; COMMIT",
        "TRUNCATE u",
        "INSERT INTO u VALUES ('after', 7)",
        "UPDATE t SET n = n * 2 WHERE id % 2 = 0",
        "SELECT pg_logical_emit_message(false, 'test_end', 'done')",
    ] {
        s.batch_execute(sql).await.unwrap();
    }

    let src_conninfo = src.conninfo();
    let txns = tokio::task::spawn_blocking(move || {
        let conn = ReplicationConnection::connect(&src_conninfo).unwrap();
        let mut stream = conn
            .start_streaming("replay_e2e", consistent_point, "pub")
            .unwrap();
        let mut assembler = TxnAssembler::new(AssemblerConfig::default());
        let mut txns = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            assert!(Instant::now() < deadline, "no end marker");
            let Some(ReplicationMessage::XLogData(x)) =
                stream.recv(Duration::from_secs(1)).unwrap()
            else {
                continue;
            };
            match assembler
                .push(PgOutputMessage::decode(x.data).unwrap())
                .unwrap()
            {
                Some(Assembled::Txn(txn)) => txns.push(wal_propagator::shadow_txn(&txn, 31)),
                Some(Assembled::Message(m)) if m.prefix == "test_end" => break,
                _ => {}
            }
        }
        txns
    })
    .await
    .unwrap();
    assert_eq!(txns.len(), 9, "one shadow txn per source transaction");
    let big_update = &txns[2].changes[0];
    assert_eq!(
        big_update.new_values[4].value,
        Some(column_value::Value::UnchangedToast(true)),
        "the TOASTed column is not resent"
    );

    let (endpoint, _stop) = start_service().await;
    let mut requests = vec![req(apply_request::Msg::Start(ApplyStart {
        migration_id: 31,
        destination_conninfo: dst.conninfo(),
        parallelism: 0,
        start_lsn: consistent_point.0,
        validation_sessions: 0,
    }))];
    let last_end = txns.last().unwrap().end_lsn;
    requests.extend(txns.into_iter().map(|t| req(apply_request::Msg::Txn(t))));
    requests.push(req(apply_request::Msg::Finish(ApplyFinish {})));
    let (progress, status) = apply_call(&endpoint, requests).await;
    status.expect("apply call ends OK");
    assert_eq!(
        *progress.last().unwrap(),
        ApplyProgress {
            applied_lsn: last_end,
            txns_applied: 9,
            durable_lsn: last_end,
        }
    );

    for q in [
        "SELECT string_agg(id || '|' || coalesce(v, '-') || '|' || n || '|' || ts || '|' \
           || coalesce(md5(big), '-') || '|' || pg_xact_commit_timestamp(xmin), ',' ORDER BY id) FROM t",
        "SELECT coalesce(string_agg(k || '|' || x || '|' || pg_xact_commit_timestamp(xmin), ',' ORDER BY k), '') FROM u",
    ] {
        let (a, b) = (query_one(&s, q).await, query_one(&d, q).await);
        assert!(!a.is_empty());
        assert_eq!(a, b, "{q}");
    }
    assert_eq!(origin_names(&d).await, "");
}
