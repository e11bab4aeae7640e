//! The SQL of a shadow transaction: identifier and literal quoting, the exactly-one-row guard
//! around every change, the encoding of row keys for the scheduler, and the statements of a
//! transaction's round trip ([`prepare`]). A change's values go into its statement as
//! literals ([`change_sql`], for validations) or apart from it as parameters `$1`, `$2`, …
//! sent in text format ([`prepare`], for the stream): the statement text then depends only on
//! the table, the operation and which columns are written or NULL, so an apply session
//! prepares it once and runs it with each transaction's values.

use std::collections::hash_map::DefaultHasher;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};

use remus_proto::v1::{column_value, row_change, RowChange, ShadowTxn};

use super::ApplyError;
use crate::scheduler::RowKey;

/// `"ident"` with embedded quotes doubled.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `'literal'` with embedded quotes doubled (sessions run with standard_conforming_strings).
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The set-up of a destination session bound to replication origin `origin` (created if
/// missing), for applying or validating shadows: the pg_remus session flag (the destination's
/// ownership checks let shadows through), replica role (the source already ran the user
/// triggers and checked the foreign keys; their effects are in the write set),
/// standard_conforming_strings (which [`quote_literal`] relies on) and `application_name`.
pub(crate) fn origin_session_setup(origin: &str, application_name: &str) -> String {
    let o = quote_literal(origin);
    format!(
        "SET remus.migration_session = on;
         SET session_replication_role = replica;
         SET standard_conforming_strings = on;
         SET application_name = {app};
         SELECT pg_catalog.pg_replication_origin_create({o})
           WHERE pg_catalog.pg_replication_origin_oid({o}) IS NULL;
         SELECT pg_catalog.pg_replication_origin_session_setup({o});",
        app = quote_literal(application_name),
    )
}

/// `X/Y` as PostgreSQL prints an LSN.
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// Checks that `s` is a sequence of one or two double-quoted identifiers separated by a dot,
/// as the protocol promises for TRUNCATE table names, so it can be spliced into SQL.
fn is_quoted_qualified_name(s: &str) -> bool {
    let mut parts = 0;
    let mut chars = s.chars().peekable();
    loop {
        if chars.next() != Some('"') {
            return false;
        }
        let mut empty = true;
        loop {
            match chars.next() {
                None | Some('\0') => return false,
                Some('"') if chars.peek() == Some(&'"') => {
                    chars.next();
                    empty = false;
                }
                Some('"') => break,
                Some(_) => empty = false,
            }
        }
        parts += 1;
        if empty || parts > 2 {
            return false;
        }
        match chars.next() {
            None => return true,
            Some('.') => continue,
            Some(_) => return false,
        }
    }
}

/// What a statement of the round trip was, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StmtInfo {
    pub(crate) op: &'static str,
    pub(crate) table: String,
    pub(crate) key: String,
    /// Wrapped in the exactly-one-row guard.
    pub(super) guarded: bool,
}

/// A statement whose values are parameters: `$1`… in `sql`, `params[0]`… their text (a NULL
/// is written into the text as `NULL`, not passed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ParamStmt {
    pub(super) sql: String,
    pub(super) params: Vec<String>,
}

/// A shadow transaction turned into statements and scheduling keys.
#[derive(Debug)]
pub(super) struct Prepared {
    pub(super) xid: u32,
    pub(super) commit_lsn: u64,
    pub(super) end_lsn: u64,
    /// The changes, in order, each with its parameters; `stmts` says what each one is.
    pub(super) changes: Vec<ParamStmt>,
    pub(super) stmts: Vec<StmtInfo>,
    pub(super) keys: Vec<RowKey>,
    pub(super) barrier: bool,
    /// A transaction the source validated (MOCC): committing its prepared shadow is its apply.
    pub(super) shadow_gid: Option<String>,
    pub(super) commit_time_us: i64,
    /// Each change as one unguarded statement with the same parameters as in `changes`,
    /// answering a row per row it touched ([`batch_statement`]), for [`batch_procedure`]
    /// (which checks the row counts itself); empty unless asked for.
    pub(super) batch: Vec<String>,
}

impl Prepared {
    /// Can it run in a batch ([`batch_procedure`])? Not a validated transaction (its apply is
    /// its prepared shadow's COMMIT PREPARED, which runs alone) nor a barrier (a TRUNCATE runs
    /// alone), and only once its batch statements are there.
    pub(super) fn batchable(&self) -> bool {
        self.shadow_gid.is_none()
            && !self.barrier
            && !self.changes.is_empty()
            && self.batch.len() == self.changes.len()
    }
}

pub(crate) type Value = column_value::Value;

fn value_of(v: &remus_proto::v1::ColumnValue) -> Option<&Value> {
    v.value.as_ref()
}

fn sql_value(v: &Value) -> String {
    match v {
        Value::Text(t) => quote_literal(t),
        Value::Null(_) => "NULL".into(),
        Value::UnchangedToast(_) => unreachable!("callers filter unchanged TOAST values"),
    }
}

/// Encodes the key values of a row the same way for every change of that row.
fn encode_key(values: &[(&str, &Value)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (_, v) in values {
        match v {
            Value::Text(t) => {
                out.push(1);
                out.extend_from_slice(&(t.len() as u32).to_be_bytes());
                out.extend_from_slice(t.as_bytes());
            }
            _ => out.push(0),
        }
    }
    out
}

fn relation_id(schema: &str, table: &str) -> u32 {
    let mut h = DefaultHasher::new();
    (schema, table).hash(&mut h);
    h.finish() as u32
}

/// `a = 'x' AND b IS NULL` over the key columns, plus the same as `a=x, b=NULL` for messages.
pub(crate) fn key_condition(values: &[(&str, &Value)]) -> (String, String) {
    key_condition_with(values, &mut sql_value)
}

/// [`key_condition`] with each non-NULL value written by `put` (a literal or a parameter).
fn key_condition_with(
    values: &[(&str, &Value)],
    put: &mut dyn FnMut(&Value) -> String,
) -> (String, String) {
    let mut cond = String::new();
    let mut shown = String::new();
    for (i, (col, v)) in values.iter().enumerate() {
        if i > 0 {
            cond.push_str(" AND ");
            shown.push_str(", ");
        }
        match v {
            Value::Null(_) => {
                let _ = write!(cond, "{} IS NULL", quote_ident(col));
                let _ = write!(shown, "{col}=NULL");
            }
            other => {
                let _ = write!(cond, "{} = {}", quote_ident(col), put(other));
                let _ = write!(shown, "{col}={}", sql_value(other));
            }
        }
    }
    (cond, shown)
}

/// Wraps a statement so that it fails with `division_by_zero` unless it touched exactly one row.
fn guard(dml: &str) -> String {
    let returning = if dml.starts_with("SELECT") {
        ""
    } else {
        " RETURNING 1"
    };
    format!("WITH w AS ({dml}{returning}) SELECT 1/(count(*) = 1)::int FROM w")
}

pub(crate) type Row<'a> = Vec<(&'a str, &'a Value)>;

/// The values of one row, paired with their column names; every value must be set.
pub(crate) fn row_values<'a>(
    xid: u32,
    table: &str,
    c: &'a RowChange,
    vals: &'a [remus_proto::v1::ColumnValue],
    what: &str,
) -> Result<Row<'a>, ApplyError> {
    let malformed = |reason: String| ApplyError::Malformed { xid, reason };
    if vals.len() != c.columns.len() {
        return Err(malformed(format!(
            "{table}: {what} has {} values for {} columns",
            vals.len(),
            c.columns.len()
        )));
    }
    vals.iter()
        .zip(&c.columns)
        .map(|(v, col)| {
            value_of(v)
                .map(|v| (col.as_str(), v))
                .ok_or_else(|| malformed(format!("{table}: {what} value of {col} is unset")))
        })
        .collect()
}

/// The key columns of a row; there must be some, and none may be an unchanged TOAST value.
pub(crate) fn key_values<'a>(
    xid: u32,
    table: &str,
    c: &RowChange,
    vals: &Row<'a>,
    what: &str,
) -> Result<Row<'a>, ApplyError> {
    let malformed = |reason: String| ApplyError::Malformed { xid, reason };
    let key: Row<'a> = vals
        .iter()
        .zip(&c.key)
        .filter(|(_, k)| **k)
        .map(|(v, _)| *v)
        .collect();
    if key.is_empty() {
        return Err(malformed(format!("{table} has no key columns")));
    }
    if key
        .iter()
        .any(|(_, v)| matches!(v, Value::UnchangedToast(_)))
    {
        return Err(malformed(format!(
            "{table}: {what} key has an unchanged TOAST value"
        )));
    }
    Ok(key)
}

pub(crate) struct ChangeSql {
    pub(crate) sql: String,
    /// The same statement without the guard around it (a TRUNCATE is never guarded).
    pub(crate) dml: String,
    pub(crate) info: StmtInfo,
    keys: Vec<RowKey>,
}

/// A change as one statement with its values as literals.
pub(crate) fn change_sql(xid: u32, c: &RowChange) -> Result<ChangeSql, ApplyError> {
    change_with(xid, c, &mut sql_value)
}

/// A change as one statement with its values as parameters, and those values.
fn change_params(xid: u32, c: &RowChange) -> Result<(ChangeSql, Vec<String>), ApplyError> {
    let mut params = Vec::new();
    let cs = change_with(xid, c, &mut |v: &Value| match v {
        Value::Text(t) => {
            params.push(t.clone());
            format!("${}", params.len())
        }
        other => sql_value(other),
    })?;
    Ok((cs, params))
}

/// A change as one statement, each value written into it by `put`.
fn change_with(
    xid: u32,
    c: &RowChange,
    put: &mut dyn FnMut(&Value) -> String,
) -> Result<ChangeSql, ApplyError> {
    let malformed = |reason: String| ApplyError::Malformed { xid, reason };
    let kind = row_change::Kind::try_from(c.kind)
        .map_err(|_| malformed(format!("unknown change kind {}", c.kind)))?;
    if kind == row_change::Kind::Truncate {
        if c.truncate_tables.is_empty() {
            return Err(malformed("TRUNCATE without tables".into()));
        }
        if let Some(bad) = c
            .truncate_tables
            .iter()
            .find(|t| !is_quoted_qualified_name(t))
        {
            return Err(malformed(format!(
                "TRUNCATE table name {bad:?} is not a quoted qualified name"
            )));
        }
        let list = c.truncate_tables.join(", ");
        return Ok(ChangeSql {
            sql: format!("TRUNCATE {list}"),
            dml: format!("TRUNCATE {list}"),
            info: StmtInfo {
                op: "TRUNCATE",
                table: list,
                key: String::new(),
                guarded: false,
            },
            keys: Vec::new(),
        });
    }

    if c.table.is_empty() || c.columns.is_empty() || c.key.len() != c.columns.len() {
        return Err(malformed(format!(
            "change on {:?}.{:?} has {} columns and {} key flags",
            c.schema,
            c.table,
            c.columns.len(),
            c.key.len()
        )));
    }
    let table = if c.schema.is_empty() {
        quote_ident(&c.table)
    } else {
        format!("{}.{}", quote_ident(&c.schema), quote_ident(&c.table))
    };
    let relid = relation_id(&c.schema, &c.table);
    let row = |vals, what| row_values(xid, &table, c, vals, what);
    let key_of = |vals, what| key_values(xid, &table, c, vals, what);

    let (op, sql, shown_key, keys) = match kind {
        row_change::Kind::Insert => {
            let new = row(&c.new_values, "new row")?;
            if new
                .iter()
                .any(|(_, v)| matches!(v, Value::UnchangedToast(_)))
            {
                return Err(malformed(format!(
                    "{table}: INSERT with an unchanged TOAST value"
                )));
            }
            let key = key_of(&new, "new")?;
            let cols: Vec<String> = new.iter().map(|(c, _)| quote_ident(c)).collect();
            let vals: Vec<String> = new.iter().map(|(_, v)| put(v)).collect();
            let sql = format!(
                "INSERT INTO {table} ({}) OVERRIDING SYSTEM VALUE VALUES ({})",
                cols.join(", "),
                vals.join(", ")
            );
            let (_, shown) = key_condition(&key);
            let keys = vec![RowKey::new(relid, encode_key(&key))];
            ("INSERT", sql, shown, keys)
        }
        row_change::Kind::Update => {
            let new = row(&c.new_values, "new row")?;
            let new_key = key_of(&new, "new")?;
            let old = if c.old_values.is_empty() {
                None
            } else {
                Some(row(&c.old_values, "old row")?)
            };
            let old_key = match &old {
                Some(old) => key_of(old, "old")?,
                None => new_key.clone(),
            };
            let old_encoded = encode_key(&old_key);
            let new_encoded = encode_key(&new_key);
            // An unchanged key is not SET: a GENERATED ALWAYS identity key refuses any value.
            let key_changed = old_encoded != new_encoded;
            let set: Vec<String> = new
                .iter()
                .zip(&c.key)
                .filter(|((_, v), is_key)| {
                    !matches!(v, Value::UnchangedToast(_)) && (key_changed || !**is_key)
                })
                .map(|((c, v), _)| format!("{} = {}", quote_ident(c), put(v)))
                .collect();
            let (cond, shown) = key_condition_with(&old_key, put);
            let sql = if set.is_empty() {
                // Nothing to write (only unchanged TOAST values besides the key): the row must
                // still exist.
                format!("SELECT 1 FROM {table} WHERE {cond} FOR UPDATE")
            } else {
                format!("UPDATE {table} SET {} WHERE {cond}", set.join(", "))
            };
            let mut keys = vec![RowKey::new(relid, old_encoded)];
            if key_changed {
                keys.push(RowKey::new(relid, new_encoded));
            }
            ("UPDATE", sql, shown, keys)
        }
        row_change::Kind::Delete => {
            let old = row(&c.old_values, "old row")?;
            let key = key_of(&old, "old")?;
            let (cond, shown) = key_condition_with(&key, put);
            let sql = format!("DELETE FROM {table} WHERE {cond}");
            (
                "DELETE",
                sql,
                shown,
                vec![RowKey::new(relid, encode_key(&key))],
            )
        }
        row_change::Kind::Truncate => unreachable!("handled above"),
    };
    Ok(ChangeSql {
        sql: guard(&sql),
        dml: sql,
        info: StmtInfo {
            op,
            table,
            key: shown_key,
            guarded: true,
        },
        keys,
    })
}

/// The statement before a catch-up shadow's COMMIT: the source's commit LSN (`$1`) and time
/// (`$2`, microseconds since 2000-01-01 UTC) recorded under the session's replication origin,
/// and an asynchronous commit (`SET LOCAL synchronous_commit = off`): as PostgreSQL's own apply
/// worker does, the slot is only confirmed up to what the destination has flushed since
/// (decision 0018, `ShadowApplier`'s durable position), so a destination crash that loses the
/// commit loses nothing the source has forgotten.
pub(super) const ORIGIN_SETUP: &str = "SELECT pg_catalog.pg_replication_origin_xact_setup(\
     $1::pg_catalog.text::pg_catalog.pg_lsn, '2000-01-01 00:00:00+00'::pg_catalog.timestamptz \
     + ($2::pg_catalog.text || ' microseconds')::pg_catalog.interval), \
     pg_catalog.set_config('synchronous_commit', 'off', true)";

/// A shipped transaction as its round trip: `BEGIN`, the guarded changes with their
/// parameters, [`ORIGIN_SETUP`], `COMMIT`. A transaction the source validated is its prepared
/// shadow's COMMIT PREPARED instead (always flushed).
/// `batched`: also write each change's unguarded statement for batches ([`Prepared::batch`]).
pub(super) fn prepare(txn: &ShadowTxn, batched: bool) -> Result<Prepared, ApplyError> {
    let mut changes = Vec::with_capacity(txn.changes.len());
    let mut stmts = Vec::with_capacity(txn.changes.len());
    let mut keys = Vec::new();
    let mut batch = Vec::new();
    let mut barrier = false;
    for c in &txn.changes {
        let (cs, params) = change_params(txn.xid, c)?;
        barrier |= cs.info.op == "TRUNCATE";
        if batched {
            batch.push(batch_statement(&cs.dml));
        }
        changes.push(ParamStmt {
            sql: cs.sql,
            params,
        });
        stmts.push(cs.info);
        keys.extend(cs.keys);
    }
    let validated = !txn.shadow_gid.is_empty();
    if validated {
        // Its changes are in the prepared shadow already; they still give its key set, so
        // dependent transactions wait for the commit.
        changes.clear();
        stmts.clear();
        batch.clear();
        barrier = false;
    }
    Ok(Prepared {
        xid: txn.xid,
        commit_lsn: txn.commit_lsn,
        end_lsn: txn.end_lsn,
        changes,
        stmts,
        keys,
        barrier,
        shadow_gid: validated.then(|| txn.shadow_gid.clone()),
        commit_time_us: txn.commit_time_us,
        batch,
    })
}

/// A change's unguarded statement as a batch runs it: answering one row per row it touched,
/// so that the procedure's `ROW_COUNT` is that count (an `EXECUTE` of a prepared statement
/// reports no count of its own); a `SELECT … FOR UPDATE` answers its rows already.
fn batch_statement(dml: &str) -> String {
    if dml.starts_with("SELECT") {
        dml.to_string()
    } else {
        format!("{dml} RETURNING 1")
    }
}

/// How a batch runs one change: `EXECUTE` of the session's prepared statement `name` (the
/// change's [`batch_statement`], prepared once per session and shape, so its plan is kept)
/// with the change's parameters as literals; PostgreSQL reads each one with the input
/// function of the parameter's type, as it reads a parameter sent in text format.
pub(super) fn execute_prepared(name: &str, params: &[String]) -> String {
    let mut sql = format!("EXECUTE {name}");
    for (i, p) in params.iter().enumerate() {
        sql.push_str(if i == 0 { "(" } else { ", " });
        sql.push_str(&quote_literal(p));
    }
    if !params.is_empty() {
        sql.push(')');
    }
    sql
}

/// The session-local procedure that applies a batch of shadow transactions in one CALL
/// (design note 0003), created on each apply session when batches are on ([`batch_setup`]) and
/// replaced each time the session gives a shape a static statement. Each transaction in turn:
/// its origin position and the source's commit time, its changes in order, the exactly-one-row
/// check of every guarded change (the same `division_by_zero` as the guard's), `COMMIT`; then
/// the commit position of the transaction just committed goes into a session sequence, which
/// no rollback undoes, so that after an error [`BATCH_DONE`] tells which ones committed. Not
/// the session's replication origin: its progress only moves forward, and a session can commit
/// a transaction after a later one of the source (one that waited for another session's). A
/// position rather than a count: a call that fails before its first commit (or before it
/// starts) leaves an earlier batch's position there, which names none of this batch's
/// transactions (every source transaction has its own commit position), where a count would.
///
/// A change runs as one of `statics` (its shape's number, from 1: [`static_statement`], PL/pgSQL
/// keeps its plan and reads its values from the flat text array `params` from the change's
/// offset), or, shape 0, as its `EXECUTE` of a statement the session prepared for its shape,
/// with its values as literals ([`execute_prepared`]).
///
/// Arguments: per transaction its commit position (bytes past 0/0) and time (microseconds since
/// 2000-01-01 UTC); per change the number (from 1) of its transaction, its `EXECUTE` (shape 0),
/// whether it is guarded, its static shape (0: none) and the offset of its values in `params`.
/// Every name starts with `remus_b_`, which no static statement contains ([`static_statement`]),
/// so that no column of a shard table can be taken for one of them. Must be called outside a
/// transaction block, so that it may commit.
pub(super) fn batch_procedure(statics: &[String]) -> String {
    let run = if statics.is_empty() {
        "EXECUTE remus_b_change_sql[remus_b_c];".to_string()
    } else {
        let mut cases = String::from("remus_b_at := remus_b_param_at[remus_b_c];\n      CASE remus_b_change_shape[remus_b_c]\n");
        for (i, statement) in statics.iter().enumerate() {
            let _ = writeln!(cases, "        WHEN {} THEN {statement};", i + 1);
        }
        cases.push_str("        ELSE EXECUTE remus_b_change_sql[remus_b_c];\n      END CASE;");
        cases
    };
    format!(
        "CREATE OR REPLACE PROCEDURE pg_temp.remus_apply_batch(
    remus_b_lsns bigint[], remus_b_times_us bigint[], remus_b_change_txn int[],
    remus_b_change_sql text[], remus_b_change_guarded bool[], remus_b_change_shape int[],
    remus_b_param_at int[], remus_b_params text[])
LANGUAGE plpgsql AS {DOLLAR}
DECLARE
  remus_b_c int := 1;
  remus_b_changes int := coalesce(array_length(remus_b_change_sql, 1), 0);
  remus_b_touched bigint;
  remus_b_at int;
BEGIN
  FOR remus_b_t IN 1 .. coalesce(array_length(remus_b_lsns, 1), 0) LOOP
    PERFORM pg_catalog.pg_replication_origin_xact_setup(
      '0/0'::pg_catalog.pg_lsn + remus_b_lsns[remus_b_t],
      '2000-01-01 00:00:00+00'::pg_catalog.timestamptz
        + remus_b_times_us[remus_b_t] * '1 microsecond'::pg_catalog.interval);
    WHILE remus_b_c <= remus_b_changes AND remus_b_change_txn[remus_b_c] = remus_b_t LOOP
      {run}
      GET DIAGNOSTICS remus_b_touched = ROW_COUNT;
      IF remus_b_change_guarded[remus_b_c] AND remus_b_touched <> 1 THEN
        RAISE EXCEPTION 'change % of transaction % of the batch touched % rows, not 1',
          remus_b_c, remus_b_t, remus_b_touched USING ERRCODE = 'division_by_zero';
      END IF;
      remus_b_c := remus_b_c + 1;
    END LOOP;
    COMMIT;
    PERFORM pg_catalog.setval('pg_temp.remus_apply_batch_done', remus_b_lsns[remus_b_t], true);
  END LOOP;
END {DOLLAR};"
    )
}

/// The dollar quote of [`batch_procedure`]'s body.
const DOLLAR: &str = "$remus_batch$";

/// What an apply session runs once when batches are on: `synchronous_commit` off for the
/// session (every catch-up shadow commits asynchronously, decision 0018; the lone path sets it
/// per transaction too; a validated shadow's COMMIT PREPARED flushes whatever the setting, as
/// every 2PC commit does), [`batch_procedure`] without static statements, and the progress
/// sequence.
pub(super) fn batch_setup() -> String {
    format!(
        "{SESSION_ASYNC_COMMIT}\n{};\n\
         CREATE TEMPORARY SEQUENCE remus_apply_batch_done MINVALUE 0 START 0;",
        batch_procedure(&[])
    )
}

/// `synchronous_commit` off for the session: what an apply session runs once when batches are
/// on, through either procedure (every catch-up shadow commits asynchronously, decision 0018).
pub(super) const SESSION_ASYNC_COMMIT: &str = "SET synchronous_commit = off;";

/// The CALL of [`batch_procedure`].
pub(super) const BATCH_CALL: &str = "CALL pg_temp.remus_apply_batch($1::bigint[], $2::bigint[], \
                                     $3::int[], $4::text[], $5::bool[], $6::int[], $7::int[], \
                                     $8::text[])";

/// Shapes a session gives a static statement in its batch procedure, at most; the others run
/// by `EXECUTE`. A few per table (its INSERT, its UPDATE of every column, its DELETE) cover
/// most workloads, and every static statement is one more branch of the procedure's `CASE`.
pub(super) const STATIC_SHAPES: usize = 16;

/// Parameter types (as `pg_prepared_statements.parameter_types` names them) a static statement
/// casts its text values to. For these a cast from text is the type's input function, which is
/// also how PostgreSQL reads an untyped literal or a parameter sent in text format; a type
/// with a cast of its own from text (`"char"`, `name`, `xml`, `regclass`, …), `character`
/// (which, named without its length, is `character(1)` and would cut the value) or a user type
/// stays on the `EXECUTE` path.
const STATIC_TYPES: &[&str] = &[
    "smallint",
    "integer",
    "bigint",
    "numeric",
    "real",
    "double precision",
    "boolean",
    "text",
    "character varying",
    "bytea",
    "uuid",
    "date",
    "time without time zone",
    "timestamp without time zone",
    "timestamp with time zone",
    "interval",
    "json",
    "jsonb",
];

/// A batch statement ([`batch_statement`]) as a static statement of [`batch_procedure`]:
/// without its `RETURNING` (a static statement sets `ROW_COUNT` itself), each `$n` replaced by
/// the change's n-th value cast to `types[n - 1]`. None when it cannot be one: a `SELECT …
/// FOR UPDATE`, a type not in [`STATIC_TYPES`], a parameter without a type, or a text that
/// contains the procedure's names or dollar quote (a quoted identifier can hold anything).
pub(super) fn static_statement(shape: &str, types: &[String]) -> Option<String> {
    let dml = shape.strip_suffix(" RETURNING 1")?;
    if dml.contains("remus_b_") || dml.contains(DOLLAR) {
        return None;
    }
    if !types.iter().all(|t| STATIC_TYPES.contains(&t.as_str())) {
        return None;
    }
    let mut out = String::with_capacity(dml.len() + 32 * types.len());
    let mut quoted = false;
    let mut chars = dml.chars().peekable();
    while let Some(ch) = chars.next() {
        if ch == '"' {
            // A doubled quote inside an identifier toggles twice.
            quoted = !quoted;
            out.push(ch);
        } else if ch == '$' && !quoted && chars.peek().is_some_and(char::is_ascii_digit) {
            let mut n = 0usize;
            while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                n = n.checked_mul(10)?.checked_add(d as usize)?;
                chars.next();
            }
            let ty = types.get(n.checked_sub(1)?)?;
            let _ = write!(out, "(remus_b_params[remus_b_at + {n}])::{ty}");
        } else {
            out.push(ch);
        }
    }
    Some(out)
}

/// Whether the node has `remus.apply_batch` (pg_remus 0.2.0 on): batches then go through it
/// ([`NATIVE_BATCH_CALL`]) instead of the session's PL/pgSQL procedure.
pub(super) const NATIVE_BATCH_PRESENT: &str = "SELECT pg_catalog.to_regprocedure(\
    'remus.apply_batch(bigint[], bigint[], integer[], text[], boolean[], integer[], text[])') \
    IS NOT NULL";

/// The CALL of the node's `remus.apply_batch` (`pg_remus/src/migration/apply_batch.rs`): per
/// transaction its commit position and time, per change the number of its transaction, the
/// name of its shape's prepared statement (kept by `remus.apply_shape`), whether it is guarded
/// and the offset of its values in the flat array of values.
pub(super) const NATIVE_BATCH_CALL: &str = "CALL remus.apply_batch($1::bigint[], $2::bigint[], \
                                            $3::int[], $4::text[], $5::bool[], $6::int[], \
                                            $7::text[])";

/// The commit position of the last transaction a [`NATIVE_BATCH_CALL`] committed in this
/// session (0 before any).
pub(super) const NATIVE_BATCH_DONE: &str = "SELECT remus.apply_batch_done()";

/// The commit position of the last transaction a [`BATCH_CALL`] committed (0 before any).
pub(super) const BATCH_DONE: &str = "SELECT last_value FROM pg_temp.remus_apply_batch_done";

/// [`ORIGIN_SETUP`]'s parameters for `p`.
pub(super) fn origin_params(p: &Prepared) -> [String; 2] {
    [format_lsn(p.commit_lsn), p.commit_time_us.to_string()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use remus_proto::v1::ColumnValue as PbValue;

    fn text(s: &str) -> PbValue {
        PbValue {
            value: Some(Value::Text(s.into())),
        }
    }
    fn null() -> PbValue {
        PbValue {
            value: Some(Value::Null(true)),
        }
    }
    fn toast() -> PbValue {
        PbValue {
            value: Some(Value::UnchangedToast(true)),
        }
    }

    fn change(kind: row_change::Kind, old: Vec<PbValue>, new: Vec<PbValue>) -> RowChange {
        RowChange {
            kind: kind as i32,
            schema: "s".into(),
            table: "t\"x".into(),
            columns: vec!["id".into(), "v".into()],
            key: vec![true, false],
            old_values: old,
            new_values: new,
            truncate_tables: vec![],
        }
    }

    fn txn(changes: Vec<RowChange>) -> ShadowTxn {
        ShadowTxn {
            xid: 7,
            commit_lsn: 0x1_0000_0010,
            end_lsn: 0x1_0000_0040,
            commit_time_us: 123,
            changes,
            shadow_gid: String::new(),
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's \\"), "'it''s \\'");
        assert_eq!(format_lsn(0x1_0000_0010), "1/10");
        assert!(is_quoted_qualified_name("\"a\".\"b\"\"c\""));
        assert!(is_quoted_qualified_name("\"t\""));
        for bad in [
            "a.b",
            "\"a\".b",
            "\"a\"; DROP",
            "\"a\".\"b\".\"c\"",
            "\"\"",
            "\"a",
        ] {
            assert!(!is_quoted_qualified_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_batch_gets_each_change_unguarded_answering_its_rows() {
        use row_change::Kind::*;
        let changes = vec![
            change(Insert, vec![], vec![text("1"), text("o'k")]),
            change(Update, vec![text("1"), null()], vec![text("2"), null()]),
            change(Delete, vec![text("2"), null()], vec![]),
            change(Update, vec![text("3"), null()], vec![text("3"), toast()]),
        ];
        let p = prepare(&txn(changes.clone()), true).unwrap();
        assert!(p.batchable());
        assert_eq!(
            p.batch,
            [
                "INSERT INTO \"s\".\"t\"\"x\" (\"id\", \"v\") OVERRIDING SYSTEM VALUE VALUES ($1, $2) RETURNING 1",
                "UPDATE \"s\".\"t\"\"x\" SET \"id\" = $1, \"v\" = NULL WHERE \"id\" = $2 RETURNING 1",
                "DELETE FROM \"s\".\"t\"\"x\" WHERE \"id\" = $1 RETURNING 1",
                "SELECT 1 FROM \"s\".\"t\"\"x\" WHERE \"id\" = $1 FOR UPDATE",
            ]
        );
        assert_eq!(
            execute_prepared("s7", &p.changes[0].params),
            "EXECUTE s7('1', 'o''k')"
        );
        assert_eq!(execute_prepared("s8", &[]), "EXECUTE s8");
        // Every change is still guarded: the batch checks the row counts of those.
        assert!(p.stmts.iter().all(|s| s.guarded));
        // Not asked for: no batch statements, and so not batchable.
        let p = prepare(&txn(changes), false).unwrap();
        assert!(p.batch.is_empty() && !p.batchable());
        assert!(batch_procedure(&[]).contains("ERRCODE = 'division_by_zero'"));
        // Catch-up shadows commit asynchronously: the session says so once, not each one.
        assert!(batch_setup().contains("SET synchronous_commit = off;"));
        assert!(!batch_setup().contains("set_config"));
    }

    #[test]
    fn static_statements_cast_each_value_and_leave_quoted_names_alone() {
        let types = |t: &[&str]| t.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            static_statement(
                "UPDATE \"s\".\"t$1\"\"x\" SET \"v\" = $1, \"w\" = NULL WHERE \"id\" = $2 RETURNING 1",
                &types(&["text", "bigint"])
            )
            .as_deref(),
            Some(
                "UPDATE \"s\".\"t$1\"\"x\" SET \"v\" = (remus_b_params[remus_b_at + 1])::text, \
                 \"w\" = NULL WHERE \"id\" = (remus_b_params[remus_b_at + 2])::bigint"
            )
        );
        let many: Vec<String> = (0..10).map(|_| "integer".to_string()).collect();
        let ten =
            static_statement("DELETE FROM \"t\" WHERE \"k\" = $10 RETURNING 1", &many).unwrap();
        assert!(
            ten.ends_with("(remus_b_params[remus_b_at + 10])::integer"),
            "{ten}"
        );
        // Not static: a SELECT … FOR UPDATE, a type with a cast of its own, a value without a
        // type, the procedure's own names or dollar quote in an identifier.
        let select = "SELECT 1 FROM \"t\" WHERE \"k\" = $1 FOR UPDATE";
        assert_eq!(static_statement(select, &types(&["integer"])), None);
        let one = "DELETE FROM \"t\" WHERE \"k\" = $1 RETURNING 1";
        assert_eq!(static_statement(one, &types(&["\"char\""])), None);
        assert_eq!(static_statement(one, &types(&["mytype"])), None);
        assert_eq!(static_statement(one, &types(&["character"])), None);
        assert_eq!(static_statement(one, &[]), None);
        let own = "DELETE FROM \"t\" WHERE \"remus_b_c\" = $1 RETURNING 1";
        assert_eq!(static_statement(own, &types(&["integer"])), None);
        let dollar = "DELETE FROM \"$remus_batch$\" WHERE \"k\" = $1 RETURNING 1";
        assert_eq!(static_statement(dollar, &types(&["integer"])), None);
        // The procedure dispatches on the shape's number, and falls back to EXECUTE.
        let proc = batch_procedure(&["DELETE FROM \"t\"".to_string()]);
        assert!(proc.contains("WHEN 1 THEN DELETE FROM \"t\";"), "{proc}");
        assert!(
            proc.contains("ELSE EXECUTE remus_b_change_sql[remus_b_c];"),
            "{proc}"
        );
    }

    #[test]
    fn statements_are_guarded_and_quoted() {
        use row_change::Kind::*;
        let p = prepare(
            &txn(vec![
                change(Insert, vec![], vec![text("1"), text("o'k")]),
                change(Update, vec![], vec![text("1"), toast()]),
                change(Update, vec![text("1"), null()], vec![text("2"), null()]),
                change(Delete, vec![text("2"), null()], vec![]),
            ]),
            false,
        )
        .unwrap();
        let stmt = |i: usize| (p.changes[i].sql.as_str(), p.changes[i].params.clone());
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            stmt(0),
            (
                "WITH w AS (INSERT INTO \"s\".\"t\"\"x\" (\"id\", \"v\") OVERRIDING SYSTEM VALUE \
                 VALUES ($1, $2) RETURNING 1) SELECT 1/(count(*) = 1)::int FROM w",
                owned(&["1", "o'k"])
            )
        );
        // An unchanged TOAST value and an unchanged key are not written: the row must exist.
        assert_eq!(
            stmt(1),
            (
                "WITH w AS (SELECT 1 FROM \"s\".\"t\"\"x\" WHERE \"id\" = $1 FOR UPDATE) \
                 SELECT 1/(count(*) = 1)::int FROM w",
                owned(&["1"])
            )
        );
        // SET values first, then the old key; a NULL is written into the text.
        assert!(
            stmt(1).0 != stmt(2).0
                && stmt(2)
                    .0
                    .contains("SET \"id\" = $1, \"v\" = NULL WHERE \"id\" = $2 RETURNING"),
            "{}",
            stmt(2).0
        );
        assert_eq!(stmt(2).1, owned(&["2", "1"]));
        assert!(stmt(3)
            .0
            .contains("DELETE FROM \"s\".\"t\"\"x\" WHERE \"id\" = $1 RETURNING"));
        assert_eq!(stmt(3).1, owned(&["2"]));
        // The same shape with other values is the same statement text.
        let again = prepare(
            &txn(vec![change(Insert, vec![], vec![text("9"), text("z")])]),
            false,
        )
        .unwrap();
        assert_eq!(again.changes[0].sql, p.changes[0].sql);
        assert_eq!(origin_params(&p), ["1/10".to_string(), "123".to_string()]);
        assert!(ORIGIN_SETUP.contains("set_config('synchronous_commit', 'off', true)"));
        assert!(!p.barrier);
        // Key 1 (insert, update, update-old) and key 2 (update-new, delete).
        let distinct: std::collections::BTreeSet<_> = p.keys.iter().collect();
        assert_eq!(distinct.len(), 2);
        assert_eq!(p.keys.len(), 5);
    }

    #[test]
    fn truncate_is_a_barrier_and_names_are_validated() {
        let mut c = change(row_change::Kind::Truncate, vec![], vec![]);
        c.truncate_tables = vec!["\"s\".\"a\"".into(), "\"s\".\"b\"".into()];
        let p = prepare(&txn(vec![c.clone()]), false).unwrap();
        assert!(p.barrier && p.keys.is_empty());
        assert_eq!(p.changes[0].sql, "TRUNCATE \"s\".\"a\", \"s\".\"b\"");
        c.truncate_tables = vec!["s.a; DROP TABLE x".into()];
        assert!(matches!(
            prepare(&txn(vec![c]), false),
            Err(ApplyError::Malformed { xid: 7, .. })
        ));
    }

    #[test]
    fn malformed_changes_are_refused() {
        use row_change::Kind::*;
        let cases = [
            change(Insert, vec![], vec![text("1")]),
            change(Insert, vec![], vec![text("1"), toast()]),
            change(Update, vec![], vec![toast(), text("x")]),
            change(Delete, vec![], vec![]),
            change(Insert, vec![], vec![PbValue { value: None }, text("x")]),
        ];
        for c in cases {
            assert!(
                matches!(
                    prepare(&txn(vec![c.clone()]), false),
                    Err(ApplyError::Malformed { .. })
                ),
                "{c:?}"
            );
        }
    }
}
