//! Resuming a migration after a coordinator restart (see [`crate::resume`]): past the Tm
//! decision it completes from what the target holds, before it it rolls back.

use tracing::{info, warn};

use remus_proto::names;

use super::handover::finish_tm_if_prepared;
use super::{describe, sql, DriverError, Run};
use crate::migration::{Mode, Phase, Status};

/// Tm's fate as the nodes record it ([`Run::tm_outcome`]).
enum TmOutcome {
    /// Committed on some node, or prepared on every node: the migration completes.
    Decided,
    /// Rolled back on `node` (with no node committed): the migration rolls back.
    RolledBack { node: String },
    /// Committed on some nodes and rolled back on others: nothing is touched.
    Inconsistent {
        committed: String,
        rolled_back: String,
    },
}

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
        self.state.gate_closed = matches!(self.plan.mode, Mode::WaitRemaster | Mode::Squall);
        self.state.capturing = self.plan.mode == Mode::Remus;
        // Read-through is held per migration id and ending it is idempotent (F13): a rollback
        // ends this migration's hold wherever it is; `crate::resume` also ends every hold on
        // every node once all resumed migrations have settled their Tm.
        self.state.read_through = true;
        let mut phase = phase;
        let mut stopped_in = format!("during phase {phase}");
        if phase == Phase::Cleanup {
            // The record says decided, but a decision write whose answer was lost may have
            // been followed by a rollback (review finding F3): only the nodes know whether Tm
            // went forward. Nothing is destroyed before they say so.
            self.state.tm_decided = true;
            match self.tm_outcome().await {
                Ok(TmOutcome::Decided) => {}
                Ok(TmOutcome::RolledBack { node }) => {
                    warn!(migration_id = id, phase = "cleanup", node = %node, "the record says decided, but Tm was rolled back on a node: rolling back");
                    self.state.tm_decided = false;
                    phase = Phase::Handover;
                    stopped_in =
                        format!("after an unconfirmed Tm decision (Tm rolled back on {node})");
                }
                Ok(TmOutcome::Inconsistent {
                    committed,
                    rolled_back,
                }) => {
                    let msg = format!(
                        "the coordinator restarted after the Tm decision, but Tm is committed on \
                         {committed} and rolled back on {rolled_back}; nothing was changed, an \
                         operator must decide"
                    );
                    warn!(migration_id = id, phase = "cleanup", error = %msg, "resumed migration failed");
                    self.reporter.finish(Status::Failed, Some(msg)).await;
                    return;
                }
                Err(e) => {
                    let msg = format!(
                        "the coordinator restarted after the Tm decision; reading Tm's state on \
                         the nodes failed, nothing was changed: {}",
                        describe(&e)
                    );
                    warn!(migration_id = id, phase = "cleanup", error = %msg, "resumed migration failed");
                    self.reporter.finish(Status::Failed, Some(msg)).await;
                    return;
                }
            }
        }
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
                    "the coordinator restarted {stopped_in}; rolling back"
                )))
                .await;
            let msg =
                format!("the coordinator stopped {stopped_in}; rolled back when it restarted");
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

    /// Whether Tm went forward, from the nodes: on each, Tm is still prepared (its gid in
    /// `pg_prepared_xacts`), committed (not prepared, the map names the target for the
    /// shards) or rolled back (not prepared, the map names someone else). The record reached
    /// `cleanup` only after Tm was prepared on every node, and the driver commits Tm only
    /// after the decision and rolls it back only before it, so: committed somewhere, or
    /// prepared everywhere, is [`TmOutcome::Decided`] (a rollback releases every node before
    /// it drops the target's copy, so that copy is intact); rolled back somewhere is
    /// [`TmOutcome::RolledBack`]; both at once cannot come from this driver and is refused.
    async fn tm_outcome(&self) -> Result<TmOutcome, DriverError> {
        let id = self.id();
        let mut committed = Vec::new();
        let mut rolled_back = Vec::new();
        for node in &self.plan.nodes {
            let c = self.connect_when_up(node).await?;
            let row = c
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_prepared_xacts WHERE gid = $1),
                            (SELECT count(*) FROM remus.shard_map
                              WHERE shard_id = ANY($2) AND node_name = $3)",
                    &[
                        &names::tm_gid(id, &node.name),
                        &self.plan.shard_ids,
                        &self.plan.target.name,
                    ],
                )
                .await
                .map_err(sql(node))?;
            let prepared: bool = row.get(0);
            let at_target: i64 = row.get(1);
            if prepared {
                continue;
            }
            if at_target == self.plan.shard_ids.len() as i64 {
                committed.push(node.name.clone());
            } else {
                rolled_back.push(node.name.clone());
            }
        }
        info!(migration_id = id, phase = "cleanup", committed = ?committed, rolled_back = ?rolled_back, "Tm's state on the nodes");
        Ok(match (committed.is_empty(), rolled_back.is_empty()) {
            (_, true) => TmOutcome::Decided,
            (true, false) => TmOutcome::RolledBack {
                node: rolled_back.join(", "),
            },
            (false, false) => TmOutcome::Inconsistent {
                committed: committed.join(", "),
                rolled_back: rolled_back.join(", "),
            },
        })
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
        if self.plan.mode == Mode::Squall {
            // Past the flip the pulls go on, before the drain as in `cleanup`: a statement on
            // the new owner that began waiting for a chunk while no coordinator ran is one of
            // the transactions the drain waits for, and it ends only once its chunk is pulled.
            self.squall_pull_all().await?;
        }
        for (node, at) in self.state.tm_committed_at.clone() {
            self.drain_older_transactions(
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
        let aborted = self.finish_after_drain().await? + self.state.terminated;
        if self.plan.mode == Mode::Squall {
            self.squall_forget_chunks().await?;
        }
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
