//! Cleanup phase, node side: the migration's abort count, and clearing everything it left in
//! this node's shared memory.

use pgrx::prelude::*;

use crate::migration::state::{
    recount, require_superuser, Gate, MigrationEntry, PreparedShadow, ShardEntry, Victim, STATE,
};

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::cleanup::*;

    /// Transactions this node counted as aborted by the migration so far.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_aborts(migration_id: i64) -> i64 {
        require_superuser("remus.migration_aborts");
        STATE
            .share()
            .migrations
            .iter()
            .find(|m| m.migration_id == migration_id)
            .map(|m| m.aborts as i64)
            .unwrap_or(0)
    }

    /// Clears everything of the migration on this node; returns its abort count. Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_end(migration_id: i64) -> i64 {
        require_superuser("remus.migration_end");
        crate::migration::handover::albatross::forget(migration_id);
        let mut s = STATE.exclusive();
        let mut aborts = 0;
        for m in s
            .migrations
            .iter_mut()
            .filter(|m| m.migration_id == migration_id)
        {
            aborts += m.aborts as i64;
            *m = MigrationEntry::default();
        }
        for e in s
            .shards
            .iter_mut()
            .filter(|e| e.migration_id == migration_id)
        {
            *e = ShardEntry::default();
        }
        for v in s
            .victims
            .iter_mut()
            .filter(|v| v.migration_id == migration_id)
        {
            *v = Victim::default();
        }
        for p in s
            .prepared_shadows
            .iter_mut()
            .filter(|p| p.migration_id == migration_id)
        {
            *p = PreparedShadow::default();
        }
        if s.gate.migration_id == migration_id {
            s.gate = Gate::default();
        }
        recount(&s);
        crate::migration::durable::sync_after(s, migration_id);
        aborts
    }
}
