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
//!
//! A write set arrives in chunks (the `Validate` call is client-streaming, review F10: a single
//! message was capped at 256 MiB): the shadow transaction begins with the first chunk and each
//! chunk runs as it arrives, so only one chunk is held here. The statements of a chunk are
//! pipelined (all sent, then the answers read in order): a chunk costs about one round trip to
//! the destination instead of two per row.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use remus_proto::names::{is_migration_object, shadow_gid_prefix, validation_origin};
use remus_proto::v1::{row_change, RowChange};
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};
use tokio_stream::{Stream, StreamExt};
use tracing::{debug, info, warn, Instrument};

use crate::apply::{
    change_sql, commit_prepared_with_origin, finish_prepared, key_condition, key_values,
    origin_session_setup, pg_message, quote_literal, row_values,
};
use crate::progress::AppliedLsnWatcher;

/// Validation sessions per migration.
pub const MAX_VALIDATION_SESSIONS: usize = 16;
/// Default longest wait for a destination row lock.
pub const DEFAULT_LOCK_TIMEOUT_MS: u32 = 5000;
/// Default longest wait for the stream to pass a transaction's L_T.
pub const STREAM_WAIT: Duration = Duration::from_secs(30);
/// Longest wait, when the Apply call ends, for running validations and resolutions to give their
/// sessions back (each is bounded by its lock timeout) before the origins are detached.
const CLOSE_WAIT: Duration = Duration::from_secs(30);
/// Longest run of one statement of a validation session on the destination (its server-side
/// `statement_timeout`): above the row-lock wait, so only a destination that hangs hits it.
const VALIDATION_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a new validation session (TCP connect, start-up, origin set-up): a
/// destination that accepts connections but never answers must not hold a permit forever.
const SESSION_OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// TCP keepalive and user timeout of the validation sessions: a partitioned destination
/// (packets dropped, no reset) ends the session instead of leaving it waiting forever.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);
/// The verdict of a validation whose source transaction rolled back meanwhile (nobody reads it).
const SOURCE_ROLLED_BACK: &str = "the source transaction rolled back during its validation";
/// PostgreSQL's GIDSIZE (200) includes the terminating NUL.
const MAX_GID_BYTES: usize = 199;

#[derive(Debug, Error)]
pub enum ValidateError {
    #[error("the stream of migration {migration_id} did not reach {wait_lsn} within {secs} s")]
    StreamTimeout {
        migration_id: u64,
        wait_lsn: String,
        secs: u64,
    },
    #[error("the apply call of migration {0} ended")]
    StreamEnded(u64),
    #[error("malformed write set: {0}")]
    Malformed(String),
    #[error("bad gid {gid:?} for migration {migration_id}: {reason}")]
    BadGid {
        migration_id: u64,
        gid: String,
        reason: &'static str,
    },
    #[error("validation session of migration {migration_id}: {message}")]
    Session { migration_id: u64, message: String },
    #[error("destination error: {0}")]
    Destination(String),
    #[error("the write set's request stream broke: {0}")]
    RequestStream(String),
}

/// The chunks of a write set after the first, as the `Validate` request stream delivers them.
pub type Chunks<'a> =
    Pin<Box<dyn Stream<Item = Result<Vec<RowChange>, ValidateError>> + Send + 'a>>;

/// No further chunks (a write set sent in one piece).
pub fn no_more_chunks<'a>() -> Chunks<'a> {
    Box::pin(tokio_stream::empty())
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
    stream_wait: Duration,
    idle: Mutex<Vec<PooledSession>>,
    permits: Semaphore,
    /// Origins `remus_m<id>_v<k>` for k below this may have been created (dropped at finish).
    next_origin: AtomicUsize,
    /// Cleared when the Apply call received `finish`: the source has no sync transaction left,
    /// so a late validation could only leave a shadow the stream never commits.
    accepting: AtomicBool,
    /// Shadows whose source transaction rolled back before its validation was known to have
    /// prepared anything (a cancel or a lost reply during COMMIT; the source records the gid
    /// before it asks): a validation still running for one rolls back what it prepares, at
    /// once, instead of leaving an orphan holding its rows until cleanup (review F6).
    rolled_back: Mutex<HashSet<String>>,
}

/// Migrations whose `Apply` call is running in this process, by id.
pub type ValidatorRegistry = Arc<Mutex<HashMap<u64, Arc<Validator>>>>;

/// The gid a migration's shadows must carry: `remus:<migration_id>:<source xid>`, which the
/// coordinator's cleanup recognises (and a shadow of another migration cannot be touched).
fn check_gid(migration_id: u64, gid: &str) -> Result<(), ValidateError> {
    let bad = |reason| {
        Err(ValidateError::BadGid {
            migration_id,
            gid: gid.to_string(),
            reason,
        })
    };
    let prefix = shadow_gid_prefix(migration_id);
    if !gid.starts_with(&prefix) || gid.len() == prefix.len() {
        return bad("expected remus:<migration_id>:<source xid>");
    }
    if gid.len() > MAX_GID_BYTES {
        return bad("longer than PostgreSQL's 199 bytes");
    }
    if gid.contains('\0') {
        return bad("contains NUL");
    }
    Ok(())
}

impl Validator {
    pub fn new(migration_id: u64, conninfo: String, watcher: AppliedLsnWatcher) -> Self {
        Self {
            migration_id,
            conninfo,
            watcher,
            stream_wait: STREAM_WAIT,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(MAX_VALIDATION_SESSIONS),
            next_origin: AtomicUsize::new(0),
            accepting: AtomicBool::new(true),
            rolled_back: Mutex::new(HashSet::new()),
        }
    }

    /// Longest wait for the stream to pass a validation's `wait_lsn` (default [`STREAM_WAIT`]).
    pub fn with_stream_wait(mut self, wait: Duration) -> Self {
        self.stream_wait = wait;
        self
    }

    pub fn migration_id(&self) -> u64 {
        self.migration_id
    }

    /// A destination session whose socket cannot wait forever (review F11): keepalives and a
    /// TCP user timeout for a partition, a bounded start-up for a server that does not answer.
    async fn connect(&self) -> Result<PooledSession, ValidateError> {
        let migration_id = self.migration_id;
        let session_error = |message: String| ValidateError::Session {
            migration_id,
            message,
        };
        let mut config: tokio_postgres::Config = self
            .conninfo
            .parse()
            .map_err(|e: tokio_postgres::Error| session_error(pg_message(&e)))?;
        config
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(KEEPALIVE_INTERVAL)
            .keepalives_retries(KEEPALIVE_RETRIES)
            .tcp_user_timeout(TCP_USER_TIMEOUT);
        let (client, connection) =
            match tokio::time::timeout(SESSION_OPEN_TIMEOUT, config.connect(NoTls)).await {
                Ok(r) => r.map_err(|e| session_error(pg_message(&e)))?,
                Err(_) => {
                    return Err(session_error(format!(
                        "the destination did not accept a session within {} s",
                        SESSION_OPEN_TIMEOUT.as_secs()
                    )))
                }
            };
        let connection = tokio::spawn(
            async move {
                if let Err(e) = connection.await {
                    debug!(migration_id, error = %pg_message(&e), "validation connection ended");
                }
            }
            .in_current_span(),
        );
        Ok(PooledSession { client, connection })
    }

    /// A new session bound to an origin of its own. An origin still held by a session that is
    /// going away (a previous Apply call of the migration, a dropped broken session) is skipped
    /// for the next number rather than waited for.
    async fn open(&self) -> Result<PooledSession, ValidateError> {
        let migration_id = self.migration_id;
        let session = self.connect().await?;
        let mut last = String::new();
        for _ in 0..2 * MAX_VALIDATION_SESSIONS {
            let k = self.next_origin.fetch_add(1, Ordering::Relaxed);
            // Like the apply sessions.
            let setup = format!(
                "{}\nSET statement_timeout = '{}ms';",
                origin_session_setup(
                    &validation_origin(migration_id, k),
                    &format!("remus-validate m{migration_id} v{k}"),
                ),
                VALIDATION_STATEMENT_TIMEOUT.as_millis()
            );
            let setup_run =
                tokio::time::timeout(SESSION_OPEN_TIMEOUT, session.client.batch_execute(&setup));
            let Ok(result) = setup_run.await else {
                return Err(ValidateError::Session {
                    migration_id,
                    message: format!(
                        "the destination did not set up a session within {} s",
                        SESSION_OPEN_TIMEOUT.as_secs()
                    ),
                });
            };
            match result {
                Ok(()) => {
                    debug!(migration_id, origin = k, "validation session ready");
                    return Ok(session);
                }
                Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) => last = pg_message(&e),
                Err(e) => {
                    return Err(ValidateError::Session {
                        migration_id,
                        message: pg_message(&e),
                    })
                }
            }
        }
        Err(ValidateError::Session {
            migration_id,
            message: format!("no free validation origin: {last}"),
        })
    }

    async fn session(
        &self,
    ) -> Result<(tokio::sync::SemaphorePermit<'_>, PooledSession), ValidateError> {
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

    /// Opens up to `n` sessions into the pool, one after another, in the background of
    /// catch-up (Remus mode: dual execution follows). A session opened on demand costs the
    /// first validations of the sync barrier a connection, a replication origin and its
    /// setup on a loaded destination: tens of milliseconds that every commit of the burst
    /// waited for (the anchors' E1, 2026-12-07: validation sessions set up 40-80 ms into the
    /// barrier while eight source COMMITs waited). Each holds a permit while it opens, so
    /// [`close`](Self::close) waits for it; none is opened once validations are refused.
    /// Failures are logged: validations then open their sessions on demand, as before.
    pub async fn open_ahead(&self, n: usize) {
        let n = n.min(MAX_VALIDATION_SESSIONS);
        let mut opened = 0;
        while opened < n {
            let Ok(_permit) = self.permits.acquire().await else {
                return;
            };
            if !self.accepting.load(Ordering::Acquire) {
                return;
            }
            if self.idle.lock().unwrap_or_else(|p| p.into_inner()).len() >= n {
                return;
            }
            match self.open().await {
                Ok(session) => self.give_back(session),
                Err(e) => {
                    warn!(migration_id = self.migration_id, error = %e, "a validation session could not be opened ahead; validations open theirs on demand");
                    return;
                }
            }
            opened += 1;
        }
        debug!(
            migration_id = self.migration_id,
            opened, "validation sessions opened ahead"
        );
    }

    fn give_back(&self, session: PooledSession) {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(session);
    }

    /// Waits for the stream to pass `wait_lsn`, then runs the shadow with the conflict check
    /// and prepares it as `gid`. The write set is `first` followed by every chunk of `rest`,
    /// each run as it arrives.
    pub async fn validate(
        &self,
        gid: &str,
        wait_lsn: u64,
        first: &[RowChange],
        rest: Chunks<'_>,
        lock_timeout_ms: u32,
    ) -> Result<Verdict, ValidateError> {
        check_gid(self.migration_id, gid)?;
        let checks = first.iter().map(check_sql).collect::<Result<Vec<_>, _>>()?;
        if !self.accepting.load(Ordering::Acquire) {
            return Err(ValidateError::StreamEnded(self.migration_id));
        }
        match tokio::time::timeout(self.stream_wait, self.watcher.wait_for(wait_lsn)).await {
            Err(_) => {
                return Err(ValidateError::StreamTimeout {
                    migration_id: self.migration_id,
                    wait_lsn: crate::apply::format_lsn(wait_lsn),
                    secs: self.stream_wait.as_secs(),
                })
            }
            Ok(Err(_)) => return Err(ValidateError::StreamEnded(self.migration_id)),
            Ok(Ok(_)) => {}
        }
        let (_permit, session) = self.session().await?;
        // Checked again with the session in hand: `close` waits for the sessions, so a
        // validation that got one before `finish` completes and any later one is refused.
        if !self.accepting.load(Ordering::Acquire) {
            self.give_back(session);
            return Err(ValidateError::StreamEnded(self.migration_id));
        }
        let lock_timeout = if lock_timeout_ms == 0 {
            DEFAULT_LOCK_TIMEOUT_MS
        } else {
            lock_timeout_ms
        };
        if self.source_rolled_back(gid) {
            self.give_back(session);
            return Ok(Verdict::Conflict(SOURCE_ROLLED_BACK.into()));
        }
        let verdict = run_shadow(&session.client, gid, checks, rest, lock_timeout).await;
        match verdict {
            // Checked after the PREPARE: a rollback recorded before it is seen here, and one
            // recorded after it finds the prepared shadow itself.
            Ok(Verdict::Prepared) if self.source_rolled_back(gid) => {
                let rollback = format!("ROLLBACK PREPARED {}", quote_literal(gid));
                let done = finish_prepared(&session.client, &rollback, None).await;
                self.forget_rolled_back(gid);
                match done {
                    Ok(_) => {
                        info!(
                            migration_id = self.migration_id,
                            gid, "the source rolled back during validation; shadow rolled back"
                        );
                        self.give_back(session);
                        Ok(Verdict::Conflict(SOURCE_ROLLED_BACK.into()))
                    }
                    Err(e) => Err(ValidateError::Destination(pg_message(&e))),
                }
            }
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
    pub async fn resolve(
        &self,
        gid: &str,
        commit: bool,
        commit_lsn: u64,
        commit_time_us: i64,
    ) -> Result<bool, ValidateError> {
        check_gid(self.migration_id, gid)?;
        if !commit {
            // Before anything else, so a validation of it still running sees it (F6).
            self.rolled_back
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(gid.to_string());
        }
        let (_permit, session) = self.session().await?;
        let result = if commit {
            commit_prepared_with_origin(&session.client, gid, commit_lsn, commit_time_us).await
        } else {
            finish_prepared(
                &session.client,
                &format!("ROLLBACK PREPARED {}", quote_literal(gid)),
                None,
            )
            .await
        };
        match result {
            Ok(found) => {
                if found && !commit {
                    // Its shadow is gone; no validation of it can prepare another.
                    self.forget_rolled_back(gid);
                }
                self.give_back(session);
                Ok(found)
            }
            Err(e) => Err(ValidateError::Destination(pg_message(&e))),
        }
    }

    fn source_rolled_back(&self, gid: &str) -> bool {
        self.rolled_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(gid)
    }

    fn forget_rolled_back(&self, gid: &str) {
        self.rolled_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(gid);
    }

    /// Refuses validations from now on (the Apply call received `finish`); resolutions still
    /// run until [`close`](Self::close).
    pub fn stop_validating(&self) {
        self.accepting.store(false, Ordering::Release);
    }

    /// Ends the validation side with its Apply call: waits (bounded) for running validations
    /// and resolutions, detaches the pooled sessions from their origins and closes them. With
    /// `drop_origins` (a clean `finish`) the validation origins are dropped as well; otherwise
    /// they are left for the coordinator, which drops every `remus_m<id>_%` origin at cleanup
    /// and rollback. An attached origin cannot be dropped, hence the order.
    pub async fn close(&self, drop_origins: bool) -> Result<(), ValidateError> {
        let migration_id = self.migration_id;
        self.stop_validating();
        // The semaphore is fair: once this waits, later callers queue behind it and see it closed.
        match tokio::time::timeout(
            CLOSE_WAIT,
            self.permits.acquire_many(MAX_VALIDATION_SESSIONS as u32),
        )
        .await
        {
            Ok(Ok(all)) => all.forget(),
            Ok(Err(_)) => {}
            Err(_) => warn!(
                migration_id,
                "validations still running after {} s; closing anyway",
                CLOSE_WAIT.as_secs()
            ),
        }
        self.permits.close();
        let sessions: Vec<PooledSession> =
            std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        let mut detached = Vec::with_capacity(sessions.len());
        for s in sessions {
            match s
                .client
                .batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
                .await
            {
                Ok(()) => detached.push(s),
                Err(e) => {
                    warn!(migration_id, error = %pg_message(&e), "detaching a validation session failed")
                }
            }
        }
        let created = self.next_origin.load(Ordering::Relaxed);
        if !drop_origins || created == 0 {
            return Ok(());
        }
        let fresh;
        let client = match detached.first() {
            Some(s) => &s.client,
            None => {
                fresh = self.connect().await?;
                &fresh.client
            }
        };
        for k in 0..created {
            drop_origin(client, migration_id, &validation_origin(migration_id, k)).await?;
        }
        info!(
            migration_id,
            origins = created,
            "validation origins dropped"
        );
        Ok(())
    }
}

/// Drops an origin if it exists. A session that was closed rather than detached releases its
/// origin only when its backend exits, a moment later: "in use" is retried for a while.
async fn drop_origin(
    client: &Client,
    migration_id: u64,
    origin: &str,
) -> Result<(), ValidateError> {
    let o = quote_literal(origin);
    let sql = format!(
        "SELECT pg_catalog.pg_replication_origin_drop({o}) WHERE pg_catalog.pg_replication_origin_oid({o}) IS NOT NULL"
    );
    let mut attempts = 0;
    loop {
        match client.batch_execute(&sql).await {
            Ok(()) => return Ok(()),
            Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) && attempts < 250 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => {
                return Err(ValidateError::Session {
                    migration_id,
                    message: format!("dropping origin {origin}: {}", pg_message(&e)),
                })
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
    let kind = row_change::Kind::try_from(c.kind)
        .map_err(|_| ValidateError::Malformed(format!("unknown change kind {}", c.kind)))?;
    if kind == row_change::Kind::Truncate {
        return Err(ValidateError::Malformed(
            "TRUNCATE cannot be validated (it is refused on a migrating shard)".into(),
        ));
    }
    let cs = change_sql(0, c).map_err(malformed)?;
    let lock = if kind == row_change::Kind::Insert {
        None
    } else {
        let table = cs.info.table.clone();
        let old_vals = if c.old_values.is_empty() {
            &c.new_values
        } else {
            &c.old_values
        };
        let old = row_values(0, &table, c, old_vals, "old row").map_err(malformed)?;
        let key = key_values(0, &table, c, &old, "old").map_err(malformed)?;
        let (cond, shown) = key_condition(&key);
        // FOR UPDATE waits for writers (prepared shadows included) and follows the update
        // chain to the latest version; the origin of its xmin must be looked up *after* the
        // lock, outside the locking query: a join inside it would be rechecked against the
        // row version it first saw (EvalPlanQual keeps the other relations' rows), i.e. the
        // origin of a version a concurrent destination transaction has just replaced.
        Some((
            format!(
                "WITH l AS MATERIALIZED (SELECT t.xmin AS x FROM {table} t WHERE {cond} FOR UPDATE OF t)
                 SELECT c.roident::text, o.roname
                   FROM l
                   LEFT JOIN LATERAL pg_catalog.pg_xact_commit_timestamp_origin(l.x) c ON true
                   LEFT JOIN pg_catalog.pg_replication_origin o ON o.roident = c.roident"
            ),
            shown,
        ))
    };
    Ok(Check {
        lock,
        op: cs.info.op,
        table: cs.info.table.clone(),
        key: cs.info.key.clone(),
        apply: cs.sql,
    })
}

/// Errors that mean "the shadow cannot be applied as the source saw it": a write-write conflict.
fn conflict_reason(e: &tokio_postgres::Error) -> Option<&'static str> {
    let code = e.code()?;
    if *code == SqlState::LOCK_NOT_AVAILABLE {
        Some("row lock not granted within the lock timeout")
    } else if *code == SqlState::T_R_DEADLOCK_DETECTED {
        Some("deadlock on the destination")
    } else if *code == SqlState::UNIQUE_VIOLATION {
        Some("key already exists on the destination")
    } else if *code == SqlState::DIVISION_BY_ZERO {
        // The exactly-one-row guard of an UPDATE/DELETE: the locked row changed key under us.
        Some("the statement did not change exactly one row")
    } else {
        None
    }
}

async fn run_shadow(
    client: &Client,
    gid: &str,
    first: Vec<Check>,
    mut rest: Chunks<'_>,
    lock_timeout_ms: u32,
) -> Result<Verdict, ValidateError> {
    let dest = |e: tokio_postgres::Error| ValidateError::Destination(pg_message(&e));
    // The BEGIN goes in the first chunk's flight: under load each round trip to the
    // destination costs a wake-up of its backend, and a source commit waits for all of them.
    let begin = format!("BEGIN; SET LOCAL lock_timeout = '{lock_timeout_ms}ms'");
    let mut prefix = Some(begin.as_str());
    let mut checks = first;
    loop {
        if let Some(refused) = run_chunk(client, prefix.take(), &checks).await? {
            return conflict(client, refused).await;
        }
        // The next chunk, if any (a broken request stream ends the validation: the caller
        // rolls the shadow back).
        match rest.next().await {
            None => break,
            Some(chunk) => {
                checks = chunk?
                    .iter()
                    .map(check_sql)
                    .collect::<Result<Vec<_>, _>>()?;
            }
        }
    }
    client
        .batch_execute(&format!("PREPARE TRANSACTION {}", quote_literal(gid)))
        .await
        .map_err(dest)?;
    Ok(Verdict::Prepared)
}

type QueryResult = Result<Vec<SimpleQueryMessage>, tokio_postgres::Error>;

/// Runs `queries` on `client` pipelined and gives their results in order. tokio-postgres sends a
/// query when its future is first polled: every future is polled once, in order, so all are sent
/// before the first answer is awaited; the server runs them in that order. After a failed one
/// the transaction is aborted and the later ones fail too, so callers read up to the first
/// failure. The answers are awaited in order, which never stalls the connection: the server
/// answers in that order too.
async fn pipelined(client: &Client, queries: &[&str]) -> Vec<QueryResult> {
    let mut pending: Vec<Pin<Box<dyn Future<Output = QueryResult> + Send + '_>>> = queries
        .iter()
        .map(|q| {
            Box::pin(client.simple_query(q))
                as Pin<Box<dyn Future<Output = QueryResult> + Send + '_>>
        })
        .collect();
    let mut early: Vec<Option<QueryResult>> = Vec::with_capacity(pending.len());
    std::future::poll_fn(|cx| {
        for f in pending.iter_mut() {
            early.push(match f.as_mut().poll(cx) {
                std::task::Poll::Ready(r) => Some(r),
                std::task::Poll::Pending => None,
            });
        }
        std::task::Poll::Ready(())
    })
    .await;
    let mut results = Vec::with_capacity(pending.len());
    for (f, done) in pending.iter_mut().zip(early) {
        results.push(match done {
            Some(r) => r,
            None => f.as_mut().await,
        });
    }
    results
}

/// Runs one chunk of the shadow (per change: its lock-and-check query, then the change) and
/// returns the write-write conflict it found, if any. Pipelined (see [`pipelined`]): a change
/// may run after an earlier check found a conflict; the whole shadow is rolled back then
/// anyway, and the statements still run in the write set's order, so every check sees exactly
/// the earlier changes, as one statement after another would. `prefix` (the shadow's BEGIN)
/// is sent first in the same flight; its failure fails the chunk.
async fn run_chunk(
    client: &Client,
    prefix: Option<&str>,
    checks: &[Check],
) -> Result<Option<String>, ValidateError> {
    let dest = |e: tokio_postgres::Error| ValidateError::Destination(pg_message(&e));
    let mut queries: Vec<&str> = Vec::with_capacity(2 * checks.len() + 1);
    queries.extend(prefix);
    for check in checks {
        if let Some((lock, _)) = &check.lock {
            queries.push(lock);
        }
        queries.push(&check.apply);
    }
    let mut results = pipelined(client, &queries).await.into_iter();
    if prefix.is_some() {
        results
            .next()
            .expect("one result per query")
            .map_err(dest)?;
    }
    for check in checks {
        if let Some((_, shown)) = &check.lock {
            let rows = match results.next().expect("one result per query") {
                Ok(r) => r,
                Err(e) => match conflict_reason(&e) {
                    Some(why) => {
                        return Ok(Some(format!(
                            "{} on {} ({shown}): {why}: {}",
                            check.op,
                            check.table,
                            pg_message(&e)
                        )))
                    }
                    None => return Err(dest(e)),
                },
            };
            let row = rows.iter().find_map(|m| match m {
                SimpleQueryMessage::Row(r) => {
                    Some((r.get(0).map(str::to_string), r.get(1).map(str::to_string)))
                }
                _ => None,
            });
            match row {
                None => {
                    return Ok(Some(format!(
                        "{} on {}: row ({shown}) missing on the destination",
                        check.op, check.table
                    )))
                }
                // No commit timestamp data: a frozen or pre-`track_commit_timestamp` version
                // (older than the migration), or this shadow's own earlier change.
                Some((None, _)) => {}
                Some((Some(roident), name)) => {
                    let remus = roident != "0" && name.as_deref().is_some_and(is_migration_object);
                    if !remus {
                        return Ok(Some(format!(
                            "{} on {}: row ({shown}) was changed by a transaction on the destination (origin {})",
                            check.op,
                            check.table,
                            name.as_deref().unwrap_or(&roident)
                        )));
                    }
                }
            }
        }
        if let Err(e) = results.next().expect("one result per query") {
            return match conflict_reason(&e) {
                Some(why) => Ok(Some(format!(
                    "{} on {} ({}): {why}: {}",
                    check.op,
                    check.table,
                    check.key,
                    pg_message(&e)
                ))),
                None => Err(dest(e)),
            };
        }
    }
    Ok(None)
}

async fn conflict(client: &Client, why: String) -> Result<Verdict, ValidateError> {
    client
        .batch_execute("ROLLBACK")
        .await
        .map_err(|e| ValidateError::Destination(pg_message(&e)))?;
    Ok(Verdict::Conflict(why))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_must_name_the_migration() {
        assert!(check_gid(7, "remus:7:123").is_ok());
        assert!(check_gid(7, "remus:8:123").is_err());
        assert!(check_gid(7, "remus:7:").is_err());
        assert!(check_gid(7, "remus:77:1").is_err());
        assert!(check_gid(7, "x").is_err());
        assert!(check_gid(7, &format!("remus:7:{}", "9".repeat(200))).is_err());
    }

    #[test]
    fn truncate_is_refused_before_anything_runs() {
        let c = RowChange {
            kind: row_change::Kind::Truncate as i32,
            truncate_tables: vec!["\"public\".\"a\"".into()],
            ..Default::default()
        };
        assert!(matches!(check_sql(&c), Err(ValidateError::Malformed(_))));
    }
}
