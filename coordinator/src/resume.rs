//! Resuming the migrations a coordinator was running when it stopped (crash or restart).
//!
//! A migration's driver lives in the coordinator's process and its record in etcd outlives it.
//! Left alone, a migration cut off in dual execution would keep its source in sync mode with no
//! stream behind it: every commit that wrote the shards would fail validation (40001) until an
//! operator stepped in. So a starting coordinator resumes every record still `running`, by the
//! Tm decision (paper section 3.7): past it (phase `cleanup`) the migration completes from what
//! the target holds, before it the migration rolls back and the source keeps the shards
//! (`driver::resume`).
//!
//! Resumed migrations run side by side, each in its own task (one held in its drain does not
//! hold up another's rollback), and new ones are refused (SQLSTATE 57P03) until all of them
//! have ended: the read-through switch is a counter per node shared by every
//! migration, and whether the previous run ended its share is unknown, so the last step here
//! ends read-through on every node, which is only right once no Tm can be in flight.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::driver::{self, DriverConfig};
use crate::migration::{MigrationRecord, MigrationStore, Status};
use crate::node_registry::NodeRegistry;
use crate::plan;

/// How long a resumed migration waits for its nodes' catalog before it is given up as failed.
const PLAN_WAIT: Duration = Duration::from_secs(300);

/// Set while a starting coordinator resumes migrations; new migrations are refused meanwhile.
#[derive(Clone, Default)]
pub struct Resuming(Arc<AtomicBool>);

impl Resuming {
    /// On from the start, so that no migration slips in before [`resume_all`] has begun.
    pub fn starting() -> Self {
        Resuming(Arc::new(AtomicBool::new(true)))
    }

    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self, on: bool) {
        self.0.store(on, Ordering::Release)
    }
}

/// Resumes every running migration in the store, then turns `resuming` off.
/// Returns how many were resumed.
pub async fn resume_all(
    config: Arc<DriverConfig>,
    store: MigrationStore,
    registry: NodeRegistry,
    resuming: Resuming,
) -> usize {
    let resumed = resume_each(&config, &store, &registry).await;
    if resumed > 0 {
        end_read_through_everywhere(&config, &registry).await;
    }
    resuming.set(false);
    resumed
}

async fn resume_each(
    config: &Arc<DriverConfig>,
    store: &MigrationStore,
    registry: &NodeRegistry,
) -> usize {
    let running = match store.running().await {
        Ok(r) => r,
        Err(e) => {
            warn!(phase = "resume", error = %e, "cannot list the running migrations; none resumed");
            return 0;
        }
    };
    // Each in its own task (review finding F18): one held in its drain must not keep another's
    // source in sync mode with no stream behind it, failing every write to its shards.
    let mut tasks = tokio::task::JoinSet::new();
    for record in running {
        let (config, store, registry) = (config.clone(), store.clone(), registry.clone());
        tasks.spawn(async move { resume_one(config, store, registry, record).await });
    }
    let mut resumed = 0;
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(true) => resumed += 1,
            Ok(false) => {}
            Err(e) => warn!(phase = "resume", error = %e, "a resumed migration's task failed"),
        }
    }
    resumed
}

/// Plans and resumes one migration; false if it could not be planned (recorded failed).
async fn resume_one(
    config: Arc<DriverConfig>,
    store: MigrationStore,
    registry: NodeRegistry,
    record: MigrationRecord,
) -> bool {
    let id = record.id.0;
    info!(migration_id = id, phase = %record.phase, "resuming a migration the previous coordinator was running");
    let started = Instant::now();
    let plan = loop {
        match plan::plan_for_resume(&registry, &config.connector, &record).await {
            Ok(p) => break p,
            Err(e) if started.elapsed() < PLAN_WAIT => {
                warn!(migration_id = id, phase = %record.phase, error = %e, "cannot plan the resumed migration yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => {
                let msg =
                    format!("the coordinator restarted and could not resume the migration: {e}");
                warn!(migration_id = id, phase = %record.phase, error = %msg, "resumed migration failed");
                if let Err(e) = store.finish(record.id, Status::Failed, Some(msg)).await {
                    warn!(migration_id = id, phase = %record.phase, error = %e, "could not record the end");
                }
                return false;
            }
        }
    };
    driver::resume(config, store, plan, record).await;
    true
}

/// Ends read-through on every node that answers (one that restarted has it off already).
async fn end_read_through_everywhere(config: &DriverConfig, registry: &NodeRegistry) {
    let nodes = match registry.list().await {
        Ok(n) => n,
        Err(e) => {
            warn!(phase = "resume", error = %e, "cannot list the nodes; read-through left as it is");
            return;
        }
    };
    for node in nodes {
        let ended = async {
            let c = config
                .connector
                .connect(&node)
                .await
                .map_err(|e| e.to_string())?;
            c.batch_execute("DO $$ BEGIN WHILE remus.end_read_through() > 0 LOOP END LOOP; END $$")
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        if let Err(e) = ended {
            warn!(phase = "resume", node = %node.name, error = %e, "read-through not ended on this node");
        }
    }
}
