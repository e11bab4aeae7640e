#!/usr/bin/env python3
"""Combines bench/scenarios.sh's runs into one Markdown table per scenario, a row per mode.

Usage: scenarios_report.py OUT SCENARIO... (reads OUT/<scenario>/<run>/{status, summary.json,
series.csv, migrations.tsv}).

"During" is the stretch from the first migration's start to the last one's end (the union of
the run's migration windows when they are back to back, as a drain's are); "before" is the run
from 1 s in (the clients connecting) to the first migration's start. Table 2: ingestion rows/s
during against before. Table 3: the mean latency of the main workload's commits (YCSB or TPC-C)
during minus before, weighted by commits per series window.
"""
import csv
import json
import os
import sys

WARMUP_MS = 1000


def load_series(path):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.setdefault(r["workload"], []).append(r)
    return rows


def span_stats(series, a, b):
    """(commits, rows, weighted mean latency ms) of windows starting in [a, b)."""
    commits = rows = 0
    lat_sum = 0.0
    for r in series:
        s = int(r["window_start_ms"])
        if a <= s < b:
            c = int(r["commits"])
            commits += c
            rows += int(r["rows"])
            if c and r["mean_latency_ms"]:
                lat_sum += c * float(r["mean_latency_ms"])
    return commits, rows, (lat_sum / commits if commits else None)


def fmt(v, spec=".1f"):
    return "–" if v is None else format(v, spec)


def run_row(rdir, label):
    status = open(os.path.join(rdir, "status")).read().strip() if os.path.exists(
        os.path.join(rdir, "status")) else "not run"
    if status in ("refused", "not run"):
        return f"| {label} | {status} |" + " |" * 9
    summary = json.load(open(os.path.join(rdir, "summary.json")))
    series = load_series(os.path.join(rdir, "series.csv"))
    migs = []
    if os.path.exists(os.path.join(rdir, "migrations.tsv")):
        for line in open(os.path.join(rdir, "migrations.tsv")):
            f = line.rstrip("\n").split("\t")
            if len(f) >= 10:
                migs.append(f)
    ok_migs = [m for m in migs if m[5] == "succeeded"]
    main = "tpcc" if "tpcc" in series else "ycsb"
    sums = {s["workload"]: s for s in summary["summaries"]}
    failed = sum(s["failed"] for s in summary["summaries"])
    aborts = sum(s["aborts"] for s in summary["summaries"])
    by_mig = sum(int(m[6] or 0) for m in migs)
    gap = sums[main]["longest_no_commit_gap_ms"] if main in sums else None
    total_ms = sum(int(float(m[7] or 0)) for m in ok_migs)
    t2 = t3 = "–"
    # The windows on remus-bench's clock (ms since its run started), as its series are.
    starts = [w["start_ms"] for w in summary["migrations"]]
    ends = [w["end_ms"] for w in summary["migrations"]]
    if starts and ends:
        a, b = min(starts), max(ends)
        before = (WARMUP_MS, a)
        if "ingest" in series:
            _, rb, _ = span_stats(series["ingest"], *before)
            _, rd, _ = span_stats(series["ingest"], a, b)
            rate_b = rb * 1000 / max(1, before[1] - before[0])
            rate_d = rd * 1000 / max(1, b - a)
            pct = f" ({rate_d / rate_b * 100:.0f}%)" if rate_b else ""
            t2 = f"{rate_b:,.0f} → {rate_d:,.0f}{pct}"
        _, _, lb = span_stats(series.get(main, []), *before)
        _, _, ld = span_stats(series.get(main, []), a, b)
        if lb is not None and ld is not None:
            t3 = f"{lb:.2f} → {ld:.2f} (+{ld - lb:.2f})" if ld >= lb else \
                f"{lb:.2f} → {ld:.2f} ({ld - lb:.2f})"
    commits = sums[main]["commits"] if main in sums else 0
    not_ok = "" if status == "ok" else f" **{status}**"
    return (f"| {label}{not_ok} | {commits:,} | {failed} | {aborts} | {by_mig} | {fmt(gap, '.0f')} | "
            f"{len(ok_migs)}/{len(migs)} | {total_ms:,} | "
            f"{(max(ends) - min(starts)) if starts and ends else 0:,} | {t2} | {t3} |")


def main():
    out, scenarios = sys.argv[1], sys.argv[2:]
    print("# Scenario runs\n")
    for sc in scenarios:
        sdir = os.path.join(out, sc)
        if not os.path.isdir(sdir):
            continue
        print(f"## {sc}\n")
        print("| mode / run | main commits | failed | aborts | aborted_by_migration | "
              "longest no-commit gap (ms) | migrations ok/all | total migration time (ms) | "
              "first start → last end (ms) | Table 2: ingest rows/s before → during | "
              "Table 3: mean latency ms before → during |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        for run in sorted(os.listdir(sdir)):
            rdir = os.path.join(sdir, run)
            if os.path.isdir(rdir):
                print(run_row(rdir, run))
        print()


if __name__ == "__main__":
    main()
