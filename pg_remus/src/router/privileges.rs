//! Privileges of a statement on distributed tables are the shell's, checked where the statement
//! enters, as PostgreSQL checks them.
//!
//! Shard tables carry no grants (application roles cannot reach them: issue 18), so a plan on
//! a shard table must not ask the executor to check the shard.
//! - The statement's own plan checks every shell it names, at every level (subqueries,
//!   sublinks, WITH, views), as the user PostgreSQL's rewriter recorded for it (the calling
//!   role, or a view's owner): when the relid swap points an entry at a shard, its required
//!   permissions move to a copy of the shell's entry appended to the range table, outside the
//!   join tree ([`Check::OnShell`], as PostgreSQL keeps a view's entry), and a plan the router
//!   builds itself carries a copy of every level's entries ([`range_table_for_checks`]: the
//!   planner would have flattened them into the plan). The executor checks them at every
//!   `ExecutorStart`, columns included, and the plan cache invalidates the plan when a shell
//!   changes.
//! - A plan made at execution for such a statement, and a marked shard statement (sent by the
//!   node the statement entered, whose plan checked the shells: it is honoured only in its own
//!   nested execution and in node-to-node sessions), only drop the shard's check
//!   ([`Check::Done`]): a view's owner, whose rights the entry node checked, is not in the
//!   deparsed text. What runs there still runs as the calling role (functions' EXECUTE, the
//!   role's code: `cluster::forwarded_role`).

use pgrx::pg_sys;

/// The range table of a plan the router builds itself (a `RemusRouter` over the whole
/// statement): the statement's own entries, then a check-only copy of every relation entry of
/// its nested queries, which PostgreSQL's planner would have flattened into the plan's range
/// table and the executor would have checked.
///
/// # Safety
/// `parse` must be the planner's Query.
pub(crate) unsafe fn range_table_for_checks(parse: *mut pg_sys::Query) -> *mut pg_sys::List {
    // SAFETY: the caller upholds this function's `# Safety` contract; copies are palloc'd in
    // the current memory context, as the plan.
    unsafe {
        let levels = crate::pg::query_tree::levels(parse);
        if levels.len() == 1 {
            return (*parse).rtable;
        }
        let mut rtable = pg_sys::list_copy((*parse).rtable);
        for level in &levels[1..] {
            for rte in crate::pg::list::list_ptrs::<pg_sys::RangeTblEntry>((*level.query).rtable) {
                if (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION && (*rte).requiredPerms != 0 {
                    rtable = pg_sys::lappend(rtable, check_only_copy(rte) as *mut std::ffi::c_void);
                }
            }
        }
        rtable
    }
}

/// A copy of `rte` that only carries its permission check.
unsafe fn check_only_copy(rte: *mut pg_sys::RangeTblEntry) -> *mut pg_sys::RangeTblEntry {
    // SAFETY: `rte` is a valid entry; the copy is palloc'd in the current memory context.
    unsafe {
        let copy =
            pg_sys::copyObjectImpl(rte as *const std::ffi::c_void) as *mut pg_sys::RangeTblEntry;
        // Not scanned, not expanded, no quals of its own (row security quals stay with the
        // scanned entry).
        (*copy).inFromCl = false;
        (*copy).inh = false;
        (*copy).securityQuals = std::ptr::null_mut();
        copy
    }
}

/// What to do with the privileges of an entry being pointed at a shard table.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Keep them checked, on the shell: the plan is the statement's own.
    OnShell,
    /// Drop them: the plan of the statement this one executes checked the shells.
    Done,
}

/// Before `rte` (an entry of `top` or of a query under it, naming a shell) is pointed at a
/// shard table: moves its required permissions as [`Check`] says.
///
/// # Safety
/// `top` must be the statement's top-level Query (a copy the caller may edit) and `rte` one of
/// its range table entries or a nested query's, still naming the shell.
pub(crate) unsafe fn move_to_shell(
    top: *mut pg_sys::Query,
    rte: *mut pg_sys::RangeTblEntry,
    check: Check,
) {
    // SAFETY: the caller upholds this function's `# Safety` contract; the copy is palloc'd in
    // the current memory context, as the Query it joins.
    unsafe {
        if (*rte).requiredPerms == 0 {
            return;
        }
        if check == Check::OnShell {
            let shell = check_only_copy(rte);
            (*top).rtable = pg_sys::lappend((*top).rtable, shell as *mut std::ffi::c_void);
        }
        (*rte).requiredPerms = 0;
        (*rte).checkAsUser = pg_sys::InvalidOid;
    }
}
