//! The daemons around the nodes (etcd, the replay worker, the coordinator), found next to
//! remusctl's own binary, started detached and tracked by PID; stopping the whole cluster.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::postgres::pg_bindir;
use super::state::{ClusterState, START_TIMEOUT};
use crate::process::{self, pid_alive};

/// A daemon binary next to remusctl's own.
pub(super) fn sibling_binary(what: &str, name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe
        .parent()
        .map(|d| d.join(name))
        .ok_or_else(|| anyhow!("cannot locate remusctl's directory"))?;
    if !path.is_file() {
        bail!(
            "missing binary: {what} ({} not found; build it with `cargo build --release`)",
            path.display()
        );
    }
    Ok(path)
}

pub(super) fn start_etcd(state: &mut ClusterState) -> Result<()> {
    let client = format!("http://127.0.0.1:{}", state.etcd.port);
    let peer = format!("http://127.0.0.1:{}", state.etcd_peer_port());
    let data = state.dir.join("etcd");
    let mut cmd = Command::new("etcd");
    cmd.arg("--name")
        .arg("remus")
        .arg("--data-dir")
        .arg(&data)
        .arg("--listen-client-urls")
        .arg(&client)
        .arg("--advertise-client-urls")
        .arg(&client)
        .arg("--listen-peer-urls")
        .arg(&peer)
        .arg("--initial-advertise-peer-urls")
        .arg(&peer)
        .arg("--initial-cluster")
        .arg(format!("remus={peer}"));
    let pid = process::spawn_daemon(&mut cmd, &state.etcd.log)?;
    state.etcd.pid = Some(pid);
    wait_until(START_TIMEOUT, || {
        if !pid_alive(pid) {
            return Err(anyhow!("exited"));
        }
        Ok(process::etcd_healthy(state.etcd.port))
    })
    .map_err(|e| {
        anyhow!(
            "etcd on port {} failed to start ({e}); see {}:\n{}",
            state.etcd.port,
            state.etcd.log.display(),
            process::log_tail(&state.etcd.log, 15)
        )
    })
}

pub(super) fn start_replay_worker(state: &mut ClusterState, bin: &Path) -> Result<()> {
    let mut cmd = Command::new(bin);
    cmd.arg("--listen")
        .arg(format!("127.0.0.1:{}", state.replay_worker.port));
    let pid = process::spawn_daemon(&mut cmd, &state.replay_worker.log)?;
    state.replay_worker.pid = Some(pid);
    let port = state.replay_worker.port;
    wait_until(START_TIMEOUT, || {
        if !pid_alive(pid) {
            bail!(
                "replay worker exited during start; see {}:\n{}",
                state.replay_worker.log.display(),
                process::log_tail(&state.replay_worker.log, 15)
            );
        }
        Ok(process::port_in_use(port))
    })
    .map_err(|e| {
        anyhow!(
            "replay worker on port {port} did not start ({e}); see {}",
            state.replay_worker.log.display()
        )
    })
}

/// Starts the coordinator of the cluster in `dir` again (after it stopped or crashed), with the
/// rest of the cluster left as it is; the new coordinator resumes the migrations its
/// predecessor was running (`coordinator::resume`).
pub async fn start_coordinator_again(dir: &Path) -> Result<ClusterState> {
    let mut state = ClusterState::load(dir)?;
    if let Some(pid) = state.coordinator.live_pid() {
        bail!(
            "the coordinator of {} is running (pid {pid})",
            state.dir.display()
        );
    }
    if process::port_in_use(state.coordinator.port) {
        bail!(
            "port {} of the coordinator is in use on 127.0.0.1",
            state.coordinator.port
        );
    }
    let bin = sibling_binary("coordinator", "remus-coordinator")?;
    start_coordinator(&mut state, &bin).await?;
    state.save()?;
    Ok(state)
}

pub(super) async fn start_coordinator(state: &mut ClusterState, bin: &Path) -> Result<()> {
    let mut cmd = Command::new(bin);
    cmd.arg("--listen")
        .arg(format!("127.0.0.1:{}", state.coordinator.port))
        .arg("--etcd")
        .arg(format!("http://127.0.0.1:{}", state.etcd.port))
        .arg("--cluster")
        .arg(&state.name)
        .arg("--replay-worker")
        .arg(state.replay_worker_endpoint())
        .arg("--pgpass")
        .arg(&state.pgpass)
        .arg("--failpoint-dir")
        .arg(state.failpoint_dir());
    let pid = process::spawn_daemon(&mut cmd, &state.coordinator.log)?;
    state.coordinator.pid = Some(pid);
    let deadline = Instant::now() + START_TIMEOUT;
    let endpoint = state.coordinator_endpoint();
    loop {
        if !pid_alive(pid) {
            bail!(
                "coordinator exited during start; see {}:\n{}",
                state.coordinator.log.display(),
                process::log_tail(&state.coordinator.log, 15)
            );
        }
        if let Ok(h) = coordinator::client::health(&endpoint).await {
            if h.etcd_ok {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "coordinator on port {} did not become healthy within {:?}; see {}",
                state.coordinator.port,
                START_TIMEOUT,
                state.coordinator.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn wait_until(timeout: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("not ready after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Stops every component by PID; idempotent. Returns one line per component.
pub fn stop_all(state: &mut ClusterState) -> Result<Vec<String>> {
    let mut report = Vec::new();
    let mut failures = Vec::new();
    if let Some(pid) = state.coordinator.live_pid() {
        match process::stop_pid(pid, Duration::from_secs(10)) {
            Ok(()) => report.push(format!("coordinator (pid {pid}) stopped")),
            Err(e) => failures.push(format!("coordinator: {e}")),
        }
    }
    for node in &state.nodes {
        let Some(pid) = node.postmaster_pid() else {
            continue;
        };
        let fast = process::run_as_postgres(
            &pg_bindir().join("pg_ctl"),
            &[
                "-D",
                &node.data_dir.to_string_lossy(),
                "-m",
                "fast",
                "-w",
                "-t",
                "60",
                "stop",
            ],
            &[],
        );
        if fast.is_err() || pid_alive(pid) {
            let _ = process::stop_pid(pid, Duration::from_secs(5));
        }
        if pid_alive(pid) {
            failures.push(format!("{}: postmaster {pid} still running", node.name));
        } else {
            report.push(format!("{} (pid {pid}) stopped", node.name));
        }
    }
    if let Some(pid) = state.replay_worker.live_pid() {
        match process::stop_pid(pid, Duration::from_secs(10)) {
            Ok(()) => report.push(format!("replay worker (pid {pid}) stopped")),
            Err(e) => failures.push(format!("replay worker: {e}")),
        }
    }
    if let Some(pid) = state.etcd.live_pid() {
        match process::stop_pid(pid, Duration::from_secs(10)) {
            Ok(()) => report.push(format!("etcd (pid {pid}) stopped")),
            Err(e) => failures.push(format!("etcd: {e}")),
        }
    }
    state.coordinator.pid = None;
    state.replay_worker.pid = None;
    state.etcd.pid = None;
    state.save()?;
    if !failures.is_empty() {
        bail!("could not stop everything: {}", failures.join("; "));
    }
    Ok(report)
}
