//! The coordinator's gRPC surface. Thin: every call maps onto a typed store in etcd.

use remus_proto::v1::coordinator_server::Coordinator;
use remus_proto::v1::{
    HealthRequest, HealthResponse, ListMigrationsRequest, ListMigrationsResponse, ListNodesRequest,
    ListNodesResponse, MigrateShardsRequest, Migration, MigrationEvent, Node, RegisterNodeRequest,
    RegisterNodeResponse,
};
use tonic::{Request, Response, Status};

use std::sync::Arc;

use tokio_stream::StreamExt;

use crate::driver::{self, DriverConfig};
use crate::migration::{MigrationError, MigrationRecord, MigrationStore};
use crate::node_registry::{NodeRecord, NodeRegistry, RegistryError};
use crate::plan::{self, Refusal};
use crate::resume::Resuming;

pub struct CoordinatorService {
    pub cluster: String,
    pub etcd_endpoint: String,
    pub etcd: etcd_client::Client,
    pub nodes: NodeRegistry,
    pub migrations: MigrationStore,
    pub driver: Arc<DriverConfig>,
    /// Migrations run on their own runtime ("migration-driver"), apart from the gRPC server's.
    pub runtime: MigrationRuntime,
    /// On while the migrations of a previous coordinator are resumed: new ones are refused.
    pub resuming: Resuming,
}

/// The named runtime the migration drivers run on.
#[derive(Clone)]
pub struct MigrationRuntime(pub tokio::runtime::Handle);

impl MigrationRuntime {
    /// Spawns `spawner` (which itself spawns the driver task) on the migration runtime and
    /// hands back what it returns.
    fn block_on_spawn<T: Send + 'static>(
        &self,
        spawner: impl FnOnce() -> T + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.0.spawn(async move { spawner() })
    }
}

fn async_stream_until_terminal(
    events: tokio_stream::wrappers::WatchStream<MigrationRecord>,
) -> impl tokio_stream::Stream<Item = Result<MigrationEvent, Status>> + Send {
    let mut done = false;
    events
        .take_while(move |r| {
            let emit = !done;
            done = r.is_terminal();
            emit
        })
        .map(|r| {
            Ok(MigrationEvent {
                migration: Some(Migration::from(r)),
            })
        })
}

impl From<RegistryError> for Status {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Invalid(m) => Status::invalid_argument(m),
            RegistryError::Conflict { .. } => Status::failed_precondition(e.to_string()),
            RegistryError::Etcd(_) => Status::unavailable(e.to_string()),
            RegistryError::Corrupt { .. } => Status::internal(e.to_string()),
        }
    }
}

impl From<MigrationError> for Status {
    fn from(e: MigrationError) -> Self {
        match e {
            MigrationError::Invalid(_) => Status::invalid_argument(e.to_string()),
            MigrationError::NotFound(_) => Status::not_found(e.to_string()),
            MigrationError::ShardBusy { .. } | MigrationError::IllegalTransition { .. } => {
                Status::failed_precondition(e.to_string())
            }
            MigrationError::Contention { .. } => Status::aborted(e.to_string()),
            MigrationError::Etcd(_) => Status::unavailable(e.to_string()),
            MigrationError::Corrupt { .. }
            | MigrationError::CorruptValue { .. }
            | MigrationError::Encode { .. } => Status::internal(e.to_string()),
        }
    }
}

impl From<MigrationRecord> for Migration {
    fn from(r: MigrationRecord) -> Self {
        Migration {
            id: r.id.0,
            shard_ids: r.shard_ids,
            source: r.source,
            target: r.target,
            mode: r.mode.as_str().to_string(),
            phase: r.phase.as_str().to_string(),
            status: r.status.as_str().to_string(),
            rows_copied: r.rows_copied,
            bytes_copied: r.bytes_copied,
            txns_replayed: r.txns_replayed,
            aborted_by_migration: r.aborted_by_migration,
            phase_ms: r.phase_ms.into_iter().collect(),
            started_at_ms: r.started_at_ms,
            finished_at_ms: r.finished_at_ms,
            error: r.error,
            waiting_on: r.waiting_on,
            phase_started_at_ms: r.phase_started_at_ms,
            copy_total_bytes: r.rates.copy_total_bytes,
            copy_bytes_per_sec: r.rates.copy_bytes_per_sec,
            source_wal_bytes_per_sec: r.rates.source_wal_bytes_per_sec,
            replay_bytes_per_sec: r.rates.replay_bytes_per_sec,
            replay_txns_per_sec: r.rates.replay_txns_per_sec,
            lag_bytes: r.rates.lag_bytes,
            lag_ms: r.rates.lag_ms,
            unavailable_ms: r.unavailable_ms,
        }
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        let etcd_ok = self.etcd.maintenance_client().status().await.is_ok();
        Ok(Response::new(HealthResponse {
            etcd_ok,
            etcd_endpoint: self.etcd_endpoint.clone(),
            cluster: self.cluster.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }

    async fn register_node(
        &self,
        req: Request<RegisterNodeRequest>,
    ) -> Result<Response<RegisterNodeResponse>, Status> {
        let node = req
            .into_inner()
            .node
            .ok_or_else(|| Status::invalid_argument("node is required"))?;
        let port = u16::try_from(node.port)
            .map_err(|_| Status::invalid_argument("port must be between 1 and 65535"))?;
        let record = NodeRecord {
            name: node.name,
            host: node.host,
            port,
        };
        let created = self.nodes.register(&record).await?;
        tracing::info!(node = %record.name, host = %record.host, port, created, "node registered");
        Ok(Response::new(RegisterNodeResponse { created }))
    }

    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let nodes = self
            .nodes
            .list()
            .await?
            .into_iter()
            .map(|n| Node {
                name: n.name,
                host: n.host,
                port: u32::from(n.port),
            })
            .collect();
        Ok(Response::new(ListNodesResponse { nodes }))
    }

    async fn list_migrations(
        &self,
        _: Request<ListMigrationsRequest>,
    ) -> Result<Response<ListMigrationsResponse>, Status> {
        let migrations = self
            .migrations
            .list()
            .await?
            .into_iter()
            .map(Migration::from)
            .collect();
        Ok(Response::new(ListMigrationsResponse { migrations }))
    }

    type MigrateShardsStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<MigrationEvent, Status>> + Send>>;

    async fn migrate_shards(
        &self,
        req: Request<MigrateShardsRequest>,
    ) -> Result<Response<Self::MigrateShardsStream>, Status> {
        let req = req.into_inner();
        let mode = plan::parse_mode(&req.mode).map_err(Refusal::into_status)?;
        if self.resuming.is_on() {
            return Err(Refusal::resuming().into_status());
        }
        let mut plan = plan::plan(
            &self.nodes,
            &self.driver.connector,
            &req.shard_ids,
            &req.target,
            mode,
        )
        .await
        .map_err(Refusal::into_status)?;
        plan.requested_by = plan::parse_requested_by(&req.requested_by);
        let record = self
            .migrations
            .create(&plan.shard_ids, &plan.source.name, &plan.target.name, mode)
            .await
            .map_err(|e| match e {
                MigrationError::ShardBusy { .. } => Refusal::shard_busy(e).into_status(),
                other => Status::from(other),
            })?;
        tracing::info!(
            migration_id = record.id.0, shards = ?plan.shard_ids, source = %plan.source.name,
            target = %plan.target.name, %mode, "migration created"
        );
        let (config, store) = (self.driver.clone(), self.migrations.clone());
        let rx = self
            .runtime
            .block_on_spawn(move || driver::spawn(config, store, plan, record));
        let events = tokio_stream::wrappers::WatchStream::new(
            rx.await.map_err(|e| Status::internal(e.to_string()))?,
        );
        // Every change until (and including) the terminal one.
        let stream = async_stream_until_terminal(events);
        Ok(Response::new(Box::pin(stream)))
    }
}
