#!/usr/bin/env python3
"""Where the slow transactions of the anchors' E1 handover window fall (issue 17).

For each pg_remus run directory of the Citus anchor toolkit's results (`$WORK/results/e1-remus-N`:
`events.env`, the pgbench per-transaction logs `main.*`, the coordinator's `coordinator.log`),
prints the transactions that committed within +-1 s of the cutover (the toolkit's window), by the
migration phase their commit fell in (copy, catch-up, barrier to Tm committed, cleanup, after the
move), with how many of them are at or above the window's p99 and at or above THRESHOLD ms.
Measurement only (bench/README.md, "Where the window's slow transactions are").

    python3 bench/e1_window_phases.py [--threshold-ms 13] RUN_DIR...
"""
import argparse
import collections
import datetime
import glob
import re
import sys

PHASES = ["copy", "catch-up", "barrier to Tm committed", "cleanup", "after the move"]


def epoch(iso):
    return datetime.datetime.fromisoformat(iso).replace(tzinfo=datetime.timezone.utc).timestamp()


def marks_of(log_path):
    """The catch-up's start, Tm's commit and the migration's end, from the coordinator's log."""
    marks = {}
    with open(log_path) as log:
        for line in log:
            m = re.match(r"(\S+)Z", line)
            if not m:
                continue
            if "phase started" in line and "phase=catchup" in line:
                marks.setdefault("catchup", epoch(m.group(1)))
            elif "Tm committed on every node" in line:
                marks["tm"] = epoch(m.group(1))
            elif "phase=done" in line and "succeeded" in line:
                marks["done"] = epoch(m.group(1))
    return marks


def commits_of(run_dir, lo, hi):
    """(commit time, latency ms) of every transaction committed in [lo, hi]."""
    out = []
    for path in glob.glob(run_dir + "/main.[0-9]*"):
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) < 6 or not p[2].isdigit():
                    continue
                end = int(p[4]) + int(p[5]) / 1e6
                if lo <= end <= hi:
                    out.append((end, int(p[2]) / 1000))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threshold-ms", type=float, default=13.0)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    for run_dir in args.runs:
        with open(run_dir + "/events.env") as f:
            ev = dict(line.strip().split("=", 1) for line in f if "=" in line)
        cut_start, cut_end = float(ev["cut_start"]), float(ev["cut_end"])
        marks = marks_of(run_dir + "/coordinator.log")
        missing = {"catchup", "tm", "done"} - marks.keys()
        if missing:
            print(f"{run_dir}: coordinator.log lacks {sorted(missing)}", file=sys.stderr)
            continue
        txns = commits_of(run_dir, cut_start - 1, cut_end + 1)
        if not txns:
            print(f"{run_dir}: no transaction in the window", file=sys.stderr)
            continue
        lats = sorted(lat for _, lat in txns)
        p99 = lats[int(len(lats) * 0.99)]

        def phase(end):
            if end < marks["catchup"]:
                return PHASES[0]
            if end < cut_start:
                return PHASES[1]
            if end < marks["tm"]:
                return PHASES[2]
            if end < marks["done"]:
                return PHASES[3]
            return PHASES[4]

        total, slow, over = (collections.Counter() for _ in range(3))
        for end, lat in txns:
            k = phase(end)
            total[k] += 1
            slow[k] += lat >= p99
            over[k] += lat >= args.threshold_ms
        print(f"{run_dir}: {len(txns)} transactions in the window, p99 {p99:.1f} ms")
        for k in PHASES:
            print(f"  {k}: {total[k]} transactions, {slow[k]} >= p99, "
                  f"{over[k]} >= {args.threshold_ms:g} ms")


if __name__ == "__main__":
    main()
