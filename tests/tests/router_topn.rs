//! `ORDER BY … LIMIT` over every shard as a top-N per shard (`router::scan`, decision 0015):
//! each shard's statement carries `ORDER BY <the query's keys> LIMIT <limit + offset>` when that
//! cannot change the answer, and the answers are those of the same query on a plain local copy
//! of the table, through a node owning some shards (n1) and a node owning none (n3), in the
//! simple, extended and prepared (generic plan) protocols: ASC / DESC, NULLS FIRST / LAST with
//! NULLs present, several keys, an expression key, OFFSET, a shipped filter, LIMIT and OFFSET
//! from parameters, a subquery's own top-N. EXPLAIN VERBOSE shows the pushed `Shard Order By`
//! and `Shard Limit` where they must be, and nothing where a push could change the answer (a
//! filter a shard cannot evaluate: volatile, stable or a generic plan's parameter; DISTINCT;
//! WITH TIES; a join; a window function; an SRF; a non-default collation; a USING operator; a
//! function not built in; LIMIT ALL; a LIMIT from a subquery). EXPLAIN ANALYZE shows the scan returning at most
//! limit + offset rows per shard.

use integration::protocol::{explain, literal, query, Protocol, PROTOCOLS};
use postgres::Client;
use remus_test_support::cluster::TestCluster;

const SHARDS: i64 = 8;

/// A 3-node cluster with `kv` over 8 shards, every shard of n3 moved to n1 (so n3 owns
/// none), and `local_kv`, a plain table with the same 600 rows, and a function `neg` of their
/// own, on n1 and on n3.
fn cluster() -> TestCluster {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let schema = "(k bigint PRIMARY KEY, g int, n int, x float8, t text)";
    n1.batch_execute(&format!(
        "CREATE TABLE kv {schema};
         SELECT remus_create_distributed_table('kv', 'k', {SHARDS});"
    ))
    .unwrap();
    let values = (1..=600)
        .map(|k: i64| {
            // NULLs in n (35 rows) and x (some), so that NULLS FIRST / LAST matter.
            let n = if k % 17 == 0 {
                "NULL".to_string()
            } else {
                ((k * 37) % 101).to_string()
            };
            let x = if k % 29 == 0 {
                "NULL".to_string()
            } else {
                format!("{}", (k * 7919 % 1000) as f64 / 8.0)
            };
            format!("({k}, {}, {n}, {x}, 't{}')", k % 7, k % 13)
        })
        .collect::<Vec<_>>()
        .join(", ");
    n1.batch_execute(&format!("INSERT INTO kv VALUES {values}"))
        .unwrap();
    for node in ["n1", "n3"] {
        c.connect(node)
            .unwrap()
            .batch_execute(&format!(
                "CREATE TABLE local_kv {schema}; INSERT INTO local_kv VALUES {values};
                 CREATE FUNCTION neg(int) RETURNS int IMMUTABLE LANGUAGE plpgsql
                   AS 'BEGIN RETURN -$1; END';"
            ))
            .unwrap();
    }
    let on_n3: Vec<i64> = n1
        .query(
            "SELECT shard_id FROM remus_shards WHERE table_name = 'kv' AND node_name = 'n3'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!on_n3.is_empty(), "n3 owns shards of kv before the move");
    let status: String = n1
        .query_one(
            "SELECT status FROM remus_migrate_shards($1, 'n1')",
            &[&on_n3],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded", "moving n3's shards to n1");
    let left: i64 = c
        .connect("n3")
        .unwrap()
        .query_one(
            "SELECT count(*) FROM remus_shards WHERE table_name = 'kv' AND node_name = 'n3'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "n3 owns none of kv");
    c
}

/// The `actual rows` of the RemusShardScan in an EXPLAIN ANALYZE.
fn scan_rows(plan: &str) -> usize {
    let line = plan
        .lines()
        .find(|l| l.contains("RemusShardScan"))
        .unwrap_or_else(|| panic!("no RemusShardScan in\n{plan}"));
    let rows = line.split("rows=").nth(1).expect("actual rows");
    rows.split(|ch: char| !ch.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Runs `sql` on `{t}` = kv and on `{t}` = local_kv through `db` in `protocol` and asserts the
/// same rows, in the same order.
fn same_answer(db: &mut Client, protocol: Protocol, sql: &str, params: &[i64], what: &str) {
    let on_kv = sql.replace("{t}", "kv");
    let on_local = sql.replace("{t}", "local_kv");
    let got = query(db, protocol, &on_kv, params).unwrap_or_else(|e| panic!("{on_kv}: {e}"));
    let want = query(db, protocol, &on_local, params).unwrap_or_else(|e| panic!("{on_local}: {e}"));
    assert!(!want.is_empty(), "{on_local} {what}: no rows to compare");
    assert_eq!(got, want, "{on_kv} {what}, {protocol:?}");
}

/// A statement on `{t}`, its parameters, and the ORDER BY and LIMIT a shard is sent (None:
/// nothing pushed).
type Case<'a> = (&'a str, &'a [i64], Option<(&'a str, &'a str)>);

/// Every sort ends in a unique column, so that the answer is one (ties would let PostgreSQL
/// return any of the tied rows, here and on the local copy alike).
#[test]
fn order_by_limit_is_a_top_n_per_shard_with_postgresql_s_answers() {
    let c = cluster();
    let pushed: &[Case] = &[
        (
            "SELECT k, n FROM {t} ORDER BY n, k LIMIT 7",
            &[],
            Some(("n ASC NULLS LAST, k ASC NULLS LAST", "7")),
        ),
        (
            "SELECT k, n, t FROM {t} ORDER BY n DESC, k LIMIT 10",
            &[],
            Some(("n DESC NULLS FIRST, k ASC NULLS LAST", "10")),
        ),
        // Across the 35 NULLs: rows 21..60 of the order.
        (
            "SELECT k, n FROM {t} ORDER BY n NULLS FIRST, k DESC LIMIT 40 OFFSET 20",
            &[],
            Some(("n ASC NULLS FIRST, k DESC NULLS FIRST", "60")),
        ),
        (
            "SELECT k, x, t FROM {t} WHERE g <> 3 AND t > 't2' \
             ORDER BY x DESC NULLS LAST, t, k LIMIT 15",
            &[],
            Some((
                "x DESC NULLS LAST, t ASC NULLS LAST, k ASC NULLS LAST",
                "15",
            )),
        ),
        (
            "SELECT k, n FROM {t} WHERE n IS NOT NULL ORDER BY n % 10 DESC, k LIMIT 12 OFFSET 3",
            &[],
            Some(("(n % 10) DESC NULLS FIRST, k ASC NULLS LAST", "15")),
        ),
        // The LIMIT and OFFSET of the statement's parameters: constants in the simple and
        // extended protocols, read at execution in a generic plan.
        (
            "SELECT k, x FROM {t} ORDER BY x NULLS FIRST, k LIMIT $1 OFFSET $2",
            &[9, 4],
            Some(("x ASC NULLS FIRST, k ASC NULLS LAST", "13")),
        ),
        // A subquery's own ORDER BY … LIMIT, sorted again above.
        (
            "SELECT * FROM (SELECT k, n FROM {t} ORDER BY n, k LIMIT 5) s ORDER BY k DESC",
            &[],
            Some(("n ASC NULLS LAST, k ASC NULLS LAST", "5")),
        ),
        // A filter a shard cannot evaluate as here (volatile, stable): checked here only, so
        // every matching row must come back.
        (
            "SELECT k, n FROM {t} WHERE x > random() * 0 + 60 ORDER BY n, k LIMIT 5",
            &[],
            None,
        ),
        (
            "SELECT k, n FROM {t} \
             WHERE n > length(current_setting('application_name')) * 0 + 50 \
             ORDER BY n, k LIMIT 5",
            &[],
            None,
        ),
        ("SELECT DISTINCT g FROM {t} ORDER BY g LIMIT 3", &[], None),
        (
            "SELECT k, g FROM {t} ORDER BY g, k FETCH FIRST 3 ROWS WITH TIES",
            &[],
            None,
        ),
        (
            "SELECT a.k, b.n FROM {t} a JOIN {t} b ON b.k = a.k + 1 ORDER BY b.n, a.k LIMIT 5",
            &[],
            None,
        ),
        (
            "SELECT k, row_number() OVER (ORDER BY n, k) FROM {t} ORDER BY k LIMIT 5",
            &[],
            None,
        ),
        (
            "SELECT k, generate_series(1, 2) FROM {t} ORDER BY k, 2 LIMIT 5",
            &[],
            None,
        ),
        (
            "SELECT k, t FROM {t} ORDER BY t COLLATE \"C\", k LIMIT 5",
            &[],
            None,
        ),
        (
            "SELECT k, t FROM {t} ORDER BY t USING ~<~, k LIMIT 5",
            &[],
            None,
        ),
        // A function of this node's own (immutable, but not built in): maybe not the same, or
        // not there, on the shards' nodes.
        ("SELECT k, n FROM {t} ORDER BY neg(n), k LIMIT 5", &[], None),
        ("SELECT k FROM {t} ORDER BY k LIMIT ALL", &[], None),
        ("SELECT k FROM {t} ORDER BY k LIMIT (SELECT 3)", &[], None),
    ];
    for entry in ["n1", "n3"] {
        for protocol in PROTOCOLS {
            let mut db = c.connect(entry).unwrap();
            for (sql, params, _) in pushed {
                same_answer(&mut db, protocol, sql, params, &format!("through {entry}"));
            }
            // A parameter in the filter: shipped as a constant in the simple and extended
            // protocols, not shipped in a generic plan (so nothing pushed there): both right.
            same_answer(
                &mut db,
                protocol,
                "SELECT k, n FROM {t} WHERE n > $1::bigint ORDER BY n, k LIMIT $2",
                &[90, 6],
                &format!("through {entry}"),
            );
        }
        let mut db = c.connect(entry).unwrap();
        for (sql, params, top_n) in pushed {
            let literal = literal(&sql.replace("{t}", "kv"), params);
            let plan = explain(&mut db, "VERBOSE, COSTS OFF", &literal);
            assert!(plan.contains("RemusShardScan"), "{literal}:\n{plan}");
            match top_n {
                Some((order_by, limit)) => {
                    assert!(
                        plan.contains(&format!("Shard Order By: {order_by}"))
                            && plan
                                .lines()
                                .any(|l| l.trim() == format!("Shard Limit: {limit}")),
                        "{literal} through {entry}:\n{plan}"
                    );
                    // Each shard returned at most its top limit + offset.
                    let analyzed = explain(
                        &mut db,
                        "ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF",
                        &literal,
                    );
                    let most = limit.parse::<usize>().unwrap() * SHARDS as usize;
                    assert!(
                        scan_rows(&analyzed) <= most,
                        "{literal} through {entry}:\n{analyzed}"
                    );
                }
                None => assert!(
                    !plan.contains("Shard Order By") && !plan.contains("Shard Limit"),
                    "{literal} through {entry}:\n{plan}"
                ),
            }
        }

        // A generic plan: LIMIT $1 OFFSET $2 pushed and read at execution; a parameter in the
        // filter is not shipped, so nothing is pushed.
        db.batch_execute(
            "SET plan_cache_mode = force_generic_plan;
             PREPARE topn(bigint, bigint) AS
               SELECT k, x FROM kv ORDER BY x NULLS FIRST, k LIMIT $1 OFFSET $2;
             PREPARE filtered(int, bigint) AS
               SELECT k, n FROM kv WHERE n > $1 ORDER BY n, k LIMIT $2;",
        )
        .unwrap();
        let plan = explain(&mut db, "VERBOSE, COSTS OFF", "EXECUTE topn(9, 4)");
        assert!(
            plan.contains("Shard Order By: x ASC NULLS FIRST, k ASC NULLS LAST")
                && plan.contains("Shard Limit: $1 + $2"),
            "generic plan through {entry}:\n{plan}"
        );
        let analyzed = explain(
            &mut db,
            "ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF",
            "EXECUTE topn(9, 4)",
        );
        assert!(
            scan_rows(&analyzed) <= 13 * SHARDS as usize,
            "generic plan through {entry}:\n{analyzed}"
        );
        let plan = explain(&mut db, "VERBOSE, COSTS OFF", "EXECUTE filtered(90, 6)");
        assert!(
            plan.contains("RemusShardScan") && !plan.contains("Shard Order By"),
            "generic plan with a parameter in the filter through {entry}:\n{plan}"
        );
    }
}
