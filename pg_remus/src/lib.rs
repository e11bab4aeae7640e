//! pg_remus: the per-node half of Remus live shard migration on stock PostgreSQL 15.
//!
//! Layers, each importing only the ones before it (checked by `scripts/check_module_cycles.py`):
//!
//! 1. [`pg`] (PostgreSQL glue), [`guc`] (the `remus.*` settings), [`error`](mod@error) (every error a
//!    user can see, with its SQLSTATE);
//! 2. [`cluster`]: membership, libpq connections to other nodes, gRPC, the shard marker;
//! 3. [`catalog`] (distributed tables, shards, the shard map and its cache, hashing) and
//!    [`twophase`] (atomic commit over every node a transaction wrote, in-doubt recovery and
//!    its background worker);
//! 4. [`migration`]: the node side of a live shard migration, one module per Remus phase;
//! 5. [`router`] (planning and executing statements on distributed tables, from any node) and
//!    [`distribute`] (turning tables into distributed or reference tables);
//! 6. [`api`]: the user-facing `remus_*` functions and views;
//! 7. [`hooks`]: every PostgreSQL hook and callback, installed once, dispatching down.
//!
//! The library must be in `shared_preload_libraries`: it installs hooks and shared memory,
//! which PostgreSQL only allows while the postmaster starts.

// The docs are for developers of the extension (built with --document-private-items); its modules
// are private, and the crate-level map links to them.
#![allow(rustdoc::private_intra_doc_links)]

use pgrx::prelude::*;

mod api;
mod catalog;
mod cluster;
mod ddl;
mod distribute;
mod error;
mod guc;
mod hooks;
mod migration;
mod pg;
mod router;
mod twophase;

::pgrx::pg_module_magic!(name, version);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: reads a postmaster global that is only true while preloading.
    if !unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        pgrx::error!("pg_remus must be loaded via shared_preload_libraries (it installs hooks, shared memory and a background worker)");
    }
    guc::register();
    cluster::forwarded_role::register();
    hooks::install();
    catalog::map_cache::init_shmem();
    migration::init_shmem();
    twophase::worker::register();
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

    /// The name comes from postgresql.conf (`pg_test::postgresql_conf_options`), and the
    /// settings that say which node this is, or that a session is one of the cluster's own,
    /// are not a session's to change (decision 0016).
    #[pg_test]
    fn local_node_name_comes_from_the_configuration() {
        assert_eq!(
            Spi::get_one::<String>("SELECT remus_local_node()").unwrap(),
            Some("n7".to_string())
        );
        let contexts = Spi::get_one::<String>(
            "SELECT string_agg(name || '=' || context, ' ' ORDER BY name) FROM pg_settings
              WHERE name IN ('remus.node_name', 'remus.forwarded', 'remus.migration_session',
                             'remus.coordinator_address')",
        )
        .unwrap();
        assert_eq!(
            contexts.as_deref(),
            Some("remus.coordinator_address=sighup remus.forwarded=superuser remus.migration_session=superuser remus.node_name=sighup")
        );
    }

    #[pg_test(error = "parameter \"remus.node_name\" cannot be changed now")]
    fn node_name_cannot_be_set_in_a_session() {
        Spi::run("SET remus.node_name = 'n8'").unwrap();
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
            // What remusctl writes per node; a session cannot change it (PGC_SIGHUP).
            "remus.node_name = 'n7'",
        ]
    }
}
