//! The durable position: what of the applied position the destination has flushed, the only
//! position the source's slot may be confirmed to (decision 0018).
//!
//! Catch-up shadows commit with `synchronous_commit = off` (see [`super::sql`]), so a commit
//! that has returned may still be lost by a destination crash. A task with its own destination
//! session ([`DurableFlusher`]) waits for the applied position to move, reads it (every
//! transaction it covers has returned from COMMIT, and each commit advanced its session's
//! replication origin's `local_lsn` before returning), then calls
//! `pg_replication_origin_progress(<origin>, true)` for every apply origin of the migration:
//! that flushes the destination's WAL up to each origin's last local commit, hence past every
//! commit covered by the position read before the call. Once the call returns, that position
//! is durable.
//!
//! The remote LSN the call returns per origin is not used as the position itself: with
//! parallel sessions, one origin's last remote commit says nothing of the source transactions
//! before it that other sessions were still applying; the applied watermark is what is
//! contiguous.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use remus_proto::names::apply_origin;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, NoTls};
use tracing::{debug, trace, warn, Instrument};

use super::sql::{format_lsn, quote_literal};
use super::{pg_message, ApplyConfig, ApplyError};
use crate::progress::AppliedLsnWatcher;

/// Shortest spacing of two flushes: commits that complete meanwhile share one WAL flush.
pub(super) const FLUSH_INTERVAL: Duration = Duration::from_millis(20);

/// `SELECT pg_replication_origin_progress(o, true)` over every apply origin of the migration:
/// the destination's WAL is flushed up to the last local commit of each.
pub(super) fn flush_sql(migration_id: u64, parallelism: usize) -> String {
    let names: Vec<String> = (0..parallelism.max(1))
        .map(|w| quote_literal(&apply_origin(migration_id, w)))
        .collect();
    format!(
        "SELECT pg_catalog.pg_replication_origin_progress(n, true)::text \
           FROM unnest(ARRAY[{}]::text[]) n \
          WHERE pg_catalog.pg_replication_origin_oid(n) IS NOT NULL",
        names.join(", ")
    )
}

/// The task that turns the applied position into the durable one.
pub(super) struct DurableFlusher {
    task: JoinHandle<()>,
    durable: watch::Receiver<u64>,
    failed: Arc<Mutex<Option<String>>>,
}

impl DurableFlusher {
    /// Connects its own destination session and starts flushing behind `applied`, from
    /// `cfg.start_lsn` (durable already: it is where the slot stands).
    pub(super) async fn start(
        cfg: &ApplyConfig,
        applied: AppliedLsnWatcher,
    ) -> Result<DurableFlusher, ApplyError> {
        let connect_err = |e: tokio_postgres::Error| ApplyError::Connect {
            worker: cfg.parallelism,
            message: format!("durable-position session: {}", pg_message(&e)),
        };
        let (client, connection) = tokio_postgres::connect(&cfg.destination_conninfo, NoTls)
            .await
            .map_err(connect_err)?;
        let migration_id = cfg.migration_id;
        let connection = tokio::spawn(
            async move {
                if let Err(e) = connection.await {
                    warn!(migration_id, error = %pg_message(&e), "durable-position connection ended");
                }
            }
            .in_current_span(),
        );
        client
            .batch_execute(&format!(
                "SET application_name = {}",
                quote_literal(&format!("remus-replay m{migration_id} flush"))
            ))
            .await
            .map_err(connect_err)?;
        let (tx, durable) = watch::channel(cfg.start_lsn);
        let failed = Arc::new(Mutex::new(None));
        let sql = flush_sql(migration_id, cfg.parallelism);
        let task = tokio::spawn(
            flush_loop(client, connection, applied, tx, failed.clone(), sql).in_current_span(),
        );
        Ok(DurableFlusher {
            task,
            durable,
            failed,
        })
    }

    /// Every source transaction ending at or before this is committed and flushed on the
    /// destination.
    pub(super) fn durable_lsn(&self) -> u64 {
        *self.durable.borrow()
    }

    /// Why flushing stopped, if it did (the destination went away).
    pub(super) fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops the task (its session closes with it).
    pub(super) fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for DurableFlusher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn flush_loop(
    client: Client,
    connection: JoinHandle<()>,
    applied: AppliedLsnWatcher,
    tx: watch::Sender<u64>,
    failed: Arc<Mutex<Option<String>>>,
    sql: String,
) {
    let mut durable = *tx.borrow();
    loop {
        // The applied watermark going away ends the apply call; so does this.
        if applied.wait_for(durable.saturating_add(1)).await.is_err() {
            break;
        }
        tokio::time::sleep(FLUSH_INTERVAL).await;
        // Read before the flush: every transaction it covers has committed already.
        let position = applied.applied_lsn();
        match client.simple_query(&sql).await {
            Ok(_) => {
                durable = position;
                tx.send_replace(position);
                trace!(durable_lsn = %format_lsn(position), "durable position advanced");
            }
            Err(e) => {
                let message = pg_message(&e);
                warn!(error = %message, durable_lsn = %format_lsn(durable), "flushing the destination failed; the durable position stays");
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(message);
                break;
            }
        }
    }
    debug!("durable-position task ended");
    drop(client);
    connection.abort();
}
