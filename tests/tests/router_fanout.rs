//! Aggregates over every shard (`router::fanout`): computed per shard and combined, with the
//! same answers, names and types as PostgreSQL's over the same rows in one local table, through
//! every node, in the simple protocol and as prepared statements (generic plans); forms it does
//! not handle keep the general path and the same answers. Scans of every shard ship what a
//! shard can evaluate (`router::scan`).

use integration::protocol::{explain, Raw};
use remus_test_support::cluster::TestCluster;

/// Every row of a result as text (NULL as "NULL"), with the column names and type OIDs.
fn rows(db: &mut postgres::Client, sql: &str) -> (Vec<(String, u32)>, Vec<Vec<String>>) {
    let stmt = db.prepare(sql).unwrap();
    let cols = stmt
        .columns()
        .iter()
        .map(|c| (c.name().to_string(), c.type_().oid()))
        .collect();
    let text = db
        .simple_query(sql)
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            postgres::SimpleQueryMessage::Row(r) => Some(
                (0..r.len())
                    .map(|i| r.get(i).unwrap_or("NULL").to_string())
                    .collect(),
            ),
            _ => None,
        })
        .collect();
    (cols, text)
}

/// Every row of a result in the extended protocol (binary), from a prepared statement run
/// twice: under `plan_cache_mode = force_generic_plan`, the second run uses the cached plan.
fn prepared_rows(db: &mut postgres::Client, sql: &str) -> Vec<Vec<Raw>> {
    let stmt = db.prepare(sql).unwrap();
    let mut last = Vec::new();
    for _ in 0..2 {
        last = db
            .query(&stmt, &[])
            .unwrap()
            .iter()
            .map(|r| (0..r.len()).map(|i| r.get::<_, Raw>(i)).collect())
            .collect();
    }
    last
}

/// `sql` with `{t}` as `kv` through `db` (node `name`) and as `local_kv` through `local`: the
/// same rows, names and types in the simple protocol, and the same bytes from a prepared
/// statement under its generic plan. Returns the statement on `kv`.
fn same_answers(
    db: &mut postgres::Client,
    local: &mut postgres::Client,
    sql: &str,
    name: &str,
) -> String {
    let on_kv = sql.replace("{t}", "kv");
    let on_local = sql.replace("{t}", "local_kv");
    assert_eq!(
        rows(db, &on_kv),
        rows(local, &on_local),
        "{on_kv} through {name}"
    );
    db.batch_execute("SET plan_cache_mode = force_generic_plan")
        .unwrap();
    assert_eq!(
        prepared_rows(db, &on_kv),
        prepared_rows(local, &on_local),
        "{on_kv} through {name}, prepared"
    );
    db.batch_execute("RESET plan_cache_mode").unwrap();
    on_kv
}

fn plan_of(db: &mut postgres::Client, sql: &str) -> String {
    explain(db, "COSTS OFF", sql)
}

/// A 3-node cluster with `kv` over 8 shards and `local_kv`, a plain table on n1, holding the
/// same 500 rows.
fn loaded() -> TestCluster {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let schema = "(k bigint PRIMARY KEY, g int, n int, x float8, m numeric, t text)";
    n1.batch_execute(&format!(
        "CREATE TABLE kv {schema}; CREATE TABLE local_kv {schema};
         SELECT remus_create_distributed_table('kv', 'k', 8);"
    ))
    .unwrap();
    let values = (1..=500)
        .map(|k| {
            let n = if k % 17 == 0 {
                "NULL".to_string()
            } else {
                ((k * 37) % 101).to_string()
            };
            format!(
                "({k}, {}, {n}, {}, {}.{}, 't{}')",
                k % 7,
                k as f64 / 8.0,
                k * 3,
                k % 10,
                k % 13
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    n1.batch_execute(&format!(
        "INSERT INTO kv VALUES {values}; INSERT INTO local_kv VALUES {values};"
    ))
    .unwrap();
    c
}

#[test]
fn aggregates_over_every_shard_answer_as_postgresql_does() {
    let c = loaded();
    let pushed = [
        "SELECT count(*), sum(n), min(n), max(n), avg(n) FROM {t}",
        "SELECT count(n) AS c, sum(m), avg(x), sum(x), min(t), max(t), avg(m) FROM {t} WHERE n > 20",
        "SELECT g, count(*), sum(n) FROM {t} GROUP BY g ORDER BY g",
        "SELECT g, count(*) AS c FROM {t} GROUP BY g ORDER BY c DESC, g LIMIT 3",
        "SELECT count(*), sum(n), max(k) FROM {t} WHERE k < 0",
        "SELECT g, max(t) FROM {t} WHERE g < 3 GROUP BY g ORDER BY g DESC OFFSET 1",
    ];
    // Not computed per shard (an aggregate inside an expression, DISTINCT, HAVING): read whole.
    let general = [
        "SELECT count(*) + 1, sum(n) * 2 FROM {t}",
        "SELECT count(DISTINCT g) FROM {t}",
        "SELECT g, sum(n) FROM {t} GROUP BY g HAVING sum(n) > 3000 ORDER BY g",
    ];
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let mut local = c.connect("n1").unwrap();
        for (sql, per_shard) in pushed
            .iter()
            .map(|s| (s, true))
            .chain(general.iter().map(|s| (s, false)))
        {
            let on_kv = same_answers(&mut db, &mut local, sql, &name);
            let plan = plan_of(&mut db, &on_kv);
            assert_eq!(
                plan.contains("Function Scan on fanout"),
                per_shard,
                "{on_kv} through {name}:\n{plan}"
            );
        }
    }
}

/// Set operations over distributed tables read every shard of each branch: a UNION ALL that
/// PostgreSQL flattens into one Append has each shell as a member relation, read through its
/// shards like a table of its own (it once read the shells' empty heaps: no rows at all).
#[test]
fn set_operations_over_distributed_tables_answer_as_postgresql_does() {
    let c = loaded();
    let queries = [
        "SELECT k FROM {t} UNION ALL SELECT k FROM {t} WHERE g = 1 ORDER BY 1",
        "SELECT count(*), sum(n) FROM (SELECT k, n FROM {t} UNION ALL SELECT k, n FROM {t}) s",
        "SELECT g FROM {t} UNION SELECT g FROM {t} ORDER BY 1",
        "SELECT k FROM {t} WHERE k < 40 INTERSECT SELECT k FROM {t} WHERE g = 2 ORDER BY 1",
        "SELECT k FROM {t} WHERE k < 40 EXCEPT SELECT k FROM {t} WHERE g = 2 ORDER BY 1",
    ];
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let mut local = c.connect("n1").unwrap();
        for sql in queries {
            let on_kv = sql.replace("{t}", "kv");
            assert!(
                !rows(&mut db, &on_kv).1.is_empty(),
                "{on_kv} through {name}: no rows"
            );
            same_answers(&mut db, &mut local, sql, &name);
        }
    }
}

/// A scan of every shard ships the clauses a shard evaluates exactly as here (no mutable
/// function, no parameter) and only the columns the plan reads; the answers are PostgreSQL's.
#[test]
fn scans_over_every_shard_ship_their_filter_and_the_columns_they_read() {
    let c = loaded();
    // (statement, the shipped filter or None, the shipped columns)
    let cases = [
        (
            "SELECT k, t FROM {t} WHERE n > 90 AND t <> 't3' ORDER BY k",
            Some("Shard Filter: (n > 90) AND (t <> 't3'::text)"),
            "Shard Columns: 1, 3, 6",
        ),
        (
            "SELECT k FROM {t} WHERE x > random() * 0 + 60 ORDER BY k",
            None,
            "Shard Columns: 1, 4",
        ),
        (
            "SELECT r::text FROM {t} r WHERE n = 5 ORDER BY 1",
            Some("Shard Filter: (n = 5)"),
            "Shard Columns: all",
        ),
        (
            "SELECT g, sum(n) FROM {t} GROUP BY g HAVING sum(n) > 3000 ORDER BY g",
            None,
            "Shard Columns: 2, 3",
        ),
    ];
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let mut local = c.connect("n1").unwrap();
        for (sql, filter, columns) in cases {
            let on_kv = sql.replace("{t}", "kv");
            // random() * 0 is 0 on every row: the answer is still exact.
            assert_eq!(
                rows(&mut db, &on_kv),
                rows(&mut local, &sql.replace("{t}", "local_kv")),
                "{on_kv} through {name}"
            );
            let plan = explain(&mut db, "VERBOSE, COSTS OFF", &on_kv);
            assert!(plan.contains(columns), "{on_kv} through {name}:\n{plan}");
            match filter {
                Some(f) => assert!(plan.contains(f), "{on_kv} through {name}:\n{plan}"),
                None => assert!(
                    !plan.contains("Shard Filter"),
                    "{on_kv} through {name}:\n{plan}"
                ),
            }
        }
        // A parameter is not shipped; a generic plan still answers right.
        db.batch_execute("SET plan_cache_mode = force_generic_plan")
            .unwrap();
        let stmt = db
            .prepare("SELECT k FROM kv WHERE n > $1 ORDER BY k")
            .unwrap();
        let want: Vec<i64> = local
            .query("SELECT k FROM local_kv WHERE n > $1 ORDER BY k", &[&95i32])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        for _ in 0..2 {
            let got: Vec<i64> = db
                .query(&stmt, &[&95i32])
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert_eq!(got, want, "prepared through {name}");
        }
    }
}
