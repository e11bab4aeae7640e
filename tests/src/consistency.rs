//! TPC-B consistency, row by row, as the concurrency tests check it after a run.

use remus_test_support::cluster::TestCluster;

/// Rows of `table` (keyed by `key`) whose `balance` differs from the sum of their history
/// deltas, plus history keys with no row: 0 when no committed write was lost or doubled.
pub fn rows_off_their_history(
    db: &mut postgres::Client,
    table: &str,
    key: &str,
    balance: &str,
) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM (SELECT {key}, {balance} AS b FROM {table}) t
           FULL JOIN (SELECT {key}, sum(delta) AS d FROM pgbench_history GROUP BY {key}) h
           USING ({key})
          WHERE coalesce(t.b, 0) <> coalesce(h.d, 0) OR t.{key} IS NULL"
    );
    db.query_one(&sql, &[]).unwrap().get(0)
}

/// Every account, teller and branch balance equals its history deltas (read through `via`),
/// and there is one history row per committed pgbench transaction (`committed`, summed over
/// every pgbench run since `pgbench -i`). Panics with the numbers otherwise.
pub fn assert_tpcb_consistent(c: &TestCluster, via: &str, committed: u64, what: &str) {
    let mut db = c.connect(via).unwrap();
    let off: Vec<(&str, i64)> = [
        ("pgbench_accounts", "aid", "abalance"),
        ("pgbench_tellers", "tid", "tbalance"),
        ("pgbench_branches", "bid", "bbalance"),
    ]
    .into_iter()
    .map(|(t, k, b)| (t, rows_off_their_history(&mut db, t, k, b)))
    .collect();
    let history: i64 = db
        .query_one("SELECT count(*) FROM pgbench_history", &[])
        .unwrap()
        .get(0);
    assert!(
        off.iter().all(|(_, n)| *n == 0),
        "{what}: rows whose balance differs from their history deltas: {off:?}"
    );
    assert_eq!(
        history as u64, committed,
        "{what}: one history row per committed transaction"
    );
}
