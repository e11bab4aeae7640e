//! Statements on one shard group run whole there (`router::colocated`): subqueries, correlated
//! sublinks, WITH, window functions, UNION, FOR UPDATE, joins with a reference table, UPDATE …
//! FROM, DELETE … USING and INSERT … SELECT, when every distributed table they name is tied to
//! the same shard-key value. Each form is run through the group's owner and through a node that
//! owns none of it, in the simple, extended and prepared (generic plan) protocols, and its
//! result compared with the same statement on plain PostgreSQL tables holding the same rows.
//! EXPLAIN ANALYZE shows that it ran as one statement: its local plan on the owner, routed
//! from elsewhere.

use postgres::types::ToSql;
use postgres::{Client, SimpleQueryMessage};
use remus_test_support::cluster::TestCluster;

/// The same rows, distributed (`acct`, `ord` co-located by `w`, `item` a reference table) and
/// plain (`p_acct`, `p_ord`, `p_item`, on n1 only).
const SCHEMA: &str = "
    CREATE TABLE acct (w int, id int, bal int NOT NULL, PRIMARY KEY (w, id));
    CREATE TABLE ord (w int, oid int, id int NOT NULL, amt int NOT NULL, PRIMARY KEY (w, oid));
    CREATE TABLE item (i int PRIMARY KEY, price int NOT NULL);
    CREATE TABLE p_acct (LIKE acct INCLUDING ALL);
    CREATE TABLE p_ord (LIKE ord INCLUDING ALL);
    CREATE TABLE p_item (LIKE item INCLUDING ALL);
    SELECT remus_create_distributed_table('acct', 'w', 4);
    SELECT remus_create_distributed_table('ord', 'w', 4, colocate_with => 'acct');
    SELECT remus_create_reference_table('item');";

/// The rows, as multi-row INSERTs into `{acct}`, `{ord}` and `{item}` (INSERT … SELECT into a
/// distributed table is refused across shard groups).
fn rows() -> String {
    let values = |rows: Vec<String>| rows.join(", ");
    let acct = (1..=8)
        .flat_map(|w| (1..=10).map(move |id| format!("({w}, {id}, {})", (w * 7 + id * 13) % 100)))
        .collect();
    let ord = (1..=8)
        .flat_map(|w| {
            (1..=30)
                .map(move |oid| format!("({w}, {oid}, {}, {})", oid % 10 + 1, (oid * 17 + w) % 100))
        })
        .collect();
    let item = (0..10).map(|i| format!("({i}, {})", i + 1)).collect();
    format!(
        "INSERT INTO {{acct}} VALUES {}; INSERT INTO {{ord}} VALUES {}; INSERT INTO {{item}} VALUES {};",
        values(acct),
        values(ord),
        values(item)
    )
}

/// Read forms: each names its tables `{acct}`, `{ord}`, `{item}`; `$1` is the group's key.
const READS: &[(&str, &str)] = &[
    (
        "uncorrelated subquery",
        "SELECT id::text, bal::text FROM {acct} WHERE w = $1
           AND bal > (SELECT avg(amt) FROM {ord} WHERE w = $1) ORDER BY id",
    ),
    (
        "correlated EXISTS",
        "SELECT a.id::text FROM {acct} a WHERE a.w = $1
           AND EXISTS (SELECT 1 FROM {ord} o WHERE o.w = a.w AND o.id = a.id AND o.amt > $2)
         ORDER BY 1",
    ),
    (
        "WITH and a window function",
        "WITH t AS (SELECT id, sum(amt) s FROM {ord} WHERE w = $1 GROUP BY id)
         SELECT id::text, s::text, rank() OVER (ORDER BY s DESC, id)::text FROM t ORDER BY id",
    ),
    (
        "join with a reference table",
        "SELECT o.oid::text, (i.price * o.amt)::text FROM {ord} o JOIN {item} i ON i.i = o.id % 10
          WHERE o.w = $1 AND o.amt > $2 ORDER BY o.oid",
    ),
    (
        "FROM subquery joined on the key",
        "SELECT a.id::text, s.n::text FROM {acct} a
           JOIN (SELECT w, id, count(*) n FROM {ord} WHERE w = $1 GROUP BY w, id) s
             ON s.w = a.w AND s.id = a.id
          WHERE a.w = $1 ORDER BY a.id",
    ),
    (
        "UNION",
        "SELECT id::text FROM {acct} WHERE w = $1 AND bal > $2
         UNION SELECT id::text FROM {ord} WHERE w = $1 AND amt > $2 ORDER BY 1",
    ),
    (
        "FOR UPDATE with a subquery",
        "SELECT id::text FROM {acct} WHERE w = $1
           AND id IN (SELECT id FROM {ord} WHERE w = $1 AND amt > $2) ORDER BY id FOR UPDATE",
    ),
];

/// Forms the router must not run on one group, though every table in them names the group's
/// key: the ON clause of an outer join and a sublink under OR filter nothing of the outer side.
/// Still the same answer (from per-shard scans).
const NOT_ONE_GROUP: &[(&str, &str)] = &[
    (
        "LEFT JOIN",
        "SELECT a.id::text, count(o.oid)::text FROM {acct} a
           LEFT JOIN {ord} o ON o.w = a.w AND o.id = a.id AND o.amt > $2
          WHERE a.w = $1 GROUP BY a.id ORDER BY a.id",
    ),
    (
        "correlated EXISTS under OR",
        "SELECT a.w::text, a.id::text FROM {acct} a
          WHERE a.bal > 90 - $2 / 10 OR EXISTS (SELECT 1 FROM {ord} o WHERE o.w = $1 AND o.w = a.w)
          ORDER BY 1, 2",
    ),
];

/// Write forms; `$2` varies per run so that each run changes something.
const WRITES: &[(&str, &str)] = &[
    (
        "UPDATE … FROM",
        "UPDATE {acct} a SET bal = a.bal + o.amt FROM {ord} o
          WHERE a.w = $1 AND o.w = a.w AND o.oid = $2 AND a.id = o.id
         RETURNING a.id::text, a.bal::text",
    ),
    (
        "INSERT … SELECT",
        "INSERT INTO {ord} (w, oid, id, amt)
         SELECT w, oid + 1000 * $2, id, amt * 2 FROM {ord} WHERE w = $1 AND oid < 4
         RETURNING oid::text",
    ),
    (
        "WITH in UPDATE",
        "WITH big AS (SELECT id FROM {ord} WHERE w = $1 AND amt > 50 + $2)
         UPDATE {acct} SET bal = bal - 1 WHERE w = $1 AND id IN (SELECT id FROM big)
         RETURNING id::text, bal::text",
    ),
    (
        "a subquery in INSERT … VALUES",
        "INSERT INTO {ord} VALUES ($1, 5000 + $2, 1, (SELECT max(amt) FROM {ord} WHERE w = $1))
         RETURNING amt::text",
    ),
    (
        "DELETE … USING",
        "DELETE FROM {ord} o USING {acct} a
          WHERE o.w = $1 AND a.w = o.w AND a.id = o.id AND o.oid = $2 - 20
         RETURNING o.oid::text",
    ),
    (
        "DELETE with a subquery",
        "DELETE FROM {ord} WHERE w = $1
           AND oid = (SELECT min(oid) FROM {ord} WHERE w = $1 AND oid > $2) RETURNING oid::text",
    ),
];

#[derive(Clone, Copy, Debug)]
enum Protocol {
    Simple,
    Extended,
    /// A prepared statement under `plan_cache_mode = force_generic_plan`: the shard is chosen
    /// at execution.
    Prepared,
}

fn on(tables: &str, sql: &str) -> String {
    match tables {
        "plain" => sql
            .replace("{acct}", "p_acct")
            .replace("{ord}", "p_ord")
            .replace("{item}", "p_item"),
        _ => sql
            .replace("{acct}", "acct")
            .replace("{ord}", "ord")
            .replace("{item}", "item"),
    }
}

/// Runs `sql` with `$1 = w`, `$2 = x` and returns its rows as text.
fn run(db: &mut Client, protocol: Protocol, sql: &str, w: i32, x: i32) -> Vec<Vec<String>> {
    match protocol {
        Protocol::Simple => {
            let literal = sql
                .replace("$1", &w.to_string())
                .replace("$2", &x.to_string());
            db.simple_query(&literal)
                .unwrap_or_else(|e| panic!("{literal}: {e}"))
                .into_iter()
                .filter_map(|m| match m {
                    SimpleQueryMessage::Row(r) => Some(
                        (0..r.len())
                            .map(|i| r.get(i).unwrap_or("NULL").to_string())
                            .collect(),
                    ),
                    _ => None,
                })
                .collect()
        }
        Protocol::Extended | Protocol::Prepared => {
            let both: [&(dyn ToSql + Sync); 2] = [&w, &x];
            let params = if sql.contains("$2") {
                &both[..]
            } else {
                &both[..1]
            };
            let rows = if let Protocol::Prepared = protocol {
                let stmt = db.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
                db.query(&stmt, params)
            } else {
                db.query(sql, params)
            }
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
            rows.iter()
                .map(|r| {
                    (0..r.len())
                        .map(|i| r.get::<_, Option<String>>(i).unwrap_or("NULL".into()))
                        .collect()
                })
                .collect()
        }
    }
}

/// EXPLAIN ANALYZE of `sql` on `db`, without costs or timings.
fn explain(db: &mut Client, sql: &str) -> String {
    integration::protocol::explain(db, "ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF", sql)
}

/// A whole table's rows, in order, as one text: the distributed one through `db`, or the plain
/// copy.
fn contents(db: &mut Client, table: &str) -> String {
    db.query_one(
        &format!("SELECT coalesce(string_agg(t::text, ';' ORDER BY t::text), '') FROM {table} t"),
        &[],
    )
    .unwrap()
    .get(0)
}

/// A 3-node cluster with the schema and rows, a session on n1 (the owner of group `w`), one on
/// n2 (which owns none of it), and `w`.
fn cluster() -> (TestCluster, Client, Client, i32) {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(SCHEMA).unwrap();
    n1.batch_execute(&on("distributed", &rows())).unwrap();
    n1.batch_execute(&on("plain", &rows())).unwrap();
    let w: i32 = n1
        .query_one(
            "SELECT w FROM generate_series(1, 8) w
               JOIN remus_shards s ON s.shard_id = remus_shard_id_for('acct', w)
              WHERE s.node_name = 'n1' ORDER BY w LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    let mut n2 = c.connect("n2").unwrap();
    let elsewhere: i64 = n2
        .query_one(
            "SELECT count(*) FROM remus_shards
              WHERE shard_id = remus_shard_id_for('acct', $1::int) AND node_name = 'n2'",
            &[&w],
        )
        .unwrap()
        .get(0);
    assert_eq!(elsewhere, 0, "n2 must own none of group {w}");
    for db in [&mut n1, &mut n2] {
        db.batch_execute("SET plan_cache_mode = force_generic_plan")
            .unwrap();
    }
    (c, n1, n2, w)
}

#[test]
fn reads_on_one_shard_group_run_whole_there_and_match_postgres() {
    let (_c, mut n1, mut n2, w) = cluster();
    let mut checked = 0;
    for (what, sql) in READS.iter().chain(NOT_ONE_GROUP).copied() {
        for x in [20, 60] {
            let expected = run(&mut n1, Protocol::Extended, &on("plain", sql), w, x);
            assert!(!expected.is_empty(), "{what}: the check needs rows");
            for (node, db) in [("n1", &mut n1), ("n2", &mut n2)] {
                for protocol in [Protocol::Simple, Protocol::Extended, Protocol::Prepared] {
                    // Twice: a prepared statement's second run uses its cached plan.
                    for _ in 0..2 {
                        let got = run(db, protocol, &on("distributed", sql), w, x);
                        assert_eq!(got, expected, "{what} via {node}, {protocol:?}, x = {x}");
                        checked += 1;
                    }
                }
            }
        }
    }
    println!("{checked} results equal to plain PostgreSQL's");

    // One statement on the group: its local plan on the owner, routed from elsewhere.
    for (what, sql) in READS {
        let literal = on("distributed", sql)
            .replace("$1", &w.to_string())
            .replace("$2", "20");
        let owner = explain(&mut n1, &literal);
        assert!(
            owner.contains("Ran: local plan"),
            "{what} on the owner:\n{owner}"
        );
        let other = explain(&mut n2, &literal);
        assert!(other.contains("Ran: routed"), "{what} through n2:\n{other}");
        assert!(
            !other.contains("RemusShardScan"),
            "{what} through n2:\n{other}"
        );
    }
}

#[test]
fn writes_on_one_shard_group_run_whole_there_and_match_postgres() {
    let (c, mut n1, mut n2, w) = cluster();
    let mut n3 = c.connect("n3").unwrap();
    // The plain copies are on n1.
    let mut plain = c.connect("n1").unwrap();
    let mut x = 0;
    for (what, sql) in WRITES {
        for (node, db) in [("n1", &mut n1), ("n2", &mut n2)] {
            for protocol in [Protocol::Simple, Protocol::Extended, Protocol::Prepared] {
                x += 1;
                let mut expected = run(&mut plain, Protocol::Extended, &on("plain", sql), w, x);
                let mut got = run(db, protocol, &on("distributed", sql), w, x);
                assert!(
                    !expected.is_empty(),
                    "{what}, x = {x}: the check needs rows"
                );
                // RETURNING's order is the scan's.
                expected.sort();
                got.sort();
                assert_eq!(got, expected, "{what} via {node}, {protocol:?}, x = {x}");
                for (dist, copy) in [("acct", "p_acct"), ("ord", "p_ord")] {
                    assert_eq!(
                        contents(&mut n3, dist),
                        contents(&mut plain, copy),
                        "{dist} after {what} via {node}, {protocol:?}"
                    );
                }
            }
        }
    }
    // Every write form ran as one statement: its local plan on the owner, routed from n2.
    for (what, sql) in WRITES {
        let literal = on("distributed", sql)
            .replace("$1", &w.to_string())
            .replace("$2", "99");
        for (db, ran) in [(&mut n1, "Ran: local plan"), (&mut n2, "Ran: routed")] {
            db.batch_execute("BEGIN").unwrap();
            let plan = explain(db, &literal);
            db.batch_execute("ROLLBACK").unwrap();
            assert!(plan.contains(ran), "{what}:\n{plan}");
        }
    }
}

#[test]
fn statements_beyond_one_shard_group_are_refused_by_name() {
    let (_c, mut n1, _n2, w) = cluster();
    for (sql, named) in [
        (
            format!("INSERT INTO ord SELECT w + 1, oid, id, amt FROM ord WHERE w = {w}"),
            "INSERT … SELECT other than within the target's shard group",
        ),
        (
            format!("UPDATE acct a SET bal = 0 FROM ord o WHERE a.w = {w} AND o.id = a.id"),
            "UPDATE … FROM / DELETE … USING other than within the target's shard group",
        ),
        (
            format!("WITH d AS (DELETE FROM ord WHERE w = {w} RETURNING id) SELECT count(*) FROM d"),
            "a data-modifying WITH",
        ),
        (
            format!(
                "SELECT * FROM acct WHERE w = {w} AND id IN (SELECT id FROM ord WHERE w = {w} FOR UPDATE)"
            ),
            "not in a subquery",
        ),
    ] {
        let e = n1.batch_execute(&sql).unwrap_err();
        let db = e.as_db_error().unwrap_or_else(|| panic!("{sql}: {e}"));
        assert_eq!(db.code().code(), "0A000", "{sql}: {db}");
        assert!(db.message().contains(named), "{sql}: {}", db.message());
    }
}
