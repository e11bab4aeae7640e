//! Handover, node side: the primitives the coordinator's three handover modes use, and what
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
//! - [`remus`]: from Tm until the migration ends, the node the shards left (the drain source),
//!   and the wait of a newer writer on the new owner for the row's older writers there.
//!
//! Here: [`admit_statement`] (the start of every statement) and the wait of a READ COMMITTED
//! transaction for a Tm that is prepared on this node ([`wait_for_in_doubt_flip`]).

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::migration::state::{active, exempt};

pub(crate) mod lock_abort;
pub(crate) mod remus;
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

/// Does this transaction route by the latest map (READ COMMITTED)? One that keeps a snapshot
/// for the whole transaction routes by that snapshot: whatever it waited for, it would route as
/// an older transaction.
pub(crate) fn routes_at_latest() -> bool {
    // SAFETY: reads the backend's isolation level.
    (unsafe { pg_sys::XactIsoLevel } as u32) < pg_sys::XACT_REPEATABLE_READ
}

/// First use of `relid`'s shards in a READ COMMITTED transaction while this node's map is read
/// through (a Tm in progress): waits for any prepared Tm on those shards' map rows. Returns
/// true when it waited.
pub(crate) fn wait_for_in_doubt_flip(relid: pg_sys::Oid) -> Result<bool, RemusError> {
    let in_doubt: Vec<u32> = Spi::connect(|c| {
        c.select(
            "SELECT m.xmax::text::bigint
               FROM remus.shards s
               JOIN remus.shard_map m USING (shard_id)
              WHERE s.logicalrelid = $1 AND m.xmax <> '0'::xid
                AND EXISTS (SELECT 1 FROM pg_catalog.pg_prepared_xacts p WHERE p.transaction = m.xmax)",
            None,
            &[relid.into()],
        )?
        .map(|r| r.get::<i64>(1).map(|x| x.unwrap_or(0) as u32))
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })?;
    for xid in &in_doubt {
        // SAFETY: waits on the prepared transaction's xid lock (interruptible; lock_timeout
        // applies), like a writer that meets its row version.
        unsafe {
            pg_sys::XactLockTableWait(
                pg_sys::TransactionId::from(*xid),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                pg_sys::XLTW_Oper::XLTW_None,
            )
        };
    }
    Ok(!in_doubt.is_empty())
}
