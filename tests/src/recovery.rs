//! Waiting for a cluster to come back from a node's crash.

use std::time::Duration;

use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

/// Waits until `node` accepts connections again after its crash and no node holds a prepared
/// transaction (the recovery worker has finished them).
pub fn wait_recovered(c: &TestCluster, node: &str) {
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(250),
        || {
            // Connections fail while a node is in crash recovery (it may still accept one just
            // before the postmaster noticed the crash): not recovered yet.
            c.connect(node).is_ok()
                && c.node_names().iter().all(|n| {
                    c.connect(n)
                        .ok()
                        .and_then(|mut db| {
                            db.query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
                                .ok()
                        })
                        .is_some_and(|r| r.get::<_, i64>(0) == 0)
                })
        },
        || format!("{node} did not recover\n{}", c.daemon_logs(40)),
    );
}
