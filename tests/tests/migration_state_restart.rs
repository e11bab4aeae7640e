//! What a node enforces for a running migration survives its restart (issue 15 requirement 3;
//! design note `docs/design/notes/0001-migration-state-across-node-restarts.md`).
//!
//! A Remus migration is held in dual execution (failpoint `dual.started`: the source captures
//! and validates in sync mode) while one node crash-restarts (kill -9 of its postmaster and
//! every child, then a start: its shared memory is gone). After the start, before anything
//! else runs there, the node's handover state shows the migration again (registration, and on
//! the source capture and sync mode with the validating replay worker), DDL and VACUUM FREEZE
//! on the migrating shard are refused with the SQLSTATE they got before the restart, and once
//! the migration goes on it ends succeeded or rolled back with every TPC-B balance equal to
//! its history and nothing of it left on any node: no shared-memory entry, no durable state,
//! no slot, publication, origin or prepared transaction. (Before the fix the restarted node
//! had forgotten the migration: no entry, and the DDL ran.)

use std::time::Duration;

use coordinator::failpoint::DUAL_STARTED;
use integration::consistency::assert_tpcb_consistent;
use integration::migrations::{start_paused, tpcb_cluster_with_shard_on, wait_ended};
use integration::pgbench::{finish, start_tpcb};
use remus_test_support::cluster::TestCluster;
use remus_test_support::sqlstate;

/// The statements a migration refuses on a node where it is registered: DDL and a freezing
/// VACUUM on `table` (the shard table on the source, the distributed table elsewhere).
fn refusals(c: &TestCluster, node: &str, table: &str) -> Vec<(String, String)> {
    let mut db = c.connect(node).unwrap();
    [
        format!("ALTER TABLE {table} ADD COLUMN restart_probe int"),
        format!("VACUUM (FREEZE) {table}"),
    ]
    .into_iter()
    .map(|q| {
        let outcome = match db.batch_execute(&q) {
            Ok(()) => "ok".to_string(),
            Err(e) => sqlstate(&e),
        };
        (q, outcome)
    })
    .collect()
}

/// The entries of migration `id` in node `node`'s handover state (shared memory and durable),
/// as "node: kind id detail" lines.
fn entries(c: &TestCluster, node: &str, id: i64) -> Vec<String> {
    let id = id.to_string();
    c.handover_state(node)
        .into_iter()
        .filter(|l| l.split_whitespace().nth(2) == Some(id.as_str()))
        .collect()
}

/// A crash of node `name` (kill -9 of the server, nothing flushed or cleaned up; shared memory
/// is created anew) and its start.
fn crash_restart(c: &TestCluster, name: &str) {
    c.kill_node(name).unwrap();
    c.start_node(name).unwrap();
}

/// Restarts `restarted` while a migration of one of n1's account shards to n2, called through
/// `via`, is held in dual execution; checks the restored state and the end (module doc).
fn restart_in_dual_execution(restarted: &str, via: &str) {
    let source = "n1";
    let (c, shard) = tpcb_cluster_with_shard_on(source);
    // What the restarted node refuses: the shard table where it is, the distributed table
    // elsewhere.
    let table = if restarted == source {
        format!("remus_shards.pgbench_accounts_{shard}")
    } else {
        "pgbench_accounts".to_string()
    };

    let (id, mover) = start_paused(&c, via, shard, "n2", DUAL_STARTED);
    // Committed transactions in dual execution (validated on the target), through a node
    // that is not restarted.
    let before = finish(start_tpcb(&c, via, 2, 2));
    assert_eq!(before.aborted_clients, 0, "{}", before.output);

    let refused = refusals(&c, restarted, &table);
    for (q, outcome) in &refused {
        assert_eq!(outcome, "55006", "{q} before the restart");
    }
    let state = entries(&c, restarted, id);

    crash_restart(&c, restarted);

    // The first statements on the restarted node: refused exactly as before.
    assert_eq!(
        refusals(&c, restarted, &table),
        refused,
        "the restarted node refuses what it refused before"
    );
    let restored = entries(&c, restarted, id);
    println!("{restarted} before the restart: {state:#?}\nafter: {restored:#?}");
    let migration = restored
        .iter()
        .find(|l| l.contains(": migration "))
        .unwrap_or_else(|| panic!("migration {id} not restored on {restarted}: {restored:?}"));
    assert!(migration.contains("restored true"), "{migration}");
    assert!(
        restored
            .iter()
            .any(|l| l.contains(&format!(": shard {id} shard {shard}"))),
        "shard {shard} registered again: {restored:?}"
    );
    assert!(
        restored.iter().any(|l| l.contains(": durable ")),
        "{restored:?}"
    );
    let on_source = restarted == source;
    assert_eq!(
        migration.contains("capture true sync true"),
        on_source,
        "capture and sync mode come back on the source only: {migration}"
    );
    // Same detail as before the restart, but for the flag and the abort count.
    let comparable = |l: &String| -> String {
        let l = l.replace(" restored true", " restored false");
        match l.split_once(" aborts ") {
            Some((head, tail)) => format!("{head}{}", &tail[tail.find(' ').unwrap_or(0)..]),
            None => l,
        }
    };
    let before_restart: Vec<String> = state.iter().map(comparable).collect();
    for l in restored.iter().filter(|l| !l.contains(": durable ")) {
        assert!(
            before_restart.contains(&comparable(l)),
            "{l} was not there before the restart: {state:?}"
        );
    }

    c.release_failpoint(DUAL_STARTED).unwrap();
    let (status, error) = wait_ended(&c, "n2", id, Duration::from_secs(60));
    assert!(
        status == "succeeded" || status == "rolled_back",
        "{status}: {error:?}\n{}",
        c.daemon_logs(40)
    );
    println!(
        "migration {id} {status} ({error:?}); the call: {:?}",
        mover.join().unwrap()
    );
    let after = finish(start_tpcb(&c, via, 2, 2));
    assert_eq!(after.aborted_clients, 0, "{}", after.output);
    assert_tpcb_consistent(
        &c,
        via,
        before.processed + after.processed,
        &format!("{restarted} restarted in dual execution, migration {status}"),
    );
    for n in c.node_names() {
        assert_eq!(
            entries(&c, &n, id),
            Vec::<String>::new(),
            "migration {id} left state on {n}"
        );
    }
    assert_eq!(c.migration_artifacts(), Vec::<String>::new());
    // The registration is gone: a freezing VACUUM runs again.
    let mut db = c.connect(restarted).unwrap();
    db.batch_execute("VACUUM (FREEZE) pgbench_accounts")
        .expect("VACUUM FREEZE after the migration");
}

/// The source restarts in dual execution: it gets back its registration, capture and sync
/// mode; the coordinator, whose stream from the source broke, rolls back (clearing them) or
/// completes.
#[test]
fn a_source_restarted_in_dual_execution_enforces_the_migration_again() {
    restart_in_dual_execution("n1", "n3");
}

/// A third node (neither source nor target) restarts in dual execution: it gets back the
/// registration, and the migration completes.
#[test]
fn a_third_node_restarted_in_dual_execution_enforces_the_migration_again() {
    restart_in_dual_execution("n3", "n2");
}

/// A node that missed a migration's end (it was down longer than the coordinator waits for it)
/// keeps that migration's state, durable copy included, and would refuse DDL on the shard and
/// fail its writes for good (README, failure 11, before the fix). The leader coordinator's
/// sweep (`coordinator::reconcile`) clears it within seconds once the migration's record says
/// it has ended. The missed end is made directly: the node is given the registration of a
/// migration that has already succeeded, as the call it missed would have left it.
#[test]
fn state_a_node_kept_for_a_migration_that_ended_is_cleared_by_the_coordinator() {
    let (c, shard) = tpcb_cluster_with_shard_on("n1");
    let mut n1 = c.connect("n1").unwrap();
    let row = n1
        .query_one(
            "SELECT migration_id, status FROM remus_migrate_shard($1, 'n2')",
            &[&shard],
        )
        .unwrap();
    let (id, status): (i64, String) = (row.get(0), row.get(1));
    assert_eq!(status, "succeeded");
    let mut n3 = c.connect("n3").unwrap();
    // One statement: the sweep must not clear it before it is seen.
    let durable: i64 = n3
        .query_one(
            "SELECT (SELECT count(*) FROM remus.handover_state()
                      WHERE migration_id = $1 AND kind = 'durable')
               FROM (SELECT remus.migration_begin($1, ARRAY[$2::bigint])) AS registered",
            &[&id, &shard],
        )
        .unwrap()
        .get(0);
    assert_eq!(durable, 1, "no durable state for migration {id} on n3");
    remus_test_support::wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || entries(&c, "n3", id).is_empty(),
        || {
            format!(
                "n3 still holds migration {id}, which succeeded: {:?}\n{}",
                entries(&c, "n3", id),
                c.daemon_logs(20)
            )
        },
    );
    // Nothing of it is enforced any more: a freezing VACUUM of the moved table runs on n3.
    n3.batch_execute("VACUUM (FREEZE) pgbench_accounts")
        .expect("VACUUM FREEZE once the ended migration's state is cleared");
}
