//! albatross (ElasTraS's Albatross, seed 003 section 6, on shared-nothing PostgreSQL; decision
//! 0024): iterative copy, then a short handover that suspends the migrating shards' new
//! transactions on every node (they wait; the extension's half is
//! `pg_remus/src/migration/handover/albatross.rs`), drains the ones in flight on them, applies
//! the last delta, runs Tm and lets the suspended work go on, routed to the target.
//!
//! - Iterative copy ([`Run::albatross_rounds`], after the snapshot copy): round k waits until
//!   the target has applied the source's stream up to a sync point emitted at its start; its
//!   delta is the source transactions on the shards the target applied in it. The rounds end
//!   when a delta is no smaller than the one before (they stopped shrinking), when a round had
//!   nothing to apply, or after [`super::super::DriverConfig::albatross_max_rounds`] rounds.
//!   Catch-up that does not converge within the limit fails as for the other baselines
//!   (decision 0022).
//! - Handover ([`Run::handover_albatross`]): `remus.albatross_suspend` on every node, then on
//!   every node the drain: client transactions that started before the suspension and hold a
//!   lock on a moved table (shell or shard table), and on the source every session and
//!   prepared transaction that holds a lock on a moved shard table; the suspended ones
//!   (`remus.albatross_waiting`) are left out. Bounded by `remus.gate_drain_timeout` (the
//!   smallest of the nodes', at most the suspension's own timeout): past it the handover
//!   fails and the migration is rolled back; nothing was aborted. Then the last delta, the
//!   optional verification, Tm, and `remus.albatross_resume` on every node (also on failure).
//!   The time from the first suspension to the last resume is the unavailability window of the
//!   shards' new transactions, kept in the record (`unavailable_ms`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use remus_proto::names;

use super::super::{callers_on, join, quote_literal, sql, DriverError, Run};
use crate::failpoint;
use crate::node_registry::NodeRecord;

impl Run {
    /// The iterative copy's rounds, once the stream runs (see the module doc).
    pub(in crate::driver) async fn albatross_rounds(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let max = self.config.albatross_max_rounds.max(1);
        let applied = |run: &Run| {
            run.state
                .propagator
                .as_ref()
                .map(|p| p.progress.txns_applied.load(Ordering::Acquire))
                .unwrap_or(0)
        };
        let mut previous: Option<u64> = None;
        let mut round = 0u32;
        let mut at = applied(self);
        loop {
            round += 1;
            let started = Instant::now();
            let lsn = self.sync_point().await?;
            let stalled = self.wait_applied_or_stall(lsn, true).await?;
            self.config
                .failpoints
                .pause(failpoint::CATCHUP_RUNNING, id)
                .await;
            let now = applied(self);
            // The round's own sync point is the migration's, not the workload's.
            let delta = now.saturating_sub(at).saturating_sub(1);
            at = now;
            info!(
                migration_id = id,
                phase = "catchup",
                round,
                delta_txns = delta,
                ms = started.elapsed().as_millis() as u64,
                "albatross copy round"
            );
            if let Some(stall) = stalled {
                return self.not_converging(stall).await;
            }
            if let Some(why) = rounds_end(delta, previous, round, max) {
                info!(
                    migration_id = id,
                    phase = "catchup",
                    round,
                    delta_txns = delta,
                    max_rounds = max,
                    "iterative copy ends: {why}"
                );
                return Ok(());
            }
            previous = Some(delta);
        }
    }

    /// The albatross handover (see the module doc).
    pub(in crate::driver) async fn handover_albatross(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let started = Instant::now();
        let r = self.albatross_suspended().await;
        let resumed = self.albatross_resume_all().await;
        let window = started.elapsed();
        let ms = window.as_millis() as u64;
        info!(
            migration_id = id,
            phase = "handover",
            unavailable_ms = ms,
            ok = r.is_ok(),
            "suspension lifted"
        );
        // Kept also when the handover failed: the shards' new transactions waited that long.
        if let Err(e) = self
            .reporter
            .update(move |r| r.unavailable_ms = Some(ms))
            .await
        {
            warn!(migration_id = id, phase = "handover", error = %e, "could not record the unavailability window");
        }
        r?;
        if let Err(e) = resumed {
            // Tm is decided: the suspension lifts by itself at its deadline and at the end of
            // the migration on the node (`remus.migration_end`).
            warn!(migration_id = id, phase = "handover", error = %e, "lifting the suspension failed on a node; it lifts at its timeout or the migration's end");
        }
        Ok(())
    }

    /// Suspends, drains, applies the last delta and runs Tm; the caller lifts the suspension.
    async fn albatross_suspended(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let timeout_ms = self.config.gate_timeout.as_millis() as i64;
        let ids = join(&self.plan.shard_ids);
        let mut bound = self.config.gate_timeout;
        let mut since = Vec::new();
        for node in &self.plan.nodes {
            let c = self.config.connector.connect(node).await?;
            let row = c
                .query_one(
                    &format!(
                        "SELECT remus.albatross_suspend({id}, ARRAY[{ids}]::bigint[], {timeout_ms})::text,
                                (extract(epoch FROM nullif(current_setting('remus.gate_drain_timeout', true), '')::interval) * 1000)::bigint"
                    ),
                    &[],
                )
                .await
                .map_err(sql(node))?;
            if let Some(ms) = row.get::<_, Option<i64>>(1) {
                bound = bound.min(Duration::from_millis(ms.max(0) as u64));
            }
            since.push((node.clone(), row.get::<_, String>(0)));
        }
        info!(
            migration_id = id,
            phase = "handover",
            bound_ms = bound.as_millis() as u64,
            "shards suspended on every node"
        );
        let drained = Instant::now();
        for (node, at) in &since {
            let left = bound.saturating_sub(drained.elapsed());
            match tokio::time::timeout(left, self.albatross_drain(node, at)).await {
                Ok(r) => r?,
                Err(_) => {
                    warn!(
                        migration_id = id,
                        phase = "handover",
                        node = %node.name,
                        timeout_ms = bound.as_millis() as u64,
                        "transactions in flight on the shards still run past remus.gate_drain_timeout; rolling back"
                    );
                    return Err(DriverError::SuspensionDrainTimeout {
                        node: node.name.clone(),
                        ms: bound.as_millis() as u64,
                    });
                }
            }
        }
        self.reporter.waiting_on(None).await;
        info!(
            migration_id = id,
            phase = "handover",
            drain_ms = drained.elapsed().as_millis() as u64,
            "transactions in flight on the shards finished"
        );
        self.config
            .failpoints
            .pause(failpoint::HANDOVER_ALBATROSS_DRAINED, id)
            .await;
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        self.verify().await?;
        self.tm().await
    }

    /// Waits until nothing in flight on the moved shards runs on `node` (see the module doc);
    /// `since` is when the suspension began there.
    async fn albatross_drain(&self, node: &NodeRecord, since: &str) -> Result<(), DriverError> {
        let id = self.id();
        let c = self.config.connector.connect(node).await?;
        let callers = callers_on(&node.name, self.plan.requested_by.as_ref());
        let shells: Vec<String> = self.plan.tables.iter().map(|t| t.shell.clone()).collect();
        let shard_tables: Vec<String> = self.plan.tables.iter().map(|t| t.qualified()).collect();
        let source = node.name == self.plan.source.name;
        let query = format!(
            "WITH moved AS (SELECT to_regclass(t)::oid AS rel FROM unnest($3::text[] || $4::text[]) t),
                  shard_rels AS (SELECT to_regclass(t)::oid AS rel FROM unnest($4::text[]) t),
                  suspended AS (SELECT unnest(remus.albatross_waiting({id})) AS pid),
                  db AS (SELECT oid FROM pg_database WHERE datname = current_database()),
                  running AS (
                    SELECT a.pid, a.xact_start FROM pg_stat_activity a
                     WHERE a.backend_type = 'client backend' AND a.datname = current_database()
                       AND a.pid <> pg_backend_pid() AND a.pid <> ALL($2::int4[])
                       AND a.pid NOT IN (SELECT pid FROM suspended)
                       AND a.application_name <> {app}
                       AND ((a.xact_start < $1::text::timestamptz
                             AND EXISTS (SELECT 1 FROM pg_locks l, db
                                          WHERE l.pid = a.pid AND l.locktype = 'relation' AND l.database = db.oid
                                            AND l.relation IN (SELECT rel FROM moved)))
                            OR ($5 AND EXISTS (SELECT 1 FROM pg_locks l, db
                                          WHERE l.pid = a.pid AND l.locktype = 'relation' AND l.database = db.oid
                                            AND l.relation IN (SELECT rel FROM shard_rels))))),
                  prepared AS (
                    SELECT count(DISTINCT l.virtualtransaction) AS n FROM pg_locks l, db
                     WHERE $5 AND l.pid IS NULL AND l.locktype = 'relation' AND l.database = db.oid
                       AND l.relation IN (SELECT rel FROM shard_rels))
             SELECT (SELECT count(*) FROM running) + (SELECT n FROM prepared),
                    (SELECT min(pid) FROM running), (SELECT min(xact_start)::text FROM running)",
            app = quote_literal(names::MIGRATION_APPLICATION_NAME)
        );
        let mut reported: Option<i64> = None;
        loop {
            let row = c
                .query_one(&query, &[&since, &callers, &shells, &shard_tables, &source])
                .await
                .map_err(sql(node))?;
            let n: i64 = row.get(0);
            if n == 0 {
                return Ok(());
            }
            if reported != Some(n) {
                let pid: Option<i32> = row.get(1);
                let at: Option<String> = row.get(2);
                self.reporter
                    .waiting_on(Some(format!(
                        "{n} transactions in flight on the suspended shards on {} (e.g. pid {}, open since {}); the handover rolls back if they still run after remus.gate_drain_timeout",
                        node.name,
                        pid.map(|p| p.to_string()).unwrap_or_else(|| "-, prepared".into()),
                        at.unwrap_or_default()
                    )))
                    .await;
                reported = Some(n);
            }
            if let Some(p) = &self.state.propagator {
                p.check()?;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Lifts this migration's suspension on every node that answers; the first failure is
    /// returned after all were tried.
    async fn albatross_resume_all(&self) -> Result<(), DriverError> {
        self.on_every_node_trying_all(
            &format!("SELECT remus.albatross_resume({})", self.id()),
            "handover",
            "lifting the suspension failed",
        )
        .await
    }
}

/// Why the iterative copy ends after round `round` (of at most `max`) whose delta was `delta`,
/// the round before having had `previous`; `None`: another round.
fn rounds_end(delta: u64, previous: Option<u64>, round: u32, max: u32) -> Option<&'static str> {
    if delta == 0 {
        Some("the round had nothing to apply")
    } else if previous.is_some_and(|p| delta >= p) {
        Some("the round's delta is no smaller than the one before")
    } else if round >= max {
        Some("the maximum number of rounds is reached")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::rounds_end;

    #[test]
    fn iterative_copy_ends_when_rounds_stop_shrinking_or_at_the_maximum() {
        // Shrinking deltas go on until the maximum.
        assert_eq!(rounds_end(900, None, 1, 10), None);
        assert_eq!(rounds_end(300, Some(900), 2, 10), None);
        assert!(rounds_end(100, Some(300), 10, 10).is_some_and(|w| w.contains("maximum")));
        // A delta no smaller than the one before ends them, whatever its size.
        assert!(rounds_end(300, Some(300), 3, 10).is_some_and(|w| w.contains("no smaller")));
        assert!(rounds_end(5000, Some(40), 3, 10).is_some_and(|w| w.contains("no smaller")));
        // Nothing to apply: the target is caught up.
        assert!(rounds_end(0, None, 1, 10).is_some_and(|w| w.contains("nothing")));
        // A maximum of one round hands over after the first.
        assert!(rounds_end(900, None, 1, 1).is_some_and(|w| w.contains("maximum")));
    }
}
