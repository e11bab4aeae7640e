//! Cluster membership from SQL: adding and removing nodes, and running a command on one.

use pgrx::prelude::*;
use pgrx::spi::Spi;

use crate::cluster::nodes::{add_node, all_nodes, lookup};
use crate::error::{OrRaise, RemusError};
use crate::migration::state::require_superuser;

pgrx::extension_sql!(
    r#"
CREATE VIEW remus_nodes AS
    SELECT name, host, port FROM remus.nodes ORDER BY name;
COMMENT ON VIEW remus_nodes IS 'Nodes this node knows: name, host, port';
"#,
    name = "views",
    requires = ["catalog"]
);

/// Adds a node to this node's catalog. Adding the same name with the same address again is a
/// no-op, so provisioning can be re-run; another address for a known name is refused (42710).
/// For superusers and `remus_admin` (its EXECUTE grant, `api::privileges`); runs as the
/// extension's owner, which owns the catalog (decision 0016).
#[pg_extern(security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn remus_add_node(name: &str, host: &str, port: i32) {
    add_node(name, host, port).or_raise();
}

/// Makes a node added after tables were distributed a full member (`distribute::new_node`):
/// every member knows it; it gets the membership, the shells, sequences and catalog of every
/// distributed and reference table, and the reference tables' rows; all in this transaction
/// (2PC). Call it on a member after `remus_add_node` of the new node there; the new node must run
/// pg_remus with its `remus.node_name` set. True when it activated the node, false when the node
/// was active already. For superusers and `remus_admin`, as `remus_add_node`.
#[pg_extern(security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn remus_activate_node(node_name: &str) -> bool {
    crate::distribute::new_node::activate(node_name).or_raise()
}

/// This node's name (`remus.node_name`).
#[pg_extern]
fn remus_local_node() -> String {
    crate::guc::node_name()
        .ok_or(RemusError::NodeNameUnset)
        .or_raise()
}

/// Runs a command on another node inside the current transaction; with several writing nodes
/// the transaction commits by two-phase commit. Returns the number of rows it affected.
/// Running it on this node itself is refused: the remote backend would wait on our own locks,
/// a deadlock no detector sees. Superuser only whatever the grants (not even `remus_admin`): the
/// command is arbitrary SQL, run there by the cluster's own connection.
#[pg_extern]
fn remus_run_on_node(node: &str, command: &str) -> i64 {
    require_superuser("remus_run_on_node");
    let run = || -> Result<i64, RemusError> {
        if crate::guc::node_name().as_deref() == Some(node) {
            return Err(RemusError::NodeIsSelf {
                node: node.to_string(),
            });
        }
        let addr = lookup(node)?;
        let r = crate::twophase::exec_in_transaction(&addr, command, true)?;
        Ok(r.affected as i64)
    };
    run().or_raise()
}

fn remove_node(name: &str) -> Result<(), RemusError> {
    let owned = Spi::get_one_with_args::<i64>(
        "SELECT count(*) FROM remus.shard_map WHERE node_name = $1",
        &[name.into()],
    )?
    .unwrap_or(0);
    if owned > 0 {
        return Err(RemusError::NodeOwnsShards {
            node: name.to_string(),
            shards: owned,
        });
    }
    let nodes = all_nodes()?;
    if !nodes.iter().any(|n| n.name == name) {
        return Err(RemusError::UnknownNode {
            node: name.to_string(),
        });
    }
    let me = crate::guc::node_name().ok_or(RemusError::NodeNameUnset)?;
    let sql = format!(
        "DELETE FROM remus.nodes WHERE name = {}",
        crate::pg::sql::quote_literal(name)
    );
    // Every remaining node forgets it, in one 2PC transaction. The leaving node is not asked:
    // it may well be down, which is a common reason to remove it.
    for n in nodes.iter().filter(|n| n.name != me && n.name != name) {
        crate::twophase::exec_in_transaction(n, &sql, true)?;
    }
    Spi::run(&sql)?;
    Ok(())
}

/// Removes a node from the cluster's membership on every node. Refused (55006) while the node
/// owns shards. For superusers and `remus_admin`, as `remus_add_node`.
#[pg_extern(security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn remus_remove_node(name: &str) {
    remove_node(name).or_raise();
}
