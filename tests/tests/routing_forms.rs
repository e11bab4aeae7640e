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

/// A statement's rows, every value as text, and its last command tag's count.
type TextResult = (Vec<Vec<Option<String>>>, Option<u64>);

/// The [`TextResult`] of a simple-protocol statement.
fn simple_rows(db: &mut postgres::Client, sql: &str) -> TextResult {
    let mut rows = Vec::new();
    let mut count = None;
    for m in db
        .simple_query(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    {
        match m {
            postgres::SimpleQueryMessage::Row(r) => {
                rows.push((0..r.len()).map(|i| r.get(i).map(str::to_string)).collect())
            }
            postgres::SimpleQueryMessage::CommandComplete(n) => count = Some(n),
            _ => {}
        }
    }
    (rows, count)
}

/// A statement with constants sent to another node goes with its constants as parameters
/// (design note 0002): the owner's log shows it executed as a statement prepared on the
/// entry's session, with `$n` where the constants were. It returns what the owner's own local
/// plan returns and what the literal text returns (`remus.enable_constant_lifting` and
/// `remus.enable_shape_cache` off), for
/// a constant of every type that is lifted, and for the constants that keep their literal
/// (a type modifier, a collation, EXTRACT's field, a sublink, IN lists, NULL, ORDER BY and
/// GROUP BY positions), under the client settings that change how values are written as text
/// (DateStyle 'SQL, DMY', IntervalStyle, extra_float_digits, TimeZone), in which a date bound
/// as a parameter through another node must still reach it as the same date.
#[test]
fn constants_routed_to_another_node_go_as_parameters_of_a_prepared_shape() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE typed (k bigint PRIMARY KEY, i2 smallint, i4 int, n numeric, f4 real,
                             f8 double precision, b bool, t text, vc varchar(10), d date,
                             ts timestamp, tz timestamptz, u uuid, c text COLLATE \"C\",
                             iv interval);
         SELECT remus_create_distributed_table('typed', 'k', 4);",
    )
    .unwrap();
    n1.batch_execute(&format!(
        "INSERT INTO typed VALUES {}",
        (1..=40)
            .map(|k| format!(
                "({k}, {k}, {k} * 10, {k} + 0.5, {k} / 4.0, {k} / 3.0, {k} % 2 = 0, 't{k}', 'v{k}',
                  date '2026-01-01' + {k}, timestamp '2026-01-01' + {k} * interval '1 hour',
                  timestamptz '2026-01-01 00:00+00' + {k} * interval '1 hour', md5('{k}')::uuid,
                  'c{k}', {k} * interval '1 day')"
            ))
            .collect::<Vec<_>>()
            .join(", ")
    ))
    .unwrap();
    let owner: String = n1
        .query_one(
            "SELECT node_name FROM remus_shards WHERE shard_id = remus_shard_id_for('typed', 7)",
            &[],
        )
        .unwrap()
        .get(0);
    let u7: String = n1
        .query_one("SELECT md5('7')::uuid::text", &[])
        .unwrap()
        .get(0);
    let mut on_owner = c.connect(&owner).unwrap();
    on_owner
        .batch_execute("ALTER SYSTEM SET log_statement = 'all'")
        .unwrap();
    on_owner.batch_execute("SELECT pg_reload_conf()").unwrap();
    let reads = [
        // Lifted: operator arguments of every lifted type, LIMIT.
        "SELECT k, i4 FROM typed WHERE k = 7 AND i2 = 7 AND i4 = 70 AND n = 7.5 AND NOT b
            AND t = 't7' AND vc = 'v7' AND c = 'c7' LIMIT 3"
            .to_string(),
        "SELECT k, f4, f8 FROM typed WHERE k = 7 AND f4 = 1.75 AND f8 > 2.3333 AND f8 < 2.3334"
            .to_string(),
        "SELECT k, d, ts, tz FROM typed WHERE k = 7 AND d = '2026-01-08'
            AND ts = '2026-01-01 07:00' AND tz = '2026-01-01 07:00+00'
            AND d < date '2026-02-01' AND ts > '2025-12-31'"
            .to_string(),
        format!("SELECT k, u FROM typed WHERE k = 7 AND u = '{u7}'"),
        "SELECT k, t || '-' || 3 FROM typed WHERE k = 7 AND t LIKE 't%' AND i4 + 1 = 71"
            .to_string(),
        // A statement's own parameters (not lifted) of types written by the client settings.
        "PREPARE dated(date, timestamptz) AS
            SELECT k, d FROM typed WHERE k = 7 AND d = $1 AND tz = $2;
         EXECUTE dated('2026-01-08', '2026-01-01 07:00+00')"
            .to_string(),
        // Kept literal, beside lifted ones.
        "SELECT k, EXTRACT(year FROM d), 'lit' FROM typed WHERE k = 7
            AND EXTRACT(month FROM ts) = 1 AND vc = 'v7x'::varchar(2)
            AND t IN ('t7', 't8') AND c = 'c7' COLLATE \"C\" AND t IS NOT NULL
            AND i4 > (SELECT 5) AND i4 IS DISTINCT FROM 3 AND iv = '7 days'
            ORDER BY 2, 1 OFFSET 0"
            .to_string(),
        "SELECT k, count(*) FROM typed WHERE k = 7 AND t <> '' GROUP BY 1 ORDER BY 1".to_string(),
        "SELECT k FROM typed WHERE k = 7 AND t = NULL".to_string(),
    ];
    let settings = [
        "RESET ALL",
        "SET DateStyle = 'SQL, DMY'; SET IntervalStyle = 'sql_standard';
         SET extra_float_digits = -3; SET TimeZone = 'Asia/Kolkata'",
    ];
    for setting in settings {
        let mut expected: Vec<TextResult> = Vec::new();
        for (i, sql) in reads.iter().enumerate() {
            let mut db = c.connect(&owner).unwrap();
            db.batch_execute(setting).unwrap();
            let here = simple_rows(&mut db, sql);
            let want_rows = if i == reads.len() - 1 { 0 } else { 1 };
            assert_eq!(
                here.0.len(),
                want_rows,
                "{sql} on its owner ({setting}): {here:?}"
            );
            expected.push(here);
        }
        for entry in c.node_names() {
            for lifting in ["on", "off"] {
                let mut db = c.connect(&entry).unwrap();
                db.batch_execute(setting).unwrap();
                // Off: neither lifted for the remote nor planned per shape here (decision
                // 0037 binds the key as a parameter too), so the literal text goes.
                db.batch_execute(&format!(
                    "SET remus.enable_constant_lifting = {lifting};
                     SET remus.enable_shape_cache = {lifting}"
                ))
                .unwrap();
                for (sql, want) in reads.iter().zip(&expected) {
                    assert_eq!(
                        &simple_rows(&mut db, sql),
                        want,
                        "{sql} through {entry}, lifting {lifting} ({setting})"
                    );
                }
            }
        }
    }

    // Writes with constants through another node, in a session writing dates as SQL, DMY.
    let entry = c.node_names().into_iter().find(|n| *n != owner).unwrap();
    let new_key: i64 = n1
        .query_one(
            "SELECT k::bigint FROM generate_series(7000000, 7100000) k
              WHERE remus_shard_id_for('typed', k) = remus_shard_id_for('typed', 7)
              ORDER BY k LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    let mut db = c.connect(&entry).unwrap();
    db.batch_execute("SET DateStyle = 'SQL, DMY'").unwrap();
    for (sql, count) in [
        ("UPDATE typed SET i4 = i4 + 1, d = '2026-03-04', t = 'u7' WHERE k = 7".to_string(), 1),
        (
            format!("INSERT INTO typed (k, i4, d, ts, t) VALUES ({new_key}, 5, '2026-03-05', '2026-03-05 06:07', 'new')"),
            1,
        ),
        (format!("UPDATE typed SET f8 = 0.1 WHERE k = {new_key} AND d = '2026-03-05'"), 1),
        (format!("DELETE FROM typed WHERE k = {new_key} AND d = '2026-03-04'"), 0),
    ] {
        let (_, n) = simple_rows(&mut db, &sql);
        assert_eq!(n, Some(count), "{sql} through {entry}");
    }
    db.batch_execute("BEGIN").unwrap();
    let (rows, _) = simple_rows(
        &mut db,
        "UPDATE typed SET n = n * 2 WHERE k = 7 AND i4 = 71 RETURNING n",
    );
    assert_eq!(rows, vec![vec![Some("15.0".to_string())]]);
    db.batch_execute("COMMIT").unwrap();
    let mut check = c.connect(&owner).unwrap();
    let r = check
        .query_one("SELECT i4, d::text, t, n::text FROM typed WHERE k = 7", &[])
        .unwrap();
    assert_eq!(
        (
            r.get::<_, i32>(0),
            r.get::<_, String>(1),
            r.get::<_, String>(2),
            r.get::<_, String>(3)
        ),
        (
            71,
            "2026-03-04".to_string(),
            "u7".to_string(),
            "15.0".to_string()
        )
    );
    let r = check
        .query_one(
            "SELECT d::text, ts::text, f8 FROM typed WHERE k = $1",
            &[&new_key],
        )
        .unwrap();
    assert_eq!(
        (
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, f64>(2)
        ),
        (
            "2026-03-05".to_string(),
            "2026-03-05 06:07:00".to_string(),
            0.1
        )
    );

    // How the statements reached the owner: executed as prepared shapes with parameters.
    let log = std::fs::read_to_string(&c.state().unwrap().node(&owner).unwrap().log).unwrap();
    // One entry per logged statement: a deparsed statement spans several lines.
    let mut entries: Vec<String> = Vec::new();
    for line in log.lines() {
        match entries.last_mut() {
            Some(e) if line.starts_with('\t') => {
                e.push(' ');
                e.push_str(line.trim());
            }
            _ => entries.push(line.to_string()),
        }
    }
    let prepared = entries
        .iter()
        .filter(|l| l.contains("execute remus_") && l.contains("typed") && l.contains("$1"))
        .count();
    assert!(
        prepared >= 10,
        "statements executed as prepared shapes: {prepared}\n{log}"
    );
    assert!(
        entries
            .iter()
            .any(|l| l.contains("statement: /*remus:shard=") && l.contains("'t7'")),
        "with lifting off, the literal text:\n{log}"
    );
    assert!(
        entries.iter().any(|l| l.contains("execute remus_")
            && l.contains("EXTRACT(month FROM")
            && l.contains("COLLATE \"C\"")),
        "kept literals beside lifted constants:\n{log}"
    );
}
