//! The cleanup phase, after the Tm decision: the drain (transactions older than Tm, Remus's
//! prepared participants), the stream stopped and the slot dropped, leftover shadows resolved,
//! the source's copy, the publication and the origins dropped, the registration ended
//! (`remus.migration_end`, the extension's half).

use std::time::{Duration, Instant};

use tracing::{info, warn};
use wal_propagator::ReplicationConnection;

use remus_proto::names;

use super::{sql, DriverError, Run};
use crate::failpoint;
use crate::migration::Mode;
use crate::node_registry::NodeRecord;

impl Run {
    pub(super) async fn cleanup(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        self.config
            .failpoints
            .pause(failpoint::CLEANUP_STARTED, id)
            .await;
        let started = Instant::now();
        let step = |step: &str| step_done(id, started, step);
        if self.plan.mode == Mode::Remus {
            // Orphan shadows keep being resolved through the drain (F6); a resumed cleanup has
            // not run dual execution in this process, so its resolver starts here.
            self.start_shadow_resolver();
        }
        let stream_lost = match self.drain_after_tm(true).await {
            Ok(()) => None,
            // Remus after Tm: every source commit since the sync barrier was validated, so its
            // shadow is prepared or committed on the target already; the stream only carried
            // the commit decisions. Finish from the shadows (paper section 3.7).
            Err(DriverError::Propagator(e)) if self.plan.mode == Mode::Remus => Some(e),
            Err(e) => return Err(e),
        };
        step("drained");
        let propagator = self.state.propagator.take().expect("propagator running");
        self.state.final_txns_applied = propagator
            .progress
            .txns_applied
            .load(std::sync::atomic::Ordering::Acquire);
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
                let note = format!(
                    "the stream failed after the handover ({e}); completing from the prepared shadows"
                );
                self.reporter.waiting_on(Some(note.clone())).await;
                self.state.stream_lost = Some(note);
                // Abandoning the apply call makes the replay worker refuse validations, so
                // source transactions older than Tm that are still to commit fail now rather
                // than wait for a stream that will not come; then wait for all of them to end.
                let conn = propagator.stop(false).await.ok();
                self.drain_after_tm(false).await?;
                self.state.stream_lost = None;
                self.reporter.waiting_on(None).await;
                conn
            }
        };
        step("stream stopped");
        self.drop_slot(conn).await?;
        step("slot dropped");
        let aborted = self.finish_after_drain().await? + self.state.terminated;
        step("source copy, publication, origins and registration removed");
        let replayed = self.txns_replayed();
        self.reporter
            .update(move |r| {
                r.aborted_by_migration = aborted;
                r.txns_replayed = replayed;
            })
            .await?;
        info!(
            migration_id = id,
            phase = "cleanup",
            aborted,
            replayed,
            "source shard removed"
        );
        Ok(())
    }

    /// Remus, once the transactions older than Tm have ended: ends the drain fence on every
    /// node (`remus.migration_drain_source` with `''`). No transaction older than Tm is left for
    /// a write on the moved shards to wait for, and each fenced write costs the source a lock
    /// query until the registration ends, the rest of cleanup. Best effort: a node that does
    /// not take it keeps fencing, harmlessly, until `migration_end`.
    async fn end_drain_fence(&self) {
        if self.plan.mode != Mode::Remus {
            return;
        }
        // Each node's failure is warned; none stops cleanup.
        let _ = self
            .on_every_node_trying_all(
                &format!("SELECT remus.migration_drain_source({}, '')", self.id()),
                "cleanup",
                "the drain fence was not ended early; it ends with the registration",
            )
            .await;
    }

    /// Waits until every transaction that could still use the source shards has ended: those
    /// older than Tm on every node and (Remus) 2PC participants prepared on the source; then
    /// (Remus) ends the drain fence. With `stream`, the target then applies the source's stream
    /// up to here.
    async fn drain_after_tm(&mut self, stream: bool) -> Result<(), DriverError> {
        let started = Instant::now();
        for (node, at) in self.state.tm_committed_at.clone() {
            self.drain_older_transactions(&node, &at, "transactions older than the handover")
                .await?;
        }
        if self.plan.mode == Mode::Remus {
            // Source transactions that predate Tm kept committing (validated) after it; 2PC
            // participants among them may still be prepared. The stream carries their commits
            // (which commit their shadows): apply all of it before it stops.
            let prepared = self.prepared_shard_lockers().await?;
            self.wait_for_lockers(&prepared, "prepared transactions older than the handover")
                .await?;
            step_done(self.id(), started, "older transactions ended");
            // Nothing is left for the fence to wait for: no source transaction older than Tm
            // runs, and each one that committed has its shadow committed on the target, or
            // prepared there (a 2PC participant's, committed by the stream below), whose row
            // locks a newer writer on the target waits for as the fence would have.
            self.end_drain_fence().await;
            step_done(self.id(), started, "drain fence ended");
            if stream {
                let lsn = self.sync_point().await?;
                self.wait_applied(lsn).await?;
            }
        }
        Ok(())
    }

    /// Cleanup's last steps, once the drain is over and the slot is gone: leftover shadows
    /// resolved (Remus), the source's copy, the publication and the origins dropped (each if it
    /// is still there: a resumed run may find them gone), the registration ended. Returns the
    /// transactions the nodes counted as aborted by the migration.
    pub(super) async fn finish_after_drain(&mut self) -> Result<u64, DriverError> {
        let started = Instant::now();
        let id = self.id();
        let step = |step: &str| step_done(id, started, step);
        if self.plan.mode == Mode::Remus {
            self.resolve_shadows().await?;
            step("leftover shadows resolved");
        }
        let source = self.session(&self.plan.source).await?;
        // The last guard before the only destructive step (F3): the source's copy goes only
        // where the source's own map, committed by Tm, already names the target.
        let astray: Vec<i64> = source
            .query(
                "SELECT shard_id FROM unnest($1::bigint[]) AS s(shard_id)
                  WHERE NOT EXISTS (SELECT 1 FROM remus.shard_map m
                                     WHERE m.shard_id = s.shard_id AND m.node_name = $2)",
                &[&self.plan.shard_ids, &self.plan.target.name],
            )
            .await
            .map_err(|e| {
                self.forget_session(&self.plan.source, &source);
                sql(&self.plan.source)(e)
            })?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if !astray.is_empty() {
            return Err(DriverError::NotHandedOver {
                source_node: self.plan.source.name.clone(),
                target: self.plan.target.name.clone(),
                shards: astray,
            });
        }
        source
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {}; DROP PUBLICATION IF EXISTS {};",
                self.table_list(),
                self.publication()
            ))
            .await
            .map_err(|e| {
                self.forget_session(&self.plan.source, &source);
                sql(&self.plan.source)(e)
            })?;
        self.state.publication = false;
        step("source copy and publication dropped");
        self.drop_origins().await?;
        step("origins dropped");
        self.end_registration().await
    }

    pub(super) async fn drop_slot(
        &mut self,
        conn: Option<ReplicationConnection>,
    ) -> Result<(), DriverError> {
        let Some(slot) = self.state.slot.clone() else {
            return Ok(());
        };
        let dropped_over_stream = match conn {
            Some(mut conn) => {
                let name = slot.clone();
                let r = tokio::task::spawn_blocking(move || conn.drop_slot(&name))
                    .await
                    .map_err(|source| DriverError::Thread {
                        what: "drop slot",
                        source,
                    })?;
                match r {
                    Ok(()) => true,
                    Err(e) => {
                        // The replication connection died with its node (a source killed
                        // mid-migration): the slot is durable and outlives it, so it is dropped
                        // over SQL once the node answers again.
                        warn!(migration_id = self.id(), node = %self.plan.source.name, error = %e, "slot not dropped over the replication connection; dropping it over SQL");
                        false
                    }
                }
            }
            None => false,
        };
        if !dropped_over_stream {
            // Waits for a source that is down, during a rollback or after the decision
            // (`connect_when_up`); otherwise the first failure is the answer.
            let source = self.connect_when_up(&self.plan.source).await?;
            // A walsender that just lost its client may still hold the slot for a moment.
            execute_while_in_use(
                &source,
                &self.plan.source,
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                &slot,
            )
            .await?;
        }
        self.state.slot = None;
        Ok(())
    }

    pub(super) async fn drop_origins(&self) -> Result<(), DriverError> {
        let target = self.session(&self.plan.target).await?;
        // The sessions of a replay worker that died are still attached to their origins until
        // their backends notice the lost client and exit.
        execute_while_in_use(
            &target,
            &self.plan.target,
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname LIKE $1",
            &names::origin_like_pattern(self.id()),
        )
        .await
        .inspect_err(|_| self.forget_session(&self.plan.target, &target))
    }

    /// Ends the registration on every node; returns the transactions the nodes counted as
    /// aborted by the migration.
    async fn end_registration(&mut self) -> Result<u64, DriverError> {
        if !self.state.registered {
            return Ok(0);
        }
        let rows = self
            .on_every_node(&format!("SELECT remus.migration_end({})", self.id()))
            .await?;
        self.state.registered = false;
        Ok(rows.iter().map(|r| r.get::<_, i64>(0).max(0) as u64).sum())
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
            Err(e)
                if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE)
                    && attempt < 200 =>
            {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(sql(node)(e)),
        }
    }
}

/// One cleanup step's end, as a time since `started`: what the clients live through right
/// after the handover happens in this phase, so its steps are timed in the log.
fn step_done(migration_id: u64, started: Instant, step: &str) {
    info!(
        migration_id,
        phase = "cleanup",
        step,
        ms = started.elapsed().as_millis() as u64,
        "cleanup step done"
    );
}
