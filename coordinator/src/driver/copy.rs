//! The copy phase: the migration is registered on every node, the source publishes the shard
//! tables, the target gets empty copies (indexes, constraints and the capture trigger
//! included), and the slot's exported snapshot is copied into them under a replication origin
//! of the migration. The extension's half is `remus.migration_begin` (registration, DDL refusal).

use tracing::info;
use wal_propagator::{CopyOptions, ReplicationConnection, ReplicationOptions};

use remus_proto::names;

use super::{join, quote_literal, sql, DriverError, Run};
use crate::failpoint;
use crate::migration::Mode;

impl Run {
    /// Runs the copy phase; leaves the replication connection (at the slot's consistent point)
    /// for catch-up.
    pub(super) async fn copy(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let ids = format!("ARRAY[{}]::bigint[]", join(&self.plan.shard_ids));
        self.state.registered = true;
        self.on_every_node(&format!("SELECT remus.migration_begin({id}, {ids})"))
            .await?;
        if self.plan.mode == Mode::Remus {
            self.start_capture().await?;
        }

        let tables: Vec<String> = self.plan.tables.iter().map(|t| t.qualified()).collect();
        let source = self.config.connector.connect(&self.plan.source).await?;
        source
            .batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLE {}",
                self.publication(),
                tables.join(", ")
            ))
            .await
            .map_err(sql(&self.plan.source))?;
        self.state.publication = true;

        // The target's tables, with every index and constraint, before any row arrives: the
        // replay applies by primary key and the shard may serve right after the handover.
        let target = self.config.connector.connect(&self.plan.target).await?;
        let ddl: String = self
            .plan
            .tables
            .iter()
            .map(|t| {
                // The write-set capture trigger comes with the table, as on the source: a later
                // migration of this shard must not need DDL on a hot table. ALWAYS, as
                // `catalog::shard_ddl` makes it: replica-role sessions are captured too (F14).
                format!(
                    "CREATE TABLE {q} (LIKE {} INCLUDING ALL);\n\
                     CREATE TRIGGER {} AFTER INSERT OR UPDATE OR DELETE ON {q} \
                     FOR EACH ROW EXECUTE FUNCTION remus.capture_write('{}');\n\
                     ALTER TABLE {q} ENABLE ALWAYS TRIGGER {};\n",
                    t.shell,
                    names::CAPTURE_TRIGGER,
                    t.shard_id,
                    names::CAPTURE_TRIGGER,
                    q = t.qualified()
                )
            })
            .collect();
        // One transaction: either every table exists afterwards (and is ours to drop on
        // rollback) or none was created (and a table that was already there is left alone).
        target
            .batch_execute(&format!("BEGIN;\n{ddl}COMMIT;"))
            .await
            .map_err(sql(&self.plan.target))?;
        self.state.target_tables = true;

        // Slot first (it waits for the source's running transactions), then the copy sessions
        // import its snapshot. Both block: run them on a blocking thread.
        self.reporter
            .waiting_on(Some(format!(
                "creating slot {}: waits for transactions holding an xid on {}",
                self.slot(),
                self.plan.source.name
            )))
            .await;
        let repl_conninfo = self.config.connector.conninfo(&self.plan.source, true);
        let source_conninfo = self.config.connector.conninfo(&self.plan.source, false);
        let target_conninfo = self.config.connector.conninfo(&self.plan.target, false);
        let slot = self.slot();
        let pairs: Vec<(String, String)> = tables.iter().map(|t| (t.clone(), t.clone())).collect();
        let parallelism = pairs.len();
        // Copied rows are committed under a Remus replication origin (one per copy session),
        // so MOCC on the target tells them from rows a target transaction wrote.
        let origin = format!(
            "{} || pg_catalog.pg_backend_pid()",
            quote_literal(&names::copy_origin_prefix(id))
        );
        let copy_options = CopyOptions {
            dest_setup_sql: Some(format!(
                "SELECT pg_catalog.pg_replication_origin_create({origin}) \
                  WHERE pg_catalog.pg_replication_origin_oid({origin}) IS NULL; \
                 SELECT pg_catalog.pg_replication_origin_session_setup({origin}) \
                  WHERE NOT pg_catalog.pg_replication_origin_session_is_setup();"
            )),
            ..CopyOptions::default()
        };
        self.state.slot = Some(slot.clone());
        let failpoints = self.config.failpoints.clone();
        let (conn, created, stats) = tokio::task::spawn_blocking(move || {
            let mut conn =
                ReplicationConnection::connect_with(&repl_conninfo, ReplicationOptions::default())?;
            let exported = conn.create_slot_exporting_snapshot(&slot)?;
            failpoints.pause_blocking(failpoint::COPY_SNAPSHOT_EXPORTED, id);
            let stats = wal_propagator::copy_tables_with(
                &source_conninfo,
                exported.snapshot_name(),
                &target_conninfo,
                &pairs,
                parallelism,
                &copy_options,
            );
            let created = exported.release();
            Ok::<_, DriverError>((conn, created, stats?))
        })
        .await
        .map_err(|source| DriverError::Thread {
            what: "copy",
            source,
        })??;
        let rows: u64 = stats.iter().map(|s| s.rows).sum();
        let bytes: u64 = stats.iter().map(|s| s.bytes).sum();
        info!(
            migration_id = id, phase = "copy", rows, bytes,
            slot_wait_ms = created.creation_time.as_millis() as u64,
            consistent_point = %created.consistent_point, "snapshot copied"
        );
        self.reporter
            .update(|r| {
                r.rows_copied = rows;
                r.bytes_copied = bytes;
                r.waiting_on = None;
            })
            .await?;
        *self.state.repl.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(conn);
        self.state.start_lsn = created.consistent_point;
        Ok(())
    }
}
