-- Bad input to the migration functions: each refused with its SQLSTATE, before anything
-- changes (no migration recorded, ownership unchanged).
CREATE TABLE mig_t (id int PRIMARY KEY, v text);
SELECT remus_create_distributed_table('mig_t', 'id', shard_count => 2);
SELECT min(shard_id) AS s1 FROM remus_shards WHERE table_name = 'mig_t' \gset
SELECT node_name AS o1 FROM remus_shards WHERE shard_id = :s1 \gset
SELECT * FROM remus_migrate_shard(999999, 'n2', 'lock_abort');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shard(:s1, 'nosuch', 'lock_abort');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shard(:s1, :'o1', 'wait_remaster');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shard(:s1, 'n3', 'bogus');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shard(:s1, :'o1');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shards(ARRAY[]::bigint[], 'n3', 'lock_abort');
\echo :LAST_ERROR_SQLSTATE
BEGIN;
SELECT * FROM remus_migrate_shard(:s1, 'n3', 'lock_abort');
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
SELECT count(*) AS migrations_recorded FROM remus_migrations;
SELECT node_name = :'o1' AS owner_unchanged FROM remus_shards WHERE shard_id = :s1;
