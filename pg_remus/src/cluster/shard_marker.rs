//! The `/*remus:shard=N*/` marker: a statement one node sends another for shard N carries it
//! at the start of its text. Which sessions honour it, and how, is the router's business
//! (`router::marker`).

use std::ffi::CStr;

/// `sql` marked for shard `shard_id`.
pub(crate) fn marked(shard_id: i64, sql: &str) -> String {
    format!("/*remus:shard={shard_id}*/ {sql}")
}

/// `/*remus:shard=N*/` at the start of the statement text.
pub(crate) fn parse(query_string: *const std::ffi::c_char) -> Option<i64> {
    if query_string.is_null() {
        return None;
    }
    // SAFETY: the planner's query string is NUL-terminated.
    let s = unsafe { CStr::from_ptr(query_string) }.to_str().ok()?;
    let rest = s.trim_start().strip_prefix("/*remus:shard=")?;
    rest[..rest.find("*/")?].parse().ok()
}
