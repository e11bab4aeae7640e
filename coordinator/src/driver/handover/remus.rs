//! Remus handover: since the sync barrier every source commit on the shards is validated on the
//! target (dual execution), so no writer is stopped or aborted. The handover is Tm alone; the
//! drain-source switch runs on each node before the barrier: once Tm routes a write to the
//! shards on the target, it first waits on the source for the row's older writers
//! (`remus.migration_drain_source`, the extension's half of this handover).

use super::super::{quote_literal, sql, DriverError, Run};

impl Run {
    /// Remus mode's handover: Tm (the drain-source switch ran before the barrier).
    pub(in crate::driver) async fn handover_remus(&mut self) -> Result<(), DriverError> {
        self.tm().await
    }

    /// The drain-source switch on every node at once ([`Self::drain_source_statement`]): each
    /// call makes the node's migration state durable (a file and its fsync). It acts only once
    /// Tm routes a write to the target, so it may come any time before Tm, whatever Tm's fate:
    /// the driver runs it before the sync barrier, so that neither sync mode nor Tm's in-doubt
    /// window waits for it; Tm runs it if it has not run (a migration resumed at its handover).
    pub(in crate::driver) async fn switch_drain_source(&mut self) -> Result<(), DriverError> {
        let order = self.tm_order();
        let opened = self.sessions_of(&order).await?;
        let drain = self.drain_source_statement();
        let switched = futures_util::future::join_all(
            order
                .iter()
                .zip(&opened)
                .map(|(node, c)| async { c.batch_execute(&drain).await.map_err(sql(node)) }),
        )
        .await;
        switched.into_iter().collect::<Result<Vec<_>, _>>()?;
        self.state.drain_switched = true;
        Ok(())
    }

    /// Remus: from here a write routed to the shards on the target first waits on the
    /// source for the row's older writers (shared memory, so it holds whatever Tm's fate;
    /// `migration_end` clears it).
    pub(in crate::driver) fn drain_source_statement(&self) -> String {
        format!(
            "SELECT remus.migration_drain_source({}, {});",
            self.id(),
            quote_literal(&self.plan.source.name)
        )
    }
}
