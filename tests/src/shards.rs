//! Where the shards of a distributed table are, as the tests read it.

use remus_test_support::cluster::TestCluster;

/// `(shard_id, owner)` of every shard of `table`, by shard id, as `db` sees it.
pub fn shards_of(db: &mut postgres::Client, table: &str) -> Vec<(i64, String)> {
    db.query(
        "SELECT shard_id, node_name FROM remus_shards WHERE table_name = $1 ORDER BY shard_id",
        &[&table],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// [`shards_of`] `table` as node n1 sees it.
pub fn owners(c: &TestCluster, table: &str) -> Vec<(i64, String)> {
    shards_of(&mut c.connect("n1").unwrap(), table)
}

/// The four tables of `pgbench -i`, distributed as `sql/pgbench_distribute.sql` does.
pub const TPCB_TABLES: [&str; 4] = [
    "pgbench_accounts",
    "pgbench_branches",
    "pgbench_tellers",
    "pgbench_history",
];

/// Panics unless `node` owns no shard of any of `tables` (as n1 sees the map): a consolidated
/// node.
pub fn assert_owns_no_shard(c: &TestCluster, node: &str, tables: &[&str]) {
    for table in tables {
        assert!(
            owners(c, table).iter().all(|(_, o)| o != node),
            "{node} still owns a shard of {table}"
        );
    }
}

/// The one value `sql` (with `params`) returns on each node, in node order.
pub fn value_on_every_node<T: postgres::types::FromSqlOwned>(
    c: &TestCluster,
    sql: &str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> Vec<T> {
    c.node_names()
        .iter()
        .map(|n| c.connect(n).unwrap().query_one(sql, params).unwrap().get(0))
        .collect()
}

/// The owner of `shard` as each node's catalog has it, by node name.
pub fn owners_everywhere(c: &TestCluster, shard: i64) -> Vec<String> {
    c.node_names()
        .iter()
        .map(|n| {
            c.connect(n)
                .unwrap()
                .query_one(
                    "SELECT node_name FROM remus_shards WHERE shard_id = $1",
                    &[&shard],
                )
                .unwrap()
                .get(0)
        })
        .collect()
}

/// Moves every shard `from` owns to `to`: one migration per table of `anchors`, each moving the
/// shards of that table `from` owns and every shard co-located with them. Checks that each
/// anchor had shards on `from` and that `from` owns no shard after.
pub fn move_every_shard(c: &TestCluster, from: &str, to: &str, anchors: &[&str]) {
    let mut db = c.connect(to).unwrap();
    for table in anchors {
        let shards: Vec<i64> = shards_of(&mut db, table)
            .into_iter()
            .filter(|(_, owner)| owner == from)
            .map(|(shard, _)| shard)
            .collect();
        assert!(
            !shards.is_empty(),
            "{from} owns shards of {table} before the move"
        );
        let status: String = db
            .query_one(
                "SELECT status FROM remus_migrate_shards($1, $2)",
                &[&shards, &to],
            )
            .unwrap()
            .get(0);
        assert_eq!(
            status, "succeeded",
            "moving {from}'s shards of {table} to {to}"
        );
    }
    let left: i64 = c
        .connect(from)
        .unwrap()
        .query_one(
            "SELECT count(*) FROM remus_shards WHERE node_name = $1",
            &[&from],
        )
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "{from} owns no shard after the moves");
}

/// Moves `shard` to node `to` in the default mode, through `db`, and checks that it succeeded.
pub fn move_shard(db: &mut postgres::Client, shard: i64, to: &str) {
    let status: String = db
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, $2)",
            &[&shard, &to],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded", "the move of shard {shard} to {to}");
}
