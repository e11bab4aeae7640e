//! Atomic commit of transactions that touched other nodes.
//!
//! The permanent `XactCallback` (installed once by `hooks::xact`; pgrx's per-transaction callbacks
//! would be lost at the first commit) drives the remote transactions through [`on_xact_event`]:
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
//! An autocommit statement that is its transaction's only work and runs on one other node is
//! that node's transaction of its own, with no remote BEGIN or COMMIT: a read
//! ([`exec_params_alone`]) or a write ([`exec_write_alone`], whose participant's answer is the
//! outcome, as for a lone writer's COMMIT).
//!
//! The decision row commits atomically with the local transaction, so "a record exists" means
//! "commit", and "no record and the local transaction is over" means "roll back" (as Citus's
//! pg_dist_transaction).
//!
//! - [`savepoints`]: subtransactions mirrored on every remote transaction.
//! - [`recovery`]: resolving in-doubt prepared transactions from the recorded decisions.
//! - [`worker`]: the background worker that runs recovery on every node.

use pgrx::pg_sys;
use pgrx::prelude::*;
use remus_proto::sqlstate::SqlState;

use crate::cluster::{remote, shard_marker};
use crate::error::RemusError;
use crate::pg::sql::quote_literal;

pub(crate) mod recovery;
pub(crate) mod savepoints;
pub(crate) mod worker;

/// The transaction callback's 2PC part (after dual execution and the end-of-transaction
/// bookkeeping of the other features, see `hooks::xact`, which then clears the connections'
/// per-transaction state).
pub(crate) fn on_xact_event(event: pg_sys::XactEvent::Type) {
    use pg_sys::XactEvent::*;
    if !remote::any_in_transaction() {
        return;
    }
    match event {
        XACT_EVENT_PRE_COMMIT | XACT_EVENT_PARALLEL_PRE_COMMIT => {
            if let Err(e) = pre_commit() {
                e.raise();
            }
        }
        XACT_EVENT_PRE_PREPARE => RemusError::Unsupported(
            "PREPARE TRANSACTION is not supported in a transaction that used other nodes",
        )
        .raise(),
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => finish(true),
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => finish(false),
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
    if let Some(e) = savepoints::take_doomed() {
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
        crate::pg::spi::as_extension_owner(|| {
            Spi::run_with_args(
                "INSERT INTO remus.commit_decisions (gid, participant) VALUES ($1, $2)",
                &[gid.as_str().into(), w.name.as_str().into()],
            )
        })?;
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
    if failure.is_none() {
        crate::guc::crash_point("after_prepare");
    }
    failure.map_or(Ok(()), Err)
}

/// Second phase (commit) or rollback. Never raises: the local outcome is already decided.
fn finish(commit: bool) {
    if commit {
        crate::guc::crash_point("after_local_commit");
    }
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
            Some(gid) if c.transaction_idle() => {
                format!("ROLLBACK PREPARED {}", quote_literal(gid))
            }
            // Nothing prepared and nothing open: a read-only or lone writer's COMMIT ran in
            // PRE_COMMIT, or the participant's block already ended.
            None if c.transaction_idle() => return,
            _ => "ROLLBACK".to_string(),
        };
        match c.exec_uninterruptible(&sql) {
            Ok(_) => {}
            // The interrupted PREPARE failed there after all: nothing to roll back.
            Err(RemusError::Remote { sqlstate, .. })
                if *sqlstate == SqlState::UNDEFINED_OBJECT
                    && sql.starts_with("ROLLBACK PREPARED") => {}
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
        c.act_as_caller()?;
        let opening = transaction_opening(c);
        if writes {
            c.modified = true;
        }
        if !opening.is_empty() && params.is_empty() {
            // One round trip: the remote transaction opens in the same simple query as its
            // first statement (it runs in the block BEGIN opened, as if sent after it). A shard
            // marker stays at the start of the text, where the remote looks for it.
            let opening: String = opening.iter().map(|o| format!("{o}; ")).collect();
            let text = match shard_marker::split(sql) {
                Some((marker, rest)) => format!("{marker}{opening}{rest}"),
                None => format!("{opening}{sql}"),
            };
            return c.exec(&text);
        }
        // With parameters: the opening statements and the statement in one flight (extended
        // protocol, pipelined), one round trip too.
        c.exec_params_after(&opening, sql, params, types)
    })
}

/// Runs one read-only statement on `addr` as a transaction of its own there (autocommit, one
/// round trip instead of BEGIN, the statement and COMMIT), for a local transaction whose only
/// remote work it is: the router decides that (`router::modify`). A remote transaction already
/// open on `addr` is used as [`exec_params_in_transaction`] would.
pub fn exec_params_alone(
    addr: &remote::NodeAddr,
    sql: &str,
    params: &[Option<String>],
    types: &[u32],
) -> Result<remote::RemoteResult, RemusError> {
    remote::with_connection(addr, |c| {
        c.act_as_caller()?;
        c.exec_params(sql, params, types)
    })
}

/// Runs one write on `addr` as a transaction of its own there (autocommit: one round trip, no
/// remote BEGIN, no COMMIT), for a local autocommit statement whose only work it is (the
/// router decides that, `router::modify`). Its outcome is the local transaction's, so a
/// cancel, statement_timeout or terminate arriving while it runs is forwarded to the
/// participant and its answer is what the client hears: its error (the write rolled back
/// there), or its success (the write committed before the cancel could stop it), in which
/// case the cancel is spent here too, as PostgreSQL completes a statement whose cancel
/// arrives while it commits.
pub fn exec_write_alone(
    addr: &remote::NodeAddr,
    sql: &str,
    params: &[Option<String>],
    types: &[u32],
) -> Result<remote::RemoteResult, RemusError> {
    let (r, forwarded) = remote::with_connection(addr, |c| {
        c.act_as_caller()?;
        c.exec_params_forwarding_cancel(sql, params, types)
    })?;
    if forwarded {
        // SAFETY: this backend's own flag; ProcessInterrupts finds nothing left to do.
        unsafe { pg_sys::QueryCancelPending = 0 };
    }
    Ok(r)
}

/// Runs read-only statements on several nodes concurrently, in the local transaction: each
/// node's statements one after another, the nodes at the same time, and `meanwhile` here while
/// they run. Returns each node's results, in the order of `work`, and `meanwhile`'s.
pub fn read_on_nodes<T>(
    work: &[(remote::NodeAddr, Vec<String>)],
    meanwhile: impl FnOnce() -> Result<T, RemusError>,
) -> Result<(Vec<Vec<remote::RemoteResult>>, T), RemusError> {
    let addrs: Vec<remote::NodeAddr> = work.iter().map(|(a, _)| a.clone()).collect();
    remote::with_connections(&addrs, |conns| {
        for (c, (_, statements)) in conns.iter_mut().zip(work) {
            c.act_as_caller()?;
            join_transaction(c)?;
            if let Some(first) = statements.first() {
                c.send(first)?;
            }
        }
        let here = meanwhile()?;
        let mut results: Vec<Vec<remote::RemoteResult>> = work
            .iter()
            .map(|(_, s)| Vec::with_capacity(s.len()))
            .collect();
        // In rounds, so that every node has its next statement as soon as it is done.
        let rounds = work.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
        for round in 0..rounds {
            for ((c, (_, statements)), mine) in conns.iter_mut().zip(work).zip(&mut results) {
                if round < statements.len() {
                    mine.push(c.receive()?);
                    if let Some(next) = statements.get(round + 1) {
                        c.send(next)?;
                    }
                }
            }
        }
        Ok((results, here))
    })
}

/// Opens, once per local transaction, the remote transaction on `c` at the local isolation
/// level, with the savepoints the local transaction has open.
fn join_transaction(c: &mut remote::RemoteConnection) -> Result<(), RemusError> {
    let opening = transaction_opening(c);
    if !opening.is_empty() {
        c.exec(&opening.join("; "))?;
    }
    Ok(())
}

/// The statements that open, once per local transaction, the remote transaction on `c` at the
/// local isolation level, with the savepoints the local transaction has open, for the caller to
/// send in this order; none when it is open already. The connection counts as in
/// the transaction from here on: an ERROR raised while they run (a cancel) leaves the abort
/// path to cancel and roll back whatever they started there.
fn transaction_opening(c: &mut remote::RemoteConnection) -> Vec<String> {
    if c.in_transaction {
        return Vec::new();
    }
    // SAFETY: plain read of a backend global.
    let iso = match unsafe { pg_sys::XactIsoLevel } as u32 {
        pg_sys::XACT_SERIALIZABLE => "SERIALIZABLE",
        pg_sys::XACT_REPEATABLE_READ => "REPEATABLE READ",
        _ => "READ COMMITTED",
    };
    c.in_transaction = true;
    let mut opening = vec![format!("BEGIN ISOLATION LEVEL {iso}")];
    // Joining inside subtransactions: recreate their savepoints there too.
    opening.extend(
        savepoints::open()
            .into_iter()
            .map(|subid| format!("SAVEPOINT {}", savepoints::savepoint_name(subid))),
    );
    opening
}

/// Streams COPY text into `sql` (a `COPY … FROM STDIN`) on `addr`, as a writing participant of
/// the current transaction.
pub fn copy_in_transaction(
    addr: &remote::NodeAddr,
    sql: &str,
    data: &[u8],
) -> Result<(), RemusError> {
    exec_in_transaction(addr, "SELECT 1", true)?;
    remote::with_connection(addr, |c| c.copy_in(sql, data))?;
    Ok(())
}
