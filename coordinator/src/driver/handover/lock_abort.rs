//! lock_abort handover (Citus-style): writes blocked by an EXCLUSIVE lock on the shard tables,
//! the writers holding them aborted, the rest fenced (`remus.migration_fence`,
//! `remus.abort_shard_writers`: the extension's half).

use std::time::Instant;

use tracing::{info, warn};

use super::super::{sql, DriverError, Run};

impl Run {
    /// Citus-style: block writes with an EXCLUSIVE lock on the shard tables, aborting (40001)
    /// the transactions that hold them, final catch-up, Tm, then let the queued writers through
    /// into the fence, which fails them so they retry on the new owner.
    pub(in crate::driver) async fn handover_lock_abort(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let source = &self.plan.source;
        let lock = self.config.connector.connect(source).await?;
        lock.batch_execute("BEGIN; SET LOCAL lock_timeout = '200ms'")
            .await
            .map_err(sql(source))?;
        let started = Instant::now();
        let mut signalled = 0i64;
        loop {
            lock.batch_execute("SAVEPOINT remus_lock")
                .await
                .map_err(sql(source))?;
            let n: i32 = lock
                .query_one(
                    &format!(
                        "SELECT remus.abort_shard_writers({id}, {})",
                        self.regclass_array()
                    ),
                    &[],
                )
                .await
                .map_err(sql(source))?
                .get(0);
            signalled += i64::from(n);
            match lock
                .batch_execute(&format!(
                    "LOCK TABLE {} IN EXCLUSIVE MODE",
                    self.table_list()
                ))
                .await
            {
                Ok(()) => break,
                Err(e)
                    if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
                {
                    lock.batch_execute("ROLLBACK TO SAVEPOINT remus_lock")
                        .await
                        .map_err(sql(source))?;
                    if started.elapsed() > self.config.lock_grace {
                        let killed = self.terminate_shard_writers(&lock).await?;
                        self.state.terminated += killed;
                    }
                    self.reporter
                        .waiting_on(Some(format!(
                            "locking the shard tables on {}: {signalled} writers aborted so far",
                            source.name
                        )))
                        .await;
                }
                Err(e) => return Err(sql(source)(e)),
            }
        }
        info!(
            migration_id = id,
            phase = "handover",
            signalled,
            lock_ms = started.elapsed().as_millis() as u64,
            "writes blocked"
        );
        let fence = self.config.connector.connect(source).await?;
        fence
            .batch_execute(&format!("SELECT remus.migration_fence({id})"))
            .await
            .map_err(sql(source))?;
        let lsn = self.sync_point().await?;
        self.wait_applied(lsn).await?;
        self.verify().await?;
        self.tm().await?;
        // Queued writers now run into the fence (40001) and retry on the new owner.
        lock.batch_execute("COMMIT")
            .await
            .map_err(sql(&self.plan.source))?;
        Ok(())
    }

    async fn terminate_shard_writers(
        &self,
        lock: &tokio_postgres::Client,
    ) -> Result<u64, DriverError> {
        let rows = lock
            .query(
                &format!(
                    "SELECT pg_terminate_backend(pid) FROM (
                       SELECT DISTINCT l.pid FROM pg_locks l
                        WHERE l.relation = ANY({}) AND l.granted AND l.pid IS NOT NULL
                          AND l.pid <> pg_backend_pid()
                          AND l.mode NOT IN ('AccessShareLock', 'RowShareLock')) w",
                    self.regclass_array()
                ),
                &[],
            )
            .await
            .map_err(sql(&self.plan.source))?;
        let n = rows.iter().filter(|r| r.get::<_, bool>(0)).count() as u64;
        if n > 0 {
            warn!(
                migration_id = self.id(),
                phase = "handover",
                terminated = n,
                "idle writers terminated after the grace period"
            );
        }
        Ok(n)
    }
}
