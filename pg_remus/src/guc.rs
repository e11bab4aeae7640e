//! `remus.*` settings.
//!
//! Who may change each is part of its definition (decision 0016): what says which node this is
//! (`remus.node_name`), where the control plane is (`remus.coordinator_address`) and what the
//! node's own background work does are read from postgresql.conf (PGC_SIGHUP, or
//! PGC_POSTMASTER); what marks a session as one of the cluster's own (`remus.forwarded`,
//! `remus.migration_session`) only a superuser may set (PGC_SUSET), since such a session skips
//! checks an application's session is held to; waits and limits that bound only the session's
//! own statements stay the session's (PGC_USERSET).

use std::ffi::CString;

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// This node's name in the cluster (n1, n2, …). Routing compares shard owners against it, so it
/// is set per node in postgresql.conf by whoever provisions the node, and no session can change
/// it (PGC_SIGHUP): a session that named itself another node would take that node's shards for
/// its own.
pub static NODE_NAME: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// Set by a node that connects to another node: the receiving session executes locally and
/// never forwards again, honours shard markers and skips the ownership check (RM001). Node-to-
/// node sessions authenticate as a superuser and set it in their startup options; nobody else
/// may set it (PGC_SUSET).
pub static FORWARDED: GucSetting<bool> = GucSetting::<bool>::new(false);

/// A session of the migration machinery (copy, replay, handover, cleanup): it may write shard
/// tables its node does not own yet, and is exempt from the admission gate, the write fence and
/// the DDL refusal that a migration puts up.
pub static MIGRATION_SESSION: GucSetting<bool> = GucSetting::<bool>::new(false);

/// A single-shard SELECT or write routed to this node runs as its local plan alone, without
/// the `RemusRouter` node (decision 0034); off: the router node stays, as with EXPLAIN.
pub static LOCAL_PLAN_ON_TOP: GucSetting<bool> = GucSetting::<bool>::new(true);

/// A statement with constants routed to another node goes with its constants as parameters,
/// prepared there once per shape (design note 0002, `router::deparse::lift_constants`); off:
/// as text with its literals, parsed and planned there every time.
pub static LIFT_CONSTANTS: GucSetting<bool> = GucSetting::<bool>::new(true);

/// A simple-protocol statement on one shard group is planned once per shape in a backend, its
/// key and written values bound as parameters (decision 0037, `router::shapes`); off: planned
/// every time.
pub static SHAPE_CACHE: GucSetting<bool> = GucSetting::<bool>::new(true);

/// gRPC address of the coordinator, for `remus_migrate_shard(s)` and `remus_migrations`.
pub static COORDINATOR_ADDRESS: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(None);

/// How often the recovery worker looks for in-doubt prepared transactions.
pub static RECOVERY_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(2000);

/// Longest wait of a write on a draining shard's new owner for the row's older writers on the
/// source (`migration::handover::remus`); 0 turns the wait off.
pub static DRAIN_WAIT_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(10_000);

/// Longest wait of a READ COMMITTED statement (or a write on the old owner) for a Tm prepared
/// on this node to be decided (`migration::handover`); past it the statement fails (55006).
pub static IN_DOUBT_WAIT_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(5_000);

/// Longest wait of a dual-execution commit for its Validate call (`migration::dual`); past it
/// the transaction fails with 40001. Above the replay worker's own waits (30 s for the stream,
/// 5 s per row lock), so it only ends validations that would otherwise hang (review F11).
pub static VALIDATION_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(60_000);

/// Longest wait of a migration's cleanup for the transactions older than its handover that can
/// still use the old placement; past it they are terminated. Read by the coordinator from each
/// node (`coordinator/src/driver/mod.rs`, `wait_for_transactions`), not used in the backend.
pub static CLEANUP_DRAIN_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(300_000);

/// Longest wait of a commit in dual execution, after it committed, for the destination to
/// commit (or roll back) its shadow (`migration::dual`, the Resolve call). Past it the client
/// gets its COMMIT with a WARNING and the coordinator's periodic resolver finishes the shadow
/// by the transaction's fate (review F6).
pub static RESOLVE_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(10_000);

/// Largest write set (row changes captured for validation, counted as their encoded size on the
/// wire) one transaction may hold per migration, in kB (`migration::catchup`). Past it, in dual
/// execution, the statement fails with 54000 instead of the backend growing until an allocation
/// fails and the node crash-restarts (review F10).
pub static MAX_WRITE_SET_KB: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);

/// Size of one chunk of a write set sent to the replay worker's Validate, in kB
/// (`migration::dual`).
pub static WRITE_SET_CHUNK_KB: GucSetting<i32> = GucSetting::<i32>::new(1024);

/// wait_remaster: longest wait of a handover, once its admission gate closed, for the
/// transactions admitted before (past it the handover rolls back). Read by the coordinator
/// from each node (`coordinator/src/driver/handover/wait_remaster.rs`), not used in the backend.
pub static GATE_DRAIN_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);

/// Fault injection for tests: the point of a two-phase commit at which this backend crashes
/// (its node restarts, as after a power cut of the process), see [`crash_point`].
pub static CRASH_AT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// The database the background workers connect to (where pg_remus is created).
pub static DATABASE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"postgres"));

pub fn database() -> String {
    DATABASE
        .get()
        .and_then(|c| c.to_str().ok().map(str::to_string))
        .unwrap_or_else(|| "postgres".into())
}

pub fn register() {
    GucRegistry::define_int_guc(
        c"remus.recovery_interval",
        c"Milliseconds between rounds of in-doubt 2PC recovery.",
        c"The recovery worker commits or rolls back prepared transactions this node coordinated.",
        &RECOVERY_INTERVAL_MS,
        100,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"remus.drain_wait_timeout",
        c"Longest wait of a write on a migrated shard for the row's older writers on the source.",
        c"Between Tm and the end of a Remus migration, a write routed to the new owner first waits for the source transactions that hold the row or are queued for it; past this it goes ahead (0: no wait).",
        &DRAIN_WAIT_TIMEOUT_MS,
        0,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_string_guc(
        c"remus.database",
        c"Database in which pg_remus is created; background workers connect to it.",
        c"",
        &DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"remus.crash_at",
        c"Fault injection for tests: crash this backend at a named point of a two-phase commit.",
        c"after_prepare: every participant prepared, the local commit not made; after_local_commit: committed here, COMMIT PREPARED not yet sent. The node restarts (crash recovery) and its recovery worker finishes the participants by the recorded decision. Superuser only; empty: off.",
        &CRASH_AT,
        GucContext::Suset,
        GucFlags::NO_SHOW_ALL,
    );
    GucRegistry::define_bool_guc(
        c"remus.forwarded",
        c"This session was opened by another pg_remus node.",
        c"Set in the connection options of node-to-node connections, which authenticate as a superuser; no other session may set it.",
        &FORWARDED,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"remus.migration_session",
        c"This session belongs to the shard migration machinery.",
        c"Exempt from ownership checks, the admission gate, the write fence and the DDL refusal of running migrations.",
        &MIGRATION_SESSION,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"remus.enable_local_plan_on_top",
        c"A single-shard SELECT or INSERT/UPDATE/DELETE routed to this node runs as its local plan alone.",
        c"Off keeps the RemusRouter node above the local plan (decision 0034), for comparison and diagnosis.",
        &LOCAL_PLAN_ON_TOP,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"remus.enable_constant_lifting",
        c"A statement with constants routed to another node goes with them as parameters, prepared there once per shape.",
        c"Off sends its text with the literals, parsed and planned on that node every time (design note 0002), for comparison and diagnosis.",
        &LIFT_CONSTANTS,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"remus.enable_shape_cache",
        c"A statement with constants on one shard group, sent as text, is planned once per shape in a backend.",
        c"Its shard-key constants and written values are bound as parameters of a plan kept per shape (decision 0037); off plans it every time, for comparison and diagnosis.",
        &SHAPE_CACHE,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"remus.coordinator_address",
        c"gRPC address of the pg_remus coordinator, e.g. http://127.0.0.1:6102; several, comma-separated, for a leader and its standbys (the first that accepts is used).",
        c"Used by remus_migrate_shard(), remus_migrate_shards() and the remus_migrations view.",
        &COORDINATOR_ADDRESS,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"remus.node_name",
        c"Name of this node in the pg_remus cluster.",
        c"Set in postgresql.conf; must match the name under which the node was added with remus_add_node().",
        &NODE_NAME,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"remus.in_doubt_wait_timeout",
        c"Longest wait for a shard-map row held by a prepared Tm (an ownership change in doubt).",
        c"A statement that needs a shard whose ownership change is prepared on this node but not yet decided here waits for the decision; past this it fails with SQLSTATE 55006 (0: fail at once).",
        &IN_DOUBT_WAIT_TIMEOUT_MS,
        0,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"remus.validation_timeout",
        c"Longest wait of a commit in dual execution for its validation on the destination.",
        c"A transaction that wrote a migrating shard in dual execution is validated by the destination's replay worker before it commits; with no answer within this time (destination hung or unreachable) it fails with SQLSTATE 40001 instead of waiting.",
        &VALIDATION_TIMEOUT_MS,
        10,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"remus.cleanup_drain_timeout",
        c"Longest wait of a migration's cleanup for transactions older than its handover.",
        c"After the handover, the migration waits for the transactions that started before it and can still use the old placement (they hold a snapshot or a lock on a moved table); past this they are terminated (SQLSTATE 57P01).",
        &CLEANUP_DRAIN_TIMEOUT_MS,
        100,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"remus.resolve_timeout",
        c"Longest wait of a dual-execution commit for the destination to finish its shadow transaction.",
        c"After a validated transaction commits or rolls back, its client waits for the destination's shadow to follow; past this it gets its COMMIT (or ROLLBACK) with a WARNING, and the migration's periodic resolver finishes the shadow by the transaction's fate within about a second.",
        &RESOLVE_TIMEOUT_MS,
        1,
        3_600_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"remus.gate_drain_timeout",
        c"Longest wait of a wait_remaster or albatross handover for the transactions in flight when it closed its gate or suspended its shards.",
        c"While the gate is closed, new transactions wait at it and the handover waits for the ones already running (named in remus_migrations.waiting_on); past this (and at most the gate's own timeout) the handover is rolled back and the gate reopens.",
        &GATE_DRAIN_TIMEOUT_MS,
        100,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"remus.max_write_set_bytes",
        c"Largest write set a transaction may build on a migrating shard.",
        c"A transaction that writes a shard under a Remus migration keeps its row changes for validation on the destination. Past this size (the changes' encoded size) a write in dual execution fails with SQLSTATE 54000; a transaction that passed it before dual execution commits unvalidated if it commits before the sync barrier, and fails with 54000 at COMMIT after it.",
        &MAX_WRITE_SET_KB,
        64,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_KB,
    );
    GucRegistry::define_int_guc(
        c"remus.write_set_chunk_bytes",
        c"Size of one chunk of a write set sent to the destination for validation.",
        c"A write set is streamed to the replay worker in chunks of about this size (at least one row each); the worker runs each chunk as one pipelined batch.",
        &WRITE_SET_CHUNK_KB,
        1,
        64 * 1024,
        GucContext::Userset,
        GucFlags::UNIT_KB,
    );
}

/// Crashes the backend (SIGABRT: the postmaster restarts the node) if `remus.crash_at` names
/// `point`. Only a superuser can set it; tests use it to kill a node between the two phases.
pub fn crash_point(point: &str) {
    if CRASH_AT
        .get()
        .is_some_and(|p| p.as_bytes() == point.as_bytes())
    {
        std::process::abort();
    }
}

pub fn node_name() -> Option<String> {
    NODE_NAME
        .get()
        .and_then(|c| c.to_str().ok().map(str::to_string))
        .filter(|s| !s.is_empty())
}

/// Is `name` this node's name? (No copy of the setting, for the per-statement paths: the
/// setting's own string is compared where PostgreSQL keeps it.)
pub fn is_this_node(name: &str) -> bool {
    // SAFETY: the GUC's storage holds NULL or a NUL-terminated string PostgreSQL owns, which a
    // backend's own statement cannot free while it compares (only a configuration reload does,
    // between statements).
    let raw = unsafe { *NODE_NAME.as_ptr() };
    !raw.is_null()
        && !name.is_empty()
        // SAFETY: as above, a valid NUL-terminated string.
        && unsafe { std::ffi::CStr::from_ptr(raw) }.to_bytes() == name.as_bytes()
}

pub fn coordinator_address() -> Option<String> {
    COORDINATOR_ADDRESS
        .get()
        .and_then(|c| c.to_str().ok().map(str::to_string))
        .filter(|s| !s.is_empty())
}
