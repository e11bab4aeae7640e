//! Resuming a migration after a coordinator restart (see [`crate::resume`]): past the Tm
//! decision it completes from what the target holds, before it it rolls back.

use tracing::{info, warn};

use remus_proto::names;

use super::handover::finish_tm_if_prepared;
use super::{describe, sql, DriverError, Run};
use crate::migration::{Mode, Phase, Status};

impl Run {
    /// Nothing of the previous run is known but the phase its record reached, so everything it
    /// may have built is assumed to exist; every step below finds out on the node and is
    /// idempotent (a step that already ran, or never did, changes nothing).
    pub(super) async fn resume(&mut self, phase: Phase) {
        let id = self.id();
        self.state.registered = true;
        self.state.publication = true;
        self.state.slot = Some(self.slot());
        self.state.target_tables = true;
        self.state.tm_prepared = true;
        self.state.gate_closed = self.plan.mode == Mode::WaitRemaster;
        self.state.capturing = self.plan.mode == Mode::Remus;
        // Read-through is one counter per node for all migrations, and whether the previous
        // run ended its share is not known: `crate::resume` ends it on every node once every
        // resumed migration has settled its Tm.
        self.state.read_through = false;
        if phase == Phase::Cleanup {
            info!(
                migration_id = id,
                phase = "cleanup",
                "resuming after a coordinator restart: past the Tm decision, completing"
            );
            self.reporter
                .waiting_on(Some(
                    "the coordinator restarted after the Tm decision; completing the migration"
                        .into(),
                ))
                .await;
            self.state.tm_decided = true;
            match self.complete_after_restart().await {
                Ok(()) => {
                    self.reporter.finish(Status::Succeeded, None).await;
                    info!(
                        migration_id = id,
                        phase = "cleanup",
                        "migration completed after a coordinator restart"
                    );
                }
                Err(e) => {
                    let msg = format!(
                        "the coordinator restarted after the Tm decision; completing failed: {}",
                        describe(&e)
                    );
                    warn!(migration_id = id, phase = "cleanup", error = %msg, "resumed migration failed");
                    self.reporter.finish(Status::Failed, Some(msg)).await;
                }
            }
        } else {
            info!(migration_id = id, phase = %phase, "resuming after a coordinator restart: before the Tm decision, rolling back");
            self.reporter
                .waiting_on(Some(format!(
                    "the coordinator restarted during phase {phase}; rolling back"
                )))
                .await;
            let msg = format!(
                "the coordinator stopped during phase {phase}; rolled back when it restarted"
            );
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
            finish_tm_if_prepared(&c, &node, &names::tm_gid(id, &node.name), "COMMIT PREPARED")
                .await?;
            if self.state.gate_closed {
                c.batch_execute(&format!("SELECT remus.open_gate({id})"))
                    .await
                    .map_err(sql(&node))?;
            }
            // The drain waits for what is older than now: a superset of what predates Tm.
            let at: Option<String> = c
                .query_one(
                    "SELECT remus.bump_map_generation(), clock_timestamp()::text",
                    &[],
                )
                .await
                .map_err(sql(&node))?
                .get(1);
            self.state
                .tm_committed_at
                .push((node, at.unwrap_or_default()));
        }
        self.state.gate_closed = false;
        for (node, at) in self.state.tm_committed_at.clone() {
            self.wait_for_older_transactions(
                &node,
                &at,
                "transactions older than the coordinator's restart",
            )
            .await?;
        }
        let source = self.connect_when_up(&self.plan.source).await?;
        let tables: Vec<String> = self.plan.tables.iter().map(|t| t.qualified()).collect();
        let left: i64 = source
            .query_one(
                "SELECT count(*) FROM unnest($1::text[]) t WHERE to_regclass(t) IS NOT NULL",
                &[&tables],
            )
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        if self.plan.mode == Mode::Remus && left > 0 {
            let prepared = self.prepared_shard_lockers().await?;
            self.wait_for_lockers(&prepared, "prepared transactions older than the handover")
                .await?;
        }
        self.drop_slot(None).await?;
        let aborted = self.finish_after_drain().await?;
        self.reporter
            .update(move |r| r.aborted_by_migration = aborted)
            .await?;
        info!(
            migration_id = id,
            phase = "cleanup",
            aborted,
            "source shard removed after a coordinator restart"
        );
        Ok(())
    }
}
