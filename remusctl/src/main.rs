//! remusctl: operate a pg_remus cluster.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use remusctl::cluster::{self, ClusterState, UpOptions};

#[derive(Parser)]
#[command(version, about = "Operate a pg_remus cluster")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// A local cluster of real PostgreSQL 15 nodes, etcd and the coordinator on loopback.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Nodes registered with the coordinator (in etcd).
    Nodes {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Move shards (and every shard co-located with them) to another node; prints a line per
    /// phase and a summary. Exit status 0 when the migration succeeded, 1 otherwise.
    Migrate {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
        /// Shard id; repeat to move several at once.
        #[arg(long = "shard", required = true)]
        shards: Vec<i64>,
        /// Target node name.
        #[arg(long)]
        to: String,
        /// remus | lock_abort | wait_remaster | squall | albatross
        #[arg(long, default_value = "remus")]
        mode: String,
    },
    /// Shard migrations known to the coordinator (in etcd), running and finished, by id.
    Migrations {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Initialise (first time) and start every component, then wire the nodes together.
    Up {
        #[arg(long, default_value_t = cluster::DEFAULT_NODES)]
        nodes: usize,
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
        #[arg(long, default_value_t = cluster::DEFAULT_BASE_PORT)]
        base_port: u16,
        /// Also start a standby coordinator (P+104) that takes over when the first one dies.
        #[arg(long)]
        standby_coordinator: bool,
    },
    /// Add a node to the running cluster: nK (K = nodes + 1) on port P+K-1, started as `up`
    /// starts a node, then joined from n1 (`remus_add_node`, `remus_activate_node`: every
    /// node's membership, the tables' shells, the catalog, the reference tables' rows) and
    /// registered with the coordinator. It owns no shard; move shards to it with `migrate`.
    /// Prints the new node's name. A failure undoes what it did.
    AddNode {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Start the coordinator again after it stopped or crashed (the rest of the cluster keeps
    /// running); it resumes the migrations it was running: those past the Tm decision
    /// complete, the others roll back.
    StartCoordinator {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Stop everything `up` started, by PID.
    Down {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Each component up or down. Exit status 0 when all are up, 3 otherwise.
    Status {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Shell `export` lines for libpq (PGHOST, PGPORT, PGUSER, PGPASSFILE, PGDATABASE).
    Env {
        #[arg(long, default_value = cluster::DEFAULT_DIR)]
        dir: PathBuf,
        #[arg(long, default_value = "n1")]
        node: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .thread_name("remusctl")
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("remusctl: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("remusctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Cluster { cmd } => cluster(cmd).await,
        Cmd::Nodes { dir } => {
            let state = ClusterState::load(&dir)?;
            let mut c = coordinator::client::connect(&state.coordinator_endpoint()).await?;
            let nodes = c
                .list_nodes(remus_proto::v1::ListNodesRequest {})
                .await?
                .into_inner()
                .nodes;
            println!("{:<8} {:<15} {:>5}", "name", "host", "port");
            for n in nodes {
                println!("{:<8} {:<15} {:>5}", n.name, n.host, n.port);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Migrate {
            dir,
            shards,
            to,
            mode,
        } => {
            let state = ClusterState::load(&dir)?;
            let mut c = coordinator::client::connect(&state.coordinator_endpoint()).await?;
            let mut events = match c
                .migrate_shards(remus_proto::v1::MigrateShardsRequest {
                    shard_ids: shards,
                    target: to,
                    mode,
                    requested_by: String::new(),
                })
                .await
            {
                Ok(r) => r.into_inner(),
                Err(status) => {
                    let sqlstate = status
                        .metadata()
                        .get(remus_proto::names::SQLSTATE_METADATA_KEY)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-")
                        .to_string();
                    eprintln!(
                        "remusctl: migration refused: {} (SQLSTATE {sqlstate})",
                        status.message()
                    );
                    return Ok(ExitCode::FAILURE);
                }
            };
            let mut last: Option<remus_proto::v1::Migration> = None;
            let mut last_phase = String::new();
            let mut live = LiveLine::new(std::io::stdout().is_terminal());
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tokio::select! {
                    ev = events.message() => {
                        let Some(ev) = ev? else { break };
                        let Some(m) = ev.migration else { continue };
                        if m.phase != last_phase {
                            live.clear();
                            println!("{}", progress_line(&m));
                            last_phase = m.phase.clone();
                        }
                        last = Some(m);
                    }
                    _ = tick.tick() => {}
                }
                if let Some(m) = last.as_ref().filter(|m| m.status == "running") {
                    live.show(&live_line(m, coordinator::migration::now_ms()));
                }
            }
            live.clear();
            let Some(m) = last else {
                anyhow::bail!("the coordinator sent no migration record")
            };
            println!("{}", summary_line(&m));
            Ok(if m.status == "succeeded" {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::Migrations { dir } => {
            let state = ClusterState::load(&dir)?;
            let mut c = coordinator::client::connect(&state.coordinator_endpoint()).await?;
            let migrations = c
                .list_migrations(remus_proto::v1::ListMigrationsRequest {})
                .await?
                .into_inner()
                .migrations;
            let now = coordinator::migration::now_ms();
            println!("{}", migration_header());
            for m in &migrations {
                println!("{}", migration_line(m, now));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// One line per phase entered by `remusctl migrate`.
fn progress_line(m: &remus_proto::v1::Migration) -> String {
    // In pipeline order (the map itself has none).
    let previous = coordinator::migration::Phase::ALL
        .iter()
        .filter_map(|p| m.phase_ms.get(p.as_str()).map(|ms| format!("{p} {ms} ms")))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "migration {} [{}] shards {:?} {}→{}: phase {} ({}){}",
        m.id,
        m.mode,
        m.shard_ids,
        m.source,
        m.target,
        m.phase,
        m.status,
        if previous.is_empty() {
            String::new()
        } else {
            format!("; done: {previous}")
        }
    )
}

/// The live progress line of `remusctl migrate`: redrawn in place on a terminal; otherwise
/// printed as a line of its own when a phase starts and then at most every [`LiveLine::EVERY`].
struct LiveLine {
    tty: bool,
    shown: bool,
    printed: Option<std::time::Instant>,
}

impl LiveLine {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(3);

    fn new(tty: bool) -> Self {
        Self {
            tty,
            shown: false,
            printed: None,
        }
    }

    fn show(&mut self, line: &str) {
        if self.tty {
            print!("\r\x1b[K{line}");
            let _ = std::io::stdout().flush();
            self.shown = true;
        } else if self.printed.is_none_or(|t| t.elapsed() >= Self::EVERY) {
            println!("{line}");
            self.printed = Some(std::time::Instant::now());
        }
    }

    /// Removes the redrawn line before a line of its own is printed; the next line is shown
    /// at once (a phase's first progress line is printed however short the phase).
    fn clear(&mut self) {
        self.printed = None;
        if self.shown {
            print!("\r\x1b[K");
            let _ = std::io::stdout().flush();
            self.shown = false;
        }
    }
}

/// Bytes for people: B, KiB, MiB, GiB with one decimal.
fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// What a running migration's current phase has done so far (decision 0022): copy: bytes copied
/// of the tables' size, rows, rate; catch-up: lag in bytes and seconds, the source's and the
/// replay's rates; every phase: its elapsed time and what it waits on.
fn live_line(m: &remus_proto::v1::Migration, now_ms: u64) -> String {
    let elapsed = now_ms.saturating_sub(m.phase_started_at_ms) as f64 / 1000.0;
    let opt = |v: Option<u64>, f: &dyn Fn(u64) -> String| v.map_or("-".to_string(), f);
    let rate = |v: u64| format!("{}/s", human_bytes(v));
    let mut line = format!("progress: {} {elapsed:.1} s", m.phase);
    match m.phase.as_str() {
        "copy" => {
            let of = match m.copy_total_bytes {
                Some(t) if t > 0 => format!(
                    " of {} ({:.0}%)",
                    human_bytes(t),
                    m.bytes_copied as f64 * 100.0 / t as f64
                ),
                _ => String::new(),
            };
            line.push_str(&format!(
                ": copied {}{of}, {} rows, {}",
                human_bytes(m.bytes_copied),
                m.rows_copied,
                opt(m.copy_bytes_per_sec, &rate)
            ));
        }
        "catchup" => line.push_str(&format!(
            ": lag {} ({} s); source {}, replay {} ({} txn/s); {} txns replayed",
            opt(m.lag_bytes, &human_bytes),
            opt(m.lag_ms, &|ms| format!("{:.1}", ms as f64 / 1000.0)),
            opt(m.source_wal_bytes_per_sec, &rate),
            opt(m.replay_bytes_per_sec, &rate),
            opt(m.replay_txns_per_sec, &|t| t.to_string()),
            m.txns_replayed
        )),
        _ => {}
    }
    if let Some(w) = &m.waiting_on {
        line.push_str(&format!(" (waiting: {w})"));
    }
    line
}

/// The final line of `remusctl migrate`: what the SQL function returns, as text.
fn summary_line(m: &remus_proto::v1::Migration) -> String {
    let ms = |p: &str| m.phase_ms.get(p).copied().unwrap_or(0);
    let total = m
        .finished_at_ms
        .unwrap_or(m.started_at_ms)
        .saturating_sub(m.started_at_ms);
    let mut line = format!(
        "migration {} {}: copy {} ms, catchup {} ms, handover {} ms, cleanup {} ms, total {} ms; rows_copied {}, bytes_copied {}, txns_replayed {}, aborted_by_migration {}",
        m.id,
        m.status,
        ms("copy"),
        ms("catchup"),
        ms("handover") + ms("barrier") + ms("dual"),
        ms("cleanup"),
        total,
        m.rows_copied,
        m.bytes_copied,
        m.txns_replayed,
        m.aborted_by_migration
    );
    // Modes that suspend the shards' new transactions (albatross, decision 0024).
    if let Some(u) = m.unavailable_ms {
        line.push_str(&format!(", unavailable {u} ms"));
    }
    if let Some(e) = &m.error {
        line.push_str(&format!("; error: {e}"));
    }
    line
}

fn migration_header() -> String {
    format!(
        "{:>5} {:<16} {:<16} {:<13} {:<9} {:<11} {:>10}  {}",
        "id", "shards", "source→target", "mode", "phase", "status", "total_ms", "error"
    )
}

/// One row of `remusctl migrations`. `total_ms` of a running migration is its age so far. The
/// last column is the error; a running migration that is blocked shows what it waits on there.
fn migration_line(m: &remus_proto::v1::Migration, now_ms: u64) -> String {
    let shards = m
        .shard_ids
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let total = m
        .finished_at_ms
        .unwrap_or(now_ms)
        .saturating_sub(m.started_at_ms);
    let note = match (&m.error, &m.waiting_on) {
        (Some(e), _) => e.clone(),
        (None, Some(w)) if m.status == "running" => format!("(waiting: {w})"),
        _ => "-".to_string(),
    };
    format!(
        "{:>5} {:<16} {:<16} {:<13} {:<9} {:<11} {:>10}  {}",
        m.id,
        shards,
        format!("{}→{}", m.source, m.target),
        m.mode,
        m.phase,
        m.status,
        total,
        note
    )
}

async fn cluster(cmd: ClusterCmd) -> Result<ExitCode> {
    match cmd {
        ClusterCmd::Up {
            nodes,
            dir,
            base_port,
            standby_coordinator,
        } => {
            let state = cluster::up(&UpOptions {
                dir,
                nodes,
                base_port,
                standby_coordinator,
            })
            .await?;
            println!("pg_remus cluster up in {}", state.dir.display());
            for n in &state.nodes {
                println!(
                    "  {:<4} postgres     {}:{}   log {}",
                    n.name,
                    n.host,
                    n.port,
                    n.log.display()
                );
            }
            println!(
                "  etcd              127.0.0.1:{}   log {}",
                state.etcd.port,
                state.etcd.log.display()
            );
            println!(
                "  coordinator       127.0.0.1:{}   log {}",
                state.coordinator.port,
                state.coordinator.log.display()
            );
            println!("connect with:");
            println!(
                "  eval \"$(remusctl cluster env --dir {})\" && psql",
                state.dir.display()
            );
            println!("stop with:");
            println!("  remusctl cluster down --dir {}", state.dir.display());
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::AddNode { dir } => {
            let node = cluster::add_node(&dir).await?;
            // stdout holds the name alone, for scripts; the rest is for the reader.
            println!("{}", node.name);
            eprintln!(
                "{} added: postgres {}:{}, log {}; it owns no shard: move shards to it with `remusctl migrate --shard ID --to {0}`",
                node.name,
                node.host,
                node.port,
                node.log.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::StartCoordinator { dir } => {
            let state = cluster::start_coordinator_again(&dir).await?;
            println!(
                "coordinator started again: 127.0.0.1:{} (pid {}), log {}",
                state.coordinator.port,
                state.coordinator.pid.unwrap_or_default(),
                state.coordinator.log.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::Down { dir } => {
            let mut state = ClusterState::load(&dir)?;
            let report = cluster::stop_all(&mut state)?;
            if report.is_empty() {
                println!("nothing was running in {}", state.dir.display());
            }
            for line in report {
                println!("{line}");
            }
            Ok(ExitCode::SUCCESS)
        }
        ClusterCmd::Status { dir } => {
            let state = ClusterState::load(&dir)?;
            let rows = cluster::status(&state).await;
            let all_up = rows.iter().all(|r| r.up);
            for r in rows {
                let pid = r.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                println!(
                    "{:<14} {:<16} {:<5} pid {:<8} log {}",
                    r.component,
                    r.address,
                    if r.up { "up" } else { "down" },
                    pid,
                    r.log.display()
                );
            }
            Ok(if all_up {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(3)
            })
        }
        ClusterCmd::Env { dir, node } => {
            let state = ClusterState::load(&dir)?;
            print!("{}", cluster::env_lines(&state, &node)?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use remus_proto::v1::Migration;

    fn sample() -> Migration {
        Migration {
            id: 12,
            shard_ids: vec![3, 4],
            source: "n1".into(),
            target: "n2".into(),
            mode: "remus".into(),
            phase: "dual".into(),
            status: "running".into(),
            started_at_ms: 1_000,
            ..Default::default()
        }
    }

    #[test]
    fn running_line_shows_age_and_wait() {
        let mut m = sample();
        m.waiting_on = Some("slot creation waits for xid 1234".into());
        let line = migration_line(&m, 3_500);
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            &cols[..7],
            ["12", "3,4", "n1→n2", "remus", "dual", "running", "2500"]
        );
        assert!(
            line.ends_with("(waiting: slot creation waits for xid 1234)"),
            "{line}"
        );
    }

    #[test]
    fn finished_line_shows_duration_and_error() {
        let mut m = sample();
        m.status = "failed".into();
        m.finished_at_ms = Some(1_750);
        m.error = Some("target n2 unreachable".into());
        m.waiting_on = Some("ignored once failed".into());
        let line = migration_line(&m, 99_999);
        assert!(line.contains(" 750  target n2 unreachable"), "{line}");
        m.error = None;
        assert!(migration_line(&m, 99_999).ends_with(" 750  -"));
    }

    #[test]
    fn live_line_per_phase() {
        let mut m = sample();
        m.phase = "copy".into();
        m.phase_started_at_ms = 1_000;
        m.bytes_copied = 512 * 1024;
        m.rows_copied = 7;
        m.copy_total_bytes = Some(2048 * 1024);
        m.copy_bytes_per_sec = Some(1024);
        assert_eq!(
            live_line(&m, 3_500),
            "progress: copy 2.5 s: copied 512.0 KiB of 2.0 MiB (25%), 7 rows, 1.0 KiB/s"
        );
        m.phase = "catchup".into();
        m.lag_bytes = Some(300);
        m.lag_ms = Some(1_500);
        m.source_wal_bytes_per_sec = Some(2048);
        m.replay_txns_per_sec = Some(40);
        m.txns_replayed = 9;
        assert_eq!(
            live_line(&m, 2_000),
            "progress: catchup 1.0 s: lag 300 B (1.5 s); source 2.0 KiB/s, replay - (40 txn/s); 9 txns replayed"
        );
        m.phase = "handover".into();
        m.waiting_on = Some("writers".into());
        assert_eq!(
            live_line(&m, 2_000),
            "progress: handover 1.0 s (waiting: writers)"
        );
    }

    #[test]
    fn summary_shows_the_unavailability_window_where_measured() {
        let mut m = sample();
        m.status = "succeeded".into();
        m.aborted_by_migration = 0;
        assert!(summary_line(&m).ends_with("aborted_by_migration 0"));
        m.mode = "albatross".into();
        m.unavailable_ms = Some(284);
        assert!(
            summary_line(&m).ends_with("aborted_by_migration 0, unavailable 284 ms"),
            "{}",
            summary_line(&m)
        );
    }

    #[test]
    fn header_and_rows_align() {
        let header = migration_header();
        let line = migration_line(&sample(), 2_000);
        assert_eq!(header.find("shards"), line.find("3,4"));
        // Widths count characters, so the arrow does not shift the columns after it.
        assert_eq!(header.find("mode"), line.find("remus"));
        assert_eq!(
            header.find("total_ms").map(|p| p + "total_ms".len()),
            line.find("1000").map(|p| p + 4)
        );
    }
}
