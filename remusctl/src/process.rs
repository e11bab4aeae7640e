//! Daemons owned by the local cluster: spawned detached, tracked by PID, stopped by PID.
//!
//! PostgreSQL refuses to run as root, so everything touching a data directory goes through
//! `runuser -u postgres`. Liveness is judged from /proc, not `kill(pid, 0)` alone: in a container
//! whose PID 1 does not reap, an exited daemon lingers as a zombie and must count as gone.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub const POSTGRES_USER: &str = "postgres";

/// True while `pid` names a live (non-zombie) process.
pub fn pid_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state field follows the parenthesised command name, which may contain spaces.
        Ok(stat) => match stat.rfind(')') {
            Some(i) => !matches!(stat[i + 1..].trim_start().chars().next(), Some('Z' | 'X')),
            None => false,
        },
        Err(_) => false,
    }
}

/// Starts `cmd` in its own process group with stdout and stderr appended to `log`, and returns
/// its PID without waiting: the daemon outlives the `remusctl` that started it.
pub fn spawn_daemon(cmd: &mut Command, log: &Path) -> Result<u32> {
    let out = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening log file {}", log.display()))?;
    let err = out.try_clone()?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    Ok(child.id())
}

/// SIGTERM, then SIGKILL after `grace`; returns once the process is gone.
pub fn stop_pid(pid: u32, grace: Duration) -> Result<()> {
    if !pid_alive(pid) {
        return Ok(());
    }
    // SAFETY: plain syscall on a PID we started and recorded; a stale PID yields ESRCH.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !pid_alive(pid) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if !pid_alive(pid) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("process {pid} did not exit after SIGKILL")
}

/// A port is free when we can bind it on loopback right now.
pub fn port_in_use(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_err()
}

pub fn tcp_reachable(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(300),
    )
    .is_ok()
}

/// etcd's `/health` endpoint, spoken as plain HTTP/1.0 so the CLI needs no HTTP client.
pub fn etcd_healthy(port: u16) -> bool {
    let probe = || -> std::io::Result<bool> {
        let mut s = TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_millis(500),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body.contains("\"health\":\"true\""))
    };
    probe().unwrap_or(false)
}

/// Runs a command as the `postgres` OS user and fails with its stderr when it fails.
pub fn run_as_postgres(program: &Path, args: &[&str], envs: &[(&str, &str)]) -> Result<Output> {
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", POSTGRES_USER, "--", "env"]);
    for (k, v) in envs {
        cmd.arg(format!("{k}={v}"));
    }
    cmd.arg(program).args(args);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} as {POSTGRES_USER}", program.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed ({}): {}{}",
            program.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(out)
}

/// uid and gid of the `postgres` OS user.
pub fn postgres_ids() -> Result<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").context("reading /etc/passwd")?;
    for line in passwd.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() > 3 && f[0] == POSTGRES_USER {
            return Ok((f[2].parse()?, f[3].parse()?));
        }
    }
    bail!("OS user {POSTGRES_USER} does not exist (install the postgresql-15 package)")
}

pub fn chown_postgres(path: &Path) -> Result<()> {
    let (uid, gid) = postgres_ids()?;
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .with_context(|| format!("chown postgres {}", path.display()))
}

pub fn write_private_file(path: &Path, contents: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(contents.as_bytes())?;
    // `mode` applies only on creation; an existing file keeps wider bits otherwise.
    fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(())
}

/// A password from the kernel's CSPRNG, alphanumeric so it needs no quoting anywhere.
pub fn generate_password(len: usize) -> Result<String> {
    const ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789";
    let mut raw = vec![0u8; len * 2];
    File::open("/dev/urandom")?.read_exact(&mut raw)?;
    // Rejection sampling keeps the distribution uniform over the alphabet.
    let limit = 256 - (256 % ALPHABET.len());
    let mut out = String::with_capacity(len);
    for b in raw {
        if (b as usize) < limit {
            out.push(ALPHABET[b as usize % ALPHABET.len()] as char);
            if out.len() == len {
                return Ok(out);
            }
        }
    }
    generate_password(len)
}

/// The last lines of a log, for error messages that point at the cause.
pub fn log_tail(path: &Path, lines: usize) -> String {
    match fs::read_to_string(path) {
        Ok(s) => {
            let v: Vec<&str> = s.lines().collect();
            v[v.len().saturating_sub(lines)..].join("\n")
        }
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_pid_is_alive_and_bogus_is_not() {
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(u32::MAX - 1));
    }

    #[test]
    fn passwords_are_alphanumeric_and_distinct() {
        let a = generate_password(24).unwrap();
        let b = generate_password(24).unwrap();
        assert_eq!(a.len(), 24);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, b);
    }

    #[test]
    fn port_probe_sees_a_bound_listener() {
        let l = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(port_in_use(port));
        assert!(tcp_reachable(port));
        drop(l);
        // The kernel may take a moment to release a port that just had a connection.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while port_in_use(port) {
            assert!(
                std::time::Instant::now() < deadline,
                "port {port} still in use after the listener closed"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn spawned_daemon_is_tracked_and_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sleep.log");
        let pid = spawn_daemon(Command::new("sleep").arg("30"), &log).unwrap();
        assert!(pid_alive(pid));
        stop_pid(pid, Duration::from_secs(5)).unwrap();
        assert!(!pid_alive(pid));
    }

    #[test]
    fn private_file_is_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        write_private_file(&p, "x").unwrap();
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}
