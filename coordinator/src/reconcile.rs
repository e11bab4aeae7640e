//! Clearing what a node still enforces for a migration that has ended.
//!
//! Every node keeps what it enforces for a running migration (registration, capture, sync mode,
//! fences, the drain source) in shared memory and in a durable copy that a restart restores
//! (design note 0001). The migration's own end (`migration_end` on every node, in cleanup or
//! rollback) clears both, but it waits for a node that is down only for a bounded time
//! (`driver::NODE_WAIT`). A node that came back later still holds the state of a migration
//! that is over: it refuses DDL on the shard, and a restored capture or sync mode fails the
//! shard's writes with 40001 with no replay worker behind them.
//!
//! So the leader sweeps the nodes every [`SWEEP_INTERVAL`]: a migration a node still holds
//! state for whose record says `succeeded` or `rolled_back` gets its `remus.migration_end`
//! there (idempotent, the very call the migration's end makes). Running migrations are not
//! touched, and neither are `failed` ones: those may hold state on purpose (a shadow of unknown
//! fate, review F16) and are for an operator. Nothing runs while the leader resumes its
//! predecessor's migrations.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::driver::DriverConfig;
use crate::migration::{MigrationId, MigrationStore, Status};
use crate::node_registry::{NodeRecord, NodeRegistry};
use crate::resume::Resuming;

/// How often the leader sweeps the nodes.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// Sweeps the nodes every `every`, for as long as this coordinator runs.
pub async fn run(
    config: Arc<DriverConfig>,
    store: MigrationStore,
    registry: NodeRegistry,
    resuming: Resuming,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if resuming.is_on() {
            continue;
        }
        sweep(&config, &store, &registry).await;
    }
}

/// One pass over every node; returns how many (node, migration) pairs it cleared.
pub async fn sweep(
    config: &DriverConfig,
    store: &MigrationStore,
    registry: &NodeRegistry,
) -> usize {
    let nodes = match registry.list().await {
        Ok(n) => n,
        Err(e) => {
            warn!(phase = "reconcile", error = %e, "cannot list the nodes");
            return 0;
        }
    };
    let mut cleared = 0;
    for node in nodes {
        cleared += sweep_node(config, store, &node).await;
    }
    cleared
}

async fn sweep_node(config: &DriverConfig, store: &MigrationStore, node: &NodeRecord) -> usize {
    // A node that does not answer is swept on a later pass.
    let Ok(db) = config.connector.connect(node).await else {
        return 0;
    };
    let held: BTreeSet<i64> = match db
        .query(
            "SELECT DISTINCT migration_id FROM remus.handover_state() WHERE migration_id > 0",
            &[],
        )
        .await
    {
        Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
        Err(e) => {
            warn!(phase = "reconcile", node = %node.name, error = %e, "cannot read the node's migration state");
            return 0;
        }
    };
    let mut cleared = 0;
    for id in held {
        let Ok(record_id) = u64::try_from(id).map(MigrationId) else {
            continue;
        };
        let status = match store.get(record_id).await {
            Ok(record) => record.status,
            // Unknown here (another cluster's, or made by hand): not ours to clear.
            Err(_) => continue,
        };
        if !matches!(status, Status::Succeeded | Status::RolledBack) {
            continue;
        }
        match db.query_one("SELECT remus.migration_end($1)", &[&id]).await {
            Ok(_) => {
                cleared += 1;
                info!(migration_id = id, phase = "reconcile", node = %node.name, status = status.as_str(),
                      "cleared the state a node still held for a migration that has ended");
            }
            Err(e) => {
                warn!(migration_id = id, phase = "reconcile", node = %node.name, error = %e,
                      "could not clear the state of a migration that has ended")
            }
        }
    }
    cleared
}
