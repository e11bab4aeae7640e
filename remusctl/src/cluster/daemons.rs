//! The daemons around the nodes (etcd, the replay worker, the coordinator), found next to
//! remusctl's own binary, started detached and tracked by PID; stopping the whole cluster.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};

use super::postgres::pg_bindir;
use super::state::{endpoint, ClusterState, DaemonState, NodeState, START_TIMEOUT};
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
/// predecessor was running (`coordinator::resume`). With a standby configured, whichever of the
/// two is not running is started; one that finds the other leading waits as the standby.
pub async fn start_coordinator_again(dir: &Path) -> Result<ClusterState> {
    let mut state = ClusterState::load(dir)?;
    let stopped: Vec<Role> = [Role::First, Role::Standby]
        .into_iter()
        .filter(|r| r.daemon(&state).is_some_and(|d| d.live_pid().is_none()))
        .collect();
    if stopped.is_empty() {
        bail!(
            "the coordinator of {} is running (pid {})",
            state.dir.display(),
            state.coordinator.live_pid().unwrap_or_default()
        );
    }
    let bin = sibling_binary("coordinator", "remus-coordinator")?;
    for role in stopped {
        let port = role.daemon(&state).map(|d| d.port).unwrap_or_default();
        if process::port_in_use(port) {
            bail!("port {port} of the {} is in use on 127.0.0.1", role.what());
        }
        start_coordinator(&mut state, &bin, role).await?;
        state.save()?;
    }
    Ok(state)
}

/// Which of a cluster's coordinators (decision 0010).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Role {
    /// `coordinator` in the state file, on P+102: the leader of a new cluster.
    First,
    /// `standby_coordinator`, on P+104.
    Standby,
}

impl Role {
    fn daemon(self, state: &ClusterState) -> Option<&DaemonState> {
        match self {
            Role::First => Some(&state.coordinator),
            Role::Standby => state.standby_coordinator.as_ref(),
        }
    }

    fn daemon_mut(self, state: &mut ClusterState) -> Option<&mut DaemonState> {
        match self {
            Role::First => Some(&mut state.coordinator),
            Role::Standby => state.standby_coordinator.as_mut(),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Role::First => "coordinator",
            Role::Standby => "standby coordinator",
        }
    }
}

/// Starts one coordinator and waits until it either serves (it is the leader) or says in its
/// log that it waits as the standby (a standby does not listen).
pub(super) async fn start_coordinator(
    state: &mut ClusterState,
    bin: &Path,
    role: Role,
) -> Result<()> {
    let Some(daemon) = role.daemon(state).cloned() else {
        bail!("this cluster has no {}", role.what());
    };
    let mut cmd = Command::new(bin);
    cmd.arg("--listen")
        .arg(format!("127.0.0.1:{}", daemon.port))
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
    // Only what this start writes counts: the log is appended to across restarts.
    let log_start = std::fs::metadata(&daemon.log).map(|m| m.len()).unwrap_or(0);
    let pid = process::spawn_daemon(&mut cmd, &daemon.log)?;
    if let Some(d) = role.daemon_mut(state) {
        d.pid = Some(pid);
    }
    let deadline = Instant::now() + START_TIMEOUT;
    let own = endpoint(daemon.port);
    loop {
        if !pid_alive(pid) {
            bail!(
                "{} exited during start; see {}:\n{}",
                role.what(),
                daemon.log.display(),
                process::log_tail(&daemon.log, 15)
            );
        }
        if let Ok(h) = coordinator::client::health(&own).await {
            if h.etcd_ok {
                return Ok(());
            }
        }
        // Waiting as the standby is a good start only behind a live leader: a coordinator
        // started again after a crash waits here until the dead one's lease has ended and it
        // serves, so that `start-coordinator` returns with a coordinator that answers.
        if other_alive(state, role)
            && log_since(&daemon.log, log_start).contains(coordinator::leader::STANDBY_LINE)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{} on port {} neither served nor waited as the standby within {:?}; see {}",
                role.what(),
                daemon.port,
                START_TIMEOUT,
                daemon.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether the cluster's other coordinator (than `role`) runs.
fn other_alive(state: &ClusterState, role: Role) -> bool {
    [Role::First, Role::Standby]
        .into_iter()
        .filter(|r| *r != role)
        .any(|r| r.daemon(state).is_some_and(|d| d.live_pid().is_some()))
}

/// What `log` holds past byte `from`.
fn log_since(log: &Path, from: u64) -> String {
    std::fs::read(log)
        .map(|b| String::from_utf8_lossy(b.get(from as usize..).unwrap_or_default()).into_owned())
        .unwrap_or_default()
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

/// Stops one node's PostgreSQL (fast shutdown, then signals); the postmaster's PID if it was
/// running.
pub(super) fn stop_node(node: &NodeState) -> Result<Option<u32>> {
    let Some(pid) = node.postmaster_pid() else {
        return Ok(None);
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
        bail!("postmaster {pid} still running");
    }
    Ok(Some(pid))
}

/// Stops every component by PID; idempotent. Returns one line per component.
pub fn stop_all(state: &mut ClusterState) -> Result<Vec<String>> {
    let mut report = Vec::new();
    let mut failures = Vec::new();
    // The standby first: stopped after the leader, it would take over and resume migrations
    // on nodes being stopped.
    if let Some(pid) = state
        .standby_coordinator
        .as_ref()
        .and_then(|d| d.live_pid())
    {
        match process::stop_pid(pid, Duration::from_secs(10)) {
            Ok(()) => report.push(format!("standby coordinator (pid {pid}) stopped")),
            Err(e) => failures.push(format!("standby coordinator: {e}")),
        }
    }
    if let Some(pid) = state.coordinator.live_pid() {
        match process::stop_pid(pid, Duration::from_secs(10)) {
            Ok(()) => report.push(format!("coordinator (pid {pid}) stopped")),
            Err(e) => failures.push(format!("coordinator: {e}")),
        }
    }
    for node in &state.nodes {
        match stop_node(node) {
            Ok(Some(pid)) => report.push(format!("{} (pid {pid}) stopped", node.name)),
            Ok(None) => {}
            Err(e) => failures.push(format!("{}: {e}", node.name)),
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
    if let Some(d) = state.standby_coordinator.as_mut() {
        d.pid = None;
    }
    state.replay_worker.pid = None;
    state.etcd.pid = None;
    state.save()?;
    if !failures.is_empty() {
        bail!("could not stop everything: {}", failures.join("; "));
    }
    Ok(report)
}
