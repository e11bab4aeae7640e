//! The replay's apply rate, measured alone (issue 17; measurement, not a test): a throwaway
//! PostgreSQL 15 server, a table of `ROWS` rows `(id int primary key, v text)`, and `TXNS`
//! shipped transactions of one UPDATE of a pseudo-random row each (the shape of the catch-up
//! bench's writers) applied by a `ShadowApplier` with `PARALLELISM` sessions. Prints the
//! transactions per second from the first submit to the last commit.
//!
//! `cargo run --release -p replay_worker --example apply_rate` (as root: the server runs as
//! the `postgres` OS user). Environment: `TXNS` (20000), `ROWS` (10000), `PARALLELISM` (4),
//! `APPLY_BATCH` (0: one transaction per call), `EXTENSION` (0; 1: the server preloads the
//! installed pg_remus and has the extension, so batches go through its `remus.apply_batch`
//! instead of each session's PL/pgSQL procedure).

use std::time::Instant;

use remus_proto::v1::{column_value, row_change, ColumnValue, RowChange, ShadowTxn};
use remus_test_support::pg::PgServer;
use replay_worker::{ApplyConfig, ShadowApplier};

const START_LSN: u64 = 0x100_0000;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn text(s: impl ToString) -> ColumnValue {
    ColumnValue {
        value: Some(column_value::Value::Text(s.to_string())),
    }
}

/// The `i`-th transaction: `UPDATE a SET v = … WHERE id = …` of one row.
fn update(i: u64, id: u64) -> ShadowTxn {
    let commit_lsn = START_LSN + (i + 1) * 0x100;
    ShadowTxn {
        xid: 1000 + i as u32,
        commit_lsn,
        end_lsn: commit_lsn + 0x30,
        commit_time_us: 700_000_000_000_000 + i as i64 * 1_000,
        changes: vec![RowChange {
            kind: row_change::Kind::Update as i32,
            schema: "public".into(),
            table: "a".into(),
            columns: vec!["id".into(), "v".into()],
            key: vec![true, false],
            new_values: vec![text(id), text(format!("v{i}"))],
            ..RowChange::default()
        }],
        shadow_gid: String::new(),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let (txns, rows, parallelism, batch) = (
        env("TXNS", 20_000),
        env("ROWS", 10_000),
        env("PARALLELISM", 4),
        env("BATCH", 1_000).max(1) as usize,
    );
    let extension = env("EXTENSION", 0) == 1;
    let dst = PgServer::start_with(
        if extension {
            "-c max_connections=40 -c track_commit_timestamp=on \
             -c shared_preload_libraries=pg_remus"
        } else {
            "-c max_connections=40 -c track_commit_timestamp=on"
        },
        "apply-rate-",
    );
    let (client, conn) = tokio_postgres::connect(&dst.conninfo(), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    if extension {
        client.batch_execute("CREATE EXTENSION pg_remus").await?;
    }
    client
        .batch_execute(&format!(
            "CREATE TABLE a(id int PRIMARY KEY, v text);
             INSERT INTO a SELECT g, 'v' FROM generate_series(1, {rows}) g;"
        ))
        .await?;
    // Alone: VACUUM refuses to run in the implicit transaction of a multi-statement query.
    client.batch_execute("VACUUM ANALYZE a").await?;
    // A fixed pseudo-random sequence of rows (an LCG), so every run applies the same stream.
    let mut x: u64 = 0x5eed;
    let stream: Vec<ShadowTxn> = (0..txns)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            update(i, (x >> 33) % rows + 1)
        })
        .collect();
    let mut applier = ShadowApplier::connect(ApplyConfig {
        migration_id: 1,
        destination_conninfo: dst.conninfo(),
        parallelism: parallelism as usize,
        start_lsn: START_LSN,
        batch: env("APPLY_BATCH", 0) as usize,
    })
    .await?;
    let started = Instant::now();
    for t in stream.iter().cloned() {
        applier.submit(t).await?;
    }
    applier.drain().await?;
    let secs = started.elapsed().as_secs_f64();
    let (batched, statics, native) = (
        applier.txns_batched(),
        applier.static_changes(),
        applier.native_changes(),
    );
    applier.finish().await?;
    println!(
        "applied {txns} one-row UPDATE transactions with {parallelism} sessions (batches of at most {}) in {secs:.2} s: {:.0} txn/s ({batched} in batches; changes static {statics}, by remus.apply_batch {native})",
        env("APPLY_BATCH", 0).max(1),
        txns as f64 / secs
    );
    let secs = apply_in_procedure(&client, &stream, batch).await?;
    println!(
        "the same {txns} transactions applied by a PL/pgSQL procedure in one session, {batch} per CALL, in {secs:.2} s: {:.0} txn/s",
        txns as f64 / secs
    );
    Ok(())
}

/// Applies `stream` (one-row UPDATEs of `a`) in the server: a procedure that sets each
/// transaction's origin position and commit time, updates the row, fails unless it found it,
/// and commits; `batch` transactions per CALL, on one session bound to an origin of its own,
/// with asynchronous commit. Returns the seconds from the first CALL to the last.
async fn apply_in_procedure(
    client: &tokio_postgres::Client,
    stream: &[ShadowTxn],
    batch: usize,
) -> anyhow::Result<f64> {
    client
        .batch_execute(
            "CREATE PROCEDURE apply_updates(ids int[], vs text[], lsns bigint[], times_us bigint[])
             LANGUAGE plpgsql AS $$
             BEGIN
               FOR i IN 1 .. coalesce(array_length(ids, 1), 0) LOOP
                 PERFORM pg_catalog.pg_replication_origin_xact_setup(
                   '0/0'::pg_catalog.pg_lsn + lsns[i],
                   '2000-01-01 00:00:00+00'::timestamptz + times_us[i] * interval '1 microsecond');
                 UPDATE a SET v = vs[i] WHERE id = ids[i];
                 IF NOT FOUND THEN
                   RAISE EXCEPTION 'row % missing', ids[i] USING ERRCODE = 'RM004';
                 END IF;
                 COMMIT;
               END LOOP;
             END $$;
             SELECT pg_catalog.pg_replication_origin_create('apply_rate_procedure');
             SELECT pg_catalog.pg_replication_origin_session_setup('apply_rate_procedure');
             SET synchronous_commit = off;",
        )
        .await?;
    let call = client
        .prepare("CALL apply_updates($1::int[], $2::text[], $3::bigint[], $4::bigint[])")
        .await?;
    // The values of each UPDATE as the stream carries them: the key, then the new value.
    let value = |t: &ShadowTxn, i: usize| -> anyhow::Result<String> {
        match t.changes[0].new_values[i].value.as_ref() {
            Some(column_value::Value::Text(v)) => Ok(v.clone()),
            other => anyhow::bail!("unexpected value {other:?}"),
        }
    };
    let started = Instant::now();
    for chunk in stream.chunks(batch) {
        let mut ids = Vec::with_capacity(chunk.len());
        let mut vs = Vec::with_capacity(chunk.len());
        for t in chunk {
            ids.push(value(t, 0)?.parse::<i32>()?);
            vs.push(value(t, 1)?);
        }
        // Past the applier's positions, so the origin only moves forward.
        let lsns: Vec<i64> = chunk
            .iter()
            .map(|t| (t.commit_lsn + 0x1000_0000) as i64)
            .collect();
        let times: Vec<i64> = chunk.iter().map(|t| t.commit_time_us).collect();
        client.execute(&call, &[&ids, &vs, &lsns, &times]).await?;
    }
    let secs = started.elapsed().as_secs_f64();
    // Each transaction committed with the source's position and time: the origin is at the
    // last one's, and the last row written carries the last commit time.
    let last = stream.last().expect("a stream of at least one transaction");
    let row = client
        .query_one(
            "SELECT (pg_catalog.pg_replication_origin_progress('apply_rate_procedure', false)
                      - '0/0'::pg_catalog.pg_lsn)::bigint,
                    (extract(epoch FROM pg_catalog.pg_xact_commit_timestamp(xmin)
                       - '2000-01-01 00:00:00+00'::timestamptz) * 1000000)::bigint
               FROM a WHERE id = $1",
            &[&value(last, 0)?.parse::<i32>()?],
        )
        .await?;
    let (origin_at, commit_time): (i64, i64) = (row.get(0), row.get(1));
    anyhow::ensure!(
        origin_at == (last.commit_lsn + 0x1000_0000) as i64 && commit_time == last.commit_time_us,
        "the procedure's last transaction committed at {origin_at:?} / {commit_time}, not at the stream's position and time"
    );
    Ok(secs)
}
