#!/usr/bin/env bash
# Sets everything up and starts a local 3-node pg_remus cluster (left running), then shows how
# to connect. REMUS_DIR overrides the cluster directory (default .remus/cluster).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
# REMUS_SETUP_DONE=1: the build and the extension are already installed (setup.sh would stop
# every running pg_remus server on the machine to reinstall the library).
[ "${REMUS_SETUP_DONE:-0}" = 1 ] || "$REPO_ROOT/scripts/setup.sh"

dir=${REMUS_DIR:-.remus/cluster}
# The servers run as the postgres OS user, which must be able to reach the data directories.
if [ -z "${REMUS_DIR:-}" ] && ! runuser -u postgres -- test -x "$REPO_ROOT"; then
    dir=/var/tmp/remus-demo
    log "the postgres user cannot reach $REPO_ROOT; using $dir"
fi
ctl="$REPO_ROOT/target/release/remusctl"

if "$ctl" cluster status --dir "$dir" >/dev/null 2>&1; then
    log "a cluster is already running in $dir"
else
    "$ctl" cluster up --nodes 3 --dir "$dir" --base-port "${REMUS_BASE_PORT:-6001}"
fi
"$ctl" cluster status --dir "$dir"

eval "$("$ctl" cluster env --dir "$dir")"
echo
echo "== every node knows every other node =="
for n in n1 n2 n3; do
    (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; psql -XAtc \
        "SELECT remus_local_node() || ' knows: ' || string_agg(name || '@' || host || ':' || port, ', ') FROM remus_nodes")
done
echo
echo "== registered with the coordinator (etcd) =="
"$ctl" nodes --dir "$dir"
echo
echo "== distributed pgbench tables, TPC-B through all three nodes at once =="
if [ "$(psql -XAtc "SELECT count(*) FROM remus_shards WHERE table_name = 'pgbench_accounts'")" = 0 ]; then
    pgbench -i -s "${REMUS_DEMO_SCALE:-2}" -q >/dev/null 2>&1
    psql -Xq -o /dev/null -f "$REPO_ROOT/sql/pgbench_distribute.sql"
fi
psql -XAtc "SELECT 'shards per node: ' || string_agg(node_name || '=' || n, ', ') FROM (SELECT node_name, count(*) n FROM remus_shards WHERE table_name = 'pgbench_accounts' GROUP BY 1 ORDER BY 1) s"
secs=${REMUS_DEMO_SECONDS:-10}
for n in n1 n2 n3; do
    (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; pgbench -n -c 4 -j 2 -T "$secs" --max-tries=1 > "/tmp/remus-demo-$n.log" 2>&1) &
done
wait
printf '%-6s %10s %10s %12s\n' node committed failed tps
for n in n1 n2 n3; do
    f=/tmp/remus-demo-$n.log
    printf '%-6s %10s %10s %12s\n' "$n" \
        "$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$f")" \
        "$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$f")" \
        "$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$f")"
done
psql -XAtc "SELECT format('balances: accounts %s, branches %s, tellers %s, history deltas %s -> %s',
    a, b, t, h, CASE WHEN a = b AND b = t AND t = h THEN 'consistent' ELSE 'INCONSISTENT' END)
  FROM (SELECT (SELECT sum(abalance) FROM pgbench_accounts) a, (SELECT sum(bbalance) FROM pgbench_branches) b,
               (SELECT sum(tbalance) FROM pgbench_tellers) t, (SELECT coalesce(sum(delta), 0) FROM pgbench_history) h) s"

echo
echo "== shards move while TPC-B keeps running on all three nodes =="
secs=${REMUS_DEMO_MIGRATION_SECONDS:-40}
for n in n1 n2 n3; do
    (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; pgbench -n -c 4 -j 2 -T "$secs" --max-tries=1 > "/tmp/remus-demo-mig-$n.log" 2>&1) &
done
sleep 2
# Two account shards of n3 (with their co-located history shards), one per baseline mode, then
# back, through different nodes; every call returns when its migration has ended.
mapfile -t movers < <(psql -XAtc "SELECT shard_id FROM remus_shards WHERE table_name = 'pgbench_accounts' AND node_name = 'n3' ORDER BY shard_id LIMIT 2")
psql -XP pager=off -c "
  SELECT migration_id, shard_ids, source, target, mode, status, copy_ms, catchup_ms, handover_ms,
         cleanup_ms, total_ms, rows_copied, txns_replayed, aborted_by_migration
    FROM remus_migrate_shard(${movers[0]}, 'n1')
  UNION ALL
  SELECT * FROM (SELECT migration_id, shard_ids, source, target, mode, status, copy_ms, catchup_ms,
         handover_ms, cleanup_ms, total_ms, rows_copied, txns_replayed, aborted_by_migration
    FROM remus_migrate_shard(${movers[1]}, 'n2', 'lock_abort')) s"
"$ctl" migrate --dir "$dir" --shard "${movers[0]}" --to n3 --mode wait_remaster
wait
printf '%-6s %10s %10s\n' node committed failed
for n in n1 n2 n3; do
    f=/tmp/remus-demo-mig-$n.log
    printf '%-6s %10s %10s\n' "$n" \
        "$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$f")" \
        "$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$f")"
done
echo "(remus, the default, and wait_remaster abort none; lock_abort's aborted_by_migration are pgbench's failed transactions)"
psql -XAtc "SELECT format('balances after the moves: accounts %s, branches %s, tellers %s, history deltas %s -> %s',
    a, b, t, h, CASE WHEN a = b AND b = t AND t = h THEN 'consistent' ELSE 'INCONSISTENT' END)
  FROM (SELECT (SELECT sum(abalance) FROM pgbench_accounts) a, (SELECT sum(bbalance) FROM pgbench_branches) b,
               (SELECT sum(tbalance) FROM pgbench_tellers) t, (SELECT coalesce(sum(delta), 0) FROM pgbench_history) h) s"
"$ctl" migrations --dir "$dir"

# The three handover modes side by side, short form: the same consolidation of n3 under TPC-B
# on a separate throwaway cluster per mode (bench/handover_modes.sh has the full version).
log "handover modes compared (short run: scale 1, 2 clients per node)"
REMUS_SETUP_DONE=1 SCALE=1 CLIENTS=2 WARMUP=2 BASE_PORT=$(( ${REMUS_BASE_PORT:-6001} + 500 )) \
    OUT_DIR=/var/tmp/remus-demo-modes "$REPO_ROOT/bench/handover_modes.sh" | tail -7

# Consolidation under the paper's hybrid workload B (issue 20): YCSB (zipfian) plus the
# duplicate-key query, whose answer must be 0 every time, while scripts/drain-node.sh moves all
# of n3's shards to n1 and n2 in mode remus, on a throwaway cluster with remus-bench's own table
# (bench/scenarios.sh has the three scenarios in every mode).
log "consolidation under hybrid workload B (remus-bench, ${REMUS_DEMO_BENCH_SECONDS:-20} s, drain n3 in mode remus)"
bdir=/var/tmp/remus-demo-bench
bout=/var/tmp/remus-demo-bench-out
"$ctl" cluster down --dir "$bdir" >/dev/null 2>&1 || true
rm -rf "$bdir" "$bout"
trap '"$ctl" cluster down --dir "$bdir" >/dev/null 2>&1 || true' EXIT
"$ctl" cluster up --nodes 3 --dir "$bdir" --base-port $(( ${REMUS_BASE_PORT:-6001} + 600 )) >/dev/null
"$REPO_ROOT/target/release/remus-bench" --cluster-dir "$bdir" load ycsb --records 10000 --shards 6
(sleep 5; eval "$("$ctl" cluster env --dir "$bdir")"; "$REPO_ROOT/scripts/drain-node.sh" n3 --mode remus) &
"$REPO_ROOT/target/release/remus-bench" --cluster-dir "$bdir" run hybrid-b --dist zipfian \
    --seconds "${REMUS_DEMO_BENCH_SECONDS:-20}" --clients 4 --out "$bout" > "$bout.log" 2>&1 || true
wait
tail -n 1 "$bout.log"
# The summaries, the migration windows and Table 3 (Table 2 needs hybrid A's ingestion).
if [ -f "$bout/tables.md" ]; then cat "$bout/tables.md"; else tail -n 20 "$bout.log"; fi
echo "(plot: $bout/throughput.png; series: $bout/series.csv; summary: $bout/summary.json)"
"$ctl" cluster down --dir "$bdir" >/dev/null 2>&1 || true
trap - EXIT

cat <<MSG

Connect to node n1:
  eval "\$($ctl cluster env --dir $dir)" && psql
Another node:  $ctl cluster env --dir $dir --node n2
Stop it all:   $ctl cluster down --dir $dir
MSG
