//! Phase 1 of a migration (DESIGN.md 3.1): copy the shard tables as of the slot's exported
//! snapshot, source to destination, in parallel, nothing staged on disk.
//!
//! Each worker thread opens one source session, `BEGIN ISOLATION LEVEL REPEATABLE READ, READ
//! ONLY; SET TRANSACTION SNAPSHOT '<name>'`, and one destination session with an open
//! transaction. It then takes tables from a shared queue, one at a time, and for each runs `COPY
//! <source> TO STDOUT (FORMAT binary)` and `COPY <dest> FROM STDIN (FORMAT binary)`, passing the
//! rows through as they arrive. Memory per worker is bounded by [`CopyOptions::chunk_bytes`]
//! plus one row: rows are batched into chunks of that size and each chunk is flushed to the
//! destination before more is read, so a slow destination slows the source read rather than
//! filling memory.
//!
//! All destination transactions are committed only after every table has been copied; on any
//! failure none is (their connections are closed, which rolls them back), and the error names
//! the table. Only a failure of one of the final COMMITs can leave some tables committed, which
//! [`CopyError::Commit`] reports.
//!
//! Binary COPY requires the destination tables to have the same columns, in the same order and
//! of the same types, as the source tables.
//!
//! With [`CopyOptions::indexes_after_rows`] (the default) each destination table is copied into
//! without its indexes: in the worker's destination transaction, before the COPY, the table's
//! index-backed constraints (primary key, unique, exclusion) and its other indexes are read as
//! DDL (`pg_get_constraintdef`, `pg_get_indexdef`, with their comments) and dropped; after the
//! COPY they are created again from that DDL, same names. The table is the migration's new,
//! empty copy, which nothing else uses before the copy commits, so nothing can see it without
//! its indexes, and catch-up (which looks rows up by the primary key) starts after the commit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, info};

use crate::libpq::ResultStatus;
use crate::session::{CancelToken, CopyRead, PgError, Session};

/// Tuning, timeouts and cancellation of [`copy_tables_with`].
#[derive(Debug, Clone)]
pub struct CopyOptions {
    pub connect_timeout: Duration,
    /// Longest time any single step may go without progress (a command, a chunk read or
    /// written). The copy as a whole has no time limit.
    pub idle_timeout: Duration,
    /// Rows are forwarded in chunks of about this many bytes.
    pub chunk_bytes: usize,
    /// SQL run in every destination transaction right after `BEGIN` (e.g. to set up a
    /// replication origin session or `SET LOCAL` options).
    pub dest_setup_sql: Option<String>,
    /// Stops the whole copy from another thread; nothing is committed.
    pub cancel: CancelToken,
    /// Counts what has passed so far, across all tables, for another thread to read.
    pub progress: std::sync::Arc<CopyProgress>,
    /// Builds each destination table's indexes after its rows are in: in the destination
    /// transaction, the indexes and the constraints they back are dropped before the COPY and
    /// created again, with the same names and definitions, after it (one sorted build per
    /// index instead of an insertion per row and index).
    pub indexes_after_rows: bool,
}

/// Bytes and rows of COPY data passed so far, updated as each row passes. `rows` counts the
/// COPY data messages, one per row (the binary format's header and trailer may count too); the
/// exact rows are in each table's [`CopyStats`].
#[derive(Debug, Default)]
pub struct CopyProgress {
    pub rows: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
}

impl Default for CopyOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            chunk_bytes: 256 * 1024,
            dest_setup_sql: None,
            cancel: CancelToken::new(),
            progress: Default::default(),
            indexes_after_rows: true,
        }
    }
}

/// What was copied for one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyStats {
    /// The source table, as given.
    pub table: String,
    pub dest_table: String,
    pub rows: u64,
    /// Bytes of binary COPY data passed through.
    pub bytes: u64,
    pub millis: u64,
}

/// What went wrong with one table.
#[derive(Debug, Error)]
pub enum TableCopyError {
    #[error("on the source: {0}")]
    Source(#[source] PgError),
    #[error("on the destination: {0}")]
    Destination(#[source] PgError),
    #[error("the source sent {source_rows} rows but the destination stored {dest_rows}")]
    RowCountMismatch { source_rows: u64, dest_rows: u64 },
}

impl TableCopyError {
    pub fn pg_error(&self) -> Option<&PgError> {
        match self {
            TableCopyError::Source(e) | TableCopyError::Destination(e) => Some(e),
            TableCopyError::RowCountMismatch { .. } => None,
        }
    }
}

/// Why [`copy_tables`] failed. Apart from [`CopyError::Commit`], nothing was committed.
#[derive(Debug, Error)]
pub enum CopyError {
    #[error("copying {source_table} into {dest_table} failed {error}")]
    Table {
        source_table: String,
        dest_table: String,
        #[source]
        error: TableCopyError,
    },
    /// A final COMMIT failed; tables of other workers may already be committed.
    #[error("committing the copy of {tables:?} on the destination failed: {error}")]
    Commit {
        tables: Vec<String>,
        #[source]
        error: PgError,
    },
    #[error("the copy was cancelled")]
    Cancelled,
    #[error("invalid copy request: {0}")]
    InvalidArgument(String),
}

impl CopyError {
    /// The source table whose copy failed.
    pub fn table(&self) -> Option<&str> {
        match self {
            CopyError::Table { source_table, .. } => Some(source_table),
            _ => None,
        }
    }

    /// The SQLSTATE of the server error behind the failure, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            CopyError::Table { error, .. } => error.pg_error().and_then(PgError::sqlstate),
            CopyError::Commit { error, .. } => error.sqlstate(),
            _ => None,
        }
    }
}

/// [`copy_tables_with`] with default [`CopyOptions`].
///
/// `tables` pairs each source table with its destination table, both as they are written in
/// SQL (schema-qualified, quoted where needed, e.g. `public."Shard_1"`; see [`qualified_name`]).
/// They are put into the COPY commands as given. At most `parallelism` tables (at least one)
/// are copied at a time. Stats come back in the order of `tables`.
pub fn copy_tables(
    source_conninfo: &str,
    snapshot_name: &str,
    dest_conninfo: &str,
    tables: &[(String, String)],
    parallelism: usize,
) -> Result<Vec<CopyStats>, CopyError> {
    copy_tables_with(
        source_conninfo,
        snapshot_name,
        dest_conninfo,
        tables,
        parallelism,
        &CopyOptions::default(),
    )
}

/// Quotes `schema.name` for use in [`copy_tables`].
pub fn qualified_name(schema: &str, name: &str) -> String {
    let q = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    format!("{}.{}", q(schema), q(name))
}

/// See [`copy_tables`] and the module documentation.
pub fn copy_tables_with(
    source_conninfo: &str,
    snapshot_name: &str,
    dest_conninfo: &str,
    tables: &[(String, String)],
    parallelism: usize,
    options: &CopyOptions,
) -> Result<Vec<CopyStats>, CopyError> {
    if tables.is_empty() {
        return Ok(Vec::new());
    }
    for (s, d) in tables {
        if s.trim().is_empty() || d.trim().is_empty() || s.contains('\0') || d.contains('\0') {
            return Err(CopyError::InvalidArgument(format!(
                "table pair ({s:?}, {d:?}) is empty or contains a NUL byte"
            )));
        }
    }
    if options.chunk_bytes == 0 {
        return Err(CopyError::InvalidArgument("chunk_bytes is 0".into()));
    }
    let ctx = Ctx {
        source_conninfo,
        snapshot_name,
        dest_conninfo,
        tables,
        options,
        abort: CancelToken::new(),
        next: AtomicUsize::new(0),
        first_error: Mutex::new(None),
        stats: Mutex::new(vec![None; tables.len()]),
    };
    let workers = parallelism.clamp(1, tables.len());
    let started = Instant::now();
    let finished: Vec<Option<Finished>> = thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .filter_map(|i| {
                let spawned = thread::Builder::new()
                    .name(format!("remus-copy-{i}"))
                    .spawn_scoped(scope, || ctx.worker());
                match spawned {
                    Ok(h) => Some(h),
                    Err(e) => {
                        // The remaining workers take over the queue.
                        debug!(error = %e, "could not start a copy worker");
                        None
                    }
                }
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    let Ctx {
        first_error, stats, ..
    } = ctx;
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if options.cancel.is_cancelled() {
        return Err(CopyError::Cancelled);
    }
    let stats: Vec<CopyStats> = stats
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .collect::<Option<_>>()
        .ok_or_else(|| CopyError::InvalidArgument("no copy worker could be started".into()))?;
    for done in finished.into_iter().flatten() {
        let Finished {
            mut dest,
            tables: idx,
        } = done;
        let names = || idx.iter().map(|&i| tables[i].1.clone()).collect::<Vec<_>>();
        let r = dest
            .exec_ok("COMMIT", "COMMIT")
            .map_err(|error| CopyError::Commit {
                tables: names(),
                error,
            })?;
        if r.cmd_status() != "COMMIT" {
            return Err(CopyError::Commit {
                tables: names(),
                error: PgError::UnexpectedResult {
                    operation: "COMMIT".into(),
                    status: r.cmd_status(),
                    expected: "COMMIT",
                },
            });
        }
    }
    info!(
        tables = tables.len(),
        rows = stats.iter().map(|s| s.rows).sum::<u64>(),
        bytes = stats.iter().map(|s| s.bytes).sum::<u64>(),
        millis = started.elapsed().as_millis() as u64,
        "snapshot copy committed"
    );
    Ok(stats)
}

/// A worker's destination session, its transaction holding the copied tables, uncommitted.
struct Finished {
    dest: Session,
    tables: Vec<usize>,
}

struct Ctx<'a> {
    source_conninfo: &'a str,
    snapshot_name: &'a str,
    dest_conninfo: &'a str,
    tables: &'a [(String, String)],
    options: &'a CopyOptions,
    /// Set on the first failure so that every other worker stops at once.
    abort: CancelToken,
    next: AtomicUsize,
    first_error: Mutex<Option<CopyError>>,
    stats: Mutex<Vec<Option<CopyStats>>>,
}

impl Ctx<'_> {
    fn stopped(&self) -> bool {
        self.abort.is_cancelled() || self.options.cancel.is_cancelled()
    }

    fn take_next(&self) -> Option<usize> {
        if self.stopped() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::SeqCst);
        (i < self.tables.len()).then_some(i)
    }

    /// Records the failure of table `i` unless another one came first (whose abort is then
    /// what made this one fail), and stops the other workers.
    fn fail(&self, i: usize, error: TableCopyError) {
        let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() && !self.abort.is_cancelled() {
            let (source_table, dest_table) = self.tables[i].clone();
            *first = Some(CopyError::Table {
                source_table,
                dest_table,
                error,
            });
        }
        self.abort.cancel();
    }

    fn session(&self, conninfo: &str) -> Result<Session, PgError> {
        Session::connect(
            conninfo,
            &[("fallback_application_name", "pg_remus_copy")],
            self.options.connect_timeout,
            self.options.idle_timeout,
            vec![self.options.cancel.clone(), self.abort.clone()],
        )
    }

    fn open_source(&self) -> Result<Session, PgError> {
        let mut s = self.session(self.source_conninfo)?;
        s.exec_ok(
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
            "BEGIN on the source",
        )?;
        let snapshot = s.escape_literal(self.snapshot_name)?;
        s.exec_ok(
            &format!("SET TRANSACTION SNAPSHOT {snapshot}"),
            "SET TRANSACTION SNAPSHOT",
        )?;
        Ok(s)
    }

    fn open_dest(&self) -> Result<Session, PgError> {
        let mut d = self.session(self.dest_conninfo)?;
        d.exec_ok("BEGIN", "BEGIN on the destination")?;
        if let Some(sql) = &self.options.dest_setup_sql {
            d.exec_ok(sql, "destination setup")?;
        }
        Ok(d)
    }

    fn worker(&self) -> Option<Finished> {
        let mut i = self.take_next()?;
        // Sessions are opened for the first table, so that failing to open them names it.
        let mut src = match self.open_source() {
            Ok(s) => s,
            Err(e) => {
                self.fail(i, TableCopyError::Source(e));
                return None;
            }
        };
        let mut dest = match self.open_dest() {
            Ok(d) => d,
            Err(e) => {
                self.fail(i, TableCopyError::Destination(e));
                return None;
            }
        };
        let mut done = Vec::new();
        loop {
            match self.copy_one(&mut src, &mut dest, i) {
                Ok(stats) => {
                    self.stats.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(stats);
                    done.push(i);
                }
                Err(e) => {
                    self.fail(i, e);
                    return None;
                }
            }
            match self.take_next() {
                Some(next) => i = next,
                None => break,
            }
        }
        if self.stopped() {
            return None;
        }
        // The read-only source transaction ends when `src` is dropped here.
        Some(Finished { dest, tables: done })
    }

    fn copy_one(
        &self,
        src: &mut Session,
        dest: &mut Session,
        i: usize,
    ) -> Result<CopyStats, TableCopyError> {
        use TableCopyError::{Destination, Source};
        let (source_table, dest_table) = &self.tables[i];
        let started = Instant::now();
        let chunk = self.options.chunk_bytes;
        let idle = self.options.idle_timeout;

        let op_out = format!("COPY {source_table} TO STDOUT");
        let r = src
            .exec(
                &format!("COPY {source_table} TO STDOUT (FORMAT binary)"),
                &op_out,
            )
            .map_err(Source)?;
        if r.status() != ResultStatus::CopyOut {
            return Err(Source(src.unexpected(&r, &op_out, "COPY OUT")));
        }

        // The source answers first (a missing table or a bad snapshot is named before the
        // destination is touched); its rows wait in the socket meanwhile.
        let rebuild = if self.options.indexes_after_rows {
            drop_indexes(dest, dest_table).map_err(Destination)?
        } else {
            Vec::new()
        };
        let op_in = format!("COPY {dest_table} FROM STDIN");
        let r = dest
            .exec(
                &format!("COPY {dest_table} FROM STDIN (FORMAT binary)"),
                &op_in,
            )
            .map_err(Destination)?;
        if r.status() != ResultStatus::CopyIn {
            return Err(Destination(dest.unexpected(&r, &op_in, "COPY IN")));
        }
        let mut buf: Vec<u8> = Vec::with_capacity(chunk);
        let mut bytes = 0u64;
        let source_rows = loop {
            let read = match src.try_read_copy(&op_out).map_err(Source)? {
                CopyRead::WouldBlock => {
                    // Nothing more buffered: pass on what we have before waiting.
                    if !buf.is_empty() {
                        dest.write_copy(&buf, &op_in).map_err(Destination)?;
                        buf.clear();
                    }
                    src.read_copy(idle, &op_out).map_err(Source)?
                }
                read => read,
            };
            match read {
                CopyRead::Data(row) => {
                    bytes += row.len() as u64;
                    let p = &self.options.progress;
                    p.rows.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    p.bytes
                        .fetch_add(row.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    if buf.is_empty() && row.len() >= chunk {
                        dest.write_copy(&row, &op_in).map_err(Destination)?;
                    } else {
                        buf.extend_from_slice(&row);
                        if buf.len() >= chunk {
                            dest.write_copy(&buf, &op_in).map_err(Destination)?;
                            buf.clear();
                            // A source that never makes us wait would never see a cancel.
                            src.check_cancelled(&op_out).map_err(Source)?;
                        }
                    }
                }
                CopyRead::WouldBlock => {}
                CopyRead::Done(result) => {
                    if result.status() != ResultStatus::CommandOk {
                        return Err(Source(src.unexpected(&result, &op_out, "COPY completion")));
                    }
                    break result.cmd_tuples();
                }
            }
        };
        if !buf.is_empty() {
            dest.write_copy(&buf, &op_in).map_err(Destination)?;
        }
        dest.put_copy_end(&op_in).map_err(Destination)?;
        let result = dest.finish_command(&op_in).map_err(Destination)?;
        if result.status() != ResultStatus::CommandOk {
            return Err(Destination(dest.unexpected(
                &result,
                &op_in,
                "COPY completion",
            )));
        }
        let dest_rows = result.cmd_tuples();
        for ddl in &rebuild {
            dest.exec_ok(ddl, "rebuilding an index after the copy")
                .map_err(Destination)?;
        }
        let (Some(source_rows), Some(dest_rows)) = (source_rows, dest_rows) else {
            return Err(TableCopyError::RowCountMismatch {
                source_rows: source_rows.unwrap_or(0),
                dest_rows: dest_rows.unwrap_or(0),
            });
        };
        if source_rows != dest_rows {
            return Err(TableCopyError::RowCountMismatch {
                source_rows,
                dest_rows,
            });
        }
        let stats = CopyStats {
            table: source_table.clone(),
            dest_table: dest_table.clone(),
            rows: dest_rows,
            bytes,
            millis: started.elapsed().as_millis() as u64,
        };
        debug!(?stats, "table copied");
        Ok(stats)
    }
}

/// The DDL that drops `table`'s indexes and index-backed constraints, and the DDL that creates
/// them again (with their comments), read from the catalog in `dest`'s transaction.
const INDEX_DDL: &str = "
WITH rel AS (SELECT $1::regclass AS oid),
cons AS (
    SELECT c.conname, c.conindid, pg_catalog.pg_get_constraintdef(c.oid) AS def,
           pg_catalog.obj_description(c.oid, 'pg_constraint') AS comment
      FROM pg_catalog.pg_constraint c, rel
     WHERE c.conrelid = rel.oid AND c.contype IN ('p', 'u', 'x') AND c.conindid <> 0),
idx AS (
    SELECT i.indexrelid, pg_catalog.pg_get_indexdef(i.indexrelid) AS def,
           pg_catalog.obj_description(i.indexrelid, 'pg_class') AS comment
      FROM pg_catalog.pg_index i, rel
     WHERE i.indrelid = rel.oid AND i.indexrelid NOT IN (SELECT conindid FROM cons))
SELECT 1, format('ALTER TABLE %s DROP CONSTRAINT %I', rel.oid, conname), NULL FROM cons, rel
UNION ALL
SELECT 1, format('DROP INDEX %s', indexrelid::regclass), NULL FROM idx
UNION ALL
SELECT 2, format('ALTER TABLE %s ADD CONSTRAINT %I %s', rel.oid, conname, def),
       CASE WHEN comment IS NOT NULL
            THEN format('COMMENT ON CONSTRAINT %I ON %s IS %L', conname, rel.oid, comment) END
  FROM cons, rel
UNION ALL
SELECT 2, def,
       CASE WHEN comment IS NOT NULL
            THEN format('COMMENT ON INDEX %s IS %L', indexrelid::regclass, comment) END
  FROM idx
ORDER BY 1";

/// Drops `table`'s indexes (and the constraints they back) in `dest`'s open transaction and
/// returns the statements that create them again, in order.
fn drop_indexes(dest: &mut Session, table: &str) -> Result<Vec<String>, PgError> {
    let literal = format!("'{}'", table.replace('\'', "''"));
    let sql = INDEX_DDL.replace("$1", &literal);
    let r = dest.exec_ok(&sql, "reading the destination's indexes")?;
    let mut rebuild = Vec::new();
    for row in 0..r.ntuples() {
        let (Some(step), Some(ddl)) = (r.value(row, 0), r.value(row, 1)) else {
            continue;
        };
        if step == "1" {
            dest.exec_ok(&ddl, "dropping an index before the copy")?;
        } else {
            rebuild.push(ddl);
            if let Some(comment) = r.value(row, 2) {
                rebuild.push(comment);
            }
        }
    }
    Ok(rebuild)
}
