//! Quoting for SQL text sent to this or another node (one copy for the whole extension).

/// Quotes an identifier for SQL text sent to this or another node.
pub fn quote_ident(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        s.to_string()
    } else {
        format!("\"{}\"", s.replace('"', "\"\""))
    }
}

/// Quotes a SQL literal for a command sent to another node.
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_are_quoted() {
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
