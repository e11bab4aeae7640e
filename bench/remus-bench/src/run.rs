//! A run's clock and shared counters, and connecting (again) to a node.

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};

use crate::series::{class_of, Event, Outcome};

/// When the run started and when it ends.
pub struct RunCtx {
    pub started: Instant,
    pub ends: Instant,
    /// Milliseconds since the epoch at `started` (to place the coordinator's migration times).
    pub started_epoch_ms: u64,
}

impl RunCtx {
    pub fn new(seconds: f64) -> Self {
        let started = Instant::now();
        RunCtx {
            started,
            ends: started + Duration::from_secs_f64(seconds),
            started_epoch_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock after 1970")
                .as_millis() as u64,
        }
    }

    pub fn over(&self) -> bool {
        Instant::now() >= self.ends
    }

    pub fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    pub fn duration_us(&self) -> u64 {
        (self.ends - self.started).as_micros() as u64
    }
}

/// Live counts of one workload, for the progress line.
#[derive(Default)]
pub struct Counters {
    pub commits: AtomicU64,
    pub aborts: AtomicU64,
}

/// Connects to `conninfo`, trying again every 100 ms until the run ends (a node that restarts);
/// each failed try is an event of class `08` (or the server's). `None` once the run is over.
pub async fn connect(ctx: &RunCtx, conninfo: &str, events: &mut Vec<Event>) -> Option<Client> {
    while !ctx.over() {
        let t = Instant::now();
        match open(conninfo).await {
            Ok(c) => return Some(c),
            Err(e) => {
                let class = match class_of(&e) {
                    [b'-', b'-'] => *b"08",
                    c => c,
                };
                events.push(Event {
                    at_us: ctx.now_us(),
                    latency_us: t.elapsed().as_micros() as u64,
                    outcome: Outcome::Retried(class),
                    units: 0,
                });
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    None
}

/// A connection whose driver runs on its own task.
pub async fn open(conninfo: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(conninfo, NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// `SQLSTATE message` of a server error, else the error.
pub fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} {}", db.code().code(), db.message()),
        None => e.to_string(),
    }
}
