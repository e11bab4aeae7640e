#!/usr/bin/env bash
# The opt-in upgrade tier (decision 0020): a cluster of the previous release, upgraded node by
# node to this checkout's build under pgbench (tests/tests/upgrade_rolling.rs).
#
#   scripts/upgrade-test.sh [TAG]        TAG: the previous release, default the newest v* tag
#
# 1. builds TAG in a git worktree outside this checkout ($REMUS_UPGRADE_OLD_TREE, default
#    /work/build-<TAG>; its own target directory): its binaries and `cargo pgrx package`;
# 2. builds this checkout: the binaries and `cargo pgrx package`, plus the earlier releases'
#    install scripts of pg_remus/sql (as install_extension installs them);
# 3. installs TAG's extension into PostgreSQL's directories (files renamed into place) and runs
#    the ignored test upgrade_rolling, which starts the cluster with TAG's remusctl, installs the
#    new build under the running servers and upgrades each node;
# 4. always installs this checkout's build again (install_extension) before it exits.
# Every node of a local cluster loads the one pg_remus.so of PostgreSQL's lib directory, so the
# whole run holds the exclusive lock $REMUS_EXT_LOCK (default /tmp/remus-ext.lock) that
# extension installs and test runs on a shared machine take. Root, PostgreSQL 15, etcd, as
# every integration test. About 3 minutes once both builds exist.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

tag=${1:-$(git tag --list 'v*' --sort=-version:refname | head -n1)}
[ -n "$tag" ] || die "no release tag (v*) to upgrade from"
git rev-parse -q --verify "refs/tags/$tag" >/dev/null || die "no tag $tag"
from=${tag#v}
old_tree=${REMUS_UPGRADE_OLD_TREE:-/work/build-$tag}
pkg_rel=target/release/pg_remus-pg15

exec 9>"${REMUS_EXT_LOCK:-/tmp/remus-ext.lock}"

# 1. The previous release.
if [ ! -d "$old_tree" ]; then
    log "worktree $old_tree at $tag"
    git worktree add --detach "$old_tree" "$tag" >/dev/null
fi
[ "$(git -C "$old_tree" rev-parse HEAD)" = "$(git rev-parse "$tag^{commit}")" ] \
    || die "$old_tree is not at $tag"
log "building $tag in $old_tree"
(
    cd "$old_tree"
    export CARGO_TARGET_DIR="$old_tree/target"
    cargo build --release --workspace --exclude pg_remus >/dev/null
    cd pg_remus && cargo pgrx package --pg-config "$PG_CONFIG" >/dev/null
)
old_pkg="$old_tree/$pkg_rel"
[ -f "$old_pkg/usr/share/postgresql/15/extension/pg_remus--$from.sql" ] \
    || die "$tag's package has no pg_remus--$from.sql"

# 2. This checkout.
log "building this checkout"
cargo build --release --workspace --exclude pg_remus >/dev/null
rm -rf "$pkg_rel"
(cd pg_remus && cargo pgrx package --pg-config "$PG_CONFIG" >/dev/null)
new_pkg="$REPO_ROOT/$pkg_rel"
install_previous_release_scripts "$new_pkg/usr/share/postgresql/15/extension"
cargo test --release -p integration --test upgrade_rolling --no-run 2>/dev/null

# 3. Under the lock: the previous release installed, the test, the current build back.
log "waiting for the exclusive extension lock"
flock -x 9
restore() {
    log "installing this checkout's build again"
    install_extension
}
trap restore EXIT
stop_remus_servers
log "installing $tag's extension"
while IFS= read -r -d '' f; do
    rel=${f#"$old_pkg"}
    mode=644
    [[ $f == *.so ]] && mode=755
    install -m "$mode" "$f" "$rel.upgrade-$$"
    mv -f "$rel.upgrade-$$" "$rel"
done < <(find "$old_pkg" -type f -print0)

log "test upgrade_rolling: $tag -> this checkout"
REMUS_BIN_DIR="$old_tree/target/release" \
REMUS_UPGRADE_FROM="$from" \
REMUS_UPGRADE_NEW_PKG="$new_pkg" \
REMUS_UPGRADE_NEW_BIN="$REPO_ROOT/target/release" \
    cargo test --release -p integration --test upgrade_rolling -- --ignored --nocapture --test-threads=1
