//! The `/*remus:shard=N*/` marker protocol, receiving side (the text format is
//! `cluster::shard_marker`). A node honours the marker only on a statement another node sent
//! (the top-level statement of a session opened by another node, `remus.forwarded`) or on the
//! statement its own nested local execution runs, by planning the statement against the local
//! shard table (relid swap): the decision where a shard lives is made once, by the coordinating
//! backend, and the executing node never routes again. Never on a statement some code runs
//! meanwhile (a function the statement calls, with a marker of its own): a marked statement
//! skips the ownership check and has its shells' privileges checked by the plan that sent it
//! (`router::privileges`).

use std::cell::Cell;
use std::ffi::c_char;

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::router::placement::{lock_local_shard, shard_at, shard_ids, shells_anywhere};
use crate::router::privileges::{move_to_shell, Check};

thread_local! {
    /// The text of the marked shard statement this backend runs locally (nested execution), the
    /// very pointer SPI plans and executes it with.
    static LOCAL_STATEMENT: Cell<*const c_char> = const { Cell::new(std::ptr::null()) };
}

/// The shard named by the marker of `query_string` (the text being planned or executed), if
/// this backend honours it there: the top-level statement of a node-to-node session (the
/// client's own query text, `debug_query_string`; a function's statements have texts of their
/// own), or the statement of this backend's nested local execution. Compared by content: the
/// protocol copies the text (a portal's copy of a prepared statement's, started at Bind); a
/// statement that some code runs with the very same text is the same statement, whose shells
/// the sending plan checked.
pub(crate) fn marked_shard(query_string: *const c_char) -> Option<i64> {
    if query_string.is_null() {
        return None;
    }
    // SAFETY: reads a backend global (the text of the client's current query, or NULL).
    let top_level = same_text(query_string, unsafe { pg_sys::debug_query_string });
    let honoured = (crate::guc::FORWARDED.get() && top_level)
        || same_text(query_string, LOCAL_STATEMENT.with(|s| s.get()));
    if honoured {
        crate::cluster::shard_marker::parse(query_string)
    } else {
        None
    }
}

/// Are `a` (not NULL) and `b` the same NUL-terminated text?
fn same_text(a: *const c_char, b: *const c_char) -> bool {
    // SAFETY: both are NULL or NUL-terminated strings PostgreSQL (or this backend's nested
    // execution) keeps alive while the statement runs.
    a == b
        || (!b.is_null() && unsafe { std::ffi::CStr::from_ptr(a) == std::ffi::CStr::from_ptr(b) })
}

/// While alive, this backend runs the marked shard statement `sql` locally (nested execution
/// honours its marker, [`marked_shard`]).
pub(crate) struct LocalShard(*const c_char);

impl LocalShard {
    pub(crate) fn enter(sql: *const c_char) -> Self {
        LocalShard(LOCAL_STATEMENT.with(|s| s.replace(sql)))
    }
}

impl Drop for LocalShard {
    fn drop(&mut self) {
        LOCAL_STATEMENT.with(|s| s.set(self.0));
    }
}

/// Rewrites the shell reference of a marked statement to the local shard table. The shard
/// must be here: the coordinating node decided it is.
///
/// # Safety
/// `parse` must be a valid Query.
pub(crate) unsafe fn pin_to_local_shard(
    parse: *mut pg_sys::Query,
    shard_id: i64,
) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let shells = shells_anywhere(parse)?;
        if shells.is_empty() {
            return Err(RemusError::MarkerWithoutTable { shard_id });
        }
        // The marker names one shard; every distributed table of the statement, at any depth,
        // uses the shard with the same index in the same co-location group (the same table
        // twice for ON CONFLICT's `excluded`), and a reference table its copy here. Shard ids
        // come from the backend's cache: no catalog query per statement.
        let mut index = None;
        for (_, t) in shells.iter().filter(|(_, t)| t.kind == 'h') {
            if let Some(i) = shard_ids(t.relid)?.iter().position(|s| *s == shard_id) {
                index = Some((i, t.colocation_id));
                break;
            }
        }
        // A statement on a reference table alone names that table's shard.
        let single_table = shells.iter().all(|(_, t)| t.relid == shells[0].1.relid);
        let (index, colocation) = match index {
            Some(found) => found,
            None if single_table => (0, shells[0].1.colocation_id),
            None => {
                return Err(RemusError::NotShardOwner {
                    shard_id,
                    node: crate::guc::node_name().unwrap_or_default(),
                })
            }
        };
        if shells
            .iter()
            .any(|(_, t)| t.kind == 'h' && t.colocation_id != colocation)
        {
            return Err(RemusError::MarkerNotColocated { shard_id });
        }
        for (rte, table) in &shells {
            let sid = if single_table {
                shard_id
            } else {
                shard_at(table, index)?.unwrap_or(shard_id)
            };
            // The parser locked the shell, not the shard; the executor expects its relations
            // locked. Not here (or dropped by a migration's cleanup once the lock was granted):
            // this node does not own it.
            let Some(shard_relid) = lock_local_shard(&table.rel_name, sid, (**rte).rellockmode)
            else {
                return Err(RemusError::NotShardOwner {
                    shard_id: sid,
                    node: crate::guc::node_name().unwrap_or_default(),
                });
            };
            move_to_shell(parse, *rte, Check::Done);
            (**rte).relid = shard_relid;
        }
        Ok(())
    }
}
