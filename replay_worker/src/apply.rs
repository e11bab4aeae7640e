//! Applying shipped source transactions on the destination node as shadow transactions.
//!
//! Every source transaction becomes exactly one destination transaction, sent in one round trip
//! (`BEGIN; …; SELECT pg_replication_origin_xact_setup(…); COMMIT`), so a transaction is either
//! wholly applied or not at all, and the commit costs one network latency, not one per row.
//! Each apply session is bound to its own replication origin; `pg_replication_origin_xact_setup`
//! stamps the destination commit with the source's commit LSN and commit time, so the
//! destination's commit timestamps (`pg_xact_commit_timestamp`) equal the source's and the
//! origin's progress records what was applied.
//!
//! Divergence between source and destination must never be silent: every INSERT, UPDATE and
//! DELETE is wrapped in a guard (`WITH w AS (<dml> RETURNING 1) SELECT 1/(count(*) = 1)::int FROM
//! w`) that raises `division_by_zero` unless the statement touched exactly one row. The error
//! aborts the transaction on the server before its COMMIT is reached, and the index of the
//! failing statement (from the CommandComplete messages that preceded the error) names the table,
//! key and source xid in an [`ApplyError::Divergence`]. The CommandComplete counts of a
//! successful round trip are checked as well.
//!
//! Transactions are applied in parallel over N sessions: [`DependencyScheduler`] orders those
//! that write a common row (keys are the relation name hash and the encoded key values) and
//! TRUNCATE is a barrier; [`AppliedWatermark`] turns out-of-order commits into the applied
//! position reported to the source.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use remus_proto::v1::{column_value, row_change, ApplyProgress, ApplyStart, RowChange, ShadowTxn};
use thiserror::Error;
use tokio::task::{JoinHandle, JoinSet};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};
use tracing::{debug, info, warn, Instrument};

use crate::progress::{AppliedLsnWatcher, AppliedWatermark, WatermarkError};
use crate::scheduler::{DependencyScheduler, RowKey, SubmitError, TxnSpec};

/// Apply sessions when [`ApplyStart::parallelism`] is 0.
pub const DEFAULT_PARALLELISM: usize = 4;
/// Transactions accepted but not yet committed, per apply session, before `submit` waits.
const PENDING_PER_SESSION: usize = 64;

/// The replication origin of apply session `worker` of a migration. The coordinator drops
/// `remus_m<id>_%` origins when it rolls a migration back.
pub fn origin_name(migration_id: u64, worker: usize) -> String {
    format!("remus_m{migration_id}_w{worker}")
}

/// Where and how to apply one migration's transactions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyConfig {
    pub migration_id: u64,
    /// libpq-style conninfo of the destination (`host=… port=… user=… dbname=…`).
    pub destination_conninfo: String,
    /// Concurrent apply sessions, at least 1.
    pub parallelism: usize,
    /// Applied position to start from (the slot's consistent point).
    pub start_lsn: u64,
}

impl ApplyConfig {
    pub fn from_start(start: &ApplyStart) -> Self {
        Self {
            migration_id: start.migration_id,
            destination_conninfo: start.destination_conninfo.clone(),
            parallelism: match start.parallelism {
                0 => DEFAULT_PARALLELISM,
                n => n as usize,
            },
            start_lsn: start.start_lsn,
        }
    }
}

/// Why applying failed. Every variant names what it was doing; nothing after the applied
/// position is committed when one is returned.
#[derive(Debug, Error)]
pub enum ApplyError {
    #[error("apply session {worker}: cannot connect to the destination: {message}")]
    Connect { worker: usize, message: String },
    #[error("apply session {worker}: setting up the session (origin {origin}) failed: {message}")]
    Setup {
        worker: usize,
        origin: String,
        message: String,
    },
    /// The destination does not hold the row the source changed (or already holds the row the
    /// source inserted). The shadow transaction was rolled back.
    #[error(
        "divergence: {op} on {table} with key ({key}) of source xid {xid} {problem}; \
         the shadow transaction was rolled back"
    )]
    Divergence {
        xid: u32,
        table: String,
        op: &'static str,
        key: String,
        problem: String,
    },
    /// Any other failure of a shadow transaction; it was rolled back.
    #[error("source xid {xid} (commit {commit_lsn}) failed at {context}: {message}")]
    Statement {
        xid: u32,
        commit_lsn: String,
        context: String,
        sqlstate: Option<String>,
        message: String,
    },
    #[error("source xid {xid}: malformed shadow transaction: {reason}")]
    Malformed { xid: u32, reason: String },
    #[error("shadow transaction out of order: {0}")]
    Order(#[from] WatermarkError),
    #[error("an apply session task was lost: {0}")]
    SessionLost(String),
    #[error("finishing the apply sessions failed: {0}")]
    Teardown(String),
    #[error("the applier already failed: {0}")]
    Failed(String),
}

/// `message (SQLSTATE xxxxx): detail` for server errors, the client error otherwise.
pub(crate) fn pg_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                let _ = write!(s, ": {detail}");
            }
            s
        }
        None => {
            let mut s = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                let _ = write!(s, ": {cause}");
                source = cause.source();
            }
            s
        }
    }
}

/// `"ident"` with embedded quotes doubled.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `'literal'` with embedded quotes doubled (sessions run with standard_conforming_strings).
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `X/Y` as PostgreSQL prints an LSN.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// Checks that `s` is a sequence of one or two double-quoted identifiers separated by a dot,
/// as the protocol promises for TRUNCATE table names, so it can be spliced into SQL.
fn is_quoted_qualified_name(s: &str) -> bool {
    let mut parts = 0;
    let mut chars = s.chars().peekable();
    loop {
        if chars.next() != Some('"') {
            return false;
        }
        let mut empty = true;
        loop {
            match chars.next() {
                None | Some('\0') => return false,
                Some('"') if chars.peek() == Some(&'"') => {
                    chars.next();
                    empty = false;
                }
                Some('"') => break,
                Some(_) => empty = false,
            }
        }
        parts += 1;
        if empty || parts > 2 {
            return false;
        }
        match chars.next() {
            None => return true,
            Some('.') => continue,
            Some(_) => return false,
        }
    }
}

/// What a statement of the round trip was, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StmtInfo {
    pub(crate) op: &'static str,
    pub(crate) table: String,
    pub(crate) key: String,
    /// Wrapped in the exactly-one-row guard.
    guarded: bool,
}

/// A shadow transaction turned into SQL and scheduling keys.
#[derive(Debug)]
struct Prepared {
    xid: u32,
    commit_lsn: u64,
    end_lsn: u64,
    sql: String,
    stmts: Vec<StmtInfo>,
    keys: Vec<RowKey>,
    barrier: bool,
    /// A transaction the source validated (MOCC): committing its prepared shadow is its apply.
    shadow_gid: Option<String>,
    commit_time_us: i64,
}

pub(crate) type Value = column_value::Value;

fn value_of(v: &remus_proto::v1::ColumnValue) -> Option<&Value> {
    v.value.as_ref()
}

fn sql_value(v: &Value) -> String {
    match v {
        Value::Text(t) => quote_literal(t),
        Value::Null(_) => "NULL".into(),
        Value::UnchangedToast(_) => unreachable!("callers filter unchanged TOAST values"),
    }
}

/// Encodes the key values of a row the same way for every change of that row.
fn encode_key(values: &[(&str, &Value)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (_, v) in values {
        match v {
            Value::Text(t) => {
                out.push(1);
                out.extend_from_slice(&(t.len() as u32).to_be_bytes());
                out.extend_from_slice(t.as_bytes());
            }
            _ => out.push(0),
        }
    }
    out
}

fn relation_id(schema: &str, table: &str) -> u32 {
    let mut h = DefaultHasher::new();
    (schema, table).hash(&mut h);
    h.finish() as u32
}

/// `a = 'x' AND b IS NULL` over the key columns, plus the same as `a=x, b=NULL` for messages.
pub(crate) fn key_condition(values: &[(&str, &Value)]) -> (String, String) {
    let mut cond = String::new();
    let mut shown = String::new();
    for (i, (col, v)) in values.iter().enumerate() {
        if i > 0 {
            cond.push_str(" AND ");
            shown.push_str(", ");
        }
        match v {
            Value::Null(_) => {
                let _ = write!(cond, "{} IS NULL", quote_ident(col));
                let _ = write!(shown, "{col}=NULL");
            }
            other => {
                let _ = write!(cond, "{} = {}", quote_ident(col), sql_value(other));
                let _ = write!(shown, "{col}={}", sql_value(other));
            }
        }
    }
    (cond, shown)
}

/// Wraps a statement so that it fails with `division_by_zero` unless it touched exactly one row.
fn guard(dml: &str) -> String {
    let returning = if dml.starts_with("SELECT") {
        ""
    } else {
        " RETURNING 1"
    };
    format!("WITH w AS ({dml}{returning}) SELECT 1/(count(*) = 1)::int FROM w")
}

pub(crate) type Row<'a> = Vec<(&'a str, &'a Value)>;

/// The values of one row, paired with their column names; every value must be set.
pub(crate) fn row_values<'a>(
    xid: u32,
    table: &str,
    c: &'a RowChange,
    vals: &'a [remus_proto::v1::ColumnValue],
    what: &str,
) -> Result<Row<'a>, ApplyError> {
    let malformed = |reason: String| ApplyError::Malformed { xid, reason };
    if vals.len() != c.columns.len() {
        return Err(malformed(format!(
            "{table}: {what} has {} values for {} columns",
            vals.len(),
            c.columns.len()
        )));
    }
    vals.iter()
        .zip(&c.columns)
        .map(|(v, col)| {
            value_of(v)
                .map(|v| (col.as_str(), v))
                .ok_or_else(|| malformed(format!("{table}: {what} value of {col} is unset")))
        })
        .collect()
}

/// The key columns of a row; there must be some, and none may be an unchanged TOAST value.
pub(crate) fn key_values<'a>(
    xid: u32,
    table: &str,
    c: &RowChange,
    vals: &Row<'a>,
    what: &str,
) -> Result<Row<'a>, ApplyError> {
    let malformed = |reason: String| ApplyError::Malformed { xid, reason };
    let key: Row<'a> = vals
        .iter()
        .zip(&c.key)
        .filter(|(_, k)| **k)
        .map(|(v, _)| *v)
        .collect();
    if key.is_empty() {
        return Err(malformed(format!("{table} has no key columns")));
    }
    if key
        .iter()
        .any(|(_, v)| matches!(v, Value::UnchangedToast(_)))
    {
        return Err(malformed(format!(
            "{table}: {what} key has an unchanged TOAST value"
        )));
    }
    Ok(key)
}

pub(crate) struct ChangeSql {
    pub(crate) sql: String,
    pub(crate) info: StmtInfo,
    keys: Vec<RowKey>,
}

pub(crate) fn change_sql(xid: u32, c: &RowChange) -> Result<ChangeSql, ApplyError> {
    let malformed = |reason: String| ApplyError::Malformed { xid, reason };
    let kind = row_change::Kind::try_from(c.kind)
        .map_err(|_| malformed(format!("unknown change kind {}", c.kind)))?;
    if kind == row_change::Kind::Truncate {
        if c.truncate_tables.is_empty() {
            return Err(malformed("TRUNCATE without tables".into()));
        }
        if let Some(bad) = c
            .truncate_tables
            .iter()
            .find(|t| !is_quoted_qualified_name(t))
        {
            return Err(malformed(format!(
                "TRUNCATE table name {bad:?} is not a quoted qualified name"
            )));
        }
        let list = c.truncate_tables.join(", ");
        return Ok(ChangeSql {
            sql: format!("TRUNCATE {list}"),
            info: StmtInfo {
                op: "TRUNCATE",
                table: list,
                key: String::new(),
                guarded: false,
            },
            keys: Vec::new(),
        });
    }

    if c.table.is_empty() || c.columns.is_empty() || c.key.len() != c.columns.len() {
        return Err(malformed(format!(
            "change on {:?}.{:?} has {} columns and {} key flags",
            c.schema,
            c.table,
            c.columns.len(),
            c.key.len()
        )));
    }
    let table = if c.schema.is_empty() {
        quote_ident(&c.table)
    } else {
        format!("{}.{}", quote_ident(&c.schema), quote_ident(&c.table))
    };
    let relid = relation_id(&c.schema, &c.table);
    let row = |vals, what| row_values(xid, &table, c, vals, what);
    let key_of = |vals, what| key_values(xid, &table, c, vals, what);

    let (op, sql, shown_key, keys) = match kind {
        row_change::Kind::Insert => {
            let new = row(&c.new_values, "new row")?;
            if new
                .iter()
                .any(|(_, v)| matches!(v, Value::UnchangedToast(_)))
            {
                return Err(malformed(format!(
                    "{table}: INSERT with an unchanged TOAST value"
                )));
            }
            let key = key_of(&new, "new")?;
            let cols: Vec<String> = new.iter().map(|(c, _)| quote_ident(c)).collect();
            let vals: Vec<String> = new.iter().map(|(_, v)| sql_value(v)).collect();
            let sql = format!(
                "INSERT INTO {table} ({}) OVERRIDING SYSTEM VALUE VALUES ({})",
                cols.join(", "),
                vals.join(", ")
            );
            let (_, shown) = key_condition(&key);
            let keys = vec![RowKey::new(relid, encode_key(&key))];
            ("INSERT", sql, shown, keys)
        }
        row_change::Kind::Update => {
            let new = row(&c.new_values, "new row")?;
            let new_key = key_of(&new, "new")?;
            let old = if c.old_values.is_empty() {
                None
            } else {
                Some(row(&c.old_values, "old row")?)
            };
            let old_key = match &old {
                Some(old) => key_of(old, "old")?,
                None => new_key.clone(),
            };
            let old_encoded = encode_key(&old_key);
            let new_encoded = encode_key(&new_key);
            // An unchanged key is not SET: a GENERATED ALWAYS identity key refuses any value.
            let key_changed = old_encoded != new_encoded;
            let set: Vec<String> = new
                .iter()
                .zip(&c.key)
                .filter(|((_, v), is_key)| {
                    !matches!(v, Value::UnchangedToast(_)) && (key_changed || !**is_key)
                })
                .map(|((c, v), _)| format!("{} = {}", quote_ident(c), sql_value(v)))
                .collect();
            let (cond, shown) = key_condition(&old_key);
            let sql = if set.is_empty() {
                // Nothing to write (only unchanged TOAST values besides the key): the row must
                // still exist.
                format!("SELECT 1 FROM {table} WHERE {cond} FOR UPDATE")
            } else {
                format!("UPDATE {table} SET {} WHERE {cond}", set.join(", "))
            };
            let mut keys = vec![RowKey::new(relid, old_encoded)];
            if key_changed {
                keys.push(RowKey::new(relid, new_encoded));
            }
            ("UPDATE", sql, shown, keys)
        }
        row_change::Kind::Delete => {
            let old = row(&c.old_values, "old row")?;
            let key = key_of(&old, "old")?;
            let (cond, shown) = key_condition(&key);
            let sql = format!("DELETE FROM {table} WHERE {cond}");
            (
                "DELETE",
                sql,
                shown,
                vec![RowKey::new(relid, encode_key(&key))],
            )
        }
        row_change::Kind::Truncate => unreachable!("handled above"),
    };
    Ok(ChangeSql {
        sql: guard(&sql),
        info: StmtInfo {
            op,
            table,
            key: shown_key,
            guarded: true,
        },
        keys,
    })
}

fn prepare(txn: &ShadowTxn) -> Result<Prepared, ApplyError> {
    if !txn.shadow_gid.is_empty() {
        // Its changes are in the prepared shadow already; they still give its key set, so
        // dependent transactions wait for the commit.
        let mut keys = Vec::new();
        for c in &txn.changes {
            keys.extend(change_sql(txn.xid, c)?.keys);
        }
        return Ok(Prepared {
            xid: txn.xid,
            commit_lsn: txn.commit_lsn,
            end_lsn: txn.end_lsn,
            sql: String::new(),
            stmts: Vec::new(),
            keys,
            barrier: false,
            shadow_gid: Some(txn.shadow_gid.clone()),
            commit_time_us: txn.commit_time_us,
        });
    }
    let mut sql = String::from("BEGIN;\n");
    let mut stmts = Vec::with_capacity(txn.changes.len());
    let mut keys = Vec::new();
    let mut barrier = false;
    for c in &txn.changes {
        let cs = change_sql(txn.xid, c)?;
        sql.push_str(&cs.sql);
        sql.push_str(";\n");
        barrier |= cs.info.op == "TRUNCATE";
        stmts.push(cs.info);
        keys.extend(cs.keys);
    }
    let _ = write!(
        sql,
        "SELECT pg_catalog.pg_replication_origin_xact_setup('{}'::pg_catalog.pg_lsn, \
         '2000-01-01 00:00:00+00'::timestamptz + interval '{} microseconds');\nCOMMIT",
        format_lsn(txn.commit_lsn),
        txn.commit_time_us
    );
    Ok(Prepared {
        xid: txn.xid,
        commit_lsn: txn.commit_lsn,
        end_lsn: txn.end_lsn,
        sql,
        stmts,
        keys,
        barrier,
        shadow_gid: None,
        commit_time_us: txn.commit_time_us,
    })
}

/// Commits prepared transaction `gid` with the source's commit LSN and time recorded under the
/// session's replication origin. Ok(false) when it does not exist (already resolved). A
/// concurrent resolver holding it ("busy") is waited out.
pub(crate) async fn commit_prepared_with_origin(
    client: &Client,
    gid: &str,
    commit_lsn: u64,
    commit_time_us: i64,
) -> Result<bool, tokio_postgres::Error> {
    let setup = format!(
        "SELECT pg_catalog.pg_replication_origin_xact_setup('{}'::pg_catalog.pg_lsn, \
         '2000-01-01 00:00:00+00'::timestamptz + interval '{} microseconds')",
        format_lsn(commit_lsn),
        commit_time_us
    );
    let result = finish_prepared(client, &format!("COMMIT PREPARED {}", quote_literal(gid)), Some(&setup)).await;
    // The values are session globals that the next transaction would reuse.
    let reset = client.batch_execute("SELECT pg_catalog.pg_replication_origin_xact_reset()").await;
    let found = result?;
    reset?;
    Ok(found)
}

/// Runs COMMIT/ROLLBACK PREPARED (alone: it refuses to share a query string), after `before`.
/// Ok(false) when no such prepared transaction exists (SQLSTATE 42704: already finished).
pub(crate) async fn finish_prepared(
    client: &Client,
    statement: &str,
    before: Option<&str>,
) -> Result<bool, tokio_postgres::Error> {
    // Up to ~10 s: a concurrent COMMIT PREPARED only has to write and flush its commit record.
    const BUSY_RETRIES: u32 = 2000;
    let mut attempt = 0;
    loop {
        if let Some(before) = before {
            client.batch_execute(before).await?;
        }
        match client.batch_execute(statement).await {
            Ok(()) => return Ok(true),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_OBJECT) => return Ok(false),
            // Another session is finishing it right now (the stream and the source's
            // post-commit call race): wait until it is gone.
            Err(e) if e.code() == Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE) && attempt < BUSY_RETRIES => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One destination connection bound to a replication origin.
struct Session {
    worker: usize,
    migration_id: u64,
    origin: String,
    client: Client,
    connection: JoinHandle<()>,
}

impl Session {
    async fn open(cfg: &ApplyConfig, worker: usize) -> Result<Session, ApplyError> {
        let origin = origin_name(cfg.migration_id, worker);
        let (client, connection) = tokio_postgres::connect(&cfg.destination_conninfo, NoTls)
            .await
            .map_err(|e| ApplyError::Connect {
                worker,
                message: pg_message(&e),
            })?;
        let migration_id = cfg.migration_id;
        let connection = tokio::spawn(
            async move {
                if let Err(e) = connection.await {
                    warn!(migration_id, worker, error = %pg_message(&e), "destination connection ended");
                }
            }
            .in_current_span(),
        );
        let session = Session {
            worker,
            migration_id,
            origin,
            client,
            connection,
        };
        let o = quote_literal(&session.origin);
        let setup = format!(
            "SET remus.migration_session = on;
             SET session_replication_role = replica;
             SET standard_conforming_strings = on;
             SET application_name = {app};
             SELECT pg_catalog.pg_replication_origin_create({o})
               WHERE pg_catalog.pg_replication_origin_oid({o}) IS NULL;
             SELECT pg_catalog.pg_replication_origin_session_setup({o});",
            app = quote_literal(&format!("remus-replay m{migration_id} w{worker}")),
        );
        session
            .client
            .batch_execute(&setup)
            .await
            .map_err(|e| ApplyError::Setup {
                worker,
                origin: session.origin.clone(),
                message: pg_message(&e),
            })?;
        debug!(migration_id, worker, origin = %session.origin, "apply session ready");
        Ok(session)
    }

    /// Runs the shadow transaction in one round trip; on any error it is rolled back.
    async fn apply(&self, p: &Prepared) -> Result<(), ApplyError> {
        if let Some(gid) = &p.shadow_gid {
            return commit_prepared_with_origin(&self.client, gid, p.commit_lsn, p.commit_time_us)
                .await
                .map(|_| ())
                .map_err(|e| ApplyError::Statement {
                    xid: p.xid,
                    commit_lsn: format_lsn(p.commit_lsn),
                    context: format!("COMMIT PREPARED {gid}"),
                    sqlstate: e.code().map(|c| c.code().to_string()),
                    message: pg_message(&e),
                });
        }
        // Statement indexes: 0 BEGIN, 1..=n changes, n+1 origin setup, n+2 COMMIT.
        let n = p.stmts.len();
        let mut completes: Vec<u64> = Vec::with_capacity(n + 3);
        let mut bad_guard_row = None;
        let result: Result<(), tokio_postgres::Error> = async {
            let stream = self.client.simple_query_raw(&p.sql).await?;
            let mut stream = std::pin::pin!(stream);
            while let Some(msg) = tokio_stream::StreamExt::next(&mut stream)
                .await
                .transpose()?
            {
                match msg {
                    SimpleQueryMessage::CommandComplete(rows) => completes.push(rows),
                    SimpleQueryMessage::Row(row) => {
                        let idx = completes.len();
                        let guarded = (1..=n).contains(&idx) && p.stmts[idx - 1].guarded;
                        if guarded && row.get(0) != Some("1") {
                            bad_guard_row = Some(idx);
                        }
                    }
                    _ => {}
                }
            }
            Ok(())
        }
        .await;

        let failed_at = completes.len();
        let stmt = |idx: usize| (1..=n).contains(&idx).then(|| &p.stmts[idx - 1]);
        match result {
            Ok(()) => {
                // The guards make a wrong row count fail on the server, before COMMIT; this only
                // catches a server that answered something else than what was sent.
                let counts_ok = completes.len() == n + 3
                    && p.stmts
                        .iter()
                        .zip(&completes[1..=n])
                        .all(|(s, &rows)| !s.guarded || rows == 1);
                if counts_ok && bad_guard_row.is_none() {
                    return Ok(());
                }
                Err(ApplyError::Statement {
                    xid: p.xid,
                    commit_lsn: format_lsn(p.commit_lsn),
                    context: "checking the statement results".into(),
                    sqlstate: None,
                    message: format!(
                        "unexpected CommandComplete counts {completes:?} for {n} changes \
                         (guard row check at statement {bad_guard_row:?}); the transaction was \
                         already committed"
                    ),
                })
            }
            Err(e) => {
                if let Err(rb) = self.client.batch_execute("ROLLBACK").await {
                    warn!(migration_id = self.migration_id, worker = self.worker, error = %pg_message(&rb), "ROLLBACK after a failed shadow transaction failed");
                }
                let code = e.code();
                if let Some(s) = stmt(failed_at) {
                    let divergence = if s.guarded && code == Some(&SqlState::DIVISION_BY_ZERO) {
                        Some("did not affect exactly one row on the destination (row missing)")
                    } else if s.op == "INSERT" && code == Some(&SqlState::UNIQUE_VIOLATION) {
                        Some("found the row already present on the destination")
                    } else {
                        None
                    };
                    if let Some(problem) = divergence {
                        return Err(ApplyError::Divergence {
                            xid: p.xid,
                            table: s.table.clone(),
                            op: s.op,
                            key: s.key.clone(),
                            problem: problem.into(),
                        });
                    }
                }
                let context = match stmt(failed_at) {
                    Some(s) if s.key.is_empty() => format!("{} {}", s.op, s.table),
                    Some(s) => format!("{} on {} with key ({})", s.op, s.table, s.key),
                    None if failed_at == 0 => "BEGIN".into(),
                    None if failed_at == n + 1 => "pg_replication_origin_xact_setup".into(),
                    None => "COMMIT".into(),
                };
                Err(ApplyError::Statement {
                    xid: p.xid,
                    commit_lsn: format_lsn(p.commit_lsn),
                    context,
                    sqlstate: code.map(|c| c.code().to_string()),
                    message: pg_message(&e),
                })
            }
        }
    }

    async fn reset(&self) -> Result<(), tokio_postgres::Error> {
        self.client
            .batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
            .await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the client ends the connection task by itself; this only hurries it up.
        self.connection.abort();
    }
}

type Completion = (Session, u64, Result<(), ApplyError>);

/// Applies one migration's shadow transactions over parallel destination sessions.
///
/// Drive it from one task: [`submit`](Self::submit) transactions in source commit order,
/// [`idle`](Self::idle) on keepalives, and poll [`next_completion`](Self::next_completion)
/// (cancel-safe, for `select!`) to learn when the applied position advances. End with
/// [`finish`](Self::finish) (drops the origins) or [`abort`](Self::abort) (leaves them).
pub struct ShadowApplier {
    cfg: ApplyConfig,
    idle_sessions: Vec<Session>,
    running: JoinSet<Completion>,
    scheduler: DependencyScheduler,
    watermark: AppliedWatermark,
    jobs: HashMap<u64, Arc<Prepared>>,
    next_seq: u64,
    txns_applied: u64,
    /// An idle LSN received while transactions were outstanding.
    idle_lsn: Option<u64>,
    failed: Option<String>,
}

impl std::fmt::Debug for ShadowApplier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShadowApplier")
            .field("cfg", &self.cfg)
            .field("idle_sessions", &self.idle_sessions.len())
            .field("running", &self.running.len())
            .field("applied_lsn", &self.watermark.applied_lsn())
            .field("txns_applied", &self.txns_applied)
            .finish_non_exhaustive()
    }
}

impl ShadowApplier {
    /// Opens `cfg.parallelism` sessions to the destination, each with its replication origin
    /// (created if missing) set up.
    pub async fn connect(cfg: ApplyConfig) -> Result<ShadowApplier, ApplyError> {
        let parallelism = cfg.parallelism.max(1);
        let mut sessions = Vec::with_capacity(parallelism);
        for worker in 0..parallelism {
            sessions.push(Session::open(&cfg, worker).await?);
        }
        info!(
            migration_id = cfg.migration_id,
            parallelism,
            start_lsn = %format_lsn(cfg.start_lsn),
            "apply sessions connected"
        );
        // Pop order = worker order, which keeps logs readable.
        sessions.reverse();
        Ok(ShadowApplier {
            scheduler: DependencyScheduler::new(parallelism * PENDING_PER_SESSION),
            watermark: AppliedWatermark::new(cfg.start_lsn),
            cfg,
            idle_sessions: sessions,
            running: JoinSet::new(),
            jobs: HashMap::new(),
            next_seq: 1,
            txns_applied: 0,
            idle_lsn: None,
            failed: None,
        })
    }

    pub fn migration_id(&self) -> u64 {
        self.cfg.migration_id
    }

    /// Every transaction submitted whose end LSN is at most this is committed on the destination.
    pub fn applied_lsn(&self) -> u64 {
        self.watermark.applied_lsn()
    }

    /// Shadow transactions committed so far (empty transactions count as applied).
    pub fn txns_applied(&self) -> u64 {
        self.txns_applied
    }

    pub fn progress(&self) -> ApplyProgress {
        ApplyProgress {
            applied_lsn: self.applied_lsn(),
            txns_applied: self.txns_applied,
        }
    }

    /// Observes the applied position from other tasks.
    pub fn watcher(&self) -> AppliedLsnWatcher {
        self.watermark.watcher()
    }

    fn check_failed(&self) -> Result<(), ApplyError> {
        match &self.failed {
            Some(e) => Err(ApplyError::Failed(e.clone())),
            None => Ok(()),
        }
    }

    /// Accepts the next source transaction (in source commit order) and starts it as soon as it
    /// does not depend on anything outstanding. Waits for completions while too many are
    /// pending; a failure of any transaction is returned from here or from
    /// [`next_completion`](Self::next_completion).
    pub async fn submit(&mut self, txn: ShadowTxn) -> Result<(), ApplyError> {
        self.check_failed()?;
        let prepared = prepare(&txn)?;
        let seq = self.next_seq;
        self.watermark.register(seq, prepared.end_lsn)?;
        self.next_seq += 1;
        if prepared.stmts.is_empty() && prepared.shadow_gid.is_none() {
            // Nothing to write: it is applied as soon as it is its turn in the watermark.
            self.txns_applied += 1;
            self.watermark.complete(seq)?;
            self.fold_idle();
            return Ok(());
        }
        let mut spec = TxnSpec::new(
            seq,
            prepared.commit_lsn,
            prepared.end_lsn,
            prepared.keys.clone(),
        );
        spec.barrier = prepared.barrier;
        self.jobs.insert(seq, Arc::new(prepared));
        loop {
            match self.scheduler.submit(spec) {
                Ok(()) => break,
                Err(SubmitError::Full { txn, .. }) => {
                    spec = *txn;
                    self.dispatch();
                    self.next_completion().await?;
                }
                Err(e @ SubmitError::OutOfOrder { .. }) => {
                    unreachable!("seqs are assigned in increasing order: {e}")
                }
            }
        }
        self.dispatch();
        Ok(())
    }

    /// The source has nothing in flight up to `lsn`: the applied position moves there once
    /// everything submitted so far is applied. Returns the new position if it moved now.
    pub fn idle(&mut self, lsn: u64) -> Option<u64> {
        if self.watermark.pending() == 0 {
            self.watermark.advance_idle(lsn)
        } else {
            self.idle_lsn = Some(self.idle_lsn.map_or(lsn, |l| l.max(lsn)));
            None
        }
    }

    /// Applies a deferred idle LSN once nothing is outstanding.
    fn fold_idle(&mut self) -> Option<u64> {
        if self.watermark.pending() > 0 {
            return None;
        }
        self.idle_lsn
            .take()
            .and_then(|lsn| self.watermark.advance_idle(lsn))
    }

    /// Transactions submitted and not yet committed.
    pub fn outstanding(&self) -> usize {
        self.watermark.pending()
    }

    fn dispatch(&mut self) {
        while !self.idle_sessions.is_empty() {
            let Some(spec) = self.scheduler.next_ready() else {
                break;
            };
            let job = self
                .jobs
                .remove(&spec.seq)
                .expect("every scheduled seq has a prepared job");
            let session = self.idle_sessions.pop().expect("checked non-empty");
            debug!(
                migration_id = self.cfg.migration_id,
                worker = session.worker,
                xid = job.xid,
                seq = spec.seq,
                "applying"
            );
            self.running.spawn(
                async move {
                    let result = session.apply(&job).await;
                    (session, spec.seq, result)
                }
                .in_current_span(),
            );
        }
    }

    /// Waits for the next shadow transaction to commit (or fail) and returns the new applied
    /// position if it advanced. Pends forever while nothing is running. Cancel-safe.
    pub async fn next_completion(&mut self) -> Result<Option<u64>, ApplyError> {
        self.check_failed()?;
        let Some(joined) = self.running.join_next().await else {
            return std::future::pending().await;
        };
        let (session, seq, result) = match joined {
            Ok(c) => c,
            Err(e) => {
                let err = ApplyError::SessionLost(e.to_string());
                self.failed = Some(err.to_string());
                return Err(err);
            }
        };
        self.idle_sessions.push(session);
        if let Err(e) = result {
            warn!(migration_id = self.cfg.migration_id, seq, error = %e, "shadow transaction failed");
            self.failed = Some(e.to_string());
            return Err(e);
        }
        self.scheduler
            .complete(seq)
            .expect("a transaction handed out by the scheduler completes once");
        self.txns_applied += 1;
        let advanced = self.watermark.complete(seq)?;
        let advanced = self.fold_idle().or(advanced);
        self.dispatch();
        Ok(advanced)
    }

    /// Waits until everything submitted is committed.
    pub async fn drain(&mut self) -> Result<(), ApplyError> {
        self.dispatch();
        while !self.running.is_empty() {
            self.next_completion().await?;
        }
        self.check_failed()?;
        if !self.scheduler.is_idle() {
            // Cannot happen: with every session idle, a pending transaction is always ready.
            return Err(ApplyError::SessionLost(format!(
                "{} transactions pending with nothing running",
                self.scheduler.pending()
            )));
        }
        Ok(())
    }

    /// Applies everything outstanding, detaches the sessions from their origins and drops the
    /// migration's origins. Returns the final progress.
    pub async fn finish(mut self) -> Result<ApplyProgress, ApplyError> {
        self.drain().await?;
        let teardown = |e: tokio_postgres::Error| ApplyError::Teardown(pg_message(&e));
        for s in &self.idle_sessions {
            s.reset().await.map_err(teardown)?;
        }
        let names: Vec<String> = (0..self.cfg.parallelism.max(1))
            .map(|w| quote_literal(&origin_name(self.cfg.migration_id, w)))
            .collect();
        let drop_sql = format!(
            "SELECT pg_catalog.pg_replication_origin_drop(n) FROM unnest(ARRAY[{}]::text[]) n \
             WHERE pg_catalog.pg_replication_origin_oid(n) IS NOT NULL",
            names.join(", ")
        );
        let first = self
            .idle_sessions
            .first()
            .ok_or_else(|| ApplyError::Teardown("no apply session left".into()))?;
        first
            .client
            .batch_execute(&drop_sql)
            .await
            .map_err(teardown)?;
        let progress = self.progress();
        info!(
            migration_id = self.cfg.migration_id,
            applied_lsn = %format_lsn(progress.applied_lsn),
            txns_applied = progress.txns_applied,
            "apply finished, origins dropped"
        );
        Ok(progress)
    }

    /// Stops: cancels running transactions (uncommitted ones roll back when their connection
    /// closes), detaches idle sessions from their origins and closes everything. The origins
    /// are left in place; the coordinator drops `remus_m<id>_%` origins when it rolls the
    /// migration back.
    pub async fn abort(mut self) {
        self.running.abort_all();
        while let Some(joined) = self.running.join_next().await {
            if let Ok((session, _, _)) = joined {
                self.idle_sessions.push(session);
            }
        }
        for s in &self.idle_sessions {
            if let Err(e) = s.reset().await {
                debug!(migration_id = self.cfg.migration_id, worker = s.worker, error = %pg_message(&e), "origin session reset on abort failed");
            }
        }
        info!(
            migration_id = self.cfg.migration_id,
            applied_lsn = %format_lsn(self.applied_lsn()),
            "apply stopped; replication origins left for the coordinator to drop"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use remus_proto::v1::ColumnValue as PbValue;

    fn text(s: &str) -> PbValue {
        PbValue {
            value: Some(Value::Text(s.into())),
        }
    }
    fn null() -> PbValue {
        PbValue {
            value: Some(Value::Null(true)),
        }
    }
    fn toast() -> PbValue {
        PbValue {
            value: Some(Value::UnchangedToast(true)),
        }
    }

    fn change(kind: row_change::Kind, old: Vec<PbValue>, new: Vec<PbValue>) -> RowChange {
        RowChange {
            kind: kind as i32,
            schema: "s".into(),
            table: "t\"x".into(),
            columns: vec!["id".into(), "v".into()],
            key: vec![true, false],
            old_values: old,
            new_values: new,
            truncate_tables: vec![],
        }
    }

    fn txn(changes: Vec<RowChange>) -> ShadowTxn {
        ShadowTxn {
            xid: 7,
            commit_lsn: 0x1_0000_0010,
            end_lsn: 0x1_0000_0040,
            commit_time_us: 123,
            changes,
            shadow_gid: String::new(),
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's \\"), "'it''s \\'");
        assert_eq!(format_lsn(0x1_0000_0010), "1/10");
        assert!(is_quoted_qualified_name("\"a\".\"b\"\"c\""));
        assert!(is_quoted_qualified_name("\"t\""));
        for bad in [
            "a.b",
            "\"a\".b",
            "\"a\"; DROP",
            "\"a\".\"b\".\"c\"",
            "\"\"",
            "\"a",
        ] {
            assert!(!is_quoted_qualified_name(bad), "{bad}");
        }
    }

    #[test]
    fn statements_are_guarded_and_quoted() {
        use row_change::Kind::*;
        let p = prepare(&txn(vec![
            change(Insert, vec![], vec![text("1"), text("o'k")]),
            change(Update, vec![], vec![text("1"), toast()]),
            change(Update, vec![text("1"), null()], vec![text("2"), null()]),
            change(Delete, vec![text("2"), null()], vec![]),
        ]))
        .unwrap();
        let lines: Vec<&str> = p.sql.lines().collect();
        assert_eq!(lines[0], "BEGIN;");
        assert_eq!(
            lines[1],
            "WITH w AS (INSERT INTO \"s\".\"t\"\"x\" (\"id\", \"v\") OVERRIDING SYSTEM VALUE \
             VALUES ('1', 'o''k') RETURNING 1) SELECT 1/(count(*) = 1)::int FROM w;"
        );
        assert!(
            lines[2].contains(
                "WITH w AS (SELECT 1 FROM \"s\".\"t\"\"x\" WHERE \"id\" = '1' FOR UPDATE) SELECT"
            ),
            "{}",
            lines[2]
        );
        assert!(lines[3].contains("SET \"id\" = '2', \"v\" = NULL WHERE \"id\" = '1' RETURNING"));
        assert!(lines[4].contains("DELETE FROM \"s\".\"t\"\"x\" WHERE \"id\" = '2' RETURNING"));
        assert!(lines[5].starts_with(
            "SELECT pg_catalog.pg_replication_origin_xact_setup('1/10'::pg_catalog.pg_lsn, \
             '2000-01-01 00:00:00+00'::timestamptz + interval '123 microseconds')"
        ));
        assert_eq!(lines[6], "COMMIT");
        assert!(!p.barrier);
        // Key 1 (insert, update, update-old) and key 2 (update-new, delete).
        let distinct: std::collections::BTreeSet<_> = p.keys.iter().collect();
        assert_eq!(distinct.len(), 2);
        assert_eq!(p.keys.len(), 5);
    }

    #[test]
    fn truncate_is_a_barrier_and_names_are_validated() {
        let mut c = change(row_change::Kind::Truncate, vec![], vec![]);
        c.truncate_tables = vec!["\"s\".\"a\"".into(), "\"s\".\"b\"".into()];
        let p = prepare(&txn(vec![c.clone()])).unwrap();
        assert!(p.barrier && p.keys.is_empty());
        assert!(p.sql.contains("\nTRUNCATE \"s\".\"a\", \"s\".\"b\";\n"));
        c.truncate_tables = vec!["s.a; DROP TABLE x".into()];
        assert!(matches!(
            prepare(&txn(vec![c])),
            Err(ApplyError::Malformed { xid: 7, .. })
        ));
    }

    #[test]
    fn malformed_changes_are_refused() {
        use row_change::Kind::*;
        let cases = [
            change(Insert, vec![], vec![text("1")]),
            change(Insert, vec![], vec![text("1"), toast()]),
            change(Update, vec![], vec![toast(), text("x")]),
            change(Delete, vec![], vec![]),
            change(Insert, vec![], vec![PbValue { value: None }, text("x")]),
        ];
        for c in cases {
            assert!(
                matches!(
                    prepare(&txn(vec![c.clone()])),
                    Err(ApplyError::Malformed { .. })
                ),
                "{c:?}"
            );
        }
    }
}
