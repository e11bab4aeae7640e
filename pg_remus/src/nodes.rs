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
