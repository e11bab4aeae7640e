//! `remusctl cluster up|down|status|env`: a real pg_remus cluster on loopback.
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
//! worker gRPC P+103.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::process::{self, pid_alive};

pub const DEFAULT_DIR: &str = ".remus/cluster";
pub const DEFAULT_BASE_PORT: u16 = 6001;
pub const DEFAULT_NODES: usize = 3;
pub use remus_proto::names::ports::{
    COORDINATOR_OFFSET as COORDINATOR_PORT_OFFSET, ETCD_CLIENT_OFFSET as ETCD_PORT_OFFSET,
    REPLAY_WORKER_OFFSET as REPLAY_WORKER_PORT_OFFSET,
};
const START_TIMEOUT: Duration = Duration::from_secs(60);

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
}

impl ClusterState {
    fn state_file(dir: &Path) -> PathBuf {
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

    fn save(&self) -> Result<()> {
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
                self.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>().join(", ")
            )
        })
    }

    /// Where files arm the coordinator's failpoints (`coordinator::failpoint`).
    pub fn failpoint_dir(&self) -> PathBuf {
        self.dir.join("failpoints")
    }

    pub fn coordinator_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.coordinator.port)
    }

    pub fn replay_worker_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.replay_worker.port)
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
        if let Some(p) = self.replay_worker.live_pid() {
            out.push(("replay worker".into(), p));
        }
        out
    }
}

pub struct UpOptions {
    pub dir: PathBuf,
    pub nodes: usize,
    pub base_port: u16,
}

fn absolute(dir: &Path) -> Result<PathBuf> {
    Ok(if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()?.join(dir)
    })
}

pub fn pg_bindir() -> PathBuf {
    std::env::var_os("REMUS_PG_BINDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(program))
            .find(|p| p.is_file())
    })
}

/// A daemon binary next to remusctl's own.
fn sibling_binary(what: &str, name: &str) -> Result<PathBuf> {
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

fn read_pgpass_password(path: &Path) -> Result<String> {
    let text =
        fs::read_to_string(path).with_context(|| format!("reading password file {}", path.display()))?;
    text.lines()
        .find_map(|l| l.rsplit(':').next().filter(|p| !p.is_empty()).map(str::to_string))
        .ok_or_else(|| anyhow!("{} holds no password", path.display()))
}

/// Builds the state for a new cluster, or reloads a stopped one so `up` restarts it in place.
fn plan(opts: &UpOptions) -> Result<ClusterState> {
    if opts.nodes == 0 || opts.nodes > 99 {
        bail!("--nodes must be between 1 and 99");
    }
    let dir = absolute(&opts.dir)?;
    if ClusterState::state_file(&dir).exists() {
        let state = ClusterState::load(&dir)?;
        let running = state.running();
        if !running.is_empty() {
            let list: Vec<String> = running.iter().map(|(c, p)| format!("{c} (pid {p})")).collect();
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
        return Ok(state);
    }
    let top = u32::from(opts.base_port) + u32::from(REPLAY_WORKER_PORT_OFFSET);
    if top > 65535 || opts.base_port < 1024 {
        bail!("--base-port must leave room for ports P..P+102 within 1024..65535");
    }
    let nodes = (1..=opts.nodes)
        .map(|i| {
            let name = format!("n{i}");
            NodeState {
                host: "127.0.0.1".into(),
                port: opts.base_port + (i as u16 - 1),
                data_dir: dir.join(&name).join("data"),
                socket_dir: dir.join(&name).join("run"),
                log: dir.join("logs").join(format!("{name}.log")),
                name,
            }
        })
        .collect();
    Ok(ClusterState {
        name: "local".into(),
        base_port: opts.base_port,
        pgpass: dir.join("pgpass"),
        etcd: DaemonState {
            port: opts.base_port + ETCD_PORT_OFFSET,
            pid: None,
            log: dir.join("logs").join("etcd.log"),
        },
        coordinator: DaemonState {
            port: opts.base_port + COORDINATOR_PORT_OFFSET,
            pid: None,
            log: dir.join("logs").join("coordinator.log"),
        },
        replay_worker: DaemonState {
            port: opts.base_port + REPLAY_WORKER_PORT_OFFSET,
            pid: None,
            log: dir.join("logs").join("replay-worker.log"),
        },
        nodes,
        dir,
    })
}

fn preflight(state: &ClusterState) -> Result<Binaries> {
    let bindir = pg_bindir();
    for bin in ["initdb", "pg_ctl", "postgres"] {
        if !bindir.join(bin).is_file() {
            bail!(
                "missing binary: PostgreSQL 15 {bin} not found in {} (install postgresql-15, or set REMUS_PG_BINDIR)",
                bindir.display()
            );
        }
    }
    if which("etcd").is_none() {
        bail!("missing binary: etcd not found on PATH (install the etcd-server package)");
    }
    if which("runuser").is_none() {
        bail!("missing binary: runuser not found on PATH (util-linux)");
    }
    process::postgres_ids()?;
    let binaries = Binaries {
        coordinator: sibling_binary("coordinator", "remus-coordinator")?,
        replay_worker: sibling_binary("replay worker", "remus-replay-worker")?,
    };
    let mut ports: Vec<(String, u16)> =
        state.nodes.iter().map(|n| (format!("{} (postgres)", n.name), n.port)).collect();
    ports.push(("etcd client".into(), state.etcd.port));
    ports.push(("etcd peer".into(), state.etcd.port + 1));
    ports.push(("coordinator".into(), state.coordinator.port));
    ports.push(("replay worker".into(), state.replay_worker.port));
    for (what, port) in ports {
        if process::port_in_use(port) {
            bail!("port {port} needed by {what} is already in use on 127.0.0.1; pick another --base-port");
        }
    }
    Ok(binaries)
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
        init_node(node, password, state.coordinator.port)?;
        start_node(state, node)?;
    }
    start_etcd(state)?;
    state.save()?;
    start_replay_worker(state, &binaries.replay_worker)?;
    state.save()?;
    start_coordinator(state, &binaries.coordinator).await?;
    state.save()?;
    for node in &state.nodes {
        let client = connect(node, password).await?;
        client
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_remus")
            .await
            .with_context(|| format!("CREATE EXTENSION pg_remus on {}", node.name))?;
        for peer in &state.nodes {
            client
                .execute(
                    "SELECT remus_add_node($1, $2, $3)",
                    &[&peer.name, &peer.host, &i32::from(peer.port)],
                )
                .await
                .with_context(|| format!("remus_add_node({}) on {}", peer.name, node.name))?;
        }
    }
    let mut grpc = crate::client::connect(&state.coordinator_endpoint()).await?;
    for node in &state.nodes {
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

pub async fn connect(node: &NodeState, password: &str) -> Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(&node.conninfo(password), tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {} on 127.0.0.1:{}", node.name, node.port))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

fn init_node(node: &NodeState, password: &str, coordinator_port: u16) -> Result<()> {
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
    fs::write(node.data_dir.join("remus.conf"), remus_conf(node, coordinator_port))?;
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

/// Settings Remus needs on every node (../shared/DESIGN.md section 7); all need a restart.
fn remus_conf(node: &NodeState, coordinator_port: u16) -> String {
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
max_replication_slots = 64
max_wal_senders = 32
max_worker_processes = 32
logical_decoding_work_mem = '64MB'
shared_buffers = '128MB'
log_line_prefix = '%m [%p] {name} %q%u@%d '
log_min_messages = warning
remus.node_name = '{name}'
remus.coordinator_address = 'http://127.0.0.1:{coordinator_port}'
",
        port = node.port,
        sock = node.socket_dir.display(),
        name = node.name,
        coordinator_port = coordinator_port,
    )
}

fn start_node(state: &ClusterState, node: &NodeState) -> Result<()> {
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
        &[("PGPASSFILE", &pgpass), ("RUST_BACKTRACE", "0"), ("RUST_LIB_BACKTRACE", "0")],
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

fn start_etcd(state: &mut ClusterState) -> Result<()> {
    let client = format!("http://127.0.0.1:{}", state.etcd.port);
    let peer = format!("http://127.0.0.1:{}", state.etcd.port + 1);
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

fn start_replay_worker(state: &mut ClusterState, bin: &Path) -> Result<()> {
    let mut cmd = Command::new(bin);
    cmd.arg("--listen").arg(format!("127.0.0.1:{}", state.replay_worker.port));
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
    .map_err(|e| anyhow!("replay worker on port {port} did not start ({e}); see {}", state.replay_worker.log.display()))
}

/// Starts the coordinator of the cluster in `dir` again (after it stopped or crashed), with the
/// rest of the cluster left as it is; the new coordinator resumes the migrations its
/// predecessor was running (`coordinator::resume`).
pub async fn start_coordinator_again(dir: &Path) -> Result<ClusterState> {
    let mut state = ClusterState::load(dir)?;
    if let Some(pid) = state.coordinator.live_pid() {
        bail!("the coordinator of {} is running (pid {pid})", state.dir.display());
    }
    if process::port_in_use(state.coordinator.port) {
        bail!("port {} of the coordinator is in use on 127.0.0.1", state.coordinator.port);
    }
    let bin = sibling_binary("coordinator", "remus-coordinator")?;
    start_coordinator(&mut state, &bin).await?;
    state.save()?;
    Ok(state)
}

async fn start_coordinator(state: &mut ClusterState, bin: &Path) -> Result<()> {
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
        if let Ok(h) = crate::client::health(&endpoint).await {
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
        let Some(pid) = node.postmaster_pid() else { continue };
        let fast = process::run_as_postgres(
            &pg_bindir().join("pg_ctl"),
            &["-D", &node.data_dir.to_string_lossy(), "-m", "fast", "-w", "-t", "60", "stop"],
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

pub struct ComponentStatus {
    pub component: String,
    pub address: String,
    pub pid: Option<u32>,
    pub up: bool,
    pub log: PathBuf,
}

pub async fn status(state: &ClusterState) -> Vec<ComponentStatus> {
    let mut out = Vec::new();
    for n in &state.nodes {
        let pid = n.postmaster_pid();
        out.push(ComponentStatus {
            component: format!("{} postgres", n.name),
            address: format!("{}:{}", n.host, n.port),
            up: pid.is_some() && process::tcp_reachable(n.port),
            pid,
            log: n.log.clone(),
        });
    }
    let pid = state.etcd.live_pid();
    out.push(ComponentStatus {
        component: "etcd".into(),
        address: format!("127.0.0.1:{}", state.etcd.port),
        up: pid.is_some() && process::etcd_healthy(state.etcd.port),
        pid,
        log: state.etcd.log.clone(),
    });
    let pid = state.coordinator.live_pid();
    let healthy = pid.is_some() && crate::client::health(&state.coordinator_endpoint()).await.is_ok();
    out.push(ComponentStatus {
        component: "coordinator".into(),
        address: format!("127.0.0.1:{}", state.coordinator.port),
        up: healthy,
        pid,
        log: state.coordinator.log.clone(),
    });
    let pid = state.replay_worker.live_pid();
    out.push(ComponentStatus {
        component: "replay worker".into(),
        address: format!("127.0.0.1:{}", state.replay_worker.port),
        up: pid.is_some() && process::port_in_use(state.replay_worker.port),
        pid,
        log: state.replay_worker.log.clone(),
    });
    out
}

/// Shell `export` lines for libpq, pointing at one node.
pub fn env_lines(state: &ClusterState, node: &str) -> Result<String> {
    let n = state.node(node)?;
    Ok(format!(
        "export PGHOST={}\nexport PGPORT={}\nexport PGUSER=postgres\nexport PGPASSFILE={}\nexport PGDATABASE=postgres\n",
        n.host,
        n.port,
        shell_quote(&state.pgpass.to_string_lossy())
    ))
}

fn shell_quote(s: &str) -> String {
    if s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+=:".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_assigns_ports_and_paths() {
        let dir = tempfile::tempdir().unwrap();
        let s = plan(&UpOptions { dir: dir.path().into(), nodes: 3, base_port: 7001 }).unwrap();
        let ports: Vec<u16> = s.nodes.iter().map(|n| n.port).collect();
        assert_eq!(ports, vec![7001, 7002, 7003]);
        assert_eq!(s.etcd.port, 7101);
        assert_eq!(s.coordinator.port, 7103);
        assert_eq!(s.nodes[1].data_dir, dir.path().join("n2/data"));
    }

    #[test]
    fn plan_rejects_bad_sizes() {
        let dir = tempfile::tempdir().unwrap();
        assert!(plan(&UpOptions { dir: dir.path().into(), nodes: 0, base_port: 7001 }).is_err());
        assert!(plan(&UpOptions { dir: dir.path().into(), nodes: 3, base_port: 65500 }).is_err());
    }

    #[test]
    fn pgpass_password_is_last_field() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pgpass");
        fs::write(&p, "*:*:*:postgres:s3cret\n").unwrap();
        assert_eq!(read_pgpass_password(&p).unwrap(), "s3cret");
    }

    #[test]
    fn env_lines_quote_odd_paths() {
        assert_eq!(shell_quote("/tmp/a b"), "'/tmp/a b'");
        assert_eq!(shell_quote("/tmp/ab"), "/tmp/ab");
    }

    #[test]
    fn conf_has_remus_requirements() {
        let dir = tempfile::tempdir().unwrap();
        let s = plan(&UpOptions { dir: dir.path().into(), nodes: 2, base_port: 7001 }).unwrap();
        let conf = remus_conf(&s.nodes[1], s.coordinator.port);
        for needle in [
            "wal_level = logical",
            "track_commit_timestamp = on",
            "shared_preload_libraries = 'pg_remus'",
            "remus.node_name = 'n2'",
            "port = 7002",
            "remus.coordinator_address = 'http://127.0.0.1:7103'",
            "max_replication_slots = 64",
        ] {
            assert!(conf.contains(needle), "missing {needle}");
        }
        assert!(!PG_HBA.contains("trust"));
    }
}
