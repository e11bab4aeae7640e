//! Which rows of a draining shard's old copy a write locks FOR SHARE on the source before it
//! runs on the shard's new owner (the drain fence, `migration::handover::remus`).
//!
//! The fence must hold the write back for exactly the source transactions older than Tm that
//! hold, or are queued for, the rows the statement itself writes (review F7): a predicate
//! wider than that (the shard key alone, as before) waits for writers of unrelated rows, up
//! to `remus.drain_wait_timeout`, and can deadlock with them; a write with no fence at all
//! leaves its older writer a write-write conflict (40001 at its commit). So the lock query is
//! built from the statement itself:
//!
//! - UPDATE / DELETE: its whole WHERE clause, deparsed as the statement is (same `$n`
//!   parameters), on every shard it is sent to (one by key, or all of them).
//! - INSERT … ON CONFLICT (DO UPDATE or DO NOTHING): the rows its conflict target (or, when it
//!   names none, the primary key) selects, one disjunct per inserted row.
//!
//! An upsert whose conflict values cannot be shipped (an arbiter that is an expression, a
//! value that is not a constant or parameter, a table with no primary key under a bare ON
//! CONFLICT) gets no fence: its older writer of the same row may then fail with 40001 at
//! commit (listed in README). A plain INSERT gets none either: a row an older writer holds
//! is one it already has, so the INSERT fails with a unique violation on either copy.

use pgrx::pg_sys;

use crate::catalog::DistTable;
use crate::pg::list::{is_tag, list_ptrs};
use crate::pg::sql::{quote_ident, quote_literal};
use crate::router::{deparse, execute, key};

/// The lock query for an UPDATE or DELETE: `SELECT 1 FROM <shell> WHERE <its WHERE> FOR SHARE`,
/// with the statement's own parameters; with UPDATE … FROM or DELETE … USING, their tables
/// join the FROM list and only the target's rows are locked (`FOR SHARE OF <target>`).
///
/// # Safety
/// `query` must be a valid rewritten UPDATE or DELETE of a distributed table's shell (what
/// `modify::plan` admits).
pub(crate) unsafe fn rows_written_by(query: *mut pg_sys::Query) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract; the copy is ours to edit.
    unsafe {
        let q = pg_sys::copyObjectImpl(query as *const std::ffi::c_void) as *mut pg_sys::Query;
        let rt = (*q).resultRelation;
        (*q).commandType = pg_sys::CmdType::CMD_SELECT;
        (*q).resultRelation = 0;
        (*q).returningList = std::ptr::null_mut();
        (*q).onConflict = std::ptr::null_mut();
        (*q).rowMarks = std::ptr::null_mut();
        (*q).hasForUpdate = false;
        select_one(q);
        // The target of an UPDATE/DELETE is not in its FROM list; a SELECT's must be (and
        // ruleutils prints only entries marked as written in FROM).
        let target = list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)[rt as usize - 1];
        (*target).inFromCl = true;
        let from =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::RangeTblRef>()) as *mut pg_sys::RangeTblRef;
        (*from).type_ = pg_sys::NodeTag::T_RangeTblRef;
        (*from).rtindex = rt;
        let mut fromlist = pg_sys::lappend(std::ptr::null_mut(), from as *mut std::ffi::c_void);
        for item in list_ptrs::<pg_sys::Node>((*(*q).jointree).fromlist) {
            let target = is_tag(item, pg_sys::NodeTag::T_RangeTblRef)
                && (*(item as *mut pg_sys::RangeTblRef)).rtindex == rt;
            if !target {
                fromlist = pg_sys::lappend(fromlist, item as *mut std::ffi::c_void);
            }
        }
        (*(*q).jointree).fromlist = fromlist;
        if list_ptrs::<pg_sys::Node>((*q).rtable).len() == 1 {
            return format!("{} FOR SHARE", deparse::deparse(q));
        }
        let mark = pg_sys::palloc0(std::mem::size_of::<pg_sys::RowMarkClause>())
            as *mut pg_sys::RowMarkClause;
        (*mark).type_ = pg_sys::NodeTag::T_RowMarkClause;
        (*mark).rti = rt as pg_sys::Index;
        (*mark).strength = pg_sys::LockClauseStrength::LCS_FORSHARE;
        (*mark).waitPolicy = pg_sys::LockWaitPolicy::LockWaitBlock;
        (*q).rowMarks = pg_sys::lappend(std::ptr::null_mut(), mark as *mut std::ffi::c_void);
        deparse::deparse(q)
    }
}

/// Makes `q`'s target list `SELECT 1` (a lock query needs no columns).
unsafe fn select_one(q: *mut pg_sys::Query) {
    // SAFETY: `q` is a Query copy of the caller's own.
    unsafe {
        let one = pg_sys::makeConst(
            pg_sys::INT4OID,
            -1,
            pg_sys::InvalidOid,
            4,
            pg_sys::Datum::from(1usize),
            false,
            true,
        );
        (*q).targetList = pg_sys::lappend(
            std::ptr::null_mut(),
            pg_sys::makeTargetEntry(one as *mut pg_sys::Expr, 1, std::ptr::null_mut(), false)
                as *mut std::ffi::c_void,
        );
    }
}

/// The lock query for a SELECT … FOR UPDATE / FOR SHARE on one shard group: the same FROM and
/// WHERE, `SELECT 1 … FOR SHARE` of the same tables, with the statement's own parameters.
///
/// # Safety
/// `query` must be a valid rewritten SELECT with row marks (what `modify::plan_single_shard_select`
/// admits).
pub(crate) unsafe fn rows_locked_by(query: *mut pg_sys::Query) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract; the copy is ours to edit.
    unsafe {
        let q = pg_sys::copyObjectImpl(query as *const std::ffi::c_void) as *mut pg_sys::Query;
        for rc in list_ptrs::<pg_sys::RowMarkClause>((*q).rowMarks) {
            (*rc).strength = pg_sys::LockClauseStrength::LCS_FORSHARE;
            (*rc).waitPolicy = pg_sys::LockWaitPolicy::LockWaitBlock;
        }
        (*q).sortClause = std::ptr::null_mut();
        (*q).limitCount = std::ptr::null_mut();
        (*q).limitOffset = std::ptr::null_mut();
        select_one(q);
        deparse::deparse(q)
    }
}

/// The lock query for an INSERT … ON CONFLICT of `rows` (for a multi-row INSERT, the rows of the
/// VALUES list, range-table entry `values_rti`, that go to one shard; for a single row, none and
/// 0), or None when the statement has no ON CONFLICT or its conflict rows cannot be shipped
/// (module doc). Conflict values are evaluated here and sent as literals.
///
/// # Safety
/// `query` must be a valid rewritten INSERT of `table`'s shell; `rows` lists of the VALUES
/// entry's expressions; `ps` a live PlanState with an ExprContext.
pub(crate) unsafe fn rows_upserted(
    query: *mut pg_sys::Query,
    table: &DistTable,
    values_rti: usize,
    rows: &[*mut pg_sys::List],
    ps: *mut pg_sys::PlanState,
) -> Option<String> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let oc = (*query).onConflict;
        if oc.is_null() {
            return None;
        }
        let rt = (*query).resultRelation;
        let mut attnos = Vec::new();
        for elem in list_ptrs::<pg_sys::InferenceElem>((*oc).arbiterElems) {
            let e = strip((*elem).expr);
            if !is_tag(e, pg_sys::NodeTag::T_Var) || (*(e as *mut pg_sys::Var)).varno != rt {
                return None;
            }
            attnos.push((*(e as *mut pg_sys::Var)).varattno);
        }
        if attnos.is_empty() {
            attnos = primary_key(table.relid)?;
        }
        let columns = attnos
            .iter()
            .map(|a| {
                let name = pg_sys::get_attname(table.relid, *a, false);
                quote_ident(&std::ffi::CStr::from_ptr(name).to_string_lossy())
            })
            .collect::<Vec<_>>();
        let tlist = list_ptrs::<pg_sys::TargetEntry>((*query).targetList);
        let single = [std::ptr::null_mut()];
        let rows: &[*mut pg_sys::List] = if rows.is_empty() { &single } else { rows };
        let mut disjuncts = Vec::with_capacity(rows.len());
        'row: for row in rows {
            let mut conjuncts = Vec::with_capacity(attnos.len());
            for (attno, column) in attnos.iter().zip(&columns) {
                let te = tlist.iter().find(|te| (***te).resno == *attno)?;
                let mut value = strip((**te).expr as *mut pg_sys::Node);
                if is_tag(value, pg_sys::NodeTag::T_Var)
                    && (*(value as *mut pg_sys::Var)).varno as usize == values_rti
                    && !row.is_null()
                {
                    let col = (*(value as *mut pg_sys::Var)).varattno as usize - 1;
                    value = *list_ptrs::<pg_sys::Node>(*row).get(col)?;
                }
                if !key::is_routable_value(value) {
                    return None;
                }
                let (datum, isnull, ty) = execute::eval_expr(value as *mut pg_sys::Expr, ps);
                if isnull {
                    // A NULL never conflicts: the row is inserted, there is nothing to wait for.
                    continue 'row;
                }
                conjuncts.push(format!(
                    "{column} = {}",
                    quote_literal(&crate::pg::datum::datum_to_text(datum, ty))
                ));
            }
            disjuncts.push(format!("({})", conjuncts.join(" AND ")));
        }
        if disjuncts.is_empty() {
            return None;
        }
        Some(format!(
            "SELECT 1 FROM {} WHERE {} FOR SHARE",
            table.qualified_name,
            disjuncts.join(" OR ")
        ))
    }
}

/// The expression under any binary-compatible relabelling.
///
/// # Safety
/// `n` must be NULL or a valid expression node.
pub(super) unsafe fn strip(mut n: *mut pg_sys::Node) -> *mut pg_sys::Node {
    // SAFETY: the callers pass valid expression nodes.
    unsafe {
        while is_tag(n, pg_sys::NodeTag::T_RelabelType) {
            n = (*(n as *mut pg_sys::RelabelType)).arg as *mut _;
        }
        n
    }
}

/// The columns of the shell's primary key, if it has one (a bare ON CONFLICT's likeliest
/// arbiter; the shell carries the distributed table's indexes).
fn primary_key(relid: pg_sys::Oid) -> Option<Vec<i16>> {
    crate::pg::spi::read_one::<Vec<i16>>(
        &format!(
            "SELECT (SELECT indkey::int2[] FROM pg_catalog.pg_index
                      WHERE indrelid = {} AND indisprimary)",
            relid.to_u32()
        ),
        &[],
    )
    .ok()
    .flatten()
    .filter(|k| !k.is_empty() && k.iter().all(|a| *a > 0))
}
