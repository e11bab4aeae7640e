//! Errors a user can see, each with the SQLSTATE a client can act on.
//!
//! Functions return `Result<_, RemusError>`; [`RemusError::raise`] turns it into an ERROR at the
//! SQL boundary, so no Rust panic carries a user-facing message.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

pub(crate) mod report;

/// Dedicated SQLSTATE (class RM, pg_remus): a statement reached a node that does not own the
/// shard for its transaction. Routers retry or redirect on it.
pub const NOT_SHARD_OWNER: &str = "RM001";

#[derive(Debug, thiserror::Error)]
pub enum RemusError {
    #[error("invalid node name {0:?}")]
    InvalidNodeName(String),
    #[error("port {0} is out of range 1..65535")]
    PortOutOfRange(i32),
    #[error("host must not be empty")]
    EmptyHost,
    #[error("node {name} already exists with address {host}:{port}")]
    NodeExists {
        name: String,
        host: String,
        port: i32,
    },
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
    #[error("{0}")]
    InsufficientPrivilege(String),
    #[error(
        "transaction aborted by shard migration {migration_id} (lock_abort); retry the transaction"
    )]
    AbortedByMigration { migration_id: i64 },
    #[error("shard {shard_id} was moved by shard migration {migration_id}; retry the transaction")]
    ShardMoved { shard_id: i64, migration_id: i64 },
    #[error("could not serialize access: write-write conflict on the destination of shard migration {migration_id}: {conflict}")]
    MigrationConflict { migration_id: i64, conflict: String },
    #[error("commit could not be validated on the destination of shard migration {migration_id}: {message}")]
    SyncValidation { migration_id: i64, message: String },
    #[error("shard migration {migration_id} {status}: {error}")]
    MigrationFailed {
        migration_id: i64,
        status: String,
        error: String,
    },
    #[error("remus.coordinator_address is not set; set it to the coordinator's gRPC address (e.g. http://127.0.0.1:6102)")]
    CoordinatorUnset,
    #[error("shard {shard_id} is not owned by node {node} for this transaction")]
    NotShardOwner { shard_id: i64, node: String },
    #[error("null value in column \"{column}\" of relation {table} violates not-null constraint")]
    NullShardKey { column: String, table: String },
    #[error(
        "a node of this transaction could not follow a savepoint; the transaction cannot commit"
    )]
    TransactionDoomed,
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
            Self::AbortedByMigration { .. }
            | Self::ShardMoved { .. }
            | Self::MigrationConflict { .. } => ERRCODE_T_R_SERIALIZATION_FAILURE,
            // The transaction aborts and nothing it wrote is visible anywhere: retrying is safe.
            Self::SyncValidation { .. } => ERRCODE_T_R_SERIALIZATION_FAILURE,
            Self::CoordinatorUnset | Self::MigrationFailed { .. } => {
                ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE
            }
            Self::Spi(_) => ERRCODE_INTERNAL_ERROR,
            Self::InvalidArgument(_) => ERRCODE_INVALID_PARAMETER_VALUE,
            Self::NoHashFunction(_) => ERRCODE_UNDEFINED_FUNCTION,
            Self::UndefinedColumn(_) => ERRCODE_UNDEFINED_COLUMN,
            Self::InvalidTableDefinition(_) => ERRCODE_INVALID_TABLE_DEFINITION,
            Self::DuplicateObject(_) => ERRCODE_DUPLICATE_OBJECT,
            Self::ObjectInUse(_) => ERRCODE_OBJECT_IN_USE,
            Self::InsufficientPrivilege(_) => ERRCODE_INSUFFICIENT_PRIVILEGE,
            Self::FeatureNotSupported(_) => ERRCODE_FEATURE_NOT_SUPPORTED,
            Self::UnknownNode(_) => ERRCODE_UNDEFINED_OBJECT,
            Self::Connection { .. } => ERRCODE_CONNECTION_FAILURE,
            Self::NullShardKey { .. } => ERRCODE_NOT_NULL_VIOLATION,
            Self::TransactionDoomed => ERRCODE_IN_FAILED_SQL_TRANSACTION,
            Self::NotShardOwner { .. } => {
                PgSqlErrorCode::from(report::sqlstate_code(NOT_SHARD_OWNER))
            }
            Self::Remote { sqlstate, .. } => PgSqlErrorCode::from(report::sqlstate_code(sqlstate)),
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

    /// The SQLSTATE as PostgreSQL encodes it (MAKE_SQLSTATE).
    fn code(&self) -> i32 {
        match self {
            Self::Remote { sqlstate, .. } => report::sqlstate_code(sqlstate),
            Self::NotShardOwner { .. } => report::sqlstate_code(NOT_SHARD_OWNER),
            other => other.sqlstate() as i32,
        }
    }

    fn detail(&self) -> Option<String> {
        match self {
            Self::Remote { node, detail, .. } => Some(match detail {
                Some(d) => format!("{d} (raised on node {node})"),
                None => format!("raised on node {node}"),
            }),
            _ => None,
        }
    }

    fn full_hint(&self) -> Option<String> {
        match self {
            Self::Remote { hint, .. } => hint.clone(),
            other => other.hint().map(str::to_string),
        }
    }

    /// Raises this error as a PostgreSQL ERROR; never returns.
    ///
    /// Always through pgrx's report path (a Rust panic turned into an ERROR at the pg_guard
    /// boundary, after every Rust frame has unwound). pgrx can only carry SQLSTATEs it has a
    /// name for; any other code (pg_remus's own class RM, or a remote node's code passed
    /// through) is remembered here and put back by the `emit_log_hook` (`hooks::emit_log`, through
    /// [`report::restore_sqlstate`]) when the error is reported, whatever guards it crossed on
    /// the way.
    pub fn raise(self) -> ! {
        let code = self.code();
        let known = PgSqlErrorCode::from(code);
        let message = self.to_string();
        if known as i32 != code {
            report::remember(message.clone(), code);
        }
        let mut report = ErrorReport::new(known, message, "pg_remus");
        if let Some(h) = self.full_hint() {
            report = report.set_hint(h);
        }
        if let Some(d) = self.detail() {
            report = report.set_detail(d);
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
