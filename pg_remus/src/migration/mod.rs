//! The node side of a shard migration, one module per Remus phase.
//!
//! The coordinator drives a migration phase by phase (`coordinator::migration::Phase`); each
//! phase has its node-side half here and its driver half in a file of the same name on the
//! coordinator, so `grep -r barrier` finds both halves of the sync barrier:
//!
//! | phase | node side (this crate) | coordinator side |
//! | --- | --- | --- |
//! | copy | [`copy`]: registration (`remus.migration_begin`), DDL refusal | `coordinator/src/driver/copy.rs` |
//! | catch-up | [`catchup`]: the capture trigger, `remus.migration_capture`; [`apply_batch`]: the target's batch apply | `coordinator/src/driver/catchup.rs`, `replay_worker/src/apply` |
//! | sync barrier | [`barrier`]: `remus.sync_barrier`, the "in async commit" marks | `coordinator/src/driver/barrier.rs` |
//! | dual execution | [`dual`]: validate-then-commit, post-commit resolve, prepared shadows | `coordinator/src/driver/dual.rs` |
//! | handover, lock_abort | [`handover::lock_abort`]: write fence, writer abort, cancel rewrite | `coordinator/src/driver/handover/lock_abort.rs` |
//! | handover, wait_remaster | [`handover::wait_remaster`]: the admission gate | `coordinator/src/driver/handover/wait_remaster.rs` |
//! | handover, remus (Tm) | [`handover::remus`]: the drain source and the drain wait | `coordinator/src/driver/handover/remus.rs` |
//! | squall (pull after Tm) | [`squall`]: the chunk catalog, the wait for unpulled chunks | `coordinator/src/driver/squall.rs` |
//! | cleanup | [`cleanup`]: `remus.migration_end`, `remus.migration_aborts` | `coordinator/src/driver/cleanup.rs` |
//!
//! Rollback and resume (`coordinator/src/driver/{rollback,resume}.rs`) have no node side of
//! their own: they call the functions above. Everything lives in shared memory ([`state`]), so
//! every backend of the node obeys it at its next statement. A node restart clears shared
//! memory; each migration's registration, capture, sync mode, fence and drain source are kept
//! on disk by the calls that set them and put back when shared memory is created, before any
//! backend runs ([`durable`]); and until the coordinator has finished the migration the node
//! also guards the moving shards from the shard map and the prepared Tm
//! ([`handover::restart`]). The coordinator decides when each
//! primitive is used; nothing here knows the order of the phases.
//!
//! Every session of the migration machinery (`remus.migration_session`) is exempt from the
//! registration's DDL refusal, the fence, the writer abort and the admission gate.

pub(crate) mod apply_batch;
pub(crate) mod barrier;
pub(crate) mod catchup;
pub(crate) mod cleanup;
pub(crate) mod copy;
pub(crate) mod dual;
pub(crate) mod durable;
pub(crate) mod handover;
pub(crate) mod squall;
pub(crate) mod state;

/// Reserves the shared memory; must run while the library is preloaded.
pub(crate) fn init_shmem() {
    durable::init_shmem();
    handover::restart::init_shmem();
    handover::albatross::init_shmem();
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    /// Runs `sql` and returns "ok", or "SQLSTATE: message" of the error it raised (caught in a
    /// subtransaction, so the test goes on).
    fn outcome(sql: &str) -> String {
        Spi::run(
            "CREATE OR REPLACE FUNCTION pg_temp.outcome(q text) RETURNS text LANGUAGE plpgsql AS $$
             BEGIN EXECUTE q; RETURN 'ok';
             EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE || ': ' || SQLERRM; END $$",
        )
        .unwrap();
        Spi::get_one_with_args::<String>("SELECT pg_temp.outcome($1)", &[sql.into()])
            .unwrap()
            .unwrap()
    }

    fn aborts(migration_id: i64) -> i64 {
        Spi::get_one_with_args::<i64>("SELECT remus.migration_aborts($1)", &[migration_id.into()])
            .unwrap()
            .unwrap()
    }

    #[pg_test]
    fn registration_is_idempotent_and_end_clears_it() {
        Spi::run("SELECT remus.migration_begin(9001, ARRAY[900101, 900102])").unwrap();
        Spi::run("SELECT remus.migration_begin(9001, ARRAY[900101, 900102])").unwrap();
        assert_eq!(aborts(9001), 0);
        assert!(outcome("SELECT remus.migration_begin(9011, ARRAY[900102])")
            .starts_with("55006: shard 900102 is already registered by migration 9001"));
        assert_eq!(
            Spi::get_one::<i64>("SELECT remus.migration_end(9001)").unwrap(),
            Some(0)
        );
        assert_eq!(
            Spi::get_one::<i64>("SELECT remus.migration_end(9001)").unwrap(),
            Some(0)
        );
        assert_eq!(
            Spi::get_one::<i64>("SELECT remus.migration_end(9999)").unwrap(),
            Some(0)
        );
        // The shards are free again.
        assert_eq!(
            outcome("SELECT remus.migration_begin(9011, ARRAY[900102])"),
            "ok"
        );
        Spi::run("SELECT remus.migration_end(9011)").unwrap();
        assert!(outcome("SELECT remus.migration_fence(9001)")
            .starts_with("22023: migration 9001 is not registered"));
    }

    #[pg_test]
    fn capture_needs_registration_and_the_barrier_needs_capture() {
        assert!(
            outcome("SELECT remus.migration_capture(9101, 'http://127.0.0.1:1')")
                .starts_with("22023: migration 9101 is not registered")
        );
        Spi::run("SELECT remus.migration_begin(9101, ARRAY[910101])").unwrap();
        assert!(outcome("SELECT remus.sync_barrier(9101)")
            .starts_with("22023: migration 9101 does not capture writes"));
        assert!(outcome("SELECT remus.migration_capture(9101, '')")
            .starts_with("22023: replay worker endpoint must be"));
        Spi::run("SELECT remus.migration_capture(9101, 'http://127.0.0.1:1')").unwrap();
        // Nobody is committing in async mode: the barrier returns the insert position at once.
        let lsn = Spi::get_one::<i64>("SELECT remus.sync_barrier(9101)")
            .unwrap()
            .unwrap();
        let now =
            Spi::get_one::<i64>("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
                .unwrap();
        assert!(lsn > 0 && Some(lsn) <= now, "{lsn} vs {now:?}");
        Spi::run("SELECT remus.migration_end(9101)").unwrap();
    }

    #[pg_test]
    fn drain_source_needs_registration_and_ends_with_the_migration_or_empty() {
        assert!(outcome("SELECT remus.migration_drain_source(9201, 'n1')")
            .starts_with("22023: migration 9201 is not registered"));
        Spi::run("SELECT remus.migration_begin(9201, ARRAY[920101])").unwrap();
        assert_eq!(
            crate::migration::handover::remus::drain_source_of(920101),
            None
        );
        assert!(
            outcome(&format!(
                "SELECT remus.migration_drain_source(9201, '{}')",
                "n".repeat(200)
            ))
            .starts_with("22023: node name must be"),
            "a name longer than shared memory holds"
        );
        // '' ends the drain (the coordinator, once nothing older than Tm is left).
        Spi::run("SELECT remus.migration_drain_source(9201, 'n1')").unwrap();
        Spi::run("SELECT remus.migration_drain_source(9201, '')").unwrap();
        assert_eq!(
            crate::migration::handover::remus::drain_source_of(920101),
            None,
            "ended by ''"
        );
        Spi::run("SELECT remus.migration_drain_source(9201, 'n1')").unwrap();
        assert_eq!(
            crate::migration::handover::remus::drain_source_of(920101).as_deref(),
            Some("n1")
        );
        assert_eq!(
            crate::migration::handover::remus::drain_source_of(920102),
            None,
            "another shard is not draining"
        );
        Spi::run("SELECT remus.migration_end(9201)").unwrap();
        assert_eq!(
            crate::migration::handover::remus::drain_source_of(920101),
            None
        );
    }

    #[pg_test]
    fn capture_trigger_is_inert_without_a_capturing_migration() {
        Spi::run("CREATE TABLE remus_shards.cap_910201 (id int PRIMARY KEY, v text)").unwrap();
        Spi::run(&crate::catalog::shard_ddl::capture_trigger_ddl(
            "remus_shards.cap_910201",
            910201,
        ))
        .unwrap();
        Spi::run("INSERT INTO remus_shards.cap_910201 VALUES (1, 'a')").unwrap();
        Spi::run("UPDATE remus_shards.cap_910201 SET v = 'b'").unwrap();
        Spi::run("DELETE FROM remus_shards.cap_910201").unwrap();
        assert_eq!(crate::migration::catchup::captured_changes(), 0);
        // Registered and capturing: each row change is in this transaction's write set.
        Spi::run("SELECT remus.migration_begin(9102, ARRAY[910201])").unwrap();
        Spi::run("SELECT remus.migration_capture(9102, 'http://127.0.0.1:1')").unwrap();
        Spi::run("INSERT INTO remus_shards.cap_910201 VALUES (2, 'c'), (3, NULL)").unwrap();
        Spi::run("UPDATE remus_shards.cap_910201 SET v = 'd' WHERE id = 2").unwrap();
        assert_eq!(crate::migration::catchup::captured_changes(), 3);
        Spi::run("SELECT remus.migration_end(9102)").unwrap();
    }

    #[pg_test]
    fn fence_fails_writes_with_40001_and_counts_them() {
        Spi::run("CREATE TABLE remus_shards.fenced_900201 (id int PRIMARY KEY, v int)").unwrap();
        Spi::run("INSERT INTO remus_shards.fenced_900201 VALUES (1, 1)").unwrap();
        Spi::run("SELECT remus.migration_begin(9002, ARRAY[900201])").unwrap();
        // Registered but not fenced: writes go on.
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 2"), "ok");
        Spi::run("SELECT remus.migration_fence(9002)").unwrap();
        let moved = "40001: shard 900201 was moved by shard migration 9002; retry the transaction";
        assert_eq!(
            outcome("INSERT INTO remus_shards.fenced_900201 VALUES (2, 2)"),
            moved
        );
        assert_eq!(
            outcome("UPDATE remus_shards.fenced_900201 SET v = 3"),
            moved
        );
        assert_eq!(outcome("DELETE FROM remus_shards.fenced_900201"), moved);
        // Reads are not fenced, and the migration's own sessions are exempt.
        assert_eq!(
            Spi::get_one::<i32>("SELECT v FROM remus_shards.fenced_900201").unwrap(),
            Some(2)
        );
        assert_eq!(aborts(9002), 3);
        Spi::run("SET LOCAL remus.migration_session = on").unwrap();
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 4"), "ok");
        Spi::run("SET LOCAL remus.migration_session = off").unwrap();
        assert_eq!(
            Spi::get_one::<i64>("SELECT remus.migration_end(9002)").unwrap(),
            Some(3)
        );
        assert_eq!(aborts(9002), 0);
        assert_eq!(outcome("UPDATE remus_shards.fenced_900201 SET v = 5"), "ok");
    }

    #[pg_test]
    fn ddl_on_a_registered_shard_is_refused_until_the_end() {
        Spi::run("CREATE TABLE remus_shards.ddl_900301 (id int PRIMARY KEY, v int)").unwrap();
        Spi::run("SELECT remus.migration_begin(9003, ARRAY[900301])").unwrap();
        for ddl in [
            "ALTER TABLE remus_shards.ddl_900301 ADD COLUMN z int",
            "CREATE INDEX ON remus_shards.ddl_900301 (v)",
            "TRUNCATE remus_shards.ddl_900301",
            "ALTER TABLE remus_shards.ddl_900301 RENAME TO ddl_x",
            "DROP TABLE remus_shards.ddl_900301",
        ] {
            let o = outcome(ddl);
            assert!(
                o.starts_with("55006: table remus_shards.ddl_900301 is being migrated by shard migration 9003"),
                "{ddl}: {o}"
            );
        }
        Spi::run("SELECT remus.migration_end(9003)").unwrap();
        assert_eq!(
            outcome("ALTER TABLE remus_shards.ddl_900301 ADD COLUMN z int"),
            "ok"
        );
    }

    #[pg_test]
    fn gate_is_held_by_one_migration_and_spares_running_transactions() {
        let closed_after_start =
            Spi::get_one::<bool>("SELECT remus.close_gate(9004, 60000) >= now()").unwrap();
        assert_eq!(closed_after_start, Some(true));
        // This transaction started before the gate closed: it is in flight and goes on.
        assert_eq!(Spi::get_one::<i32>("SELECT 1").unwrap(), Some(1));
        assert!(outcome("SELECT remus.close_gate(9005, 1000)")
            .starts_with("55006: the admission gate is held by migration 9004"));
        // Opening it is the holder's business; closing it again is idempotent.
        Spi::run("SELECT remus.open_gate(9005)").unwrap();
        assert!(outcome("SELECT remus.close_gate(9005, 1000)").starts_with("55006"));
        assert_eq!(outcome("SELECT remus.close_gate(9004, 60000)"), "ok");
        Spi::run("SELECT remus.open_gate(9004)").unwrap();
        assert_eq!(outcome("SELECT remus.close_gate(9005, 1000)"), "ok");
        Spi::run("SELECT remus.open_gate(9005)").unwrap();
    }

    #[pg_test]
    fn abort_shard_writers_leaves_its_own_backend_alone() {
        Spi::run("CREATE TABLE remus_shards.own_900601 (id int)").unwrap();
        Spi::run("INSERT INTO remus_shards.own_900601 VALUES (1)").unwrap();
        let n = Spi::get_one::<i32>(
            "SELECT remus.abort_shard_writers(9006, ARRAY['remus_shards.own_900601'::regclass])",
        )
        .unwrap();
        assert_eq!(n, Some(0));
        assert_eq!(
            Spi::get_one::<i64>("SELECT remus.migration_end(9006)").unwrap(),
            Some(0)
        );
    }

    #[pg_test]
    fn handover_functions_are_superuser_only() {
        Spi::run("CREATE ROLE remus_handover_nobody").unwrap();
        // With the schema usable, the refusal is the functions' EXECUTE privilege, which
        // PUBLIC lacks (api::privileges); their bodies check for a superuser too.
        Spi::run("GRANT USAGE ON SCHEMA remus TO remus_handover_nobody").unwrap();
        Spi::run("SET LOCAL ROLE remus_handover_nobody").unwrap();
        for q in [
            "SELECT remus.migration_begin(9007, ARRAY[1])",
            "SELECT remus.migration_aborts(9007)",
            "SELECT remus.close_gate(9007, 10)",
            "SELECT remus.abort_shard_writers(9007, ARRAY[]::regclass[])",
            "SELECT remus.migration_drain_source(9007, 'n1')",
        ] {
            let o = outcome(q);
            let function = q["SELECT remus.".len()..].split('(').next().unwrap();
            assert_eq!(
                o,
                format!("42501: permission denied for function {function}"),
                "{q}"
            );
        }
        assert!(outcome("SET remus.migration_session = on").starts_with("42501"));
        Spi::run("RESET ROLE").unwrap();
    }

    #[pg_test]
    fn migrate_without_a_coordinator_address_is_refused() {
        let o = outcome("SELECT * FROM remus_migrate_shard(1, 'n2')");
        assert!(
            o.starts_with("55000: remus.coordinator_address is not set"),
            "{o}"
        );
        let o = outcome("SELECT * FROM remus_migrations");
        assert!(
            o.starts_with("55000: remus.coordinator_address is not set"),
            "{o}"
        );
    }
}
