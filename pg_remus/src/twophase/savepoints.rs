//! Savepoints follow subtransactions onto every remote transaction (PL/pgSQL exception blocks,
//! SAVEPOINT / ROLLBACK TO), so rolling back a subtransaction also undoes its remote work.
//! Driven by the `SubXactCallback` in `hooks::xact`.

use crate::cluster::remote;
use crate::error::RemusError;

thread_local! {
    /// Open subtransactions (innermost last). Each has a savepoint on every remote transaction.
    static SUBXACTS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A remote participant could not follow a savepoint release or rollback: the transaction
    /// can no longer commit consistently. Holds the error its commit will raise: the
    /// participant's own when it is a retryable 40xxx (e.g. a shard migration aborted it),
    /// `TransactionDoomed` otherwise.
    static DOOMED: std::cell::RefCell<Option<RemusError>> = const { std::cell::RefCell::new(None) };
}

pub(crate) fn savepoint_name(subid: u32) -> String {
    format!("remus_s{subid}")
}

/// A subtransaction `subid` started: a savepoint on every remote transaction.
pub(crate) fn start_sub(subid: u32) {
    SUBXACTS.with(|s| s.borrow_mut().push(subid));
    let mut failure = None;
    remote::for_each_in_transaction(|c| {
        if failure.is_none() {
            if let Err(e) = c.exec(&format!("SAVEPOINT {}", savepoint_name(subid))) {
                failure = Some(e);
            }
        }
    });
    if let Some(e) = failure {
        e.raise();
    }
}

/// Subtransaction `subid` ended (`commit`: released; otherwise rolled back).
pub(crate) fn end_sub(subid: u32, commit: bool) {
    SUBXACTS.with(|s| s.borrow_mut().retain(|x| *x != subid));
    remote::for_each_in_transaction(|c| {
        if !commit {
            c.cancel_running();
        }
        let sql = if commit {
            format!("RELEASE SAVEPOINT {}", savepoint_name(subid))
        } else {
            format!("ROLLBACK TO SAVEPOINT {}", savepoint_name(subid))
        };
        // No ERROR here (we may be in abort processing): a participant that cannot
        // follow dooms the transaction, which then fails at commit.
        if let Err(e) = c.exec_uninterruptible(&sql) {
            pgrx::warning!("pg_remus: {sql} on node {} failed: {e}", c.addr.name);
            c.broken = true;
            let retryable =
                matches!(&e, RemusError::Remote { sqlstate, .. } if sqlstate.starts_with("40"));
            DOOMED.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() || retryable {
                    *d = Some(if retryable {
                        e
                    } else {
                        RemusError::TransactionDoomed
                    });
                }
            });
        }
    });
}

/// The savepoints a remote transaction joining now must recreate (outermost first).
pub(crate) fn open() -> Vec<u32> {
    SUBXACTS.with(|s| s.borrow().clone())
}

/// The error a doomed transaction's commit raises, if a participant could not follow.
pub(crate) fn take_doomed() -> Option<RemusError> {
    DOOMED.with(|d| d.borrow_mut().take())
}

/// The transaction ended: no subtransaction is open, and the next one is not doomed.
pub(crate) fn end_of_transaction() {
    SUBXACTS.with(|s| s.borrow_mut().clear());
    DOOMED.with(|d| d.borrow_mut().take());
}
