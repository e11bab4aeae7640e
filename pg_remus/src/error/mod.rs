//! Errors a user can see, each with the SQLSTATE a client can act on.
//!
//! Functions return `Result<_, RemusError>`; [`RemusError::raise`] turns it into an ERROR at the
//! SQL boundary, so no Rust panic carries a user-facing message.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};
use remus_proto::sqlstate::SqlState;

pub(crate) mod report;

/// The node name the coordinator's errors are reported under (in DETAIL).
pub(crate) const COORDINATOR_NODE: &str = "coordinator";

/// PostgreSQL's codes that [`SqlState`] does not name; `tests::pg_codes_match_pgrx` checks them
/// against pgrx's list.
mod pg_code {
    use remus_proto::sqlstate::SqlState;

    /// `42703` undefined_column.
    pub(super) const UNDEFINED_COLUMN: SqlState = SqlState("42703");
    /// `42P16` invalid_table_definition.
    pub(super) const INVALID_TABLE_DEFINITION: SqlState = SqlState("42P16");
    /// `42710` duplicate_object.
    pub(super) const DUPLICATE_OBJECT: SqlState = SqlState("42710");
    /// `42883` undefined_function.
    pub(super) const UNDEFINED_FUNCTION: SqlState = SqlState("42883");
    /// `F0000` config_file_error.
    pub(super) const CONFIG_FILE_ERROR: SqlState = SqlState("F0000");
    /// `23502` not_null_violation.
    pub(super) const NOT_NULL_VIOLATION: SqlState = SqlState("23502");
    /// `53000` insufficient_resources.
    pub(super) const INSUFFICIENT_RESOURCES: SqlState = SqlState("53000");
    /// `25P02` in_failed_sql_transaction.
    pub(super) const IN_FAILED_SQL_TRANSACTION: SqlState = SqlState("25P02");
    /// `54000` program_limit_exceeded.
    pub(super) const PROGRAM_LIMIT_EXCEEDED: SqlState = SqlState("54000");
    /// `58030` io_error.
    pub(super) const IO_ERROR: SqlState = SqlState("58030");
    /// `2D000` invalid_transaction_termination.
    pub(super) const INVALID_TRANSACTION_TERMINATION: SqlState = SqlState("2D000");
    /// `26000` invalid_sql_statement_name.
    pub(super) const INVALID_SQL_STATEMENT_NAME: SqlState = SqlState("26000");
    /// `22012` division_by_zero: what a replayed change that touched other than one row raises,
    /// the same code as the guard of the one-at-a-time path (the replay worker's divergence).
    pub(super) const DIVISION_BY_ZERO: SqlState = SqlState("22012");
}

#[derive(Debug, thiserror::Error)]
pub enum RemusError {
    #[error("invalid node name {name:?}")]
    InvalidNodeName { name: String },
    #[error("port {port} is out of range 1..65535")]
    PortOutOfRange { port: i32 },
    #[error("host must not be empty")]
    EmptyHost,
    #[error("node {name} already exists with address {host}:{port}")]
    NodeExists {
        name: String,
        host: String,
        port: i32,
    },
    #[error("node {node} was removed concurrently")]
    NodeVanished { node: String },
    #[error("remus.node_name is not set on this node")]
    NodeNameUnset,
    #[error("unknown node {node}")]
    UnknownNode { node: String },
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
    #[error("type with oid {type_oid} has no hash function, so it cannot be a shard key")]
    NoHashFunction { type_oid: u32 },
    // 22023 invalid_parameter_value: an argument, a setting or a catalog entry is not usable.
    #[error("node {node} is this node; run the command directly")]
    NodeIsSelf { node: String },
    #[error("this node ({node}) is not in remus_nodes; add it with remus_add_node first")]
    SelfNotInCluster { node: String },
    #[error("remus.coordinator_address {address:?}: {reason}")]
    BadCoordinatorAddress { address: String, reason: String },
    #[error("bad replay worker endpoint {endpoint}: {reason}")]
    BadReplayWorkerEndpoint { endpoint: String, reason: String },
    /// A name or address too long for its slot in shared memory.
    #[error("{what} must be 1..{max} bytes")]
    LengthOutOfRange { what: &'static str, max: usize },
    #[error("NUL in {what}")]
    NulIn { what: &'static str },
    #[error("NUL byte in {text:?}")]
    NulByte { text: String },
    #[error("shard_count must be between 1 and {max}, not {shard_count}")]
    ShardCountOutOfRange { shard_count: i32, max: i32 },
    #[error("relation with oid {oid} does not exist")]
    NoSuchRelation { oid: u32 },
    #[error("table {table} is not distributed")]
    NotDistributed { table: String },
    #[error("relation {relid:?} has no columns")]
    NoColumns { relid: pgrx::pg_sys::Oid },
    #[error("distributed table disappeared")]
    TableDisappeared,
    #[error("distributed table disappeared during the scan")]
    TableDisappearedDuringScan,
    #[error("reference table has no shard")]
    ReferenceTableWithoutShard,
    #[error("{table} is a reference table; it has a single shard on every node")]
    ReferenceTableHasOneShard { table: String },
    #[error("shard map is incomplete")]
    IncompleteShardMap,
    #[error("no shard {index} in the shard map of {table}")]
    NoShardAtIndex { index: i32, table: String },
    #[error("colocate_with must be a distributed table")]
    ColocateWithNotDistributed,
    #[error("{table} is a reference table; colocate_with needs a hash-distributed table")]
    ColocateWithReference { table: String },
    #[error("cannot co-locate {table} with {other}: shard keys have different types")]
    ColocateKeyTypesDiffer { table: String, other: String },
    #[error("cannot co-locate {table} ({shard_count} shards) with {other} ({other_shard_count} shards): pass shard_count => {other_shard_count}")]
    ColocateShardCountsDiffer {
        table: String,
        shard_count: i32,
        other: String,
        other_shard_count: i32,
    },
    #[error("local shard statement failed (SPI code {spi_code})")]
    LocalShardStatementFailed { spi_code: i32 },
    #[error("invalid migration id {migration_id}")]
    InvalidMigrationId { migration_id: i64 },
    #[error("migration {migration_id} is not registered on this node")]
    MigrationNotRegistered { migration_id: i64 },
    #[error("migration {migration_id} does not capture writes on this node")]
    MigrationNotCapturing { migration_id: i64 },
    #[error("migration {migration_id} is not in dual execution on this node (its sync barrier is not set)")]
    MigrationNotInSync { migration_id: i64 },

    // Catch-up's batch apply (`migration::apply_batch`).
    #[error("remus.apply_batch must be run by CALL outside a transaction block: it commits each transaction of its batch")]
    ApplyBatchNotInCall,
    #[error(
        "no replication origin is set up in this session (pg_replication_origin_session_setup)"
    )]
    ApplyBatchNoOrigin,
    #[error("invalid batch: {detail}")]
    ApplyBatchInvalid { detail: String },
    #[error("prepared statement {name:?} has no kept plan in this session (remus.apply_shape)")]
    ApplyShapeUnknown { name: String },
    #[error("change {change} of transaction {txn} of the batch touched {rows} rows, not 1")]
    ShadowChangeRowCount {
        change: usize,
        txn: usize,
        rows: u64,
    },

    // 0A000 feature_not_supported.
    /// The recurring wording: `what` is a statement form or clause.
    #[error("{what} is not supported on distributed tables")]
    UnsupportedOnDistributed { what: &'static str },
    /// A one-off refusal whose whole text is fixed.
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("the shard key of an INSERT into {table} must be a constant or a parameter")]
    InsertKeyNotConstant { table: String },
    #[error("COPY {table} TO is not supported; use COPY (SELECT * FROM {table}) TO …")]
    CopyToUnsupported { table: String },
    #[error("{what} on {table} is not propagated to every node and shard, so it is refused")]
    DdlNotPropagated { what: &'static str, table: String },
    #[error("a statement for shard {shard_id} must reference its distributed table")]
    MarkerWithoutTable { shard_id: i64 },
    #[error("a statement for shard {shard_id} may only reference tables co-located with it")]
    MarkerNotColocated { shard_id: i64 },
    #[error("{table} is not an ordinary table; only ordinary tables can be distributed")]
    NotOrdinaryTable { table: String },
    #[error("{table} is temporary or unlogged; only permanent logged tables can be distributed")]
    NotPermanentTable { table: String },
    #[error("{table} is not an ordinary permanent table")]
    NotOrdinaryPermanentTable { table: String },
    #[error("{table} has foreign keys or is referenced by one; distribute the tables without them, then add them with ALTER TABLE … ADD FOREIGN KEY (between co-located tables on the shard key, or to reference tables; decision 0028)")]
    HasForeignKeys { table: String },
    /// A sequence default on a column that is not bigint (serial, smallserial, or a sequence
    /// default on another type): its range cannot be split between the nodes.
    #[error("column {column} of {table} takes its default from a sequence but is of type {type_name}; only bigint columns (bigserial) can draw cluster-unique values from every node (use bigserial, or bigint DEFAULT nextval(…) with a bigint sequence)")]
    SequenceColumnNotBigint {
        table: String,
        column: String,
        type_name: String,
    },
    /// An identity column that is not bigint: as for serial, its sequence's 2^31 values cannot
    /// be split into useful ranges, one per node.
    #[error("column {column} of {table} is an identity column of type {type_name}; only bigint identity columns can draw cluster-unique values from every node (2^31 values cannot be split between the nodes): use bigint GENERATED … AS IDENTITY")]
    IdentityColumnNotBigint {
        table: String,
        column: String,
        type_name: String,
    },
    /// An identity column on a reference table: every copy would draw its own value, and a
    /// write to a reference table with a volatile default is refused.
    #[error("column {column} of {table} is an identity column, which reference tables do not support (each copy would draw its own values)")]
    ReferenceIdentityColumn { table: String, column: String },
    /// A sequence default that cannot be given one disjoint range per node: `reason` says why.
    #[error("column {column} of {table} takes its default from sequence {sequence}, which cannot be split between the nodes: {reason}")]
    SequenceNotSplittable {
        table: String,
        column: String,
        sequence: String,
        reason: String,
    },
    #[error("{table} has dropped columns; shards are planned with the shell's column numbers, so recreate the table (CREATE TABLE … AS) before distributing it")]
    HasDroppedColumns { table: String },
    /// [`Self::HasDroppedColumns`] for a reference table, which has no shard plans.
    #[error("{table} has dropped columns; recreate the table before distributing it")]
    ReferenceHasDroppedColumns { table: String },
    /// Row-level security is not propagated to the shards yet: distributing a table that has it
    /// enabled would drop its policies silently (issue 18).
    #[error("{table} has row-level security enabled, which distributed and reference tables do not support yet (its policies would not be enforced on the shards); disable it (ALTER TABLE … DISABLE ROW LEVEL SECURITY) or keep the table local")]
    DistributeWithRowSecurity { table: String },
    /// A statement that would turn row-level security on for a distributed or reference table
    /// (`what`: the construct, such as `CREATE POLICY`).
    #[error("{what} on {kind} table {table} is not supported: row-level security is not propagated to the shards yet, so its policies would not be enforced")]
    RowSecurityOnDistributed {
        what: &'static str,
        kind: &'static str,
        table: String,
    },

    // 42703 undefined_column.
    #[error("column \"{column}\" of table {table} does not exist")]
    NoSuchColumn { column: String, table: String },
    #[error("shard key \"{key}\" of {table} is gone")]
    ShardKeyGone { key: String, table: String },

    // 42P16 invalid_table_definition.
    #[error("shard key \"{key}\" has type {type_name}, which has no hash function")]
    KeyTypeWithoutHash { key: String, type_name: String },
    #[error("table {table} has no primary key; a distributed table needs a primary key that contains the shard key \"{key}\"")]
    NoPrimaryKey { table: String, key: String },
    #[error("the primary key of {table} does not contain the shard key \"{key}\"; a distributed table needs a primary key that contains its shard key")]
    PrimaryKeyWithoutShardKey { table: String, key: String },
    #[error("{table} has a unique index without the shard key \"{key}\"; uniqueness could not be enforced across shards")]
    UniqueIndexWithoutShardKey { table: String, key: String },

    // 42710 duplicate_object.
    #[error("table {table} is already distributed")]
    AlreadyDistributed { table: String },
    #[error("table {table} already exists on node {node}; drop it there first")]
    TableExistsOnNode { table: String, node: String },

    // 55006 object_in_use.
    #[error("node {node} still owns {shards} shards; move them away first (remus_migrate_shard)")]
    NodeOwnsShards { node: String, shards: i64 },
    #[error("node {node} cannot be activated while a shard migration runs on this node; retry when it has ended")]
    ActivationDuringMigration { node: String },
    #[error("node {node} already holds {tables} distributed or reference tables that differ from this node's; activate a node that has none")]
    NodeHoldsTables { node: String, tables: i64 },
    #[error("table {table} is being migrated by shard migration {migration_id} (shard {shard_id}); retry the DDL when it has ended")]
    TableMigrating {
        table: String,
        migration_id: i64,
        shard_id: i64,
    },
    #[error("{what} would freeze rows of shard {shard_id}, which shard migration {migration_id} is moving (frozen rows hide destination writes from its write-write conflict check); retry when the migration has ended")]
    FreezeDuringMigration {
        what: String,
        migration_id: i64,
        shard_id: i64,
    },
    #[error("this backend (pgprocno {procno}) is beyond the {max} backends the sync barrier of shard migrations tracks, so it cannot commit a write to a migrating shard before the barrier; retry on another connection, or lower max_connections")]
    BarrierUntracked { procno: i32, max: usize },
    #[error("shard {shard_id} is already registered by migration {migration_id}")]
    ShardAlreadyRegistered { shard_id: i64, migration_id: i64 },
    #[error("too many concurrent migrations on this node (at most {max})")]
    TooManyMigrations { max: usize },
    #[error("too many migrating shards on this node (at most {max})")]
    TooManyMigratingShards { max: usize },
    #[error("the admission gate is held by migration {migration_id}")]
    GateHeld { migration_id: i64 },

    // 42501 insufficient_privilege.
    #[error("permission denied for function {function}: superuser required")]
    SuperuserRequired { function: String },
    /// Distributing a table is an ALTER TABLE of it: its owner's (or a superuser's) to do.
    #[error("must be owner of table {table}")]
    NotTableOwner { table: String },
    /// A table converted for a caller who is not superuser runs its own code (constraints,
    /// generated columns, index expressions, triggers) with the cluster's rights while its rows
    /// move; code a non-superuser could have written is refused (decision 0016).
    #[error("{table} uses {function}, owned by {owner}, who is not a superuser: its rows move with the cluster's rights, which would run that code as a superuser; a superuser must distribute this table")]
    TableCodeNotTrusted {
        table: String,
        function: String,
        owner: String,
    },

    #[error(
        "transaction aborted by shard migration {migration_id} (lock_abort); retry the transaction"
    )]
    AbortedByMigration { migration_id: i64 },
    #[error("shard {shard_id} was moved by shard migration {migration_id}; retry the transaction")]
    ShardMoved { shard_id: i64, migration_id: i64 },
    /// A write reached the old owner's copy while this node holds no state of the migration
    /// that moves it (lost in a restart): unvalidated, it would be dropped with the copy.
    #[error("shard {shard_id} now belongs to node {owner}; this node lost the state of the migration that moved it in a restart, so its copy here takes no more writes; retry the transaction (it will run on the new owner)")]
    ShardMovedAcrossRestart { shard_id: i64, owner: String },
    /// wait_remaster: a REPEATABLE READ or SERIALIZABLE transaction that waited at the
    /// admission gate holds a snapshot from before the gate opened, so from before the
    /// ownership change it waited for (review finding F20).
    #[error("this transaction waited at the admission gate of shard migration {migration_id} and its snapshot predates the ownership change; retry the transaction (it will run on the new owner)")]
    GateWaitedWithOldSnapshot { migration_id: i64 },
    /// squall: a REPEATABLE READ or SERIALIZABLE transaction waited for the pull of a shard
    /// whose rows its snapshot cannot see (decision 0025).
    #[error("this transaction waited for shard {shard_id} to be pulled by shard migration {migration_id} (squall) and its snapshot predates the pull; retry the transaction")]
    PulledAfterSnapshot { shard_id: i64, migration_id: i64 },
    /// A co-located join whose tables this transaction routes to different nodes (one used
    /// before an ownership change, one first after it; review finding F12).
    #[error("this transaction reads shard {shard_id} on node {node} but co-located shard {other_shard_id} on node {other_node} (an ownership change happened in between); a join of both cannot run on one node; retry the transaction")]
    ColocatedShardsApart {
        shard_id: i64,
        node: String,
        other_shard_id: i64,
        other_node: String,
    },
    #[error("the ownership change of shard {shard_id} (shard migration {migration_id}) is still undecided on this node after {waited_ms} ms (remus.in_doubt_wait_timeout); retry when the coordinator has completed it")]
    OwnershipInDoubt {
        shard_id: i64,
        migration_id: i64,
        waited_ms: i64,
    },
    #[error("could not serialize access: write-write conflict on the destination of shard migration {migration_id}: {conflict}")]
    MigrationConflict { migration_id: i64, conflict: String },
    #[error("commit could not be validated on the destination of shard migration {migration_id}: replay worker {endpoint}: {message}")]
    SyncValidation {
        migration_id: i64,
        endpoint: String,
        message: String,
    },
    /// A transaction's captured write set outgrew its setting (review F10).
    #[error("the write set of this transaction on shard migration {migration_id} is larger than remus.max_write_set_bytes ({limit_kb} kB); write less per transaction on a migrating shard, or raise the setting")]
    WriteSetTooLarge { migration_id: i64, limit_kb: i64 },
    #[error("shard migration {migration_id} {status}: {error}")]
    MigrationFailed {
        migration_id: i64,
        status: String,
        error: String,
    },
    #[error("remus.coordinator_address is not set; set it to the coordinator's gRPC address (e.g. http://127.0.0.1:6102)")]
    CoordinatorUnset,
    // 08006 connection_failure, reported as if the coordinator had raised it (DETAIL "raised on
    // node coordinator", as for its own errors in [`Self::Remote`]).
    #[error("cannot reach the coordinator at {address}: {reason}")]
    CoordinatorUnreachable { address: String, reason: String },
    #[error("the coordinator ended the call without a migration")]
    CoordinatorEndedCall,
    #[error("cannot start the gRPC runtime: {reason}")]
    GrpcRuntime { reason: String },
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
    /// The durable copy of a migration's state on this node could not be written or removed
    /// (`migration::durable`; issue 15 requirement 3).
    #[error(
        "could not keep the state of shard migration {migration_id} on disk ({path}): {message}"
    )]
    DurableState {
        migration_id: i64,
        path: String,
        message: String,
    },
}

impl RemusError {
    /// The five-character SQLSTATE a client sees.
    pub fn sqlstate(&self) -> &str {
        match self {
            Self::InvalidNodeName { .. }
            | Self::PortOutOfRange { .. }
            | Self::EmptyHost
            | Self::NodeIsSelf { .. }
            | Self::SelfNotInCluster { .. }
            | Self::BadCoordinatorAddress { .. }
            | Self::BadReplayWorkerEndpoint { .. }
            | Self::LengthOutOfRange { .. }
            | Self::NulIn { .. }
            | Self::NulByte { .. }
            | Self::ShardCountOutOfRange { .. }
            | Self::NoSuchRelation { .. }
            | Self::NotDistributed { .. }
            | Self::NoColumns { .. }
            | Self::TableDisappeared
            | Self::TableDisappearedDuringScan
            | Self::ReferenceTableWithoutShard
            | Self::ReferenceTableHasOneShard { .. }
            | Self::IncompleteShardMap
            | Self::NoShardAtIndex { .. }
            | Self::ColocateWithNotDistributed
            | Self::ColocateWithReference { .. }
            | Self::ColocateKeyTypesDiffer { .. }
            | Self::ColocateShardCountsDiffer { .. }
            | Self::LocalShardStatementFailed { .. }
            | Self::InvalidMigrationId { .. }
            | Self::MigrationNotRegistered { .. }
            | Self::MigrationNotCapturing { .. }
            | Self::ApplyBatchInvalid { .. } => SqlState::INVALID_PARAMETER_VALUE.code(),
            Self::ApplyBatchNotInCall => pg_code::INVALID_TRANSACTION_TERMINATION.code(),
            Self::ApplyShapeUnknown { .. } => pg_code::INVALID_SQL_STATEMENT_NAME.code(),
            Self::ShadowChangeRowCount { .. } => pg_code::DIVISION_BY_ZERO.code(),
            Self::UnsupportedOnDistributed { .. }
            | Self::Unsupported(_)
            | Self::InsertKeyNotConstant { .. }
            | Self::CopyToUnsupported { .. }
            | Self::DdlNotPropagated { .. }
            | Self::MarkerWithoutTable { .. }
            | Self::MarkerNotColocated { .. }
            | Self::NotOrdinaryTable { .. }
            | Self::NotPermanentTable { .. }
            | Self::NotOrdinaryPermanentTable { .. }
            | Self::HasForeignKeys { .. }
            | Self::SequenceColumnNotBigint { .. }
            | Self::IdentityColumnNotBigint { .. }
            | Self::ReferenceIdentityColumn { .. }
            | Self::SequenceNotSplittable { .. }
            | Self::HasDroppedColumns { .. }
            | Self::ReferenceHasDroppedColumns { .. }
            | Self::DistributeWithRowSecurity { .. }
            | Self::RowSecurityOnDistributed { .. } => SqlState::FEATURE_NOT_SUPPORTED.code(),
            Self::NoSuchColumn { .. } | Self::ShardKeyGone { .. } => {
                pg_code::UNDEFINED_COLUMN.code()
            }
            Self::KeyTypeWithoutHash { .. }
            | Self::NoPrimaryKey { .. }
            | Self::PrimaryKeyWithoutShardKey { .. }
            | Self::UniqueIndexWithoutShardKey { .. } => pg_code::INVALID_TABLE_DEFINITION.code(),
            Self::NodeExists { .. }
            | Self::AlreadyDistributed { .. }
            | Self::TableExistsOnNode { .. } => pg_code::DUPLICATE_OBJECT.code(),
            Self::NodeOwnsShards { .. }
            | Self::ActivationDuringMigration { .. }
            | Self::NodeHoldsTables { .. }
            | Self::TableMigrating { .. }
            | Self::ShardAlreadyRegistered { .. }
            | Self::FreezeDuringMigration { .. }
            | Self::TooManyMigrations { .. }
            | Self::TooManyMigratingShards { .. }
            | Self::GateHeld { .. }
            | Self::OwnershipInDoubt { .. } => SqlState::OBJECT_IN_USE.code(),
            Self::SuperuserRequired { .. }
            | Self::NotTableOwner { .. }
            | Self::TableCodeNotTrusted { .. } => SqlState::INSUFFICIENT_PRIVILEGE.code(),
            Self::BarrierUntracked { .. } => pg_code::INSUFFICIENT_RESOURCES.code(),
            Self::NodeNameUnset => pg_code::CONFIG_FILE_ERROR.code(),
            Self::NodeVanished { .. }
            | Self::AbortedByMigration { .. }
            | Self::ShardMoved { .. }
            | Self::ShardMovedAcrossRestart { .. }
            | Self::GateWaitedWithOldSnapshot { .. }
            | Self::PulledAfterSnapshot { .. }
            | Self::ColocatedShardsApart { .. }
            | Self::MigrationConflict { .. } => SqlState::SERIALIZATION_FAILURE.code(),
            // The transaction aborts and nothing it wrote is visible anywhere: retrying is safe.
            Self::SyncValidation { .. } => SqlState::SERIALIZATION_FAILURE.code(),
            Self::WriteSetTooLarge { .. } => pg_code::PROGRAM_LIMIT_EXCEEDED.code(),
            Self::CoordinatorUnset
            | Self::MigrationFailed { .. }
            | Self::MigrationNotInSync { .. }
            | Self::ApplyBatchNoOrigin => SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE.code(),
            Self::Spi(_) => SqlState::INTERNAL_ERROR.code(),
            Self::DurableState { .. } => pg_code::IO_ERROR.code(),
            Self::NoHashFunction { .. } => pg_code::UNDEFINED_FUNCTION.code(),
            Self::UnknownNode { .. } => SqlState::UNDEFINED_OBJECT.code(),
            Self::Connection { .. }
            | Self::CoordinatorUnreachable { .. }
            | Self::CoordinatorEndedCall
            | Self::GrpcRuntime { .. } => SqlState::CONNECTION_FAILURE.code(),
            Self::NullShardKey { .. } => pg_code::NOT_NULL_VIOLATION.code(),
            Self::TransactionDoomed => pg_code::IN_FAILED_SQL_TRANSACTION.code(),
            Self::NotShardOwner { .. } => SqlState::NOT_SHARD_OWNER.code(),
            Self::Remote { sqlstate, .. } => sqlstate,
        }
    }

    fn hint(&self) -> Option<&'static str> {
        match self {
            Self::InvalidNodeName { .. } => Some(
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
        report::sqlstate_code(self.sqlstate())
    }

    fn detail(&self) -> Option<String> {
        match self {
            Self::Remote { node, detail, .. } => Some(match detail {
                Some(d) => format!("{d} (raised on node {node})"),
                None => format!("raised on node {node}"),
            }),
            Self::CoordinatorUnreachable { .. }
            | Self::CoordinatorEndedCall
            | Self::GrpcRuntime { .. } => Some(format!("raised on node {COORDINATOR_NODE}")),
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

#[cfg(test)]
mod tests {
    use super::pg_code;
    use super::report::sqlstate_code;
    use super::RemusError;
    use pgrx::PgSqlErrorCode::*;

    /// Texts with more than one field or a repeated one (the regress tier pins the others).
    #[test]
    fn typed_variants_keep_their_texts() {
        let e = RemusError::CopyToUnsupported {
            table: "public.t".into(),
        };
        assert_eq!(
            e.to_string(),
            "COPY public.t TO is not supported; use COPY (SELECT * FROM public.t) TO …"
        );
        assert_eq!(e.sqlstate(), "0A000");
        let e = RemusError::ColocateShardCountsDiffer {
            table: "public.a".into(),
            shard_count: 8,
            other: "public.b".into(),
            other_shard_count: 4,
        };
        assert_eq!(
            e.to_string(),
            "cannot co-locate public.a (8 shards) with public.b (4 shards): pass shard_count => 4"
        );
        assert_eq!(e.sqlstate(), "22023");
        let e = RemusError::SyncValidation {
            migration_id: 7,
            endpoint: "http://127.0.0.1:1".into(),
            message: "gone".into(),
        };
        assert_eq!(
            e.to_string(),
            "commit could not be validated on the destination of shard migration 7: replay worker http://127.0.0.1:1: gone"
        );
        let e = RemusError::CoordinatorUnreachable {
            address: "http://127.0.0.1:2".into(),
            reason: "refused".into(),
        };
        assert_eq!(
            e.to_string(),
            "cannot reach the coordinator at http://127.0.0.1:2: refused"
        );
        assert_eq!(e.sqlstate(), "08006");
        assert_eq!(e.detail().as_deref(), Some("raised on node coordinator"));
        let e = RemusError::LengthOutOfRange {
            what: "node name",
            max: 63,
        };
        assert_eq!(e.to_string(), "node name must be 1..63 bytes");
        assert_eq!(
            RemusError::NotShardOwner {
                shard_id: 1,
                node: "n1".into()
            }
            .sqlstate(),
            "RM001"
        );
    }

    #[test]
    fn pg_codes_match_pgrx() {
        for (code, pgrx_code) in [
            (pg_code::UNDEFINED_COLUMN, ERRCODE_UNDEFINED_COLUMN),
            (
                pg_code::INVALID_TABLE_DEFINITION,
                ERRCODE_INVALID_TABLE_DEFINITION,
            ),
            (pg_code::DUPLICATE_OBJECT, ERRCODE_DUPLICATE_OBJECT),
            (pg_code::UNDEFINED_FUNCTION, ERRCODE_UNDEFINED_FUNCTION),
            (pg_code::CONFIG_FILE_ERROR, ERRCODE_CONFIG_FILE_ERROR),
            (pg_code::NOT_NULL_VIOLATION, ERRCODE_NOT_NULL_VIOLATION),
            (
                pg_code::PROGRAM_LIMIT_EXCEEDED,
                ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            ),
            (pg_code::IO_ERROR, ERRCODE_IO_ERROR),
            (
                pg_code::IN_FAILED_SQL_TRANSACTION,
                ERRCODE_IN_FAILED_SQL_TRANSACTION,
            ),
            (
                pg_code::INVALID_TRANSACTION_TERMINATION,
                ERRCODE_INVALID_TRANSACTION_TERMINATION,
            ),
            (
                pg_code::INVALID_SQL_STATEMENT_NAME,
                ERRCODE_INVALID_SQL_STATEMENT_NAME,
            ),
            (pg_code::DIVISION_BY_ZERO, ERRCODE_DIVISION_BY_ZERO),
        ] {
            assert_eq!(sqlstate_code(code.code()), pgrx_code as i32, "{code}");
        }
    }
}
