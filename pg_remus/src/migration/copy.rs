//! Copy phase, node side: the migration's registration. From `remus.migration_begin` until
//! `remus.migration_end` (cleanup), DDL on its shard tables and on their distributed tables
//! fails with 55006, because a shard whose schema changes under the copy and the replay would
//! silently diverge.

use pgrx::prelude::*;

use crate::error::RemusError;
use crate::migration::state::{
    active, exempt, migration_of, recount, require_superuser, MigrationEntry, ShardEntry,
    MAX_MIGRATING_SHARDS, MAX_MIGRATIONS, STATE,
};

/// Before DDL on a relation: `shard_ids` are the shards the relation is (a shard table) or has
/// (a distributed table). Refused while one of them is migrating.
pub(crate) fn check_ddl(table: &str, shard_ids: &[i64]) -> Result<(), RemusError> {
    if !active() || exempt() {
        return Ok(());
    }
    let s = STATE.share();
    for &shard_id in shard_ids {
        if let Some(migration_id) = migration_of(&s, shard_id) {
            return Err(RemusError::TableMigrating {
                table: table.to_string(),
                migration_id,
                shard_id,
            });
        }
    }
    Ok(())
}

/// Before a VACUUM that freezes (FREEZE, or `vacuum_freeze_min_age = 0`): `table` and the shards
/// it is or has, or `None` for the whole database. Refused while one of them (for the whole
/// database: any shard) is registered by a migration here: MOCC on the destination tells a
/// pre-migration row from a destination write by its xmin's commit timestamp and origin, which
/// a frozen version no longer has once the commit-timestamp data is truncated (review F15).
pub(crate) fn check_freeze(table: Option<&str>, shard_ids: &[i64]) -> Result<(), RemusError> {
    if !active() || exempt() {
        return Ok(());
    }
    let s = STATE.share();
    let found = match table {
        Some(_) => shard_ids
            .iter()
            .find_map(|&id| migration_of(&s, id).map(|m| (id, m))),
        None => s
            .shards
            .iter()
            .find(|e| e.migration_id != 0)
            .map(|e| (e.shard_id, e.migration_id)),
    };
    match found {
        Some((shard_id, migration_id)) => Err(RemusError::FreezeDuringMigration {
            what: match table {
                Some(t) => format!("VACUUM FREEZE of {t}"),
                None => "VACUUM FREEZE of the whole database".to_string(),
            },
            migration_id,
            shard_id,
        }),
        None => Ok(()),
    }
}

#[pg_schema]
mod remus {
    use pgrx::prelude::*;

    use crate::migration::copy::*;

    /// Registers a migration's shards on this node (DDL on them is refused until
    /// `migration_end`). Idempotent.
    #[pg_extern(volatile, parallel_unsafe)]
    fn migration_begin(migration_id: i64, shard_ids: Vec<i64>) {
        require_superuser("remus.migration_begin");
        if migration_id <= 0 {
            RemusError::InvalidMigrationId { migration_id }.raise();
        }
        let mut s = STATE.exclusive();
        // Refuse before changing anything.
        if let Some((shard_id, other)) = shard_ids.iter().find_map(|&id| {
            migration_of(&s, id)
                .filter(|&m| m != migration_id)
                .map(|m| (id, m))
        }) {
            drop(s);
            RemusError::ShardAlreadyRegistered {
                shard_id,
                migration_id: other,
            }
            .raise();
        }
        if !s.migrations.iter().any(|m| m.migration_id == migration_id) {
            let Some(slot) = s.migrations.iter_mut().find(|m| m.migration_id == 0) else {
                drop(s);
                RemusError::TooManyMigrations {
                    max: MAX_MIGRATIONS,
                }
                .raise()
            };
            *slot = MigrationEntry {
                migration_id,
                ..MigrationEntry::default()
            };
        }
        for shard_id in shard_ids {
            if migration_of(&s, shard_id).is_some() {
                continue;
            }
            let Some(slot) = s.shards.iter_mut().find(|e| e.migration_id == 0) else {
                drop(s);
                RemusError::TooManyMigratingShards {
                    max: MAX_MIGRATING_SHARDS,
                }
                .raise()
            };
            *slot = ShardEntry {
                migration_id,
                shard_id,
            };
        }
        recount(&s);
        crate::migration::durable::sync_after(s, migration_id);
    }
}
