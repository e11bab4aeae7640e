//! remus-bench: loads and runs YCSB, TPC-C and the Remus paper's hybrid workloads against a
//! pg_remus cluster, and writes per-window series (CSV), a summary (JSON and text), the
//! paper's Tables 2 and 3 for the migration windows, and a throughput plot (PNG).

mod keys;
mod plot;
mod run;
mod series;
mod tables;
mod tpcc;
mod ycsb;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde::Serialize;
use tokio::task::JoinHandle;

use keys::{KeyChooser, KeyDist};
use run::{Counters, RunCtx};
use series::{Event, Summary};
use tables::MigrationWindow;

#[derive(Parser)]
#[command(name = "remus-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    conn: ConnArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Creates, distributes and fills a workload's tables (dropping them first).
    Load {
        workload: Workload,
        #[command(flatten)]
        opts: LoadArgs,
    },
    /// Runs a workload for --seconds and writes its series, summary, tables and plot to --out.
    Run {
        workload: Workload,
        #[command(flatten)]
        opts: RunArgs,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Workload {
    /// YCSB: 50% reads, 50% updates, each in its own BEGIN … COMMIT.
    Ycsb,
    /// TPC-C's five transactions in the standard mix.
    Tpcc,
    /// YCSB plus batch COPY ingestion of new rows (loads as ycsb).
    HybridA,
    /// YCSB plus the duplicate-key analytical query in a loop (loads as ycsb).
    HybridB,
}

#[derive(clap::Args)]
struct ConnArgs {
    /// A libpq-style connection string of a node; repeat for several (clients go round-robin).
    #[arg(long = "conn", global = true)]
    conn: Vec<String>,
    /// A `remusctl cluster up` directory: every node of that cluster.
    #[arg(long, global = true)]
    cluster_dir: Option<PathBuf>,
    /// With --cluster-dir: only these nodes (n1, n2, …).
    #[arg(long = "node", global = true)]
    nodes: Vec<String>,
}

#[derive(clap::Args)]
struct LoadArgs {
    /// YCSB rows.
    #[arg(long, default_value_t = 100_000)]
    records: i64,
    /// TPC-C warehouses.
    #[arg(long, default_value_t = 4)]
    warehouses: i32,
    /// TPC-C customers (and initial orders) per district (the spec's 3000; small by default).
    #[arg(long, default_value_t = 30)]
    customers: i32,
    /// TPC-C items (the spec's 100000).
    #[arg(long, default_value_t = 1000)]
    items: i32,
    /// Shards of the YCSB table, or of warehouse and its co-located tables.
    #[arg(long, default_value_t = 8)]
    shards: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args)]
struct RunArgs {
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Clients of the main workload (YCSB or TPC-C); hybrids add one more client.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// YCSB key choice.
    #[arg(long, value_enum, default_value_t = KeyDist::Uniform)]
    dist: KeyDist,
    /// YCSB: percent of reads.
    #[arg(long, default_value_t = 50)]
    read_pct: u32,
    /// YCSB: keys 1..=records (default: the table's highest key at the start).
    #[arg(long)]
    records: Option<i64>,
    /// TPC-C: percent of NewOrders with a remote supply warehouse and of Payments for a remote
    /// customer.
    #[arg(long, default_value_t = 10)]
    remote_pct: u64,
    /// Hybrid A: rows per COPY batch.
    #[arg(long, default_value_t = 1000)]
    batch_rows: i64,
    /// Series window width.
    #[arg(long, default_value_t = 100)]
    window_ms: u64,
    /// A migration window `LABEL=START_MS-END_MS` (ms since the run started), for the tables
    /// and the plot; repeatable. Migrations in `remus_migrations` that overlap the run are
    /// added unless --no-cluster-windows.
    #[arg(long = "window", value_parser = tables::parse_window)]
    windows: Vec<MigrationWindow>,
    #[arg(long)]
    no_cluster_windows: bool,
    /// `SECONDS:SQL`: runs SQL (e.g. `SELECT * FROM remus_migrate_shards(…)`) through the first
    /// node that many seconds into the run; repeatable.
    #[arg(long = "at")]
    at: Vec<String>,
    /// Where the outputs go.
    #[arg(long, default_value = "remus-bench-out")]
    out: PathBuf,
    #[arg(long)]
    no_plot: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let targets = targets(&cli.conn)?;
    match cli.cmd {
        Cmd::Load { workload, opts } => rt.block_on(load(workload, &opts, &targets)),
        Cmd::Run { workload, opts } => {
            let ok = rt.block_on(run_workload(workload, &opts, &targets))?;
            rt.shutdown_timeout(Duration::from_secs(1));
            if !ok {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

/// The nodes' connection strings: --conn, else --cluster-dir's nodes, else libpq's PG*
/// variables (as `remusctl cluster env` exports them; PGPASSFILE is read).
fn targets(a: &ConnArgs) -> Result<Vec<String>> {
    if !a.conn.is_empty() {
        return Ok(a.conn.clone());
    }
    if let Some(dir) = &a.cluster_dir {
        let st = remusctl::cluster::ClusterState::load(dir)?;
        let pw = st.password()?;
        let nodes: Vec<String> = st
            .nodes
            .iter()
            .filter(|n| a.nodes.is_empty() || a.nodes.contains(&n.name))
            .map(|n| n.conninfo(&pw))
            .collect();
        if nodes.is_empty() {
            bail!("no node of {} matches {:?}", dir.display(), a.nodes);
        }
        return Ok(nodes);
    }
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let host = var("PGHOST").unwrap_or_else(|| "localhost".into());
    let port = var("PGPORT").unwrap_or_else(|| "5432".into());
    let user = var("PGUSER").unwrap_or_else(|| "postgres".into());
    let db = var("PGDATABASE").unwrap_or_else(|| user.clone());
    let password = var("PGPASSWORD").or_else(|| {
        let file = var("PGPASSFILE")?;
        pgpass_lookup(
            &std::fs::read_to_string(file).ok()?,
            &host,
            &port,
            &db,
            &user,
        )
    });
    let mut s = format!("host={host} port={port} user={user} dbname={db}");
    if let Some(p) = password {
        s.push_str(&format!(
            " password='{}'",
            p.replace('\\', "\\\\").replace('\'', "\\'")
        ));
    }
    Ok(vec![s])
}

/// The password of the first matching `host:port:db:user:password` line (`*` matches all).
fn pgpass_lookup(text: &str, host: &str, port: &str, db: &str, user: &str) -> Option<String> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let f: Vec<&str> = l.splitn(5, ':').collect();
        let m = |i: usize, v: &str| f.get(i).is_some_and(|x| *x == "*" || *x == v);
        (f.len() == 5 && m(0, host) && m(1, port) && m(2, db) && m(3, user))
            .then(|| f[4].to_string())
    })
}

async fn load(w: Workload, o: &LoadArgs, targets: &[String]) -> Result<()> {
    let t = std::time::Instant::now();
    match w {
        Workload::Ycsb | Workload::HybridA | Workload::HybridB => {
            let db = run::open(&targets[0]).await.context("connecting")?;
            ycsb::load(&db, o.records, o.shards, o.seed).await?;
            println!(
                "loaded usertable: {} rows of ~1 KB over {} shards in {:.1} s",
                o.records,
                o.shards,
                t.elapsed().as_secs_f64()
            );
        }
        Workload::Tpcc => {
            let s = tpcc::scale(o.warehouses, o.customers, o.items);
            tpcc::load(targets[0].clone(), s, o.shards, o.seed).await?;
            println!(
                "loaded TPC-C: {} warehouses, {} customers per district, {} items, {} shards in {:.1} s",
                s.warehouses,
                s.customers,
                s.items,
                o.shards,
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// What a run writes to summary.json.
#[derive(Serialize)]
struct Report {
    workload: Workload,
    seconds: f64,
    clients: usize,
    nodes: usize,
    key_distribution: Option<KeyDist>,
    summaries: Vec<Summary>,
    migrations: Vec<MigrationWindow>,
    table2: Vec<tables::IngestRow>,
    table3: Vec<tables::LatencyRow>,
    tpcc: Option<tpcc::TpccStats>,
    consistency_violations: Vec<String>,
    duplicate_answers_not_zero: Vec<String>,
    at_results: Vec<String>,
    error_samples: Vec<String>,
    problems: Vec<String>,
    ok: bool,
}

type Clients = Vec<JoinHandle<(Vec<Event>, Vec<String>)>>;

async fn run_workload(w: Workload, o: &RunArgs, targets: &[String]) -> Result<bool> {
    std::fs::create_dir_all(&o.out).with_context(|| format!("creating {}", o.out.display()))?;
    let first = run::open(&targets[0]).await.context("connecting")?;
    let target = |i: usize| targets[i % targets.len()].clone();
    let mut labels: Vec<&'static str> = Vec::new();
    let mut counters: Vec<Arc<Counters>> = Vec::new();
    let mut add = |name: &'static str| {
        labels.push(name);
        let c = Arc::new(Counters::default());
        counters.push(c.clone());
        c
    };

    // Everything read before the clock starts.
    let (mut ycsb_keys, mut ingest_from, mut scale) = (None, None, None);
    match w {
        Workload::Tpcc => scale = Some(tpcc::read_scale(&first).await?),
        _ => {
            let max = ycsb::max_key(&first).await?;
            let records = o.records.unwrap_or(max);
            if records < 1 {
                bail!("usertable is empty (remus-bench load ycsb)");
            }
            ycsb_keys = Some(Arc::new(KeyChooser::new(records as u64, o.dist)));
            ingest_from = Some(max + 1);
        }
    }

    let ctx = Arc::new(RunCtx::new(o.seconds));
    let mut groups: Vec<Clients> = Vec::new();
    let mut tpcc_clients = Vec::new();
    let mut analytic = None;
    if let Some(keys) = &ycsb_keys {
        let c = add("ycsb");
        groups.push(
            (0..o.clients)
                .map(|i| {
                    tokio::spawn(ycsb::client(
                        ctx.clone(),
                        target(i),
                        keys.clone(),
                        o.read_pct,
                        o.seed * 1000 + i as u64,
                        c.clone(),
                    ))
                })
                .collect(),
        );
    }
    if let Some(s) = scale {
        let c = add("tpcc");
        tpcc_clients = (0..o.clients)
            .map(|i| {
                tokio::spawn(tpcc::client(
                    ctx.clone(),
                    target(i),
                    s,
                    o.remote_pct,
                    o.seed * 1000 + i as u64,
                    c.clone(),
                ))
            })
            .collect();
    }
    if w == Workload::HybridA {
        let c = add("ingest");
        let from = ingest_from.expect("YCSB read the highest key");
        groups.push(vec![tokio::spawn(ycsb::ingest(
            ctx.clone(),
            target(o.clients),
            from,
            o.batch_rows,
            o.seed,
            c,
        ))]);
    }
    if w == Workload::HybridB {
        let c = add("analytic");
        analytic = Some(tokio::spawn(ycsb::analytic(
            ctx.clone(),
            target(o.clients),
            c,
        )));
    }
    let at = at_tasks(&ctx, &o.at, &targets[0])?;
    let progress = tokio::spawn(progress(ctx.clone(), labels.clone(), counters.clone()));

    // Collect, in the order of `labels`.
    let mut events: Vec<Vec<Event>> = Vec::new();
    let mut errors = Vec::new();
    let mut tpcc_stats = None;
    let mut wrong = Vec::new();
    for label in &labels {
        let mut evs = Vec::new();
        match *label {
            "tpcc" => {
                let mut st = tpcc::TpccStats::default();
                for h in tpcc_clients.drain(..) {
                    let (e, s) = h.await?;
                    evs.extend(e);
                    st.add(&s);
                }
                errors.extend(st.errors.iter().take(20).cloned());
                tpcc_stats = Some(st);
            }
            "analytic" => {
                let (e, errs, bad) = analytic.take().expect("spawned").await?;
                evs = e;
                errors.extend(errs);
                wrong = bad;
            }
            _ => {
                for h in groups.remove(0) {
                    let (e, errs) = h.await?;
                    evs.extend(e);
                    errors.extend(errs.into_iter().map(|m| format!("{label}: {m}")));
                }
            }
        }
        events.push(evs);
    }
    let _ = progress.await;
    let mut at_results = Vec::new();
    for h in at {
        at_results.push(h.await?);
    }

    let end_us = ctx.duration_us();
    let end_ms = end_us / 1000;
    let mut migrations = o.windows.clone();
    if !o.no_cluster_windows {
        migrations.extend(cluster_windows(&first, &ctx, end_ms).await?);
    }
    migrations.sort_by_key(|m| m.start_ms);

    let summaries: Vec<Summary> = labels
        .iter()
        .zip(&events)
        .map(|(l, e)| series::summarize(l, e, end_us))
        .collect();
    let mut csv = String::from(series::CSV_HEADER);
    let mut panels = Vec::new();
    for (l, e) in labels.iter().zip(&events) {
        let ws = series::windows(e, o.window_ms, end_ms);
        csv.push_str(&series::csv_rows(l, &ws, o.window_ms));
        let unit = if *l == "ingest" {
            "rows/s"
        } else {
            "commits/s"
        };
        panels.push((format!("{l} ({unit})"), unit, ws));
    }
    write(&o.out.join("series.csv"), &csv)?;

    let (table2, table3) = paper_tables(&labels, &events, &migrations);

    let mut consistency = Vec::new();
    if let Some(s) = scale {
        consistency = tpcc::violations(targets[0].clone(), s).await?;
    }

    let mut problems = Vec::new();
    if !consistency.is_empty() {
        problems.push(format!(
            "TPC-C consistency: {} violations",
            consistency.len()
        ));
    }
    if !wrong.is_empty() {
        problems.push(format!(
            "the duplicate-key query answered other than 0 {} times",
            wrong.len()
        ));
    }
    for s in &summaries {
        if s.commits == 0 {
            problems.push(format!("{}: nothing committed", s.workload));
        }
    }
    let plot_path = o.out.join("throughput.png");
    if !o.no_plot {
        if let Err(e) = plot::throughput(&plot_path, &panels, &migrations, o.window_ms, end_ms) {
            eprintln!("no plot: {e:#}");
        }
    }
    let report = Report {
        workload: w,
        seconds: o.seconds,
        clients: o.clients,
        nodes: targets.len(),
        key_distribution: ycsb_keys.as_ref().map(|_| o.dist),
        summaries,
        migrations,
        table2,
        table3,
        tpcc: tpcc_stats,
        consistency_violations: consistency,
        duplicate_answers_not_zero: wrong,
        at_results,
        error_samples: errors,
        ok: problems.is_empty(),
        problems,
    };
    write(
        &o.out.join("summary.json"),
        &serde_json::to_string_pretty(&report)?,
    )?;
    write(&o.out.join("tables.md"), &tables_md(&report))?;
    print_report(&report, &o.out);
    Ok(report.ok)
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Tables 2 and 3 of a run, one row per migration window each: Table 2 from the ingestion
/// client's events (hybrid A), Table 3 from the main workload's (YCSB, also in the hybrids, or
/// TPC-C). `events[i]` are the events of workload `labels[i]`.
fn paper_tables(
    labels: &[&str],
    events: &[Vec<Event>],
    migrations: &[MigrationWindow],
) -> (Vec<tables::IngestRow>, Vec<tables::LatencyRow>) {
    let idx = |l: &str| labels.iter().position(|x| *x == l);
    let table2 = idx("ingest")
        .map(|i| tables::table2(&events[i], migrations))
        .unwrap_or_default();
    let mut table3 = Vec::new();
    for l in ["ycsb", "tpcc"] {
        if let Some(i) = idx(l) {
            table3.extend(tables::table3(l, &events[i], migrations));
        }
    }
    (table2, table3)
}

/// Migrations in `remus_migrations` that overlap the run, as windows relative to its start
/// (one still running ends with the run).
async fn cluster_windows(
    db: &tokio_postgres::Client,
    ctx: &RunCtx,
    end_ms: u64,
) -> Result<Vec<MigrationWindow>> {
    let rows = db
        .query(
            "SELECT migration_id, mode, status, \
                    (extract(epoch FROM started_at) * 1000)::bigint, \
                    (extract(epoch FROM finished_at) * 1000)::bigint \
               FROM remus_migrations ORDER BY migration_id",
            &[],
        )
        .await
        .context("reading remus_migrations")?;
    let t0 = ctx.started_epoch_ms as i64;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let (id, mode, status): (i64, String, String) = (r.get(0), r.get(1), r.get(2));
            let start = r.get::<_, i64>(3) - t0;
            let end = r.get::<_, Option<i64>>(4).map_or(end_ms as i64, |e| e - t0);
            (end > 0 && start < end_ms as i64).then(|| MigrationWindow {
                label: format!("migration {id} ({mode}, {status})"),
                start_ms: start.max(0) as u64,
                end_ms: (end.min(end_ms as i64)).max(start.max(0)) as u64,
            })
        })
        .collect())
}

/// Tasks running each `SECONDS:SQL` of --at through `conninfo`: each returns what happened.
fn at_tasks(ctx: &Arc<RunCtx>, at: &[String], conninfo: &str) -> Result<Vec<JoinHandle<String>>> {
    let mut out = Vec::new();
    for a in at {
        let (secs, sql) = a
            .split_once(':')
            .with_context(|| format!("--at {a}: expected SECONDS:SQL"))?;
        let secs: f64 = secs.trim().parse().with_context(|| format!("--at {a}"))?;
        let (sql, conninfo, ctx) = (sql.to_string(), conninfo.to_string(), ctx.clone());
        out.push(tokio::spawn(async move {
            let when = ctx.started + Duration::from_secs_f64(secs);
            tokio::time::sleep_until(when.into()).await;
            let t = ctx.now_us();
            let r = async {
                let db = run::open(&conninfo).await?;
                db.simple_query(&sql).await
            }
            .await;
            let took = (ctx.now_us() - t) / 1000;
            match r {
                Ok(_) => format!("at {} ms: {sql}: ok after {took} ms", t / 1000),
                Err(e) => format!(
                    "at {} ms: {sql}: {} after {took} ms",
                    t / 1000,
                    run::describe(&e)
                ),
            }
        }));
    }
    Ok(out)
}

/// The live line: per workload, commits, the last second's rate and aborts. Redrawn in place
/// on a terminal, a plain line a second otherwise.
async fn progress(ctx: Arc<RunCtx>, labels: Vec<&'static str>, counters: Vec<Arc<Counters>>) {
    let tty = std::io::stdout().is_terminal();
    let bar = tty.then(|| {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(ctx.duration_us() / 1000),
            indicatif::ProgressDrawTarget::stdout(),
        );
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:20} {elapsed:>4}/{duration} {msg}")
                .expect("a valid template"),
        );
        b
    });
    let mut last = vec![0u64; counters.len()];
    let mut last_at = ctx.now_us();
    let tick = Duration::from_millis(if tty { 250 } else { 1000 });
    loop {
        tokio::time::sleep(
            tick.min(
                ctx.ends
                    .saturating_duration_since(std::time::Instant::now())
                    .max(Duration::from_millis(10)),
            ),
        )
        .await;
        let over = ctx.over();
        let now = ctx.now_us();
        let dt = (now - last_at).max(1) as f64 / 1e6;
        let mut parts = Vec::new();
        for (i, (l, c)) in labels.iter().zip(&counters).enumerate() {
            let commits = c.commits.load(Ordering::Relaxed);
            let aborts = c.aborts.load(Ordering::Relaxed);
            parts.push(format!(
                "{l} {commits} ({:.0}/s) aborts {aborts}",
                (commits - last[i]) as f64 / dt
            ));
            last[i] = commits;
        }
        last_at = now;
        let msg = parts.join(" | ");
        match &bar {
            Some(b) => {
                b.set_position((now / 1000).min(ctx.duration_us() / 1000));
                b.set_message(msg);
            }
            None => println!("{:6.1}s {msg}", now as f64 / 1e6),
        }
        if over {
            break;
        }
    }
    if let Some(b) = bar {
        b.finish();
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into())
}

/// Tables 2 and 3, the migrations and the summaries as Markdown.
fn tables_md(r: &Report) -> String {
    let mut s = String::from(
        "| workload | commits | rows | aborts (by class) | failed | mean ms | p99 ms | longest no-commit gap ms (at) |\n|---|---:|---:|---|---:|---:|---:|---|\n",
    );
    for x in &r.summaries {
        s.push_str(&format!(
            "| {} | {} | {} | {} {:?} | {} | {} | {} | {:.0} ({:.0}) |\n",
            x.workload,
            x.commits,
            x.units,
            x.aborts,
            x.aborts_by_class,
            x.failed,
            opt(x.mean_latency_ms),
            opt(x.p99_latency_ms),
            x.longest_no_commit_gap_ms,
            x.longest_no_commit_gap_at_ms
        ));
    }
    s.push_str("\nMigration windows (ms since the run started):\n\n| window | start | end | length ms |\n|---|---:|---:|---:|\n");
    for m in &r.migrations {
        s.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            m.label,
            m.start_ms,
            m.end_ms,
            m.end_ms - m.start_ms
        ));
    }
    if !r.table2.is_empty() {
        s.push_str("\nTable 2 (batch ingestion):\n\n| window | rows/s before | rows/s during | during / before |\n|---|---:|---:|---:|\n");
        for t in &r.table2 {
            s.push_str(&format!(
                "| {} | {:.0} | {:.0} | {} |\n",
                t.window,
                t.rows_per_s_before,
                t.rows_per_s_during,
                t.percent_of_before
                    .map(|p| format!("{p:.1}%"))
                    .unwrap_or_else(|| "-".into())
            ));
        }
    }
    if !r.table3.is_empty() {
        s.push_str("\nTable 3 (mean latency):\n\n| window | workload | before ms | during ms | increase ms |\n|---|---|---:|---:|---:|\n");
        for t in &r.table3 {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                t.window,
                t.workload,
                opt(t.mean_ms_before),
                opt(t.mean_ms_during),
                opt(t.increase_ms)
            ));
        }
    }
    s
}

fn print_report(r: &Report, out: &Path) {
    println!("\n{}", tables_md(r));
    if let Some(t) = &r.tpcc {
        let [no, pay, os, dlv, sl] = t.committed;
        println!(
            "TPC-C: NewOrder {no} ({} remote, {} rolled back by the 1% rule), Payment {pay} ({} remote), OrderStatus {os}, Delivery {dlv}, StockLevel {sl}",
            t.remote_new_orders, t.rolled_back, t.remote_payments
        );
        println!(
            "TPC-C consistency (conditions 1-4, cross-warehouse sums): {}",
            if r.consistency_violations.is_empty() {
                "holds".to_string()
            } else {
                r.consistency_violations.join("; ")
            }
        );
    }
    if r.workload == Workload::HybridB {
        println!(
            "duplicate-key query: {}",
            if r.duplicate_answers_not_zero.is_empty() {
                "0 every time".to_string()
            } else {
                r.duplicate_answers_not_zero.join("; ")
            }
        );
    }
    for a in &r.at_results {
        println!("--at {a}");
    }
    for e in r.error_samples.iter().take(10) {
        println!("error: {e}");
    }
    println!("outputs in {}", out.display());
    if r.ok {
        println!("RESULT: ok");
    } else {
        println!("RESULT: FAILED: {}", r.problems.join("; "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgpass_lines_match_with_wildcards() {
        let f = "# comment\nother:1:*:*:no\n127.0.0.1:26401:*:postgres:secret:with:colons\n";
        assert_eq!(
            pgpass_lookup(f, "127.0.0.1", "26401", "postgres", "postgres").as_deref(),
            Some("secret:with:colons")
        );
        assert_eq!(
            pgpass_lookup(f, "127.0.0.1", "1", "postgres", "postgres"),
            None
        );
    }

    /// Hybrid A's tables.md: the ingestion client gives Table 2, YCSB Table 3, each with one
    /// row per migration window, printed once (the ingestion client has no Table 3 rows).
    #[test]
    fn hybrid_a_tables_list_each_window_once() {
        use crate::series::tests::commit;
        let window = |label: &str, start_ms, end_ms| MigrationWindow {
            label: label.into(),
            start_ms,
            end_ms,
        };
        let migrations = [window("m1", 1000, 2000), window("m2", 3000, 4000)];
        let ycsb: Vec<Event> = (0..40).map(|i| commit(i * 100, 1 + i % 3)).collect();
        let ingest: Vec<Event> = (0..40)
            .map(|i| Event {
                units: 50,
                ..commit(i * 100 + 50, 5)
            })
            .collect();
        let labels = ["ycsb", "ingest"];
        let (table2, table3) = paper_tables(&labels, &[ycsb, ingest], &migrations);
        assert_eq!(
            table3
                .iter()
                .map(|r| (r.window.as_str(), r.workload.as_str()))
                .collect::<Vec<_>>(),
            [("m1", "ycsb"), ("m2", "ycsb")]
        );
        assert_eq!(
            table2.iter().map(|r| r.window.as_str()).collect::<Vec<_>>(),
            ["m1", "m2"]
        );
        let report = Report {
            workload: Workload::HybridA,
            seconds: 4.0,
            clients: 3,
            nodes: 3,
            key_distribution: Some(KeyDist::Uniform),
            summaries: Vec::new(),
            migrations: migrations.to_vec(),
            table2,
            table3,
            tpcc: None,
            consistency_violations: Vec::new(),
            duplicate_answers_not_zero: Vec::new(),
            at_results: Vec::new(),
            error_samples: Vec::new(),
            problems: Vec::new(),
            ok: true,
        };
        let md = tables_md(&report);
        let count = |prefix: &str| md.lines().filter(|l| l.starts_with(prefix)).count();
        assert_eq!(count("Table 2"), 1, "{md}");
        assert_eq!(count("Table 3"), 1, "{md}");
        for m in ["m1", "m2"] {
            // The window's line, its Table 2 line and its Table 3 line.
            assert_eq!(count(&format!("| {m} |")), 3, "{md}");
            assert_eq!(count(&format!("| {m} | ycsb |")), 1, "{md}");
        }
        assert!(!md.contains("| ingest |"), "{md}");
    }

    #[test]
    fn the_cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let c = Cli::try_parse_from([
            "remus-bench",
            "run",
            "hybrid-a",
            "--seconds",
            "2",
            "--window",
            "m=100-200",
            "--at",
            "1:SELECT 1",
            "--conn",
            "host=x",
        ])
        .unwrap();
        assert_eq!(c.conn.conn, ["host=x"]);
        let Cmd::Run { workload, opts } = c.cmd else {
            panic!("run")
        };
        assert_eq!(workload, Workload::HybridA);
        assert_eq!(opts.windows[0].end_ms, 200);
    }
}
