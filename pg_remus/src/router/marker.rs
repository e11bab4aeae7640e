//! The `/*remus:shard=N*/` marker protocol, receiving side (the text format is
//! `cluster::shard_marker`). A node honours the marker only in a session opened by another node
//! (`remus.forwarded`) or in its own nested local execution, by planning the statement against
//! the local shard table (relid swap): the decision where a shard lives is made once, by the
//! coordinating backend, and the executing node never routes again.

use std::cell::Cell;

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::router::placement::{lock_local_shard, shard_at, shard_ids, shells_anywhere};
use crate::router::privileges::{move_to_shell, Check};

thread_local! {
    /// Set while this backend runs a marked shard statement locally.
    static LOCAL_SHARD_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Does this session execute marked statements on its local shards?
pub(crate) fn marker_honoured() -> bool {
    crate::guc::FORWARDED.get() || LOCAL_SHARD_DEPTH.with(|d| d.get()) > 0
}

/// While alive, this backend runs a marked shard statement locally (nested execution honours
/// the marker).
pub(crate) struct LocalShard;

impl LocalShard {
    pub(crate) fn enter() -> Self {
        LOCAL_SHARD_DEPTH.with(|d| d.set(d.get() + 1));
        LocalShard
    }
}

impl Drop for LocalShard {
    fn drop(&mut self) {
        LOCAL_SHARD_DEPTH.with(|d| d.set(d.get() - 1));
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
        let nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), false);
        for (rte, table) in &shells {
            let sid = if single_table {
                shard_id
            } else {
                shard_at(table, index)?.unwrap_or(shard_id)
            };
            // The parser locked the shell, not the shard; the executor expects its relations
            // locked. Not here (or dropped by a migration's cleanup once the lock was granted):
            // this node does not own it.
            let Some(shard_relid) =
                lock_local_shard(&table.rel_name, sid, nsp, (**rte).rellockmode)
            else {
                return Err(RemusError::NotShardOwner {
                    shard_id: sid,
                    node: crate::guc::node_name().unwrap_or_default(),
                });
            };
            move_to_shell(parse, *rte, Check::OnShell);
            (**rte).relid = shard_relid;
        }
        Ok(())
    }
}
