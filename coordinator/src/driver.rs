//! Drives one migration through its phases: copy, catch-up, handover (by mode), Tm, cleanup —
//! and rolls it back completely when it fails before Tm.
//!
//! The record in etcd is the truth about where a migration is; every phase change goes through
//! [`MigrationStore::advance`] and is published to the callers waiting on the migration (the
//! `MigrateShards` stream). Advancing to `cleanup` is written only after Tm is prepared on every
//! node: it is the commit decision of Tm (../shared/DESIGN.md section 4). Before it, a failure
//! rolls everything back; after it, Tm is committed everywhere and the migration can only go
//! forward.

use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::watch;
use tracing::{debug, info, info_span, warn, Instrument};
use wal_propagator::{CopyOptions, Lsn, ReplicationConnection, ReplicationOptions};

use remus_proto::names;

use crate::failpoint::{self, Failpoints};
use crate::migration::{MigrationError, MigrationRecord, MigrationStore, Mode, Phase, Status};
use crate::node_conn::{NodeConnError, NodeConnector};
use crate::node_registry::NodeRecord;
use crate::plan::MigrationPlan;
use crate::propagator::{Propagator, PropagatorError};

/// After the Tm decision, how long the driver keeps retrying a node that does not answer (a
/// crashed target restarting) before the migration ends `failed`.
const NODE_WAIT: Duration = Duration::from_secs(300);
/// A catch-up round this short means the target is close behind the source.
const CATCHUP_CLOSE_ENOUGH: Duration = Duration::from_millis(500);
/// A source that writes faster than the target applies never gets close; hand over anyway.
const CATCHUP_MAX_ROUNDS: u32 = 20;

/// Static configuration of the migration machinery.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    pub connector: NodeConnector,
    /// gRPC endpoint of the replay worker, e.g. `http://127.0.0.1:6103`.
    pub replay_endpoint: String,
    /// Concurrent apply sessions on the target.
    pub apply_parallelism: u32,
    /// lock_abort: how long an idle writer holding the shard may keep the handover waiting
    /// before it is terminated.
    pub lock_grace: Duration,
    /// wait_remaster: the longest the admission gate stays closed.
    pub gate_timeout: Duration,
    /// Before Tm, while the source is quiet, compare every shard table on source and target
    /// (row count and a digest over all columns) and fail the migration on any difference.
    /// Costs a full read of both copies inside the handover window, so it is off by default.
    pub verify_handover: bool,
    /// Named places where a test can stop a migration (`failpoint`).
    pub failpoints: Failpoints,
}

#[derive(Debug, Error)]
pub enum DriverError {
    #[error(transparent)]
    Store(#[from] MigrationError),
    #[error(transparent)]
    Connect(#[from] NodeConnError),
    #[error("on node {node}: {source}")]
    Sql {
        node: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error(transparent)]
    Replication(#[from] wal_propagator::ReplicationError),
    #[error(transparent)]
    Copy(#[from] wal_propagator::CopyError),
    #[error(transparent)]
    Propagator(#[from] PropagatorError),
    #[error("{0}")]
    Other(String),
}

fn sql(node: &NodeRecord) -> impl Fn(tokio_postgres::Error) -> DriverError + '_ {
    move |source| DriverError::Sql { node: node.name.clone(), source: flatten_db_error(source) }
}

/// tokio-postgres prints only "db error"; keep the server's message in the chain.
fn flatten_db_error(e: tokio_postgres::Error) -> tokio_postgres::Error {
    e
}

fn describe(e: &DriverError) -> String {
    match e {
        DriverError::Sql { node, source } => match source.as_db_error() {
            Some(db) => format!("on node {node}: {} (SQLSTATE {})", db.message(), db.code().code()),
            None => format!("on node {node}: {source}"),
        },
        other => other.to_string(),
    }
}

/// Publishes record changes to whoever waits on the migration.
struct Reporter {
    store: MigrationStore,
    tx: watch::Sender<MigrationRecord>,
}

impl Reporter {
    fn id(&self) -> crate::migration::MigrationId {
        self.tx.borrow().id
    }

    async fn advance(&self, next: Phase) -> Result<(), DriverError> {
        let r = self.store.advance(self.id(), next, |_| {}).await?;
        info!(migration_id = r.id.0, phase = %next, "phase started");
        self.tx.send_replace(r);
        Ok(())
    }

    async fn update(&self, f: impl FnMut(&mut MigrationRecord)) -> Result<(), DriverError> {
        let r = self.store.update(self.id(), f).await?;
        self.tx.send_replace(r);
        Ok(())
    }

    async fn waiting_on(&self, what: Option<String>) {
        let w = what.clone();
        if let Err(e) = self.update(move |r| r.waiting_on = w.clone()).await {
            warn!(migration_id = self.id().0, error = %e, "could not record waiting_on");
        }
    }

    async fn finish(&self, status: Status, error: Option<String>) {
        match self.store.finish(self.id(), status, error).await {
            Ok(r) => {
                self.tx.send_replace(r);
            }
            Err(e) => warn!(migration_id = self.id().0, error = %e, "could not record the end"),
        }
    }
}

/// Starts driving `record` (just created, phase pending) on the current runtime; the receiver
/// sees every change of the record until it is terminal.
pub fn spawn(
    config: Arc<DriverConfig>,
    store: MigrationStore,
    plan: MigrationPlan,
    record: MigrationRecord,
) -> watch::Receiver<MigrationRecord> {
    let (tx, rx) = watch::channel(record.clone());
    let id = record.id.0;
    let span = info_span!("migration", migration_id = id, mode = %plan.mode);
    tokio::spawn(
        async move {
            let reporter = Reporter { store, tx };
            let mut run = Run { config, plan, reporter, state: State::default() };
            run.drive().await;
        }
        .instrument(span),
    );
    rx
}

/// Resumes `record`, a migration that a coordinator was running when it stopped, and returns
/// once it has ended: past the Tm decision (phase `cleanup`) it completes, before it rolls
/// back. See [`crate::recovery`].
pub async fn resume(config: Arc<DriverConfig>, store: MigrationStore, plan: MigrationPlan, record: MigrationRecord) {
    let span = info_span!("migration", migration_id = record.id.0, mode = %plan.mode);
    let phase = record.phase;
    let (tx, _rx) = watch::channel(record);
    async move {
        let reporter = Reporter { store, tx };
        let mut run = Run { config, plan, reporter, state: State::default() };
        run.resume(phase).await;
    }
    .instrument(span)
    .await
}

/// What exists on the nodes, so that a rollback removes exactly that.
#[derive(Default)]
struct State {
    registered: bool,
    publication: bool,
    slot: Option<String>,
    /// The replication connection while it is not streaming (to drop the slot). In a mutex
    /// only because libpq connections are not `Sync` and the driver's future must be `Send`.
    repl: std::sync::Mutex<Option<ReplicationConnection>>,
    target_tables: bool,
    propagator: Option<Propagator>,
    gate_closed: bool,
    tm_prepared: bool,
    tm_decided: bool,
    /// Set when the rollback starts: its steps on the target wait for it ([`Run::connect_when_up`]).
    rolling_back: bool,
    read_through: bool,
    start_lsn: Lsn,
    sync_points: u64,
    final_txns_applied: u64,
    /// Idle writers terminated by lock_abort after the grace period.
    terminated: u64,
    /// Per node, when Tm committed there (text timestamptz): cleanup waits for older ones.
    tm_committed_at: Vec<(NodeRecord, String)>,
    /// Remus: the source captures write sets (`remus.migration_capture`).
    capturing: bool,
    /// Remus: transactions (virtual xids) that held a write lock on the shards when capture
    /// started; their write sets are incomplete, so the sync barrier waits for them.
    pre_capture_writers: Vec<String>,
}

struct Run {
    config: Arc<DriverConfig>,
    plan: MigrationPlan,
    reporter: Reporter,
    state: State,
}

impl Run {
    fn id(&self) -> u64 {
        self.reporter.id().0
    }

    fn take_repl(&mut self) -> Option<ReplicationConnection> {
        self.state.repl.get_mut().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn publication(&self) -> String {
        names::publication_name(self.id())
    }

    fn slot(&self) -> String {
        names::slot_name(self.id())
    }

    async fn drive(&mut self) {
        let started = Instant::now();
        match self.phases().await {
            Ok(()) => {
                self.reporter.finish(Status::Succeeded, None).await;
                info!(migration_id = self.id(), ms = started.elapsed().as_millis() as u64, "migration done");
            }
            Err(e) => {
                let msg = describe(&e);
                warn!(migration_id = self.id(), error = %msg, "migration failed");
                if self.state.tm_decided {
                    // Ownership already moved; only cleanup failed. Leave the rest for an
                    // operator and say so.
                    self.reporter
                        .finish(Status::Failed, Some(format!("cleanup after the handover failed: {msg}")))
                        .await;
                } else {
                    match self.rollback().await {
                        Ok(()) => self.reporter.finish(Status::RolledBack, Some(msg)).await,
                        Err(re) => {
                            self.reporter
                                .finish(
                                    Status::Failed,
                                    Some(format!("{msg}; rollback failed too: {}", describe(&re))),
                                )
                                .await
                        }
                    }
                }
            }
        }
    }

    async fn phases(&mut self) -> Result<(), DriverError> {
        self.reporter.advance(Phase::Copy).await?;
        self.copy().await?;
        self.reporter.advance(Phase::Catchup).await?;
        self.catch_up().await?;
        match self.plan.mode {
            Mode::LockAbort => {
                self.reporter.advance(Phase::Handover).await?;
                self.handover_lock_abort().await?
            }
            Mode::WaitRemaster => {
                self.reporter.advance(Phase::Handover).await?;
                self.handover_wait_remaster().await?
            }
            Mode::Remus => {
                self.reporter.advance(Phase::Barrier).await?;
                self.sync_barrier().await?;
                // Dual execution is on: source commits of the shards validate on the target.
                self.reporter.advance(Phase::Dual).await?;
                self.config.failpoints.pause(failpoint::DUAL_STARTED, self.id()).await;
                self.reporter.advance(Phase::Handover).await?;
                self.tm().await?;
            }
        }
        self.cleanup().await
    }

    async fn on_every_node(&self, sql_text: &str) -> Result<Vec<tokio_postgres::Row>, DriverError> {
        let mut rows = Vec::new();
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            rows.extend(c.query(sql_text, &[]).await.map_err(sql(node))?);
        }
        Ok(rows)
    }

    // ---- copy ---------------------------------------------------------------------------

    async fn copy(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let ids = format!("ARRAY[{}]::bigint[]", join(&self.plan.shard_ids));
        self.state.registered = true;
        self.on_every_node(&format!("SELECT remus.migration_begin({id}, {ids})")).await?;
        if self.plan.mode == Mode::Remus {
            self.start_capture().await?;
        }

        let tables: Vec<String> = self.plan.tables.iter().map(|t| t.qualified()).collect();
        let source = self.config.connector.connect(&self.plan.source).await?;
        source
            .batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLE {}",
                self.publication(),
                tables.join(", ")
            ))
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.publication = true;

        // The target's tables, with every index and constraint, before any row arrives: the
        // replay applies by primary key and the shard may serve right after the handover.
        let target = self.config.connector.connect(&self.plan.target).await?;
        let ddl: String = self
            .plan
            .tables
            .iter()
            .map(|t| {
                // The write-set capture trigger comes with the table, as on the source: a later
                // migration of this shard must not need DDL on a hot table.
                format!(
                    "CREATE TABLE {q} (LIKE {} INCLUDING ALL);\n\
                     CREATE TRIGGER {} AFTER INSERT OR UPDATE OR DELETE ON {q} \
                     FOR EACH ROW EXECUTE FUNCTION remus.capture_write('{}');\n",
                    t.shell,
                    names::CAPTURE_TRIGGER,
                    t.shard_id,
                    q = t.qualified()
                )
            })
            .collect();
        // One transaction: either every table exists afterwards (and is ours to drop on
        // rollback) or none was created (and a table that was already there is left alone).
        target
            .batch_execute(&format!("BEGIN;\n{ddl}COMMIT;"))
            .await
            .map_err(sql(&self.plan.target))?;
        self.state.target_tables = true;

        // Slot first (it waits for the source's running transactions), then the copy sessions
        // import its snapshot. Both block: run them on a blocking thread.
        self.reporter
            .waiting_on(Some(format!(
                "creating slot {}: waits for transactions holding an xid on {}",
                self.slot(),
                self.plan.source.name
            )))
            .await;
        let repl_conninfo = self.config.connector.conninfo(&self.plan.source, true);
        let source_conninfo = self.config.connector.conninfo(&self.plan.source, false);
        let target_conninfo = self.config.connector.conninfo(&self.plan.target, false);
        let slot = self.slot();
        let pairs: Vec<(String, String)> = tables.iter().map(|t| (t.clone(), t.clone())).collect();
        let parallelism = pairs.len();
        // Copied rows are committed under a Remus replication origin (one per copy session),
        // so MOCC on the target tells them from rows a target transaction wrote.
        let origin = format!("{} || pg_catalog.pg_backend_pid()", quote_literal(&names::copy_origin_prefix(id)));
        let copy_options = CopyOptions {
            dest_setup_sql: Some(format!(
                "SELECT pg_catalog.pg_replication_origin_create({origin}) \
                  WHERE pg_catalog.pg_replication_origin_oid({origin}) IS NULL; \
                 SELECT pg_catalog.pg_replication_origin_session_setup({origin}) \
                  WHERE NOT pg_catalog.pg_replication_origin_session_is_setup();"
            )),
            ..CopyOptions::default()
        };
        self.state.slot = Some(slot.clone());
        let failpoints = self.config.failpoints.clone();
        let (conn, created, stats) = tokio::task::spawn_blocking(move || {
            let mut conn = ReplicationConnection::connect_with(&repl_conninfo, ReplicationOptions::default())?;
            let exported = conn.create_slot_exporting_snapshot(&slot)?;
            failpoints.pause_blocking(failpoint::COPY_SNAPSHOT_EXPORTED, id);
            let stats = wal_propagator::copy_tables_with(
                &source_conninfo,
                exported.snapshot_name(),
                &target_conninfo,
                &pairs,
                parallelism,
                &copy_options,
            );
            let created = exported.release();
            Ok::<_, DriverError>((conn, created, stats?))
        })
        .await
        .map_err(|e| DriverError::Other(format!("copy thread: {e}")))??;
        let rows: u64 = stats.iter().map(|s| s.rows).sum();
        let bytes: u64 = stats.iter().map(|s| s.bytes).sum();
        info!(
            migration_id = id, phase = "copy", rows, bytes,
            slot_wait_ms = created.creation_time.as_millis() as u64,
            consistent_point = %created.consistent_point, "snapshot copied"
        );
        self.reporter
            .update(|r| {
                r.rows_copied = rows;
                r.bytes_copied = bytes;
                r.waiting_on = None;
            })
            .await?;
        *self.state.repl.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(conn);
        self.state.start_lsn = created.consistent_point;
        Ok(())
    }

    // ---- catch-up -----------------------------------------------------------------------

    async fn catch_up(&mut self) -> Result<(), DriverError> {
        let conn = self.take_repl().expect("copy leaves the replication connection");
        let propagator = Propagator::start(
            self.id(),
            &self.config.replay_endpoint,
            self.config.connector.conninfo(&self.plan.target, false),
            conn,
            self.slot(),
            self.publication(),
            self.state.start_lsn,
            self.config.apply_parallelism,
        )
        .await?;
        self.state.propagator = Some(propagator);
        // Catch up in rounds until one round is short: the handover's final catch-up then has
        // only about one round's worth of backlog to apply while writes are held.
        let mut previous = Duration::MAX;
        for round in 1..=CATCHUP_MAX_ROUNDS {
            let started = Instant::now();
            let lsn = self.sync_point().await?;
            self.wait_applied(lsn).await?;
            let took = started.elapsed();
            info!(migration_id = self.id(), phase = "catchup", round, ms = took.as_millis() as u64, "catch-up round");
            if took <= CATCHUP_CLOSE_ENOUGH {
                break;
            }
            if took >= previous {
                // The source writes the shards faster than the target applies: more rounds
                // would only grow the backlog. The handover applies what is left.
                warn!(migration_id = self.id(), phase = "catchup", round, "catch-up is not converging; handing over with the backlog");
                break;
            }
            previous = took;
        }
        Ok(())
    }

    /// A position in the source's stream that everything committed before this call precedes:
    /// a transactional logical message, so the stream reaches it even when the migrating shards
    /// see no writes.
    async fn sync_point(&mut self) -> Result<Lsn, DriverError> {
        let source = self.config.connector.connect(&self.plan.source).await?;
        let lsn: String = source
            .query_one(
                &format!(
                    "SELECT pg_logical_emit_message(true, {}, $1)::text",
                    quote_literal(names::SYNC_POINT_MESSAGE_PREFIX)
                ),
                &[&self.id().to_string()],
            )
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        self.state.sync_points += 1;
        lsn.parse::<Lsn>().map_err(|e| DriverError::Other(e.to_string()))
    }

    async fn wait_applied(&self, lsn: Lsn) -> Result<(), DriverError> {
        let propagator = self.state.propagator.as_ref().expect("propagator running");
        let mut last_report = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_secs(1), propagator.wait_applied(lsn)).await {
                Ok(r) => {
                    r?;
                    break;
                }
                Err(_) => {
                    if last_report.elapsed() >= Duration::from_secs(1) {
                        let applied = propagator.progress.applied();
                        let replayed = self.txns_replayed();
                        let w = format!("target has applied up to {applied}, waiting for {lsn}");
                        self.reporter
                            .update(move |r| {
                                r.txns_replayed = replayed;
                                r.waiting_on = Some(w.clone());
                            })
                            .await?;
                        last_report = Instant::now();
                    }
                }
            }
        }
        let replayed = self.txns_replayed();
        self.reporter
            .update(move |r| {
                r.txns_replayed = replayed;
                r.waiting_on = None;
            })
            .await
    }

    fn txns_replayed(&self) -> u64 {
        let applied = self
            .state
            .propagator
            .as_ref()
            .map(|p| p.progress.txns_applied.load(std::sync::atomic::Ordering::Acquire))
            .unwrap_or(self.state.final_txns_applied);
        // The sync points are the migration's own transactions, not the workload's.
        applied.saturating_sub(self.state.sync_points)
    }

    // ---- handover -----------------------------------------------------------------------

    fn table_list(&self) -> String {
        self.plan.tables.iter().map(|t| t.qualified()).collect::<Vec<_>>().join(", ")
    }

    fn regclass_array(&self) -> String {
        let items: Vec<String> =
            self.plan.tables.iter().map(|t| quote_literal(&t.qualified())).collect();
        format!("ARRAY[{}]::regclass[]::oid[]", items.join(", "))
    }

    /// Citus-style: block writes with an EXCLUSIVE lock on the shard tables, aborting (40001)
    /// the transactions that hold them, final catch-up, Tm, then let the queued writers through
    /// into the fence, which fails them so they retry on the new owner.
    async fn handover_lock_abort(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let source = &self.plan.source;
        let lock = self.config.connector.connect(source).await?;
        lock.batch_execute("BEGIN; SET LOCAL lock_timeout = '200ms'").await.map_err(sql(source))?;
        let started = Instant::now();
        let mut signalled = 0i64;
        loop {
            lock.batch_execute("SAVEPOINT remus_lock").await.map_err(sql(source))?;
            let n: i32 = lock
                .query_one(
                    &format!("SELECT remus.abort_shard_writers({id}, {})", self.regclass_array()),
                    &[],
                )
                .await
                .map_err(sql(source))?
                .get(0);
            signalled += i64::from(n);
            match lock
                .batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", self.table_list()))
                .await
            {
                Ok(()) => break,
                Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                    lock.batch_execute("ROLLBACK TO SAVEPOINT remus_lock").await.map_err(sql(source))?;
                    if started.elapsed() > self.config.lock_grace {
                        let killed = self.terminate_shard_writers(&lock).await?;
                        self.state.terminated += killed;
                    }
                    self.reporter
                        .waiting_on(Some(format!(
                            "locking the shard tables on {}: {signalled} writers aborted so far",
                            source.name
                        )))
                        .await;
                }
                Err(e) => return Err(sql(source)(e)),
            }
        }
        info!(migration_id = id, phase = "handover", signalled, lock_ms = started.elapsed().as_millis() as u64, "writes blocked");
        let fence = self.config.connector.connect(source).await?;
        fence
            .batch_execute(&format!("SELECT remus.migration_fence({id})"))
            .await
            .map_err(sql(source))?;
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        self.verify().await?;
        self.tm().await?;
        // Queued writers now run into the fence (40001) and retry on the new owner.
        lock.batch_execute("COMMIT").await.map_err(sql(&self.plan.source))?;
        Ok(())
    }

    async fn terminate_shard_writers(&self, lock: &tokio_postgres::Client) -> Result<u64, DriverError> {
        let rows = lock
            .query(
                &format!(
                    "SELECT pg_terminate_backend(pid) FROM (
                       SELECT DISTINCT l.pid FROM pg_locks l
                        WHERE l.relation = ANY({}) AND l.granted AND l.pid IS NOT NULL
                          AND l.pid <> pg_backend_pid()
                          AND l.mode NOT IN ('AccessShareLock', 'RowShareLock')) w",
                    self.regclass_array()
                ),
                &[],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        let n = rows.iter().filter(|r| r.get::<_, bool>(0)).count() as u64;
        if n > 0 {
            warn!(migration_id = self.id(), phase = "handover", terminated = n, "idle writers terminated after the grace period");
        }
        Ok(n)
    }

    /// DynaMast-style: stop admitting new transactions on every node, wait for the ones in
    /// flight, final catch-up, Tm, reopen.
    async fn handover_wait_remaster(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let timeout_ms = self.config.gate_timeout.as_millis() as i64;
        let mut closed_at = Vec::new();
        self.state.gate_closed = true;
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            let at: String = c
                .query_one(&format!("SELECT remus.close_gate({id}, {timeout_ms})::text"), &[])
                .await
                .map_err(sql(node))?
                .get(0);
            closed_at.push((node.clone(), at));
        }
        let started = Instant::now();
        for (node, at) in &closed_at {
            self.wait_for_older_transactions(node, at, "transactions in flight when the gate closed").await?;
        }
        info!(migration_id = id, phase = "handover", drain_ms = started.elapsed().as_millis() as u64, "in-flight transactions finished");
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        let tm = match self.verify().await {
            Ok(()) => self.tm().await,
            Err(e) => Err(e),
        };
        self.open_gates().await?;
        tm
    }

    async fn open_gates(&mut self) -> Result<(), DriverError> {
        if !self.state.gate_closed {
            return Ok(());
        }
        let id = self.id();
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            c.batch_execute(&format!("SELECT remus.open_gate({id})")).await.map_err(sql(node))?;
        }
        self.state.gate_closed = false;
        Ok(())
    }

    /// A session on `node`, retried while the node does not answer, for at most [`NODE_WAIT`]:
    /// after the Tm decision the migration can only go forward, so a target that crashed is
    /// waited for (its prepared shadows survive the restart); a rollback waits for it to remove
    /// its copy. A stream failure meanwhile is reported at once (the caller then completes
    /// without the stream).
    async fn connect_when_up(&self, node: &NodeRecord) -> Result<tokio_postgres::Client, DriverError> {
        self.connect_patiently(node, true).await
    }

    /// [`Self::connect_when_up`]; with `watch_stream` false a failed stream does not end the
    /// wait (Tm's own steps: cleanup deals with the stream).
    async fn connect_patiently(&self, node: &NodeRecord, watch_stream: bool) -> Result<tokio_postgres::Client, DriverError> {
        if !(self.state.tm_decided || self.state.rolling_back) {
            // Before the decision a node that does not answer fails the migration at once
            // (the rollback then waits for it): holding a handover for it would stall writers.
            return Ok(self.config.connector.connect(node).await?);
        }
        let started = Instant::now();
        let mut reported = false;
        loop {
            match self.config.connector.connect(node).await {
                Ok(c) => {
                    if reported {
                        self.reporter.waiting_on(None).await;
                    }
                    return Ok(c);
                }
                Err(e) if started.elapsed() < NODE_WAIT => {
                    if !reported {
                        warn!(migration_id = self.id(), node = %node.name, error = %e, "node unreachable; retrying");
                        self.reporter
                            .waiting_on(Some(format!("node {} is unreachable ({e}); retrying", node.name)))
                            .await;
                        reported = true;
                    }
                    if let Some(p) = self.state.propagator.as_ref().filter(|_| watch_stream) {
                        p.check()?;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Runs `query` (two text columns; the second is returned) on `node` after the Tm decision:
    /// on the Tm session, else, if that session or the node went away (a restart also clears
    /// the node's read-through and map cache state, so running it again is harmless), on a new
    /// one once the node answers.
    async fn after_decision(
        &self,
        node: &NodeRecord,
        session: &tokio_postgres::Client,
        query: &str,
    ) -> Result<Option<String>, DriverError> {
        let mut result = session.query_one(query, &[]).await;
        let started = Instant::now();
        loop {
            match result {
                Ok(row) => return Ok(row.get(1)),
                Err(e) if started.elapsed() >= NODE_WAIT => return Err(sql(node)(e)),
                Err(e) => {
                    warn!(migration_id = self.id(), phase = "handover", node = %node.name, error = %e, "step after the Tm decision failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let c = self.connect_patiently(node, false).await?;
                    result = c.query_one(query, &[]).await;
                }
            }
        }
    }

    /// Waits until no client transaction that started before `before` (a timestamptz in text)
    /// is running on `node`, reporting what it waits for.
    async fn wait_for_older_transactions(
        &self,
        node: &NodeRecord,
        before: &str,
        what: &str,
    ) -> Result<(), DriverError> {
        let mut c = self.connect_when_up(node).await?;
        let requester = match &self.plan.requested_by {
            Some((n, pid)) if *n == node.name => *pid,
            _ => 0,
        };
        let query = format!(
            "SELECT count(*), min(pid), min(xact_start)::text FROM pg_stat_activity
              WHERE backend_type = 'client backend' AND xact_start < {}::timestamptz
                AND pid <> pg_backend_pid() AND pid <> {requester}
                AND application_name <> {}",
            quote_literal(before),
            quote_literal(names::MIGRATION_APPLICATION_NAME)
        );
        let mut reported = false;
        loop {
            let row = match c.query_one(&query, &[]).await {
                Ok(row) => row,
                // The node went away (a crash ends its transactions too): ask again once it is
                // back.
                Err(e) if c.is_closed() || self.state.tm_decided => {
                    warn!(migration_id = self.id(), node = %node.name, error = %e, "polling for older transactions failed; reconnecting");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    c = self.connect_when_up(node).await?;
                    continue;
                }
                Err(e) => return Err(sql(node)(e)),
            };
            let n: i64 = row.get(0);
            if n == 0 {
                break;
            }
            if !reported {
                let pid: Option<i32> = row.get(1);
                let since: Option<String> = row.get(2);
                self.reporter
                    .waiting_on(Some(format!(
                        "{n} {what} on {} (e.g. pid {}, open since {})",
                        node.name,
                        pid.unwrap_or_default(),
                        since.unwrap_or_default()
                    )))
                    .await;
                reported = true;
            }
            if let Some(p) = &self.state.propagator {
                p.check()?;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if reported {
            self.reporter.waiting_on(None).await;
        }
        Ok(())
    }

    /// See [`DriverConfig::verify_handover`].
    async fn verify(&self) -> Result<(), DriverError> {
        if !self.config.verify_handover {
            return Ok(());
        }
        let source = self.config.connector.connect(&self.plan.source).await?;
        let target = self.config.connector.connect(&self.plan.target).await?;
        for t in &self.plan.tables {
            let q = format!(
                "SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h)), '')
                   FROM (SELECT md5(x::text) AS h FROM {} x) d",
                t.qualified()
            );
            let (s, d) = tokio::try_join!(source.query_one(&q, &[]), target.query_one(&q, &[]))
                .map_err(sql(&self.plan.source))?;
            let s: (i64, String) = (s.get(0), s.get(1));
            let d: (i64, String) = (d.get(0), d.get(1));
            if s != d {
                return Err(DriverError::Other(format!(
                    "verification failed: {} holds {} rows (digest {}) on {} but {} rows (digest {}) on {}",
                    t.qualified(), s.0, s.1, self.plan.source.name, d.0, d.1, self.plan.target.name
                )));
            }
            info!(migration_id = self.id(), phase = "handover", table = %t.qualified(), rows = s.0, digest = %s.1, "handover verified");
        }
        Ok(())
    }

    /// Tm: one transaction per node moves the shards in the map, prepared everywhere; the
    /// decision is the record's move to `cleanup` in etcd; then committed on the target first
    /// (so any node that sees the new owner finds it already committed there), the other nodes,
    /// the source last. Read-through covers every node while the map is in flux.
    async fn tm(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let order = self.tm_order();
        let ids = join(&self.plan.shard_ids);
        let target = quote_literal(&self.plan.target.name);
        // Remus: from here a write routed to the shards on the target first waits on the
        // source for the row's older writers (shared memory, so it holds whatever Tm's fate;
        // `migration_end` clears it).
        let drain = if self.plan.mode == Mode::Remus {
            format!("SELECT remus.migration_drain_source({id}, {});", quote_literal(&self.plan.source.name))
        } else {
            String::new()
        };
        let mut sessions = Vec::new();
        for node in &order {
            let c = self.config.connector.connect(node).await?;
            self.state.read_through = true;
            self.state.tm_prepared = true;
            c.batch_execute(&format!(
                "{drain}
                 BEGIN;
                 SELECT remus.begin_read_through();
                 UPDATE remus.shard_map SET node_name = {target} WHERE shard_id IN ({ids});
                 PREPARE TRANSACTION {};",
                quote_literal(&names::tm_gid(id, &node.name))
            ))
            .await
            .map_err(sql(node))?;
            sessions.push((node.clone(), c));
        }
        // A stream that has already failed is known before the decision: roll back rather
        // than hand over to a target that stopped receiving the source's commits. (One that
        // fails after it is recovered in `cleanup`.)
        if let Some(p) = &self.state.propagator {
            p.check()?;
        }
        // The decision.
        self.reporter.advance(Phase::Cleanup).await?;
        self.state.tm_decided = true;
        self.config.failpoints.pause(failpoint::HANDOVER_DECIDED, id).await;
        let started = Instant::now();
        for (node, c) in &sessions {
            // Decided: a node that does not answer is retried (a fresh session each time)
            // until it commits; giving up here would leave the map split.
            let gid = names::tm_gid(id, &node.name);
            let mut attempt = 0u32;
            loop {
                let r = async {
                    let c = self.config.connector.connect(node).await?;
                    finish_tm_if_prepared(&c, node, &gid, "COMMIT PREPARED").await
                }
                .await;
                match r {
                    Ok(()) => break,
                    Err(e) if attempt < 600 || started.elapsed() < NODE_WAIT => {
                        attempt += 1;
                        if attempt == 1 {
                            warn!(migration_id = id, phase = "handover", node = %node.name, error = %describe(&e), "COMMIT PREPARED of Tm failed; retrying");
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
            let at = self
                .after_decision(node, c, "SELECT remus.bump_map_generation(), clock_timestamp()::text")
                .await?
                .unwrap_or_default();
            self.state.tm_committed_at.push((node.clone(), at));
        }
        for (node, c) in &sessions {
            self.after_decision(node, c, "SELECT remus.end_read_through()::text, NULL::text").await?;
        }
        self.state.read_through = false;
        info!(migration_id = id, phase = "handover", "Tm committed on every node");
        Ok(())
    }

    fn tm_order(&self) -> Vec<NodeRecord> {
        let mut order = vec![self.plan.target.clone()];
        order.extend(
            self.plan
                .nodes
                .iter()
                .filter(|n| n.name != self.plan.target.name && n.name != self.plan.source.name)
                .cloned(),
        );
        order.push(self.plan.source.clone());
        order
    }

    // ---- remus: capture, sync barrier --------------------------------------------------

    /// Remus: the source starts capturing write sets on the shards, and notes the transactions
    /// that already hold a write lock on them (their write sets miss what they wrote before).
    async fn start_capture(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let source = self.config.connector.connect(&self.plan.source).await?;
        source
            .execute(
                &format!("SELECT remus.migration_capture({id}, $1)"),
                &[&self.config.replay_endpoint],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.capturing = true;
        let rows = source
            .query(
                &format!(
                    "SELECT DISTINCT virtualtransaction FROM pg_locks
                      WHERE relation = ANY({}) AND granted
                        AND mode NOT IN ('AccessShareLock', 'RowShareLock')",
                    self.regclass_array()
                ),
                &[],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.pre_capture_writers = rows.iter().map(|r| r.get::<_, String>(0)).collect();
        Ok(())
    }

    /// Prepared transactions (2PC participants: no backend) holding locks on the source's shard
    /// tables, as virtual xids.
    async fn prepared_shard_lockers(&self) -> Result<Vec<String>, DriverError> {
        let source = self.config.connector.connect(&self.plan.source).await?;
        let rows = source
            .query(
                &format!(
                    "SELECT DISTINCT virtualtransaction FROM pg_locks
                      WHERE relation = ANY({}) AND pid IS NULL",
                    self.regclass_array()
                ),
                &[],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Waits until none of `vxids` holds a lock on the shard tables on the source any more.
    async fn wait_for_lockers(&self, vxids: &[String], what: &str) -> Result<(), DriverError> {
        if vxids.is_empty() {
            return Ok(());
        }
        let source = self.config.connector.connect(&self.plan.source).await?;
        let query = format!(
            "SELECT count(DISTINCT virtualtransaction), min(pid) FROM pg_locks
              WHERE relation = ANY({}) AND virtualtransaction = ANY($1)",
            self.regclass_array()
        );
        let mut reported = false;
        loop {
            let row = source.query_one(&query, &[&vxids]).await.map_err(sql(&self.plan.source))?;
            let n: i64 = row.get(0);
            if n == 0 {
                break;
            }
            if !reported {
                let pid: Option<i32> = row.get(1);
                let who = pid.map(|p| format!("pid {p}")).unwrap_or_else(|| "a prepared transaction".into());
                self.reporter
                    .waiting_on(Some(format!("{n} {what} on {} (e.g. {who})", self.plan.source.name)))
                    .await;
                info!(migration_id = self.id(), phase = "barrier", n, what, "waiting for transactions");
                reported = true;
            }
            if let Some(p) = &self.state.propagator {
                p.check()?;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if reported {
            self.reporter.waiting_on(None).await;
        }
        Ok(())
    }

    /// The sync barrier: wait for the writers whose write sets are incomplete, switch the
    /// source to sync mode (TS_unsync drains inside `remus.sync_barrier`), wait for the 2PC
    /// participants prepared in async mode, then until the target applied everything up to
    /// there. From then on every source commit on the shards is validated on the target.
    async fn sync_barrier(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let started = Instant::now();
        let writers = self.state.pre_capture_writers.clone();
        self.wait_for_lockers(&writers, "transactions that were writing the shards when the migration started").await?;
        let source = self.config.connector.connect(&self.plan.source).await?;
        let lsn_unsync: i64 = source
            .query_one(&format!("SELECT remus.sync_barrier({id})"), &[])
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        // Prepared transactions (2PC participants) hold their shard locks without a backend;
        // those prepared before sync mode committed unvalidated, and must be applied before
        // the handover. Newer ones are validated already; waiting for them too is harmless.
        let prepared = self.prepared_shard_lockers().await?;
        self.wait_for_lockers(&prepared, "transactions prepared before the sync barrier").await?;
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        info!(
            migration_id = id,
            phase = "barrier",
            lsn_unsync = %Lsn(lsn_unsync as u64),
            ms = started.elapsed().as_millis() as u64,
            "sync barrier set; dual execution on"
        );
        Ok(())
    }

    /// Remus: prepared shadow transactions of this migration still on the target after the
    /// stream ended belong to source transactions whose commit or abort the target has not
    /// heard of (the source's post-commit call or the stream did not reach it): each follows
    /// its source transaction's fate. A committed one gets the source's commit time, through a
    /// replication origin of the migration (dropped with the others).
    async fn resolve_shadows(&self) -> Result<(), DriverError> {
        let target = self.connect_when_up(&self.plan.target).await?;
        let source = self.connect_when_up(&self.plan.source).await?;
        let prefix = names::shadow_gid_prefix(self.id());
        let gids: Vec<String> = target
            .query("SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, $1)", &[&prefix])
            .await
            .map_err(sql(&self.plan.target))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if gids.is_empty() {
            return Ok(());
        }
        let origin = quote_literal(&names::shadow_resolve_origin(self.id()));
        target
            .batch_execute(&format!(
                "SELECT pg_replication_origin_create({origin}) WHERE pg_replication_origin_oid({origin}) IS NULL;
                 SELECT pg_replication_origin_session_setup({origin});"
            ))
            .await
            .map_err(sql(&self.plan.target))?;
        let resolved = async {
            for gid in &gids {
                let fxid = gid.rsplit(':').next().unwrap_or_default();
                let row = loop {
                    let row = source
                    .query_one(
                        "SELECT pg_xact_status(x), pg_xact_commit_timestamp((x::text::bigint % 4294967296)::text::xid)::text,
                                pg_current_wal_lsn()::text
                           FROM (SELECT $1::text::xid8 AS x) t",
                        &[&fxid],
                    )
                    .await
                    .map_err(sql(&self.plan.source))?;
                    // Still running or prepared on the source: its fate is not known yet.
                    if row.get::<_, Option<String>>(0).as_deref() != Some("in progress") {
                        break row;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                };
                let status: Option<String> = row.get(0);
                let committed_at: Option<String> = row.get(1);
                let lsn: String = row.get(2);
                let verb = if status.as_deref() == Some("committed") {
                    if let Some(at) = committed_at {
                        target
                            .batch_execute(&format!(
                                "SELECT pg_replication_origin_xact_setup({}::pg_lsn, {}::timestamptz)",
                                quote_literal(&lsn),
                                quote_literal(&at)
                            ))
                            .await
                            .map_err(sql(&self.plan.target))?;
                    }
                    "COMMIT"
                } else {
                    "ROLLBACK"
                };
                let statement = format!("{verb} PREPARED {}", quote_literal(gid));
                warn!(migration_id = self.id(), phase = "cleanup", %gid, ?status, "resolving a shadow transaction left prepared by its source transaction's fate");
                match target.batch_execute(&statement).await {
                    Ok(()) => {}
                    // Finished meanwhile by the replay worker (a late post-commit call).
                    Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT) => {}
                    Err(e) => return Err(sql(&self.plan.target)(e)),
                }
                target
                    .batch_execute("SELECT pg_replication_origin_xact_reset()")
                    .await
                    .map_err(sql(&self.plan.target))?;
            }
            Ok::<_, DriverError>(())
        }
        .await;
        // Detached before `drop_origins` (an origin in use cannot be dropped).
        let reset = target
            .batch_execute("SELECT pg_replication_origin_session_reset()")
            .await
            .map_err(sql(&self.plan.target));
        resolved?;
        reset
    }

    /// Rollback: every prepared shadow of this migration on the target goes (the source keeps
    /// everything its transactions wrote).
    async fn drop_shadows(&self) -> Result<(), DriverError> {
        let target = self.connect_when_up(&self.plan.target).await?;
        let prefix = names::shadow_gid_prefix(self.id());
        let rows = target
            .query("SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, $1)", &[&prefix])
            .await
            .map_err(sql(&self.plan.target))?;
        for r in rows {
            let gid: String = r.get(0);
            target
                .batch_execute(&format!("ROLLBACK PREPARED {}", quote_literal(&gid)))
                .await
                .map_err(sql(&self.plan.target))?;
        }
        Ok(())
    }

    // ---- cleanup ------------------------------------------------------------------------

    /// Waits until every transaction that could still use the source shards has ended: those
    /// older than Tm on every node and (Remus) 2PC participants prepared on the source. With
    /// `stream`, the target then applies the source's stream up to here.
    async fn drain_after_tm(&mut self, stream: bool) -> Result<(), DriverError> {
        for (node, at) in self.state.tm_committed_at.clone() {
            self.wait_for_older_transactions(&node, &at, "transactions older than the handover").await?;
        }
        if self.plan.mode == Mode::Remus {
            // Source transactions that predate Tm kept committing (validated) after it; 2PC
            // participants among them may still be prepared. The stream carries their commits
            // (which commit their shadows): apply all of it before it stops.
            let prepared = self.prepared_shard_lockers().await?;
            self.wait_for_lockers(&prepared, "prepared transactions older than the handover").await?;
            if stream {
                let lsn = self.sync_point().await?;
                self.wait_applied(lsn).await?;
            }
        }
        Ok(())
    }

    async fn cleanup(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let stream_lost = match self.drain_after_tm(true).await {
            Ok(()) => None,
            // Remus after Tm: every source commit since the sync barrier was validated, so its
            // shadow is prepared or committed on the target already; the stream only carried
            // the commit decisions. Finish from the shadows (paper section 3.7).
            Err(DriverError::Propagator(e)) if self.plan.mode == Mode::Remus => Some(e),
            Err(e) => return Err(e),
        };
        let propagator = self.state.propagator.take().expect("propagator running");
        self.state.final_txns_applied =
            propagator.progress.txns_applied.load(std::sync::atomic::Ordering::Acquire);
        let conn = match stream_lost {
            // Everything up to the final sync point is applied; a worker that cannot finish
            // cleanly now (its target restarting, say) leaves only its origins, dropped below.
            None => match propagator.stop(true).await {
                Ok(conn) => Some(conn),
                Err(e) => {
                    warn!(migration_id = id, phase = "cleanup", error = %e, "the replay worker did not finish cleanly");
                    None
                }
            },
            Some(e) => {
                warn!(migration_id = id, phase = "cleanup", error = %e, "the stream failed after the handover; completing from the prepared shadows");
                self.reporter
                    .waiting_on(Some(format!("the stream failed after the handover ({e}); completing from the prepared shadows")))
                    .await;
                // Abandoning the apply call makes the replay worker refuse validations, so
                // source transactions older than Tm that are still to commit fail now rather
                // than wait for a stream that will not come; then wait for all of them to end.
                let conn = propagator.stop(false).await.ok();
                self.drain_after_tm(false).await?;
                self.reporter.waiting_on(None).await;
                conn
            }
        };
        self.drop_slot(conn).await?;
        let aborted = self.finish_after_drain().await? + self.state.terminated;
        let replayed = self.txns_replayed();
        self.reporter
            .update(move |r| {
                r.aborted_by_migration = aborted;
                r.txns_replayed = replayed;
            })
            .await?;
        info!(migration_id = id, phase = "cleanup", aborted, replayed, "source shard removed");
        Ok(())
    }

    /// Cleanup's last steps, once the drain is over and the slot is gone: leftover shadows
    /// resolved (Remus), the source's copy, the publication and the origins dropped (each if it
    /// is still there: a resumed run may find them gone), the registration ended. Returns the
    /// transactions the nodes counted as aborted by the migration.
    async fn finish_after_drain(&mut self) -> Result<u64, DriverError> {
        if self.plan.mode == Mode::Remus {
            self.resolve_shadows().await?;
        }
        let source = self.connect_when_up(&self.plan.source).await?;
        source
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {}; DROP PUBLICATION IF EXISTS {};",
                self.table_list(),
                self.publication()
            ))
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.publication = false;
        self.drop_origins().await?;
        self.end_registration().await
    }

    async fn drop_slot(&mut self, conn: Option<ReplicationConnection>) -> Result<(), DriverError> {
        let Some(slot) = self.state.slot.clone() else { return Ok(()) };
        match conn {
            Some(mut conn) => {
                tokio::task::spawn_blocking(move || conn.drop_slot(&slot))
                    .await
                    .map_err(|e| DriverError::Other(format!("drop slot thread: {e}")))??;
            }
            None => {
                let source = self.config.connector.connect(&self.plan.source).await?;
                // A walsender that just lost its client may still hold the slot for a moment.
                execute_while_in_use(
                    &source,
                    &self.plan.source,
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                    &slot,
                )
                .await?;
            }
        }
        self.state.slot = None;
        Ok(())
    }

    async fn drop_origins(&self) -> Result<(), DriverError> {
        let target = self.connect_when_up(&self.plan.target).await?;
        // The sessions of a replay worker that died are still attached to their origins until
        // their backends notice the lost client and exit.
        execute_while_in_use(
            &target,
            &self.plan.target,
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname LIKE $1",
            &names::origin_like_pattern(self.id()),
        )
        .await
    }

    /// Ends the registration on every node; returns the transactions the nodes counted as
    /// aborted by the migration.
    async fn end_registration(&mut self) -> Result<u64, DriverError> {
        if !self.state.registered {
            return Ok(0);
        }
        let rows = self.on_every_node(&format!("SELECT remus.migration_end({})", self.id())).await?;
        self.state.registered = false;
        Ok(rows.iter().map(|r| r.get::<_, i64>(0).max(0) as u64).sum())
    }

    // ---- resuming after a coordinator restart -------------------------------------------

    /// Nothing of the previous run is known but the phase its record reached, so everything it
    /// may have built is assumed to exist; every step below finds out on the node and is
    /// idempotent (a step that already ran, or never did, changes nothing).
    async fn resume(&mut self, phase: Phase) {
        let id = self.id();
        self.state.registered = true;
        self.state.publication = true;
        self.state.slot = Some(self.slot());
        self.state.target_tables = true;
        self.state.tm_prepared = true;
        self.state.gate_closed = self.plan.mode == Mode::WaitRemaster;
        self.state.capturing = self.plan.mode == Mode::Remus;
        // Read-through is one counter per node for all migrations, and whether the previous
        // run ended its share is not known: `recovery` ends it on every node once every
        // resumed migration has settled its Tm.
        self.state.read_through = false;
        if phase == Phase::Cleanup {
            info!(migration_id = id, phase = "cleanup", "resuming after a coordinator restart: past the Tm decision, completing");
            self.reporter
                .waiting_on(Some("the coordinator restarted after the Tm decision; completing the migration".into()))
                .await;
            self.state.tm_decided = true;
            match self.complete_after_restart().await {
                Ok(()) => {
                    self.reporter.finish(Status::Succeeded, None).await;
                    info!(migration_id = id, phase = "cleanup", "migration completed after a coordinator restart");
                }
                Err(e) => {
                    let msg = format!("the coordinator restarted after the Tm decision; completing failed: {}", describe(&e));
                    warn!(migration_id = id, phase = "cleanup", error = %msg, "resumed migration failed");
                    self.reporter.finish(Status::Failed, Some(msg)).await;
                }
            }
        } else {
            info!(migration_id = id, phase = %phase, "resuming after a coordinator restart: before the Tm decision, rolling back");
            self.reporter
                .waiting_on(Some(format!("the coordinator restarted during phase {phase}; rolling back")))
                .await;
            let msg = format!("the coordinator stopped during phase {phase}; rolled back when it restarted");
            match self.rollback().await {
                Ok(()) => self.reporter.finish(Status::RolledBack, Some(msg)).await,
                Err(e) => {
                    let msg = format!("{msg}, but the rollback failed: {}", describe(&e));
                    warn!(migration_id = id, phase = "rollback", error = %msg, "resumed migration failed");
                    self.reporter.finish(Status::Failed, Some(msg)).await
                }
            }
        }
    }

    /// The rest of a migration decided by its Tm, with the stream gone with the previous
    /// coordinator: Tm committed where it is still prepared, the drain, then what `cleanup`
    /// does after a failed stream (every source commit since the sync barrier was validated,
    /// so the prepared shadows are the rest of the shard; source transactions that commit
    /// from now on find no stream to validate against and fail with 40001, keeping nothing).
    async fn complete_after_restart(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        for node in self.tm_order() {
            let c = self.connect_when_up(&node).await?;
            finish_tm_if_prepared(&c, &node, &names::tm_gid(id, &node.name), "COMMIT PREPARED").await?;
            if self.state.gate_closed {
                c.batch_execute(&format!("SELECT remus.open_gate({id})")).await.map_err(sql(&node))?;
            }
            // The drain waits for what is older than now: a superset of what predates Tm.
            let at: Option<String> = c
                .query_one("SELECT remus.bump_map_generation(), clock_timestamp()::text", &[])
                .await
                .map_err(sql(&node))?
                .get(1);
            self.state.tm_committed_at.push((node, at.unwrap_or_default()));
        }
        self.state.gate_closed = false;
        for (node, at) in self.state.tm_committed_at.clone() {
            self.wait_for_older_transactions(&node, &at, "transactions older than the coordinator's restart").await?;
        }
        let source = self.connect_when_up(&self.plan.source).await?;
        let tables: Vec<String> = self.plan.tables.iter().map(|t| t.qualified()).collect();
        let left: i64 = source
            .query_one("SELECT count(*) FROM unnest($1::text[]) t WHERE to_regclass(t) IS NOT NULL", &[&tables])
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        if self.plan.mode == Mode::Remus && left > 0 {
            let prepared = self.prepared_shard_lockers().await?;
            self.wait_for_lockers(&prepared, "prepared transactions older than the handover").await?;
        }
        self.drop_slot(None).await?;
        let aborted = self.finish_after_drain().await?;
        self.reporter.update(move |r| r.aborted_by_migration = aborted).await?;
        info!(migration_id = id, phase = "cleanup", aborted, "source shard removed after a coordinator restart");
        Ok(())
    }

    // ---- rollback -----------------------------------------------------------------------

    /// Undoes everything a migration that failed before the Tm decision built: the source keeps
    /// (and never lost) the shards.
    ///
    /// Every node that answers is released first (its prepared Tm rolled back, read-through
    /// ended, gate opened, registration ended): a target that is down must not keep the source
    /// in sync mode, where every write to the shards would fail to validate until it is back.
    /// Then the source's stream, slot and publication go, and only then does the rollback wait
    /// for the nodes that did not answer (the target's copy, shadows and origins with them).
    async fn rollback(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        info!(migration_id = id, phase = "rollback", "rolling back");
        self.state.rolling_back = true;
        let mut first_error: Option<DriverError> = None;
        let mut note = |r: Result<(), DriverError>| {
            if let Err(e) = r {
                warn!(migration_id = id, phase = "rollback", error = %describe(&e), "rollback step failed");
                first_error.get_or_insert(e);
            }
        };
        let mut unreachable = Vec::new();
        for node in self.plan.nodes.clone() {
            let released = async {
                let c = self.config.connector.connect(&node).await?;
                self.release_node(&node, &c).await
            }
            .await;
            if let Err(e) = released {
                warn!(migration_id = id, phase = "rollback", node = %node.name, error = %describe(&e), "node not released; retried once it answers");
                unreachable.push(node);
            }
        }
        let conn = match self.state.propagator.take() {
            Some(p) => p.stop(false).await.ok(),
            None => self.take_repl(),
        };
        note(self.drop_slot(conn).await);
        if self.state.publication {
            let r = async {
                let c = self.config.connector.connect(&self.plan.source).await?;
                c.batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", self.publication()))
                    .await
                    .map_err(sql(&self.plan.source))
            }
            .await;
            note(r);
        }
        for node in &unreachable {
            let r = async {
                let c = self.connect_when_up(node).await?;
                self.release_node(node, &c).await
            }
            .await;
            note(r);
        }
        if self.plan.mode == Mode::Remus && self.state.target_tables {
            note(self.drop_shadows().await);
        }
        if self.state.target_tables {
            let r = async {
                let c = self.connect_when_up(&self.plan.target).await?;
                let drops: String = self
                    .plan
                    .tables
                    .iter()
                    .map(|t| format!("DROP TABLE IF EXISTS {};", t.qualified()))
                    .collect();
                c.batch_execute(&drops).await.map_err(sql(&self.plan.target))
            }
            .await;
            note(r);
        }
        note(self.drop_origins().await);
        if first_error.is_none() {
            self.state.read_through = false;
            self.state.gate_closed = false;
            self.state.registered = false;
        }
        match first_error {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// The rollback's steps on one node, each idempotent: roll back its prepared Tm, end
    /// read-through, open the gate, end the registration (capture and sync mode with it).
    async fn release_node(&self, node: &NodeRecord, c: &tokio_postgres::Client) -> Result<(), DriverError> {
        let id = self.id();
        if self.state.tm_prepared {
            finish_tm_if_prepared(c, node, &names::tm_gid(id, &node.name), "ROLLBACK PREPARED").await?;
        }
        if self.state.read_through {
            c.batch_execute("SELECT remus.end_read_through()").await.map_err(sql(node))?;
        }
        if self.state.gate_closed {
            c.batch_execute(&format!("SELECT remus.open_gate({id})")).await.map_err(sql(node))?;
        }
        if self.state.registered {
            c.batch_execute(&format!("SELECT remus.migration_end({id})")).await.map_err(sql(node))?;
        }
        debug!(migration_id = id, phase = "rollback", node = %node.name, "node released");
        Ok(())
    }
}

/// Runs `statement` (one text parameter), retried for up to 10 s while it fails with "object
/// in use" (55006): a slot or origin still held by a backend that is on its way out.
async fn execute_while_in_use(
    client: &tokio_postgres::Client,
    node: &NodeRecord,
    statement: &str,
    param: &str,
) -> Result<(), DriverError> {
    let mut attempt = 0u32;
    loop {
        match client.execute(statement, &[&param]).await {
            Ok(_) => return Ok(()),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) && attempt < 200 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(sql(node)(e)),
        }
    }
}

/// Runs `verb` (COMMIT PREPARED or ROLLBACK PREPARED) on a node's Tm transaction if it is still
/// prepared there: every caller may be a retry after the first attempt got through.
async fn finish_tm_if_prepared(
    c: &tokio_postgres::Client,
    node: &NodeRecord,
    gid: &str,
    verb: &str,
) -> Result<(), DriverError> {
    let prepared = !c
        .query("SELECT 1 FROM pg_prepared_xacts WHERE gid = $1", &[&gid])
        .await
        .map_err(sql(node))?
        .is_empty();
    if prepared {
        c.batch_execute(&format!("{verb} {}", quote_literal(gid))).await.map_err(sql(node))?;
    }
    Ok(())
}

fn join(ids: &[i64]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
