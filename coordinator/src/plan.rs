//! Turning a migration request into a plan, or into a refusal that changes nothing.
//!
//! Everything that can be wrong with a request is checked here, before a record exists in etcd
//! and before any node is touched, so that a refused request leaves no trace. Each refusal
//! carries the gRPC code and the SQLSTATE the SQL functions raise (see `remus.proto`).

use std::collections::BTreeSet;

use tonic::Code;

use crate::migration::{MigrationRecord, Mode};
use crate::node_conn::NodeConnector;
use crate::node_registry::{NodeRecord, NodeRegistry};

/// Where the extension keeps the physical shard tables (`remus_shards.<table>_<shard_id>`).
pub use remus_proto::names::SHARD_SCHEMA;
use remus_proto::names;

/// One shard table to move: the physical table `schema.name` on the source, created with the
/// same name on the target from the shell `shell`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardTable {
    pub shard_id: i64,
    /// Quoted, schema-qualified shell (distributed table).
    pub shell: String,
    pub schema: String,
    pub name: String,
}

impl ShardTable {
    /// Quoted, schema-qualified shard table.
    pub fn qualified(&self) -> String {
        wal_propagator::qualified_name(&self.schema, &self.name)
    }
}

#[derive(Debug, Clone)]
pub struct MigrationPlan {
    pub mode: Mode,
    /// The requested shards plus every shard co-located with them; sorted.
    pub shard_ids: Vec<i64>,
    pub tables: Vec<ShardTable>,
    pub source: NodeRecord,
    pub target: NodeRecord,
    /// Every node of the cluster (Tm and the handover touch them all).
    pub nodes: Vec<NodeRecord>,
    /// The backend waiting for this migration from SQL (node name, pid): its own one-statement
    /// transaction is not one the migration waits for.
    pub requested_by: Option<(String, i32)>,
}

/// "<node>:<pid>" as sent by the SQL functions.
pub fn parse_requested_by(s: &str) -> Option<(String, i32)> {
    let (node, pid) = s.rsplit_once(':')?;
    Some((node.to_string(), pid.parse().ok()?))
}

/// A refused request.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub code: Code,
    pub sqlstate: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(code: Code, sqlstate: &'static str, message: impl Into<String>) -> Self {
        Self { code, sqlstate, message: message.into() }
    }

    pub fn into_status(self) -> tonic::Status {
        let mut status = tonic::Status::new(self.code, self.message);
        if let Ok(v) = self.sqlstate.parse() {
            status.metadata_mut().insert(names::SQLSTATE_METADATA_KEY, v);
        }
        status
    }
}

pub fn parse_mode(mode: &str) -> Result<Mode, Refusal> {
    let mode = if mode.is_empty() { "remus" } else { mode };
    mode.parse::<Mode>()
        .map_err(|e| Refusal::new(Code::InvalidArgument, "22023", e.to_string()))
}

/// Checks the request against the registry and the target's catalog and resolves co-location.
pub async fn plan(
    registry: &NodeRegistry,
    connector: &NodeConnector,
    requested: &[i64],
    target: &str,
    mode: Mode,
) -> Result<MigrationPlan, Refusal> {
    if requested.is_empty() {
        return Err(Refusal::new(Code::InvalidArgument, "22023", "no shard given"));
    }
    let nodes = registry
        .list()
        .await
        .map_err(|e| Refusal::new(Code::Unavailable, "08006", format!("node registry: {e}")))?;
    let target_node = nodes.iter().find(|n| n.name == target).cloned().ok_or_else(|| {
        Refusal::new(
            Code::NotFound,
            "42704",
            format!(
                "node \"{target}\" does not exist (nodes: {})",
                nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>().join(", ")
            ),
        )
    })?;
    let client = connector.connect(&target_node).await.map_err(|e| {
        Refusal::new(Code::Unavailable, "08006", format!("target node is unreachable: {e}"))
    })?;
    let catalog = |e: tokio_postgres::Error| {
        Refusal::new(Code::Unavailable, "08006", format!("reading the catalog on {target}: {e}"))
    };

    // The requested shards, then their whole co-location groups (same colocation_id and index).
    let rows = client
        .query(
            "SELECT s.shard_id, d.kind::text, d.colocation_id, s.shard_index, m.node_name
               FROM remus.shards s
               JOIN remus.distributed_tables d USING (logicalrelid)
               LEFT JOIN remus.shard_map m USING (shard_id)
              WHERE s.shard_id = ANY($1)",
            &[&requested],
        )
        .await
        .map_err(catalog)?;
    let found: BTreeSet<i64> = rows.iter().map(|r| r.get::<_, i64>(0)).collect();
    if let Some(missing) = requested.iter().find(|s| !found.contains(s)) {
        return Err(Refusal::new(Code::NotFound, "42704", format!("shard {missing} does not exist")));
    }
    if let Some(r) = rows.iter().find(|r| r.get::<_, String>(1) != "h") {
        return Err(Refusal::new(
            Code::InvalidArgument,
            "22023",
            format!(
                "shard {} belongs to a reference table, which is on every node and is not migrated",
                r.get::<_, i64>(0)
            ),
        ));
    }
    let groups: Vec<(i32, i32)> = rows.iter().map(|r| (r.get(2), r.get(3))).collect();
    let colocation_ids: Vec<i32> = groups.iter().map(|g| g.0).collect();
    let indexes: Vec<i32> = groups.iter().map(|g| g.1).collect();
    let members = client
        .query(
            "SELECT s.shard_id, m.node_name, n.nspname::text, c.relname::text,
                    quote_ident(n.nspname) || '.' || quote_ident(c.relname)
               FROM remus.shards s
               JOIN remus.distributed_tables d USING (logicalrelid)
               JOIN pg_class c ON c.oid = d.logicalrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN remus.shard_map m USING (shard_id)
              WHERE d.kind = 'h'
                AND (d.colocation_id, s.shard_index) IN
                    (SELECT * FROM unnest($1::int[], $2::int[]))
              ORDER BY s.shard_id",
            &[&colocation_ids, &indexes],
        )
        .await
        .map_err(catalog)?;
    let mut source: Option<String> = None;
    let mut tables = Vec::new();
    for r in &members {
        let shard_id: i64 = r.get(0);
        let owner: Option<String> = r.get(1);
        let owner = owner.ok_or_else(|| {
            Refusal::new(Code::FailedPrecondition, "55000", format!("shard {shard_id} has no owner"))
        })?;
        match &source {
            None => source = Some(owner),
            Some(s) if *s != owner => {
                return Err(Refusal::new(
                    Code::InvalidArgument,
                    "22023",
                    format!(
                        "shards of one migration must be on one node: shard {shard_id} is on {owner}, others on {s}"
                    ),
                ))
            }
            Some(_) => {}
        }
        let relname: String = r.get(3);
        tables.push(ShardTable {
            shard_id,
            shell: r.get(4),
            schema: SHARD_SCHEMA.to_string(),
            name: names::shard_table_name(&relname, shard_id),
        });
    }
    let source = source.expect("at least the requested shards are members");
    if source == target {
        return Err(Refusal::new(
            Code::InvalidArgument,
            "22023",
            format!("shard {} is already on node {target}", requested[0]),
        ));
    }
    let source_node = nodes.iter().find(|n| n.name == source).cloned().ok_or_else(|| {
        Refusal::new(Code::FailedPrecondition, "55000", format!("owner node {source} is not registered"))
    })?;

    // Apply by primary key needs one on every table (and pgoutput's replica identity is it).
    let shells: BTreeSet<&str> = tables.iter().map(|t| t.shell.as_str()).collect();
    for shell in shells {
        let has_pk: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indrelid = $1::text::regclass AND indisprimary)",
                &[&shell],
            )
            .await
            .map_err(catalog)?
            .get(0);
        if !has_pk {
            return Err(Refusal::new(
                Code::InvalidArgument,
                "55000",
                format!("table {shell} has no primary key; a shard is replayed on its target by primary key"),
            ));
        }
    }
    // The source must answer too: a migration that cannot read its source only fails later.
    connector.connect(&source_node).await.map_err(|e| {
        Refusal::new(Code::Unavailable, "08006", format!("source node is unreachable: {e}"))
    })?;
    let shard_ids = tables.iter().map(|t| t.shard_id).collect();
    Ok(MigrationPlan { mode, shard_ids, tables, source: source_node, target: target_node, nodes, requested_by: None })
}

/// The plan of a migration that a coordinator was running when it stopped, rebuilt from its
/// record (which lists every shard, co-located ones included) and the catalog, which every
/// node holds alike: the target's is asked first, then the source's, then any other's.
pub async fn plan_for_recovery(
    registry: &NodeRegistry,
    connector: &NodeConnector,
    record: &MigrationRecord,
) -> Result<MigrationPlan, String> {
    let nodes = registry.list().await.map_err(|e| format!("node registry: {e}"))?;
    let find = |name: &str| {
        nodes.iter().find(|n| n.name == name).cloned().ok_or_else(|| format!("node {name} is not registered"))
    };
    let (source, target) = (find(&record.source)?, find(&record.target)?);
    let mut last_error = String::from("no node is registered");
    let candidates: Vec<NodeRecord> = [target.clone(), source.clone()].into_iter().chain(nodes.iter().cloned()).collect();
    for node in &candidates {
        let client = match connector.connect(node).await {
            Ok(c) => c,
            Err(e) => {
                last_error = format!("{}: {e}", node.name);
                continue;
            }
        };
        let rows = client
            .query(
                "SELECT s.shard_id, c.relname::text, quote_ident(n.nspname) || '.' || quote_ident(c.relname)
                   FROM remus.shards s
                   JOIN remus.distributed_tables d USING (logicalrelid)
                   JOIN pg_class c ON c.oid = d.logicalrelid
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE s.shard_id = ANY($1)
                  ORDER BY s.shard_id",
                &[&record.shard_ids],
            )
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                last_error = format!("{}: {e}", node.name);
                continue;
            }
        };
        if rows.len() != record.shard_ids.len() {
            return Err(format!(
                "the catalog on {} lists {} of the migration's {} shards",
                node.name,
                rows.len(),
                record.shard_ids.len()
            ));
        }
        let tables = rows
            .iter()
            .map(|r| {
                let shard_id: i64 = r.get(0);
                let relname: String = r.get(1);
                ShardTable { shard_id, shell: r.get(2), schema: SHARD_SCHEMA.to_string(), name: names::shard_table_name(&relname, shard_id) }
            })
            .collect();
        return Ok(MigrationPlan {
            mode: record.mode,
            shard_ids: record.shard_ids.clone(),
            tables,
            source,
            target,
            nodes,
            requested_by: None,
        });
    }
    Err(format!("no node's catalog could be read ({last_error})"))
}
