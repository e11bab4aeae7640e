#!/usr/bin/env bash
# pg_regress golden-file tests against node n1 of a running cluster.
# Usage: sql/regress/run.sh CLUSTER_DIR   (REGRESS_ACCEPT=1 rewrites expected/ from the results)
# The cluster must be fresh: the tests create their own tables.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$1
ctl="$here/../../target/release/remusctl"
eval "$("$ctl" cluster env --dir "$dir")"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
pg_regress=$(dirname "$(/usr/lib/postgresql/15/bin/pg_config --pgxs)")/../test/regress/pg_regress
"$pg_regress" --use-existing --host="$PGHOST" --port="$PGPORT" --user="$PGUSER" --dbname="$PGDATABASE" \
    --inputdir="$here" --outputdir="$out" --bindir=/usr/lib/postgresql/15/bin errors migrate_errors handover_errors api_errors || {
    if [ "${REGRESS_ACCEPT:-0}" = 1 ]; then
        # Regenerate the golden files (review the diff before committing it).
        cp "$out/results/"*.out "$here/expected/"
        exit 0
    fi
    cat "$out/regression.diffs" 2>/dev/null
    exit 1
}
