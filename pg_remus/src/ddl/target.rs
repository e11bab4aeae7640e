//! What DDL on a shell works on: the table, the shard tables this node holds, and the work each
//! of them gets.

use std::ffi::CString;

use pgrx::pg_sys;

pub(super) use crate::pg::relation::{relid_of, shard_range_var};

use crate::catalog::DistTable;
use crate::error::RemusError;

/// What one shard table gets.
pub(super) enum ShardWork {
    /// A copy of the user's statement aimed at the shard table.
    Tree(*mut pg_sys::Node),
    /// A statement the extension wrote (names of the shard's own objects).
    Sql(String),
}

/// A distributed or reference table as DDL sees it: its catalog entry and the shard tables
/// this node holds.
pub(super) struct Target {
    pub(super) table: DistTable,
    /// (shard id, unquoted shard table name) of each shard table present on this node.
    pub(super) local_shards: Vec<(i64, String)>,
    /// Every shard id of the table, wherever it lives.
    pub(super) shard_ids: Vec<i64>,
}

impl Target {
    pub(super) fn is_reference(&self) -> bool {
        self.table.kind == 'r'
    }
}

/// The table `relid` if it is distributed or a reference table, with its shard tables here.
pub(super) fn target(relid: pg_sys::Oid) -> Result<Option<Target>, RemusError> {
    if relid == pg_sys::InvalidOid {
        return Ok(None);
    }
    let Some(table) = crate::router::placement::dist_table(relid)? else {
        return Ok(None);
    };
    let shard_ids: Vec<i64> = crate::catalog::shard_ids(relid)?
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    let mut local_shards = Vec::new();
    // SAFETY: catalog lookups by name; the strings outlive the calls.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), true);
        for &id in &shard_ids {
            let name = format!("{}_{id}", table.rel_name);
            let c = CString::new(name.as_str()).expect("no NUL in names");
            if nsp != pg_sys::InvalidOid
                && pg_sys::get_relname_relid(c.as_ptr(), nsp) != pg_sys::InvalidOid
            {
                local_shards.push((id, name));
            }
        }
    }
    local_shards.sort();
    Ok(Some(Target {
        table,
        local_shards,
        shard_ids,
    }))
}

/// A palloc'd copy of `node` (a parse tree).
///
/// # Safety
/// `node` must be a valid parse node.
pub(super) unsafe fn copy_node<T>(node: *mut T) -> *mut T {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe { pg_sys::copyObjectImpl(node as *const std::ffi::c_void) as *mut T }
}

/// The refusal of a DDL form that is not propagated (0A000, naming it and the table).
pub(super) fn refused(what: &'static str, t: &Target) -> RemusError {
    RemusError::DdlNotPropagated {
        what,
        table: t.table.qualified_name.to_string(),
    }
}
