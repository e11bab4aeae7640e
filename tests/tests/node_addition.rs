//! A node added to a running cluster after its tables were distributed (`remusctl cluster
//! add-node`, which calls `remus_add_node` and `remus_activate_node` on n1; issue 18, and the
//! scale-out of issue 20).
//!
//! `a_node_added_after_distribution_serves_and_receives_shards_under_load`: three nodes with the
//! TPC-B tables, a distributed table with a `bigserial` column (schema `app`) and a reference
//! table with rows. A fourth node is added while pgbench runs on n1..n3. Then:
//! - every node's membership lists it, and it has every shell, the catalog of every table (the
//!   same shard map as n1), the reference table's rows, and routes from its first statement
//!   (the accounts counted through it, a keyed read of the `app` table);
//! - its copy of the sequence hands out a range of its own (the slot after n1..n3's);
//! - pgbench also runs on it while two account shards and a shard of the `app` table move to it
//!   (remus mode); afterwards no pgbench transaction failed, every balance equals its history,
//!   a row inserted through n4 into the `app` shard it now owns takes its id from n4's range;
//! - activating it again does nothing (false); activating an unknown node (42704) or the node
//!   itself (22023) is refused.

use integration::consistency::assert_tpcb_consistent;
use integration::pgbench::{finish, init_tpcb, start_tpcb, wait_committing};
use integration::shards::{owners, shards_of};
use remus_test_support::cluster::TestCluster;

const SEQUENCE_SLOT_BITS: u32 = 48;

/// How long pgbench runs on n1..n3 (on n4, half of it, from its activation on): the node is
/// added and the shards move meanwhile.
const LOAD_SECONDS: u32 = 30;

fn migrate(c: &TestCluster, shard: i64, target: &str) {
    let status: String = c
        .connect("n1")
        .unwrap()
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, $2)",
            &[&shard, &target],
        )
        .unwrap_or_else(|e| panic!("moving shard {shard} to {target}: {e:?}"))
        .get(0);
    assert_eq!(status, "succeeded", "shard {shard} to {target}");
}

#[test]
fn a_node_added_after_distribution_serves_and_receives_shards_under_load() {
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 1);
    for n in c.node_names() {
        c.connect(&n)
            .unwrap()
            .batch_execute("CREATE SCHEMA app")
            .unwrap();
    }
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE app.events (id bigserial, k int NOT NULL, v text, PRIMARY KEY (k, id));
         SELECT remus_create_distributed_table('app.events', 'k');
         CREATE TABLE app.regions (id int PRIMARY KEY, name text);
         INSERT INTO app.regions VALUES (1, 'north'), (2, 'south'), (3, 'east');
         SELECT remus_create_reference_table('app.regions');",
    )
    .unwrap();
    for k in 1..=20 {
        n1.execute("INSERT INTO app.events (k, v) VALUES ($1, 'before')", &[&k])
            .unwrap();
    }

    let mut load: Vec<_> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| start_tpcb(&c, n, 2, LOAD_SECONDS))
        .collect();
    wait_committing(&c, "n1", 100);
    let n4 = c.add_node().expect("remusctl cluster add-node");
    assert_eq!(n4, "n4");

    // A full member: known everywhere, with every shell and the whole catalog.
    for n in c.node_names() {
        let members: Vec<String> = c
            .connect(&n)
            .unwrap()
            .query("SELECT name FROM remus_nodes", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(members, ["n1", "n2", "n3", "n4"], "membership on {n}");
    }
    let mut db4 = c.connect("n4").unwrap();
    for table in ["pgbench_accounts", "pgbench_history", "app.events"] {
        assert_eq!(
            shards_of(&mut db4, table),
            shards_of(&mut n1, table),
            "the shard map of {table} on n4"
        );
    }
    let regions: Vec<String> = db4
        .query("SELECT name FROM app.regions ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(regions, ["north", "south", "east"]);
    let accounts: i64 = db4
        .query_one("SELECT count(*) FROM pgbench_accounts", &[])
        .unwrap()
        .get(0);
    assert_eq!(accounts, 100_000, "the accounts, routed through n4");
    let v: String = db4
        .query_one("SELECT v FROM app.events WHERE k = 7", &[])
        .unwrap()
        .get(0);
    assert_eq!(v, "before");
    let slots: Vec<i64> = c
        .node_names()
        .iter()
        .map(|n| {
            c.connect(n)
                .unwrap()
                .query_one(
                    &format!(
                        "SELECT min_value >> {SEQUENCE_SLOT_BITS} FROM pg_sequences
                          WHERE schemaname = 'app' AND sequencename = 'events_id_seq'"
                    ),
                    &[],
                )
                .unwrap()
                .get(0)
        })
        .collect();
    assert_eq!(
        slots,
        [1, 2, 3, 4],
        "each node's range of app.events_id_seq"
    );

    // It receives shards under load, and serves its own clients meanwhile.
    load.push(start_tpcb(&c, "n4", 2, LOAD_SECONDS / 2));
    let moving: Vec<i64> = owners(&c, "pgbench_accounts")
        .into_iter()
        .filter(|(_, o)| o == "n1" || o == "n2")
        .map(|(s, _)| s)
        .take(2)
        .collect();
    for shard in &moving {
        migrate(&c, *shard, "n4");
    }
    let (event_shard, _) = owners(&c, "app.events")
        .into_iter()
        .find(|(_, o)| o != "n4")
        .unwrap();
    migrate(&c, event_shard, "n4");
    let mut committed = 0;
    for p in load {
        let r = finish(p);
        assert_eq!(r.failed, 0, "{}", r.output);
        committed += r.processed;
    }
    for shard in &moving {
        assert!(
            owners(&c, "pgbench_accounts").contains(&(*shard, "n4".to_string())),
            "shard {shard} on n4"
        );
    }
    assert_tpcb_consistent(&c, "n4", committed, "after the moves to the added node");

    // A key of the app shard n4 now owns: its id comes from n4's range.
    let key: i32 = db4
        .query_one(
            "SELECT k FROM generate_series(1, 10000) k
              WHERE remus_shard_id_for('app.events', k) = $1 LIMIT 1",
            &[&event_shard],
        )
        .unwrap()
        .get(0);
    let id: i64 = db4
        .query_one(
            "INSERT INTO app.events (k, v) VALUES ($1, 'on n4') RETURNING id",
            &[&key],
        )
        .unwrap()
        .get(0);
    assert_eq!(id >> SEQUENCE_SLOT_BITS, 4, "id {id} from n4's range");

    // Again: nothing to do. Bad input: refused with its SQLSTATE.
    let again: bool = n1
        .query_one("SELECT remus_activate_node('n4')", &[])
        .unwrap()
        .get(0);
    assert!(!again, "n4 is active already");
    let e = n1
        .query_one("SELECT remus_activate_node('n9')", &[])
        .unwrap_err();
    assert_eq!(remus_test_support::sqlstate(&e), "42704", "{e:?}");
    let e = n1
        .query_one("SELECT remus_activate_node('n1')", &[])
        .unwrap_err();
    assert_eq!(remus_test_support::sqlstate(&e), "22023", "{e:?}");
    let left = c.migration_artifacts();
    assert!(left.is_empty(), "left behind: {left:?}");
}
