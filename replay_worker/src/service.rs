//! The `ReplayWorker` gRPC service: one `Apply` call per migration drives one [`ShadowApplier`].
//!
//! The call is the migration's lifetime on the destination. Its request stream carries `start`,
//! then the source transactions in commit order, keepalive `idle_lsn`s and finally `finish`; the
//! response stream carries the applied position and the durable position behind it (what the
//! destination has flushed, decision 0018), coalesced (at most one message per progress
//! interval, and only when one of them moved; the final one, durable = applied, is always
//! sent), so the coordinator can confirm the slot (to the durable position) and run the sync
//! barrier (on the applied one) without a message per transaction.
//!
//! How a call ends decides what happens to the migration's replication origins:
//! - `finish`: everything is applied, the final progress is sent, the sessions are detached
//!   from their origins and the origins are dropped; the stream then ends with OK.
//! - apply error: the call ends with a Status carrying the error (divergence is
//!   FAILED_PRECONDITION); the sessions are closed and the origins are left.
//! - client disconnect (the call is cancelled or the response stream dropped) or a request
//!   stream that ends without `finish` (the call ends with ABORTED): running transactions are
//!   cancelled (they roll back), the sessions are reset and closed, and the origins are left. The coordinator drops `remus_m<id>_%` origins when it rolls the migration back.
//!
//! While an `Apply` call runs, its migration is registered for `Validate` and `Resolve` (MOCC
//! dual execution, see [`crate::validate`]): they need the call's applied position and the
//! destination. Their sessions are bound to origins `remus_m<id>_v<k>`; `finish` stops new
//! validations, drains the stream (resolutions still run), then detaches and drops those
//! origins; any other end detaches and leaves them. A migration without a running call answers
//! FAILED_PRECONDITION.
//!
//! Every log line of a call carries its `migration_id` (through the call's tracing span).

use std::future::Future;
use std::time::Duration;

use remus_proto::v1::replay_worker_server::{ReplayWorker, ReplayWorkerServer};
use std::sync::Arc;

use remus_proto::v1::{
    apply_request, ApplyProgress, ApplyRequest, ResolveReply, ResolveRequest, ValidateReply,
    ValidateRequest,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::StreamExt;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::{info, info_span, warn, Instrument};

use crate::apply::{format_lsn, ApplyConfig, ApplyError, ShadowApplier};
use crate::validate::{Chunks, ValidateError, Validator, ValidatorRegistry, Verdict, STREAM_WAIT};

/// Largest request accepted: one source transaction is one `Apply` message, and bulk
/// transactions are big (tonic's default limit is 4 MiB). Matches what the coordinator's client
/// sends. (A `Validate` write set has no such limit: it comes in chunks, review F10.)
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// Default minimum spacing of progress messages. The coordinator's waits for the target to
/// reach a sync point (catch-up rounds, the sync barrier, cleanup's final pass) end on these
/// messages, so their spacing is added to each such wait: at 50 ms the barrier's wait under the
/// anchors' E1 took 20-70 ms, all of it in sync mode, where every writer of the moving shards
/// waits for its validation. A message is sent only when the position moved.
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(5);

/// gRPC status for an apply error.
pub fn status_of(e: &ApplyError) -> Status {
    let code = match e {
        ApplyError::Connect { .. } => Code::Unavailable,
        ApplyError::Setup { .. } | ApplyError::Divergence { .. } => Code::FailedPrecondition,
        ApplyError::Malformed { .. } | ApplyError::Order(_) => Code::InvalidArgument,
        ApplyError::Failed(_) => Code::Aborted,
        ApplyError::Statement { .. }
        | ApplyError::SessionLost(_)
        | ApplyError::Teardown(_)
        | ApplyError::Flush(_) => Code::Internal,
    };
    Status::new(code, e.to_string())
}

/// Implementation of the `ReplayWorker` service.
#[derive(Clone)]
pub struct ReplayWorkerService {
    progress_interval: Duration,
    /// Longest wait of a `Validate` for its migration's stream to reach `wait_lsn`.
    stream_wait: Duration,
    /// Migrations with a running `Apply` call: `Validate` and `Resolve` need their stream.
    validators: ValidatorRegistry,
}

impl std::fmt::Debug for ReplayWorkerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayWorkerService")
            .field("progress_interval", &self.progress_interval)
            .finish()
    }
}

fn validate_status(e: &ValidateError) -> Status {
    let code = match e {
        ValidateError::StreamTimeout { .. } => Code::DeadlineExceeded,
        ValidateError::StreamEnded(_) => Code::Unavailable,
        ValidateError::Malformed(_) | ValidateError::BadGid { .. } => Code::InvalidArgument,
        ValidateError::Session { .. } => Code::Unavailable,
        ValidateError::Destination(_) => Code::Internal,
        ValidateError::RequestStream(_) => Code::Cancelled,
    };
    Status::new(code, e.to_string())
}

impl Default for ReplayWorkerService {
    fn default() -> Self {
        Self::new()
    }
}

impl ReplayWorkerService {
    pub fn new() -> Self {
        Self {
            progress_interval: PROGRESS_INTERVAL,
            stream_wait: STREAM_WAIT,
            validators: Arc::default(),
        }
    }

    /// Minimum spacing of progress messages (default [`PROGRESS_INTERVAL`]).
    pub fn with_progress_interval(mut self, interval: Duration) -> Self {
        self.progress_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Longest wait of a `Validate` for the stream to reach its `wait_lsn` (default
    /// [`STREAM_WAIT`]); past it the call fails with DEADLINE_EXCEEDED.
    pub fn with_stream_wait(mut self, wait: Duration) -> Self {
        self.stream_wait = wait;
        self
    }

    /// The tonic service, accepting messages up to [`MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> ReplayWorkerServer<Self> {
        ReplayWorkerServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

/// Serves the `ReplayWorker` service on `listener` until `shutdown` resolves. In-process use
/// (tests, a node agent): bind a [`TcpListener`], spawn this, connect a
/// `ReplayWorkerClient` to the listener's address.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(ReplayWorkerService::new().into_server())
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
}

impl ReplayWorkerService {
    fn validator(&self, migration_id: u64) -> Result<Arc<Validator>, Status> {
        self.validators
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&migration_id)
            .cloned()
            .ok_or_else(|| {
                Status::failed_precondition(format!(
                    "migration {migration_id} has no apply stream in this replay worker"
                ))
            })
    }
}

/// The changes of the `Validate` messages after the first. A later message may repeat the
/// header, but not name another write set.
fn later_chunks(
    inbound: Streaming<ValidateRequest>,
    migration_id: u64,
    gid: String,
) -> Chunks<'static> {
    Box::pin(inbound.map(move |m| match m {
        Ok(m)
            if (m.migration_id == 0 || m.migration_id == migration_id)
                && (m.gid.is_empty() || m.gid == gid) =>
        {
            Ok(m.changes)
        }
        Ok(m) => Err(ValidateError::Malformed(format!(
            "a later chunk names write set {}/{:?}, not {migration_id}/{gid:?}",
            m.migration_id, m.gid
        ))),
        Err(status) => Err(ValidateError::RequestStream(status.message().to_string())),
    }))
}

fn describe(msg: &apply_request::Msg) -> &'static str {
    match msg {
        apply_request::Msg::Start(_) => "start",
        apply_request::Msg::Txn(_) => "txn",
        apply_request::Msg::IdleLsn(_) => "idle_lsn",
        apply_request::Msg::Finish(_) => "finish",
    }
}

#[tonic::async_trait]
impl ReplayWorker for ReplayWorkerService {
    type ApplyStream = ReceiverStream<Result<ApplyProgress, Status>>;

    async fn validate(
        &self,
        request: Request<Streaming<ValidateRequest>>,
    ) -> Result<Response<ValidateReply>, Status> {
        let mut inbound = request.into_inner();
        let req = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("the Validate request stream is empty"))?;
        let validator = self.validator(req.migration_id)?;
        let span = info_span!("validate", migration_id = req.migration_id, gid = %req.gid);
        let rest = later_chunks(inbound, req.migration_id, req.gid.clone());
        let verdict = validator
            .validate(
                &req.gid,
                req.wait_lsn,
                &req.changes,
                rest,
                req.lock_timeout_ms,
            )
            .instrument(span.clone())
            .await
            .map_err(|e| {
                warn!(parent: &span, error = %e, "validation failed");
                validate_status(&e)
            })?;
        Ok(Response::new(match verdict {
            Verdict::Prepared => ValidateReply {
                ok: true,
                conflict: String::new(),
            },
            Verdict::Conflict(why) => {
                info!(parent: &span, conflict = %why, "write-write conflict; source transaction refused");
                ValidateReply {
                    ok: false,
                    conflict: why,
                }
            }
        }))
    }

    async fn resolve(
        &self,
        request: Request<ResolveRequest>,
    ) -> Result<Response<ResolveReply>, Status> {
        let req = request.into_inner();
        let validator = self.validator(req.migration_id)?;
        let found = validator
            .resolve(&req.gid, req.commit, req.commit_lsn, req.commit_time_us)
            .await
            .map_err(|e| validate_status(&e))?;
        Ok(Response::new(ResolveReply { found }))
    }

    async fn apply(
        &self,
        request: Request<Streaming<ApplyRequest>>,
    ) -> Result<Response<Self::ApplyStream>, Status> {
        let mut inbound = request.into_inner();
        let start = match inbound.message().await?.and_then(|r| r.msg) {
            Some(apply_request::Msg::Start(start)) => start,
            Some(other) => {
                return Err(Status::invalid_argument(format!(
                    "the first ApplyRequest must be start, got {}",
                    describe(&other)
                )))
            }
            None => {
                return Err(Status::invalid_argument(
                    "the request stream ended before start",
                ))
            }
        };
        if start.destination_conninfo.trim().is_empty() {
            return Err(Status::invalid_argument(
                "start.destination_conninfo is empty",
            ));
        }
        let cfg = ApplyConfig::from_start(&start);
        let span = info_span!("apply", migration_id = cfg.migration_id);
        info!(parent: &span, parallelism = cfg.parallelism, start_lsn = %format_lsn(cfg.start_lsn), "apply call started");
        let applier = ShadowApplier::connect(cfg)
            .instrument(span.clone())
            .await
            .map_err(|e| {
                warn!(parent: &span, error = %e, "apply sessions could not be set up");
                status_of(&e)
            })?;
        let migration_id = applier.migration_id();
        let validator = Arc::new(
            Validator::new(
                migration_id,
                start.destination_conninfo.clone(),
                applier.watcher(),
            )
            .with_stream_wait(self.stream_wait),
        );
        // A new call for the migration (the coordinator reconnected) replaces a previous one
        // that is still winding down; that one then unregisters only itself.
        if let Some(previous) = self
            .validators
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(migration_id, validator.clone())
        {
            warn!(parent: &span, "a previous apply call of the migration is still registered; replaced");
            previous.stop_validating();
        }
        if start.validation_sessions > 0 {
            let ahead = validator.clone();
            let n = start.validation_sessions as usize;
            tokio::spawn(async move { ahead.open_ahead(n).await }.instrument(span.clone()));
        }
        let (tx, rx) = mpsc::channel(16);
        let validators = self.validators.clone();
        let progress_interval = self.progress_interval;
        tokio::spawn(
            async move {
                run(applier, &validator, inbound, tx, progress_interval).await;
                let mut registry = validators.lock().unwrap_or_else(|p| p.into_inner());
                if registry
                    .get(&migration_id)
                    .is_some_and(|v| Arc::ptr_eq(v, &validator))
                {
                    registry.remove(&migration_id);
                }
            }
            .instrument(span),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

async fn close_leaving_origins(validator: &Validator) {
    if let Err(e) = validator.close(false).await {
        warn!(error = %e, "closing the validation sessions failed");
    }
}

enum End {
    Finish,
    Failed(Status),
    Disconnected(String),
}

async fn run(
    mut applier: ShadowApplier,
    validator: &Validator,
    mut inbound: Streaming<ApplyRequest>,
    tx: mpsc::Sender<Result<ApplyProgress, Status>>,
    progress_interval: Duration,
) {
    let mut tick = tokio::time::interval(progress_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent = applier.progress();
    let end = loop {
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(ApplyRequest { msg: Some(msg) })) => match msg {
                    apply_request::Msg::Txn(txn) => {
                        if let Err(e) = applier.submit(txn).await {
                            break End::Failed(status_of(&e));
                        }
                    }
                    apply_request::Msg::IdleLsn(lsn) => {
                        applier.idle(lsn);
                    }
                    apply_request::Msg::Finish(_) => break End::Finish,
                    apply_request::Msg::Start(_) => {
                        break End::Failed(Status::invalid_argument("start sent twice"))
                    }
                },
                Ok(Some(ApplyRequest { msg: None })) => {
                    break End::Failed(Status::invalid_argument("empty ApplyRequest"))
                }
                Ok(None) => {
                    break End::Failed(Status::aborted(
                        "the request stream ended without finish; apply stopped, origins left",
                    ))
                }
                Err(status) => break End::Disconnected(format!("request stream failed: {status}")),
            },
            completion = applier.next_completion() => {
                if let Err(e) = completion {
                    break End::Failed(status_of(&e));
                }
            }
            _ = tick.tick() => {
                if let Err(e) = applier.check_durable() {
                    break End::Failed(status_of(&e));
                }
                let now = applier.progress();
                if now.applied_lsn != sent.applied_lsn || now.durable_lsn != sent.durable_lsn {
                    if tx.send(Ok(now)).await.is_err() {
                        break End::Disconnected("response stream dropped".into());
                    }
                    sent = now;
                }
            }
            _ = tx.closed() => break End::Disconnected("response stream dropped".into()),
        }
    };
    match end {
        End::Finish => {
            // Resolutions keep working while the stream drains (a stream transaction may wait
            // for a shadow's row lock); new validations are refused.
            validator.stop_validating();
            let finished = applier.finish().await;
            let closed = validator.close(finished.is_ok()).await;
            if let Err(e) = &closed {
                // The coordinator drops every remus_m<id>_% origin at cleanup anyway.
                warn!(error = %e, "closing the validation sessions failed");
            }
            match finished {
                Ok(progress) => {
                    let _ = tx.send(Ok(progress)).await;
                    info!(
                        applied_lsn = %format_lsn(progress.applied_lsn),
                        txns_applied = progress.txns_applied,
                        "apply call finished"
                    );
                }
                Err(e) => {
                    warn!(error = %e, "finishing the apply call failed");
                    let _ = tx.send(Err(status_of(&e))).await;
                }
            }
        }
        End::Failed(status) => {
            warn!(error = %status.message(), "apply call failed");
            // The stream first: cancelling its transactions releases row locks a running
            // validation may be waiting for.
            applier.abort().await;
            close_leaving_origins(validator).await;
            let _ = tx.send(Err(status)).await;
        }
        End::Disconnected(why) => {
            warn!(why = %why, "client went away; stopping, origins left in place");
            applier.abort().await;
            close_leaving_origins(validator).await;
        }
    }
}
