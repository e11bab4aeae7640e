//! Turning a table into a distributed (hash-sharded) table.
//!
//! `remus_create_distributed_table` runs on any node and, inside the caller's transaction:
//! locks the table, writes the catalog rows on every node, creates the shell (same columns,
//! constraints and indexes) on every other node, creates each shard table on its owner
//! (`CREATE TABLE … (LIKE shell INCLUDING ALL)`), moves existing rows into their shards (COPY to
//! remote owners), empties the local shell and puts the shell guard on every shell. The remote
//! parts are remote transactions of the caller's transaction, so the whole conversion commits
//! by 2PC or not at all.

//!
//! [`validate`] checks that a table can be distributed; [`move_rows`](mod@move_rows) moves its
//! existing rows; [`sequences`] gives each node its own range of the table's sequences (created
//! on the other nodes before their shells, whose defaults name them); [`caller`] checks who asks
//! (the table's owner) and runs the conversion with the cluster's rights.

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::catalog::hashing;
use crate::catalog::shard_ddl::{capture_trigger_ddl, guard_ddl};
use crate::catalog::shard_table_name;
use crate::error::RemusError;
use crate::pg::sql::quote_literal;

mod caller;
mod move_rows;
pub(crate) mod new_node;
mod sequences;
mod validate;

use move_rows::{move_rows, rows_as_copy_text, ShardPlan};
use validate::inspect;

/// Most shards a distributed table may have.
const MAX_SHARD_COUNT: i32 = 4096;

/// Runs `read` with search_path = pg_catalog, so that every name it deparses (pg_get_expr,
/// pg_get_constraintdef, pg_get_indexdef, regclass) is schema-qualified, then restores the
/// caller's search_path (on an error the transaction aborts, and the local setting with it).
fn with_qualified_names<'conn, T>(
    client: &mut SpiClient<'conn>,
    read: impl FnOnce(&mut SpiClient<'conn>) -> Result<T, RemusError>,
) -> Result<T, RemusError> {
    let saved = client
        .select("SELECT current_setting('search_path')", Some(1), &[])?
        .first()
        .get::<String>(1)?
        .unwrap_or_default();
    client.update(
        "SELECT set_config('search_path', 'pg_catalog', true)",
        None,
        &[],
    )?;
    let read = read(client)?;
    client.update(
        "SELECT set_config('search_path', $1, true)",
        None,
        &[saved.as_str().into()],
    )?;
    Ok(read)
}

/// CREATE TABLE (columns, defaults, constraints) plus the table's other indexes and its owner,
/// for shells on other nodes (which run it as the node user: without the owner, the shells
/// there would be the node user's, and the table's owner could not use them). Deparsed with
/// search_path = pg_catalog so every name is schema-qualified. The owner role must exist on
/// every node (roles are per PostgreSQL cluster), and so must every role the table's grants
/// name: they are copied (table and column privileges), so that a role granted access before the
/// conversion keeps it through every node.
fn shell_ddl(
    client: &mut SpiClient<'_>,
    relid: pg_sys::Oid,
    qualified: &str,
) -> Result<String, RemusError> {
    let (body, indexes, owner, grants) = with_qualified_names(client, |client| {
        let body = client
            .select(
                "SELECT string_agg(def, ', ' ORDER BY ord) FROM (
                   SELECT a.attnum AS ord,
                          format('%I %s', a.attname, format_type(a.atttypid, a.atttypmod))
                          || CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
                                  THEN ' COLLATE ' || format('%I.%I', cn.nspname, co.collname) ELSE '' END
                          || CASE WHEN a.attgenerated = 's'
                                  THEN ' GENERATED ALWAYS AS (' || pg_get_expr(d.adbin, d.adrelid) || ') STORED'
                                  WHEN d.adbin IS NOT NULL THEN ' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid)
                                  ELSE '' END
                          || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END AS def
                     FROM pg_attribute a
                     JOIN pg_type t ON t.oid = a.atttypid
                     LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                     LEFT JOIN pg_collation co ON co.oid = a.attcollation
                     LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
                    WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
                   UNION ALL
                   SELECT 100000 + row_number() OVER (ORDER BY c.conname),
                          format('CONSTRAINT %I %s', c.conname, pg_get_constraintdef(c.oid))
                     FROM pg_constraint c WHERE c.conrelid = $1 AND c.contype IN ('p', 'u', 'c', 'x')
                 ) defs",
                Some(1),
                &[relid.into()],
            )?
            .first()
            .get::<String>(1)?
            .unwrap_or_default();
        let indexes = client
            .select(
                "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i
                  WHERE i.indrelid = $1
                    AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)",
                None,
                &[relid.into()],
            )?
            .map(|r| r.get::<String>(1).map(|v| v.unwrap_or_default()))
            .collect::<Result<Vec<_>, _>>()?;
        let owner = client
            .select(
                "SELECT quote_ident(pg_get_userbyid(relowner)) FROM pg_class WHERE oid = $1",
                Some(1),
                &[relid.into()],
            )?
            .first()
            .get::<String>(1)?
            .unwrap_or_default();
        // The grants, as the owner made them (the node user runs these: PostgreSQL records a
        // superuser's grant as the owner's). Privileges the owner holds are implicit.
        let grants = client
            .select(
                "SELECT format('GRANT %s ON %s TO %s%s', a.privilege_type, $2,
                               CASE a.grantee WHEN 0 THEN 'PUBLIC'
                                    ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                               CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
                   FROM pg_class c
                   CROSS JOIN LATERAL aclexplode(c.relacl) a
                  WHERE c.oid = $1 AND a.grantee <> c.relowner
                 UNION ALL
                 SELECT format('GRANT %s (%s) ON %s TO %s%s', a.privilege_type,
                               quote_ident(col.attname), $2,
                               CASE a.grantee WHEN 0 THEN 'PUBLIC'
                                    ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                               CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
                   FROM pg_class c
                   JOIN pg_attribute col ON col.attrelid = c.oid AND col.attnum > 0
                                        AND NOT col.attisdropped AND col.attacl IS NOT NULL
                   CROSS JOIN LATERAL aclexplode(col.attacl) a
                  WHERE c.oid = $1 AND a.grantee <> c.relowner",
                None,
                &[relid.into(), qualified.into()],
            )?
            .map(|r| r.get::<String>(1).map(|v| v.unwrap_or_default()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((body, indexes, owner, grants))
    })?;
    let mut ddl = format!("CREATE TABLE {qualified} ({body});\n");
    for i in indexes {
        ddl.push_str(&i);
        ddl.push_str(";\n");
    }
    ddl.push_str(&format!("ALTER TABLE {qualified} OWNER TO {owner};\n"));
    for g in grants {
        ddl.push_str(&g);
        ddl.push_str(";\n");
    }
    Ok(ddl)
}

fn create(
    relid: pg_sys::Oid,
    key: &str,
    shard_count: i32,
    colocate_with: Option<pg_sys::Oid>,
) -> Result<(), RemusError> {
    let me = crate::guc::node_name().ok_or(RemusError::NodeNameUnset)?;
    if !(1..=MAX_SHARD_COUNT).contains(&shard_count) {
        return Err(RemusError::ShardCountOutOfRange {
            shard_count,
            max: MAX_SHARD_COUNT,
        });
    }
    let nodes = crate::cluster::nodes::all_nodes()?;
    if !nodes.iter().any(|n| n.name == me) {
        return Err(RemusError::SelfNotInCluster { node: me });
    }
    Spi::connect_mut(|client| -> Result<(), RemusError> {
        let info = inspect(client, relid, key)?;
        // Serialise conversions on this node and keep writers off the table while rows move.
        client.update(
            &format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", info.qualified),
            None,
            &[],
        )?;
        client.update("LOCK TABLE remus.shards IN EXCLUSIVE MODE", None, &[])?;

        let (colocation_id, owners): (i32, Option<Vec<String>>) = match colocate_with {
            Some(other) => {
                let other_t = crate::catalog::dist_table(other)?
                    .ok_or(RemusError::ColocateWithNotDistributed)?;
                if other_t.kind != 'h' {
                    return Err(RemusError::ColocateWithReference {
                        table: other_t.qualified_name.to_string(),
                    });
                }
                if other_t.key_type != info.key_type {
                    return Err(RemusError::ColocateKeyTypesDiffer {
                        table: info.qualified.clone(),
                        other: other_t.qualified_name.to_string(),
                    });
                }
                if other_t.shard_count != shard_count {
                    return Err(RemusError::ColocateShardCountsDiffer {
                        table: info.qualified.clone(),
                        shard_count,
                        other: other_t.qualified_name.to_string(),
                        other_shard_count: other_t.shard_count,
                    });
                }
                let owners = crate::catalog::placements(other)?
                    .into_iter()
                    .map(|p| p.node_name)
                    .collect();
                (other_t.colocation_id, Some(owners))
            }
            None => {
                let next = client
                    .select(
                        "SELECT coalesce(max(colocation_id), 0) + 1 FROM remus.distributed_tables",
                        Some(1),
                        &[],
                    )?
                    .first()
                    .get::<i32>(1)?
                    .unwrap_or(1);
                (next, None)
            }
        };
        let first_id = client
            .select(
                "SELECT coalesce(max(shard_id), 0) + 1 FROM remus.shards",
                Some(1),
                &[],
            )?
            .first()
            .get::<i64>(1)?
            .unwrap_or(1);
        let shards: Vec<ShardPlan> = hashing::shard_ranges(shard_count as u32)
            .into_iter()
            .enumerate()
            .map(|(i, (lo, hi))| ShardPlan {
                shard_id: first_id + i as i64,
                index: i as i32,
                lo,
                hi,
                owner: match &owners {
                    Some(o) => o[i].clone(),
                    None => nodes[i % nodes.len()].name.clone(),
                },
            })
            .collect();

        let catalog_sql = {
            let rel = quote_literal(&info.qualified);
            let mut s = format!(
                "INSERT INTO remus.distributed_tables VALUES ({rel}::regclass, {}, {}::regtype, 'h', {shard_count}, {colocation_id});\n",
                quote_literal(key),
                quote_literal(&info.key_type_name)
            );
            let vals: Vec<String> = shards
                .iter()
                .map(|p| {
                    format!(
                        "({}, {rel}::regclass, {}, {}, {})",
                        p.shard_id, p.index, p.lo, p.hi
                    )
                })
                .collect();
            s.push_str(&format!(
                "INSERT INTO remus.shards VALUES {};\n",
                vals.join(", ")
            ));
            let map: Vec<String> = shards
                .iter()
                .map(|p| format!("({}, {})", p.shard_id, quote_literal(&p.owner)))
                .collect();
            s.push_str(&format!(
                "INSERT INTO remus.shard_map VALUES {};\n",
                map.join(", ")
            ));
            s
        };
        let shard_ddl = |owner: &str| -> String {
            shards
                .iter()
                .filter(|p| p.owner == owner)
                .map(|p| {
                    let table = shard_table_name(&info.rel_name, p.shard_id);
                    // Without the identity: the shell's sequence is the one that draws.
                    format!(
                        "CREATE TABLE {table} (LIKE {} INCLUDING ALL EXCLUDING IDENTITY);\n{}",
                        info.qualified,
                        capture_trigger_ddl(&table, p.shard_id)
                    )
                })
                .collect()
        };
        let shell = shell_ddl(client, relid, &info.qualified)?;

        // Other nodes: shell, guard, catalog, their shard tables; in this transaction.
        for n in nodes.iter().filter(|n| n.name != me) {
            let exists = crate::twophase::exec_in_transaction(
                n,
                &format!(
                    "SELECT to_regclass({}) IS NOT NULL",
                    quote_literal(&info.qualified)
                ),
                true,
            )?;
            if exists.rows.first().and_then(|r| r[0].as_deref()) == Some("t") {
                return Err(RemusError::TableExistsOnNode {
                    table: info.qualified.clone(),
                    node: n.name.clone(),
                });
            }
            let slot = sequences::slot_of(&nodes, &n.name)?;
            let sql = format!(
                "LOCK TABLE remus.shards IN EXCLUSIVE MODE;\n{}{shell}{}{}{catalog_sql}{}",
                sequences::before_shell(&info.sequences, slot),
                sequences::after_shell(&info.sequences, &info.qualified, slot),
                guard_ddl(&info.qualified),
                shard_ddl(&n.name)
            );
            crate::twophase::exec_in_transaction(n, &sql, true)?;
        }
        // This node. Its sequences keep the values handed out so far (slot 0) and go on in
        // its own range. Rows move before the local catalog says the table is distributed: from
        // then on the router reads its shards instead of the shell's heap.
        if !info.sequences.is_empty() {
            let restrict =
                sequences::restrict_local(&info.sequences, sequences::slot_of(&nodes, &me)?);
            client.update(&restrict, None, &[])?;
        }
        let local_ddl = shard_ddl(&me);
        if !local_ddl.is_empty() {
            client.update(&local_ddl, None, &[])?;
        }
        move_rows(client, &info, key, &shards, &me, &nodes)?;
        client.update(&catalog_sql, None, &[])?;
        client.update(&format!("TRUNCATE ONLY {}", info.qualified), None, &[])?;
        client.update(&guard_ddl(&info.qualified), None, &[])?;
        Ok(())
    })
}

fn create_reference(relid: pg_sys::Oid) -> Result<(), RemusError> {
    let me = crate::guc::node_name().ok_or(RemusError::NodeNameUnset)?;
    let nodes = crate::cluster::nodes::all_nodes()?;
    if !nodes.iter().any(|n| n.name == me) {
        return Err(RemusError::SelfNotInCluster { node: me });
    }
    Spi::connect_mut(|client| -> Result<(), RemusError> {
        let r = client.select(
            "SELECT c.relkind::text, format('%I.%I', n.nspname, c.relname), c.relname::text, c.relpersistence::text,
                    EXISTS (SELECT 1 FROM remus.distributed_tables WHERE logicalrelid = c.oid),
                    EXISTS (SELECT 1 FROM pg_constraint WHERE contype = 'f' AND (conrelid = c.oid OR confrelid = c.oid)),
                    EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = c.oid AND attisdropped),
                    c.relrowsecurity,
                    (SELECT quote_ident(attname) FROM pg_attribute
                      WHERE attrelid = c.oid AND attnum > 0 AND NOT attisdropped
                        AND attidentity <> '' ORDER BY attnum LIMIT 1)
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
            Some(1),
            &[relid.into()],
        )?;
        let r = r.first();
        let qualified = r.get::<String>(2)?.unwrap_or_default();
        let rel_name = r.get::<String>(3)?.unwrap_or_default();
        if r.get::<String>(1)?.as_deref() != Some("r")
            || r.get::<String>(4)?.as_deref() != Some("p")
        {
            return Err(RemusError::NotOrdinaryPermanentTable { table: qualified });
        }
        if r.get::<bool>(5)? == Some(true) {
            return Err(RemusError::AlreadyDistributed { table: qualified });
        }
        if r.get::<bool>(6)? == Some(true) {
            return Err(RemusError::HasForeignKeys { table: qualified });
        }
        if r.get::<bool>(7)? == Some(true) {
            return Err(RemusError::ReferenceHasDroppedColumns { table: qualified });
        }
        if r.get::<bool>(8)? == Some(true) {
            return Err(RemusError::DistributeWithRowSecurity { table: qualified });
        }
        if let Some(column) = r.get::<String>(9)? {
            return Err(RemusError::ReferenceIdentityColumn {
                table: qualified,
                column,
            });
        }
        client.update(
            &format!("LOCK TABLE {qualified} IN ACCESS EXCLUSIVE MODE"),
            None,
            &[],
        )?;
        client.update("LOCK TABLE remus.shards IN EXCLUSIVE MODE", None, &[])?;
        let shard_id = client
            .select(
                "SELECT coalesce(max(shard_id), 0) + 1 FROM remus.shards",
                Some(1),
                &[],
            )?
            .first()
            .get::<i64>(1)?
            .unwrap_or(1);
        let rel = quote_literal(&qualified);
        let catalog_sql = format!(
            "INSERT INTO remus.distributed_tables VALUES ({rel}::regclass, NULL, NULL, 'r', 1, 0);\n\
             INSERT INTO remus.shards VALUES ({shard_id}, {rel}::regclass, 0, {}, {});\n",
            i32::MIN,
            i32::MAX
        );
        let shard = shard_table_name(&rel_name, shard_id);
        let shard_ddl =
            format!("CREATE TABLE {shard} (LIKE {qualified} INCLUDING ALL EXCLUDING IDENTITY);\n");
        let shell = shell_ddl(client, relid, &qualified)?;
        // The rows as COPY text, once, for every other node.
        let (cols, data) = rows_as_copy_text(client, relid, &qualified)?;
        for n in nodes.iter().filter(|n| n.name != me) {
            let exists = crate::twophase::exec_in_transaction(
                n,
                &format!(
                    "SELECT to_regclass({}) IS NOT NULL",
                    quote_literal(&qualified)
                ),
                true,
            )?;
            if exists.rows.first().and_then(|r| r[0].as_deref()) == Some("t") {
                return Err(RemusError::TableExistsOnNode {
                    table: qualified.clone(),
                    node: n.name.clone(),
                });
            }
            let sql = format!(
                "LOCK TABLE remus.shards IN EXCLUSIVE MODE;\n{shell}{}{catalog_sql}{shard_ddl}",
                guard_ddl(&qualified)
            );
            crate::twophase::exec_in_transaction(n, &sql, true)?;
            if !data.is_empty() {
                crate::twophase::copy_in_transaction(
                    n,
                    &format!("COPY {shard} ({cols}) FROM STDIN"),
                    data.as_bytes(),
                )?;
            }
        }
        client.update(&shard_ddl, None, &[])?;
        client.update(
            &format!("INSERT INTO {shard} ({cols}) SELECT {cols} FROM ONLY {qualified}"),
            None,
            &[],
        )?;
        client.update(&catalog_sql, None, &[])?;
        client.update(&format!("TRUNCATE ONLY {qualified}"), None, &[])?;
        client.update(&guard_ddl(&qualified), None, &[])?;
        Ok(())
    })
}

#[pg_schema]
mod remus {
    use pgrx::datum::AnyElement;
    use pgrx::prelude::*;

    use crate::error::{OrRaise, RemusError};

    /// Runs as its caller, who must own the table; the conversion itself runs as the bootstrap
    /// superuser (`distribute::caller`), under this pinned search_path.
    #[pg_extern(volatile, parallel_unsafe)]
    #[search_path(pg_catalog, pg_temp)]
    fn create_distributed_table(
        relid: pg_sys::Oid,
        shard_key: &str,
        shard_count: i32,
        colocate_with: Option<pg_sys::Oid>,
    ) {
        crate::distribute::caller::convert(relid, || {
            crate::distribute::create(relid, shard_key, shard_count, colocate_with)
        })
        .or_raise();
    }

    /// As `create_distributed_table`.
    #[pg_extern(volatile, parallel_unsafe)]
    #[search_path(pg_catalog, pg_temp)]
    fn create_reference_table(relid: pg_sys::Oid) {
        crate::distribute::caller::convert(relid, || crate::distribute::create_reference(relid))
            .or_raise();
    }

    /// The int4 hash of a shard-key value (its type's standard hash function).
    #[pg_extern(immutable, strict, parallel_safe)]
    fn key_hash(value: AnyElement) -> i32 {
        // SAFETY: AnyElement carries a valid datum of the type it names.
        unsafe {
            crate::catalog::hashing::hash_datum(value.datum(), value.oid(), pg_sys::InvalidOid)
        }
        .or_raise()
    }

    /// The shard id a value of the table's shard key maps to: `remus_shard_id_for(table_name
    /// regclass, value anyelement)`, defined here by hand so that it takes a regclass and sits
    /// in the extension's schema, callable by every role (decision 0016) without the `remus`
    /// schema, as the caller (the value's coercion to the key type is the caller's code).
    #[pg_extern(
        stable,
        strict,
        parallel_safe,
        sql = "CREATE FUNCTION remus_shard_id_for(table_name regclass, value anyelement) RETURNS bigint
    STABLE STRICT PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'shard_id_for_wrapper';
COMMENT ON FUNCTION remus_shard_id_for(regclass, anyelement) IS 'The shard a shard-key value maps to';"
    )]
    fn shard_id_for(relid: pg_sys::Oid, value: AnyElement) -> i64 {
        let run = || -> Result<i64, RemusError> {
            let Some(t) = crate::catalog::dist_table(relid)? else {
                // Named schema-qualified, as the other messages name tables, not by oid.
                let table = Spi::get_one_with_args::<String>(
                    "SELECT format('%I.%I', n.nspname, c.relname)
                       FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                      WHERE c.oid = $1",
                    &[relid.into()],
                )?
                .unwrap_or_else(|| relid.to_u32().to_string());
                return Err(RemusError::NotDistributed { table });
            };
            if t.kind != 'h' {
                return Err(RemusError::ReferenceTableHasOneShard {
                    table: t.qualified_name.to_string(),
                });
            }
            // SAFETY: AnyElement carries a valid datum of its type; coercion goes through the
            // types' text I/O, which errors on a value the key type cannot represent.
            let hash = unsafe {
                let d = crate::pg::datum::coerce_via_text(value.datum(), value.oid(), t.key_type);
                crate::catalog::hashing::hash_datum(d, t.key_type, pg_sys::InvalidOid)?
            };
            let idx = crate::catalog::hashing::shard_index(hash, t.shard_count as u32) as i32;
            crate::catalog::placements(relid)?
                .into_iter()
                .find(|p| p.shard_index == idx)
                .map(|p| p.shard_id)
                .ok_or(RemusError::IncompleteShardMap)
        };
        run().or_raise()
    }
}

// SQL-standard bodies (BEGIN ATOMIC): parsed here, so a call names nothing in schema `remus` at
// run time, and its callers need EXECUTE on the function there but no USAGE on the schema
// (decision 0016: nobody but a superuser can name `remus`'s internals).
pgrx::extension_sql!(
    r#"
CREATE FUNCTION remus_create_distributed_table(
    table_name regclass, shard_key text, shard_count int DEFAULT 32, colocate_with regclass DEFAULT NULL)
RETURNS void LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT remus.create_distributed_table(table_name::oid, shard_key, shard_count, colocate_with::oid);
END;
COMMENT ON FUNCTION remus_create_distributed_table(regclass, text, int, regclass) IS
    'Hash-shard a table over all nodes (atomic across nodes; existing rows move into the shards)';

CREATE FUNCTION remus_create_reference_table(table_name regclass) RETURNS void
LANGUAGE sql VOLATILE
BEGIN ATOMIC
    SELECT remus.create_reference_table(table_name::oid);
END;
COMMENT ON FUNCTION remus_create_reference_table(regclass) IS
    'Copy a table to every node: reads are local, writes go to every node in one 2PC transaction';
"#,
    name = "distribute_wrappers",
    requires = ["distribution_catalog", "remus_schema_fns"]
);

pgrx::extension_sql!(
    "",
    name = "remus_schema_fns",
    requires = [
        create_distributed_table,
        shard_id_for,
        create_reference_table
    ]
);
