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
//! - [`assembler`] turns that message stream into [`CommittedTxn`]s, bounded in memory;
//! - [`ship`] converts a [`CommittedTxn`] into the `ShadowTxn` message the replay worker applies.
//!
//! Network I/O is in two modules on top of libpq (the only code that talks to it, and the only
//! `unsafe` code of the crate, is the private `libpq` module):
//!
//! - [`replication`]: the walsender connection: slot with exported snapshot, `START_REPLICATION`
//!   and the status updates that advance the slot;
//! - [`snapshot_copy`]: the parallel binary COPY of the shard tables as of that snapshot.
//!
//! Both block the calling thread, but every wait has a timeout and can be cancelled from another
//! thread with a [`CancelToken`].

#![deny(unsafe_code)]

pub mod assembler;
#[allow(unsafe_code)]
mod libpq;
pub mod pgoutput;
pub mod replication;
mod session;
pub mod ship;
pub mod snapshot_copy;

pub use assembler::{
    AssembleError, Assembled, AssemblerConfig, Change, CommittedTxn, TxnAssembler, TxnMessage,
};
pub use pgoutput::{
    pg_timestamp_to_system_time, system_time_to_pg_timestamp, Begin, Column, ColumnValue, Commit,
    DecodeError, Delete, Insert, LogicalMessage, Lsn, LsnParseError, OldTuple, Origin,
    PgOutputMessage, PrimaryKeepalive, Relation, ReplicaIdentity, ReplicationMessage,
    StandbyStatusUpdate, Truncate, TupleData, TypeInfo, Update, XLogData, PG_EPOCH_UNIX_SECS,
};
pub use replication::{
    CreatedSlot, ExportedSnapshot, ReplicationConnection, ReplicationError, ReplicationOptions,
    ReplicationStream, SystemIdentity,
};
pub use session::{CancelToken, PgError, ServerError};
pub use ship::shadow_txn;
pub use snapshot_copy::{
    copy_tables, copy_tables_with, qualified_name, CopyError, CopyOptions, CopyProgress, CopyStats,
    TableCopyError,
};
