#!/usr/bin/env bash
# Catch-up against PostgreSQL's own logical replication (issue 17). One shard of one table is
# written by pgbench (single-row UPDATEs through the distributed table, on the shard's node) and
# migrated to the other node; beside it, in the same run, a subscription of PostgreSQL's own
# logical replication applies the same stream: a second database on the TARGET node's server
# holds a copy of the shard table under the same schema-qualified name, subscribed to a
# publication of that table on the source. Every 100 ms one psql session on the source samples
# the clock, pg_current_wal_lsn(), both slots' confirmed_flush_lsn (the migration's remus_m<id>
# and the subscription's catchup_sub) and the migration's phase and counters (remus_migrations);
# a second one on the target samples what each applier has applied there (their replication
# origins: `applied_sql`), which is not held back by how often an applier reports to its slot;
# bench/catchup_cpu.py samples the CPU each process of the cluster uses, by role (the replay's
# apply sessions, replay worker, coordinator and walsender; the subscription's apply worker and
# walsender; the writers), for the cores each applier used during catch-up and its CPU per MB.
# After the run the samples and pgbench's per-transaction log give, per 100 ms interval: the
# source's commits/s and WAL bytes/s, each applier's bytes/s and lag (bytes and ms). Prints a
# summary per mode. Measurement only (bench/README.md, "Catch-up against PostgreSQL's own
# subscription").
#
# Both appliers face about the same backlog: the subscription's slot is created as soon as the
# migration's slot appears (the next sample), and the subscription is enabled when the migration
# leaves its copy phase, which is when the migration's propagator starts streaming its slot.
#
#   MODES (default $MODE or "remus"; e.g. "remus lock_abort wait_remaster albatross squall";
#   "citus" after them: the same writers and move with Citus, see citus_run)
#   CLIENTS (default auto: the count in SWEEP with the highest source tps in a SWEEP_SECONDS
#   pgbench run each, measured once on the first mode's cluster)  SWEEP (default "2 4 8 12 16")
#   SUB_PAUSE (1: the subscription is disabled from the first sample past catch-up until the
#   writers stop, so that no second applier loads the target during the handover, as in
#   production and in the Citus run; its figures leave that time out. 0: it runs throughout)
#   SWEEP_SECONDS (5)  ROWS (rows in the shard, default 1000000, ~100 MB)  WARMUP (5 s of writes
#   before the migration)  TAIL (3 s of writes after it)  SUB_WAIT (at most 60 s more for the
#   subscription to catch up once the writers stop)  CONVERGE_LIMIT_MS (coordinator
#   REMUS_CATCHUP_CONVERGE_LIMIT_MS, default 60000)  BASE_PORT (27801)  DIR
#   (/var/tmp/remus-bench-catchup)  OUT_DIR (/var/tmp/remus-bench-catchup-results)
#   REANALYZE=1: no run, the summaries again from the files of an earlier run in OUT_DIR.
#   REMUS_EXTRA_SETTINGS (postgresql.conf lines for pg_remus's nodes only, a diagnosis; refused
#   with citus in MODES)
#   ANCHOR_DIR (../shared/anchors/citus): the Citus anchor toolkit, for the Citus run and for
#   the server settings of both sides (its EXTRA_CONF is added to the pg_remus nodes' too).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/../scripts/lib.sh"
cd "$REPO_ROOT"

modes=${MODES:-${MODE:-remus}}
clients=${CLIENTS:-auto}
sweep=${SWEEP:-2 4 8 12 16}
sweep_s=${SWEEP_SECONDS:-5}
rows=${ROWS:-1000000}
warmup=${WARMUP:-5}
tail_s=${TAIL:-3}
sub_wait=${SUB_WAIT:-60}
sub_pause=${SUB_PAUSE:-1}
limit_ms=${CONVERGE_LIMIT_MS:-60000}
port=${BASE_PORT:-27801}
dir=${DIR:-/var/tmp/remus-bench-catchup}
out=${OUT_DIR:-/var/tmp/remus-bench-catchup-results}
ctl="$REPO_ROOT/target/release/remusctl"
summary="$out/summary.txt"
[ -x "$ctl" ] || die "$ctl not built (cargo build --release --workspace --exclude pg_remus)"

on() { local n=$1; shift; (eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; "$@"); }
# Runs `$3` on node `$2` every `$1` seconds until the run's stop file exists, its rows (fields
# separated by `$4`) written to file `$5`: one psql session for the whole run.
poll_to_file() {
    local every=$1 node=$2 sql=$3 sep=$4 file=$5
    while [ ! -e "$stop" ]; do echo "$sql"; sleep "$every"; done \
        | on "$node" stdbuf -oL psql -XAtq -F "$sep" 2>> "$out/$mode.sampler.err" > "$file"
}
# As on, but replaces the shell it runs in: run as `on_exec … &`, $! is the command's PID.
on_exec() { local n=$1; shift; eval "$("$ctl" cluster env --dir "$dir" --node "$n")"; exec "$@"; }

target="" writers="" stop=""
cleanup() {
    [ -z "$stop" ] || touch "$stop"
    [ -z "$writers" ] || kill -TERM "$writers" 2>/dev/null || true
    if [ -n "$target" ]; then
        on "$target" psql -Xq -d catchup_sub -c "ALTER SUBSCRIPTION catchup_sub DISABLE" \
            -c "ALTER SUBSCRIPTION catchup_sub SET (slot_name = NONE)" \
            -c "DROP SUBSCRIPTION catchup_sub" >/dev/null 2>&1 || true
    fi
    "$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# One sample: epoch s | source WAL insert position | migration slot's and subscription slot's
# confirmed_flush_lsn (bytes) | the newest migration's phase, status, txns_replayed,
# replay_txns_per_sec, lag_bytes.
sample_sql="SELECT extract(epoch FROM clock_timestamp()), pg_current_wal_lsn() - '0/0',
  (SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name LIKE 'remus\\_%' ORDER BY slot_name LIMIT 1),
  (SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = 'catchup_sub'),
  m.phase, m.status, m.txns_replayed, m.replay_txns_per_sec, m.lag_bytes
  FROM (SELECT 1) one LEFT JOIN LATERAL
       (SELECT * FROM remus_migrations ORDER BY migration_id DESC LIMIT 1) m ON true;"

# What each applier has applied on the target, sampled there every 100 ms: epoch s | the highest
# source commit position any apply session of the migration has committed (its origins
# remus_m<id>_w<k>; the sessions apply in parallel, so the contiguous position can trail it by
# the transactions in flight) | the subscription's origin (pg_<oid>, one apply worker, in
# order). Slots' confirmed positions advance only with each applier's feedback (the
# subscription's in bursts), so peaks of confirmed advance overstate a burst's rate.
applied_sql="SELECT extract(epoch FROM clock_timestamp()),
  (SELECT max(remote_lsn) - '0/0' FROM pg_replication_origin_status WHERE external_id LIKE 'remus\\_m%\\_w%'),
  (SELECT o.remote_lsn - '0/0' FROM pg_replication_origin_status o JOIN pg_subscription s ON o.external_id = 'pg_' || s.oid
    WHERE s.subname = 'catchup_sub');"

# Reads the sampler's lines, appends them to $1 and drives the subscription: creates its slot on
# the source once the migration's slot exists (or the migration is past its copy without one),
# enables it once the migration has left pending/copy. Events go to $2.
controller() {
    local csv=$1 events=$2 slot_made=0 enabled=0 paused=0 t wal rs sc phase status txr rtps lagb
    while IFS='|' read -r t wal rs sc phase status txr rtps lagb; do
        case "$t" in [0-9]*) ;; *) continue ;; esac
        printf '%s,%s,%s,%s,%s,%s,%s,%s,%s\n' "$t" "$wal" "$rs" "$sc" "$phase" "$status" "$txr" "$rtps" "$lagb" >> "$csv"
        local past_copy=0
        case "$phase" in ""|pending|copy) ;; *) past_copy=1 ;; esac
        if [ "$slot_made" = 0 ] && { [ -n "$rs" ] || [ "$past_copy" = 1 ]; }; then
            on "$source" psql -XAtq -c "SELECT pg_create_logical_replication_slot('catchup_sub', 'pgoutput')" >/dev/null
            slot_made=1
            echo "slot $(date +%s.%N)" >> "$events"
        fi
        if [ "$slot_made" = 1 ] && [ "$enabled" = 0 ] && [ "$past_copy" = 1 ]; then
            on "$target" psql -Xq -d catchup_sub -c "ALTER SUBSCRIPTION catchup_sub ENABLE"
            enabled=1
            echo "enabled $(date +%s.%N) $phase" >> "$events"
        fi
        # Past catch-up (barrier, handover, cleanup, the end): the subscription stops writing on
        # the target until the writers stop (SUB_PAUSE=1), so that the handover runs on a target
        # that no second applier loads, as in production and as in the Citus run.
        if [ "$sub_pause" = 1 ] && [ "$enabled" = 1 ] && [ "$paused" = 0 ]; then
            case "$phase" in ""|pending|copy|catchup) ;; *)
                on "$target" psql -Xq -d catchup_sub -c "ALTER SUBSCRIPTION catchup_sub DISABLE"
                paused=1
                echo "paused $(date +%s.%N) $phase" >> "$events" ;;
            esac
        fi
    done
}

# MODES may include "citus": the same table, rows, writers (the same script and client count, on
# the shard's worker) and a move with Citus 13's citus_move_shard_placement (force_logical) on a
# coordinator + 2 workers made by the anchor toolkit (ANCHOR_DIR, default ../shared/anchors/citus,
# as bench/routing.sh; its settings, not remusctl's: shared_buffers 256MB), in CITUS_WORK
# (/var/tmp/remus-bench-catchup-citus) on ports CITUS_PORT_BASE+10..12 (default 28800: below the
# ephemeral port range, where a client connection can hold a port a server then cannot listen
# on). No subscription and no sampling there: the move's duration and the writers' longest
# no-commit gap.
citus_run() (
    export WORK=${CITUS_WORK:-/var/tmp/remus-bench-catchup-citus} PORT_BASE=${CITUS_PORT_BASE:-28800}
    anchor=${ANCHOR_DIR:-$REPO_ROOT/../shared/anchors/citus}
    [ -f "$anchor/lib.sh" ] || die "the Citus anchor toolkit is not at $anchor (set ANCHOR_DIR)"
    # shellcheck source=/dev/null
    source "$anchor/lib.sh"
    trap 'citus_stop coord w1 w2' EXIT
    citus_stop coord w1 w2
    citus_up_fresh
    log "citus: loading $rows rows into a one-shard table"
    q ccoord -q >/dev/null <<SQL
SET citus.shard_count = 1;
CREATE TABLE cu (id bigint PRIMARY KEY, v bigint NOT NULL DEFAULT 0, pad text NOT NULL);
SELECT create_distributed_table('cu', 'id');
INSERT INTO cu SELECT i, 0, md5(i::text) || md5((i + 1)::text) FROM generate_series(1, $rows) i;
SQL
    local shard wport src dst start end
    read -r shard wport <<<"$(q ccoord -AtF ' ' -c "SELECT shardid, nodeport FROM citus_shards WHERE table_name = 'cu'::regclass")"
    if [ "$wport" = "$P_CW1" ]; then src=cw1 dst=cw2; else src=cw2 dst=cw1; fi
    q ccoord -qc "VACUUM ANALYZE cu" >/dev/null
    # As for pg_remus: the load's writes flushed before the writers start.
    q ccoord -qc CHECKPOINT; q cw1 -qc CHECKPOINT; q cw2 -qc CHECKPOINT
    log "citus: $clients clients updating shard $shard through $src; moving it to $dst"
    (PGPASSFILE=$(passfile_of "$src") exec pgbench -h 127.0.0.1 -p "$(port_of "$src")" -n -c "$clients" \
        -j "$((clients < 2 ? clients : 2))" -T 3600 --max-tries=1 -l --log-prefix="$out/citus-w" \
        -f "$out/update.sql" > "$out/citus.pgbench.txt" 2>&1) &
    local writers=$!
    sleep "$warmup"
    start=$(date +%s.%N)
    q ccoord -XAt -c "SELECT citus_move_shard_placement($shard, '127.0.0.1', $(port_of "$src"), '127.0.0.1',
        $(port_of "$dst"), shard_transfer_mode => 'force_logical')" > "$out/citus.move.txt" 2>&1 \
        || log "citus: move failed: $(cat "$out/citus.move.txt")"
    end=$(date +%s.%N)
    sleep "$tail_s"
    kill -TERM "$writers" 2>/dev/null || true
    wait "$writers" || true
    cat "$out"/citus-w.* | awk 'NF >= 6 && NF <= 8 && $5 > 1e9 && $6 < 1e6 && $3 !~ /^[a-z]/ {
        printf "%.6f\n", $5 + $6 / 1e6 }' | sort -n > "$out/citus.commits"
    {
        printf 'mode citus (load average at its end %s): move %s, %.1f s, %d clients, %d committed, %d failed\n' \
            "$(cut -d' ' -f1 /proc/loadavg)" "$(grep -q ERROR "$out/citus.move.txt" && echo failed || echo succeeded)" \
            "$(echo "$end - $start" | bc)" "$clients" "$(awk -v a="$start" -v b="$end" '$1 >= a && $1 <= b' "$out/citus.commits" | wc -l)" \
            "$(cat "$out"/citus-w.* | awk 'NF >= 6 && NF <= 8 && $3 ~ /^[a-z]/' | wc -l)"
        awk -v a="$start" -v b="$end" '$1 >= a - 1 && $1 <= b + 1' "$out/citus.commits" \
            | awk -v a="$start" 'NR > 1 && $1 - p > g { g = $1 - p; at = p } { p = $1 }
                END { printf "  longest no-commit gap on the moving shard (move +-1 s): %.1f ms (%.3f s after the move began)\n", g * 1000, at - a }'
    } >> "$summary"
)

# awk functions of both analyses below (t[]: the samples' times): x's rate over the samples of
# the second ending at sample i ("" when they span under 0.5 s or a value is missing), and bytes
# as MB.
awk_rates='
function rate1s(x, i,   k) { k = i; while (k > 1 && t[i] - t[k] < 1) k--
    if (t[i] - t[k] < 0.5 || x[i] == "" || x[k] == "") return ""; return (x[i] - x[k]) / (t[i] - t[k]) }
function mb(v) { return v == "" ? "-" : sprintf("%.1f", v / 1048576) }
'

# The summary of mode $1's run from the files in $out: its samples, pgbench logs and events
# (the migration's start and end, the client count and the load average, written by the run).
analyze() {
    local mode=$1 csv="$out/$1.samples.csv" events="$out/$1.events" mig_start mig_end clients load failed
    read -r _ mig_start mig_end clients load <<<"$(grep '^run ' "$events")"
    # Commit times (epoch s) of the writers' successful transactions; a line cut short by the TERM
    # can run into the next one: a time field out of range drops it.
    cat "$out/$mode"-w.* | awk 'NF >= 6 && NF <= 8 && $5 > 1e9 && $6 < 1e6 && $3 !~ /^[a-z]/ {
        printf "%.6f\n", $5 + $6 / 1e6 }' | sort -n > "$out/$mode.commits"
    failed=$(cat "$out/$mode"-w.* | awk 'NF >= 6 && NF <= 8 && $3 ~ /^[a-z]/' | wc -l)

    # Per sample interval: source commits/s (pgbench log) and WAL B/s, each applier's B/s of
    # confirmed_flush advance, lag in bytes and in ms (how long ago the source's WAL was at the
    # applier's position). Rates over 1 s windows for the peaks.
    awk -F, -v OFS=, -v ms="$mig_start" -v me="$mig_end" -v mode="$mode" -v clients="$clients" \
        -v failed="$failed" -v load="$load" -v ev="$events" -v mig="$out/$mode.migration.txt" -v sum="$summary" \
        -v derived="$out/$mode.series.csv" -v commits="$out/$mode.commits" -v limit_ms="$limit_ms" "$awk_rates"'
        BEGIN { while ((getline x < commits) > 0) c[++nc] = x }
        { n++; t[n] = $1; w[n] = $2; r[n] = $3; s[n] = $4; ph[n] = $5; st[n] = $6; tr[n] = $7; rt[n] = $8 }
        # How long ago the source first wrote past pos (0 when it has not): the age of the
        # oldest WAL the applier has not confirmed, at the samples resolution.
        function lagms(pos, i,   j) { if (pos == "") return ""; if (w[i] <= pos) return 0; j = i
            while (j > 1 && w[j - 1] > pos) j--
            return (t[i] - t[j]) * 1000 }
        function fmt(v) { return v == "" ? "-" : sprintf("%.0f", v) }
        END {
            while ((getline line < ev) > 0) { split(line, e, " "); if (e[1] == "enabled") enabled_at = e[2]; if (e[1] == "slot") slot_at = e[2]
                if (e[1] == "paused") { paused_at = e[2]; paused_in = e[3] }; if (e[1] == "resumed") resumed_at = e[2] }
            pause_s = (paused_at == "") ? 0 : ((resumed_at == "" ? t[n] : resumed_at) - paused_at)
            getline mline < mig; split(mline, m, "|")
            print "t,phase,src_commits_per_s,src_wal_Bps,replay_Bps,sub_Bps,replay_lag_bytes,sub_lag_bytes,replay_lag_ms,sub_lag_ms,remus_replay_txns_per_s" > derived
            k = 1
            for (i = 1; i <= n; i++) {
                # commits in (t[i-1], t[i]]
                cnt = 0; while (k <= nc && c[k] <= t[i]) { if (i > 1 && c[k] > t[i - 1]) cnt++; k++ }
                if (i == 1) { cum[1] = 0; continue }
                dt = t[i] - t[i - 1]
                rl = (r[i] == "") ? "" : w[i] - r[i]; sl = (s[i] == "") ? "" : w[i] - s[i]
                rlm = lagms(r[i], i); slm = lagms(s[i], i)
                rb = (r[i] == "" || r[i - 1] == "") ? "" : (r[i] - r[i - 1]) / dt
                sb = (s[i] == "" || s[i - 1] == "") ? "" : (s[i] - s[i - 1]) / dt
                print t[i], ph[i], cnt / dt, (w[i] - w[i - 1]) / dt, rb, sb, rl, sl, rlm, slm, rt[i] > derived
                if (ph[i] != "") { if (!(ph[i] in pt)) order[++np] = ph[i]
                    pt[ph[i]] += dt; pc[ph[i]] += cnt; pw[ph[i]] += w[i] - w[i - 1]
                    pr[ph[i]] += (rb == "" ? 0 : rb * dt); ps[ph[i]] += (sb == "" ? 0 : sb * dt) }
                # cumulative commits for 1 s windows
                cum[i] = cum[i - 1] + cnt
                if (t[i] < ms) { v = rate1s(cum, i); if (v != "" && v > pre_tps_peak) pre_tps_peak = v }
                if (t[i] >= ms && t[i] <= me) {
                    v = rate1s(cum, i); if (v != "" && v > src_tps_peak) src_tps_peak = v
                    v = rate1s(w, i); if (v != "" && v > src_wal_peak) src_wal_peak = v
                    src_n += cnt; src_b += w[i] - w[i - 1]; src_t += dt
                }
                if (ph[i] == "catchup") { if (cu0 == "") cu0 = t[i - 1]; cu1 = t[i]
                    if (rlm != "" && (minlag_cu == "" || rlm < minlag_cu)) minlag_cu = rlm
                    if (rl != "" && rl > maxlag_r) maxlag_r = rl
                    if (rlm != "" && rlm > maxlagms_r) maxlagms_r = rlm
                    if (rl != "") { lastlag_r = rl; lastlagms_r = rlm } }
                if (r[i] != "") { v = rate1s(r, i); if (v != "" && v > r_peak) r_peak = v
                    # backlogged: still >= 300 ms behind the source at the end of the interval
                    if (rb != "" && rlm >= 300) { r_bb += rb * dt; r_bt += dt } }
                # SUB_PAUSE: the subscription disabled from the barrier until the writers stop; its
                # intervals then say nothing of its speed and are left out of its figures.
                sub_paused = (paused_at != "" && t[i] > paused_at && (resumed_at == "" || t[i - 1] < resumed_at))
                if (enabled_at != "" && t[i - 1] >= enabled_at && s[i] != "" && !sub_paused) {
                    v = rate1s(s, i); if (v != "" && v > s_peak) s_peak = v
                    if (sb != "" && slm >= 300) { s_bb += sb * dt; s_bt += dt }
                    if (sl > maxlag_s) maxlag_s = sl; if (slm > maxlagms_s) maxlagms_s = slm
                    if (t[i] <= me) { lag_s_at_me = sl; lagms_s_at_me = slm }
                    if (s_conv == "" && slm != "" && slm <= 500 && t[i] - enabled_at > 0)
                        s_conv = t[i] - enabled_at - (paused_at != "" && t[i] > paused_at ? pause_s : 0)
                }
                # The same intervals for both: each still >= 300 ms behind at the end of the interval.
                if (rb != "" && sb != "" && rlm >= 300 && slm >= 300 && t[i - 1] >= enabled_at && !sub_paused) {
                    both_r += rb * dt; both_s += sb * dt; both_t += dt; both_w += (w[i] - w[i - 1]) }
                if (rt[i] != "" && rt[i] > rt_peak) rt_peak = rt[i]
                # Transactions the replay applied (txns_replayed) over 1 s windows: its rate in
                # the unit of the source, which WAL bytes are not (full-page images after a checkpoint
                # make the WAL of a transaction several times larger, and decoding skips them).
                v = rate1s(tr, i); if (v != "" && v > tr_peak) tr_peak = v
            }
            converged = (minlag_cu != "" && minlag_cu <= 500) ? "yes" : (cu0 == "" ? "no catch-up phase" : "no")
            # The coordinator leaves catch-up when the applied position is close enough (decision
            # 0022: <= 500 ms behind), or hands over when the lag has not shrunk for its limit;
            # the slot, confirmed only as far as the target has flushed (decision 0018), trails
            # the applied position.
            converged_a = (cu0 == "") ? "no catch-up phase" : ((cu1 - cu0) * 1000 < limit_ms ? "yes" : "no, handed over at the limit")
            printf "mode %s (load average at its end %s): status %s, phases (ms) %s, %d clients, %d committed, %d failed\n", mode, load, m[2], m[3], clients, src_n, failed >> sum
            printf "  source (migration window): peak %s commits/s, mean %s; WAL peak %s MB/s, mean %s MB/s\n",
                fmt(src_tps_peak), fmt(src_t ? src_n / src_t : ""), mb(src_wal_peak), mb(src_t ? src_b / src_t : "") >> sum
            printf "  migration replay: peak %s MB/s (1 s), mean while >= 300 ms behind %s MB/s over %.1f s; remus_migrations replay peak %s txn/s (5 s avg), final %s B/s\n",
                mb(r_peak), mb(r_bt ? r_bb / r_bt : ""), r_bt, fmt(rt_peak), m[5] >> sum
            printf "  migration replay in transactions: peak %s txn/s (1 s, txns_replayed); the source peak %s commits/s in the migration window (%s), %s in the warm-up before it (%s)\n",
                fmt(tr_peak), fmt(src_tps_peak), (src_tps_peak > 0 && tr_peak != "" ? sprintf("replay %.2fx", tr_peak / src_tps_peak) : "-"),
                fmt(pre_tps_peak), (pre_tps_peak > 0 && tr_peak != "" ? sprintf("replay %.2fx", tr_peak / pre_tps_peak) : "-") >> sum
            printf "  migration catch-up: %.1f s; lag max %s MB / %s ms, at its end %s MB / %s ms; converged (<= 500 ms behind): %s; by the applied position, as the coordinator judged it: %s\n",
                (cu0 == "" ? 0 : cu1 - cu0), mb(maxlag_r), fmt(maxlagms_r), mb(lastlag_r), fmt(lastlagms_r), converged, converged_a >> sum
            printf "  subscription: peak %s MB/s (1 s), mean while >= 300 ms behind %s MB/s over %.1f s; lag max %s MB / %s ms, at migration end %s MB / %s ms; <= 500 ms behind %s s after enable%s\n",
                mb(s_peak), mb(s_bt ? s_bb / s_bt : ""), s_bt, mb(maxlag_s), fmt(maxlagms_s), mb(lag_s_at_me), fmt(lagms_s_at_me), (s_conv == "" ? "never" : sprintf("%.1f", s_conv)),
                (paused_at == "" ? "" : sprintf(" (paused %.1f s, from the %s until the writers stopped: not counted)", pause_s, paused_in)) >> sum
            printf "  both >= 300 ms behind, same intervals (%.1f s): migration %s MB/s, subscription %s MB/s, source WAL %s MB/s\n",
                both_t, mb(both_t ? both_r / both_t : ""), mb(both_t ? both_s / both_t : ""), mb(both_t ? both_w / both_t : "") >> sum
            printf "  per phase (sampled s: commits/s, source / replay / subscription MB/s):" >> sum
            for (q = 1; q <= np; q++) { p = order[q]
                printf " %s %.1f s: %.0f, %.2f / %.2f / %.2f;", p, pt[p], pc[p] / pt[p], pw[p] / pt[p] / 1048576,
                    pr[p] / pt[p] / 1048576, ps[p] / pt[p] / 1048576 >> sum }
            printf "\n" >> sum
            if (m[8] != "") printf "  waiting_on: %s\n", m[8] >> sum
            if (m[9] != "") printf "  error: %s\n", m[9] >> sum
        }' "$csv"
    # Applied on the target (origins): each applier's best 1 s, and how long after the
    # subscription's enable each had applied everything the source had written at that moment.
    if [ -s "$out/$mode.applied.csv" ]; then
        awk -F, -v csv="$csv" -v ev="$events" "$awk_rates"'
            BEGIN { while ((getline line < ev) > 0) { split(line, e, " "); if (e[1] == "enabled") en = e[2]
                        if (e[1] == "paused") pa = e[2]; if (e[1] == "resumed") re = e[2] }
                    while ((getline line < csv) > 0) { split(line, f, ","); if (en != "" && f[1] <= en) wal_at_en = f[2] } }
            # 0: an origin made but not yet advanced (the subscription origin at its enable).
            $1 ~ /^[0-9]/ { n++; t[n] = $1; r[n] = ($2 == "" || $2 + 0 == 0) ? "" : $2; s[n] = ($3 == "" || $3 + 0 == 0) ? "" : $3 }
            function peak(x,   i, v, best) { best = ""
                for (i = 2; i <= n; i++) { v = rate1s(x, i); if (v != "" && (best == "" || v > best)) best = v }
                return best }
            function drained(x,   i) { if (en == "" || wal_at_en == "") return "-"
                # Time paused (SUB_PAUSE) is not counted.
                for (i = 1; i <= n; i++) if (t[i] >= en && x[i] != "" && x[i] >= wal_at_en)
                    return sprintf("%.2f s", t[i] - en - (pa != "" && t[i] > pa ? (re == "" ? t[i] : (t[i] < re ? t[i] : re)) - pa : 0))
                return "never" }
            END { printf "  applied on the target (origins, 100 ms): replay peak %s MB/s (1 s), subscription peak %s MB/s; the source position at the enable applied %s after it by the replay, %s by the subscription\n",
                mb(peak(r)), mb(peak(s)), drained(r), drained(s) }' "$out/$mode.applied.csv" >> "$summary"
    fi
    # The cores each applier used during catch-up, and its CPU per MB applied.
    if [ -s "$out/$mode.cpu.csv" ] && [ -s "$out/$mode.applied.csv" ]; then
        python3 "$REPO_ROOT/bench/catchup_cpu.py" report "$out/$mode.cpu.csv" "$csv" "$out/$mode.applied.csv" >> "$summary"
    fi
    # Longest interval with no commit of any writer, over the migration (+-1 s).
    awk -v a="$mig_start" -v b="$mig_end" '$1 >= a - 1 && $1 <= b + 1' "$out/$mode.commits" \
        | awk -F, -v csv="$csv" 'NR > 1 && $1 - p > g { g = $1 - p; at = p } { p = $1 }
            END { # The migration phase (sampled) at the gap'"'"'s start and at its end.
                  while ((getline line < csv) > 0) { split(line, f, ",")
                      if (f[1] <= at) from = f[5]; else if (f[1] >= at + g && to == "") to = f[5] }
                  printf "  longest no-commit gap on the moving shard (migration +-1 s): %.1f ms (from %.3f; phase %s to %s)\n",
                      g * 1000, at, (from == "" ? "-" : from), (to == "" ? "-" : to) }' >> "$summary"
    # Writes after Tm that waited remus.drain_wait_timeout for older source writers and then
    # went ahead (the nodes' logs): a no-commit gap of that length is one of these.
    if [ -d "$out/$mode.logs" ]; then
        printf '  fenced writes that went ahead after remus.drain_wait_timeout (nodes'"'"' logs): %s\n' \
            "$(cat "$out/$mode.logs"/n*.log 2>/dev/null | grep -c 'after remus.drain_wait_timeout' || true)" >> "$summary"
    fi
}

if [ "${REANALYZE:-0}" = 1 ]; then
    # The summaries again from an earlier run's files in OUT_DIR (nothing is started).
    # Citus's lines are written by its run, not by analyze: kept as they are.
    citus_lines=$(awk '/^mode / { keep = ($2 == "citus") } keep' "$summary")
    sed -i '/^mode /,$d' "$summary"
    for mode in $modes; do [ "$mode" = citus ] || analyze "$mode"; done
    [ -z "$citus_lines" ] || printf '%s\n' "$citus_lines" >> "$summary"
    cat "$summary"
    exit 0
fi
rm -rf "$out"; mkdir -p "$out"; chmod 777 "$out"
cat > "$out/update.sql" <<SQL
\\set id random(1, $rows)
UPDATE cu SET v = v + 1 WHERE id = :id;
SQL
echo "$(date -u '+%F %T') UTC, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), tree $(git rev-parse --short HEAD)" > "$summary"


# The toolkit's settings for every server beside its defaults (EXTRA_CONF), read from its
# lib.sh in a subshell with a scratch WORK (sourcing it sets up directories and ports).
anchor_dir=${ANCHOR_DIR:-$REPO_ROOT/../shared/anchors/citus}
[ -f "$anchor_dir/lib.sh" ] || die "the Citus anchor toolkit is not at $anchor_dir (set ANCHOR_DIR): its server settings are the bench's"
same_as_citus=$(scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT; WORK=$scratch OUT=$scratch/results \
    bash -c 'source "$1/lib.sh" >/dev/null; printf "%s" "$EXTRA_CONF"' _ "$anchor_dir")
[ -n "$same_as_citus" ] || die "no EXTRA_CONF in $anchor_dir/lib.sh"
# REMUS_EXTRA_SETTINGS: lines added to pg_remus's nodes only, for a diagnosis (e.g.
# "max_wal_size = '8GB'": no checkpoint during the run); not a comparison, so not beside Citus.
if [ -n "${REMUS_EXTRA_SETTINGS:-}" ]; then
    case " $modes " in *" citus "*) die "REMUS_EXTRA_SETTINGS: pg_remus's nodes only, so not with citus in MODES" ;; esac
    same_as_citus="$same_as_citus
$REMUS_EXTRA_SETTINGS"
fi
echo "server settings beside remusctl's (the anchor toolkit's, and REMUS_EXTRA_SETTINGS if set): $(paste -sd';' <<<"$same_as_citus")" >> "$summary"

for mode in $modes; do
    if [ "$mode" = citus ]; then
        [ "$clients" != auto ] || die "MODES: put citus after a pg_remus mode (its sweep sets CLIENTS) or set CLIENTS"
        citus_run
        sed -n '/^mode citus/,$p' "$summary"
        continue
    fi
    "$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
    rm -rf "$dir"
    REMUS_CATCHUP_CONVERGE_LIMIT_MS=$limit_ms "$ctl" cluster up --nodes 2 --dir "$dir" --base-port "$port" >/dev/null
    # The settings the Citus run gets from the anchor toolkit (shared_buffers 256MB, fsync and
    # synchronous_commit on), as its pg_remus clusters get them: the same server settings on
    # both sides of the comparison.
    "$ctl" cluster down --dir "$dir" >/dev/null
    for n in n1 n2; do printf '%s\n' "$same_as_citus" >> "$dir/$n/data/remus.conf"; done
    REMUS_CATCHUP_CONVERGE_LIMIT_MS=$limit_ms "$ctl" cluster up --nodes 2 --dir "$dir" --base-port "$port" >/dev/null
    [ "$(on n1 psql -XAtc 'SHOW shared_buffers')" = "$(sed -n "s/^shared_buffers = '\(.*\)'$/\1/p" <<<"$same_as_citus")" ] \
        || die "the anchor toolkit's settings were not applied to the pg_remus cluster"
    log "$mode: loading $rows rows into a one-shard table"
    on n1 psql -Xq -v ON_ERROR_STOP=1 >/dev/null <<SQL
CREATE TABLE cu (id bigint PRIMARY KEY, v bigint NOT NULL DEFAULT 0, pad text NOT NULL);
INSERT INTO cu SELECT i, 0, md5(i::text) || md5((i + 1)::text) FROM generate_series(1, $rows) i;
SELECT remus_create_distributed_table('cu', 'id', shard_count => 1);
SQL

    read -r shard source <<<"$(on n1 psql -XAt -F ' ' -c "SELECT shard_id, node_name FROM remus_shards WHERE table_name = 'cu'")"
    target=$([ "$source" = n1 ] && echo n2 || echo n1)
    shard_table="remus_shards.cu_$shard"

    if [ "$clients" = auto ]; then
        best=0 best_tps=0
        for c in $sweep; do
            tps=$(on "$source" pgbench -n -c "$c" -j "$((c < 2 ? c : 2))" -T "$sweep_s" -f "$out/update.sql" 2>/dev/null \
                | sed -n 's/^tps = \([0-9.]*\) .*/\1/p')
            echo "clients $c: $tps tps" | tee -a "$out/sweep.txt"
            if awk -v a="$tps" -v b="$best_tps" 'BEGIN { exit !(a > b) }'; then best=$c best_tps=$tps; fi
        done
        clients=$best
        log "clients: $clients (highest source tps in the sweep, $best_tps)"
        echo "sweep (${sweep_s} s each): $(paste -sd';' "$out/sweep.txt"); clients $clients" >> "$summary"
    fi

    # The subscription's side: a database on the target's server with the shard table under the
    # same name and the same rows, a publication of the shard table on the source. The
    # subscription exists disabled (its table recorded as ready: no copy) and without a slot until
    # the migration starts.
    log "$mode: shard $shard on $source -> $target; publication, subscriber database"
    on "$source" psql -Xq -v ON_ERROR_STOP=1 -c "CREATE PUBLICATION catchup_pub FOR TABLE $shard_table"
    on "$target" psql -Xq -v ON_ERROR_STOP=1 -c "CREATE DATABASE catchup_sub"
    on "$target" psql -Xq -v ON_ERROR_STOP=1 -d catchup_sub \
        -c "CREATE SCHEMA remus_shards" \
        -c "CREATE TABLE $shard_table (id bigint PRIMARY KEY, v bigint NOT NULL DEFAULT 0, pad text NOT NULL)"
    on "$source" psql -XAtq -v ON_ERROR_STOP=1 -c "COPY $shard_table TO STDOUT (FORMAT binary)" \
        | on "$target" psql -Xq -v ON_ERROR_STOP=1 -d catchup_sub -c "COPY $shard_table FROM STDIN (FORMAT binary)"
    # The subscription connects as the cluster's user with its generated password (pg_hba wants
    # scram over TCP; the walreceiver has no PGPASSFILE).
    conninfo=$(eval "$("$ctl" cluster env --dir "$dir" --node "$source")"
        pw=$(awk -F: -v p="$PGPORT" -v u="$PGUSER" '($2 == p || $2 == "*") && $4 == u { print $5; exit }' "$PGPASSFILE")
        echo "host=127.0.0.1 port=$PGPORT user=$PGUSER dbname=$PGDATABASE password=$pw")
    on "$target" psql -Xq -v ON_ERROR_STOP=1 -d catchup_sub -c "CREATE SUBSCRIPTION catchup_sub
        CONNECTION '$conninfo' PUBLICATION catchup_pub
        WITH (slot_name = 'catchup_sub', create_slot = false, enabled = false, copy_data = false)"

    # The setup's writes (the table's load, the sweep, the subscriber's copy of the rows: about
    # a GB of dirty pages on each node) are flushed now, not by a checkpoint during the
    # migration: its sync would stall every commit on this disk in the middle of the measured
    # window (230-340 ms of no commit at the copy's end, in every run before this).
    on n1 psql -Xq -v ON_ERROR_STOP=1 -c CHECKPOINT
    on n2 psql -Xq -v ON_ERROR_STOP=1 -c CHECKPOINT
    csv="$out/$mode.samples.csv" events="$out/$mode.events" stop="$out/$mode.stop"
    : > "$csv"; : > "$events"; rm -f "$stop"
    log "$mode: $clients clients updating the shard through $source; sampling every 100 ms"
    on_exec "$source" pgbench -n -c "$clients" -j "$((clients < 2 ? clients : 2))" -T 3600 \
        --max-tries=1 -l --log-prefix="$out/$mode-w" -f "$out/update.sql" > "$out/$mode.pgbench.txt" 2>&1 &
    writers=$!
    # The 100 ms tick; the sample's own clock is what the analysis uses, so sleep drift is harmless.
    (while [ ! -e "$stop" ]; do echo "$sample_sql"; sleep 0.1; done \
        | on "$source" stdbuf -oL psql -XAtq -F '|' 2>> "$out/$mode.sampler.err" | controller "$csv" "$events") &
    sampler=$!
    poll_to_file 0.1 "$target" "$applied_sql" ',' "$out/$mode.applied.csv" &
    applied_sampler=$!
    # What every running statement of both nodes waits on, every 50 ms (not analysed here:
    # `$mode.waits.<node>.txt` is read by hand when a gap needs explaining): the clock, the pid,
    # the application name, the wait event and the statement's start.
    waits_sql="SELECT extract(epoch FROM clock_timestamp()), pid, application_name, state,
      coalesce(wait_event_type || ':' || wait_event, '-'), backend_xid IS NOT NULL,
      extract(epoch FROM xact_start), left(regexp_replace(query, '\s+', ' ', 'g'), 80)
      FROM pg_stat_activity WHERE backend_type = 'client backend' AND state <> 'idle'
       AND pid <> pg_backend_pid();"
    wait_samplers=""
    for n in "$source" "$target"; do
        poll_to_file 0.05 "$n" "$waits_sql" '|' "$out/$mode.waits.$n.txt" &
        wait_samplers="$wait_samplers $!"
    done
    # The CPU every process of the cluster uses, by role (bench/catchup_cpu.py).
    : > "$out/$mode.cpu.csv"
    python3 "$REPO_ROOT/bench/catchup_cpu.py" sample "$dir" "$out/$mode.cpu.csv" "$stop" \
        2>> "$out/$mode.sampler.err" &
    cpu_sampler=$!
    sleep "$warmup"
    mig_start=$(date +%s.%N)
    if ! result=$(on "$target" psql -XAt -F ' ' -v ON_ERROR_STOP=1 \
            -c "SELECT status FROM remus_migrate_shard($shard, '$target', '$mode')" 2>&1); then
        log "$mode: migration failed: $result"
    fi
    mig_end=$(date +%s.%N)
    echo "run $mig_start $mig_end $clients $(cut -d' ' -f1 /proc/loadavg)" >> "$events"
    sleep "$tail_s"
    kill -TERM "$writers" 2>/dev/null || true
    wait "$writers" || true
    writers=""
    if grep -q '^paused ' "$events"; then
        on "$target" psql -Xq -d catchup_sub -c "ALTER SUBSCRIPTION catchup_sub ENABLE"
        echo "resumed $(date +%s.%N)" >> "$events"
    fi
    # The subscription gets until it has confirmed the source's position at the writers' end.
    stop_lsn=$(on "$source" psql -XAtc "SELECT pg_current_wal_lsn() - '0/0'")
    for _ in $(seq $((sub_wait * 10))); do
        c=$(on "$source" psql -XAtc "SELECT coalesce(confirmed_flush_lsn - '0/0', 0) >= $stop_lsn
                                     FROM pg_replication_slots WHERE slot_name = 'catchup_sub'")
        [ "$c" = f ] || break
        sleep 0.1
    done
    touch "$stop"
    wait "$sampler" || true
    wait "$applied_sampler" || true
    wait "$cpu_sampler" || true
    for p in $wait_samplers; do wait "$p" || true; done
    on "$source" psql -XAt -F '|' -c "SELECT phase, status, phase_ms, txns_replayed, replay_bytes_per_sec,
        replay_txns_per_sec, source_wal_bytes_per_sec, coalesce(waiting_on, ''), coalesce(error, '')
        FROM remus_migrations ORDER BY migration_id DESC LIMIT 1" > "$out/$mode.migration.txt" || true
    on "$target" psql -Xq -d catchup_sub -c "ALTER SUBSCRIPTION catchup_sub DISABLE" \
        -c "ALTER SUBSCRIPTION catchup_sub SET (slot_name = NONE)" -c "DROP SUBSCRIPTION catchup_sub" >/dev/null || true
    "$ctl" cluster down --dir "$dir" >/dev/null 2>&1 || true
    # The cluster's logs (coordinator, replay worker, nodes): the next mode's cluster replaces them.
    rm -rf "$out/$mode.logs"
    cp -r "$dir/logs" "$out/$mode.logs" 2>/dev/null || true
    target=""

    analyze "$mode"
    sed -n "/^mode $mode:/,\$p" "$summary"
done
echo
cat "$summary"
echo "(samples, per-interval series, pgbench logs and events in $out)"
