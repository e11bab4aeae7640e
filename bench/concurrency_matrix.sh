#!/usr/bin/env bash
# The full concurrency matrix of issue 15 (requirement 2): pairs of migrations at once (from one
# source, into one target, crossing) in every mode (remus, lock_abort, wait_remaster), each
# with pgbench TPC-B on every node at READ COMMITTED, REPEATABLE READ and SERIALIZABLE:
# 27 cases on three clusters, about half an hour on the project machine. After each case every
# balance equals its history row by row, there is one history row per committed transaction,
# no pgbench client hit an error it does not retry, and nothing of the migrations is left.
#
# It is the #[ignore]d test full_concurrency_matrix of tests/tests/migration_concurrency.rs;
# the CI tier runs the compact matrix of the same file. Needs the extension installed and the
# binaries built (scripts/setup.sh). Usage: bash bench/concurrency_matrix.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
exec cargo test --release -p integration --test migration_concurrency -- \
    --ignored full_concurrency_matrix --test-threads=1 --nocapture
