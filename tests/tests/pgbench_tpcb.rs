//! The routing issue's acceptance: pgbench TPC-B through all three nodes at once, and the same
//! with one postmaster killed with SIGKILL and restarted mid-run.

use std::time::Duration;

use integration::pgbench::{balances, finish, init_tpcb, prepared_everywhere, start_tpcb};
use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

#[test]
fn tpcb_through_every_node_keeps_the_balances() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 10);
    let runs: Vec<_> = c
        .node_names()
        .iter()
        .map(|n| start_tpcb(&c, n, 8, 60))
        .collect();
    let mut processed = 0;
    for (node, r) in c.node_names().iter().zip(runs.into_iter().map(finish)) {
        let tps = r
            .output
            .lines()
            .find(|l| l.starts_with("tps = "))
            .unwrap_or("tps = ?")
            .to_string();
        println!(
            "{node}: {} committed, {} failed, {tps}",
            r.processed, r.failed
        );
        assert_eq!(r.failed, 0, "{}", r.output);
        assert_eq!(r.aborted_clients, 0, "{}", r.output);
        assert!(r.processed > 0, "{}", r.output);
        processed += r.processed;
    }
    let (a, b, t, h) = balances(&c, "n2");
    assert_eq!((a, b, t), (h, h, h), "balances diverge");
    let mut n3 = c.connect("n3").unwrap();
    let hist: i64 = n3
        .query_one("SELECT count(*) FROM pgbench_history", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        hist as u64, processed,
        "every committed transaction left one history row"
    );
    assert_eq!(prepared_everywhere(&c), 0);
}

#[test]
fn a_killed_node_loses_nothing_and_in_doubt_work_resolves() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 2);
    let state = c.state().unwrap();
    let runs: Vec<_> = c
        .node_names()
        .iter()
        .map(|n| start_tpcb(&c, n, 8, 25))
        .collect();
    std::thread::sleep(Duration::from_secs(6));
    let victim = state.node("n3").unwrap().clone();
    let pid = victim.postmaster_pid().expect("n3 runs");
    // SAFETY: SIGKILL to the postmaster this test's cluster started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_secs(3));
    c.start_node("n3").expect("restart n3");
    for r in runs.into_iter().map(finish) {
        // Clients of the killed node lose their connection; others may see its errors. What
        // matters is what committed.
        assert!(r.processed > 0, "{}", r.output);
    }
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(500),
        || prepared_everywhere(&c) == 0,
        || "in-doubt transactions left after a minute".into(),
    );
    let (a, b, t, h) = balances(&c, "n1");
    assert_eq!((a, b, t), (h, h, h), "balances diverge after the crash");
}
