//! The user-facing `remus_*` SQL functions and views that compose features from the layers
//! below (the SQL functions of one feature, such as `remus_create_distributed_table` or the
//! migration primitives in schema `remus`, live with that feature).
//!
//! - [`nodes`]: `remus_add_node`, `remus_remove_node`, `remus_local_node`, `remus_run_on_node`,
//!   the `remus_nodes` view.
//! - [`shards`]: the `remus_shards` view and `remus_shard_size`.
//! - [`migrate`]: `remus_migrate_shard(s)` and the `remus_migrations` view.
//! - [`handover_state`]: `remus.handover_state()`, the migration entries in shared memory.
//! - [`privileges`]: who may call what (every GRANT and REVOKE, and the `remus_admin` role).

mod handover_state;
mod migrate;
mod nodes;
mod privileges;
mod shards;
