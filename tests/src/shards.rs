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
