//! Rolling back a migration that failed before the Tm decision: the source keeps (and never
//! lost) the shards, and everything the migration built on the nodes goes.

use tracing::{debug, info, warn};

use remus_proto::names;

use super::handover::finish_tm_if_prepared;
use super::{describe, sql, DriverError, Run};
use crate::migration::Mode;
use crate::node_registry::NodeRecord;

impl Run {
    /// Undoes everything a migration that failed before the Tm decision built: the source keeps
    /// (and never lost) the shards.
    ///
    /// Every node that answers is released first (its prepared Tm rolled back, read-through
    /// ended, gate opened, registration ended): a target that is down must not keep the source
    /// in sync mode, where every write to the shards would fail to validate until it is back.
    /// Then the source's stream, slot and publication go, and only then does the rollback wait
    /// for the nodes that did not answer (the target's copy, shadows and origins with them).
    pub(super) async fn rollback(&mut self) -> Result<(), DriverError> {
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
        if (self.state.tm_prepared || self.state.tm_noted) && unreachable.is_empty() {
            // Tm's in-doubt note (written before its first PREPARE) is no longer true.
            self.reporter.waiting_on(None).await;
        }
        let conn = match self.state.propagator.take() {
            Some(p) => p.stop(false).await.ok(),
            None => self.take_repl(),
        };
        note(self.drop_slot(conn).await);
        if self.state.publication {
            let r = async {
                // A source that is down is waited for (bounded, shown in `waiting_on`): the
                // publication is durable and would outlive a rollback that gave up on it.
                let c = self.connect_when_up(&self.plan.source).await?;
                c.batch_execute(&format!(
                    "DROP PUBLICATION IF EXISTS {}",
                    self.publication()
                ))
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
        if self.plan.mode == Mode::Squall && self.state.target_tables {
            note(self.squall_forget_chunks().await);
        }
        if self.state.target_tables {
            let r = async {
                let c = self.connect_when_up(&self.plan.target).await?;
                // One statement: the group's foreign keys between its tables do not hold
                // back a table dropped with the tables that reference it.
                c.batch_execute(&format!("DROP TABLE IF EXISTS {};", self.table_list()))
                    .await
                    .map_err(sql(&self.plan.target))
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
    async fn release_node(
        &self,
        node: &NodeRecord,
        c: &tokio_postgres::Client,
    ) -> Result<(), DriverError> {
        let id = self.id();
        if self.state.tm_prepared {
            finish_tm_if_prepared(c, node, &names::tm_gid(id, &node.name), "ROLLBACK PREPARED")
                .await?;
        }
        if self.state.read_through {
            // This migration's hold only (F13): on a node its Tm never reached, nothing.
            c.batch_execute(&format!("SELECT remus.end_read_through({id})"))
                .await
                .map_err(sql(node))?;
        }
        if self.state.gate_closed {
            c.batch_execute(&format!("SELECT remus.open_gate({id})"))
                .await
                .map_err(sql(node))?;
        }
        if self.state.registered {
            c.batch_execute(&format!("SELECT remus.migration_end({id})"))
                .await
                .map_err(sql(node))?;
        }
        debug!(migration_id = id, phase = "rollback", node = %node.name, "node released");
        Ok(())
    }
}
