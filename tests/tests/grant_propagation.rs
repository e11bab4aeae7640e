//! GRANT and REVOKE on distributed and reference tables take effect on every node or on none
//! (issue 18 item 3; `pg_remus/src/router/grant.rs`), and a table's grants follow it when it is
//! distributed (`pg_remus/src/distribute/mod.rs`, `shell_ddl`).

use integration::pgbench::prepared_everywhere;
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

/// The ACL of `table`'s shell on every node, as text, in node order.
fn acls(c: &TestCluster, table: &str) -> Vec<String> {
    c.node_names()
        .iter()
        .map(|n| {
            c.connect(n)
                .unwrap()
                .query_one(
                    "SELECT coalesce(relacl::text, '') FROM pg_class WHERE oid = $1::text::regclass",
                    &[&table],
                )
                .unwrap()
                .get(0)
        })
        .collect()
}

#[test]
fn grant_and_revoke_reach_every_node_or_none() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE acct (id int PRIMARY KEY, bal int);
         SELECT remus_create_distributed_table('acct', 'id', 4);
         CREATE TABLE region (id int PRIMARY KEY, name text);
         SELECT remus_create_reference_table('region');
         CREATE TABLE local_only (id int);",
    )
    .unwrap();
    // Roles are per PostgreSQL cluster: `app` on every node, `only_n1` on n1 alone.
    for n in c.node_names() {
        c.connect(&n)
            .unwrap()
            .batch_execute("CREATE ROLE app")
            .unwrap();
    }
    n1.batch_execute("CREATE ROLE only_n1").unwrap();

    // Entered through n2, a GRANT on a distributed and a reference table lands everywhere.
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute("GRANT SELECT, UPDATE ON acct, region TO app")
        .unwrap();
    for table in ["acct", "region"] {
        let a = acls(&c, table);
        assert!(a[0].contains("app=rw/"), "{table} on n1: {}", a[0]);
        assert!(a.iter().all(|x| *x == a[0]), "{table}: {a:?}");
    }
    // Inside a transaction block, with other work: committed with it.
    n2.batch_execute(
        "BEGIN; UPDATE acct SET bal = 1 WHERE id = 1; REVOKE UPDATE ON acct FROM app; COMMIT",
    )
    .unwrap();
    let a = acls(&c, "acct");
    assert!(a[0].contains("app=r/"), "{}", a[0]);
    assert!(a.iter().all(|x| *x == a[0]), "{a:?}");
    // Rolled back with its transaction: nowhere.
    n2.batch_execute("BEGIN; GRANT DELETE ON acct TO app; ROLLBACK")
        .unwrap();
    assert!(acls(&c, "acct").iter().all(|x| *x == a[0]));

    // A role that one node lacks fails the GRANT on every node, nothing left prepared.
    let e = n1
        .batch_execute("GRANT SELECT ON acct TO only_n1")
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42704", "{e:?}");
    assert!(acls(&c, "acct").iter().all(|x| *x == a[0]));
    assert_eq!(prepared_everywhere(&c), 0);

    // What would act on distributed tables on one node only is refused.
    for sql in [
        "GRANT SELECT ON acct, local_only TO app",
        "GRANT SELECT ON ALL TABLES IN SCHEMA public TO app",
    ] {
        let e = n1.batch_execute(sql).unwrap_err();
        assert_eq!(sqlstate(&e), "0A000", "{sql}: {e:?}");
    }
    assert!(acls(&c, "acct").iter().all(|x| *x == a[0]));
    // A local table alone is PostgreSQL's business.
    n1.batch_execute("GRANT SELECT ON local_only TO app")
        .unwrap();

    // Grants made before a table is distributed (table and column privileges, PUBLIC, grant
    // option) are on every node's shell after it.
    n1.batch_execute(
        "CREATE TABLE early (id int PRIMARY KEY, secret text, note text);
         GRANT SELECT ON early TO app WITH GRANT OPTION;
         GRANT UPDATE (note) ON early TO app;
         GRANT INSERT ON early TO PUBLIC;
         SELECT remus_create_distributed_table('early', 'id', 4);",
    )
    .unwrap();
    let a = acls(&c, "early");
    assert!(a[0].contains("app=r*/") && a[0].contains("=a/"), "{}", a[0]);
    assert!(a.iter().all(|x| *x == a[0]), "{a:?}");
    let column_acls: Vec<String> = c
        .node_names()
        .iter()
        .map(|n| {
            c.connect(n)
                .unwrap()
                .query_one(
                    "SELECT string_agg(attname || coalesce(attacl::text, ''), ' ' ORDER BY attnum)
                       FROM pg_attribute WHERE attrelid = 'early'::regclass AND attnum > 0",
                    &[],
                )
                .unwrap()
                .get(0)
        })
        .collect();
    assert!(column_acls[0].contains("note{app=w/"), "{}", column_acls[0]);
    assert!(
        column_acls.iter().all(|x| *x == column_acls[0]),
        "{column_acls:?}"
    );
}
