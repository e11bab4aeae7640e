//! Every routing form through every node: single-shard statements in the simple, extended and
//! prepared protocols, multi-row INSERT, ON CONFLICT, RETURNING, co-located joins, fan-out
//! reads and aggregates, multi-shard writes (and their rollback), and the 0A000 paths.

use std::collections::BTreeMap;

use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

/// What the table should hold: k -> (v, n).
type Model = BTreeMap<i64, (String, i32)>;

fn check_everywhere(c: &TestCluster, model: &Model) {
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let rows: Model = db
            .query("SELECT k, v, n FROM kv", &[])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), (r.get(1), r.get(2))))
            .collect();
        assert_eq!(&rows, model, "kv as seen through {name}");
        let r = db
            .query_one(
                "SELECT count(*), sum(n)::bigint, min(k), max(k), avg(n)::float8 FROM kv",
                &[],
            )
            .unwrap();
        let sum: i64 = model.values().map(|(_, n)| *n as i64).sum();
        assert_eq!(
            r.get::<_, i64>(0),
            model.len() as i64,
            "count through {name}"
        );
        assert_eq!(
            r.get::<_, Option<i64>>(1),
            if model.is_empty() { None } else { Some(sum) }
        );
        assert_eq!(r.get::<_, Option<i64>>(2), model.keys().next().copied());
        assert_eq!(r.get::<_, Option<i64>>(3), model.keys().last().copied());
        if !model.is_empty() {
            let avg = r.get::<_, f64>(4);
            assert!((avg - sum as f64 / model.len() as f64).abs() < 1e-9);
        }
    }
}

#[test]
fn every_form_through_every_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv (k bigint PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0);
         CREATE TABLE kv_log (k bigint, id int, note text, PRIMARY KEY (k, id));
         SELECT remus_create_distributed_table('kv', 'k', 8);
         SELECT remus_create_distributed_table('kv_log', 'k', 8, colocate_with => 'kv');",
    )
    .unwrap();
    let mut model = Model::new();

    for (i, name) in c.node_names().iter().enumerate() {
        let base = (i as i64 + 1) * 100;
        let mut db = c.connect(name).unwrap();

        // Multi-row INSERT (rows on different shards), RETURNING, command tag.
        let rows = db
            .query(
                &format!("INSERT INTO kv VALUES ({b}, 'a', 1), ({b1}, 'b', 2), ({b2}, 'c', 3), ({b3}, 'd', 4) RETURNING k", b = base, b1 = base + 1, b2 = base + 2, b3 = base + 3),
                &[],
            )
            .unwrap();
        let mut ks: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        ks.sort();
        assert_eq!(ks, vec![base, base + 1, base + 2, base + 3]);
        for (k, v, n) in [
            (base, "a", 1),
            (base + 1, "b", 2),
            (base + 2, "c", 3),
            (base + 3, "d", 4),
        ] {
            model.insert(k, (v.into(), n));
        }

        // Simple protocol, literal keys.
        let r = db
            .simple_query(&format!("UPDATE kv SET n = n + 10 WHERE k = {base}"))
            .unwrap();
        let tag = r.iter().find_map(|m| match m {
            postgres::SimpleQueryMessage::CommandComplete(n) => Some(*n),
            _ => None,
        });
        assert_eq!(tag, Some(1));
        model.get_mut(&base).unwrap().1 += 10;
        let r = db
            .simple_query(&format!("SELECT v FROM kv WHERE k = {}", base + 1))
            .unwrap();
        let v = r.iter().find_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_string),
            _ => None,
        });
        assert_eq!(v.as_deref(), Some("b"));

        // Extended protocol, bind parameters (including an int4 parameter for an int8 key).
        assert_eq!(
            db.execute("UPDATE kv SET v = $2 WHERE k = $1", &[&(base + 2), &"C"])
                .unwrap(),
            1
        );
        model.get_mut(&(base + 2)).unwrap().0 = "C".into();
        let v: String = db
            .query_one(
                "SELECT v FROM kv WHERE k = $1::int4",
                &[&((base + 2) as i32)],
            )
            .unwrap()
            .get(0);
        assert_eq!(v, "C");

        // Named prepared statement, executed often enough for a generic plan.
        let stmt = db.prepare("SELECT n FROM kv WHERE k = $1").unwrap();
        for round in 0..8 {
            let k = base + (round % 4);
            let n: i32 = db.query_one(&stmt, &[&k]).unwrap().get(0);
            assert_eq!(n, model[&k].1, "prepared round {round} via {name}");
        }
        let del = db
            .prepare("DELETE FROM kv WHERE k = $1 RETURNING v")
            .unwrap();
        let gone: String = db.query_one(&del, &[&(base + 3)]).unwrap().get(0);
        assert_eq!(gone, "d");
        model.remove(&(base + 3));

        // ON CONFLICT DO UPDATE / DO NOTHING.
        let r = db
            .query_one(&format!("INSERT INTO kv VALUES ({base}, 'x', 0) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v || '!' RETURNING v, n"), &[])
            .unwrap();
        assert_eq!(
            (r.get::<_, String>(0), r.get::<_, i32>(1)),
            ("x!".to_string(), model[&base].1)
        );
        model.get_mut(&base).unwrap().0 = "x!".into();
        assert_eq!(
            db.execute(
                &format!(
                    "INSERT INTO kv VALUES ({}, 'y', 0) ON CONFLICT DO NOTHING",
                    base + 1
                ),
                &[]
            )
            .unwrap(),
            0
        );

        // Co-located join on one key value.
        db.batch_execute(&format!(
            "INSERT INTO kv_log VALUES ({base}, 1, 'one'), ({base}, 2, 'two')"
        ))
        .unwrap();
        let joined: Vec<(String, String)> = db
            .query("SELECT kv.v, l.note FROM kv JOIN kv_log l ON kv.k = l.k WHERE kv.k = $1 ORDER BY l.id", &[&base])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(
            joined,
            vec![
                ("x!".to_string(), "one".to_string()),
                ("x!".to_string(), "two".to_string())
            ]
        );

        check_everywhere(&c, &model);
    }

    // Fan-out: GROUP BY, ORDER BY … LIMIT.
    let mut n2 = c.connect("n2").unwrap();
    let top: Vec<i64> = n2
        .query("SELECT k FROM kv ORDER BY n DESC, k LIMIT 2", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut expect: Vec<(i32, i64)> = model.iter().map(|(k, (_, n))| (*n, *k)).collect();
    expect.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    assert_eq!(
        top,
        expect.iter().take(2).map(|(_, k)| *k).collect::<Vec<_>>()
    );
    let groups: BTreeMap<i64, i64> = n2
        .query("SELECT k / 100 AS g, count(*) FROM kv GROUP BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(groups, BTreeMap::from([(1, 3), (2, 3), (3, 3)]));

    // Multi-shard UPDATE / DELETE in one transaction, and their rollback.
    let mut n3 = c.connect("n3").unwrap();
    n3.batch_execute("BEGIN; UPDATE kv SET n = n * 2; DELETE FROM kv WHERE n > 20; ROLLBACK;")
        .unwrap();
    check_everywhere(&c, &model);
    assert_eq!(
        n3.execute("UPDATE kv SET n = n + 1", &[]).unwrap(),
        model.len() as u64
    );
    for v in model.values_mut() {
        v.1 += 1;
    }
    let deleted = n3.execute("DELETE FROM kv WHERE n > 12", &[]).unwrap();
    let before = model.len();
    model.retain(|_, (_, n)| *n <= 12);
    assert_eq!(deleted as usize, before - model.len());
    check_everywhere(&c, &model);

    // What is not routed fails with 0A000 and changes nothing; a NULL key is 23502.
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        for sql in [
            "UPDATE kv SET k = k + 1 WHERE k = 100",
            // Across shard groups (within one, these forms run: router_shard_group).
            "INSERT INTO kv SELECT k + 1000, v, n FROM kv",
            "SELECT * FROM kv WHERE k IN (100, 101) FOR UPDATE",
            "UPDATE kv SET v = 'q' FROM kv_log WHERE kv.k = kv_log.k",
            "WITH x AS (SELECT k FROM kv) DELETE FROM kv WHERE k = 100 AND k IN (SELECT k FROM x)",
            "MERGE INTO kv USING (SELECT 100 AS k) s ON kv.k = s.k WHEN MATCHED THEN UPDATE SET v = 'm'",
        ] {
            let e = db.batch_execute(sql).unwrap_err();
            assert_eq!(sqlstate(&e), "0A000", "{sql} via {name}: {e:?}");
        }
        let e = db
            .batch_execute("INSERT INTO kv (v) VALUES ('no key')")
            .unwrap_err();
        assert_eq!(sqlstate(&e), "23502");
    }
    check_everywhere(&c, &model);
    read_only_transactions_take_no_xid(&c, &model);
}

/// A read-only transaction, single-shard and fan-out, local and forwarded, takes no xid on the
/// coordinating node nor on any participant (an xid costs a commit record, and a migration's
/// slot creation waits for every transaction holding one).
fn read_only_transactions_take_no_xid(c: &TestCluster, model: &Model) {
    let keys: Vec<i64> = model.keys().copied().collect();
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        db.batch_execute("BEGIN").unwrap();
        for k in &keys {
            db.query_one("SELECT v FROM kv WHERE k = $1", &[k]).unwrap();
        }
        db.query_one("SELECT count(*) FROM kv JOIN kv_log USING (k)", &[])
            .unwrap();
        let xid: Option<String> = db
            .query_one("SELECT pg_current_xact_id_if_assigned()::text", &[])
            .unwrap()
            .get(0);
        assert_eq!(
            xid, None,
            "a read-only transaction through {name} took an xid there"
        );
        for other in c.node_names() {
            let holders: Vec<String> = c
                .connect(&other)
                .unwrap()
                .query(
                    "SELECT pid::text || ' ' || query FROM pg_stat_activity
                      WHERE backend_xid IS NOT NULL AND backend_type = 'client backend'",
                    &[],
                )
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert!(
                holders.is_empty(),
                "reading through {name}: participants on {other} hold an xid: {holders:?}"
            );
        }
        db.batch_execute("COMMIT").unwrap();
    }
}
