//! The pg_remus control plane: the `remus-coordinator` service. The local cluster launcher
//! (`remusctl cluster …`) is the `remusctl` crate.
//!
//! - [`node_registry`]: cluster membership kept in etcd.
//! - [`migration`]: each shard migration's persisted state machine (phases, status, progress)
//!   and the per-shard locks, kept in etcd.
//! - [`service`]: the tonic gRPC service the coordinator process serves.
//! - [`plan`]: checking a migration request and resolving co-location, or refusing it.
//! - [`driver`]: running one migration through its phases and handover, or rolling it back.
//! - [`leader`]: leader election among the coordinators of a cluster (etcd lease); a standby
//!   takes over when the leader's lease ends.
//! - [`resume`]: a starting coordinator resumes the migrations its predecessor was running.
//! - [`reconcile`]: the leader clears what a node that was down still holds for a migration
//!   that has ended.
//! - [`propagator`]: the slot's pgoutput stream shipped to the replay worker over gRPC.
//! - [`node_conn`]: conninfo and sessions of the migration machinery on the nodes.
//! - [`failpoint`]: named places where a test can stop a running migration.
//! - [`client`]: small helpers for talking to the coordinator over gRPC.

pub mod client;
pub mod driver;
pub mod failpoint;
pub mod leader;
pub mod migration;
pub mod node_conn;
pub mod node_registry;
pub mod plan;
pub mod propagator;
pub mod reconcile;
pub mod resume;
pub mod service;
