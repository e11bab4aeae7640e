//! `remus-replay-worker`: the destination-side apply service of pg_remus shard migrations.
//!
//! The coordinator opens one `ReplayWorker.Apply` call per migration against the worker next to
//! the destination node. On start-up the worker prints `remus-replay-worker listening on ADDR`
//! (health checks and scripts wait for that line, then just connect).
//!
//! Environment: `REMUS_APPLY_BATCH`, the most transactions an apply session takes in one call of
//! its batch procedure (default 64; 0 or 1: one transaction per round trip; decision 0035);
//! `REMUS_APPLY_NATIVE=0`, batches through each session's PL/pgSQL procedure even where the
//! node has pg_remus's `remus.apply_batch` (the default uses it when present).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tracing::{info, warn};

/// How long in-flight Apply calls get to end after SIGTERM/SIGINT.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(
    version,
    about = "pg_remus replay worker (applies shadow transactions on a destination node)"
)]
struct Args {
    /// Address to serve the ReplayWorker gRPC service on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50061")]
    listen: SocketAddr,
    /// Worker threads of the runtime.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        // Colours only on a terminal: `remusctl cluster up` sends the output to a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("replay-worker")
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("local address")?;
    println!("remus-replay-worker listening on {addr}");
    info!(%addr, "listening");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(replay_worker::serve(listener, async {
        let _ = stop_rx.await;
    }));
    shutdown_signal().await?;
    info!("shutting down");
    let _ = stop_tx.send(());
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(joined) => joined.context("server task")?.context("gRPC server")?,
        Err(_) => warn!(
            grace = ?SHUTDOWN_GRACE,
            "Apply calls still open after the grace period; exiting, their origins stay in place"
        ),
    }
    Ok(())
}

async fn shutdown_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {},
        r = tokio::signal::ctrl_c() => r.context("SIGINT handler")?,
    }
    Ok(())
}
