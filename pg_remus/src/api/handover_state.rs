//! `remus.handover_state()`: what this node's shared memory holds for migrations (registered
//! shards and migrations, marked victims, the gate, prepared shadows, open sync-barrier marks),
//! one row per entry in use, and the durable copy of each migration's state that a restart
//! restores (`migration::durable`, kind `durable`; a migration put back from it at this start
//! says `restored true`). Read-only; for tests and operators checking that a migration that
//! ended (succeeded or rolled back, also across crashes) left nothing behind on the node.

use pgrx::prelude::*;

use crate::migration::durable;
use crate::migration::state::{require_superuser, STATE};

/// One entry in use: (kind, migration id, what else the entry holds).
type Entry = (String, i64, String);

fn entries() -> Vec<Entry> {
    let s = STATE.share();
    let mut out = Vec::new();
    for e in s.shards.iter().filter(|e| e.migration_id != 0) {
        out.push((
            "shard".into(),
            e.migration_id,
            format!("shard {}", e.shard_id),
        ));
    }
    for m in s.migrations.iter().filter(|m| m.migration_id != 0) {
        out.push((
            "migration".into(),
            m.migration_id,
            format!(
                "fenced {} capture {} sync {} aborts {} endpoint '{}' drain_source {:?} restored {}",
                m.fenced,
                m.capture,
                m.sync,
                m.aborts,
                m.endpoint(),
                m.drain_source(),
                m.restored
            ),
        ));
    }
    for v in s.victims.iter().filter(|v| v.migration_id != 0) {
        out.push((
            "victim".into(),
            v.migration_id,
            format!("pid {} lxid {} stray {}", v.pid, v.lxid, v.stray),
        ));
    }
    if s.gate.migration_id != 0 {
        out.push(("gate".into(), s.gate.migration_id, String::new()));
    }
    for p in s.prepared_shadows.iter().filter(|p| p.migration_id != 0) {
        out.push((
            "prepared_shadow".into(),
            p.migration_id,
            format!("xid {}", p.xid),
        ));
    }
    drop(s);
    for saved in durable::saved() {
        out.push(match saved {
            Ok(d) => (
                "durable".into(),
                d.migration_id,
                format!(
                    "shards {:?} fenced {} capture {} sync {} endpoint '{}' drain_source {:?}",
                    d.shards, d.fenced, d.capture, d.sync, d.endpoint, d.drain_source
                ),
            ),
            // Shown, not hidden: a file a restart cannot use is something to look at.
            Err((file, why)) => ("durable".into(), 0, format!("{file}: {why}")),
        });
    }
    let s = STATE.share();
    for (procno, mark) in s.async_commit.iter().enumerate().filter(|(_, m)| **m != 0) {
        // A mark belongs to a backend, not a migration: 0 in the id column.
        out.push((
            "async_commit".into(),
            0,
            format!("pgprocno {procno} mark {mark}"),
        ));
    }
    out
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    /// Every shared-memory entry of the migration machinery in use on this node.
    #[pg_extern(volatile, parallel_unsafe)]
    #[allow(clippy::type_complexity)] // pgrx reads the column names from the signature
    fn handover_state() -> TableIterator<
        'static,
        (
            name!(kind, String),
            name!(migration_id, i64),
            name!(detail, String),
        ),
    > {
        super::require_superuser("remus.handover_state");
        TableIterator::new(super::entries())
    }
}
