//! Ownership of shards, per transaction.
//!
//! - A transaction's routing decision for a shard is made once, at its first use, with the
//!   snapshot of that statement, and pinned until the transaction ends (`pinned_owner`). So a
//!   transaction never sees a shard move under it, whatever the shard map says later.
//! - On the data node, `ExecutorStart` refuses a statement that reads or writes a shard table
//!   (`remus_shards.*`) this node does not own in the statement's snapshot, with SQLSTATE RM001.
//!   Statements carrying a coordinator's shard marker are exempt: they execute a routing
//!   decision already made (and pinned) by the coordinating backend. Sessions that apply
//!   replicated changes (a replication origin is set) and sessions of the migration machinery
//!   (`remus.migration_session`) are exempt too.
//! - Before that check, the migration handover primitives have their say (`handover`): the
//!   admission gate, aborted transactions, and the write fence of a moved shard.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;

static mut PREV_EXECUTOR_START: pg_sys::ExecutorStart_hook_type = None;

thread_local! {
    static PINS: RefCell<HashMap<i64, String>> = RefCell::new(HashMap::new());
}

pub fn install() {
    // SAFETY: process-global hook set once at preload, previous value chained.
    unsafe {
        PREV_EXECUTOR_START = pg_sys::ExecutorStart_hook;
        pg_sys::ExecutorStart_hook = Some(executor_start);
    }
}

/// The owner this transaction uses for `shard_id`: the pinned one, or `seen` (which becomes
/// the pin).
pub fn pinned_owner(shard_id: i64, seen: &str) -> String {
    PINS.with(|p| p.borrow_mut().entry(shard_id).or_insert_with(|| seen.to_string()).clone())
}

/// Has this transaction already routed `shard_id`?
pub fn is_pinned(shard_id: i64) -> bool {
    PINS.with(|p| p.borrow().contains_key(&shard_id))
}

pub fn end_of_transaction() {
    PINS.with(|p| p.borrow_mut().clear());
}

#[pg_guard]
unsafe extern "C-unwind" fn executor_start(query_desc: *mut pg_sys::QueryDesc, eflags: i32) {
    if let Err(e) = check(query_desc) {
        e.raise();
    }
    match PREV_EXECUTOR_START {
        Some(prev) => prev(query_desc, eflags),
        None => pg_sys::standard_ExecutorStart(query_desc, eflags),
    }
}

unsafe fn check(query_desc: *mut pg_sys::QueryDesc) -> Result<(), RemusError> {
    if !super::extension_present() || pg_sys::replorigin_session_origin != 0 || crate::guc::MIGRATION_SESSION.get() {
        return Ok(());
    }
    crate::handover::admit_statement()?;
    let stmt = (*query_desc).plannedstmt;
    if stmt.is_null() {
        return Ok(());
    }
    let shard_nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), true);
    if shard_nsp == pg_sys::InvalidOid {
        return Ok(());
    }
    let mut shards = Vec::new();
    for rte in super::list_ptrs::<pg_sys::RangeTblEntry>((*stmt).rtable) {
        if (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION || pg_sys::get_rel_namespace((*rte).relid) != shard_nsp {
            continue;
        }
        let name = pg_sys::get_rel_name((*rte).relid);
        if name.is_null() {
            continue;
        }
        let name = CStr::from_ptr(name).to_string_lossy();
        if let Some(id) = name.rsplit('_').next().and_then(|s| s.parse::<i64>().ok()) {
            shards.push(id);
        }
    }
    if shards.is_empty() {
        return Ok(());
    }
    // A write reaching a fenced shard was routed with a stale map, marker or not.
    if (*query_desc).operation != pg_sys::CmdType::CMD_SELECT {
        crate::handover::check_write(&shards)?;
    }
    if super::marker_honoured() && super::shard_marker((*query_desc).sourceText).is_some() {
        return Ok(());
    }
    let me = crate::guc::node_name().unwrap_or_default();
    for shard_id in shards {
        // Read with the statement's snapshot (the active one): what this statement may see.
        let owner = crate::catalog::read_one::<String>(
            "SELECT max(node_name) FROM remus.shard_map WHERE shard_id = $1",
            &[shard_id.into()],
        )?;
        if let Some(owner) = owner {
            if owner != me {
                return Err(RemusError::NotShardOwner { shard_id, node: me });
            }
        }
    }
    Ok(())
}
