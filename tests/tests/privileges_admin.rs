//! Who may change a node's settings and administer the cluster (issue 18 item 2, decision
//! 0016), and row-level security refused on distributed and reference tables.
//!
//! Roles are per PostgreSQL cluster: `app` (LOGIN, no superuser, nothing granted) and `ops`
//! (LOGIN, no superuser, member of `remus_admin`, CREATE on schema public) are made on every
//! node by the test.
//!
//! - `a_session_cannot_change_the_nodes_settings`: `remus.node_name`, `remus.forwarded`,
//!   `remus.migration_session` and `remus.coordinator_address` refused to `app` by SET, by
//!   `set_config`, by `ALTER ROLE … SET` and in the connection's startup options (SIGHUP
//!   ones 55P02, SUSET ones 42501), and the two SIGHUP ones to the superuser too; the settings
//!   keep their values; a superuser still sets the SUSET ones in its startup options, as the
//!   nodes' and the migration machinery's sessions do.
//! - `an_application_role_gets_42501_from_every_admin_function`: each function that changes the
//!   cluster, `remus_run_on_node` and the admin views refuse `app` (42501), change nothing;
//!   nothing in schema `remus` but `remus.fanout` is executable by `app`, and for `ops` only
//!   what its conversions and `remus_migrations` call; the read-only functions answer `app`.
//! - `a_remus_admin_member_administers_the_cluster`: `ops` adds and removes a node, resolves
//!   in-doubt transactions, distributes a table it owns (rows moved, its shells on every node
//!   its own) and a reference table, is refused a table it does not own, the internals of
//!   schema `remus` by name, and a table whose code a non-superuser wrote (42501, nothing
//!   distributed; the superuser may distribute that one), migrates a shard and reads the
//!   migration; `remus_run_on_node` stays refused to it (42501).
//! - `row_level_security_is_refused_on_distributed_tables`: distributing (hash or reference)
//!   a table with row-level security enabled, ENABLE / FORCE ROW LEVEL SECURITY, CREATE POLICY
//!   and ALTER POLICY on a distributed or a reference table: 0A000 naming the construct, and
//!   nothing changed on any node; DROP POLICY still works, and a table distributes once its
//!   row-level security is disabled.

use integration::roles::{connect_with_options, Role};
use postgres::Client;
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

fn app() -> Role {
    Role::new("app", "app-Pw-41d7")
}

fn ops() -> Role {
    Role::new("ops", "ops-Pw-93b2")
}

/// Creates `app` and `ops` on every node.
fn create_roles(c: &TestCluster) {
    for node in c.node_names() {
        c.connect(&node)
            .unwrap()
            .batch_execute(&format!(
                "CREATE ROLE app LOGIN PASSWORD '{}';
                 CREATE ROLE ops LOGIN PASSWORD '{}' IN ROLE remus_admin;
                 GRANT CREATE ON SCHEMA public TO ops;",
                app().password,
                ops().password
            ))
            .unwrap();
    }
}

/// "ok", or the SQLSTATE `sql` failed with.
fn outcome(db: &mut Client, sql: &str) -> String {
    match db.batch_execute(sql) {
        Ok(()) => "ok".into(),
        Err(e) => sqlstate(&e),
    }
}

/// The error message `sql` failed with (the test fails if it did not).
fn message(db: &mut Client, sql: &str) -> String {
    let e = db.batch_execute(sql).expect_err(sql);
    e.as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_else(|| format!("{e:?}"))
}

/// Runs every (statement, expected SQLSTATE) and fails the test listing every mismatch.
fn expect_all(db: &mut Client, who: &str, cases: &[(String, &str)]) {
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|(sql, want)| {
            let got = outcome(db, sql);
            (got != *want).then(|| format!("{who}: {sql}: {got}, expected {want}"))
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

fn one<T: for<'a> postgres::types::FromSql<'a>>(db: &mut Client, sql: &str) -> T {
    db.query_one(sql, &[]).unwrap().get(0)
}

const SETTINGS: [(&str, &str, &str); 4] = [
    // (setting, a value to try, SQLSTATE an ordinary session gets)
    ("remus.node_name", "n9", "55P02"),
    ("remus.forwarded", "on", "42501"),
    ("remus.migration_session", "on", "42501"),
    ("remus.coordinator_address", "http://127.0.0.1:1", "55P02"),
];

#[test]
fn a_session_cannot_change_the_nodes_settings() {
    let c = TestCluster::start(2).expect("cluster up");
    create_roles(&c);
    let mut su = c.connect("n1").unwrap();
    let show = |db: &mut Client| -> Vec<String> {
        SETTINGS
            .iter()
            .map(|(name, _, _)| one::<String>(db, &format!("SELECT current_setting('{name}')")))
            .collect()
    };
    let before = show(&mut su);
    assert_eq!(before[0], "n1");
    assert_eq!(before[1], "off");
    assert_eq!(before[2], "off");

    let mut a = connect_with_options(&c, "n1", &app(), None).unwrap();
    let mut cases = Vec::new();
    for (name, value, code) in SETTINGS {
        cases.push((format!("SET {name} = '{value}'"), code));
        cases.push((format!("SET LOCAL {name} = '{value}'"), code));
        cases.push((
            format!("SELECT set_config('{name}', '{value}', false)"),
            code,
        ));
        cases.push((
            format!("SELECT set_config('{name}', '{value}', true)"),
            code,
        ));
        // A per-role default the role sets for itself: refused as SET is (the SIGHUP ones:
        // a role default can never set them).
        cases.push((format!("ALTER ROLE app SET {name} = '{value}'"), code));
    }
    expect_all(&mut a, "app", &cases);
    assert_eq!(show(&mut a), before, "app changed a setting");

    // In the startup options: the connection itself is refused.
    for (name, value, code) in SETTINGS {
        let r = connect_with_options(&c, "n2", &app(), Some(&format!("-c {name}={value}")));
        match r {
            Ok(_) => panic!("app connected with -c {name}={value}"),
            Err(e) => assert_eq!(sqlstate(&e), code, "-c {name}={value}: {e}"),
        }
    }
    // The cluster's own sessions still set what they need: a superuser the SUSET ones (as
    // node-to-node connections and the migration machinery do, in startup options too).
    let mut node_session = connect_with_options(
        &c,
        "n2",
        &Role::superuser(&c),
        Some("-c remus.forwarded=on -c remus.migration_session=on"),
    )
    .unwrap();
    assert_eq!(
        one::<String>(
            &mut node_session,
            "SELECT current_setting('remus.forwarded')"
        ),
        "on"
    );
    // The SIGHUP ones only in postgresql.conf, whoever asks.
    let mut su_cases = Vec::new();
    for (name, value, _) in SETTINGS.iter().filter(|(_, _, code)| *code == "55P02") {
        su_cases.push((format!("SET {name} = '{value}'"), "55P02"));
        su_cases.push((
            format!("SELECT set_config('{name}', '{value}', false)"),
            "55P02",
        ));
    }
    assert_eq!(su_cases.len(), 4);
    expect_all(&mut su, "superuser", &su_cases);
    assert_eq!(show(&mut su), before);
    assert_eq!(
        one::<String>(&mut su, "SELECT remus_local_node()"),
        "n1",
        "the node's name is its configuration's"
    );
}

#[test]
fn an_application_role_gets_42501_from_every_admin_function() {
    let c = TestCluster::start(2).expect("cluster up");
    create_roles(&c);
    let mut su = c.connect("n1").unwrap();
    su.batch_execute(
        "CREATE TABLE dist (id int PRIMARY KEY, v int);
         INSERT INTO dist SELECT g, g FROM generate_series(1, 20) g;
         SELECT remus_create_distributed_table('dist', 'id', 4);
         CREATE TABLE mine (id int PRIMARY KEY); ALTER TABLE mine OWNER TO app;",
    )
    .unwrap();
    let shard: i64 = one(&mut su, "SELECT min(shard_id) FROM remus_shards");
    let state = |db: &mut Client| -> String {
        one(
            db,
            "SELECT (SELECT string_agg(name || '@' || port, ',' ORDER BY name) FROM remus.nodes)
                    || ' ' || (SELECT string_agg(shard_id || '>' || node_name, ',' ORDER BY shard_id) FROM remus.shard_map)
                    || ' ' || (SELECT count(*) FROM remus.distributed_tables)",
        )
    };
    let before = state(&mut su);

    let mut a = connect_with_options(&c, "n1", &app(), None).unwrap();
    let cases: Vec<(String, &str)> = [
        "SELECT remus_create_distributed_table('mine', 'id')".to_string(),
        "SELECT remus_create_reference_table('mine')".into(),
        "SELECT remus_add_node('n9', '127.0.0.1', 1)".into(),
        "SELECT remus_remove_node('n2')".into(),
        format!("SELECT * FROM remus_migrate_shard({shard}, 'n2', 'lock_abort')"),
        format!("SELECT * FROM remus_migrate_shards(ARRAY[{shard}], 'n2')"),
        "SELECT * FROM remus_recover_prepared()".into(),
        "SELECT remus_run_on_node('n2', 'SELECT 1')".into(),
        "SELECT * FROM remus_migrations".into(),
        "SELECT * FROM remus_nodes".into(),
        "SELECT * FROM remus_shards".into(),
        // The internals: no USAGE on the schema, and no EXECUTE.
        "SELECT remus.migration_begin(1, ARRAY[1]::bigint[])".into(),
        "SELECT remus.bump_map_generation()".into(),
        "SELECT remus.create_distributed_table('mine'::regclass, 'id', 4, NULL)".into(),
    ]
    .into_iter()
    .map(|sql| (sql, "42501"))
    .collect();
    expect_all(&mut a, "app", &cases);
    assert_eq!(
        message(&mut a, "SELECT remus_add_node('n9', '127.0.0.1', 1)"),
        "permission denied for function remus_add_node"
    );
    assert_eq!(
        state(&mut su),
        before,
        "an application role changed the cluster"
    );
    assert_eq!(
        one::<i64>(&mut su, "SELECT count(*) FROM dist"),
        20,
        "nothing moved"
    );

    // EXECUTE in schema remus, as \df remus.* lists it: remus.fanout only (the router's
    // aggregates call it as the calling role), and for remus_admin what its conversions and
    // remus_migrations call.
    let executable = |db: &mut Client, role: &str| -> String {
        db.query_one(
            "SELECT coalesce(string_agg(p.oid::regprocedure::text, ' '
                                        ORDER BY p.oid::regprocedure::text COLLATE \"C\"), '')
               FROM pg_proc p
              WHERE p.pronamespace = 'remus'::regnamespace
                AND has_function_privilege($1, p.oid, 'EXECUTE')",
            &[&role],
        )
        .unwrap()
        .get(0)
    };
    assert_eq!(executable(&mut su, "app"), "remus.fanout(regclass,text)");
    assert_eq!(
        executable(&mut su, "ops"),
        "remus.create_distributed_table(oid,text,integer,oid) remus.create_reference_table(oid) \
         remus.fanout(regclass,text) remus.list_migrations()"
    );
    // Every function of the extension that an application role may execute.
    let public: String = one(
        &mut su,
        "SELECT string_agg(p.oid::regprocedure::text, ' '
                           ORDER BY p.oid::regprocedure::text COLLATE \"C\")
           FROM pg_depend d JOIN pg_proc p ON d.classid = 'pg_proc'::regclass AND p.oid = d.objid
          WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
            AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_remus')
            AND has_function_privilege('app', p.oid, 'EXECUTE')",
    );
    assert_eq!(
        public,
        "remus.fanout(regclass,text) remus_local_node() remus_shard_id_for(regclass,anyelement) \
         remus_shard_size(bigint)"
    );
    // The read-only ones answer it.
    assert_eq!(one::<String>(&mut a, "SELECT remus_local_node()"), "n1");
    let size: Option<i64> = one(&mut a, &format!("SELECT remus_shard_size({shard})"));
    assert!(size.is_some_and(|s| s > 0), "{size:?}");
}

#[test]
fn a_remus_admin_member_administers_the_cluster() {
    let c = TestCluster::start(2).expect("cluster up");
    create_roles(&c);
    let mut su = c.connect("n1").unwrap();
    let mut o = connect_with_options(&c, "n1", &ops(), None).unwrap();
    assert!(!one::<bool>(
        &mut o,
        "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"
    ));

    // Membership: a node added on n1, then removed from every node.
    o.batch_execute("SELECT remus_add_node('n9', '127.0.0.1', 1)")
        .unwrap();
    assert_eq!(
        one::<i64>(
            &mut su,
            "SELECT count(*) FROM remus.nodes WHERE name = 'n9'"
        ),
        1
    );
    o.batch_execute("SELECT remus_remove_node('n9')").unwrap();
    for node in c.node_names() {
        let mut db = c.connect(&node).unwrap();
        assert_eq!(
            one::<String>(
                &mut db,
                "SELECT string_agg(name, ',' ORDER BY name) FROM remus.nodes"
            ),
            "n1,n2",
            "{node}"
        );
    }
    // One round of in-doubt resolution by hand (nothing is in doubt: it only has to run).
    let r = o
        .query_one("SELECT * FROM remus_recover_prepared()", &[])
        .unwrap();
    assert_eq!((r.get::<_, i64>(0), r.get::<_, i64>(1)), (0, 0));

    // A table it owns, with rows, distributed; and a reference table.
    o.batch_execute(
        "CREATE TABLE ops_t (id int PRIMARY KEY, v int CHECK (v >= 0), u uuid DEFAULT gen_random_uuid());
         INSERT INTO ops_t (id, v) SELECT g, g FROM generate_series(1, 200) g;
         SELECT remus_create_distributed_table('ops_t', 'id', 4);
         CREATE TABLE ops_ref (code text PRIMARY KEY);
         INSERT INTO ops_ref VALUES ('a'), ('b');
         SELECT remus_create_reference_table('ops_ref');",
    )
    .unwrap();
    assert_eq!(
        one::<String>(
            &mut su,
            "SELECT string_agg(DISTINCT node_name, ',' ORDER BY node_name) FROM remus_shards
              WHERE table_name = 'ops_t'"
        ),
        "n1,n2"
    );
    assert_eq!(
        one::<i64>(&mut su, "SELECT count(*) FROM ops_t"),
        200,
        "every row in a shard"
    );
    for node in c.node_names() {
        let mut db = c.connect(&node).unwrap();
        assert_eq!(
            one::<String>(
                &mut db,
                "SELECT string_agg(relname || '=' || pg_get_userbyid(relowner), ',' ORDER BY relname)
                   FROM pg_class WHERE relname IN ('ops_t', 'ops_ref') AND relnamespace = 'public'::regnamespace"
            ),
            "ops_ref=ops,ops_t=ops",
            "the shells on {node} are the owner's"
        );
        assert_eq!(
            one::<i64>(&mut db, "SELECT count(*) FROM ops_ref"),
            2,
            "{node}"
        );
    }

    // Not its table: refused as ALTER TABLE refuses it, nothing distributed.
    su.batch_execute(
        "CREATE TABLE su_t (id int PRIMARY KEY); CREATE TABLE su_r (id int PRIMARY KEY);",
    )
    .unwrap();
    let not_owner = [
        "SELECT remus_create_distributed_table('su_t', 'id')",
        "SELECT remus_create_reference_table('su_r')",
        // Nor can it name the internals (no USAGE on remus).
        "SELECT remus.create_distributed_table('su_t'::regclass, 'id', 4, NULL)",
        "SELECT * FROM remus.fanout('ops_t', 'SELECT 1') AS f(x int)",
    ];
    expect_all(&mut o, "ops", &not_owner.map(|s| (s.to_string(), "42501")));
    assert_eq!(
        message(&mut o, not_owner[0]),
        "must be owner of table public.su_t"
    );
    // Its own table whose code it wrote: the rows would move with superuser rights.
    o.batch_execute(
        "CREATE FUNCTION ops_positive(int) RETURNS bool LANGUAGE sql IMMUTABLE AS 'SELECT $1 >= 0';
         CREATE TABLE ops_checked (id int PRIMARY KEY, v int CHECK (ops_positive(v)));
         CREATE TABLE ops_trig (id int PRIMARY KEY);
         CREATE FUNCTION ops_tg() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END';
         CREATE TRIGGER ops_tg AFTER TRUNCATE ON ops_trig EXECUTE FUNCTION ops_tg();",
    )
    .unwrap();
    expect_all(
        &mut o,
        "ops",
        &[
            (
                "SELECT remus_create_distributed_table('ops_checked', 'id')".into(),
                "42501",
            ),
            (
                "SELECT remus_create_reference_table('ops_trig')".into(),
                "42501",
            ),
        ],
    );
    let m = message(
        &mut o,
        "SELECT remus_create_distributed_table('ops_checked', 'id')",
    );
    assert!(
        m.contains("ops_positive(integer)") && m.contains("owned by ops"),
        "{m}"
    );
    assert_eq!(
        one::<String>(
            &mut su,
            "SELECT string_agg(logicalrelid::text, ',' ORDER BY logicalrelid::text)
               FROM remus.distributed_tables"
        ),
        "ops_ref,ops_t",
        "nothing else distributed"
    );
    // The superuser may (the function must exist on every node, as the shells' CHECK names it).
    connect_with_options(&c, "n2", &ops(), None)
        .unwrap()
        .batch_execute(
            "CREATE FUNCTION ops_positive(int) RETURNS bool LANGUAGE sql IMMUTABLE AS 'SELECT $1 >= 0'",
        )
        .unwrap();
    su.batch_execute("SELECT remus_create_distributed_table('ops_checked', 'id', 2)")
        .unwrap();

    // A migration of one of its shards, and the view that shows it.
    let (shard, from): (i64, String) = {
        let r = o
            .query_one(
                "SELECT shard_id, node_name FROM remus_shards WHERE table_name = 'ops_t'
                  ORDER BY shard_id LIMIT 1",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    let to = if from == "n1" { "n2" } else { "n1" };
    let r = o
        .query_one(
            "SELECT migration_id, status FROM remus_migrate_shard($1, $2, 'lock_abort')",
            &[&shard, &to],
        )
        .unwrap();
    let (id, status): (i64, String) = (r.get(0), r.get(1));
    assert_eq!(status, "succeeded");
    assert_eq!(
        su.query_one(
            "SELECT node_name FROM remus_shards WHERE shard_id = $1",
            &[&shard]
        )
        .unwrap()
        .get::<_, String>(0),
        to
    );
    assert_eq!(one::<i64>(&mut su, "SELECT count(*) FROM ops_t"), 200);
    assert_eq!(
        o.query_one(
            "SELECT status FROM remus_migrations WHERE migration_id = $1",
            &[&id]
        )
        .unwrap()
        .get::<_, String>(0),
        "succeeded"
    );

    // Arbitrary SQL on a node stays the superuser's.
    expect_all(
        &mut o,
        "ops",
        &[("SELECT remus_run_on_node('n2', 'SELECT 1')".into(), "42501")],
    );
}

#[test]
fn row_level_security_is_refused_on_distributed_tables() {
    let c = TestCluster::start(2).expect("cluster up");
    let mut db = c.connect("n2").unwrap();
    db.batch_execute(
        "CREATE TABLE rls_h (id int PRIMARY KEY, who text);
         CREATE TABLE rls_r (id int PRIMARY KEY, who text);
         ALTER TABLE rls_h ENABLE ROW LEVEL SECURITY;
         ALTER TABLE rls_r ENABLE ROW LEVEL SECURITY;
         CREATE TABLE d (id int PRIMARY KEY, who text);
         CREATE POLICY mine ON d USING (who = current_user);
         SELECT remus_create_distributed_table('d', 'id', 4);
         CREATE TABLE r (id int PRIMARY KEY, who text);
         CREATE POLICY mine ON r USING (who = current_user);
         SELECT remus_create_reference_table('r');",
    )
    .unwrap();
    let cases: Vec<(String, &str)> = [
        "SELECT remus_create_distributed_table('rls_h', 'id')",
        "SELECT remus_create_reference_table('rls_r')",
        "ALTER TABLE d ENABLE ROW LEVEL SECURITY",
        "ALTER TABLE d FORCE ROW LEVEL SECURITY",
        "ALTER TABLE r ENABLE ROW LEVEL SECURITY",
        "ALTER TABLE r FORCE ROW LEVEL SECURITY",
        "CREATE POLICY other ON d USING (true)",
        "CREATE POLICY other ON r FOR SELECT USING (true)",
        "ALTER POLICY mine ON d USING (true)",
        "ALTER POLICY mine ON r TO PUBLIC",
    ]
    .into_iter()
    .map(|s| (s.to_string(), "0A000"))
    .collect();
    expect_all(&mut db, "superuser", &cases);
    for (sql, names) in [
        (
            "SELECT remus_create_distributed_table('rls_h', 'id')",
            "public.rls_h has row-level security enabled",
        ),
        (
            "ALTER TABLE d ENABLE ROW LEVEL SECURITY",
            "ALTER TABLE … ENABLE ROW LEVEL SECURITY on distributed table public.d",
        ),
        (
            "ALTER TABLE d FORCE ROW LEVEL SECURITY",
            "ALTER TABLE … FORCE ROW LEVEL SECURITY on distributed table public.d",
        ),
        (
            "CREATE POLICY other ON r FOR SELECT USING (true)",
            "CREATE POLICY on reference table public.r",
        ),
        (
            "ALTER POLICY mine ON d USING (true)",
            "ALTER POLICY on distributed table public.d",
        ),
    ] {
        let m = message(&mut db, sql);
        assert!(m.starts_with(names), "{sql}: {m}");
    }
    // Nothing of it happened, on any node.
    for node in c.node_names() {
        let mut n = c.connect(&node).unwrap();
        assert_eq!(
            one::<String>(
                &mut n,
                "SELECT string_agg(c.relname || ':' || c.relrowsecurity || c.relforcerowsecurity
                                   || ':' || (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid),
                                   ' ' ORDER BY c.relname)
                   FROM pg_class c WHERE c.relname IN ('d', 'r') AND c.relnamespace = 'public'::regnamespace"
            ),
            if node == "n2" { "d:falsefalse:1 r:falsefalse:1" } else { "d:falsefalse:0 r:falsefalse:0" },
            "{node}"
        );
    }
    assert_eq!(
        one::<i64>(
            &mut db,
            "SELECT count(*) FROM remus.distributed_tables WHERE logicalrelid::text IN ('rls_h', 'rls_r')"
        ),
        0
    );
    // Turning it off loses nothing: still allowed.
    expect_all(
        &mut db,
        "superuser",
        &[
            ("DROP POLICY mine ON d".into(), "ok"),
            ("DROP POLICY mine ON r".into(), "ok"),
        ],
    );
    db.batch_execute(
        "ALTER TABLE rls_h DISABLE ROW LEVEL SECURITY;
         SELECT remus_create_distributed_table('rls_h', 'id', 4);",
    )
    .unwrap();
}
