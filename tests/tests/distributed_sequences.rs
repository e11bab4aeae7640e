//! Sequences on distributed tables (issue 18 item 4, decision 0019): a `bigserial` or bigint
//! identity column of a distributed table draws cluster-unique values through any node; each
//! node's copy of the sequence hands out its own range (`pg_remus/src/distribute/sequences.rs`),
//! and a key drawn from its default is drawn once where the statement entered, then routed with
//! the value (`pg_remus/src/router/modify.rs`, `with_key_drawn`; COPY fills it in
//! `router/utility.rs`); so is every identity value (`with_identities_drawn`).
//!
//! - `bigserial_draws_unique_values_through_every_node`: 3 nodes; a table with a bigserial key
//!   and a bigserial non-key column, with rows from before it was distributed. Through every
//!   node: one-row INSERT, multi-row VALUES, DEFAULT among explicit keys, RETURNING, a prepared
//!   statement run past the switch to its generic plan, and COPY without the key column. Every
//!   key and every non-key value is distinct; each key drawn through node `nK` is in that node's
//!   range; RETURNING gives the row that was written; each row is found by the routed SELECT by
//!   its key through every node and lies in the shard table `remus_shard_id_for` names, on its
//!   owner; the sequence exists on every node, restricted to the node's range; a multi-row
//!   INSERT naming its columns out of the table's order puts each value in its column; any
//!   other volatile key is still refused (0A000).
//! - `serial_smallserial_and_int_identity_are_refused`: serial, smallserial, int and smallint
//!   identities and an int sequence: 0A000 naming the column, nothing left distributed, and the
//!   table still usable locally; an identity column on a reference table likewise.
//! - `application_role_needs_usage_on_the_sequences`: a role granted INSERT, SELECT and USAGE on
//!   the sequences before distribution inserts with the defaults through every node (one row,
//!   several, COPY); a role granted INSERT and SELECT only gets PostgreSQL's 42501 for the
//!   sequence, and after one `GRANT USAGE ON SEQUENCE` through n2 (propagated to every node,
//!   `router/grant.rs`) inserts too; a GRANT naming such a sequence and another is refused.
//! - `identity_columns_draw_unique_values_through_every_node`: 3 nodes; `ida` (key GENERATED
//!   ALWAYS AS IDENTITY, another column BY DEFAULT) and `idd` (the other way round), with rows
//!   from before. Every node's shell has both identities, each sequence restricted to the node's
//!   range; no shard table has an identity or a sequence. Through every node: one row, DEFAULT,
//!   several rows, several rows all DEFAULT, a prepared statement past the generic-plan switch,
//!   COPY: both values of every row drawn in the inserting node's range, all distinct, RETURNING
//!   the stored row, each row in its shard. An explicit value for an ALWAYS column is 428C9
//!   (one row, several, a parameter), taken with OVERRIDING SYSTEM VALUE; BY DEFAULT takes one;
//!   OVERRIDING USER VALUE draws instead. A GRANT on an identity's sequence through n2 reaches
//!   every node. ALTER … SET GENERATED / RESTART / DROP IDENTITY / ADD GENERATED and ADD COLUMN
//!   … GENERATED AS IDENTITY are refused (0A000); DROP TABLE through n3 drops the sequences on
//!   every node.
//! - `identity_after_migration_and_on_a_new_node`: 2 nodes, `ida` distributed; n3 added
//!   (`remus_activate_node`) gets the shell's identities in slot 3; a shard moved from n1 to n3
//!   has a shard table without identity there; rows through all three nodes (the moved shard's
//!   included) have both values in the inserting node's range; multi-row and COPY through n3;
//!   all distinct, every row in its shard.
//! - `moved_shard_keeps_drawing_unique_values`: 2 nodes; a shard moved from n1 to n2
//!   (`remus_migrate_shard`) takes rows again through both nodes, its non-key default now drawn
//!   from n2's range; every value still distinct and every row in its shard.

use std::collections::HashSet;
use std::io::Write;

use integration::roles::{connect_as, Role};
use integration::shards::owners;
use postgres::Client;
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

/// Low bits of a node's range: node `nK` (slot K, nodes sorted by name) draws from
/// `[K << 48, (K + 1) << 48)`.
const SLOT_BITS: u32 = 48;

const TABLE: &str =
    "CREATE TABLE orders (id bigserial PRIMARY KEY, note text NOT NULL, seq bigserial NOT NULL)";

/// The slot of node `n1`, `n2`, …: its number.
fn slot(node: &str) -> i64 {
    node.trim_start_matches('n').parse().unwrap()
}

/// Inserts rows through `db` in every form (notes prefixed with `tag`); the `(id, note)` pairs
/// RETURNING gave.
fn insert_every_form(db: &mut Client, tag: &str) -> Vec<(i64, String)> {
    let mut got = Vec::new();
    let mut take = |rows: Vec<postgres::Row>| {
        for r in rows {
            got.push((r.get::<_, i64>(0), r.get::<_, String>(1)));
        }
    };
    // One row, the key omitted.
    take(
        db.query(
            "INSERT INTO orders (note) VALUES ($1) RETURNING id, note",
            &[&format!("{tag}-one")],
        )
        .unwrap(),
    );
    // One row in the simple protocol, the key written DEFAULT.
    db.batch_execute(&format!(
        "INSERT INTO orders (id, note) VALUES (DEFAULT, '{tag}-default')"
    ))
    .unwrap();
    // Several rows, the key omitted.
    take(
        db.query(
            &format!(
                "INSERT INTO orders (note) VALUES ('{tag}-m1'), ('{tag}-m2'), ('{tag}-m3'), ('{tag}-m4') \
                 RETURNING id, note"
            ),
            &[],
        )
        .unwrap(),
    );
    // Several rows, DEFAULT next to explicit keys (columns listed out of order).
    let base = slot_base_free(tag);
    take(
        db.query(
            &format!(
                "INSERT INTO orders (note, id) VALUES ('{tag}-d1', DEFAULT), ('{tag}-x1', {base}), \
                 ('{tag}-d2', DEFAULT) RETURNING id, note"
            ),
            &[],
        )
        .unwrap(),
    );
    // A prepared statement, past PostgreSQL's switch to a generic plan.
    let st = db
        .prepare("INSERT INTO orders (note) VALUES ($1) RETURNING id, note")
        .unwrap();
    for i in 0..8 {
        take(db.query(&st, &[&format!("{tag}-p{i}")]).unwrap());
    }
    let st = db
        .prepare("INSERT INTO orders (note) VALUES ($1), ($2) RETURNING id, note")
        .unwrap();
    for i in 0..7 {
        take(
            db.query(&st, &[&format!("{tag}-pa{i}"), &format!("{tag}-pb{i}")])
                .unwrap(),
        );
    }
    // COPY without the key (nor the non-key sequence column).
    let mut w = db.copy_in("COPY orders (note) FROM STDIN").unwrap();
    for i in 0..20 {
        writeln!(w, "{tag}-c{i}").unwrap();
    }
    assert_eq!(w.finish().unwrap(), 20);
    got
}

/// An explicit key for `tag`'s rows that no sequence hands out (slot 0, above the rows written
/// before distribution).
fn slot_base_free(tag: &str) -> i64 {
    1_000_000 + slot(tag) * 1000
}

/// Every row of `orders` as the routed SELECT over every shard sees it through `db`:
/// `(id, note, seq)`.
fn all_rows(db: &mut Client) -> Vec<(i64, String, i64)> {
    db.query("SELECT id, note, seq FROM orders", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Checks that every row of `orders` lies in the shard table `remus_shard_id_for` names, read
/// on its owner, and that the shard tables hold exactly `expected` rows together.
fn rows_in_their_shards(c: &TestCluster, expected: usize) {
    rows_of_in_their_shards(c, "orders", expected);
}

/// [`rows_in_their_shards`] for `table`, whose key is `id`.
fn rows_of_in_their_shards(c: &TestCluster, table: &str, expected: usize) {
    let mut total = 0;
    for (shard, owner) in owners(c, table) {
        let mut db = c.connect(&owner).unwrap();
        let rows = db
            .query(
                &format!(
                    "SELECT id, remus_shard_id_for('{table}', id) FROM remus_shards.{table}_{shard}"
                ),
                &[],
            )
            .unwrap();
        for r in &rows {
            let (id, want): (i64, i64) = (r.get(0), r.get(1));
            assert_eq!(want, shard, "{table}: row {id} in shard {shard} on {owner}");
        }
        total += rows.len();
    }
    assert_eq!(total, expected, "{table}: rows in the shard tables");
}

/// Checks that keys and non-key values are all distinct, `count` rows.
fn all_distinct(rows: &[(i64, String, i64)], count: usize) {
    assert_eq!(rows.len(), count);
    let ids: HashSet<i64> = rows.iter().map(|r| r.0).collect();
    let seqs: HashSet<i64> = rows.iter().map(|r| r.2).collect();
    assert_eq!(ids.len(), count, "distinct keys");
    assert_eq!(seqs.len(), count, "distinct non-key sequence values");
}

#[test]
fn bigserial_draws_unique_values_through_every_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(&format!(
        "{TABLE};
         INSERT INTO orders (note) VALUES ('before-1'), ('before-2'), ('before-3');
         SELECT remus_create_distributed_table('orders', 'id', 6);"
    ))
    .unwrap();
    // Each node's copy of each sequence, restricted to its range.
    for n in c.node_names() {
        let rows = c
            .connect(&n)
            .unwrap()
            .query(
                "SELECT sequencename::text, min_value, max_value FROM pg_sequences
                  WHERE sequencename IN ('orders_id_seq', 'orders_seq_seq') ORDER BY 1",
                &[],
            )
            .unwrap();
        assert_eq!(rows.len(), 2, "both sequences on {n}");
        for r in rows {
            let (min, max): (i64, i64) = (r.get(1), r.get(2));
            assert_eq!(min, slot(&n) << SLOT_BITS, "{n}");
            assert_eq!(max, ((slot(&n) + 1) << SLOT_BITS) - 1, "{n}");
        }
    }

    let mut returned = Vec::new();
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        let got = insert_every_form(&mut db, &n);
        for (id, note) in &got {
            // Drawn through this node: in its range; the explicit key is its own.
            if *id != slot_base_free(&n) {
                assert_eq!(id >> SLOT_BITS, slot(&n), "{note}: {id} drawn through {n}");
            }
        }
        returned.extend(got);
    }
    // Per node: 1 + 1 + 4 + 3 + 8 + 14 + 20 rows; plus the 3 from before.
    let per_node = 51;
    let count = 3 + 3 * per_node;
    let rows = all_rows(&mut n1);
    all_distinct(&rows, count);
    // The rows from before kept their keys (slot 0).
    for k in 1..=3i64 {
        assert!(rows
            .iter()
            .any(|r| r.0 == k && r.1 == format!("before-{k}")));
    }
    // RETURNING gave the row that was written, found by its key through every node.
    let mut dbs: Vec<Client> = c
        .node_names()
        .iter()
        .map(|n| c.connect(n).unwrap())
        .collect();
    for (i, (id, note)) in returned.iter().enumerate() {
        let db = &mut dbs[i % 3];
        let found: Vec<String> = db
            .query("SELECT note FROM orders WHERE id = $1", &[id])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(found, vec![note.clone()], "row {id}");
    }
    rows_in_their_shards(&c, count);
    // Each COPY row is there once, with a key drawn through its node.
    for n in c.node_names() {
        for i in 0..20 {
            let note = format!("{n}-c{i}");
            let ids: Vec<i64> = rows.iter().filter(|r| r.1 == note).map(|r| r.0).collect();
            assert_eq!(ids.len(), 1, "{note}");
            assert_eq!(ids[0] >> SLOT_BITS, slot(&n), "{note}");
        }
    }
    // A multi-row INSERT naming its columns out of the table's order, two of them bigint: each
    // value in its own column (the shards' statements list the columns in the VALUES order).
    n1.batch_execute(
        "INSERT INTO orders (seq, id, note) VALUES (5, 10, 'swap-a'), (6, 11, 'swap-b'), (7, 12, 'swap-c')",
    )
    .unwrap();
    for (id, seq, note) in [
        (10i64, 5i64, "swap-a"),
        (11, 6, "swap-b"),
        (12, 7, "swap-c"),
    ] {
        let r = dbs[1]
            .query_one("SELECT seq, note FROM orders WHERE id = $1", &[&id])
            .unwrap();
        assert_eq!(
            (r.get::<_, i64>(0), r.get::<_, String>(1)),
            (seq, note.to_string())
        );
    }
    // Other volatile keys stay refused.
    let e = n1
        .batch_execute("INSERT INTO orders (id, note) VALUES ((random() * 10)::bigint, 'r')")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "0A000", "{e:?}");
}

#[test]
fn serial_smallserial_and_int_identity_are_refused() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    for (table, ddl, column) in [
        (
            "s4",
            "CREATE TABLE s4 (id serial PRIMARY KEY, v text)",
            "id",
        ),
        (
            "s2",
            "CREATE TABLE s2 (id bigint PRIMARY KEY, n smallserial)",
            "n",
        ),
        (
            "s8",
            "CREATE TABLE s8 (id bigint PRIMARY KEY, n int GENERATED BY DEFAULT AS IDENTITY)",
            "n",
        ),
        (
            "s9",
            "CREATE TABLE s9 (id smallint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text)",
            "id",
        ),
        (
            "s3",
            "CREATE SEQUENCE s3_seq AS integer;
             CREATE TABLE s3 (id bigint PRIMARY KEY DEFAULT nextval('s3_seq'), v text)",
            "id",
        ),
    ] {
        n1.batch_execute(ddl).unwrap();
        let e = n1
            .batch_execute(&format!(
                "SELECT remus_create_distributed_table('{table}', 'id')"
            ))
            .unwrap_err();
        assert_eq!(sqlstate(&e), "0A000", "{table}: {e:?}");
        let msg = e.as_db_error().unwrap().message().to_string();
        assert!(
            msg.contains(&format!("column {column} of public.{table}")),
            "{table}: {msg}"
        );
        // Nothing distributed, nowhere; the table still a plain table here.
        for n in c.node_names() {
            let known: i64 = c
                .connect(&n)
                .unwrap()
                .query_one(
                    "SELECT count(*) FROM remus_shards WHERE table_name = $1",
                    &[&table],
                )
                .unwrap()
                .get(0);
            assert_eq!(known, 0, "{table} on {n}");
        }
        n1.batch_execute(&format!("INSERT INTO {table} (id) VALUES (1)"))
            .or_else(|_| n1.batch_execute(&format!("INSERT INTO {table} DEFAULT VALUES")))
            .unwrap();
    }
    let e = n1
        .batch_execute("SELECT remus_create_distributed_table('s4', 'id')")
        .unwrap_err();
    assert!(
        e.as_db_error().unwrap().message().contains("bigserial"),
        "{e:?}"
    );
    // An int identity is told to be bigint.
    let e = n1
        .batch_execute("SELECT remus_create_distributed_table('s8', 'id')")
        .unwrap_err();
    let msg = e.as_db_error().unwrap().message().to_string();
    assert!(
        msg.contains("identity column of type integer") && msg.contains("bigint GENERATED"),
        "{msg}"
    );
    // A reference table with an identity column: every copy would draw its own values.
    n1.batch_execute(
        "CREATE TABLE r8 (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text)",
    )
    .unwrap();
    let e = n1
        .batch_execute("SELECT remus_create_reference_table('r8')")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "0A000", "{e:?}");
    assert!(
        e.as_db_error()
            .unwrap()
            .message()
            .contains("column id of public.r8 is an identity column"),
        "{e:?}"
    );
    for n in c.node_names() {
        let known: i64 = c
            .connect(&n)
            .unwrap()
            .query_one(
                "SELECT count(*) FROM remus_shards WHERE table_name = 'r8'",
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(known, 0, "r8 on {n}");
    }
}

#[test]
fn application_role_needs_usage_on_the_sequences() {
    let c = TestCluster::start(3).expect("cluster up");
    let app = Role::new("app", "app-secret");
    let plain = Role::new("plain", "plain-secret");
    for n in c.node_names() {
        c.connect(&n)
            .unwrap()
            .batch_execute(&format!("{}; {}", app.create_sql(), plain.create_sql()))
            .unwrap();
    }
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(&format!(
        "{TABLE};
         GRANT INSERT, SELECT ON orders TO app, plain;
         GRANT USAGE ON SEQUENCE orders_id_seq, orders_seq_seq TO app;
         SELECT remus_create_distributed_table('orders', 'id', 6);"
    ))
    .unwrap();
    let mut expected = 0;
    for n in c.node_names() {
        let mut db = connect_as(&c, &n, &app).unwrap();
        let id: i64 = db
            .query_one(
                "INSERT INTO orders (note) VALUES ($1) RETURNING id",
                &[&format!("app-{n}")],
            )
            .unwrap()
            .get(0);
        assert_eq!(id >> SLOT_BITS, slot(&n));
        db.batch_execute("INSERT INTO orders (note) VALUES ('a'), ('b'), ('c'), ('d')")
            .unwrap();
        let mut w = db.copy_in("COPY orders (note) FROM STDIN").unwrap();
        w.write_all(b"c1\nc2\nc3\n").unwrap();
        assert_eq!(w.finish().unwrap(), 3);
        expected += 8;

        // Without USAGE on the sequence: PostgreSQL's own refusal, on every form.
        let mut db = connect_as(&c, &n, &plain).unwrap();
        for sql in [
            "INSERT INTO orders (note) VALUES ('p')",
            "INSERT INTO orders (note) VALUES ('p'), ('q'), ('r'), ('s')",
        ] {
            let e = db.batch_execute(sql).unwrap_err();
            assert_eq!(sqlstate(&e), "42501", "{n}: {sql}: {e:?}");
            assert!(
                e.as_db_error().unwrap().message().contains("sequence"),
                "{e:?}"
            );
        }
        let e = db
            .copy_in::<str>("COPY orders (note) FROM STDIN")
            .and_then(|mut w| {
                w.write_all(b"p\n").unwrap();
                w.finish()
            })
            .unwrap_err();
        assert_eq!(sqlstate(&e), "42501", "{n}: COPY: {e:?}");
    }
    // A GRANT on the table's sequences through one node reaches every node.
    c.connect("n2")
        .unwrap()
        .batch_execute("GRANT USAGE ON SEQUENCE orders_id_seq, orders_seq_seq TO plain")
        .unwrap();
    // Naming another sequence with them would grant on one node only: refused.
    n1.batch_execute("CREATE SEQUENCE local_seq").unwrap();
    let e = n1
        .batch_execute("GRANT USAGE ON SEQUENCE orders_id_seq, local_seq TO plain")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "0A000", "{e:?}");
    for n in c.node_names() {
        let mut db = connect_as(&c, &n, &plain).unwrap();
        db.batch_execute("INSERT INTO orders (note) VALUES ('p'), ('q'), ('r'), ('s')")
            .unwrap();
        db.batch_execute("INSERT INTO orders (note) VALUES ('t')")
            .unwrap();
        expected += 5;
    }
    let rows = all_rows(&mut n1);
    all_distinct(&rows, expected);
    rows_in_their_shards(&c, expected);
}

#[test]
fn moved_shard_keeps_drawing_unique_values() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(&format!(
        "{TABLE}; SELECT remus_create_distributed_table('orders', 'id', 4);"
    ))
    .unwrap();
    let mut n2 = c.connect("n2").unwrap();
    // Per node: 51 rows (`insert_every_form`).
    insert_every_form(&mut n1, "n1");
    insert_every_form(&mut n2, "n2");
    let mut count = 2 * 51;
    let moved = owners(&c, "orders")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .map(|(s, _)| s)
        .expect("n1 owns a shard");
    let status: String = n2
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n2')",
            &[&moved],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded");
    // Rows again through both nodes, until the moved shard has taken some of each.
    let mut into_moved = [0usize; 2];
    for round in 0..200 {
        if into_moved.iter().all(|k| *k >= 3) {
            break;
        }
        for (i, db) in [&mut n1, &mut n2].into_iter().enumerate() {
            let r = db
                .query_one(
                    "INSERT INTO orders (note) VALUES ($1)
                     RETURNING id, seq, remus_shard_id_for('orders', id)",
                    &[&format!("after-{round}-{i}")],
                )
                .unwrap();
            count += 1;
            let (id, seq, shard): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
            assert_eq!(
                id >> SLOT_BITS,
                i as i64 + 1,
                "key drawn through n{}",
                i + 1
            );
            if shard == moved {
                into_moved[i] += 1;
                // The non-key default is drawn on the shard's new owner.
                assert_eq!(seq >> SLOT_BITS, 2, "row {id} of the moved shard");
            }
        }
    }
    assert!(into_moved.iter().all(|k| *k >= 3), "{into_moved:?}");
    let rows = all_rows(&mut n1);
    all_distinct(&rows, count);
    rows_in_their_shards(&c, count);
}

/// Two identity tables: `ida` whose key is GENERATED ALWAYS (and `n` BY DEFAULT), `idd` whose key
/// is BY DEFAULT (and `n` ALWAYS). Keyed by `id`.
const IDENTITY_TABLES: &str = "
    CREATE TABLE ida (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text NOT NULL,
                      n bigint GENERATED BY DEFAULT AS IDENTITY);
    CREATE TABLE idd (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, note text NOT NULL,
                      n bigint GENERATED ALWAYS AS IDENTITY)";

/// Inserts rows into identity table `table` through `db` in every form that draws both
/// identities (notes prefixed with `tag`); the `(id, n, note)` triples RETURNING gave.
fn insert_identity_forms(db: &mut Client, table: &str, tag: &str) -> Vec<(i64, i64, String)> {
    let mut got = Vec::new();
    let mut take = |rows: Vec<postgres::Row>| {
        for r in rows {
            got.push((r.get(0), r.get(1), r.get(2)));
        }
    };
    // One row, both omitted.
    take(
        db.query(
            &format!("INSERT INTO {table} (note) VALUES ($1) RETURNING id, n, note"),
            &[&format!("{tag}-one")],
        )
        .unwrap(),
    );
    // One row in the simple protocol, both written DEFAULT (allowed for ALWAYS too).
    db.batch_execute(&format!(
        "INSERT INTO {table} (id, note, n) VALUES (DEFAULT, '{tag}-default', DEFAULT)"
    ))
    .unwrap();
    // Several rows, both omitted.
    take(
        db.query(
            &format!(
                "INSERT INTO {table} (note) VALUES ('{tag}-m1'), ('{tag}-m2'), ('{tag}-m3'), \
                 ('{tag}-m4') RETURNING id, n, note"
            ),
            &[],
        )
        .unwrap(),
    );
    // Several rows, every value of both written DEFAULT (the rewriter then takes the default
    // into the target list and leaves NULLs in the VALUES list), columns out of order.
    take(
        db.query(
            &format!(
                "INSERT INTO {table} (n, note, id) VALUES (DEFAULT, '{tag}-d1', DEFAULT), \
                 (DEFAULT, '{tag}-d2', DEFAULT), (DEFAULT, '{tag}-d3', DEFAULT) RETURNING id, n, note"
            ),
            &[],
        )
        .unwrap(),
    );
    // A prepared statement, past PostgreSQL's switch to a generic plan.
    let st = db
        .prepare(&format!(
            "INSERT INTO {table} (note) VALUES ($1) RETURNING id, n, note"
        ))
        .unwrap();
    for i in 0..8 {
        take(db.query(&st, &[&format!("{tag}-p{i}")]).unwrap());
    }
    // COPY without either.
    let mut w = db
        .copy_in(&format!("COPY {table} (note) FROM STDIN"))
        .unwrap();
    for i in 0..10 {
        writeln!(w, "{tag}-c{i}").unwrap();
    }
    assert_eq!(w.finish().unwrap(), 10);
    got
}

/// Per node and table: 1 + 1 + 4 + 3 + 8 + 10 rows.
const IDENTITY_FORMS_ROWS: usize = 27;

/// Every row of identity table `table` through `db`: `(id, n, note)`.
fn identity_rows(db: &mut Client, table: &str) -> Vec<(i64, i64, String)> {
    db.query(&format!("SELECT id, n, note FROM {table}"), &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Checks, on every node, that no shard table has an identity column or a sequence of its own.
fn shards_have_no_identity(c: &TestCluster) {
    for n in c.node_names() {
        let r = c
            .connect(&n)
            .unwrap()
            .query_one(
                "SELECT (SELECT count(*) FROM pg_attribute a
                           JOIN pg_class t ON t.oid = a.attrelid
                          WHERE t.relnamespace = 'remus_shards'::regnamespace
                            AND a.attidentity <> ''),
                        (SELECT count(*) FROM pg_class
                          WHERE relnamespace = 'remus_shards'::regnamespace AND relkind = 'S'),
                        (SELECT count(*) FROM pg_class
                          WHERE relnamespace = 'remus_shards'::regnamespace AND relkind = 'r')",
                &[],
            )
            .unwrap();
        let (identities, sequences, tables): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
        assert_eq!((identities, sequences), (0, 0), "{n}");
        assert!(tables > 0, "{n} holds shard tables");
    }
}

/// Checks that `table`'s shell on `node` has its identity columns (`id` of `id_kind`, `n` of
/// the other kind), each sequence restricted to slot `slot`.
fn shell_identities(c: &TestCluster, node: &str, table: &str, id_kind: &str, slot: i64) {
    let rows = c
        .connect(node)
        .unwrap()
        .query(
            "SELECT a.attname::text, a.attidentity::text, s.min_value, s.max_value
               FROM pg_attribute a
               JOIN pg_sequences s
                 ON format('%I.%I', s.schemaname, s.sequencename)
                    = pg_get_serial_sequence(a.attrelid::regclass::text, a.attname)
              WHERE a.attrelid = $1::text::regclass AND a.attidentity <> ''
              ORDER BY a.attnum",
            &[&table],
        )
        .unwrap();
    let other = if id_kind == "a" { "d" } else { "a" };
    let got: Vec<(String, String, i64, i64)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let (lo, hi) = (slot << SLOT_BITS, ((slot + 1) << SLOT_BITS) - 1);
    assert_eq!(
        got,
        vec![
            ("id".to_string(), id_kind.to_string(), lo, hi),
            ("n".to_string(), other.to_string(), lo, hi)
        ],
        "{table} on {node}"
    );
}

#[test]
fn identity_columns_draw_unique_values_through_every_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(&format!(
        "{IDENTITY_TABLES};
         INSERT INTO ida (note) VALUES ('before-1'), ('before-2');
         INSERT INTO idd (note) VALUES ('before-1'), ('before-2');
         SELECT remus_create_distributed_table('ida', 'id', 6);
         SELECT remus_create_distributed_table('idd', 'id', 6);"
    ))
    .unwrap();
    for n in c.node_names() {
        shell_identities(&c, &n, "ida", "a", slot(&n));
        shell_identities(&c, &n, "idd", "d", slot(&n));
    }
    shards_have_no_identity(&c);

    for table in ["ida", "idd"] {
        let mut returned = Vec::new();
        for n in c.node_names() {
            let mut db = c.connect(&n).unwrap();
            let got = insert_identity_forms(&mut db, table, &n);
            for (id, v, note) in &got {
                assert_eq!(id >> SLOT_BITS, slot(&n), "{table} {note}: id {id} via {n}");
                assert_eq!(v >> SLOT_BITS, slot(&n), "{table} {note}: n {v} via {n}");
            }
            returned.extend(got);
        }
        let count = 2 + 3 * IDENTITY_FORMS_ROWS;
        let rows = identity_rows(&mut n1, table);
        assert_eq!(rows.len(), count, "{table}");
        let ids: HashSet<i64> = rows.iter().map(|r| r.0).collect();
        let ns: HashSet<i64> = rows.iter().map(|r| r.1).collect();
        assert_eq!((ids.len(), ns.len()), (count, count), "{table}: distinct");
        // The rows from before kept their values (slot 0); every other one is in the range of
        // the node its note names.
        for (id, v, note) in &rows {
            let via = note.split('-').next().unwrap();
            let want = if via == "before" { 0 } else { slot(via) };
            assert_eq!(
                (id >> SLOT_BITS, v >> SLOT_BITS),
                (want, want),
                "{table} {note}"
            );
        }
        // RETURNING gave the row that was written, found by its key through another node.
        let mut n2 = c.connect("n2").unwrap();
        for (id, v, note) in &returned {
            let r = n2
                .query_one(&format!("SELECT n, note FROM {table} WHERE id = $1"), &[id])
                .unwrap();
            assert_eq!(
                (r.get::<_, i64>(0), r.get::<_, String>(1)),
                (*v, note.clone())
            );
        }
        rows_of_in_their_shards(&c, table, count);
    }

    // GENERATED ALWAYS refuses an explicit value (PostgreSQL's 428C9) through every node,
    // unless OVERRIDING SYSTEM VALUE; BY DEFAULT takes one.
    let mut extra = 0;
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        let base = 1_000_000 + slot(&n) * 1000;
        for sql in [
            format!("INSERT INTO ida (id, note) VALUES ({base}, 'x')"),
            format!(
                "INSERT INTO ida (id, note) VALUES ({base}, 'x'), ({}, 'y')",
                base + 1
            ),
            format!("INSERT INTO idd (id, note, n) VALUES ({base}, 'x', 7)"),
        ] {
            let e = db.batch_execute(&sql).unwrap_err();
            assert_eq!(sqlstate(&e), "428C9", "{n}: {sql}: {e:?}");
        }
        let e = db
            .query("INSERT INTO ida (id, note) VALUES ($1, 'x')", &[&base])
            .unwrap_err();
        assert_eq!(sqlstate(&e), "428C9", "{n}: {e:?}");
        let r = db
            .query_one(
                "INSERT INTO ida (id, note, n) OVERRIDING SYSTEM VALUE VALUES ($1, 'ov', $2)
                 RETURNING id, n",
                &[&base, &(base + 5)],
            )
            .unwrap();
        assert_eq!((r.get::<_, i64>(0), r.get::<_, i64>(1)), (base, base + 5));
        let rows = db
            .query(
                &format!(
                    "INSERT INTO ida (id, note) OVERRIDING SYSTEM VALUE
                     VALUES ({}, 'ov2'), ({}, 'ov3') RETURNING id, n",
                    base + 1,
                    base + 2
                ),
                &[],
            )
            .unwrap();
        // RETURNING gives the rows shard by shard: compared sorted.
        let mut got: Vec<(i64, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        got.sort_unstable();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0, got[1].0), (base + 1, base + 2));
        assert!(got.iter().all(|r| r.1 >> SLOT_BITS == slot(&n)), "{got:?}");
        // BY DEFAULT key: explicit values taken; the ALWAYS n drawn here.
        let rows = db
            .query(
                &format!(
                    "INSERT INTO idd (id, note) VALUES ({base}, 'e1'), ({}, 'e2'), (DEFAULT, 'e3')
                     RETURNING id, n",
                    base + 1
                ),
                &[],
            )
            .unwrap();
        let mut got: Vec<(i64, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        got.sort_unstable();
        assert_eq!(got.len(), 3);
        assert_eq!((got[0].0, got[1].0), (base, base + 1));
        assert_eq!(got[2].0 >> SLOT_BITS, slot(&n));
        assert!(got.iter().all(|r| r.1 >> SLOT_BITS == slot(&n)), "{got:?}");
        // OVERRIDING USER VALUE: the values given for the BY DEFAULT key are replaced by drawn
        // ones, here.
        let rows = db
            .query(
                "INSERT INTO idd (id, note) OVERRIDING USER VALUE VALUES (1, 'u1'), (2, 'u2')
                 RETURNING id, n",
                &[],
            )
            .unwrap();
        assert_eq!(rows.len(), 2);
        for r in rows {
            let (id, v): (i64, i64) = (r.get(0), r.get(1));
            assert_eq!(
                (id >> SLOT_BITS, v >> SLOT_BITS),
                (slot(&n), slot(&n)),
                "{n}"
            );
        }
        extra += 8;
    }
    let total = 2 * (2 + 3 * IDENTITY_FORMS_ROWS) + extra;
    let rows = identity_rows(&mut n1, "ida").len() + identity_rows(&mut n1, "idd").len();
    assert_eq!(rows, total);
    let ids: HashSet<i64> = identity_rows(&mut n1, "ida")
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(
        ids.len(),
        2 + 3 * IDENTITY_FORMS_ROWS + 9,
        "ida keys distinct"
    );
    shards_have_no_identity(&c);
    // A GRANT on an identity's sequence through one node reaches every node's copy.
    c.connect("n2")
        .unwrap()
        .batch_execute("GRANT SELECT ON SEQUENCE ida_id_seq TO PUBLIC")
        .unwrap();
    for n in c.node_names() {
        let granted: bool = c
            .connect(&n)
            .unwrap()
            .query_one(
                "SELECT has_sequence_privilege('public', 'ida_id_seq', 'SELECT')",
                &[],
            )
            .unwrap()
            .get(0);
        assert!(granted, "{n}");
    }
    // Changing an identity by ALTER stays refused (each node's sequence would need its own
    // range in the statement), naming the form; nothing changed.
    for sql in [
        "ALTER TABLE ida ALTER COLUMN n SET GENERATED ALWAYS",
        "ALTER TABLE ida ALTER COLUMN n RESTART WITH 5",
        "ALTER TABLE ida ALTER COLUMN n DROP IDENTITY",
        "ALTER TABLE idd ALTER COLUMN note ADD GENERATED ALWAYS AS IDENTITY",
        "ALTER TABLE ida ADD COLUMN z bigint GENERATED ALWAYS AS IDENTITY",
    ] {
        let e = n1.batch_execute(sql).unwrap_err();
        assert_eq!(sqlstate(&e), "0A000", "{sql}: {e:?}");
        assert!(
            e.as_db_error().unwrap().message().contains("IDENTITY"),
            "{sql}: {e:?}"
        );
    }
    shell_identities(&c, "n1", "ida", "a", 1);
    // DROP TABLE through another node takes the identities' sequences with the shells.
    c.connect("n3")
        .unwrap()
        .batch_execute("DROP TABLE idd")
        .unwrap();
    for n in c.node_names() {
        let left: i64 = c
            .connect(&n)
            .unwrap()
            .query_one(
                "SELECT count(*) FROM pg_class WHERE relname IN ('idd_id_seq', 'idd_n_seq')",
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(left, 0, "{n}");
    }
}

#[test]
fn identity_after_migration_and_on_a_new_node() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(&format!(
        "{IDENTITY_TABLES}; SELECT remus_create_distributed_table('ida', 'id', 4);"
    ))
    .unwrap();
    // A node that joins afterwards gets the shell with its identities, in the slot after the
    // highest in use.
    let n3 = c.add_node().expect("add node");
    assert_eq!(n3, "n3");
    shell_identities(&c, "n3", "ida", "a", 3);
    let moved = owners(&c, "ida")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .map(|(s, _)| s)
        .expect("n1 owns a shard");
    let status: String = c
        .connect("n2")
        .unwrap()
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, 'n3')",
            &[&moved],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded");
    // The moved shard's new table has no identity (nor does any other).
    shards_have_no_identity(&c);
    let ident: String = c
        .connect("n3")
        .unwrap()
        .query_one(
            &format!(
                "SELECT string_agg(attidentity::text, '') FROM pg_attribute
                  WHERE attrelid = 'remus_shards.ida_{moved}'::regclass AND attnum > 0"
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(ident, "", "remus_shards.ida_{moved} on n3");
    // Rows through every node until the moved shard has taken some through each.
    let mut dbs: Vec<Client> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| c.connect(n).unwrap())
        .collect();
    let mut into_moved = [0usize; 3];
    let mut count = 0;
    for round in 0..300 {
        if into_moved.iter().all(|k| *k >= 2) {
            break;
        }
        for (i, db) in dbs.iter_mut().enumerate() {
            let r = db
                .query_one(
                    "INSERT INTO ida (note) VALUES ($1)
                     RETURNING id, n, remus_shard_id_for('ida', id)",
                    &[&format!("after-{round}-{i}")],
                )
                .unwrap();
            count += 1;
            let (id, v, shard): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
            let via = i as i64 + 1;
            assert_eq!(
                (id >> SLOT_BITS, v >> SLOT_BITS),
                (via, via),
                "drawn via n{via}"
            );
            if shard == moved {
                into_moved[i] += 1;
            }
        }
    }
    assert!(into_moved.iter().all(|k| *k >= 2), "{into_moved:?}");
    // Multi-row and COPY through the new node.
    dbs[2]
        .batch_execute(
            "INSERT INTO ida (note) VALUES ('m1'), ('m2'), ('m3'), ('m4'), ('m5'), ('m6')",
        )
        .unwrap();
    let mut w = dbs[2].copy_in("COPY ida (note) FROM STDIN").unwrap();
    w.write_all(b"c1\nc2\nc3\nc4\nc5\nc6\n").unwrap();
    assert_eq!(w.finish().unwrap(), 6);
    count += 12;
    let rows = identity_rows(&mut n1, "ida");
    assert_eq!(rows.len(), count);
    let ids: HashSet<i64> = rows.iter().map(|r| r.0).collect();
    let ns: HashSet<i64> = rows.iter().map(|r| r.1).collect();
    assert_eq!((ids.len(), ns.len()), (count, count), "distinct");
    for (id, v, note) in &rows {
        if !note.starts_with("after-") {
            assert_eq!((id >> SLOT_BITS, v >> SLOT_BITS), (3, 3), "{note} via n3");
        }
    }
    rows_of_in_their_shards(&c, "ida", count);
}
