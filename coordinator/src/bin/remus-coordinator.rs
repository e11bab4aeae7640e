//! The coordinator daemon: serves the control-plane gRPC API, state in etcd.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use coordinator::migration::MigrationStore;
use coordinator::node_registry::NodeRegistry;
use coordinator::service::CoordinatorService;
use remus_proto::v1::coordinator_server::CoordinatorServer;

#[derive(Parser)]
#[command(version, about = "pg_remus migration coordinator")]
struct Args {
    /// gRPC listen address (loopback only in the local cluster).
    #[arg(long, default_value = "127.0.0.1:6102")]
    listen: SocketAddr,
    /// etcd client endpoint.
    #[arg(long, default_value = "http://127.0.0.1:6100")]
    etcd: String,
    /// Namespace of this cluster's keys in etcd.
    #[arg(long, default_value = "default")]
    cluster: String,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    // A named runtime makes thread dumps and tracing output attributable.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("coordinator-grpc")
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let etcd = etcd_client::Client::connect([args.etcd.as_str()], None)
        .await
        .with_context(|| format!("connecting to etcd at {}", args.etcd))?;
    let service = CoordinatorService {
        nodes: NodeRegistry::new(etcd.clone(), &args.cluster),
        migrations: MigrationStore::new(etcd.clone(), &args.cluster),
        cluster: args.cluster.clone(),
        etcd_endpoint: args.etcd.clone(),
        etcd,
    };
    tracing::info!(listen = %args.listen, etcd = %args.etcd, cluster = %args.cluster, "coordinator serving");
    tonic::transport::Server::builder()
        .add_service(CoordinatorServer::new(service))
        .serve_with_shutdown(args.listen, shutdown_signal())
        .await
        .context("gRPC server")?;
    tracing::info!("coordinator stopped");
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
