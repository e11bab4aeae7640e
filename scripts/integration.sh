#!/usr/bin/env bash
# The integration tier (package `integration`, one test binary per tests/tests/*.rs): builds the
# binaries, then runs REMUS_IT_JOBS of them at a time (default 2), the longest first, each with
# its tests two at a time (--test-threads=2). A binary's output is printed whole when it ends, so
# two binaries' lines never interleave. Every binary runs even after one fails; the exit status
# says whether any failed, and the last lines name them.
#
# Why not `cargo test -p integration`: cargo runs test binaries one after another, and most of
# the tier's time is spent waiting on servers (loads of fixed length, migrations, restarts), so
# two at a time take about half the time on two cores (decision 0033). Why not cargo-nextest: it
# would be built on every fresh machine (minutes, like cargo-pgrx), for a pool of 40 lines here.
#
# Usage: scripts/integration.sh [ARGS...]   ARGS go to every test binary (a test-name filter,
#        --ignored, --nocapture). Needs scripts/setup.sh's build and install.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
jobs_max=${REMUS_IT_JOBS:-2}

# Longest first (by their times in the fresh-clone CI of 57fc50f), so that the pool's workers
# end together instead of one starting the longest file last. Files not named run after these,
# in name order; a file missing here only makes the schedule worse, never wrong.
LONGEST_FIRST=(migration_concurrency migration_remus migration_baselines coordinator_failover
               application_role distributed_ddl pgbench_tpcb migration_albatross tpcc
               migration_squall migration_squall_faults drain_node router_local_plan
               node_addition two_phase fault_matrix migration_state_restart migration_recovery
               router_semantics bench_smoke foreign_keys)

out=$(mktemp -d /tmp/remus-it-XXXXXX)
trap 'rm -rf "$out"' EXIT

# Built as the unit tier's tests are (test_cargo, scripts/lib.sh: no cross-crate LTO, in
# target/test); they start the LTO binaries of target/release.
log "building the integration test binaries"
test_cargo -p integration --no-run --message-format=json-render-diagnostics > "$out/build.json"
# The executable of every test target (the package's tests/*.rs and its lib's tests), by name.
declare -A exe_of
while IFS=$'\t' read -r name exe; do
    exe_of[$name]=$exe
done < <(jq -r 'select(.reason == "compiler-artifact" and .profile.test == true
                       and .executable != null) | [.target.name, .executable] | @tsv' \
            "$out/build.json")
[ ${#exe_of[@]} -gt 0 ] || die "cargo built no integration test binary"

ordered=()
for name in "${LONGEST_FIRST[@]}"; do
    [ -n "${exe_of[$name]:-}" ] && ordered+=("$name")
done
for name in $(printf '%s\n' "${!exe_of[@]}" | sort); do
    [[ " ${LONGEST_FIRST[*]} " == *" $name "* ]] || ordered+=("$name")
done

run_binary() {
    local name=$1; shift
    local exe=${exe_of[$name]} t0=$SECONDS rc=0
    # cargo runs a test binary in its package's directory; so does this.
    (cd tests && "$exe" --test-threads=2 "$@") > "$out/$name.log" 2>&1 || rc=$?
    echo "$rc" > "$out/$name.rc"
    {
        flock -x 9
        echo "     Running $name ($exe), $((SECONDS - t0)) s, exit $rc"
        cat "$out/$name.log"
    } 9>"$out/print.lock"
}

log "running ${#ordered[@]} test binaries, $jobs_max at a time"
for name in "${ordered[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    run_binary "$name" "$@" &
done
wait

failed=()
for name in "${ordered[@]}"; do
    [ "$(cat "$out/$name.rc" 2>/dev/null || echo missing)" = 0 ] || failed+=("$name")
done
if [ ${#failed[@]} -gt 0 ]; then
    log "failed test binaries: ${failed[*]}"
    exit 1
fi
log "every integration test binary passed"
