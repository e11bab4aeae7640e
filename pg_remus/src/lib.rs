//! pg_remus: the per-node half of Remus live shard migration on stock PostgreSQL 15.
//!
//! Module map (one job each):
//! - [`guc`]: the `remus.*` settings, registered at preload time.
//! - [`error`]: every error a user can see, with its SQLSTATE.
//! - [`nodes`]: cluster membership in this node's catalog (`remus.nodes`, `remus_nodes`).
//! - [`remote`]: libpq connections from this backend to other nodes, interruptible waits.
//! - [`twophase`]: atomic commit over every node a transaction wrote (2PC).
//! - [`router`]: planning and executing statements on distributed tables, from any node.
//! - [`handover`]: shared-memory primitives of a migration's handover (registration, fence,
//!   writer abort, admission gate).
//! - [`mocc`]: write-set capture and validate-then-commit of source transactions (dual
//!   execution).
//! - [`migrate`]: `remus_migrate_shard(s)` and `remus_migrations`, answered by the coordinator.
//! - [`recovery`]: resolving in-doubt prepared transactions from the recorded decisions.
//! - [`recovery_worker`]: the background worker that runs recovery on every node.
//!
//! The library must be in `shared_preload_libraries`: later modules install hooks and shared
//! memory, which PostgreSQL only allows while the postmaster starts.

use pgrx::prelude::*;

pub mod catalog;
pub mod distribute;
pub mod error;
pub mod guc;
pub mod handover;
pub mod hashing;
pub mod migrate;
pub mod mocc;
pub mod nodes;
pub mod recovery;
pub mod recovery_worker;
pub mod remote;
pub mod router;
pub mod twophase;

::pgrx::pg_module_magic!(name, version);

// The catalog lives in schema `remus`; the user-facing functions and views are created in the
// extension's schema (public by default) so they are callable without qualification.
pgrx::extension_sql!(
    r#"
CREATE SCHEMA IF NOT EXISTS remus;

CREATE TABLE remus.nodes (
    name     text PRIMARY KEY,
    host     text NOT NULL,
    port     int  NOT NULL CHECK (port BETWEEN 1 AND 65535),
    added_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE remus.nodes IS 'Every node of the pg_remus cluster, this one included';

-- One row per remote participant of a two-phase commit this node coordinates, inserted in the
-- local transaction before PREPARE: the row exists exactly when the decision is commit.
CREATE TABLE remus.commit_decisions (
    gid         text PRIMARY KEY,
    participant text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
"#,
    name = "catalog",
    bootstrap
);

pgrx::extension_sql!(
    r#"
CREATE VIEW remus_nodes AS
    SELECT name, host, port FROM remus.nodes ORDER BY name;
COMMENT ON VIEW remus_nodes IS 'Nodes this node knows: name, host, port';
"#,
    name = "views",
    requires = ["catalog"],
    finalize
);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: reads a postmaster global that is only true while preloading.
    if !unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        pgrx::error!("pg_remus must be loaded via shared_preload_libraries (it installs hooks, shared memory and a background worker)");
    }
    guc::register();
    error::install_emit_log_hook();
    twophase::register_callbacks();
    router::install_hooks();
    router::map_cache::init_shmem();
    handover::init_shmem();
    recovery_worker::register();
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    #[pg_test]
    fn add_node_is_recorded_and_idempotent() {
        Spi::run("SELECT remus_add_node('n1', '127.0.0.1', 6001)").unwrap();
        Spi::run("SELECT remus_add_node('n1', '127.0.0.1', 6001)").unwrap();
        Spi::run("SELECT remus_add_node('n2', '127.0.0.1', 6002)").unwrap();
        let n = Spi::get_one::<i64>("SELECT count(*) FROM remus_nodes").unwrap();
        assert_eq!(n, Some(2));
        let port = Spi::get_one::<i32>("SELECT port FROM remus_nodes WHERE name = 'n2'").unwrap();
        assert_eq!(port, Some(6002));
    }

    #[pg_test(error = "node n1 already exists with address 127.0.0.1:6001")]
    fn add_node_with_other_address_is_refused() {
        Spi::run("SELECT remus_add_node('n1', '127.0.0.1', 6001)").unwrap();
        Spi::run("SELECT remus_add_node('n1', '127.0.0.1', 7001)").unwrap();
    }

    #[pg_test(error = "port 70000 is out of range 1..65535")]
    fn add_node_rejects_bad_port() {
        Spi::run("SELECT remus_add_node('n9', '127.0.0.1', 70000)").unwrap();
    }

    #[pg_test(error = "invalid node name \"Bad-Name\"")]
    fn add_node_rejects_bad_name() {
        Spi::run("SELECT remus_add_node('Bad-Name', '127.0.0.1', 6001)").unwrap();
    }

    #[pg_test]
    fn local_node_name_comes_from_the_guc() {
        Spi::run("SET remus.node_name = 'n7'").unwrap();
        assert_eq!(
            Spi::get_one::<String>("SELECT remus_local_node()").unwrap(),
            Some("n7".to_string())
        );
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![
            "shared_preload_libraries = 'pg_remus'",
            "wal_level = logical",
            "track_commit_timestamp = on",
            "max_prepared_transactions = 20",
        ]
    }
}
