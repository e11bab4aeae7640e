-- The handover primitives' refusals, each with its SQLSTATE: bad calls, non-superusers, DDL on
-- a registered migration's tables, writes to a fenced shard, a gate held by another migration.
CREATE TABLE ho_t (id int PRIMARY KEY, v int);
SELECT remus_create_distributed_table('ho_t', 'id', shard_count => 3);
SELECT s.shard_id AS s1 FROM remus_shards s WHERE s.table_name = 'ho_t' AND s.node_name = 'n1' \gset
-- Bad calls.
SELECT remus.migration_fence(424242);
\echo :LAST_ERROR_SQLSTATE
SELECT remus.migration_begin(0, ARRAY[1]::bigint[]);
\echo :LAST_ERROR_SQLSTATE
SELECT remus.migration_end(424242) AS unknown_migration_aborts;
SELECT remus.migration_aborts(424242) AS unknown_migration_aborts;
-- Superuser only.
CREATE ROLE ho_nobody;
GRANT USAGE ON SCHEMA remus TO ho_nobody;
SET ROLE ho_nobody;
SELECT remus.migration_begin(77, ARRAY[1]::bigint[]);
\echo :LAST_ERROR_SQLSTATE
SELECT remus.close_gate(77, 1000);
\echo :LAST_ERROR_SQLSTATE
SELECT remus.albatross_suspend(77, ARRAY[1]::bigint[], 1000);
\echo :LAST_ERROR_SQLSTATE
SET remus.migration_session = on;
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
REVOKE USAGE ON SCHEMA remus FROM ho_nobody;
DROP ROLE ho_nobody;
-- DDL while registered: the distributed table and the shard table.
SELECT remus.migration_begin(77, ARRAY[:s1]::bigint[]);
SELECT remus.migration_begin(77, ARRAY[:s1]::bigint[]) AS idempotent;
SELECT remus.migration_begin(78, ARRAY[:s1]::bigint[]);
\echo :LAST_ERROR_SQLSTATE
ALTER TABLE ho_t ADD COLUMN z int;
\echo :LAST_ERROR_SQLSTATE
TRUNCATE ho_t;
\echo :LAST_ERROR_SQLSTATE
SELECT format('remus_shards.ho_t_%s', :s1) AS shard_table \gset
CREATE INDEX ON :shard_table (v);
\echo :LAST_ERROR_SQLSTATE
ALTER TABLE :shard_table RENAME TO ho_renamed;
\echo :LAST_ERROR_SQLSTATE
DROP TABLE :shard_table;
\echo :LAST_ERROR_SQLSTATE
-- Fenced: writes fail with 40001 and are counted; reads go on.
SELECT remus.migration_fence(77);
SELECT id FROM generate_series(1, 100) id WHERE remus_shard_id_for('ho_t', id) = :s1 ORDER BY id LIMIT 1 \gset k_
INSERT INTO ho_t VALUES (:k_id, 1);
\echo :LAST_ERROR_SQLSTATE
UPDATE ho_t SET v = 2 WHERE id = :k_id;
\echo :LAST_ERROR_SQLSTATE
SELECT count(*) AS rows_readable FROM ho_t;
SELECT remus.migration_aborts(77) AS aborts;
-- The gate belongs to one migration at a time (closed from a migration session, as the
-- driver does: any other session would wait at its own gate).
SET remus.migration_session = on;
SELECT remus.close_gate(77, 60000) IS NOT NULL AS closed;
SELECT remus.close_gate(78, 60000);
\echo :LAST_ERROR_SQLSTATE
SELECT remus.open_gate(78);
SELECT remus.open_gate(77);
RESET remus.migration_session;
-- A gate past its timeout lets statements through with a WARNING and reopens.
SET remus.migration_session = on;
SELECT remus.close_gate(79, 0) IS NOT NULL AS closed;
RESET remus.migration_session;
SELECT 1 AS passes_after_timeout;
SELECT 1 AS passes_without_warning;
SELECT remus.migration_end(77) AS aborts_at_end;
SELECT remus.migration_end(77) AS aborts_after_end;
-- After the end, writes and DDL are allowed again.
INSERT INTO ho_t VALUES (:k_id, 1);
CREATE INDEX ho_v ON :shard_table (v);
DROP INDEX remus_shards.ho_v;
SELECT count(*) AS rows_after FROM ho_t;
-- albatross (decision 0024): a suspension holds at most 128 shards; one past its timeout lets a
-- statement on its shard through with a WARNING and lifts; nobody waits at it afterwards.
SELECT remus.albatross_suspend(80, array(SELECT generate_series(1, 200))::bigint[], 1000);
\echo :LAST_ERROR_SQLSTATE
SELECT remus.albatross_suspend(80, ARRAY[:s1]::bigint[], 0) IS NOT NULL AS suspended;
SELECT v AS passes_after_timeout FROM ho_t WHERE id = :k_id;
SELECT v AS passes_without_warning FROM ho_t WHERE id = :k_id;
SELECT remus.albatross_waiting(80) AS waiting;
SELECT remus.albatross_resume(80);
