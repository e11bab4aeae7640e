//! Names that cross the wire or a crate boundary, defined once.
//!
//! Each name here is written by one component and read by another: the extension prepares a
//! shadow under a gid the replay worker checks and the coordinator resolves; the coordinator
//! drops replication origins that the replay worker and the copy created; the extension's
//! logical messages are recognised by the propagator; the coordinator's refusals carry a
//! SQLSTATE that the SQL functions and `remusctl` read back. Building and parsing each name in
//! one place keeps the two ends from drifting apart.
//!
//! Per migration `m`, on the nodes:
//!
//! | name | form | written by | read by |
//! | --- | --- | --- | --- |
//! | shadow transaction gid | `remus:<m>:<source xid>` | extension (dual execution) | replay worker, coordinator cleanup |
//! | replication slot, publication | `remus_m<m>` | coordinator (copy) | coordinator (streaming, cleanup) |
//! | copy origin | `remus_m<m>_c<backend pid>` | coordinator (copy sessions on the target) | replay worker validation (MOCC) |
//! | apply origin | `remus_m<m>_w<k>` | replay worker apply session `k` | replay worker validation |
//! | validation origin | `remus_m<m>_v<k>` | replay worker validation session `k` | — |
//! | shadow-resolve origin | `remus_m<m>_recovery` | coordinator (shadow resolution) | — |
//! | Tm transaction gid | `remus_tm:<m>:<node>` | coordinator (handover) | coordinator (commit, rollback, resume) |
//! | sync point message | prefix `remus_sync`, body `<m>` | coordinator (catch-up, barrier) | — (only its LSN matters) |
//! | capture trigger | `remus_capture` on each shard table | coordinator (target copy), extension (source) | — |
//!
//! Every origin of a migration starts with `remus_m<m>_`, which is how the coordinator drops
//! them all ([`origin_like_pattern`]).

use std::ffi::CStr;

/// Prefix of every replication slot, publication and origin a migration creates (`remus_m…`).
pub const MIGRATION_OBJECT_PREFIX: &str = "remus_m";

/// Prefix of the logical decoding messages (`pg_logical_emit_message`) with which the
/// extension marks a transaction of dual execution; the message body is the shadow gid.
pub const MESSAGE_PREFIX: &str = "remus";
/// [`MESSAGE_PREFIX`] for C callers (`LogLogicalMessage`).
pub const MESSAGE_PREFIX_C: &CStr = c"remus";

/// Prefix of the transactional logical message the coordinator emits on the source to get a
/// stream position that everything committed before it precedes (a sync point).
pub const SYNC_POINT_MESSAGE_PREFIX: &str = "remus_sync";

/// Prefix of the non-transactional logical message a source transaction validating behind the
/// stream writes at its pre-commit: decoded and sent at once, it carries the stream past the
/// transaction's WAL position even when nothing published commits after it (every writer of
/// the shards waiting in its own validation, say). Its body is empty.
pub const STREAM_MARK_MESSAGE_PREFIX: &str = "remus_mark";
/// [`STREAM_MARK_MESSAGE_PREFIX`] for C callers (`LogLogicalMessage`).
pub const STREAM_MARK_MESSAGE_PREFIX_C: &CStr = c"remus_mark";

/// Name of the write-set capture trigger on every shard table (on the source and, added after
/// the copy's rows, on the target).
pub const CAPTURE_TRIGGER: &str = "remus_capture";

/// The DDL of [`CAPTURE_TRIGGER`] on shard table `shard_table` (schema-qualified, quoted) of
/// shard `shard_id`: what the extension creates with every shard table and the coordinator on a
/// migration's target. ENABLE ALWAYS: a session in `session_replication_role = replica` (a
/// superuser's, a logical-replication apply worker's) must be captured too, or its commit would
/// skip validation and be applied blindly on the destination after Tm (review finding F14).
/// The migration's own replica-role sessions return at once (`remus.migration_session`).
pub fn capture_trigger_ddl(shard_table: &str, shard_id: i64) -> String {
    format!(
        "CREATE TRIGGER {CAPTURE_TRIGGER} AFTER INSERT OR UPDATE OR DELETE ON {shard_table} \
         FOR EACH ROW EXECUTE FUNCTION remus.capture_write('{shard_id}');\n\
         ALTER TABLE {shard_table} ENABLE ALWAYS TRIGGER {CAPTURE_TRIGGER};\n"
    )
}

/// gRPC metadata key under which the coordinator sends the SQLSTATE of a refusal.
pub const SQLSTATE_METADATA_KEY: &str = "remus-sqlstate";

/// `application_name` of the coordinator's connections to the nodes; a migration never waits
/// for its own sessions.
pub const MIGRATION_APPLICATION_NAME: &str = "remus_migration";

/// Schema of the physical shard tables on every node (`remus_shards.<table>_<shard id>`).
pub const SHARD_SCHEMA: &str = "remus_shards";
/// [`SHARD_SCHEMA`] for C callers.
pub const SHARD_SCHEMA_C: &CStr = c"remus_shards";

/// The physical table name of shard `shard_id` of the table named `relname` (in [`SHARD_SCHEMA`]).
pub fn shard_table_name(relname: &str, shard_id: i64) -> String {
    format!("{relname}_{shard_id}")
}

// ---- shadow transactions ----

const SHADOW_GID_PREFIX: &str = "remus:";

/// Gid of the prepared shadow on the target of source transaction `source_xid` (a full
/// transaction id) of migration `migration_id`: `remus:<m>:<source xid>`.
pub fn shadow_gid(migration_id: u64, source_xid: u64) -> String {
    format!("{SHADOW_GID_PREFIX}{migration_id}:{source_xid}")
}

/// What every shadow gid of migration `migration_id` starts with: `remus:<m>:`.
pub fn shadow_gid_prefix(migration_id: u64) -> String {
    format!("{SHADOW_GID_PREFIX}{migration_id}:")
}

/// The source transaction part of a shadow gid of migration `migration_id` (the text after
/// [`shadow_gid_prefix`]), or `None` if `gid` is not one of that migration's shadow gids or
/// the part is empty. The text is not checked to be a number.
pub fn shadow_gid_source_xid(migration_id: u64, gid: &str) -> Option<&str> {
    let rest = gid.strip_prefix(&shadow_gid_prefix(migration_id))?;
    (!rest.is_empty()).then_some(rest)
}

/// `(migration_id, source_xid)` of a well-formed shadow gid, or `None`.
pub fn parse_shadow_gid(gid: &str) -> Option<(u64, u64)> {
    let (m, xid) = gid.strip_prefix(SHADOW_GID_PREFIX)?.split_once(':')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(m) || !digits(xid) {
        return None;
    }
    Some((m.parse().ok()?, xid.parse().ok()?))
}

// ---- Tm ----

/// Gid of migration `migration_id`'s Tm transaction (the shard map change) on `node`.
pub fn tm_gid(migration_id: u64, node: &str) -> String {
    format!("remus_tm:{migration_id}:{node}")
}

// ---- slot, publication, replication origins ----

/// The logical replication slot of migration `migration_id` on its source.
pub fn slot_name(migration_id: u64) -> String {
    format!("{MIGRATION_OBJECT_PREFIX}{migration_id}")
}

/// The publication of migration `migration_id` on its source (same name as its slot).
pub fn publication_name(migration_id: u64) -> String {
    format!("{MIGRATION_OBJECT_PREFIX}{migration_id}")
}

/// What the copy origin of migration `migration_id` starts with; the copy session's backend
/// pid follows (`remus_m<m>_c<pid>`, see [`copy_origin`]).
pub fn copy_origin_prefix(migration_id: u64) -> String {
    format!("{MIGRATION_OBJECT_PREFIX}{migration_id}_c")
}

/// The origin of the copy session with backend pid `pid` on the target.
pub fn copy_origin(migration_id: u64, pid: i32) -> String {
    format!("{}{pid}", copy_origin_prefix(migration_id))
}

/// The origin of replay worker apply session `worker` of migration `migration_id`.
pub fn apply_origin(migration_id: u64, worker: usize) -> String {
    format!("{MIGRATION_OBJECT_PREFIX}{migration_id}_w{worker}")
}

/// The origin of replay worker validation session `k` of migration `migration_id`.
pub fn validation_origin(migration_id: u64, k: usize) -> String {
    format!("{MIGRATION_OBJECT_PREFIX}{migration_id}_v{k}")
}

/// The origin under which the coordinator commits the shadows it resolves after the stream
/// ended (they get their source transaction's commit time).
pub fn shadow_resolve_origin(migration_id: u64) -> String {
    format!("{MIGRATION_OBJECT_PREFIX}{migration_id}_recovery")
}

/// `LIKE` pattern matching every origin of migration `migration_id` (`remus\_m<m>\_%`).
pub fn origin_like_pattern(migration_id: u64) -> String {
    format!(r"remus\_m{migration_id}\_%")
}

/// Whether `name` is an origin (or slot) of some migration.
pub fn is_migration_object(name: &str) -> bool {
    name.starts_with(MIGRATION_OBJECT_PREFIX)
}

// ---- node-to-node statements ----

const SHARD_MARKER_START: &str = "/*remus:shard=";
const SHARD_MARKER_END: &str = "*/";

/// `sql` prefixed with the marker that pins it to shard `shard_id` on the node it is sent to:
/// `/*remus:shard=<id>*/ <sql>`.
pub fn shard_marked(shard_id: i64, sql: &str) -> String {
    format!("{SHARD_MARKER_START}{shard_id}{SHARD_MARKER_END} {sql}")
}

/// The shard of a statement that starts (after white space) with a shard marker.
pub fn parse_shard_marker(sql: &str) -> Option<i64> {
    let rest = sql.trim_start().strip_prefix(SHARD_MARKER_START)?;
    rest[..rest.find(SHARD_MARKER_END)?].parse().ok()
}

/// Gid of the prepared part on `participant` of the distributed transaction `xid` begun on
/// node `coordinator_node`: `remus_<node>_<xid>_<participant>`.
pub fn two_phase_gid(
    coordinator_node: &str,
    xid: impl std::fmt::Display,
    participant: &str,
) -> String {
    format!("remus_{coordinator_node}_{xid}_{participant}")
}

// ---- local cluster ports ----

/// Port layout of a cluster started by `remusctl cluster up --base-port P`: nodes listen on
/// `P..P+N-1`, the other daemons at fixed offsets from `P`.
pub mod ports {
    /// etcd client port, `P+100`.
    pub const ETCD_CLIENT_OFFSET: u16 = 100;
    /// etcd peer port, `P+101`.
    pub const ETCD_PEER_OFFSET: u16 = 101;
    /// Coordinator gRPC, `P+102`.
    pub const COORDINATOR_OFFSET: u16 = 102;
    /// Replay worker gRPC, `P+103`.
    pub const REPLAY_WORKER_OFFSET: u16 = 103;
    /// gRPC of the standby coordinator (`cluster up --standby-coordinator`), `P+104`: it
    /// listens only once it has won the leadership (decision 0010). The highest port of a
    /// cluster.
    pub const STANDBY_COORDINATOR_OFFSET: u16 = 104;
    /// The highest offset used.
    pub const MAX_OFFSET: u16 = STANDBY_COORDINATOR_OFFSET;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadow_gids_round_trip() {
        let gid = shadow_gid(7, 123_456_789);
        assert_eq!(gid, "remus:7:123456789");
        assert!(gid.starts_with(&shadow_gid_prefix(7)));
        assert_eq!(parse_shadow_gid(&gid), Some((7, 123_456_789)));
        assert_eq!(shadow_gid_source_xid(7, &gid), Some("123456789"));
        assert_eq!(
            parse_shadow_gid(&shadow_gid(u64::MAX, 0)),
            Some((u64::MAX, 0))
        );
    }

    #[test]
    fn shadow_gids_of_another_migration_or_malformed_are_rejected() {
        assert_eq!(shadow_gid_source_xid(7, "remus:77:1"), None);
        assert_eq!(shadow_gid_source_xid(7, "remus:8:1"), None);
        assert_eq!(shadow_gid_source_xid(7, "remus:7:"), None);
        for bad in [
            "remus:7:",
            "remus::1",
            "remus:7",
            "remus:x:1",
            "remus:7:1:2",
            "remus_n1_5_n2",
            "remus:+7:1",
        ] {
            assert_eq!(parse_shadow_gid(bad), None, "{bad}");
        }
    }

    #[test]
    fn migration_objects_share_one_prefix_the_cleanup_pattern_matches() {
        assert_eq!(slot_name(3), "remus_m3");
        assert_eq!(publication_name(3), "remus_m3");
        assert_eq!(copy_origin_prefix(3), "remus_m3_c");
        assert_eq!(copy_origin(3, 4242), "remus_m3_c4242");
        assert_eq!(apply_origin(3, 0), "remus_m3_w0");
        assert_eq!(validation_origin(3, 2), "remus_m3_v2");
        assert_eq!(shadow_resolve_origin(3), "remus_m3_recovery");
        assert_eq!(origin_like_pattern(3), r"remus\_m3\_%");
        for o in [
            copy_origin(3, 1),
            apply_origin(3, 1),
            validation_origin(3, 1),
            shadow_resolve_origin(3),
        ] {
            assert!(is_migration_object(&o));
            assert!(like(&origin_like_pattern(3), &o), "{o}");
            assert!(!like(&origin_like_pattern(31), &o), "{o}");
        }
    }

    /// Enough of SQL `LIKE` (`\` escapes, `%` any suffix) for the patterns above.
    fn like(pattern: &str, s: &str) -> bool {
        let literal = pattern
            .strip_suffix('%')
            .expect("pattern ends in %")
            .replace('\\', "");
        s.starts_with(&literal)
    }

    #[test]
    fn shard_markers_round_trip() {
        let sql = shard_marked(42, "SELECT 1");
        assert_eq!(sql, "/*remus:shard=42*/ SELECT 1");
        assert_eq!(parse_shard_marker(&sql), Some(42));
        assert_eq!(parse_shard_marker("  /*remus:shard=-3*/x"), Some(-3));
        assert_eq!(parse_shard_marker("SELECT 1 /*remus:shard=42*/"), None);
        assert_eq!(parse_shard_marker("/*remus:shard=42"), None);
        assert_eq!(parse_shard_marker("/*remus:shard=x*/"), None);
    }

    #[test]
    fn fixed_names() {
        assert_eq!(MESSAGE_PREFIX_C.to_str(), Ok(MESSAGE_PREFIX));
        assert_eq!(
            STREAM_MARK_MESSAGE_PREFIX_C.to_str(),
            Ok(STREAM_MARK_MESSAGE_PREFIX)
        );
        assert_eq!(SHARD_SCHEMA_C.to_str(), Ok(SHARD_SCHEMA));
        assert_eq!(shard_table_name("accounts", 102008), "accounts_102008");
        assert_eq!(two_phase_gid("n1", 778u32, "n3"), "remus_n1_778_n3");
        assert_eq!(tm_gid(12, "n2"), "remus_tm:12:n2");
        // A Tm gid is not the 2PC gid of a node named "tm" (that one has `_` after the node).
        assert!(!tm_gid(12, "n2").starts_with("remus_tm_"));
        assert_eq!(ports::ETCD_PEER_OFFSET, ports::ETCD_CLIENT_OFFSET + 1);
        assert_eq!(ports::MAX_OFFSET, 104);
    }
}
