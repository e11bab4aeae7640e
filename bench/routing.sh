#!/usr/bin/env bash
# pgbench select-only and TPC-B through (a) a plain PostgreSQL 15, (b) the owner node and
# (c) a non-owner node of a 3-node pg_remus cluster. Prints a markdown table.
# Usage: bash bench/routing.sh   (SECONDS_PER_RUN=20 CLIENTS=8 SCALE=10 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${SECONDS_PER_RUN:-20}
clients=${CLIENTS:-8}
scale=${SCALE:-10}
bin=/usr/lib/postgresql/15/bin
ctl=target/release/remusctl
work=/tmp/remus-bench
plain_port=24500
rm -rf "$work"; mkdir -p "$work"; chmod 755 "$work"
cleanup() {
    "$ctl" cluster down --dir "$work/cluster" >/dev/null 2>&1 || true
    runuser -u postgres -- "$bin/pg_ctl" -D "$work/plain" -m immediate stop >/dev/null 2>&1 || true
}
trap cleanup EXIT

# (a) plain server: no pg_remus; local socket only, in a private directory.
install -d -o postgres -g postgres "$work/plain" "$work/sock"
runuser -u postgres -- "$bin/initdb" -D "$work/plain" -A peer -U postgres >/dev/null
runuser -u postgres -- "$bin/pg_ctl" -D "$work/plain" -l "$work/sock/plain.log" -w \
    -o "-p $plain_port -c listen_addresses='' -c unix_socket_directories=$work/sock -c shared_buffers=128MB" start >/dev/null
plain() { runuser -u postgres -- env PGHOST="$work/sock" PGPORT=$plain_port "$@"; }
plain pgbench -i -s "$scale" -q postgres >/dev/null 2>&1

# (b, c) the cluster, tables distributed as in the routing issue.
"$ctl" cluster up --dir "$work/cluster" --base-port 24001 >/dev/null
node() { local n=$1; shift; (eval "$("$ctl" cluster env --dir "$work/cluster" --node "$n")"; "$@"); }
node n1 pgbench -i -s "$scale" -q >/dev/null 2>&1
node n1 psql -Xq -o /dev/null -f sql/pgbench_distribute.sql
# Keys whose shards n1 owns, in plain local tables on n1 and n2 (read locally by \gset), so the
# single-shard runs touch only n1's data whichever node they enter through.
keys_sql() { # $1: the largest key, $2: the table
    printf "SELECT row_number() OVER (ORDER BY k), k FROM generate_series(1, %s) k
           JOIN remus.shards s ON remus.key_hash(k) BETWEEN s.hash_min AND s.hash_max
           JOIN remus.shard_map m USING (shard_id)
           WHERE s.logicalrelid = '%s'::regclass AND m.node_name = 'n1'" "$1" "$2"
}
for n in n1 n2; do
    node "$n" psql -Xq -o /dev/null -c "CREATE TABLE owned_a (i bigint PRIMARY KEY, k int); CREATE TABLE owned_t (i bigint PRIMARY KEY, k int); CREATE TABLE owned_b (i bigint PRIMARY KEY, k int)"
done
na=$(node n1 psql -XAtc "SELECT count(*) FROM ($(keys_sql $((100000 * scale)) pgbench_accounts)) x")
nt=$(node n1 psql -XAtc "SELECT count(*) FROM ($(keys_sql $((10 * scale)) pgbench_tellers)) x")
nb=$(node n1 psql -XAtc "SELECT count(*) FROM ($(keys_sql "$scale" pgbench_branches)) x")
for n in n1 n2; do
    for t in a:pgbench_accounts:$((100000 * scale)) t:pgbench_tellers:$((10 * scale)) b:pgbench_branches:$scale; do
        IFS=: read -r s tab max <<<"$t"
        node n1 psql -XAtc "COPY ($(keys_sql "$max" "$tab")) TO STDOUT" | node "$n" psql -Xq -c "COPY owned_$s FROM STDIN"
    done
done
cat > "$work/select_owned.sql" <<SQL
\\set r random(1, $na)
SELECT k AS aid FROM owned_a WHERE i = :r \\gset
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
SQL
cat > "$work/tpcb_owned.sql" <<SQL
\\set ra random(1, $na)
\\set rt random(1, $nt)
\\set rb random(1, $nb)
\\set delta random(-5000, 5000)
SELECT k AS aid FROM owned_a WHERE i = :ra \\gset
SELECT k AS tid FROM owned_t WHERE i = :rt \\gset
SELECT k AS bid FROM owned_b WHERE i = :rb \\gset
BEGIN;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
SQL
chmod 644 "$work"/*.sql

row() {  # label target pgbench-output
    local tps lat failed
    tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$3")
    lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$3")
    failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$3")
    printf '| %s | %s | %.0f | %.2f | %s |\n' "$1" "$2" "$tps" "$lat" "${failed:-0}"
}
run() {  # label target cmd...
    local label=$1 target=$2; shift 2
    "$@" -n -c "$clients" -j 2 -T "$secs" > "$work/out" 2>&1 || true
    row "$label" "$target" "$work/out"
}
echo "| workload | through | tps | mean latency (ms) | failed |"
echo "| --- | --- | ---: | ---: | ---: |"
run "select-only (-S)" "plain PostgreSQL" plain pgbench -S postgres
run "select-only (-S), all keys" "n1 (owns 1/3 of shards)" node n1 pgbench -S
run "select-only, keys owned by n1" "n1 (owner)" node n1 pgbench -f "$work/select_owned.sql"
run "select-only, keys owned by n1" "n2 (non-owner)" node n2 pgbench -f "$work/select_owned.sql"
run "TPC-B" "plain PostgreSQL" plain pgbench postgres
run "TPC-B, all keys" "n1 (owns 1/3 of shards)" node n1 pgbench
run "TPC-B, keys owned by n1" "n1 (owner)" node n1 pgbench -f "$work/tpcb_owned.sql"
run "TPC-B, keys owned by n1" "n2 (non-owner)" node n2 pgbench -f "$work/tpcb_owned.sql"
