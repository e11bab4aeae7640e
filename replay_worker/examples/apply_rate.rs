//! The replay's apply rate, measured alone (issue 17; measurement, not a test): a throwaway
//! PostgreSQL 15 server, a table of `ROWS` rows `(id int primary key, v text)`, and `TXNS`
//! shipped transactions of one UPDATE of a pseudo-random row each (the shape of the catch-up
//! bench's writers) applied by a `ShadowApplier` with `PARALLELISM` sessions. Prints the
//! transactions per second from the first submit to the last commit.
//!
//! `cargo run --release -p replay_worker --example apply_rate` (as root: the server runs as
//! the `postgres` OS user). Environment: `TXNS` (20000), `ROWS` (10000), `PARALLELISM` (4).

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
    let (txns, rows, parallelism) = (
        env("TXNS", 20_000),
        env("ROWS", 10_000),
        env("PARALLELISM", 4),
    );
    let dst = PgServer::start_with(
        "-c max_connections=40 -c track_commit_timestamp=on",
        "apply-rate-",
    );
    let (client, conn) = tokio_postgres::connect(&dst.conninfo(), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
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
    })
    .await?;
    let started = Instant::now();
    for t in stream {
        applier.submit(t).await?;
    }
    applier.drain().await?;
    let secs = started.elapsed().as_secs_f64();
    applier.finish().await?;
    println!(
        "applied {txns} one-row UPDATE transactions with {parallelism} sessions in {secs:.2} s: {:.0} txn/s",
        txns as f64 / secs
    );
    Ok(())
}
