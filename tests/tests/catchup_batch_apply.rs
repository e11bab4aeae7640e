//! Catch-up's batches through the node's `remus.apply_batch` (decision 0035, third amendment):
//! the replay worker's apply sessions find the procedure on a node with pg_remus and send every
//! batch to it; the server keeps a plan per change shape and reads each value with its
//! parameter type's input function. The PL/pgSQL path, on a server without the extension, is
//! `replay_worker/tests/apply.rs`'s.
//!
//! - `every_type_and_null_arrives_as_the_source_wrote_it`: a stream over a table of many
//!   column types (an array, a domain with a check, `character(n)`, `"char"`, `bytea`, `jsonb`,
//!   NULLs) and a plain one, applied in batches; the rows equal what the same values give when
//!   inserted by SQL, every transaction committed alone with its source commit time, and the
//!   origin stands at the last commit position.
//! - `a_divergence_inside_a_batch_commits_the_transactions_before_it`: a guarded UPDATE of a
//!   missing row in the middle of a batch: the ones before it stay committed, nothing of it
//!   or after it, and the applier names it.
//! - `more_shapes_than_a_session_keeps_plans_for`: 1,300 INSERT shapes (the columns left NULL
//!   differ) and `SELECT … FOR UPDATE` shapes (an update that changes only unchanged TOAST
//!   values): the session deallocates its prepared statements past 512 and the server forgets
//!   their plans past 1,024, and batches keep applying, every row as written.
//! - `the_procedure_refuses_what_it_cannot_do_safely`: inside a transaction block, without a
//!   replication origin, with an unknown statement, as a non-superuser: each a clear error with
//!   its SQLSTATE, nothing committed.
//!
//! Needs the extension built from this tree installed (`install_extension`). Seconds.

use postgres::NoTls;
use remus_proto::v1::{column_value, row_change, ColumnValue, RowChange, ShadowTxn};
use remus_test_support::pg::PgServer;
use replay_worker::{ApplyConfig, ApplyError, ShadowApplier};

const START_LSN: u64 = 0x200_0000;

fn server() -> PgServer {
    PgServer::start_with(
        "-c shared_preload_libraries=pg_remus -c track_commit_timestamp=on \
         -c max_prepared_transactions=20 -c remus.node_name=n1",
        "remus-batch-apply-",
    )
}

fn sql_client(pg: &PgServer) -> postgres::Client {
    postgres::Client::connect(&pg.conninfo(), NoTls).expect("connect")
}

fn value(v: Option<&str>) -> ColumnValue {
    ColumnValue {
        value: Some(match v {
            Some(s) => column_value::Value::Text(s.to_string()),
            None => column_value::Value::Null(true),
        }),
    }
}

fn change(
    kind: row_change::Kind,
    table: &str,
    cols: &[&str],
    values: &[Option<&str>],
) -> RowChange {
    let values: Vec<ColumnValue> = values.iter().map(|v| value(*v)).collect();
    RowChange {
        kind: kind as i32,
        schema: "public".into(),
        table: table.into(),
        columns: cols.iter().map(|c| c.to_string()).collect(),
        key: cols.iter().enumerate().map(|(i, _)| i == 0).collect(),
        new_values: values,
        ..RowChange::default()
    }
}

/// The `i`-th transaction of a stream.
fn txn(i: u64, changes: Vec<RowChange>) -> ShadowTxn {
    let commit_lsn = START_LSN + (i + 1) * 0x100;
    ShadowTxn {
        xid: 5000 + i as u32,
        commit_lsn,
        end_lsn: commit_lsn + 0x30,
        commit_time_us: 720_000_000_000_000 + i as i64 * 1_000,
        changes,
        shadow_gid: String::new(),
    }
}

fn config(pg: &PgServer, migration_id: u64) -> ApplyConfig {
    ApplyConfig {
        migration_id,
        destination_conninfo: pg.conninfo(),
        parallelism: 1,
        start_lsn: START_LSN,
        batch: 64,
    }
}

const TYPED_COLUMNS: &[&str] = &[
    "id", "n", "big", "num", "ch", "c1", "flag", "at", "day", "doc", "raw", "u", "ints", "pos",
    "note",
];

/// Values of row `i` of the typed table, as pgoutput writes them (each type's text output),
/// with NULLs in the columns of `i`'s set bits past the key.
fn typed_values(i: u64) -> Vec<Option<String>> {
    let all = [
        i.to_string(),
        format!("{}", i as i64 * 7 - 3),
        format!("{}", 9_000_000_000_i64 + i as i64),
        format!("{}.{:03}", i, i % 1000),
        "ab".to_string(),
        "x".to_string(),
        if i.is_multiple_of(2) { "t" } else { "f" }.to_string(),
        format!("2026-12-07 10:{:02}:{:02}.123456+00", i % 60, (i * 7) % 60),
        format!("2026-01-{:02}", 1 + i % 28),
        format!("{{\"k\": {i}, \"s\": \"it's\"}}"),
        format!("\\x{:02x}ff00", i % 256),
        format!("00000000-0000-0000-0000-{:012x}", i),
        format!("{{{i},{},NULL}}", i + 1),
        format!("{}", 1 + i),
        "a 'quoted' \\ value".to_string(),
    ];
    all.iter()
        .enumerate()
        .map(|(c, v)| (c == 0 || (i >> (c % 8)) & 1 == 0).then(|| v.clone()))
        .collect()
}

/// A runtime for the applier (the `postgres` client runs its own, outside it).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// An applier of migration `migration_id` (one session, batches) that has applied all of
/// `txns`, with the runtime it runs on.
fn apply_all(
    pg: &PgServer,
    migration_id: u64,
    txns: &[ShadowTxn],
) -> (tokio::runtime::Runtime, ShadowApplier) {
    let rt = runtime();
    let mut applier = rt
        .block_on(ShadowApplier::connect(config(pg, migration_id)))
        .unwrap();
    rt.block_on(async {
        for t in txns {
            applier.submit(t.clone()).await.unwrap();
        }
        applier.drain().await.unwrap();
    });
    (rt, applier)
}

#[test]
fn every_type_and_null_arrives_as_the_source_wrote_it() {
    let pg = server();
    let mut c = sql_client(&pg);
    c.batch_execute(
        "CREATE EXTENSION pg_remus;
         CREATE DOMAIN positive AS int CHECK (VALUE > 0);
         CREATE TABLE typed(id bigint PRIMARY KEY, n int, big bigint, num numeric(12,3),
           ch character(3), c1 \"char\", flag bool, at timestamptz, day date, doc jsonb,
           raw bytea, u uuid, ints int[], pos positive, note text);
         CREATE TABLE expected (LIKE typed);
         CREATE TABLE marker(id int PRIMARY KEY, v text);",
    )
    .unwrap();
    const N: u64 = 200;
    let mut txns = Vec::new();
    for i in 0..N {
        let values = typed_values(i);
        let refs: Vec<Option<&str>> = values.iter().map(|v| v.as_deref()).collect();
        let mut changes = vec![
            change(
                row_change::Kind::Insert,
                "marker",
                &["id", "v"],
                &[Some(&i.to_string()), Some("m")],
            ),
            change(row_change::Kind::Insert, "typed", TYPED_COLUMNS, &refs),
        ];
        // Every fifth transaction also updates the row of the one before it: a guarded UPDATE
        // of one row, which must find it.
        if i % 5 == 4 {
            let prev = (i - 1).to_string();
            changes.push(change(
                row_change::Kind::Update,
                "typed",
                &["id", "note"],
                &[Some(&prev), Some("updated")],
            ));
        }
        txns.push(txn(i, changes));
    }
    let (rt, applier) = apply_all(&pg, 31, &txns);
    assert_eq!(applier.txns_applied(), N);
    assert_eq!(
        applier.batches_failed(),
        0,
        "no batch failed (a failed one is applied again one by one, which would hide it)"
    );
    assert!(
        applier.txns_batched() > N / 2,
        "{} of {N} in batches",
        applier.txns_batched()
    );
    assert!(
        applier.native_changes() > 0,
        "batches went through remus.apply_batch"
    );
    assert_eq!(
        applier.static_changes(),
        0,
        "not through the session's PL/pgSQL procedure"
    );

    // The same values inserted by SQL, each a literal PostgreSQL reads with the column's input.
    let cols = TYPED_COLUMNS.join(", ");
    for i in 0..N {
        let literals: Vec<String> = typed_values(i)
            .iter()
            .map(|v| {
                v.as_ref().map_or("NULL".to_string(), |s| {
                    format!("'{}'", s.replace('\'', "''"))
                })
            })
            .collect();
        c.execute(
            &format!(
                "INSERT INTO expected ({cols}) VALUES ({})",
                literals.join(", ")
            ),
            &[],
        )
        .unwrap();
        if i % 5 == 4 {
            c.execute(
                "UPDATE expected SET note = 'updated' WHERE id = $1",
                &[&((i - 1) as i64)],
            )
            .unwrap();
        }
    }
    let differ: i64 = c
        .query_one(
            "SELECT count(*) FROM (
               (SELECT * FROM typed EXCEPT SELECT * FROM expected)
               UNION ALL (SELECT * FROM expected EXCEPT SELECT * FROM typed)) d",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        differ, 0,
        "rows that differ from the same values inserted by SQL"
    );
    let rows: i64 = c
        .query_one("SELECT count(*) FROM typed", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, N as i64);

    // Each transaction committed alone, at its source commit time.
    let wrong: i64 = c
        .query_one(
            "SELECT count(*) FROM marker
              WHERE pg_catalog.pg_xact_commit_timestamp(xmin)
                    <> '2000-01-01 00:00:00+00'::timestamptz
                       + (720000000000000 + id::bigint * 1000) * interval '1 microsecond'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        wrong, 0,
        "marker rows whose commit time is not their source's"
    );
    let distinct: i64 = c
        .query_one("SELECT count(DISTINCT xmin::text) FROM marker", &[])
        .unwrap()
        .get(0);
    assert_eq!(distinct, N as i64);
    let origin: String = c
        .query_one(
            "SELECT pg_catalog.pg_replication_origin_progress('remus_m31_w0', false)::text",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        origin,
        replay_worker::apply::format_lsn(txns.last().unwrap().commit_lsn)
    );
    rt.block_on(applier.finish()).unwrap();
}

fn dump(c: &mut postgres::Client) -> String {
    c.query_one(
        "SELECT coalesce(string_agg(id || ':' || v, ',' ORDER BY id), '') FROM b",
        &[],
    )
    .unwrap()
    .get(0)
}

#[test]
fn a_divergence_inside_a_batch_commits_the_transactions_before_it() {
    let pg = server();
    let mut c = sql_client(&pg);
    c.batch_execute(
        "CREATE EXTENSION pg_remus;
         CREATE TABLE a(id int PRIMARY KEY, v text);
         CREATE TABLE b(id int PRIMARY KEY, v text);",
    )
    .unwrap();
    let ins = |t: &str, id: i64, v: &str| {
        change(
            row_change::Kind::Insert,
            t,
            &["id", "v"],
            &[Some(&id.to_string()), Some(v)],
        )
    };
    let rt = runtime();
    let mut applier = rt
        .block_on(ShadowApplier::connect(config(&pg, 32)))
        .unwrap();
    // The first runs alone (the session is idle when it arrives); the next four, independent
    // of each other, wait for it and then go as one batch.
    let first = txn(0, vec![ins("b", 1, "first")]);
    let before = txn(1, vec![ins("b", 2, "before")]);
    let bad = txn(
        2,
        vec![
            ins("b", 3, "must not stay"),
            change(
                row_change::Kind::Update,
                "a",
                &["id", "v"],
                &[Some("99"), Some("x")],
            ),
        ],
    );
    let after = txn(3, vec![ins("b", 4, "after")]);
    let err = rt.block_on(async {
        for t in [&first, &before, &bad, &after] {
            applier.submit(t.clone()).await.unwrap();
        }
        applier.drain().await.expect_err("update of a missing row")
    });
    match &err {
        ApplyError::Divergence { xid, table, op, .. } => {
            assert_eq!(
                (*xid, table.as_str(), *op),
                (bad.xid, "\"public\".\"a\"", "UPDATE")
            )
        }
        other => panic!("expected a divergence, got {other:?}"),
    }
    assert_eq!(
        applier.batches_failed(),
        1,
        "the batch stopped at the bad transaction"
    );
    assert!(applier.native_changes() == 0, "no batch call succeeded");
    assert_eq!(dump(&mut c), "1:first,2:before");
    assert_eq!(applier.applied_lsn(), before.end_lsn);
    rt.block_on(applier.abort());
}

#[test]
fn more_shapes_than_a_session_keeps_plans_for() {
    let pg = server();
    let mut c = sql_client(&pg);
    c.batch_execute(
        "CREATE EXTENSION pg_remus;
         CREATE TABLE wide(id int PRIMARY KEY, c0 int, c1 int, c2 int, c3 int, c4 int, \
           c5 int, c6 int, c7 int, c8 int, c9 int, c10 int)",
    )
    .unwrap();
    let cols: Vec<String> = std::iter::once("id".to_string())
        .chain((0..11).map(|j| format!("c{j}")))
        .collect();
    let col_refs: Vec<&str> = cols.iter().map(String::as_str).collect();
    const N: u64 = 1300;
    let txns: Vec<ShadowTxn> = (0..N)
        .map(|i| {
            let id = i.to_string();
            // Column j is NULL where bit j of the id is set: 1,300 ids, as many shapes.
            let values: Vec<Option<&str>> = std::iter::once(Some(id.as_str()))
                .chain((0..11).map(|j| (i >> j & 1 == 0).then_some(id.as_str())))
                .collect();
            let mut changes = vec![change(row_change::Kind::Insert, "wide", &col_refs, &values)];
            if i % 7 == 0 {
                // An update that changes only unchanged TOAST values: a guarded SELECT … FOR
                // UPDATE of the row.
                let mut untouched = change(
                    row_change::Kind::Update,
                    "wide",
                    &col_refs,
                    &[Some(id.as_str())],
                );
                untouched.new_values.extend((0..11).map(|_| ColumnValue {
                    value: Some(column_value::Value::UnchangedToast(true)),
                }));
                changes.push(untouched);
            }
            txn(i, changes)
        })
        .collect();
    let (rt, applier) = apply_all(&pg, 33, &txns);
    assert_eq!(applier.txns_applied(), N);
    assert_eq!(applier.batches_failed(), 0, "no batch failed");
    assert!(
        applier.txns_batched() > N / 2,
        "{} of {N} in batches",
        applier.txns_batched()
    );
    assert!(applier.native_changes() > 0);
    let wrong: i64 = c
        .query_one(
            "SELECT count(*) FROM wide WHERE EXISTS (
               SELECT FROM generate_series(0, 10) j
                WHERE (pg_catalog.to_jsonb(wide) ->> ('c' || j)) IS DISTINCT FROM
                      CASE WHEN id >> j & 1 = 1 THEN NULL ELSE id::text END)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(wrong, 0, "rows whose columns are not their INSERT's");
    let rows: i64 = c
        .query_one("SELECT count(*) FROM wide", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, N as i64);
    rt.block_on(applier.finish()).unwrap();
}

/// The SQLSTATE of `sql`'s error.
fn error_of(c: &mut postgres::Client, sql: &str) -> String {
    match c.batch_execute(sql) {
        Ok(()) => format!("no error from {sql}"),
        Err(e) => e
            .code()
            .map_or_else(|| e.to_string(), |s| s.code().to_string()),
    }
}

#[test]
fn the_procedure_refuses_what_it_cannot_do_safely() {
    let pg = server();
    let mut c = sql_client(&pg);
    c.batch_execute(
        "CREATE EXTENSION pg_remus;
         CREATE TABLE t(id int PRIMARY KEY, v text);
         CREATE ROLE app LOGIN;
         GRANT ALL ON t TO app;
         PREPARE shape_t AS INSERT INTO t (id, v) VALUES ($1, $2);
         SELECT remus.apply_shape('shape_t', 'INSERT INTO t (id, v) VALUES ($1, $2)');",
    )
    .unwrap();
    let call = |stmt: &str| {
        format!(
            "CALL remus.apply_batch(ARRAY[1000]::bigint[], ARRAY[0]::bigint[], ARRAY[1], \
             ARRAY['{stmt}'], ARRAY[false], ARRAY[0], ARRAY['7', 'seven'])"
        )
    };
    // No replication origin set up in the session.
    assert_eq!(error_of(&mut c, &call("shape_t")), "55000");
    c.batch_execute(
        "SELECT pg_catalog.pg_replication_origin_create('batch_test');
         SELECT pg_catalog.pg_replication_origin_session_setup('batch_test');",
    )
    .unwrap();
    // Inside a transaction block it could not commit.
    assert_eq!(
        error_of(&mut c, &format!("BEGIN; {}", call("shape_t"))),
        "2D000"
    );
    c.batch_execute("ROLLBACK").unwrap();
    // A statement the session has no kept plan of.
    assert_eq!(error_of(&mut c, &call("nope")), "26000");
    // Arrays that do not line up.
    assert_eq!(
        error_of(
            &mut c,
            "CALL remus.apply_batch(ARRAY[1]::bigint[], ARRAY[]::bigint[], ARRAY[1], ARRAY['shape_t'], \
             ARRAY[false], ARRAY[0], ARRAY['7', 'seven'])"
        ),
        "22023"
    );
    let rows: i64 = c.query_one("SELECT count(*) FROM t", &[]).unwrap().get(0);
    assert_eq!(rows, 0, "nothing committed by a refused call");
    assert_eq!(
        c.query_one("SELECT remus.apply_batch_done()", &[])
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    // The same call as it should be commits its one transaction at the position given.
    c.batch_execute(&call("shape_t")).unwrap();
    let row = c.query_one("SELECT v FROM t WHERE id = 7", &[]).unwrap();
    assert_eq!(row.get::<_, String>(0), "seven");
    assert_eq!(
        c.query_one("SELECT remus.apply_batch_done()", &[])
            .unwrap()
            .get::<_, i64>(0),
        1000
    );
    // An application role may not call it (nor keep shapes).
    let mut app =
        postgres::Client::connect(&pg.conninfo().replace("user=postgres", "user=app"), NoTls)
            .expect("connect as app");
    assert_eq!(error_of(&mut app, &call("shape_t")), "42501");
    assert_eq!(
        error_of(&mut app, "SELECT remus.apply_shape('shape_t', 'SELECT 1')"),
        "42501"
    );
}
