//! Handover, node side: the primitives the coordinator's handover modes use, and what
//! every statement of the node checks while a migration is registered.
//!
//! - [`lock_abort`]: the write fence (`remus.migration_fence`) and the writer abort
//!   (`remus.abort_shard_writers`). Once ownership has moved (or is about to), a write that
//!   still reaches the source's shard table was routed with a stale map; it fails with 40001 so
//!   the client retries on the new owner, and is counted as aborted by the migration. The
//!   backends holding a write lock on the shard are cancelled; the cancel they get is turned
//!   into 40001 (retryable) and counted. A victim idle in its transaction ignores a cancel, so
//!   its next statement raises instead.
//! - [`wait_remaster`]: the admission gate (`remus.close_gate` / `remus.open_gate`): client
//!   transactions that start after the gate closed wait at their next statement; transactions
//!   already running (and 2PC participants working for them) are never held.
//! - [`albatross`]: the per-shard suspension (`remus.albatross_suspend` / `_resume`): a client
//!   transaction that routes a suspended shard for the first time waits at that decision and
//!   then routes by the map as it is after the wait.
//! - [`remus`]: from Tm until the migration ends, the node the shards left (the drain source),
//!   and the wait of a newer writer on the new owner for the row's older writers there.
//!
//! - [`restart`]: what the node enforces when a restart lost a running migration's state.
//!
//! Here: [`admit_statement`] (the start of every statement), the shards whose ownership change
//! (Tm) is prepared on this node but not decided here ([`in_doubt`]), and the bounded wait for
//! that decision ([`wait_decided`]).

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::migration::state::{active, exempt};

pub(crate) mod albatross;
pub(crate) mod lock_abort;
pub(crate) mod remus;
pub(crate) mod restart;
pub(crate) mod wait_remaster;

/// At the start of every statement of a client session (planner, ExecutorStart and utility
/// hooks): waits at a closed gate, and fails a transaction that a lock_abort handover aborted
/// while it was idle.
pub(crate) fn admit_statement() -> Result<(), RemusError> {
    if !active() || exempt() {
        return Ok(());
    }
    wait_remaster::wait_at_gate();
    lock_abort::fail_if_aborted()
}

// In pg glue so that the handover's submodules reach it without an edge back to this module.
pub(crate) use crate::pg::isolation::routes_at_latest;

/// A shard whose map row is held by a prepared Tm on this node: its ownership change is
/// decided elsewhere (perhaps committed on the target already) but not yet here.
#[derive(Clone, Copy, Debug)]
pub(crate) struct InDoubt {
    pub(crate) shard_id: i64,
    /// The prepared Tm's xid.
    pub(crate) xid: u32,
    pub(crate) migration_id: i64,
}

/// The shards of `relid` (all distributed tables when None, or only `shard_ids` when given)
/// whose map row, as the active snapshot sees it, is held by a prepared Tm (`remus_tm:` gid).
/// Read from the catalog and `pg_prepared_xacts` only: it does not depend on shared memory,
/// so it holds after a restart that lost the migration's state (review finding F4).
pub(crate) fn in_doubt(
    relid: Option<pg_sys::Oid>,
    shard_ids: Option<&[i64]>,
) -> Result<Vec<InDoubt>, RemusError> {
    let rows = crate::pg::spi::connect(|c| {
        c.select(
            "SELECT m.shard_id, m.xmax::text::bigint,
                    split_part(p.gid, ':', 2)::bigint
               FROM remus.shard_map m
               JOIN remus.shards s USING (shard_id)
               JOIN pg_catalog.pg_prepared_xacts p ON p.transaction = m.xmax
              WHERE m.xmax <> '0'::xid AND starts_with(p.gid, 'remus_tm:')
                AND ($1::oid IS NULL OR s.logicalrelid = $1)
                AND ($2::bigint[] IS NULL OR m.shard_id = ANY ($2))",
            None,
            &[relid.into(), shard_ids.map(|s| s.to_vec()).into()],
        )?
        .map(|r| {
            Ok(InDoubt {
                shard_id: r.get::<i64>(1)?.unwrap_or(0),
                xid: r.get::<i64>(2)?.unwrap_or(0) as u32,
                migration_id: r.get::<i64>(3)?.unwrap_or(0),
            })
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })?;
    Ok(rows)
}

/// How long to poll between looks at a prepared Tm while waiting for its decision. The look is
/// a probe of the lock table, and every waiter resumes within this long of the node's COMMIT
/// PREPARED: at 10 ms the waiters of the anchors' E1 lost 5 ms on average after an in-doubt
/// window of 10-20 ms.
const IN_DOUBT_POLL_MS: i64 = 1;

/// Waits until each prepared Tm of `rows` is decided on this node (committed or rolled back),
/// at most `remus.in_doubt_wait_timeout` in all; past it fails with 55006 naming the shard.
/// The wait shows in `pg_stat_activity` as wait event `Extension` with the Tm's shard in the
/// log, and a cancel or statement_timeout ends it (review finding F5: it used to be an
/// unbounded lock wait).
pub(crate) fn wait_decided(rows: &[InDoubt]) -> Result<(), RemusError> {
    if rows.is_empty() {
        return Ok(());
    }
    let limit_ms = i64::from(crate::guc::IN_DOUBT_WAIT_TIMEOUT_MS.get());
    let started = std::time::Instant::now();
    for r in rows {
        pgrx::debug1!(
            "shard {} waits for the decision of migration {}'s Tm (xid {})",
            r.shard_id,
            r.migration_id,
            r.xid
        );
        loop {
            // SAFETY: tries the prepared transaction's xid lock without blocking; true once
            // that transaction is no longer in progress.
            if unsafe { pg_sys::ConditionalXactLockTableWait(pg_sys::TransactionId::from(r.xid)) } {
                break;
            }
            let waited = started.elapsed().as_millis() as i64;
            if waited >= limit_ms {
                return Err(RemusError::OwnershipInDoubt {
                    shard_id: r.shard_id,
                    migration_id: r.migration_id,
                    waited_ms: waited,
                });
            }
            crate::pg::latch::wait_ms(IN_DOUBT_POLL_MS.min(limit_ms - waited).max(1));
        }
    }
    Ok(())
}
