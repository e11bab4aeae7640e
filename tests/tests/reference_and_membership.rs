//! Reference tables (a full copy on every node, writes to all copies atomically) and node
//! removal.

use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

fn copies(c: &TestCluster, shard_id: i64) -> Vec<String> {
    c.node_names()
        .iter()
        .map(|n| {
            let mut db = c.connect(n).unwrap();
            db.query_one(
                &format!("SELECT coalesce(string_agg(code || '=' || rate, ',' ORDER BY code), '') FROM remus_shards.cur_{shard_id}"),
                &[],
            )
            .unwrap()
            .get(0)
        })
        .collect()
}

#[test]
fn reference_tables_stay_identical_on_every_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n3 = c.connect("n3").unwrap();
    n3.batch_execute(
        "CREATE TABLE cur (code text PRIMARY KEY, rate numeric NOT NULL);
         INSERT INTO cur VALUES ('EUR', 1.1), ('USD', 1);
         SELECT remus_create_reference_table('cur');",
    )
    .unwrap();
    let shard_id: i64 = n3
        .query_one(
            "SELECT shard_id FROM remus_shards WHERE table_name = 'cur'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(copies(&c, shard_id), vec!["EUR=1.1,USD=1"; 3]);

    // Writes through any node reach every copy; reads through any node see them.
    let mut n1 = c.connect("n1").unwrap();
    let r = n1
        .query_one("INSERT INTO cur VALUES ('GBP', 1.3) RETURNING code", &[])
        .unwrap();
    assert_eq!(r.get::<_, String>(0), "GBP");
    let mut n2 = c.connect("n2").unwrap();
    assert_eq!(
        n2.execute("UPDATE cur SET rate = 1.2 WHERE code = 'EUR'", &[])
            .unwrap(),
        1
    );
    let mut w = n2.copy_in("COPY cur FROM STDIN").unwrap();
    std::io::Write::write_all(&mut w, b"CHF\t1.05\n").unwrap();
    assert_eq!(w.finish().unwrap(), 1);
    assert_eq!(
        copies(&c, shard_id),
        vec!["CHF=1.05,EUR=1.2,GBP=1.3,USD=1"; 3]
    );
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let n: i64 = db
            .query_one("SELECT count(*) FROM cur", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, 4, "read through {name}");
    }

    // A write that fails on one copy fails everywhere.
    let e = n1
        .batch_execute("INSERT INTO cur VALUES ('USD', 9)")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "23505");
    assert_eq!(
        copies(&c, shard_id),
        vec!["CHF=1.05,EUR=1.2,GBP=1.3,USD=1"; 3]
    );
    // Volatile values would differ per copy: refused.
    let e = n1
        .batch_execute("INSERT INTO cur VALUES ('JPY', random())")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "0A000");

    // Joins with distributed tables read the local copy.
    n1.batch_execute(
        "CREATE TABLE o (id int PRIMARY KEY, code text);
         SELECT remus_create_distributed_table('o', 'id', 4);
         INSERT INTO o VALUES (1, 'EUR'), (2, 'USD'), (3, 'GBP'), (4, 'XXX');",
    )
    .unwrap();
    let rows: Vec<(i32, String)> = n2
        .query(
            "SELECT o.id, cur.rate::text FROM o JOIN cur USING (code) ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        rows,
        vec![(1, "1.2".into()), (2, "1".into()), (3, "1.3".into())]
    );

    // TRUNCATE empties every copy.
    n3.batch_execute("TRUNCATE cur").unwrap();
    assert_eq!(copies(&c, shard_id), vec![""; 3]);
}

#[test]
fn removing_a_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY); SELECT remus_create_distributed_table('t', 'id', 3);",
    )
    .unwrap();
    // n3 owns a shard: refused, nothing changes.
    let e = n1
        .batch_execute("SELECT remus_remove_node('n3')")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "55006");
    assert!(e
        .as_db_error()
        .unwrap()
        .message()
        .contains("still owns 1 shards"));
    let e = n1
        .batch_execute("SELECT remus_remove_node('n9')")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42704");
    // A node that owns nothing leaves every node's membership.
    let add_n4 = format!(
        "SELECT remus_add_node('n4', '127.0.0.1', {})",
        c.base_port + 3
    );
    n1.batch_execute(&add_n4).unwrap();
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute(&add_n4).unwrap();
    n2.batch_execute("SELECT remus_remove_node('n4')").unwrap();
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let n: i64 = db
            .query_one("SELECT count(*) FROM remus_nodes WHERE name = 'n4'", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, 0, "{name} still knows n4");
        let all: i64 = db
            .query_one("SELECT count(*) FROM remus_nodes", &[])
            .unwrap()
            .get(0);
        assert_eq!(all, 3);
    }
}
