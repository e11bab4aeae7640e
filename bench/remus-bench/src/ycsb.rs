//! YCSB (workload A: 50% reads, 50% updates of one field, each in its own BEGIN … COMMIT) on
//! `usertable (ycsb_key bigint, field0 … field9 text)`: 8-byte keys and 10 × 100 bytes, hash
//! distributed by key. And the two clients the hybrid workloads add: batch COPY ingestion of new
//! rows with monotonic keys (A), and the paper's duplicate-key query (B).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use bytes::Bytes;
use futures_util::SinkExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_postgres::Client;

use crate::keys::{pick_op, KeyChooser, Op};
use crate::run::{connect, describe, Counters, RunCtx};
use crate::series::{class_of, Event, Outcome};

pub const TABLE: &str = "usertable";
pub const FIELDS: usize = 10;
pub const FIELD_LEN: usize = 100;

/// The paper's duplicate-key check (`… group by aid … where x != 't'`): keys seen more than
/// once in a full read of the table. The filter makes every row be read.
pub const DUPLICATES: &str = "SELECT count(*) FROM (SELECT ycsb_key FROM usertable \
     WHERE field0 <> 't' GROUP BY ycsb_key HAVING count(*) > 1) AS dup";

const READ: &str = "SELECT field0, field1, field2, field3, field4, field5, field6, field7, \
     field8, field9 FROM usertable WHERE ycsb_key = $1";
const UPDATES: [&str; FIELDS] = [
    "UPDATE usertable SET field0 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field1 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field2 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field3 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field4 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field5 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field6 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field7 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field8 = $1 WHERE ycsb_key = $2",
    "UPDATE usertable SET field9 = $1 WHERE ycsb_key = $2",
];

/// A field value: `FIELD_LEN` printable characters.
pub fn field(rng: &mut impl Rng) -> String {
    (0..FIELD_LEN)
        .map(|_| char::from(rng.random_range(b'a'..=b'z')))
        .collect()
}

/// COPY text rows for keys `from..to`.
pub fn copy_rows(rng: &mut impl Rng, from: i64, to: i64) -> String {
    let mut s =
        String::with_capacity((to - from).max(0) as usize * (FIELDS * (FIELD_LEN + 1) + 21));
    for k in from..to {
        s.push_str(&k.to_string());
        for _ in 0..FIELDS {
            s.push('\t');
            s.push_str(&field(rng));
        }
        s.push('\n');
    }
    s
}

/// Drops and creates the table, distributes it over `shards` shards and fills keys
/// `1..=records` with COPY.
pub async fn load(db: &Client, records: i64, shards: u32, seed: u64) -> Result<()> {
    let cols: Vec<String> = (0..FIELDS).map(|i| format!("field{i} text")).collect();
    db.batch_execute(&format!(
        "DROP TABLE IF EXISTS {TABLE}; \
         CREATE TABLE {TABLE} (ycsb_key bigint PRIMARY KEY, {}); \
         SELECT remus_create_distributed_table('{TABLE}', 'ycsb_key', {shards});",
        cols.join(", ")
    ))
    .await
    .context("creating usertable")?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut k = 1;
    while k <= records {
        let to = (k + 5000).min(records + 1);
        copy(db, copy_rows(&mut rng, k, to))
            .await
            .with_context(|| format!("COPY of keys {k}..{to}"))?;
        k = to;
    }
    Ok(())
}

async fn copy(db: &Client, rows: String) -> Result<u64, tokio_postgres::Error> {
    let sink = db
        .copy_in::<_, Bytes>(&format!("COPY {TABLE} FROM STDIN"))
        .await?;
    futures_util::pin_mut!(sink);
    sink.send(Bytes::from(rows)).await?;
    sink.finish().await
}

/// The highest key in the table (0 when empty).
pub async fn max_key(db: &Client) -> Result<i64> {
    Ok(db
        .query_one(
            &format!("SELECT coalesce(max(ycsb_key), 0) FROM {TABLE}"),
            &[],
        )
        .await
        .context("max(ycsb_key)")?
        .get(0))
}

/// One YCSB client against its node until the run ends: no retries (an aborted operation is
/// an abort in the series).
pub async fn client(
    ctx: Arc<RunCtx>,
    conninfo: String,
    keys: Arc<KeyChooser>,
    read_pct: u32,
    seed: u64,
    counters: Arc<Counters>,
) -> (Vec<Event>, Vec<String>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut events = Vec::new();
    let mut errors = Vec::new();
    let mut db: Option<(Client, Vec<tokio_postgres::Statement>)> = None;
    while !ctx.over() {
        if db.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            db = None;
            let Some(c) = connect(&ctx, &conninfo, &mut events).await else {
                break;
            };
            let mut stmts = Vec::new();
            for sql in std::iter::once(READ).chain(UPDATES) {
                match c.prepare(sql).await {
                    Ok(s) => stmts.push(s),
                    Err(e) => {
                        if errors.len() < 20 {
                            errors.push(format!("preparing {sql}: {}", describe(&e)));
                        }
                        break;
                    }
                }
            }
            if stmts.len() != 1 + FIELDS {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
            db = Some((c, stmts));
        }
        let (c, stmts) = db.as_mut().expect("connected");
        let key = keys.next(&mut rng);
        let op = pick_op(&mut rng, read_pct);
        let value = (op == Op::Update).then(|| (rng.random_range(0..FIELDS), field(&mut rng)));
        let started = Instant::now();
        let r = async {
            let tx = c.transaction().await?;
            match &value {
                None => {
                    tx.query_opt(&stmts[0], &[&key]).await?;
                }
                Some((f, v)) => {
                    tx.execute(&stmts[1 + f], &[v, &key]).await?;
                }
            }
            tx.commit().await
        }
        .await;
        let latency_us = started.elapsed().as_micros() as u64;
        let outcome = match &r {
            Ok(()) => {
                counters.commits.fetch_add(1, Ordering::Relaxed);
                Outcome::Commit
            }
            Err(e) => {
                counters.aborts.fetch_add(1, Ordering::Relaxed);
                if errors.len() < 20 {
                    errors.push(describe(e));
                }
                Outcome::Failed(class_of(e))
            }
        };
        events.push(Event {
            at_us: ctx.now_us(),
            latency_us,
            outcome,
            units: 1,
        });
    }
    (events, errors)
}

/// Hybrid A's ingestion client: COPY batches of `batch` new rows with keys from `first` up,
/// each batch tried again until it commits (each failed try an abort in the series).
pub async fn ingest(
    ctx: Arc<RunCtx>,
    conninfo: String,
    first: i64,
    batch: i64,
    seed: u64,
    counters: Arc<Counters>,
) -> (Vec<Event>, Vec<String>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut events = Vec::new();
    let mut errors = Vec::new();
    let mut db: Option<Client> = None;
    let mut next = first;
    // The first key of the batch whose last try failed.
    let mut failed_at: Option<i64> = None;
    while !ctx.over() {
        if db.as_ref().is_none_or(Client::is_closed) {
            db = connect(&ctx, &conninfo, &mut events).await;
            if db.is_none() {
                break;
            }
        }
        let c = db.as_ref().expect("connected");
        let rows = copy_rows(&mut rng, next, next + batch);
        // The same batch until it commits. A unique violation after a failed try means that
        // try committed and only its answer was lost (COPY is atomic, and nobody else writes
        // these keys): the batch is in.
        loop {
            let started = Instant::now();
            let r = copy(c, rows.clone()).await;
            let latency_us = started.elapsed().as_micros() as u64;
            let at_us = ctx.now_us();
            let lost_answer = failed_at == Some(next)
                && matches!(&r, Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION));
            match r {
                _ if lost_answer => {
                    counters.commits.fetch_add(1, Ordering::Relaxed);
                    errors.push(format!(
                        "keys {next}.. were committed by a try whose answer was lost"
                    ));
                    events.push(Event {
                        at_us,
                        latency_us,
                        outcome: Outcome::Commit,
                        units: batch as u64,
                    });
                    next += batch;
                    break;
                }
                Ok(_) => {
                    counters.commits.fetch_add(1, Ordering::Relaxed);
                    events.push(Event {
                        at_us,
                        latency_us,
                        outcome: Outcome::Commit,
                        units: batch as u64,
                    });
                    next += batch;
                    break;
                }
                Err(e) => {
                    counters.aborts.fetch_add(1, Ordering::Relaxed);
                    if errors.len() < 20 {
                        errors.push(describe(&e));
                    }
                    events.push(Event {
                        at_us,
                        latency_us,
                        outcome: Outcome::Retried(class_of(&e)),
                        units: 0,
                    });
                    failed_at = Some(next);
                    if ctx.over() || c.is_closed() {
                        break;
                    }
                }
            }
        }
    }
    (events, errors)
}

/// Hybrid B's analytical client: [`DUPLICATES`] in a loop; every answer other than 0 is
/// returned as a violation.
pub async fn analytic(
    ctx: Arc<RunCtx>,
    conninfo: String,
    counters: Arc<Counters>,
) -> (Vec<Event>, Vec<String>, Vec<String>) {
    let mut events = Vec::new();
    let mut errors = Vec::new();
    let mut wrong = Vec::new();
    let mut db: Option<Client> = None;
    while !ctx.over() {
        if db.as_ref().is_none_or(Client::is_closed) {
            db = connect(&ctx, &conninfo, &mut events).await;
            if db.is_none() {
                break;
            }
        }
        let c = db.as_ref().expect("connected");
        let started = Instant::now();
        let r = c.query_one(DUPLICATES, &[]).await;
        let latency_us = started.elapsed().as_micros() as u64;
        let at_us = ctx.now_us();
        let outcome = match r {
            Ok(row) => {
                let n: i64 = row.get(0);
                if n != 0 {
                    wrong.push(format!("at {} ms: {n} duplicated keys", at_us / 1000));
                }
                counters.commits.fetch_add(1, Ordering::Relaxed);
                Outcome::Commit
            }
            Err(e) => {
                counters.aborts.fetch_add(1, Ordering::Relaxed);
                if errors.len() < 20 {
                    errors.push(describe(&e));
                }
                Outcome::Failed(class_of(&e))
            }
        };
        events.push(Event {
            at_us,
            latency_us,
            outcome,
            units: 1,
        });
    }
    (events, errors, wrong)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_rows_are_a_kilobyte_with_the_keys_in_order() {
        let mut rng = StdRng::seed_from_u64(1);
        let s = copy_rows(&mut rng, 5, 8);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 3);
        for (l, k) in lines.iter().zip(5..) {
            let cols: Vec<&str> = l.split('\t').collect();
            assert_eq!(cols[0], k.to_string());
            assert_eq!(cols.len(), 1 + FIELDS);
            assert!(cols[1..].iter().all(|c| c.len() == FIELD_LEN));
        }
        assert!(copy_rows(&mut rng, 3, 3).is_empty());
    }
}
