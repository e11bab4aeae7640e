//! A node that joins after tables were distributed (`remus_activate_node`): it gets what every
//! node of the cluster holds, so that it can route from the first statement and receive shards
//! by migration.
//!
//! Run on a member that already knows the new node (`remus_add_node` there), in the caller's
//! transaction, every remote part a remote transaction of it (one 2PC, all or nothing):
//! - every other member adds the new node to its membership (`remus_add_node`, idempotent);
//! - the new node gets the whole membership, then, table after table in the order of their
//!   co-location groups, the shell (columns, constraints, indexes, owner, grants: the same DDL a
//!   conversion sends, from this node's shell) with its guard, the sequences of a distributed
//!   table (in a range of their own: the slot after the highest any member uses, decision 0019),
//!   and the catalog rows (`remus.distributed_tables`, `remus.shards`, `remus.shard_map`) as
//!   this node has them; a reference table's shard table and its rows (copied from this
//!   node's copy).
//!
//! The new node owns no shard afterwards; shards move to it by migration. Not its business:
//! roles (per PostgreSQL cluster: the tables' owners and grantees must exist on the new node,
//! or the DDL fails and nothing is applied), schemas other than the shells' own (created if
//! missing, owned by the shell's schema owner), and types or functions the shells use (they
//! must exist there). Refused while a migration is registered on this node (the map it copies
//! could change under it), and on a node that already holds distributed tables (one holding as
//! many as this node, compared by count, is taken as active already: nothing is done).

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::catalog::shard_ddl::guard_ddl;
use crate::catalog::shard_table_name;
use crate::cluster::remote::NodeAddr;
use crate::error::RemusError;
use crate::pg::sql::quote_literal;

use super::{rows_as_copy_text, sequences, shell_ddl, with_qualified_names};

/// A table of this node's catalog, as the new node must record it.
struct CatalogTable {
    relid: pg_sys::Oid,
    qualified: String,
    rel_name: String,
    schema: String,
    schema_owner: String,
    kind: char,
    /// `INSERT INTO remus.distributed_tables` values.
    row: String,
}

/// Activates `name` (see the module comment); false when it already was.
pub(crate) fn activate(name: &str) -> Result<bool, RemusError> {
    let me = crate::guc::node_name().ok_or(RemusError::NodeNameUnset)?;
    if name == me {
        return Err(RemusError::NodeIsSelf {
            node: name.to_string(),
        });
    }
    let nodes = crate::cluster::nodes::all_nodes()?;
    if !nodes.iter().any(|n| n.name == me) {
        return Err(RemusError::SelfNotInCluster { node: me });
    }
    let new = nodes
        .iter()
        .find(|n| n.name == name)
        .cloned()
        .ok_or_else(|| RemusError::UnknownNode {
            node: name.to_string(),
        })?;
    if crate::migration::state::active() {
        return Err(RemusError::ActivationDuringMigration {
            node: name.to_string(),
        });
    }
    Spi::connect_mut(|client| -> Result<bool, RemusError> {
        // No conversion or other activation meanwhile: they take the same lock.
        client.update("LOCK TABLE remus.shards IN EXCLUSIVE MODE", None, &[])?;
        let tables = catalog_tables(client)?;
        let held = crate::twophase::exec_in_transaction(
            &new,
            "SELECT count(*) FROM remus.distributed_tables",
            false,
        )?
        .rows
        .first()
        .and_then(|r| r[0].as_deref().and_then(|v| v.parse::<i64>().ok()))
        .unwrap_or(0);
        if held > 0 {
            if held == tables.len() as i64 {
                return Ok(false);
            }
            return Err(RemusError::NodeHoldsTables {
                node: name.to_string(),
                tables: held,
            });
        }
        for n in nodes.iter().filter(|n| n.name != me && n.name != name) {
            crate::twophase::exec_in_transaction(n, &add_node_sql(&new), true)?;
        }
        let mut sql = String::from("LOCK TABLE remus.shards IN EXCLUSIVE MODE;\n");
        for n in &nodes {
            sql.push_str(&add_node_sql(n));
        }
        let mut schemas: Vec<(&str, &str)> = Vec::new();
        for t in &tables {
            if t.schema != "public" && !schemas.iter().any(|(s, _)| *s == t.schema) {
                schemas.push((&t.schema, &t.schema_owner));
            }
        }
        for (schema, owner) in schemas {
            sql.push_str(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema} AUTHORIZATION {owner};\n"
            ));
        }
        let mut references = Vec::new();
        for t in &tables {
            if t.kind == 'h' {
                let seqs = sequences::inspect_distributed(client, t.relid, &t.qualified)?;
                let slots = seqs
                    .iter()
                    .map(|s| next_slot(client, &nodes, &me, &new, s))
                    .collect::<Result<Vec<_>, _>>()?;
                for (s, slot) in seqs.iter().zip(&slots) {
                    sql.push_str(&sequences::before_shell(std::slice::from_ref(s), *slot));
                }
                sql.push_str(&shell_ddl(client, t.relid, &t.qualified)?);
                // An identity comes with its sequence, once the shell has the column.
                for (s, slot) in seqs.iter().zip(&slots) {
                    sql.push_str(&sequences::after_shell(
                        std::slice::from_ref(s),
                        &t.qualified,
                        *slot,
                    ));
                }
            } else {
                sql.push_str(&shell_ddl(client, t.relid, &t.qualified)?);
            }
            sql.push_str(&guard_ddl(&t.qualified));
            sql.push_str(&format!(
                "INSERT INTO remus.distributed_tables VALUES {};\n",
                t.row
            ));
        }
        sql.push_str(&shard_rows(client)?);
        for t in tables.iter().filter(|t| t.kind == 'r') {
            let shard_id = crate::catalog::reference_shard(t.relid)?;
            let shard = shard_table_name(&t.rel_name, shard_id);
            sql.push_str(&format!(
                "CREATE TABLE {shard} (LIKE {} INCLUDING ALL EXCLUDING IDENTITY);\n",
                t.qualified
            ));
            references.push((t, shard));
        }
        crate::twophase::exec_in_transaction(&new, &sql, true)?;
        for (t, shard) in references {
            let (cols, data) = rows_as_copy_text(client, t.relid, &shard)?;
            if !data.is_empty() {
                crate::twophase::copy_in_transaction(
                    &new,
                    &format!("COPY {shard} ({cols}) FROM STDIN"),
                    data.as_bytes(),
                )?;
            }
        }
        // The foreign keys last, once every shell and reference row is there: the new node's
        // own DDL path adds each to its shell and to the shard tables it holds (the reference
        // tables' only), validating them against the rows just copied.
        let foreign_keys = foreign_key_ddl(client)?;
        if !foreign_keys.is_empty() {
            crate::twophase::exec_in_transaction(&new, &foreign_keys, true)?;
        }
        Ok(true)
    })
}

/// The foreign keys of every distributed and reference table, as ALTER TABLE statements with
/// every name schema-qualified.
fn foreign_key_ddl(client: &mut SpiClient<'_>) -> Result<String, RemusError> {
    with_qualified_names(client, |client| {
        Ok(client
            .select(
                "SELECT string_agg(format('ALTER TABLE %s ADD CONSTRAINT %I %s;',
                                          c.conrelid::regclass, c.conname, pg_get_constraintdef(c.oid)),
                                   E'\n' ORDER BY c.conrelid, c.conname)
                   FROM pg_constraint c
                   JOIN remus.distributed_tables d ON d.logicalrelid = c.conrelid
                  WHERE c.contype = 'f'",
                Some(1),
                &[],
            )?
            .first()
            .get::<String>(1)?
            .unwrap_or_default())
    })
}

/// `remus_add_node` of `n`, as a statement for another node.
fn add_node_sql(n: &NodeAddr) -> String {
    format!(
        "SELECT remus_add_node({}, {}, {});\n",
        quote_literal(&n.name),
        quote_literal(&n.host),
        n.port
    )
}

/// This node's distributed and reference tables, by co-location group then creation (a group's
/// first table before the ones co-located with it).
fn catalog_tables(client: &SpiClient<'_>) -> Result<Vec<CatalogTable>, RemusError> {
    Ok(client
        .select(
            "SELECT c.oid, format('%I.%I', n.nspname, c.relname), c.relname::text,
                    quote_ident(n.nspname), quote_ident(pg_get_userbyid(n.nspowner)), d.kind::text,
                    format('(%L::regclass, %L, %L::regtype, %L, %s, %s)',
                           format('%I.%I', n.nspname, c.relname), d.shard_key,
                           CASE WHEN d.key_type IS NULL THEN NULL
                                ELSE format('%I.%I', tn.nspname, t.typname) END,
                           d.kind, d.shard_count, d.colocation_id)
               FROM remus.distributed_tables d
               JOIN pg_class c ON c.oid = d.logicalrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN pg_type t ON t.oid = d.key_type
               LEFT JOIN pg_namespace tn ON tn.oid = t.typnamespace
              ORDER BY d.colocation_id, c.oid",
            None,
            &[],
        )?
        .map(|r| {
            Ok(CatalogTable {
                relid: r.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid),
                qualified: r.get::<String>(2)?.unwrap_or_default(),
                rel_name: r.get::<String>(3)?.unwrap_or_default(),
                schema: r.get::<String>(4)?.unwrap_or_default(),
                schema_owner: r.get::<String>(5)?.unwrap_or_default(),
                kind: r
                    .get::<String>(6)?
                    .and_then(|k| k.chars().next())
                    .unwrap_or('h'),
                row: r.get::<String>(7)?.unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()?)
}

/// The rows of `remus.shards` and `remus.shard_map` as this node has them, as INSERTs.
fn shard_rows(client: &SpiClient<'_>) -> Result<String, RemusError> {
    let rows = client
        .select(
            "SELECT format('INSERT INTO remus.shards VALUES (%s, %L::regclass, %s, %s, %s);',
                           s.shard_id, format('%I.%I', n.nspname, c.relname), s.shard_index,
                           s.hash_min, s.hash_max)
                    || CASE WHEN m.node_name IS NULL THEN ''
                            ELSE format(' INSERT INTO remus.shard_map VALUES (%s, %L);',
                                        s.shard_id, m.node_name) END
               FROM remus.shards s
               JOIN pg_class c ON c.oid = s.logicalrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN remus.shard_map m USING (shard_id)
              ORDER BY s.shard_id",
            None,
            &[],
        )?
        .map(|r| r.get::<String>(1).map(|v| v.unwrap_or_default()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows.into_iter().map(|r| r + "\n").collect())
}

/// The slot of the new node's copy of sequence `s`: one past the highest slot any member's copy
/// uses (a copy's slot is its MINVALUE's, decision 0019).
fn next_slot(
    client: &SpiClient<'_>,
    nodes: &[NodeAddr],
    me: &str,
    new: &NodeAddr,
    s: &sequences::SeqColumn,
) -> Result<usize, RemusError> {
    let query = format!(
        "SELECT coalesce(max(min_value >> {}), 0) FROM pg_catalog.pg_sequences
          WHERE format('%I.%I', schemaname, sequencename) = {}",
        sequences::SLOT_BITS,
        quote_literal(s.sequence_name())
    );
    let mut highest = client
        .select(&query, Some(1), &[])?
        .first()
        .get::<i64>(1)?
        .unwrap_or(0);
    for n in nodes.iter().filter(|n| n.name != me && n.name != new.name) {
        let r = crate::twophase::exec_in_transaction(n, &query, false)?;
        if let Some(v) = r
            .rows
            .first()
            .and_then(|r| r[0].as_deref().and_then(|v| v.parse::<i64>().ok()))
        {
            highest = highest.max(v);
        }
    }
    Ok(highest as usize + 1)
}
