//! MOCC on the destination: validating a source transaction that commits while its migration
//! is in sync mode (dual execution), and resolving the prepared shadow afterwards.
//!
//! A [`Validator`] belongs to one migration's `Apply` call (it needs that call's applied
//! position: a shadow may only run once the stream has applied everything the source committed
//! before the transaction's pre-commit, L_T, or an older change of the same row would later
//! overwrite it). It keeps a small pool of destination sessions, each bound to its own Remus
//! replication origin (`remus_m<id>_v<k>`), so a committed shadow carries the source's commit
//! time and a Remus origin like every other replayed row.
//!
//! Write-write conflict (the transaction is refused, the source aborts it with 40001): for an
//! UPDATE or DELETE, the row is locked by its old key and its latest version was committed by a
//! transaction that is not Remus's (no origin, or an origin not named `remus_m…`: a destination
//! transaction after the ownership flip), or the row is missing; for an INSERT, the key exists;
//! a lock wait past the timeout or a deadlock is a conflict too (the source must not wait on the
//! destination forever).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use remus_proto::v1::{row_change, RowChange};
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};
use tracing::{debug, warn, Instrument};

use crate::apply::{
    change_sql, commit_prepared_with_origin, finish_prepared, key_condition, key_values, pg_message, quote_literal,
    row_values,
};
use crate::progress::AppliedLsnWatcher;

/// Validation sessions per migration.
pub const MAX_VALIDATION_SESSIONS: usize = 16;
/// Default longest wait for a destination row lock.
pub const DEFAULT_LOCK_TIMEOUT_MS: u32 = 5000;
/// Longest wait for the stream to pass a transaction's L_T.
pub const STREAM_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum ValidateError {
    #[error("the stream of migration {migration_id} did not reach {wait_lsn} within {secs} s")]
    StreamTimeout { migration_id: u64, wait_lsn: String, secs: u64 },
    #[error("the apply call of migration {0} ended")]
    StreamEnded(u64),
    #[error("malformed write set: {0}")]
    Malformed(String),
    #[error("validation session of migration {migration_id}: {message}")]
    Session { migration_id: u64, message: String },
    #[error("destination error: {0}")]
    Destination(String),
}

/// The outcome of a validation that ran.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The shadow is prepared under the requested gid.
    Prepared,
    /// A write-write conflict; nothing is left on the destination.
    Conflict(String),
}

struct PooledSession {
    client: Client,
    connection: tokio::task::JoinHandle<()>,
}

impl Drop for PooledSession {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// One migration's validation side.
pub struct Validator {
    migration_id: u64,
    conninfo: String,
    watcher: AppliedLsnWatcher,
    idle: Mutex<Vec<PooledSession>>,
    permits: Semaphore,
    next_origin: Mutex<usize>,
}

/// Migrations whose `Apply` call is running in this process, by id.
pub type ValidatorRegistry = Arc<Mutex<HashMap<u64, Arc<Validator>>>>;

/// The validation session origin `k` of a migration (dropped with every `remus_m<id>_%`).
pub fn validation_origin(migration_id: u64, k: usize) -> String {
    format!("remus_m{migration_id}_v{k}")
}

impl Validator {
    pub fn new(migration_id: u64, conninfo: String, watcher: AppliedLsnWatcher) -> Self {
        Self {
            migration_id,
            conninfo,
            watcher,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(MAX_VALIDATION_SESSIONS),
            next_origin: Mutex::new(0),
        }
    }

    async fn open(&self) -> Result<PooledSession, ValidateError> {
        let k = {
            let mut n = self.next_origin.lock().unwrap_or_else(|p| p.into_inner());
            *n += 1;
            *n - 1
        };
        let migration_id = self.migration_id;
        let session_err = |e: tokio_postgres::Error| ValidateError::Session { migration_id, message: pg_message(&e) };
        let (client, connection) = tokio_postgres::connect(&self.conninfo, NoTls).await.map_err(session_err)?;
        let connection = tokio::spawn(
            async move {
                if let Err(e) = connection.await {
                    debug!(migration_id, error = %pg_message(&e), "validation connection ended");
                }
            }
            .in_current_span(),
        );
        let o = quote_literal(&validation_origin(migration_id, k));
        client
            .batch_execute(&format!(
                "SET remus.migration_session = on;
                 SET standard_conforming_strings = on;
                 SET application_name = {app};
                 SELECT pg_catalog.pg_replication_origin_create({o})
                   WHERE pg_catalog.pg_replication_origin_oid({o}) IS NULL;
                 SELECT pg_catalog.pg_replication_origin_session_setup({o});",
                app = quote_literal(&format!("remus-validate m{migration_id} v{k}")),
            ))
            .await
            .map_err(session_err)?;
        Ok(PooledSession { client, connection })
    }

    async fn session(&self) -> Result<(tokio::sync::SemaphorePermit<'_>, PooledSession), ValidateError> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| ValidateError::StreamEnded(self.migration_id))?;
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let session = match pooled {
            Some(s) => s,
            None => self.open().await?,
        };
        Ok((permit, session))
    }

    fn give_back(&self, session: PooledSession) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(session);
    }

    /// Waits for the stream to pass `wait_lsn`, then runs the shadow with the conflict check
    /// and prepares it as `gid`.
    pub async fn validate(
        &self,
        gid: &str,
        wait_lsn: u64,
        changes: &[RowChange],
        lock_timeout_ms: u32,
    ) -> Result<Verdict, ValidateError> {
        let checks = changes.iter().map(check_sql).collect::<Result<Vec<_>, _>>()?;
        match tokio::time::timeout(STREAM_WAIT, self.watcher.wait_for(wait_lsn)).await {
            Err(_) => {
                return Err(ValidateError::StreamTimeout {
                    migration_id: self.migration_id,
                    wait_lsn: crate::apply::format_lsn(wait_lsn),
                    secs: STREAM_WAIT.as_secs(),
                })
            }
            Ok(Err(_)) => return Err(ValidateError::StreamEnded(self.migration_id)),
            Ok(Ok(_)) => {}
        }
        let (_permit, session) = self.session().await?;
        let lock_timeout = if lock_timeout_ms == 0 { DEFAULT_LOCK_TIMEOUT_MS } else { lock_timeout_ms };
        let verdict = run_shadow(&session.client, gid, &checks, lock_timeout).await;
        match verdict {
            Ok(v) => {
                self.give_back(session);
                Ok(v)
            }
            Err(e) => {
                // The session may be mid-transaction or broken: roll back, or drop it.
                if session.client.batch_execute("ROLLBACK").await.is_ok() {
                    self.give_back(session);
                }
                Err(e)
            }
        }
    }

    /// Commits (with the source's commit time) or rolls back the prepared shadow `gid`.
    /// Ok(false) when it does not exist.
    pub async fn resolve(&self, gid: &str, commit: bool, commit_lsn: u64, commit_time_us: i64) -> Result<bool, ValidateError> {
        let (_permit, session) = self.session().await?;
        let result = if commit {
            commit_prepared_with_origin(&session.client, gid, commit_lsn, commit_time_us).await
        } else {
            finish_prepared(&session.client, &format!("ROLLBACK PREPARED {}", quote_literal(gid)), None).await
        };
        match result {
            Ok(found) => {
                self.give_back(session);
                Ok(found)
            }
            Err(e) => Err(ValidateError::Destination(pg_message(&e))),
        }
    }

    /// Detaches the pooled sessions from their origins and closes them (the coordinator drops
    /// the origins at cleanup; an attached origin could not be dropped).
    pub async fn close(&self) {
        self.permits.close();
        let sessions: Vec<PooledSession> = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        for s in sessions {
            if let Err(e) = s.client.batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()").await {
                warn!(migration_id = self.migration_id, error = %pg_message(&e), "detaching a validation session failed");
            }
        }
    }
}

/// What one change of the write set runs: an optional lock-and-check query, then the change.
struct Check {
    lock: Option<(String, String)>,
    op: &'static str,
    table: String,
    key: String,
    apply: String,
}

fn check_sql(c: &RowChange) -> Result<Check, ValidateError> {
    let malformed = |e: crate::apply::ApplyError| ValidateError::Malformed(e.to_string());
    let kind = row_change::Kind::try_from(c.kind).map_err(|_| ValidateError::Malformed(format!("unknown change kind {}", c.kind)))?;
    if kind == row_change::Kind::Truncate {
        return Err(ValidateError::Malformed("TRUNCATE cannot be validated (it is refused on a migrating shard)".into()));
    }
    let cs = change_sql(0, c).map_err(malformed)?;
    let lock = if kind == row_change::Kind::Insert {
        None
    } else {
        let table = cs.info.table.clone();
        let old_vals = if c.old_values.is_empty() { &c.new_values } else { &c.old_values };
        let old = row_values(0, &table, c, old_vals, "old row").map_err(malformed)?;
        let key = key_values(0, &table, c, &old, "old").map_err(malformed)?;
        let (cond, shown) = key_condition(&key);
        // The latest version (FOR UPDATE follows the update chain and waits for writers,
        // prepared ones included), with the origin of the transaction that committed it.
        Some((
            format!(
                "SELECT c.roident::text, o.roname
                   FROM {table} t
                   LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(t.xmin) c ON true
                   LEFT JOIN pg_catalog.pg_replication_origin o ON o.roident = c.roident
                  WHERE {cond} FOR UPDATE OF t"
            ),
            shown,
        ))
    };
    Ok(Check { lock, op: cs.info.op, table: cs.info.table.clone(), key: cs.info.key.clone(), apply: cs.sql })
}

fn is_conflict_code(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::T_R_DEADLOCK_DETECTED
            || *c == SqlState::UNIQUE_VIOLATION || *c == SqlState::DIVISION_BY_ZERO
    )
}

async fn run_shadow(client: &Client, gid: &str, checks: &[Check], lock_timeout_ms: u32) -> Result<Verdict, ValidateError> {
    let dest = |e: tokio_postgres::Error| ValidateError::Destination(pg_message(&e));
    client
        .batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '{lock_timeout_ms}ms'"))
        .await
        .map_err(dest)?;
    for check in checks {
        if let Some((lock, shown)) = &check.lock {
            let rows = match client.simple_query(lock).await {
                Ok(r) => r,
                Err(e) if is_conflict_code(&e) => return conflict(client, format!("{} on {} ({shown}): {}", check.op, check.table, pg_message(&e))).await,
                Err(e) => return Err(dest(e)),
            };
            let row = rows.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some((r.get(0).map(str::to_string), r.get(1).map(str::to_string))),
                _ => None,
            });
            match row {
                None => {
                    return conflict(client, format!("{} on {}: row ({shown}) is missing on the destination", check.op, check.table)).await
                }
                // No commit timestamp data: a version older than the migration (or this
                // shadow's own earlier change).
                Some((None, _)) => {}
                Some((Some(roident), name)) => {
                    let remus = roident != "0" && name.as_deref().is_some_and(|n| n.starts_with("remus_m"));
                    if !remus {
                        return conflict(
                            client,
                            format!("{} on {}: row ({shown}) was changed by a transaction on the destination", check.op, check.table),
                        )
                        .await;
                    }
                }
            }
        }
        match client.simple_query(&check.apply).await {
            Ok(_) => {}
            Err(e) if is_conflict_code(&e) => {
                let why = if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
                    format!("{} on {}: key ({}) already exists on the destination", check.op, check.table, check.key)
                } else {
                    format!("{} on {} ({}): {}", check.op, check.table, check.key, pg_message(&e))
                };
                return conflict(client, why).await;
            }
            Err(e) => return Err(dest(e)),
        }
    }
    client
        .batch_execute(&format!("PREPARE TRANSACTION {}", quote_literal(gid)))
        .await
        .map_err(dest)?;
    Ok(Verdict::Prepared)
}

async fn conflict(client: &Client, why: String) -> Result<Verdict, ValidateError> {
    client
        .batch_execute("ROLLBACK")
        .await
        .map_err(|e| ValidateError::Destination(pg_message(&e)))?;
    Ok(Verdict::Conflict(why))
}
