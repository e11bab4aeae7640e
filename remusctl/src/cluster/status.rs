//! `remusctl cluster status` and `env`: what runs, where, whether it answers.

use std::path::PathBuf;

use anyhow::Result;

use super::state::endpoint;
use super::ClusterState;
use crate::process;

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
    // Only the leader answers; a live standby is up too (it waits, by design, without a port).
    let with_standby = state.standby_coordinator.is_some();
    for (i, d) in state.coordinators().enumerate() {
        let pid = d.live_pid();
        let leading = pid.is_some() && coordinator::client::health(&endpoint(d.port)).await.is_ok();
        // Named by place (P+102, P+104): which one leads changes with every takeover.
        let name = if i == 0 {
            "coordinator"
        } else {
            "coordinator 2"
        };
        out.push(ComponentStatus {
            component: match (with_standby, leading, pid.is_some()) {
                (false, _, _) => name.to_string(),
                (true, true, _) => format!("{name} (leader)"),
                (true, false, true) => format!("{name} (standby)"),
                (true, false, false) => name.to_string(),
            },
            address: format!("127.0.0.1:{}", d.port),
            up: leading || (with_standby && pid.is_some()),
            pid,
            log: d.log.clone(),
        });
    }
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
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+=:".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_lines_quote_odd_paths() {
        assert_eq!(shell_quote("/tmp/a b"), "'/tmp/a b'");
        assert_eq!(shell_quote("/tmp/ab"), "/tmp/ab");
    }
}
