//! Errors a user can see, each with the SQLSTATE a client can act on.
//!
//! Functions return `Result<_, RemusError>`; [`RemusError::raise`] turns it into an ERROR at the
//! SQL boundary, so no Rust panic carries a user-facing message.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

#[derive(Debug, thiserror::Error)]
pub enum RemusError {
    #[error("invalid node name {0:?}")]
    InvalidNodeName(String),
    #[error("port {0} is out of range 1..65535")]
    PortOutOfRange(i32),
    #[error("host must not be empty")]
    EmptyHost,
    #[error("node {name} already exists with address {host}:{port}")]
    NodeExists { name: String, host: String, port: i32 },
    #[error("node {0} was removed concurrently")]
    NodeVanished(String),
    #[error("remus.node_name is not set on this node")]
    NodeNameUnset,
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    FeatureNotSupported(String),
    #[error("unknown node {0}")]
    UnknownNode(String),
    #[error("could not connect to node {node}: {message}")]
    Connection { node: String, message: String },
    #[error("{message}")]
    Remote {
        node: String,
        sqlstate: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
    },
    #[error("type with oid {0} has no hash function, so it cannot be a shard key")]
    NoHashFunction(u32),
    #[error("{0}")]
    UndefinedColumn(String),
    #[error("{0}")]
    InvalidTableDefinition(String),
    #[error("{0}")]
    DuplicateObject(String),
    #[error("{0}")]
    ObjectInUse(String),
    #[error("catalog access failed: {0}")]
    Spi(#[from] pgrx::spi::Error),
}

impl RemusError {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        use PgSqlErrorCode::*;
        match self {
            Self::InvalidNodeName(_) | Self::PortOutOfRange(_) | Self::EmptyHost => {
                ERRCODE_INVALID_PARAMETER_VALUE
            }
            Self::NodeExists { .. } => ERRCODE_DUPLICATE_OBJECT,
            Self::NodeNameUnset => ERRCODE_CONFIG_FILE_ERROR,
            Self::NodeVanished(_) => ERRCODE_T_R_SERIALIZATION_FAILURE,
            Self::Spi(_) => ERRCODE_INTERNAL_ERROR,
            Self::InvalidArgument(_) => ERRCODE_INVALID_PARAMETER_VALUE,
            Self::NoHashFunction(_) => ERRCODE_UNDEFINED_FUNCTION,
            Self::UndefinedColumn(_) => ERRCODE_UNDEFINED_COLUMN,
            Self::InvalidTableDefinition(_) => ERRCODE_INVALID_TABLE_DEFINITION,
            Self::DuplicateObject(_) => ERRCODE_DUPLICATE_OBJECT,
            Self::ObjectInUse(_) => ERRCODE_OBJECT_IN_USE,
            Self::FeatureNotSupported(_) => ERRCODE_FEATURE_NOT_SUPPORTED,
            Self::UnknownNode(_) => ERRCODE_UNDEFINED_OBJECT,
            Self::Connection { .. } => ERRCODE_CONNECTION_FAILURE,
            Self::Remote { sqlstate, .. } => {
                PgSqlErrorCode::from(crate::remote::sqlstate_code(sqlstate))
            }
        }
    }

    fn hint(&self) -> Option<&'static str> {
        match self {
            Self::InvalidNodeName(_) => Some(
                "Node names are 1-32 characters of a-z, 0-9 and _, starting with a letter; they become part of slot and transaction names.",
            ),
            Self::NodeExists { .. } => {
                Some("Remove the node first, or add it under another name.")
            }
            Self::NodeNameUnset => Some("Set remus.node_name in postgresql.conf and reload."),
            _ => None,
        }
    }

    /// Raises this error as a PostgreSQL ERROR; never returns.
    pub fn raise(self) -> ! {
        let mut report = ErrorReport::new(self.sqlstate(), self.to_string(), "pg_remus");
        if let Some(h) = self.hint() {
            report = report.set_hint(h);
        }
        if let Self::Remote { node, detail, hint, .. } = &self {
            let d = match detail {
                Some(d) => format!("{d} (raised on node {node})"),
                None => format!("raised on node {node}"),
            };
            report = report.set_detail(d);
            if let Some(h) = hint {
                report = report.set_hint(h.clone());
            }
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("ERROR does not return")
    }
}

/// Unwraps a result at the SQL boundary.
pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T> OrRaise<T> for Result<T, RemusError> {
    fn or_raise(self) -> T {
        match self {
            Ok(v) => v,
            Err(e) => e.raise(),
        }
    }
}
