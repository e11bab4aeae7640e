#!/usr/bin/env bash
# A 1 GB shard moves between two nodes under pgbench load; prints each phase's duration and the
# copy throughput next to a plain `COPY … TO STDOUT | COPY … FROM STDIN` pipe between the same
# two nodes. Measurement only (see bench/README.md).
#
#   MODE=remus|lock_abort|wait_remaster|albatross (default lock_abort)  ROWS (default 1000000,
#   ~1 GB)  CLIENTS (default 4 per node)  BASE_PORT (default 24801)
#   COPY_SESSIONS, COPY_SPLIT_MB: the coordinator's --copy-sessions / --copy-split-mb (its
#   defaults when unset: 4 sessions, ranges of 64 MB)
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/../scripts/lib.sh"
cd "$REPO_ROOT"
"$REPO_ROOT/scripts/setup.sh" >/dev/null

mode=${MODE:-lock_abort}
[ -n "${COPY_SESSIONS:-}" ] && export REMUS_COPY_SESSIONS=$COPY_SESSIONS
[ -n "${COPY_SPLIT_MB:-}" ] && export REMUS_COPY_SPLIT_MB=$COPY_SPLIT_MB
rows=${ROWS:-1000000}
clients=${CLIENTS:-4}
port=${BASE_PORT:-24801}
dir=/var/tmp/remus-bench-migration
ctl="$REPO_ROOT/target/release/remusctl"

"$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
rm -rf "$dir"
"$ctl" cluster up --nodes 3 --dir "$dir" --base-port "$port" >/dev/null
trap '"$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true' EXIT
on() { local n=$1; shift; (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; "$@"); }

log "loading $rows rows (~1 KB each) into one shard on n1"
on n1 psql -Xq -v ON_ERROR_STOP=1 <<SQL
CREATE TABLE big (id bigint PRIMARY KEY, counter bigint NOT NULL DEFAULT 0, pad text NOT NULL);
INSERT INTO big SELECT i, 0, repeat(md5(i::text), 30) FROM generate_series(1, $rows) i;
SELECT remus_create_distributed_table('big', 'id', shard_count => 1);
SQL
shard=$(on n1 psql -XAtc "SELECT shard_id FROM remus_shards WHERE table_name = 'big'")
size=$(on n1 psql -XAtc "SELECT pg_size_pretty(size_bytes) FROM remus_shards WHERE shard_id = $shard")
log "shard $shard on n1: $size"
# The first scan of freshly loaded rows sets their hint bits and so rewrites every page: without
# this VACUUM the first pipe below paid for that and the pipe and copy after it did not.
on n1 psql -Xq -c "VACUUM (ANALYZE) remus_shards.big_$shard"

# Baseline: the same bytes through a plain binary COPY pipe n1 -> n2 into a table with the same
# indexes, as one client would do it.
# Measured twice: on a quiet cluster, and again under the same pgbench load as the migration.
pipe() {
    on n2 psql -Xq -c "SET remus.migration_session = on; CREATE TABLE big_pipe (LIKE big INCLUDING ALL)"
    local start
    start=$(date +%s.%N)
    on n1 psql -XAtc "COPY remus_shards.big_$shard TO STDOUT (FORMAT binary)" \
        | on n2 psql -Xq -c "COPY big_pipe FROM STDIN (FORMAT binary)"
    echo "$(date +%s.%N) - $start" | bc
    on n2 psql -Xq -c "SET remus.migration_session = on; DROP TABLE big_pipe"
}
pipe_s=$(pipe)

cat > /tmp/remus-bench-big.sql <<SQL
\\set id random(1, $rows)
UPDATE big SET counter = counter + 1 WHERE id = :id;
SQL
log "pgbench: $clients clients per node on n1..n3 updating random rows of big; migrating with $mode"
for n in n1 n2 n3; do
    on "$n" pgbench -n -c "$clients" -j 2 -T 600 --max-tries=1 -f /tmp/remus-bench-big.sql \
        > "/tmp/remus-bench-mig-$n.log" 2>&1 &
done
sleep 5
log "the plain COPY pipe again, under the load"
pipe_load_s=$(pipe)
result=$(on n2 psql -XAt -F ' ' -c "SELECT copy_ms, catchup_ms, handover_ms, cleanup_ms, total_ms,
    rows_copied, bytes_copied, txns_replayed, aborted_by_migration, status
    FROM remus_migrate_shard($shard, 'n2', '$mode')")
sleep 3
# TERM, not INT: started from a background job (`cmd &` in a script, nohup), this script and
# its pgbench clients inherit SIGINT ignored, and pgbench would run on for its whole -T.
pkill -TERM -f "pgbench -n -c $clients -j 2 -T 600" || true
wait || true
read -r copy_ms catchup_ms handover_ms cleanup_ms total_ms rcopied bcopied replayed aborted status <<<"$result"
mb=$(echo "scale=1; $bcopied / 1048576" | bc)
echo
echo "| what | value |"
echo "| --- | ---: |"
echo "| shard size | $size ($rcopied rows, $mb MB of binary COPY data) |"
echo "| mode / status | $mode / $status |"
echo "| copy | $copy_ms ms ($(echo "scale=1; $mb * 1000 / $copy_ms" | bc) MB/s) |"
echo "| catchup | $catchup_ms ms ($replayed source transactions replayed in all) |"
echo "| handover | $handover_ms ms |"
echo "| cleanup | $cleanup_ms ms |"
echo "| total | $total_ms ms |"
echo "| aborted_by_migration | $aborted |"
echo "| plain COPY pipe n1 -> n2, no load | $(printf '%.1f' "$pipe_s") s ($(echo "scale=1; $mb / $pipe_s" | bc) MB/s) |"
echo "| plain COPY pipe n1 -> n2, under the same load | $(printf '%.1f' "$pipe_load_s") s ($(echo "scale=1; $mb / $pipe_load_s" | bc) MB/s) |"
echo "| copy speed / pipe speed, no load | $(echo "scale=2; $pipe_s * 1000 / $copy_ms" | bc) |"
echo "| copy speed / pipe speed, under load | $(echo "scale=2; $pipe_load_s * 1000 / $copy_ms" | bc) |"
parts=$(grep -a "snapshot copied" "$dir/logs/coordinator.log" | grep -o "parts=[0-9]*" | tail -1 || true)
echo "| copy sessions | ${parts:-?} (block ranges and whole tables) |"
