//! Errors a user can see, each with the SQLSTATE a client can act on.
//!
//! Functions return `Result<_, RemusError>`; [`RemusError::raise`] turns it into an ERROR at the
//! SQL boundary, so no Rust panic carries a user-facing message.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

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
    #[error("shard {shard_id} is not owned by node {node} for this transaction")]
    NotShardOwner { shard_id: i64, node: String },
    #[error("null value in column \"{column}\" of relation {table} violates not-null constraint")]
    NullShardKey { column: String, table: String },
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
            Self::NullShardKey { .. } => ERRCODE_NOT_NULL_VIOLATION,
            Self::NotShardOwner { .. } => PgSqlErrorCode::from(crate::remote::sqlstate_code(NOT_SHARD_OWNER)),
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

    /// The SQLSTATE as PostgreSQL encodes it (MAKE_SQLSTATE).
    fn code(&self) -> i32 {
        match self {
            Self::Remote { sqlstate, .. } => crate::remote::sqlstate_code(sqlstate),
            Self::NotShardOwner { .. } => crate::remote::sqlstate_code(NOT_SHARD_OWNER),
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
    pub fn raise(self) -> ! {
        let code = self.code();
        let known = PgSqlErrorCode::from(code);
        if known as i32 == code {
            // The usual path: a Rust panic carrying the report, turned into an ERROR by the
            // pg_guard boundary after every Rust frame has been unwound.
            let mut report = ErrorReport::new(known, self.to_string(), "pg_remus");
            if let Some(h) = self.full_hint() {
                report = report.set_hint(h);
            }
            if let Some(d) = self.detail() {
                report = report.set_detail(d);
            }
            report.report(PgLogLevel::ERROR);
            unreachable!("ERROR does not return")
        }
        raise_with_code(code, self.to_string(), self.detail(), self.full_hint())
    }
}

/// ERROR with a SQLSTATE that pgrx's `PgSqlErrorCode` cannot name (pg_remus's own class RM,
/// or a remote node's code passed through). Strings are copied into PostgreSQL memory and every
/// Rust value is dropped before `errfinish` jumps out, so nothing with a destructor is skipped.
fn raise_with_code(code: i32, message: String, detail: Option<String>, hint: Option<String>) -> ! {
    unsafe extern "C-unwind" {
        fn errstart(elevel: std::ffi::c_int, domain: *const std::ffi::c_char) -> bool;
        fn errcode(sqlerrcode: std::ffi::c_int) -> std::ffi::c_int;
        fn errmsg(fmt: *const std::ffi::c_char, ...) -> std::ffi::c_int;
        fn errdetail(fmt: *const std::ffi::c_char, ...) -> std::ffi::c_int;
        fn errhint(fmt: *const std::ffi::c_char, ...) -> std::ffi::c_int;
        fn errfinish(filename: *const std::ffi::c_char, lineno: std::ffi::c_int, funcname: *const std::ffi::c_char);
    }
    let to_pg = |s: Option<String>| -> *mut std::ffi::c_char {
        match s.and_then(|s| std::ffi::CString::new(s).ok()) {
            // SAFETY: pstrdup copies into the current (per-query or error) memory context.
            Some(c) => unsafe { pgrx::pg_sys::pstrdup(c.as_ptr()) },
            None => std::ptr::null_mut(),
        }
    };
    let (m, d, h) = (to_pg(Some(message)), to_pg(detail), to_pg(hint));
    // SAFETY: the standard ereport sequence; all arguments are PostgreSQL-allocated C strings.
    unsafe {
        if errstart(PgLogLevel::ERROR as i32, std::ptr::null()) {
            errcode(code);
            errmsg(c"%s".as_ptr(), m);
            if !d.is_null() {
                errdetail(c"%s".as_ptr(), d);
            }
            if !h.is_null() {
                errhint(c"%s".as_ptr(), h);
            }
            errfinish(c"error.rs".as_ptr(), line!() as i32, c"pg_remus".as_ptr());
        }
    }
    unreachable!("ERROR does not return")
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
