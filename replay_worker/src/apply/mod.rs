//! Applying shipped source transactions on the destination node as shadow transactions.
//!
//! Every source transaction becomes exactly one destination transaction, sent in one round trip
//! (`BEGIN`, the changes, `SELECT pg_replication_origin_xact_setup(…)`, `COMMIT`, pipelined over
//! the extended protocol), so a transaction is either wholly applied or not at all, and the
//! commit costs one network latency, not one per row. A change's statement carries its values
//! as text-format parameters, so its text depends only on the table, the operation and the
//! column shape: each session prepares it once and runs it with every later transaction's
//! values (no parse or plan per row; measured with `examples/apply_rate.rs`).
//! Each apply session is bound to its own replication origin; `pg_replication_origin_xact_setup`
//! stamps the destination commit with the source's commit LSN and commit time, so the
//! destination's commit timestamps (`pg_xact_commit_timestamp`) equal the source's and the
//! origin's progress records what was applied.
//!
//! Divergence between source and destination must never be silent: every INSERT, UPDATE and
//! DELETE is wrapped in a guard (`WITH w AS (<dml> RETURNING 1) SELECT 1/(count(*) = 1)::int FROM
//! w`) that raises `division_by_zero` unless the statement touched exactly one row. The error
//! aborts the transaction on the server before its COMMIT is reached (the statements after it
//! fail with 25P02 and the COMMIT ends the aborted transaction), and the index of the first
//! failing statement names the table, key and source xid in an [`ApplyError::Divergence`]. The
//! guards' answers of a successful round trip are checked as well.
//!
//! Transactions are applied in parallel over N sessions:
//! [`DependencyScheduler`](crate::scheduler::DependencyScheduler) orders those that write a
//! common row (keys are the relation name hash and the encoded key values) and TRUNCATE is a
//! barrier; [`AppliedWatermark`](crate::progress::AppliedWatermark) turns out-of-order commits
//! into the applied position (what the sync barrier and validations wait for). Catch-up shadows
//! commit asynchronously (`synchronous_commit = off`, as PostgreSQL's own apply worker does), so
//! what is reported to the source's slot is the durable position behind it: the applied
//! position as of the destination's last WAL flush (`durable`, decision 0018).

//!
//! The module is cut by concern: [`sql`] turns a shipped transaction into the SQL text of its
//! round trip (quoting, key encoding, the guard), `session` runs it on one destination session
//! bound to its origin, `applier` ([`ShadowApplier`]) schedules transactions over the
//! sessions and tracks the applied position, and `durable` flushes the destination behind it.

use std::fmt::Write as _;

use remus_proto::v1::ApplyStart;
use thiserror::Error;

use crate::progress::WatermarkError;

mod applier;
mod durable;
mod session;
pub(crate) mod sql;

pub use applier::ShadowApplier;
pub(crate) use session::{commit_prepared_with_origin, finish_prepared};
pub(crate) use sql::{change_sql, key_condition, key_values, origin_session_setup, row_values};
pub use sql::{format_lsn, quote_ident, quote_literal};

/// Apply sessions when [`ApplyStart::parallelism`] is 0: as the coordinator's default
/// (decision 0031).
pub const DEFAULT_PARALLELISM: usize = 16;

/// [`ApplyConfig::batch`] unless the replay worker's environment sets `REMUS_APPLY_BATCH`
/// (decision 0035: 0 or 1 turns batches off).
pub const DEFAULT_BATCH: usize = 64;

/// `REMUS_APPLY_BATCH` (transactions per call of the batch procedure), or [`DEFAULT_BATCH`].
/// A value that is not a number is warned about and ignored.
fn batch_from_env() -> usize {
    let Ok(value) = std::env::var("REMUS_APPLY_BATCH") else {
        return DEFAULT_BATCH;
    };
    value.trim().parse().unwrap_or_else(|_| {
        tracing::warn!(
            value = %value,
            default = DEFAULT_BATCH,
            "REMUS_APPLY_BATCH is not a number of transactions; using the default"
        );
        DEFAULT_BATCH
    })
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
    /// Most transactions a session applies in one call of its batch procedure (design note
    /// 0003); 0 or 1: one transaction per round trip, as four statements.
    pub batch: usize,
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
            batch: batch_from_env(),
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
    /// The destination could not be flushed: the durable position, which the source's slot is
    /// confirmed to, cannot advance.
    #[error("flushing the destination failed: {0}")]
    Flush(String),
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
