//! `remusctl`: the operator's and developer's command line of pg_remus, and the local cluster
//! launcher behind `remusctl cluster …`. Kept apart from the `coordinator` crate, which is the
//! control plane service only; remusctl talks to it over gRPC like any client.
//!
//! - [`cluster`]: `remusctl cluster …`, a real multi-node cluster of PostgreSQL 15 servers,
//!   etcd, the replay worker and the coordinator on loopback, for development, tests and the
//!   demo.
//! - [`process`]: starting, probing and stopping the daemons that `cluster` owns.

pub mod cluster;
pub mod process;
