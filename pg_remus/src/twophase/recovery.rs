//! Resolution of in-doubt prepared transactions that this node coordinated.
//!
//! A gid is `remus_<coordinator>_<xid>_<participant>`. For each one prepared on a peer:
//! the local transaction still running → leave it; a decision row exists → COMMIT PREPARED;
//! no row → the local transaction aborted (or never reached its commit, also when a crash lost
//! all of its WAL and its xid is ahead of the restarted node's counter) → ROLLBACK PREPARED.
//! Decision rows whose prepared transaction is gone everywhere are then deleted.
//!
//! A transaction prepared less than [`IN_DOUBT_GRACE`] ago is left alone (and its decision row
//! kept): its coordinating backend runs the second phase itself right after its local commit,
//! and a recovery round stepping in between would race it for the same gid ("busy" or "does
//! not exist" on one side, and a dropped connection).

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::cluster::{nodes, remote};
use crate::error::OrRaise;
use crate::error::RemusError;
use crate::pg::sql::quote_literal;

#[derive(Debug, Default, Clone, Copy)]
pub struct RecoveryStats {
    pub committed: i64,
    pub rolled_back: i64,
    pub in_progress: i64,
}

/// How long a prepared transaction belongs to its coordinating backend before recovery may
/// finish it (a PostgreSQL interval).
const IN_DOUBT_GRACE: &str = "5 seconds";

/// Whether local transaction `xid` may still be running. An xid at or past this node's next
/// xid was never assigned since the node's last start: a crash can lose a coordinating
/// transaction's only WAL (its decision rows, never flushed, no commit record), and its xid
/// then lies ahead of the restarted node's counter. `TransactionIdIsInProgress` answers true
/// for such an xid (it follows latestCompletedXid), which kept its participants prepared, and
/// their row locks held, until the node happened to assign xids past it (a node with no
/// writes: forever). It did not commit here, so its participants are rolled back.
fn may_be_running(xid: u32) -> bool {
    let xid = pg_sys::TransactionId::from(xid);
    // SAFETY: reads the shared next-xid counter (under XidGenLock, taken inside) and probes
    // the proc array read-only.
    unsafe {
        let next = pg_sys::ReadNextFullTransactionId();
        let next_xid = pg_sys::TransactionId::from((next.value & 0xffff_ffff) as u32);
        !pg_sys::TransactionIdFollowsOrEquals(xid, next_xid)
            && pg_sys::TransactionIdIsInProgress(xid)
    }
}

fn parse_xid(gid: &str, me: &str) -> Option<u32> {
    gid.strip_prefix(&format!("remus_{me}_"))?
        .split('_')
        .next()?
        .parse()
        .ok()
}

pub fn recover() -> Result<RecoveryStats, RemusError> {
    if remote::any_in_transaction() {
        return Err(RemusError::Unsupported(
            "recovery cannot run inside a transaction that uses other nodes",
        ));
    }
    let me = crate::guc::node_name().ok_or(RemusError::NodeNameUnset)?;
    let mut stats = RecoveryStats::default();
    let mut still_prepared: Vec<String> = Vec::new();
    // Peers whose prepared transactions were listed in this round. A decision row may only be
    // dropped when its participant was listed: a peer that is down right now may still hold
    // the prepared transaction, and without the row it would be rolled back after its restart.
    let mut listed: Vec<String> = Vec::new();
    for peer in nodes::all_nodes()?.into_iter().filter(|n| n.name != me) {
        let pattern = format!("remus\\_{me}\\_%");
        let listing = remote::with_connection(&peer, |c| {
            c.exec(&format!(
                "SELECT gid, (prepared > now() - interval {})::text FROM pg_prepared_xacts
                  WHERE gid LIKE {} AND database = current_database()",
                quote_literal(IN_DOUBT_GRACE),
                quote_literal(&pattern)
            ))
        });
        let rows = match listing {
            Ok(r) => {
                listed.push(peer.name.clone());
                r.rows
            }
            Err(e) => {
                pgrx::warning!("pg_remus recovery: node {} unreachable: {e}", peer.name);
                continue;
            }
        };
        for row in rows {
            let mut cols = row.into_iter();
            let Some(gid) = cols.next().flatten() else {
                continue;
            };
            let young = cols.next().flatten().as_deref() == Some("true");
            let Some(xid) = parse_xid(&gid, &me) else {
                continue;
            };
            if young || may_be_running(xid) {
                stats.in_progress += 1;
                still_prepared.push(gid);
                continue;
            }
            let decided = Spi::get_one_with_args::<bool>(
                "SELECT EXISTS (SELECT 1 FROM remus.commit_decisions WHERE gid = $1)",
                &[gid.as_str().into()],
            )?
            .unwrap_or(false);
            let verb = if decided { "COMMIT" } else { "ROLLBACK" };
            let done = remote::with_connection(&peer, |c| {
                c.exec(&format!("{verb} PREPARED {}", quote_literal(&gid)))
            });
            match done {
                Ok(_) if decided => stats.committed += 1,
                Ok(_) => stats.rolled_back += 1,
                Err(e) => {
                    pgrx::warning!(
                        "pg_remus recovery: {verb} PREPARED {gid} on {}: {e}",
                        peer.name
                    );
                    still_prepared.push(gid);
                }
            }
        }
    }
    // Rows of transactions still running locally may not be prepared yet: keep those.
    let rows: Vec<(String, String)> = Spi::connect(|c| {
        c.select(
            "SELECT gid, participant FROM remus.commit_decisions",
            None,
            &[],
        )?
        .map(|r| {
            Ok((
                r.get::<String>(1)?.unwrap_or_default(),
                r.get::<String>(2)?.unwrap_or_default(),
            ))
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })?;
    for (gid, participant) in rows {
        let running = parse_xid(&gid, &me).is_some_and(may_be_running);
        if !running && listed.contains(&participant) && !still_prepared.contains(&gid) {
            Spi::run_with_args(
                "DELETE FROM remus.commit_decisions WHERE gid = $1",
                &[gid.as_str().into()],
            )?;
        }
    }
    Ok(stats)
}

/// Resolves in-doubt prepared transactions this node coordinated; returns how many were
/// committed, rolled back, and are still running.
#[pg_extern]
fn remus_recover_prepared() -> TableIterator<
    'static,
    (
        name!(committed, i64),
        name!(rolled_back, i64),
        name!(in_progress, i64),
    ),
> {
    let s = recover().or_raise();
    TableIterator::once((s.committed, s.rolled_back, s.in_progress))
}
