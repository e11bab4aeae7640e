//! The three ways a client sends a statement, for tests that check a routed statement behaves
//! the same in each; and EXPLAIN's text.

use postgres::types::{FromSql, ToSql, Type};
use postgres::{Client, SimpleQueryMessage};

#[derive(Clone, Copy, Debug)]
pub enum Protocol {
    Simple,
    /// Parse / Bind / Execute of an unnamed statement: a custom plan with the parameters bound.
    Extended,
    /// A named prepared statement under `plan_cache_mode = force_generic_plan` (set on the
    /// session, left set): parameters are read at execution.
    Prepared,
}

pub const PROTOCOLS: [Protocol; 3] = [Protocol::Simple, Protocol::Extended, Protocol::Prepared];

/// A column value as the protocol returns it: text (simple) or binary (extended), NULL as None.
/// Compare values of the same protocol only.
#[derive(Clone, Debug, PartialEq)]
pub struct Raw(pub Option<Vec<u8>>);

impl<'a> FromSql<'a> for Raw {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Raw(Some(raw.to_vec())))
    }

    fn from_sql_null(_: &Type) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Raw(None))
    }

    fn accepts(_: &Type) -> bool {
        true
    }
}

/// Runs `sql` on `db` in `protocol` with `$n` = `params[n - 1]` (bigint parameters; in the
/// simple protocol written as literals); its rows.
pub fn query(
    db: &mut Client,
    protocol: Protocol,
    sql: &str,
    params: &[i64],
) -> Result<Vec<Vec<Raw>>, postgres::Error> {
    let binary = |rows: Vec<postgres::Row>| {
        rows.iter()
            .map(|r| (0..r.len()).map(|i| r.get::<_, Raw>(i)).collect())
            .collect()
    };
    let values: Vec<&(dyn ToSql + Sync)> =
        params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
    match protocol {
        Protocol::Simple => db.simple_query(&literal(sql, params)).map(|m| {
            m.into_iter()
                .filter_map(|m| match m {
                    SimpleQueryMessage::Row(r) => Some(
                        (0..r.len())
                            .map(|i| Raw(r.get(i).map(|v| v.as_bytes().to_vec())))
                            .collect(),
                    ),
                    _ => None,
                })
                .collect()
        }),
        Protocol::Extended => db.query(sql, &values).map(binary),
        Protocol::Prepared => {
            db.batch_execute("SET plan_cache_mode = force_generic_plan")?;
            let stmt = db.prepare(sql)?;
            db.query(&stmt, &values).map(binary)
        }
    }
}

/// `sql` with `$n` replaced by `params[n - 1]` written as a literal.
pub fn literal(sql: &str, params: &[i64]) -> String {
    // From the highest number down, so that `$1` does not eat into `$12`.
    params
        .iter()
        .enumerate()
        .rev()
        .fold(sql.to_string(), |s, (i, p)| {
            s.replace(&format!("${}", i + 1), &p.to_string())
        })
}

/// The text of `EXPLAIN (<options>) <sql>` on `db`, one line per plan line.
pub fn explain(db: &mut Client, options: &str, sql: &str) -> String {
    db.simple_query(&format!("EXPLAIN ({options}) {sql}"))
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}
