//! Issue 16's TPC-C acceptance: the nine tables distributed by warehouse and co-located (item a
//! reference table), the five transactions as a plain PostgreSQL implementation writes them
//! (`integration::tpcc`), run concurrently through every node (three clients per node, over the
//! simple, extended and prepared protocols), then TPC-C's consistency conditions 1 to 4
//! (clause 3.3.2) checked through two nodes, with every committed NewOrder one more order and no
//! prepared transaction left. The second test does the same while warehouse 1's shard group
//! moves to another node in Remus mode early in the run, and back later in it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use integration::pgbench::prepared_everywhere;
use integration::shards::owners_everywhere;
use integration::tpcc::{self, Protocol, Scale, Session, Stats};
use remus_test_support::cluster::TestCluster;
use remus_test_support::wait_until;

const SCALE: Scale = Scale::SMALL;
const CLIENTS_PER_NODE: usize = 3;
const TXNS_PER_CLIENT: u64 = 400;

/// A 3-node cluster with the TPC-C tables loaded through n1, conditions 1 to 4 checked through
/// n2 and n3; and the number of orders.
fn loaded_cluster() -> (TestCluster, i64) {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let t = Instant::now();
    tpcc::create_schema(&mut n1).expect("TPC-C schema");
    tpcc::load(&mut n1, SCALE, 16).expect("TPC-C load");
    println!("schema and load: {:?}", t.elapsed());
    for via in ["n2", "n3"] {
        tpcc::assert_consistent(
            &mut c.connect(via).unwrap(),
            SCALE,
            &format!("after the load, through {via}"),
        );
    }
    let orders = tpcc::order_count(&mut n1);
    assert_eq!(
        orders,
        i64::from(SCALE.warehouses * SCALE.districts * SCALE.orders),
        "orders loaded"
    );
    (c, orders)
}

/// The protocol of client `k` of the `i`-th node: one simple-protocol client, two with
/// prepared statements, the rest extended.
fn protocol_of(i: usize, k: usize) -> Protocol {
    match (i, k) {
        (0, 0) => Protocol::Simple,
        (1, 1) | (2, 2) => Protocol::Prepared,
        _ => Protocol::Extended,
    }
}

type Worker = (String, Protocol, JoinHandle<Stats>);

/// [`CLIENTS_PER_NODE`] workers per node, each with its own session on its node, running
/// [`TXNS_PER_CLIENT`] transactions; `done` counts the finished ones.
fn start_workers(c: &TestCluster, done: &Arc<AtomicU64>) -> Vec<Worker> {
    let mut workers = Vec::new();
    for (i, node) in c.node_names().into_iter().enumerate() {
        for k in 0..CLIENTS_PER_NODE {
            let protocol = protocol_of(i, k);
            let session =
                Session::new(c.connect(&node).unwrap(), protocol, Duration::from_secs(60));
            let done = done.clone();
            let seed = 1000 + (i * CLIENTS_PER_NODE + k) as u64;
            workers.push((
                node.clone(),
                protocol,
                std::thread::spawn(move || {
                    tpcc::run_worker(session, SCALE, TXNS_PER_CLIENT, seed, done)
                }),
            ));
        }
    }
    workers
}

/// Waits for the workers; their stats summed, each printed.
fn finish(workers: Vec<Worker>) -> Stats {
    let mut all = Stats::default();
    for (node, protocol, h) in workers {
        let s = h.join().expect("worker panicked");
        println!("{node} {protocol:?}: {s}");
        all.add(&s);
    }
    println!("all: {all}");
    all
}

/// What must hold after a run that started with `orders_before` orders: no error but 40001 and
/// 40P01 (retried), one order per committed NewOrder, conditions 1 to 4 through n2 and n3, no
/// prepared transaction left.
fn assert_run_kept_tpcc(c: &TestCluster, stats: &Stats, orders_before: i64) {
    assert!(
        stats.errors.is_empty(),
        "{} transactions failed:\n{}",
        stats.errors.len(),
        stats.errors.join("\n")
    );
    assert_eq!(
        stats.total_committed() + stats.rolled_back,
        TXNS_PER_CLIENT * (c.node_names().len() * CLIENTS_PER_NODE) as u64,
        "every transaction committed or (NewOrder with an unused item) rolled back"
    );
    assert!(
        stats.remote_new_orders > 0 && stats.remote_payments > 0,
        "{stats}"
    );
    let orders_after = tpcc::order_count(&mut c.connect("n1").unwrap());
    assert_eq!(
        orders_after - orders_before,
        stats.committed[0] as i64,
        "orders grew by {} but {} NewOrders committed",
        orders_after - orders_before,
        stats.committed[0]
    );
    for via in ["n2", "n3"] {
        tpcc::assert_consistent(
            &mut c.connect(via).unwrap(),
            SCALE,
            &format!("after the run, through {via}"),
        );
    }
    assert_eq!(prepared_everywhere(c), 0, "prepared transactions left");
}

#[test]
fn tpcc_through_every_node_keeps_conditions_1_to_4() {
    let (c, orders) = loaded_cluster();
    let done = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let stats = finish(start_workers(&c, &done));
    println!("run: {:?}", t.elapsed());
    assert_run_kept_tpcc(&c, &stats, orders);
}

#[test]
fn tpcc_keeps_conditions_1_to_4_while_a_warehouse_shard_group_moves() {
    let (c, orders) = loaded_cluster();
    let mut n1 = c.connect("n1").unwrap();
    let shard: i64 = n1
        .query_one("SELECT remus_shard_id_for('warehouse', 1)", &[])
        .unwrap()
        .get(0);
    let source = owners_everywhere(&c, shard).remove(0);
    let target = c.node_names().into_iter().find(|n| *n != source).unwrap();

    let done = Arc::new(AtomicU64::new(0));
    let total = TXNS_PER_CLIENT * (c.node_names().len() * CLIENTS_PER_NODE) as u64;
    let t = Instant::now();
    let workers = start_workers(&c, &done);
    // There, and back once 60% of the run is done.
    let mut moves = Vec::new();
    for (from, to, at) in [(&source, &target, 0), (&target, &source, total * 3 / 5)] {
        wait_until(
            Duration::from_secs(300),
            Duration::from_millis(50),
            || done.load(Ordering::Relaxed) >= at,
            || format!("the run did not get to {at} transactions"),
        );
        let started_at = done.load(Ordering::Relaxed);
        let row = n1
            .query_one(
                "SELECT migration_id, shard_ids, status, aborted_by_migration, total_ms
                   FROM remus_migrate_shard($1, $2)",
                &[&shard, to],
            )
            .unwrap_or_else(|e| panic!("migrating shard {shard} {from} -> {to}: {e:?}"));
        let ended_at = done.load(Ordering::Relaxed);
        let (id, group, status, aborted, ms): (i64, Vec<i64>, String, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        println!(
            "migration {id} of shards {group:?} {from} -> {to}: {status} in {ms} ms, \
             {aborted} aborted, transactions done {started_at} -> {ended_at} of {total}"
        );
        assert_eq!(status, "succeeded", "migration {id}");
        assert_eq!(
            group.len(),
            8,
            "the warehouse shard moves with its 7 co-located shards"
        );
        assert!(
            ended_at < total,
            "migration {id} ended after the run ({ended_at} of {total} transactions done)"
        );
        let owners = owners_everywhere(&c, shard);
        assert!(
            owners.iter().all(|o| o == to),
            "after migration {id} every node has {to} as the owner: {owners:?}"
        );
        moves.push(id);
    }
    let stats = finish(workers);
    println!("run: {:?}", t.elapsed());
    assert_run_kept_tpcc(&c, &stats, orders);
}
