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
    /// Columns whose default draws from a sequence (`distribute::sequences`).
    pub(crate) sequences: Vec<super::sequences::SeqColumn>,
}

pub(crate) fn inspect(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
    key: &str,
) -> Result<TableInfo, RemusError> {
    let r = client.select(
        "SELECT c.relkind::text, format('%I.%I', n.nspname, c.relname), c.relname::text,
                c.relpersistence::text, c.relrowsecurity
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
        Some(1),
        &[relid.into()],
    )?;
    if r.is_empty() {
        return Err(RemusError::NoSuchRelation {
            oid: relid.to_u32(),
        });
    }
    let r = r.first();
    let relkind = r.get::<String>(1)?.unwrap_or_default();
    let qualified = r.get::<String>(2)?.unwrap_or_default();
    let rel_name = r.get::<String>(3)?.unwrap_or_default();
    if relkind != "r" {
        return Err(RemusError::NotOrdinaryTable { table: qualified });
    }
    if r.get::<String>(4)?.as_deref() != Some("p") {
        return Err(RemusError::NotPermanentTable { table: qualified });
    }
    if r.get::<bool>(5)? == Some(true) {
        return Err(RemusError::DistributeWithRowSecurity { table: qualified });
    }
    let already = client
        .select(
            "SELECT 1 FROM remus.distributed_tables WHERE logicalrelid = $1",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if already > 0 {
        return Err(RemusError::AlreadyDistributed { table: qualified });
    }
    let k = client.select(
        "SELECT a.attnum, a.atttypid, format_type(a.atttypid, NULL)
           FROM pg_attribute a WHERE a.attrelid = $1 AND a.attname = $2 AND a.attnum > 0
            AND NOT a.attisdropped",
        Some(1),
        &[relid.into(), key.into()],
    )?;
    if k.is_empty() {
        return Err(RemusError::NoSuchColumn {
            column: key.to_string(),
            table: qualified,
        });
    }
    let k = k.first();
    let key_attnum = k.get::<i16>(1)?.unwrap_or_default();
    let key_type = k.get::<pg_sys::Oid>(2)?.unwrap_or(pg_sys::InvalidOid);
    let key_type_name = k.get::<String>(3)?.unwrap_or_default();
    if !hashing::type_has_hash(key_type) {
        return Err(RemusError::KeyTypeWithoutHash {
            key: key.to_string(),
            type_name: key_type_name,
        });
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
            return Err(RemusError::NoPrimaryKey {
                table: qualified,
                key: key.to_string(),
            })
        }
        Some(false) => {
            return Err(RemusError::PrimaryKeyWithoutShardKey {
                table: qualified,
                key: key.to_string(),
            })
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
        return Err(RemusError::UniqueIndexWithoutShardKey {
            table: qualified,
            key: key.to_string(),
        });
    }
    let fks = client
        .select(
            "SELECT 1 FROM pg_constraint WHERE contype = 'f' AND (conrelid = $1 OR confrelid = $1)",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if fks > 0 {
        return Err(RemusError::HasForeignKeys { table: qualified });
    }
    let sequences = super::sequences::inspect(client, relid, &qualified)?;
    let dropped = client
        .select(
            "SELECT 1 FROM pg_attribute WHERE attrelid = $1 AND attisdropped",
            Some(1),
            &[relid.into()],
        )?
        .len();
    if dropped > 0 {
        return Err(RemusError::HasDroppedColumns { table: qualified });
    }
    let copy_columns = copy_columns(client, relid)?;
    Ok(TableInfo {
        qualified,
        rel_name,
        key_type,
        key_type_name,
        copy_columns,
        sequences,
    })
}

/// The columns COPY moves of `relid` (quoted, in order; generated ones left out: computed again
/// where the rows land).
pub(crate) fn copy_columns(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
) -> Result<Vec<String>, pgrx::spi::Error> {
    client
        .select(
            "SELECT quote_ident(attname) FROM pg_attribute
              WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
              ORDER BY attnum",
            None,
            &[relid.into()],
        )?
        .map(|r| r.get::<String>(1).map(|v| v.unwrap_or_default()))
        .collect()
}
