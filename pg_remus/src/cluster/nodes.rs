//! Cluster membership in this node's catalog.
//!
//! Each node keeps its own copy of the member list: routing must be able to find an owner's
//! address with nothing but a local catalog read inside the statement's snapshot. The SQL
//! functions that change it are in `api::nodes`.

use pgrx::spi::Spi;

use crate::cluster::remote::NodeAddr;
use crate::error::RemusError;

/// Same rule as the coordinator's registry (node names end up inside slot, publication and
/// prepared-transaction names, which are plain identifiers).
pub fn is_valid_node_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase())
        && name.len() <= 32
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

pub(crate) fn add_node(name: &str, host: &str, port: i32) -> Result<bool, RemusError> {
    if !is_valid_node_name(name) {
        return Err(RemusError::InvalidNodeName {
            name: name.to_string(),
        });
    }
    if host.trim().is_empty() {
        return Err(RemusError::EmptyHost);
    }
    if !(1..=65535).contains(&port) {
        return Err(RemusError::PortOutOfRange { port });
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
            _ => Err(RemusError::NodeVanished {
                node: name.to_string(),
            }),
        }
    })
}

/// Every node in this node's catalog.
pub fn all_nodes() -> Result<Vec<NodeAddr>, RemusError> {
    Spi::connect(|c| {
        c.select(
            "SELECT name, host, port FROM remus.nodes ORDER BY name",
            None,
            &[],
        )?
        .map(|r| {
            Ok(NodeAddr {
                name: r.get::<String>(1)?.unwrap_or_default(),
                host: r.get::<String>(2)?.unwrap_or_default(),
                port: r.get::<i32>(3)?.unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })
    .map_err(RemusError::from)
}

pub fn lookup(name: &str) -> Result<NodeAddr, RemusError> {
    all_nodes()?
        .into_iter()
        .find(|n| n.name == name)
        .ok_or_else(|| RemusError::UnknownNode {
            node: name.to_string(),
        })
}
