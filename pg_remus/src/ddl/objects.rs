//! Indexes and index-backed constraints of shells and their twins on the shard tables.
//!
//! Index names are per schema, and every shard table of a node lives in `remus_shards`: a
//! shard's index is therefore named after its shard table (PostgreSQL's default name), not
//! after the shell's index. The twin of a shell's index on a shard is found by its definition
//! (method, columns or expressions, predicate, uniqueness), which is the same on both since the
//! shard has the shell's columns.

use std::ffi::CStr;

use pgrx::pg_sys;

use super::target::{copy_node, refused, shard_range_var, ShardWork, Target};
use crate::error::RemusError;
use crate::pg::list::list_ptrs;

/// CREATE INDEX on a shell: the copies for the shard tables (their names left to PostgreSQL).
///
/// # Safety
/// `i` must be the statement about to run, `t` its table.
pub(super) unsafe fn create_index(
    i: *mut pg_sys::IndexStmt,
    t: &Target,
) -> Result<Vec<ShardWork>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if (*i).concurrent {
            return Err(refused(
                "CREATE INDEX CONCURRENTLY (use CREATE INDEX: it runs in one transaction on every node)",
                t,
            ));
        }
        if (*i).unique && !t.is_reference() {
            let key = t.table.shard_key.as_deref().unwrap_or_default();
            let has_key = list_ptrs::<pg_sys::IndexElem>((*i).indexParams)
                .into_iter()
                .any(|e| {
                    !(*e).name.is_null() && CStr::from_ptr((*e).name).to_bytes() == key.as_bytes()
                });
            if !has_key {
                return Err(RemusError::UniqueIndexWithoutShardKey {
                    table: t.table.qualified_name.to_string(),
                    key: key.to_string(),
                });
            }
        }
        // IF NOT EXISTS of an index the shell has: nothing to do anywhere (a shard copy has
        // no name to find it by).
        if (*i).if_not_exists && !(*i).idxname.is_null() {
            let nsp = pg_sys::get_rel_namespace(t.table.relid);
            if pg_sys::get_relname_relid((*i).idxname, nsp) != pg_sys::InvalidOid {
                return Ok(Vec::new());
            }
        }
        Ok(t.local_shards
            .iter()
            .map(|(_, name)| {
                let copy = copy_node(i);
                (*copy).relation = shard_range_var(name);
                (*copy).idxname = std::ptr::null_mut();
                (*copy).if_not_exists = false;
                ShardWork::Tree(copy as *mut pg_sys::Node)
            })
            .collect())
    }
}

/// The qualified names of the twins of shell index `index` on this node's shard tables.
pub(super) fn index_twins(index: pg_sys::Oid, t: &Target) -> Result<Vec<String>, RemusError> {
    let mut twins = Vec::new();
    for (_, shard) in &t.local_shards {
        let twin = crate::pg::spi::read_one::<String>(
            "SELECT min(format('remus_shards.%I', c.relname))
               FROM pg_index i
               JOIN pg_class c ON c.oid = i.indexrelid
               JOIN pg_index s ON s.indexrelid = $1
              WHERE i.indrelid = format('remus_shards.%I', $2::text)::regclass
                AND i.indisunique = s.indisunique
                AND substring(pg_get_indexdef(i.indexrelid) FROM ' USING .*$')
                  = substring(pg_get_indexdef(s.indexrelid) FROM ' USING .*$')",
            &[index.into(), shard.as_str().into()],
        )?;
        twins.extend(twin);
    }
    Ok(twins)
}

/// The kind (`pg_constraint.contype`) of the shell's constraint `name`, if it has one.
pub(super) fn constraint_kind(relid: pg_sys::Oid, name: &str) -> Result<Option<char>, RemusError> {
    Ok(crate::pg::spi::read_one::<String>(
        "SELECT min(contype::text) FROM pg_constraint WHERE conrelid = $1 AND conname = $2",
        &[relid.into(), name.into()],
    )?
    .and_then(|s| s.chars().next()))
}

/// The name on shard `shard_id` of the shell's index-backed constraint `name` (PRIMARY KEY,
/// UNIQUE, EXCLUDE); None for other constraints (same name) or a name the shell lacks.
pub(super) fn constraint_twin(
    t: &Target,
    name: &str,
    shard_id: i64,
) -> Result<Option<String>, RemusError> {
    let shard = format!("{}_{shard_id}", t.table.rel_name);
    Ok(crate::pg::spi::read_one::<String>(
        "SELECT min(sc.conname::text)
           FROM pg_constraint c
           JOIN pg_constraint sc ON sc.conrelid = format('remus_shards.%I', $3::text)::regclass
                                AND sc.contype = c.contype AND sc.conkey = c.conkey
          WHERE c.conrelid = $1 AND c.conname = $2 AND c.contype IN ('p', 'u', 'x')",
        &[t.table.relid.into(), name.into(), shard.as_str().into()],
    )?)
}
