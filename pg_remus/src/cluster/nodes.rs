//! Cluster membership in this node's catalog.
//!
//! Each node keeps its own copy of the member list: routing must be able to find an owner's
//! address with nothing but a local catalog read inside the statement's snapshot. The SQL
//! functions that change it are in `api::nodes`.

use std::cell::RefCell;

use pgrx::prelude::*;
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
    crate::pg::spi::connect(|c| {
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

thread_local! {
    /// The member list as last read, with the OID of `remus.nodes`, for [`lookup`]: routing
    /// needs an owner's address per remote statement. Cleared by a relcache invalidation of
    /// `remus.nodes` (its statement trigger sends one when membership changes) or of
    /// everything.
    static NODES: RefCell<Option<(pg_sys::Oid, Vec<NodeAddr>)>> = const { RefCell::new(None) };
}

/// A relcache invalidation of `relid` (`InvalidOid`: of everything).
pub(crate) fn forget_relation(relid: pg_sys::Oid) {
    NODES.with(|n| {
        let mut n = n.borrow_mut();
        if relid == pg_sys::InvalidOid || n.as_ref().is_some_and(|(r, _)| *r == relid) {
            *n = None;
        }
    });
}

/// The address of node `name`, from the backend's copy of the member list.
pub fn lookup(name: &str) -> Result<NodeAddr, RemusError> {
    let hit = NODES.with(|n| {
        n.borrow()
            .as_ref()
            .map(|(_, all)| all.iter().find(|a| a.name == name).cloned())
    });
    if let Some(found) = hit {
        return found.ok_or_else(|| RemusError::UnknownNode {
            node: name.to_string(),
        });
    }
    let all = all_nodes()?;
    let found = all.iter().find(|n| n.name == name).cloned();
    // SAFETY: name lookups in the catalog of the current database.
    let relid = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"remus".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            pg_sys::InvalidOid
        } else {
            pg_sys::get_relname_relid(c"nodes".as_ptr(), nsp)
        }
    };
    if relid != pg_sys::InvalidOid {
        NODES.with(|n| *n.borrow_mut() = Some((relid, all)));
    }
    found.ok_or_else(|| RemusError::UnknownNode {
        node: name.to_string(),
    })
}

pgrx::extension_sql!(
    r#"
CREATE TRIGGER nodes_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON remus.nodes
    FOR EACH STATEMENT EXECUTE FUNCTION remus.nodes_changed();
"#,
    name = "nodes_changed_trigger",
    requires = ["catalog", remus::nodes_changed]
);

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    /// Statement trigger on `remus.nodes`: every backend's copy of the member list (the
    /// router's node addresses) is dropped when the change commits.
    #[pg_trigger]
    fn nodes_changed<'a>(
        trigger: &'a pgrx::PgTrigger<'a>,
    ) -> Result<Option<PgHeapTuple<'a, pgrx::AllocatedByPostgres>>, PgHeapTupleError> {
        if let Ok(rel) = trigger.relation() {
            // SAFETY: queues a transactional invalidation of an existing relation.
            unsafe { pg_sys::CacheInvalidateRelcacheByRelid(rel.oid()) };
        }
        Ok(None)
    }
}
