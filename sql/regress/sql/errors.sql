-- Bad input and unsupported forms: the message and SQLSTATE users see.
\set VERBOSITY default
\set SHOW_CONTEXT never
CREATE TABLE reg_t (id int PRIMARY KEY, v text);
CREATE TABLE reg_nopk (id int, v text);
CREATE TABLE reg_wrongpk (id int PRIMARY KEY, k int);
SELECT remus_create_distributed_table('reg_t', 'nosuch');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('reg_nopk', 'id');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('reg_wrongpk', 'k');
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('reg_t', 'id', 0);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_create_distributed_table('reg_t', 'id', 4);
SELECT remus_create_distributed_table('reg_t', 'id', 4);
\echo :LAST_ERROR_SQLSTATE
SELECT table_name, shard_key, hash_min, hash_max FROM remus_shards WHERE table_name = 'reg_t';
INSERT INTO reg_t VALUES (1, 'a'), (2, 'b'), (3, 'c') RETURNING *;
UPDATE reg_t SET id = 5 WHERE id = 1;
\echo :LAST_ERROR_SQLSTATE
INSERT INTO reg_t SELECT id + 100, v FROM reg_t;
\echo :LAST_ERROR_SQLSTATE
INSERT INTO reg_t (v) VALUES ('no key');
\echo :LAST_ERROR_SQLSTATE
SELECT * FROM reg_t WHERE id IN (1, 2) FOR UPDATE;
\echo :LAST_ERROR_SQLSTATE
WITH x AS (SELECT id FROM reg_t) UPDATE reg_t SET v = 'w' WHERE id = 1 AND id IN (SELECT id FROM x);
\echo :LAST_ERROR_SQLSTATE
UPDATE reg_t SET v = 'q' FROM reg_nopk WHERE reg_t.id = reg_nopk.id;
\echo :LAST_ERROR_SQLSTATE
ALTER TABLE reg_t ALTER COLUMN id TYPE bigint;
\echo :LAST_ERROR_SQLSTATE
ALTER TABLE reg_t SET UNLOGGED;
\echo :LAST_ERROR_SQLSTATE
COPY reg_t TO STDOUT;
\echo :LAST_ERROR_SQLSTATE
SELECT remus_add_node('Bad-Name', '127.0.0.1', 1);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_add_node('x1', '127.0.0.1', 70000);
\echo :LAST_ERROR_SQLSTATE
SELECT remus_remove_node('nosuch');
\echo :LAST_ERROR_SQLSTATE
SELECT count(*), sum(id) FROM reg_t;
TRUNCATE reg_t;
SELECT count(*) FROM reg_t;
