//! FOREIGN KEY constraints of distributed and reference tables (issue 18 item 3;
//! `pg_remus/src/ddl/foreign_key.rs`, decision 0021): between co-located tables on the shard
//! key and to reference tables, added from any node, enforced on every shard through any node,
//! carried by a migrated shard group, all or nothing across a crash; the other forms refused.

use integration::recovery::wait_recovered;
use integration::shards::{owners, value_on_every_node};
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

const SCHEMA: &str = "
CREATE TABLE warehouse (w_id int PRIMARY KEY, name text);
CREATE TABLE district (w_id int, d_id int, name text, PRIMARY KEY (w_id, d_id));
CREATE TABLE orders (w_id int, o_id int, d_id int, i_id int, PRIMARY KEY (w_id, o_id));
CREATE TABLE other (w_id int, x int, PRIMARY KEY (w_id, x));
CREATE TABLE item (i_id int PRIMARY KEY, name text);
CREATE TABLE apart (k int PRIMARY KEY);
INSERT INTO warehouse SELECT g, 'w' || g FROM generate_series(1, 12) g;
INSERT INTO district SELECT w, d, 'd' FROM generate_series(1, 12) w, generate_series(1, 3) d;
INSERT INTO item SELECT g, 'i' || g FROM generate_series(1, 20) g;
INSERT INTO orders SELECT w, w * 10 + d, d, d FROM generate_series(1, 12) w, generate_series(1, 3) d;
SELECT remus_create_distributed_table('warehouse', 'w_id', 6);
SELECT remus_create_distributed_table('district', 'w_id', 6, 'warehouse');
SELECT remus_create_distributed_table('orders', 'w_id', 6, 'warehouse');
SELECT remus_create_distributed_table('other', 'w_id', 6, 'warehouse');
SELECT remus_create_distributed_table('apart', 'k', 4);
SELECT remus_create_reference_table('item');";

/// On every node: `name`'s constraint on the shell `table` (validated) and on each shard table
/// of `table` the node holds, each referencing the shard table of `referenced` with the same
/// shard index (or the reference table's one shard). Returns per node how many shard tables
/// carry it, after checking that every shard table of the node does.
fn constraint_everywhere(c: &TestCluster, table: &str, name: &str, referenced: &str) -> Vec<i64> {
    value_on_every_node(
        c,
        "WITH a AS (SELECT $1::text AS t, $2::text AS name, $3::text AS r),
         shard AS (
           SELECT s.shard_id, s.shard_index,
                  to_regclass(format('remus_shards.%I', a.t || '_' || s.shard_id)) AS rel
             FROM remus.shards s, a WHERE s.logicalrelid = a.t::regclass)
         SELECT CASE
           WHEN NOT EXISTS (SELECT FROM pg_constraint, a WHERE conrelid = a.t::regclass
                              AND conname = a.name AND contype = 'f' AND convalidated
                              AND confrelid = a.r::regclass) THEN -1
           WHEN EXISTS (SELECT FROM shard WHERE rel IS NOT NULL AND NOT EXISTS (
                  SELECT FROM pg_constraint k
                   CROSS JOIN a
                   JOIN remus.shards rs ON rs.logicalrelid = a.r::regclass
                   JOIN remus.distributed_tables rd ON rd.logicalrelid = rs.logicalrelid
                  WHERE k.confrelid = to_regclass(format('remus_shards.%I', a.r || '_' || rs.shard_id))
                    AND k.conrelid = shard.rel AND k.conname = a.name AND k.contype = 'f'
                    AND k.convalidated
                    AND (rd.kind = 'r' OR rs.shard_index = shard.shard_index))) THEN -2
           ELSE (SELECT count(*) FROM shard WHERE rel IS NOT NULL) END",
        &[&table, &name, &referenced],
    )
}

/// [`constraint_everywhere`] of key `name` on `nodes` nodes: validated on every shell and on
/// each of the table's six shard tables, wherever they are; `when` names the moment.
fn assert_held(
    c: &TestCluster,
    table: &str,
    name: &str,
    referenced: &str,
    nodes: usize,
    when: &str,
) {
    let held = constraint_everywhere(c, table, name, referenced);
    assert_eq!(held.len(), nodes, "{name} {when}: {held:?}");
    assert!(held.iter().all(|n| *n >= 0), "{name} {when}: {held:?}");
    assert_eq!(held.iter().sum::<i64>(), 6, "{name} {when}: {held:?}");
}

/// The three keys the first test adds, each held as [`assert_held`] checks.
fn keys_held_everywhere(c: &TestCluster, nodes: usize, when: &str) {
    for (table, name, referenced) in [
        ("district", "district_w_id_fkey", "warehouse"),
        ("orders", "orders_district", "district"),
        ("orders", "orders_item", "item"),
    ] {
        assert_held(c, table, name, referenced, nodes, when);
    }
}

/// How many constraints named `name` exist on any table of any node (shells and shards).
fn anywhere(c: &TestCluster, name: &str) -> i64 {
    value_on_every_node::<i64>(
        c,
        "SELECT count(*) FROM pg_constraint WHERE conname = $1",
        &[&name],
    )
    .into_iter()
    .sum()
}

fn error_of(db: &mut postgres::Client, sql: &str) -> String {
    let e = db
        .batch_execute(sql)
        .expect_err(&format!("{sql}: should fail"));
    sqlstate(&e)
}

#[test]
fn foreign_keys_between_co_located_tables_and_to_reference_tables() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(SCHEMA).unwrap();
    let mut n2 = c.connect("n2").unwrap();
    let mut n3 = c.connect("n3").unwrap();

    // Added through different nodes; the unnamed one gets PostgreSQL's name everywhere.
    n2.batch_execute(
        "ALTER TABLE district ADD FOREIGN KEY (w_id) REFERENCES warehouse (w_id) ON DELETE CASCADE",
    )
    .unwrap();
    n3.batch_execute(
        "ALTER TABLE orders ADD CONSTRAINT orders_district
             FOREIGN KEY (w_id, d_id) REFERENCES district (w_id, d_id);
         ALTER TABLE orders ADD CONSTRAINT orders_item FOREIGN KEY (i_id) REFERENCES item",
    )
    .unwrap();
    keys_held_everywhere(&c, 3, "after they were added");

    // Enforced on the shards, through owners and non-owners of the rows' shards.
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        assert_eq!(
            error_of(
                &mut db,
                "INSERT INTO district VALUES (99, 1, 'no warehouse')"
            ),
            "23503",
            "through {n}"
        );
        assert_eq!(
            error_of(&mut db, "INSERT INTO orders VALUES (1, 900, 1, 999)"),
            "23503",
            "through {n}: no such item"
        );
        assert_eq!(
            error_of(&mut db, "INSERT INTO orders VALUES (1, 901, 7, 1)"),
            "23503",
            "through {n}: no such district"
        );
        assert_eq!(
            error_of(&mut db, "DELETE FROM item WHERE i_id = 1"),
            "23503",
            "through {n}: item 1 is ordered"
        );
    }
    n2.batch_execute("INSERT INTO orders VALUES (2, 900, 2, 20)")
        .unwrap();
    // ON DELETE CASCADE on the shard: the warehouse's districts go with it (its orders are
    // deleted first: they reference the districts with NO ACTION).
    n3.batch_execute("DELETE FROM orders WHERE w_id = 5; DELETE FROM warehouse WHERE w_id = 5")
        .unwrap();
    let left: i64 = n1
        .query_one("SELECT count(*) FROM district WHERE w_id = 5", &[])
        .unwrap()
        .get(0);
    assert_eq!(left, 0);

    // Refused with 0A000 before anything ran.
    for refused in [
        "ALTER TABLE orders ADD FOREIGN KEY (w_id) REFERENCES apart (k)",
        "ALTER TABLE orders ADD FOREIGN KEY (w_id, o_id) REFERENCES other (x, w_id)",
        "ALTER TABLE orders ADD FOREIGN KEY (i_id) REFERENCES item ON DELETE CASCADE",
        "ALTER TABLE item ADD FOREIGN KEY (i_id) REFERENCES warehouse (w_id)",
        "ALTER TABLE district ADD FOREIGN KEY (w_id) REFERENCES warehouse ON DELETE SET NULL",
        "CREATE TABLE local_orders (w_id int REFERENCES warehouse (w_id))",
    ] {
        assert_eq!(error_of(&mut n2, refused), "0A000", "{refused}");
    }
    n1.batch_execute("CREATE TABLE plain (k int PRIMARY KEY)")
        .unwrap();
    assert_eq!(
        error_of(
            &mut n1,
            "ALTER TABLE plain ADD FOREIGN KEY (k) REFERENCES warehouse (w_id)"
        ),
        "0A000"
    );
    // Rows that break it: PostgreSQL's 23503 on a shard, and the constraint nowhere.
    n1.batch_execute("INSERT INTO other VALUES (3, 77)")
        .unwrap();
    assert_eq!(
        error_of(
            &mut n1,
            "ALTER TABLE other ADD CONSTRAINT other_district FOREIGN KEY (w_id, x) REFERENCES district (w_id, d_id)"
        ),
        "23503"
    );
    assert_eq!(anywhere(&c, "other_district"), 0);

    // A shard group moved afterwards carries the keys, validated, and enforces them there.
    let mut db = c.connect("n1").unwrap();
    let (shard, from) = owners(&c, "warehouse")[0].clone();
    let to = c.node_names().into_iter().find(|n| *n != from).unwrap();
    let squall = db
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, $2, 'squall')",
            &[&shard, &to],
        )
        .expect_err("squall refuses a group with foreign keys");
    assert_eq!(sqlstate(&squall), "0A000", "{squall:?}");
    integration::shards::move_shard(&mut db, shard, &to);
    keys_held_everywhere(&c, 3, "after the move");
    let moved_w: i32 = c
        .connect(&to)
        .unwrap()
        .query_one(
            &format!("SELECT min(w_id) FROM remus_shards.warehouse_{shard}"),
            &[],
        )
        .unwrap()
        .get(0);
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        assert_eq!(
            error_of(
                &mut db,
                &format!("INSERT INTO orders VALUES ({moved_w}, 903, 9, 1)")
            ),
            "23503",
            "through {n}: no such district on the moved shard"
        );
    }

    // A node added afterwards gets the keys on its shells and on its copy of the reference
    // table, and a group moved to it carries them.
    let n4 = c.add_node().expect("remusctl cluster add-node");
    let (shard4, _) = owners(&c, "warehouse")[1].clone();
    let status: String = db
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, $2)",
            &[&shard4, &n4],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded");
    keys_held_everywhere(&c, 4, &format!("with {n4} added"));
    assert_eq!(
        error_of(
            &mut c.connect(&n4).unwrap(),
            "INSERT INTO orders VALUES (1, 904, 1, 999)"
        ),
        "23503"
    );

    // Renamed and dropped everywhere.
    n2.batch_execute("ALTER TABLE orders RENAME CONSTRAINT orders_item TO orders_item_ref")
        .unwrap();
    assert_held(
        &c,
        "orders",
        "orders_item_ref",
        "item",
        4,
        "after the rename",
    );
    assert_eq!(anywhere(&c, "orders_item"), 0);
    n3.batch_execute("ALTER TABLE orders DROP CONSTRAINT orders_item_ref")
        .unwrap();
    assert_eq!(anywhere(&c, "orders_item_ref"), 0);
    n1.batch_execute("INSERT INTO orders VALUES (1, 902, 1, 999)")
        .unwrap();
    n1.batch_execute("DELETE FROM orders WHERE o_id = 902")
        .unwrap();

    // DROP TABLE … CASCADE of a referenced table drops the keys on every shard too.
    assert_eq!(error_of(&mut n2, "DROP TABLE warehouse"), "2BP01");
    n2.batch_execute("DROP TABLE warehouse CASCADE").unwrap();
    assert_eq!(anywhere(&c, "district_w_id_fkey"), 0);
    let districts: i64 = n3
        .query_one("SELECT count(*) FROM district", &[])
        .unwrap()
        .get(0);
    assert_eq!(districts, 33);
}

/// ADD FOREIGN KEY through a node killed between the two phases of its commit: nowhere after a
/// crash before its own commit, everywhere (shells and shards, validated) after one between
/// its commit and COMMIT PREPARED.
#[test]
fn a_foreign_key_is_added_everywhere_or_nowhere_across_a_crash() {
    let c = TestCluster::start(3).expect("cluster up");
    c.connect("n1").unwrap().batch_execute(SCHEMA).unwrap();
    let ddl = "ALTER TABLE district ADD CONSTRAINT district_warehouse FOREIGN KEY (w_id) REFERENCES warehouse (w_id)";

    let mut victim = c.connect("n2").unwrap();
    victim
        .batch_execute("SET remus.crash_at = 'after_prepare'")
        .unwrap();
    assert!(victim.batch_execute(ddl).is_err(), "the backend lived");
    wait_recovered(&c, "n2");
    assert_eq!(anywhere(&c, "district_warehouse"), 0);

    let mut victim = c.connect("n2").unwrap();
    victim
        .batch_execute("SET remus.crash_at = 'after_local_commit'")
        .unwrap();
    assert!(victim.batch_execute(ddl).is_err(), "the backend lived");
    wait_recovered(&c, "n2");
    assert_held(
        &c,
        "district",
        "district_warehouse",
        "warehouse",
        3,
        "after the crash",
    );
    // Three shells and six shard tables.
    assert_eq!(anywhere(&c, "district_warehouse"), 9);
}
