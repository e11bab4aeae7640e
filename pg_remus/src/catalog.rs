//! The distribution catalog: which tables are distributed, their shards, and the shard map.
//!
//! Every node holds the same rows; every change is one 2PC transaction over all nodes. Tables
//! are referenced by `regclass`, so each node stores its own OID for the same name. The shard
//! map (`remus.shard_map`) is an ordinary table: MVCC makes it multiversioned, and a reader sees
//! the owner its own snapshot sees.

use pgrx::prelude::*;

use crate::error::RemusError;

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

#[derive(Debug, Clone)]
pub struct DistTable {
    pub relid: pg_sys::Oid,
    pub qualified_name: String,
    pub rel_name: String,
    pub shard_key: Option<String>,
    pub key_type: pg_sys::Oid,
    pub kind: char,
    pub shard_count: i32,
    pub colocation_id: i32,
}

#[derive(Debug, Clone)]
pub struct ShardPlacement {
    pub shard_id: i64,
    pub shard_index: i32,
    pub hash_min: i32,
    pub hash_max: i32,
    pub node_name: String,
}

/// Quotes an identifier for SQL text sent to this or another node.
pub fn quote_ident(s: &str) -> String {
    if !s.is_empty()
        && s.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        s.to_string()
    } else {
        format!("\"{}\"", s.replace('"', "\"\""))
    }
}

/// `remus_shards.<table>_<shard_id>`, quoted.
pub fn shard_table_name(rel_name: &str, shard_id: i64) -> String {
    format!("remus_shards.{}", quote_ident(&format!("{rel_name}_{shard_id}")))
}

pub fn dist_table(relid: pg_sys::Oid) -> Result<Option<DistTable>, RemusError> {
    Spi::connect(|c| {
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
        Ok(Some(DistTable {
            relid,
            shard_key: r.get::<String>(1)?,
            key_type: r.get::<pg_sys::Oid>(2)?.unwrap_or(pg_sys::InvalidOid),
            kind: r.get::<String>(3)?.and_then(|s| s.chars().next()).unwrap_or('h'),
            shard_count: r.get::<i32>(4)?.unwrap_or(0),
            colocation_id: r.get::<i32>(5)?.unwrap_or(0),
            qualified_name: r.get::<String>(6)?.unwrap_or_default(),
            rel_name: r.get::<String>(7)?.unwrap_or_default(),
        }))
    })
    .map_err(RemusError::from)
}

/// Shards of a table with their owners, as this transaction's snapshot sees them.
pub fn placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    Spi::connect(|c| {
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

/// The one value of a read-only query (an aggregate, so there is always one row), read with the
/// active snapshot. pgrx's `Spi::get_one*` run their query as a mutating one, which assigns the
/// transaction an xid: on the routing path that gave every read-only transaction an xid (a
/// commit record to flush, and a migration's slot creation waiting for it to end).
pub fn read_one<'mcx, A: FromDatum + IntoDatum>(
    query: &str,
    args: &[pgrx::datum::DatumWithOid<'mcx>],
) -> Result<Option<A>, pgrx::spi::Error> {
    Spi::connect(|c| c.select(query, Some(1), args)?.first().get_one())
}

/// The single shard of a reference table (present on every node).
pub fn reference_shard(relid: pg_sys::Oid) -> Result<i64, RemusError> {
    read_one::<i64>("SELECT min(shard_id) FROM remus.shards WHERE logicalrelid = $1", &[relid.into()])?
        .ok_or_else(|| RemusError::InvalidArgument("reference table has no shard".into()))
}

/// A reference table's placements: its one shard, on every node.
pub fn reference_placements(relid: pg_sys::Oid) -> Result<Vec<ShardPlacement>, RemusError> {
    let shard_id = reference_shard(relid)?;
    Ok(crate::nodes::all_nodes()?
        .into_iter()
        .map(|n| ShardPlacement { shard_id, shard_index: 0, hash_min: i32::MIN, hash_max: i32::MAX, node_name: n.name })
        .collect())
}

/// Size of a shard's table on its owner, asked of the owner when it is another node.
#[pg_extern(volatile, parallel_unsafe)]
fn remus_shard_size(shard_id: i64) -> Option<i64> {
    let run = || -> Result<Option<i64>, RemusError> {
        let row = Spi::connect(|c| {
            let r = c.select(
                "SELECT cl.relname::text, m.node_name FROM remus.shards s
                   JOIN remus.shard_map m USING (shard_id)
                   JOIN pg_class cl ON cl.oid = s.logicalrelid WHERE s.shard_id = $1",
                Some(1),
                &[shard_id.into()],
            )?;
            if r.is_empty() {
                return Ok::<_, pgrx::spi::Error>(None);
            }
            let r = r.first();
            Ok(Some((r.get::<String>(1)?.unwrap_or_default(), r.get::<String>(2)?.unwrap_or_default())))
        })?;
        let Some((rel, owner)) = row else { return Ok(None) };
        let sql = format!(
            "SELECT pg_total_relation_size(to_regclass({}))",
            crate::remote::quote_literal(&shard_table_name(&rel, shard_id))
        );
        if crate::guc::node_name().as_deref() == Some(owner.as_str()) {
            return Ok(Spi::get_one::<i64>(&sql)?);
        }
        let addr = crate::nodes::lookup(&owner)?;
        let r = crate::twophase::exec_in_transaction(&addr, &sql, false)?;
        Ok(r.rows.first().and_then(|row| row[0].as_ref()).and_then(|v| v.parse().ok()))
    };
    crate::error::OrRaise::or_raise(run())
}

pgrx::extension_sql!(
    r#"
CREATE VIEW remus_shards AS
    SELECT s.shard_id, d.logicalrelid::text AS table_name, d.shard_key, s.hash_min, s.hash_max,
           m.node_name, d.colocation_id, remus_shard_size(s.shard_id) AS size_bytes
      FROM remus.shards s
      JOIN remus.distributed_tables d USING (logicalrelid)
      LEFT JOIN remus.shard_map m USING (shard_id)
     ORDER BY s.shard_id;
COMMENT ON VIEW remus_shards IS 'Every shard: table, key, hash range, owner node (NULL: a reference table, on every node), size on the owner';
"#,
    name = "shards_view",
    requires = ["distribution_catalog", remus_shard_size]
);
