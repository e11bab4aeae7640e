//! lock_abort handover, node side: the write fence and the writer abort, and the cancel a
//! victim gets turned into a retryable, counted 40001.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::migration::state::{
    active, count_abort, exempt, migration_of, my_pid, my_vxid, recount, require_superuser, Victim,
    STATE,
};
use crate::pg::ffi::{kill, SIGINT};

/// A transaction a lock_abort handover aborted while it was idle fails at its next statement
/// (the second half of [`super::admit_statement`]).
pub(crate) fn fail_if_aborted() -> Result<(), RemusError> {
    let (backend_id, lxid) = my_vxid();
    let pid = my_pid();
    let mine = |v: &Victim| {
        v.migration_id != 0
            && !v.stray
            && v.pid == pid
            && v.backend_id == backend_id
            && v.lxid == lxid
    };
    // Every statement of the node passes here while a migration is registered: look under the
    // shared lock, take the exclusive one only to consume this backend's own mark.
    if !STATE.share().victims.iter().any(mine) {
        return Ok(());
    }
    let mut s = STATE.exclusive();
    if let Some(v) = s.victims.iter_mut().find(|v| mine(v)) {
        let migration_id = v.migration_id;
        *v = Victim::default();
        count_abort(&mut s, migration_id);
        recount(&s);
        return Err(RemusError::AbortedByMigration { migration_id });
    }
    Ok(())
}

/// At the end of every transaction (commit, abort, prepare): the marks of this backend's
/// transaction go away; a mark never outlives the transaction it was made for.
pub(crate) fn end_of_transaction() {
    if !active() {
        return;
    }
    let pid = my_pid();
    let mut s = STATE.exclusive();
    let mut changed = false;
    for v in s
        .victims
        .iter_mut()
        .filter(|v| v.migration_id != 0 && v.pid == pid)
    {
        changed = true;
        if v.stray {
            // It covered the transaction after the marked one; that one is over too.
            *v = Victim::default();
        } else {
            // The marked transaction ends without having been failed: its cancel was signalled
            // while it was live (see `abort_shard_writers`) and is pending or lost; drop it,
            // and keep a stray mark in case the signal lands only in the next transaction.
            // SAFETY: this backend's own interrupt flag; clearing a cancel of a statement that
            // is over is what PostgreSQL does itself when a cancel arrives while idle.
            unsafe { pg_sys::QueryCancelPending = 0 };
            v.stray = true;
        }
    }
    if changed {
        recount(&s);
    }
}

/// Before a write (INSERT/UPDATE/DELETE/COPY FROM) on shard tables `shard_ids` of this node:
/// fails it if one of them is fenced.
pub(crate) fn check_write(shard_ids: &[i64]) -> Result<(), RemusError> {
    if !active() || exempt() || shard_ids.is_empty() {
        return Ok(());
    }
    let moved = {
        let s = STATE.share();
        shard_ids.iter().find_map(|&shard_id| {
            let migration_id = migration_of(&s, shard_id)?;
            s.migrations
                .iter()
                .any(|m| m.migration_id == migration_id && m.fenced)
                .then_some((shard_id, migration_id))
        })
    };
    match moved {
        Some((shard_id, migration_id)) => {
            count_abort(&mut STATE.exclusive(), migration_id);
            Err(RemusError::ShardMoved {
                shard_id,
                migration_id,
            })
        }
        None => Ok(()),
    }
}

/// emit_log_hook: a query cancel that a lock_abort handover sent becomes a retryable 40001 for
/// the client, and is counted. Returns the migration if `edata` was rewritten.
///
/// # Safety
/// `edata` must be the ErrorData being emitted.
pub(crate) unsafe fn rewrite_cancel(edata: *mut pg_sys::ErrorData) -> Option<i64> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if edata.is_null() || !active() {
            return None;
        }
        if (*edata).sqlerrcode != PgSqlErrorCode::ERRCODE_QUERY_CANCELED as i32
            || (*edata).elevel < PgLogLevel::ERROR as i32
        {
            return None;
        }
        let pid = my_pid();
        // Still the victim's transaction: the hook runs before the abort is processed.
        let (backend_id, lxid) = my_vxid();
        let migration_id = {
            // Never re-entered while this backend holds the lock: LWLockAcquire holds off
            // interrupts until the release, so no cancel can be raised in between, and every
            // other error path here drops the guard before raising.
            let mut s = STATE.exclusive();
            let v = s.victims.iter_mut().find(|v| {
                v.migration_id != 0
                    && v.pid == pid
                    && (v.stray || (v.backend_id == backend_id && v.lxid == lxid))
            })?;
            let migration_id = v.migration_id;
            *v = Victim::default();
            count_abort(&mut s, migration_id);
            recount(&s);
            migration_id
        };
        let message = RemusError::AbortedByMigration { migration_id }.to_string();
        let c = std::ffi::CString::new(message).ok()?;
        (*edata).sqlerrcode = PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE as i32;
        (*edata).message = pg_sys::MemoryContextStrdup(pg_sys::ErrorContext, c.as_ptr());
        Some(migration_id)
    }
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::handover::lock_abort::*;

    /// From now on a write that reaches one of the migration's shard tables on this node fails
    /// with 40001 and is counted.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_fence(migration_id: i64) {
        require_superuser("remus.migration_fence");
        let mut s = STATE.exclusive();
        match s
            .migrations
            .iter_mut()
            .find(|m| m.migration_id == migration_id)
        {
            Some(m) => m.fenced = true,
            None => {
                drop(s);
                RemusError::MigrationNotRegistered { migration_id }.raise()
            }
        }
        crate::migration::durable::sync_after(s, migration_id);
    }

    /// lock_abort: cancels every other backend holding a write lock (RowExclusiveLock or
    /// stronger) on `relids`, after marking its transaction as a victim of the migration (its
    /// cancel becomes 40001; idle in transaction, its next statement fails). Returns how many
    /// were signalled. Prepared transactions are not backends and are left to finish.
    #[pg_extern(volatile, parallel_unsafe)]
    fn abort_shard_writers(migration_id: i64, relids: Vec<pg_sys::Oid>) -> i32 {
        require_superuser("remus.abort_shard_writers");
        let holders: Vec<(i32, i32, u32)> = crate::pg::spi::connect(|c| {
            c.select(
                // Client backends only: a prepared transaction has no pid, and autovacuum's
                // ShareUpdateExclusiveLock is no client's write.
                "SELECT DISTINCT l.pid, split_part(l.virtualtransaction, '/', 1)::int,
                        split_part(l.virtualtransaction, '/', 2)::bigint
                   FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                  WHERE l.relation = ANY($1) AND l.granted AND l.pid IS NOT NULL
                    AND l.pid <> pg_backend_pid() AND a.backend_type = 'client backend'
                    AND l.mode NOT IN ('AccessShareLock', 'RowShareLock')",
                None,
                &[relids.into()],
            )?
            .map(|r| {
                Ok((
                    r.get::<i32>(1)?.unwrap_or(0),
                    r.get::<i32>(2)?.unwrap_or(-1),
                    r.get::<i64>(3)?.unwrap_or(0) as u32,
                ))
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()
        })
        .unwrap_or_else(|e| RemusError::from(e).raise());
        // Mark and signal under the lock, and only a transaction still live in its PGPROC: a
        // victim's end-of-transaction bookkeeping (which needs this lock) then always runs after
        // its signal was sent, so a cancel never outlives the transaction it was meant for
        // unnoticed (`end_of_transaction`).
        let mut signalled = 0;
        let mut s = STATE.exclusive();
        for &(pid, backend_id, lxid) in &holders {
            // SAFETY: looks up a PGPROC in the proc array (takes ProcArrayLock itself); the
            // two fields are plain integers, read once.
            let live = unsafe {
                let proc = pg_sys::BackendPidGetProc(pid);
                !proc.is_null() && (*proc).backendId == backend_id && (*proc).lxid == lxid
            };
            if !live
                || s.victims.iter().any(|v| {
                    !v.stray && v.pid == pid && v.backend_id == backend_id && v.lxid == lxid
                })
            {
                continue;
            }
            let Some(slot) = s.victims.iter_mut().find(|v| v.migration_id == 0) else {
                break;
            };
            *slot = Victim {
                migration_id,
                pid,
                backend_id,
                lxid,
                stray: false,
            };
            // What pg_cancel_backend() sends (the backend's whole process group), without SPI
            // under the lock. SAFETY: signalling a live backend of this cluster.
            if unsafe { kill(-pid, SIGINT) } == 0 || unsafe { kill(pid, SIGINT) } == 0 {
                signalled += 1;
            }
        }
        recount(&s);
        drop(s);
        signalled
    }
}
