//! DDL text for the triggers every shell and every shard table carries.

use remus_proto::names::CAPTURE_TRIGGER;

/// The trigger every shell carries: it refuses any write that reaches the (empty) shell.
pub(crate) fn guard_ddl(qualified: &str) -> String {
    format!(
        "CREATE TRIGGER remus_shell_guard BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON {qualified} \
         FOR EACH STATEMENT EXECUTE FUNCTION remus.shell_guard();\n"
    )
}

/// The trigger every shard table carries (created with the table). ENABLE ALWAYS: a session in
/// `session_replication_role = replica` (a superuser's, a logical-replication apply worker's)
/// must be captured too, or its commit would skip validation and be applied blindly on the
/// destination after Tm (review finding F14). The migration's own replica-role sessions return
/// at once (`remus.migration_session`).
pub fn capture_trigger_ddl(shard_table: &str, shard_id: i64) -> String {
    format!(
        "CREATE TRIGGER {CAPTURE_TRIGGER} AFTER INSERT OR UPDATE OR DELETE ON {shard_table} \
         FOR EACH ROW EXECUTE FUNCTION remus.capture_write('{shard_id}');\n\
         ALTER TABLE {shard_table} ENABLE ALWAYS TRIGGER {CAPTURE_TRIGGER};\n"
    )
}
