//! The source side of a running migration: streams the slot's pgoutput, assembles whole committed
//! transactions and ships them to the replay worker over gRPC; feeds the replay worker's durable
//! position back to the slot, so `confirmed_flush_lsn` means "committed and flushed on the
//! target" (catch-up shadows commit asynchronously, decision 0018). The applied position, ahead
//! of it, is what the driver's waits (sync points, the barrier, the handover) compare.
//!
//! The replication client is blocking libpq, so the stream is read on a dedicated OS thread; it
//! talks to the async side through a bounded channel (back-pressure: a slow target slows the
//! reading, it does not grow memory) and two atomics.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use remus_proto::v1::replay_worker_client::ReplayWorkerClient;
use remus_proto::v1::{apply_request, ApplyFinish, ApplyRequest, ApplyStart};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tracing::{info, warn};
use wal_propagator::{
    AssembleError, Assembled, AssemblerConfig, DecodeError, Lsn, PgOutputMessage,
    ReplicationConnection, ReplicationError, ReplicationMessage, TxnAssembler,
};

#[derive(Debug, Error)]
pub enum PropagatorError {
    #[error("replication stream: {0}")]
    Replication(#[from] ReplicationError),
    #[error("decoding pgoutput: {0}")]
    Decode(#[from] DecodeError),
    #[error("assembling transactions: {0}")]
    Assemble(#[from] AssembleError),
    #[error("replay worker at {endpoint}: {detail}")]
    Replay { endpoint: String, detail: String },
    /// The stream thread stopped before it was asked to, with this error.
    #[error("the replication stream from the source ended early: {0}")]
    StreamEnded(String),
    #[error("propagator thread panicked")]
    Panicked,
}

/// Progress shared between the stream thread, the replay acknowledgements and the driver.
#[derive(Debug, Default)]
pub struct Progress {
    /// Every source transaction ending at or before this LSN is committed on the target (maybe
    /// not yet flushed there): what the driver waits for.
    pub applied_lsn: AtomicU64,
    /// Every source transaction ending at or before this LSN is committed and flushed on the
    /// target: what the slot is confirmed to. At most `applied_lsn`.
    pub durable_lsn: AtomicU64,
    pub txns_applied: AtomicU64,
    pub txns_shipped: AtomicU64,
    stop: AtomicBool,
    /// Set when the replay call ended with an error; the driver reads it.
    pub failed: std::sync::Mutex<Option<String>>,
    /// Set when the stream thread ended on an error: why, for the migration's error (the
    /// thread's own result is read only when the propagator is stopped).
    stream_failed: std::sync::Mutex<Option<String>>,
}

impl Progress {
    pub fn applied(&self) -> Lsn {
        Lsn(self.applied_lsn.load(Ordering::Acquire))
    }

    pub fn durable(&self) -> Lsn {
        Lsn(self.durable_lsn.load(Ordering::Acquire))
    }

    pub fn failure(&self) -> Option<String> {
        self.failed.lock().map(|f| f.clone()).unwrap_or(None)
    }
}

/// A propagator running for one migration.
pub struct Propagator {
    pub progress: Arc<Progress>,
    requests: mpsc::Sender<ApplyRequest>,
    stream_thread: Option<JoinHandle<Result<ReplicationConnection, PropagatorError>>>,
    acks: Option<tokio::task::JoinHandle<()>>,
    endpoint: String,
}

impl Propagator {
    /// Opens the Apply call on the replay worker and starts streaming `slot` from `start`.
    // One caller (the driver's catch-up), which names every argument it passes.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        migration_id: u64,
        replay_endpoint: &str,
        destination_conninfo: String,
        conn: ReplicationConnection,
        slot: String,
        publication: String,
        start: Lsn,
        parallelism: u32,
        validation_sessions: u32,
        failpoints: crate::failpoint::Failpoints,
    ) -> Result<Self, PropagatorError> {
        let replay_err = |detail: String| PropagatorError::Replay {
            endpoint: replay_endpoint.to_string(),
            detail,
        };
        let mut client = ReplayWorkerClient::connect(replay_endpoint.to_string())
            .await
            .map_err(|e| replay_err(e.to_string()))?
            .max_decoding_message_size(256 * 1024 * 1024)
            .max_encoding_message_size(256 * 1024 * 1024);
        let (tx, rx) = mpsc::channel::<ApplyRequest>(256);
        tx.send(ApplyRequest {
            msg: Some(apply_request::Msg::Start(ApplyStart {
                migration_id,
                destination_conninfo,
                parallelism,
                start_lsn: start.0,
                validation_sessions,
            })),
        })
        .await
        .map_err(|_| replay_err("request channel closed".into()))?;
        let mut acks = client
            .apply(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| replay_err(s.message().to_string()))?
            .into_inner();
        let progress = Arc::new(Progress::default());
        progress.applied_lsn.store(start.0, Ordering::Release);
        progress.durable_lsn.store(start.0, Ordering::Release);

        let p = progress.clone();
        let ack_task = tokio::spawn(async move {
            loop {
                match acks.next().await {
                    Some(Ok(a)) => {
                        p.applied_lsn.fetch_max(a.applied_lsn, Ordering::AcqRel);
                        p.durable_lsn.fetch_max(a.durable_lsn, Ordering::AcqRel);
                        p.txns_applied.store(a.txns_applied, Ordering::Release);
                    }
                    Some(Err(status)) => {
                        if let Ok(mut f) = p.failed.lock() {
                            *f = Some(status.message().to_string());
                        }
                        break;
                    }
                    None => {
                        // Only a stop ends the call cleanly; anything else is a lost worker.
                        if !p.stop.load(Ordering::Acquire) {
                            if let Ok(mut f) = p.failed.lock() {
                                f.get_or_insert_with(|| "the replay call ended".into());
                            }
                        }
                        break;
                    }
                }
            }
        });

        let p = progress.clone();
        let thread_tx = tx.clone();
        let stream_thread = std::thread::Builder::new()
            .name(format!("propagator-m{migration_id}"))
            .spawn(move || {
                let streamed = stream_loop(
                    migration_id,
                    conn,
                    &slot,
                    &publication,
                    start,
                    thread_tx,
                    &p,
                    &failpoints,
                );
                if let Err(e) = &streamed {
                    if let Ok(mut f) = p.stream_failed.lock() {
                        f.get_or_insert_with(|| e.to_string());
                    }
                }
                streamed
            })
            .expect("spawning a thread");
        Ok(Self {
            progress,
            requests: tx,
            stream_thread: Some(stream_thread),
            acks: Some(ack_task),
            endpoint: replay_endpoint.to_string(),
        })
    }

    /// Waits until the target has applied everything up to `lsn`, failing early if the stream
    /// thread or the replay call fails.
    pub async fn wait_applied(&self, lsn: Lsn) -> Result<(), PropagatorError> {
        loop {
            if self.progress.applied() >= lsn {
                return Ok(());
            }
            self.check()?;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// An error if the replay call or the stream thread has ended.
    pub fn check(&self) -> Result<(), PropagatorError> {
        if let Some(f) = self.progress.failure() {
            return Err(PropagatorError::Replay {
                endpoint: self.endpoint.clone(),
                detail: f,
            });
        }
        if self.stream_thread.as_ref().is_some_and(|t| t.is_finished()) {
            let why = self
                .progress
                .stream_failed
                .lock()
                .ok()
                .and_then(|f| f.clone())
                .unwrap_or_else(|| "no error recorded".into());
            return Err(PropagatorError::StreamEnded(why));
        }
        Ok(())
    }

    /// Stops streaming and returns the replication connection (for dropping the slot). With
    /// `finish`, the replay worker is told to finish cleanly (it drops its replication origins)
    /// and this waits for it; otherwise the call is abandoned.
    pub async fn stop(mut self, finish: bool) -> Result<ReplicationConnection, PropagatorError> {
        self.progress.stop.store(true, Ordering::Release);
        let thread = self.stream_thread.take().expect("stopped once");
        let conn = tokio::task::spawn_blocking(move || thread.join())
            .await
            .map_err(|_| PropagatorError::Panicked)?
            .map_err(|_| PropagatorError::Panicked)?;
        if finish {
            let _ = self
                .requests
                .send(ApplyRequest {
                    msg: Some(apply_request::Msg::Finish(ApplyFinish {})),
                })
                .await;
        }
        drop(self.requests);
        if let Some(acks) = self.acks.take() {
            if finish {
                let _ = acks.await;
            } else {
                acks.abort();
            }
        }
        if finish {
            if let Some(f) = self.progress.failure() {
                return Err(PropagatorError::Replay {
                    endpoint: self.endpoint,
                    detail: f,
                });
            }
        }
        conn
    }
}

// One caller (`Propagator::start`), which names every argument it passes.
#[allow(clippy::too_many_arguments)]
fn stream_loop(
    migration_id: u64,
    conn: ReplicationConnection,
    slot: &str,
    publication: &str,
    start: Lsn,
    tx: mpsc::Sender<ApplyRequest>,
    progress: &Progress,
    failpoints: &crate::failpoint::Failpoints,
) -> Result<ReplicationConnection, PropagatorError> {
    let mut stream = conn.start_streaming(slot, start, publication)?;
    info!(migration_id, phase = "catchup", slot, %start, "streaming started");
    let mut assembler = TxnAssembler::new(AssemblerConfig::default());
    let mut confirmed = start;
    // Test-only: a slower replay (failpoint `catchup.slow_replay`), looked up twice a second.
    let mut slow_replay = (
        std::time::Instant::now(),
        failpoints.delay(crate::failpoint::CATCHUP_SLOW_REPLAY),
    );
    // The stream's position between transactions (a closed call shows at the next one).
    let send_idle = |lsn: u64| {
        let _ = tx.blocking_send(ApplyRequest {
            msg: Some(apply_request::Msg::IdleLsn(lsn)),
        });
    };
    let result = (|| -> Result<(), PropagatorError> {
        while !progress.stop.load(Ordering::Acquire) {
            // Only what the target has flushed is confirmed (it becomes the slot's
            // confirmed_flush_lsn): a target crash may lose asynchronously committed shadows
            // past it, and the source must still have them.
            let durable = progress.durable();
            if durable > confirmed {
                let applied = progress.applied().max(durable);
                stream.send_feedback(applied, durable, applied)?;
                confirmed = durable;
            }
            match stream.recv(Duration::from_millis(50))? {
                None => {}
                Some(ReplicationMessage::XLogData(x)) => {
                    let msg = PgOutputMessage::decode(x.data)?;
                    let assembled = assembler.push(msg)?;
                    // A non-transactional message (a validating source transaction's stream
                    // mark, decision 0036) is decoded in WAL order outside any transaction:
                    // every transaction committed before it has been sent.
                    if let Some(Assembled::Message(m)) = &assembled {
                        if !assembler.in_transaction() {
                            send_idle(m.lsn.0);
                        }
                    }
                    if let Some(Assembled::Txn(txn)) = assembled {
                        let shadow = wal_propagator::ship::shadow_txn(&txn, migration_id);
                        progress.txns_shipped.fetch_add(1, Ordering::AcqRel);
                        if tx
                            .blocking_send(ApplyRequest {
                                msg: Some(apply_request::Msg::Txn(shadow)),
                            })
                            .is_err()
                        {
                            return Err(PropagatorError::Replay {
                                endpoint: String::new(),
                                detail: "the replay call ended".into(),
                            });
                        }
                        if slow_replay.0.elapsed() >= Duration::from_millis(500) {
                            slow_replay = (
                                std::time::Instant::now(),
                                failpoints.delay(crate::failpoint::CATCHUP_SLOW_REPLAY),
                            );
                        }
                        if let Some(d) = slow_replay.1 {
                            std::thread::sleep(d);
                        }
                    }
                }
                // Between transactions everything up to the server's position has been
                // sent: the target may report it applied once it has applied what we sent.
                Some(ReplicationMessage::PrimaryKeepalive(k)) if !assembler.in_transaction() => {
                    send_idle(k.wal_end.0);
                }
                Some(ReplicationMessage::PrimaryKeepalive(_)) => {}
            }
        }
        Ok(())
    })();
    if let Err(e) = &result {
        warn!(migration_id, phase = "catchup", error = %e, "propagator stopped on error");
    }
    let conn = stream.stop()?;
    result.map(|_| conn)
}
