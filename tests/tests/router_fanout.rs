//! Aggregates over every shard (`router::fanout`): computed per shard and combined, with the
//! same answers, names and types as PostgreSQL's over the same rows in one local table, through
//! every node; forms it does not handle keep the general path and the same answers.

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

fn plan_of(db: &mut postgres::Client, sql: &str) -> String {
    db.simple_query(&format!("EXPLAIN (COSTS OFF) {sql}"))
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn aggregates_over_every_shard_answer_as_postgresql_does() {
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
            let on_kv = sql.replace("{t}", "kv");
            let got = rows(&mut db, &on_kv);
            let want = rows(&mut local, &sql.replace("{t}", "local_kv"));
            assert_eq!(got, want, "{on_kv} through {name}");
            let plan = plan_of(&mut db, &on_kv);
            assert_eq!(
                plan.contains("Function Scan on fanout"),
                per_shard,
                "{on_kv} through {name}:\n{plan}"
            );
        }
    }
}
