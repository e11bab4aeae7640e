//! Wire protocol between `remusctl`, the coordinator and the per-node migration agents.
//!
//! Kept in its own crate so that every component compiles against one generated copy of the
//! messages and a protocol change is a single, reviewable diff to `proto/remus.proto`.

pub mod v1 {
    tonic::include_proto!("remus.v1");
}
