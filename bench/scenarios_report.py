#!/usr/bin/env python3
"""Combines bench/scenarios.sh's runs into one Markdown table per scenario, a row per mode.

Usage: scenarios_report.py OUT SCENARIO... (reads OUT/<scenario>/<run>/{status, summary.json,
series.csv, migrations.tsv, add_node.tsv}).

"During" is the stretch from the first migration's start to the last one's end (the union of
the run's migration windows when they are back to back, as a drain's are); "before" is the run
from 1 s in (the clients connecting) to the first migration's start. Table 2: ingestion rows/s
during against before. Table 3: the mean latency of the main workload's commits (YCSB or TPC-C)
during minus before, weighted by commits per series window.

A run that added a node (scale-out: add_node.tsv) has "before" end where add-node started (the
load on the nodes as they were), and two more columns: the node added, when (s into the run),
add-node's time and the activation's (ms), and the main workload's mean latency while add-node
ran.
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


def load_add_node(rdir):
    """(node, start ms, end ms, activation ms or None) since the run's t0, or None."""
    path = os.path.join(rdir, "add_node.tsv")
    if not os.path.exists(path):
        return None
    f = open(path).read().rstrip("\n").split("\t")
    return f[0], int(f[1]), int(f[2]), (int(float(f[3])) if len(f) > 3 and f[3] else None)


def run_row(rdir, label, add_cols):
    status = open(os.path.join(rdir, "status")).read().strip() if os.path.exists(
        os.path.join(rdir, "status")) else "not run"
    if status in ("refused", "not run"):
        return f"| {label} | {status} |" + " |" * (9 + add_cols)
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
    added = load_add_node(rdir)
    add_cells = ["–", "–"] if add_cols else []
    add_span = None
    if added:
        # add_node.tsv counts from scenarios.sh's t0, migrations.tsv too (column 9, the start);
        # remus-bench's clock starts a little later: the first migration gives the offset.
        off = 0
        if starts and migs:
            off = min(starts) - min(int(float(m[8] or 0)) for m in migs)
        node, s0, s1, act = added
        add_span = (s0 + off, s1 + off)
        _, _, la = span_stats(series.get(main, []), *add_span)
        add_cells = [f"{node} at {add_span[0] / 1000:.1f} s: {s1 - s0:,} ms "
                     f"(activation {fmt(act, ',')} ms)", fmt(la, ".2f")]
    if starts and ends:
        a, b = min(starts), max(ends)
        before = (WARMUP_MS, add_span[0] if add_span else a)
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
            f"{(max(ends) - min(starts)) if starts and ends else 0:,} | {t2} | {t3} |"
            + "".join(f" {c} |" for c in add_cells))


def main():
    out, scenarios = sys.argv[1], sys.argv[2:]
    print("# Scenario runs\n")
    for sc in scenarios:
        sdir = os.path.join(out, sc)
        if not os.path.isdir(sdir):
            continue
        runs = [os.path.join(sdir, r) for r in sorted(os.listdir(sdir))
                if os.path.isdir(os.path.join(sdir, r))]
        add_cols = 2 if any(os.path.exists(os.path.join(r, "add_node.tsv")) or
                            os.path.exists(os.path.join(r, "mover.failed")) for r in runs) else 0
        print(f"## {sc}\n")
        print("| mode / run | main commits | failed | aborts | aborted_by_migration | "
              "longest no-commit gap (ms) | migrations ok/all | total migration time (ms) | "
              "first start → last end (ms) | Table 2: ingest rows/s before → during | "
              "Table 3: mean latency ms before → during |"
              + (" node added: when, add-node time | Table 3: mean latency ms during add-node |"
                 if add_cols else ""))
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
              + " --- | ---: |" * (add_cols // 2))
        for rdir in runs:
            print(run_row(rdir, os.path.basename(rdir), add_cols))
        print()


if __name__ == "__main__":
    main()
