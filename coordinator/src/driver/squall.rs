//! squall mode (Squall, seed 000; the Remus paper's PolarDB-Squall; decision 0025): ownership
//! passes to the target first, then the target pulls the data.
//!
//! - `copy`: the migration is registered on every node, the target gets the empty shard tables
//!   (as every mode's copy makes them) and the chunk catalog `remus.squall_chunks`: each shard's
//!   hash range split into sub-ranges of about [`DEFAULT_CHUNK_BYTES`] of the source's rows
//!   (split points: percentiles of `remus.key_hash(key)` over the source's rows). No row moves.
//! - `handover`: the admission gate closes on every node and the transactions admitted before
//!   it drain, bounded by `remus.gate_drain_timeout` (wait_remaster's primitive: nothing is
//!   aborted; past the bound the migration rolls back); the source's copy is fenced (a write
//!   routed to it with a stale map fails with 40001, so the copy the pulls read never changes);
//!   Tm flips ownership; the gates reopen. From here the target serves the shards.
//! - `cleanup` (after the Tm decision: forward only): one puller per shard pulls chunk after
//!   chunk, each in one target transaction that holds the chunk's range lock (a transaction
//!   advisory lock `(shard_id, chunk)`), inserts its rows (read from the source as text of the row type) and
//!   marks it pulled; between pulls it paces ([`DEFAULT_PACE`], the paper's 200 ms) unless a
//!   target transaction asks for a chunk or the shard (`migration::squall` on the node): the
//!   puller stops pacing and pulls a chunk asked for first, Squall's reactive pull. A failed pull is retried (a fresh session)
//!   for up to [`NODE_WAIT`] of consecutive failures. Then the drain of transactions older
//!   than Tm, the source's copy dropped, the registration ended, the chunk catalog emptied.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::{join, sql, DriverError, Run, NODE_WAIT};
use crate::failpoint::{self, Failpoints};
use crate::migration::Phase;
use crate::node_conn::NodeConnector;
use crate::node_registry::NodeRecord;

/// The paper's chunk size limit (section 7: 8 MB).
const DEFAULT_CHUNK_BYTES: u64 = 8 << 20;
/// The paper's minimum time between asynchronous pulls (section 7: 200 ms).
const DEFAULT_PACE: Duration = Duration::from_millis(200);
/// How often a pacing puller looks for a target transaction waiting for its shard.
const REQUEST_POLL: Duration = Duration::from_millis(10);

/// `REMUS_SQUALL_CHUNK_BYTES` in the coordinator's environment, else the paper's 8 MB.
fn chunk_bytes() -> u64 {
    std::env::var("REMUS_SQUALL_CHUNK_BYTES")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|b| *b > 0)
        .unwrap_or(DEFAULT_CHUNK_BYTES)
}

/// `REMUS_SQUALL_PACE_MS` in the coordinator's environment, else the paper's 200 ms.
fn pace() -> Duration {
    std::env::var("REMUS_SQUALL_PACE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_PACE)
}

/// The chunks `[lo, hi]` of a shard's hash range `[hash_min, hash_max]` split at `bounds`
/// (each bound the last hash of a chunk); bounds outside the range or repeated are skipped, so
/// the chunks cover the range exactly, in order, without overlap.
fn chunk_ranges(hash_min: i32, hash_max: i32, bounds: &[i32]) -> Vec<(i32, i32)> {
    let mut bounds: Vec<i32> = bounds
        .iter()
        .copied()
        .filter(|b| *b >= hash_min && *b < hash_max)
        .collect();
    bounds.sort_unstable();
    bounds.dedup();
    let mut chunks = Vec::with_capacity(bounds.len() + 1);
    let mut lo = hash_min;
    for b in bounds {
        chunks.push((lo, b));
        lo = b + 1;
    }
    chunks.push((lo, hash_max));
    chunks
}

/// Rows and bytes pulled so far by every puller of a migration.
#[derive(Default)]
struct Pulled {
    rows: AtomicU64,
    bytes: AtomicU64,
}

/// What one shard's puller needs, owned: the pullers run as tasks of their own.
#[derive(Clone)]
struct Puller {
    migration_id: u64,
    shard_id: i64,
    /// Quoted, qualified shard table (the same name on source and target).
    table: String,
    /// Quoted shard key column.
    key: String,
    /// Quoted columns that a pull inserts (not dropped, not generated), in order.
    columns: String,
    /// The same columns as fields of the row `r`: `(r).a, (r).b`.
    fields: String,
    source: NodeRecord,
    target: NodeRecord,
    connector: NodeConnector,
    failpoints: Failpoints,
}

impl Run {
    /// The squall pipeline: `copy` (empty tables, chunk catalog), `handover` (ownership),
    /// `cleanup` (the pulls, then the source's copy dropped).
    pub(super) async fn squall(&mut self) -> Result<(), DriverError> {
        self.reporter.advance(Phase::Copy).await?;
        self.squall_prepare().await?;
        self.reporter.advance(Phase::Handover).await?;
        let gated = Instant::now();
        self.close_gates_and_drain().await?;
        let id = self.id();
        let source = self.config.connector.connect(&self.plan.source).await?;
        source
            .batch_execute(&format!("SELECT remus.migration_fence({id})"))
            .await
            .map_err(sql(&self.plan.source))?;
        let tm = self.tm().await;
        self.open_gates().await?;
        tm?;
        // The window in which the gates held every new transaction (the flip's cost; the waits
        // of statements for unpulled chunks afterwards are not in it).
        let ms = gated.elapsed().as_millis() as u64;
        self.reporter
            .update(move |r| r.unavailable_ms = Some(ms))
            .await?;
        info!(
            migration_id = id,
            phase = "cleanup",
            "ownership passed to the target; pulling"
        );
        self.squall_pull_all().await?;
        for (node, at) in self.state.tm_committed_at.clone() {
            self.drain_older_transactions(&node, &at, "transactions older than the handover")
                .await?;
        }
        let aborted = self.finish_after_drain().await? + self.state.terminated;
        self.squall_forget_chunks().await?;
        self.reporter
            .update(move |r| r.aborted_by_migration = aborted)
            .await?;
        info!(
            migration_id = id,
            phase = "cleanup",
            aborted,
            "source shard removed"
        );
        Ok(())
    }

    /// Registration, the target's empty tables, the chunk catalog on the target.
    async fn squall_prepare(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let ids = format!("ARRAY[{}]::bigint[]", join(&self.plan.shard_ids));
        self.state.registered = true;
        self.on_every_node(&format!("SELECT remus.migration_begin({id}, {ids})"))
            .await?;
        self.create_target_tables(super::copy::CaptureTrigger::WithTable)
            .await?;
        let source = self.config.connector.connect(&self.plan.source).await?;
        let limit = chunk_bytes() as i64;
        let mut inserts = String::new();
        let mut total_bytes = 0u64;
        let mut chunk_count = 0usize;
        for t in &self.plan.tables {
            let key = key_column(&source, &self.plan.source, &t.shell).await?;
            let row = source
                .query_one(
                    "SELECT hash_min, hash_max, pg_catalog.pg_table_size($2::text::regclass)
                       FROM remus.shards WHERE shard_id = $1",
                    &[&t.shard_id, &t.qualified()],
                )
                .await
                .map_err(sql(&self.plan.source))?;
            let (hash_min, hash_max, bytes): (i32, i32, i64) = (row.get(0), row.get(1), row.get(2));
            total_bytes += bytes.max(0) as u64;
            let n = ((bytes.max(0) + limit - 1) / limit).max(1);
            let bounds: Vec<i32> = if n > 1 {
                source
                    .query_one(
                        &format!(
                            "SELECT percentile_disc(ARRAY(SELECT g::float8 / $1 FROM generate_series(1, $1 - 1) g))
                                    WITHIN GROUP (ORDER BY remus.key_hash({key}))
                               FROM {}",
                            t.qualified()
                        ),
                        &[&(n as i32)],
                    )
                    .await
                    .map_err(sql(&self.plan.source))?
                    .get::<_, Option<Vec<i32>>>(0)
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            let chunks = chunk_ranges(hash_min, hash_max, &bounds);
            chunk_count += chunks.len();
            for (i, (lo, hi)) in chunks.iter().enumerate() {
                inserts.push_str(&format!(
                    "INSERT INTO remus.squall_chunks (migration_id, shard_id, chunk, hash_lo, hash_hi) \
                     VALUES ({id}, {}, {i}, {lo}, {hi});\n",
                    t.shard_id
                ));
            }
        }
        let target = self.config.connector.connect(&self.plan.target).await?;
        target
            .batch_execute(&format!("BEGIN;\n{inserts}COMMIT;"))
            .await
            .map_err(sql(&self.plan.target))?;
        self.reporter
            .update(move |r| r.rates.copy_total_bytes = Some(total_bytes))
            .await?;
        info!(
            migration_id = id,
            phase = "copy",
            chunks = chunk_count,
            chunk_bytes = limit,
            total_bytes,
            "target tables created, chunks planned"
        );
        Ok(())
    }

    /// Runs one puller per shard until every chunk is on the target, recording the rows and
    /// bytes pulled (`rows_copied`, `bytes_copied`) every second. Also a resumed migration's
    /// (`resume.rs`): what an earlier run pulled is counted from the catalog, and a shard whose
    /// chunks are all pulled (or whose catalog is gone) has nothing to do.
    pub(super) async fn squall_pull_all(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let target = self.connect_when_up(&self.plan.target).await?;
        let before = target
            .query_one(
                "SELECT coalesce(sum(rows_pulled), 0)::bigint, coalesce(sum(bytes_pulled), 0)::bigint
                   FROM remus.squall_chunks WHERE migration_id = $1 AND pulled",
                &[&(id as i64)],
            )
            .await
            .map_err(sql(&self.plan.target))?;
        let (base_rows, base_bytes) = (
            before.get::<_, i64>(0).max(0) as u64,
            before.get::<_, i64>(1).max(0) as u64,
        );
        let source = self.connect_when_up(&self.plan.source).await?;
        let mut pullers = Vec::new();
        for t in &self.plan.tables {
            let exists: bool = source
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[&t.qualified()])
                .await
                .map_err(sql(&self.plan.source))?
                .get(0);
            if !exists {
                // A resumed run after the source's copy was dropped: everything was pulled.
                continue;
            }
            let key = key_column(&source, &self.plan.source, &t.shell).await?;
            let row = source
                .query_one(
                    "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum),
                            string_agg('(r).' || quote_ident(attname), ', ' ORDER BY attnum)
                       FROM pg_attribute
                      WHERE attrelid = $1::text::regclass AND attnum > 0
                        AND NOT attisdropped AND attgenerated = ''",
                    &[&t.qualified()],
                )
                .await
                .map_err(sql(&self.plan.source))?;
            let (columns, fields): (String, String) = (row.get(0), row.get(1));
            pullers.push(Puller {
                migration_id: id,
                shard_id: t.shard_id,
                table: t.qualified(),
                key,
                columns,
                fields,
                source: self.plan.source.clone(),
                target: self.plan.target.clone(),
                connector: self.config.connector.clone(),
                failpoints: self.config.failpoints.clone(),
            });
        }
        let pulled = Arc::new(Pulled::default());
        let mut tasks = tokio::task::JoinSet::new();
        for p in pullers {
            tasks.spawn(p.run(pulled.clone()));
        }
        let started = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let mut first_error = None;
        loop {
            tokio::select! {
                done = tasks.join_next() => match done {
                    None => break,
                    Some(Ok(Ok(()))) => {}
                    Some(Ok(Err(e))) => { first_error.get_or_insert(e); }
                    Some(Err(source)) => { first_error.get_or_insert(DriverError::Thread { what: "squall puller", source }); }
                },
                _ = tick.tick() => self.report_pulled(&pulled, base_rows, base_bytes).await,
            }
        }
        self.report_pulled(&pulled, base_rows, base_bytes).await;
        if let Some(e) = first_error {
            return Err(e);
        }
        info!(
            migration_id = id,
            phase = "cleanup",
            rows = pulled.rows.load(Ordering::Relaxed),
            bytes = pulled.bytes.load(Ordering::Relaxed),
            pull_ms = started.elapsed().as_millis() as u64,
            "every chunk pulled"
        );
        Ok(())
    }

    async fn report_pulled(&self, pulled: &Pulled, base_rows: u64, base_bytes: u64) {
        let rows = base_rows + pulled.rows.load(Ordering::Relaxed);
        let bytes = base_bytes + pulled.bytes.load(Ordering::Relaxed);
        let reported = self
            .reporter
            .update(move |r| {
                r.rows_copied = rows;
                r.bytes_copied = bytes;
            })
            .await;
        if let Err(e) = reported {
            warn!(migration_id = self.id(), phase = "cleanup", error = %e, "could not record the pull's progress");
        }
    }

    /// Empties this migration's chunk catalog on the target (the end of a migration, or its
    /// rollback: `rollback.rs`).
    pub(super) async fn squall_forget_chunks(&self) -> Result<(), DriverError> {
        let target = self.connect_when_up(&self.plan.target).await?;
        target
            .execute(
                "DELETE FROM remus.squall_chunks WHERE migration_id = $1",
                &[&(self.id() as i64)],
            )
            .await
            .map_err(sql(&self.plan.target))?;
        Ok(())
    }
}

/// The quoted shard key column of the distributed table `shell` (as `node` records it).
async fn key_column(
    c: &tokio_postgres::Client,
    node: &NodeRecord,
    shell: &str,
) -> Result<String, DriverError> {
    Ok(c.query_one(
        "SELECT quote_ident(shard_key) FROM remus.distributed_tables
          WHERE logicalrelid = $1::text::regclass",
        &[&shell],
    )
    .await
    .map_err(sql(node))?
    .get(0))
}

impl Puller {
    /// Pulls every chunk of the shard, pacing between pulls; retries a failed pull (with fresh
    /// sessions) until [`NODE_WAIT`] of consecutive failures.
    async fn run(self, pulled: Arc<Pulled>) -> Result<(), DriverError> {
        let mut sessions: Option<(tokio_postgres::Client, tokio_postgres::Client)> = None;
        let mut failing_since: Option<Instant> = None;
        loop {
            let step = async {
                if sessions.is_none() {
                    let s = self.connector.connect(&self.source).await?;
                    let t = self.connector.connect(&self.target).await?;
                    sessions = Some((s, t));
                }
                let (s, t) = sessions.as_ref().expect("sessions set above");
                self.pull_next(s, t, &pulled).await
            }
            .await;
            match step {
                Ok(false) => return Ok(()),
                Ok(true) => {
                    failing_since = None;
                    if let Some((_, t)) = &sessions {
                        self.pace(t).await;
                    }
                }
                Err(e) => {
                    sessions = None;
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= NODE_WAIT {
                        return Err(e);
                    }
                    warn!(
                        migration_id = self.migration_id,
                        phase = "cleanup",
                        shard_id = self.shard_id,
                        error = %super::describe(&e),
                        "squall pull failed; retrying"
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Pulls the first chunk not pulled yet; false when there is none.
    async fn pull_next(
        &self,
        source: &tokio_postgres::Client,
        target: &tokio_postgres::Client,
        pulled: &Pulled,
    ) -> Result<bool, DriverError> {
        let t = sql(&self.target);
        // A chunk a target transaction waits for first (its request: a shared advisory lock
        // `(shard, -2 - chunk)`, `migration::squall` on the node), else the next in order.
        let next = target
            .query_opt(
                "SELECT c.chunk, c.hash_lo, c.hash_hi FROM remus.squall_chunks c
                  WHERE c.migration_id = $1 AND c.shard_id = $2 AND NOT c.pulled
                  ORDER BY EXISTS (SELECT 1 FROM pg_catalog.pg_locks l
                                    WHERE l.locktype = 'advisory' AND l.objsubid = 2
                                      AND l.database = (SELECT oid FROM pg_catalog.pg_database
                                                         WHERE datname = current_database())
                                      AND l.classid = ($2::bigint % 2147483647)::oid
                                      AND l.objid = (4294967294 - c.chunk)::oid) DESC,
                           c.chunk
                  LIMIT 1",
                &[&(self.migration_id as i64), &self.shard_id],
            )
            .await
            .map_err(&t)?;
        let Some(next) = next else {
            return Ok(false);
        };
        let (chunk, lo, hi): (i32, i32, i32) = (next.get(0), next.get(1), next.get(2));
        let started = Instant::now();
        target.batch_execute("BEGIN").await.map_err(&t)?;
        // The range lock: a target transaction that needs this chunk waits on it.
        target
            .query_one(
                "SELECT 1 FROM (SELECT pg_advisory_xact_lock(($1::bigint % 2147483647)::int4, $2)) l",
                &[&self.shard_id, &chunk],
            )
            .await
            .map_err(&t)?;
        let done: bool = target
            .query_one(
                "SELECT pulled FROM remus.squall_chunks
                  WHERE migration_id = $1 AND shard_id = $2 AND chunk = $3",
                &[&(self.migration_id as i64), &self.shard_id, &chunk],
            )
            .await
            .map_err(&t)?
            .get(0);
        if done {
            target.batch_execute("COMMIT").await.map_err(&t)?;
            return Ok(true);
        }
        // Rows as text (the table's row type): the shard tables have the same columns on both
        // nodes; generated columns are computed again on insert.
        let texts: Vec<String> = source
            .query(
                &format!(
                    "SELECT x::text FROM ONLY {table} x WHERE remus.key_hash(x.{key}) BETWEEN $1 AND $2",
                    table = self.table,
                    key = self.key
                ),
                &[&lo, &hi],
            )
            .await
            .map_err(sql(&self.source))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let bytes: u64 = texts.iter().map(|r| r.len() as u64).sum();
        let rows = target
            .execute(
                &format!(
                    "INSERT INTO {table} ({cols}) SELECT {fields} FROM (SELECT x::{table} AS r FROM unnest($1::text[]) x) s",
                    table = self.table,
                    cols = self.columns,
                    fields = self.fields
                ),
                &[&texts],
            )
            .await
            .map_err(&t)?;
        target
            .execute(
                "UPDATE remus.squall_chunks SET (pulled, rows_pulled, bytes_pulled) = (true, $4, $5)
                  WHERE migration_id = $1 AND shard_id = $2 AND chunk = $3",
                &[
                    &(self.migration_id as i64),
                    &self.shard_id,
                    &chunk,
                    &(rows as i64),
                    &(bytes as i64),
                ],
            )
            .await
            .map_err(&t)?;
        target.batch_execute("COMMIT").await.map_err(&t)?;
        pulled.rows.fetch_add(rows, Ordering::Relaxed);
        pulled.bytes.fetch_add(bytes, Ordering::Relaxed);
        info!(
            migration_id = self.migration_id,
            phase = "cleanup",
            shard_id = self.shard_id,
            chunk,
            rows,
            bytes,
            ms = started.elapsed().as_millis() as u64,
            "chunk pulled"
        );
        Ok(true)
    }

    /// The pause between two background pulls: [`pace`] (or the `squall.slow_pull` failpoint's
    /// delay), cut short as soon as a target transaction waits for this shard: for one of its
    /// chunks (`(shard, -2 - chunk)`) or for all of them (`(shard, -1)`), the negative second
    /// keys, which `pg_locks` shows as `objid` of 2^31 and above.
    async fn pace(&self, target: &tokio_postgres::Client) {
        let pause = self
            .failpoints
            .delay(failpoint::SQUALL_SLOW_PULL)
            .unwrap_or_else(pace);
        let left = target
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM remus.squall_chunks
                                 WHERE migration_id = $1 AND shard_id = $2 AND NOT pulled)",
                &[&(self.migration_id as i64), &self.shard_id],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(true);
        if !left {
            return;
        }
        let started = Instant::now();
        while started.elapsed() < pause {
            let asked = target
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks
                                     WHERE locktype = 'advisory' AND objsubid = 2
                                       AND database = (SELECT oid FROM pg_catalog.pg_database
                                                        WHERE datname = current_database())
                                       AND classid = ($1::bigint % 2147483647)::oid
                                       AND objid >= 2147483648::oid)",
                    &[&self.shard_id],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false);
            if asked {
                return;
            }
            tokio::time::sleep(REQUEST_POLL.min(pause.saturating_sub(started.elapsed()))).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_in_order() {
        assert_eq!(chunk_ranges(-10, 10, &[]), vec![(-10, 10)]);
        assert_eq!(
            chunk_ranges(-10, 10, &[0, -5, 0, 10, 42, -11]),
            vec![(-10, -5), (-4, 0), (1, 10)]
        );
        assert_eq!(
            chunk_ranges(i32::MIN, i32::MAX, &[i32::MIN]),
            vec![(i32::MIN, i32::MIN), (i32::MIN + 1, i32::MAX)]
        );
        for bounds in [
            vec![3, 7, 7, 1],
            vec![9],
            vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        ] {
            let c = chunk_ranges(0, 9, &bounds);
            assert_eq!(c.first().unwrap().0, 0);
            assert_eq!(c.last().unwrap().1, 9);
            for w in c.windows(2) {
                assert_eq!(w[0].1 + 1, w[1].0);
            }
            assert!(c.iter().all(|(lo, hi)| lo <= hi));
        }
    }
}
