//! The planner hook's decision (the hook itself is `hooks::planner`): a marked statement is pinned
//! to its local shard, INSERT / UPDATE / DELETE on a shell become a `RemusRouter` plan
//! ([`super::modify`]), a statement whose distributed tables are all tied to one key value
//! runs as one statement on its shard group, and the forms the router cannot run correctly are refused.
//! Everything else is planned by PostgreSQL (scans of shells then become `RemusShardScan`s).

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::pg::extension::extension_present;
use crate::router::local::PlanContext;
use crate::router::marker::{marked_shard, pin_to_local_shard};
use crate::router::placement::{shells_anywhere, shells_in};
use crate::router::{colocated, fanout, modify};

/// Decides how a statement is planned. `Ok(None)`: by PostgreSQL (the scan hook may still
/// replace shell scans).
///
/// # Safety
/// `parse` must be the planner's Query and `query_string` its NUL-terminated text (or NULL).
pub(crate) unsafe fn route(
    parse: *mut pg_sys::Query,
    ctx: &PlanContext,
) -> Result<Option<*mut pg_sys::PlannedStmt>, RemusError> {
    let query_string = ctx.query_string;
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if parse.is_null()
            || (*parse).commandType == pg_sys::CmdType::CMD_UTILITY
            || !extension_present()
        {
            return Ok(None);
        }
        if let Some(shard_id) = marked_shard(query_string) {
            pin_to_local_shard(parse, shard_id)?;
            return Ok(None);
        }
        let cmd = (*parse).commandType;
        if (*parse).hasModifyingCTE && !shells_anywhere(parse)?.is_empty() {
            return Err(RemusError::Unsupported(
                "a data-modifying WITH (INSERT, UPDATE or DELETE in WITH) in a statement on distributed tables",
            ));
        }
        if cmd == pg_sys::CmdType::CMD_INSERT
            || cmd == pg_sys::CmdType::CMD_UPDATE
            || cmd == pg_sys::CmdType::CMD_DELETE
        {
            let rt = (*parse).resultRelation as usize;
            let shells = shells_in(parse)?;
            if let Some((_, t)) = shells.iter().find(|(i, _)| *i == rt) {
                return modify::plan(parse, t, ctx).map(Some);
            }
            if !shells.is_empty() {
                return Err(RemusError::Unsupported(
                    "a statement that modifies a local table cannot read distributed tables yet",
                ));
            }
            return Ok(None);
        }
        if cmd == pg_sys::CmdType::CMD_MERGE && !shells_in(parse)?.is_empty() {
            return Err(RemusError::Unsupported(
                "MERGE on distributed tables is not supported",
            ));
        }
        if cmd == pg_sys::CmdType::CMD_SELECT {
            let levels = crate::pg::query_tree::levels(parse);
            // FOR UPDATE / FOR SHARE of the statement itself (not of a subquery, which the
            // drain fence would not see).
            let inner_locks = levels
                .iter()
                .skip(1)
                .any(|l| !(*l.query).rowMarks.is_null());
            // Whole on one shard group, row locks included: they are taken where the rows are.
            if !inner_locks {
                if let Some((anchor_table, anchor_value)) = colocated::colocated_anchor(parse)? {
                    return modify::plan_single_shard_select(
                        parse,
                        &anchor_table,
                        anchor_value,
                        ctx,
                    )
                    .map(Some);
                }
            }
            // Aggregates over every shard of one table: computed per shard, combined here.
            if let Some(stmt) = fanout::plan(parse, ctx)? {
                return Ok(Some(stmt));
            }
            let locks = inner_locks || !(*parse).rowMarks.is_null();
            if locks && !shells_anywhere(parse)?.is_empty() {
                return Err(RemusError::Unsupported(
                    "SELECT … FOR UPDATE/SHARE on distributed tables is supported on one shard group only (every distributed table restricted to the same shard-key value), and not in a subquery",
                ));
            }
        }
        Ok(None)
    }
}
