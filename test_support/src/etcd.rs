//! A throwaway etcd: started on two ports of a reserved [`PortBlock`] (client `base`, peer
//! `base+1`) with a temporary data directory, killed when dropped.

use std::fs::File;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use remusctl::process::etcd_healthy;
use tempfile::TempDir;

use crate::ports::PortBlock;

pub struct Etcd {
    child: Child,
    endpoint: String,
    // Dropped after the process is killed (field order), so etcd never sees its directory vanish.
    _dir: TempDir,
    _ports: PortBlock,
}

impl Etcd {
    /// Starts etcd and waits until it reports itself healthy (20 s at the most per try).
    pub fn start() -> Etcd {
        let mut last_log = String::new();
        // A port found free can be taken by someone else before etcd binds it: try a few times.
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("temp dir");
            let ports = PortBlock::reserve();
            let (client_port, peer_port) = (ports.port(0), ports.port(1));
            let client = format!("http://127.0.0.1:{client_port}");
            let peer = format!("http://127.0.0.1:{peer_port}");
            let log_path = dir.path().join("etcd.log");
            let log = File::create(&log_path).expect("etcd log");
            let child = Command::new("etcd")
                .arg("--name")
                .arg("default")
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .arg("--listen-client-urls")
                .arg(&client)
                .arg("--advertise-client-urls")
                .arg(&client)
                .arg("--listen-peer-urls")
                .arg(&peer)
                .arg("--initial-advertise-peer-urls")
                .arg(&peer)
                .arg("--initial-cluster")
                .arg(format!("default={peer}"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log handle"))
                .stderr(log)
                .spawn()
                .expect("etcd is installed and on PATH");
            let mut etcd = Etcd {
                child,
                endpoint: client,
                _dir: dir,
                _ports: ports,
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if etcd_healthy(client_port) {
                    return etcd;
                }
                let exited = matches!(etcd.child.try_wait(), Ok(Some(_)));
                if exited || Instant::now() > deadline {
                    last_log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    break; // `etcd` drops here: killed, directory removed.
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        panic!("etcd did not become healthy; last log:\n{last_log}");
    }

    /// `http://127.0.0.1:<client port>`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
