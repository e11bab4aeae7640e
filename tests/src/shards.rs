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
