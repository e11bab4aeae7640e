#!/usr/bin/env bash
# A/B of the path through a node that owns no shard (issue 16): the anchor toolkit's 3-node
# pg_remus cluster (../shared/anchors/citus, `setup.sh remus`: pgbench -i -s SCALE, accounts and
# history over SHARDS shards, none on n1), entered through n1, every client over TCP. CLUSTER=r1
# runs the same on the toolkit's 1-node cluster (`setup.sh remus1`: the owner's path). Variants
# run interleaved, round after round, on the same cluster and data, so that the machine's drift
# (10-30 % between runs here) falls on every variant alike.
#
# A variant is NAME=PGOPTIONS (session settings of pgbench's connections, e.g.
# "lift_off=-c remus.enable_constant_lifting=off"), or NAME=@/path/to/pg_remus.so: the cluster is
# stopped, that build of the extension copied in and the cluster started before the variant runs
# (an A/B of two builds; the installed .so is put back at the end). A settings variant runs on
# the build of the last build variant before it (the installed one if none). Workloads: stock pgbench
# scripts, `pgbench -n --max-tries=1 -T SECS -c CLIENTS -j 2`:
#   sel (-S), selprep (-S -M prepared), tpcb (-b tpcb-like), tpcbprep (-b tpcb-like -M prepared)
# Prints a markdown table of tps per variant (median of the rounds, and each round's).
#
# After a swap of builds, WARM seconds (5) of select-only warm the restarted cluster's buffers.
# Each round starts one variant later than the one before (b a, then a b, …), so that no variant
# always runs first or right after another: the position in a round moved tps by 5-8 % here. Not
# when build and settings variants are mixed (a settings variant runs on the build before it).
# Environment: VARIANTS (required, space-separated NAME=VALUE; quote values with spaces as one
# word: "on= off=-c%20remus.enable_constant_lifting=off" takes %20 for a space), WORKLOADS
# ("sel tpcb"), ROUNDS (3), SECS (20), CLIENTS (8), SCALE / SHARDS (toolkit: 20, 8), WORK
# (default /var/tmp/remus-remote-ab), PORT_BASE (30500), ANCHOR_DIR, REUSE (1: keep a cluster
# already set up in WORK), CLUSTER (r3, or r1).
# Usage: VARIANTS="on= off=-c%20remus.enable_constant_lifting=off" bash bench/remote_ab.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ANCHOR_DIR=${ANCHOR_DIR:-$ROOT/../shared/anchors/citus}
[ -f "$ANCHOR_DIR/lib.sh" ] || { echo "remote_ab.sh: no anchor toolkit at $ANCHOR_DIR" >&2; exit 2; }
ANCHOR_DIR=$(cd "$ANCHOR_DIR" && pwd)
: "${VARIANTS:?set VARIANTS, e.g. \"on= off=-c%20remus.enable_constant_lifting=off\"}"
WORKLOADS=${WORKLOADS:-sel tpcb}; ROUNDS=${ROUNDS:-3}; SECS=${SECS:-20}; CLIENTS=${CLIENTS:-8}
REUSE=${REUSE:-1}
CLUSTER=${CLUSTER:-r3}
case $CLUSTER in r3) SETUP=remus;; r1) SETUP=remus1;; *) echo "remote_ab.sh: CLUSTER is r3 or r1" >&2; exit 2;; esac
ENTRY=${CLUSTER}n1
export WORK=${WORK:-/var/tmp/remus-remote-ab} PORT_BASE=${PORT_BASE:-30500} REMUS_REPO=$ROOT
# shellcheck source=/dev/null
source "$ANCHOR_DIR/lib.sh"
D=$OUT/remote_ab
mkdir -p "$D"
SO=$(pg_config --pkglibdir)/pg_remus.so
cp "$SO" "$D/installed.so"
restore() { remus_stop "$CLUSTER"; cp "$D/installed.so" "$SO"; }
trap restore EXIT

if [ "$REUSE" = 1 ] && [ -f "$(remus_dir "$CLUSTER")/cluster.json" ]; then
    log "reusing the cluster in $(remus_dir "$CLUSTER")"
    remus_start "$CLUSTER"
else
    log "setting up the cluster (toolkit setup.sh $SETUP)"
    "$ANCHOR_DIR/setup.sh" "$SETUP" > "$D/setup.log" 2>&1 || die "setup failed, see $D/setup.log"
fi
current_so=installed
: > "$D/results.txt"
read -r -a variants <<< "$VARIANTS"
settings_variants=0
for v in "${variants[@]}"; do [ "${v#*=@}" != "$v" ] || settings_variants=$((settings_variants + 1)); done
# rotation only when all variants are builds or all are settings
if [ "$settings_variants" = 0 ] || [ "$settings_variants" = "${#variants[@]}" ]; then rotate=1; else rotate=0; fi
n=${#variants[@]}
for round in $(seq 1 "$ROUNDS"); do
    start=$(( rotate ? (round - 1) % n : 0 ))
    order=("${variants[@]:start}" "${variants[@]:0:start}")
    for v in "${order[@]}"; do
        name=${v%%=*}; value=${v#*=}; opts=""
        if [ "${value#@}" != "$value" ]; then
            if [ "$current_so" != "$name" ]; then
                remus_stop "$CLUSTER"
                cp "${value#@}" "$SO"
                remus_start "$CLUSTER"
                current_so=$name
                # A restarted cluster starts with cold buffers: warm them as the setup did.
                PGPASSFILE=$(passfile_of "$ENTRY") timeout 120 pgbench -h 127.0.0.1 \
                    -p "$(port_of "$ENTRY")" -n -S -T "${WARM:-5}" -c "$CLIENTS" -j 2 > /dev/null 2>&1 || true
            fi
        else
            opts=${value//%20/ }
        fi
        for w in $WORKLOADS; do
            case $w in
                sel) args=(-S);; selprep) args=(-S -M prepared);;
                tpcb) args=(-b tpcb-like);; tpcbprep) args=(-b tpcb-like -M prepared);;
                *) die "unknown workload $w";;
            esac
            o=$D/r$round-$name-$w.out
            PGOPTIONS=$opts PGPASSFILE=$(passfile_of "$ENTRY") timeout $((SECS + 120)) \
                pgbench -h 127.0.0.1 -p "$(port_of "$ENTRY")" -n --max-tries=1 -T "$SECS" \
                -c "$CLIENTS" -j 2 "${args[@]}" > "$o" 2>&1 || true
            tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' "$o" | head -n1)
            log "round $round $name $w: ${tps:-failed} tps"
            echo "$round $name $w ${tps:-0}" >> "$D/results.txt"
        done
    done
done
python3 - "$D/results.txt" "$VARIANTS" "$WORKLOADS" <<'EOF' | tee "$D/table.md"
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    _, name, w, tps = line.split()
    runs[(name, w)].append(float(tps))
names = [v.split("=", 1)[0] for v in sys.argv[2].split()]
workloads = sys.argv[3].split()
print("| variant | " + " | ".join(workloads) + " |")
print("|---|" + "---:|" * len(workloads))
for n in names:
    cells = []
    for w in workloads:
        r = runs[(n, w)]
        cells.append("%.0f (%s)" % (statistics.median(r), " / ".join("%.0f" % x for x in r)) if r else "-")
    print("| %s | %s |" % (n, " | ".join(cells)))
base = names[0]
for n in names[1:]:
    print("\n%s / %s: " % (n, base) + ", ".join(
        "%s %.2f" % (w, statistics.median(runs[(n, w)]) / statistics.median(runs[(base, w)]))
        for w in workloads if runs[(n, w)] and runs[(base, w)] and statistics.median(runs[(base, w)]) > 0))
EOF
