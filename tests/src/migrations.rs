//! Waiting for a migration, as the tests that drive one past a fault do.

use std::time::Duration;

use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_for;

/// Waits (at most `limit`) until migration `id` has ended, reading `remus_migrations` through
/// node `via`; its status and error. Fails the test with the daemons' logs otherwise.
pub fn wait_ended(
    c: &TestCluster,
    via: &str,
    id: i64,
    limit: Duration,
) -> (String, Option<String>) {
    let mut db = c.connect(via).unwrap();
    wait_for(
        limit,
        Duration::from_millis(50),
        || {
            let row = db
                .query_one(
                    "SELECT status, error FROM remus_migrations WHERE migration_id = $1",
                    &[&id],
                )
                .ok()?;
            let status: String = row.get(0);
            (status != "running").then(|| (status, row.get(1)))
        },
        || format!("migration {id} did not end\n{}", c.daemon_logs(40)),
    )
}

/// The running `remus_migrate_shard` call of [`start_paused`]: its status, or its error.
pub type MigrationCall = std::thread::JoinHandle<Result<String, postgres::Error>>;

/// Arms failpoint `failpoint` (pause), calls `remus_migrate_shard(shard, target)` through node
/// `via` in a thread, and waits until the migration is paused there: its id and the call.
pub fn start_paused(
    c: &TestCluster,
    via: &str,
    shard: i64,
    target: &str,
    failpoint: &str,
) -> (i64, MigrationCall) {
    c.arm_pause(failpoint).unwrap();
    let mut db = c.connect(via).unwrap();
    let target = target.to_string();
    let call = std::thread::spawn(move || {
        db.query_one(
            "SELECT status FROM remus_migrate_shard($1, $2)",
            &[&shard, &target],
        )
        .map(|r| r.get::<_, String>(0))
    });
    let id = c
        .wait_paused_at(failpoint, Duration::from_secs(60))
        .unwrap();
    (id, call)
}

/// A 3-node cluster with the TPC-B tables (scale 1), and one of the account shards that node
/// `owner` holds.
pub fn tpcb_cluster_with_shard_on(owner: &str) -> (TestCluster, i64) {
    let c = TestCluster::start(3).expect("cluster up");
    crate::pgbench::init_tpcb(&c, 1);
    let shard = crate::shards::owners(&c, "pgbench_accounts")
        .into_iter()
        .find(|(_, o)| o == owner)
        .map(|(s, _)| s)
        .unwrap_or_else(|| panic!("{owner} holds no account shard"));
    (c, shard)
}

/// The `aborted_by_migration` of migration `id`.
pub fn aborted_by(c: &TestCluster, id: i64) -> i64 {
    c.connect("n1")
        .unwrap()
        .query_one(
            "SELECT aborted_by_migration FROM remus_migrations WHERE migration_id = $1",
            &[&id],
        )
        .unwrap()
        .get(0)
}
