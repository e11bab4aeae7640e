//! The SQL face of shard migration: `remus_migrate_shard(s)` and the `remus_migrations` view ask
//! the coordinator (gRPC, `remus.coordinator_address`), which drives migrations and keeps their
//! state in etcd. Nothing of a migration runs inside the calling backend, so cancelling the call
//! stops the waiting, not the migration.
//!
//! The gRPC client runs on the backend's runtime (`cluster::rpc`), which serves interrupts
//! (cancel, statement_timeout, terminate) within 100 ms.

use pgrx::prelude::*;
use remus_proto::sqlstate::SqlState;
use remus_proto::v1::{ListMigrationsRequest, MigrateShardsRequest, Migration};

use crate::cluster::rpc::{block_on, connect_coordinator};
use crate::error::{RemusError, COORDINATOR_NODE};

fn address() -> Result<String, RemusError> {
    crate::guc::coordinator_address().ok_or(RemusError::CoordinatorUnset)
}

fn status_error(status: tonic::Status) -> RemusError {
    let sqlstate = status
        .metadata()
        .get(remus_proto::names::SQLSTATE_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .unwrap_or_else(|| SqlState::for_grpc_code(status.code()).code().to_string());
    RemusError::Remote {
        node: COORDINATOR_NODE.into(),
        sqlstate,
        message: status.message().to_string(),
        detail: None,
        hint: None,
    }
}

fn migrate(
    shard_ids: Vec<i64>,
    target: &str,
    mode: &str,
    what: &std::ffi::CStr,
) -> Result<Migration, RemusError> {
    // Who may ask is the functions' EXECUTE grant (superusers and `remus_admin`,
    // `api::privileges`): the coordinator moves the shard with the cluster's own credentials,
    // so nothing here needs a privilege of the caller's, and runs as the caller.
    let address = address()?;
    // The migration runs its own cross-node transactions; waiting for it inside a transaction
    // block would hold this transaction's snapshot and locks across the whole move.
    // SAFETY: raises 25001 inside a transaction block, as VACUUM does.
    unsafe { pg_sys::PreventInTransactionBlock(true, what.as_ptr()) };
    // SAFETY: process global.
    let pid = unsafe { pg_sys::MyProcPid };
    let requested_by = format!("{}:{pid}", crate::guc::node_name().unwrap_or_default());
    let request = MigrateShardsRequest {
        shard_ids,
        target: target.to_string(),
        mode: mode.to_string(),
        requested_by,
    };
    let last = block_on(async {
        let mut client = connect_coordinator(&address).await?;
        let mut events = client
            .migrate_shards(request)
            .await
            .map_err(status_error)?
            .into_inner();
        let mut last = None;
        loop {
            match events.message().await {
                Ok(Some(ev)) => last = ev.migration.or(last),
                Ok(None) => break,
                Err(s) => return Err(status_error(s)),
            }
        }
        Ok::<_, RemusError>(last)
    })??;
    let m = last.ok_or(RemusError::CoordinatorEndedCall)?;
    match m.status.as_str() {
        "succeeded" => Ok(m),
        _ => Err(RemusError::MigrationFailed {
            migration_id: m.id as i64,
            status: m.status.clone(),
            error: m
                .error
                .clone()
                .unwrap_or_else(|| "no reason recorded".into()),
        }),
    }
}

type MigrationRow = (
    name!(migration_id, i64),
    name!(shard_ids, Vec<i64>),
    name!(source, String),
    name!(target, String),
    name!(mode, String),
    name!(status, String),
    name!(copy_ms, i64),
    name!(catchup_ms, i64),
    name!(handover_ms, i64),
    name!(cleanup_ms, i64),
    name!(total_ms, i64),
    name!(rows_copied, i64),
    name!(bytes_copied, i64),
    name!(txns_replayed, i64),
    name!(aborted_by_migration, i64),
);

fn summary(m: Migration) -> MigrationRow {
    let ms = |p: &str| m.phase_ms.get(p).copied().unwrap_or(0) as i64;
    let total = m
        .finished_at_ms
        .unwrap_or(m.started_at_ms)
        .saturating_sub(m.started_at_ms) as i64;
    (
        m.id as i64,
        m.shard_ids.clone(),
        m.source.clone(),
        m.target.clone(),
        m.mode.clone(),
        m.status.clone(),
        ms("copy"),
        ms("catchup"),
        ms("handover") + ms("barrier") + ms("dual"),
        ms("cleanup"),
        total,
        m.rows_copied as i64,
        m.bytes_copied as i64,
        m.txns_replayed as i64,
        m.aborted_by_migration as i64,
    )
}

/// Moves `shard_id` and every shard co-located with it to `target_node`; returns when the
/// migration has ended, with its figures. A migration that did not succeed raises its error.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)] // pgrx reads the column names from the signature
fn remus_migrate_shard(
    shard_id: i64,
    target_node: &str,
    mode: default!(&str, "'remus'"),
) -> TableIterator<
    'static,
    (
        name!(migration_id, i64),
        name!(shard_ids, Vec<i64>),
        name!(source, String),
        name!(target, String),
        name!(mode, String),
        name!(status, String),
        name!(copy_ms, i64),
        name!(catchup_ms, i64),
        name!(handover_ms, i64),
        name!(cleanup_ms, i64),
        name!(total_ms, i64),
        name!(rows_copied, i64),
        name!(bytes_copied, i64),
        name!(txns_replayed, i64),
        name!(aborted_by_migration, i64),
    ),
> {
    let m = migrate(vec![shard_id], target_node, mode, c"remus_migrate_shard()")
        .unwrap_or_else(|e| e.raise());
    TableIterator::once(summary(m))
}

/// Moves several shards (of one node) at once; see `remus_migrate_shard`.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)] // pgrx reads the column names from the signature
fn remus_migrate_shards(
    shard_ids: Vec<i64>,
    target_node: &str,
    mode: default!(&str, "'remus'"),
) -> TableIterator<
    'static,
    (
        name!(migration_id, i64),
        name!(shard_ids, Vec<i64>),
        name!(source, String),
        name!(target, String),
        name!(mode, String),
        name!(status, String),
        name!(copy_ms, i64),
        name!(catchup_ms, i64),
        name!(handover_ms, i64),
        name!(cleanup_ms, i64),
        name!(total_ms, i64),
        name!(rows_copied, i64),
        name!(bytes_copied, i64),
        name!(txns_replayed, i64),
        name!(aborted_by_migration, i64),
    ),
> {
    let m = migrate(shard_ids, target_node, mode, c"remus_migrate_shards()")
        .unwrap_or_else(|e| e.raise());
    TableIterator::once(summary(m))
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::api::migrate::*;

    /// Every migration the coordinator knows, for the `remus_migrations` view.
    #[pg_extern(volatile, parallel_unsafe)]
    #[allow(clippy::type_complexity)]
    fn list_migrations() -> TableIterator<
        'static,
        (
            name!(migration_id, i64),
            name!(shard_ids, Vec<i64>),
            name!(source, String),
            name!(target, String),
            name!(mode, String),
            name!(phase, String),
            name!(status, String),
            name!(rows_copied, i64),
            name!(bytes_copied, i64),
            name!(txns_replayed, i64),
            name!(aborted_by_migration, i64),
            name!(phase_ms, String),
            name!(started_at_ms, i64),
            name!(finished_at_ms, Option<i64>),
            name!(waiting_on, Option<String>),
            name!(error, Option<String>),
            name!(copy_total_bytes, Option<i64>),
            name!(copy_bytes_per_sec, Option<i64>),
            name!(source_wal_bytes_per_sec, Option<i64>),
            name!(replay_bytes_per_sec, Option<i64>),
            name!(replay_txns_per_sec, Option<i64>),
            name!(lag_bytes, Option<i64>),
            name!(lag_ms, Option<i64>),
            name!(unavailable_ms, Option<i64>),
        ),
    > {
        let result = address().and_then(|address| {
            block_on(async {
                let mut client = connect_coordinator(&address).await?;
                client
                    .list_migrations(ListMigrationsRequest {})
                    .await
                    .map(|r| r.into_inner().migrations)
                    .map_err(status_error)
            })?
        });
        let migrations = result.unwrap_or_else(|e| e.raise());
        let rows: Vec<_> = migrations
            .into_iter()
            .map(|m| {
                let phase_ms = format!(
                    "{{{}}}",
                    m.phase_ms
                        .iter()
                        .map(|(k, v)| format!("\"{k}\": {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                (
                    m.id as i64,
                    m.shard_ids,
                    m.source,
                    m.target,
                    m.mode,
                    m.phase,
                    m.status,
                    m.rows_copied as i64,
                    m.bytes_copied as i64,
                    m.txns_replayed as i64,
                    m.aborted_by_migration as i64,
                    phase_ms,
                    m.started_at_ms as i64,
                    m.finished_at_ms.map(|v| v as i64),
                    m.waiting_on,
                    m.error,
                    m.copy_total_bytes.map(|v| v as i64),
                    m.copy_bytes_per_sec.map(|v| v as i64),
                    m.source_wal_bytes_per_sec.map(|v| v as i64),
                    m.replay_bytes_per_sec.map(|v| v as i64),
                    m.replay_txns_per_sec.map(|v| v as i64),
                    m.lag_bytes.map(|v| v as i64),
                    m.lag_ms.map(|v| v as i64),
                    m.unavailable_ms.map(|v| v as i64),
                )
            })
            .collect();
        TableIterator::new(rows)
    }
}

pgrx::extension_sql!(
    r#"
CREATE VIEW remus_migrations AS
    SELECT migration_id, shard_ids, source, target, mode, phase, status, rows_copied,
           bytes_copied, txns_replayed, aborted_by_migration, phase_ms::jsonb AS phase_ms,
           to_timestamp(started_at_ms / 1000.0) AS started_at,
           to_timestamp(finished_at_ms / 1000.0) AS finished_at, waiting_on, error,
           copy_total_bytes, copy_bytes_per_sec, source_wal_bytes_per_sec, replay_bytes_per_sec,
           replay_txns_per_sec, lag_bytes, lag_ms, unavailable_ms
      FROM remus.list_migrations();
COMMENT ON VIEW remus_migrations IS 'Shard migrations, running and finished, as the coordinator keeps them: live phase, status, counters, rates and lag, what a running one waits on, why a failed one failed';
"#,
    name = "migrations_view",
    requires = [list_migrations],
);
