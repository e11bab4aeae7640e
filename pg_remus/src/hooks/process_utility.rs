//! `ProcessUtility_hook`: the router's utility statements (COPY FROM, TRUNCATE, refusals), DDL
//! on distributed tables (`ddl`, around PostgreSQL's own run on the shell), GRANT propagation and
//! the handover's checks; after a COMMIT / ROLLBACK PREPARED, its Remus shadows follow.

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::migration::dual;

static mut PREV_UTILITY: pg_sys::ProcessUtility_hook_type = None;

pub(super) fn install() {
    // SAFETY: process-global hook set once at preload, previous value chained.
    unsafe {
        PREV_UTILITY = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
    }
}

#[allow(clippy::too_many_arguments)]
#[pg_guard]
unsafe extern "C-unwind" fn process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        // Not for transaction control (COMMIT PREPARED is the node user's) nor SET (how the
        // entry node sets the role): neither runs the role's code.
        let stmt = (*pstmt).utilityStmt;
        if !stmt.is_null()
            && !matches!(
                (*stmt).type_,
                pg_sys::NodeTag::T_TransactionStmt
                    | pg_sys::NodeTag::T_VariableSetStmt
                    | pg_sys::NodeTag::T_VariableShowStmt
            )
        {
            crate::cluster::forwarded_role::enter();
        }
        match crate::router::utility::intercept(pstmt, query_string, qc) {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => e.raise(),
        }
        let grant = match crate::router::grant::to_propagate(pstmt, query_string) {
            Ok(g) => g,
            Err(e) => e.raise(),
        };
        let ddl = match crate::ddl::prepare(pstmt, query_string) {
            Ok(d) => d,
            Err(e) => e.raise(),
        };
        let finishing = dual::finishing_prepared(pstmt);
        match PREV_UTILITY {
            Some(prev) => prev(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
            None => pg_sys::standard_ProcessUtility(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
        }
        if let Some(pending) = ddl {
            if let Err(e) = crate::ddl::finish(pending) {
                e.raise();
            }
        }
        if let Some(sql) = grant {
            if let Err(e) = crate::router::grant::propagate(&sql) {
                e.raise();
            }
        }
        if let Some((xid, commit)) = finishing {
            dual::prepared_finished(xid, commit);
        }
    }
}
