#!/usr/bin/env bash
# The same consolidation (every shard of n3 onto n1 and n2) under pgbench TPC-B against all three
# nodes, once per handover mode, recorded with pgbench's per-transaction log (-l). Prints, per
# mode: committed and failed transactions, the longest interval with no completed transaction
# (over all clients of all nodes), and the mean latency of transactions that completed while a
# migration was in its handover window (barrier/dual/handover for remus, handover for the
# baselines, handover and the pulls for squall) next to the steady state (no migration running),
# and the p99 latency of transactions that completed within 1 s of a cutover (the end of the
# handover, where cleanup begins) next to the steady state's p99 (issue 17's handover-window
# measure). Measurement only (bench/README.md).
#
#   MODES (default "lock_abort wait_remaster albatross squall remus"; a mode the build refuses
#   with 0A000 is reported as refused)  SCALE (default 4)
#   CLIENTS (default 4 per node)  WARMUP (default 5 s)  BASE_PORT (default 25801)
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/../scripts/lib.sh"
cd "$REPO_ROOT"
# demo.sh has just set up (REMUS_SETUP_DONE=1): installing the extension again would stop its
# running cluster (servers are stopped before the .so is replaced).
[ "${REMUS_SETUP_DONE:-0}" = 1 ] || "$REPO_ROOT/scripts/setup.sh" >/dev/null

modes=${MODES:-lock_abort wait_remaster albatross squall remus}
scale=${SCALE:-4}
clients=${CLIENTS:-4}
warmup=${WARMUP:-5}
port=${BASE_PORT:-25801}
dir=/var/tmp/remus-bench-modes
out=${OUT_DIR:-/var/tmp/remus-bench-modes-logs}
ctl="$REPO_ROOT/target/release/remusctl"
on() { local n=$1; shift; (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; "$@"); }
trap '"$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true' EXIT
rm -rf "$out"; mkdir -p "$out"; chmod 777 "$out"

table="$out/table.txt"

# The 99th percentile, in ms, of the latencies (us, one per line) in file $1 ("-" if none).
p99_ms() {
    sort -n "$1" | awk '{ v[NR] = $1 } END {
        if (NR == 0) { print "-"; exit }
        i = int(NR * 0.99 + 0.999999); if (i < 1) i = 1; if (i > NR) i = NR
        printf "%.2f", v[i] / 1000 }'
}
printf '%-14s %10s %7s %13s %14s %14s %11s %15s %13s\n' mode committed failed longest_gap_ms handover_lat_ms steady_lat_ms migrations cutover_p99_ms steady_p99_ms > "$table"

for mode in $modes; do
    "$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
    rm -rf "$dir"
    "$ctl" cluster up --nodes 3 --dir "$dir" --base-port "$port" >/dev/null
    on n1 pgbench -i -s "$scale" -q >/dev/null 2>&1
    on n1 psql -Xq -v ON_ERROR_STOP=1 -f sql/pgbench_distribute.sql >/dev/null
    log "$mode: pgbench -c $clients per node on n1..n3, consolidating n3"
    for n in n1 n2 n3; do
        (cd "$out" && on "$n" pgbench -n -c "$clients" -j 2 -T 3600 --max-tries=1 -l \
            --log-prefix="$mode-$n" > "$out/out-$mode-$n.txt" 2>&1) &
    done
    sleep "$warmup"
    k=0 refused=""
    for shard in $(on n1 psql -XAtc "SELECT shard_id FROM remus_shards WHERE node_name = 'n3'
                                        AND table_name <> 'pgbench_history' ORDER BY shard_id"); do
        target=$([ $((k % 2)) -eq 0 ] && echo n1 || echo n2); k=$((k + 1))
        if ! err=$(on n2 psql -XAtq -v ON_ERROR_STOP=1 \
                -c "SELECT status FROM remus_migrate_shard($shard, '$target', '$mode')" 2>&1 >/dev/null); then
            case "$err" in
                *"not available in this build"*) refused=$err; break ;;
                *) log "$mode: shard $shard: $err" ;;
            esac
        fi
    done
    if [ -n "$refused" ]; then
        pkill -TERM -f "pgbench -n -c $clients -j 2 -T 3600" || true
        wait
        log "$mode: refused by this build: $refused"
        printf '%-14s %s\n' "$mode" "refused (0A000: not available in this build)" >> "$table"
        continue
    fi
    sleep "$warmup"
    # TERM, not INT: started from a background job (`cmd &` in a script, nohup), this script and
    # its pgbench clients inherit SIGINT ignored, and pgbench would run on for its whole -T.
    pkill -TERM -f "pgbench -n -c $clients -j 2 -T 3600" || true
    wait
    # Handover windows (epoch seconds): remus from the barrier on, the baselines their handover,
    # each until the migration's cleanup began; squall's until its end, since its data moves
    # after the flip, in cleanup (the pulls, which statements on the shard wait for).
    on n1 psql -XAt -F ' ' -c "
        SELECT extract(epoch FROM started_at)
                 + (coalesce((phase_ms::json->>'copy')::numeric, 0) + coalesce((phase_ms::json->>'catchup')::numeric, 0)) / 1000,
               extract(epoch FROM finished_at)
                 - CASE WHEN mode = 'squall' THEN 0
                        ELSE coalesce((phase_ms::json->>'cleanup')::numeric, 0) / 1000 END,
               extract(epoch FROM finished_at)
                 - coalesce((phase_ms::json->>'cleanup')::numeric, 0) / 1000
          FROM remus_migrations WHERE mode = '$mode' AND status = 'succeeded'" > "$out/$mode.windows"
    migrations=$(wc -l < "$out/$mode.windows")
    # pgbench -l lines: client txn latency_us|failed script epoch_s epoch_us [lag] [retries].
    # A line cut short by the TERM above can run into the next one: a time field out of range drops it.
    cat "$out/$mode"-n?.* | awk 'NF >= 6 && NF <= 8 && $5 > 1e9 && $6 < 1e6' > "$out/$mode.txns"
    gap=$(awk '$3 !~ /^[a-z]/ { printf "%.6f\n", $5 + $6 / 1e6 }' "$out/$mode.txns" | sort -n \
        | awk 'NR > 1 && $1 - p > g { g = $1 - p } { p = $1 } END { printf "%.1f", g * 1000 }')
    # Latencies (us) within 1 s of a cutover, and of the steady state (in no window and not near
    # a cutover), one per line, for their p99.
    : > "$out/$mode.cutover_lat"
    : > "$out/$mode.steady_lat"
    awk -v mode="$mode" -v migrations="$migrations" -v gap="$gap" -v windows="$out/$mode.windows" \
        -v cut_lat="$out/$mode.cutover_lat" -v steady_lat="$out/$mode.steady_lat" '
        BEGIN { n = 0; while ((getline line < windows) > 0) { split(line, w, " "); ws[n] = w[1]; we[n] = w[2]; wc[n] = w[3]; n++ } }
        {
            t = $5 + $6 / 1e6
            if ($3 == "failed" || $3 ~ /^[a-z]/) { failed++; next }
            ok++
            inw = 0; near = 0
            for (i = 0; i < n; i++) {
                if (t >= ws[i] && t <= we[i]) inw = 1
                if (t >= wc[i] - 1 && t <= wc[i] + 1) near = 1
            }
            if (inw) { hs += $3; hn++ } else { ss += $3; sn++ }
            if (near) print $3 > cut_lat
            else if (!inw) print $3 > steady_lat
        }
        END {
            printf "%-14s %10d %7d %13.1f %14.2f %14.2f %11d", mode, ok, failed, gap,
                (hn ? hs / hn / 1000 : 0), (sn ? ss / sn / 1000 : 0), migrations
        }' "$out/$mode.txns" >> "$table"
    printf ' %15s %13s\n' "$(p99_ms "$out/$mode.cutover_lat")" "$(p99_ms "$out/$mode.steady_lat")" >> "$table"
    tail -1 "$table"
done
echo
cat "$table"
echo "(pgbench per-transaction logs and windows in $out)"
