//! DDL text for the triggers every shell and every shard table carries.

/// The trigger every shell carries: it refuses any write that reaches the (empty) shell.
pub(crate) fn guard_ddl(qualified: &str) -> String {
    format!(
        "CREATE TRIGGER remus_shell_guard BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON {qualified} \
         FOR EACH STATEMENT EXECUTE FUNCTION remus.shell_guard();\n"
    )
}

/// The trigger every shard table carries (created with the table): its DDL is shared with the
/// coordinator, which adds it on a migration's target (`remus_proto::names`).
pub use remus_proto::names::capture_trigger_ddl;
