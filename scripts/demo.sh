#!/usr/bin/env bash
# Sets everything up and starts a local 3-node pg_remus cluster (left running), then shows how
# to connect. REMUS_DIR overrides the cluster directory (default .remus/cluster).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
"$REPO_ROOT/scripts/setup.sh"

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
cat <<MSG

Connect to node n1:
  eval "\$($ctl cluster env --dir $dir)" && psql
Another node:  $ctl cluster env --dir $dir --node n2
Stop it all:   $ctl cluster down --dir $dir
MSG
