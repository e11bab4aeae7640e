//! Remus handover: since the sync barrier every source commit on the shards is validated on the
//! target (dual execution), so no writer is stopped or aborted. The handover is Tm alone, with
//! the drain-source switch run on each node first: from then on a write routed to the shards on
//! the target first waits on the source for the row's older writers
//! (`remus.migration_drain_source`, the extension's half of this handover).

use super::super::{quote_literal, DriverError, Run};

impl Run {
    /// Remus mode's handover: Tm, with the drain-source switch ([`Self::drain_source_statement`])
    /// run on each node just before its part of Tm.
    pub(in crate::driver) async fn handover_remus(&mut self) -> Result<(), DriverError> {
        self.tm().await
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
