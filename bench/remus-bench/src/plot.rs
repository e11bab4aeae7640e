//! PNG plots in the manner of the Remus paper's figures 6–10: throughput over time per
//! workload, one panel each, the migration windows shaded.
//!
//! Text is drawn with plotters' `ab_glyph` backend from a TrueType file read at run time
//! (`REMUS_BENCH_FONT`, else DejaVu Sans or Liberation Sans where Debian puts them), so no
//! system font library is needed to build. Without a font file no plot is drawn (and the run
//! says so).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use crate::series::Window;
use crate::tables::MigrationWindow;

const FONT_FILES: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers the first font file found as "sans-serif" (once per process).
fn font() -> Result<()> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let candidates: Vec<String> = std::env::var("REMUS_BENCH_FONT")
            .into_iter()
            .chain(FONT_FILES.iter().map(|s| s.to_string()))
            .collect();
        let (path, bytes) = candidates
            .iter()
            .find_map(|p| std::fs::read(p).ok().map(|b| (p.clone(), b)))
            .ok_or_else(|| {
                format!("no font file (set REMUS_BENCH_FONT to a .ttf; tried {candidates:?})")
            })?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a font plotters can read"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// One panel per `(title, unit, windows)`: the unit's rate per second over the run's seconds.
pub fn throughput(
    path: &Path,
    panels: &[(String, &'static str, Vec<Window>)],
    migrations: &[MigrationWindow],
    width_ms: u64,
    end_ms: u64,
) -> Result<()> {
    font()?;
    let height = 300 * panels.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    let secs = end_ms as f64 / 1000.0;
    for ((title, unit, ws), area) in panels.iter().zip(areas) {
        let per_s = |w: &Window| {
            let v = if *unit == "rows/s" {
                w.units
            } else {
                w.commits
            };
            v as f64 * 1000.0 / width_ms as f64
        };
        let top = ws.iter().map(per_s).fold(0.0, f64::max).max(1.0) * 1.1;
        let mut chart = ChartBuilder::on(&area)
            .caption(title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..secs.max(0.1), 0.0..top)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc(*unit)
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(migrations.iter().map(|m| {
                Rectangle::new(
                    [
                        (m.start_ms as f64 / 1000.0, 0.0),
                        (m.end_ms.min(end_ms) as f64 / 1000.0, top),
                    ],
                    RGBColor(255, 210, 210).filled(),
                )
            }))
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .draw_series(LineSeries::new(
                ws.iter()
                    .map(|w| ((w.start_ms + width_ms / 2) as f64 / 1000.0, per_s(w))),
                BLUE.stroke_width(1),
            ))
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
