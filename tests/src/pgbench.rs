//! Running real pgbench against cluster nodes.

use std::process::{Child, Stdio};

use remus_test_support::cluster::TestCluster;

/// The TPC-B tables of `pgbench -i -s <scale>`, distributed the way the routing issue asks:
/// accounts by aid, branches by bid, tellers by tid, history by aid co-located with accounts
/// (after giving it a primary key that contains aid).
pub fn init_tpcb(c: &TestCluster, scale: u32) {
    let out = c
        .pgbench("n1", &["-i", "-s", &scale.to_string(), "-q"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(include_str!("../../sql/pgbench_distribute.sql"))
        .unwrap();
}

/// The default TPC-B script against one node, no retries.
pub fn start_tpcb(c: &TestCluster, node: &str, clients: u32, seconds: u32) -> Child {
    c.pgbench(
        node,
        &[
            "-n",
            "-c",
            &clients.to_string(),
            "-j",
            "2",
            "-T",
            &seconds.to_string(),
            "--max-tries=1",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

/// Waits until the TPC-B load has committed at least `transactions` (rows of `pgbench_history`,
/// read through `node`): a migration started right after `start_tpcb` can otherwise find the
/// stream still empty, because pgbench connects and prepares before its first commit.
pub fn wait_committing(c: &TestCluster, node: &str, transactions: i64) {
    let mut db = c.connect(node).unwrap();
    remus_test_support::wait_until(
        std::time::Duration::from_secs(120),
        std::time::Duration::from_millis(100),
        || {
            db.query_one("SELECT count(*) FROM pgbench_history", &[])
                .map(|r| r.get::<_, i64>(0) >= transactions)
                .unwrap_or(false)
        },
        || format!("pgbench on {node} committed fewer than {transactions} transactions"),
    );
}

pub struct PgbenchResult {
    pub processed: u64,
    pub failed: u64,
    pub aborted_clients: usize,
    pub output: String,
}

pub fn finish(child: Child) -> PgbenchResult {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let field = |prefix: &str| -> u64 {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    PgbenchResult {
        processed: field("number of transactions actually processed: "),
        failed: field("number of failed transactions: "),
        aborted_clients: stderr.lines().filter(|l| l.contains("aborted")).count(),
        output: format!("{stdout}\n{stderr}"),
    }
}

/// (sum abalance, sum bbalance, sum tbalance, sum delta), read through the router.
pub fn balances(c: &TestCluster, node: &str) -> (i64, i64, i64, i64) {
    let mut db = c.connect(node).unwrap();
    let r = db
        .query_one(
            "SELECT (SELECT sum(abalance) FROM pgbench_accounts)::bigint,
                    (SELECT sum(bbalance) FROM pgbench_branches)::bigint,
                    (SELECT sum(tbalance) FROM pgbench_tellers)::bigint,
                    (SELECT coalesce(sum(delta), 0) FROM pgbench_history)::bigint",
            &[],
        )
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

pub fn prepared_everywhere(c: &TestCluster) -> i64 {
    c.node_names()
        .iter()
        .map(|n| {
            c.connect(n)
                .unwrap()
                .query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
                .unwrap()
                .get::<_, i64>(0)
        })
        .sum()
}
