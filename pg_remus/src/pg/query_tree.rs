//! Every Query of a statement: the statement itself, its WITH queries, its FROM subqueries and
//! its sublinks, each with the level it is nested in, so that a `Var`'s `varlevelsup` can be
//! followed to the query it belongs to; and the text of one statement of a query string.

use std::ffi::{c_char, c_void, CStr};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::pg::list::is_tag;

/// One Query of a statement's tree.
pub(crate) struct Level {
    pub(crate) query: *mut pg_sys::Query,
    /// The level this one is nested in (the one its `varlevelsup = 1` Vars point at); None for
    /// the statement itself.
    pub(crate) parent: Option<usize>,
}

/// The statement's queries, the statement first (index 0), then depth first.
///
/// # Safety
/// `top` must be a valid Query (parsed or rewritten, not yet planned).
pub(crate) unsafe fn levels(top: *mut pg_sys::Query) -> Vec<Level> {
    // SAFETY: `top` is a valid Query (the caller's contract).
    if unsafe { flat(top) } {
        // The common case, without a walk over every expression.
        return vec![Level {
            query: top,
            parent: None,
        }];
    }
    let mut walk = Walk {
        levels: vec![Level {
            query: top,
            parent: None,
        }],
        current: 0,
    };
    // SAFETY: `top` is a valid Query (the caller's contract); the walker only reads the tree
    // and records Query pointers in `walk`, which outlives the walk.
    unsafe {
        pg_sys::query_tree_walker(top, Some(visit), (&raw mut walk).cast::<c_void>(), 0);
    }
    walk.levels
}

/// Has `q` no nested Query: no WITH, no sublink, no subquery in FROM?
unsafe fn flat(q: *mut pg_sys::Query) -> bool {
    // SAFETY: `q` is a valid Query.
    unsafe {
        (*q).cteList.is_null()
            && !(*q).hasSubLinks
            && (*q).setOperations.is_null()
            && crate::pg::list::list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)
                .into_iter()
                .all(|r| (*r).rtekind != pg_sys::RTEKind::RTE_SUBQUERY)
    }
}

/// The index of the level `up` levels above `level` (`varlevelsup`), if there is one.
pub(crate) fn ancestor(levels: &[Level], mut level: usize, up: u32) -> Option<usize> {
    for _ in 0..up {
        level = levels.get(level)?.parent?;
    }
    Some(level)
}

struct Walk {
    levels: Vec<Level>,
    current: usize,
}

#[pg_guard]
unsafe extern "C-unwind" fn visit(node: *mut pg_sys::Node, cx: *mut c_void) -> bool {
    // SAFETY: PostgreSQL's tree walkers call this with nodes of the tree `levels` walks and the
    // `Walk` it passed as context.
    unsafe {
        if node.is_null() {
            return false;
        }
        let walk = cx as *mut Walk;
        if is_tag(node, pg_sys::NodeTag::T_Query) {
            // Through the raw pointer only: the nested walk below reaches `*walk` again.
            let parent = (*walk).current;
            (*walk).levels.push(Level {
                query: node as *mut pg_sys::Query,
                parent: Some(parent),
            });
            (*walk).current = (*walk).levels.len() - 1;
            let stop = pg_sys::query_tree_walker(node as *mut pg_sys::Query, Some(visit), cx, 0);
            (*walk).current = parent;
            return stop;
        }
        pg_sys::expression_tree_walker(node, Some(visit), cx)
    }
}

/// The text of the statement `pstmt` within `query_string` (which may hold several).
///
/// # Safety
/// `pstmt` and `query_string` must be the ProcessUtility hook's arguments.
pub(crate) unsafe fn statement_text(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const c_char,
) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let text = CStr::from_ptr(query_string).to_bytes();
        let start = ((*pstmt).stmt_location.max(0) as usize).min(text.len());
        let end = match (*pstmt).stmt_len {
            0 => text.len(),
            n => (start + n as usize).min(text.len()),
        };
        String::from_utf8_lossy(&text[start..end]).into_owned()
    }
}
