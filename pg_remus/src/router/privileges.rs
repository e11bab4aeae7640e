//! Privileges of a statement on distributed tables are the shell's, checked as the calling role.
//!
//! Shard tables carry no grants (application roles cannot reach them: issue 18), so a plan on
//! a shard table must not ask the executor to check the shard. When the relid swap points a
//! range table entry at a shard, its required permissions move to a copy of the shell's entry
//! appended to the statement's range table, outside the join tree: the executor checks it at
//! every `ExecutorStart` as the user running the statement (column privileges included), as it
//! checks a view's entry, and the plan cache invalidates the plan when the shell changes. A
//! plan made at execution for a statement whose own plan names the shells ([`Check::Done`])
//! only drops the shard's check: the statement's `ExecutorStart` has checked the shells.

use pgrx::pg_sys;

/// What to do with the privileges of an entry being pointed at a shard table.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Check {
    /// Keep them checked, on the shell: the plan is the statement's own.
    OnShell,
    /// Drop them: the statement's own plan checks the shells.
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
            let shell = pg_sys::copyObjectImpl(rte as *const std::ffi::c_void)
                as *mut pg_sys::RangeTblEntry;
            // Only for the permission check: not scanned, not expanded, no quals of its own
            // (the row security quals stay with the scanned entry).
            (*shell).inFromCl = false;
            (*shell).inh = false;
            (*shell).securityQuals = std::ptr::null_mut();
            (*top).rtable = pg_sys::lappend((*top).rtable, shell as *mut std::ffi::c_void);
        }
        (*rte).requiredPerms = 0;
        (*rte).checkAsUser = pg_sys::InvalidOid;
    }
}
