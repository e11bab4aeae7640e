//! Cluster membership in this node's catalog.
//!
//! Each node keeps its own copy of the member list: routing must be able to find an owner's
//! address with nothing but a local catalog read inside the statement's snapshot.

use pgrx::prelude::*;
use pgrx::spi::Spi;

use crate::error::{OrRaise, RemusError};

/// Same rule as the coordinator's registry (node names end up inside slot, publication and
/// prepared-transaction names, which are plain identifiers).
pub fn is_valid_node_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase())
        && name.len() <= 32
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn add_node(name: &str, host: &str, port: i32) -> Result<bool, RemusError> {
    if !is_valid_node_name(name) {
        return Err(RemusError::InvalidNodeName(name.to_string()));
    }
    if host.trim().is_empty() {
        return Err(RemusError::EmptyHost);
    }
    if !(1..=65535).contains(&port) {
        return Err(RemusError::PortOutOfRange(port));
    }
    Spi::connect_mut(|client| {
        // Insert-or-inspect in one statement keeps concurrent provisioning runs from racing.
        let inserted = client
            .update(
                "INSERT INTO remus.nodes (name, host, port) VALUES ($1, $2, $3) \
                 ON CONFLICT (name) DO NOTHING RETURNING true",
                None,
                &[name.into(), host.into(), port.into()],
            )?
            .len()
            == 1;
        if inserted {
            return Ok(true);
        }
        let (h, p) = client
            .update(
                "SELECT host, port FROM remus.nodes WHERE name = $1 FOR UPDATE",
                Some(1),
                &[name.into()],
            )?
            .first()
            .get_two::<String, i32>()?;
        match (h, p) {
            (Some(h), Some(p)) if h == host && p == port => Ok(false),
            (Some(h), Some(p)) => Err(RemusError::NodeExists {
                name: name.to_string(),
                host: h,
                port: p,
            }),
            _ => Err(RemusError::NodeVanished(name.to_string())),
        }
    })
}

/// Adds a node to this node's catalog. Adding the same name with the same address again is a
/// no-op, so provisioning can be re-run; another address for a known name is refused (42710).
#[pg_extern]
fn remus_add_node(name: &str, host: &str, port: i32) {
    add_node(name, host, port).or_raise();
}

/// This node's name (`remus.node_name`).
#[pg_extern]
fn remus_local_node() -> String {
    crate::guc::node_name()
        .ok_or(RemusError::NodeNameUnset)
        .or_raise()
}

/// Every node in this node's catalog.
pub fn all_nodes() -> Result<Vec<crate::remote::NodeAddr>, RemusError> {
    Spi::connect(|c| {
        c.select("SELECT name, host, port FROM remus.nodes ORDER BY name", None, &[])?
            .map(|r| {
                Ok(crate::remote::NodeAddr {
                    name: r.get::<String>(1)?.unwrap_or_default(),
                    host: r.get::<String>(2)?.unwrap_or_default(),
                    port: r.get::<i32>(3)?.unwrap_or_default(),
                })
            })
            .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })
    .map_err(RemusError::from)
}

pub fn lookup(name: &str) -> Result<crate::remote::NodeAddr, RemusError> {
    all_nodes()?
        .into_iter()
        .find(|n| n.name == name)
        .ok_or_else(|| RemusError::UnknownNode(name.to_string()))
}

/// Runs a command on another node inside the current transaction; with several writing nodes
/// the transaction commits by two-phase commit. Returns the number of rows it affected.
/// Running it on this node itself is refused: the remote backend would wait on our own locks,
/// a deadlock no detector sees.
#[pg_extern]
fn remus_run_on_node(node: &str, command: &str) -> i64 {
    let run = || -> Result<i64, RemusError> {
        if crate::guc::node_name().as_deref() == Some(node) {
            return Err(RemusError::InvalidArgument(format!(
                "node {node} is this node; run the command directly"
            )));
        }
        let addr = lookup(node)?;
        let r = crate::twophase::exec_in_transaction(&addr, command, true)?;
        Ok(r.affected as i64)
    };
    run().or_raise()
}

/// Resolves in-doubt prepared transactions this node coordinated; returns how many were
/// committed, rolled back, and are still running.
#[pg_extern]
fn remus_recover_prepared() -> TableIterator<
    'static,
    (name!(committed, i64), name!(rolled_back, i64), name!(in_progress, i64)),
> {
    let s = crate::recovery::recover().or_raise();
    TableIterator::once((s.committed, s.rolled_back, s.in_progress))
}

fn remove_node(name: &str) -> Result<(), RemusError> {
    let owned = Spi::get_one_with_args::<i64>(
        "SELECT count(*) FROM remus.shard_map WHERE node_name = $1",
        &[name.into()],
    )?
    .unwrap_or(0);
    if owned > 0 {
        return Err(RemusError::ObjectInUse(format!(
            "node {name} still owns {owned} shards; move them away first (remus_migrate_shard)"
        )));
    }
    let nodes = all_nodes()?;
    if !nodes.iter().any(|n| n.name == name) {
        return Err(RemusError::UnknownNode(name.to_string()));
    }
    let me = crate::guc::node_name().ok_or(RemusError::NodeNameUnset)?;
    let sql = format!("DELETE FROM remus.nodes WHERE name = {}", crate::remote::quote_literal(name));
    // Every remaining node forgets it, in one 2PC transaction. The leaving node is not asked:
    // it may well be down, which is a common reason to remove it.
    for n in nodes.iter().filter(|n| n.name != me && n.name != name) {
        crate::twophase::exec_in_transaction(n, &sql, true)?;
    }
    Spi::run(&sql)?;
    Ok(())
}

/// Removes a node from the cluster's membership on every node. Refused (55006) while the node
/// owns shards.
#[pg_extern]
fn remus_remove_node(name: &str) {
    remove_node(name).or_raise();
}
