//! The catch-up phase: the stream from the source's slot to the replay worker on the target,
//! sync points in it, and waiting until the target has applied up to one. In Remus mode the
//! source also captures write sets from the copy on (`remus.migration_capture`, the extension's
//! half of catch-up), so that the sync barrier can switch it to validated commits.

use std::time::{Duration, Instant};

use tracing::{info, warn};
use wal_propagator::Lsn;

use remus_proto::names;

use super::{quote_literal, sql, DriverError, Run};
use crate::failpoint;
use crate::propagator::Propagator;

/// A catch-up round this short means the target is close behind the source.
const CATCHUP_CLOSE_ENOUGH: Duration = Duration::from_millis(500);
/// A source that writes faster than the target applies never gets close; hand over anyway.
const CATCHUP_MAX_ROUNDS: u32 = 20;

impl Run {
    /// Starts the stream (the slot's changes since the copy's snapshot, shipped to the replay
    /// worker) and catches up in rounds until one round is short: the handover's final
    /// catch-up then has only about one round's worth of backlog to apply while writes are held.
    pub(super) async fn catch_up(&mut self) -> Result<(), DriverError> {
        let conn = self
            .take_repl()
            .expect("copy leaves the replication connection");
        let propagator = Propagator::start(
            self.id(),
            &self.config.replay_endpoint,
            self.config.connector.conninfo(&self.plan.target, false),
            conn,
            self.slot(),
            self.publication(),
            self.state.start_lsn,
            self.config.apply_parallelism,
        )
        .await?;
        self.state.propagator = Some(propagator);
        let mut previous = Duration::MAX;
        for round in 1..=CATCHUP_MAX_ROUNDS {
            let started = Instant::now();
            let lsn = self.sync_point().await?;
            self.wait_applied(lsn).await?;
            let took = started.elapsed();
            self.config
                .failpoints
                .pause(failpoint::CATCHUP_RUNNING, self.id())
                .await;
            info!(
                migration_id = self.id(),
                phase = "catchup",
                round,
                ms = took.as_millis() as u64,
                "catch-up round"
            );
            match after_round(took, previous) {
                Round::CloseEnough => break,
                Round::NotConverging => {
                    warn!(
                        migration_id = self.id(),
                        phase = "catchup",
                        round,
                        "catch-up is not converging; handing over with the backlog"
                    );
                    break;
                }
                Round::Again => previous = took,
            }
        }
        Ok(())
    }

    /// Remus: the source starts capturing write sets on the shards, and notes the transactions
    /// that already hold a write lock on them (their write sets miss what they wrote before).
    pub(super) async fn start_capture(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let source = self.config.connector.connect(&self.plan.source).await?;
        source
            .execute(
                &format!("SELECT remus.migration_capture({id}, $1)"),
                &[&self.config.replay_endpoint],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.capturing = true;
        let rows = source
            .query(
                &format!(
                    "SELECT DISTINCT virtualtransaction FROM pg_locks
                      WHERE relation = ANY({}) AND granted
                        AND mode NOT IN ('AccessShareLock', 'RowShareLock')",
                    self.regclass_array()
                ),
                &[],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.pre_capture_writers = rows.iter().map(|r| r.get::<_, String>(0)).collect();
        Ok(())
    }

    /// A position in the source's stream that everything committed before this call precedes:
    /// a transactional logical message, so the stream reaches it even when the migrating shards
    /// see no writes.
    pub(super) async fn sync_point(&mut self) -> Result<Lsn, DriverError> {
        let source = self.config.connector.connect(&self.plan.source).await?;
        let lsn: String = source
            .query_one(
                &format!(
                    "SELECT pg_logical_emit_message(true, {}, $1)::text",
                    quote_literal(names::SYNC_POINT_MESSAGE_PREFIX)
                ),
                &[&self.id().to_string()],
            )
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        self.state.sync_points += 1;
        Ok(lsn.parse::<Lsn>()?)
    }

    pub(super) async fn wait_applied(&self, lsn: Lsn) -> Result<(), DriverError> {
        let propagator = self.state.propagator.as_ref().expect("propagator running");
        let mut last_report = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_secs(1), propagator.wait_applied(lsn)).await {
                Ok(r) => {
                    r?;
                    break;
                }
                Err(_) => {
                    if last_report.elapsed() >= Duration::from_secs(1) {
                        let applied = propagator.progress.applied();
                        let replayed = self.txns_replayed();
                        let w = format!("target has applied up to {applied}, waiting for {lsn}");
                        self.reporter
                            .update(move |r| {
                                r.txns_replayed = replayed;
                                r.waiting_on = Some(w.clone());
                            })
                            .await?;
                        last_report = Instant::now();
                    }
                }
            }
        }
        let replayed = self.txns_replayed();
        self.reporter
            .update(move |r| {
                r.txns_replayed = replayed;
                r.waiting_on = None;
            })
            .await
    }

    pub(super) fn txns_replayed(&self) -> u64 {
        let applied = self
            .state
            .propagator
            .as_ref()
            .map(|p| {
                p.progress
                    .txns_applied
                    .load(std::sync::atomic::Ordering::Acquire)
            })
            .unwrap_or(self.state.final_txns_applied);
        // The sync points are the migration's own transactions, not the workload's.
        applied.saturating_sub(self.state.sync_points)
    }
}

/// What a catch-up round that took `took` says, after a previous one that took `previous`.
#[derive(Debug, PartialEq, Eq)]
enum Round {
    /// The target is close behind the source: hand over.
    CloseEnough,
    /// The source writes the shards faster than the target applies: more rounds would only
    /// grow the backlog. The handover applies what is left.
    NotConverging,
    /// Another round.
    Again,
}

fn after_round(took: Duration, previous: Duration) -> Round {
    if took <= CATCHUP_CLOSE_ENOUGH {
        Round::CloseEnough
    } else if took >= previous {
        Round::NotConverging
    } else {
        Round::Again
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catch_up_ends_on_a_short_round_or_one_no_shorter_than_the_last() {
        let ms = Duration::from_millis;
        assert_eq!(after_round(ms(500), Duration::MAX), Round::CloseEnough);
        assert_eq!(after_round(ms(10), ms(5)), Round::CloseEnough);
        assert_eq!(after_round(ms(9000), Duration::MAX), Round::Again);
        assert_eq!(after_round(ms(800), ms(900)), Round::Again);
        assert_eq!(after_round(ms(900), ms(900)), Round::NotConverging);
        assert_eq!(after_round(ms(1200), ms(900)), Round::NotConverging);
    }
}
