//! The cluster as this node sees it: its members, connections to them, and the wire formats
//! shared with them.
//!
//! - [`forwarded_role`]: the role a node-to-node session runs its transactions as.
//! - [`nodes`]: membership in this node's catalog (`remus.nodes`).
//! - [`remote`]: libpq connections from this backend to other nodes, interruptible waits.
//! - [`rpc`]: the backend's gRPC runtime (coordinator, replay workers).
//! - [`shard_marker`]: the `/*remus:shard=N*/` statement marker nodes send each other.

pub(crate) mod forwarded_role;
pub(crate) mod nodes;
pub(crate) mod remote;
pub(crate) mod rpc;
pub(crate) mod shard_marker;
