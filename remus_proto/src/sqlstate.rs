//! SQLSTATEs that pg_remus raises or sends across the wire, as named constants.
//!
//! PostgreSQL's own codes are listed where a component outside the server (the coordinator's
//! refusals, the SQL functions' reading of them, `remusctl`) picks one by hand. `RM…` is
//! pg_remus's own class (decision 0005).

use std::fmt;

/// A five-character SQLSTATE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SqlState(pub &'static str);

impl SqlState {
    // pg_remus's own class RM.
    /// `RM001`: the node no longer owns the shard (it moved); retry through the router.
    pub const NOT_SHARD_OWNER: SqlState = SqlState("RM001");

    // PostgreSQL's codes (names as in `errcodes.txt`).
    /// `0A000` feature_not_supported.
    pub const FEATURE_NOT_SUPPORTED: SqlState = SqlState("0A000");
    /// `08006` connection_failure.
    pub const CONNECTION_FAILURE: SqlState = SqlState("08006");
    /// `22023` invalid_parameter_value.
    pub const INVALID_PARAMETER_VALUE: SqlState = SqlState("22023");
    /// `23505` unique_violation.
    pub const UNIQUE_VIOLATION: SqlState = SqlState("23505");
    /// `40001` serialization_failure.
    pub const SERIALIZATION_FAILURE: SqlState = SqlState("40001");
    /// `42501` insufficient_privilege.
    pub const INSUFFICIENT_PRIVILEGE: SqlState = SqlState("42501");
    /// `42704` undefined_object.
    pub const UNDEFINED_OBJECT: SqlState = SqlState("42704");
    /// `42P01` undefined_table.
    pub const UNDEFINED_TABLE: SqlState = SqlState("42P01");
    /// `55000` object_not_in_prerequisite_state.
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: SqlState = SqlState("55000");
    /// `55006` object_in_use.
    pub const OBJECT_IN_USE: SqlState = SqlState("55006");
    /// `57014` query_canceled.
    pub const QUERY_CANCELED: SqlState = SqlState("57014");
    /// `57P03` cannot_connect_now.
    pub const CANNOT_CONNECT_NOW: SqlState = SqlState("57P03");
    /// `XX000` internal_error.
    pub const INTERNAL_ERROR: SqlState = SqlState("XX000");

    /// The five characters.
    pub const fn code(self) -> &'static str {
        self.0
    }

    /// The class: the first two characters (`"40"` for every transaction rollback).
    pub fn class(self) -> &'static str {
        &self.0[..2]
    }

    /// What the SQL functions raise for a coordinator error that carries no SQLSTATE of its
    /// own, by its gRPC code.
    pub fn for_grpc_code(code: tonic::Code) -> SqlState {
        use tonic::Code;
        match code {
            Code::InvalidArgument => Self::INVALID_PARAMETER_VALUE,
            Code::NotFound => Self::UNDEFINED_OBJECT,
            Code::AlreadyExists | Code::FailedPrecondition => Self::OBJECT_IN_USE,
            Code::Unimplemented => Self::FEATURE_NOT_SUPPORTED,
            Code::Unavailable => Self::CONNECTION_FAILURE,
            _ => Self::INTERNAL_ERROR,
        }
    }
}

impl fmt::Display for SqlState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl AsRef<str> for SqlState {
    fn as_ref(&self) -> &str {
        self.0
    }
}

impl PartialEq<str> for SqlState {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for SqlState {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<SqlState> for str {
    fn eq(&self, other: &SqlState) -> bool {
        self == other.0
    }
}

impl PartialEq<SqlState> for String {
    fn eq(&self, other: &SqlState) -> bool {
        self == other.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [SqlState; 14] = [
        SqlState::NOT_SHARD_OWNER,
        SqlState::FEATURE_NOT_SUPPORTED,
        SqlState::CONNECTION_FAILURE,
        SqlState::INVALID_PARAMETER_VALUE,
        SqlState::UNIQUE_VIOLATION,
        SqlState::SERIALIZATION_FAILURE,
        SqlState::INSUFFICIENT_PRIVILEGE,
        SqlState::UNDEFINED_OBJECT,
        SqlState::UNDEFINED_TABLE,
        SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
        SqlState::OBJECT_IN_USE,
        SqlState::QUERY_CANCELED,
        SqlState::CANNOT_CONNECT_NOW,
        SqlState::INTERNAL_ERROR,
    ];

    #[test]
    fn codes_are_five_upper_case_alphanumerics() {
        for s in ALL {
            assert_eq!(s.code().len(), 5, "{s}");
            assert!(
                s.code()
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase()),
                "{s}"
            );
            // Usable as gRPC metadata (what the coordinator sends).
            assert!(s
                .code()
                .parse::<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>()
                .is_ok());
        }
    }

    #[test]
    fn compares_and_prints_as_its_code() {
        assert_eq!(SqlState::NOT_SHARD_OWNER.to_string(), "RM001");
        assert_eq!(SqlState::SERIALIZATION_FAILURE.class(), "40");
        let from_a_server = String::from("55006");
        assert!(from_a_server == SqlState::OBJECT_IN_USE);
        assert!(SqlState::UNDEFINED_TABLE == "42P01");
    }

    #[test]
    fn grpc_fallbacks() {
        use tonic::Code;
        assert_eq!(
            SqlState::for_grpc_code(Code::InvalidArgument),
            SqlState::INVALID_PARAMETER_VALUE
        );
        assert_eq!(
            SqlState::for_grpc_code(Code::NotFound),
            SqlState::UNDEFINED_OBJECT
        );
        assert_eq!(
            SqlState::for_grpc_code(Code::AlreadyExists),
            SqlState::OBJECT_IN_USE
        );
        assert_eq!(
            SqlState::for_grpc_code(Code::FailedPrecondition),
            SqlState::OBJECT_IN_USE
        );
        assert_eq!(
            SqlState::for_grpc_code(Code::Unimplemented),
            SqlState::FEATURE_NOT_SUPPORTED
        );
        assert_eq!(
            SqlState::for_grpc_code(Code::Unavailable),
            SqlState::CONNECTION_FAILURE
        );
        assert_eq!(
            SqlState::for_grpc_code(Code::Internal),
            SqlState::INTERNAL_ERROR
        );
    }
}
