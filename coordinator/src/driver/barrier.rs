//! Remus: the sync barrier, between catch-up and dual execution. Writers whose write sets are
//! incomplete are waited for, the source switches to sync mode (`remus.sync_barrier`, the
//! extension's half of the barrier), 2PC participants prepared before it are waited for, the
//! target applies the stream up to there, and the source's validations stop waiting for the
//! stream (`remus.migration_barrier_applied`). The lock waits here serve cleanup and resume too.

use std::time::Instant;

use tracing::info;
use wal_propagator::Lsn;

use super::{sql, DriverError, Run};
use crate::failpoint;

impl Run {
    /// The sync barrier: wait for the writers whose write sets are incomplete, switch the
    /// source to sync mode (TS_unsync drains inside `remus.sync_barrier`), wait for the 2PC
    /// participants prepared in async mode, then until the target applied everything up to
    /// there. From then on every source commit on the shards is validated on the target, and
    /// without waiting for the stream: its write-write predecessors are applied there or
    /// prepared shadows whose row locks its validation waits for.
    pub(super) async fn sync_barrier(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let started = Instant::now();
        let writers = self.state.pre_capture_writers.clone();
        self.wait_for_lockers(
            &writers,
            "transactions that were writing the shards when the migration started",
        )
        .await?;
        let writers_waited = started.elapsed();
        let source = self.source_session().await?;
        let lsn_unsync: i64 = source
            .query_one(&format!("SELECT remus.sync_barrier({id})"), &[])
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        let set = started.elapsed();
        self.config
            .failpoints
            .pause(failpoint::BARRIER_SET, id)
            .await;
        // Prepared transactions (2PC participants) hold their shard locks without a backend;
        // those prepared before sync mode committed unvalidated, and must be applied before
        // the handover. Newer ones are validated already; waiting for them too is harmless.
        let prepared = self.prepared_shard_lockers().await?;
        self.wait_for_lockers(&prepared, "transactions prepared before the sync barrier")
            .await?;
        let prepared_waited = started.elapsed();
        let lsn = self.sync_point().await?;
        let sync_point = started.elapsed();
        self.wait_applied(lsn).await?;
        // Every source commit before the sync point is applied on the target, every one after
        // it is validated: validations wait for the stream only up to the sync point (and no
        // longer flush for it).
        source
            .batch_execute(&format!(
                "SELECT remus.migration_barrier_applied({id}, {})",
                lsn.0
            ))
            .await
            .map_err(sql(&self.plan.source))?;
        // Where the barrier's time goes (each a time since its start): the writers of the
        // migration's start, the source's switch to sync mode, the 2PC participants, the sync
        // point's emission, then the target applying up to it.
        info!(
            migration_id = id,
            phase = "barrier",
            lsn_unsync = %Lsn(lsn_unsync as u64),
            writers_ms = writers_waited.as_millis() as u64,
            set_ms = set.as_millis() as u64,
            prepared_ms = prepared_waited.as_millis() as u64,
            sync_point_ms = sync_point.as_millis() as u64,
            ms = started.elapsed().as_millis() as u64,
            "sync barrier set; dual execution on"
        );
        Ok(())
    }

    /// Prepared transactions (2PC participants: no backend) holding locks on the source's shard
    /// tables, as virtual xids.
    pub(super) async fn prepared_shard_lockers(&self) -> Result<Vec<String>, DriverError> {
        let source = self.source_session().await?;
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
    pub(super) async fn wait_for_lockers(
        &self,
        vxids: &[String],
        what: &str,
    ) -> Result<(), DriverError> {
        if vxids.is_empty() {
            return Ok(());
        }
        let source = self.source_session().await?;
        let query = format!(
            "SELECT count(DISTINCT virtualtransaction), min(pid) FROM pg_locks
              WHERE relation = ANY({}) AND virtualtransaction = ANY($1)",
            self.regclass_array()
        );
        let mut reported = false;
        let started = Instant::now();
        loop {
            let row = source
                .query_one(&query, &[&vxids])
                .await
                .map_err(sql(&self.plan.source))?;
            let n: i64 = row.get(0);
            if n == 0 {
                break;
            }
            // Named once the wait lasts (an etcd write each way; see `NOTE_WAIT_AFTER`).
            if !reported && started.elapsed() >= super::NOTE_WAIT_AFTER {
                let pid: Option<i32> = row.get(1);
                let who = pid
                    .map(|p| format!("pid {p}"))
                    .unwrap_or_else(|| "a prepared transaction".into());
                self.reporter
                    .waiting_on(Some(self.with_stream_note(format!(
                        "{n} {what} on {} (e.g. {who})",
                        self.plan.source.name
                    ))))
                    .await;
                info!(
                    migration_id = self.id(),
                    phase = "barrier",
                    n,
                    what,
                    "waiting for transactions"
                );
                reported = true;
            }
            if let Some(p) = &self.state.propagator {
                p.check()?;
            }
            tokio::time::sleep(super::WAIT_POLL).await;
        }
        if reported {
            self.reporter.waiting_on(None).await;
        }
        Ok(())
    }
}
