//! Ownership of shards, per transaction.
//!
//! - A transaction's routing decision for a shard is made once and pinned until the transaction
//!   ends (`router::placement::pinned_owner`).
//! - On the data node, `ExecutorStart` refuses a statement that reads or writes a shard table
//!   (`remus_shards.*`) this node does not own in the statement's snapshot, with SQLSTATE RM001.
//!   Statements carrying a coordinator's shard marker are exempt: they execute a routing
//!   decision already made (and pinned) by the coordinating backend. Sessions that apply
//!   replicated changes (a replication origin is set) and sessions of the migration machinery
//!   (`remus.migration_session`) are exempt too. The hook itself is `hooks::executor_start`.
//! - Before that check, the migration handover primitives have their say (`migration::handover`): the
//!   admission gate, aborted transactions, the write fence of a moved shard, and, after a
//!   restart that lost a migration's state, the refusal of writes on a copy that is moving
//!   away (`migration::handover::restart`).

use pgrx::pg_sys;

use crate::error::RemusError;

/// Refuses a statement on shard tables this node does not own (RM001), after the handover checks.
///
/// # Safety
/// `query_desc` must be the QueryDesc that ExecutorStart is starting.
pub(crate) unsafe fn check(query_desc: *mut pg_sys::QueryDesc) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if !crate::pg::extension::extension_present()
            || pg_sys::replorigin_session_origin != 0
            || crate::guc::MIGRATION_SESSION.get()
        {
            return Ok(());
        }
        crate::migration::handover::admit_statement()?;
        let stmt = (*query_desc).plannedstmt;
        if stmt.is_null() {
            return Ok(());
        }
        // squall: a statement on shards still being pulled to this node waits for them, also
        // one that executes a routing decision (`migration::squall`); a statement that waited
        // for a migration (squall's pull, albatross's suspension) runs with a newer snapshot.
        crate::migration::squall::wait_for_pulls(query_desc)?;
        // A read that executes a routing decision has nothing left to check (the checks below
        // that are not exempt for it are for writes): the local plan's nested statement. A
        // `RemusRouter` plan makes the decision itself: its range table names the shells (no
        // shard table to check), or, for a spliced local plan, the shard tables it guessed at
        // plan time and runs only if execution decides they are this node's (and, for a
        // write, after the handover's write checks below, which the router runs itself).
        if ((*query_desc).operation == pg_sys::CmdType::CMD_SELECT
            && crate::router::local::decided())
            || crate::router::modify::is_router_plan(stmt)
        {
            return Ok(());
        }
        let shards = shard_ids(stmt);
        if shards.is_empty() {
            return Ok(());
        }
        // A write reaching a fenced shard was routed with a stale map, marker or not.
        if (*query_desc).operation != pg_sys::CmdType::CMD_SELECT {
            crate::migration::handover::lock_abort::check_write(&shards)?;
            // After a restart that lost a migration's state: no unvalidated write on a copy
            // the migration moves away (review finding F4).
            crate::migration::handover::restart::check_write(&shards)?;
        }
        if crate::router::local::decided()
            || crate::router::marker::marked_shard((*query_desc).sourceText).is_some()
        {
            return Ok(());
        }
        let me = crate::guc::node_name().unwrap_or_default();
        for shard_id in shards {
            // Read with the statement's snapshot (the active one): what this statement may see.
            let owner = crate::pg::spi::read_one::<String>(
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
}

/// The shard ids of the shard tables (`remus_shards.*`) in `stmt`'s range table.
///
/// # Safety
/// `stmt` must be a valid PlannedStmt.
unsafe fn shard_ids(stmt: *mut pg_sys::PlannedStmt) -> Vec<i64> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe { crate::catalog::shard_rtes(stmt) }
        .into_iter()
        .map(|(_, _, shard_id)| shard_id)
        .collect()
}
