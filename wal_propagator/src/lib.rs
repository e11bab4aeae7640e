//! The source side of a Remus shard migration: the source's committed transactions, as whole
//! units, ready to be shipped to the replay worker.
//!
//! The propagator consumes the logical replication stream of the source node (the built-in
//! `pgoutput` plugin, protocol version 1) so that the source needs no extension code on the
//! replication path, and it hands on only complete, committed transactions because the
//! destination applies each one atomically as a shadow transaction. The crate is split so that
//! everything that can be wrong about bytes and ordering is tested without a server:
//!
//! - [`pgoutput`] turns the bytes of the CopyBoth stream into typed messages (and encodes the
//!   feedback the client sends back);
//! - [`assembler`] turns that message stream into [`CommittedTxn`]s, bounded in memory.
//!
//! The replication connection itself lives elsewhere; nothing here performs network I/O.

pub mod assembler;
pub mod pgoutput;

pub use assembler::{
    AssembleError, Assembled, AssemblerConfig, Change, CommittedTxn, TxnAssembler, TxnMessage,
    REMUS_MESSAGE_PREFIX,
};
pub use pgoutput::{
    pg_timestamp_to_system_time, system_time_to_pg_timestamp, Begin, Column, ColumnValue, Commit,
    DecodeError, Delete, Insert, LogicalMessage, Lsn, LsnParseError, OldTuple, Origin,
    PgOutputMessage, PrimaryKeepalive, Relation, ReplicaIdentity, ReplicationMessage,
    StandbyStatusUpdate, Truncate, TupleData, TypeInfo, Update, XLogData, PG_EPOCH_UNIX_SECS,
};
