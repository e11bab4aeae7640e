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
//!
//! A large table is copied by several sessions at once ([`CopyOptions::split_bytes`]): when
//! `parallelism` allows more than one session for it, a table of at least twice `split_bytes`
//! on the source is cut into block ranges of about that size (at most `parallelism` ranges),
//! each read under the same exported snapshot by `COPY (SELECT <columns> FROM <table> WHERE
//! ctid >= '(a,0)' AND ctid < '(b,0)') TO STDOUT` (a TID range scan; the first range is open
//! below, the last open above, so blocks added after the size was read are read too). Every
//! range is a work item of the shared queue, copied in the worker's open destination
//! transaction like a whole table. Such a table's indexes cannot be dropped in one worker's
//! transaction (its lock would hold every other range's COPY until the end): they are dropped
//! in a destination transaction of their own that commits before the rows arrive, and built
//! again in one transaction per table after every worker committed. So a failure of the copy
//! leaves a split table empty but without its indexes (the caller's table, which it drops on
//! failure), and a failure of the rebuild ([`CopyError::Rebuild`]) leaves its rows committed.

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
    /// A table of at least twice this many bytes on the source is copied in block ranges of
    /// about this size by several sessions at once, as many as `parallelism` allows (see the
    /// module documentation). 0 copies every table whole, by one session.
    pub split_bytes: u64,
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
            split_bytes: 64 * 1024 * 1024,
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
    /// The longest any one of its parts took.
    pub millis: u64,
    /// Block ranges it was copied in, each by its own session; 1: the whole table at once.
    pub parts: usize,
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
    /// The rows of a table copied in parts are committed, but building its indexes again
    /// failed; tables copied whole are committed with theirs.
    #[error("rebuilding the indexes of {dest_table} after its copy failed: {error}")]
    Rebuild {
        dest_table: String,
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
            CopyError::Commit { error, .. } | CopyError::Rebuild { error, .. } => error.sqlstate(),
            _ => None,
        }
    }
}

/// [`copy_tables_with`] with default [`CopyOptions`].
///
/// `tables` pairs each source table with its destination table, both as they are written in
/// SQL (schema-qualified, quoted where needed, e.g. `public."Shard_1"`; see [`qualified_name`]).
/// They are put into the COPY commands as given. At most `parallelism` sessions (at least one)
/// copy at a time, each a whole table or a block range of a large one
/// ([`CopyOptions::split_bytes`]). Stats come back in the order of `tables`.
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
    let mut ctx = Ctx {
        source_conninfo,
        snapshot_name,
        dest_conninfo,
        tables,
        parts: Vec::new(),
        options,
        abort: CancelToken::new(),
        next: AtomicUsize::new(0),
        first_error: Mutex::new(None),
        stats: Mutex::new(vec![None; tables.len()]),
    };
    let started = Instant::now();
    ctx.parts = ctx.plan_parts(parallelism)?;
    let rebuild = ctx.drop_split_indexes()?;
    let workers = parallelism.clamp(1, ctx.parts.len());
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
        first_error,
        stats,
        parts,
        ..
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
            parts: idx,
        } = done;
        let names = || {
            let mut names: Vec<String> = idx
                .iter()
                .map(|&p| tables[parts[p].table].1.clone())
                .collect();
            names.dedup();
            names
        };
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
    for (t, ddl) in rebuild {
        let dest_table = &tables[t].1;
        rebuild_indexes(dest_conninfo, options, &ddl).map_err(|error| CopyError::Rebuild {
            dest_table: dest_table.clone(),
            error,
        })?;
    }
    info!(
        tables = tables.len(),
        parts = parts.len(),
        rows = stats.iter().map(|s| s.rows).sum::<u64>(),
        bytes = stats.iter().map(|s| s.bytes).sum::<u64>(),
        millis = started.elapsed().as_millis() as u64,
        "snapshot copy committed"
    );
    Ok(stats)
}

/// A worker's destination session, its transaction holding the copied parts, uncommitted.
struct Finished {
    dest: Session,
    parts: Vec<usize>,
}

/// One work item of the copy: a whole table or a block range of one.
#[derive(Debug)]
struct Part {
    /// Index into the copy's tables.
    table: usize,
    /// The `COPY … TO STDOUT (FORMAT binary)` that reads it on the source.
    copy_out: String,
    /// How many parts its table was cut into; 1: the whole table, whose indexes the worker
    /// drops and builds again in its own transaction.
    of: usize,
}

/// Size, block size and COPY column list (what `COPY <table> TO` sends: neither dropped nor
/// generated columns) of the table `$1`, read under the copy's snapshot.
const SIZE_SQL: &str = "
SELECT pg_catalog.pg_relation_size(c.oid), pg_catalog.current_setting('block_size')::bigint,
       (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(a.attname), ', ' ORDER BY a.attnum)
          FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '')
  FROM (SELECT $1::pg_catalog.regclass AS oid) c";

/// The `COPY … TO STDOUT` statements that read `table` as `parts` block ranges of about equal
/// size out of `blocks` blocks: the first open below, the last open above.
fn range_copies(table: &str, columns: &str, blocks: u64, parts: u64) -> Vec<String> {
    (0..parts)
        .map(|k| {
            let mut bounds = Vec::new();
            if k > 0 {
                bounds.push(format!(
                    "ctid >= '({},0)'::pg_catalog.tid",
                    blocks * k / parts
                ));
            }
            if k + 1 < parts {
                bounds.push(format!(
                    "ctid < '({},0)'::pg_catalog.tid",
                    blocks * (k + 1) / parts
                ));
            }
            format!(
                "COPY (SELECT {columns} FROM {table} WHERE {}) TO STDOUT (FORMAT binary)",
                bounds.join(" AND ")
            )
        })
        .collect()
}

/// Builds a split table's indexes again (the statements [`drop_indexes`] returned) in a
/// destination transaction of their own.
fn rebuild_indexes(conninfo: &str, options: &CopyOptions, ddl: &[String]) -> Result<(), PgError> {
    let mut dest = Session::connect(
        conninfo,
        &[("fallback_application_name", "pg_remus_copy")],
        options.connect_timeout,
        options.idle_timeout,
        vec![options.cancel.clone()],
    )?;
    dest.exec_ok("BEGIN", "BEGIN on the destination")?;
    for statement in ddl {
        dest.exec_ok(statement, "rebuilding an index after the copy")?;
    }
    dest.exec_ok("COMMIT", "COMMIT of the rebuilt indexes")?;
    Ok(())
}

struct Ctx<'a> {
    source_conninfo: &'a str,
    snapshot_name: &'a str,
    dest_conninfo: &'a str,
    tables: &'a [(String, String)],
    /// The work items, taken in order by the workers.
    parts: Vec<Part>,
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
        (i < self.parts.len()).then_some(i)
    }

    /// `error` as the failure of table `table`.
    fn table_error(&self, table: usize, error: TableCopyError) -> CopyError {
        let (source_table, dest_table) = self.tables[table].clone();
        CopyError::Table {
            source_table,
            dest_table,
            error,
        }
    }

    /// Cuts the tables into work items: a table of at least twice `split_bytes` into block
    /// ranges, when `parallelism` gives it more than one session; every other table whole.
    fn plan_parts(&self, parallelism: usize) -> Result<Vec<Part>, CopyError> {
        let whole = |table: usize| Part {
            table,
            copy_out: format!("COPY {} TO STDOUT (FORMAT binary)", self.tables[table].0),
            of: 1,
        };
        let split = self.options.split_bytes;
        if parallelism < 2 || split == 0 {
            return Ok((0..self.tables.len()).map(whole).collect());
        }
        let source_error = |table, e| self.table_error(table, TableCopyError::Source(e));
        let mut src = self.open_source().map_err(|e| source_error(0, e))?;
        let mut parts = Vec::new();
        for (table, (source_table, _)) in self.tables.iter().enumerate() {
            let literal = src
                .escape_literal(source_table)
                .map_err(|e| source_error(table, e))?;
            let r = src
                .exec_ok(&SIZE_SQL.replace("$1", &literal), "reading a table's size")
                .map_err(|e| source_error(table, e))?;
            let number = |col: usize| -> u64 {
                r.value(0, col)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_default()
            };
            let (size, block) = (number(0), number(1).max(1));
            let ranges = (size / split).min(parallelism as u64);
            match r.value(0, 2) {
                Some(columns) if ranges >= 2 => {
                    let copies = range_copies(source_table, &columns, size / block, ranges);
                    let of = copies.len();
                    debug!(table = %source_table, size, parts = of, "copying in block ranges");
                    parts.extend(copies.into_iter().map(|copy_out| Part {
                        table,
                        copy_out,
                        of,
                    }));
                }
                _ => parts.push(whole(table)),
            }
        }
        Ok(parts)
    }

    /// Drops the indexes of every table copied in parts, in one destination transaction
    /// committed before any row arrives; returns, per such table, what builds them again.
    fn drop_split_indexes(&self) -> Result<Vec<(usize, Vec<String>)>, CopyError> {
        let mut split: Vec<usize> = self
            .parts
            .iter()
            .filter(|p| p.of > 1)
            .map(|p| p.table)
            .collect();
        split.dedup();
        if split.is_empty() || !self.options.indexes_after_rows {
            return Ok(Vec::new());
        }
        let dest_error = |table, e| self.table_error(table, TableCopyError::Destination(e));
        let mut dest = self
            .session(self.dest_conninfo)
            .map_err(|e| dest_error(split[0], e))?;
        dest.exec_ok("BEGIN", "BEGIN on the destination")
            .map_err(|e| dest_error(split[0], e))?;
        let mut rebuild = Vec::new();
        for &table in &split {
            let ddl =
                drop_indexes(&mut dest, &self.tables[table].1).map_err(|e| dest_error(table, e))?;
            rebuild.push((table, ddl));
        }
        dest.exec_ok("COMMIT", "COMMIT of the dropped indexes")
            .map_err(|e| dest_error(split[0], e))?;
        Ok(rebuild)
    }

    /// Records the failure of table `i` unless another one came first (whose abort is then
    /// what made this one fail), and stops the other workers.
    fn fail(&self, i: usize, error: TableCopyError) {
        let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() && !self.abort.is_cancelled() {
            *first = Some(self.table_error(i, error));
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
        // Sessions are opened for the first part, so that failing to open them names its table.
        let mut src = match self.open_source() {
            Ok(s) => s,
            Err(e) => {
                self.fail(self.parts[i].table, TableCopyError::Source(e));
                return None;
            }
        };
        let mut dest = match self.open_dest() {
            Ok(d) => d,
            Err(e) => {
                self.fail(self.parts[i].table, TableCopyError::Destination(e));
                return None;
            }
        };
        let mut done = Vec::new();
        loop {
            let table = self.parts[i].table;
            match self.copy_one(&mut src, &mut dest, i) {
                Ok(part) => {
                    let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
                    match &mut stats[table] {
                        Some(sum) => {
                            sum.rows += part.rows;
                            sum.bytes += part.bytes;
                            sum.millis = sum.millis.max(part.millis);
                            sum.parts += 1;
                        }
                        empty => *empty = Some(part),
                    }
                    done.push(i);
                }
                Err(e) => {
                    self.fail(table, e);
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
        Some(Finished { dest, parts: done })
    }

    fn copy_one(
        &self,
        src: &mut Session,
        dest: &mut Session,
        i: usize,
    ) -> Result<CopyStats, TableCopyError> {
        use TableCopyError::{Destination, Source};
        let part = &self.parts[i];
        let (source_table, dest_table) = &self.tables[part.table];
        let started = Instant::now();
        let chunk = self.options.chunk_bytes;
        let idle = self.options.idle_timeout;

        let op_out = format!("COPY {source_table} TO STDOUT");
        let r = src.exec(&part.copy_out, &op_out).map_err(Source)?;
        if r.status() != ResultStatus::CopyOut {
            return Err(Source(src.unexpected(&r, &op_out, "COPY OUT")));
        }

        // The source answers first (a missing table or a bad snapshot is named before the
        // destination is touched); its rows wait in the socket meanwhile.
        let rebuild = if self.options.indexes_after_rows && part.of == 1 {
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
            parts: 1,
        };
        debug!(?stats, copy = %part.copy_out, "part copied");
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
