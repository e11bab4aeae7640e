#!/usr/bin/env bash
# Routing overhead, issue 16: plain PostgreSQL 15, pg_remus and Citus 13.2.2 side by side, in one
# run, every client over TCP on 127.0.0.1, every server with the same settings.
#
# Uses the anchor toolkit in ../shared/anchors/citus (relative to the repository root; override
# with ANCHOR_DIR): its lib.sh gives every server the same postgresql.conf, its setup.sh creates
# each configuration fresh and loads `pgbench -i -s SCALE` through the entry node. Configurations
# (one at a time: each one starts, runs its workloads and stops before the next starts):
#   plain    plain PostgreSQL 15, no extension
#   r1       pg_remus, 1 node: every shard local (the pure cost of routing on the owner)
#   r3       pg_remus, 3 nodes, entered through n1, which owns no shard of accounts/history
#   csingle  Citus, single node (coordinator holding every shard)
#   citus    Citus, coordinator (no shards) + 2 workers, entered through the coordinator
#   hop      plain PostgreSQL entered through pgbouncer (session pooling, one server connection
#            per client): an entry that parses no SQL and only forwards each message to the
#            server holding the data. Not a rival: the ceiling, on this machine, of any entry node
#            that owns none of the data, r3's and Citus's coordinator's alike (one more process
#            and two more loopback messages per statement). Shares plain's data directory; its
#            pgbouncer listens on PORT_BASE + 420 (installed with apt-get when missing).
# Every configuration gets the same schema: pgbench -i, then history gets the (aid, hid uuid)
# primary key pg_remus needs (plain too); accounts by aid and history by aid (co-located) are
# distributed over SHARDS shards; branches and tellers stay local tables on the entry node.
# Workloads, stock pgbench scripts, `pgbench -n --max-tries=1`:
#   sel      select-only, simple protocol          (-S,              CLIENTS clients, -j 2)
#   selprep  select-only, prepared                 (-S -M prepared,  CLIENTS clients, -j 2)
#   tpcb     TPC-B, builtin tpcb-like               (-b tpcb-like,    CLIENTS clients, -j 2)
#   tpcbprep TPC-B, prepared (not in the default set: a transaction's statements with
#            parameters, as application drivers send them)
#                                                   (-b tpcb-like -M prepared, CLIENTS, -j 2)
#   agg      fan-out aggregate, one statement file  (-f: SELECT count(*), sum(abalance) FROM
#            pgbench_accounts; AGG_CLIENTS clients) over SCALE * 100,000 rows
# Prints a markdown table (tps, ratio to plain PostgreSQL of the same run); a workload that fails
# on a configuration shows as "failed" with its error below the table; the run goes on.
# Under it, the CPU each configuration's background processes (and pg_remus's etcd, coordinator
# and replay worker) used during each workload, as a share of the machine's cores.
#
# Environment: SECONDS_PER_RUN (20), ROUNDS (1; rounds interleave the configurations, the
# schema is loaded once in round 1), CLIENTS (8), AGG_CLIENTS (4), WARM (5 s of -S first),
# SCALE and SHARDS (toolkit: 20, 8), CONFIGS ("plain r1 r3 csingle citus hop"),
# WORKLOADS ("sel selprep agg tpcb"), REMUS_REPO (this repository), WORK, OUT,
# PORT_BASE (30000: the servers use 30010-30402, below the ephemeral port range),
# KEEP_DATA (0: data directories are removed at the end, results kept), SETUP_TIMEOUT (1800 s).
# pg_remus configurations run under `flock -s /tmp/remus-ext.lock` (REMUS_EXT_LOCK), so that a
# reinstall of the extension (which takes the lock exclusively) never swaps the .so under them.
#
# Usage: bash bench/routing.sh
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
ROOT=$(cd "$(dirname "$SELF")/.." && pwd)
ANCHOR_DIR=${ANCHOR_DIR:-$ROOT/../shared/anchors/citus}
if [ ! -f "$ANCHOR_DIR/lib.sh" ] || [ ! -x "$ANCHOR_DIR/setup.sh" ]; then
    echo "routing.sh: the Citus anchor toolkit is not at $ANCHOR_DIR (expected lib.sh and setup.sh)." >&2
    echo "routing.sh: it lives outside the repository, in ../shared/anchors/citus; set ANCHOR_DIR to its directory." >&2
    exit 2
fi
ANCHOR_DIR=$(cd "$ANCHOR_DIR" && pwd)
export ANCHOR_DIR REMUS_REPO=${REMUS_REPO:-$ROOT}
SECS=${SECONDS_PER_RUN:-20}; ROUNDS=${ROUNDS:-1}; CLIENTS=${CLIENTS:-8}; AGG_CLIENTS=${AGG_CLIENTS:-4}
WARM=${WARM:-5}; SETUP_TIMEOUT=${SETUP_TIMEOUT:-1800}; KEEP_DATA=${KEEP_DATA:-0}
CONFIGS=${CONFIGS:-plain r1 r3 csingle citus hop}; WORKLOADS=${WORKLOADS:-sel selprep agg tpcb}
LOCK=${REMUS_EXT_LOCK:-/tmp/remus-ext.lock}
export SECONDS_PER_RUN=$SECS ROUNDS CLIENTS AGG_CLIENTS WARM SETUP_TIMEOUT CONFIGS WORKLOADS
# Below the ephemeral port range (32768 and up here), where a client connection can hold a
# server's port: the toolkit's own default, 40000, is inside it.
export PORT_BASE=${PORT_BASE:-30000}
# The toolkit: settings, ports, start/stop, q/pgb (psql/pgbench over TCP), WORK, OUT, SCALE.
# shellcheck source=/dev/null
source "$ANCHOR_DIR/lib.sh"
D=$OUT/routing
mkdir -p "$D"

is_remus() { case $1 in r1|r3) return 0;; *) return 1;; esac; }
target_of() { case $1 in plain|hop) echo plain;; r1) echo r1n1;; r3) echo r3n1;; csingle) echo csingle;; citus) echo ccoord;; *) die "unknown configuration $1";; esac; }
setup_of() { case $1 in plain|hop) echo plain;; r1) echo remus1;; r3) echo remus;; csingle) echo csingle;; citus) echo citus;; esac; }
# pgbench's port: the target's, but pgbouncer's for hop.
P_HOP=$((PORT_BASE + 420))
entry_port_of() { if [ "$1" = hop ]; then echo "$P_HOP"; else port_of "$(target_of "$1")"; fi; }
HOP_DIR=$D/pgbouncer
hop_start() {
    mkdir -p "$HOP_DIR"
    # pgbouncer logs in to plain with the toolkit's password (SCRAM needs it in clear in its
    # auth_file); its clients, pgbench on loopback, are trusted.
    printf '"postgres" "%s"\n' "$(cut -d: -f5 "$(passfile_of plain)")" > "$HOP_DIR/users.txt"
    cat > "$HOP_DIR/pgbouncer.ini" <<EOF
[databases]
* = host=127.0.0.1 port=$P_PLAIN
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $P_HOP
unix_socket_dir =
auth_type = trust
auth_file = $HOP_DIR/users.txt
pool_mode = session
default_pool_size = $((CLIENTS + AGG_CLIENTS + 4))
max_client_conn = 200
logfile = $HOP_DIR/pgbouncer.log
pidfile = $HOP_DIR/pgbouncer.pid
EOF
    chown -R postgres "$HOP_DIR"; chmod 600 "$HOP_DIR/users.txt"
    as_pg pgbouncer -d "$HOP_DIR/pgbouncer.ini"
}
hop_stop() {
    local pid
    pid=$(cat "$HOP_DIR/pgbouncer.pid" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    rm -f "$HOP_DIR/pgbouncer.pid"
}
start_cfg() {
    case $1 in
        plain) pg_start "$(plain_dir)";; r1) remus_start r1;; r3) remus_start r3;;
        csingle) citus_start single;; citus) citus_start coord w1 w2;;
        hop) pg_start "$(plain_dir)"; hop_start;;
    esac
}
stop_cfg() {
    case $1 in
        plain) pg_stop "$(plain_dir)";; r1) remus_stop r1;; r3) remus_stop r3;;
        csingle) citus_stop single;; citus) citus_stop coord w1 w2;;
        hop) hop_stop; pg_stop "$(plain_dir)";;
    esac
}
nodes_of() { case $1 in plain|hop) echo plain;; r1) echo r1n1;; r3) echo r3n1 r3n2 r3n3;; csingle) echo csingle;; citus) echo ccoord cw1 cw2;; esac; }
ports_of() {
    case $1 in
        plain) echo "$P_PLAIN";; hop) echo "$P_PLAIN $P_HOP";;
        csingle) echo "$P_CSINGLE";; citus) echo "$P_CCOORD $P_CW1 $P_CW2";;
        r1) echo "$P_R1 $((P_R1 + 100)) $((P_R1 + 101)) $((P_R1 + 102))";;
        r3) echo "$P_R3 $((P_R3 + 1)) $((P_R3 + 2)) $((P_R3 + 100)) $((P_R3 + 101)) $((P_R3 + 102))";;
    esac
}

# The CPU a configuration spends outside the backends serving pgbench while a workload runs:
# every server's background processes (checkpointer, walwriter, autovacuum launcher, pg_remus's
# and Citus's background workers) and a pg_remus cluster's etcd, coordinator and replay worker.
# On this 2-core machine that CPU is taken from the clients and backends being measured, so each
# run records it (utime + stime in clock ticks, /proc/PID/stat; a process that exits during the
# run, e.g. an autovacuum worker, is not counted).
datadirs_of() {
    case $1 in
        plain|hop) plain_dir;; csingle) citus_dir single;;
        citus) citus_dir coord; citus_dir w1; citus_dir w2;;
        r1) echo "$(remus_dir r1)/n1/data";;
        r3) for i in 1 2 3; do echo "$(remus_dir r3)/n$i/data"; done;;
    esac
}
background_pids() { # cfg
    local dd pm
    for dd in $(datadirs_of "$1"); do
        pm=$(head -n1 "$dd/postmaster.pid" 2>/dev/null) || continue
        echo "$pm"
        # client backends show their client's address in their title; the rest are background
        ps -o pid=,args= --ppid "$pm" | awk '$0 !~ /127\.0\.0\.1\(/ {print $1}'
    done
    if is_remus "$1"; then
        python3 -c 'import json, sys
c = json.load(open(sys.argv[1]))
print("\n".join(str(c[k]["pid"]) for k in ("etcd", "coordinator", "replay_worker") if c.get(k) and c[k].get("pid")))' \
            "$(remus_dir "$1")/cluster.json" 2>/dev/null || true
    fi
}
cpu_ticks() { # pids... -> "pid ticks" lines
    local p
    for p in "$@"; do awk -v p="$p" '{print p, $14 + $15}' "/proc/$p/stat" 2>/dev/null || true; done
}

# ---------------------------------------------------------------- one configuration, one round
# Runs in its own process (`routing.sh __config CFG ROUND`), so that the toolkit's die, a failed
# setup or a hung server ends this configuration only.
bench_pgbench() { # configuration timeout-seconds pgbench-args...
    local cfg=$1 limit=$2; shift 2
    PGPASSFILE=$(passfile_of "$(target_of "$cfg")") timeout "$limit" pgbench -h 127.0.0.1 -p "$(entry_port_of "$cfg")" -n "$@"
}
run_config() {
    local round=$2 t w o rc tps lat failed err args
    CFG=$1
    t=$(target_of "$CFG")
    trap 'stop_cfg "$CFG"' EXIT
    local cfg=$CFG
    if [ "$round" = 1 ]; then
        log "$cfg: setup (fresh cluster, pgbench -i -s $SCALE, distribution)"
        if ! timeout "$SETUP_TIMEOUT" "$ANCHOR_DIR/setup.sh" "$(setup_of "$cfg")" > "$D/setup-$cfg.log" 2>&1; then
            log "$cfg: setup failed, see $D/setup-$cfg.log"
            echo "setup failed: $(grep -m1 -E 'ERROR|error|FATAL' "$D/setup-$cfg.log" || tail -n1 "$D/setup-$cfg.log")" > "$D/setup-failed-$cfg"
            return 1
        fi
        # What the comparison rests on, kept with the results: the settings of every node, the
        # aggregate's answer before any write (the same on every configuration, or the row is
        # not comparable), and where the shards are.
        for n in $(nodes_of "$cfg"); do
            q "$n" -Atc "SELECT name || ' = ' || setting FROM pg_settings
                         WHERE source NOT IN ('default', 'override', 'client', 'session')
                           AND name NOT IN ('port', 'unix_socket_directories', 'config_file', 'data_directory',
                                            'hba_file', 'ident_file', 'cluster_name', 'shared_preload_libraries')
                           AND name NOT LIKE 'citus.%' AND name NOT LIKE 'remus.%' ORDER BY 1" > "$D/settings-$cfg-$n.txt" 2>&1 || true
        done
        q "$t" -AtF ' ' -f "$D/agg.sql" > "$D/answer-$cfg.txt" 2>&1 || true
        case $cfg in
            r1|r3) q "$t" -AtF ' ' -c "SELECT node_name, table_name::text, count(*) FROM remus_shards GROUP BY 1, 2 ORDER BY 1, 2" > "$D/placement-$cfg.txt" 2>&1 || true;;
            csingle|citus) q "$t" -AtF ' ' -c "SELECT nodeport, table_name::text, count(*) FROM citus_shards GROUP BY 1, 2 ORDER BY 1, 2" > "$D/placement-$cfg.txt" 2>&1 || true;;
        esac
    else
        [ ! -f "$D/setup-failed-$cfg" ] || return 1
        start_cfg "$cfg"
    fi
    # In round 1 the setup started the server, not the configuration's own processes.
    if [ "$cfg" = hop ] && [ "$round" = 1 ]; then hop_start; fi
    q "$t" -qc CHECKPOINT || true
    bench_pgbench "$cfg" $((WARM + 60)) -S -c "$CLIENTS" -j 2 -T "$WARM" > /dev/null 2>&1 || true   # warm the buffers
    for w in $WORKLOADS; do
        case $w in
            sel) args=(-S -c "$CLIENTS" -j 2);;
            selprep) args=(-S -M prepared -c "$CLIENTS" -j 2);;
            tpcb) args=(-b tpcb-like -c "$CLIENTS" -j 2);;
            tpcbprep) args=(-b tpcb-like -M prepared -c "$CLIENTS" -j 2);;
            agg) args=(-f "$D/agg.sql" -c "$AGG_CLIENTS" -j "$((AGG_CLIENTS < 2 ? AGG_CLIENTS : 2))");;
            *) die "unknown workload $w";;
        esac
        o=$D/r$round-$cfg-$w.out
        rc=0
        # shellcheck disable=SC2046
        cpu_ticks $(background_pids "$cfg") > "$o.bg0"
        bench_pgbench "$cfg" $((SECS + 120)) --max-tries=1 -T "$SECS" "${args[@]}" > "$o" 2>&1 || rc=$?
        # shellcheck disable=SC2046
        cpu_ticks $(awk '{print $1}' "$o.bg0") > "$o.bg1"
        # background CPU as a share of the machine's cores over the run (ticks / (secs * HZ * cores))
        awk -v secs="$SECS" -v hz="$(getconf CLK_TCK)" -v cores="$(nproc)" -v tag="$round $cfg $w" \
            'NR == FNR {t0[$1] = $2; next} ($1 in t0) {d += $2 - t0[$1]}
             END {printf "%s %.1f\n", tag, 100 * d / (secs * hz * cores)}' "$o.bg0" "$o.bg1" >> "$D/background.txt"
        rm -f "$o.bg0" "$o.bg1"
        tps=$(awk '/^tps = / {print $3; exit}' "$o")
        lat=$(awk '/^latency average/ {print $4; exit}' "$o")
        failed=$(awk '/number of failed transactions/ {print $5; exit}' "$o")
        err=$(grep -m1 -E 'ERROR|error:|FATAL|aborted' "$o" | tr '\t' ' ' || true)
        if [ "$rc" != 0 ] || [ -z "$tps" ]; then
            echo "$round $cfg $w NA ${lat:-NA} ${failed:-NA} $rc" >> "$D/results.txt"
            printf '%s %s %s %s\n' "$round" "$cfg" "$w" "exit $rc: ${err:-no tps line}" >> "$D/errors.txt"
            log "$cfg $w: FAILED (exit $rc): ${err:-no tps line}"
        else
            echo "$round $cfg $w $tps ${lat:-NA} ${failed:-0} 0" >> "$D/results.txt"
            log "$cfg $w: $tps tps, ${lat:-NA} ms, ${failed:-0} failed"
            [ "${failed:-0}" = 0 ] || printf '%s %s %s %s\n' "$round" "$cfg" "$w" "$failed failed transactions: ${err:-}" >> "$D/errors.txt"
        fi
    done
}

if [ "${1:-}" = __config ]; then
    run_config "$2" "$3"
    exit $?
fi

# ---------------------------------------------------------------- the run
for c in $CONFIGS; do target_of "$c" > /dev/null; done
if [[ " $CONFIGS " =~ \ hop\  ]] && ! command -v pgbouncer > /dev/null; then
    log "installing pgbouncer (configuration hop)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer > /dev/null || die "could not install pgbouncer"
fi
if [ "$SCALE" -lt 10 ]; then
    log "warning: SCALE=$SCALE gives $((SCALE * 100000)) accounts rows; the fan-out target of issue 16 is over 1M rows (SCALE >= 10)"
fi
if [[ " $CONFIGS " =~ \ r[13]\  ]] && [ ! -x "$REMUS_REPO/target/release/remusctl" ]; then
    log "warning: $REMUS_REPO/target/release/remusctl missing: the pg_remus rows will fail"
fi
"$ANCHOR_DIR/stop_all.sh" > /dev/null 2>&1 || true
busy=""
for c in $CONFIGS; do
    for p in $(ports_of "$c"); do
        if ss -Htln "sport = :$p" | grep -q .; then busy="$busy $p"; fi
    done
done
[ -z "$busy" ] || die "ports already in use on 127.0.0.1:$busy (another run? set PORT_BASE)"
trap '"$ANCHOR_DIR/stop_all.sh" > /dev/null 2>&1 || true' EXIT
: > "$D/results.txt"; : > "$D/errors.txt"; : > "$D/background.txt"; rm -f "$D"/setup-failed-* "$D"/r[0-9]*-*.out "$D"/settings-* "$D"/answer-* "$D"/placement-*
echo 'SELECT count(*), sum(abalance) FROM pgbench_accounts;' > "$D/agg.sql"
cat > "$D/command.txt" <<EOF
$(date -u '+%Y-%m-%d %H:%M:%S UTC') $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo "?")
SECONDS_PER_RUN=$SECS ROUNDS=$ROUNDS CLIENTS=$CLIENTS AGG_CLIENTS=$AGG_CLIENTS WARM=$WARM SCALE=$SCALE SHARDS=$SHARDS CONFIGS="$CONFIGS" WORKLOADS="$WORKLOADS" bash bench/routing.sh
EOF
log "results in $D (WORK=$WORK)"
for round in $(seq 1 "$ROUNDS"); do
    for c in $CONFIGS; do
        log "round $round: $c"
        if is_remus "$c"; then
            flock -s "$LOCK" bash "$SELF" __config "$c" "$round" || log "$c: configuration failed in round $round"
        else
            bash "$SELF" __config "$c" "$round" || log "$c: configuration failed in round $round"
        fi
    done
done
"$ANCHOR_DIR/stop_all.sh" > /dev/null 2>&1 || true

python3 - "$D" "$CONFIGS" "$WORKLOADS" "$SCALE" <<'EOF' | tee "$D/table.md"
import collections, os, sys
d, configs, scale = sys.argv[1], sys.argv[2].split(), int(sys.argv[4])
# columns in the order of issue 16 (the runs put TPC-B last, so that its writes come after the reads)
workloads = [w for w in ("sel", "selprep", "tpcb", "tpcbprep", "agg") if w in sys.argv[3].split()]
names = {"plain": "plain PostgreSQL 15", "r1": "pg_remus, 1 node (owner)",
         "r3": "pg_remus, 3 nodes, via n1 (owns no shard)", "csingle": "Citus 13.2.2, single node",
         "citus": "Citus 13.2.2, coordinator + 2 workers",
         "hop": "plain PostgreSQL 15 through pgbouncer (ceiling of an entry that owns nothing)"}
heads = {"sel": "select-only", "selprep": "select-only -M prepared", "tpcb": "TPC-B (tpcb-like)",
         "tpcbprep": "TPC-B -M prepared",
         "agg": "count(*), sum over %s rows" % format(scale * 100000, ",")}
tps, bad, failed_txn = collections.defaultdict(list), collections.defaultdict(int), collections.defaultdict(int)
for line in open(os.path.join(d, "results.txt")):
    rnd, cfg, w, t, lat, failed, rc = line.split()
    if t == "NA":
        bad[(cfg, w)] += 1
    else:
        tps[(cfg, w)].append(float(t))
        if failed not in ("0", "NA"):
            failed_txn[(cfg, w)] += int(failed)
mean = lambda v: sum(v) / len(v)
fmt = lambda x: f"{x:,.0f}" if x >= 100 else f"{x:.2f}"
print("| configuration | " + " | ".join(f"{heads[w]} tps | ratio" for w in workloads) + " |")
print("|---|" + "---:|---:|" * len(workloads))
for c in configs:
    cells = []
    setup_failed = os.path.exists(os.path.join(d, f"setup-failed-{c}"))
    for w in workloads:
        v, base = tps.get((c, w)), tps.get(("plain", w))
        if not v:
            cells += ["setup failed" if setup_failed else "failed", "NA"]
            continue
        cell = fmt(mean(v))
        if len(v) > 1:
            cell += " (" + "/".join(fmt(x) for x in v) + ")"
        if bad.get((c, w)):
            cell += f" ({bad[(c, w)]} runs failed)"
        if failed_txn.get((c, w)):
            cell += f" ({failed_txn[(c, w)]} txns failed)"
        cells += [cell, f"{mean(v) / mean(base):.2f}" if base else "NA"]
    print(f"| {names.get(c, c)} | " + " | ".join(cells) + " |")
bg = collections.defaultdict(list)
bg_path = os.path.join(d, "background.txt")
for line in (open(bg_path) if os.path.exists(bg_path) else []):
    rnd, cfg, w, pct = line.split()
    bg[(cfg, w)].append(float(pct))
if bg:
    print("\nCPU of background processes and sidecars (server background workers; pg_remus's etcd,"
          " coordinator, replay worker) during each workload, % of the machine's cores, mean over rounds:\n")
    print("| configuration | " + " | ".join(heads[w] for w in workloads) + " |")
    print("|---|" + "---:|" * len(workloads))
    for c in configs:
        print(f"| {names.get(c, c)} | " + " | ".join(
            f"{mean(bg[(c, w)]):.1f}" if bg.get((c, w)) else "NA" for w in workloads) + " |")
errs = open(os.path.join(d, "errors.txt")).read().splitlines()
errs += [f"{c}: " + open(os.path.join(d, f"setup-failed-{c}")).read().strip() for c in configs
         if os.path.exists(os.path.join(d, f"setup-failed-{c}"))]
if errs:
    print("\nFailures (round config workload: error):\n")
    for e in errs:
        print(f"- {e}")
EOF

# The comparison assumes one postgresql.conf and one answer: report what differs from plain.
if [ -f "$D/settings-plain-plain.txt" ]; then
    for c in $CONFIGS; do
        [ "$c" != plain ] || continue
        for n in $(nodes_of "$c"); do
            f=$D/settings-$c-$n.txt
            [ -f "$f" ] || continue
            if ! diff -q "$D/settings-plain-plain.txt" "$f" > /dev/null; then
                echo
                echo "settings of $c node $n that differ from plain (< plain, > $n):"
                diff "$D/settings-plain-plain.txt" "$f" | grep '^[<>]' || true
            fi
        done
        if [ -f "$D/answer-$c.txt" ] && ! diff -q "$D/answer-plain.txt" "$D/answer-$c.txt" > /dev/null; then
            echo
            echo "WARNING: $c answered the fan-out aggregate '$(cat "$D/answer-$c.txt")', plain '$(cat "$D/answer-plain.txt")'"
        fi
    done
fi
if [ "$KEEP_DATA" = 0 ]; then
    rm -rf "$(plain_dir)" "$(citus_dir coord)" "$(citus_dir w1)" "$(citus_dir w2)" "$(citus_dir single)" \
        "$(remus_dir r1)" "$(remus_dir r3)"
fi
echo
echo "raw results (pgbench output per run, results.txt, errors.txt, settings, setup logs): $D"
