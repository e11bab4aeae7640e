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
use remus_proto::{names, SqlState};

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

/// `<node>:<pid>` as sent by the SQL functions.
pub fn parse_requested_by(s: &str) -> Option<(String, i32)> {
    let (node, pid) = s.rsplit_once(':')?;
    Some((node.to_string(), pid.parse().ok()?))
}

/// A refused request: the gRPC code and the SQLSTATE (sent as [`names::SQLSTATE_METADATA_KEY`])
/// the SQL functions raise. One constructor per reason.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub code: Code,
    pub sqlstate: SqlState,
    pub message: String,
}

impl Refusal {
    pub fn new(code: Code, sqlstate: SqlState, message: impl Into<String>) -> Self {
        Self {
            code,
            sqlstate,
            message: message.into(),
        }
    }

    pub fn into_status(self) -> tonic::Status {
        let mut status = tonic::Status::new(self.code, self.message);
        if let Ok(v) = self.sqlstate.code().parse() {
            status
                .metadata_mut()
                .insert(names::SQLSTATE_METADATA_KEY, v);
        }
        status
    }

    /// The mode is none of the known ones.
    pub fn unknown_mode(e: impl ToString) -> Self {
        Self::new(
            Code::InvalidArgument,
            SqlState::INVALID_PARAMETER_VALUE,
            e.to_string(),
        )
    }

    /// A known mode this build cannot run yet.
    pub fn mode_not_available(mode: Mode) -> Self {
        Self::new(
            Code::Unimplemented,
            SqlState::FEATURE_NOT_SUPPORTED,
            format!("migration mode {mode} is not available in this build"),
        )
    }

    pub fn no_shard_given() -> Self {
        Self::new(
            Code::InvalidArgument,
            SqlState::INVALID_PARAMETER_VALUE,
            "no shard given",
        )
    }

    /// etcd did not answer with the node list.
    pub fn registry_unavailable(e: impl std::fmt::Display) -> Self {
        Self::new(
            Code::Unavailable,
            SqlState::CONNECTION_FAILURE,
            format!("node registry: {e}"),
        )
    }

    pub fn unknown_node(target: &str, nodes: &[NodeRecord]) -> Self {
        Self::new(
            Code::NotFound,
            SqlState::UNDEFINED_OBJECT,
            format!(
                "node \"{target}\" does not exist (nodes: {})",
                nodes
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    }

    pub fn target_unreachable(e: impl std::fmt::Display) -> Self {
        Self::new(
            Code::Unavailable,
            SqlState::CONNECTION_FAILURE,
            format!("target node is unreachable: {e}"),
        )
    }

    pub fn source_unreachable(e: impl std::fmt::Display) -> Self {
        Self::new(
            Code::Unavailable,
            SqlState::CONNECTION_FAILURE,
            format!("source node is unreachable: {e}"),
        )
    }

    /// Reading the catalog on `node` failed.
    pub fn catalog_unreadable(node: &str, e: impl std::fmt::Display) -> Self {
        Self::new(
            Code::Unavailable,
            SqlState::CONNECTION_FAILURE,
            format!("reading the catalog on {node}: {e}"),
        )
    }

    pub fn unknown_shard(shard_id: i64) -> Self {
        Self::new(
            Code::NotFound,
            SqlState::UNDEFINED_OBJECT,
            format!("shard {shard_id} does not exist"),
        )
    }

    pub fn reference_table_shard(shard_id: i64) -> Self {
        Self::new(
            Code::InvalidArgument,
            SqlState::INVALID_PARAMETER_VALUE,
            format!("shard {shard_id} belongs to a reference table, which is on every node and is not migrated"),
        )
    }

    pub fn shard_without_owner(shard_id: i64) -> Self {
        Self::new(
            Code::FailedPrecondition,
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("shard {shard_id} has no owner"),
        )
    }

    /// `shard_id` is on `owner`, the shards before it on `others`.
    pub fn shards_on_several_nodes(shard_id: i64, owner: &str, others: &str) -> Self {
        Self::new(
            Code::InvalidArgument,
            SqlState::INVALID_PARAMETER_VALUE,
            format!("shards of one migration must be on one node: shard {shard_id} is on {owner}, others on {others}"),
        )
    }

    pub fn already_on_target(shard_id: i64, target: &str) -> Self {
        Self::new(
            Code::InvalidArgument,
            SqlState::INVALID_PARAMETER_VALUE,
            format!("shard {shard_id} is already on node {target}"),
        )
    }

    pub fn owner_not_registered(owner: &str) -> Self {
        Self::new(
            Code::FailedPrecondition,
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("owner node {owner} is not registered"),
        )
    }

    /// `shell` (a distributed table) has no primary key.
    pub fn no_primary_key(shell: &str) -> Self {
        Self::new(
            Code::InvalidArgument,
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("table {shell} has no primary key; a shard is replayed on its target by primary key"),
        )
    }

    /// A coordinator that restarted takes no new migration until it has resumed the old ones.
    /// Squall fills the target's tables chunk by chunk, in no order across the tables of a
    /// group, after the target serves them: a foreign key there would refuse a row whose
    /// referenced row is not pulled yet.
    pub fn squall_with_foreign_keys(shell: &str) -> Self {
        Self::new(
            Code::FailedPrecondition,
            SqlState::FEATURE_NOT_SUPPORTED,
            format!(
                "table {shell} has foreign keys, which the squall mode cannot move (its target \
                 serves the tables before their rows are all pulled); use another mode"
            ),
        )
    }

    pub fn resuming() -> Self {
        Self::new(
            Code::Unavailable,
            SqlState::CANNOT_CONNECT_NOW,
            "the coordinator restarted and is resuming the migrations it was running; try again once they have ended (see remus_migrations)",
        )
    }

    /// A shard of the request is already being migrated (`e` says which, by which migration).
    pub fn shard_busy(e: impl ToString) -> Self {
        Self::new(Code::AlreadyExists, SqlState::OBJECT_IN_USE, e.to_string())
    }
}

pub fn parse_mode(mode: &str) -> Result<Mode, Refusal> {
    let mode = if mode.is_empty() { "remus" } else { mode };
    mode.parse::<Mode>().map_err(Refusal::unknown_mode)
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
        return Err(Refusal::no_shard_given());
    }
    let nodes = registry
        .list()
        .await
        .map_err(Refusal::registry_unavailable)?;
    let target_node = nodes
        .iter()
        .find(|n| n.name == target)
        .cloned()
        .ok_or_else(|| Refusal::unknown_node(target, &nodes))?;
    let client = connector
        .connect(&target_node)
        .await
        .map_err(Refusal::target_unreachable)?;
    let catalog = |e: tokio_postgres::Error| Refusal::catalog_unreadable(target, e);

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
        return Err(Refusal::unknown_shard(*missing));
    }
    if let Some(r) = rows.iter().find(|r| r.get::<_, String>(1) != "h") {
        return Err(Refusal::reference_table_shard(r.get(0)));
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
        let owner = owner.ok_or_else(|| Refusal::shard_without_owner(shard_id))?;
        match &source {
            None => source = Some(owner),
            Some(s) if *s != owner => {
                return Err(Refusal::shards_on_several_nodes(shard_id, &owner, s))
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
        return Err(Refusal::already_on_target(requested[0], target));
    }
    let source_node = nodes
        .iter()
        .find(|n| n.name == source)
        .cloned()
        .ok_or_else(|| Refusal::owner_not_registered(&source))?;

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
            return Err(Refusal::no_primary_key(shell));
        }
        if mode == Mode::Squall {
            let has_fk: bool = client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_constraint
                                     WHERE contype = 'f' AND conrelid = $1::text::regclass)",
                    &[&shell],
                )
                .await
                .map_err(catalog)?
                .get(0);
            if has_fk {
                return Err(Refusal::squall_with_foreign_keys(shell));
            }
        }
    }
    // The source must answer too: a migration that cannot read its source only fails later.
    connector
        .connect(&source_node)
        .await
        .map_err(Refusal::source_unreachable)?;
    let shard_ids = tables.iter().map(|t| t.shard_id).collect();
    Ok(MigrationPlan {
        mode,
        shard_ids,
        tables,
        source: source_node,
        target: target_node,
        nodes,
        requested_by: None,
    })
}

/// The plan of a migration that a coordinator was running when it stopped, rebuilt from its
/// record (which lists every shard, co-located ones included) and the catalog, which every
/// node holds alike: the target's is asked first, then the source's, then any other's.
pub async fn plan_for_resume(
    registry: &NodeRegistry,
    connector: &NodeConnector,
    record: &MigrationRecord,
) -> Result<MigrationPlan, String> {
    let nodes = registry
        .list()
        .await
        .map_err(|e| format!("node registry: {e}"))?;
    let find = |name: &str| {
        nodes
            .iter()
            .find(|n| n.name == name)
            .cloned()
            .ok_or_else(|| format!("node {name} is not registered"))
    };
    let (source, target) = (find(&record.source)?, find(&record.target)?);
    let mut last_error = String::from("no node is registered");
    let candidates: Vec<NodeRecord> = [target.clone(), source.clone()]
        .into_iter()
        .chain(nodes.iter().cloned())
        .collect();
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
                ShardTable {
                    shard_id,
                    shell: r.get(2),
                    schema: SHARD_SCHEMA.to_string(),
                    name: names::shard_table_name(&relname, shard_id),
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_carry_their_grpc_code_and_sqlstate() {
        let cases = [
            (
                Refusal::unknown_mode("bad mode"),
                Code::InvalidArgument,
                "22023",
            ),
            (Refusal::no_shard_given(), Code::InvalidArgument, "22023"),
            (
                Refusal::registry_unavailable("down"),
                Code::Unavailable,
                "08006",
            ),
            (Refusal::unknown_node("n9", &[]), Code::NotFound, "42704"),
            (
                Refusal::target_unreachable("refused"),
                Code::Unavailable,
                "08006",
            ),
            (
                Refusal::source_unreachable("refused"),
                Code::Unavailable,
                "08006",
            ),
            (
                Refusal::catalog_unreadable("n2", "gone"),
                Code::Unavailable,
                "08006",
            ),
            (Refusal::unknown_shard(7), Code::NotFound, "42704"),
            (
                Refusal::reference_table_shard(7),
                Code::InvalidArgument,
                "22023",
            ),
            (
                Refusal::shard_without_owner(7),
                Code::FailedPrecondition,
                "55000",
            ),
            (
                Refusal::shards_on_several_nodes(7, "n1", "n2"),
                Code::InvalidArgument,
                "22023",
            ),
            (
                Refusal::already_on_target(7, "n2"),
                Code::InvalidArgument,
                "22023",
            ),
            (
                Refusal::owner_not_registered("n1"),
                Code::FailedPrecondition,
                "55000",
            ),
            (
                Refusal::no_primary_key("public.t"),
                Code::InvalidArgument,
                "55000",
            ),
            (Refusal::resuming(), Code::Unavailable, "57P03"),
            (Refusal::shard_busy("busy"), Code::AlreadyExists, "55006"),
        ];
        for (refusal, code, sqlstate) in cases {
            assert_eq!(
                (refusal.code, refusal.sqlstate.code()),
                (code, sqlstate),
                "{refusal}"
            );
            let status = refusal.clone().into_status();
            assert_eq!(status.code(), code);
            assert_eq!(status.message(), refusal.message);
            let sent = status
                .metadata()
                .get(names::SQLSTATE_METADATA_KEY)
                .and_then(|v| v.to_str().ok());
            assert_eq!(sent, Some(sqlstate));
        }
    }

    #[test]
    fn refusal_messages() {
        let nodes = [("n1", 6001), ("n2", 6002)]
            .map(|(name, port)| NodeRecord {
                name: name.into(),
                host: "127.0.0.1".into(),
                port,
            })
            .to_vec();
        assert_eq!(
            Refusal::unknown_node("n9", &nodes).message,
            "node \"n9\" does not exist (nodes: n1, n2)"
        );
        assert_eq!(
            Refusal::shards_on_several_nodes(7, "n1", "n2").message,
            "shards of one migration must be on one node: shard 7 is on n1, others on n2"
        );
        assert_eq!(parse_mode("").unwrap(), Mode::Remus);
        assert_eq!(
            parse_mode("nope").unwrap_err().sqlstate,
            SqlState::INVALID_PARAMETER_VALUE
        );
    }
}
