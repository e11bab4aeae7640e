//! COPY and TRUNCATE on distributed tables, the DDL guards, and ownership enforcement on the
//! data node (SQLSTATE RM001).

use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

#[test]
fn copy_truncate_guards_and_ownership() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute(
        "CREATE TABLE c (id int PRIMARY KEY, v text, g int GENERATED ALWAYS AS (id * 2) STORED, d text DEFAULT 'dflt');
         SELECT remus_create_distributed_table('c', 'id', 4);",
    )
    .unwrap();

    // COPY FROM STDIN through every node: each row lands on its shard, defaults and generated
    // columns are filled in, escapes survive.
    for (i, name) in c.node_names().iter().enumerate() {
        let mut db = c.connect(name).unwrap();
        let base = (i as i32) * 1000;
        let mut data = String::new();
        for k in 0..100 {
            data.push_str(&format!("{}\tv{}\\tx\n", base + k, k));
        }
        data.push_str(&format!("{}\t\\N\n", base + 500));
        let mut w = db.copy_in("COPY c (id, v) FROM STDIN").unwrap();
        std::io::Write::write_all(&mut w, data.as_bytes()).unwrap();
        assert_eq!(w.finish().unwrap(), 101);
    }
    let mut n1 = c.connect("n1").unwrap();
    let r = n1
        .query_one(
            "SELECT count(*), sum(g)::bigint, count(*) FILTER (WHERE d = 'dflt'), count(v) FROM c",
            &[],
        )
        .unwrap();
    let expected_g: i64 = (0..3)
        .map(|i| {
            (0..100).map(|k| 2 * (i * 1000 + k) as i64).sum::<i64>() + 2 * (i * 1000 + 500) as i64
        })
        .sum();
    assert_eq!(
        (
            r.get::<_, i64>(0),
            r.get::<_, i64>(1),
            r.get::<_, i64>(2),
            r.get::<_, i64>(3)
        ),
        (303, expected_g, 303, 300)
    );
    let v: String = n1
        .query_one("SELECT v FROM c WHERE id = 1007", &[])
        .unwrap()
        .get(0);
    assert_eq!(v, "v7\tx");
    // Every row is in the shard its key hashes to.
    let misplaced: i64 = n1
        .query_one(
            "SELECT count(*) FROM c WHERE remus_shard_id_for('c', id) IS NULL",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(misplaced, 0);
    for (shard_id, owner) in n1
        .query(
            "SELECT shard_id, node_name FROM remus_shards WHERE table_name = 'c'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1)))
    {
        let mut o = c.connect(&owner).unwrap();
        let wrong: i64 = o
            .query_one(&format!("SELECT count(*) FROM remus_shards.c_{shard_id} WHERE remus_shard_id_for('c', id) <> {shard_id}"), &[])
            .unwrap()
            .get(0);
        assert_eq!(wrong, 0, "rows in the wrong shard on {owner}");
    }
    // CSV input too; a NULL key is refused and nothing of that COPY stays.
    {
        let mut w = n1
            .copy_in("COPY c (id, v) FROM STDIN WITH (FORMAT csv)")
            .unwrap();
        std::io::Write::write_all(&mut w, b"9001,\"a, b\"\n").unwrap();
        assert_eq!(w.finish().unwrap(), 1);
    }
    let e = {
        let mut w = n1.copy_in("COPY c (id, v) FROM STDIN").unwrap();
        std::io::Write::write_all(&mut w, b"9002\tok\n\\N\tbad\n").unwrap();
        w.finish().unwrap_err()
    };
    assert_eq!(sqlstate(&e), "23502");
    assert_eq!(
        n1.query_one("SELECT count(*) FROM c WHERE id = 9002", &[])
            .unwrap()
            .get::<_, i64>(0),
        0
    );

    // Statements that would act on the empty shell or make shards diverge are refused.
    for sql in [
        "ALTER TABLE c ALTER COLUMN id TYPE bigint",
        "ALTER TABLE c SET UNLOGGED",
        "COPY c TO STDOUT",
    ] {
        let e = n1.batch_execute(sql).unwrap_err();
        assert_eq!(sqlstate(&e), "0A000", "{sql}");
    }

    // A shard table read directly on a node that does not own it in the statement's snapshot:
    // RM001. (Simulated by changing the owner inside an uncommitted transaction.)
    let local: i64 = n1
        .query_one(
            "SELECT min(shard_id) FROM remus_shards WHERE table_name = 'c' AND node_name = 'n1'",
            &[],
        )
        .unwrap()
        .get(0);
    n1.batch_execute(&format!("SELECT count(*) FROM remus_shards.c_{local}"))
        .unwrap();
    n1.batch_execute("BEGIN").unwrap();
    n1.batch_execute(&format!(
        "UPDATE remus.shard_map SET node_name = 'n2' WHERE shard_id = {local}"
    ))
    .unwrap();
    let e = n1
        .batch_execute(&format!("SELECT count(*) FROM remus_shards.c_{local}"))
        .unwrap_err();
    assert_eq!(sqlstate(&e), "RM001", "{e:?}");
    n1.batch_execute("ROLLBACK").unwrap();

    // TRUNCATE empties every shard on every node.
    n2.batch_execute("TRUNCATE c").unwrap();
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        assert_eq!(
            db.query_one("SELECT count(*) FROM c", &[])
                .unwrap()
                .get::<_, i64>(0),
            0,
            "{name}"
        );
    }
}

/// The per-backend shard-map cache: used until the map generation is bumped, bypassed while
/// read-through is on (what a migration's ownership flip relies on).
#[test]
fn shard_map_cache_follows_generation_and_read_through() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute("CREATE TABLE t (id int PRIMARY KEY, v text); SELECT remus_create_distributed_table('t', 'id', 3); INSERT INTO t VALUES (1, 'x');").unwrap();
    let (shard, owner): (i64, String) = {
        let r = n1.query_one("SELECT shard_id, node_name FROM remus_shards WHERE shard_id = remus_shard_id_for('t', 1)", &[]).unwrap();
        (r.get(0), r.get(1))
    };
    let other = c.node_names().into_iter().find(|n| *n != owner).unwrap();
    let set_owner = |to: &str| {
        for name in c.node_names() {
            let mut db = c.connect(&name).unwrap();
            db.execute(
                "UPDATE remus.shard_map SET node_name = $1 WHERE shard_id = $2",
                &[&to, &shard],
            )
            .unwrap();
        }
    };
    let bump = || {
        for name in c.node_names() {
            c.connect(&name)
                .unwrap()
                .batch_execute("SELECT remus.bump_map_generation()")
                .unwrap();
        }
    };
    // A session that has routed to the shard once.
    let mut s = c.connect("n2").unwrap();
    let read = |s: &mut postgres::Client| {
        s.query_one("SELECT v FROM t WHERE id = 1", &[])
            .map(|r| r.get::<_, String>(0))
    };
    assert_eq!(read(&mut s).unwrap(), "x");

    // The map now names a node without the shard table (a simulated flip, data not moved).
    set_owner(&other);
    assert_eq!(
        read(&mut s).unwrap(),
        "x",
        "the cached map is used until the change is announced"
    );
    bump();
    let e = read(&mut s).unwrap_err();
    assert_eq!(
        sqlstate(&e),
        "RM001",
        "after the bump the new owner is used: {e:?}"
    );

    // Back, announced: routing works again.
    set_owner(&owner);
    bump();
    assert_eq!(read(&mut s).unwrap(), "x");

    // With read-through on, a change is seen at once, without a bump.
    s.batch_execute("SELECT remus.begin_read_through()")
        .unwrap();
    set_owner(&other);
    let e = read(&mut s).unwrap_err();
    assert_eq!(sqlstate(&e), "RM001");
    set_owner(&owner);
    assert_eq!(read(&mut s).unwrap(), "x");
    s.batch_execute("SELECT remus.end_read_through()").unwrap();
}
