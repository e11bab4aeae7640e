//! The cluster's state file (`cluster.json`): what was started where, so that `down` and
//! `status` work from it alone; and the plan of a new cluster's ports and paths, and of a node
//! added to a running one.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use remus_proto::names::ports;
use serde::{Deserialize, Serialize};

use crate::process::pid_alive;

/// How long `up` waits for each server or daemon to accept connections.
pub(super) const START_TIMEOUT: Duration = Duration::from_secs(60);

/// What `remusctl cluster up` was asked for: the cluster's directory, size and first port.
pub struct UpOptions {
    pub dir: PathBuf,
    pub nodes: usize,
    pub base_port: u16,
    /// A second coordinator on P+104 that takes over when the first one's etcd lease ends
    /// (decision 0010).
    pub standby_coordinator: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeState {
    pub name: String,
    pub host: String,
    pub port: u16,
    pub data_dir: PathBuf,
    pub socket_dir: PathBuf,
    pub log: PathBuf,
}

impl NodeState {
    /// The postmaster's PID, from its own pid file: PostgreSQL daemonizes, so the PID we would
    /// get from spawning pg_ctl is not the server's.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let text = fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        let pid: u32 = text.lines().next()?.trim().parse().ok()?;
        pid_alive(pid).then_some(pid)
    }

    pub fn conninfo(&self, password: &str) -> String {
        format!(
            "host={} port={} user=postgres password={} dbname=postgres connect_timeout=10",
            self.host, self.port, password
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DaemonState {
    pub port: u16,
    pub pid: Option<u32>,
    pub log: PathBuf,
}

impl DaemonState {
    pub fn live_pid(&self) -> Option<u32> {
        self.pid.filter(|p| pid_alive(*p))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterState {
    pub dir: PathBuf,
    pub name: String,
    pub base_port: u16,
    pub pgpass: PathBuf,
    pub nodes: Vec<NodeState>,
    pub etcd: DaemonState,
    pub coordinator: DaemonState,
    pub replay_worker: DaemonState,
    /// The standby coordinator, if `up` started one (absent from older state files).
    #[serde(default)]
    pub standby_coordinator: Option<DaemonState>,
}

impl ClusterState {
    pub(super) fn state_file(dir: &Path) -> PathBuf {
        dir.join("cluster.json")
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let dir = absolute(dir)?;
        let path = Self::state_file(&dir);
        let text = fs::read_to_string(&path).map_err(|e| {
            anyhow!(
                "no cluster in {} ({}: {e}); start one with `remusctl cluster up --dir {}`",
                dir.display(),
                path.display(),
                dir.display()
            )
        })?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub(super) fn save(&self) -> Result<()> {
        let path = Self::state_file(&self.dir);
        let tmp = path.with_extension("json.tmp");
        fs::write(&tmp, serde_json::to_string_pretty(self)?)?;
        fs::rename(&tmp, &path)?;
        Ok(())
    }

    pub fn password(&self) -> Result<String> {
        read_pgpass_password(&self.pgpass)
    }

    pub fn node(&self, name: &str) -> Result<&NodeState> {
        self.nodes.iter().find(|n| n.name == name).ok_or_else(|| {
            anyhow!(
                "no node {name} in this cluster (nodes: {})",
                self.nodes
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// Where files arm the coordinator's failpoints (`coordinator::failpoint`).
    pub fn failpoint_dir(&self) -> PathBuf {
        self.dir.join("failpoints")
    }

    /// etcd's peer port (P+101), next to its client port.
    pub fn etcd_peer_port(&self) -> u16 {
        self.etcd.port + (ports::ETCD_PEER_OFFSET - ports::ETCD_CLIENT_OFFSET)
    }

    /// Every coordinator's gRPC address, comma-separated, the first coordinator first: what
    /// the nodes' `remus.coordinator_address` holds and what `coordinator::client::connect`
    /// takes (only the leader listens).
    pub fn coordinator_endpoint(&self) -> String {
        self.coordinators()
            .map(|d| endpoint(d.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The coordinators `up` started: the first one, then the standby if any.
    pub fn coordinators(&self) -> impl Iterator<Item = &DaemonState> {
        std::iter::once(&self.coordinator).chain(self.standby_coordinator.as_ref())
    }

    pub fn replay_worker_endpoint(&self) -> String {
        endpoint(self.replay_worker.port)
    }

    /// Every component that is running now, as (component, pid).
    pub fn running(&self) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = self
            .nodes
            .iter()
            .filter_map(|n| n.postmaster_pid().map(|p| (n.name.clone(), p)))
            .collect();
        if let Some(p) = self.etcd.live_pid() {
            out.push(("etcd".into(), p));
        }
        if let Some(p) = self.coordinator.live_pid() {
            out.push(("coordinator".into(), p));
        }
        if let Some(p) = self.standby_coordinator.as_ref().and_then(|d| d.live_pid()) {
            out.push(("standby coordinator".into(), p));
        }
        if let Some(p) = self.replay_worker.live_pid() {
            out.push(("replay worker".into(), p));
        }
        out
    }
}

/// Builds the state for a new cluster, or reloads a stopped one so `up` restarts it in place.
pub(super) fn plan(opts: &UpOptions) -> Result<ClusterState> {
    if opts.nodes == 0 || opts.nodes > 99 {
        bail!("--nodes must be between 1 and 99");
    }
    let dir = absolute(&opts.dir)?;
    if ClusterState::state_file(&dir).exists() {
        let state = ClusterState::load(&dir)?;
        let running = state.running();
        if !running.is_empty() {
            let list: Vec<String> = running
                .iter()
                .map(|(c, p)| format!("{c} (pid {p})"))
                .collect();
            bail!(
                "a cluster is already running in {}: {}; see `remusctl cluster status --dir {0}` or stop it with `remusctl cluster down --dir {0}`",
                dir.display(),
                list.join(", ")
            );
        }
        if state.nodes.len() != opts.nodes || state.base_port != opts.base_port {
            bail!(
                "{} holds a stopped cluster of {} nodes on base port {}; start it with those settings or remove the directory",
                dir.display(),
                state.nodes.len(),
                state.base_port
            );
        }
        // The nodes' remus.coordinator_address was written at initdb and lists the coordinators.
        if state.standby_coordinator.is_some() != opts.standby_coordinator {
            bail!(
                "{} holds a stopped cluster {} a standby coordinator; start it the same way or remove the directory",
                dir.display(),
                if state.standby_coordinator.is_some() { "with" } else { "without" }
            );
        }
        return Ok(state);
    }
    let top = u32::from(opts.base_port) + u32::from(ports::MAX_OFFSET);
    if top > 65535 || opts.base_port < 1024 {
        bail!(
            "--base-port must leave room for ports P..P+{} within 1024..65535",
            ports::MAX_OFFSET
        );
    }
    let nodes = (1..=opts.nodes)
        .map(|k| node_state(&dir, k, opts.base_port + (k as u16 - 1)))
        .collect();
    Ok(ClusterState {
        name: "local".into(),
        base_port: opts.base_port,
        pgpass: dir.join("pgpass"),
        etcd: DaemonState {
            port: opts.base_port + ports::ETCD_CLIENT_OFFSET,
            pid: None,
            log: dir.join("logs").join("etcd.log"),
        },
        coordinator: DaemonState {
            port: opts.base_port + ports::COORDINATOR_OFFSET,
            pid: None,
            log: dir.join("logs").join("coordinator.log"),
        },
        replay_worker: DaemonState {
            port: opts.base_port + ports::REPLAY_WORKER_OFFSET,
            pid: None,
            log: dir.join("logs").join("replay-worker.log"),
        },
        standby_coordinator: opts
            .standby_coordinator
            .then(|| standby_coordinator(&dir, opts.base_port)),
        nodes,
        dir,
    })
}

/// Node `nK` of the cluster in `dir`, listening on `port`.
fn node_state(dir: &Path, k: usize, port: u16) -> NodeState {
    let name = format!("n{k}");
    NodeState {
        host: "127.0.0.1".into(),
        port,
        data_dir: dir.join(&name).join("data"),
        socket_dir: dir.join(&name).join("run"),
        log: dir.join("logs").join(format!("{name}.log")),
        name,
    }
}

/// The node `cluster add-node` adds to the running cluster `state`: with N nodes, `nK` for
/// K = N + 1 on port P+K-1, where `up --nodes K` would have put it. Refused when that port
/// would be P+100 or above: those belong to etcd, the coordinators and the replay worker
/// ([`ports`]); or when the name or the port is already a node's.
pub(super) fn plan_added_node(state: &ClusterState) -> Result<NodeState> {
    let k = state.nodes.len() + 1;
    let offset = u16::try_from(k - 1)
        .ok()
        .filter(|o| *o < ports::ETCD_CLIENT_OFFSET);
    let Some(offset) = offset else {
        bail!(
            "cannot add node n{k}: its port would be P+{} (P = base port {}), but P+{}.. belong to etcd, the coordinators and the replay worker; a cluster holds at most {} nodes",
            k - 1,
            state.base_port,
            ports::ETCD_CLIENT_OFFSET,
            ports::ETCD_CLIENT_OFFSET
        );
    };
    let Some(port) = state.base_port.checked_add(offset) else {
        bail!(
            "cannot add node n{k}: base port {} + {offset} is above 65535",
            state.base_port
        );
    };
    let node = node_state(&state.dir, k, port);
    if let Some(other) = state
        .nodes
        .iter()
        .find(|n| n.name == node.name || n.port == node.port)
    {
        bail!(
            "cannot add node {} on port {}: node {} of {} has that {}",
            node.name,
            node.port,
            other.name,
            state.dir.display(),
            if other.name == node.name {
                "name"
            } else {
                "port"
            }
        );
    }
    Ok(node)
}

fn standby_coordinator(dir: &Path, base_port: u16) -> DaemonState {
    DaemonState {
        port: base_port + ports::STANDBY_COORDINATOR_OFFSET,
        pid: None,
        log: dir.join("logs").join("coordinator-standby.log"),
    }
}

/// A gRPC address on loopback.
pub(super) fn endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

fn absolute(dir: &Path) -> Result<PathBuf> {
    Ok(if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()?.join(dir)
    })
}

pub(super) fn read_pgpass_password(path: &Path) -> Result<String> {
    let text = fs::read_to_string(path)
        .with_context(|| format!("reading password file {}", path.display()))?;
    text.lines()
        .find_map(|l| {
            l.rsplit(':')
                .next()
                .filter(|p| !p.is_empty())
                .map(str::to_string)
        })
        .ok_or_else(|| anyhow!("{} holds no password", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_assigns_ports_and_paths() {
        let dir = tempfile::tempdir().unwrap();
        let s = plan(&UpOptions {
            dir: dir.path().into(),
            nodes: 3,
            base_port: 7001,
            standby_coordinator: false,
        })
        .unwrap();
        let ports: Vec<u16> = s.nodes.iter().map(|n| n.port).collect();
        assert_eq!(ports, vec![7001, 7002, 7003]);
        assert_eq!(s.etcd.port, 7101);
        assert_eq!(s.coordinator.port, 7103);
        assert_eq!(s.nodes[1].data_dir, dir.path().join("n2/data"));
    }

    #[test]
    fn plan_rejects_bad_sizes() {
        let dir = tempfile::tempdir().unwrap();
        assert!(plan(&UpOptions {
            dir: dir.path().into(),
            nodes: 0,
            base_port: 7001,
            standby_coordinator: false,
        })
        .is_err());
        assert!(plan(&UpOptions {
            dir: dir.path().into(),
            nodes: 3,
            base_port: 65500,
            standby_coordinator: false,
        })
        .is_err());
    }

    fn planned(nodes: usize, base_port: u16) -> (tempfile::TempDir, ClusterState) {
        let dir = tempfile::tempdir().unwrap();
        let s = plan(&UpOptions {
            dir: dir.path().into(),
            nodes,
            base_port,
            standby_coordinator: false,
        })
        .unwrap();
        (dir, s)
    }

    #[test]
    fn added_node_is_next_name_and_port() {
        let (dir, mut s) = planned(3, 7001);
        let n = plan_added_node(&s).unwrap();
        assert_eq!(n.name, "n4");
        assert_eq!(n.port, 7004);
        assert_eq!(n.host, "127.0.0.1");
        assert_eq!(n.data_dir, dir.path().join("n4/data"));
        assert_eq!(n.socket_dir, dir.path().join("n4/run"));
        assert_eq!(n.log, dir.path().join("logs/n4.log"));
        // Where `up --nodes 4` would have put it.
        let (_, four) = planned(4, 7001);
        assert_eq!(four.nodes[3].port, n.port);
        // After it is added, the next one follows it.
        s.nodes.push(n);
        let n5 = plan_added_node(&s).unwrap();
        assert_eq!((n5.name.as_str(), n5.port), ("n5", 7005));
    }

    #[test]
    fn added_node_stays_below_the_service_ports() {
        // 99 nodes on P..P+98: the 100th gets P+99, the last port before etcd's client port.
        let (_dir, mut s) = planned(99, 7001);
        let n100 = plan_added_node(&s).unwrap();
        assert_eq!((n100.name.as_str(), n100.port), ("n100", 7001 + 99));
        assert!(n100.port < s.etcd.port);
        s.nodes.push(n100);
        // The 101st would be on P+100, etcd's client port.
        let err = plan_added_node(&s).unwrap_err().to_string();
        assert!(err.contains("n101") && err.contains("P+100"), "{err}");
    }

    #[test]
    fn added_node_refuses_a_taken_name_or_port() {
        let (_dir, mut s) = planned(2, 7001);
        // A state whose second node was renamed n3 (by hand): n3 is taken.
        s.nodes[1].name = "n3".into();
        let err = plan_added_node(&s).unwrap_err().to_string();
        assert!(err.contains("has that name"), "{err}");
        // A state whose first node listens on P+2: that port is taken.
        s.nodes[1].name = "n2".into();
        s.nodes[0].port = 7003;
        let err = plan_added_node(&s).unwrap_err().to_string();
        assert!(err.contains("n1") && err.contains("has that port"), "{err}");
    }

    #[test]
    fn pgpass_password_is_last_field() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pgpass");
        fs::write(&p, "*:*:*:postgres:s3cret\n").unwrap();
        assert_eq!(read_pgpass_password(&p).unwrap(), "s3cret");
    }
}
