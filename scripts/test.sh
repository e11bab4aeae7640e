#!/usr/bin/env bash
# Sets everything up, then runs every test tier:
#   1. Rust unit tests of every crate,
#   2. #[pg_test] tests of the extension inside a real PostgreSQL 15 (as user postgres),
#   3. pg_regress golden files (sql/regress) against a real cluster: messages and SQLSTATEs,
#   4. integration tests against real local clusters (tests/).
# The fast check tier (fmt, clippy, docs, module cycles, shellcheck) is scripts/check.sh; .ci/run
# runs it before this script, which does not repeat it.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
start=$SECONDS
results=$(mktemp)
trap 'rm -f "$results" "$results".*' EXIT

"$REPO_ROOT/scripts/setup.sh"

run_tier() {
    local name=$1; shift
    local t0=$SECONDS
    log "tier: $name"
    set +e
    "$@" 2>&1 | tee -a "$results.$name"
    local rc=${PIPESTATUS[0]}
    set -e
    grep -h '^test result:' "$results.$name" >> "$results" || true
    mv "$results.$name" "$results.$name.log"
    log "tier $name finished in $((SECONDS - t0)) s (exit $rc)"
    [ "$rc" -eq 0 ] || { summary; die "tier $name failed"; }
}

summary() {
    awk '{for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
         END { printf "tests: %d passed, %d failed\n", p, f }' "$results"
}

run_tier unit test_cargo --workspace --exclude pg_remus --exclude integration

# pgrx runs its own PostgreSQL as user postgres in a data directory that user owns.
PGRX_PGDATA=/var/tmp/pg_remus_pgrx_test
as_root rm -rf "$PGRX_PGDATA"
as_root install -d -o postgres -g postgres "$PGRX_PGDATA"
stop_remus_servers
run_tier pg_test bash -c "cd pg_remus && cargo pgrx test --release pg15 --runas postgres --pgdata $PGRX_PGDATA"
# `cargo pgrx test` installed its test build; put the release build back for the clusters.
install_extension

regress() {
    local dir
    dir=$(mktemp -d /tmp/remus-regress-XXXXXX)
    chmod 755 "$dir"
    target/release/remusctl cluster up --nodes 3 --dir "$dir" --base-port 29001 >/dev/null
    local rc=0
    sql/regress/run.sh "$dir" || rc=$?
    target/release/remusctl cluster down --dir "$dir" >/dev/null
    rm -rf "$dir"
    return $rc
}
run_tier regress regress
# pg_regress prints "All N tests passed."; count its files like the other tiers' tests.
sed -n 's/.*All \([0-9]*\) tests passed.*/test result: ok. \1 passed; 0 failed;/p' "$results.regress.log" >> "$results" 2>/dev/null || true

# Two test binaries at a time, every one run even after one fails (scripts/integration.sh).
run_tier integration "$REPO_ROOT/scripts/integration.sh"

log "all tiers passed in $((SECONDS - start)) s"
summary
