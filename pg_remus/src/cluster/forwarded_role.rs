//! The role a node-to-node session runs its statements as.
//!
//! A node reaches another as the node user (the bootstrap superuser, whose credentials every
//! node has), never as the application's role: nodes need no password of application roles.
//! The entry node then sets `remus.forwarded_role` on that session to the role running the
//! statement there (`cluster::remote::RemoteConnection::act_as_caller`), and every
//! transaction of the session runs as that role from its first statement on: privileges are
//! checked, functions run and `current_user` answers as on the entry node.
//!
//! The switch is the one PostgreSQL makes for a SECURITY DEFINER function: a local user id
//! change, under which neither `SET ROLE` nor `SET SESSION AUTHORIZATION` can be run (the
//! role's own code cannot climb back to the node user), and which every abort undoes. It is
//! made by the first planner, executor or utility call of each transaction (parse analysis
//! before it only resolves names) and undone at the transaction's end. Only a session that
//! authenticated as a superuser can set the setting, or `remus.forwarded` that makes it
//! count; the role, switched to, cannot reset it, and `RESET ALL` / `DISCARD ALL` leave it.

use std::cell::Cell;
use std::ffi::CString;

use pgrx::{pg_sys, GucContext, GucFlags, GucRegistry, GucSetting};

/// Set by an entry node on its node-to-node session: the role to run this session's
/// transactions as. Empty: the node user the session authenticated as.
pub static FORWARDED_ROLE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

thread_local! {
    /// The user and security context before this transaction's switch, to restore at its end.
    static BEFORE: Cell<Option<(pg_sys::Oid, i32)>> = const { Cell::new(None) };
}

pub(crate) fn register() {
    GucRegistry::define_string_guc(
        c"remus.forwarded_role",
        c"Role this node-to-node session runs its transactions as.",
        c"Set by the node that opened the session; only in sessions with remus.forwarded.",
        &FORWARDED_ROLE,
        GucContext::Suset,
        GucFlags::NO_SHOW_ALL | GucFlags::NO_RESET_ALL | GucFlags::NOT_WHILE_SEC_REST,
    );
}

/// At the first planner, executor or utility call of a transaction in a node-to-node session
/// with `remus.forwarded_role` set: run the rest of the transaction as that role.
pub(crate) fn enter() {
    if !crate::guc::FORWARDED.get() {
        return;
    }
    // SAFETY: the GUC's storage holds NULL or a NUL-terminated string PostgreSQL owns.
    let raw = unsafe { *FORWARDED_ROLE.as_ptr() };
    // SAFETY: `raw` is NULL or a NUL-terminated string (above); the rest reads backend
    // globals. Inside a local user id change (this transaction's switch, or a SECURITY DEFINER
    // function) nothing is to be done; an abort that undid the switch (a subtransaction's)
    // leaves none, and the next call switches again.
    let idle = unsafe {
        raw.is_null() || *raw == 0 || !pg_sys::IsTransactionState() || pg_sys::InLocalUserIdChange()
    };
    if idle {
        return;
    }
    // SAFETY: a syscache lookup by a NUL-terminated name; an unknown role is an ERROR (42704),
    // raised before anything ran as the node user.
    let role = unsafe { pg_sys::get_role_oid(raw, false) };
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: reads two backend globals into locals.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    if BEFORE.get().is_none() {
        BEFORE.set(Some((user, context)));
    }
    // SAFETY: sets the current user to an existing role; undone by `leave` at the end of the
    // transaction and by any abort (which restores the user of the (sub)transaction's start).
    unsafe {
        pg_sys::SetUserIdAndSecContext(role, context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32)
    };
}

/// At the end of the transaction (before its commit work: PRE_COMMIT, PRE_PREPARE; and at
/// its end): back to the node user.
pub(crate) fn leave() {
    if let Some((user, context)) = BEFORE.take() {
        // SAFETY: restores the values saved by `enter`.
        unsafe { pg_sys::SetUserIdAndSecContext(user, context) };
    }
}
