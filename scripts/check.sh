#!/usr/bin/env bash
# The fast check tier: formatting, lints, docs, the module-cycle rule and shell scripts, in
# minutes, before any test tier builds a release or starts a server. Needs what
# `scripts/setup.sh --toolchain-only` installs (cargo-pgrx's `pgrx init`: clippy and rustdoc
# compile the pg_remus extension against PostgreSQL 15's headers).
# Usage: scripts/check.sh [--fail-fast]
#   Runs every check and lists the failed ones at the end; --fail-fast stops at the first.
# The functions below are called through check "$@", which shellcheck cannot follow.
# shellcheck disable=SC2317
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
start=$SECONDS
fail_fast=false
case "${1:-}" in
    --fail-fast) fail_fast=true ;;
    "") ;;
    *) die "usage: $0 [--fail-fast]" ;;
esac
failed=()

# The src directory of every workspace member.
crate_srcs() {
    cargo metadata --no-deps --format-version 1 | python3 -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    src = os.path.join(os.path.dirname(p["manifest_path"]), "src")
    if os.path.isdir(src):
        print(os.path.relpath(src))'
}

# The first lines of rustfmt's diff, then the list of files it would change (`cargo fmt --all`
# fixes them).
rustfmt_check() {
    local out
    out=$(cargo fmt --all -- --check 2>&1) && return 0
    printf '%s\n' "$out" | head -n 60
    log "rustfmt: $(printf '%s\n' "$out" | wc -l) lines of diff; files to format (cargo fmt --all):"
    cargo fmt --all -- --check -l || true
    return 1
}

module_cycles() {
    local srcs
    mapfile -t srcs < <(crate_srcs)
    python3 scripts/check_module_cycles.py --self-test >/dev/null &&
        python3 scripts/check_module_cycles.py "${srcs[@]}"
}

shell_scripts() {
    command -v shellcheck >/dev/null || { log "shellcheck not installed (scripts/setup.sh installs it)"; return 1; }
    shellcheck -x scripts/*.sh bench/*.sh sql/regress/run.sh .ci/run
}

check() {
    local name=$1; shift
    local t0=$SECONDS rc=0
    log "check: $name"
    "$@" || rc=$?
    log "check $name: $([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
    if [ "$rc" -ne 0 ]; then
        failed+=("$name")
        $fail_fast && finish
    fi
    return 0
}

finish() {
    if [ ${#failed[@]} -eq 0 ]; then
        log "check tier passed in $((SECONDS - start)) s"
        exit 0
    fi
    log "check tier FAILED in $((SECONDS - start)) s: ${failed[*]}"
    exit 1
}

# Cheapest first, so a style slip is reported within seconds.
check rustfmt rustfmt_check
check module-cycles module_cycles
check shellcheck shell_scripts
# --workspace takes pg_remus too (it is not a default member); its default feature is pg15.
# --keep-going (clippy and rustdoc): the findings of every crate, not only of the first that
# fails.
# rustdoc documents private items too, so a public doc linking to a private item is no broken
# link here (a module doc listing its private children, say).
check clippy cargo clippy --workspace --all-targets --keep-going -- -D warnings
check rustdoc env RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" cargo doc --workspace --no-deps --document-private-items --keep-going
finish
