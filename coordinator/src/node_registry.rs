//! Cluster membership in etcd: `/remus/<cluster>/nodes/<name>` → JSON `{name, host, port}`.
//!
//! etcd, not the nodes' catalogs, is what the coordinator trusts when it plans a migration: a
//! node's catalog can lag behind (it is updated by SQL on that node), etcd is the one record
//! every coordinator replica agrees on.

use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    pub host: String,
    pub port: u16,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("corrupt node record at {key}: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("node {name} is already registered as {existing_host}:{existing_port}")]
    Conflict {
        name: String,
        existing_host: String,
        existing_port: u16,
    },
    #[error("invalid node: {0}")]
    Invalid(String),
}

#[derive(Clone)]
pub struct NodeRegistry {
    client: Client,
    prefix: String,
}

impl NodeRegistry {
    pub fn new(client: Client, cluster: &str) -> Self {
        Self {
            client,
            prefix: format!("/remus/{cluster}/nodes/"),
        }
    }

    /// Registers a node; `Ok(true)` when it was new, `Ok(false)` when the same record existed.
    /// The compare-and-put makes two concurrent registrations of one name agree.
    pub async fn register(&self, node: &NodeRecord) -> Result<bool, RegistryError> {
        validate(node)?;
        let key = format!("{}{}", self.prefix, node.name);
        let value = serde_json::to_string(node).expect("NodeRecord always serializes");
        let txn = Txn::new()
            .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), value, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let resp = self.client.kv_client().txn(txn).await?;
        if resp.succeeded() {
            return Ok(true);
        }
        for op in resp.op_responses() {
            if let TxnOpResponse::Get(get) = op {
                if let Some(kv) = get.kvs().first() {
                    let existing: NodeRecord =
                        serde_json::from_slice(kv.value()).map_err(|source| {
                            RegistryError::Corrupt {
                                key: key.clone(),
                                source,
                            }
                        })?;
                    if existing == *node {
                        return Ok(false);
                    }
                    return Err(RegistryError::Conflict {
                        name: node.name.clone(),
                        existing_host: existing.host,
                        existing_port: existing.port,
                    });
                }
            }
        }
        // The key vanished between compare and get: a concurrent delete. Retry once via recursion
        // would hide a flapping registry; report it instead.
        Err(RegistryError::Invalid(format!(
            "node {} was removed while registering it",
            node.name
        )))
    }

    pub async fn list(&self) -> Result<Vec<NodeRecord>, RegistryError> {
        let resp = self
            .client
            .kv_client()
            .get(self.prefix.clone(), Some(GetOptions::new().with_prefix()))
            .await?;
        let mut nodes = resp
            .kvs()
            .iter()
            .map(|kv| {
                serde_json::from_slice::<NodeRecord>(kv.value()).map_err(|source| {
                    RegistryError::Corrupt {
                        key: String::from_utf8_lossy(kv.key()).into_owned(),
                        source,
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(nodes)
    }
}

/// Same rule as the extension's `remus_add_node`: a node name becomes part of object names
/// (slots, publications, prepared-transaction ids), so it is a plain lowercase identifier.
pub fn validate(node: &NodeRecord) -> Result<(), RegistryError> {
    if !is_valid_node_name(&node.name) {
        return Err(RegistryError::Invalid(format!(
            "node name {:?} must be 1-32 characters of a-z, 0-9 and _, starting with a letter",
            node.name
        )));
    }
    if node.host.is_empty() {
        return Err(RegistryError::Invalid("host must not be empty".into()));
    }
    if node.port == 0 {
        return Err(RegistryError::Invalid(
            "port must be between 1 and 65535".into(),
        ));
    }
    Ok(())
}

pub fn is_valid_node_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase())
        && name.len() <= 32
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names() {
        assert!(is_valid_node_name("n1"));
        assert!(is_valid_node_name("node_a7"));
        assert!(!is_valid_node_name(""));
        assert!(!is_valid_node_name("1n"));
        assert!(!is_valid_node_name("N1"));
        assert!(!is_valid_node_name("n-1"));
        assert!(!is_valid_node_name(&"n".repeat(33)));
    }

    #[test]
    fn validate_rejects_port_zero_and_empty_host() {
        let mut n = NodeRecord {
            name: "n1".into(),
            host: "127.0.0.1".into(),
            port: 6001,
        };
        assert!(validate(&n).is_ok());
        n.port = 0;
        assert!(matches!(validate(&n), Err(RegistryError::Invalid(_))));
        n.port = 1;
        n.host.clear();
        assert!(matches!(validate(&n), Err(RegistryError::Invalid(_))));
    }
}
