//! The catch-up phase: the stream from the source's slot to the replay worker on the target,
//! sync points in it, and waiting until the target has applied up to one. In Remus mode the
//! source also captures write sets from the copy on (`remus.migration_capture`, the extension's
//! half of catch-up), so that the sync barrier can switch it to validated commits.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::{info, warn};
use wal_propagator::Lsn;

use remus_proto::names;

use super::meter::{Meter, Stall};
use super::{quote_literal, sql, DriverError, Run};
use crate::failpoint;
use crate::migration::Mode;
use crate::propagator::Propagator;

/// A catch-up round this short means the target is close behind the source. What is left
/// for the sync barrier (Remus) or the held handover (baselines) is about what the source
/// wrote during the last round, so this bounds the writers' stall (decision 0022, amended
/// 2026-11-28: 500 ms made the barrier stall 100-200 ms under load). Rounds under load stop
/// shrinking above it only at the stream's own round-trip floor, which ends catch-up by the
/// no-shorter-round rule instead.
const CATCHUP_CLOSE_ENOUGH: Duration = Duration::from_millis(50);
/// Remus hands over after this many rounds whatever they took; so do the baselines, whose
/// rounds are bounded in time by the convergence limit meanwhile.
const CATCHUP_MAX_ROUNDS: u32 = 20;
/// A baseline whose rounds stopped shrinking hands over when its last round took at most this
/// long: writes are held about that long while the handover applies the backlog.
const BASELINE_TOLERABLE_BACKLOG: Duration = Duration::from_secs(5);

/// Validation sessions the replay worker opens during a Remus migration's catch-up, so that
/// the sync barrier's burst of validations (one per source writer committing) does not wait
/// for new connections on the target (decision 0036).
pub const VALIDATION_SESSIONS_AHEAD: u32 = 8;

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
            // Remus: the barrier's first validations find their sessions open.
            if self.plan.mode == Mode::Remus {
                VALIDATION_SESSIONS_AHEAD
            } else {
                0
            },
            self.config.failpoints.clone(),
        )
        .await?;
        self.state.propagator = Some(propagator);
        self.meter().restart();
        if self.plan.mode == Mode::Albatross {
            return self.albatross_rounds().await;
        }
        let mut previous = Duration::MAX;
        let mut round = 0u32;
        loop {
            round += 1;
            let started = Instant::now();
            let lsn = self.sync_point().await?;
            let stalled = self.wait_applied_or_stall(lsn, true).await?;
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
            if let Some(stall) = stalled {
                return self.not_converging(stall).await;
            }
            // Remus hands over with the backlog: from the sync barrier on, every source commit
            // on the shards waits for the stream (dual execution), which paces the source's
            // writers to the replay. The baselines hold writes while they apply the backlog,
            // so they go on unless one round's worth is short enough (or the limit says no).
            let hand_over = match after_round(took, previous) {
                Round::CloseEnough => break,
                Round::NotConverging => {
                    self.plan.mode == Mode::Remus || took <= BASELINE_TOLERABLE_BACKLOG
                }
                Round::Again => false,
            };
            if hand_over || round >= CATCHUP_MAX_ROUNDS {
                warn!(
                    migration_id = self.id(),
                    phase = "catchup",
                    round,
                    ms = took.as_millis() as u64,
                    "catch-up rounds no longer shrink; handing over with the last round's backlog"
                );
                break;
            }
            previous = took;
        }
        Ok(())
    }

    /// Catch-up has not converged within the limit: Remus hands over (dual execution paces the
    /// source's writers to the replay); the baselines fail, and the driver rolls them back.
    pub(super) async fn not_converging(&mut self, stall: Stall) -> Result<(), DriverError> {
        let limit_ms = self.config.catchup_converge_limit.as_millis() as u64;
        if self.plan.mode == Mode::Remus {
            warn!(
                migration_id = self.id(),
                phase = "catchup",
                source_wal_bytes_per_sec = stall.source_rate,
                replay_bytes_per_sec = stall.replay_rate,
                lag_bytes = stall.lag_bytes,
                "catch-up is not converging; handing over: dual execution paces the source's writers"
            );
            let w = format!(
                "catch-up not converging (source writes {} B/s of WAL, target replays {} B/s, {} transactions/s; \
                 lag {} bytes, {} ms, not shrunk for {limit_ms} ms): handing over, dual execution paces the source's writers",
                stall.source_rate, stall.replay_rate, stall.replay_txns, stall.lag_bytes, stall.lag_ms
            );
            self.state.not_converging = Some(w.clone());
            return self
                .reporter
                .update(move |r| r.waiting_on = Some(w.clone()))
                .await;
        }
        Err(DriverError::NotConverging {
            mode: self.plan.mode.as_str(),
            source_rate: stall.source_rate,
            replay_rate: stall.replay_rate,
            replay_txns: stall.replay_txns,
            lag_bytes: stall.lag_bytes,
            lag_ms: stall.lag_ms,
            limit_ms,
        })
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
        let source = self.source_session().await?;
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
        self.wait_applied_or_stall(lsn, false).await.map(|_| ())
    }

    fn meter(&self) -> std::sync::MutexGuard<'_, Meter> {
        self.state.meter.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the target has applied up to `lsn`, measuring once a second the source's
    /// and the replay's rates and the lag into the record. With `detect`, gives up and returns
    /// what was measured when the lag has not shrunk for the convergence limit.
    pub(super) async fn wait_applied_or_stall(
        &self,
        lsn: Lsn,
        detect: bool,
    ) -> Result<Option<Stall>, DriverError> {
        let propagator = self.state.propagator.as_ref().expect("propagator running");
        loop {
            match tokio::time::timeout(Duration::from_secs(1), propagator.wait_applied(lsn)).await {
                Ok(r) => {
                    r?;
                    break;
                }
                Err(_) => {
                    let applied = propagator.progress.applied();
                    let txns = propagator.progress.txns_applied.load(Ordering::Acquire);
                    let source_lsn = self.source_wal_position().await;
                    let (rates, stall) = {
                        let mut meter = self.meter();
                        if let Some(s) = source_lsn {
                            meter.sample(Instant::now(), s, applied, txns);
                        }
                        (
                            meter.rates(Instant::now()),
                            meter.stalled(Instant::now(), self.config.catchup_converge_limit),
                        )
                    };
                    let replayed = self.txns_replayed();
                    let mut w = format!("target has applied up to {applied}, waiting for {lsn}");
                    if let Some(note) = &self.state.not_converging {
                        w.push_str("; ");
                        w.push_str(note);
                    }
                    self.reporter
                        .update(move |r| {
                            r.txns_replayed = replayed;
                            r.waiting_on = Some(w.clone());
                            rates.write_to(&mut r.rates);
                        })
                        .await?;
                    if detect {
                        if let Some(stall) = stall {
                            return Ok(Some(stall));
                        }
                    }
                }
            }
        }
        let replayed = self.txns_replayed();
        let rates = {
            let mut meter = self.meter();
            let applied = propagator.progress.applied();
            let txns = propagator.progress.txns_applied.load(Ordering::Acquire);
            // The sync point is reached: the source was at most there when it was emitted.
            meter.caught_up(Instant::now(), applied, txns);
            meter.rates(Instant::now())
        };
        self.reporter
            .update(move |r| {
                r.txns_replayed = replayed;
                r.waiting_on = None;
                rates.write_to(&mut r.rates);
            })
            .await?;
        Ok(None)
    }

    /// The source's current WAL position; `None` when the source does not answer (the wait
    /// goes on; a source that is gone fails the stream).
    async fn source_wal_position(&self) -> Option<Lsn> {
        let source = self.source_session().await.ok()?;
        let lsn: String = source
            .query_one("SELECT pg_catalog.pg_current_wal_lsn()::text", &[])
            .await
            .ok()?
            .get(0);
        lsn.parse().ok()
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
        assert_eq!(after_round(ms(50), Duration::MAX), Round::CloseEnough);
        assert_eq!(after_round(ms(10), ms(5)), Round::CloseEnough);
        assert_eq!(after_round(ms(400), ms(600)), Round::Again);
        assert_eq!(after_round(ms(80), ms(70)), Round::NotConverging);
        assert_eq!(after_round(ms(9000), Duration::MAX), Round::Again);
        assert_eq!(after_round(ms(800), ms(900)), Round::Again);
        assert_eq!(after_round(ms(900), ms(900)), Round::NotConverging);
        assert_eq!(after_round(ms(1200), ms(900)), Round::NotConverging);
    }
}
