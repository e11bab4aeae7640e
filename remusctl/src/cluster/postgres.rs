//! The PostgreSQL nodes: where the server binaries are, `initdb` with the settings Remus needs
//! (`remus.conf`, `pg_hba.conf`), starting a node, connecting to one.

use std::fs;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::state::{ClusterState, NodeState, START_TIMEOUT};
use crate::process;

pub fn pg_bindir() -> PathBuf {
    std::env::var_os("REMUS_PG_BINDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

pub(super) fn init_node(node: &NodeState, password: &str, coordinator_address: &str) -> Result<()> {
    let node_dir = node.data_dir.parent().expect("data dir has a parent");
    fs::create_dir_all(&node.socket_dir)?;
    process::chown_postgres(node_dir)?;
    process::chown_postgres(&node.socket_dir)?;
    if node.data_dir.join("PG_VERSION").exists() {
        return Ok(());
    }
    let pwfile = node_dir.join(".initdb-pw");
    process::write_private_file(&pwfile, password)?;
    process::chown_postgres(&pwfile)?;
    let res = process::run_as_postgres(
        &pg_bindir().join("initdb"),
        &[
            "-D",
            &node.data_dir.to_string_lossy(),
            "-U",
            "postgres",
            "--pwfile",
            &pwfile.to_string_lossy(),
            "--auth-local=peer",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-locale",
        ],
        &[],
    );
    let _ = fs::remove_file(&pwfile);
    res.with_context(|| format!("initdb for {}", node.name))?;

    let conf = node.data_dir.join("postgresql.conf");
    let mut main = fs::read_to_string(&conf)?;
    main.push_str("\ninclude 'remus.conf'\n");
    fs::write(&conf, main)?;
    fs::write(
        node.data_dir.join("remus.conf"),
        remus_conf(node, coordinator_address),
    )?;
    fs::write(node.data_dir.join("pg_hba.conf"), PG_HBA)?;
    for f in ["remus.conf", "pg_hba.conf"] {
        process::chown_postgres(&node.data_dir.join(f))?;
    }
    Ok(())
}

/// Nothing is `trust`: local socket connections need the OS user to match (peer), everything
/// over TCP, replication included, needs the generated password.
const PG_HBA: &str = "\
# TYPE  DATABASE     USER  ADDRESS       METHOD
local   all          all                 peer
host    all          all   127.0.0.1/32  scram-sha-256
host    replication  all   127.0.0.1/32  scram-sha-256
";

/// Settings Remus needs on every node (`docs/design/DESIGN.md` section 7); all need a restart.
fn remus_conf(node: &NodeState, coordinator_address: &str) -> String {
    format!(
        "# Written by remusctl cluster up; edits are kept across restarts.
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{sock}'
max_connections = 200
password_encryption = 'scram-sha-256'
shared_preload_libraries = 'pg_remus'
wal_level = logical
track_commit_timestamp = on
max_prepared_transactions = 200
max_replication_slots = 128
max_wal_senders = 32
max_worker_processes = 32
logical_decoding_work_mem = '64MB'
shared_buffers = '128MB'
log_line_prefix = '%m [%p] {name} %q%u@%d '
log_min_messages = warning
remus.node_name = '{name}'
remus.coordinator_address = '{coordinator_address}'
",
        port = node.port,
        sock = node.socket_dir.display(),
        name = node.name,
        coordinator_address = coordinator_address,
    )
}

pub(super) fn start_node(state: &ClusterState, node: &NodeState) -> Result<()> {
    if node.postmaster_pid().is_some() {
        return Ok(());
    }
    let pgpass = state.pgpass.to_string_lossy().into_owned();
    let res = process::run_as_postgres(
        &pg_bindir().join("pg_ctl"),
        &[
            "-D",
            &node.data_dir.to_string_lossy(),
            "-l",
            &node.log.to_string_lossy(),
            "-w",
            "-t",
            &START_TIMEOUT.as_secs().to_string(),
            "start",
        ],
        // The servers' own connections to their peers (2PC, forwarding) authenticate with this.
        // Error details carry no Rust backtraces: they are for developers, not for clients.
        &[
            ("PGPASSFILE", &pgpass),
            ("RUST_BACKTRACE", "0"),
            ("RUST_LIB_BACKTRACE", "0"),
        ],
    );
    if let Err(e) = res {
        bail!(
            "{} (postgres on port {}) failed to start: {e}\nsee {}:\n{}",
            node.name,
            node.port,
            node.log.display(),
            process::log_tail(&node.log, 15)
        );
    }
    Ok(())
}

pub async fn connect(node: &NodeState, password: &str) -> Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(&node.conninfo(password), tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {} on 127.0.0.1:{}", node.name, node.port))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::state::{plan, UpOptions};

    #[test]
    fn conf_has_remus_requirements() {
        let dir = tempfile::tempdir().unwrap();
        let s = plan(&UpOptions {
            dir: dir.path().into(),
            nodes: 2,
            base_port: 7001,
            standby_coordinator: true,
        })
        .unwrap();
        let conf = remus_conf(&s.nodes[1], &s.coordinator_endpoint());
        for needle in [
            "wal_level = logical",
            "track_commit_timestamp = on",
            "shared_preload_libraries = 'pg_remus'",
            "remus.node_name = 'n2'",
            "port = 7002",
            "remus.coordinator_address = 'http://127.0.0.1:7103,http://127.0.0.1:7105'",
            "max_replication_slots = 128",
        ] {
            assert!(conf.contains(needle), "missing {needle}");
        }
        assert!(!PG_HBA.contains("trust"));
    }
}
