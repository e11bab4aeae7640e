#!/usr/bin/env bash
# Soak: many consecutive migrations under pgbench TPC-B load on all three nodes; samples what a
# leak would grow (replication slots, origins, publications, prepared transactions, connections,
# the resident memory of every process) before the first move, after a warm-up of moves, and
# after the last; then checks TPC-B consistency row by row. Measurement plus a consistency
# verdict; nothing here runs in CI (issue 15, requirement 7; results in bench/README.md).
#
#   MODE (default remus)  MIGRATIONS (default 60)  WARM (moves before the warm sample, default 10)
#   SCALE (default 4)  CLIENTS (default 2 per node)  BASE_PORT (default 26801)
#
# Exit status: 0 when every migration succeeded, nothing that should be back to zero is left,
# and every balance equals its history deltas; 1 otherwise. Memory is reported, not judged:
# growth between the warm and the final sample is printed per process for a reader to weigh.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/../scripts/lib.sh"
cd "$REPO_ROOT"
[ "${REMUS_SETUP_DONE:-0}" = 1 ] || "$REPO_ROOT/scripts/setup.sh" >/dev/null

mode=${MODE:-remus}
migrations=${MIGRATIONS:-60}
warm=${WARM:-10}
scale=${SCALE:-4}
clients=${CLIENTS:-2}
port=${BASE_PORT:-26801}
dir=/var/tmp/remus-bench-soak
out=${OUT_DIR:-/var/tmp/remus-bench-soak-logs}
ctl="$REPO_ROOT/target/release/remusctl"
on() { local n=$1; shift; (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; "$@"); }
q() { local n=$1; shift; on "$n" psql -XAtq -v ON_ERROR_STOP=1 -c "$*"; }
nodes=(n1 n2 n3)

"$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir" "$out"; mkdir -p "$out"; chmod 777 "$out"
"$ctl" cluster up --nodes 3 --dir "$dir" --base-port "$port" >/dev/null
trap 'pkill -TERM -f "pgbench -n -c $clients -j 1 -T 7200" || true; "$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true' EXIT
on n1 pgbench -i -s "$scale" -q >/dev/null 2>&1
on n1 psql -Xq -v ON_ERROR_STOP=1 -f sql/pgbench_distribute.sql >/dev/null

# Resident memory in kB: the daemons' RSS; for a node, the postmaster's RSS and the sum of the
# private memory (Private_Clean + Private_Dirty) of all its processes: a backend's RSS counts
# the shared buffers it has touched, which grows with no leak at all.
rss() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }
private_kb() {
    local total=0 p
    for p in "$@"; do
        total=$((total + $(awk '/^Private_(Clean|Dirty):/ { s += $2 } END { print s + 0 }' \
            "/proc/$p/smaps_rollup" 2>/dev/null || echo 0)))
    done
    echo "$total"
}
daemon_pid() { jq -r ".$1.pid // empty" "$dir/cluster.json"; }

# One sample: "metric value" lines into $out/sample-$1.
sample() {
    local f="$out/sample-$1" n pm children d
    {
        for n in "${nodes[@]}"; do
            echo "$n.slots $(q "$n" "SELECT count(*) FROM pg_replication_slots")"
            echo "$n.origins $(q "$n" "SELECT count(*) FROM pg_replication_origin")"
            echo "$n.publications $(q "$n" "SELECT count(*) FROM pg_publication")"
            # Older than 5 s: the 2PC commits of the load itself are prepared for milliseconds.
            echo "$n.stuck_prepared_xacts $(q "$n" "SELECT count(*) FROM pg_prepared_xacts WHERE prepared < now() - interval '5 seconds'")"
            # The fewest of three looks: the coordinator's sweep (coordinator/src/reconcile.rs)
            # opens a session on every node for a few milliseconds every 10 s; a leak stays.
            echo "$n.connections $(for _ in 1 2 3; do q "$n" "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"; sleep 0.2; done | sort -n | head -1)"
            pm=$(head -1 "$(jq -r ".nodes[] | select(.name == \"$n\") | .data_dir" "$dir/cluster.json")/postmaster.pid")
            children=$(pgrep -P "$pm" | tr '\n' ' ')
            echo "$n.postmaster_rss_kb $(rss "$pm")"
            # shellcheck disable=SC2086
            echo "$n.private_kb $(private_kb "$pm" $children)"
        done
        for d in etcd coordinator replay_worker; do
            echo "$d.rss_kb $(rss "$(daemon_pid "$d")")"
        done
        echo "remus_migrations.unfinished $(q n1 "SELECT count(*) FROM remus_migrations WHERE status = 'running'")"
    } > "$f"
}

sample idle_before
log "soak: $migrations $mode migrations under pgbench TPC-B (-c $clients on each of n1..n3, scale $scale)"
for n in "${nodes[@]}"; do
    (cd "$out" && on "$n" pgbench -n -c "$clients" -j 1 -T 7200 --max-tries=1 \
        > "$out/pgbench-$n.txt" 2>&1) &
done
sleep 5
sample before

# Each move takes a shard of accounts (history follows, co-located), tellers or branches from
# its owner to the next node in n1 -> n2 -> n3 -> n1, cycling through the shards; the call
# enters through a node that is neither side every other time.
mapfile -t shards < <(q n1 "SELECT shard_id FROM remus_shards
                             WHERE table_name <> 'pgbench_history' ORDER BY shard_id")
failed_moves=0
started=$SECONDS
for ((i = 0; i < migrations; i++)); do
    shard=${shards[$((i * 7 % ${#shards[@]}))]}
    owner=$(q n1 "SELECT node_name FROM remus_shards WHERE shard_id = $shard")
    case $owner in n1) target=n2 ;; n2) target=n3 ;; *) target=n1 ;; esac
    entry=${nodes[$((i % 3))]}
    status=$(q "$entry" "SELECT status FROM remus_migrate_shard($shard, '$target', '$mode')" 2>&1) \
        || status="error: $status"
    [ "$status" = succeeded ] || { failed_moves=$((failed_moves + 1)); log "move $((i + 1)): shard $shard $owner -> $target: $status"; }
    printf '\r[soak] %d/%d moves, %d not succeeded, %d s' $((i + 1)) "$migrations" "$failed_moves" $((SECONDS - started)) >&2
    [ $((i + 1)) -eq "$warm" ] && sample warm
done
echo >&2
sleep 5
sample after
pkill -TERM -f "pgbench -n -c $clients -j 1 -T 7200" || true
wait || true
sleep 3
sample idle_after

# pgbench killed by TERM prints no summary: history is the ground truth for what committed, and
# a client's error shows in its output (serialization failures are not retried: --max-tries=1).
pgfailed=$(cat "$out"/pgbench-n?.txt | grep -c 'ERROR:\|aborted in command' || true)
history=$(q n1 "SELECT count(*) FROM pgbench_history")
mismatches=$(q n1 "
    SELECT (SELECT count(*) FROM pgbench_accounts a LEFT JOIN (SELECT aid, sum(delta) d FROM pgbench_history GROUP BY aid) h USING (aid) WHERE a.abalance <> coalesce(h.d, 0))
         + (SELECT count(*) FROM pgbench_tellers t LEFT JOIN (SELECT tid, sum(delta) d FROM pgbench_history GROUP BY tid) h USING (tid) WHERE t.tbalance <> coalesce(h.d, 0))
         + (SELECT count(*) FROM pgbench_branches b LEFT JOIN (SELECT bid, sum(delta) d FROM pgbench_history GROUP BY bid) h USING (bid) WHERE b.bbalance <> coalesce(h.d, 0))")
aborted=$(q n1 "SELECT coalesce(sum(aborted_by_migration), 0) FROM remus_migrations")

echo
printf '| %-28s | %10s | %10s | %10s | %10s | %10s |\n' metric "idle, start" "load, start" "after $warm" "after $migrations" "idle, end"
printf '| %-28s | %10s | %10s | %10s | %10s | %10s |\n' --- ---: ---: ---: ---: ---:
leftovers=0
while read -r metric idle0; do
    v() { awk -v m="$metric" '$1 == m { print $2 }' "$out/sample-$1"; }
    idle1=$(v idle_after)
    printf '| %-28s | %10s | %10s | %10s | %10s | %10s |\n' "$metric" "$idle0" "$(v before)" "$(v warm)" "$(v after)" "$idle1"
    case $metric in
        *_kb) ;;
        *) [ "$idle1" -le "$idle0" ] || { leftovers=$((leftovers + 1)); log "left over: $metric $idle0 -> $idle1"; } ;;
    esac
done < "$out/sample-idle_before"
echo
echo "migrations: $migrations ($mode), not succeeded: $failed_moves, in $((SECONDS - started)) s"
echo "pgbench: $history transactions committed (history rows), $pgfailed client errors; aborted_by_migration: $aborted"
echo "rows whose balance differs from its history deltas: $mismatches"
echo "counts (slots, origins, publications, stuck prepared transactions, connections, running migrations) above their idle starting value once the load stopped: $leftovers"
[ "$failed_moves" -eq 0 ] && [ "$mismatches" -eq 0 ] && [ "$leftovers" -eq 0 ] && [ "$pgfailed" -eq 0 ]
