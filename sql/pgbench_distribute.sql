-- Distributes the tables of `pgbench -i` the way the routing issue asks: accounts by aid,
-- branches by bid, tellers by tid, and history by aid, co-located with accounts, after giving
-- it a primary key that contains aid. Used by the demo, the benchmark and the tests.
ALTER TABLE pgbench_history ADD COLUMN hid uuid NOT NULL DEFAULT gen_random_uuid();
ALTER TABLE pgbench_history ADD PRIMARY KEY (aid, hid);
SELECT remus_create_distributed_table('pgbench_accounts', 'aid');
SELECT remus_create_distributed_table('pgbench_branches', 'bid');
SELECT remus_create_distributed_table('pgbench_tellers', 'tid');
SELECT remus_create_distributed_table('pgbench_history', 'aid', colocate_with => 'pgbench_accounts');
