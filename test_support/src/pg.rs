//! Throwaway PostgreSQL 15 servers for tests: initdb into a temporary directory (as the
//! `postgres` OS user when running as root, since initdb and pg_ctl refuse root), trust
//! authentication, listening on 127.0.0.1 only, stopped with `pg_ctl stop -m immediate` on drop.
//! The port comes from a [`PortBlock`] that the server holds until it is stopped.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ports::PortBlock;

pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

pub fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().expect("run id -u");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// A command run as the `postgres` OS user (initdb and pg_ctl refuse to run as root).
pub fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

pub fn run(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub struct PgServer {
    pub dir: tempfile::TempDir,
    pub port: u16,
    // Released after the server is stopped (`Drop` runs before the fields are dropped).
    _ports: PortBlock,
}

impl PgServer {
    /// initdb and start a server on the first port of a reserved [`PortBlock`], with
    /// `wal_level=logical` plus `settings` (`-c name=value ...`); its directory under /tmp
    /// starts with `prefix`.
    pub fn start_with(settings: &str, prefix: &str) -> PgServer {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/tmp")
            .expect("temporary directory");
        if is_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres:postgres").arg(dir.path());
            run(chown, "chown");
        }
        let data = dir.path().join("data");
        let mut initdb = as_postgres(&Path::new(PG_BIN).join("initdb"));
        initdb.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run(initdb, "initdb");
        let mut last_err = String::new();
        for _ in 0..5 {
            let ports = PortBlock::reserve();
            let port = ports.base();
            let opts = format!(
                "-p {port} -c wal_level=logical -c listen_addresses=127.0.0.1 \
                 -c unix_socket_directories={} -c fsync=off -c max_wal_senders=8 \
                 -c shared_buffers=16MB {settings}",
                dir.path().display()
            );
            let out = as_postgres(&Path::new(PG_BIN).join("pg_ctl"))
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(dir.path().join("server.log"))
                .args(["-o", &opts, "-w", "-t", "60", "start"])
                .output()
                .expect("pg_ctl start");
            if out.status.success() {
                return PgServer {
                    dir,
                    port,
                    _ports: ports,
                };
            }
            last_err = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
        panic!("could not start PostgreSQL: {last_err}\n{log}");
    }

    pub fn conninfo_db(&self, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={db}",
            self.port
        )
    }

    pub fn conninfo(&self) -> String {
        self.conninfo_db("postgres")
    }

    pub fn psql_cmd(&self, db: &str) -> Command {
        let mut c = Command::new(Path::new(PG_BIN).join("psql"));
        c.args([
            "-X",
            "-A",
            "-t",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
        ])
        .arg("-p")
        .arg(self.port.to_string())
        .arg("-d")
        .arg(db);
        c
    }

    /// Runs an SQL script (statements autocommit unless it says BEGIN) and returns the output.
    pub fn psql_db(&self, db: &str, sql: &str) -> String {
        let mut child = self
            .psql_cmd(db)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn psql");
        child
            .stdin
            .take()
            .expect("psql stdin")
            .write_all(sql.as_bytes())
            .expect("write to psql");
        let out = child.wait_with_output().expect("psql");
        assert!(
            out.status.success(),
            "psql failed on {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn psql(&self, sql: &str) -> String {
        self.psql_db("postgres", sql)
    }

    pub fn slot_names(&self) -> String {
        self.psql("SELECT string_agg(slot_name, ',' ORDER BY slot_name) FROM pg_replication_slots")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = as_postgres(&Path::new(PG_BIN).join("pg_ctl"))
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
