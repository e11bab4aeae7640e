//! Schema changes of distributed and reference tables from any node, on every node and every
//! shard or on none (issue 18 item 3; `pg_remus/src/ddl/`, decision 0021), by a superuser and by
//! the table's owner role.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use integration::pgbench::prepared_everywhere;
use integration::recovery::wait_recovered;
use integration::roles::{connect_as, Role};
use integration::shards::{assert_owns_no_shard, owners, value_on_every_node};
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

/// Every node's shell of `table` and each shard table it holds, as
/// "relation: attnum name type dropped" lines; the shards must match their node's shell.
fn columns_match_everywhere(c: &TestCluster, table: &str) -> Vec<String> {
    let mut shells = Vec::new();
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        let shape = |db: &mut postgres::Client, rel: &str| -> String {
            db.query(
                "SELECT attnum, CASE WHEN attisdropped THEN '' ELSE attname::text END,
                        CASE WHEN attisdropped THEN 0 ELSE atttypid::oid END::int8, attisdropped
                   FROM pg_attribute WHERE attrelid = $1::text::regclass AND attnum > 0
                  ORDER BY attnum",
                &[&rel],
            )
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "{} {} {} {}",
                    r.get::<_, i16>(0),
                    r.get::<_, String>(1),
                    r.get::<_, i64>(2),
                    r.get::<_, bool>(3)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
        };
        let shell = shape(&mut db, table);
        let shards: Vec<String> = db
            .query(
                "SELECT format('remus_shards.%I', c.relname) FROM pg_class c
                   JOIN pg_namespace s ON s.oid = c.relnamespace AND s.nspname = 'remus_shards'
                  WHERE c.relkind = 'r' AND c.relname ~ ('^' || $1 || '_[0-9]+$')",
                &[&table],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        for s in shards {
            assert_eq!(shape(&mut db, &s), shell, "{n}: {s} against the shell");
        }
        shells.push(format!("{n}: {shell}"));
    }
    shells
}

/// The indexes of every shard table of `table` on every node whose definition contains `needle`.
fn shard_indexes_with(c: &TestCluster, table: &str, needle: &str) -> i64 {
    value_on_every_node::<i64>(
        c,
        "SELECT count(*) FROM pg_indexes
          WHERE schemaname = 'remus_shards' AND tablename ~ ('^' || $1 || '_[0-9]+$')
            AND indexdef LIKE '%' || $2 || '%'",
        &[&table, &needle],
    )
    .into_iter()
    .sum()
}

fn count(db: &mut postgres::Client, sql: &str) -> i64 {
    db.query_one(sql, &[]).unwrap().get(0)
}

#[test]
fn ddl_reaches_every_node_and_shard() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    let mut n3 = c.connect("n3").unwrap();
    n1.batch_execute(
        "CREATE TABLE acct (id int PRIMARY KEY, bal int, note text);
         INSERT INTO acct SELECT g, g * 10, 'n' || g FROM generate_series(1, 60) g;
         SELECT remus_create_distributed_table('acct', 'id', 6);
         CREATE TABLE region (id int PRIMARY KEY, name text);
         SELECT remus_create_reference_table('region');
         INSERT INTO region VALUES (1, 'north'), (2, 'south');",
    )
    .unwrap();
    columns_match_everywhere(&c, "acct");

    // ADD COLUMN with a default, entered through n2: every existing row has it on every shard.
    n2.batch_execute("ALTER TABLE acct ADD COLUMN extra int DEFAULT 7")
        .unwrap();
    assert_eq!(count(&mut n3, "SELECT sum(extra) FROM acct"), 7 * 60);
    n3.batch_execute("INSERT INTO acct (id, bal, note, extra) VALUES (61, 1, 'x', 1)")
        .unwrap();
    // Type, default, NOT NULL, in one statement and apart.
    n3.batch_execute(
        "ALTER TABLE acct ALTER COLUMN note TYPE varchar(40), ALTER COLUMN extra SET DEFAULT 9;
         ALTER TABLE acct ALTER COLUMN extra SET NOT NULL",
    )
    .unwrap();
    let e = n1
        .batch_execute("INSERT INTO acct (id, bal, note, extra) VALUES (62, 1, 'x', NULL)")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "23502", "{e:?}");
    n1.batch_execute("INSERT INTO acct (id, bal, note) VALUES (62, 1, 'x')")
        .unwrap();
    assert_eq!(
        count(&mut n2, "SELECT extra::int8 FROM acct WHERE id = 62"),
        9
    );
    n1.batch_execute(
        "ALTER TABLE acct ALTER COLUMN extra DROP NOT NULL, ALTER COLUMN extra DROP DEFAULT",
    )
    .unwrap();
    n1.batch_execute("INSERT INTO acct (id, bal) VALUES (63, 1)")
        .unwrap();
    assert_eq!(
        count(&mut n2, "SELECT count(*) FROM acct WHERE extra IS NULL"),
        1
    );
    columns_match_everywhere(&c, "acct");

    // CHECK constraints: enforced on every shard, dropped from every shard.
    n2.batch_execute("ALTER TABLE acct ADD CONSTRAINT bal_positive CHECK (bal >= 0)")
        .unwrap();
    for id in 100..106 {
        let e = n1
            .execute("INSERT INTO acct (id, bal) VALUES ($1, -1)", &[&id])
            .unwrap_err();
        assert_eq!(sqlstate(&e), "23514", "{e:?}");
    }
    n3.batch_execute("ALTER TABLE acct DROP CONSTRAINT bal_positive")
        .unwrap();
    n1.batch_execute("INSERT INTO acct (id, bal) VALUES (100, -1)")
        .unwrap();

    // A UNIQUE constraint with the shard key, and an index: on every shard, then gone.
    n1.batch_execute("ALTER TABLE acct ADD CONSTRAINT acct_id_note UNIQUE (id, note)")
        .unwrap();
    assert_eq!(shard_indexes_with(&c, "acct", "(id, note)"), 6);
    n2.batch_execute("CREATE INDEX acct_bal_idx ON acct (bal)")
        .unwrap();
    assert_eq!(shard_indexes_with(&c, "acct", "(bal)"), 6);
    n3.batch_execute("DROP INDEX acct_bal_idx; ALTER TABLE acct DROP CONSTRAINT acct_id_note")
        .unwrap();
    assert_eq!(shard_indexes_with(&c, "acct", "(bal)"), 0);
    assert_eq!(shard_indexes_with(&c, "acct", "(id, note)"), 0);

    // DROP COLUMN keeps the shards' column numbers equal to their shell's.
    n2.batch_execute("ALTER TABLE acct DROP COLUMN note")
        .unwrap();
    columns_match_everywhere(&c, "acct");
    n3.batch_execute("INSERT INTO acct (id, bal, extra) VALUES (64, 5, 5)")
        .unwrap();
    assert_eq!(
        count(
            &mut n1,
            "SELECT sum(bal)::int8 FROM acct WHERE id IN (1, 64)"
        ),
        15
    );

    // Renames: a column, the shard key, the table.
    n1.batch_execute("ALTER TABLE acct RENAME COLUMN bal TO balance")
        .unwrap();
    n2.batch_execute("ALTER TABLE acct RENAME COLUMN id TO acct_id")
        .unwrap();
    n3.batch_execute("ALTER TABLE acct RENAME TO account")
        .unwrap();
    for db in [&mut n1, &mut n2, &mut n3] {
        assert_eq!(
            count(db, "SELECT balance::int8 FROM account WHERE acct_id = 5"),
            50
        );
    }
    n2.batch_execute("UPDATE account SET balance = balance + 1 WHERE acct_id = 5")
        .unwrap();
    assert_eq!(
        count(
            &mut n1,
            "SELECT count(*) FROM remus_shards WHERE table_name = 'account'"
        ),
        6
    );
    columns_match_everywhere(&c, "account");

    // SET SCHEMA moves every node's shell; the shard tables stay where they are.
    for n in c.node_names() {
        c.connect(&n)
            .unwrap()
            .batch_execute("CREATE SCHEMA app")
            .unwrap();
    }
    n2.batch_execute("ALTER TABLE account SET SCHEMA app")
        .unwrap();
    assert_eq!(
        value_on_every_node::<String>(&c, "SELECT 'app.account'::regclass::text", &[]),
        vec!["app.account"; 3]
    );
    assert_eq!(
        count(
            &mut n3,
            "SELECT balance::int8 FROM app.account WHERE acct_id = 5"
        ),
        51
    );
    n1.batch_execute("ALTER TABLE app.account SET SCHEMA public")
        .unwrap();

    // COMMENT and OWNER reach every node's shell.
    for n in c.node_names() {
        c.connect(&n)
            .unwrap()
            .batch_execute("CREATE ROLE ddl_owner")
            .unwrap();
    }
    n1.batch_execute(
        "COMMENT ON TABLE account IS 'accounts'; COMMENT ON COLUMN account.balance IS 'cents';
         ALTER TABLE account OWNER TO ddl_owner",
    )
    .unwrap();
    for n in c.node_names() {
        let row = c
            .connect(&n)
            .unwrap()
            .query_one(
                "SELECT obj_description('account'::regclass, 'pg_class'),
                        col_description('account'::regclass, 2),
                        pg_get_userbyid(relowner)::text
                   FROM pg_class WHERE oid = 'account'::regclass",
                &[],
            )
            .unwrap();
        assert_eq!(
            (
                row.get::<_, String>(0),
                row.get::<_, String>(1),
                row.get::<_, String>(2)
            ),
            ("accounts".into(), "cents".into(), "ddl_owner".into()),
            "{n}"
        );
    }

    // What is not propagated is refused before anything ran, naming it.
    n2.batch_execute("CREATE TABLE plain (id int PRIMARY KEY)")
        .unwrap();
    let before = columns_match_everywhere(&c, "account");
    for (sql, state) in [
        (
            "ALTER TABLE account ALTER COLUMN acct_id TYPE bigint",
            "0A000",
        ),
        ("ALTER TABLE account DROP COLUMN acct_id", "0A000"),
        ("ALTER TABLE account ADD COLUMN s serial", "0A000"),
        (
            "ALTER TABLE account ADD COLUMN r int REFERENCES region (id)",
            "0A000",
        ),
        (
            "ALTER TABLE account ADD CONSTRAINT u UNIQUE (balance)",
            "42P16",
        ),
        ("CREATE UNIQUE INDEX ON account (balance)", "42P16"),
        (
            "CREATE UNIQUE INDEX CONCURRENTLY ON account (balance)",
            "42P16",
        ),
        ("ALTER TABLE account SET UNLOGGED", "0A000"),
        (
            "ALTER TABLE account ADD COLUMN z int, SET UNLOGGED",
            "0A000",
        ),
        (
            "ALTER TABLE region ADD COLUMN at timestamptz DEFAULT now()",
            "0A000",
        ),
        ("DROP TABLE account, plain", "0A000"),
        (
            "CREATE TRIGGER t BEFORE INSERT ON account FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()",
            "0A000",
        ),
        ("CREATE RULE r AS ON INSERT TO account DO INSTEAD NOTHING", "0A000"),
        ("DROP INDEX acct_pkey, plain_pkey", "0A000"),
    ] {
        let e = n2.batch_execute(sql).expect_err(sql);
        assert_eq!(sqlstate(&e), state, "{sql}: {e:?}");
    }
    assert_eq!(columns_match_everywhere(&c, "account"), before);

    // A reference table: its copy on every node follows.
    n3.batch_execute(
        "ALTER TABLE region ADD COLUMN code text DEFAULT 'x'; ALTER TABLE region DROP COLUMN name",
    )
    .unwrap();
    columns_match_everywhere(&c, "region");
    for db in [&mut n1, &mut n2, &mut n3] {
        assert_eq!(count(db, "SELECT count(*) FROM region WHERE code = 'x'"), 2);
    }

    // A shard moved after the DDL carries it: the target's shard table has the shell's
    // column numbers (a dropped column included) and serves reads and writes.
    let (shard, from) = owners(&c, "account")[0].clone();
    let to = if from == "n1" { "n2" } else { "n1" };
    let status: String = n3
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, $2)",
            &[&shard, &to],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded");
    columns_match_everywhere(&c, "account");
    let total = count(&mut n1, "SELECT count(*) FROM account");
    for id in 200..230 {
        n3.execute(
            "INSERT INTO account (acct_id, balance) VALUES ($1, 1)",
            &[&id],
        )
        .unwrap();
    }
    assert_eq!(count(&mut n2, "SELECT count(*) FROM account"), total + 30);

    // DROP TABLE: shells, shard tables and catalog rows gone from every node.
    n2.batch_execute("DROP TABLE account").unwrap();
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        assert_eq!(
            count(
                &mut db,
                "SELECT count(*) FROM pg_class WHERE relname ~ '^account(_[0-9]+)?$'"
            ),
            0,
            "{n}"
        );
        assert_eq!(
            count(
                &mut db,
                "SELECT count(*) FROM remus_shards WHERE table_name = 'account'"
            ),
            0,
            "{n}"
        );
    }
    assert_eq!(prepared_everywhere(&c), 0);
}

#[test]
fn ddl_applies_everywhere_or_nowhere() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE t (id int PRIMARY KEY, v int);
         INSERT INTO t SELECT g, g FROM generate_series(1, 30) g;
         SELECT remus_create_distributed_table('t', 'id', 6);",
    )
    .unwrap();
    let has_column = |name: &str| -> Vec<i64> {
        value_on_every_node(
            &c,
            "SELECT count(*) FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
              WHERE a.attname = $1 AND NOT a.attisdropped
                AND (c.relname = 't' OR c.relname ~ '^t_[0-9]+$')",
            &[&name],
        )
    };
    // Every node holds the shell and two shards: three tables with the column on each.
    let everywhere = vec![3, 3, 3];
    let nowhere = vec![0, 0, 0];

    // Rolled back with its transaction.
    n1.batch_execute("BEGIN; ALTER TABLE t ADD COLUMN a int; ROLLBACK")
        .unwrap();
    assert_eq!(has_column("a"), nowhere);
    // In a transaction with routed writes: committed with them.
    n1.batch_execute("BEGIN; UPDATE t SET v = 0 WHERE id = 1; ALTER TABLE t ADD COLUMN b int; UPDATE t SET b = 1 WHERE id = 2; COMMIT")
        .unwrap();
    assert_eq!(has_column("b"), everywhere);

    // Failing on one node (an object of that name there) fails it on every node.
    c.connect("n3")
        .unwrap()
        .batch_execute("CREATE TABLE t_w_idx (x int)")
        .unwrap();
    n1.batch_execute("ALTER TABLE t ADD COLUMN w int").unwrap();
    let e = n1
        .batch_execute("CREATE INDEX t_w_idx ON t (w)")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42P07", "{e:?}");
    assert_eq!(shard_indexes_with(&c, "t", "(w)"), 0);
    assert_eq!(prepared_everywhere(&c), 0);

    // The entry node killed after every participant prepared, before its own commit: nothing
    // anywhere once its recovery worker has rolled the participants back.
    let mut victim = c.connect("n1").unwrap();
    victim
        .batch_execute("SET remus.crash_at = 'after_prepare'")
        .unwrap();
    assert!(victim
        .batch_execute("ALTER TABLE t ADD COLUMN c int")
        .is_err());
    wait_recovered(&c, "n1");
    assert_eq!(has_column("c"), nowhere);

    // Killed after its own commit, before COMMIT PREPARED: everywhere once recovery has
    // committed the participants by the recorded decision.
    let mut victim = c.connect("n1").unwrap();
    victim
        .batch_execute("SET remus.crash_at = 'after_local_commit'")
        .unwrap();
    let _ = victim.batch_execute("ALTER TABLE t ADD COLUMN d int");
    wait_recovered(&c, "n1");
    assert_eq!(has_column("d"), everywhere);
    columns_match_everywhere(&c, "t");
    // The table still serves through every node.
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        db.batch_execute("UPDATE t SET d = 1 WHERE id = 3").unwrap();
        assert_eq!(count(&mut db, "SELECT count(*) FROM t"), 30);
    }
}

/// The shape of a table, names of its indexes and index-backed constraints aside (a shard's
/// are its own): columns (dropped ones as `-`, in number order), constraints, indexes.
const SHAPE_FUNCTION: &str = "
CREATE FUNCTION ddl_shape(rel regclass) RETURNS text LANGUAGE sql STABLE AS $$
SELECT concat_ws(' | ',
  (SELECT string_agg(CASE WHEN a.attisdropped THEN '-'
                          ELSE concat_ws(':', a.attname, format_type(a.atttypid, a.atttypmod),
                                         a.attnotnull, pg_get_expr(d.adbin, d.adrelid)) END,
                     ', ' ORDER BY a.attnum)
     FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE a.attrelid = rel AND a.attnum > 0),
  (SELECT string_agg(def, ', ' ORDER BY def)
     FROM (SELECT CASE WHEN contype = 'c' THEN conname || ' ' ELSE '' END
                  || pg_get_constraintdef(oid) AS def
             FROM pg_constraint WHERE conrelid = rel) cons),
  (SELECT string_agg(def, ', ' ORDER BY def)
     FROM (SELECT indisunique || substring(pg_get_indexdef(indexrelid) FROM ' USING .*$') AS def
             FROM pg_index WHERE indrelid = rel) idx))
$$;
CREATE FUNCTION ddl_fingerprint() RETURNS text LANGUAGE sql STABLE AS $$
SELECT coalesce(string_agg(concat_ws(' / ', c.relname, pg_get_userbyid(c.relowner),
                                     obj_description(c.oid, 'pg_class'), ddl_shape(c.oid),
                                     (SELECT string_agg(indexrelid::regclass::text, ', ' ORDER BY indexrelid::regclass::text)
                                        FROM pg_index WHERE indrelid = c.oid)),
                           ' // ' ORDER BY c.relname), 'no table')
  FROM remus.distributed_tables d JOIN pg_class c ON c.oid = d.logicalrelid
$$;
CREATE FUNCTION ddl_shards_follow() RETURNS bool LANGUAGE sql STABLE AS $$
WITH shard AS (
  SELECT c.oid AS shell, to_regclass(format('remus_shards.%I', c.relname || '_' || s.shard_id)) AS rel
    FROM remus.distributed_tables d JOIN pg_class c ON c.oid = d.logicalrelid
    JOIN remus.shards s ON s.logicalrelid = d.logicalrelid)
SELECT coalesce((SELECT bool_and(ddl_shape(rel) = ddl_shape(shell)) FROM shard WHERE rel IS NOT NULL), true)
   AND NOT EXISTS (SELECT FROM pg_class t
                    WHERE t.relnamespace = 'remus_shards'::regnamespace AND t.relkind = 'r'
                      AND t.oid NOT IN (SELECT rel FROM shard WHERE rel IS NOT NULL))
$$;";

/// Every node's fingerprint of its distributed tables (name, owner, comment, shape, shard
/// tables held), after checking that each shard table has its shell's shape.
fn fingerprints(c: &TestCluster) -> Vec<String> {
    for n in c.node_names() {
        let follow: bool = c
            .connect(&n)
            .unwrap()
            .query_one("SELECT ddl_shards_follow()", &[])
            .unwrap()
            .get(0);
        assert!(
            follow,
            "{n}: a shard table differs from its shell, or belongs to no table"
        );
    }
    value_on_every_node(c, "SELECT ddl_fingerprint()", &[])
}

/// Every DDL form the crash matrix knows, in the order it runs them (each form may need the
/// ones before it; the last uses of the renamed table and key are `t2` and `t_id`).
const CRASH_FORMS: &[&str] = &[
    "ALTER TABLE t ADD COLUMN a int DEFAULT 1",
    "ALTER TABLE t ALTER COLUMN w TYPE varchar(20)",
    "ALTER TABLE t ALTER COLUMN v SET DEFAULT 5",
    "ALTER TABLE t ALTER COLUMN v SET NOT NULL",
    "ALTER TABLE t ADD CONSTRAINT v_positive CHECK (v >= 0)",
    "ALTER TABLE t DROP CONSTRAINT v_positive",
    "ALTER TABLE t ADD CONSTRAINT t_id_v UNIQUE (id, v)",
    "ALTER TABLE t DROP CONSTRAINT t_id_v",
    "CREATE INDEX t_w_idx ON t (w)",
    "ALTER INDEX t_w_idx RENAME TO t_w_index",
    "DROP INDEX t_w_index",
    "ALTER TABLE t DROP COLUMN a",
    "ALTER TABLE t RENAME COLUMN w TO label",
    "ALTER TABLE t RENAME COLUMN id TO t_id",
    "COMMENT ON TABLE t IS 'the table'",
    "ALTER TABLE t OWNER TO ddl_owner",
    "ALTER TABLE t RENAME TO t2",
    "ALTER TABLE r ADD COLUMN code text DEFAULT 'x'",
    "DROP TABLE r",
];

/// The CI subset of [`CRASH_FORMS`]: one form of each kind of work the commit carries (a
/// rewrite with a default, a type change, an index-backed constraint and its name twins on
/// the shards, an index, the catalog's shard key and table renames, a reference table's drop
/// and its catalog rows). The whole matrix is [`every_form_is_all_or_nothing_full`].
const CRASH_FORMS_CI: &[&str] = &[
    "ALTER TABLE t ADD COLUMN a int DEFAULT 1",
    "ALTER TABLE t ALTER COLUMN w TYPE varchar(20)",
    "ALTER TABLE t ADD CONSTRAINT t_id_v UNIQUE (id, v)",
    "CREATE INDEX t_w_idx ON t (w)",
    "ALTER TABLE t RENAME COLUMN id TO t_id",
    "ALTER TABLE t RENAME TO t2",
    "DROP TABLE r",
];

/// The DDL forms of [`CRASH_FORMS_CI`] (one of each kind; the CI tier), through each node in
/// turn, across a crash between the two phases of their commit (see [`crash_matrix`]).
#[test]
fn every_form_is_all_or_nothing_across_a_crash_between_the_phases() {
    crash_matrix(CRASH_FORMS_CI);
}

/// Opt-in: all of [`CRASH_FORMS`] (about 5 minutes).
#[test]
#[ignore = "opt-in, about 5 minutes: cargo test --release -p integration --test distributed_ddl -- --ignored --test-threads=1"]
fn every_form_is_all_or_nothing_full() {
    crash_matrix(CRASH_FORMS);
}

/// Each DDL form, entered through a node whose backend is killed between the two phases of
/// its commit: after the participants prepared and before its own commit, the change is
/// nowhere once the node is back and recovery ran; after its own commit and before COMMIT
/// PREPARED, it is everywhere. Either way every shard table has its shell's shape, and a shard
/// migrated afterwards carries every change.
fn crash_matrix(forms: &[&str]) {
    let c = TestCluster::start(3).expect("cluster up");
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        db.batch_execute(SHAPE_FUNCTION).unwrap();
        db.batch_execute("CREATE ROLE ddl_owner").unwrap();
    }
    c.connect("n1")
        .unwrap()
        .batch_execute(
            "CREATE TABLE t (id int PRIMARY KEY, v int, w text);
         INSERT INTO t SELECT g, g, 'w' || g FROM generate_series(1, 40) g;
         SELECT remus_create_distributed_table('t', 'id', 4);
         CREATE TABLE r (id int PRIMARY KEY, name text);
         INSERT INTO r VALUES (1, 'one');
         SELECT remus_create_reference_table('r');",
        )
        .unwrap();
    let nodes = c.node_names();
    for (i, ddl) in forms.iter().enumerate() {
        let entry = &nodes[i % nodes.len()];
        let before = fingerprints(&c);

        let mut victim = c.connect(entry).unwrap();
        victim
            .batch_execute("SET remus.crash_at = 'after_prepare'")
            .unwrap();
        assert!(
            victim.batch_execute(ddl).is_err(),
            "{ddl}: the backend lived"
        );
        wait_recovered(&c, entry);
        assert_eq!(
            fingerprints(&c),
            before,
            "{ddl} through {entry}: not nowhere"
        );

        let mut victim = c.connect(entry).unwrap();
        victim
            .batch_execute("SET remus.crash_at = 'after_local_commit'")
            .unwrap();
        assert!(
            victim.batch_execute(ddl).is_err(),
            "{ddl}: the backend lived"
        );
        wait_recovered(&c, entry);
        let after = fingerprints(&c);
        for (n, (b, a)) in nodes.iter().zip(before.iter().zip(&after)) {
            assert_ne!(a, b, "{ddl} through {entry}: not applied on {n}");
        }
        assert!(
            after.iter().all(|f| *f == after[0]),
            "{ddl} through {entry}: nodes differ: {after:#?}"
        );
    }

    // A shard moved after every form carries them all, and the table serves through every node.
    let (shard, from) = owners(&c, "t2")[0].clone();
    let to = nodes.iter().find(|n| **n != from).unwrap();
    let status: String = c
        .connect("n1")
        .unwrap()
        .query_one(
            "SELECT status FROM remus_migrate_shard($1, $2)",
            &[&shard, to],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded");
    fingerprints(&c);
    for n in &nodes {
        let mut db = c.connect(n).unwrap();
        db.batch_execute("UPDATE t2 SET v = v + 1 WHERE t_id = 7")
            .unwrap();
        assert_eq!(count(&mut db, "SELECT count(*) FROM t2"), 40);
    }
}

/// An application role that owns a distributed table (LOGIN, no superuser; `remus_admin` to
/// distribute it) changes its schema through any node, as on one PostgreSQL; another role gets
/// PostgreSQL's own 42501 and changes nothing anywhere.
#[test]
fn the_table_owner_role_changes_the_schema_through_any_node() {
    let c = TestCluster::start(3).expect("cluster up");
    let owner = Role::new("ddl_app", "ddl-app-Pw-1");
    let other = Role::new("ddl_other", "ddl-other-Pw-2");
    for n in c.node_names() {
        c.connect(&n)
            .unwrap()
            .batch_execute(&format!(
                "{}; {}; GRANT remus_admin TO ddl_app; GRANT CREATE ON SCHEMA public TO ddl_app;",
                owner.create_sql(),
                other.create_sql()
            ))
            .unwrap();
    }
    let mut o1 = connect_as(&c, "n1", &owner).unwrap();
    o1.batch_execute(
        "CREATE TABLE owned (id int PRIMARY KEY, v int);
         INSERT INTO owned SELECT g, g FROM generate_series(1, 20) g;
         SELECT remus_create_distributed_table('owned', 'id', 4);",
    )
    .unwrap();
    // Apart: the conversion's remote work runs as the cluster's superuser, the GRANT's as the
    // owner, and one transaction runs as one role on another node.
    o1.batch_execute("GRANT SELECT ON owned TO ddl_other")
        .unwrap();
    let mut o2 = connect_as(&c, "n2", &owner).unwrap();
    o2.batch_execute(
        "ALTER TABLE owned ADD COLUMN note text DEFAULT 'n', ALTER COLUMN v SET NOT NULL;
         CREATE INDEX owned_v_idx ON owned (v);
         ALTER TABLE owned ADD CONSTRAINT v_small CHECK (v < 1000);
         ALTER TABLE owned RENAME COLUMN v TO val;
         COMMENT ON COLUMN owned.val IS 'value';",
    )
    .unwrap();
    columns_match_everywhere(&c, "owned");
    assert_eq!(shard_indexes_with(&c, "owned", "(val)"), 4);
    let mut o3 = connect_as(&c, "n3", &owner).unwrap();
    let e = o3
        .batch_execute("INSERT INTO owned (id, val) VALUES (100, 5000)")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "23514", "{e:?}");
    assert_eq!(
        count(&mut o3, "SELECT count(*) FROM owned WHERE note = 'n'"),
        20
    );

    // Not the owner: PostgreSQL's refusal on the node it entered, nothing changed anywhere.
    let before = columns_match_everywhere(&c, "owned");
    let mut x2 = connect_as(&c, "n2", &other).unwrap();
    for sql in [
        "ALTER TABLE owned ADD COLUMN z int",
        "CREATE INDEX ON owned (note)",
        "DROP INDEX owned_v_idx",
        "ALTER TABLE owned RENAME TO mine",
        "COMMENT ON TABLE owned IS 'x'",
        "DROP TABLE owned",
    ] {
        let e = x2.batch_execute(sql).expect_err(sql);
        assert_eq!(sqlstate(&e), "42501", "{sql}: {e:?}");
    }
    assert_eq!(columns_match_everywhere(&c, "owned"), before);
    assert_eq!(shard_indexes_with(&c, "owned", "(val)"), 4);

    // The owner drops it from any node: gone everywhere.
    o3.batch_execute("DROP INDEX owned_v_idx; DROP TABLE owned")
        .unwrap();
    assert_eq!(
        value_on_every_node::<i64>(
            &c,
            "SELECT count(*) FROM pg_class WHERE relname ~ '^owned(_[0-9]+)?$'",
            &[]
        ),
        vec![0, 0, 0]
    );
    assert_eq!(prepared_everywhere(&c), 0);
}

/// A routed statement with parameters is prepared once per shape on each node it reaches and
/// kept there for the backend's life. After ALTER COLUMN … TYPE changes what such a statement
/// returns, the same statement through the same session still runs (PostgreSQL refuses to reuse
/// a prepared plan whose result type changed: the stale one is dropped and prepared again).
#[test]
fn a_routed_statement_prepared_before_a_type_change_runs_after_it() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE typed (id int PRIMARY KEY, v int);
         INSERT INTO typed SELECT g, g FROM generate_series(1, 20) g;
         SELECT remus_create_distributed_table('typed', 'id', 4);",
    )
    .unwrap();
    // Keys whose shard n2 owns: reached from n1 as a prepared statement on n2.
    let remote: Vec<i32> = (1..=20)
        .filter(|k| {
            n1.query_one(
                "SELECT node_name FROM remus_shards WHERE shard_id = remus_shard_id_for('typed', $1::int)",
                &[k],
            )
            .unwrap()
            .get::<_, String>(0)
                == "n2"
        })
        .collect();
    assert!(!remote.is_empty());
    let k = remote[0];
    let before: i32 = n1
        .query_one("SELECT v FROM typed WHERE id = $1", &[&k])
        .unwrap()
        .get(0);
    assert_eq!(before, k);
    c.connect("n2")
        .unwrap()
        .batch_execute("ALTER TABLE typed ALTER COLUMN v TYPE bigint")
        .unwrap();
    // Autocommit, then inside a transaction block.
    let after: i64 = n1
        .query_one("SELECT v FROM typed WHERE id = $1", &[&k])
        .unwrap()
        .get(0);
    assert_eq!(after, i64::from(k));
    n1.batch_execute("ALTER TABLE typed ALTER COLUMN v TYPE numeric")
        .unwrap();
    let mut tx = n1.transaction().unwrap();
    let in_block: String = tx
        .query_one("SELECT v::text FROM typed WHERE id = $1", &[&k])
        .unwrap()
        .get(0);
    assert_eq!(in_block, k.to_string());
    tx.commit().unwrap();
}

/// Per node: (indexes of the shell `table` whose definition contains `needle`, their twins on
/// the node's shard tables of `table`, how many of both are not valid).
fn index_everywhere(c: &TestCluster, table: &str, needle: &str) -> Vec<(i64, i64, i64)> {
    c.node_names()
        .iter()
        .map(|n| {
            let r = c
                .connect(n)
                .unwrap()
                .query_one(
                    "WITH i AS (
                       SELECT i.indisvalid, t.relnamespace = 'remus_shards'::regnamespace AS twin
                         FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid
                        WHERE (t.oid = $1::text::regclass
                               OR (t.relnamespace = 'remus_shards'::regnamespace
                                   AND t.relname ~ ('^' || $1 || '_[0-9]+$')))
                          AND pg_get_indexdef(i.indexrelid) LIKE '%' || $2 || '%')
                     SELECT count(*) FILTER (WHERE NOT twin), count(*) FILTER (WHERE twin),
                            count(*) FILTER (WHERE NOT indisvalid)
                       FROM i",
                    &[&table, &needle],
                )
                .unwrap();
            (r.get(0), r.get(1), r.get(2))
        })
        .collect()
}

/// (1 shell index, one twin per shard the node holds, none invalid) on every node, as
/// [`index_everywhere`] counts them.
fn valid_everywhere(c: &TestCluster, table: &str) -> Vec<(i64, i64, i64)> {
    let held = owners(c, table);
    c.node_names()
        .iter()
        .map(|n| (1, held.iter().filter(|(_, o)| o == n).count() as i64, 0))
        .collect()
}

/// Every shard table of `table` on every node returns as many rows with `cond` through an
/// index scan as through a sequential scan: a concurrent build missed no row written meanwhile.
fn index_scans_match(c: &TestCluster, table: &str, cond: &str) {
    for n in c.node_names() {
        let mut db = c.connect(&n).unwrap();
        let shards: Vec<String> = db
            .query(
                "SELECT format('remus_shards.%I', relname) FROM pg_class
                  WHERE relnamespace = 'remus_shards'::regnamespace AND relkind = 'r'
                    AND relname ~ ('^' || $1 || '_[0-9]+$')",
                &[&table],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        for s in shards {
            let sql = format!("SELECT count(*) FROM {s} WHERE {cond}");
            db.batch_execute("SET enable_seqscan = off").unwrap();
            let plan: String = db
                .query(&format!("EXPLAIN {sql}"), &[])
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect();
            assert!(
                plan.contains("Index"),
                "{n}: {s} not scanned by index: {plan}"
            );
            let by_index = count(&mut db, &sql);
            db.batch_execute(
                "RESET enable_seqscan; SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off",
            )
            .unwrap();
            let by_heap = count(&mut db, &sql);
            db.batch_execute("RESET ALL").unwrap();
            assert_eq!(by_index, by_heap, "{n}: {s}");
        }
    }
}

/// Updates and inserts (of ids from `first_id` on) on `busy` through one node, from
/// [`BusyWriter::start`] until [`BusyWriter::finish`].
struct BusyWriter {
    stop: Arc<AtomicBool>,
    handle: thread::JoinHandle<(i64, Vec<String>)>,
}

impl BusyWriter {
    fn start(c: &TestCluster, node: &str, first_id: i32) -> BusyWriter {
        let mut db = c.connect(node).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let handle = thread::spawn(move || {
            let (mut committed, mut errors) = (0i64, Vec::new());
            let mut i = 0i32;
            while !stopped.load(Ordering::Acquire) {
                i += 1;
                let r = db
                    .execute(
                        "UPDATE busy SET v = v + 1, w = w - 1 WHERE id = $1",
                        &[&(i % 2000 + 1)],
                    )
                    .and_then(|_| {
                        db.execute(
                            "INSERT INTO busy VALUES ($1, $1, -$1::int)",
                            &[&(first_id + i)],
                        )
                    });
                match r {
                    Ok(_) => committed += 1,
                    Err(e) => errors.push(format!("{e:?}")),
                }
            }
            (committed, errors)
        });
        BusyWriter { stop, handle }
    }

    /// Stops the writer; panics unless it committed and nothing failed.
    fn finish(self) {
        self.stop.store(true, Ordering::Release);
        let (committed, errors) = self.handle.join().unwrap();
        assert!(
            errors.is_empty(),
            "the writer failed: {:?}",
            &errors[..errors.len().min(3)]
        );
        assert!(committed > 0, "the writer committed nothing");
    }
}

/// CREATE INDEX CONCURRENTLY through a node that owns shards and through one that owns none,
/// while another node writes the table: valid on every shell and shard table, holding every
/// row written meanwhile; a shard migrated afterwards carries it; DROP INDEX CONCURRENTLY
/// removes it everywhere; inside a transaction block both are refused as PostgreSQL refuses
/// them (25001).
#[test]
fn create_index_concurrently_from_any_node_while_writing() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    let mut n2 = c.connect("n2").unwrap();
    let mut n3 = c.connect("n3").unwrap();
    n1.batch_execute(
        "CREATE TABLE busy (id int PRIMARY KEY, v int, w int);
         INSERT INTO busy SELECT g, g, -g FROM generate_series(1, 2000) g;
         SELECT remus_create_distributed_table('busy', 'id', 2);
         CREATE TABLE tags (id int PRIMARY KEY, label text);
         INSERT INTO tags SELECT g, 'l' || g FROM generate_series(1, 50) g;
         SELECT remus_create_reference_table('tags');",
    )
    .unwrap();
    assert_owns_no_shard(&c, "n3", &["busy"]);
    let writer = BusyWriter::start(&c, "n2", 100_000);
    let before: i64 = count(&mut n1, "SELECT count(*) FROM busy");

    // Through an owner, and through a node that owns none (a partial index, a reference table).
    n1.batch_execute("CREATE INDEX CONCURRENTLY busy_v_idx ON busy (v)")
        .unwrap();
    n3.batch_execute("CREATE INDEX CONCURRENTLY busy_w_idx ON busy (w) WHERE w < 0")
        .unwrap();
    n3.batch_execute("CREATE INDEX CONCURRENTLY tags_label_idx ON tags (label)")
        .unwrap();
    // IF NOT EXISTS of an index the shell has: nothing anywhere.
    n2.batch_execute("CREATE INDEX CONCURRENTLY IF NOT EXISTS busy_v_idx ON busy (v)")
        .unwrap();
    // Inside a transaction block: PostgreSQL's refusal, nothing done anywhere.
    for sql in [
        "BEGIN; CREATE INDEX CONCURRENTLY busy_v2_idx ON busy (v, w); COMMIT",
        "BEGIN; DROP INDEX CONCURRENTLY busy_v_idx; COMMIT",
    ] {
        let e = n2.batch_execute(sql).expect_err(sql);
        assert_eq!(sqlstate(&e), "25001", "{sql}: {e:?}");
        n2.batch_execute("ROLLBACK").unwrap();
    }
    assert_eq!(shard_indexes_with(&c, "busy", "(v, w)"), 0);
    writer.finish();
    assert!(count(&mut n1, "SELECT count(*) FROM busy") > before);

    assert_eq!(
        index_everywhere(&c, "busy", "(v)"),
        valid_everywhere(&c, "busy")
    );
    assert_eq!(
        index_everywhere(&c, "busy", "(w)"),
        valid_everywhere(&c, "busy")
    );
    assert_eq!(index_everywhere(&c, "tags", "(label)"), vec![(1, 1, 0); 3]);
    index_scans_match(&c, "busy", "v > -1000000");
    index_scans_match(&c, "busy", "w < 0");

    // A shard migrated to the node that had none carries both indexes.
    let (shard, _) = owners(&c, "busy")
        .into_iter()
        .find(|(_, o)| o == "n1")
        .expect("n1 owns a shard of busy");
    let status: String = n3
        .query_one(
            "SELECT status FROM remus_migrate_shards(ARRAY[$1::int8], 'n3')",
            &[&shard],
        )
        .unwrap()
        .get(0);
    assert_eq!(status, "succeeded");
    assert_eq!(
        index_everywhere(&c, "busy", "(v)"),
        valid_everywhere(&c, "busy")
    );
    assert_eq!(
        index_everywhere(&c, "busy", "(w)"),
        valid_everywhere(&c, "busy")
    );
    index_scans_match(&c, "busy", "v > -1000000");

    // DROP INDEX CONCURRENTLY through a node and through another: gone everywhere.
    let writer = BusyWriter::start(&c, "n1", 200_000);
    n2.batch_execute("DROP INDEX CONCURRENTLY busy_v_idx")
        .unwrap();
    n1.batch_execute("DROP INDEX CONCURRENTLY tags_label_idx")
        .unwrap();
    writer.finish();
    assert_eq!(index_everywhere(&c, "busy", "(v)"), vec![(0, 0, 0); 3]);
    assert_eq!(index_everywhere(&c, "tags", "(label)"), vec![(0, 0, 0); 3]);
    assert_eq!(
        index_everywhere(&c, "busy", "(w)"),
        valid_everywhere(&c, "busy")
    );
    assert_eq!(prepared_everywhere(&c), 0);
}

/// A CREATE INDEX CONCURRENTLY that fails — a UNIQUE index over duplicates on a shard of
/// another node, on a shard of the entry node, a shard being migrated (55006), or a node that
/// is down — is an error naming where, with a hint; what it left (valid or INVALID indexes on
/// some nodes, none on the others) goes with one DROP INDEX (plain or CONCURRENTLY) of the
/// shell's index on the entry node.
#[test]
fn a_failed_create_index_concurrently_leaves_nothing_after_drop_index() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE dup (id int, k int, v int, PRIMARY KEY (k, id));
         INSERT INTO dup SELECT g, g, g FROM generate_series(1, 300) g;
         INSERT INTO dup VALUES (1000, 5, 5);
         SELECT remus_create_distributed_table('dup', 'k', 6);",
    )
    .unwrap();
    let dup_owner: String = n1
        .query_one(
            "SELECT node_name FROM remus_shards WHERE shard_id = remus_shard_id_for('dup', 5)",
            &[],
        )
        .unwrap()
        .get(0);
    let other = c
        .node_names()
        .into_iter()
        .find(|n| *n != dup_owner)
        .unwrap();
    for (entry, drop) in [
        (other.as_str(), "DROP INDEX dup_uq"),
        (dup_owner.as_str(), "DROP INDEX CONCURRENTLY dup_uq"),
    ] {
        let mut db = c.connect(entry).unwrap();
        let e = db
            .batch_execute("CREATE UNIQUE INDEX CONCURRENTLY dup_uq ON dup (k, v)")
            .expect_err("duplicates");
        assert_eq!(sqlstate(&e), "23505", "{e:?}");
        let db_err = e.as_db_error().unwrap();
        assert!(
            db_err.message().contains(&format!("node {dup_owner}")),
            "{e:?}"
        );
        assert!(
            db_err
                .hint()
                .is_some_and(|h| h.contains("DROP INDEX dup_uq")),
            "{e:?}"
        );
        // Something was left: the entry node's shell has the index.
        assert_eq!(
            count(
                &mut db,
                "SELECT count(*) FROM pg_class WHERE relname = 'dup_uq'"
            ),
            1
        );
        db.batch_execute(drop).unwrap();
        assert_eq!(
            index_everywhere(&c, "dup", "(k, v)"),
            vec![(0, 0, 0); 3],
            "{entry}"
        );
    }

    // A shard being migrated (registered on its owner): 55006 there, before anything ran;
    // entered elsewhere, that node refuses its part, and DROP INDEX removes the others'.
    let (sid, _) = owners(&c, "dup")
        .into_iter()
        .find(|(_, o)| *o == dup_owner)
        .unwrap();
    let mut owner_db = c.connect(&dup_owner).unwrap();
    owner_db
        .execute(
            "SELECT remus.migration_begin(4343, ARRAY[$1]::bigint[])",
            &[&sid],
        )
        .unwrap();
    let e = owner_db
        .batch_execute("CREATE INDEX CONCURRENTLY dup_v_idx ON dup (v)")
        .expect_err("migrating");
    assert_eq!(sqlstate(&e), "55006", "{e:?}");
    assert_eq!(index_everywhere(&c, "dup", "(v)"), vec![(0, 0, 0); 3]);
    let mut other_db = c.connect(&other).unwrap();
    let e = other_db
        .batch_execute("CREATE INDEX CONCURRENTLY dup_v_idx ON dup (v)")
        .expect_err("migrating on another node");
    assert_eq!(sqlstate(&e), "55006", "{e:?}");
    assert!(
        e.as_db_error()
            .is_some_and(|d| d.message().contains(&format!("failed on node {dup_owner}"))),
        "{e:?}"
    );
    owner_db
        .query_one("SELECT remus.migration_end(4343)", &[])
        .unwrap();
    other_db.batch_execute("DROP INDEX dup_v_idx").unwrap();
    assert_eq!(index_everywhere(&c, "dup", "(v)"), vec![(0, 0, 0); 3]);

    // A node that is down: the others have it, that one does not.
    n1.batch_execute("DELETE FROM dup WHERE id = 1000").unwrap();
    c.stop_node("n3").unwrap();
    let e = n1
        .batch_execute("CREATE INDEX CONCURRENTLY dup_v_idx ON dup (v)")
        .expect_err("n3 is down");
    assert!(
        e.as_db_error()
            .is_some_and(|d| d.message().contains("failed on node n3")),
        "{e:?}"
    );
    c.start_node("n3").unwrap();
    assert_eq!(
        count(
            &mut n1,
            "SELECT count(*) FROM pg_index WHERE indexrelid = 'dup_v_idx'::regclass AND indisvalid"
        ),
        1
    );
    n1.batch_execute("DROP INDEX dup_v_idx").unwrap();
    assert_eq!(index_everywhere(&c, "dup", "(v)"), vec![(0, 0, 0); 3]);

    // DROP INDEX CONCURRENTLY with a node down: done up to it; that node's shell still has the
    // index, and a DROP INDEX there ends it.
    n1.batch_execute("CREATE INDEX CONCURRENTLY dup_v_idx ON dup (v)")
        .unwrap();
    c.stop_node("n3").unwrap();
    let e = n1
        .batch_execute("DROP INDEX CONCURRENTLY dup_v_idx")
        .expect_err("n3 is down");
    assert!(
        e.as_db_error()
            .is_some_and(|d| d.message().contains("failed on node n3")),
        "{e:?}"
    );
    c.start_node("n3").unwrap();
    let left = index_everywhere(&c, "dup", "(v)");
    assert_eq!((left[0].0, left[1].0, left[2].0), (0, 0, 1), "{left:?}");
    c.connect("n3")
        .unwrap()
        .batch_execute("DROP INDEX dup_v_idx")
        .unwrap();
    assert_eq!(index_everywhere(&c, "dup", "(v)"), vec![(0, 0, 0); 3]);
    assert_eq!(prepared_everywhere(&c), 0);
}
