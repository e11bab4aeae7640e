//! Sync barrier, node side (Remus mode): `remus.sync_barrier` switches a migration to sync mode
//! and waits for the transactions that were committing in async mode at that moment (TS_unsync),
//! which mark themselves "in async commit" at pre-commit ([`enter_commit`]) until they end
//! ([`leave_commit`]).

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::migration::state::{require_superuser, MAX_PROCS, STATE};

/// How a transaction that wrote a capturing shard of a migration commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitMode {
    /// Async mode: commit as usual; the stream carries the change.
    Async,
    /// Sync mode: validate on the destination through this replay worker first.
    Sync { endpoint: String },
    /// The migration is gone (ended or rolled back): nothing to do.
    Gone,
}

/// This backend's pgprocno (index of its PGPROC), for the barrier marks.
fn my_procno() -> Option<usize> {
    // SAFETY: MyProc is this backend's own PGPROC once it runs transactions.
    let procno = unsafe {
        if pg_sys::MyProc.is_null() {
            return None;
        } else {
            (*pg_sys::MyProc).pgprocno
        }
    };
    usize::try_from(procno).ok().filter(|&p| p < MAX_PROCS)
}

thread_local! {
    static MARK_SEQ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// At pre-commit (or pre-prepare) of a transaction that wrote capturing shards of
/// `migrations`: reads each one's mode and, when any is async, marks this backend "in async
/// commit" under the same lock, so the barrier either sees the mark or this backend sees sync
/// (the Dekker pairing of the paper's barrier, made trivial by the lock). The mark stays until
/// [`leave_commit`] at the end of the transaction.
pub(crate) fn enter_commit(migrations: &[i64]) -> Vec<(i64, CommitMode)> {
    let mut s = STATE.exclusive();
    let mut modes = Vec::with_capacity(migrations.len());
    let mut mark = false;
    for &migration_id in migrations {
        let mode = match s
            .migrations
            .iter()
            .find(|m| m.migration_id == migration_id && m.capture)
        {
            None => CommitMode::Gone,
            Some(m) if m.sync => CommitMode::Sync {
                endpoint: m.endpoint(),
            },
            Some(_) => {
                mark = true;
                CommitMode::Async
            }
        };
        modes.push((migration_id, mode));
    }
    if mark {
        if let Some(procno) = my_procno() {
            let seq = MARK_SEQ.with(|c| {
                c.set(c.get() + 1);
                c.get()
            });
            s.async_commit[procno] = seq;
        }
    }
    modes
}

/// At the end of the transaction: clears this backend's barrier mark.
pub(crate) fn leave_commit() {
    if let Some(procno) = my_procno() {
        if STATE.share().async_commit[procno] != 0 {
            STATE.exclusive().async_commit[procno] = 0;
        }
    }
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::barrier::*;

    /// The sync barrier (Remus mode): switches the migration to sync mode, then waits until
    /// every transaction that was committing in async mode at that moment (TS_unsync) has
    /// finished, and returns LSN_unsync, the WAL insert position after them (as a bigint). Commits that start
    /// from now on validate on the destination; nothing is blocked while the mode changes.
    #[pg_extern(volatile, parallel_unsafe)]
    fn sync_barrier(migration_id: i64) -> i64 {
        require_superuser("remus.sync_barrier");
        let marked: Vec<(usize, u64)> = {
            let mut s = STATE.exclusive();
            match s
                .migrations
                .iter_mut()
                .find(|m| m.migration_id == migration_id && m.capture)
            {
                Some(m) => m.sync = true,
                None => {
                    drop(s);
                    RemusError::MigrationNotCapturing { migration_id }.raise()
                }
            }
            s.async_commit
                .iter()
                .enumerate()
                .filter(|(_, &v)| v != 0)
                .map(|(i, &v)| (i, v))
                .collect()
        };
        // TS_unsync: each marked backend clears (or renews) its mark when its commit is over.
        let mut waiting = marked;
        while !waiting.is_empty() {
            {
                let s = STATE.share();
                waiting.retain(|&(procno, seq)| s.async_commit[procno] == seq);
            }
            if waiting.is_empty() {
                break;
            }
            // A short sleep on this backend's own latch, interrupts served after.
            crate::pg::latch::wait_ms(1);
        }
        // SAFETY: reads the shared WAL insert position.
        unsafe { pg_sys::GetXLogInsertRecPtr() as i64 }
    }
}
