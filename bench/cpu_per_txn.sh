#!/usr/bin/env bash
# Server CPU per transaction, issue 16: plain PostgreSQL 15, pg_remus on one node and Citus 13.2.2
# on one node, the same stock pgbench workloads, measured as the CPU time the server's processes
# used per transaction instead of transactions per second.
#
# Why a second routing bench: on this 2-core machine the tps of two 15-s runs of the same build
# differ by 10-30 % (bench/README.md), which hides a change of a few microseconds per statement.
# The CPU a server spends per transaction moves much less with the machine's other load: it is
# read from /proc (clock ticks of the postmaster, of its live children and of the children it
# has reaped, so the pgbench backends are counted after they exit) before and after a run of a
# fixed number of transactions (`pgbench -t`). It counts the server only, not pgbench.
#
# Uses the anchor toolkit in ../shared/anchors/citus (ANCHOR_DIR overrides) for the servers and
# their identical settings, as bench/routing.sh does: every client over TCP on 127.0.0.1.
# Configurations: plain, r1 (1-node pg_remus, every shard local), csingle (1-node Citus).
# Workloads: sel (-S), selprep (-S -M prepared), tpcb (-b tpcb-like). Rows of r1 may be
# repeated with settings (REMUS_SETTINGS, space-separated name=value, each one a row of its own,
# passed through PGOPTIONS): an A/B of a pg_remus setting in one run.
#
# Environment: CONFIGS ("plain r1 csingle"), WORKLOADS ("sel selprep tpcb"), ROUNDS (3; rounds
# interleave every row), CLIENTS (8), TXNS (per client per run: 20000 for the reads, a tenth for
# TPC-B), REMUS_SETTINGS (""), SETUP (1: create and load every configuration fresh; 0: reuse
# WORK's), SCALE (toolkit, 20), WORK (/var/tmp/remus-bench-cpu), PORT_BASE (31000: below the ephemeral
# port range, which starts at 32768 here, so that no client connection holds a server's port),
# KEEP_DATA (0).
# Prints a markdown table: the median over rounds of µs of server CPU per transaction (each
# round's in brackets) and its ratio to plain's (lower is better). Results in $WORK/results/cpu.
#
# Usage: bash bench/cpu_per_txn.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ANCHOR_DIR=${ANCHOR_DIR:-$ROOT/../shared/anchors/citus}
if [ ! -f "$ANCHOR_DIR/lib.sh" ] || [ ! -x "$ANCHOR_DIR/setup.sh" ]; then
    echo "cpu_per_txn.sh: the Citus anchor toolkit is not at $ANCHOR_DIR (set ANCHOR_DIR)." >&2
    exit 2
fi
ANCHOR_DIR=$(cd "$ANCHOR_DIR" && pwd)
export REMUS_REPO=${REMUS_REPO:-$ROOT}
export WORK=${WORK:-/var/tmp/remus-bench-cpu} PORT_BASE=${PORT_BASE:-31000}
CONFIGS=${CONFIGS:-plain r1 csingle}; WORKLOADS=${WORKLOADS:-sel selprep tpcb}
ROUNDS=${ROUNDS:-3}; CLIENTS=${CLIENTS:-8}; SETUP=${SETUP:-1}; KEEP_DATA=${KEEP_DATA:-0}
REMUS_SETTINGS=${REMUS_SETTINGS:-}
# shellcheck source=/dev/null
source "$ANCHOR_DIR/lib.sh"
D=$OUT/cpu
mkdir -p "$D"
HZ=$(getconf CLK_TCK)

datadir_of() {
    case $1 in
        plain) plain_dir ;;
        r1) echo "$(remus_dir r1)/n1/data" ;;
        csingle) citus_dir single ;;
        *) die "unknown configuration $1" ;;
    esac
}
target_of() { case $1 in r1) echo r1n1 ;; *) echo "$1" ;; esac; }
setup_of() { case $1 in r1) echo remus1 ;; *) echo "$1" ;; esac; }
start_cfg() {
    case $1 in
        r1) remus_start r1 ;;
        csingle) citus_start single ;;
        plain) pg_start "$(plain_dir)" ;;
    esac
}
stop_cfg() {
    case $1 in
        r1) remus_stop r1 ;;
        csingle) citus_stop single ;;
        plain) pg_stop "$(plain_dir)" ;;
    esac
}
pgbench_args() {
    case $1 in
        sel) echo "-S" ;;
        selprep) echo "-S -M prepared" ;;
        tpcb) echo "-b tpcb-like" ;;
        *) die "unknown workload $1" ;;
    esac
}
txns_of() { [ "$1" = tpcb ] && echo "${TXNS:-2000}" || echo "${TXNS:-20000}"; }

# Clock ticks the server of data directory $1 has used: the postmaster's own and its reaped
# children's, plus those of the children alive now.
server_ticks() {
    local pm t c
    pm=$(head -n 1 "$1/postmaster.pid")
    t=$(awk '{ print $14 + $15 + $16 + $17 }' "/proc/$pm/stat")
    for c in $(pgrep -P "$pm" || true); do
        t=$((t + $(awk '{ print $14 + $15 }' "/proc/$c/stat" 2>/dev/null || echo 0)))
    done
    echo "$t"
}

# Rows: every configuration, r1 once per setting given.
ROWS=()
for cfg in $CONFIGS; do
    if [ "$cfg" = r1 ] && [ -n "$REMUS_SETTINGS" ]; then
        for s in $REMUS_SETTINGS; do ROWS+=("r1:$s"); done
    else
        ROWS+=("$cfg")
    fi
done

trap '"$ANCHOR_DIR/stop_all.sh" > /dev/null 2>&1 || true' EXIT
for cfg in $CONFIGS; do
    if [ "$SETUP" = 1 ]; then
        log "setting up $cfg"
        "$ANCHOR_DIR/setup.sh" "$(setup_of "$cfg")" > "$D/setup-$cfg.log" 2>&1 \
            || die "setup of $cfg failed: $D/setup-$cfg.log"
    else
        start_cfg "$cfg" > /dev/null 2>&1 || true
    fi
done
echo "$0 CONFIGS=\"$CONFIGS\" WORKLOADS=\"$WORKLOADS\" ROUNDS=$ROUNDS CLIENTS=$CLIENTS REMUS_SETTINGS=\"$REMUS_SETTINGS\" SCALE=$SCALE (git $(git -C "$ROOT" rev-parse --short HEAD))" > "$D/command.txt"
: > "$D/results.txt"
for round in $(seq 1 "$ROUNDS"); do
    for w in $WORKLOADS; do
        for row in "${ROWS[@]}"; do
            cfg=${row%%:*}; setting=${row#*:}; [ "$setting" = "$row" ] && setting=""
            dir=$(datadir_of "$cfg"); n=$(txns_of "$w")
            before=$(server_ticks "$dir")
            # shellcheck disable=SC2046
            out=$(PGOPTIONS="${setting:+-c $setting}" pgb "$(target_of "$cfg")" -n --max-tries=1 \
                $(pgbench_args "$w") -c "$CLIENTS" -j 2 -t "$n" 2>&1) || { log "$row $w failed"; echo "$out" >&2; continue; }
            sleep 0.3  # the backends have exited and been reaped
            after=$(server_ticks "$dir")
            done_txns=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<< "$out")
            us=$(awk -v a="$after" -v b="$before" -v n="$done_txns" -v hz="$HZ" 'BEGIN { printf "%.1f", (a - b) / hz * 1e6 / n }')
            printf '%s\t%s\t%s\t%s\n' "$round" "$row" "$w" "$us" >> "$D/results.txt"
            log "round $round $row $w: $us us of server CPU per transaction ($done_txns)"
        done
    done
done

python3 - "$D/results.txt" "$WORKLOADS" "${ROWS[@]}" > "$D/table.md" <<'PY'
import statistics, sys
path, workloads, rows = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
cells = {}
for line in open(path):
    rnd, row, w, us = line.rstrip("\n").split("\t")
    cells.setdefault((row, w), []).append(float(us))
names = {"plain": "plain PostgreSQL 15", "r1": "pg_remus, 1 node (owner)", "csingle": "Citus 13.2.2, single node"}
head = "| configuration | " + " | ".join(f"{w} µs/txn | ratio" for w in workloads) + " |"
print(head)
print("|---|" + "---:|---:|" * len(workloads))
for row in rows:
    cfg, _, setting = row.partition(":")
    out = [names.get(cfg, cfg) + (f" ({setting})" if setting else "")]
    for w in workloads:
        v = cells.get((row, w))
        base = cells.get(("plain", w))
        if not v:
            out += ["–", "–"]
            continue
        med = statistics.median(v)
        out.append(f"{med:.1f} ({'/'.join(f'{x:.1f}' for x in v)})")
        out.append(f"{med / statistics.median(base):.2f}" if base else "–")
    print("| " + " | ".join(out) + " |")
PY
cat "$D/table.md"
echo "results: $D"
for cfg in $CONFIGS; do stop_cfg "$cfg" > /dev/null 2>&1 || true; done
if [ "$KEEP_DATA" = 0 ]; then rm -rf "$(remus_dir r1)" "$(plain_dir)" "$(citus_dir single)"; fi
