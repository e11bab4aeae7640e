//! The distribution catalog: which tables are distributed, their shards, and the shard map.
//!
//! Every node holds the same rows; every change is one 2PC transaction over all nodes. Tables
//! are referenced by `regclass`, so each node stores its own OID for the same name. The shard
//! map (`remus.shard_map`) is an ordinary table: MVCC makes it multiversioned, and a reader sees
//! the owner its own snapshot sees.

use std::rc::Rc;

use pgrx::prelude::*;

use crate::error::RemusError;

pub(crate) mod hashing;
pub(crate) mod map_cache;
pub(crate) mod shard_ddl;

// The catalog lives in schema `remus`; the user-facing functions and views are created in the
// extension's schema (public by default) so they are callable without qualification.
pgrx::extension_sql!(
    r#"
CREATE SCHEMA IF NOT EXISTS remus;

CREATE TABLE remus.nodes (
    name     text PRIMARY KEY,
    host     text NOT NULL,
    port     int  NOT NULL CHECK (port BETWEEN 1 AND 65535),
    added_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE remus.nodes IS 'Every node of the pg_remus cluster, this one included';

-- One row per remote participant of a two-phase commit this node coordinates, inserted in the
-- local transaction before PREPARE: the row exists exactly when the decision is commit.
CREATE TABLE remus.commit_decisions (
    gid         text PRIMARY KEY,
    participant text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
"#,
    name = "catalog",
    bootstrap
);

pgrx::extension_sql!(
    r#"
CREATE SCHEMA remus_shards;
COMMENT ON SCHEMA remus_shards IS 'Physical shard tables of pg_remus distributed tables';

CREATE TABLE remus.distributed_tables (
    logicalrelid  regclass PRIMARY KEY,
    shard_key     text,
    key_type      regtype,
    kind          "char" NOT NULL CHECK (kind IN ('h', 'r')),
    shard_count   int NOT NULL CHECK (shard_count > 0),
    colocation_id int NOT NULL
);
COMMENT ON TABLE remus.distributed_tables IS 'Distributed (h: hash) and reference (r) tables';

CREATE TABLE remus.shards (
    shard_id     bigint PRIMARY KEY,
    logicalrelid regclass NOT NULL REFERENCES remus.distributed_tables ON DELETE CASCADE,
    shard_index  int NOT NULL,
    hash_min     int NOT NULL,
    hash_max     int NOT NULL,
    UNIQUE (logicalrelid, shard_index)
);

-- Owner of each hash shard. Changed only by the ownership flip (Tm) of a migration.
CREATE TABLE remus.shard_map (
    shard_id  bigint PRIMARY KEY REFERENCES remus.shards ON DELETE CASCADE,
    node_name text NOT NULL REFERENCES remus.nodes (name)
);

-- Shells of distributed tables stay empty: the router never runs DML on them, so reaching this
-- trigger means a statement form the router does not handle.
CREATE FUNCTION remus.shell_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'cannot modify the shell of distributed table %', TG_TABLE_NAME::regclass
        USING ERRCODE = '0A000',
              HINT = 'This statement form is not routed by pg_remus.';
END $$;
"#,
    name = "distribution_catalog",
    requires = ["catalog"]
);

/// A distributed or reference table's distribution. Cloned on every routing lookup, so its
/// names are shared, not copied.
#[derive(Debug, Clone)]
pub struct DistTable {
    pub relid: pg_sys::Oid,
    pub qualified_name: Rc<str>,
    pub rel_name: Rc<str>,
    pub shard_key: Option<Rc<str>>,
    /// The shard key's attribute number in the shell (0: the column is gone).
    pub key_attno: i16,
    pub key_type: pg_sys::Oid,
    pub kind: char,
    pub shard_count: i32,
    pub colocation_id: i32,
}

#[derive(Debug, Clone)]
pub struct ShardPlacement {
    pub shard_id: i64,
    pub shard_index: i32,
    // The shard's hash range as the catalog stores it; routing computes the shard index instead.
    #[allow(dead_code)]
    pub hash_min: i32,
    #[allow(dead_code)]
    pub hash_max: i32,
    pub node_name: String,
}

/// `remus_shards.<table>_<shard_id>`, quoted.
pub fn shard_table_name(rel_name: &str, shard_id: i64) -> String {
    format!(
        "remus_shards.{}",
        crate::pg::sql::quote_ident(&format!("{rel_name}_{shard_id}"))
    )
}

pub fn dist_table(relid: pg_sys::Oid) -> Result<Option<DistTable>, RemusError> {
    crate::pg::spi::connect(|c| {
        let rows = c.select(
            "SELECT d.shard_key, d.key_type::oid, d.kind::text, d.shard_count, d.colocation_id,
                    format('%I.%I', n.nspname, cl.relname), cl.relname::text
               FROM remus.distributed_tables d
               JOIN pg_class cl ON cl.oid = d.logicalrelid
               JOIN pg_namespace n ON n.oid = cl.relnamespace
              WHERE d.logicalrelid = $1",
            Some(1),
            &[relid.into()],
        )?;
        if rows.is_empty() {
            return Ok::<_, pgrx::spi::Error>(None);
        }
        let r = rows.first();
        let shard_key = r.get::<String>(1)?;
        let key_attno = match shard_key.as_deref().map(std::ffi::CString::new) {
            // SAFETY: a catalog lookup of an attribute by name in an existing relation.
            Some(Ok(c)) => unsafe { pg_sys::get_attnum(relid, c.as_ptr()) }.max(0),
            _ => 0,
        };
        Ok(Some(DistTable {
            relid,
            shard_key: shard_key.map(Rc::from),
            key_attno,
            key_type: r.get::<pg_sys::Oid>(2)?.unwrap_or(pg_sys::InvalidOid),
            kind: r
                .get::<String>(3)?
                .and_then(|s| s.chars().next())
                .unwrap_or('h'),
            shard_count: r.get::<i32>(4)?.unwrap_or(0),
            colocation_id: r.get::<i32>(5)?.unwrap_or(0),
            qualified_name: r.get::<String>(6)?.unwrap_or_default().into(),
            rel_name: r.get::<String>(7)?.unwrap_or_default().into(),
        }))
    })
    .map_err(RemusError::from)
}

/// Shards of a table with their owners, as this transaction's snapshot sees them.
pub fn placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    crate::pg::spi::connect(|c| {
        c.select(
            "SELECT s.shard_id, s.shard_index, s.hash_min, s.hash_max, m.node_name
               FROM remus.shards s JOIN remus.shard_map m USING (shard_id)
              WHERE s.logicalrelid = $1 ORDER BY s.shard_index",
            None,
            &[relid.into()],
        )?
        .map(|r| {
            Ok(ShardPlacement {
                shard_id: r.get::<i64>(1)?.unwrap_or_default(),
                shard_index: r.get::<i32>(2)?.unwrap_or_default(),
                hash_min: r.get::<i32>(3)?.unwrap_or_default(),
                hash_max: r.get::<i32>(4)?.unwrap_or_default(),
                node_name: r.get::<String>(5)?.unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })
    .map_err(RemusError::from)
}

/// Shard indexes and ids of a table (immutable while it stays distributed).
pub fn shard_ids(relid: pg_sys::Oid) -> Result<Vec<(i32, i64)>, RemusError> {
    crate::pg::spi::connect(|c| {
        c.select(
            "SELECT shard_index, shard_id FROM remus.shards WHERE logicalrelid = $1",
            None,
            &[relid.into()],
        )?
        .map(|r| {
            Ok((
                r.get::<i32>(1)?.unwrap_or_default(),
                r.get::<i64>(2)?.unwrap_or_default(),
            ))
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })
    .map_err(RemusError::from)
}

/// The single shard of a reference table (present on every node).
pub fn reference_shard(relid: pg_sys::Oid) -> Result<i64, RemusError> {
    crate::pg::spi::read_one::<i64>(
        "SELECT min(shard_id) FROM remus.shards WHERE logicalrelid = $1",
        &[relid.into()],
    )?
    .ok_or(RemusError::ReferenceTableWithoutShard)
}

/// A reference table's placements: its one shard, on every node.
pub fn reference_placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    let shard_id = reference_shard(relid)?;
    Ok(crate::cluster::nodes::all_nodes()?
        .into_iter()
        .map(|n| ShardPlacement {
            shard_id,
            shard_index: 0,
            hash_min: i32::MIN,
            hash_max: i32::MAX,
            node_name: n.name,
        })
        .collect())
}

/// The shard tables (`remus_shards.*`) in `stmt`'s range table: range-table index, relation,
/// shard id.
///
/// # Safety
/// `stmt` must be a valid PlannedStmt.
pub(crate) unsafe fn shard_rtes(stmt: *mut pg_sys::PlannedStmt) -> Vec<(i32, pg_sys::Oid, i64)> {
    let mut shards = Vec::new();
    // SAFETY: the caller upholds this function's `# Safety` contract; catalog lookups run
    // inside the statement's transaction.
    unsafe {
        let shard_nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), true);
        if shard_nsp == pg_sys::InvalidOid {
            return shards;
        }
        let rtes = crate::pg::list::list_ptrs::<pg_sys::RangeTblEntry>((*stmt).rtable);
        for (i, rte) in rtes.into_iter().enumerate() {
            if (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION
                || pg_sys::get_rel_namespace((*rte).relid) != shard_nsp
            {
                continue;
            }
            let name = pg_sys::get_rel_name((*rte).relid);
            if name.is_null() {
                continue;
            }
            let name = std::ffi::CStr::from_ptr(name).to_string_lossy();
            if let Some(id) = name.rsplit('_').next().and_then(|s| s.parse::<i64>().ok()) {
                shards.push(((i + 1) as i32, (*rte).relid, id));
            }
        }
    }
    shards
}
