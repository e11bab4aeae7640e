//! Migrations that must not happen or must not leave anything behind: DDL refused while a
//! migration holds the shards, a target node that is down, a migration that fails after its
//! copy (rolled back completely) or at its first step (a pre-existing table on the target is
//! not touched), and the `remusctl migrate` CLI.

use integration::shards::shards_of;
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

#[test]
fn failures_change_nothing_and_leave_nothing() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, v text);
         INSERT INTO items SELECT i, 'v' || i FROM generate_series(1, 2000) i;
         SELECT remus_create_distributed_table('items', 'id', shard_count => 3);",
    )
    .unwrap();
    let shards = shards_of(&mut n1, "items");
    let (sid, owner) = shards
        .iter()
        .find(|(_, o)| o == "n1")
        .cloned()
        .expect("n1 owns a shard");
    let shard_table = format!("remus_shards.items_{sid}");

    // DDL on a registered (migrating) shard and on its distributed table is refused with 55006,
    // and allowed again once the registration ends.
    n1.execute(
        "SELECT remus.migration_begin(4242, ARRAY[$1]::bigint[])",
        &[&sid],
    )
    .unwrap();
    for ddl in [
        format!("ALTER TABLE {shard_table} ADD COLUMN z int"),
        format!("CREATE INDEX ON {shard_table} (v)"),
        format!("TRUNCATE {shard_table}"),
        format!("DROP TABLE {shard_table}"),
        "TRUNCATE items".to_string(),
    ] {
        let e = n1.batch_execute(&ddl).expect_err(&ddl);
        assert_eq!(sqlstate(&e), "55006", "{ddl}: {e:?}");
        assert!(
            format!("{e:?}").contains("being migrated by shard migration 4242"),
            "{e:?}"
        );
    }
    assert_eq!(
        n1.query_one("SELECT remus.migration_end(4242)", &[])
            .unwrap()
            .get::<_, i64>(0),
        0
    );
    n1.batch_execute(&format!(
        "CREATE INDEX items_v_idx ON {shard_table} (v); DROP INDEX remus_shards.items_v_idx"
    ))
    .unwrap();

    // A target node that is down: refused (08006), nothing recorded.
    c.stop_node("n3").unwrap();
    let target_down = n1
        .query(
            "SELECT * FROM remus_migrate_shard($1, 'n3', 'lock_abort')",
            &[&sid],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&target_down), "08006", "{target_down:?}");
    c.start_node("n3").unwrap();
    // This session's cached connection to n3 died with it (see the note in README "Status").
    let mut n1 = c.connect("n1").unwrap();
    let recorded: i64 = n1
        .query_one("SELECT count(*) FROM remus_migrations", &[])
        .unwrap()
        .get(0);
    assert_eq!(recorded, 0, "a refused request records nothing");

    // A table of that name already on the target: the migration fails at its first step, is
    // rolled back, and the stranger's table is left alone.
    let mut n2 = c.connect("n2").unwrap();
    n2.batch_execute(&format!("SET remus.migration_session = on; CREATE TABLE {shard_table} (note text); INSERT INTO {shard_table} VALUES ('mine')"))
        .unwrap();
    let e = n1
        .query(
            "SELECT * FROM remus_migrate_shard($1, 'n2', 'lock_abort')",
            &[&sid],
        )
        .unwrap_err();
    assert!(format!("{e:?}").contains("rolled_back"), "{e:?}");
    let note: String = n2
        .query_one(&format!("SELECT note FROM {shard_table}"), &[])
        .unwrap()
        .get(0);
    assert_eq!(note, "mine");
    n2.batch_execute(&format!(
        "SET remus.migration_session = on; DROP TABLE {shard_table}"
    ))
    .unwrap();
    let row = n1
        .query_one(
            "SELECT status, phase, error FROM remus_migrations ORDER BY migration_id DESC LIMIT 1",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "rolled_back");
    assert!(
        row.get::<_, Option<String>>(2)
            .unwrap_or_default()
            .contains("already exists"),
        "{:?}",
        row.get::<_, Option<String>>(2)
    );

    // The replay worker is gone: the migration fails after its copy and is rolled back
    // completely: target tables, slot, publication, origins, registration.
    let state = c.state().unwrap();
    let worker = state.replay_worker.live_pid().expect("replay worker runs");
    // SAFETY: SIGKILL to the replay worker this test's cluster started.
    unsafe { libc::kill(worker as i32, libc::SIGKILL) };
    let e = n1
        .query(
            "SELECT * FROM remus_migrate_shard($1, 'n2', 'wait_remaster')",
            &[&sid],
        )
        .unwrap_err();
    assert!(format!("{e:?}").contains("rolled_back"), "{e:?}");
    let exists: bool = n2
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&shard_table])
        .unwrap()
        .get(0);
    assert!(!exists, "the target's copy is dropped");
    assert_eq!(c.migration_artifacts(), Vec::<String>::new());
    assert_eq!(shards_of(&mut n1, "items"), shards, "ownership unchanged");
    let (count, sum): (i64, i64) = {
        let r = n1
            .query_one("SELECT count(*), sum(id) FROM items", &[])
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (count, sum),
        (2000, 2001000),
        "the source still serves every row"
    );
    // The registration ended with the rollback: DDL on the shard is allowed again.
    n1.batch_execute(&format!(
        "CREATE INDEX items_v2_idx ON {shard_table} (v); DROP INDEX remus_shards.items_v2_idx"
    ))
    .unwrap();
    assert_eq!(owner, "n1");
}

#[test]
fn remusctl_migrate_prints_phases_and_a_summary() {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(
        "CREATE TABLE kv (k int PRIMARY KEY, v int NOT NULL);
         INSERT INTO kv SELECT i, i FROM generate_series(1, 500) i;
         SELECT remus_create_distributed_table('kv', 'k', shard_count => 3);",
    )
    .unwrap();
    let (sid, _) = shards_of(&mut n1, "kv")
        .into_iter()
        .find(|(_, o)| o == "n2")
        .unwrap();
    let out = c.ctl(&[
        "migrate",
        "--shard",
        &sid.to_string(),
        "--to",
        "n3",
        "--mode",
        "wait_remaster",
    ]);
    let text = remus_test_support::cluster::stdout(&out);
    assert!(
        out.status.success(),
        "{text}{}",
        remus_test_support::cluster::stderr(&out)
    );
    for phase in ["copy", "catchup", "handover", "cleanup", "done"] {
        assert!(
            text.contains(&format!("phase {phase} ")),
            "no line for phase {phase}:\n{text}"
        );
    }
    assert!(
        text.lines().last().unwrap_or("").contains("succeeded"),
        "{text}"
    );
    assert_eq!(
        shards_of(&mut n1, "kv")
            .iter()
            .find(|(s, _)| *s == sid)
            .unwrap()
            .1,
        "n3"
    );
    let sum: i64 = n1
        .query_one("SELECT sum(v)::bigint FROM kv", &[])
        .unwrap()
        .get(0);
    assert_eq!(sum, 125_250);

    // Refusals come back with their SQLSTATE and a non-zero exit.
    let out = c.ctl(&[
        "migrate",
        "--shard",
        &sid.to_string(),
        "--to",
        "n3",
        "--mode",
        "lock_abort",
    ]);
    assert!(!out.status.success());
    assert!(
        remus_test_support::cluster::stderr(&out).contains("SQLSTATE 22023"),
        "{}",
        remus_test_support::cluster::stderr(&out)
    );
    let listed = remus_test_support::cluster::stdout(&c.ctl(&["migrations"]));
    assert!(
        listed.contains("wait_remaster") && listed.contains("succeeded"),
        "{listed}"
    );
}
