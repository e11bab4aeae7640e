//! The integration tests' own fixtures. The cluster harness they run on is
//! `remus_test_support::cluster`; what is here is workload, not harness.

pub mod consistency;
pub mod migrations;
pub mod pgbench;
pub mod protocol;
pub mod recovery;
pub mod roles;
pub mod shards;
pub mod tpcc;
