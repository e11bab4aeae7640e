//! DDL text for the triggers every shell and every shard table carries.

use remus_proto::names::CAPTURE_TRIGGER;

/// The trigger every shell carries: it refuses any write that reaches the (empty) shell.
pub(crate) fn guard_ddl(qualified: &str) -> String {
    format!(
        "CREATE TRIGGER remus_shell_guard BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON {qualified} \
         FOR EACH STATEMENT EXECUTE FUNCTION remus.shell_guard();\n"
    )
}

/// The trigger every shard table carries (created with the table).
pub fn capture_trigger_ddl(shard_table: &str, shard_id: i64) -> String {
    format!(
        "CREATE TRIGGER {CAPTURE_TRIGGER} AFTER INSERT OR UPDATE OR DELETE ON {shard_table} \
         FOR EACH ROW EXECUTE FUNCTION remus.capture_write('{shard_id}');\n"
    )
}
