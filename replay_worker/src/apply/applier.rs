//! [`ShadowApplier`]: one migration's shadow transactions scheduled over parallel destination
//! sessions, with the applied position they reach and the durable position behind it (what
//! the destination has flushed: [`super::durable`]).

use std::collections::HashMap;
use std::sync::Arc;

use remus_proto::names::apply_origin;
use remus_proto::v1::{ApplyProgress, ShadowTxn};
use tokio::task::JoinSet;
use tracing::{debug, info, warn, Instrument};

use super::durable::{flush_sql, DurableFlusher};
use super::session::{Applied, Session};
use super::sql::{format_lsn, prepare, quote_literal, Prepared};
use super::{pg_message, ApplyConfig, ApplyError};
use crate::progress::{AppliedLsnWatcher, AppliedWatermark};
use crate::scheduler::{DependencyScheduler, SubmitError, TxnSpec};

/// Transactions accepted but not yet committed, per apply session, before `submit` waits.
const PENDING_PER_SESSION: usize = 64;

/// Apply sessions opened when the call starts; the rest, up to [`ApplyConfig::parallelism`],
/// open one at a time while transactions are ready with every session busy (decision 0031).
/// Each session is a backend the destination forks and warms up, about 10 ms of its CPU: a
/// shard written at a few hundred transactions per second needs one or two, and sixteen
/// opened at once stalled every client of a loaded two-core machine for tens of milliseconds.
const INITIAL_SESSIONS: usize = 2;

/// A session back from applying transactions `seqs` (in order), and what it did with them.
struct Completion {
    session: Session,
    seqs: Vec<u64>,
    applied: Applied,
}

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
    /// Sessions being opened (see [`INITIAL_SESSIONS`]).
    opening: JoinSet<Result<Session, ApplyError>>,
    /// Sessions opened or being opened: the next one's worker number.
    sessions_started: usize,
    /// At most this many sessions: `cfg.parallelism`, or fewer once one failed to open.
    max_sessions: usize,
    scheduler: DependencyScheduler,
    watermark: AppliedWatermark,
    jobs: HashMap<u64, Arc<Prepared>>,
    next_seq: u64,
    txns_applied: u64,
    /// Of those, committed by a call of an apply session's batch procedure.
    txns_batched: u64,
    /// Batch calls that failed (their transactions from the failed one on were applied one
    /// by one).
    batches_failed: u64,
    /// Changes run as static statements of a batch procedure (decision 0035).
    static_changes: u64,
    /// Changes run by the node's `remus.apply_batch` (decision 0035, third amendment).
    native_changes: u64,
    /// An idle LSN received while transactions were outstanding.
    idle_lsn: Option<u64>,
    failed: Option<String>,
    /// Flushes the destination behind the applied position.
    flusher: DurableFlusher,
    /// Set by [`finish`](Self::finish) once everything applied is flushed.
    final_durable: Option<u64>,
}

impl std::fmt::Debug for ShadowApplier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShadowApplier")
            .field("cfg", &self.cfg)
            .field("idle_sessions", &self.idle_sessions.len())
            .field("running", &self.running.len())
            .field("opening", &self.opening.len())
            .field("applied_lsn", &self.watermark.applied_lsn())
            .field("durable_lsn", &self.durable_lsn())
            .field("txns_applied", &self.txns_applied)
            .finish_non_exhaustive()
    }
}

impl ShadowApplier {
    /// Opens the first sessions to the destination ([`INITIAL_SESSIONS`] of at most
    /// `cfg.parallelism`), each with its replication origin (created if missing) set up.
    pub async fn connect(cfg: ApplyConfig) -> Result<ShadowApplier, ApplyError> {
        let parallelism = cfg.parallelism.max(1);
        let initial = parallelism.min(INITIAL_SESSIONS);
        // Concurrently: each open is a connection and a setup round trip.
        let mut sessions = futures_util::future::try_join_all(
            (0..initial).map(|worker| Session::open(&cfg, worker)),
        )
        .await?;
        info!(
            migration_id = cfg.migration_id,
            sessions = initial,
            parallelism,
            start_lsn = %format_lsn(cfg.start_lsn),
            "apply sessions connected"
        );
        // Pop order = worker order, which keeps logs readable.
        sessions.reverse();
        let watermark = AppliedWatermark::new(cfg.start_lsn);
        let flusher = DurableFlusher::start(&cfg, watermark.watcher()).await?;
        Ok(ShadowApplier {
            scheduler: DependencyScheduler::new(parallelism * PENDING_PER_SESSION),
            watermark,
            flusher,
            final_durable: None,
            cfg,
            idle_sessions: sessions,
            running: JoinSet::new(),
            opening: JoinSet::new(),
            sessions_started: initial,
            max_sessions: parallelism,
            jobs: HashMap::new(),
            next_seq: 1,
            txns_applied: 0,
            txns_batched: 0,
            batches_failed: 0,
            static_changes: 0,
            native_changes: 0,
            idle_lsn: None,
            failed: None,
        })
    }

    pub fn migration_id(&self) -> u64 {
        self.cfg.migration_id
    }

    /// Every transaction submitted whose end LSN is at most this is committed on the destination
    /// (catch-up shadows asynchronously: visible there, not yet necessarily flushed). What the
    /// sync barrier and validations wait for.
    pub fn applied_lsn(&self) -> u64 {
        self.watermark.applied_lsn()
    }

    /// Every transaction submitted whose end LSN is at most this is committed and flushed on the
    /// destination: what the source's slot may be confirmed to. At most
    /// [`applied_lsn`](Self::applied_lsn).
    pub fn durable_lsn(&self) -> u64 {
        self.final_durable
            .unwrap_or_else(|| self.flusher.durable_lsn())
            .min(self.applied_lsn())
    }

    /// Shadow transactions committed so far (empty transactions count as applied).
    pub fn txns_applied(&self) -> u64 {
        self.txns_applied
    }

    /// Of [`txns_applied`](Self::txns_applied), those committed by a call of an apply
    /// session's batch procedure (decision 0035).
    pub fn txns_batched(&self) -> u64 {
        self.txns_batched
    }

    /// Batch calls that failed: a transaction that could not commit (it is then applied alone
    /// and reports its own error, or commits that way), or a batch statement that could not be
    /// prepared or run.
    pub fn batches_failed(&self) -> u64 {
        self.batches_failed
    }

    /// Changes that batches ran as static statements of their session's procedure (the first
    /// shapes a session sees; the others run by `EXECUTE`).
    pub fn static_changes(&self) -> u64 {
        self.static_changes
    }

    /// Changes run by the node's `remus.apply_batch` in batch calls that succeeded.
    pub fn native_changes(&self) -> u64 {
        self.native_changes
    }

    pub fn progress(&self) -> ApplyProgress {
        ApplyProgress {
            applied_lsn: self.applied_lsn(),
            txns_applied: self.txns_applied,
            durable_lsn: self.durable_lsn(),
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

    /// An error once the destination could not be flushed (the durable position would stop
    /// while the applied one goes on): the call ends, as on any lost destination session.
    pub fn check_durable(&self) -> Result<(), ApplyError> {
        match self.flusher.failure() {
            Some(message) => Err(ApplyError::Flush(message)),
            None => Ok(()),
        }
    }

    /// Accepts the next source transaction (in source commit order) and starts it as soon as it
    /// does not depend on anything outstanding. Waits for completions while too many are
    /// pending; a failure of any transaction is returned from here or from
    /// [`next_completion`](Self::next_completion).
    pub async fn submit(&mut self, txn: ShadowTxn) -> Result<(), ApplyError> {
        self.check_failed()?;
        let prepared = prepare(&txn, self.cfg.batch > 1)?;
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
        self.assign_sessions();
        // Ready transactions left with every session busy: one more session, up to the limit.
        // One at a time, so that a backlog grows the sessions in steps rather than forking a
        // burst of backends on the destination at once.
        if self.scheduler.ready_len() > 0
            && self.opening.is_empty()
            && self.sessions_started < self.max_sessions
        {
            let worker = self.sessions_started;
            self.sessions_started += 1;
            let cfg = self.cfg.clone();
            self.opening
                .spawn(async move { Session::open(&cfg, worker).await }.in_current_span());
        }
    }

    /// Hands ready transactions to idle sessions: one each, or with batches on
    /// ([`ApplyConfig::batch`]) every ready one that can run in a batch, up to the limit, in
    /// source order. Ready transactions depend on nothing outstanding, so those of one batch
    /// do not depend on each other.
    fn assign_sessions(&mut self) {
        while !self.idle_sessions.is_empty() {
            let Some(spec) = self.scheduler.next_ready() else {
                break;
            };
            let first = self
                .jobs
                .remove(&spec.seq)
                .expect("every scheduled seq has a prepared job");
            let mut seqs = vec![spec.seq];
            let mut jobs = vec![first];
            // The next ready ones while the batch has room and each can run in one.
            while jobs[0].batchable() && jobs.len() < self.cfg.batch {
                let Some(next) = self.scheduler.peek_ready() else {
                    break;
                };
                if !self.jobs.get(&next).is_some_and(|j| j.batchable()) {
                    break;
                }
                let spec = self.scheduler.next_ready().expect("peeked above");
                seqs.push(spec.seq);
                jobs.push(
                    self.jobs
                        .remove(&spec.seq)
                        .expect("every scheduled seq has a prepared job"),
                );
            }
            let session = self.idle_sessions.pop().expect("checked non-empty");
            debug!(
                migration_id = self.cfg.migration_id,
                worker = session.worker,
                xid = jobs[0].xid,
                seq = seqs[0],
                transactions = jobs.len(),
                "applying"
            );
            self.running.spawn(
                async move {
                    let refs: Vec<&Prepared> = jobs.iter().map(|j| j.as_ref()).collect();
                    let applied = session.apply_many(&refs).await;
                    Completion {
                        session,
                        seqs,
                        applied,
                    }
                }
                .in_current_span(),
            );
        }
    }

    /// Waits for the next shadow transaction to commit (or fail) and returns the new applied
    /// position if it advanced. Pends forever while nothing is running. Cancel-safe.
    pub async fn next_completion(&mut self) -> Result<Option<u64>, ApplyError> {
        self.check_failed()?;
        let joined = tokio::select! {
            Some(joined) = self.running.join_next() => joined,
            Some(opened) = self.opening.join_next() => {
                self.session_opened(opened);
                self.dispatch();
                return Ok(None);
            }
            else => return std::future::pending().await,
        };
        let Completion {
            session,
            seqs,
            applied:
                Applied {
                    committed,
                    batched,
                    batch_failed,
                    static_changes,
                    native_changes,
                    failure,
                },
        } = match joined {
            Ok(c) => c,
            Err(e) => {
                let err = ApplyError::SessionLost(e.to_string());
                self.failed = Some(err.to_string());
                return Err(err);
            }
        };
        self.idle_sessions.push(session);
        self.txns_batched += batched as u64;
        self.batches_failed += u64::from(batch_failed);
        self.static_changes += static_changes as u64;
        self.native_changes += native_changes as u64;
        let mut advanced = None;
        for &seq in &seqs[..committed] {
            self.scheduler
                .complete(seq)
                .expect("a transaction handed out by the scheduler completes once");
            self.txns_applied += 1;
            advanced = self.watermark.complete(seq)?.or(advanced);
        }
        if let Some(e) = failure {
            let seq = seqs[committed];
            warn!(migration_id = self.cfg.migration_id, seq, error = %e, "shadow transaction failed");
            self.failed = Some(e.to_string());
            return Err(e);
        }
        let advanced = self.fold_idle().or(advanced);
        self.dispatch();
        Ok(advanced)
    }

    /// A session opened for [`Self::dispatch`] joins the idle ones. One that failed to open is
    /// warned and caps the sessions at those already open: the call goes on with them (it
    /// has at least the first ones).
    fn session_opened(
        &mut self,
        opened: Result<Result<Session, ApplyError>, tokio::task::JoinError>,
    ) {
        match opened {
            Ok(Ok(session)) => {
                info!(
                    migration_id = self.cfg.migration_id,
                    worker = session.worker,
                    "apply session added"
                );
                self.idle_sessions.push(session);
            }
            Ok(Err(e)) => self.session_not_opened(&e),
            Err(e) => self.session_not_opened(&e),
        }
    }

    fn session_not_opened(&mut self, e: &dyn std::fmt::Display) {
        warn!(migration_id = self.cfg.migration_id, error = %e, "an apply session could not be added; going on with those open");
        self.max_sessions = self.sessions_started;
    }

    /// Waits until everything submitted is committed, and for sessions still opening.
    pub async fn drain(&mut self) -> Result<(), ApplyError> {
        self.dispatch();
        while !self.running.is_empty() || !self.opening.is_empty() {
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

    /// Applies everything outstanding, flushes it on the destination, detaches the sessions
    /// from their origins and drops the migration's origins. Returns the final progress
    /// (durable = applied).
    pub async fn finish(mut self) -> Result<ApplyProgress, ApplyError> {
        self.drain().await?;
        self.flusher.stop();
        let teardown = |e: tokio_postgres::Error| ApplyError::Teardown(pg_message(&e));
        {
            let first = self
                .idle_sessions
                .first()
                .ok_or_else(|| ApplyError::Teardown("no apply session left".into()))?;
            let applied = self.applied_lsn();
            first
                .client
                .simple_query(&flush_sql(self.cfg.migration_id, self.cfg.parallelism))
                .await
                .map_err(|e| ApplyError::Flush(pg_message(&e)))?;
            self.final_durable = Some(applied);
        }
        for s in &self.idle_sessions {
            s.reset().await.map_err(teardown)?;
        }
        let names: Vec<String> = (0..self.cfg.parallelism.max(1))
            .map(|w| quote_literal(&apply_origin(self.cfg.migration_id, w)))
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
            txns_batched = self.txns_batched,
            batches_failed = self.batches_failed,
            static_changes = self.static_changes,
            native_changes = self.native_changes,
            "apply finished, origins dropped"
        );
        Ok(progress)
    }

    /// Stops: cancels running transactions (uncommitted ones roll back when their connection
    /// closes), detaches idle sessions from their origins and closes everything. The origins
    /// are left in place; the coordinator drops `remus_m<id>_%` origins when it rolls the
    /// migration back.
    pub async fn abort(mut self) {
        self.flusher.stop();
        self.running.abort_all();
        // A session still opening closes when its task is aborted.
        self.opening.abort_all();
        while let Some(joined) = self.running.join_next().await {
            if let Ok(Completion { session, .. }) = joined {
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
            durable_lsn = %format_lsn(self.durable_lsn()),
            "apply stopped; replication origins left for the coordinator to drop"
        );
    }
}
