//! Atomic commit of transactions that touched other nodes.
//!
//! A permanent `XactCallback` (registered once in `_PG_init`; pgrx's per-transaction callbacks
//! would be lost at the first commit) drives the remote transactions:
//! - PRE_COMMIT: with writes on more than one node (a remote writer plus a local write, or two
//!   remote writers), record the decision for every remote writer in `remus.commit_decisions`
//!   inside the local transaction, then PREPARE TRANSACTION on each writer. Any failure is an
//!   ERROR, and the abort path rolls everything back: nothing is half-committed. Read-only
//!   participants and a lone remote writer just COMMIT here; a cancel arriving during that
//!   COMMIT is forwarded to the participant, and its answer is the transaction's outcome (an
//!   error raised here after the participant committed would misreport a committed transaction).
//! - COMMIT (after the local commit is durable): COMMIT PREPARED everywhere. This may not raise:
//!   a failure is a WARNING, and recovery commits it later from the recorded decision.
//! - ABORT: cancel what is running remotely, then ROLLBACK / ROLLBACK PREPARED.
//!
//! The decision row commits atomically with the local transaction, so "a record exists" means
//! "commit", and "no record and the local transaction is over" means "roll back" (as Citus's
//! pg_dist_transaction).

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::remote::{self, quote_literal};

thread_local! {
    /// Open subtransactions (innermost last). Each has a savepoint on every remote transaction.
    static SUBXACTS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A remote participant could not follow a savepoint release or rollback: the transaction
    /// can no longer commit consistently. Holds the error its commit will raise: the
    /// participant's own when it is a retryable 40xxx (e.g. a shard migration aborted it),
    /// `TransactionDoomed` otherwise.
    static DOOMED: std::cell::RefCell<Option<RemusError>> = const { std::cell::RefCell::new(None) };
}

pub fn register_callbacks() {
    // SAFETY: registering static function pointers with no argument; done once at preload.
    unsafe {
        pg_sys::RegisterXactCallback(Some(xact_callback), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(subxact_callback), std::ptr::null_mut());
    }
}

fn savepoint_name(subid: u32) -> String {
    format!("remus_s{subid}")
}

/// Savepoints follow subtransactions onto every remote transaction (PL/pgSQL exception blocks,
/// SAVEPOINT / ROLLBACK TO), so rolling back a subtransaction also undoes its remote work.
#[pg_guard]
unsafe extern "C-unwind" fn subxact_callback(
    event: pg_sys::SubXactEvent::Type,
    my_subid: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    let subid: u32 = my_subid;
    match event {
        SUBXACT_EVENT_START_SUB => {
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
        SUBXACT_EVENT_COMMIT_SUB | SUBXACT_EVENT_ABORT_SUB => {
            if event == SUBXACT_EVENT_ABORT_SUB {
                crate::mocc::subxact_aborted(my_subid);
            }
            SUBXACTS.with(|s| s.borrow_mut().retain(|x| *x != subid));
            let commit = event == SUBXACT_EVENT_COMMIT_SUB;
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
                    let retryable = matches!(&e, RemusError::Remote { sqlstate, .. } if sqlstate.starts_with("40"));
                    DOOMED.with(|d| {
                        let mut d = d.borrow_mut();
                        if d.is_none() || retryable {
                            *d = Some(if retryable { e } else { RemusError::TransactionDoomed });
                        }
                    });
                }
            });
        }
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn xact_callback(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    // Dual execution first: a write set refused by the destination fails the transaction
    // before any remote participant is prepared.
    match event {
        XACT_EVENT_PRE_COMMIT | XACT_EVENT_PRE_PREPARE => {
            if let Err(e) = crate::mocc::pre_commit() {
                e.raise();
            }
        }
        XACT_EVENT_COMMIT => crate::mocc::end_of_transaction(true),
        XACT_EVENT_ABORT => crate::mocc::end_of_transaction(false),
        XACT_EVENT_PREPARE => crate::mocc::prepared(),
        _ => {}
    }
    if matches!(
        event,
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT | XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT | XACT_EVENT_PREPARE
    ) {
        crate::router::ownership::end_of_transaction();
        crate::handover::end_of_transaction();
        SUBXACTS.with(|s| s.borrow_mut().clear());
        DOOMED.with(|d| d.borrow_mut().take());
    }
    if !remote::any_in_transaction() {
        return;
    }
    match event {
        XACT_EVENT_PRE_COMMIT | XACT_EVENT_PARALLEL_PRE_COMMIT => {
            if let Err(e) = pre_commit() {
                e.raise();
            }
        }
        XACT_EVENT_PRE_PREPARE => RemusError::FeatureNotSupported(
            "PREPARE TRANSACTION is not supported in a transaction that used other nodes".into(),
        )
        .raise(),
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => {
            finish(true);
            remote::end_of_transaction();
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            finish(false);
            remote::end_of_transaction();
        }
        _ => {}
    }
}

/// Does this transaction write on more than one node?
fn needs_two_phase(remote_writers: usize) -> bool {
    // SAFETY: reads the current transaction's xid without assigning one.
    let local_write = unsafe { pg_sys::GetTopTransactionIdIfAny() } != pg_sys::InvalidTransactionId;
    remote_writers >= 2 || (remote_writers == 1 && local_write)
}

fn local_node() -> String {
    crate::guc::node_name().unwrap_or_else(|| "node".into())
}

fn pre_commit() -> Result<(), RemusError> {
    if let Some(e) = DOOMED.with(|d| d.borrow_mut().take()) {
        return Err(e);
    }
    let mut writers = Vec::new();
    remote::for_each_in_transaction(|c| {
        if c.modified {
            writers.push(c.addr.clone());
        }
    });
    if !needs_two_phase(writers.len()) {
        let mut failure = None;
        remote::for_each_in_transaction(|c| {
            if failure.is_none() {
                // This COMMIT decides the transaction: a cancel meanwhile goes to the
                // participant, and the client hears what the participant did.
                if let Err(e) = c.exec_forwarding_cancel("COMMIT") {
                    failure = Some(e);
                }
                // A COMMIT refused before it ran (e.g. a transaction a migration aborted) leaves
                // the remote block open and failed: the abort callback must roll it back.
                c.in_transaction = c.status_ok() && !c.transaction_idle();
            }
        });
        return failure.map_or(Ok(()), Err);
    }
    // SAFETY: assigns (or returns) the top-level xid; the decision rows below need one anyway.
    let xid = unsafe { pg_sys::GetTopTransactionId() };
    let me = local_node();
    // PRE_COMMIT runs after the portal's snapshot is gone; SPI needs an active one.
    // SAFETY: push/pop are paired on every path below (errors abort the transaction, and
    // abort processing pops the active-snapshot stack).
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
    for w in &writers {
        let gid = format!("remus_{me}_{xid}_{}", w.name);
        Spi::run_with_args(
            "INSERT INTO remus.commit_decisions (gid, participant) VALUES ($1, $2)",
            &[gid.as_str().into(), w.name.as_str().into()],
        )?;
    }
    // SAFETY: pairs the push above.
    unsafe { pg_sys::PopActiveSnapshot() };
    let mut failure = None;
    remote::for_each_in_transaction(|c| {
        if failure.is_some() {
            return;
        }
        let sql = if c.modified {
            let gid = format!("remus_{me}_{xid}_{}", c.addr.name);
            // Recorded before the PREPARE is sent: an interrupt (a cancel, statement_timeout, a
            // lock_abort migration) can raise out of the wait while the participant completes
            // the PREPARE anyway, and the abort path must then roll back what may be prepared.
            // Left alone, such an orphan holds its row locks until recovery's grace period.
            c.prepared_gid = Some(gid.clone());
            let r = c.exec(&format!("PREPARE TRANSACTION {}", quote_literal(&gid)));
            // The participant's own error proves nothing was prepared; a lost connection
            // proves nothing either way (recovery rolls back an orphan without a decision).
            if matches!(r, Err(RemusError::Remote { .. })) {
                c.prepared_gid = None;
            }
            r
        } else {
            let r = c.exec("COMMIT");
            c.in_transaction = c.status_ok() && !c.transaction_idle();
            r
        };
        if let Err(e) = sql {
            failure = Some(e);
        }
    });
    failure.map_or(Ok(()), Err)
}

/// Second phase (commit) or rollback. Never raises: the local outcome is already decided.
fn finish(commit: bool) {
    remote::for_each_in_transaction(|c| {
        // Unless committing what is prepared there, first take the outcome of whatever still
        // runs there (an interrupted PREPARE included): an idle connection afterwards means the
        // PREPARE ran, or the participant's block is already over; a block still open means
        // neither did.
        if !commit || c.prepared_gid.is_none() {
            c.cancel_running();
        }
        let sql = match &c.prepared_gid {
            Some(gid) if commit => format!("COMMIT PREPARED {}", quote_literal(gid)),
            Some(gid) if c.transaction_idle() => format!("ROLLBACK PREPARED {}", quote_literal(gid)),
            // Nothing prepared and nothing open: a read-only or lone writer's COMMIT ran in
            // PRE_COMMIT, or the participant's block already ended.
            None if c.transaction_idle() => return,
            _ => "ROLLBACK".to_string(),
        };
        match c.exec_uninterruptible(&sql) {
            Ok(_) => {}
            // The interrupted PREPARE failed there after all: nothing to roll back.
            Err(RemusError::Remote { sqlstate, .. })
                if sqlstate == "42704" && sql.starts_with("ROLLBACK PREPARED") => {}
            Err(e) => {
                // Commit: recovery finishes it from the decision record. Abort: recovery rolls
                // back a prepared orphan (no record), and a plain remote transaction dies with
                // the connection, which we drop.
                pgrx::warning!("pg_remus: {sql} on node {} failed: {e}", c.addr.name);
                c.broken = true;
            }
        }
    });
}

/// Opens (once per local transaction) a remote transaction on `addr` at the local isolation
/// level, then runs `sql` in it. `writes` marks the participant for two-phase commit.
pub fn exec_in_transaction(
    addr: &remote::NodeAddr,
    sql: &str,
    writes: bool,
) -> Result<remote::RemoteResult, RemusError> {
    exec_params_in_transaction(addr, sql, &[], &[], writes)
}

/// [`exec_in_transaction`] for one statement with text parameters.
pub fn exec_params_in_transaction(
    addr: &remote::NodeAddr,
    sql: &str,
    params: &[Option<String>],
    types: &[u32],
    writes: bool,
) -> Result<remote::RemoteResult, RemusError> {
    remote::with_connection(addr, |c| {
        if !c.in_transaction {
            // SAFETY: plain read of a backend global.
            let iso = match unsafe { pg_sys::XactIsoLevel } as u32 {
                pg_sys::XACT_SERIALIZABLE => "SERIALIZABLE",
                pg_sys::XACT_REPEATABLE_READ => "REPEATABLE READ",
                _ => "READ COMMITTED",
            };
            c.exec(&format!("BEGIN ISOLATION LEVEL {iso}"))?;
            c.in_transaction = true;
            // Joining inside subtransactions: recreate their savepoints here too.
            let open: Vec<u32> = SUBXACTS.with(|s| s.borrow().clone());
            for subid in open {
                c.exec(&format!("SAVEPOINT {}", savepoint_name(subid)))?;
            }
        }
        if writes {
            c.modified = true;
        }
        c.exec_params(sql, params, types)
    })
}

/// Streams COPY text into `sql` (a `COPY … FROM STDIN`) on `addr`, as a writing participant of
/// the current transaction.
pub fn copy_in_transaction(addr: &remote::NodeAddr, sql: &str, data: &[u8]) -> Result<(), RemusError> {
    exec_in_transaction(addr, "SELECT 1", true)?;
    remote::with_connection(addr, |c| c.copy_in(sql, data))?;
    Ok(())
}
