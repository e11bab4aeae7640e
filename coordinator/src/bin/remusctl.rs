//! remusctl: operate a pg_remus cluster.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use coordinator::local_cluster::{self, ClusterState, UpOptions};

#[derive(Parser)]
#[command(version, about = "Operate a pg_remus cluster")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A local cluster of real PostgreSQL 15 nodes, etcd and the coordinator on loopback.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Nodes registered with the coordinator (in etcd).
    Nodes {
        #[arg(long, default_value = local_cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Initialise (first time) and start every component, then wire the nodes together.
    Up {
        #[arg(long, default_value_t = local_cluster::DEFAULT_NODES)]
        nodes: usize,
        #[arg(long, default_value = local_cluster::DEFAULT_DIR)]
        dir: PathBuf,
        #[arg(long, default_value_t = local_cluster::DEFAULT_BASE_PORT)]
        base_port: u16,
    },
    /// Stop everything `up` started, by PID.
    Down {
        #[arg(long, default_value = local_cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Each component up or down. Exit status 0 when all are up, 3 otherwise.
    Status {
        #[arg(long, default_value = local_cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Shell `export` lines for libpq (PGHOST, PGPORT, PGUSER, PGPASSFILE, PGDATABASE).
    Env {
        #[arg(long, default_value = local_cluster::DEFAULT_DIR)]
        dir: PathBuf,
        #[arg(long, default_value = "n1")]
        node: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .thread_name("remusctl")
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("remusctl: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("remusctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Cluster { cmd } => cluster(cmd).await,
        Cmd::Nodes { dir } => {
            let state = ClusterState::load(&dir)?;
            let mut c = coordinator::client::connect(&state.coordinator_endpoint()).await?;
            let nodes = c
                .list_nodes(remus_proto::v1::ListNodesRequest {})
                .await?
                .into_inner()
                .nodes;
            println!("{:<8} {:<15} {:>5}", "name", "host", "port");
            for n in nodes {
                println!("{:<8} {:<15} {:>5}", n.name, n.host, n.port);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn cluster(cmd: ClusterCmd) -> Result<ExitCode> {
    match cmd {
        ClusterCmd::Up { nodes, dir, base_port } => {
            let state = local_cluster::up(&UpOptions { dir, nodes, base_port }).await?;
            println!("pg_remus cluster up in {}", state.dir.display());
            for n in &state.nodes {
                println!("  {:<4} postgres     {}:{}   log {}", n.name, n.host, n.port, n.log.display());
            }
            println!("  etcd              127.0.0.1:{}   log {}", state.etcd.port, state.etcd.log.display());
            println!(
                "  coordinator       127.0.0.1:{}   log {}",
                state.coordinator.port,
                state.coordinator.log.display()
            );
            println!("connect with:");
            println!("  eval \"$(remusctl cluster env --dir {})\" && psql", state.dir.display());
            println!("stop with:");
            println!("  remusctl cluster down --dir {}", state.dir.display());
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::Down { dir } => {
            let mut state = ClusterState::load(&dir)?;
            let report = local_cluster::stop_all(&mut state)?;
            if report.is_empty() {
                println!("nothing was running in {}", state.dir.display());
            }
            for line in report {
                println!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::Status { dir } => {
            let state = ClusterState::load(&dir)?;
            let rows = local_cluster::status(&state).await;
            let all_up = rows.iter().all(|r| r.up);
            for r in rows {
                let pid = r.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                println!(
                    "{:<14} {:<16} {:<5} pid {:<8} log {}",
                    r.component,
                    r.address,
                    if r.up { "up" } else { "down" },
                    pid,
                    r.log.display()
                );
            }
            Ok(if all_up { ExitCode::SUCCESS } else { ExitCode::from(3) })
        }
        ClusterCmd::Env { dir, node } => {
            let state = ClusterState::load(&dir)?;
            print!("{}", local_cluster::env_lines(&state, &node)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}
