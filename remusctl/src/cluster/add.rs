//! `remusctl cluster add-node`: one more node in a running cluster (scale-out, issues 18 and
//! 20).
//!
//! The new node `nK` (K = N + 1, on port P+K-1: where `up --nodes K` would have put it) is
//! initdb'd and started the way `up` starts a node and gets the extension. n1 then joins it to
//! the cluster: `remus_add_node` there, then `remus_activate_node`, which in one 2PC
//! transaction adds it to every other node's membership and gives it the membership, the
//! shells of the distributed and reference tables, the catalog, the sequences and the
//! reference tables' rows. It owns no shard; shards move to it by migration. Last it is
//! registered with the coordinator and written to `cluster.json`.
//!
//! A failure once the node's directory exists undoes the add, so that a second try starts from
//! the same cluster: the nodes forget it again (`remus_remove_node` on n1, itself a 2PC
//! transaction over the remaining nodes), its server is stopped and its directory removed. Its
//! log stays, for the diagnosis. `cluster.json` is written only when everything succeeded.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::daemons::stop_node;
use super::postgres::{connect, init_node, start_node};
use super::state::{plan_added_node, ClusterState, NodeState};
use super::{add_to_membership, check_postgres_binaries, create_extension, register_nodes};
use crate::process;

/// Adds a node to the running cluster in `dir`; returns it. See the module documentation.
pub async fn add_node(dir: &Path) -> Result<NodeState> {
    let state = ClusterState::load(dir)?;
    let node = plan_added_node(&state)?;
    check_postgres_binaries()?;
    // Every node takes part in the activation's 2PC transaction: one that is down would fail
    // it anyway, later and less clearly.
    let down: Vec<&str> = state
        .nodes
        .iter()
        .filter(|n| n.postmaster_pid().is_none())
        .map(|n| n.name.as_str())
        .collect();
    if !down.is_empty() {
        bail!(
            "cannot add a node to {}: not running: {} (every node takes part in the new node's activation)",
            state.dir.display(),
            down.join(", ")
        );
    }
    let Some(entry) = state.nodes.first() else {
        bail!("{} holds a cluster without nodes", state.dir.display());
    };
    coordinator::client::connect(&state.coordinator_endpoint())
        .await
        .with_context(|| {
            format!(
                "cannot add a node to {}: no coordinator answers; start it with `remusctl cluster start-coordinator --dir {0}`",
                state.dir.display()
            )
        })?;
    if process::port_in_use(node.port) {
        bail!(
            "cannot add {}: its port {} is already in use on 127.0.0.1",
            node.name,
            node.port
        );
    }
    let password = state.password()?;
    let node_dir = node_dir(&node);
    // Creating the directory claims the name: of two add-nodes at once, the second stops here.
    match fs::create_dir(&node_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => bail!(
            "cannot add {}: {} exists already (left by an earlier add-node, or another one is running); remove it first",
            node.name,
            node_dir.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("creating {}", node_dir.display())),
    }

    let mut done = Done::default();
    let result = match join(&state, entry, &node, &password, &mut done).await {
        Ok(()) => record(&state.dir, &node),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        let undone = undo(entry, &node, &password, &done).await;
        return Err(e.context(format!(
            "adding {} (127.0.0.1:{}) to {} failed ({undone}; cluster.json is unchanged; its log: {})",
            node.name,
            node.port,
            state.dir.display(),
            node.log.display()
        )));
    }
    Ok(node)
}

/// `DIR/nK`, the new node's directory (data and socket).
fn node_dir(node: &NodeState) -> PathBuf {
    node.data_dir
        .parent()
        .expect("a node's data directory has a parent")
        .to_path_buf()
}

/// What of the add took effect beyond the node itself, for [`undo`].
#[derive(Default)]
struct Done {
    /// n1's membership lists the node (after the activation, every node's does).
    member: bool,
    /// The coordinator lists the node.
    registered: bool,
}

async fn join(
    state: &ClusterState,
    entry: &NodeState,
    node: &NodeState,
    password: &str,
    done: &mut Done,
) -> Result<()> {
    init_node(node, password, &state.coordinator_endpoint())?;
    start_node(state, node)?;
    let client = connect(node, password).await?;
    create_extension(&client, node).await?;
    let on_entry = connect(entry, password).await?;
    add_to_membership(&on_entry, entry, node).await?;
    done.member = true;
    on_entry
        .execute("SELECT remus_activate_node($1)", &[&node.name])
        .await
        .with_context(|| format!("remus_activate_node({}) on {}", node.name, entry.name))?;
    register_nodes(&state.coordinator_endpoint(), std::slice::from_ref(node)).await?;
    done.registered = true;
    Ok(())
}

/// Writes the node into `cluster.json`, read again so that nothing another remusctl recorded
/// meanwhile (a daemon's new PID) is lost.
fn record(dir: &Path, node: &NodeState) -> Result<()> {
    let mut state = ClusterState::load(dir)?;
    state.nodes.push(node.clone());
    state
        .save()
        .with_context(|| format!("writing {} into {}", node.name, dir.display()))
}

/// Undoes a failed add; says what it did and what it could not.
async fn undo(entry: &NodeState, node: &NodeState, password: &str, done: &Done) -> String {
    let mut undone = Vec::new();
    let mut left = Vec::new();
    if done.member {
        let removed = async {
            connect(entry, password)
                .await?
                .execute("SELECT remus_remove_node($1)", &[&node.name])
                .await
                .with_context(|| format!("remus_remove_node({}) on {}", node.name, entry.name))
        }
        .await;
        match removed {
            Ok(_) => undone.push(format!("the nodes' membership no longer lists {}", node.name)),
            Err(e) => left.push(format!(
                "the membership may still list {0} (run SELECT remus_remove_node('{0}') on {1}): {e:#}",
                node.name, entry.name
            )),
        }
    }
    if done.registered {
        // The coordinator has no call to forget a node; a registered one that is gone only
        // makes a migration to it fail.
        left.push(format!("the coordinator still lists {}", node.name));
    }
    let dir = node_dir(node);
    match stop_node(node) {
        Ok(stopped) => {
            if let Some(pid) = stopped {
                undone.push(format!("its server (pid {pid}) stopped"));
            }
            match fs::remove_dir_all(&dir) {
                Ok(()) => undone.push(format!("{} removed", dir.display())),
                Err(e) => left.push(format!("{} not removed: {e}", dir.display())),
            }
        }
        Err(e) => left.push(format!(
            "its server could not be stopped ({e}), {} kept",
            dir.display()
        )),
    }
    let mut out = if undone.is_empty() {
        "nothing undone".to_string()
    } else {
        format!("undone: {}", undone.join(", "))
    };
    if !left.is_empty() {
        out.push_str(&format!("; left behind: {}", left.join("; ")));
    }
    out
}
