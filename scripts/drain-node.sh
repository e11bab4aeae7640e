#!/usr/bin/env bash
# drain-node.sh NODE [options]: moves every shard NODE owns to the other nodes, K co-location
# groups per migration, through `remus_migrate_shards` on any node, printing its progress.
#
# Safe to run again after an interruption (Ctrl-C, a lost connection, a failed migration): each
# step reads what NODE still owns and which migrations are running from the cluster itself, waits
# for a migration of NODE's shards that is still running (the coordinator finishes or rolls back
# a migration whose client went away), and never starts one for a shard that is already moving.
#
# Options:
#   --mode M             remus (default) | lock_abort | wait_remaster | squall | albatross
#   --per-migration K    co-location groups moved by one migration (default 1)
#   --to N1,N2,...       the nodes that may receive shards (default: every other node)
#   --retries R          attempts per group before giving up (default 3)
#   --dry-run            print the plan and change nothing
# Connection: libpq's environment (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSFILE; e.g.
# `eval "$(remusctl cluster env --dir DIR)"`), or `-d CONNINFO` of any node. The role needs
# remus_admin (or superuser), as remus_migrate_shards does.
#
# Exit status: 0 drained (NODE owns no shard), 1 a group could not be moved after R attempts,
# 2 bad usage or unknown node.
set -euo pipefail

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

node="" mode=remus per=1 to="" retries=3 dry=0 conninfo=""
while [ $# -gt 0 ]; do
    case "$1" in
        --mode) mode=${2:?}; shift 2 ;;
        --per-migration) per=${2:?}; shift 2 ;;
        --to) to=${2:?}; shift 2 ;;
        --retries) retries=${2:?}; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -d) conninfo=${2:?}; shift 2 ;;
        -h|--help) usage ;;
        -*) echo "drain-node: unknown option $1" >&2; usage ;;
        *) [ -z "$node" ] || usage; node=$1; shift ;;
    esac
done
[ -n "$node" ] || usage
case "$per" in ''|*[!0-9]*|0) echo "drain-node: --per-migration needs a positive number" >&2; exit 2 ;; esac
case "$retries" in ''|*[!0-9]*|0) echo "drain-node: --retries needs a positive number" >&2; exit 2 ;; esac

log() { printf '[drain %s %s] %s\n' "$node" "$(date +%T)" "$*"; }

# One query, unaligned, no header; values are psql variables, quoted by psql (:'name'), which
# interpolates them in what it reads from standard input (not in -c).
q() {
    local sql=$1; shift
    psql -X -q -At -v ON_ERROR_STOP=1 ${conninfo:+-d "$conninfo"} \
        -v node="$node" -v mode="$mode" -v to="$to" "$@" <<<"$sql"
}

if [ "$(q "SELECT count(*) FROM remus_nodes WHERE name = :'node'" 2>&1)" != 1 ]; then
    echo "drain-node: node \"$node\" is not a member of the cluster (remus_nodes)" >&2
    exit 2
fi

# The nodes that may receive shards, by what they hold (bytes of hash shards), fewest first.
RECEIVERS="
SELECT n.name
  FROM remus_nodes n
  LEFT JOIN remus_shards s ON s.node_name = n.name
 WHERE n.name <> :'node'
   AND (:'to' = '' OR n.name = ANY (string_to_array(:'to', ',')))
 GROUP BY n.name
 ORDER BY coalesce(sum(s.size_bytes), 0), n.name"

# NODE's co-location groups not moving now: one shard id per group (the migration takes the
# group's other shards with it), smallest group first so progress shows early.
GROUPS_LEFT="
WITH moving AS (
    SELECT unnest(shard_ids) AS shard_id FROM remus_migrations WHERE status = 'running')
SELECT min(s.shard_id)
  FROM remus_shards s
 WHERE s.node_name = :'node'
   AND NOT EXISTS (SELECT 1 FROM moving m WHERE m.shard_id = s.shard_id)
 GROUP BY s.colocation_id, s.hash_min
 ORDER BY sum(s.size_bytes), min(s.shard_id)"

RUNNING="SELECT count(*) FROM remus_migrations WHERE status = 'running' AND source = :'node'"

receivers=$(q "$RECEIVERS")
[ -n "$receivers" ] || { echo "drain-node: no node to receive $node's shards" >&2; exit 2; }
total=$(q "SELECT count(*) FROM (SELECT 1 FROM remus_shards WHERE node_name = :'node' GROUP BY colocation_id, hash_min) g")
log "mode $mode, $per group(s) per migration; $total co-location group(s) left; receivers: $(printf '%s' "$receivers" | paste -sd, -)"

declare -A attempts=()
moved=0
while :; do
    # An earlier run's migration (or another operator's) of this node's shards: wait for it.
    while [ "$(q "$RUNNING")" != 0 ]; do
        log "waiting for running migration(s) from $node: $(q "SELECT string_agg(migration_id || ' ' || phase || coalesce(' (' || waiting_on || ')', ''), '; ') FROM remus_migrations WHERE status = 'running' AND source = :'node'")"
        sleep 2
    done
    mapfile -t left < <(q "$GROUPS_LEFT")
    if [ ${#left[@]} -eq 0 ]; then
        log "drained: $node owns no shard ($moved group(s) moved by this run)"
        exit 0
    fi
    batch=("${left[@]:0:$per}")
    target=$(q "$RECEIVERS" | head -n 1)
    ids=$(IFS=,; echo "${batch[*]}")
    key=${batch[0]}
    attempts[$key]=$(( ${attempts[$key]:-0} + 1 ))
    if [ "${attempts[$key]}" -gt "$retries" ]; then
        log "giving up: shards {$ids} were not moved after $retries attempt(s)"
        exit 1
    fi
    done_groups=$(( total - ${#left[@]} ))
    log "[$done_groups/$total] moving shards {$ids} (and their co-located shards) to $target, attempt ${attempts[$key]}"
    if [ "$dry" = 1 ]; then
        log "dry run: stop here"
        exit 0
    fi
    set +e
    out=$(q "SELECT migration_id, status, total_ms, aborted_by_migration
               FROM remus_migrate_shards(ARRAY[$ids]::bigint[], :'target', :'mode')" \
            -v target="$target" 2>&1)
    rc=$?
    set -e
    status=$(printf '%s' "$out" | awk -F'|' 'NR==1 {print $2}')
    if [ $rc -eq 0 ] && [ "$status" = succeeded ]; then
        IFS='|' read -r mid _ ms aborted <<<"$out"
        moved=$(( moved + ${#batch[@]} ))
        log "migration $mid succeeded in ${ms} ms (aborted_by_migration $aborted)"
    else
        log "not moved (attempt ${attempts[$key]} of $retries): $(printf '%s' "$out" | tr '\n' ' ')"
        sleep 1
    fi
done
