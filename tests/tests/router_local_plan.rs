//! The router's local fast path (`router::local`): a statement on one shard group this node owns
//! runs as PostgreSQL's own plan on the local shard tables, everything else is routed, and a
//! local plan made before its shard moved is never used after. EXPLAIN shows which: "Local Plan
//! For Shard: <id>" when a local plan was made, and with ANALYZE "Ran: local plan" or
//! "Ran: routed".

use remus_test_support::cluster::TestCluster;

/// EXPLAIN ANALYZE of `sql` on `db`, without costs or timings.
fn explain(db: &mut postgres::Client, sql: &str) -> String {
    integration::protocol::explain(db, "ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF", sql)
}

/// A key of `kv` whose shard `node` owns (`owned`) or does not own, and its shard.
fn key_on(db: &mut postgres::Client, node: &str, owned: bool) -> (i64, i64) {
    key_from(db, node, owned, 1)
}

/// [`key_on`], the smallest such key from `from` on.
fn key_from(db: &mut postgres::Client, node: &str, owned: bool, from: i64) -> (i64, i64) {
    let r = db
        .query_one(
            "SELECT k::bigint, s.shard_id FROM generate_series($3::bigint, $3::bigint + 10000) k
               JOIN remus_shards s ON s.shard_id = remus_shard_id_for('kv', k)
              WHERE (s.node_name = $1) = $2 ORDER BY k LIMIT 1",
            &[&node, &owned, &from],
        )
        .unwrap();
    (r.get(0), r.get(1))
}

/// A 3-node cluster with `kv` over 4 shards holding rows 1..=rows, a session on n1, and a key
/// whose shard n1 owns.
fn four_shards_and_a_key_on_n1(rows: i64) -> (TestCluster, postgres::Client, i64, i64) {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv (k bigint PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0);
         SELECT remus_create_distributed_table('kv', 'k', 4);",
    )
    .unwrap();
    fill(&mut n1, rows);
    let (k, shard) = key_on(&mut n1, "n1", true);
    (c, n1, k, shard)
}

/// Rows 1..=n of `kv`: (k, 'v<k>', 0).
fn fill(db: &mut postgres::Client, n: i64) {
    db.batch_execute(&format!(
        "INSERT INTO kv VALUES {}",
        (1..=n)
            .map(|k| format!("({k}, 'v{k}', 0)"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
    .unwrap();
}

/// `n` of key `k` in `node`'s shard table of `shard`, read there directly.
fn n_in_shard_table(c: &TestCluster, node: &str, shard: i64, k: i64) -> i32 {
    c.connect(node)
        .unwrap()
        .query_one(
            &format!("SELECT n FROM remus_shards.kv_{shard} WHERE k = $1"),
            &[&k],
        )
        .unwrap()
        .get(0)
}

fn n_of(c: &TestCluster, via: &str, k: i64) -> i32 {
    c.connect(via)
        .unwrap()
        .query_one("SELECT n FROM kv WHERE k = $1", &[&k])
        .unwrap()
        .get(0)
}

#[test]
fn statements_on_owned_shards_run_their_local_plan_and_the_rest_is_routed() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv (k bigint PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0);
         CREATE TABLE kv_log (k bigint, id int, note text, PRIMARY KEY (k, id));
         SELECT remus_create_distributed_table('kv', 'k', 8);
         SELECT remus_create_distributed_table('kv_log', 'k', 8, colocate_with => 'kv');",
    )
    .unwrap();
    fill(&mut n1, 200);
    n1.batch_execute(&format!(
        "INSERT INTO kv_log VALUES {}",
        (1..=200)
            .map(|k| format!("({k}, 1, 'note {k}')"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
    .unwrap();

    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let (mine, my_shard) = key_on(&mut db, &name, true);
        let (theirs, _) = key_on(&mut db, &name, false);
        // The first statement on a table finds the backend's shard-map cache empty at plan
        // time: its local plan is made at execution (and the map cached).
        let plan = explain(&mut db, &format!("SELECT v FROM kv WHERE k = {mine}"));
        assert!(
            !plan.contains("Local Plan For Shard") && plan.contains("Ran: local plan"),
            "first statement:\n{plan}"
        );
        let v: String = db
            .query_one("SELECT v FROM kv WHERE k = $1", &[&mine])
            .unwrap()
            .get(0);
        assert_eq!(v, format!("v{mine}"));
        db.query_one("SELECT count(*) FROM kv_log WHERE k = $1", &[&mine])
            .unwrap();

        let plan = explain(&mut db, &format!("SELECT v, n FROM kv WHERE k = {mine}"));
        assert!(
            plan.contains(&format!("Local Plan For Shard: {my_shard}"))
                && plan.contains("Ran: local plan"),
            "a key {name} owns, through {name}:\n{plan}"
        );
        // Planned at plan time, the local plan is the statement's own (decision 0014): EXPLAIN
        // shows the scan of the shard table under the router node.
        assert!(
            plan.contains(&format!(" on kv_{my_shard} (")),
            "the spliced local plan, through {name}:\n{plan}"
        );
        let plan = explain(&mut db, &format!("SELECT v, n FROM kv WHERE k = {theirs}"));
        assert!(
            !plan.contains("Local Plan For Shard") && plan.contains("Ran: routed"),
            "a key {name} does not own, through {name}:\n{plan}"
        );

        // Writes: UPDATE … RETURNING, DELETE, INSERT, ON CONFLICT, each a local plan (decision
        // 0014's amendment: spliced, the write's ModifyTable under the router node).
        let plan = explain(
            &mut db,
            &format!("UPDATE kv SET n = n + 5 WHERE k = {mine} RETURNING n"),
        );
        // Spliced too: the shard table's ModifyTable runs under the router node.
        assert!(
            plan.contains("Ran: local plan") && plan.contains(&format!("Update on kv_{my_shard}")),
            "UPDATE:\n{plan}"
        );
        let n: i32 = db
            .query_one("UPDATE kv SET n = n + 1 WHERE k = $1 RETURNING n", &[&mine])
            .unwrap()
            .get(0);
        assert_eq!(n, 6, "RETURNING of a local UPDATE through {name}");
        for via in c.node_names() {
            assert_eq!(
                n_of(&c, &via, mine),
                6,
                "the local UPDATE seen through {via}"
            );
        }
        let plan = explain(
            &mut db,
            &format!("INSERT INTO kv_log VALUES ({mine}, 2, 'two') ON CONFLICT (k, id) DO UPDATE SET note = 'again'"),
        );
        assert!(
            plan.contains("Ran: local plan") && plan.contains("Insert on kv_log_"),
            "INSERT:\n{plan}"
        );
        assert_eq!(
            db.execute("DELETE FROM kv_log WHERE k = $1 AND id = 2", &[&mine])
                .unwrap(),
            1,
            "DELETE of the row the local INSERT made, through {name}"
        );

        // A co-located join on one key value, ORDER BY and an aggregate: one local plan.
        let sql = format!(
            "SELECT kv.v, count(l.*) FROM kv JOIN kv_log l ON l.k = kv.k WHERE kv.k = {mine} GROUP BY kv.v ORDER BY 1"
        );
        let plan = explain(&mut db, &sql);
        assert!(plan.contains("Ran: local plan"), "join:\n{plan}");
        let r = db.query_one(sql.as_str(), &[]).unwrap();
        assert_eq!(
            (r.get::<_, String>(0), r.get::<_, i64>(1)),
            (format!("v{mine}"), 1)
        );

        // Tables tied by their keys equal to the same value, not by a join on the keys.
        for k in [mine, theirs] {
            let sql = format!(
                "SELECT count(*) FROM kv, kv_log WHERE kv.k = {k} AND kv_log.k = {k} AND kv_log.id = 1"
            );
            let plan = explain(&mut db, &sql);
            assert!(
                plan.contains("Custom Scan (RemusRouter)") && !plan.contains("RemusShardScan"),
                "{sql} through {name} runs whole on its shard group:\n{plan}"
            );
            let n: i64 = db.query_one(sql.as_str(), &[]).unwrap().get(0);
            assert_eq!(n, 1, "{sql} through {name}");
        }

        // Parameters: a prepared statement's generic plan (from the sixth execution on) makes
        // its local plan at execution, once per shard, and runs it in its own executor; a key
        // elsewhere is routed.
        db.batch_execute("PREPARE get(bigint) AS SELECT n FROM kv WHERE k = $1")
            .unwrap();
        for _ in 0..7 {
            db.batch_execute(&format!("EXECUTE get({mine}); EXECUTE get({theirs})"))
                .unwrap();
        }
        // It runs in the statement's own executor (decision 0014): EXPLAIN shows its scan of
        // the shard's index under the router node.
        let plan = explain(&mut db, &format!("EXECUTE get({mine})"));
        assert!(
            plan.contains("Ran: local plan") && plan.contains(&format!("kv_{my_shard}_pkey")),
            "EXECUTE, owned key:\n{plan}"
        );
        let plan = explain(&mut db, &format!("EXECUTE get({theirs})"));
        assert!(plan.contains("Ran: routed"), "EXECUTE, other key:\n{plan}");
        let stmt = db.prepare("SELECT n FROM kv WHERE k = $1").unwrap();
        for _ in 0..8 {
            assert_eq!(db.query_one(&stmt, &[&mine]).unwrap().get::<_, i32>(0), 6);
            assert_eq!(db.query_one(&stmt, &[&theirs]).unwrap().get::<_, i32>(0), 0);
        }
        db.batch_execute("DEALLOCATE get").unwrap();

        // PL/pgSQL: its statements' plans are generic after a few calls, with the key a
        // parameter chosen at each execution; owned and other keys alike, one transaction.
        db.batch_execute(
            "CREATE OR REPLACE FUNCTION bump_twice(key bigint) RETURNS int LANGUAGE plpgsql AS $$
             DECLARE r int;
             BEGIN
                 UPDATE kv SET n = n + 1 WHERE k = key;
                 UPDATE kv SET n = n + 1 WHERE k = key RETURNING n INTO r;
                 PERFORM 1 FROM kv WHERE k = key FOR UPDATE;
                 RETURN r - (SELECT n FROM kv WHERE k = key);
             END $$",
        )
        .unwrap();
        for _ in 0..8 {
            for key in [mine, theirs] {
                let d: i32 = db
                    .query_one("SELECT bump_twice($1)", &[&key])
                    .unwrap()
                    .get(0);
                assert_eq!(
                    d, 0,
                    "a function's own writes are visible to it through {name}"
                );
            }
        }
        assert_eq!(
            n_of(&c, &name, mine),
            6 + 16,
            "PL/pgSQL writes on an owned key"
        );
        assert_eq!(
            n_of(&c, &name, theirs),
            16,
            "PL/pgSQL writes on another node's key"
        );
        db.batch_execute(&format!(
            "UPDATE kv SET n = 6 WHERE k = {mine}; UPDATE kv SET n = 0 WHERE k = {theirs}"
        ))
        .unwrap();

        // A read through a non-owner inside a transaction sees that transaction's own write
        // there (it joins the remote transaction, it is not a transaction of its own).
        db.batch_execute(&format!("BEGIN; UPDATE kv SET n = 99 WHERE k = {theirs}"))
            .unwrap();
        assert_eq!(
            db.query_one("SELECT n FROM kv WHERE k = $1", &[&theirs])
                .unwrap()
                .get::<_, i32>(0),
            99
        );
        db.batch_execute("ROLLBACK").unwrap();
        assert_eq!(n_of(&c, &name, theirs), 0, "rolled back through {name}");
        db.batch_execute(&format!("UPDATE kv SET n = 0 WHERE k = {mine}"))
            .unwrap();
    }
}

#[test]
fn a_local_plan_made_before_its_shard_moved_is_not_used_after() {
    let (c, mut n1, k, shard) = four_shards_and_a_key_on_n1(100);
    // Plans with the key as a constant: cached once, each with its local plan.
    let mut s = c.connect("n1").unwrap();
    s.batch_execute(&format!(
        "SELECT n FROM kv WHERE k = {k};
         PREPARE get AS SELECT n FROM kv WHERE k = {k};
         PREPARE bump AS UPDATE kv SET n = n + 1 WHERE k = {k} RETURNING n;"
    ))
    .unwrap();
    for i in 1..=3 {
        let n: i32 = s.query_one("EXECUTE bump", &[]).unwrap().get(0);
        assert_eq!(n, i);
    }
    let plan = explain(&mut s, "EXECUTE get");
    assert!(
        plan.contains(&format!("Local Plan For Shard: {shard}"))
            && plan.contains("Ran: local plan"),
        "before the move:\n{plan}"
    );

    // The shard moves to n2 (its copy on n1 is dropped at the end of the migration).
    integration::shards::move_shard(&mut n1, shard, "n2");

    // The same session, the same prepared statements: routed to n2, nothing lost.
    let n: i32 = s.query_one("EXECUTE get", &[]).unwrap().get(0);
    assert_eq!(
        n, 3,
        "the moved row, read through the old owner's prepared statement"
    );
    let n: i32 = s.query_one("EXECUTE bump", &[]).unwrap().get(0);
    assert_eq!(n, 4);
    let plan = explain(&mut s, "EXECUTE get");
    assert!(plan.contains("Ran: routed"), "after the move:\n{plan}");
    for via in c.node_names() {
        assert_eq!(
            n_of(&c, &via, k),
            4,
            "the write after the move, seen through {via}"
        );
    }
    assert_eq!(
        n_in_shard_table(&c, "n2", shard, k),
        4,
        "the write reached the new owner's shard table"
    );
}

/// SELECT … FOR UPDATE / FOR SHARE on one shard group takes its row locks where the rows are,
/// through the owner (local plan) and through a non-owner (routed), and holds them to the end
/// of the transaction; on several shards it is refused with 0A000.
#[test]
fn select_for_update_on_one_shard_group_locks_the_rows_until_commit() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv (k bigint PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0);
         SELECT remus_create_distributed_table('kv', 'k', 8);",
    )
    .unwrap();
    fill(&mut n1, 50);
    let mut expected = 0;
    for name in c.node_names() {
        let mut locker = c.connect(&name).unwrap();
        for owned in [true, false] {
            let (k, _) = key_on(&mut locker, &name, owned);
            // Warm the map cache, so that an owned key gets its local plan.
            locker
                .query_one("SELECT n FROM kv WHERE k = $1", &[&k])
                .unwrap();
            locker.batch_execute("BEGIN").unwrap();
            let plan = explain(
                &mut locker,
                &format!("SELECT n FROM kv WHERE k = {k} FOR UPDATE"),
            );
            let how = if owned {
                "Ran: local plan"
            } else {
                "Ran: routed"
            };
            assert!(
                plan.contains(how),
                "FOR UPDATE through {name}, owned {owned}:\n{plan}"
            );
            let n: i32 = locker
                .query_one("SELECT n FROM kv WHERE k = $1 FOR UPDATE", &[&k])
                .unwrap()
                .get(0);
            // A writer through a third node waits for the lock.
            let other = c.node_names().into_iter().find(|o| *o != name).unwrap();
            let mut writer = c.connect(&other).unwrap();
            writer
                .batch_execute("SET statement_timeout = '1s'")
                .unwrap();
            let e = writer
                .execute("UPDATE kv SET n = n + 1 WHERE k = $1", &[&k])
                .unwrap_err();
            assert_eq!(
                remus_test_support::sqlstate(&e),
                "57014",
                "the UPDATE through {other} waits for the lock taken through {name}: {e:?}"
            );
            locker
                .execute("UPDATE kv SET n = $2 WHERE k = $1", &[&k, &(n + 10)])
                .unwrap();
            locker.batch_execute("COMMIT").unwrap();
            writer
                .execute("UPDATE kv SET n = n + 1 WHERE k = $1", &[&k])
                .unwrap();
            assert_eq!(n_of(&c, "n1", k), n + 11);
            expected += 1;
        }
    }
    assert_eq!(expected, 6);
    let e = n1
        .query("SELECT n FROM kv WHERE k IN (1, 2, 3) FOR UPDATE", &[])
        .unwrap_err();
    assert_eq!(remus_test_support::sqlstate(&e), "0A000", "{e:?}");
}

/// The execution-time decision, not the plan, says where a statement runs: a cached plan whose
/// local plan was made while this node owned the shard is routed to the new owner once the
/// shard map says so, although the local copy is still here (a simulated flip, data not moved:
/// the new owner has no shard table, so the statement fails there with RM001 instead of reading
/// the stale local copy).
#[test]
fn a_cached_local_plan_is_not_used_once_the_map_names_another_owner() {
    let (c, _n1, k, shard) = four_shards_and_a_key_on_n1(40);
    let mut s = c.connect("n1").unwrap();
    s.batch_execute(&format!(
        "SELECT n FROM kv WHERE k = {k};
         PREPARE get AS SELECT n FROM kv WHERE k = {k};
         PREPARE get_p(bigint) AS SELECT n FROM kv WHERE k = $1;"
    ))
    .unwrap();
    for _ in 0..7 {
        s.batch_execute(&format!("EXECUTE get; EXECUTE get_p({k})"))
            .unwrap();
    }
    for stmt in ["EXECUTE get".to_string(), format!("EXECUTE get_p({k})")] {
        let plan = explain(&mut s, &stmt);
        assert!(plan.contains("Ran: local plan"), "{stmt} before:\n{plan}");
    }
    for name in c.node_names() {
        c.connect(&name)
            .unwrap()
            .batch_execute(&format!(
                "UPDATE remus.shard_map SET node_name = 'n2' WHERE shard_id = {shard};
                 SELECT remus.bump_map_generation();"
            ))
            .unwrap();
    }
    for stmt in ["EXECUTE get".to_string(), format!("EXECUTE get_p({k})")] {
        let e = s.batch_execute(&stmt).unwrap_err();
        assert_eq!(
            remus_test_support::sqlstate(&e),
            "RM001",
            "{stmt} after the map names n2 must be routed there, not read here: {e:?}"
        );
    }
}

/// The plan `sql` (after `setup`) ran as, by `auto_explain` in a psql session on `node`: the
/// executor's own plan, as started (not EXPLAIN's, which keeps the router node), and the rows.
fn executed_plan(c: &TestCluster, node: &str, setup: &str, sql: &str) -> (String, String) {
    use std::io::Write;
    let mut psql = c
        .libpq_command(node, "psql")
        .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psql");
    let script = format!(
        "{setup}
         LOAD 'auto_explain';
         SET auto_explain.log_min_duration = 0;
         SET auto_explain.log_level = notice;
         {sql};"
    );
    psql.stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = psql.wait_with_output().unwrap();
    let notices = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{script}: {notices}");
    (
        notices,
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    )
}

/// A SELECT that execution routes to this node's shard runs as the local plan alone, with no
/// router node above it (decision 0034): a prepared statement's generic plan, a custom plan
/// and a statement with the key as a constant alike. A key elsewhere keeps the router node,
/// and so does the statement under EXPLAIN.
#[test]
fn a_select_routed_here_runs_as_its_local_plan_alone() {
    let (c, mut n1, mine, shard) = four_shards_and_a_key_on_n1(100);
    let (theirs, _) = key_on(&mut n1, "n1", false);
    n1.batch_execute(&format!(
        "UPDATE kv SET n = 7 WHERE k = {mine}; UPDATE kv SET n = 9 WHERE k = {theirs}"
    ))
    .unwrap();
    let local_scan = format!("Index Scan using kv_{shard}_pkey on kv_{shard}");
    let prepare = "PREPARE get(bigint) AS SELECT n FROM kv WHERE k = $1;";
    for mode in ["force_generic_plan", "force_custom_plan"] {
        let setup = format!("SET plan_cache_mode = {mode}; {prepare}");
        let (plan, rows) = executed_plan(&c, "n1", &setup, &format!("EXECUTE get({mine})"));
        assert_eq!(rows, "7", "{mode}, owned key");
        assert!(
            plan.contains(&local_scan) && !plan.contains("RemusRouter"),
            "{mode}, owned key: the local plan alone:\n{plan}"
        );
        let (plan, rows) = executed_plan(&c, "n1", &setup, &format!("EXECUTE get({theirs})"));
        assert_eq!(rows, "9", "{mode}, key on another node");
        assert!(
            plan.contains("Custom Scan (RemusRouter)"),
            "{mode}, key on another node: routed:\n{plan}"
        );
    }
    let (plan, rows) = executed_plan(&c, "n1", "", &format!("SELECT n FROM kv WHERE k = {mine}"));
    assert_eq!(rows, "7", "constant key");
    assert!(
        plan.contains(&local_scan) && !plan.contains("RemusRouter"),
        "constant key: the local plan alone:\n{plan}"
    );
    // EXPLAIN ANALYZE shows the router node and how it ran.
    n1.batch_execute(&format!(
        "SET plan_cache_mode = force_generic_plan; {prepare}"
    ))
    .unwrap();
    let plan = explain(&mut n1, &format!("EXECUTE get({mine})"));
    assert!(
        plan.contains("Custom Scan (RemusRouter)") && plan.contains("Ran: local plan"),
        "EXPLAIN ANALYZE:\n{plan}"
    );
}

/// A write on one shard that execution routes to this node runs as the shard's own
/// ModifyTable plan alone, with no router node above it (decision 0034, amended): an UPDATE, a
/// DELETE and a single-row INSERT, with and without RETURNING, through a prepared statement's
/// generic plan, a custom plan and a constant key. Rows counted and returned are the
/// statement's; a key elsewhere, a multi-row INSERT and EXPLAIN ANALYZE keep the router node.
#[test]
fn a_write_routed_here_runs_as_its_local_plan_alone() {
    let (c, mut n1, mine, shard) = four_shards_and_a_key_on_n1(100);
    let (theirs, _) = key_on(&mut n1, "n1", false);
    let local_update = format!("Update on kv_{shard}");
    let alone = |plan: &str, node: &str, what: &str| {
        assert!(
            plan.contains(node) && !plan.contains("RemusRouter"),
            "{what}: the local plan alone:\n{plan}"
        );
    };
    let prepare = "PREPARE bump(bigint) AS UPDATE kv SET n = n + 1 WHERE k = $1 RETURNING n;
                   PREPARE bump_quiet(bigint) AS UPDATE kv SET n = n + 10 WHERE k = $1;";
    let mut expected = 0;
    for mode in ["force_generic_plan", "force_custom_plan"] {
        let setup = format!("SET plan_cache_mode = {mode}; {prepare}");
        let (plan, rows) = executed_plan(&c, "n1", &setup, &format!("EXECUTE bump({mine})"));
        expected += 1;
        assert_eq!(
            rows,
            expected.to_string(),
            "{mode}: RETURNING of the owned key"
        );
        alone(&plan, &local_update, &format!("{mode}, UPDATE … RETURNING"));
        let (plan, rows) = executed_plan(&c, "n1", &setup, &format!("EXECUTE bump_quiet({mine})"));
        expected += 10;
        assert_eq!(rows, "", "{mode}: no RETURNING");
        alone(&plan, &local_update, &format!("{mode}, UPDATE"));
        assert_eq!(
            n_of(&c, "n2", mine) as i64,
            expected,
            "{mode}: the row, read elsewhere"
        );
        let (plan, rows) = executed_plan(&c, "n1", &setup, &format!("EXECUTE bump({theirs})"));
        assert!(
            plan.contains("Custom Scan (RemusRouter)"),
            "{mode}, key on another node: routed:\n{plan}"
        );
        assert!(!rows.is_empty(), "{mode}: RETURNING of the routed key");
    }
    // A constant key: an INSERT, an UPDATE and a DELETE, each alone on the shard.
    // Keys above the loaded rows (1..=100), for the INSERTs.
    let (new, new_shard) = key_from(&mut n1, "n1", true, 1000);
    let (plan, rows) = executed_plan(
        &c,
        "n1",
        "",
        &format!("INSERT INTO kv VALUES ({new}, 'new', 5) RETURNING n"),
    );
    assert_eq!(rows, "5", "INSERT … RETURNING");
    alone(&plan, &format!("Insert on kv_{new_shard}"), "INSERT");
    let (plan, _) = executed_plan(
        &c,
        "n1",
        "",
        &format!("UPDATE kv SET v = 'changed' WHERE k = {new} AND n = 5"),
    );
    alone(
        &plan,
        &format!("Update on kv_{new_shard}"),
        "UPDATE, constant key",
    );
    let (plan, rows) = executed_plan(
        &c,
        "n1",
        "",
        &format!("DELETE FROM kv WHERE k = {new} RETURNING v"),
    );
    assert_eq!(rows, "changed", "DELETE … RETURNING");
    alone(&plan, &format!("Delete on kv_{new_shard}"), "DELETE");
    // The counts the client is told are the shard's.
    assert_eq!(
        n1.execute("UPDATE kv SET n = n + 100 WHERE k = $1", &[&mine])
            .unwrap(),
        1
    );
    assert_eq!(
        n1.execute("DELETE FROM kv WHERE k = $1", &[&new]).unwrap(),
        0,
        "a deleted row is not deleted twice"
    );
    assert_eq!(n_of(&c, "n3", mine) as i64, expected + 100);
    // A multi-row INSERT is split by shard: the router's.
    let (other, _) = key_from(&mut n1, "n1", false, 1000);
    let (plan, _) = executed_plan(
        &c,
        "n1",
        "",
        &format!("INSERT INTO kv VALUES ({new}, 'a', 1), ({other}, 'b', 2)"),
    );
    assert!(
        plan.contains("Custom Scan (RemusRouter)"),
        "multi-row INSERT: routed:\n{plan}"
    );
    let count: i64 = c
        .connect("n2")
        .unwrap()
        .query_one(
            "SELECT count(*) FROM kv WHERE k = ANY($1)",
            &[&vec![new, other]],
        )
        .unwrap()
        .get(0);
    assert_eq!(count, 2, "both rows of the multi-row INSERT");
    // EXPLAIN ANALYZE shows the router node and how it ran.
    let plan = explain(
        &mut n1,
        &format!("UPDATE kv SET n = n + 1 WHERE k = {mine}"),
    );
    assert!(
        plan.contains("Custom Scan (RemusRouter)") && plan.contains("Ran: local plan"),
        "EXPLAIN ANALYZE:\n{plan}"
    );
    // Off, the router node stays above the same write (remus.enable_local_plan_on_top).
    let (plan, _) = executed_plan(
        &c,
        "n1",
        "SET remus.enable_local_plan_on_top = off;",
        &format!("UPDATE kv SET n = n + 1 WHERE k = {mine}"),
    );
    assert!(
        plan.contains("Custom Scan (RemusRouter)"),
        "setting off: the router node:\n{plan}"
    );
}

/// The values of the first column of every row `sql` (one statement, simple protocol) returns.
fn text_rows(db: &mut postgres::Client, sql: &str) -> Vec<String> {
    db.simple_query(sql)
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or("NULL").to_string()),
            _ => None,
        })
        .collect()
}

/// A statement sent as text with its constants is planned once per shape (decision 0037): its
/// key and the values it writes run as parameters of the shape's plan (auto_explain shows
/// `$1`), with the same rows and counts as before, through the owner and to another node; its
/// other constants stay in the plan, and a statement differing in them gets its own; EXPLAIN,
/// `plan_cache_mode = force_custom_plan` and the setting off keep the constants; a statement
/// without parameters in the extended protocol reads current rows at every execution.
#[test]
fn a_text_statement_is_planned_once_per_shape() {
    let (c, mut n1, mine, shard) = four_shards_and_a_key_on_n1(100);
    let (theirs, _) = key_on(&mut n1, "n1", false);
    let local_scan = format!("Index Scan using kv_{shard}_pkey on kv_{shard}");
    let script = format!(
        "SELECT n FROM kv WHERE k = {mine};
         UPDATE kv SET n = n + 5 WHERE k = {mine};
         UPDATE kv SET n = n + 7 WHERE k = {theirs};
         SELECT n FROM kv WHERE k = {mine};
         SELECT n FROM kv WHERE k = {theirs};
         SELECT v FROM kv WHERE k = {mine} AND n = 5;
         SELECT v FROM kv WHERE k = {mine} AND n = 6;
         SELECT v FROM kv WHERE k = {mine} AND n = 5"
    );
    let expected = |n: i32, m: i32| format!("{n}\n{}\n{}\nv{mine}\nv{mine}", n + 5, m + 7);
    let (plan, rows) = executed_plan(&c, "n1", "", &script);
    assert_eq!(rows, expected(0, 0), "the rows, planned per shape");
    assert!(
        plan.contains(&local_scan) && plan.contains("(k = $1)"),
        "the key is the shape's parameter, on the local shard:\n{plan}"
    );
    assert!(
        plan.contains("n = 5") && plan.contains("n = 6"),
        "other constants stay in the plan:\n{plan}"
    );
    for setup in [
        "SET remus.enable_shape_cache = off;",
        "SET plan_cache_mode = force_custom_plan;",
    ] {
        // Back to n = 0 on both keys, so that the script's rows are the same.
        n1.batch_execute(&format!(
            "UPDATE kv SET n = 0 WHERE k = {mine}; UPDATE kv SET n = 0 WHERE k = {theirs}"
        ))
        .unwrap();
        let (plan, rows) = executed_plan(&c, "n1", setup, &script);
        assert_eq!(rows, expected(0, 0), "{setup} the same rows");
        assert!(
            plan.contains(&local_scan) && !plan.contains("(k = $1)"),
            "{setup} the constants in the plan:\n{plan}"
        );
    }

    // Written values: INSERT, UPDATE and DELETE through the owner and to another node, with
    // the counts the client is told.
    let (new_mine, _) = key_from(&mut n1, "n1", true, 1000);
    let (new_theirs, _) = key_from(&mut n1, "n1", false, 1000);
    let mut s = c.connect("n1").unwrap();
    for (k, what) in [(new_mine, "owned"), (new_theirs, "routed")] {
        for round in 1..=3 {
            let sql = format!("INSERT INTO kv VALUES ({k}, 'r{round}', {round}) RETURNING n");
            assert_eq!(
                text_rows(&mut s, &sql),
                [round.to_string()],
                "{what}: {sql}"
            );
            let sql =
                format!("UPDATE kv SET v = 'u{round}', n = n * 10 WHERE k = {k} RETURNING v, n");
            assert_eq!(
                text_rows(&mut s, &sql),
                [format!("u{round}")],
                "{what}: {sql}"
            );
            assert_eq!(
                n_of(&c, "n3", k),
                round * 10,
                "{what}: the row written, round {round}"
            );
            let deleted = s
                .simple_query(&format!("DELETE FROM kv WHERE k = {k}"))
                .unwrap()
                .into_iter()
                .find_map(|m| match m {
                    postgres::SimpleQueryMessage::CommandComplete(n) => Some(n),
                    _ => None,
                });
            assert_eq!(deleted, Some(1), "{what}: DELETE's count, round {round}");
        }
    }

    // EXPLAIN is planned inside its portal: the constant, as written.
    text_rows(&mut s, &format!("SELECT n FROM kv WHERE k = {mine}"));
    let plan = explain(&mut s, &format!("SELECT n FROM kv WHERE k = {mine}"));
    assert!(
        !plan.contains("(k = $1)"),
        "EXPLAIN keeps the constant:\n{plan}"
    );

    // The extended protocol, a statement without parameters: planned at its Bind and kept by
    // PostgreSQL's plan cache with its own values; every execution reads the current row.
    let get = s
        .prepare(&format!("SELECT n FROM kv WHERE k = {mine}"))
        .unwrap();
    for i in 1..=3 {
        s.batch_execute(&format!("UPDATE kv SET n = {i} WHERE k = {mine}"))
            .unwrap();
        let n: i32 = s.query_one(&get, &[]).unwrap().get(0);
        assert_eq!(n, i, "extended protocol, execution {i}");
        let n: i32 = s
            .query_one(&format!("SELECT n FROM kv WHERE k = {theirs}"), &[])
            .unwrap()
            .get(0);
        assert_eq!(
            n, 7,
            "extended protocol, another node's key (the script's last +7)"
        );
    }
}

/// A shape made while this node owned the shard routes to the new owner once the shard has
/// moved, as a prepared statement does: the owner is decided at every execution.
#[test]
fn a_shape_made_before_its_shard_moved_routes_to_the_new_owner() {
    let (c, mut n1, k, shard) = four_shards_and_a_key_on_n1(100);
    let mut s = c.connect("n1").unwrap();
    let read = format!("SELECT n FROM kv WHERE k = {k}");
    let bump = format!("UPDATE kv SET n = n + 1 WHERE k = {k} RETURNING n");
    assert_eq!(text_rows(&mut s, &read), ["0"]);
    for i in 1..=3 {
        assert_eq!(text_rows(&mut s, &bump), [i.to_string()]);
    }
    integration::shards::move_shard(&mut n1, shard, "n2");
    assert_eq!(text_rows(&mut s, &read), ["3"], "read after the move");
    assert_eq!(text_rows(&mut s, &bump), ["4"], "written after the move");
    assert_eq!(
        n_in_shard_table(&c, "n2", shard, k),
        4,
        "the write reached the new owner's shard table"
    );
}

/// A function replaced, and a table dropped and made again under the same name, make the
/// shape (and the local plan made at execution, prepared statements' too) again: no plan
/// outlives what it was made from.
#[test]
fn a_replaced_function_or_a_new_table_makes_the_shape_again() {
    let (c, mut n1, k, _) = four_shards_and_a_key_on_n1(10);
    n1.batch_execute(
        "CREATE FUNCTION plus(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1 + 1';",
    )
    .unwrap();
    let mut s = c.connect("n1").unwrap();
    s.batch_execute("PREPARE plus_of(bigint) AS SELECT plus(n) FROM kv WHERE k = $1")
        .unwrap();
    // A constant key and a row lock: the router node stays on top of the kept plan.
    s.batch_execute(&format!(
        "PREPARE plus_locked AS SELECT plus(n) FROM kv WHERE k = {k} FOR UPDATE"
    ))
    .unwrap();
    let read = format!("SELECT plus(n) FROM kv WHERE k = {k}");
    let prepared = format!("EXECUTE plus_of({k})");
    let locked = "EXECUTE plus_locked";
    for _ in 0..2 {
        assert_eq!(text_rows(&mut s, &read), ["1"]);
        assert_eq!(text_rows(&mut s, &prepared), ["1"]);
        assert_eq!(text_rows(&mut s, locked), ["1"]);
    }
    n1.batch_execute(
        "CREATE OR REPLACE FUNCTION plus(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1 + 100';",
    )
    .unwrap();
    assert_eq!(
        text_rows(&mut s, &read),
        ["100"],
        "after the function changed"
    );
    assert_eq!(
        text_rows(&mut s, &prepared),
        ["100"],
        "prepared, after the function changed"
    );
    assert_eq!(
        text_rows(&mut s, locked),
        ["100"],
        "prepared with a constant key and a row lock, after the function changed"
    );

    let make = |db: &mut postgres::Client, v: &str| {
        db.batch_execute(&format!(
            "CREATE TABLE kv2 (k bigint PRIMARY KEY, v text NOT NULL);
             SELECT remus_create_distributed_table('kv2', 'k', 4);
             INSERT INTO kv2 VALUES ({k}, '{v}');"
        ))
        .unwrap();
    };
    make(&mut n1, "first");
    let read2 = format!("SELECT v FROM kv2 WHERE k = {k}");
    assert_eq!(text_rows(&mut s, &read2), ["first"]);
    assert_eq!(text_rows(&mut s, &read2), ["first"]);
    n1.batch_execute("DROP TABLE kv2").unwrap();
    make(&mut n1, "second");
    assert_eq!(
        text_rows(&mut s, &read2),
        ["second"],
        "the table made again"
    );
}

/// A join kept with its plan (a prepared statement's generic plan, a text statement's shape)
/// and routed to another node runs again and again: its deparse no longer rebuilds the kept
/// Query's join alias list in the execution's memory (which made the second execution fail with
/// XX000 "unrecognized node type" or crash, before 4ac55c7).
#[test]
fn a_kept_join_routed_to_another_node_runs_at_every_execution() {
    let (c, mut n1, _, _) = four_shards_and_a_key_on_n1(100);
    n1.batch_execute(
        "CREATE TABLE kv_log (k bigint, id int, note text, PRIMARY KEY (k, id));
         SELECT remus_create_distributed_table('kv_log', 'k', 4, colocate_with => 'kv');",
    )
    .unwrap();
    let (a, _) = key_on(&mut n1, "n1", false);
    let (b, _) = key_from(&mut n1, "n1", false, a + 1);
    n1.batch_execute(&format!(
        "INSERT INTO kv_log VALUES ({a}, 1, 'a'), ({b}, 1, 'b')"
    ))
    .unwrap();
    let mut s = c.connect("n1").unwrap();
    let join = "SELECT l.note FROM kv JOIN kv_log l ON l.k = kv.k WHERE kv.k =";
    s.batch_execute(&format!(
        "SET plan_cache_mode = force_generic_plan; PREPARE j(bigint) AS {join} $1"
    ))
    .unwrap();
    for (k, note) in [(a, "a"), (b, "b"), (a, "a"), (b, "b")] {
        assert_eq!(
            text_rows(&mut s, &format!("EXECUTE j({k})")),
            [note],
            "prepared, key {k}"
        );
        assert_eq!(
            text_rows(&mut s, &format!("{join} {k}")),
            [note],
            "text statement, key {k}"
        );
    }
}
