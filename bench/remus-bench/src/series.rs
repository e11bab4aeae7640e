//! What every client did, one [`Event`] per transaction attempt, and what is made of it: the
//! per-window series (commits, aborts by SQLSTATE class, mean and p99 latency), the summary of
//! a workload (commits, aborts, longest no-commit gap, mean latency) and the CSV.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// How one attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Commit,
    /// Failed with an SQLSTATE of this class (`"40"`, `"08"`, `"RM"`; `"--"` for a failure
    /// without one, a lost connection) and was run again.
    Retried([u8; 2]),
    /// Failed with an SQLSTATE of this class and was not run again (YCSB's aborts, or a TPC-C
    /// transaction that failed otherwise than by a serialization failure or deadlock).
    Failed([u8; 2]),
}

/// One transaction attempt (or one COPY batch, or one analytical query).
#[derive(Clone, Copy, Debug)]
pub struct Event {
    /// When it ended, in microseconds since the run started.
    pub at_us: u64,
    pub latency_us: u64,
    pub outcome: Outcome,
    /// Rows it wrote (a COPY batch's size); 1 for a transaction.
    pub units: u64,
}

impl Event {
    pub fn is_commit(&self) -> bool {
        self.outcome == Outcome::Commit
    }

    /// The SQLSTATE class of a failed attempt.
    pub fn class(&self) -> Option<String> {
        match self.outcome {
            Outcome::Commit => None,
            Outcome::Retried(c) | Outcome::Failed(c) => Some(String::from_utf8_lossy(&c).into()),
        }
    }
}

/// The class of an error: its SQLSTATE's first two characters, `--` without one.
pub fn class_of(err: &tokio_postgres::Error) -> [u8; 2] {
    match err.code() {
        Some(c) => {
            let b = c.code().as_bytes();
            [b[0], b[1]]
        }
        None => *b"--",
    }
}

/// One window of the series.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Window {
    pub start_ms: u64,
    pub commits: u64,
    /// Rows committed (COPY batches' rows; transactions count 1).
    pub units: u64,
    /// Failed attempts by SQLSTATE class, retried or not.
    pub aborts: BTreeMap<String, u64>,
    pub mean_latency_ms: Option<f64>,
    pub p99_latency_ms: Option<f64>,
}

/// The p-th percentile (nearest rank) of sorted `v`.
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// `events` (any order) cut into windows of `width_ms` by their end time, from 0 up to
/// `end_ms` (the last window may be partial); events at or after `end_ms` are left out.
/// Latencies are of commits only.
pub fn windows(events: &[Event], width_ms: u64, end_ms: u64) -> Vec<Window> {
    assert!(width_ms > 0);
    let n = end_ms.div_ceil(width_ms) as usize;
    let mut out: Vec<Window> = (0..n)
        .map(|i| Window {
            start_ms: i as u64 * width_ms,
            ..Window::default()
        })
        .collect();
    let mut lat: Vec<Vec<u64>> = vec![Vec::new(); n];
    for e in events {
        let i = (e.at_us / 1000 / width_ms) as usize;
        if e.at_us >= end_ms * 1000 || i >= n {
            continue;
        }
        match e.class() {
            None => {
                out[i].commits += 1;
                out[i].units += e.units;
                lat[i].push(e.latency_us);
            }
            Some(c) => *out[i].aborts.entry(c).or_default() += 1,
        }
    }
    for (w, mut l) in out.iter_mut().zip(lat) {
        l.sort_unstable();
        w.mean_latency_ms = mean_ms(&l);
        w.p99_latency_ms = percentile(&l, 99.0).map(|v| v as f64 / 1000.0);
    }
    out
}

fn mean_ms(latencies_us: &[u64]) -> Option<f64> {
    (!latencies_us.is_empty())
        .then(|| latencies_us.iter().sum::<u64>() as f64 / latencies_us.len() as f64 / 1000.0)
}

/// The longest stretch of `0..end_us` without a commit: its length and where it starts, both
/// in microseconds. The stretches before the first and after the last commit count.
pub fn longest_gap(events: &[Event], end_us: u64) -> (u64, u64) {
    let mut at: Vec<u64> = events
        .iter()
        .filter(|e| e.is_commit() && e.at_us <= end_us)
        .map(|e| e.at_us)
        .collect();
    at.sort_unstable();
    let mut best = (0, 0);
    let mut prev = 0;
    for t in at.into_iter().chain(std::iter::once(end_us)) {
        if t - prev > best.0 {
            best = (t - prev, prev);
        }
        prev = t;
    }
    best
}

/// A workload's totals.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub workload: String,
    pub duration_ms: u64,
    pub commits: u64,
    pub units: u64,
    /// Failed attempts, retried or not, and by SQLSTATE class.
    pub aborts: u64,
    pub aborts_by_class: BTreeMap<String, u64>,
    /// Failed attempts that were not retried.
    pub failed: u64,
    pub mean_latency_ms: Option<f64>,
    pub p99_latency_ms: Option<f64>,
    pub longest_no_commit_gap_ms: f64,
    pub longest_no_commit_gap_at_ms: f64,
}

pub fn summarize(workload: &str, events: &[Event], end_us: u64) -> Summary {
    let mut lat: Vec<u64> = events
        .iter()
        .filter(|e| e.is_commit())
        .map(|e| e.latency_us)
        .collect();
    lat.sort_unstable();
    let mut by_class = BTreeMap::new();
    for c in events.iter().filter_map(Event::class) {
        *by_class.entry(c).or_default() += 1;
    }
    let (gap, gap_at) = longest_gap(events, end_us);
    Summary {
        workload: workload.into(),
        duration_ms: end_us / 1000,
        commits: lat.len() as u64,
        units: events
            .iter()
            .filter(|e| e.is_commit())
            .map(|e| e.units)
            .sum(),
        aborts: by_class.values().sum(),
        aborts_by_class: by_class,
        failed: events
            .iter()
            .filter(|e| matches!(e.outcome, Outcome::Failed(_)))
            .count() as u64,
        mean_latency_ms: mean_ms(&lat),
        p99_latency_ms: percentile(&lat, 99.0).map(|v| v as f64 / 1000.0),
        longest_no_commit_gap_ms: gap as f64 / 1000.0,
        longest_no_commit_gap_at_ms: gap_at as f64 / 1000.0,
    }
}

/// The CSV header of [`csv_rows`].
pub const CSV_HEADER: &str =
    "workload,window_start_ms,commits,rows,commits_per_s,aborts,aborts_by_class,mean_latency_ms,p99_latency_ms\n";

/// One line per window: `aborts_by_class` as `40:3;08:1`, latencies empty without commits.
pub fn csv_rows(workload: &str, ws: &[Window], width_ms: u64) -> String {
    let mut s = String::new();
    let opt = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_default();
    for w in ws {
        let classes: Vec<String> = w.aborts.iter().map(|(c, n)| format!("{c}:{n}")).collect();
        let _ = writeln!(
            s,
            "{workload},{},{},{},{:.1},{},{},{},{}",
            w.start_ms,
            w.commits,
            w.units,
            w.commits as f64 * 1000.0 / width_ms as f64,
            w.aborts.values().sum::<u64>(),
            classes.join(";"),
            opt(w.mean_latency_ms),
            opt(w.p99_latency_ms)
        );
    }
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn commit(at_ms: u64, latency_ms: u64) -> Event {
        Event {
            at_us: at_ms * 1000,
            latency_us: latency_ms * 1000,
            outcome: Outcome::Commit,
            units: 1,
        }
    }

    fn failed(at_ms: u64, class: &[u8; 2]) -> Event {
        Event {
            at_us: at_ms * 1000,
            latency_us: 1000,
            outcome: Outcome::Failed(*class),
            units: 0,
        }
    }

    #[test]
    fn events_fall_into_their_window_by_end_time() {
        let mut ev = vec![
            commit(0, 2),
            commit(99, 4),
            commit(100, 10),
            failed(150, b"40"),
            failed(160, b"40"),
            failed(170, b"08"),
            commit(399, 1),
            commit(400, 1), // at the end: left out
        ];
        ev.reverse(); // any order
        let ws = windows(&ev, 100, 400);
        assert_eq!(ws.len(), 4);
        assert_eq!(
            ws.iter().map(|w| w.start_ms).collect::<Vec<_>>(),
            [0, 100, 200, 300]
        );
        assert_eq!(
            ws.iter().map(|w| w.commits).collect::<Vec<_>>(),
            [2, 1, 0, 1]
        );
        assert_eq!(ws[0].mean_latency_ms, Some(3.0));
        assert_eq!(ws[0].p99_latency_ms, Some(4.0));
        assert_eq!(ws[1].aborts.get("40"), Some(&2));
        assert_eq!(ws[1].aborts.get("08"), Some(&1));
        assert_eq!(
            ws[2],
            Window {
                start_ms: 200,
                ..Window::default()
            }
        );
        let csv = csv_rows("ycsb", &ws, 100);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "ycsb,0,2,2,20.0,0,,3.000,4.000");
        assert_eq!(lines[1], "ycsb,100,1,1,10.0,3,08:1;40:2,10.000,10.000");
        assert_eq!(lines[2], "ycsb,200,0,0,0.0,0,,,");
        assert_eq!(
            CSV_HEADER.trim_end().split(',').count(),
            lines[0].split(',').count()
        );
    }

    #[test]
    fn a_partial_last_window_is_kept() {
        let ws = windows(&[commit(250, 1)], 100, 251);
        assert_eq!(ws.len(), 3);
        assert_eq!(ws[2].commits, 1);
    }

    #[test]
    fn p99_is_the_nearest_rank() {
        let v: Vec<u64> = (1..=200).collect();
        assert_eq!(percentile(&v, 99.0), Some(198));
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[], 99.0), None);
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
    }

    #[test]
    fn the_longest_gap_counts_the_edges_and_ignores_aborts() {
        // Commits at 100, 200, 900 of 1000 ms; an abort in the gap changes nothing.
        let ev = [
            commit(200, 1),
            commit(100, 1),
            failed(500, b"40"),
            commit(900, 1),
        ];
        assert_eq!(longest_gap(&ev, 1_000_000), (700_000, 200_000));
        // Leading gap.
        assert_eq!(longest_gap(&[commit(600, 1)], 1_000_000), (600_000, 0));
        // Trailing gap.
        assert_eq!(
            longest_gap(&[commit(100, 1), commit(200, 1)], 1_000_000),
            (800_000, 200_000)
        );
        // No commit: the whole run.
        assert_eq!(longest_gap(&[failed(5, b"40")], 1_000_000), (1_000_000, 0));
    }

    #[test]
    fn the_summary_counts_commits_aborts_and_failures() {
        let mut retried = failed(30, b"40");
        retried.outcome = Outcome::Retried(*b"40");
        let ev = [
            commit(10, 2),
            commit(20, 4),
            retried,
            failed(40, b"RM"),
            Event {
                units: 500,
                ..commit(50, 6)
            },
        ];
        let s = summarize("w", &ev, 100_000);
        assert_eq!(s.commits, 3);
        assert_eq!(s.units, 502);
        assert_eq!(s.aborts, 2);
        assert_eq!(s.failed, 1);
        assert_eq!(s.aborts_by_class.get("RM"), Some(&1));
        assert_eq!(s.mean_latency_ms, Some(4.0));
        assert_eq!(s.longest_no_commit_gap_ms, 50.0);
        assert_eq!(s.longest_no_commit_gap_at_ms, 50.0);
    }
}
