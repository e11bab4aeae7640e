//! wait_remaster handover (DynaMast-style): new transactions held at an admission gate on every
//! node (`remus.close_gate` / `remus.open_gate`: the extension's half) while the ones in flight
//! finish.

use std::time::Instant;

use tracing::info;

use super::super::{sql, DriverError, Run};

impl Run {
    /// DynaMast-style: stop admitting new transactions on every node, wait for the ones in
    /// flight, final catch-up, Tm, reopen.
    pub(in crate::driver) async fn handover_wait_remaster(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let timeout_ms = self.config.gate_timeout.as_millis() as i64;
        let mut closed_at = Vec::new();
        self.state.gate_closed = true;
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            let at: String = c
                .query_one(
                    &format!("SELECT remus.close_gate({id}, {timeout_ms})::text"),
                    &[],
                )
                .await
                .map_err(sql(node))?
                .get(0);
            closed_at.push((node.clone(), at));
        }
        let started = Instant::now();
        for (node, at) in &closed_at {
            self.wait_for_older_transactions(
                node,
                at,
                "transactions in flight when the gate closed",
            )
            .await?;
        }
        info!(
            migration_id = id,
            phase = "handover",
            drain_ms = started.elapsed().as_millis() as u64,
            "in-flight transactions finished"
        );
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        let tm = match self.verify().await {
            Ok(()) => self.tm().await,
            Err(e) => Err(e),
        };
        self.open_gates().await?;
        tm
    }

    async fn open_gates(&mut self) -> Result<(), DriverError> {
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
