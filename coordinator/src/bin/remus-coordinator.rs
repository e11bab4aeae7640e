//! The coordinator daemon: serves the control-plane gRPC API, state in etcd.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use coordinator::leader;
use coordinator::migration::MigrationStore;
use coordinator::node_registry::NodeRegistry;
use std::sync::Arc;
use std::time::Duration;

use coordinator::driver::DriverConfig;
use coordinator::failpoint::Failpoints;
use coordinator::node_conn::NodeConnector;
use coordinator::reconcile;
use coordinator::resume::{self, Resuming};
use coordinator::service::{CoordinatorService, MigrationRuntime};
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
    /// gRPC endpoint of the replay worker that applies migrations on their targets.
    #[arg(long, default_value = "http://127.0.0.1:6103")]
    replay_worker: String,
    /// libpq password file with the nodes' password for user postgres.
    #[arg(long, env = "PGPASSFILE")]
    pgpass: Option<std::path::PathBuf>,
    /// Database of the nodes that holds the distributed tables.
    #[arg(long, default_value = "postgres")]
    database: String,
    /// Concurrent apply sessions per migration on the target (each holds one connection and
    /// one replication origin there while the migration runs). Many more than the target's
    /// cores: a session waits out a round trip per transaction, so under a busy source the
    /// replay keeps up only with enough transactions in flight (decision 0031).
    #[arg(long, env = "REMUS_APPLY_PARALLELISM", default_value_t = 16)]
    apply_parallelism: u32,
    /// Sessions of a migration's snapshot copy: one per table at least, and at least this
    /// many, so that a large shard table is copied in block ranges by several at once.
    #[arg(long, env = "REMUS_COPY_SESSIONS", default_value_t = 4)]
    copy_sessions: u32,
    /// A shard table of at least twice this many MiB is copied in block ranges of about this
    /// size, each by its own session; 0 copies every table by one session.
    #[arg(long, env = "REMUS_COPY_SPLIT_MB", default_value_t = 64)]
    copy_split_mb: u64,
    /// lock_abort: idle writers holding a migrating shard are terminated after this long.
    #[arg(long, default_value_t = 10_000)]
    lock_grace_ms: u64,
    /// wait_remaster: the admission gate reopens by itself after this long.
    #[arg(long, default_value_t = 60_000)]
    gate_timeout_ms: u64,
    /// Compare source and target copies before every ownership flip (full read of both).
    #[arg(long, env = "REMUS_VERIFY_HANDOVER")]
    verify_handover: bool,
    /// Catch-up whose lag has not shrunk for this long is not converging: remus hands over
    /// (dual execution paces the source's writers), lock_abort and wait_remaster roll back.
    #[arg(
        long,
        env = "REMUS_CATCHUP_CONVERGE_LIMIT_MS",
        default_value_t = 300_000
    )]
    catchup_converge_limit_ms: u64,
    /// albatross: the iterative copy ends after at most this many catch-up rounds, also while
    /// their deltas still shrink (decision 0024).
    #[arg(long, env = "REMUS_ALBATROSS_MAX_ROUNDS", default_value_t = 10)]
    albatross_max_rounds: u32,
    /// Directory whose files arm the driver's failpoints (see `coordinator::failpoint`); none
    /// can be armed without it.
    #[arg(long)]
    failpoint_dir: Option<std::path::PathBuf>,
    /// TTL of the etcd lease behind this coordinator's leadership (`coordinator::leader`): a
    /// standby takes over this long after the leader dies; a leader that cannot renew its
    /// lease for this long stops its migrations and starts again as a standby.
    #[arg(long, default_value_t = 5)]
    lease_ttl_secs: u64,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Colours only on a terminal: `remusctl cluster up` sends the output to a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    // A named runtime makes thread dumps and tracing output attributable.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("coordinator-grpc")
        .worker_threads(2)
        .enable_all()
        .build()?;
    // Migrations run apart from the gRPC server, so a busy migration never delays an RPC.
    let migrations = tokio::runtime::Builder::new_multi_thread()
        .thread_name("migration-driver")
        .worker_threads(2)
        .enable_all()
        .build()?;
    let handle = migrations.handle().clone();
    let result = runtime.block_on(serve(args, handle));
    migrations.shutdown_timeout(std::time::Duration::from_secs(5));
    result
}

async fn serve(args: Args, migrations: tokio::runtime::Handle) -> anyhow::Result<()> {
    let etcd = leader::connect_etcd(&args.etcd).await;
    // A standby waits here, without listening, until the leader's lease is gone; nothing of a
    // migration runs before this process is the leader.
    let me = format!("http://{}", args.listen);
    let lease = tokio::select! {
        lease = leader::become_leader(
            etcd.clone(),
            &args.cluster,
            &me,
            Duration::from_secs(args.lease_ttl_secs),
        ) => lease,
        _ = shutdown_signal() => {
            tracing::info!("standby coordinator stopped");
            return Ok(());
        }
    };
    let resuming = Resuming::starting();
    let service = CoordinatorService {
        nodes: NodeRegistry::new(etcd.clone(), &args.cluster),
        migrations: MigrationStore::new(etcd.clone(), &args.cluster),
        cluster: args.cluster.clone(),
        etcd_endpoint: args.etcd.clone(),
        etcd,
        driver: Arc::new(DriverConfig {
            connector: NodeConnector::from_pgpass(args.pgpass.as_deref(), &args.database)?,
            replay_endpoint: args.replay_worker.clone(),
            apply_parallelism: args.apply_parallelism,
            copy_sessions: args.copy_sessions,
            copy_split_bytes: args.copy_split_mb * 1024 * 1024,
            lock_grace: Duration::from_millis(args.lock_grace_ms),
            gate_timeout: Duration::from_millis(args.gate_timeout_ms),
            verify_handover: args.verify_handover,
            catchup_converge_limit: Duration::from_millis(args.catchup_converge_limit_ms),
            albatross_max_rounds: args.albatross_max_rounds,
            failpoints: args
                .failpoint_dir
                .clone()
                .map(Failpoints::in_dir)
                .unwrap_or_else(Failpoints::disabled),
        }),
        runtime: MigrationRuntime(migrations.clone()),
        resuming: resuming.clone(),
    };
    // Migrations the previous coordinator was running are resumed before new ones are taken.
    migrations.spawn(resume::resume_all(
        service.driver.clone(),
        service.migrations.clone(),
        service.nodes.clone(),
        resuming.clone(),
    ));
    // Then, every few seconds, clears what a node that was down still holds for a migration
    // that has ended (`coordinator::reconcile`).
    migrations.spawn(reconcile::run(
        service.driver.clone(),
        service.migrations.clone(),
        service.nodes.clone(),
        resuming,
        reconcile::SWEEP_INTERVAL,
    ));
    tracing::info!(listen = %args.listen, etcd = %args.etcd, cluster = %args.cluster, lease, "coordinator serving");
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
