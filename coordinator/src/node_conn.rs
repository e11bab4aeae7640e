//! How the coordinator reaches the PostgreSQL nodes: one place that builds conninfo strings for
//! tokio-postgres (control statements), libpq (replication, COPY) and the replay worker.
//!
//! Every session the migration machinery opens is a *migration session*
//! (`remus.migration_session=on`): the extension lets it write shard tables its node does not own
//! yet (the copy and the replay on the target), and exempts it from the admission gate, the write
//! fence and the DDL refusal that the migration itself puts up.

use std::path::Path;
use std::time::Duration;

use thiserror::Error;

use crate::node_registry::NodeRecord;

pub const DB_USER: &str = "postgres";
const MIGRATION_OPTIONS: &str = "-c remus.migration_session=on -c statement_timeout=0";

#[derive(Debug, Error)]
pub enum NodeConnError {
    #[error("cannot connect to node {node} ({host}:{port}): {source}")]
    Connect {
        node: String,
        host: String,
        port: u16,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("connecting to node {node} ({host}:{port}) timed out after {secs} s")]
    Timeout {
        node: String,
        host: String,
        port: u16,
        secs: u64,
    },
    #[error("reading the password file {path}: {detail}")]
    Pgpass { path: String, detail: String },
}

/// Credentials and database shared by every node of the cluster.
#[derive(Debug, Clone)]
pub struct NodeConnector {
    pub database: String,
    pub password: Option<String>,
    pub connect_timeout: Duration,
}

impl NodeConnector {
    /// `pgpass`: a libpq password file; the first entry for user `postgres` is used (the local
    /// cluster writes a single `*:*:*:postgres:<password>` line).
    pub fn from_pgpass(pgpass: Option<&Path>, database: &str) -> Result<Self, NodeConnError> {
        let password = match pgpass {
            None => None,
            Some(path) => Some(read_pgpass(path)?),
        };
        Ok(Self {
            database: database.to_string(),
            password,
            connect_timeout: Duration::from_secs(10),
        })
    }

    /// A libpq conninfo for `node`, optionally as a logical replication connection.
    pub fn conninfo(&self, node: &NodeRecord, replication: bool) -> String {
        let mut s = format!(
            "host={} port={} user={} dbname={} connect_timeout={} application_name={}",
            quote_conninfo(&node.host),
            node.port,
            DB_USER,
            quote_conninfo(&self.database),
            self.connect_timeout.as_secs().max(1),
            remus_proto::names::MIGRATION_APPLICATION_NAME
        );
        if let Some(p) = &self.password {
            s.push_str(&format!(" password={}", quote_conninfo(p)));
        }
        if replication {
            s.push_str(" replication=database");
        } else {
            s.push_str(&format!(" options={}", quote_conninfo(MIGRATION_OPTIONS)));
        }
        s
    }

    /// A tokio-postgres migration session on `node`; the connection task runs on the current
    /// runtime and ends with the client.
    pub async fn connect(
        &self,
        node: &NodeRecord,
    ) -> Result<tokio_postgres::Client, NodeConnError> {
        let conninfo = self.conninfo(node, false);
        let fut = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls);
        let (client, conn) = tokio::time::timeout(self.connect_timeout, fut)
            .await
            .map_err(|_| NodeConnError::Timeout {
                node: node.name.clone(),
                host: node.host.clone(),
                port: node.port,
                secs: self.connect_timeout.as_secs(),
            })?
            .map_err(|source| NodeConnError::Connect {
                node: node.name.clone(),
                host: node.host.clone(),
                port: node.port,
                source,
            })?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(client)
    }
}

fn quote_conninfo(v: &str) -> String {
    format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
}

fn read_pgpass(path: &Path) -> Result<String, NodeConnError> {
    let text = std::fs::read_to_string(path).map_err(|e| NodeConnError::Pgpass {
        path: path.display().to_string(),
        detail: e.to_string(),
    })?;
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|l| {
            let fields: Vec<&str> = l.splitn(5, ':').collect();
            (fields.len() == 5 && (fields[3] == DB_USER || fields[3] == "*"))
                .then(|| fields[4].trim_end().to_string())
        })
        .ok_or_else(|| NodeConnError::Pgpass {
            path: path.display().to_string(),
            detail: format!("no entry for user {DB_USER}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeRecord {
        NodeRecord {
            name: "n1".into(),
            host: "127.0.0.1".into(),
            port: 5432,
        }
    }

    #[test]
    fn conninfo_quotes_values_and_marks_migration_sessions() {
        let c = NodeConnector {
            database: "post'gres".into(),
            password: Some("p w\\d".into()),
            connect_timeout: Duration::from_secs(3),
        };
        let s = c.conninfo(&node(), false);
        assert!(s.contains("dbname='post\\'gres'"), "{s}");
        assert!(s.contains("password='p w\\\\d'"), "{s}");
        assert!(s.contains("remus.migration_session=on"), "{s}");
        let r = c.conninfo(&node(), true);
        assert!(r.ends_with("replication=database"), "{r}");
        assert!(!r.contains("options="), "{r}");
    }

    #[test]
    fn pgpass_entry_for_postgres_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pgpass");
        std::fs::write(
            &p,
            "# comment\nh:1:db:other:x\n*:*:*:postgres:secret:with:colons\n",
        )
        .unwrap();
        assert_eq!(read_pgpass(&p).unwrap(), "secret:with:colons");
        std::fs::write(&p, "h:1:db:other:x\n").unwrap();
        assert!(matches!(read_pgpass(&p), Err(NodeConnError::Pgpass { .. })));
    }
}
