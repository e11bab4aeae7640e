//! Can this table be distributed? What the conversion needs to know about it.

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::catalog::hashing;
use crate::error::RemusError;

pub(crate) struct TableInfo {
    pub(crate) qualified: String,
    pub(crate) rel_name: String,
    pub(crate) key_type: pg_sys::Oid,
    pub(crate) key_type_name: String,
    /// Non-generated columns, quoted, in attnum order (what COPY and INSERT … SELECT carry).
    pub(crate) copy_columns: Vec<String>,
}

pub(crate) fn inspect(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
    key: &str,
) -> Result<TableInfo, RemusError> {
    let r = client.select(
        "SELECT c.relkind::text, format('%I.%I', n.nspname, c.relname), c.relname::text,
                c.relpersistence::text
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
        Some(1),
        &[relid.into()],
    )?;
    if r.is_empty() {
        return Err(RemusError::InvalidArgument(format!(
            "relation with oid {} does not exist",
            relid.to_u32()
        )));
    }
    let r = r.first();
    let relkind = r.get::<String>(1)?.unwrap_or_default();
    let qualified = r.get::<String>(2)?.unwrap_or_default();
    let rel_name = r.get::<String>(3)?.unwrap_or_default();
    if relkind != "r" {
        return Err(RemusError::FeatureNotSupported(format!(
            "{qualified} is not an ordinary table; only ordinary tables can be distributed"
        )));
    }
    if r.get::<String>(4)?.as_deref() != Some("p") {
        return Err(RemusError::FeatureNotSupported(format!(
            "{qualified} is temporary or unlogged; only permanent logged tables can be distributed"
        )));
    }
    let already = client
        .select(
            "SELECT 1 FROM remus.distributed_tables WHERE logicalrelid = $1",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if already > 0 {
        return Err(RemusError::DuplicateObject(format!(
            "table {qualified} is already distributed"
        )));
    }
    let k = client.select(
        "SELECT a.attnum, a.atttypid, format_type(a.atttypid, NULL)
           FROM pg_attribute a WHERE a.attrelid = $1 AND a.attname = $2 AND a.attnum > 0
            AND NOT a.attisdropped",
        Some(1),
        &[relid.into(), key.into()],
    )?;
    if k.is_empty() {
        return Err(RemusError::UndefinedColumn(format!(
            "column \"{key}\" of table {qualified} does not exist"
        )));
    }
    let k = k.first();
    let key_attnum = k.get::<i16>(1)?.unwrap_or_default();
    let key_type = k.get::<pg_sys::Oid>(2)?.unwrap_or(pg_sys::InvalidOid);
    let key_type_name = k.get::<String>(3)?.unwrap_or_default();
    if !hashing::type_has_hash(key_type) {
        return Err(RemusError::InvalidTableDefinition(format!(
            "shard key \"{key}\" has type {key_type_name}, which has no hash function"
        )));
    }
    let pk = client.select(
        "SELECT $2::int2 = ANY (i.indkey::int2[]) FROM pg_index i WHERE i.indrelid = $1 AND i.indisprimary",
        Some(1),
        &[relid.into(), key_attnum.into()],
    )?;
    let pk_has_key = if pk.is_empty() {
        None
    } else {
        pk.first().get::<bool>(1)?
    };
    match pk_has_key {
        None => {
            return Err(RemusError::InvalidTableDefinition(format!(
                "table {qualified} has no primary key; a distributed table needs a primary key that contains the shard key \"{key}\""
            )))
        }
        Some(false) => {
            return Err(RemusError::InvalidTableDefinition(format!(
                "the primary key of {qualified} does not contain the shard key \"{key}\"; a distributed table needs a primary key that contains its shard key"
            )))
        }
        Some(true) => {}
    }
    let unique_without_key = client
        .select(
            "SELECT 1 FROM pg_index i WHERE i.indrelid = $1 AND i.indisunique AND NOT i.indisprimary
               AND NOT ($2::int2 = ANY (i.indkey::int2[]))",
            Some(1),
            &[relid.into(), key_attnum.into()],
        )?
        .len();
    if unique_without_key > 0 {
        return Err(RemusError::InvalidTableDefinition(format!(
            "{qualified} has a unique index without the shard key \"{key}\"; uniqueness could not be enforced across shards"
        )));
    }
    let fks = client
        .select(
            "SELECT 1 FROM pg_constraint WHERE contype = 'f' AND (conrelid = $1 OR confrelid = $1)",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if fks > 0 {
        return Err(RemusError::FeatureNotSupported(format!(
            "{qualified} has foreign keys; foreign keys on distributed tables are not supported"
        )));
    }
    let seq_defaults = client
        .select(
            "SELECT 1 FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
              WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
                AND (a.attidentity <> '' OR pg_get_expr(d.adbin, d.adrelid) LIKE '%nextval(%')",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if seq_defaults > 0 {
        return Err(RemusError::FeatureNotSupported(format!(
            "{qualified} has identity or serial columns; each node would draw its own values, so they are not supported on distributed tables (use uuid defaults such as gen_random_uuid())"
        )));
    }
    let dropped = client
        .select(
            "SELECT 1 FROM pg_attribute WHERE attrelid = $1 AND attisdropped",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if dropped > 0 {
        return Err(RemusError::FeatureNotSupported(format!(
            "{qualified} has dropped columns; shards are planned with the shell's column numbers, so recreate the table (CREATE TABLE … AS) before distributing it"
        )));
    }
    let copy_columns = client
        .select(
            "SELECT quote_ident(attname) FROM pg_attribute
              WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
              ORDER BY attnum",
            None,
            &[relid.into()],
        )?
        .map(|r| r.get::<String>(1).map(|v| v.unwrap_or_default()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TableInfo {
        qualified,
        rel_name,
        key_type,
        key_type_name,
        copy_columns,
    })
}
