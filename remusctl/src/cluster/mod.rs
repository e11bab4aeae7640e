//! `remusctl cluster up|add-node|start-coordinator|down|status|env`: a real pg_remus cluster
//! on loopback.
//!
//! Layout under DIR:
//! - `cluster.json`: what was started (ports, data directories, daemon PIDs); `down` and
//!   `status` work from it alone, so a cluster can be stopped from any shell.
//! - `pgpass`: the generated superuser password (mode 0600, owned by `postgres` so that the
//!   servers' own libpq connections to their peers can read it too; root reads it regardless).
//! - `nK/data`, `nK/run` (unix socket): node K, owned by `postgres`.
//! - `etcd/`: etcd's data; `logs/`: one log per component; `failpoints/`: files that arm the
//!   coordinator's failpoints (empty unless a test arms one).
//!
//! Ports: nodes P..P+N-1, etcd client P+100 and peer P+101, coordinator gRPC P+102, replay
//! worker gRPC P+103, standby coordinator gRPC P+104 (`--standby-coordinator`, decision 0010;
//! the nodes' `remus.coordinator_address` lists both coordinators)
//! ([`remus_proto::names::ports`]).
//!
//! - `state`: the state file and the plan of a new cluster or of an added node.
//! - `postgres`: initdb, configuration, starting and connecting to the nodes.
//! - `daemons`: etcd, the replay worker and the coordinator; stopping everything.
//! - `status`: `status` and `env`.
//! - `add`: `add-node`, one more node `nK` on P+K-1 in a running cluster, started as `up` starts
//!   one and joined by `remus_activate_node` on n1; it owns no shard until migrations move
//!   some to it. A failed `add-node` undoes itself.
//! - here: `up` (preflight, then every component in order, then the nodes registered).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::process;

mod add;
mod daemons;
mod postgres;
mod state;
mod status;

pub use add::add_node;
use daemons::{sibling_binary, start_coordinator, start_etcd, start_replay_worker, Role};
pub use daemons::{start_coordinator_again, stop_all};
pub use postgres::{connect, pg_bindir};
use postgres::{init_node, start_node};
use state::{plan, read_pgpass_password};
pub use state::{ClusterState, DaemonState, NodeState, UpOptions};
pub use status::{env_lines, status, ComponentStatus};

pub const DEFAULT_DIR: &str = ".remus/cluster";
pub const DEFAULT_BASE_PORT: u16 = 6001;
pub const DEFAULT_NODES: usize = 3;

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(program))
            .find(|p| p.is_file())
    })
}

fn preflight(state: &ClusterState) -> Result<Binaries> {
    check_postgres_binaries()?;
    if which("etcd").is_none() {
        bail!("missing binary: etcd not found on PATH (install the etcd-server package)");
    }
    let binaries = Binaries {
        coordinator: sibling_binary("coordinator", "remus-coordinator")?,
        replay_worker: sibling_binary("replay worker", "remus-replay-worker")?,
    };
    let mut ports: Vec<(String, u16)> = state
        .nodes
        .iter()
        .map(|n| (format!("{} (postgres)", n.name), n.port))
        .collect();
    ports.push(("etcd client".into(), state.etcd.port));
    ports.push(("etcd peer".into(), state.etcd_peer_port()));
    ports.push(("coordinator".into(), state.coordinator.port));
    if let Some(standby) = &state.standby_coordinator {
        ports.push(("standby coordinator".into(), standby.port));
    }
    ports.push(("replay worker".into(), state.replay_worker.port));
    for (what, port) in ports {
        if process::port_in_use(port) {
            bail!("port {port} needed by {what} is already in use on 127.0.0.1; pick another --base-port");
        }
    }
    Ok(binaries)
}

/// What initdb'ing and starting a node needs: the PostgreSQL 15 server binaries, runuser and
/// the `postgres` OS user.
fn check_postgres_binaries() -> Result<()> {
    let bindir = pg_bindir();
    for bin in ["initdb", "pg_ctl", "postgres"] {
        if !bindir.join(bin).is_file() {
            bail!(
                "missing binary: PostgreSQL 15 {bin} not found in {} (install postgresql-15, or set REMUS_PG_BINDIR)",
                bindir.display()
            );
        }
    }
    if which("runuser").is_none() {
        bail!("missing binary: runuser not found on PATH (util-linux)");
    }
    process::postgres_ids()?;
    Ok(())
}

struct Binaries {
    coordinator: PathBuf,
    replay_worker: PathBuf,
}

pub async fn up(opts: &UpOptions) -> Result<ClusterState> {
    let mut state = plan(opts)?;
    let binaries = preflight(&state)?;
    fs::create_dir_all(state.dir.join("logs"))
        .with_context(|| format!("creating {}", state.dir.display()))?;
    process::chown_postgres(&state.dir.join("logs"))?;
    fs::create_dir_all(state.failpoint_dir())
        .with_context(|| format!("creating {}", state.failpoint_dir().display()))?;
    ensure_postgres_can_reach(&state.dir)?;
    let password = match read_pgpass_password(&state.pgpass) {
        Ok(p) => p,
        Err(_) => {
            let p = process::generate_password(24)?;
            process::write_private_file(&state.pgpass, &format!("*:*:*:postgres:{p}\n"))?;
            process::chown_postgres(&state.pgpass)?;
            p
        }
    };
    state.save()?;

    let started = start_all(&mut state, &password, &binaries).await;
    if let Err(e) = started {
        // Leave nothing half-started behind: a failed `up` stops what it started.
        let _ = stop_all(&mut state);
        return Err(e);
    }
    Ok(state)
}

fn ensure_postgres_can_reach(dir: &Path) -> Result<()> {
    let ok = Command::new("runuser")
        .args(["-u", process::POSTGRES_USER, "--", "test", "-x"])
        .arg(dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        bail!(
            "the postgres OS user cannot reach {} (a parent directory is not world-searchable); use a --dir such as /var/tmp/remus",
            dir.display()
        );
    }
    Ok(())
}

async fn start_all(state: &mut ClusterState, password: &str, binaries: &Binaries) -> Result<()> {
    for node in &state.nodes {
        init_node(node, password, &state.coordinator_endpoint())?;
        start_node(state, node)?;
    }
    start_etcd(state)?;
    state.save()?;
    start_replay_worker(state, &binaries.replay_worker)?;
    state.save()?;
    // The first coordinator wins the leadership of a new cluster; the standby waits behind it.
    start_coordinator(state, &binaries.coordinator, Role::First).await?;
    state.save()?;
    if state.standby_coordinator.is_some() {
        start_coordinator(state, &binaries.coordinator, Role::Standby).await?;
        state.save()?;
    }
    for node in &state.nodes {
        let client = connect(node, password).await?;
        create_extension(&client, node).await?;
        for peer in &state.nodes {
            add_to_membership(&client, node, peer).await?;
        }
    }
    register_nodes(&state.coordinator_endpoint(), &state.nodes).await
}

async fn create_extension(client: &tokio_postgres::Client, node: &NodeState) -> Result<()> {
    client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_remus")
        .await
        .with_context(|| format!("CREATE EXTENSION pg_remus on {}", node.name))
}

/// `remus_add_node(peer)` on `node` (a no-op when `node` knows `peer` already).
async fn add_to_membership(
    client: &tokio_postgres::Client,
    node: &NodeState,
    peer: &NodeState,
) -> Result<()> {
    client
        .execute(
            "SELECT remus_add_node($1, $2, $3)",
            &[&peer.name, &peer.host, &i32::from(peer.port)],
        )
        .await
        .with_context(|| format!("remus_add_node({}) on {}", peer.name, node.name))?;
    Ok(())
}

/// Registers `nodes` with the coordinator (in etcd), where migrations find their targets.
async fn register_nodes(coordinator_endpoint: &str, nodes: &[NodeState]) -> Result<()> {
    let mut grpc = coordinator::client::connect(coordinator_endpoint).await?;
    for node in nodes {
        grpc.register_node(remus_proto::v1::RegisterNodeRequest {
            node: Some(remus_proto::v1::Node {
                name: node.name.clone(),
                host: node.host.clone(),
                port: u32::from(node.port),
            }),
        })
        .await
        .with_context(|| format!("registering {} with the coordinator", node.name))?;
    }
    Ok(())
}
