//! `remus.*` settings.

use std::ffi::CString;

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// This node's name in the cluster (n1, n2, …). Routing compares shard owners against it, so it
/// is set per node in postgresql.conf by whoever provisions the node.
pub static NODE_NAME: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// Set by a node that connects to another node: the receiving session executes locally and
/// never forwards again.
pub static FORWARDED: GucSetting<bool> = GucSetting::<bool>::new(false);

pub fn register() {
    GucRegistry::define_bool_guc(
        c"remus.forwarded",
        c"This session was opened by another pg_remus node.",
        c"Set in the connection options of node-to-node connections.",
        &FORWARDED,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"remus.node_name",
        c"Name of this node in the pg_remus cluster.",
        c"Must match the name under which the node was added with remus_add_node().",
        &NODE_NAME,
        GucContext::Userset,
        GucFlags::default(),
    );
}

pub fn node_name() -> Option<String> {
    NODE_NAME
        .get()
        .and_then(|c| c.to_str().ok().map(str::to_string))
        .filter(|s| !s.is_empty())
}
