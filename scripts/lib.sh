# Shared helpers for the scripts in this directory; source it, do not run it.
# shellcheck shell=bash

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
# Used by the scripts that source this file.
# shellcheck disable=SC2034
PGRX_VERSION=0.18.1
export PATH="$HOME/.cargo/bin:$PATH"

log() { printf '[%s %s] %s\n' "$(basename "$0")" "$(date +%H:%M:%S)" "$*"; }
die() { log "ERROR: $*"; exit 1; }

# `cargo test --release` as the test tiers run it (scripts/test.sh's unit tier,
# scripts/integration.sh): without cross-crate LTO, in a target directory of its own. The
# release profile's thin LTO took about 30 s per test binary on two cores against about 6 s
# without it (22 of the integration tier's 55 minutes on a cold machine, 2026-11-29); the
# dependencies are built once more for it (about 3.5 minutes). target/test keeps these builds
# apart from target/release, whose LTO binaries (scripts/setup.sh) are the ones the integration
# tests start (`test_support::cluster::bin_dir`) and the benches measure: in target/release the
# unit tier's rebuild of remus-coordinator and remus-replay-worker would replace them.
test_cargo() {
    CARGO_TARGET_DIR="$REPO_ROOT/target/test" CARGO_PROFILE_RELEASE_LTO=false cargo test --release "$@"
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Makes the toolchain rust-toolchain.toml pins available. rustup would download a missing one
# (or refuse, with RUSTUP_AUTO_INSTALL=0); when the machine's stable toolchain is that very
# release, the pinned name is made to point at it instead, with no download.
ensure_toolchain() {
    command -v rustup >/dev/null || return 0
    local channel host sysroot
    channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$REPO_ROOT/rust-toolchain.toml")
    [ -n "$channel" ] || die "no channel in rust-toolchain.toml"
    if rustup toolchain list | grep -q "^$channel-"; then
        return 0
    fi
    if [ "$(RUSTUP_TOOLCHAIN=stable rustc --version 2>/dev/null | awk '{print $2}')" = "$channel" ]; then
        host=$(RUSTUP_TOOLCHAIN=stable rustc -vV | sed -n 's/^host: //p')
        sysroot=$(RUSTUP_TOOLCHAIN=stable rustc --print sysroot)
        log "toolchain $channel: the installed stable toolchain ($sysroot)"
        ln -s "$sysroot" "$(rustup show home)/toolchains/$channel-$host"
    else
        log "installing toolchain $channel"
        rustup toolchain install "$channel" --profile minimal --component rustfmt --component clippy
    fi
}

# Stops every running PostgreSQL server that preloads pg_remus: swapping the .so under a server
# that has it loaded crashes that server. A postmaster's cwd is its data directory, and the
# clusters remusctl makes carry remus.conf there.
stop_remus_servers() {
    local pid dir
    for pid in $(pgrep -x postgres 2>/dev/null || true); do
        # Only postmasters: their parent is not a postgres process.
        [ "$(ps -o comm= -p "$(ps -o ppid= -p "$pid" | tr -d ' ')" 2>/dev/null)" = postgres ] && continue
        dir=$(readlink "/proc/$pid/cwd" 2>/dev/null) || continue
        if [ -f "$dir/remus.conf" ] || grep -qs "pg_remus" "$dir/postgresql.auto.conf" "$dir/postgresql.conf"; then
            log "stopping PostgreSQL in $dir (pid $pid) before installing pg_remus"
            as_root runuser -u postgres -- "$(dirname "$PG_CONFIG")/pg_ctl" -D "$dir" -m fast -w stop >/dev/null || true
        fi
    done
}

# Builds and installs pg_remus: the library, the control file and this version's generated
# install script (cargo pgrx install, which also copies the upgrade scripts
# pg_remus/sql/pg_remus--<from>--<to>.sql), plus the install scripts of earlier releases kept in
# pg_remus/sql/pg_remus--<version>.sql (cargo pgrx copies only upgrade scripts), so that
# `CREATE EXTENSION pg_remus VERSION '<earlier>'` works: the upgrade check creates a previous
# release's catalog with the new library and updates it (decision 0020).
install_extension() {
    stop_remus_servers
    log "installing pg_remus into $("$PG_CONFIG" --pkglibdir)"
    (cd "$REPO_ROOT/pg_remus" && cargo pgrx install --release --pg-config "$PG_CONFIG" >/dev/null)
    install_previous_release_scripts "$("$PG_CONFIG" --sharedir)/extension"
}

# Copies pg_remus/sql/pg_remus--<version>.sql (earlier releases' whole install scripts) into
# extension directory $1; the current version's script is the one cargo pgrx generated.
install_previous_release_scripts() {
    local extdir=$1 f name current
    current=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO_ROOT/Cargo.toml" | head -n1)
    for f in "$REPO_ROOT"/pg_remus/sql/pg_remus--*.sql; do
        [ -e "$f" ] || continue
        name=$(basename "$f")
        case "$name" in
            pg_remus--*--*.sql) continue ;;  # an upgrade script: cargo pgrx installed it
            "pg_remus--$current.sql") die "$name: the current version's script is generated, not kept" ;;
        esac
        install -m 644 "$f" "$extdir/$name"
    done
}
