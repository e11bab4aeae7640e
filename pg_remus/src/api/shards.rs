//! The `remus_shards` view: every shard with its owner and its size there.

use pgrx::prelude::*;

use crate::catalog::shard_table_name;
use crate::error::RemusError;

/// Size of a shard's table on its owner, asked of the owner when it is another node. Anyone
/// may ask (as anyone may call `pg_total_relation_size`); it runs as the extension's owner,
/// which can read the catalog and name the shard table there (decision 0016).
#[pg_extern(volatile, parallel_unsafe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
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
            Ok(Some((
                r.get::<String>(1)?.unwrap_or_default(),
                r.get::<String>(2)?.unwrap_or_default(),
            )))
        })?;
        let Some((rel, owner)) = row else {
            return Ok(None);
        };
        let sql = format!(
            "SELECT pg_total_relation_size(to_regclass({}))",
            crate::pg::sql::quote_literal(&shard_table_name(&rel, shard_id))
        );
        if crate::guc::node_name().as_deref() == Some(owner.as_str()) {
            return Ok(Spi::get_one::<i64>(&sql)?);
        }
        let addr = crate::cluster::nodes::lookup(&owner)?;
        let r = crate::twophase::exec_in_transaction(&addr, &sql, false)?;
        Ok(r.rows
            .first()
            .and_then(|row| row[0].as_ref())
            .and_then(|v| v.parse().ok()))
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
