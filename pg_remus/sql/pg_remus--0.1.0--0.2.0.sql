-- pg_remus 0.1.0 -> 0.2.0, run by ALTER EXTENSION pg_remus UPDATE on a node that already
-- loads the 0.2.0 library (decision 0020, README "Upgrading").
--
-- The rule: every change to the SQL surface in the 0.2.0 development cycle (a function, view,
-- table, column, grant or comment added, changed or removed in pg_remus/src) adds its
-- statements here, in the order they must run, so that a 0.1.0 database updated by this file
-- ends up with exactly the catalog of a fresh CREATE EXTENSION pg_remus of 0.2.0. The
-- integration test upgrade_catalog fails with the difference when it does not.
--
-- Write it as the generated install script writes the same objects (pgrx's `cargo pgrx schema`
-- output for the function, `AS 'MODULE_PATHNAME', '<symbol>'` for a Rust function), and repeat
-- the grants of the install script's `finalize` block (pg_remus/src/api/privileges.rs) for what
-- it covers: a new function in schema remus gets REVOKE EXECUTE ... FROM PUBLIC, a new
-- administration function REVOKE from PUBLIC and GRANT to remus_admin.

\echo Use "ALTER EXTENSION pg_remus UPDATE" to load this file. \quit

-- Decision 0022: remus_migrations gains the migration's rates and lag (copy total and rate,
-- source WAL rate, replay rates, lag in bytes and milliseconds); remus.list_migrations returns
-- them, so the view that reads it is dropped and made again, with its grants. Decision 0024
-- adds unavailable_ms (how long the moved shards' new transactions waited in the handover).
DROP VIEW remus_migrations;
DROP FUNCTION remus.list_migrations();
CREATE  FUNCTION remus."list_migrations"() RETURNS TABLE (
	"migration_id" bigint,  /* i64 */
	"shard_ids" bigint[],  /* Vec < i64 > */
	"source" TEXT,  /* String */
	"target" TEXT,  /* String */
	"mode" TEXT,  /* String */
	"phase" TEXT,  /* String */
	"status" TEXT,  /* String */
	"rows_copied" bigint,  /* i64 */
	"bytes_copied" bigint,  /* i64 */
	"txns_replayed" bigint,  /* i64 */
	"aborted_by_migration" bigint,  /* i64 */
	"phase_ms" TEXT,  /* String */
	"started_at_ms" bigint,  /* i64 */
	"finished_at_ms" bigint,  /* Option < i64 > */
	"waiting_on" TEXT,  /* Option < String > */
	"error" TEXT,  /* Option < String > */
	"copy_total_bytes" bigint,  /* Option < i64 > */
	"copy_bytes_per_sec" bigint,  /* Option < i64 > */
	"source_wal_bytes_per_sec" bigint,  /* Option < i64 > */
	"replay_bytes_per_sec" bigint,  /* Option < i64 > */
	"replay_txns_per_sec" bigint,  /* Option < i64 > */
	"lag_bytes" bigint,  /* Option < i64 > */
	"lag_ms" bigint,  /* Option < i64 > */
	"unavailable_ms" bigint  /* Option < i64 > */
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'list_migrations_wrapper';
CREATE VIEW remus_migrations AS
    SELECT migration_id, shard_ids, source, target, mode, phase, status, rows_copied,
           bytes_copied, txns_replayed, aborted_by_migration, phase_ms::jsonb AS phase_ms,
           to_timestamp(started_at_ms / 1000.0) AS started_at,
           to_timestamp(finished_at_ms / 1000.0) AS finished_at, waiting_on, error,
           copy_total_bytes, copy_bytes_per_sec, source_wal_bytes_per_sec, replay_bytes_per_sec,
           replay_txns_per_sec, lag_bytes, lag_ms, unavailable_ms
      FROM remus.list_migrations();
COMMENT ON VIEW remus_migrations IS 'Shard migrations, running and finished, as the coordinator keeps them: live phase, status, counters, rates and lag, what a running one waits on, why a failed one failed';
REVOKE EXECUTE ON FUNCTION remus.list_migrations() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION remus.list_migrations() TO remus_admin;
GRANT SELECT ON remus_migrations TO remus_admin;

-- squall mode (decision 0025): the chunk catalog of the shards a migration pulls to this node.
CREATE TABLE remus.squall_chunks (
    migration_id bigint NOT NULL,
    shard_id     bigint NOT NULL,
    chunk        int    NOT NULL,
    hash_lo      int    NOT NULL,
    hash_hi      int    NOT NULL,
    pulled       bool   NOT NULL DEFAULT false,
    rows_pulled  bigint NOT NULL DEFAULT 0,
    bytes_pulled bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (migration_id, shard_id, chunk),
    CHECK (hash_lo <= hash_hi)
);
COMMENT ON TABLE remus.squall_chunks IS 'squall migrations: the chunks of each shard being pulled to this node, and whether each is pulled';

-- albatross mode (decision 0024): the per-shard suspension of a handover, on every node.
CREATE  FUNCTION remus."albatross_suspend"(
	"migration_id" bigint, /* i64 */
	"shard_ids" bigint[], /* Vec < i64 > */
	"timeout_ms" INT /* i32 */
) RETURNS timestamp with time zone /* TimestampWithTimeZone */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'albatross_suspend_wrapper';
CREATE  FUNCTION remus."albatross_resume"(
	"migration_id" bigint /* i64 */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'albatross_resume_wrapper';
CREATE  FUNCTION remus."albatross_waiting"(
	"migration_id" bigint /* i64 */
) RETURNS INT[] /* Vec < i32 > */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'albatross_waiting_wrapper';
REVOKE EXECUTE ON FUNCTION remus.albatross_suspend(bigint, bigint[], int) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION remus.albatross_resume(bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION remus.albatross_waiting(bigint) FROM PUBLIC;

-- A node added after tables were distributed becomes a full member (distribute/new_node.rs):
-- an administration function, as remus_add_node.
CREATE  FUNCTION "remus_activate_node"(
	"node_name" TEXT /* & str */
) RETURNS bool /* bool */
STRICT SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'remus_activate_node_wrapper';
REVOKE EXECUTE ON FUNCTION remus_activate_node(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION remus_activate_node(text) TO remus_admin;

-- The end of the sync barrier on the source (decision 0036): from it, a validation in dual
-- execution does not wait for the stream.
CREATE  FUNCTION remus."migration_barrier_applied"(
	"migration_id" bigint, /* i64 */
	"sync_point" bigint /* i64 */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'migration_barrier_applied_wrapper';
REVOKE EXECUTE ON FUNCTION remus.migration_barrier_applied(bigint, bigint) FROM PUBLIC;

-- Catch-up's batch apply in the server (decision 0035, third amendment): the replay worker's
-- apply sessions keep a plan per change shape (remus.apply_shape) and commit batches of shadow
-- transactions through remus.apply_batch; remus.apply_batch_done says how far a call got.
CREATE PROCEDURE remus.apply_batch(
    lsns bigint[], times_us bigint[], change_txn integer[], change_stmt text[],
    change_guarded boolean[], param_at integer[], params text[])
    LANGUAGE c AS 'MODULE_PATHNAME', 'remus_apply_batch';
COMMENT ON PROCEDURE remus.apply_batch(bigint[], bigint[], integer[], text[], boolean[], integer[], text[]) IS
    'Catch-up: commits a batch of shadow transactions, each with its source commit time and origin position (used by the replay worker; see migration/apply_batch.rs)';
REVOKE EXECUTE ON PROCEDURE remus.apply_batch(bigint[], bigint[], integer[], text[], boolean[], integer[], text[]) FROM PUBLIC;
CREATE  FUNCTION remus."apply_batch_done"() RETURNS bigint /* i64 */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'apply_batch_done_wrapper';
REVOKE EXECUTE ON FUNCTION remus.apply_batch_done() FROM PUBLIC;
CREATE  FUNCTION remus."apply_shape"(
	"name" TEXT, /* & str */
	"statement" TEXT /* & str */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'apply_shape_wrapper';
REVOKE EXECUTE ON FUNCTION remus.apply_shape(text, text) FROM PUBLIC;

-- The drain fence's question to a drain source (remus.rs, source_copy_is_free): is its copy of
-- the shard free of every older writer and row locker? Asked before the fence waits there.
CREATE  FUNCTION remus."drain_source_copy_is_free"(
	"rel_name" TEXT, /* & str */
	"shard_id" bigint /* i64 */
) RETURNS bool /* bool */
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'drain_source_copy_is_free_wrapper';
REVOKE EXECUTE ON FUNCTION remus.drain_source_copy_is_free(text, bigint) FROM PUBLIC;
