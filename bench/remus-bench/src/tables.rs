//! The arithmetic of the Remus paper's Table 2 (batch-ingestion throughput before and during a
//! migration) and Table 3 (mean latency increase of transactions during a migration), given the
//! migration windows.
//!
//! "Before" a window is the stretch of the same length that ends where the window starts, cut
//! at the run's start and at the end of the previous window (so it never overlaps a migration).

use serde::Serialize;

use crate::series::Event;

/// A migration, in milliseconds since the run started.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MigrationWindow {
    pub label: String,
    pub start_ms: u64,
    pub end_ms: u64,
}

/// The "before" stretch of `windows[i]`: `(start, end)` in ms, `None` when empty.
pub fn before_span(windows: &[MigrationWindow], i: usize) -> Option<(u64, u64)> {
    let w = &windows[i];
    let len = w.end_ms.saturating_sub(w.start_ms).max(1);
    let prev_end = windows
        .iter()
        .filter(|o| o.end_ms <= w.start_ms)
        .map(|o| o.end_ms)
        .max()
        .unwrap_or(0);
    let start = w.start_ms.saturating_sub(len).max(prev_end);
    (start < w.start_ms).then_some((start, w.start_ms))
}

/// Rows committed per second by events ending in `[a, b)` ms.
pub fn rate(events: &[Event], (a, b): (u64, u64)) -> f64 {
    let rows: u64 = in_span(events, (a, b)).map(|e| e.units).sum();
    rows as f64 * 1000.0 / (b - a).max(1) as f64
}

/// Mean latency (ms) of commits ending in `[a, b)` ms.
pub fn mean_latency(events: &[Event], (a, b): (u64, u64)) -> Option<f64> {
    let (n, sum) =
        in_span(events, (a, b)).fold((0u64, 0u64), |(n, s), e| (n + 1, s + e.latency_us));
    (n > 0).then(|| sum as f64 / n as f64 / 1000.0)
}

fn in_span(events: &[Event], (a, b): (u64, u64)) -> impl Iterator<Item = &Event> {
    events
        .iter()
        .filter(move |e| e.is_commit() && e.at_us >= a * 1000 && e.at_us < b * 1000)
}

/// A row of Table 2.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct IngestRow {
    pub window: String,
    pub rows_per_s_before: f64,
    pub rows_per_s_during: f64,
    /// During as a percentage of before (the paper's 93%).
    pub percent_of_before: Option<f64>,
}

pub fn table2(ingest: &[Event], windows: &[MigrationWindow]) -> Vec<IngestRow> {
    (0..windows.len())
        .map(|i| {
            let w = &windows[i];
            let during = rate(ingest, (w.start_ms, w.end_ms.max(w.start_ms + 1)));
            let before = before_span(windows, i).map(|s| rate(ingest, s));
            IngestRow {
                window: w.label.clone(),
                rows_per_s_before: before.unwrap_or(0.0),
                rows_per_s_during: during,
                percent_of_before: before.filter(|b| *b > 0.0).map(|b| during / b * 100.0),
            }
        })
        .collect()
}

/// A row of Table 3.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatencyRow {
    pub window: String,
    pub workload: String,
    pub mean_ms_before: Option<f64>,
    pub mean_ms_during: Option<f64>,
    /// During minus before (the paper's 1.7–6.6 ms for Remus).
    pub increase_ms: Option<f64>,
}

pub fn table3(workload: &str, events: &[Event], windows: &[MigrationWindow]) -> Vec<LatencyRow> {
    (0..windows.len())
        .map(|i| {
            let w = &windows[i];
            let during = mean_latency(events, (w.start_ms, w.end_ms.max(w.start_ms + 1)));
            let before = before_span(windows, i).and_then(|s| mean_latency(events, s));
            LatencyRow {
                window: w.label.clone(),
                workload: workload.into(),
                mean_ms_before: before,
                mean_ms_during: during,
                increase_ms: before.zip(during).map(|(b, d)| d - b),
            }
        })
        .collect()
}

/// Parses `START_MS-END_MS` or `LABEL=START_MS-END_MS` (ms since the run started).
pub fn parse_window(s: &str) -> Result<MigrationWindow, String> {
    let (label, span) = match s.split_once('=') {
        Some((l, r)) => (l.to_string(), r),
        None => (s.to_string(), s),
    };
    let (a, b) = span
        .split_once('-')
        .ok_or_else(|| format!("{s}: expected START_MS-END_MS"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<u64>()
            .map_err(|e| format!("{s}: {v}: {e}"))
    };
    let (start_ms, end_ms) = (num(a)?, num(b)?);
    if end_ms < start_ms {
        return Err(format!("{s}: the window ends before it starts"));
    }
    Ok(MigrationWindow {
        label,
        start_ms,
        end_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::series::tests::commit;

    fn w(label: &str, a: u64, b: u64) -> MigrationWindow {
        MigrationWindow {
            label: label.into(),
            start_ms: a,
            end_ms: b,
        }
    }

    #[test]
    fn before_is_as_long_as_the_window_and_never_overlaps_another() {
        let ws = [w("a", 5000, 7000), w("b", 7500, 9500), w("c", 500, 1500)];
        assert_eq!(before_span(&ws, 0), Some((3000, 5000)));
        // Cut at the end of "a".
        assert_eq!(before_span(&ws, 1), Some((7000, 7500)));
        // Cut at the run's start.
        assert_eq!(before_span(&ws, 2), Some((0, 500)));
        assert_eq!(before_span(&[w("x", 0, 100)], 0), None);
        assert_eq!(
            before_span(&[w("x", 1000, 3000), w("y", 3000, 4000)], 1),
            None
        );
    }

    #[test]
    fn table2_compares_rows_per_second() {
        // Before (1000..2000): 4 batches of 100 rows; during (2000..3000): 3 batches of 100.
        let mut ev = Vec::new();
        for t in [1000, 1200, 1500, 1999] {
            ev.push(Event {
                units: 100,
                ..commit(t, 1)
            });
        }
        for t in [2000, 2500, 2999] {
            ev.push(Event {
                units: 100,
                ..commit(t, 1)
            });
        }
        ev.push(Event {
            units: 100,
            ..commit(3000, 1)
        }); // after the window
        let rows = table2(&ev, &[w("m1", 2000, 3000)]);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].rows_per_s_before, 400.0);
        assert_eq!(rows[0].rows_per_s_during, 300.0);
        assert_eq!(rows[0].percent_of_before, Some(75.0));
        // Nothing before: no ratio.
        let rows = table2(&ev[4..], &[w("m1", 2000, 3000)]);
        assert_eq!(rows[0].percent_of_before, None);
    }

    #[test]
    fn table3_is_the_difference_of_mean_latencies() {
        let ev = [
            commit(100, 2),
            commit(900, 4),
            commit(1100, 5),
            commit(1500, 9),
            commit(2500, 100),
        ];
        let rows = table3("ycsb", &ev, &[w("m1", 1000, 2000)]);
        assert_eq!(rows[0].mean_ms_before, Some(3.0));
        assert_eq!(rows[0].mean_ms_during, Some(7.0));
        assert_eq!(rows[0].increase_ms, Some(4.0));
        let none = table3("ycsb", &ev[2..], &[w("m1", 1000, 2000)]);
        assert_eq!(none[0].increase_ms, None);
    }

    #[test]
    fn windows_parse_with_and_without_labels() {
        assert_eq!(parse_window("m1=10-20"), Ok(w("m1", 10, 20)));
        assert_eq!(parse_window("10-20"), Ok(w("10-20", 10, 20)));
        assert!(parse_window("20-10").is_err());
        assert!(parse_window("x").is_err());
    }
}
