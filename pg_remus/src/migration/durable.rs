//! The durable copy of what this node enforces for each running migration (issue 15
//! requirement 3; design note `docs/design/notes/0001-migration-state-across-node-restarts.md`).
//!
//! Every node-side function the coordinator calls to change a migration's enforcement state
//! (`remus.migration_begin`, `migration_capture`, `sync_barrier`, `migration_fence`,
//! `migration_drain_source`, `migration_end`) ends with [`sync_after`] / [`sync`]: the
//! migration's entry in shared memory (its shards, capture and the validating replay worker,
//! sync mode, the write fence, the drain source) is written to one file per migration under
//! `$PGDATA/pg_remus/migrations/`, or the file is removed once the entry is gone.
//!
//! Why files and not a catalog table: the shared memory the file mirrors is not transactional
//! (a change holds from the call on, whatever the caller's transaction does next), and neither
//! is the file; a table row would be, and `migration_drain_source` runs inside the transaction
//! the coordinator PREPAREs as Tm, so the row would stay invisible (and locked) while Tm is in
//! doubt, exactly when a restart needs it. A file can also be read where no transaction exists:
//! in the postmaster, while it creates shared memory.
//!
//! Restore: [`restored`] is the value shared memory is created with (`pg_shmem_init!` in
//! [`init_shmem`]), so it runs in the postmaster on every start and on every
//! crash-restart's re-initialisation, before the startup process and before any backend
//! exists: no client statement can ever see the node without its migrations. The entries come
//! back marked `restored`, so `handover::restart` still treats their shards as having lost
//! their stream and read-through (its F4 rule stays in force for them).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use pgrx::lwlock::PgLwLockExclusiveGuard;
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PgLwLock};

use crate::error::RemusError;
use crate::migration::state::{
    HandoverState, MigrationEntry, ShardEntry, ACTIVE, ENDPOINT_BYTES, MAX_MIGRATING_SHARDS,
    MAX_MIGRATIONS, NODE_NAME_BYTES, STATE,
};

/// Relative to the data directory, the working directory of the postmaster and its children.
const DIR: &str = "pg_remus/migrations";
/// The `format` of a state file; a file with another (or none) is not restored (and logged).
/// A JSON document through serde rather than a format of our own: nothing to parse by hand,
/// and a field added later is a field, not a new line syntax.
const FORMAT: u32 = 2;

/// What a state file holds.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    format: u32,
    migration: Saved,
}

/// Serialises the writers of the files (lock order: this one, then `STATE`), so the last file
/// written for a migration reflects its latest entry. Its value is unused.
// SAFETY: set up by `init_shmem` (pg_shmem_init!) while the library is preloaded, before any
// backend takes the lock.
static FILE_LOCK: PgLwLock<u64> = unsafe { PgLwLock::new(c"remus_durable_state_files") };

/// Reserves the handover state (`state::STATE` and its counter), created in the postmaster at
/// start and at every crash-restart's re-initialisation with the migrations whose files
/// survive, before any backend runs; and the lock of the files. The state is initialised here,
/// not in `state`, so that `state` does not depend on its durable copy.
pub(crate) fn init_shmem() {
    pg_shmem_init!(STATE = restored());
    // After STATE (hooks registered earlier run first): `restored()` counted the migrations.
    pg_shmem_init!(ACTIVE = AtomicU32::new(restored_count()));
    pg_shmem_init!(FILE_LOCK);
}

/// One migration's durable state.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Saved {
    pub(crate) migration_id: i64,
    pub(crate) shards: Vec<i64>,
    pub(crate) capture: bool,
    pub(crate) sync: bool,
    pub(crate) fenced: bool,
    pub(crate) endpoint: String,
    pub(crate) drain_source: Option<String>,
}

impl Saved {
    fn of(s: &HandoverState, migration_id: i64) -> Option<Saved> {
        let m = s
            .migrations
            .iter()
            .find(|m| m.migration_id == migration_id)?;
        Some(Saved {
            migration_id,
            shards: s
                .shards
                .iter()
                .filter(|e| e.migration_id == migration_id)
                .map(|e| e.shard_id)
                .collect(),
            capture: m.capture,
            sync: m.sync,
            fenced: m.fenced,
            endpoint: m.endpoint(),
            drain_source: m.drain_source(),
        })
    }

    fn render(&self) -> String {
        let file = StateFile {
            format: FORMAT,
            migration: self.clone(),
        };
        // Plain data (integers, booleans, strings): serialising it cannot fail.
        serde_json::to_string_pretty(&file).unwrap_or_default() + "\n"
    }

    fn parse(text: &str) -> Result<Saved, String> {
        let file: StateFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if file.format != FORMAT {
            return Err(format!("unknown format {}", file.format));
        }
        let saved = file.migration;
        if saved.migration_id <= 0 {
            return Err("no migration id".into());
        }
        // They go into fixed-size shared-memory fields (with a NUL).
        if saved.endpoint.len() >= ENDPOINT_BYTES {
            return Err("endpoint too long".into());
        }
        if saved
            .drain_source
            .as_ref()
            .is_some_and(|d| d.is_empty() || d.len() >= NODE_NAME_BYTES)
        {
            return Err("bad drain source".into());
        }
        Ok(saved)
    }

    /// The shared-memory entry this state restores.
    fn entry(&self) -> MigrationEntry {
        let mut m = MigrationEntry {
            migration_id: self.migration_id,
            fenced: self.fenced,
            capture: self.capture,
            sync: self.sync,
            restored: true,
            ..MigrationEntry::default()
        };
        m.endpoint[..self.endpoint.len()].copy_from_slice(self.endpoint.as_bytes());
        if let Some(d) = &self.drain_source {
            m.drain_source[..d.len()].copy_from_slice(d.as_bytes());
        }
        m
    }
}

fn file_of(migration_id: i64) -> PathBuf {
    Path::new(DIR).join(migration_id.to_string())
}

/// fsyncs a directory, so a file created, renamed or removed in it survives a crash.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// Writes `saved` as its migration's file: a temporary file, fsynced, renamed over the old one.
fn write(saved: &Saved) -> std::io::Result<()> {
    let dir = Path::new(DIR);
    if !dir.is_dir() {
        fs::create_dir_all(dir)?;
        sync_dir(Path::new("pg_remus"))?;
        sync_dir(Path::new("."))?;
    }
    let path = file_of(saved.migration_id);
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(saved.render().as_bytes())?;
        f.sync_all()?;
    }
    fs::rename(&tmp, &path)?;
    sync_dir(dir)
}

fn remove(migration_id: i64) -> std::io::Result<()> {
    match fs::remove_file(file_of(migration_id)) {
        Ok(()) => sync_dir(Path::new(DIR)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// After a change of migration `migration_id`'s entry in shared memory (by the calling SQL
/// function, its lock released): writes the entry to its file, or removes the file when the
/// entry is gone. A file that cannot be written fails the call (58030), so the coordinator
/// never goes on with state that would not survive a restart.
pub(crate) fn sync(migration_id: i64) {
    let result = {
        let _files = FILE_LOCK.exclusive();
        let saved = Saved::of(&STATE.share(), migration_id);
        match saved {
            Some(saved) => write(&saved),
            None => remove(migration_id),
        }
    };
    if let Err(e) = result {
        RemusError::DurableState {
            migration_id,
            path: format!("{DIR}/{migration_id}"),
            message: e.to_string(),
        }
        .raise();
    }
}

/// [`sync`] for a caller still holding the state lock: releases it first (a writer takes the
/// file lock before the state lock).
pub(crate) fn sync_after(guard: PgLwLockExclusiveGuard<'_, HandoverState>, migration_id: i64) {
    drop(guard);
    sync(migration_id);
}

/// The state files found now (for `remus.handover_state()`).
pub(crate) fn saved() -> Vec<Result<Saved, (String, String)>> {
    let Ok(dir) = fs::read_dir(DIR) else {
        return Vec::new();
    };
    let mut out: Vec<_> = dir
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_none())
        .map(|p| {
            let name = p.display().to_string();
            fs::read_to_string(&p)
                .map_err(|e| e.to_string())
                .and_then(|t| Saved::parse(&t))
                .map_err(|why| (name, why))
        })
        .collect();
    out.sort_by_key(|r| r.as_ref().map(|s| s.migration_id).unwrap_or(0));
    out
}

/// One line on stderr; a closed stderr is not an error worth dying for in the postmaster.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Migrations restored by [`restored`] in this process, for
/// the "anything registered?" word created right after it.
static RESTORED: AtomicU32 = AtomicU32::new(0);

/// How many migrations [`restored`] put back (the initial value of `state`'s active word).
pub(crate) fn restored_count() -> u32 {
    RESTORED.load(Ordering::Relaxed)
}

/// The shared-memory state a (re)start begins with: every migration whose file survives,
/// marked restored. Runs in the postmaster: never raises (a file it cannot use is reported and
/// left for `remus.handover_state()` to show, or removed if it is a torn temporary one).
///
/// It reports on stderr (the server log: `pg_ctl -l`'s file, or the logging collector after a
/// crash-restart), not through `ereport`: this runs while the handover state is being created,
/// and the extension's `emit_log_hook` reads that state, so an `ereport` from here would
/// re-enter it before it exists.
pub(crate) fn restored() -> HandoverState {
    let mut s = HandoverState::default();
    let mut n = 0u32;
    if let Ok(dir) = fs::read_dir(DIR) {
        for p in dir.filter_map(|e| e.ok()).map(|e| e.path()) {
            if p.extension().is_some_and(|e| e == "tmp") {
                // A write that a crash interrupted before its rename: the old file (if any)
                // still holds the state as it was.
                let _ = fs::remove_file(&p);
                continue;
            }
            let parsed = fs::read_to_string(&p)
                .map_err(|e| e.to_string())
                .and_then(|t| Saved::parse(&t));
            let saved = match parsed {
                Ok(saved) => saved,
                Err(why) => {
                    report(&format!(
                        "WARNING:  pg_remus: migration state file {} not restored: {why}",
                        p.display()
                    ));
                    continue;
                }
            };
            let Some(slot) = s.migrations.iter_mut().find(|m| m.migration_id == 0) else {
                report(&format!(
                    "WARNING:  pg_remus: more than {MAX_MIGRATIONS} migration state files; {} not restored",
                    p.display()
                ));
                continue;
            };
            *slot = saved.entry();
            n += 1;
            for &shard_id in &saved.shards {
                match s.shards.iter_mut().find(|e| e.migration_id == 0) {
                    Some(e) => {
                        *e = ShardEntry {
                            migration_id: saved.migration_id,
                            shard_id,
                        }
                    }
                    None => report(&format!(
                        "WARNING:  pg_remus: more than {MAX_MIGRATING_SHARDS} migrating shards; shard {shard_id} of migration {} not restored",
                        saved.migration_id
                    )),
                }
            }
            report(&format!(
                "LOG:  pg_remus: restored migration {}'s state on this node: shards {:?} capture {} sync {} fenced {} drain_source {:?}",
                saved.migration_id,
                saved.shards,
                saved.capture,
                saved.sync,
                saved.fenced,
                saved.drain_source
            ));
        }
    }
    RESTORED.store(n, Ordering::Relaxed);
    s
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    use super::Saved;

    #[pg_test]
    fn a_state_file_reads_back_as_written() {
        let s = Saved {
            migration_id: 42,
            shards: vec![7, 9],
            capture: true,
            sync: true,
            fenced: false,
            endpoint: "http://127.0.0.1:16104".into(),
            drain_source: Some("n1".into()),
        };
        assert_eq!(Saved::parse(&s.render()), Ok(s.clone()));
        let bare = Saved {
            migration_id: 3,
            ..Saved::default()
        };
        assert_eq!(Saved::parse(&bare.render()), Ok(bare));
        assert!(Saved::parse("something else\nmigration 3\n").is_err());
        assert!(
            Saved::parse(&s.render().replace("\"sync\": true", "\"sync\": \"maybe\"")).is_err()
        );
        assert!(Saved::parse(&s.render().replace("\"format\": 2", "\"format\": 1")).is_err());
        assert!(
            Saved::parse(&s.render().replace("\"shards\"", "\"more\": 1, \"shards\"")).is_err()
        );
    }

    fn saved_of(migration_id: i64) -> Option<Saved> {
        super::saved()
            .into_iter()
            .filter_map(Result::ok)
            .find(|s| s.migration_id == migration_id)
    }

    /// Each call the coordinator makes leaves the migration's whole entry on disk, what a start
    /// would restore is that entry (marked restored), and the end removes the file.
    #[pg_test]
    fn the_calls_keep_the_file_a_start_restores_it_and_the_end_removes_it() {
        Spi::run("SELECT remus.migration_begin(9301, ARRAY[930101, 930102])").unwrap();
        assert_eq!(
            saved_of(9301).map(|s| (s.shards, s.capture)),
            Some((vec![930101, 930102], false))
        );
        Spi::run("SELECT remus.migration_capture(9301, 'http://127.0.0.1:1')").unwrap();
        Spi::run("SELECT remus.sync_barrier(9301)").unwrap();
        Spi::run("SELECT remus.migration_fence(9301)").unwrap();
        Spi::run("SELECT remus.migration_drain_source(9301, 'n1')").unwrap();
        let expected = Saved {
            migration_id: 9301,
            shards: vec![930101, 930102],
            capture: true,
            sync: true,
            fenced: true,
            endpoint: "http://127.0.0.1:1".into(),
            drain_source: Some("n1".into()),
        };
        assert_eq!(saved_of(9301), Some(expected.clone()));
        let fresh = super::restored();
        let m = fresh
            .migrations
            .iter()
            .find(|m| m.migration_id == 9301)
            .expect("restored");
        assert!(m.restored && m.capture && m.sync && m.fenced);
        assert_eq!(m.endpoint(), expected.endpoint);
        assert_eq!(m.drain_source(), expected.drain_source);
        let mut shards: Vec<i64> = fresh
            .shards
            .iter()
            .filter(|e| e.migration_id == 9301)
            .map(|e| e.shard_id)
            .collect();
        shards.sort_unstable();
        assert_eq!(shards, expected.shards);
        Spi::run("SELECT remus.migration_end(9301)").unwrap();
        assert_eq!(saved_of(9301), None);
    }
}
