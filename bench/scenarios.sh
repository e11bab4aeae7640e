#!/usr/bin/env bash
# The functions below are also called through run_one's "$@", which shellcheck cannot follow.
# shellcheck disable=SC2317
# The Remus paper's three scenarios (section 4), each in every mode of MODES, on a fresh cluster
# per (scenario, mode) (3 nodes; scale-out starts with 2 and adds one), with remus-bench for the
# load and the migrations running during the run (bench/README.md, "Scenarios"):
#
#   consolidation   hybrid A (and B) on n1..n3; scripts/drain-node.sh n3 --per-migration K
#                   --mode M started START_AFTER s into the run (all of n3's shards to n1, n2)
#   load_balancing  YCSB zipfian (unscrambled: key 1 hottest); before the run the shards with
#                   the most zipfian weight (sum of key^-0.99 over their rows) are put on n1,
#                   the others off it; during the run n1's HOT_MOVES hottest shards move to n2
#                   and n3, one per migration
#   scale_out       TPC-C on a 2-node cluster, n1 given most warehouses, n2 the rest; START_AFTER
#                   s into the run `remusctl cluster add-node` adds n3 to the running cluster,
#                   then half of n1's warehouse groups move to it, one per migration
#
# Per run, OUT/<scenario>/<mode>[-<workload>]/ holds remus-bench's series.csv, summary.json,
# tables.md, throughput.png, the migrations of the run (migrations.tsv) and the mover's log;
# scale-out's also add_node.tsv (the node added, add-node's start and end in ms since t0, the
# activation's time on the new node);
# at the end OUT/scenarios.md has one table per scenario, a row per mode. A mode the build
# refuses (0A000 'not available in this build') is reported as refused, and not run again.
#
#   MODES      (default "remus lock_abort wait_remaster albatross squall")
#   SCENARIOS  (default "consolidation load_balancing scale_out")
#   CONSOLIDATION_WORKLOADS (default "hybrid-a hybrid-b")
#   RUN_SECONDS (20)  START_AFTER (5)  CLIENTS (4, plus one for a hybrid's second client)
#   RECORDS (20000 YCSB rows, ~1 KB each)  SHARDS (6 YCSB shards)  LB_SHARDS (9, load balancing)
#   PER_MIGRATION (1)  HOT_MOVES (2)  WAREHOUSES (6)  TPCC_SHARDS (12)  BATCH_ROWS (500)
#   BASE_PORT (31000)  OUT (/var/tmp/remus-scenarios)  DIR (/var/tmp/remus-scenarios-cluster)
# Exit status: 0 when every run that was not refused ended ok (remus-bench's checks), else 1.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/../scripts/lib.sh"
cd "$REPO_ROOT"

modes=${MODES:-remus lock_abort wait_remaster albatross squall}
scenarios=${SCENARIOS:-consolidation load_balancing scale_out}
cons_workloads=${CONSOLIDATION_WORKLOADS:-hybrid-a hybrid-b}
secs=${RUN_SECONDS:-20}
start_after=${START_AFTER:-5}
clients=${CLIENTS:-4}
records=${RECORDS:-20000}
shards=${SHARDS:-6}
lb_shards=${LB_SHARDS:-9}
per=${PER_MIGRATION:-1}
hot_moves=${HOT_MOVES:-2}
warehouses=${WAREHOUSES:-6}
tpcc_shards=${TPCC_SHARDS:-12}
batch_rows=${BATCH_ROWS:-500}
port=${BASE_PORT:-31000}
out=${OUT:-/var/tmp/remus-scenarios}
dir=${DIR:-/var/tmp/remus-scenarios-cluster}
ctl="$REPO_ROOT/target/release/remusctl"
bench="$REPO_ROOT/target/release/remus-bench"
{ [ -x "$ctl" ] && [ -x "$bench" ]; } || die "build first: cargo build --release (remusctl, remus-bench)"

trap '"$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true' EXIT
mkdir -p "$out"

# psql on node $1 (n1 by default through `on n1`), unaligned, no header.
on() { local n=$1; shift; (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; "$@"); }
q() { on "${2:-n1}" psql -X -q -At -v ON_ERROR_STOP=1 -c "$1"; }

# The nodes of the cluster being measured (scale-out adds one during its run).
cluster_nodes=()

# A new cluster of $1 nodes (3 by default).
fresh_cluster() {
    local n=${1:-3} i
    "$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
    rm -rf "$dir"
    "$ctl" cluster up --nodes "$n" --dir "$dir" --base-port "$port" >/dev/null
    cluster_nodes=()
    for ((i = 1; i <= n; i++)); do cluster_nodes+=("n$i"); done
}

# "shard_id weight" for every shard of table $1 on every node, weight = SQL aggregate $2 over
# the shard table's rows (remus_shards.<table>_<id> on its owner).
shard_weights() {
    local table=$1 agg=$2 n
    for n in "${cluster_nodes[@]}"; do
        on "$n" psql -X -q -At -F ' ' -v ON_ERROR_STOP=1 <<SQL
SELECT format('SELECT %s, coalesce(($agg)::float8, 0) FROM remus_shards.%I',
              substring(tablename FROM '_(\d+)\$'), tablename)
  FROM pg_tables WHERE schemaname = 'remus_shards' AND tablename ~ '^${table}_\d+\$' \gexec
SQL
    done
}

# Setup moves (before the run, mode remus): shard $1 to node $2 unless it is there.
place() {
    local shard=$1 target=$2 owner
    owner=$(q "SELECT node_name FROM remus_shards WHERE shard_id = $shard")
    [ "$owner" = "$target" ] && return 0
    q "SELECT status FROM remus_migrate_shards(ARRAY[$shard]::bigint[], '$target', 'remus')" >/dev/null
}

# Runs migrations "shard target" (one per line of $1) in mode $2, one after the other, logging.
move_list() {
    local list=$1 mode=$2 shard target
    while read -r shard target; do
        [ -n "$shard" ] || continue
        echo "[move $(date +%T)] shard $shard -> $target ($mode)"
        q "SELECT migration_id, status, total_ms, aborted_by_migration
             FROM remus_migrate_shards(ARRAY[$shard]::bigint[], '$target', '$mode')" 2>&1 || true
    done <<<"$list"
}

# Milliseconds from epoch time $1 to epoch time $2 (both with fractions, as date +%s.%N).
ms_between() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%d", (b - a) * 1000 }'; }

# Scale-out's mover: adds a node to the running cluster (remusctl cluster add-node), then runs
# the migrations of $1 ("shard NEW" lines, NEW standing for the added node) in mode $2. Writes
# $3/add_node.tsv: the node, add-node's start and end (ms since the run's t0) and the
# activation's time, read on the new node from commit timestamps: from its CREATE EXTENSION's
# commit to remus_activate_node's (which follows remus_add_node on n1 and runs in one 2PC
# transaction over every member). A failed add-node writes $3/mover.failed and moves nothing.
add_node_then_move() {
    local list=$1 mode=$2 rdir=$3 t0 a b node act
    t0=$(cat "$rdir/t0")
    echo "[add-node $(date +%T)] remusctl cluster add-node --dir $dir"
    a=$(date +%s.%N)
    if ! node=$("$ctl" cluster add-node --dir "$dir"); then
        echo "[add-node $(date +%T)] failed after $(ms_between "$a" "$(date +%s.%N)") ms; no migration run"
        echo "add-node failed" > "$rdir/mover.failed"
        return 1
    fi
    b=$(date +%s.%N)
    act=$(q "SELECT round(extract(epoch FROM
                 (SELECT max(pg_xact_commit_timestamp(xmin)) FROM remus.distributed_tables)
               - (SELECT pg_xact_commit_timestamp(xmin) FROM pg_extension WHERE extname = 'pg_remus'))
               * 1000)" "$node") || act=""
    printf '%s\t%s\t%s\t%s\n' "$node" "$(ms_between "$t0" "$a")" "$(ms_between "$t0" "$b")" "$act" \
        > "$rdir/add_node.tsv"
    echo "[add-node $(date +%T)] $node added in $(ms_between "$a" "$b") ms (activation ${act:-?} ms)"
    move_list "${list//NEW/$node}" "$mode"
}

declare -A refused=()
status=0

# One run: scenario $1, mode $2, workload $3, run dir $4, mover command (a function and args).
run_one() {
    local scenario=$1 mode=$2 workload=$3 rdir=$4; shift 4
    local t0 mover_pid dist_args=()
    rm -rf "$rdir"; mkdir -p "$rdir"
    [ "$workload" = ycsb ] && dist_args=(--dist zipfian)
    # Where the shards are as the run starts.
    q "SELECT table_name, node_name, count(*), string_agg(shard_id::text, ',' ORDER BY shard_id)
         FROM remus_shards WHERE table_name IN ('usertable', 'warehouse') GROUP BY 1, 2 ORDER BY 1, 2" \
        > "$rdir/placement.txt"
    t0=$(date +%s.%N)
    echo "$t0" > "$rdir/t0"
    ( sleep "$start_after"; "$@" ) > "$rdir/mover.log" 2>&1 &
    mover_pid=$!
    local rc=0
    "$bench" --cluster-dir "$dir" run "$workload" --seconds "$secs" --clients "$clients" \
        --batch-rows "$batch_rows" "${dist_args[@]}" --out "$rdir" > "$rdir/bench.log" 2>&1 || rc=$?
    # A mover still going when the run ends: its migrations are waited for (they are not cut).
    wait "$mover_pid" || true
    q "SELECT migration_id, array_to_string(shard_ids, ','), source, target, mode, status,
              aborted_by_migration,
              round((extract(epoch FROM finished_at) - extract(epoch FROM started_at)) * 1000),
              round((extract(epoch FROM started_at) - $t0) * 1000),
              round((extract(epoch FROM finished_at) - $t0) * 1000), coalesce(error, '')
         FROM remus_migrations WHERE started_at >= to_timestamp($t0) ORDER BY migration_id" \
        | tr '|' '\t' > "$rdir/migrations.tsv" || true
    if grep -q "not available in this build" "$rdir/mover.log"; then
        refused[$mode]=1
        echo refused > "$rdir/status"
        log "$scenario/$mode: mode refused by this build (0A000 not available)"
        return 0
    fi
    if [ -e "$rdir/mover.failed" ]; then
        echo "failed ($(cat "$rdir/mover.failed"))" > "$rdir/status"; status=1
    elif [ "$rc" -eq 0 ]; then echo ok > "$rdir/status"; else echo "failed (rc $rc)" > "$rdir/status"; status=1; fi
    log "$scenario/$mode/$workload: $(cat "$rdir/status"); $(grep -c . "$rdir/migrations.tsv" || true) migration(s); $(tail -n 1 "$rdir/bench.log")"
}

drain_n3() {
    on n1 "$REPO_ROOT/scripts/drain-node.sh" n3 --per-migration "$per" --mode "$1"
}

scenario_consolidation() {
    local mode=$1 w
    for w in $cons_workloads; do
        [ -z "${refused[$mode]:-}" ] || return 0
        fresh_cluster
        "$bench" --cluster-dir "$dir" load ycsb --records "$records" --shards "$shards" >/dev/null
        run_one consolidation "$mode" "$w" "$out/consolidation/$mode-$w" drain_n3 "$mode"
    done
}

scenario_load_balancing() {
    local mode=$1 i=0 shard weight list="" hot=() cold=()
    fresh_cluster
    "$bench" --cluster-dir "$dir" load ycsb --records "$records" --shards "$lb_shards" >/dev/null
    # The hottest third of the shards on n1, the rest spread over n2 and n3.
    while read -r shard weight; do
        if [ "$i" -lt $((lb_shards / 3)) ]; then hot+=("$shard"); else cold+=("$shard"); fi
        i=$((i + 1))
    done < <(shard_weights usertable 'sum(power(ycsb_key, -0.99))' | sort -k2,2gr)
    for shard in "${hot[@]}"; do place "$shard" n1; done
    i=0
    for shard in "${cold[@]}"; do place "$shard" "n$((2 + i % 2))"; i=$((i + 1)); done
    shard_weights usertable 'sum(power(ycsb_key, -0.99))' | sort -k2,2gr > "$out/load_balancing/weights-$mode.txt" 2>/dev/null || true
    i=0
    for shard in "${hot[@]:0:$hot_moves}"; do
        list+="$shard n$((2 + i % 2))"$'\n'; i=$((i + 1))
    done
    run_one load_balancing "$mode" ycsb "$out/load_balancing/$mode" move_list "$list" "$mode"
}

scenario_scale_out() {
    local mode=$1 i=0 shard weight list="" full=() empty=() n1n
    # The nodes that hold data; the third is added during the run.
    fresh_cluster 2
    "$bench" --cluster-dir "$dir" load tpcc --warehouses "$warehouses" --shards "$tpcc_shards" >/dev/null
    while read -r shard weight; do
        if [ "${weight%.*}" -gt 0 ]; then full+=("$shard"); else empty+=("$shard"); fi
    done < <(shard_weights warehouse 'count(*)' | sort -k2,2gr -k1,1n)
    # Unequal load: three quarters of the warehouses (rounded up) on n1, the rest on n2.
    n1n=$(( (${#full[@]} * 3 + 3) / 4 ))
    for shard in "${full[@]}"; do
        if [ "$i" -lt "$n1n" ]; then place "$shard" n1; else place "$shard" n2; fi
        i=$((i + 1))
    done
    for shard in "${empty[@]}"; do place "$shard" n2; done
    # During the run: a node added, then half of n1's warehouse groups to it.
    for shard in "${full[@]:0:$((n1n / 2 > 0 ? n1n / 2 : 1))}"; do list+="$shard NEW"$'\n'; done
    run_one scale_out "$mode" tpcc "$out/scale_out/$mode" \
        add_node_then_move "$list" "$mode" "$out/scale_out/$mode"
}

for scenario in $scenarios; do
    mkdir -p "$out/$scenario"
    for mode in $modes; do
        if [ -n "${refused[$mode]:-}" ]; then
            log "$scenario/$mode: refused earlier, not run"
            mkdir -p "$out/$scenario/$mode"; echo refused > "$out/$scenario/$mode/status"
            continue
        fi
        log "$scenario/$mode"
        "scenario_$scenario" "$mode"
    done
done
"$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true

# shellcheck disable=SC2086 # a list
python3 "$REPO_ROOT/bench/scenarios_report.py" "$out" $scenarios > "$out/scenarios.md"
cat "$out/scenarios.md"
log "runs, series, plots and tables under $out"
exit $status
