//! The `/*remus:shard=N*/` marker: a statement one node sends another for shard N carries it
//! at the start of its text. Which sessions honour it, and how, is the router's business
//! (`router::marker`).

use std::ffi::CStr;

/// What a marker starts with; the shard id and `*/` follow.
const PREFIX: &str = "/*remus:shard=";

/// `sql` marked for shard `shard_id`.
pub(crate) fn marked(shard_id: i64, sql: &str) -> String {
    format!("{PREFIX}{shard_id}*/ {sql}")
}

/// A marked text split after its marker (the marker with the space that follows it, the rest).
pub(crate) fn split(sql: &str) -> Option<(&str, &str)> {
    let body = sql.strip_prefix(PREFIX)?;
    let end = PREFIX.len() + body.find("*/")? + 2;
    let end = if sql[end..].starts_with(' ') {
        end + 1
    } else {
        end
    };
    Some(sql.split_at(end))
}

/// `/*remus:shard=N*/` at the start of the statement text.
pub(crate) fn parse(query_string: *const std::ffi::c_char) -> Option<i64> {
    if query_string.is_null() {
        return None;
    }
    // SAFETY: the planner's query string is NUL-terminated.
    let s = unsafe { CStr::from_ptr(query_string) }.to_str().ok()?;
    let rest = s.trim_start().strip_prefix(PREFIX)?;
    rest[..rest.find("*/")?].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_text_splits_after_its_marker() {
        let sql = marked(42, "UPDATE t SET v = 1 WHERE k = 7");
        assert_eq!(
            split(&sql),
            Some(("/*remus:shard=42*/ ", "UPDATE t SET v = 1 WHERE k = 7"))
        );
        assert_eq!(split("SELECT 1"), None);
        assert_eq!(
            split("/*remus:shard=3*/SELECT 1"),
            Some(("/*remus:shard=3*/", "SELECT 1"))
        );
        // What the opening of a remote transaction is put between.
        let (marker, rest) = split(&sql).unwrap();
        let text = format!("{marker}BEGIN ISOLATION LEVEL READ COMMITTED; {rest}");
        let c = std::ffi::CString::new(text).unwrap();
        assert_eq!(parse(c.as_ptr()), Some(42));
    }
}
