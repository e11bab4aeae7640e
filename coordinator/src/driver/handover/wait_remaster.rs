//! wait_remaster handover (DynaMast-style): new transactions held at an admission gate on every
//! node (`remus.close_gate` / `remus.open_gate`: the extension's half) while the ones in flight
//! finish, for at most `remus.gate_drain_timeout` (then the handover rolls back).

use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::super::{sql, DriverError, Run};

impl Run {
    /// DynaMast-style: stop admitting new transactions on every node, wait for the ones in
    /// flight, final catch-up, Tm, reopen.
    pub(in crate::driver) async fn handover_wait_remaster(&mut self) -> Result<(), DriverError> {
        self.close_gates_and_drain().await?;
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        let tm = match self.verify().await {
            Ok(()) => self.tm().await,
            Err(e) => Err(e),
        };
        self.open_gates().await?;
        tm
    }

    /// Closes the admission gate on every node and waits for the transactions admitted before
    /// it, for at most `remus.gate_drain_timeout` (then [`DriverError::GateDrainTimeout`]: the
    /// caller rolls back, which reopens the gates). Also squall's start (`driver/squall.rs`).
    pub(in crate::driver) async fn close_gates_and_drain(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let timeout_ms = self.config.gate_timeout.as_millis() as i64;
        let mut closed_at = Vec::new();
        // The drain's bound: the smallest remus.gate_drain_timeout of the nodes, and at most the
        // gate's own timeout (past it the gates reopen by themselves and the drain no longer
        // holds anything back).
        let mut bound = self.config.gate_timeout;
        self.state.gate_closed = true;
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            let ms: Option<i64> = c
                .query_one(
                    "SELECT (extract(epoch FROM nullif(current_setting('remus.gate_drain_timeout', true), '')::interval) * 1000)::bigint",
                    &[],
                )
                .await
                .map_err(sql(node))?
                .get(0);
            if let Some(ms) = ms {
                bound = bound.min(Duration::from_millis(ms.max(0) as u64));
            }
            let at = self.close_gate_when_free(node, &c, timeout_ms).await?;
            closed_at.push((node.clone(), at));
        }
        let started = Instant::now();
        let what = format!(
            "transactions in flight when the gate closed (the handover rolls back if any still runs after {} ms, remus.gate_drain_timeout)",
            bound.as_millis()
        );
        for (node, at) in &closed_at {
            let left = bound.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, self.wait_for_older_transactions(node, at, &what))
                .await
            {
                Ok(r) => r?,
                Err(_) => {
                    warn!(
                        migration_id = id,
                        phase = "handover",
                        node = %node.name,
                        timeout_ms = bound.as_millis() as u64,
                        "transactions admitted before the gate closed still run past remus.gate_drain_timeout; rolling back"
                    );
                    return Err(DriverError::GateDrainTimeout {
                        node: node.name.clone(),
                        ms: bound.as_millis() as u64,
                    });
                }
            }
        }
        info!(
            migration_id = id,
            phase = "handover",
            drain_ms = started.elapsed().as_millis() as u64,
            "in-flight transactions finished"
        );
        Ok(())
    }

    /// Closes the gate of `node` for this migration. A node has one gate: while another
    /// migration's handover holds it (55006), this one waits its turn, for at most the gate's
    /// own timeout (after which the other's gate opens by itself), named in `waiting_on`. Every
    /// migration closes the gates in the order of the plan's nodes, so two handovers cannot
    /// each hold a gate the other waits for.
    async fn close_gate_when_free(
        &self,
        node: &crate::node_registry::NodeRecord,
        c: &tokio_postgres::Client,
        timeout_ms: i64,
    ) -> Result<String, DriverError> {
        let id = self.id();
        let started = Instant::now();
        let mut reported = false;
        loop {
            let r = c
                .query_one(
                    &format!("SELECT remus.close_gate({id}, {timeout_ms})::text"),
                    &[],
                )
                .await;
            match r {
                Ok(row) => {
                    if reported {
                        self.reporter.waiting_on(None).await;
                    }
                    return Ok(row.get(0));
                }
                Err(e)
                    if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE)
                        && started.elapsed() < self.config.gate_timeout =>
                {
                    if !reported {
                        let what = e
                            .as_db_error()
                            .map(|d| d.message().to_string())
                            .unwrap_or_else(|| e.to_string());
                        info!(migration_id = id, phase = "handover", node = %node.name, "{what}; waiting for its handover to end");
                        self.reporter
                            .waiting_on(Some(format!("node {}: {what}", node.name)))
                            .await;
                        reported = true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(sql(node)(e)),
            }
        }
    }

    pub(in crate::driver) async fn open_gates(&mut self) -> Result<(), DriverError> {
        if !self.state.gate_closed {
            return Ok(());
        }
        let id = self.id();
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            c.batch_execute(&format!("SELECT remus.open_gate({id})"))
                .await
                .map_err(sql(node))?;
        }
        self.state.gate_closed = false;
        Ok(())
    }
}
