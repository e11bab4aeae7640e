#!/usr/bin/env bash
# Idempotent set-up of everything pg_remus needs on a Debian 12 machine: system packages,
# cargo-pgrx, the release build, and the extension installed into the system PostgreSQL 15.
# Usage: scripts/setup.sh [--toolchain-only]
#   --toolchain-only: packages, the pinned Rust toolchain, cargo-pgrx and `cargo pgrx init`, all
#   the check tier (scripts/check.sh) needs; no release build, no install.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
start=$SECONDS
toolchain_only=false
case "${1:-}" in
    --toolchain-only) toolchain_only=true ;;
    "") ;;
    *) die "usage: $0 [--toolchain-only]" ;;
esac

PACKAGES=(postgresql-15 postgresql-server-dev-15 postgresql-contrib libpq-dev protobuf-compiler
          etcd-server etcd-client libclang-dev clang build-essential pkg-config libssl-dev sudo
          procps util-linux shellcheck jq)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    log "system packages present"
fi

command -v cargo >/dev/null || die "cargo not found: install Rust (rustup) first"
ensure_toolchain

if cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION"; then
    log "cargo-pgrx $PGRX_VERSION present"
else
    # An unoptimised build: 2.5 minutes on two cores against about 10 for the release build
    # (2026-11-29). cargo-pgrx drives cargo and copies files; the time of its runs is cargo's.
    log "installing cargo-pgrx $PGRX_VERSION (a few minutes on a cold machine)"
    cargo install cargo-pgrx --version "=$PGRX_VERSION" --locked --debug
fi

if ! grep -qs "pg15 = \"$PG_CONFIG\"" "$HOME/.pgrx/config.toml"; then
    log "cargo pgrx init --pg15 $PG_CONFIG"
    cargo pgrx init --pg15 "$PG_CONFIG" >/dev/null
fi

if $toolchain_only; then
    log "toolchain set-up done in $((SECONDS - start)) s"
    exit 0
fi

log "building the workspace (release)"
cargo build --release
install_extension
[ -x target/release/remusctl ] || die "target/release/remusctl was not built"
log "set-up done in $((SECONDS - start)) s; remusctl is target/release/remusctl"
