//! What the pg_remus components agree on: the gRPC protocol, the names that cross the wire, and
//! the SQLSTATEs they raise or pass on.
//!
//! Used by the extension (`pg_remus`, which calls the coordinator and the replay worker from its
//! SQL functions and commit path), the coordinator (which serves `remus.v1.Coordinator` and
//! drives migrations), `remusctl` and the replay worker (which serves `remus.v1.ReplayWorker`).
//! Kept in its own crate so that every component compiles against one generated copy of the
//! messages and a protocol change is a single, reviewable diff to `proto/remus.proto`. It is
//! linked into the extension, so it stays dependency-light.

pub mod names;
pub mod sqlstate;

pub use sqlstate::SqlState;

/// The messages' encoding (`encoded_len`), for callers that size what they send.
pub use prost::Message;

pub mod v1 {
    tonic::include_proto!("remus.v1");
}
