-- Wrong calls of the SQL API that errors.sql and migrate_errors.sql leave out: unknown,
-- duplicate, out-of-range, wrong state, wrong node, inside a transaction block, and every
-- administration function called by a plain role. Each is refused with its SQLSTATE, and after
-- each group api_state() shows that nothing changed: nodes (here and on n2), distributed
-- tables, every shard's owner, migrations recorded.
\set VERBOSITY default
\set SHOW_CONTEXT never
CREATE TABLE api_t (id int PRIMARY KEY, v text);
SELECT remus_create_distributed_table('api_t', 'id', shard_count => 2);
CREATE TABLE api_ref (id int PRIMARY KEY);
SELECT remus_create_reference_table('api_ref');
CREATE TABLE api_plain (id int PRIMARY KEY, v text);
CREATE FUNCTION api_state() RETURNS text LANGUAGE sql AS $$
    SELECT format('nodes %s; nodes on n2 %s; tables %s; owners %s; migrations %s',
        (SELECT string_agg(name || '@' || port, ',' ORDER BY name) FROM remus_nodes),
        remus_run_on_node('n2', 'SELECT 1 FROM remus.nodes'),
        (SELECT string_agg(logicalrelid::text, ',' ORDER BY logicalrelid::text)
           FROM remus.distributed_tables),
        (SELECT string_agg(s.shard_id || '>' || coalesce(m.node_name, '*'), ',' ORDER BY s.shard_id)
           FROM remus.shards s LEFT JOIN remus.shard_map m USING (shard_id)),
        (SELECT count(*) FROM remus_migrations))
$$;
SELECT api_state() AS before \gset
-- Distributing: unknown table, duplicate, out of range, wrong kind.
SELECT remus_create_distributed_table('api_nosuch', 'id');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_reference_table('api_t');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('api_ref', 'id');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('api_plain', 'id', 5000);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('api_plain', 'id', 2, colocate_with => 'api_ref');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('api_plain', 'id', 4, colocate_with => 'api_t');
\echo :LAST_ERROR_SQLSTATE
CREATE UNLOGGED TABLE api_unlogged (id int PRIMARY KEY);
SELECT remus_create_reference_table('api_unlogged');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_shard_id_for('api_plain', 1);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_shard_id_for('api_ref', 1);
\echo :LAST_ERROR_SQLSTATE
-- Wrong node: a table of that name already exists on n2; nothing is left on any node.
SELECT remus_run_on_node('n2', 'CREATE TABLE api_clash (id int PRIMARY KEY)');
CREATE TABLE api_clash (id int PRIMARY KEY);
SELECT remus_create_distributed_table('api_clash', 'id');
\echo :LAST_ERROR_SQLSTATE
SELECT count(*) AS shards_of_clash FROM remus.shards WHERE logicalrelid = 'api_clash'::regclass;
SELECT remus_run_on_node('n3', 'SELECT 1 FROM pg_tables WHERE tablename = ''api_clash''') AS clash_on_n3;
SELECT remus_run_on_node('n2', 'DROP TABLE api_clash');
DROP TABLE api_clash;
SELECT api_state() = :'before' AS nothing_changed;
-- Nodes: duplicate, out of range, wrong state, wrong node, unknown node.
-- (The message names n2's address; its port depends on the cluster's base port.)
DO $$
BEGIN
    PERFORM remus_add_node('n2', '127.0.0.1', 1);
EXCEPTION WHEN OTHERS THEN
    RAISE NOTICE '% (SQLSTATE %)', regexp_replace(SQLERRM, ':[0-9]+$', ':<port>'), SQLSTATE;
END $$;
SELECT remus_add_node('api_x', '', 5432);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_add_node('api_x', '127.0.0.1', 0);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_remove_node('n2');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_run_on_node(remus_local_node(), 'SELECT 1');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_run_on_node('api_nosuch', 'SELECT 1');
\echo :LAST_ERROR_SQLSTATE
SELECT api_state() = :'before' AS nothing_changed;
-- Migrations: wrong kind of shard, shards of several nodes, a transaction block.
SELECT shard_id AS r1 FROM remus_shards WHERE table_name = 'api_ref' \gset
SELECT * FROM remus_migrate_shard(:r1, 'n2');
\echo :LAST_ERROR_SQLSTATE
SELECT array_agg(shard_id ORDER BY shard_id) AS both FROM remus_shards WHERE table_name = 'api_t' \gset
SELECT count(DISTINCT node_name) AS owners_of_api_t FROM remus_shards WHERE table_name = 'api_t';
SELECT * FROM remus_migrate_shards(:'both', 'n3');
\echo :LAST_ERROR_SQLSTATE
BEGIN;
SELECT * FROM remus_migrate_shards(:'both', 'n3');
\echo :LAST_ERROR_SQLSTATE
ROLLBACK;
SELECT api_state() = :'before' AS nothing_changed;
-- A plain role (no superuser), owning the table it tries to distribute.
CREATE ROLE api_user LOGIN;
ALTER TABLE api_plain OWNER TO api_user;
SELECT min(shard_id) AS s1 FROM remus_shards WHERE table_name = 'api_t' \gset
SELECT node_name = 'n3' AS s1_on_n3 FROM remus_shards WHERE shard_id = :s1 \gset
\if :s1_on_n3
\set away n2
\else
\set away n3
\endif
SET ROLE api_user;
SELECT remus_create_distributed_table('api_plain', 'id');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_reference_table('api_plain');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_add_node('api_x', '127.0.0.1', 5432);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_remove_node('n3');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_run_on_node('n2', 'SELECT 1');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shard(:s1, :'away');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM remus_migrate_shards(ARRAY[:s1]::bigint[], :'away', 'lock_abort');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
SELECT api_state() = :'before' AS nothing_changed;
DROP TABLE api_plain, api_unlogged;
DROP ROLE api_user;
