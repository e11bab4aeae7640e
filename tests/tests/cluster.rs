//! Foundation: `remusctl cluster up|status|env|down` against real PostgreSQL 15 servers, etcd and
//! the coordinator.

use std::net::TcpListener;

use remus_test_support::cluster::{remusctl, stderr, stdout, TestCluster};
use remus_test_support::ports::PortBlock;
use remusctl::process::pid_alive;

#[test]
fn three_node_cluster_lifecycle() {
    let c = TestCluster::start(3).expect("cluster up");
    let state = c.state().unwrap();
    let password = c.password().unwrap();
    assert!(password.len() >= 20, "generated password is too short");

    // Every node answers over TCP with the generated password, knows itself by name, and knows
    // every node of the cluster with the right address.
    for name in c.node_names() {
        let mut db = c.connect(&name).unwrap();
        let me: String = db
            .query_one("SELECT remus_local_node()", &[])
            .unwrap()
            .get(0);
        assert_eq!(me, name);
        let rows = db
            .query("SELECT name, host, port FROM remus_nodes", &[])
            .unwrap();
        let seen: Vec<(String, String, i32)> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let expected: Vec<(String, String, i32)> = state
            .nodes
            .iter()
            .map(|n| (n.name.clone(), "127.0.0.1".to_string(), i32::from(n.port)))
            .collect();
        assert_eq!(seen, expected, "remus_nodes on {name}");
        // Remus needs these on every node (DESIGN.md section 7).
        for (guc, want) in [
            ("wal_level", "logical"),
            ("track_commit_timestamp", "on"),
            ("shared_preload_libraries", "pg_remus"),
        ] {
            let v: String = db.query_one(&format!("SHOW {guc}"), &[]).unwrap().get(0);
            assert_eq!(v, want, "{guc} on {name}");
        }
        let mpx: String = db
            .query_one("SHOW max_prepared_transactions", &[])
            .unwrap()
            .get(0);
        assert!(mpx.parse::<i32>().unwrap() > 0);
    }

    // Nothing is trust over TCP: a wrong password is refused.
    let n1 = state.node("n1").unwrap();
    let bad = postgres::Client::connect(&n1.conninfo("not-the-password"), postgres::NoTls);
    let err = bad.err().expect("wrong password must be refused");
    let code = err.code().expect("refusal comes from the server").code();
    assert_eq!(code, "28P01", "expected invalid_password, got {err:?}");

    // The password file is private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&state.pgpass)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);

    // The coordinator registered every node in etcd.
    let nodes = c.ctl(&["nodes"]);
    assert!(nodes.status.success(), "{}", stderr(&nodes));
    for n in &state.nodes {
        assert!(
            stdout(&nodes)
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>()
                    == [n.name.as_str(), "127.0.0.1", &n.port.to_string()]),
            "{} missing from `remusctl nodes`:\n{}",
            n.name,
            stdout(&nodes)
        );
    }
    let etcd = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args([
            "--endpoints",
            &format!("127.0.0.1:{}", state.etcd.port),
            "get",
            "--prefix",
            "/remus/local/nodes/",
            "--keys-only",
        ])
        .output()
        .unwrap();
    let keys = stdout(&etcd);
    for n in &state.nodes {
        assert!(
            keys.contains(&format!("/remus/local/nodes/{}", n.name)),
            "etcd keys: {keys}"
        );
    }

    // status: everything up.
    let st = c.ctl(&["cluster", "status"]);
    assert!(
        st.status.success(),
        "status: {}{}",
        stdout(&st),
        stderr(&st)
    );
    assert_eq!(
        stdout(&st).lines().filter(|l| l.contains(" up ")).count(),
        6,
        "{}",
        stdout(&st)
    );
    assert!(
        stdout(&st)
            .lines()
            .any(|l| l.starts_with("replay worker") && l.contains(" up ")),
        "{}",
        stdout(&st)
    );

    // env prints libpq settings for the node asked for, and they work with psql.
    let env = c.ctl(&["cluster", "env", "--node", "n2"]);
    let env_text = stdout(&env);
    assert!(env_text.contains(&format!("export PGPORT={}", state.node("n2").unwrap().port)));
    assert!(env_text.contains("export PGUSER=postgres"));
    assert!(env_text.contains("export PGDATABASE=postgres"));
    let psql = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "{env_text}\npsql -XAtc 'SELECT remus_local_node()'"
        ))
        .output()
        .unwrap();
    assert_eq!(
        stdout(&psql).trim(),
        "n2",
        "psql via env: {}",
        stderr(&psql)
    );

    // A second `up` on a running cluster refuses and exits non-zero.
    let again = c.ctl(&["cluster", "up", "--base-port", &c.base_port.to_string()]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("already running"),
        "{}",
        stderr(&again)
    );

    // down stops every process it started, by PID, and frees every port.
    let mut pids: Vec<u32> = state
        .nodes
        .iter()
        .filter_map(|n| n.postmaster_pid())
        .collect();
    pids.extend(state.etcd.pid);
    pids.extend(state.coordinator.pid);
    pids.extend(state.replay_worker.pid);
    assert_eq!(pids.len(), 6);
    let down = c.ctl(&["cluster", "down"]);
    assert!(down.status.success(), "{}", stderr(&down));
    for pid in pids {
        assert!(!pid_alive(pid), "pid {pid} survived cluster down");
    }
    let children = std::process::Command::new("pgrep")
        .args(["-f", &c.dir_str()])
        .output()
        .unwrap();
    assert!(
        stdout(&children).trim().is_empty(),
        "processes left behind: {}",
        stdout(&children)
    );
    let p = c.base_port;
    for port in [p, p + 1, p + 2, p + 100, p + 101, p + 102, p + 103] {
        assert!(
            TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} still bound"
        );
    }
    let st = c.ctl(&["cluster", "status"]);
    assert_eq!(
        st.status.code(),
        Some(3),
        "status after down: {}",
        stdout(&st)
    );
}

#[test]
fn restart_keeps_catalog_and_password() {
    let c = TestCluster::start(2).expect("cluster up");
    let pw = c.password().unwrap();
    let down = c.ctl(&["cluster", "down"]);
    assert!(down.status.success(), "{}", stderr(&down));
    let up = c.ctl(&[
        "cluster",
        "up",
        "--nodes",
        "2",
        "--base-port",
        &c.base_port.to_string(),
    ]);
    assert!(up.status.success(), "{}{}", stdout(&up), stderr(&up));
    assert_eq!(c.password().unwrap(), pw);
    let mut db = c.connect("n2").unwrap();
    let n: i64 = db
        .query_one("SELECT count(*) FROM remus_nodes", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

#[test]
fn up_names_the_component_whose_port_is_taken() {
    let dir = tempfile::Builder::new()
        .prefix("remus-it-")
        .tempdir_in("/tmp")
        .unwrap();
    let ports = PortBlock::reserve();
    let _squatter = TcpListener::bind(("127.0.0.1", ports.port(1))).unwrap();
    let base = ports.base().to_string();
    let out = remusctl(&[
        "cluster",
        "up",
        "--nodes",
        "3",
        "--base-port",
        &base,
        "--dir",
        &dir.path().to_string_lossy(),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains(&format!("port {}", ports.port(1))) && err.contains("n2"),
        "{err}"
    );
    // Nothing was started.
    assert!(TcpListener::bind(("127.0.0.1", ports.base())).is_ok());
}

#[test]
fn commands_on_a_missing_cluster_explain_themselves() {
    let dir = tempfile::Builder::new()
        .prefix("remus-it-")
        .tempdir_in("/tmp")
        .unwrap();
    for cmd in [
        ["cluster", "status"],
        ["cluster", "down"],
        ["cluster", "env"],
    ] {
        let mut args = cmd.to_vec();
        let d = dir.path().to_string_lossy().into_owned();
        args.extend(["--dir", &d]);
        let out = remusctl(&args);
        assert!(!out.status.success());
        assert!(stderr(&out).contains("no cluster in"), "{}", stderr(&out));
    }
}
