//! The persisted state machine of every shard migration, kept in etcd.
//!
//! Key layout (all values are written only by [`MigrationStore`]):
//!
//! | key                                         | value                                          |
//! |---------------------------------------------|------------------------------------------------|
//! | `/remus/<cluster>/migration_seq`            | the last allocated [`MigrationId`], decimal    |
//! | `/remus/<cluster>/migrations/<id>`          | [`MigrationRecord`] as JSON                    |
//! | `/remus/<cluster>/shard_locks/<shard_id>`   | id of the running migration owning the shard   |
//!
//! A shard lock exists exactly while the migration it names is running: [`MigrationStore::create`]
//! writes the record and all its locks in one etcd transaction, and every step that makes a record
//! terminal ([`MigrationStore::finish`], or [`MigrationStore::advance`] to [`Phase::Done`]) deletes
//! them in the same transaction that writes the terminal record. Every change to a record is a
//! compare-and-swap on its `mod_revision`, so two coordinator replicas driving the same migration
//! can never both apply one step, and no update is lost.
//!
//! Phases follow [`Phase::can_advance_to`]: Remus runs
//! `Pending → Copy → Catchup → Barrier → Dual → Handover → Cleanup → Done`; the baselines
//! ([`Mode::LockAbort`], [`Mode::WaitRemaster`]) skip `Barrier` and `Dual`
//! (`Catchup → Handover`); [`Mode::Squall`] also skips `Catchup` (`Copy → Handover`) and pulls
//! the data in `Cleanup`. A running migration may fail from any phase; it then keeps the phase it
//! failed in and takes status [`Status::Failed`] or [`Status::RolledBack`]. A record whose status
//! is not [`Status::Running`] is terminal and never changes again.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};

use crate::node_registry::is_valid_node_name;

/// How many lost compare-and-swap races one store call tolerates before it reports
/// [`MigrationError::Contention`]. Only coordinator replicas and a migration's own driver write a
/// record, so a handful of writers at most compete; 32 lost races in a row means something is
/// spinning on the record and deserves an error rather than an unbounded loop.
pub const MAX_CAS_ATTEMPTS: u32 = 32;

/// Upper bound on the shards of one migration. etcd refuses transactions with more than
/// `--max-txn-ops` (default 128) compares or operations, and [`MigrationStore::create`] needs one
/// compare and one put per shard plus two for the counter and the record.
pub const MAX_SHARDS_PER_MIGRATION: usize = 100;

/// Identifies a migration within a cluster.
///
/// A `u64` allocated from the etcd counter `/remus/<cluster>/migration_seq`, not a string (UUID or
/// name): it is short enough to type in `remusctl` and maps onto a `bigint` column of the
/// `remus_migrations` view; ids increase with creation time, so "sorted by id" is "in the order
/// they were started"; and the counter is bumped in the very transaction that writes the record
/// and its shard locks (compare-and-swap on the counter's `mod_revision`), so a refused create
/// (shard busy) consumes no id and ids have no gaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MigrationId(pub u64);

impl fmt::Display for MigrationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for MigrationId {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        s.parse::<u64>().map(MigrationId).map_err(|_| ParseError {
            what: "migration id",
            value: s.to_string(),
            expected: &["a non-negative integer"],
        })
    }
}

/// A string that names no variant of one of this module's enums.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?} (expected {})", expected.join(" | "))]
pub struct ParseError {
    pub what: &'static str,
    pub value: String,
    pub expected: &'static [&'static str],
}

/// An enum whose variants have one stable lowercase name, used in JSON, gRPC, the CLI and SQL.
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $name:ident, $what:literal {
            $( $(#[$vmeta:meta])* $variant:ident => $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text)] $variant ),+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = ParseError;
            fn from_str(s: &str) -> Result<Self, ParseError> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(ParseError {
                        what: $what,
                        value: s.to_string(),
                        expected: &[$($text),+],
                    }),
                }
            }
        }
    };
}

named_enum! {
    /// How the ownership of the shards moves from source to target.
    Mode, "migration mode" {
        /// The paper's protocol: barrier, dual execution, then handover without aborts.
        Remus => "remus",
        /// Baseline: lock the shards, abort the transactions in the way, switch ownership.
        LockAbort => "lock_abort",
        /// Baseline: stop new transactions on the shards, wait for running ones to finish.
        WaitRemaster => "wait_remaster",
        /// Seed baseline (Squall, seed 000): ownership moves first, the target pulls the data
        /// in chunks, on demand and in the background (issue 19).
        Squall => "squall",
        /// Seed baseline (ElasTraS's Albatross, seed 003): iterative copy, then a short
        /// handover that suspends the shards' new transactions (issue 19).
        Albatross => "albatross",
    }
}

named_enum! {
    /// Where a migration is. Declaration order is pipeline order.
    Phase, "migration phase" {
        /// Created, shard locks held, no work started.
        Pending => "pending",
        /// Snapshot copy of the shards to the target.
        Copy => "copy",
        /// Logical replication replay until the target is close behind the source.
        Catchup => "catchup",
        /// Remus only: the barrier that starts dual execution.
        Barrier => "barrier",
        /// Remus only: transactions run on both source and target.
        Dual => "dual",
        /// Ownership switches to the target.
        Handover => "handover",
        /// Dropping the source's copy, slots and publications.
        Cleanup => "cleanup",
        /// Finished successfully; status is then [`Status::Succeeded`].
        Done => "done",
    }
}

named_enum! {
    /// Whether a migration is still running and, if not, how it ended.
    Status, "migration status" {
        Running => "running",
        Succeeded => "succeeded",
        Failed => "failed",
        /// Failed, and the source was verified to own the shards again.
        RolledBack => "rolled_back",
    }
}

const REMUS_PATH: &[Phase] = &[
    Phase::Pending,
    Phase::Copy,
    Phase::Catchup,
    Phase::Barrier,
    Phase::Dual,
    Phase::Handover,
    Phase::Cleanup,
    Phase::Done,
];

const BASELINE_PATH: &[Phase] = &[
    Phase::Pending,
    Phase::Copy,
    Phase::Catchup,
    Phase::Handover,
    Phase::Cleanup,
    Phase::Done,
];

/// squall: ownership first (`handover`), then the pull (`cleanup`); `copy` only creates the
/// target's empty tables and plans the chunks; there is no catch-up.
const SQUALL_PATH: &[Phase] = &[
    Phase::Pending,
    Phase::Copy,
    Phase::Handover,
    Phase::Cleanup,
    Phase::Done,
];

impl Phase {
    /// The phases a migration in `mode` passes through, in order.
    pub fn path(mode: Mode) -> &'static [Phase] {
        match mode {
            Mode::Remus => REMUS_PATH,
            Mode::Squall => SQUALL_PATH,
            Mode::LockAbort | Mode::WaitRemaster | Mode::Albatross => BASELINE_PATH,
        }
    }

    /// The phase after `self` in `mode`; `None` after `Done` or for a phase `mode` never visits.
    pub fn next(self, mode: Mode) -> Option<Phase> {
        let path = Phase::path(mode);
        let i = path.iter().position(|p| *p == self)?;
        path.get(i + 1).copied()
    }

    /// The one legal forward step: `next` must directly follow `self` on `mode`'s path. Failing is
    /// not a phase change (see [`MigrationStore::finish`]), so it is not covered here.
    pub fn can_advance_to(self, next: Phase, mode: Mode) -> bool {
        self.next(mode) == Some(next)
    }
}

impl Status {
    /// Terminal records never change again.
    pub fn is_terminal(self) -> bool {
        self != Status::Running
    }
}

/// One migration as stored in etcd (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationRecord {
    pub id: MigrationId,
    /// Sorted, distinct, positive.
    pub shard_ids: Vec<i64>,
    /// Node names as in the node registry.
    pub source: String,
    pub target: String,
    pub mode: Mode,
    pub phase: Phase,
    pub status: Status,
    pub rows_copied: u64,
    pub bytes_copied: u64,
    pub txns_replayed: u64,
    /// Client transactions the migration aborted (the cost the baselines pay and Remus avoids).
    pub aborted_by_migration: u64,
    /// Milliseconds spent in each phase that has ended, keyed by [`Phase::as_str`]; includes the
    /// phase a migration failed in.
    #[serde(default)]
    pub phase_ms: BTreeMap<String, u64>,
    /// Wall clock, milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// When the current phase began (same clock); what `phase_ms` is computed from.
    pub phase_started_at_ms: u64,
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
    #[serde(default)]
    pub error: Option<String>,
    /// What the current phase is blocked on, e.g. "slot creation waits for xid 1234". Cleared on
    /// every phase change and on success; kept on failure as a diagnostic.
    #[serde(default)]
    pub waiting_on: Option<String>,
    /// Rates and lag measured during copy and catch-up (decision 0022); a progress field.
    #[serde(default)]
    pub rates: Rates,
    /// Milliseconds the moved shards' new transactions could not be served during the handover
    /// (albatross: suspended, decision 0024); `None` where the mode does not measure it. A
    /// progress field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable_ms: Option<u64>,
}

/// What the driver measured of a migration's copy and catch-up (decision 0022): `None` until
/// measured; kept after the phase that measured them, so a finished record shows the last
/// values. Units as in the proto's `Migration` (bytes, bytes/s, transactions/s, milliseconds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rates {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_total_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_bytes_per_sec: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_wal_bytes_per_sec: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_bytes_per_sec: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_txns_per_sec: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_ms: Option<u64>,
}

impl MigrationRecord {
    pub fn is_terminal(&self) -> bool {
        self.status.is_terminal()
    }

    /// Wall time from start to finish, or to `now_ms` while running.
    pub fn total_ms(&self, now_ms: u64) -> u64 {
        self.finished_at_ms
            .unwrap_or(now_ms)
            .saturating_sub(self.started_at_ms)
    }

    /// Ends the current phase: records its duration and starts `next` at `now`.
    fn enter_phase(&mut self, next: Phase, now: u64) {
        self.phase_ms.insert(
            self.phase.as_str().to_string(),
            now.saturating_sub(self.phase_started_at_ms),
        );
        self.phase = next;
        self.phase_started_at_ms = now;
        self.waiting_on = None;
    }

    /// The fields a caller's update function may change; everything else is the store's.
    fn with_progress_of(&self, other: &MigrationRecord) -> MigrationRecord {
        MigrationRecord {
            rows_copied: other.rows_copied,
            bytes_copied: other.bytes_copied,
            txns_replayed: other.txns_replayed,
            aborted_by_migration: other.aborted_by_migration,
            waiting_on: other.waiting_on.clone(),
            rates: other.rates.clone(),
            unavailable_ms: other.unavailable_ms,
            ..self.clone()
        }
    }
}

/// A change requested of a record, as reported by [`MigrationError::IllegalTransition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Advance(Phase),
    Finish(Status),
    /// A progress update within the current phase.
    Update,
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transition::Advance(p) => write!(f, "advancing to phase {p}"),
            Transition::Finish(s) => write!(f, "finishing with status {s}"),
            Transition::Update => f.write_str("updating progress"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("corrupt migration record at {key}: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("corrupt value at {key}: {detail}")]
    CorruptValue { key: String, detail: String },
    #[error("cannot encode migration {id}: {source}")]
    Encode {
        id: MigrationId,
        #[source]
        source: serde_json::Error,
    },
    #[error("migration {0} not found")]
    NotFound(MigrationId),
    #[error("shard {shard_id} is already being migrated by migration {migration}")]
    ShardBusy {
        shard_id: i64,
        migration: MigrationId,
    },
    #[error(
        "migration {id} (mode {mode}, phase {phase}, status {status}): {requested} is not allowed"
    )]
    IllegalTransition {
        id: MigrationId,
        mode: Mode,
        phase: Phase,
        status: Status,
        requested: Transition,
    },
    #[error("{what}: gave up after {attempts} lost compare-and-swap races")]
    Contention { what: String, attempts: u32 },
    #[error("invalid migration request: {0}")]
    Invalid(String),
}

/// Reads and writes migration records and shard locks of one cluster in etcd.
#[derive(Clone)]
pub struct MigrationStore {
    client: Client,
    /// `/remus/<cluster>/`
    root: String,
}

impl MigrationStore {
    pub fn new(client: Client, cluster: &str) -> Self {
        Self {
            client,
            root: format!("/remus/{cluster}/"),
        }
    }

    pub fn seq_key(&self) -> String {
        format!("{}migration_seq", self.root)
    }

    pub fn records_prefix(&self) -> String {
        format!("{}migrations/", self.root)
    }

    pub fn record_key(&self, id: MigrationId) -> String {
        format!("{}migrations/{id}", self.root)
    }

    pub fn lock_key(&self, shard_id: i64) -> String {
        format!("{}shard_locks/{shard_id}", self.root)
    }

    /// Allocates an id and writes a `Pending`/`Running` record plus one lock per shard, all in one
    /// etcd transaction. Refused with [`MigrationError::ShardBusy`] (naming the lowest busy shard)
    /// when any shard is locked; then nothing is written and no id is consumed.
    pub async fn create(
        &self,
        shard_ids: &[i64],
        source: &str,
        target: &str,
        mode: Mode,
    ) -> Result<MigrationRecord, MigrationError> {
        let shard_ids = validate_create(shard_ids, source, target)?;
        let seq_key = self.seq_key();
        let lock_keys: Vec<String> = shard_ids.iter().map(|s| self.lock_key(*s)).collect();
        for attempt in 1..=MAX_CAS_ATTEMPTS {
            let resp = self.client.kv_client().get(seq_key.clone(), None).await?;
            let (last, seq_rev) = match resp.kvs().first() {
                Some(kv) => (parse_id(kv)?.0, kv.mod_revision()),
                None => (0, 0),
            };
            let id =
                MigrationId(
                    last.checked_add(1)
                        .ok_or_else(|| MigrationError::CorruptValue {
                            key: seq_key.clone(),
                            detail: "migration id counter is exhausted".into(),
                        })?,
                );
            let now = now_ms();
            let record = MigrationRecord {
                id,
                shard_ids: shard_ids.clone(),
                source: source.to_string(),
                target: target.to_string(),
                mode,
                phase: Phase::Pending,
                status: Status::Running,
                rows_copied: 0,
                bytes_copied: 0,
                txns_replayed: 0,
                aborted_by_migration: 0,
                phase_ms: BTreeMap::new(),
                started_at_ms: now,
                phase_started_at_ms: now,
                finished_at_ms: None,
                error: None,
                waiting_on: None,
                rates: Rates::default(),
                unavailable_ms: None,
            };
            let value = encode(&record)?;
            let record_key = self.record_key(id);

            // Absent keys have mod_revision 0, so one compare covers "no counter yet" too.
            let mut compares = vec![
                Compare::mod_revision(seq_key.clone(), CompareOp::Equal, seq_rev),
                Compare::version(record_key.clone(), CompareOp::Equal, 0),
            ];
            compares.extend(
                lock_keys
                    .iter()
                    .map(|k| Compare::version(k.clone(), CompareOp::Equal, 0)),
            );
            let mut puts = vec![
                TxnOp::put(seq_key.clone(), id.to_string(), None),
                TxnOp::put(record_key.clone(), value, None),
            ];
            puts.extend(
                lock_keys
                    .iter()
                    .map(|k| TxnOp::put(k.clone(), id.to_string(), None)),
            );
            let mut reads: Vec<TxnOp> = lock_keys
                .iter()
                .map(|k| TxnOp::get(k.clone(), None))
                .collect();
            reads.push(TxnOp::get(record_key.clone(), None));
            reads.push(TxnOp::get(seq_key.clone(), None));
            let txn = Txn::new().when(compares).and_then(puts).or_else(reads);
            let resp = self.client.kv_client().txn(txn).await?;
            if resp.succeeded() {
                tracing::info!(%id, shards = ?record.shard_ids, source, target, %mode, "migration created");
                return Ok(record);
            }

            let gets: Vec<Option<KeyValue>> = resp
                .op_responses()
                .into_iter()
                .map(|op| match op {
                    TxnOpResponse::Get(g) => g.kvs().first().cloned(),
                    _ => None,
                })
                .collect();
            for (shard_id, kv) in shard_ids.iter().zip(&gets) {
                if let Some(kv) = kv {
                    return Err(MigrationError::ShardBusy {
                        shard_id: *shard_id,
                        migration: parse_id(kv)?,
                    });
                }
            }
            let record_exists = matches!(gets.get(shard_ids.len()), Some(Some(_)));
            let seq_moved = gets
                .get(shard_ids.len() + 1)
                .and_then(|kv| kv.as_ref())
                .map_or(0, |kv| kv.mod_revision())
                != seq_rev;
            if record_exists && !seq_moved {
                return Err(MigrationError::CorruptValue {
                    key: seq_key,
                    detail: format!("counter {last} is behind the existing migration {id}"),
                });
            }
            // Another create took the next id first: try again with the new counter.
            backoff(attempt).await;
        }
        Err(MigrationError::Contention {
            what: "creating a migration".into(),
            attempts: MAX_CAS_ATTEMPTS,
        })
    }

    pub async fn get(&self, id: MigrationId) -> Result<MigrationRecord, MigrationError> {
        self.get_versioned(id).await.map(|(record, _)| record)
    }

    /// Every migration of the cluster, sorted by id.
    pub async fn list(&self) -> Result<Vec<MigrationRecord>, MigrationError> {
        let resp = self
            .client
            .kv_client()
            .get(self.records_prefix(), Some(GetOptions::new().with_prefix()))
            .await?;
        let mut records = resp
            .kvs()
            .iter()
            .map(decode)
            .collect::<Result<Vec<_>, _>>()?;
        records.sort_by_key(|r| r.id);
        Ok(records)
    }

    /// The migrations whose status is [`Status::Running`], sorted by id.
    pub async fn running(&self) -> Result<Vec<MigrationRecord>, MigrationError> {
        let mut records = self.list().await?;
        records.retain(|r| !r.is_terminal());
        Ok(records)
    }

    /// The running migration that holds `shard_id`'s lock, if any.
    pub async fn lock_holder(&self, shard_id: i64) -> Result<Option<MigrationId>, MigrationError> {
        let resp = self
            .client
            .kv_client()
            .get(self.lock_key(shard_id), None)
            .await?;
        resp.kvs().first().map(parse_id).transpose()
    }

    /// Moves a running migration one step along its mode's path (see [`Phase::can_advance_to`]),
    /// recording how long the phase it leaves took, and applies `update` to the progress fields
    /// (`rows_copied`, `bytes_copied`, `txns_replayed`, `aborted_by_migration`, `waiting_on`,
    /// `rates`; an
    /// update that touches any other field is refused as [`MigrationError::Invalid`]).
    /// `waiting_on` is cleared before `update` runs. Advancing to [`Phase::Done`] makes the record
    /// [`Status::Succeeded`] and releases its shard locks in the same transaction.
    ///
    /// `update` runs on a fresh copy of the record for each compare-and-swap attempt, so it must
    /// be a function of the record (e.g. "add n"), not a one-shot side effect.
    pub async fn advance<F>(
        &self,
        id: MigrationId,
        next: Phase,
        mut update: F,
    ) -> Result<MigrationRecord, MigrationError>
    where
        F: FnMut(&mut MigrationRecord),
    {
        let requested = Transition::Advance(next);
        self.compare_and_swap(id, |record, now| {
            if record.is_terminal() || !record.phase.can_advance_to(next, record.mode) {
                return Err(illegal(record, requested));
            }
            record.enter_phase(next, now);
            if next == Phase::Done {
                record.status = Status::Succeeded;
                record.finished_at_ms = Some(now);
            }
            apply_update(record, &mut update)
        })
        .await
    }

    /// Changes only the progress fields of a running migration, in its current phase (same
    /// rules for `update` as [`MigrationStore::advance`]).
    pub async fn update<F>(
        &self,
        id: MigrationId,
        mut update: F,
    ) -> Result<MigrationRecord, MigrationError>
    where
        F: FnMut(&mut MigrationRecord),
    {
        self.compare_and_swap(id, |record, _| {
            if record.is_terminal() {
                return Err(illegal(record, Transition::Update));
            }
            apply_update(record, &mut update)
        })
        .await
    }

    /// Ends a running migration and releases its shard locks in the same transaction.
    ///
    /// - [`Status::Failed`] / [`Status::RolledBack`]: from any phase; the phase stays the one it
    ///   failed in (its time so far goes into `phase_ms`), `error` is stored.
    /// - [`Status::Succeeded`]: only where advancing to [`Phase::Done`] is legal (from `Cleanup`),
    ///   and same as that advance; `error` must be `None`.
    /// - [`Status::Running`] is not an end: [`MigrationError::IllegalTransition`].
    pub async fn finish(
        &self,
        id: MigrationId,
        status: Status,
        error: Option<String>,
    ) -> Result<MigrationRecord, MigrationError> {
        if status == Status::Succeeded && error.is_some() {
            return Err(MigrationError::Invalid(
                "a migration that succeeded carries no error".into(),
            ));
        }
        let requested = Transition::Finish(status);
        self.compare_and_swap(id, |record, now| {
            if record.is_terminal() || !status.is_terminal() {
                return Err(illegal(record, requested));
            }
            if status == Status::Succeeded {
                if !record.phase.can_advance_to(Phase::Done, record.mode) {
                    return Err(illegal(record, requested));
                }
                record.enter_phase(Phase::Done, now);
            } else {
                record.phase_ms.insert(
                    record.phase.as_str().to_string(),
                    now.saturating_sub(record.phase_started_at_ms),
                );
                record.error = error.clone();
            }
            record.status = status;
            record.finished_at_ms = Some(now);
            Ok(())
        })
        .await
    }

    async fn get_versioned(
        &self,
        id: MigrationId,
    ) -> Result<(MigrationRecord, i64), MigrationError> {
        let resp = self
            .client
            .kv_client()
            .get(self.record_key(id), None)
            .await?;
        let kv = resp.kvs().first().ok_or(MigrationError::NotFound(id))?;
        Ok((decode(kv)?, kv.mod_revision()))
    }

    /// Read, `change` (which also checks legality), write back if the record's `mod_revision` is
    /// still the one read; a record that became terminal also loses its shard locks in that write.
    async fn compare_and_swap<F>(
        &self,
        id: MigrationId,
        mut change: F,
    ) -> Result<MigrationRecord, MigrationError>
    where
        F: FnMut(&mut MigrationRecord, u64) -> Result<(), MigrationError>,
    {
        let key = self.record_key(id);
        for attempt in 1..=MAX_CAS_ATTEMPTS {
            let (mut record, rev) = self.get_versioned(id).await?;
            change(&mut record, now_ms())?;
            let mut ops = vec![TxnOp::put(key.clone(), encode(&record)?, None)];
            if record.is_terminal() {
                // Each lock is deleted only while it still names this migration: a lock someone
                // else holds is never released by us.
                ops.extend(record.shard_ids.iter().map(|s| {
                    let lock = self.lock_key(*s);
                    TxnOp::txn(
                        Txn::new()
                            .when([Compare::value(
                                lock.clone(),
                                CompareOp::Equal,
                                id.to_string(),
                            )])
                            .and_then([TxnOp::delete(lock, None)]),
                    )
                }));
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), CompareOp::Equal, rev)])
                .and_then(ops);
            if self.client.kv_client().txn(txn).await?.succeeded() {
                tracing::info!(%id, phase = %record.phase, status = %record.status, "migration updated");
                return Ok(record);
            }
            backoff(attempt).await;
        }
        Err(MigrationError::Contention {
            what: format!("migration {id}"),
            attempts: MAX_CAS_ATTEMPTS,
        })
    }
}

fn illegal(record: &MigrationRecord, requested: Transition) -> MigrationError {
    MigrationError::IllegalTransition {
        id: record.id,
        mode: record.mode,
        phase: record.phase,
        status: record.status,
        requested,
    }
}

fn apply_update<F>(record: &mut MigrationRecord, update: &mut F) -> Result<(), MigrationError>
where
    F: FnMut(&mut MigrationRecord),
{
    let before = record.clone();
    update(record);
    if before.with_progress_of(record) != *record {
        return Err(MigrationError::Invalid(
            "an update may change only rows_copied, bytes_copied, txns_replayed, \
             aborted_by_migration, waiting_on and rates"
                .into(),
        ));
    }
    Ok(())
}

/// Checks a create request and returns its shard ids sorted.
fn validate_create(
    shard_ids: &[i64],
    source: &str,
    target: &str,
) -> Result<Vec<i64>, MigrationError> {
    if shard_ids.is_empty() {
        return Err(MigrationError::Invalid("no shards given".into()));
    }
    if shard_ids.len() > MAX_SHARDS_PER_MIGRATION {
        return Err(MigrationError::Invalid(format!(
            "{} shards given; one migration moves at most {MAX_SHARDS_PER_MIGRATION}",
            shard_ids.len()
        )));
    }
    let mut sorted = shard_ids.to_vec();
    sorted.sort_unstable();
    if let Some(bad) = sorted.iter().find(|s| **s <= 0) {
        return Err(MigrationError::Invalid(format!(
            "shard id {bad} is not positive"
        )));
    }
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(MigrationError::Invalid(format!(
            "shard {} is given twice",
            w[0]
        )));
    }
    for (role, name) in [("source", source), ("target", target)] {
        if !is_valid_node_name(name) {
            return Err(MigrationError::Invalid(format!(
                "{role} {name:?} is not a valid node name"
            )));
        }
    }
    if source == target {
        return Err(MigrationError::Invalid(format!(
            "source and target are both {source}"
        )));
    }
    Ok(sorted)
}

fn encode(record: &MigrationRecord) -> Result<String, MigrationError> {
    serde_json::to_string(record).map_err(|source| MigrationError::Encode {
        id: record.id,
        source,
    })
}

fn decode(kv: &KeyValue) -> Result<MigrationRecord, MigrationError> {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    let record: MigrationRecord =
        serde_json::from_slice(kv.value()).map_err(|source| MigrationError::Corrupt {
            key: key.clone(),
            source,
        })?;
    if !key.ends_with(&format!("/{}", record.id)) {
        return Err(MigrationError::CorruptValue {
            detail: format!("holds the record of migration {}", record.id),
            key,
        });
    }
    Ok(record)
}

/// A migration id stored as a decimal value (the counter and the shard locks).
fn parse_id(kv: &KeyValue) -> Result<MigrationId, MigrationError> {
    std::str::from_utf8(kv.value())
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| MigrationError::CorruptValue {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            detail: format!(
                "expected a migration id, found {:?}",
                String::from_utf8_lossy(kv.value())
            ),
        })
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A short, jittered pause after a lost race, so that racing writers do not stay in lockstep.
async fn backoff(attempt: u32) {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let cap_us = 200 * u64::from(attempt.min(10));
    tokio::time::sleep(Duration::from_micros(u64::from(nanos) % cap_us.max(1))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_parses_and_prints() {
        assert_eq!("remus".parse::<Mode>(), Ok(Mode::Remus));
        assert_eq!("lock_abort".parse::<Mode>(), Ok(Mode::LockAbort));
        assert_eq!("wait_remaster".parse::<Mode>(), Ok(Mode::WaitRemaster));
        for m in Mode::ALL {
            assert_eq!(m.as_str().parse::<Mode>(), Ok(*m));
            assert_eq!(m.to_string(), m.as_str());
        }
        let err = "Remus".parse::<Mode>().unwrap_err();
        assert_eq!(err.what, "migration mode");
        assert_eq!(err.value, "Remus");
        assert_eq!(
            err.to_string(),
            "invalid migration mode \"Remus\" (expected remus | lock_abort | wait_remaster | squall | albatross)"
        );
        assert!("".parse::<Mode>().is_err());
        assert!("lock-abort".parse::<Mode>().is_err());
    }

    #[test]
    fn phase_and_status_parse_and_match_serde_names() {
        for p in Phase::ALL {
            assert_eq!(p.as_str().parse::<Phase>(), Ok(*p));
            assert_eq!(
                serde_json::to_string(p).unwrap(),
                format!("\"{}\"", p.as_str())
            );
        }
        for s in Status::ALL {
            assert_eq!(s.as_str().parse::<Status>(), Ok(*s));
            assert_eq!(
                serde_json::to_string(s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        for m in Mode::ALL {
            assert_eq!(
                serde_json::to_string(m).unwrap(),
                format!("\"{}\"", m.as_str())
            );
        }
        assert_eq!("rolled_back".parse::<Status>(), Ok(Status::RolledBack));
        assert_eq!("catchup".parse::<Phase>(), Ok(Phase::Catchup));
        assert!("finished".parse::<Phase>().is_err());
        assert!("ok".parse::<Status>().is_err());
        assert_eq!("42".parse::<MigrationId>(), Ok(MigrationId(42)));
        assert!("-1".parse::<MigrationId>().is_err());
    }

    #[test]
    fn remus_path() {
        use Phase::*;
        let steps = [
            Pending, Copy, Catchup, Barrier, Dual, Handover, Cleanup, Done,
        ];
        for w in steps.windows(2) {
            assert!(
                w[0].can_advance_to(w[1], Mode::Remus),
                "{} -> {}",
                w[0],
                w[1]
            );
        }
        assert!(!Catchup.can_advance_to(Handover, Mode::Remus));
        assert_eq!(Done.next(Mode::Remus), None);
    }

    #[test]
    fn baseline_paths_skip_barrier_and_dual() {
        use Phase::*;
        for mode in [Mode::LockAbort, Mode::WaitRemaster] {
            let steps = [Pending, Copy, Catchup, Handover, Cleanup, Done];
            for w in steps.windows(2) {
                assert!(
                    w[0].can_advance_to(w[1], mode),
                    "{mode}: {} -> {}",
                    w[0],
                    w[1]
                );
            }
            assert!(!Catchup.can_advance_to(Barrier, mode));
            assert!(!Barrier.can_advance_to(Dual, mode));
            assert!(!Dual.can_advance_to(Handover, mode));
            assert_eq!(Barrier.next(mode), None);
        }
    }

    #[test]
    fn squall_path_hands_over_before_the_data() {
        use Phase::*;
        let steps = [Pending, Copy, Handover, Cleanup, Done];
        for w in steps.windows(2) {
            assert!(
                w[0].can_advance_to(w[1], Mode::Squall),
                "{} -> {}",
                w[0],
                w[1]
            );
        }
        assert!(!Copy.can_advance_to(Catchup, Mode::Squall));
        assert_eq!(Catchup.next(Mode::Squall), None);
    }

    #[test]
    fn only_single_forward_steps_are_legal() {
        for mode in Mode::ALL {
            let path = Phase::path(*mode);
            for from in Phase::ALL {
                for to in Phase::ALL {
                    let expected = path
                        .iter()
                        .position(|p| p == from)
                        .is_some_and(|i| path.get(i + 1) == Some(to));
                    assert_eq!(
                        from.can_advance_to(*to, *mode),
                        expected,
                        "{mode}: {from} -> {to}"
                    );
                }
            }
            // No self-loops, no going back, no skipping.
            assert!(!Phase::Copy.can_advance_to(Phase::Copy, *mode));
            assert!(!Phase::Catchup.can_advance_to(Phase::Copy, *mode));
            assert!(!Phase::Pending.can_advance_to(Phase::Catchup, *mode));
            assert!(!Phase::Done.can_advance_to(Phase::Pending, *mode));
        }
    }

    #[test]
    fn terminal_statuses() {
        assert!(!Status::Running.is_terminal());
        assert!(Status::Succeeded.is_terminal());
        assert!(Status::Failed.is_terminal());
        assert!(Status::RolledBack.is_terminal());
    }

    fn sample() -> MigrationRecord {
        MigrationRecord {
            id: MigrationId(7),
            shard_ids: vec![3, 4],
            source: "n1".into(),
            target: "n2".into(),
            mode: Mode::LockAbort,
            phase: Phase::Catchup,
            status: Status::Running,
            rows_copied: 10,
            bytes_copied: 2048,
            txns_replayed: 5,
            aborted_by_migration: 1,
            phase_ms: BTreeMap::from([("copy".to_string(), 120), ("pending".to_string(), 3)]),
            started_at_ms: 1_000,
            phase_started_at_ms: 1_123,
            finished_at_ms: None,
            error: None,
            waiting_on: Some("slot creation waits for xid 1234".into()),
            rates: Rates::default(),
            unavailable_ms: None,
        }
    }

    #[test]
    fn record_json_round_trip() {
        let r = sample();
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.contains("\"mode\":\"lock_abort\""), "{json}");
        assert!(json.contains("\"phase\":\"catchup\""), "{json}");
        assert!(json.contains("\"id\":7"), "{json}");
        assert_eq!(serde_json::from_str::<MigrationRecord>(&json).unwrap(), r);
    }

    #[test]
    fn corrupt_json_is_a_typed_error() {
        let cases: [&[u8]; 4] = [
            b"not json",
            b"{\"id\":1}",
            b"\xff\xfe",
            br#"{"id":1,"shard_ids":[1],"source":"n1","target":"n2","mode":"teleport","phase":"copy","status":"running","rows_copied":0,"bytes_copied":0,"txns_replayed":0,"aborted_by_migration":0,"started_at_ms":0,"phase_started_at_ms":0}"#,
        ];
        for value in cases {
            let err = serde_json::from_slice::<MigrationRecord>(value).unwrap_err();
            let e = MigrationError::Corrupt {
                key: "/remus/c/migrations/1".into(),
                source: err,
            };
            assert!(e
                .to_string()
                .starts_with("corrupt migration record at /remus/c/migrations/1"));
        }
    }

    #[test]
    fn total_ms_uses_finish_or_now() {
        let mut r = sample();
        assert_eq!(r.total_ms(1_500), 500);
        r.finished_at_ms = Some(1_300);
        assert_eq!(r.total_ms(9_999), 300);
        assert_eq!(r.total_ms(0), 300);
        r.finished_at_ms = None;
        assert_eq!(
            r.total_ms(0),
            0,
            "a clock behind the start must not underflow"
        );
    }

    #[test]
    fn enter_phase_records_duration_and_clears_wait() {
        let mut r = sample();
        r.enter_phase(Phase::Handover, 1_500);
        assert_eq!(r.phase, Phase::Handover);
        assert_eq!(r.phase_ms.get("catchup"), Some(&377));
        assert_eq!(r.phase_started_at_ms, 1_500);
        assert_eq!(r.waiting_on, None);
    }

    #[test]
    fn updates_may_touch_only_progress_fields() {
        let mut r = sample();
        apply_update(&mut r, &mut |r: &mut MigrationRecord| {
            r.rows_copied += 5;
            r.waiting_on = None;
        })
        .unwrap();
        assert_eq!(r.rows_copied, 15);
        assert_eq!(r.waiting_on, None);

        let before = sample();
        for bad in [
            (|r: &mut MigrationRecord| r.phase = Phase::Done) as fn(&mut MigrationRecord),
            |r| r.status = Status::Failed,
            |r| r.shard_ids.push(9),
            |r| r.target = "n3".into(),
            |r| r.error = Some("x".into()),
            |r| {
                r.phase_ms.insert("copy".into(), 0);
            },
        ] {
            let mut r = before.clone();
            let mut f = bad;
            let err = apply_update(&mut r, &mut f).unwrap_err();
            assert!(matches!(err, MigrationError::Invalid(_)), "{err}");
        }
    }

    #[test]
    fn create_validation() {
        assert_eq!(
            validate_create(&[5, 2, 9], "n1", "n2").unwrap(),
            vec![2, 5, 9]
        );
        for (shards, src, dst) in [
            (&[][..], "n1", "n2"),
            (&[1, 1][..], "n1", "n2"),
            (&[0][..], "n1", "n2"),
            (&[-4][..], "n1", "n2"),
            (&[1][..], "n1", "n1"),
            (&[1][..], "", "n2"),
            (&[1][..], "n1", "N2"),
        ] {
            assert!(
                matches!(
                    validate_create(shards, src, dst),
                    Err(MigrationError::Invalid(_))
                ),
                "{shards:?} {src} {dst}"
            );
        }
        let many: Vec<i64> = (1..=(MAX_SHARDS_PER_MIGRATION as i64 + 1)).collect();
        assert!(matches!(
            validate_create(&many, "n1", "n2"),
            Err(MigrationError::Invalid(_))
        ));
    }

    #[test]
    fn illegal_transition_message_names_everything() {
        let e = illegal(&sample(), Transition::Advance(Phase::Barrier));
        assert_eq!(
            e.to_string(),
            "migration 7 (mode lock_abort, phase catchup, status running): advancing to phase barrier is not allowed"
        );
    }
}
