//! Harness for integration tests: a real cluster started with the real `remusctl`, always torn
//! down again (also when a test panics), plus helpers to talk to its nodes.
//!
//! Tests use the release binaries that `scripts/setup.sh` builds (override with REMUS_BIN_DIR)
//! and the pg_remus extension installed into the system PostgreSQL 15.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{bail, Context, Result};
use remus_proto::names::ports::{ETCD_CLIENT_OFFSET, MAX_OFFSET};
pub use remusctl::cluster::ClusterState;

use crate::ports::{PortBlock, NODE_PORTS, SERVICE_OFFSET, SERVICE_PORTS};

// A cluster on base port P uses P..P+N-1 for its nodes and P+100..P+104 for etcd (client and
// peer), the coordinator, the replay worker and the standby coordinator
// (`remus_proto::names::ports`): all inside one `PortBlock`.
const _: () =
    assert!(ETCD_CLIENT_OFFSET >= SERVICE_OFFSET && MAX_OFFSET < SERVICE_OFFSET + SERVICE_PORTS);

/// Where the release binaries are: `REMUS_BIN_DIR`, or the workspace's `target/release`.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("REMUS_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release"))
}

pub fn remusctl(args: &[&str]) -> Output {
    let bin = bin_dir().join("remusctl");
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// How many times [`TestCluster::start`] tries `cluster up`.
pub const START_ATTEMPTS: usize = 3;

/// A running cluster in a private directory; `Drop` runs `remusctl cluster down`.
pub struct TestCluster {
    pub dir: tempfile::TempDir,
    pub base_port: u16,
    pub nodes: usize,
    // Released after `cluster down` (`Drop` runs before the fields are dropped).
    _ports: PortBlock,
}

impl TestCluster {
    /// A cluster of `nodes` nodes on the ports of a freshly reserved [`PortBlock`] (at most
    /// `NODE_PORTS` nodes), all below Linux's ephemeral range (see [`crate::ports`]).
    ///
    /// A `cluster up` that fails is reported on stderr (with the tails of the daemons' logs that
    /// `remusctl` includes) and tried again, up to [`START_ATTEMPTS`] times, on a new block in a
    /// new directory: the allocator probes a block's ports before handing it out, but another
    /// process can still take one of them between the probe and the daemon's bind. A test that
    /// needs its cluster never passes on a broken start; it only survives a port race.
    pub fn start(nodes: usize) -> Result<Self> {
        Self::start_with(nodes, &[])
    }

    /// Like [`start`](Self::start), with a standby coordinator (`cluster up
    /// --standby-coordinator`, decision 0010): the nodes' `remus.coordinator_address` lists
    /// both coordinators, the first one leads.
    pub fn start_with_standby(nodes: usize) -> Result<Self> {
        Self::start_with(nodes, &["--standby-coordinator"])
    }

    fn start_with(nodes: usize, up_args: &[&str]) -> Result<Self> {
        if nodes > usize::from(NODE_PORTS) {
            bail!("a test cluster has at most {NODE_PORTS} nodes, not {nodes}");
        }
        let mut last = None;
        for attempt in 1..=START_ATTEMPTS {
            match Self::start_once(nodes, up_args) {
                Ok(c) => return Ok(c),
                Err(e) => {
                    eprintln!("test cluster start, attempt {attempt} of {START_ATTEMPTS}: {e:#}");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn start_once(nodes: usize, up_args: &[&str]) -> Result<Self> {
        let ports = PortBlock::reserve();
        let base_port = ports.base();
        // Under /tmp (world-searchable) so the postgres OS user can reach the data directories.
        // REMUS_TEST_KEEP=1 keeps the cluster's directory (server and daemon logs) after the test.
        let keep = std::env::var_os("REMUS_TEST_KEEP").is_some();
        let dir = tempfile::Builder::new()
            .prefix("remus-it-")
            .disable_cleanup(keep)
            .tempdir_in("/tmp")?;
        let c = TestCluster {
            dir,
            base_port,
            nodes,
            _ports: ports,
        };
        let (nodes_arg, port_arg) = (nodes.to_string(), base_port.to_string());
        let mut args = vec![
            "cluster",
            "up",
            "--nodes",
            &nodes_arg,
            "--base-port",
            &port_arg,
        ];
        args.extend_from_slice(up_args);
        let out = c.ctl(&args);
        if !out.status.success() {
            // Dropping `c` runs `cluster down`: whatever did start is stopped before the retry.
            bail!(
                "cluster up on ports {base_port}.. failed: {}{}",
                stdout(&out),
                stderr(&out)
            );
        }
        Ok(c)
    }

    pub fn dir_str(&self) -> String {
        self.dir.path().to_string_lossy().into_owned()
    }

    /// Runs `remusctl <args> --dir <this cluster>`.
    pub fn ctl(&self, args: &[&str]) -> Output {
        let dir = self.dir_str();
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--dir", &dir]);
        remusctl(&all)
    }

    pub fn state(&self) -> Result<ClusterState> {
        ClusterState::load(self.dir.path())
    }

    pub fn password(&self) -> Result<String> {
        self.state()?.password()
    }

    /// A connection to node `name` over TCP with the generated password.
    pub fn connect(&self, name: &str) -> Result<postgres::Client> {
        let state = self.state()?;
        let node = state.node(name)?;
        postgres::Client::connect(&node.conninfo(&state.password()?), postgres::NoTls)
            .with_context(|| format!("connecting to {name}"))
    }

    /// Starts node `name` again the way `cluster up` does (after a crash or a stop).
    pub fn start_node(&self, name: &str) -> Result<()> {
        let state = self.state()?;
        let n = state.node(name)?;
        let out = Command::new("runuser")
            .args([
                "-u",
                "postgres",
                "--",
                "env",
                &format!("PGPASSFILE={}", state.pgpass.display()),
                "RUST_BACKTRACE=0",
            ])
            .arg(remusctl::cluster::pg_bindir().join("pg_ctl"))
            .args([
                "-D",
                &n.data_dir.to_string_lossy(),
                "-l",
                &n.log.to_string_lossy(),
                "-w",
                "-t",
                "120",
                "start",
            ])
            .output()?;
        if !out.status.success() {
            bail!("starting {name}: {}", stderr(&out));
        }
        Ok(())
    }

    /// Stops node `name` cleanly (prepared transactions survive, as after a crash).
    pub fn stop_node(&self, name: &str) -> Result<()> {
        let state = self.state()?;
        let n = state.node(name)?;
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(remusctl::cluster::pg_bindir().join("pg_ctl"))
            .args([
                "-D",
                &n.data_dir.to_string_lossy(),
                "-m",
                "fast",
                "-w",
                "stop",
            ])
            .output()?;
        if !out.status.success() {
            bail!("stopping {name}: {}", stderr(&out));
        }
        Ok(())
    }

    /// Kills the coordinator with SIGKILL (a crash: nothing of it is cleaned up) and waits
    /// until it is gone.
    pub fn kill_coordinator(&self) -> Result<()> {
        let state = self.state()?;
        let Some(pid) = state.coordinator.live_pid() else {
            bail!("the coordinator is not running")
        };
        // SAFETY: plain syscall on the PID the cluster recorded for its coordinator.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let started = std::time::Instant::now();
        while state.coordinator.live_pid().is_some() {
            if started.elapsed() > std::time::Duration::from_secs(30) {
                bail!("the coordinator (pid {pid}) survived SIGKILL");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    /// The port of the coordinator that leads now: of a cluster's coordinators, only the leader
    /// listens (decision 0010). None while none does (a takeover in progress).
    pub fn leading_coordinator_port(&self) -> Result<Option<u16>> {
        let state = self.state()?;
        let leading = state
            .coordinators()
            .filter(|d| d.live_pid().is_some())
            .map(|d| d.port)
            .find(|p| remusctl::process::tcp_reachable(*p));
        Ok(leading)
    }

    /// Kills the coordinator that leads now with SIGKILL and waits until it is gone; returns
    /// the port it served on.
    pub fn kill_leading_coordinator(&self) -> Result<u16> {
        let Some(port) = self.leading_coordinator_port()? else {
            bail!("no coordinator leads")
        };
        let state = self.state()?;
        let leader = state
            .coordinators()
            .find(|d| d.port == port)
            .expect("the port is one of the coordinators'");
        let Some(pid) = leader.live_pid() else {
            bail!("the coordinator on port {port} is not running")
        };
        // SAFETY: plain syscall on a PID the cluster recorded for one of its coordinators.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let started = std::time::Instant::now();
        while remusctl::process::pid_alive(pid) {
            if started.elapsed() > std::time::Duration::from_secs(30) {
                bail!("the coordinator (pid {pid}) survived SIGKILL");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(port)
    }

    /// A connection to node `name` as a session of the migration machinery
    /// (`remus.migration_session`), which a closed admission gate does not hold: a test's own
    /// observations must not wait at the gate they observe. The setting comes with the
    /// connection's startup packet: a `SET` is a statement of a transaction that starts after
    /// the gate closed, so it would wait at the gate itself, until the gate's timeout.
    pub fn connect_migration_session(&self, name: &str) -> Result<postgres::Client> {
        let state = self.state()?;
        let node = state.node(name)?;
        postgres::Client::connect(
            &format!(
                "{} options='-c remus.migration_session=on'",
                node.conninfo(&state.password()?)
            ),
            postgres::NoTls,
        )
        .with_context(|| format!("connecting to {name} as a migration session"))
    }

    /// `remusctl cluster start-coordinator`: the coordinator again, the rest as it is. A killed
    /// coordinator's port can take a moment to be free again: while remusctl says it is in use,
    /// tried again for up to 30 s.
    pub fn start_coordinator_again(&self) -> Result<()> {
        let started = std::time::Instant::now();
        loop {
            let out = self.ctl(&["cluster", "start-coordinator"]);
            if out.status.success() {
                return Ok(());
            }
            let why = format!("{}{}", stdout(&out), stderr(&out));
            if !why.contains("in use") || started.elapsed() > std::time::Duration::from_secs(30) {
                bail!("start-coordinator failed: {why}");
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// Arms the coordinator's failpoint `name` (`coordinator::failpoint`) with `pause`: the
    /// next migration to get there stops until [`release_failpoint`](Self::release_failpoint).
    pub fn arm_pause(&self, name: &str) -> Result<()> {
        let dir = self.state()?.failpoint_dir();
        std::fs::create_dir_all(&dir)?;
        // A marker left by a coordinator killed while paused would read as reached.
        let _ = std::fs::remove_file(dir.join(format!("{name}.reached")));
        std::fs::write(dir.join(name), "pause")?;
        Ok(())
    }

    /// Waits until a migration is paused at failpoint `name`; returns its migration id.
    pub fn wait_paused_at(&self, name: &str, limit: std::time::Duration) -> Result<i64> {
        let marker = self
            .state()?
            .failpoint_dir()
            .join(format!("{name}.reached"));
        let started = std::time::Instant::now();
        loop {
            if let Ok(id) = std::fs::read_to_string(&marker) {
                if let Ok(id) = id.trim().parse() {
                    return Ok(id);
                }
            }
            if started.elapsed() > limit {
                bail!(
                    "no migration reached failpoint {name} within {limit:?}\n{}",
                    self.daemon_logs(30)
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Lets a migration paused at failpoint `name` go on.
    pub fn release_failpoint(&self, name: &str) -> Result<()> {
        let path = self.state()?.failpoint_dir().join(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// The last `lines` lines of the coordinator's and the replay worker's logs (for failure
    /// messages: the cluster directory is removed when the test ends).
    pub fn daemon_logs(&self, lines: usize) -> String {
        let Ok(state) = self.state() else {
            return String::new();
        };
        format!(
            "--- coordinator log ---\n{}\n--- replay worker log ---\n{}",
            remusctl::process::log_tail(&state.coordinator.log, lines),
            remusctl::process::log_tail(&state.replay_worker.log, lines)
        )
    }

    /// `pgbench <args>` with libpq pointed at `node` (password from the cluster's pgpass).
    pub fn pgbench(&self, node: &str, args: &[&str]) -> Command {
        let mut cmd = self.libpq_command(node, "pgbench");
        cmd.args(args);
        cmd
    }

    /// `program` with libpq's environment pointed at `node` as the cluster's superuser
    /// (PGHOST, PGPORT, PGUSER, PGDATABASE, and PGPASSFILE for the password).
    pub fn libpq_command(&self, node: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let state = self.state().unwrap();
        let n = state.node(node).unwrap();
        let mut cmd = Command::new(program);
        cmd.env("PGHOST", &n.host)
            .env("PGPORT", n.port.to_string())
            .env("PGUSER", "postgres")
            .env("PGDATABASE", "postgres")
            .env("PGPASSFILE", &state.pgpass);
        cmd
    }

    /// The cluster's nodes, from its state: those it was started with and those
    /// [`add_node`](Self::add_node) added.
    pub fn node_names(&self) -> Vec<String> {
        self.state()
            .expect("reading the test cluster's state")
            .nodes
            .iter()
            .map(|n| n.name.clone())
            .collect()
    }

    /// `remusctl cluster add-node`: one more node, on the next port of this cluster's
    /// [`PortBlock`] (refused past its `NODE_PORTS` node ports, which are another block's),
    /// activated (membership, tables, catalog, reference rows) and registered with the
    /// coordinator; it owns no shard. Returns its name, which [`node_names`](Self::node_names)
    /// and [`connect`](Self::connect) then know (`nodes` stays the count the cluster was
    /// started with).
    pub fn add_node(&self) -> Result<String> {
        let before = self.state()?.nodes.len();
        if before >= usize::from(NODE_PORTS) {
            bail!("a test cluster has at most {NODE_PORTS} nodes; this one has {before}");
        }
        let out = self.ctl(&["cluster", "add-node"]);
        if !out.status.success() {
            bail!("cluster add-node failed: {}{}", stdout(&out), stderr(&out));
        }
        let name = stdout(&out).trim().to_string();
        let state = self.state()?;
        if state.nodes.len() != before + 1 || state.nodes.last().map(|n| &n.name) != Some(&name) {
            bail!(
                "cluster add-node printed {name:?} but the cluster's state lists {:?}",
                state.nodes.iter().map(|n| &n.name).collect::<Vec<_>>()
            );
        }
        Ok(name)
    }

    /// What a migration may leave behind on the nodes, as "node: kind name" lines: replication
    /// slots, publications, replication origins and prepared transactions.
    pub fn migration_artifacts(&self) -> Vec<String> {
        let mut found = Vec::new();
        for n in self.node_names() {
            let mut db = self.connect(&n).unwrap();
            for (what, q) in [
                ("slot", "SELECT slot_name::text FROM pg_replication_slots"),
                ("publication", "SELECT pubname::text FROM pg_publication"),
                ("origin", "SELECT roname FROM pg_replication_origin"),
                ("prepared", "SELECT gid FROM pg_prepared_xacts"),
            ] {
                for r in db.query(q, &[]).unwrap() {
                    found.push(format!("{n}: {what} {}", r.get::<_, String>(0)));
                }
            }
        }
        found
    }
}

/// Crash helpers: kill -9 of one component and its start again the way an operator would, for
/// the fault matrix (`tests/tests/fault_matrix.rs`).
impl TestCluster {
    /// Kills node `name`'s PostgreSQL with SIGKILL, the postmaster and every process it started
    /// (a crash of the server, not a clean stop: nothing is flushed or cleaned up), and waits
    /// until all of them are gone, so that [`start_node`](Self::start_node) finds the shared
    /// memory free and runs crash recovery.
    pub fn kill_node(&self, name: &str) -> Result<()> {
        let state = self.state()?;
        let Some(pid) = state.node(name)?.postmaster_pid() else {
            bail!("node {name} is not running")
        };
        // Stopped first, so that it forks no child between the listing and the kill.
        // SAFETY: plain syscall on the postmaster recorded in the node's pid file.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let mut pids = children_of(pid);
        pids.push(pid);
        for p in &pids {
            // SAFETY: plain syscall on the postmaster and its children; a PID that is gone
            // already yields ESRCH.
            unsafe { libc::kill(*p as i32, libc::SIGKILL) };
        }
        wait_gone(&pids, &format!("node {name}"))?;
        // In a container whose PID 1 does not reap, the dead postmaster stays a zombie, which
        // its successor's liveness probe (kill 0) takes for a running server: the successor
        // refuses to start ("lock file ... already exists"). With every process of
        // the server gone, the lock files (data directory, Unix socket) are stale, as after a
        // reboot.
        let n = state.node(name)?;
        let _ = std::fs::remove_file(n.data_dir.join("postmaster.pid"));
        let _ = std::fs::remove_file(n.socket_dir.join(format!(".s.PGSQL.{}.lock", n.port)));
        Ok(())
    }

    /// Kills the replay worker with SIGKILL and waits until it is gone.
    pub fn kill_replay_worker(&self) -> Result<()> {
        let Some(pid) = self.state()?.replay_worker.live_pid() else {
            bail!("the replay worker is not running")
        };
        kill9(pid, "the replay worker")
    }

    /// Starts the replay worker again on its port (as `cluster up` does) and records its PID in
    /// the cluster's state, so that `cluster down` stops it.
    pub fn start_replay_worker_again(&self) -> Result<()> {
        let mut state = self.state()?;
        if let Some(pid) = state.replay_worker.live_pid() {
            bail!("the replay worker is running (pid {pid})");
        }
        let port = state.replay_worker.port;
        let pid = remusctl::process::spawn_daemon(
            Command::new(bin_dir().join("remus-replay-worker"))
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}")),
            &state.replay_worker.log,
        )?;
        state.replay_worker.pid = Some(pid);
        save_state(&state)?;
        wait_ready(pid, "the replay worker", || {
            remusctl::process::port_in_use(port)
        })
    }

    /// Kills etcd with SIGKILL and waits until it is gone.
    pub fn kill_etcd(&self) -> Result<()> {
        let Some(pid) = self.state()?.etcd.live_pid() else {
            bail!("etcd is not running")
        };
        kill9(pid, "etcd")
    }

    /// Starts etcd again on its data directory and ports (as `cluster up` does) and records its
    /// PID in the cluster's state; returns once it reports healthy.
    pub fn start_etcd_again(&self) -> Result<()> {
        let mut state = self.state()?;
        if let Some(pid) = state.etcd.live_pid() {
            bail!("etcd is running (pid {pid})");
        }
        let client = format!("http://127.0.0.1:{}", state.etcd.port);
        let peer = format!("http://127.0.0.1:{}", state.etcd_peer_port());
        let pid = remusctl::process::spawn_daemon(
            Command::new("etcd")
                .arg("--name")
                .arg("remus")
                .arg("--data-dir")
                .arg(state.dir.join("etcd"))
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer])
                .args(["--initial-advertise-peer-urls", &peer])
                .arg("--initial-cluster")
                .arg(format!("remus={peer}")),
            &state.etcd.log,
        )?;
        state.etcd.pid = Some(pid);
        save_state(&state)?;
        let port = state.etcd.port;
        wait_ready(pid, "etcd", || remusctl::process::etcd_healthy(port))
    }

    /// The entries of the migration machinery in node `name`'s shared memory
    /// (`remus.handover_state()`), as "kind migration_id detail" lines.
    pub fn handover_state(&self, name: &str) -> Vec<String> {
        let mut db = self.connect(name).unwrap();
        db.query(
            "SELECT kind, migration_id, detail FROM remus.handover_state()",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{}: {} {} {}",
                name,
                r.get::<_, String>(0),
                r.get::<_, i64>(1),
                r.get::<_, String>(2)
            )
        })
        .collect()
    }
}

/// How long a killed process may take to disappear, or a restarted one to be ready.
const KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

fn kill9(pid: u32, what: &str) -> Result<()> {
    // SAFETY: plain syscall on a PID the cluster recorded for one of its daemons.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_gone(&[pid], what)
}

fn wait_gone(pids: &[u32], what: &str) -> Result<()> {
    let started = std::time::Instant::now();
    while pids.iter().any(|p| remusctl::process::pid_alive(*p)) {
        if started.elapsed() > KILL_WAIT {
            bail!("{what} survived SIGKILL");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

fn wait_ready(pid: u32, what: &str, ready: impl Fn() -> bool) -> Result<()> {
    let started = std::time::Instant::now();
    while !ready() {
        if !remusctl::process::pid_alive(pid) {
            bail!("{what} (pid {pid}) exited during its start");
        }
        if started.elapsed() > KILL_WAIT {
            bail!("{what} (pid {pid}) not ready within {KILL_WAIT:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}

/// Live processes whose parent is `pid` (from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|stat| {
                    // Fields after the parenthesised command name: state, ppid, ...
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .filter(|p| remusctl::process::pid_alive(*p))
        .collect()
}

/// Writes `state` to the cluster's state file the way remusctl does (whole file, renamed into
/// place), after a test restarted one of its daemons.
fn save_state(state: &ClusterState) -> Result<()> {
    let path = state.dir.join("cluster.json");
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(state)?)?;
    std::fs::rename(&tmp, &path)?;
    Ok(())
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        let out = self.ctl(&["cluster", "down"]);
        if !out.status.success() {
            eprintln!("cluster down failed: {}", stderr(&out));
        }
    }
}
