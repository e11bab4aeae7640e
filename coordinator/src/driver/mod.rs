//! Drives one migration through its phases and rolls it back completely when it fails before
//! the Tm decision. One module per phase, named as [`Phase`] and as the node side of the phase in
//! the extension (`pg_remus/src/migration/<phase>.rs`), so that a grep for a phase finds both
//! halves:
//!
//! | phase | driver (here) | what the driver does |
//! | --- | --- | --- |
//! | `copy` | `copy.rs` | registers the migration on every node, creates the publication, the target's tables and the slot, copies the slot's snapshot |
//! | `catchup` | `catchup.rs` | starts the stream to the replay worker and waits until a round of it is short; Remus: starts write-set capture |
//! | `barrier` | `barrier.rs` | Remus: the sync barrier, after which every source commit on the shards is validated on the target |
//! | `dual` | `dual.rs` | Remus: dual execution runs on the nodes; the driver resolves or drops the prepared shadows it leaves |
//! | `handover` | `handover/mod.rs` | per mode (`handover/lock_abort.rs`, `handover/wait_remaster.rs`, `handover/albatross.rs`, `handover/remus.rs`), ending in Tm |
//! | squall | `squall.rs` | squall mode's own pipeline: empty target tables and chunk plan (`copy`), gate, fence and Tm (`handover`), the pulls (`cleanup`) |
//! | `cleanup` | `cleanup.rs` | drain, stream and slot stopped, the source's copy, publication and origins dropped, registration ended |
//! | — | `rollback.rs` | undoes everything a migration failed before the Tm decision built |
//! | — | `resume.rs` | a restarted coordinator completes (past the decision) or rolls back (before it) a migration |
//!
//! The record in etcd is the truth about where a migration is; every phase change goes through
//! [`MigrationStore::advance`] and is published to the callers waiting on the migration (the
//! `MigrateShards` stream). Advancing to `cleanup` is written only after Tm is prepared on every
//! node: it is the commit decision of Tm (`docs/design/DESIGN.md` section 4). Before it, a failure
//! rolls everything back; after it, Tm is committed everywhere and the migration can only go
//! forward.
//!
//! Glossary:
//! - **Tm**: the ownership transfer transaction (the paper's name): one transaction per node
//!   moves the shards to the target in `remus.shard_map`, prepared on every node, decided by the
//!   record's move to `cleanup`, then committed on the target first and on every other node
//!   at once (`handover/mod.rs`, `Run::tm`). Every handover mode ends in it.
//! - **sync point**: a transactional logical message on the source whose LSN everything
//!   committed before it precedes; the driver waits until the target applied up to it.
//! - **shadow transaction**: Remus: a source transaction's writes prepared on the target under
//!   the gid `remus:<migration>:<source xid>` ([`remus_proto::names::shadow_gid`]), committed
//!   or rolled back with its source transaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::watch;
use tracing::{info, info_span, warn, Instrument};
use wal_propagator::{Lsn, ReplicationConnection};

use remus_proto::names;

use crate::failpoint::{self, Failpoints};
use crate::migration::{MigrationError, MigrationRecord, MigrationStore, Mode, Phase, Status};
use crate::node_conn::{NodeConnError, NodeConnector};
use crate::node_registry::NodeRecord;
use crate::plan::MigrationPlan;
use crate::propagator::{Propagator, PropagatorError};

mod barrier;
mod catchup;
pub use catchup::VALIDATION_SESSIONS_AHEAD;
mod cleanup;
mod copy;
mod dual;
mod handover;
mod meter;
mod resume;
mod rollback;
mod squall;

/// After the Tm decision, how long the driver keeps retrying a node that does not answer (a
/// crashed target restarting) before the migration ends `failed`.
const NODE_WAIT: Duration = Duration::from_secs(300);

/// Static configuration of the migration machinery.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    pub connector: NodeConnector,
    /// gRPC endpoint of the replay worker, e.g. `http://127.0.0.1:6103`.
    pub replay_endpoint: String,
    /// Concurrent apply sessions on the target.
    pub apply_parallelism: u32,
    /// Sessions of the snapshot copy: at least one per table of the shard group, and this
    /// many at least, so that a large shard table is read and written in block ranges by
    /// several sessions at once (`wal_propagator::CopyOptions::split_bytes`).
    pub copy_sessions: u32,
    /// A shard table of at least twice this many bytes is copied in block ranges of about
    /// this size; 0 copies every table by one session.
    pub copy_split_bytes: u64,
    /// lock_abort: how long an idle writer holding the shard may keep the handover waiting
    /// before it is terminated.
    pub lock_grace: Duration,
    /// wait_remaster: the longest the admission gate stays closed.
    pub gate_timeout: Duration,
    /// Before Tm, while the source is quiet, compare every shard table on source and target
    /// (row count and a digest over all columns) and fail the migration on any difference.
    /// Costs a full read of both copies inside the handover window, so it is off by default.
    pub verify_handover: bool,
    /// Catch-up whose lag has not come back to its smallest value for this long is not
    /// converging: Remus hands over (dual execution paces the source's writers to the
    /// replay), the baselines roll back (decision 0022).
    pub catchup_converge_limit: Duration,
    /// albatross: the iterative copy's rounds end after at most this many, also while their
    /// deltas still shrink (decision 0024).
    pub albatross_max_rounds: u32,
    /// Named places where a test can stop a migration (`failpoint`).
    pub failpoints: Failpoints,
}

#[derive(Debug, Error)]
pub enum DriverError {
    #[error(transparent)]
    Store(#[from] MigrationError),
    /// A mode this build plans but cannot run (refused earlier, by `plan::parse_mode`).
    #[error("migration mode {0} is not available in this build")]
    ModeNotAvailable(Mode),
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
    /// The source answered a sync point with something that is not an LSN.
    #[error(transparent)]
    SyncPoint(#[from] wal_propagator::LsnParseError),
    /// A blocking step (the copy, dropping the slot) ran on a thread that panicked or was
    /// cancelled.
    #[error("{what} thread: {source}")]
    Thread {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// [`DriverConfig::verify_handover`] found the target's copy of a shard table different
    /// from the source's.
    #[error(transparent)]
    Verification(Box<VerificationFailed>),
    /// wait_remaster: transactions admitted before the admission gate closed still ran when the
    /// drain's bound passed; the handover is rolled back (its gates reopen).
    #[error(
        "wait_remaster: transactions admitted before the admission gate closed still ran on {node} after {ms} ms \
         (remus.gate_drain_timeout, at most the gate's own timeout); the handover is rolled back"
    )]
    GateDrainTimeout { node: String, ms: u64 },
    /// albatross: transactions in flight on the suspended shards still ran when the drain's
    /// bound passed; the handover is rolled back (the suspension lifted, nothing aborted).
    #[error(
        "albatross: transactions in flight on the suspended shards still ran on {node} after {ms} ms \
         (remus.gate_drain_timeout, at most the suspension's own timeout); the handover is rolled back"
    )]
    SuspensionDrainTimeout { node: String, ms: u64 },
    /// lock_abort, wait_remaster: catch-up did not converge within
    /// [`DriverConfig::catchup_converge_limit`]; the migration is rolled back (decision 0022).
    #[error(
        "catch-up is not converging: the source writes {source_rate} B/s of WAL and the target replays {replay_rate} B/s \
         ({replay_txns} transactions/s); the lag of {lag_bytes} bytes ({lag_ms} ms) has not shrunk for {limit_ms} ms \
         ({mode} holds writes while it applies the backlog, so it does not hand over with one; \
         the remus mode paces the source's writers instead); the migration is rolled back"
    )]
    NotConverging {
        mode: &'static str,
        source_rate: u64,
        replay_rate: u64,
        replay_txns: u64,
        lag_bytes: u64,
        lag_ms: u64,
        limit_ms: u64,
    },
    /// Cleanup was about to drop the source's copy of shards that the source's own map does
    /// not give to the target: Tm did not commit there, so that copy may be the only one.
    #[error(
        "refusing to drop the source's copy: on {source_node} the shard map does not give shards {shards:?} to {target}"
    )]
    NotHandedOver {
        source_node: String,
        target: String,
        shards: Vec<i64>,
    },
    /// A prepared shadow whose source transaction's fate cannot be read any more (F16): left
    /// prepared, for an operator to commit or roll back.
    #[error(
        "shadow transaction {gid} on {target_node} left prepared: the status of its source transaction on {source_node} is {status} \
         (its commit log is truncated); cleanup stopped before dropping the source's copy: COMMIT PREPARED it there if that transaction committed, else ROLLBACK PREPARED"
    )]
    ShadowInDoubt {
        gid: String,
        source_node: String,
        target_node: String,
        status: String,
    },
}

/// A shard table whose copies differ: rows and digest on each side.
#[derive(Debug, Error)]
#[error(
    "verification failed: {table} holds {source_rows} rows (digest {source_digest}) on {source_node} \
     but {target_rows} rows (digest {target_digest}) on {target_node}"
)]
pub struct VerificationFailed {
    pub table: String,
    pub source_node: String,
    pub source_rows: i64,
    pub source_digest: String,
    pub target_node: String,
    pub target_rows: i64,
    pub target_digest: String,
}

fn sql(node: &NodeRecord) -> impl Fn(tokio_postgres::Error) -> DriverError + '_ {
    move |source| DriverError::Sql {
        node: node.name.clone(),
        source,
    }
}

fn describe(e: &DriverError) -> String {
    match e {
        DriverError::Sql { node, source } => match source.as_db_error() {
            Some(db) => format!(
                "on node {node}: {} (SQLSTATE {})",
                db.message(),
                db.code().code()
            ),
            None => format!("on node {node}: {source}"),
        },
        other => other.to_string(),
    }
}

/// Publishes record changes to whoever waits on the migration.
struct Reporter {
    store: MigrationStore,
    tx: watch::Sender<MigrationRecord>,
    failpoints: Failpoints,
}

/// How long the driver keeps reading back a record whose Tm decision write failed before it
/// gives up and rolls back (see [`Reporter::advance`]).
const DECISION_READBACK: Duration = Duration::from_secs(30);

impl Reporter {
    fn id(&self) -> crate::migration::MigrationId {
        self.tx.borrow().id
    }

    /// Moves the record to `next`. For [`Phase::Cleanup`], the Tm decision, a failed write is
    /// not taken as "not decided": a write whose answer was lost (etcd leader election) may
    /// have been applied. The record is read back with a compare-and-swap of `waiting_on`
    /// ([`Self::settle_decision`]); the decision stands if it says `cleanup`.
    async fn advance(&self, next: Phase) -> Result<(), DriverError> {
        self.advance_noting(next, None).await
    }

    /// [`Self::advance`], with `waiting_on` set to `note` in the same write (one etcd write
    /// instead of two).
    async fn advance_noting(&self, next: Phase, note: Option<String>) -> Result<(), DriverError> {
        let id = self.id();
        let written = self
            .store
            .advance(id, next, |r| {
                if let Some(n) = &note {
                    r.waiting_on = Some(n.clone());
                }
            })
            .await;
        let written = match written {
            Ok(_)
                if next == Phase::Cleanup
                    && self
                        .failpoints
                        .fails(failpoint::HANDOVER_DECISION_UNACKNOWLEDGED, id.0) =>
            {
                Err(MigrationError::Invalid(
                    "failpoint: the decision was written but its answer lost".into(),
                ))
            }
            other => other,
        };
        let r = match written {
            Ok(r) => r,
            Err(e) if next == Phase::Cleanup => self.settle_decision(e).await?,
            Err(e) => return Err(e.into()),
        };
        info!(migration_id = r.id.0, phase = %next, "phase started");
        self.tx.send_replace(r);
        Ok(())
    }

    /// After the write of the Tm decision failed: whether it was applied anyway. A successful
    /// compare-and-swap on the record is also a fence: the failed write compared the record's
    /// older `mod_revision`, so if it is still in flight it can no longer be applied. Returns
    /// the record when it is in `cleanup` (decided); `failed` when it is not, or when etcd does
    /// not answer within [`DECISION_READBACK`]. Rolling back then is safe even if the write
    /// lands later: a resumed migration completes only on evidence from the nodes that Tm
    /// committed or is still prepared everywhere (`resume.rs`, `Run::tm_outcome`).
    async fn settle_decision(
        &self,
        failed: MigrationError,
    ) -> Result<MigrationRecord, DriverError> {
        let id = self.id();
        warn!(migration_id = id.0, phase = "handover", error = %failed, "the Tm decision's write failed; reading the record back");
        let note = format!("the Tm decision's write to etcd failed ({failed}); reading it back");
        let started = Instant::now();
        loop {
            let read = if self
                .failpoints
                .fails(failpoint::HANDOVER_DECISION_UNREADABLE, id.0)
            {
                Err(MigrationError::Invalid(
                    "failpoint: the record cannot be read back".into(),
                ))
            } else {
                self.store
                    .update(id, |r| r.waiting_on = Some(note.clone()))
                    .await
            };
            match read {
                Ok(r) if r.phase == Phase::Cleanup => {
                    info!(
                        migration_id = id.0,
                        phase = "handover",
                        "the Tm decision was written after all; going on"
                    );
                    return Ok(self
                        .store
                        .update(id, |r| r.waiting_on = None)
                        .await
                        .unwrap_or(r));
                }
                Ok(r) => {
                    warn!(migration_id = id.0, phase = %r.phase, "the Tm decision was not written; rolling back");
                    self.tx.send_replace(r);
                    return Err(failed.into());
                }
                Err(e)
                    if started.elapsed() < DECISION_READBACK
                        && !matches!(
                            e,
                            MigrationError::Invalid(_) | MigrationError::IllegalTransition { .. }
                        ) =>
                {
                    warn!(migration_id = id.0, phase = "handover", error = %e, "reading the record back failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => {
                    warn!(migration_id = id.0, phase = "handover", error = %e, "whether the Tm decision was written is unknown; rolling back (a restarted coordinator decides by the nodes' Tm)");
                    return Err(failed.into());
                }
            }
        }
    }

    /// Changes the record. While etcd does not answer (restarting, a leader election), the
    /// change is retried for at most [`NODE_WAIT`]: after the Tm decision a progress note must
    /// not turn a migration that can only go forward into a failed cleanup (fault matrix: etcd
    /// killed after the decision). An update is a compare-and-swap of the whole record, so a
    /// retry after a lost answer applies `f` to what etcd holds, not twice to a stale copy.
    async fn update(&self, mut f: impl FnMut(&mut MigrationRecord)) -> Result<(), DriverError> {
        let mut etcd = EtcdRetry::new();
        loop {
            match self.store.update(self.id(), &mut f).await {
                Ok(r) => {
                    self.tx.send_replace(r);
                    return Ok(());
                }
                Err(e) if etcd.again(self.id(), "update the record", &e).await => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn waiting_on(&self, what: Option<String>) {
        let w = what.clone();
        if let Err(e) = self.update(move |r| r.waiting_on = w.clone()).await {
            warn!(migration_id = self.id().0, error = %e, "could not record waiting_on");
        }
    }

    async fn finish(&self, status: Status, error: Option<String>) {
        if self
            .failpoints
            .fails(failpoint::END_UNRECORDED, self.id().0)
        {
            warn!(migration_id = self.id().0, %status, "failpoint: the end is not recorded");
            return;
        }
        // An etcd that is down or restarting (fault matrix: etcd killed mid-migration) must not
        // leave the record `running` for ever after the nodes were rolled back or completed:
        // the write is retried while etcd does not answer, for at most NODE_WAIT. A write that
        // landed although its answer was lost shows up on the retry as a record that already
        // ended with this status.
        let mut etcd = EtcdRetry::new();
        loop {
            match self.store.finish(self.id(), status, error.clone()).await {
                Ok(r) => {
                    self.tx.send_replace(r);
                    return;
                }
                Err(e) if etcd.again(self.id(), "record the end", &e).await => {}
                Err(e) => {
                    if let Ok(r) = self.store.get(self.id()).await {
                        if r.status == status {
                            self.tx.send_replace(r);
                            return;
                        }
                    }
                    warn!(migration_id = self.id().0, error = %e, "could not record the end");
                    return;
                }
            }
        }
    }
}

/// The retry policy of record writes while etcd does not answer (restarting, a leader
/// election): back off from 200 ms to 5 s, for at most [`NODE_WAIT`] from the first failure.
/// Only [`MigrationError::Etcd`] is retried; a refused change (an illegal transition, a
/// compare-and-swap that lost to another writer) is an answer, not an outage.
struct EtcdRetry {
    started: Instant,
    pause: Duration,
}

impl EtcdRetry {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            pause: Duration::from_millis(200),
        }
    }

    /// After `failed`: sleeps and returns true when the write should be tried again.
    async fn again(
        &mut self,
        id: crate::migration::MigrationId,
        what: &str,
        failed: &MigrationError,
    ) -> bool {
        let MigrationError::Etcd(e) = failed else {
            return false;
        };
        if self.started.elapsed() >= NODE_WAIT {
            return false;
        }
        warn!(migration_id = id.0, error = %e, "could not {what} yet; retrying while etcd does not answer");
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(Duration::from_secs(5));
        true
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
            let _caller = register_caller(id, plan.requested_by.as_ref());
            let reporter = Reporter {
                store,
                tx,
                failpoints: config.failpoints.clone(),
            };
            let mut run = Run {
                config,
                plan,
                reporter,
                state: State::default(),
            };
            run.drive().await;
        }
        .instrument(span),
    );
    rx
}

/// Resumes `record`, a migration that a coordinator was running when it stopped, and returns
/// once it has ended: past the Tm decision (phase `cleanup`) it completes, before it rolls
/// back. See [`crate::resume`].
pub async fn resume(
    config: Arc<DriverConfig>,
    store: MigrationStore,
    plan: MigrationPlan,
    record: MigrationRecord,
) {
    let span = info_span!("migration", migration_id = record.id.0, mode = %plan.mode);
    let phase = record.phase;
    let (tx, _rx) = watch::channel(record);
    async move {
        let reporter = Reporter {
            store,
            tx,
            failpoints: config.failpoints.clone(),
        };
        let mut run = Run {
            config,
            plan,
            reporter,
            state: State::default(),
        };
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
    /// The catch-up's rates and lag, sampled while the driver waits for the stream.
    meter: std::sync::Mutex<meter::Meter>,
    /// Remus: catch-up did not converge; said with every later wait for the stream.
    not_converging: Option<String>,
    /// Cleanup completing without the stream (it failed after Tm): said with every wait of the
    /// drain that follows, so that what an operator reads keeps naming the failure.
    stream_lost: Option<String>,
    /// Remus: the drain-source switch ran on every node ([`Run::switch_drain_source`]).
    drain_switched: bool,
    /// Tm's in-doubt note is in `waiting_on` already (written with the handover's phase change).
    tm_noted: bool,
    /// The driver's own sessions, one per node, for its short statements ([`Run::session`]).
    sessions: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio_postgres::Client>>>,
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
        self.state
            .repl
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// The driver's session on the source ([`Self::session`]).
    async fn source_session(&self) -> Result<Arc<tokio_postgres::Client>, DriverError> {
        self.session(&self.plan.source).await
    }

    /// A session on `node` for the driver's short statements (sync points, lock checks, the
    /// WAL position, the barrier's switch, Tm, the drain's polls, the registration's steps),
    /// kept for the run: a new connection costs tens of milliseconds on a loaded node, and from
    /// the barrier to the end of the drain fence the shard's writers wait on these statements.
    /// Opened as [`Self::connect_when_up`] does, and again once it has closed (a node restart).
    /// Autocommit statements only, nothing set on the session; a step whose statement failed
    /// on it calls [`Self::forget_session`] so that no later step finds it mid-transaction.
    async fn session(&self, node: &NodeRecord) -> Result<Arc<tokio_postgres::Client>, DriverError> {
        self.kept_session(node, true).await
    }

    /// [`Self::session`], but a node that does not answer is an error at once, whatever the
    /// phase (steps that warn and go on, or fail, rather than wait for a node).
    async fn session_now(
        &self,
        node: &NodeRecord,
    ) -> Result<Arc<tokio_postgres::Client>, DriverError> {
        self.kept_session(node, false).await
    }

    /// `node`'s kept session, opened first if there is none open; `patient`: as
    /// [`Self::connect_when_up`] connects, else at once.
    async fn kept_session(
        &self,
        node: &NodeRecord,
        patient: bool,
    ) -> Result<Arc<tokio_postgres::Client>, DriverError> {
        if let Some(client) = self.cached_session(node) {
            return Ok(client);
        }
        let client = Arc::new(if patient {
            self.connect_when_up(node).await?
        } else {
            self.config.connector.connect(node).await?
        });
        self.state
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.name.clone(), client.clone());
        Ok(client)
    }

    fn cached_session(&self, node: &NodeRecord) -> Option<Arc<tokio_postgres::Client>> {
        self.state
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&node.name)
            .filter(|c| !c.is_closed())
            .cloned()
    }

    /// Drops `client` from the cache if it is still `node`'s session: after a statement failed
    /// on it, it may be closed, or inside a transaction that the failure aborted.
    fn forget_session(&self, node: &NodeRecord, client: &Arc<tokio_postgres::Client>) {
        let mut sessions = self
            .state
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if sessions
            .get(&node.name)
            .is_some_and(|c| Arc::ptr_eq(c, client))
        {
            sessions.remove(&node.name);
        }
    }

    /// Runs `sql_text` (one statement, autocommit) on `node`'s session; once more on a new
    /// session if the cached one turns out to be closed (its node restarted since).
    async fn query_on(
        &self,
        node: &NodeRecord,
        sql_text: &str,
    ) -> Result<Vec<tokio_postgres::Row>, DriverError> {
        let c = self.session_now(node).await?;
        match c.query(sql_text, &[]).await {
            Ok(rows) => Ok(rows),
            Err(e) => {
                self.forget_session(node, &c);
                if !c.is_closed() {
                    return Err(sql(node)(e));
                }
                let c = self.session_now(node).await?;
                c.query(sql_text, &[]).await.map_err(|e| {
                    self.forget_session(node, &c);
                    sql(node)(e)
                })
            }
        }
    }

    /// `waiting` behind the note of a stream lost after Tm, if cleanup is completing without it.
    fn with_stream_note(&self, waiting: String) -> String {
        match &self.state.stream_lost {
            Some(note) => format!("{note}; {waiting}"),
            None => waiting,
        }
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
                info!(
                    migration_id = self.id(),
                    ms = started.elapsed().as_millis() as u64,
                    "migration done"
                );
            }
            Err(e) => {
                let msg = describe(&e);
                warn!(migration_id = self.id(), error = %msg, "migration failed");
                if self.state.tm_decided {
                    // Ownership already moved; only cleanup failed. Leave the rest for an
                    // operator and say so.
                    self.reporter
                        .finish(
                            Status::Failed,
                            Some(format!("cleanup after the handover failed: {msg}")),
                        )
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
        if self.plan.mode == Mode::Squall {
            // Ownership first, then the pull: no snapshot copy, no catch-up (`squall.rs`).
            return self.squall().await;
        }
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
            // Driven by `squall()` above.
            Mode::Squall => return Err(DriverError::ModeNotAvailable(self.plan.mode)),
            Mode::Albatross => {
                self.reporter.advance(Phase::Handover).await?;
                self.handover_albatross().await?
            }
            Mode::Remus => {
                self.reporter.advance(Phase::Barrier).await?;
                // Before sync mode: from the barrier until Tm has committed, every source commit
                // on the shards waits for its validation, so that stretch carries no step that
                // can come earlier.
                self.switch_drain_source().await?;
                self.sync_barrier().await?;
                self.reporter.advance(Phase::Dual).await?;
                self.dual().await;
                // Tm's in-doubt note goes with the phase change: one etcd write, not two.
                self.reporter
                    .advance_noting(Phase::Handover, Some(self.tm_note()))
                    .await?;
                self.state.tm_noted = true;
                self.handover_remus().await?;
            }
        }
        self.cleanup().await
    }

    async fn on_every_node(&self, sql_text: &str) -> Result<Vec<tokio_postgres::Row>, DriverError> {
        let mut rows = Vec::new();
        for node in &self.plan.nodes {
            rows.extend(self.query_on(node, sql_text).await?);
        }
        Ok(rows)
    }

    /// Runs `sql_text` (one statement) on every node at once, each on its session
    /// ([`Self::query_on`]), going on past a node that fails (warned as `failed`, with the
    /// phase): for steps that must reach every node that answers. Returns the first failure
    /// once all were tried.
    async fn on_every_node_trying_all(
        &self,
        sql_text: &str,
        phase: &str,
        failed: &str,
    ) -> Result<(), DriverError> {
        let id = self.id();
        // Every node at once, each on its own session: a step that must reach every node (the
        // drain fence's end, under the anchors' E1 with each node's state made durable: 14-19
        // ms one after another) takes the slowest node's time, not the sum.
        let results = futures_util::future::join_all(
            self.plan
                .nodes
                .iter()
                .map(|node| async move { (node, self.query_on(node, sql_text).await) }),
        )
        .await;
        let mut first = None;
        for (node, result) in results {
            if let Err(e) = result {
                warn!(migration_id = id, phase, node = %node.name, error = %e, "{failed}");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn table_list(&self) -> String {
        self.plan
            .tables
            .iter()
            .map(|t| t.qualified())
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn regclass_array(&self) -> String {
        let items: Vec<String> = self
            .plan
            .tables
            .iter()
            .map(|t| quote_literal(&t.qualified()))
            .collect();
        format!("ARRAY[{}]::regclass[]::oid[]", items.join(", "))
    }

    /// A session on `node`, retried while the node does not answer, for at most [`NODE_WAIT`]:
    /// after the Tm decision the migration can only go forward, so a target that crashed is
    /// waited for (its prepared shadows survive the restart); a rollback waits for it to remove
    /// its copy. A stream failure meanwhile is reported at once (the caller then completes
    /// without the stream).
    async fn connect_when_up(
        &self,
        node: &NodeRecord,
    ) -> Result<tokio_postgres::Client, DriverError> {
        self.connect_patiently(node, true).await
    }

    /// [`Self::connect_when_up`]; with `watch_stream` false a failed stream does not end the
    /// wait (Tm's own steps: cleanup deals with the stream).
    async fn connect_patiently(
        &self,
        node: &NodeRecord,
        watch_stream: bool,
    ) -> Result<tokio_postgres::Client, DriverError> {
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
                            .waiting_on(Some(format!(
                                "node {} is unreachable ({e}); retrying",
                                node.name
                            )))
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

    /// Waits until no client transaction that started before `before` (a timestamptz in text)
    /// and could still use the shards' old placement is running on `node`, reporting what it
    /// waits for (node, pid, since when) in `waiting_on`.
    ///
    /// Which transactions count (review finding F9), and why skipping the others is sound:
    /// - only this database's: the router and the shard tables live in it, and a session of
    ///   another database cannot open them;
    /// - not the backends waiting in `remus_migrate_shard(s)` for a migration (this one's or
    ///   another's, [`callers_on`]): that call refuses to run in a transaction block, so their
    ///   transaction is the call itself, which reads no shard (two calls would otherwise wait
    ///   for each other forever);
    /// - [`Drain::AfterTm`]: only those that hold a snapshot (`backend_xmin`: a running
    ///   statement, or a REPEATABLE READ / SERIALIZABLE transaction, whose older snapshot still
    ///   routes to the old owner) or a lock on one of the moved tables, shell or shard table (a
    ///   transaction that used the table before Tm pinned its placements and keeps that lock
    ///   until it ends; a statement on the old owner's copy, also one forwarded from another
    ///   node, locks the shard table there). A READ COMMITTED transaction idle between
    ///   statements with neither takes a new snapshot for its next statement, which sees Tm and
    ///   routes to the new owner.
    ///
    /// [`Drain::AfterTm`] is bounded by `remus.cleanup_drain_timeout` on `node`: past it the
    /// transactions still waited for are terminated (`pg_terminate_backend`, the client sees
    /// 57P01), counted in `aborted_by_migration`, and the wait goes on until they are gone.
    async fn wait_for_older_transactions(
        &self,
        node: &NodeRecord,
        before: &str,
        what: &str,
    ) -> Result<(), DriverError> {
        self.wait_for_transactions(node, before, what, Drain::Gate)
            .await
            .map(|_| ())
    }

    /// [`Self::wait_for_older_transactions`] after Tm ([`Drain::AfterTm`]); the transactions it
    /// terminated count as aborted by the migration.
    async fn drain_older_transactions(
        &mut self,
        node: &NodeRecord,
        before: &str,
        what: &str,
    ) -> Result<(), DriverError> {
        let killed = self
            .wait_for_transactions(node, before, what, Drain::AfterTm)
            .await?;
        self.state.terminated += killed;
        Ok(())
    }

    /// The wait of [`Self::wait_for_older_transactions`]; returns how many it terminated.
    async fn wait_for_transactions(
        &self,
        node: &NodeRecord,
        before: &str,
        what: &str,
        drain: Drain,
    ) -> Result<u64, DriverError> {
        let mut c = self.session(node).await?;
        let callers = callers_on(&node.name, self.plan.requested_by.as_ref());
        let tables: Vec<String> = self
            .plan
            .tables
            .iter()
            .flat_map(|t| [t.shell.clone(), t.qualified()])
            .collect();
        let usage = match drain {
            Drain::Gate => "AND $3::text[] IS NOT NULL",
            Drain::AfterTm => {
                "AND (a.backend_xmin IS NOT NULL OR EXISTS (
                        SELECT 1 FROM pg_locks l
                         WHERE l.pid = a.pid AND l.locktype = 'relation'
                           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                           AND l.relation IN (SELECT to_regclass(t)::oid FROM unnest($3::text[]) t)))"
            }
        };
        let stragglers = format!(
            "FROM pg_stat_activity a
              WHERE a.backend_type = 'client backend' AND a.xact_start < $1::text::timestamptz
                AND a.datname = current_database()
                AND a.pid <> pg_backend_pid() AND a.pid <> ALL($2::int4[])
                AND a.application_name <> {} {usage}",
            quote_literal(names::MIGRATION_APPLICATION_NAME)
        );
        // The bound is read with every poll, so that a reload changes a wait under way.
        let count = format!(
            "SELECT count(*), min(a.pid), min(a.xact_start)::text,
                    (extract(epoch FROM nullif(current_setting('remus.cleanup_drain_timeout', true), '')::interval) * 1000)::bigint
               {stragglers}"
        );
        let terminate = format!(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid)),
                    string_agg(a.pid::text, ', ' ORDER BY a.pid) {stragglers}"
        );
        let started = Instant::now();
        let mut terminated_once = false;
        let mut terminated = 0u64;
        let mut reported: Option<(i64, Option<Duration>)> = None;
        loop {
            let row = match c.query_one(&count, &[&before, &callers, &tables]).await {
                Ok(row) => row,
                // The node went away (a crash ends its transactions too): ask again once it is
                // back.
                Err(e) if c.is_closed() || self.state.tm_decided => {
                    warn!(migration_id = self.id(), node = %node.name, error = %e, "polling for older transactions failed; reconnecting");
                    self.forget_session(node, &c);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    c = self.session(node).await?;
                    continue;
                }
                Err(e) => {
                    self.forget_session(node, &c);
                    return Err(sql(node)(e));
                }
            };
            let n: i64 = row.get(0);
            if n == 0 {
                break;
            }
            let bound = (drain == Drain::AfterTm).then(|| {
                row.get::<_, Option<i64>>(3)
                    .map(|ms| Duration::from_millis(ms.max(0) as u64))
                    .unwrap_or(DEFAULT_DRAIN_TIMEOUT)
            });
            // Named in `waiting_on` once the wait lasts: each note is an etcd write awaited
            // here, and under the anchors' E1 a drain of a few milliseconds, noting every change
            // of its count, was paced by those writes (11-22 ms each, 69 ms in all).
            if reported != Some((n, bound)) && started.elapsed() >= NOTE_WAIT_AFTER {
                let pid: Option<i32> = row.get(1);
                let since: Option<String> = row.get(2);
                let limit = match bound {
                    Some(b) if !terminated_once => format!(
                        "; terminated after remus.cleanup_drain_timeout ({} ms) if still open",
                        b.as_millis()
                    ),
                    Some(_) => "; terminated, waiting for them to exit".to_string(),
                    None => String::new(),
                };
                self.reporter
                    .waiting_on(Some(self.with_stream_note(format!(
                        "{n} {what} on {} (e.g. pid {}, open since {}){limit}",
                        node.name,
                        pid.unwrap_or_default(),
                        since.unwrap_or_default()
                    ))))
                    .await;
                reported = Some((n, bound));
            }
            if let Some(b) = bound.filter(|b| !terminated_once && started.elapsed() >= *b) {
                let row = c
                    .query_one(&terminate, &[&before, &callers, &tables])
                    .await
                    .map_err(sql(node))?;
                let killed: i64 = row.get(0);
                let pids: Option<String> = row.get(1);
                warn!(
                    migration_id = self.id(),
                    phase = "cleanup",
                    node = %node.name,
                    terminated = killed,
                    pids = %pids.unwrap_or_default(),
                    timeout_ms = b.as_millis() as u64,
                    "transactions older than the handover still open after remus.cleanup_drain_timeout: terminated"
                );
                terminated += killed.max(0) as u64;
                terminated_once = true;
                reported = None;
            }
            if let Some(p) = &self.state.propagator {
                p.check()?;
            }
            tokio::time::sleep(WAIT_POLL).await;
        }
        if reported.is_some() {
            self.reporter.waiting_on(None).await;
        }
        Ok(terminated)
    }
}

/// How long a wait for older transactions or lockers goes on before `waiting_on` names it.
const NOTE_WAIT_AFTER: Duration = Duration::from_millis(100);

/// How often those waits look again. Short: after Tm, writes on the moved shards pay the drain
/// fence until cleanup's waits are over (`end_drain_fence`), and most of what they wait for
/// lasts milliseconds.
const WAIT_POLL: Duration = Duration::from_millis(2);

/// Which transactions [`Run::wait_for_older_transactions`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// wait_remaster before Tm: every transaction admitted before the gate closed.
    Gate,
    /// After Tm: those that can still use the shards' old placement, bounded.
    AfterTm,
}

/// `remus.cleanup_drain_timeout` where the node does not define it (an older build); the same
/// default as the setting's.
const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(300);

/// The backends of `node` that wait in `remus_migrate_shard(s)` for a migration of this
/// coordinator, `own` (this migration's caller) included.
fn callers_on(node: &str, own: Option<&(String, i32)>) -> Vec<i32> {
    let mut pids: Vec<i32> = CALLERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(_, n, _)| n == node)
        .map(|(_, _, pid)| *pid)
        .collect();
    pids.extend(own.filter(|(n, _)| n == node).map(|(_, pid)| *pid));
    pids
}

/// Every running migration's caller (migration id, node, pid): see
/// [`Run::wait_for_older_transactions`].
static CALLERS: std::sync::Mutex<Vec<(u64, String, i32)>> = std::sync::Mutex::new(Vec::new());

/// Registers `id`'s caller until the returned guard is dropped (the driver's task ends).
fn register_caller(id: u64, caller: Option<&(String, i32)>) -> CallerGuard {
    if let Some((node, pid)) = caller {
        CALLERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((id, node.clone(), *pid));
    }
    CallerGuard(id)
}

struct CallerGuard(u64);

impl Drop for CallerGuard {
    fn drop(&mut self) {
        CALLERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(id, _, _)| *id != self.0);
    }
}

fn join(ids: &[i64]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}
