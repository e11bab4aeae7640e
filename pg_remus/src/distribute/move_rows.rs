//! Moving a table's existing rows into its new shards: INSERT … SELECT for local shards, COPY
//! over the remote transaction for shards on other nodes.

use std::collections::BTreeMap;

use pgrx::pg_sys;
use pgrx::spi::SpiClient;

use crate::catalog::hashing;
use crate::catalog::shard_table_name;
use crate::cluster::remote::NodeAddr;
use crate::distribute::validate::TableInfo;
use crate::error::RemusError;
use crate::pg::sql::quote_ident;

const COPY_FLUSH_BYTES: usize = 4 << 20;

/// One shard of the table being distributed.
pub(crate) struct ShardPlan {
    pub(crate) shard_id: i64,
    pub(crate) index: i32,
    pub(crate) lo: i32,
    pub(crate) hi: i32,
    pub(crate) owner: String,
}

/// Moves the table's existing rows into their shards: INSERT … SELECT for local shards, COPY
/// over the remote transaction for shards on other nodes.
pub(crate) fn move_rows(
    client: &mut SpiClient<'_>,
    info: &TableInfo,
    key: &str,
    shards: &[ShardPlan],
    me: &str,
    nodes: &[NodeAddr],
) -> Result<(), RemusError> {
    let cols = info.copy_columns.join(", ");
    let qkey = quote_ident(key);
    for p in shards.iter().filter(|p| p.owner == me) {
        client.update(
            &format!(
                "INSERT INTO {} ({cols}) SELECT {cols} FROM ONLY {} WHERE remus.key_hash({qkey}) BETWEEN {} AND {}",
                shard_table_name(&info.rel_name, p.shard_id),
                info.qualified,
                p.lo,
                p.hi
            ),
            None,
            &[],
        )?;
    }
    if shards.iter().all(|p| p.owner == me) {
        return Ok(());
    }
    let text_cols: Vec<String> = info
        .copy_columns
        .iter()
        .map(|c| format!("{c}::text"))
        .collect();
    let query = format!(
        "SELECT remus.key_hash({qkey}), {} FROM ONLY {}",
        text_cols.join(", "),
        info.qualified
    );
    let by_index: BTreeMap<i32, &ShardPlan> = shards.iter().map(|p| (p.index, p)).collect();
    let mut buffers: BTreeMap<i64, String> = BTreeMap::new();
    let flush = |shard: &ShardPlan, data: &str| -> Result<(), RemusError> {
        let addr = nodes
            .iter()
            .find(|n| n.name == shard.owner)
            .expect("owner is a known node");
        let sql = format!(
            "COPY {} ({cols}) FROM STDIN",
            shard_table_name(&info.rel_name, shard.shard_id)
        );
        crate::cluster::remote::with_connection(addr, |c| c.copy_in(&sql, data.as_bytes()))?;
        Ok(())
    };
    let mut cursor = client.open_cursor(&query, &[]);
    loop {
        let batch = cursor.fetch(10_000)?;
        if batch.is_empty() {
            break;
        }
        for row in batch {
            let hash = row.get::<i32>(1)?.unwrap_or_default();
            let idx = hashing::shard_index(hash, shards.len() as u32) as i32;
            let shard = by_index[&idx];
            if shard.owner == me {
                continue;
            }
            let buf = buffers.entry(shard.shard_id).or_default();
            for i in 0..info.copy_columns.len() {
                if i > 0 {
                    buf.push('\t');
                }
                match row.get::<String>(i + 2)? {
                    Some(v) => copy_escape(&v, buf),
                    None => buf.push_str("\\N"),
                }
            }
            buf.push('\n');
            if buf.len() >= COPY_FLUSH_BYTES {
                let data = std::mem::take(buf);
                flush(shard, &data)?;
            }
        }
    }
    for (shard_id, data) in buffers {
        if let Some(shard) = shards.iter().find(|p| p.shard_id == shard_id) {
            if !data.is_empty() {
                flush(shard, &data)?;
            }
        }
    }
    Ok(())
}

/// Escapes one value for COPY text format.
pub(crate) fn copy_escape(v: &str, out: &mut String) {
    for ch in v.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
}

/// The columns (quoted, comma-separated; generated ones left out) of `relid` and the rows of
/// `table` (with those columns) as COPY text.
pub(crate) fn rows_as_copy_text(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
    table: &str,
) -> Result<(String, String), RemusError> {
    let columns = crate::distribute::validate::copy_columns(client, relid)?;
    let text: Vec<String> = columns.iter().map(|c| format!("{c}::text")).collect();
    let mut data = String::new();
    let mut cursor = client.open_cursor(
        &format!("SELECT {} FROM ONLY {table}", text.join(", ")),
        &[],
    );
    loop {
        let batch = cursor.fetch(10_000)?;
        if batch.is_empty() {
            break;
        }
        for row in batch {
            for i in 0..columns.len() {
                if i > 0 {
                    data.push('\t');
                }
                match row.get::<String>(i + 1)? {
                    Some(v) => copy_escape(&v, &mut data),
                    None => data.push_str("\\N"),
                }
            }
            data.push('\n');
        }
    }
    Ok((columns.join(", "), data))
}
