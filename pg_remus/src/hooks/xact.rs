//! The transaction and subtransaction callbacks, registered once (pgrx's per-transaction
//! callbacks would be lost at the first commit). Order within each event:
//!
//! 1. dual execution (`migration::dual`): a write set refused by the destination fails the
//!    transaction before any remote participant is prepared;
//! 2. at the end of the transaction: the router's pins, the handover's victim marks, and the
//!    2PC savepoint state;
//! 3. 2PC (`twophase`): prepare / commit / roll back the remote participants.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::migration::{catchup, dual};
use crate::twophase::{self, savepoints};

pub(super) fn install() {
    // SAFETY: registering static function pointers with no argument; done once at preload.
    unsafe {
        pg_sys::RegisterXactCallback(Some(xact_callback), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(subxact_callback), std::ptr::null_mut());
    }
}

/// Savepoints follow subtransactions onto every remote transaction; a rolled-back
/// subtransaction's captured writes leave the write set first.
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
        SUBXACT_EVENT_START_SUB => savepoints::start_sub(subid),
        SUBXACT_EVENT_COMMIT_SUB | SUBXACT_EVENT_ABORT_SUB => {
            if event == SUBXACT_EVENT_ABORT_SUB {
                catchup::subxact_aborted(my_subid);
            }
            savepoints::end_sub(subid, event == SUBXACT_EVENT_COMMIT_SUB);
        }
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn xact_callback(
    event: pg_sys::XactEvent::Type,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::XactEvent::*;
    // A node-to-node session's transaction ran as the entry node's role: its commit work and
    // whatever follows are the node user's again.
    crate::cluster::forwarded_role::leave();
    // Dual execution first: a write set refused by the destination fails the transaction
    // before any remote participant is prepared.
    match event {
        XACT_EVENT_PRE_COMMIT | XACT_EVENT_PRE_PREPARE => {
            if let Err(e) = dual::pre_commit() {
                e.raise();
            }
        }
        XACT_EVENT_COMMIT => dual::end_of_transaction(true),
        XACT_EVENT_ABORT => dual::end_of_transaction(false),
        XACT_EVENT_PREPARE => dual::prepared(),
        _ => {}
    }
    let ended = matches!(
        event,
        XACT_EVENT_COMMIT
            | XACT_EVENT_PARALLEL_COMMIT
            | XACT_EVENT_ABORT
            | XACT_EVENT_PARALLEL_ABORT
    );
    if ended || event == XACT_EVENT_PREPARE {
        crate::router::placement::end_of_transaction();
        crate::router::shapes::end_of_transaction();
        crate::migration::handover::lock_abort::end_of_transaction();
        savepoints::end_of_transaction();
    }
    twophase::on_xact_event(event);
    // Once 2PC is done with them: the connections' per-transaction state goes, and so do the
    // connections kept only for this transaction (the drain fence's, review F19; a statement
    // forwarded here and fenced here has no remote participant at all) and broken ones.
    if ended {
        crate::cluster::remote::end_of_transaction();
    }
}
