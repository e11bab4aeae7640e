#!/usr/bin/env python3
"""CPU of each applier in bench/catchup.sh: where the machine's cores go while the migration's
replay and PostgreSQL's own subscription apply the same stream.

    catchup_cpu.py sample CLUSTER_DIR OUT_CSV STOP_FILE
        Every 100 ms until STOP_FILE exists: the CPU time (utime + stime, /proc/<pid>/stat) every
        process of the pg_remus cluster in CLUSTER_DIR (remusctl's cluster.json: each node's
        postmaster and its children, the coordinator, the replay worker) has used since the
        sampler saw it first, summed by role. Each node's pg_stat_activity is read once a second
        (and when a new process appears) to give its backends a role. Appends
        `t,role,cpu_seconds` lines (t: epoch seconds, cpu_seconds: cumulative).

    catchup_cpu.py report CPU_CSV SAMPLES_CSV APPLIED_CSV
        One summary line: the cores each role used during the catch-up phase (the interval in
        which SAMPLES_CSV's phase column says `catchup`) and, for each applier, its CPU per MB of
        source WAL it applied over that interval (APPLIED_CSV: what each one's origins on the
        target say it applied).

Roles: `writers` (the source's pgbench backends), `replay apply sessions` (the target's
`remus-replay m<id> …` backends), `replay worker` and `coordinator` (the processes),
`replay walsender` and `subscription walsender` (the source's walsenders of the migration's and
the subscription's slots), `subscription apply worker` (the target's logical replication
worker), `other` (every other process of the cluster: checkpointer, walwriter, samplers, …).
Only stdlib; Linux /proc.
"""

import bisect
import csv
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
ROLES = [
    "writers",
    "replay apply sessions",
    "replay worker",
    "coordinator",
    "replay walsender",
    "subscription apply worker",
    "subscription walsender",
    "other",
]


def proc_stat(pid):
    """(ppid, cpu seconds) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after its closing one.
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def activity(node):
    """pid -> (backend_type, application_name) of `node`'s backends (empty if it cannot say)."""
    env = dict(os.environ, PGHOST=node["host"], PGPORT=str(node["port"]),
               PGPASSFILE=node["pgpass"], PGUSER=node.get("user", "postgres"),
               PGDATABASE="postgres", PGCONNECT_TIMEOUT="2")
    try:
        out = subprocess.run(
            ["psql", "-XAtq", "-F", "\t", "-c",
             "SELECT pid, backend_type, coalesce(application_name, '') FROM pg_stat_activity"],
            env=env, capture_output=True, text=True, timeout=5, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return {}
    result = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            result[int(parts[0])] = (parts[1], parts[2])
    return result


def role_of(backend_type, app):
    if backend_type == "walsender":
        if app.startswith("remus"):
            return "replay walsender"
        if app == "catchup_sub":
            return "subscription walsender"
        return "other"
    if backend_type == "logical replication worker":
        return "subscription apply worker"
    if app.startswith("remus-replay m"):
        return "replay apply sessions"
    if app == "pgbench":
        return "writers"
    return "other"


def sample(cluster_dir, out_csv, stop_file):
    with open(os.path.join(cluster_dir, "cluster.json")) as f:
        cluster = json.load(f)
    nodes = []
    for n in cluster["nodes"]:
        with open(os.path.join(n["data_dir"], "postmaster.pid")) as f:
            postmaster = int(f.readline())
        nodes.append(dict(n, pgpass=cluster["pgpass"], postmaster=postmaster))
    daemons = {}
    for key, role in (("coordinator", "coordinator"), ("replay_worker", "replay worker")):
        pid = (cluster.get(key) or {}).get("pid")
        if pid:
            daemons[int(pid)] = role
    postmasters = {n["postmaster"] for n in nodes}
    first = {}   # pid -> cpu seconds when first seen
    last = {}    # pid -> latest cpu seconds
    roles = {}   # pid -> role
    done = {r: 0.0 for r in ROLES}   # cpu of processes that have exited
    next_activity = 0.0
    with open(out_csv, "a") as out:
        while not os.path.exists(stop_file):
            now = time.time()
            seen = {}
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                pid = int(entry)
                st = proc_stat(pid)
                if st is None:
                    continue
                ppid, cpu = st
                if pid in daemons or ppid in postmasters:
                    seen[pid] = cpu
            unknown = any(p not in roles and p not in daemons for p in seen)
            if unknown or now >= next_activity:
                for n in nodes:
                    for pid, (btype, app) in activity(n).items():
                        if pid in seen:
                            roles[pid] = role_of(btype, app)
                next_activity = now + 1.0
            for pid, cpu in seen.items():
                first.setdefault(pid, cpu)
                last[pid] = cpu
            for pid in [p for p in last if p not in seen]:
                done[daemons.get(pid) or roles.get(pid, "other")] += last[pid] - first[pid]
                del last[pid]
                del first[pid]
            totals = dict(done)
            for pid, cpu in last.items():
                totals[daemons.get(pid) or roles.get(pid, "other")] += cpu - first[pid]
            for r in ROLES:
                out.write(f"{now:.3f},{r},{totals[r]:.2f}\n")
            out.flush()
            time.sleep(max(0.0, 0.1 - (time.time() - now)))


def at(series, t):
    """The value of a (times, values) step series at time t (the last sample at or before t)."""
    times, values = series
    i = bisect.bisect_right(times, t) - 1
    return values[i] if i >= 0 else None


def report(cpu_csv, samples_csv, applied_csv):
    with open(samples_csv) as f:
        catchup = [float(r[0]) for r in csv.reader(f) if len(r) > 4 and r[4] == "catchup"]
    if not catchup:
        print("  CPU during catch-up: no catch-up phase sampled")
        return
    t0, t1 = catchup[0], catchup[-1]
    cpu = {r: ([], []) for r in ROLES}
    with open(cpu_csv) as f:
        for t, role, secs in csv.reader(f):
            if role in cpu:
                cpu[role][0].append(float(t))
                cpu[role][1].append(float(secs))
    used = {}
    for role, series in cpu.items():
        a, b = at(series, t0), at(series, t1)
        used[role] = (b - a) if a is not None and b is not None else 0.0
    applied = ([], []), ([], [])
    with open(applied_csv) as f:
        for row in csv.reader(f):
            if len(row) < 3 or not row[0][:1].isdigit():
                continue
            for k, v in enumerate(row[1:3]):
                if v not in ("", "0"):
                    applied[k][0].append(float(row[0]))
                    applied[k][1].append(float(v))

    def mb_applied(k):
        a, b = at(applied[k], t0), at(applied[k], t1)
        if a is None:  # the subscription's origin may start moving inside the interval
            a = applied[k][1][0] if applied[k][1] else None
        return (b - a) / 1048576 if a is not None and b is not None else 0.0

    span = t1 - t0
    replay = ("replay apply sessions", "replay worker", "coordinator", "replay walsender")
    sub = ("subscription apply worker", "subscription walsender")
    replay_cpu = sum(used[r] for r in replay)
    sub_cpu = sum(used[r] for r in sub)
    replay_mb, sub_mb = mb_applied(0), mb_applied(1)

    def per_mb(c, mb):
        return f"{c / mb:.2f} CPU s per MB" if mb > 0.05 else "-"

    print(f"  CPU during catch-up ({span:.1f} s, cores used): writers {used['writers'] / span:.2f}; "
          f"replay {replay_cpu / span:.2f} (apply sessions {used['replay apply sessions'] / span:.2f}, "
          f"replay worker {used['replay worker'] / span:.2f}, coordinator {used['coordinator'] / span:.2f}, "
          f"walsender {used['replay walsender'] / span:.2f}) for {replay_mb:.1f} MB applied, "
          f"{per_mb(replay_cpu, replay_mb)}; subscription {sub_cpu / span:.2f} "
          f"(apply worker {used['subscription apply worker'] / span:.2f}, walsender "
          f"{used['subscription walsender'] / span:.2f}) for {sub_mb:.1f} MB applied, "
          f"{per_mb(sub_cpu, sub_mb)}; other {used['other'] / span:.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "sample":
        sample(*sys.argv[2:])
    elif len(sys.argv) == 5 and sys.argv[1] == "report":
        report(*sys.argv[2:])
    else:
        sys.exit(__doc__)
