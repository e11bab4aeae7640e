//! What the driver measures of a migration's catch-up while it waits for the stream (decision
//! 0022): the source's and the replay's rates, the lag in bytes and in time, and whether the lag
//! still shrinks.

use std::time::{Duration, Instant};

use wal_propagator::Lsn;

use crate::migration::Rates;

/// What the convergence check saw when it gave up (decision 0022).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    pub source_rate: u64,
    pub replay_rate: u64,
    pub replay_txns: u64,
    pub lag_bytes: u64,
    pub lag_ms: u64,
}

/// One look at the stream: the source's WAL position and the target's applied position.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    source: Lsn,
    applied: Lsn,
    txns: u64,
}

/// Samples of a migration's catch-up, once a second while the driver waits for the stream:
/// the rates over the last [`RATE_WINDOW`], the lag in bytes and in time (since when the
/// source was where the target now is), and the smallest lag seen with when it was seen.
#[derive(Debug, Default)]
pub struct Meter {
    samples: std::collections::VecDeque<Sample>,
    /// The smallest lag seen and when it was last seen; reset by [`Meter::restart`].
    best: Option<(u64, Instant)>,
    started: Option<Instant>,
}

/// Rates are averaged over this long.
const RATE_WINDOW: Duration = Duration::from_secs(5);
/// Samples older than this are dropped (the lag in time reads as "at least this").
const HISTORY: Duration = Duration::from_secs(3600);

/// The measured values, as the record keeps them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Measured {
    source_rate: Option<u64>,
    replay_rate: Option<u64>,
    replay_txns: Option<u64>,
    lag_bytes: Option<u64>,
    lag_ms: Option<u64>,
}

impl Measured {
    pub fn write_to(&self, r: &mut Rates) {
        if self.lag_bytes.is_some() {
            r.lag_bytes = self.lag_bytes;
            r.lag_ms = self.lag_ms;
        }
        if self.source_rate.is_some() {
            r.source_wal_bytes_per_sec = self.source_rate;
            r.replay_bytes_per_sec = self.replay_rate;
            r.replay_txns_per_sec = self.replay_txns;
        }
    }
}

impl Meter {
    /// A new catch-up: the convergence limit counts from now.
    pub fn restart(&mut self) {
        *self = Meter {
            started: Some(Instant::now()),
            ..Meter::default()
        };
    }

    pub fn sample(&mut self, at: Instant, source: Lsn, applied: Lsn, txns: u64) {
        // The source's position never goes back; a sample taken before the applied position
        // was read may show it behind.
        let source = source.max(applied);
        self.samples.push_back(Sample {
            at,
            source,
            applied,
            txns,
        });
        while self
            .samples
            .front()
            .is_some_and(|s| at.duration_since(s.at) > HISTORY)
        {
            self.samples.pop_front();
        }
        let lag = source.0 - applied.0;
        if self.best.is_none_or(|(b, _)| lag <= b) {
            self.best = Some((lag, at));
        }
    }

    /// The target has applied a sync point: it was no further behind than the source was at
    /// the last sample.
    pub fn caught_up(&mut self, at: Instant, applied: Lsn, txns: u64) {
        let source = self
            .samples
            .back()
            .map_or(applied, |s| s.source)
            .max(applied);
        self.sample(at, source, applied, txns);
    }

    pub fn rates(&self, now: Instant) -> Measured {
        let Some(last) = self.samples.back().copied() else {
            return Measured::default();
        };
        let lag_bytes = last.source.0 - last.applied.0;
        // Since when the source has been past the applied position: the first sample whose
        // source position is at or beyond it.
        let lag_ms = if lag_bytes == 0 {
            0
        } else {
            let since = self
                .samples
                .iter()
                .find(|s| s.source >= last.applied)
                .map_or(last.at, |s| s.at);
            now.duration_since(since).as_millis() as u64
        };
        let mut m = Measured {
            lag_bytes: Some(lag_bytes),
            lag_ms: Some(lag_ms),
            ..Measured::default()
        };
        let first = self
            .samples
            .iter()
            .find(|s| last.at.duration_since(s.at) <= RATE_WINDOW)
            .copied()
            .unwrap_or(last);
        let ms = last.at.duration_since(first.at).as_millis() as u64;
        let per_sec = |d: u64| (d * 1000).checked_div(ms);
        m.source_rate = per_sec(last.source.0 - first.source.0);
        m.replay_rate = per_sec(last.applied.0.saturating_sub(first.applied.0));
        m.replay_txns = per_sec(last.txns.saturating_sub(first.txns));
        m
    }

    /// Not converging: the lag has not come back to its smallest value for `limit` (counted from
    /// the catch-up's start at the earliest).
    pub fn stalled(&self, now: Instant, limit: Duration) -> Option<Stall> {
        let (_, best_at) = self.best?;
        let since = self.started.map_or(best_at, |s| s.max(best_at));
        if now.duration_since(since) < limit {
            return None;
        }
        let m = self.rates(now);
        Some(Stall {
            source_rate: m.source_rate.unwrap_or(0),
            replay_rate: m.replay_rate.unwrap_or(0),
            replay_txns: m.replay_txns.unwrap_or(0),
            lag_bytes: m.lag_bytes.unwrap_or(0),
            lag_ms: m.lag_ms.unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meter_rates_lag_and_stall() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut m = Meter {
            started: Some(t0),
            ..Meter::default()
        };
        assert!(m.rates(t0).lag_bytes.is_none());
        // The source writes 1000 B/s, the target applies 400 B/s.
        for i in 0..=4u64 {
            m.sample(
                t0 + s(i),
                Lsn(10_000 + 1000 * i),
                Lsn(10_000 + 400 * i),
                2 * i,
            );
        }
        let r = m.rates(t0 + s(4));
        assert_eq!(r.source_rate, Some(1000));
        assert_eq!(r.replay_rate, Some(400));
        assert_eq!(r.replay_txns, Some(2));
        assert_eq!(r.lag_bytes, Some(2400));
        // The target (11_600) is where the source was at t0 + 2 s.
        assert_eq!(r.lag_ms, Some(2000));
        // The lag was smallest at t0 (0): after the limit from then, not converging.
        assert!(m.stalled(t0 + s(4), s(10)).is_none());
        let stall = m.stalled(t0 + s(10), s(10)).expect("stalled");
        assert_eq!((stall.source_rate, stall.replay_rate), (1000, 400));
        // A smaller lag restarts the window.
        m.sample(t0 + s(11), Lsn(16_000), Lsn(16_000), 20);
        assert!(m.stalled(t0 + s(12), s(10)).is_none());
        assert_eq!(m.rates(t0 + s(11)).lag_ms, Some(0));
    }
}
