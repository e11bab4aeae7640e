//! Distributed-table DDL on a real 3-node cluster: conversion of a filled table from any node,
//! the shard map on every node, shard-key hashing, and bad input.

use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

#[test]
fn distribute_a_filled_table_from_a_non_first_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, owner text NOT NULL, balance numeric DEFAULT 0,
                                note text, CHECK (balance >= 0));
         CREATE INDEX accounts_owner ON accounts (owner);
         INSERT INTO accounts SELECT g, 'o' || g, g % 100, CASE WHEN g % 7 = 0 THEN NULL ELSE E'tab\\there' END
           FROM generate_series(1, 5000) g;",
    )
    .unwrap();
    let before: (i64, String) = {
        let r = n2
            .query_one(
                "SELECT count(*), md5(string_agg(a::text, '|' ORDER BY id)) FROM accounts a",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    // From a fresh session that never read the table, as a user would.
    let mut fresh = c.connect("n2").unwrap();
    fresh
        .batch_execute("SELECT remus_create_distributed_table('accounts', 'id', 6)")
        .unwrap();
    // Reads through the router see every row, from every node.
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let r = db
            .query_one(
                "SELECT count(*), md5(string_agg(a::text, '|' ORDER BY id)) FROM accounts a",
                &[],
            )
            .unwrap();
        assert_eq!(
            (r.get::<_, i64>(0), r.get::<_, String>(1)),
            before,
            "rows seen through {name}"
        );
    }

    // Same shard map on every node; shards spread round robin over the three nodes.
    let mut maps = Vec::new();
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let rows = db
            .query("SELECT shard_id, table_name, shard_key, hash_min, hash_max, node_name FROM remus_shards", &[])
            .unwrap();
        let map: Vec<(i64, String, String, i32, i32, String)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
            .collect();
        assert_eq!(map.len(), 6, "{name}");
        maps.push(map);
    }
    assert!(
        maps.windows(2).all(|w| w[0] == w[1]),
        "shard maps differ between nodes"
    );
    let owners: Vec<&str> = maps[0].iter().map(|m| m.5.as_str()).collect();
    assert_eq!(owners, ["n1", "n2", "n3", "n1", "n2", "n3"]);
    assert_eq!(maps[0][0].3, i32::MIN);
    assert_eq!(maps[0][5].4, i32::MAX);

    // Every row moved into the shard its key hashes to, on the shard's owner; nothing is lost,
    // nothing changed; shells are empty everywhere.
    let mut total = 0i64;
    let mut all_rows: Vec<String> = Vec::new();
    for (shard_id, _, _, lo, hi, owner) in &maps[0] {
        let mut db = c.connect(owner).unwrap();
        let t = format!("remus_shards.accounts_{shard_id}");
        let misplaced: i64 = db
            .query_one(
                &format!(
                    "SELECT count(*) FROM {t} WHERE remus.key_hash(id) NOT BETWEEN {lo} AND {hi}"
                ),
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(misplaced, 0);
        let n: i64 = db
            .query_one(&format!("SELECT count(*) FROM {t}"), &[])
            .unwrap()
            .get(0);
        total += n;
        for r in db
            .query(&format!("SELECT a::text FROM {t} a"), &[])
            .unwrap()
        {
            all_rows.push(r.get(0));
        }
        // Constraints and indexes came along.
        let idx: i64 = db
            .query_one(&format!("SELECT count(*) FROM pg_indexes WHERE schemaname = 'remus_shards' AND tablename = 'accounts_{shard_id}'"), &[])
            .unwrap()
            .get(0);
        assert_eq!(idx, 2, "pkey and owner index on shard {shard_id}");
        let e = db
            .batch_execute(&format!("INSERT INTO {t} VALUES (-1, 'x', -5)"))
            .unwrap_err();
        assert_eq!(sqlstate(&e), "23514");
    }
    assert_eq!(total, before.0);
    all_rows.sort_by_key(|r| {
        r.trim_start_matches('(')
            .split(',')
            .next()
            .unwrap()
            .parse::<i64>()
            .unwrap()
    });
    let mut n1 = c.connect("n1").unwrap();
    let md5: String = n1
        .query_one("SELECT md5($1)", &[&all_rows.join("|")])
        .unwrap()
        .get(0);
    assert_eq!(md5, before.1, "rows changed while moving");
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        // The shell's own heap is empty (reads of the shell go to the shards).
        let n: i64 = db
            .query_one("SELECT pg_relation_size('accounts')", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, 0, "shell on {name} is not empty");
    }
    assert_eq!(total, 5000);

    // remus_shard_id_for agrees with where the row is, from any node, for int4 input too.
    let sid: i64 = n1
        .query_one("SELECT remus_shard_id_for('accounts', 4242::bigint)", &[])
        .unwrap()
        .get(0);
    let sid4: i64 = n1
        .query_one("SELECT remus_shard_id_for('accounts', 4242)", &[])
        .unwrap()
        .get(0);
    assert_eq!(sid, sid4);
    let owner = &maps[0].iter().find(|m| m.0 == sid).unwrap().5;
    let mut o = c.connect(owner).unwrap();
    let n: i64 = o
        .query_one(
            &format!("SELECT count(*) FROM remus_shards.accounts_{sid} WHERE id = 4242"),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 1);

    // Shard sizes are reported for every shard, remote ones included.
    let nulls: i64 = n1
        .query_one(
            "SELECT count(*) FROM remus_shards WHERE size_bytes IS NULL OR size_bytes <= 0",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(nulls, 0);
    assert_eq!(
        n1.query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
            .unwrap()
            .get::<_, i64>(0),
        0
    );

    // Co-location: same ranges, same owners.
    n1.batch_execute(
        "CREATE TABLE history (id bigint, hid uuid DEFAULT gen_random_uuid(), delta int, PRIMARY KEY (id, hid));
         SELECT remus_create_distributed_table('history', 'id', 6, colocate_with => 'accounts');",
    )
    .unwrap();
    let pairs: i64 = n1
        .query_one(
            "SELECT count(*) FROM remus_shards a JOIN remus_shards h USING (hash_min, hash_max, node_name, colocation_id)
              WHERE a.table_name = 'accounts' AND h.table_name = 'history'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(pairs, 6);

    // A join of co-located tables on one key value runs as one statement on that shard group.
    n1.batch_execute("INSERT INTO history (id, delta) VALUES (4242, 7), (4242, 8), (17, 1)")
        .unwrap();
    let plan: Vec<String> = n1
        .query("EXPLAIN (COSTS OFF) SELECT a.owner, h.delta FROM accounts a JOIN history h ON a.id = h.id WHERE a.id = 4242", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        plan,
        vec!["Custom Scan (RemusRouter)".to_string()],
        "{plan:?}"
    );
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let rows: Vec<(String, i32)> = db
            .query("SELECT a.owner, h.delta FROM accounts a JOIN history h USING (id) WHERE id = $1 ORDER BY h.delta", &[&4242i64])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(
            rows,
            vec![("o4242".to_string(), 7), ("o4242".to_string(), 8)],
            "through {name}"
        );
    }
}

#[test]
fn bad_distribution_requests_are_refused_cleanly() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text);
         CREATE TABLE nopk (id int, v text);
         CREATE TABLE wrongpk (id int, k int, PRIMARY KEY (id));
         CREATE TABLE ser (id serial PRIMARY KEY);",
    )
    .unwrap();
    let cases = [
        (
            "SELECT remus_create_distributed_table('t', 'nosuch')",
            "42703",
            "column \"nosuch\"",
        ),
        (
            "SELECT remus_create_distributed_table('nopk', 'id')",
            "42P16",
            "has no primary key",
        ),
        (
            "SELECT remus_create_distributed_table('wrongpk', 'k')",
            "42P16",
            "does not contain the shard key",
        ),
        (
            "SELECT remus_create_distributed_table('t', 'id', 0)",
            "22023",
            "shard_count",
        ),
        (
            "SELECT remus_create_distributed_table('ser', 'id')",
            "0A000",
            "serial",
        ),
        (
            "SELECT remus_create_distributed_table('nosuchtable', 'id')",
            "42P01",
            "nosuchtable",
        ),
    ];
    for (sql, state, text) in cases {
        let e = n1.batch_execute(sql).unwrap_err();
        assert_eq!(sqlstate(&e), state, "{sql}: {e:?}");
        let msg = e
            .as_db_error()
            .map(|d| d.message().to_string())
            .unwrap_or_default();
        assert!(msg.contains(text), "{sql}: {msg}");
    }
    n1.batch_execute("SELECT remus_create_distributed_table('t', 'id', 4)")
        .unwrap();
    let e = n1
        .batch_execute("SELECT remus_create_distributed_table('t', 'id', 4)")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42710");
    // A failed conversion leaves nothing behind on any node.
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let n: i64 = db
            .query_one("SELECT count(*) FROM remus.distributed_tables", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, 1, "{name}");
        let prepared: i64 = db
            .query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
            .unwrap()
            .get(0);
        assert_eq!(prepared, 0);
    }
    // Statement forms the router does not run are refused rather than run on the empty shell.
    // (INSERT … SELECT within one shard group is run: router_shard_group.)
    let e = n1
        .batch_execute("INSERT INTO t SELECT id + 100, 'x' FROM t")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "0A000");
}
