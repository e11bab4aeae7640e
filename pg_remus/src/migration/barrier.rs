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
    /// `barrier_lsn`: the barrier's sync point, once applied on the destination; until then
    /// (None) the validation waits for the stream to pass this transaction's own WAL position.
    Sync {
        endpoint: String,
        barrier_lsn: Option<u64>,
    },
    /// The migration is gone (ended or rolled back): nothing to do.
    Gone,
}

/// This backend's pgprocno (index of its PGPROC), for the barrier marks; -1 without a PGPROC.
fn my_pgprocno() -> i32 {
    // SAFETY: MyProc is this backend's own PGPROC once it runs transactions.
    unsafe {
        if pg_sys::MyProc.is_null() {
            -1
        } else {
            (*pg_sys::MyProc).pgprocno
        }
    }
}

/// This backend's barrier mark, if the marks reach it.
fn my_procno() -> Option<usize> {
    mark_slot(my_pgprocno())
}

/// The barrier mark of backend `procno`, if the marks reach it (they cover the first
/// [`MAX_PROCS`] PGPROCs; review F17: a backend past them must not commit unmarked).
fn mark_slot(procno: i32) -> Option<usize> {
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
///
/// A backend the marks do not reach (pgprocno past [`MAX_PROCS`], with max_connections in the
/// thousands) is refused an async commit: unmarked, the barrier would not wait for it, and its
/// write could reach the destination only through the stream after the sync point, unchecked.
pub(crate) fn enter_commit(migrations: &[i64]) -> Result<Vec<(i64, CommitMode)>, RemusError> {
    enter_commit_as(migrations, my_pgprocno())
}

/// [`enter_commit`] for the backend with PGPROC number `pgprocno`.
fn enter_commit_as(
    migrations: &[i64],
    pgprocno: i32,
) -> Result<Vec<(i64, CommitMode)>, RemusError> {
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
                barrier_lsn: Some(m.barrier_lsn).filter(|&l| l != 0),
            },
            Some(_) => {
                mark = true;
                CommitMode::Async
            }
        };
        modes.push((migration_id, mode));
    }
    if mark {
        let Some(procno) = mark_slot(pgprocno) else {
            drop(s);
            return Err(RemusError::BarrierUntracked {
                procno: pgprocno,
                max: MAX_PROCS,
            });
        };
        let seq = MARK_SEQ.with(|c| {
            c.set(c.get() + 1);
            c.get()
        });
        s.async_commit[procno] = seq;
    }
    Ok(modes)
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
        crate::migration::durable::sync(migration_id);
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

    /// The end of the sync barrier (Remus mode), called by the coordinator once the
    /// destination has applied the source's stream up to `sync_point`, the sync point it
    /// emitted after TS_unsync and the 2PC participants prepared in async mode. Every source
    /// commit on the shards before that point is applied there, and every one after it is
    /// validated (its shadow prepared there, holding its row locks until it commits). So a
    /// validation from now on waits for the stream only up to `sync_point`, not up to its
    /// transaction's WAL position (nor flushes that position first): a write-write predecessor
    /// of it is either applied or a prepared shadow whose row lock the validation's
    /// `FOR UPDATE` waits for. The stream has passed `sync_point` already, unless the replay
    /// restarted (a destination restart loses catch-up commits not yet flushed, and the stream
    /// applies them again from the slot): then the validation waits for them. Not kept across
    /// a restart of this node: validations then wait for the stream again, which is always
    /// safe.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_barrier_applied(migration_id: i64, sync_point: i64) {
        require_superuser("remus.migration_barrier_applied");
        let mut s = STATE.exclusive();
        match s
            .migrations
            .iter_mut()
            .find(|m| m.migration_id == migration_id && m.capture)
        {
            Some(m) if m.sync => m.barrier_lsn = sync_point.max(1) as u64,
            Some(_) => {
                drop(s);
                RemusError::MigrationNotInSync { migration_id }.raise()
            }
            None => {
                drop(s);
                RemusError::MigrationNotCapturing { migration_id }.raise()
            }
        }
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    use super::{enter_commit_as, CommitMode};
    use crate::migration::state::{MAX_PROCS, STATE};

    /// A backend past the marks (review F17) must not commit async unmarked: the barrier would
    /// not wait for it. One within them is marked.
    #[pg_test]
    fn a_backend_past_the_barrier_marks_is_refused_an_async_commit() {
        Spi::run("SELECT remus.migration_begin(9171, ARRAY[917101])").unwrap();
        Spi::run("SELECT remus.migration_capture(9171, 'http://127.0.0.1:1')").unwrap();
        let last = (MAX_PROCS - 1) as i32;
        let modes = enter_commit_as(&[9171], last).expect("within the marks");
        assert_eq!(modes, vec![(9171, CommitMode::Async)]);
        assert_ne!(STATE.share().async_commit[MAX_PROCS - 1], 0, "marked");
        STATE.exclusive().async_commit[MAX_PROCS - 1] = 0;
        let past = enter_commit_as(&[9171], MAX_PROCS as i32 + 3);
        Spi::run("SELECT remus.migration_end(9171)").unwrap();
        let e = past.expect_err("past the marks");
        assert_eq!(e.sqlstate(), "53000", "{e}");
    }

    /// A capturing migration validates behind the stream until its barrier is applied, then
    /// without it.
    #[pg_test]
    fn validations_wait_for_the_stream_until_the_barrier_is_applied() {
        let mode = || enter_commit_as(&[9172], 0).expect("a commit mode");
        let sync = |barrier_lsn| CommitMode::Sync {
            endpoint: "http://127.0.0.1:1".into(),
            barrier_lsn,
        };
        Spi::run("SELECT remus.migration_begin(9172, ARRAY[917201])").unwrap();
        Spi::run("SELECT remus.migration_capture(9172, 'http://127.0.0.1:1')").unwrap();
        Spi::run("SELECT remus.sync_barrier(9172)").unwrap();
        assert_eq!(mode(), vec![(9172, sync(None))]);
        Spi::run("SELECT remus.migration_barrier_applied(9172, 123456)").unwrap();
        assert_eq!(mode(), vec![(9172, sync(Some(123456)))]);
        Spi::run("SELECT remus.migration_end(9172)").unwrap();
    }
}
