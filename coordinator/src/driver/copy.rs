//! The copy phase: the migration is registered on every node, the source publishes the shard
//! tables, the target gets empty copies (indexes and constraints included), and the slot's
//! exported snapshot is copied into them under a replication origin of the migration; then the
//! copies get the capture trigger and foreign keys. The extension's half is
//! `remus.migration_begin` (registration, DDL refusal).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::{info, warn};
use wal_propagator::{CopyOptions, CopyProgress, ReplicationConnection, ReplicationOptions};

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

        // The capture trigger comes after the rows (`complete_target_tables`): an AFTER ROW
        // trigger during the COPY costs every copied row a trigger event (~15 % of a 1 GB copy).
        self.create_target_tables(CaptureTrigger::AfterCopy).await?;

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
        let parallelism = pairs.len().max(self.config.copy_sessions as usize);
        // Copied rows are committed under a Remus replication origin (one per copy session),
        // so MOCC on the target tells them from rows a target transaction wrote.
        let origin = format!(
            "{} || pg_catalog.pg_backend_pid()",
            quote_literal(&names::copy_origin_prefix(id))
        );
        // What the copy has to pass, for its progress: the tables' size on the source (heap,
        // TOAST, indexes), an upper bound for the binary COPY bytes counted as rows pass.
        let total: i64 = source
            .query_one(
                &format!(
                    "SELECT coalesce(sum(pg_catalog.pg_total_relation_size(t)), 0)::bigint \
                       FROM unnest({}) AS t",
                    self.regclass_array()
                ),
                &[],
            )
            .await
            .map_err(sql(&self.plan.source))?
            .get(0);
        let total = total.max(0) as u64;
        self.reporter
            .update(move |r| r.rates.copy_total_bytes = Some(total))
            .await?;
        let progress = std::sync::Arc::new(CopyProgress::default());
        let copy_options = CopyOptions {
            progress: progress.clone(),
            dest_setup_sql: Some(format!(
                "SELECT pg_catalog.pg_replication_origin_create({origin}) \
                  WHERE pg_catalog.pg_replication_origin_oid({origin}) IS NULL; \
                 SELECT pg_catalog.pg_replication_origin_session_setup({origin}) \
                  WHERE NOT pg_catalog.pg_replication_origin_session_is_setup();"
            )),
            split_bytes: self.config.copy_split_bytes,
            ..CopyOptions::default()
        };
        self.state.slot = Some(slot.clone());
        let copy_started = std::time::Instant::now();
        let failpoints = self.config.failpoints.clone();
        let copying = tokio::task::spawn_blocking(move || {
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
        });
        let copied = self.report_copy(copying, &progress).await;
        let (conn, created, stats) = copied.map_err(|source| DriverError::Thread {
            what: "copy",
            source,
        })??;
        let rows: u64 = stats.iter().map(|s| s.rows).sum();
        let bytes: u64 = stats.iter().map(|s| s.bytes).sum();
        let parts: usize = stats.iter().map(|s| s.parts).sum();
        let copy_ms = copy_started.elapsed().as_millis().max(1) as u64;
        info!(
            migration_id = id, phase = "copy", rows, bytes, parts,
            slot_wait_ms = created.creation_time.as_millis() as u64,
            consistent_point = %created.consistent_point, "snapshot copied"
        );
        self.reporter
            .update(|r| {
                r.rows_copied = rows;
                r.bytes_copied = bytes;
                r.rates.copy_bytes_per_sec = Some(bytes * 1000 / copy_ms);
                r.waiting_on = None;
            })
            .await?;
        *self.state.repl.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(conn);
        self.state.start_lsn = created.consistent_point;
        self.complete_target_tables().await
    }
}

impl Run {
    /// The target's tables, with every index and constraint, before any row arrives: the
    /// replay applies by primary key and the shard may serve right after the handover. The
    /// write-set capture trigger comes with them, or after the copy (`capture`).
    pub(super) async fn create_target_tables(
        &mut self,
        capture: CaptureTrigger,
    ) -> Result<(), DriverError> {
        let target = self.config.connector.connect(&self.plan.target).await?;
        let mut ddl = String::new();
        for t in &self.plan.tables {
            // The shard table has the column numbers of the target's shell (the router plans
            // on the shell and runs the plan on the shard): `LIKE` renumbers the columns when
            // the shell has dropped ones (a distributed ALTER TABLE … DROP COLUMN), so then
            // the table is built column by column with the dropped ones in place.
            let created: String = target
                .query_one(SHARD_TABLE_DDL, &[&t.shell, &t.qualified()])
                .await
                .map_err(sql(&self.plan.target))?
                .get(0);
            ddl.push_str(&created);
            ddl.push('\n');
            if capture == CaptureTrigger::WithTable {
                ddl.push_str(&capture_trigger_ddl(t));
            }
        }
        // One transaction: either every table exists afterwards (and is ours to drop on
        // rollback) or none was created (and a table that was already there is left alone).
        target
            .batch_execute(&format!("BEGIN;\n{ddl}COMMIT;"))
            .await
            .map_err(sql(&self.plan.target))?;
        self.state.target_tables = true;
        Ok(())
    }

    /// Waits for the copy thread, recording every second what it has passed so far (rows,
    /// bytes, the rate over the last second) in the migration's record.
    async fn report_copy<T>(
        &self,
        mut copying: tokio::task::JoinHandle<T>,
        progress: &CopyProgress,
    ) -> Result<T, tokio::task::JoinError> {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        let mut last = (Instant::now(), 0u64);
        loop {
            tokio::select! {
                done = &mut copying => return done,
                _ = tick.tick() => {
                    let rows = progress.rows.load(Ordering::Relaxed);
                    let bytes = progress.bytes.load(Ordering::Relaxed);
                    let ms = last.0.elapsed().as_millis().max(1) as u64;
                    let rate = bytes.saturating_sub(last.1) * 1000 / ms;
                    last = (Instant::now(), bytes);
                    let reported = self
                        .reporter
                        .update(move |r| {
                            r.rows_copied = rows;
                            r.bytes_copied = bytes;
                            r.rates.copy_bytes_per_sec = Some(rate);
                        })
                        .await;
                    if let Err(e) = reported {
                        warn!(migration_id = self.id(), error = %e, "could not record the copy's progress");
                    }
                }
            }
        }
    }
}

impl Run {
    /// Once the rows are in, before catch-up, in one transaction: the capture trigger of every
    /// target table, and the shells' foreign keys on them (a foreign key is between tables of
    /// the moving group or to a reference table, whose copy the target has): added after the
    /// copy, which fills the tables in parallel and in no order, and before catch-up, whose
    /// replay (a replica-role session) does not fire them. Each is validated against the
    /// copied rows.
    async fn complete_target_tables(&mut self) -> Result<(), DriverError> {
        let target = self.config.connector.connect(&self.plan.target).await?;
        let mut ddl: String = self.plan.tables.iter().map(capture_trigger_ddl).collect();
        let mut foreign_keys = false;
        for t in &self.plan.tables {
            for row in target
                .query(FOREIGN_KEY_DDL, &[&t.shell, &t.qualified(), &t.shard_id])
                .await
                .map_err(sql(&self.plan.target))?
            {
                ddl.push_str(row.get::<_, &str>(0));
                ddl.push('\n');
                foreign_keys = true;
            }
        }
        target
            .batch_execute(&format!("BEGIN;\n{ddl}COMMIT;"))
            .await
            .map_err(sql(&self.plan.target))?;
        info!(
            migration_id = self.id(),
            phase = "copy",
            foreign_keys,
            "capture triggers and foreign keys added to the target's shard tables"
        );
        Ok(())
    }
}

/// When the target's shard tables get their write-set capture trigger.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum CaptureTrigger {
    /// With the table: squall's tables take writes as soon as ownership moves, before the
    /// pulls fill them.
    WithTable,
    /// After the copy, before catch-up: nothing else writes the table before then.
    AfterCopy,
}

/// The write-set capture trigger of shard table `t`, as the extension creates it with every
/// shard table: a later migration of this shard must not need DDL on a hot table.
fn capture_trigger_ddl(t: &crate::plan::ShardTable) -> String {
    names::capture_trigger_ddl(&t.qualified(), t.shard_id)
}

/// The foreign keys of shell `$1` as DDL for its shard table `$2` (shard `$3`): each references
/// the referenced table's shard table on the same node, the co-located shard of the same shard
/// index or the reference table's one shard; same name, columns, match type, actions,
/// deferrability and validity as the shell's.
const FOREIGN_KEY_DDL: &str = r#"
WITH p AS (SELECT $1::text::regclass AS shell, $2::text AS shard, $3::bigint AS shard_id)
SELECT format('ALTER TABLE %s ADD CONSTRAINT %I FOREIGN KEY (%s) REFERENCES %s (%s)%s ON UPDATE %s ON DELETE %s%s%s%s;',
              p.shard, c.conname,
              (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord)
                 FROM unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord)
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum),
              format('remus_shards.%I', rc.relname || '_' || rs.shard_id),
              (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord)
                 FROM unnest(c.confkey) WITH ORDINALITY AS k(attnum, ord)
                 JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.attnum),
              CASE c.confmatchtype WHEN 'f' THEN ' MATCH FULL' ELSE '' END,
              CASE c.confupdtype WHEN 'r' THEN 'RESTRICT' WHEN 'c' THEN 'CASCADE'
                                 WHEN 'n' THEN 'SET NULL' WHEN 'd' THEN 'SET DEFAULT' ELSE 'NO ACTION' END,
              CASE c.confdeltype WHEN 'r' THEN 'RESTRICT' WHEN 'c' THEN 'CASCADE'
                                 WHEN 'n' THEN 'SET NULL' WHEN 'd' THEN 'SET DEFAULT' ELSE 'NO ACTION' END,
              (SELECT ' (' || string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord) || ')'
                 FROM unnest(c.confdelsetcols) WITH ORDINALITY AS k(attnum, ord)
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum),
              CASE WHEN c.condeferrable THEN ' DEFERRABLE' ELSE '' END
                || CASE WHEN c.condeferred THEN ' INITIALLY DEFERRED' ELSE '' END,
              CASE WHEN c.convalidated THEN '' ELSE ' NOT VALID' END)
  FROM p
  JOIN pg_constraint c ON c.conrelid = p.shell AND c.contype = 'f'
  JOIN pg_class rc ON rc.oid = c.confrelid
  JOIN remus.distributed_tables rd ON rd.logicalrelid = c.confrelid
  JOIN remus.shards rs ON rs.logicalrelid = c.confrelid
   AND (rd.kind = 'r'
        OR rs.shard_index = (SELECT shard_index FROM remus.shards WHERE shard_id = p.shard_id))
 ORDER BY c.conname
"#;

/// The DDL of an empty shard table `$2` shaped as shell `$1`: `LIKE … INCLUDING ALL EXCLUDING
/// IDENTITY` when the shell has no dropped column (an identity's values come from the shell's
/// sequence, drawn where the statement entered: decision 0019) and no invalid index (one a
/// failed CREATE INDEX CONCURRENTLY left, which `LIKE` would build as valid, or fail to if it is
/// UNIQUE over duplicates: such an index is not copied); otherwise every column in the
/// shell's order, a placeholder where a column was dropped (then dropped too, so the numbers
/// match), then the constraints (CHECK by name; a primary key, unique or exclusion constraint
/// named after the shard table, as index names are per schema) and the other indexes.
const SHARD_TABLE_DDL: &str = r#"
WITH p AS (SELECT $1::text::regclass AS shell, $2::text AS shard)
SELECT CASE WHEN NOT EXISTS (SELECT FROM pg_attribute
                              WHERE attrelid = p.shell AND attnum > 0 AND attisdropped)
             AND NOT EXISTS (SELECT FROM pg_index WHERE indrelid = p.shell AND NOT indisvalid)
       THEN format('CREATE TABLE %s (LIKE %s INCLUDING ALL EXCLUDING IDENTITY);', p.shard, p.shell)
       ELSE format('CREATE TABLE %s (%s);', p.shard,
              (SELECT string_agg(
                 CASE WHEN a.attisdropped THEN format('%I int4', 'remus_dropped_' || a.attnum)
                 ELSE format('%I %s', a.attname, format_type(a.atttypid, a.atttypmod))
                      || CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
                              THEN ' COLLATE ' || a.attcollation::regcollation::text ELSE '' END
                      || CASE WHEN a.attgenerated = 's'
                              THEN ' GENERATED ALWAYS AS (' || pg_get_expr(d.adbin, d.adrelid) || ') STORED'
                              WHEN d.adbin IS NOT NULL THEN ' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid)
                              ELSE '' END
                      || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
                 END, ', ' ORDER BY a.attnum)
                 FROM pg_attribute a
                 LEFT JOIN pg_type t ON t.oid = a.atttypid
                 LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                WHERE a.attrelid = p.shell AND a.attnum > 0))
         || (SELECT string_agg(format(' ALTER TABLE %s DROP COLUMN %I;', p.shard, 'remus_dropped_' || attnum), '' ORDER BY attnum)
               FROM pg_attribute WHERE attrelid = p.shell AND attnum > 0 AND attisdropped)
         || coalesce((SELECT string_agg(format(' ALTER TABLE %s ADD %s%s;', p.shard,
                                     CASE WHEN contype = 'c' THEN format('CONSTRAINT %I ', conname) ELSE '' END,
                                     pg_get_constraintdef(oid)), '' ORDER BY conname)
                        FROM pg_constraint WHERE conrelid = p.shell AND contype IN ('p', 'u', 'c', 'x')), '')
         || coalesce((SELECT string_agg(format(' CREATE %sINDEX ON %s%s;',
                                     CASE WHEN i.indisunique THEN 'UNIQUE ' ELSE '' END, p.shard,
                                     substring(pg_get_indexdef(i.indexrelid) FROM ' USING .*$')), '')
                        FROM pg_index i
                       WHERE i.indrelid = p.shell AND i.indisvalid
                         AND NOT EXISTS (SELECT FROM pg_constraint c WHERE c.conindid = i.indexrelid)), '')
       END
  FROM p
"#;
