//! One destination session bound to a replication origin, and what runs a shadow transaction's
//! round trip on it (plus COMMIT/ROLLBACK PREPARED of validated shadows).

use std::collections::HashMap;
use std::fmt::Write as _;

use remus_proto::names::apply_origin;
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{Format, IsNull, ToSql, Type};
use tokio_postgres::{Client, NoTls, Statement};
use tracing::{debug, warn, Instrument};

use super::sql::{
    batch_procedure, batch_setup, execute_prepared, format_lsn, origin_params,
    origin_session_setup, quote_literal, static_statement, Prepared, BATCH_CALL, BATCH_DONE,
    NATIVE_BATCH_CALL, NATIVE_BATCH_DONE, NATIVE_BATCH_PRESENT, ORIGIN_SETUP, SESSION_ASYNC_COMMIT,
    STATIC_SHAPES,
};
use super::{pg_message, ApplyConfig, ApplyError};

/// Commits prepared transaction `gid` with the source's commit LSN and time recorded under the
/// session's replication origin. Ok(false) when it does not exist (already resolved). A
/// concurrent resolver holding it ("busy") is waited out.
pub(crate) async fn commit_prepared_with_origin(
    client: &Client,
    gid: &str,
    commit_lsn: u64,
    commit_time_us: i64,
) -> Result<bool, tokio_postgres::Error> {
    let setup = format!(
        "SELECT pg_catalog.pg_replication_origin_xact_setup('{}'::pg_catalog.pg_lsn, \
         '2000-01-01 00:00:00+00'::timestamptz + interval '{} microseconds')",
        format_lsn(commit_lsn),
        commit_time_us
    );
    let commit = format!("COMMIT PREPARED {}", quote_literal(gid));
    // The values are session globals that the next transaction would reuse, hence the reset.
    const RESET: &str = "SELECT pg_catalog.pg_replication_origin_xact_reset()";
    // The first try in one flight (tokio-postgres sends each query when its future is first
    // polled, and `join!` polls them in order): a source commit waits for this, and under load
    // every round trip costs a wake-up of the destination's backend. Were the setup to fail,
    // the commit would only miss its origin's progress, which a later commit advances past.
    let (setup_done, committed, reset) = tokio::join!(
        client.batch_execute(&setup),
        client.batch_execute(&commit),
        client.batch_execute(RESET)
    );
    let found = match committed {
        Ok(()) => {
            if let Err(e) = setup_done {
                warn!(gid, error = %e, "origin setup before COMMIT PREPARED failed; committed without it");
            }
            true
        }
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_OBJECT) => false,
        // Busy (another session is finishing it) or failed: the careful path, in turn.
        Err(_) => {
            let result = finish_prepared(client, &commit, Some(&setup)).await;
            let reset = client.batch_execute(RESET).await;
            let found = result?;
            reset?;
            return Ok(found);
        }
    };
    reset?;
    Ok(found)
}

/// Runs COMMIT/ROLLBACK PREPARED (alone: it refuses to share a query string), after `before`.
/// Ok(false) when no such prepared transaction exists (SQLSTATE 42704: already finished).
pub(crate) async fn finish_prepared(
    client: &Client,
    statement: &str,
    before: Option<&str>,
) -> Result<bool, tokio_postgres::Error> {
    // Up to ~10 s: a concurrent COMMIT PREPARED only has to write and flush its commit record.
    // Polled every millisecond: the source's post-commit call and the stream race for every
    // validated shadow, and the loser's wait is a source client's (or every later
    // validation's) wait; at 5 ms it lost 2.5 ms on average, longer than the flush it waits for.
    const BUSY_POLL: std::time::Duration = std::time::Duration::from_millis(1);
    const BUSY_RETRIES: u32 = 10_000;
    let mut attempt = 0;
    loop {
        if let Some(before) = before {
            client.batch_execute(before).await?;
        }
        match client.batch_execute(statement).await {
            Ok(()) => return Ok(true),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_OBJECT) => return Ok(false),
            // Another session is finishing it right now (the stream and the source's
            // post-commit call race): wait until it is gone.
            Err(e)
                if e.code() == Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE)
                    && attempt < BUSY_RETRIES =>
            {
                attempt += 1;
                tokio::time::sleep(BUSY_POLL).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One destination connection bound to a replication origin.
pub(super) struct Session {
    pub(super) worker: usize,
    pub(super) migration_id: u64,
    pub(super) origin: String,
    pub(super) client: Client,
    connection: JoinHandle<()>,
    /// The statements prepared on this session, by their text (one per table, operation and
    /// column shape); emptied when it holds [`MAX_STATEMENTS`].
    statements: std::sync::Mutex<HashMap<String, Statement>>,
    /// The SQL-level prepared statements of batches ([`Prepared::batch`]).
    batch_statements: std::sync::Mutex<BatchStatements>,
    /// Batches go through the node's `remus.apply_batch` (kept plans in the server), not the
    /// session's PL/pgSQL procedure: the node has it (decision 0035, third amendment).
    native: bool,
}

/// A session's SQL-level prepared statements of batch statements, by their text, and the
/// shapes its batch procedure runs as static statements.
#[derive(Default)]
struct BatchStatements {
    names: HashMap<String, String>,
    /// The number in the last name given (`remus_batch_<n>`).
    next: u64,
    /// The static statements of the session's batch procedure, shape 1 first
    /// ([`static_statement`]).
    statics: Vec<String>,
    /// The number of each batch statement's static statement.
    static_of: HashMap<String, i32>,
}

/// `REMUS_APPLY_NATIVE` in the replay worker's environment: `0` keeps batches on each session's
/// PL/pgSQL procedure even where the node has `remus.apply_batch` (a way back, and the A/B of
/// the two); anything else, or unset, uses the node's procedure when it has one.
fn native_from_env() -> bool {
    std::env::var("REMUS_APPLY_NATIVE").map_or(true, |v| v.trim() != "0")
}

/// Prepared statements an apply session keeps at most.
const MAX_STATEMENTS: usize = 512;

/// What [`Session::apply_many`] did with its transactions.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// How many committed, from the first.
    pub(super) committed: usize,
    /// Of those, how many a call of the batch procedure committed.
    pub(super) batched: usize,
    /// A batch call failed; the rest went one by one.
    pub(super) batch_failed: bool,
    /// Changes a batch call that succeeded ran as static statements of the procedure.
    pub(super) static_changes: usize,
    /// Changes a batch call that succeeded ran through `remus.apply_batch`.
    pub(super) native_changes: usize,
    /// The error of the transaction after the committed ones, if one failed.
    pub(super) failure: Option<ApplyError>,
}

/// A parameter sent in text format, whatever the type PostgreSQL inferred for it: the value
/// is what pgoutput gave, the column type's text output, which its input function reads back.
#[derive(Debug)]
struct TextParam<'a>(&'a str);

impl TextParam<'_> {
    fn all(values: &[String]) -> Vec<TextParam<'_>> {
        values.iter().map(|v| TextParam(v)).collect()
    }
}

impl ToSql for TextParam<'_> {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn encode_format(&self, _ty: &Type) -> Format {
        Format::Text
    }

    tokio_postgres::types::to_sql_checked!();
}

impl Session {
    pub(super) async fn open(cfg: &ApplyConfig, worker: usize) -> Result<Session, ApplyError> {
        let origin = apply_origin(cfg.migration_id, worker);
        let (client, connection) = tokio_postgres::connect(&cfg.destination_conninfo, NoTls)
            .await
            .map_err(|e| ApplyError::Connect {
                worker,
                message: pg_message(&e),
            })?;
        let migration_id = cfg.migration_id;
        let connection = tokio::spawn(
            async move {
                if let Err(e) = connection.await {
                    warn!(migration_id, worker, error = %pg_message(&e), "destination connection ended");
                }
            }
            .in_current_span(),
        );
        let native = cfg.batch > 1
            && native_from_env()
            && match client.query_one(NATIVE_BATCH_PRESENT, &[]).await {
                Ok(row) => row.get::<_, bool>(0),
                Err(e) => {
                    warn!(migration_id, worker, error = %pg_message(&e), "could not look for remus.apply_batch; batches use the session's own procedure");
                    false
                }
            };
        let session = Session {
            worker,
            migration_id,
            origin,
            client,
            connection,
            statements: Default::default(),
            batch_statements: Default::default(),
            native,
        };
        let setup = origin_session_setup(
            &session.origin,
            &format!("remus-replay m{migration_id} w{worker}"),
        );
        let setup = if native {
            format!("{setup}\n{SESSION_ASYNC_COMMIT}")
        } else if cfg.batch > 1 {
            format!("{setup}\n{}", batch_setup())
        } else {
            setup
        };
        session
            .client
            .batch_execute(&setup)
            .await
            .map_err(|e| ApplyError::Setup {
                worker,
                origin: session.origin.clone(),
                message: pg_message(&e),
            })?;
        debug!(migration_id, worker, origin = %session.origin, native, "apply session ready");
        Ok(session)
    }

    /// Runs the shadow transaction in one round trip (after preparing the shapes this session
    /// has not seen); on any error it is rolled back.
    pub(super) async fn apply(&self, p: &Prepared) -> Result<(), ApplyError> {
        if let Some(gid) = &p.shadow_gid {
            return commit_prepared_with_origin(&self.client, gid, p.commit_lsn, p.commit_time_us)
                .await
                .map(|_| ())
                .map_err(|e| ApplyError::Statement {
                    xid: p.xid,
                    commit_lsn: format_lsn(p.commit_lsn),
                    context: format!("COMMIT PREPARED {gid}"),
                    sqlstate: e.code().map(|c| c.code().to_string()),
                    message: pg_message(&e),
                });
        }
        // Statement indexes: 0 BEGIN, 1..=n changes, n+1 origin setup, n+2 COMMIT. Every
        // statement is prepared once per session and shape; then the whole transaction is
        // sent at once (tokio-postgres pipelines the requests of futures polled together, in
        // the order they are first polled) and the answers are read in order. After an error
        // the later statements fail with 25P02 and the COMMIT ends the aborted transaction.
        let n = p.changes.len();
        let origin_params = origin_params(p);
        let mut shapes: Vec<(&str, Vec<TextParam>)> = Vec::with_capacity(n + 3);
        shapes.push(("BEGIN", Vec::new()));
        for c in &p.changes {
            shapes.push((&c.sql, TextParam::all(&c.params)));
        }
        shapes.push((ORIGIN_SETUP, TextParam::all(&origin_params)));
        shapes.push(("COMMIT", Vec::new()));
        // The first statement that failed (to prepare or to run), and its error.
        let mut failure: Option<(usize, tokio_postgres::Error)> = None;
        let mut statements = Vec::with_capacity(shapes.len());
        for (i, (sql, _)) in shapes.iter().enumerate() {
            match self.statement(sql).await {
                Ok(s) => statements.push(s),
                Err(e) => {
                    failure = Some((i, e));
                    break;
                }
            }
        }
        let mut bad_guard_row = None;
        if failure.is_none() {
            let answers = futures_util::future::join_all(statements.iter().zip(&shapes).map(
                |(statement, (_, values))| {
                    let values: Vec<&(dyn ToSql + Sync)> =
                        values.iter().map(|v| v as &(dyn ToSql + Sync)).collect();
                    async move { self.client.query(statement, &values).await }
                },
            ))
            .await;
            for (i, answer) in answers.into_iter().enumerate() {
                match answer {
                    Ok(rows) => {
                        let guarded = (1..=n).contains(&i) && p.stmts[i - 1].guarded;
                        let one = rows.len() == 1 && rows[0].try_get::<_, i32>(0).ok() == Some(1);
                        if guarded && !one && bad_guard_row.is_none() {
                            bad_guard_row = Some(i);
                        }
                    }
                    Err(e) => {
                        failure = Some((i, e));
                        break;
                    }
                }
            }
        }
        let stmt = |idx: usize| (1..=n).contains(&idx).then(|| &p.stmts[idx - 1]);
        match failure {
            None => {
                // The guards make a wrong row count fail on the server, before COMMIT; this only
                // catches a server that answered something else than what was sent.
                if bad_guard_row.is_none() {
                    return Ok(());
                }
                Err(ApplyError::Statement {
                    xid: p.xid,
                    commit_lsn: format_lsn(p.commit_lsn),
                    context: "checking the statement results".into(),
                    sqlstate: None,
                    message: format!(
                        "the guard of statement {bad_guard_row:?} of {n} changes did not \
                         answer one row of 1; the transaction was already committed"
                    ),
                })
            }
            Some((failed_at, e)) => {
                if let Err(rb) = self.client.batch_execute("ROLLBACK").await {
                    warn!(migration_id = self.migration_id, worker = self.worker, error = %pg_message(&rb), "ROLLBACK after a failed shadow transaction failed");
                }
                let code = e.code();
                if let Some(s) = stmt(failed_at) {
                    let divergence = if s.guarded && code == Some(&SqlState::DIVISION_BY_ZERO) {
                        Some("did not affect exactly one row on the destination (row missing)")
                    } else if s.op == "INSERT" && code == Some(&SqlState::UNIQUE_VIOLATION) {
                        Some("found the row already present on the destination")
                    } else {
                        None
                    };
                    if let Some(problem) = divergence {
                        return Err(ApplyError::Divergence {
                            xid: p.xid,
                            table: s.table.clone(),
                            op: s.op,
                            key: s.key.clone(),
                            problem: problem.into(),
                        });
                    }
                }
                let context = match stmt(failed_at) {
                    Some(s) if s.key.is_empty() => format!("{} {}", s.op, s.table),
                    Some(s) => format!("{} on {} with key ({})", s.op, s.table, s.key),
                    None if failed_at == 0 => "BEGIN".into(),
                    None if failed_at == n + 1 => "pg_replication_origin_xact_setup".into(),
                    None => "COMMIT".into(),
                };
                Err(ApplyError::Statement {
                    xid: p.xid,
                    commit_lsn: format_lsn(p.commit_lsn),
                    context,
                    sqlstate: code.map(|c| c.code().to_string()),
                    message: pg_message(&e),
                })
            }
        }
    }

    /// Applies `jobs` (independent of each other, in source order). Batchable ones
    /// ([`Prepared::batchable`]) go in one call of the session's batch procedure
    /// ([`batch_procedure`]), each still its own transaction. If the call fails, the session's
    /// progress sequence says which ones committed (the last one's commit position); the one
    /// that failed is applied again on its own ([`Self::apply`]), which reports its error as a
    /// lone transaction's (a divergence names its table, operation and key) or, if it now
    /// commits, goes on with the rest.
    pub(super) async fn apply_many(&self, jobs: &[&Prepared]) -> Applied {
        let mut applied = Applied::default();
        if jobs.len() > 1 && jobs.iter().all(|p| p.batchable()) {
            match self.apply_batch(jobs).await {
                Ok(changes) => {
                    applied.committed = jobs.len();
                    applied.batched = jobs.len();
                    if self.native {
                        applied.native_changes = changes;
                    } else {
                        applied.static_changes = changes;
                    }
                    return applied;
                }
                Err(e) => match self.batch_done(jobs).await {
                    Ok(n) => {
                        debug!(migration_id = self.migration_id, worker = self.worker, committed = n, error = %pg_message(&e), "batch stopped; applying the rest one by one");
                        applied.committed = n;
                        applied.batched = n;
                        applied.batch_failed = true;
                    }
                    Err(read) => {
                        let first = jobs[0];
                        applied.batch_failed = true;
                        applied.failure = Some(ApplyError::Statement {
                            xid: first.xid,
                            commit_lsn: format_lsn(first.commit_lsn),
                            context: "reading how much of a failed batch committed".into(),
                            sqlstate: read.code().map(|c| c.code().to_string()),
                            message: format!(
                                "{} (the batch failed with: {})",
                                pg_message(&read),
                                pg_message(&e)
                            ),
                        });
                        return applied;
                    }
                },
            }
        }
        for p in &jobs[applied.committed..] {
            if let Err(e) = self.apply(p).await {
                applied.failure = Some(e);
                return applied;
            }
            applied.committed += 1;
        }
        applied
    }

    /// One call of the batch procedure with `jobs`; returns how many changes ran as static
    /// statements of the session's procedure, or, through the node's `remus.apply_batch`, how
    /// many ran there.
    async fn apply_batch(&self, jobs: &[&Prepared]) -> Result<usize, tokio_postgres::Error> {
        if self.native {
            return self.apply_batch_native(jobs).await;
        }
        let mut lsns = Vec::with_capacity(jobs.len());
        let mut times = Vec::with_capacity(jobs.len());
        let mut change_txn = Vec::new();
        let mut change_sql = Vec::new();
        let mut change_guarded = Vec::new();
        let mut change_shape = Vec::new();
        let mut param_at = Vec::new();
        let mut params: Vec<&str> = Vec::new();
        let mut statics = 0;
        let names = self.batch_statement_names(jobs).await?;
        {
            // Held while the arrays are built: no await in this block.
            let prepared = self
                .batch_statements
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (t, p) in jobs.iter().enumerate() {
                // LSNs stay below 2^63.
                lsns.push(p.commit_lsn as i64);
                times.push(p.commit_time_us);
                for ((shape, change), info) in p.batch.iter().zip(&p.changes).zip(&p.stmts) {
                    change_txn.push(t as i32 + 1);
                    change_guarded.push(info.guarded);
                    param_at.push(params.len() as i32);
                    match prepared.static_of.get(shape) {
                        Some(&number) => {
                            statics += 1;
                            change_shape.push(number);
                            change_sql.push(String::new());
                            params.extend(change.params.iter().map(String::as_str));
                        }
                        None => {
                            change_shape.push(0);
                            change_sql
                                .push(execute_prepared(&names[shape.as_str()], &change.params));
                        }
                    }
                }
            }
        }
        let call = self.statement(BATCH_CALL).await?;
        self.client
            .execute(
                &call,
                &[
                    &lsns,
                    &times,
                    &change_txn,
                    &change_sql,
                    &change_guarded,
                    &change_shape,
                    &param_at,
                    &params,
                ],
            )
            .await
            .map(|_| statics)
    }

    /// One call of the node's `remus.apply_batch` with `jobs`: every change by the name of its
    /// shape's prepared statement, whose plan the server keeps ([`NATIVE_BATCH_CALL`]).
    /// Returns how many changes it ran.
    async fn apply_batch_native(&self, jobs: &[&Prepared]) -> Result<usize, tokio_postgres::Error> {
        let names = self.batch_statement_names(jobs).await?;
        let changes: usize = jobs.iter().map(|p| p.changes.len()).sum();
        let mut lsns = Vec::with_capacity(jobs.len());
        let mut times = Vec::with_capacity(jobs.len());
        let mut change_txn = Vec::with_capacity(changes);
        let mut change_stmt: Vec<&str> = Vec::with_capacity(changes);
        let mut change_guarded = Vec::with_capacity(changes);
        let mut param_at = Vec::with_capacity(changes);
        let mut params: Vec<&str> = Vec::new();
        for (t, p) in jobs.iter().enumerate() {
            // LSNs stay below 2^63.
            lsns.push(p.commit_lsn as i64);
            times.push(p.commit_time_us);
            for ((shape, change), info) in p.batch.iter().zip(&p.changes).zip(&p.stmts) {
                change_txn.push(t as i32 + 1);
                change_stmt.push(names[shape.as_str()].as_str());
                change_guarded.push(info.guarded);
                param_at.push(params.len() as i32);
                params.extend(change.params.iter().map(String::as_str));
            }
        }
        let call = self.statement(NATIVE_BATCH_CALL).await?;
        self.client
            .execute(
                &call,
                &[
                    &lsns,
                    &times,
                    &change_txn,
                    &change_stmt,
                    &change_guarded,
                    &param_at,
                    &params,
                ],
            )
            .await
            .map(|_| changes)
    }

    /// The name of the session's prepared statement of every batch statement of `jobs`
    /// ([`Prepared::batch`]) that has no static statement, preparing those it has not prepared
    /// yet in one round trip (`PREPARE`: SQL-level, so that the batch procedure can `EXECUTE`
    /// them). A name is never used twice: a `PREPARE` that failed after others had succeeded leaves those behind,
    /// unknown to the cache, but nothing can collide with them.
    async fn batch_statement_names(
        &self,
        jobs: &[&Prepared],
    ) -> Result<HashMap<String, String>, tokio_postgres::Error> {
        let mut names = HashMap::new();
        let mut missing = Vec::new();
        {
            let prepared = self
                .batch_statements
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for shape in jobs.iter().flat_map(|p| &p.batch) {
                // A static shape runs without its prepared statement (which may have been
                // deallocated since).
                if names.contains_key(shape)
                    || missing.contains(&shape)
                    || prepared.static_of.contains_key(shape)
                {
                    continue;
                }
                match prepared.names.get(shape) {
                    Some(name) => {
                        names.insert(shape.clone(), name.clone());
                    }
                    None => missing.push(shape),
                }
            }
        }
        if missing.is_empty() {
            return Ok(names);
        }
        let mut sql = String::new();
        let mut new = Vec::with_capacity(missing.len());
        {
            let mut prepared = self
                .batch_statements
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if prepared.names.len() + missing.len() > MAX_STATEMENTS {
                // Deallocate all but the ones this batch uses.
                prepared.names.retain(|shape, name| {
                    let keep = names.contains_key(shape);
                    if !keep {
                        let _ = write!(sql, "DEALLOCATE {name};");
                    }
                    keep
                });
            }
            for shape in missing {
                prepared.next += 1;
                let name = format!("remus_batch_{}", prepared.next);
                let _ = write!(sql, "PREPARE {name} AS {shape};");
                if self.native {
                    // The server keeps a plan of the same text with the types PREPARE inferred.
                    let _ = write!(
                        sql,
                        "SELECT remus.apply_shape({}, {});",
                        quote_literal(&name),
                        quote_literal(shape)
                    );
                }
                new.push((shape.clone(), name));
            }
        }
        self.client.batch_execute(&sql).await?;
        {
            let mut prepared = self
                .batch_statements
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (shape, name) in &new {
                prepared.names.insert(shape.clone(), name.clone());
                names.insert(shape.clone(), name.clone());
            }
        }
        if !self.native {
            self.add_static_statements(&new).await;
        }
        Ok(names)
    }

    /// Gives the shapes just prepared (`new`: shape and statement name) a static statement in
    /// the session's batch procedure while it has fewer than [`STATIC_SHAPES`], with the
    /// parameter types `PREPARE` inferred, and replaces the procedure. Best effort: a shape that
    /// cannot be static, or a procedure that cannot be replaced (the old one stays), leaves the
    /// shapes on the `EXECUTE` path, warned.
    async fn add_static_statements(&self, new: &[(String, String)]) {
        let room = {
            let prepared = self
                .batch_statements
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            STATIC_SHAPES.saturating_sub(prepared.statics.len())
        };
        if room == 0 {
            return;
        }
        let wanted: Vec<&str> = new.iter().map(|(_, name)| name.as_str()).collect();
        let rows = match self
            .client
            .query(
                "SELECT name, parameter_types::text[] FROM pg_catalog.pg_prepared_statements \
                 WHERE name = ANY($1)",
                &[&wanted],
            )
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                warn!(migration_id = self.migration_id, worker = self.worker, error = %pg_message(&e), "parameter types of batch statements not read; they run by EXECUTE");
                return;
            }
        };
        let types: HashMap<String, Vec<String>> = rows
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, Vec<String>>(1)))
            .collect();
        let (statics, added) = {
            let prepared = self
                .batch_statements
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let mut statics = prepared.statics.clone();
            let mut added = Vec::new();
            for (shape, name) in new {
                if statics.len() >= STATIC_SHAPES {
                    break;
                }
                if let Some(statement) = types.get(name).and_then(|t| static_statement(shape, t)) {
                    statics.push(statement);
                    added.push((shape.clone(), statics.len() as i32));
                }
            }
            (statics, added)
        };
        if added.is_empty() {
            return;
        }
        if let Err(e) = self.client.batch_execute(&batch_procedure(&statics)).await {
            warn!(migration_id = self.migration_id, worker = self.worker, error = %pg_message(&e), "batch procedure not replaced; its new shapes run by EXECUTE");
            return;
        }
        let mut prepared = self
            .batch_statements
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        prepared.statics = statics;
        prepared.static_of.extend(added);
    }

    /// How many of `jobs`, from the first, the batch call that applied them committed: up to
    /// the one whose commit position the session's sequence holds, none if it holds another
    /// (an earlier batch's, when this call failed before its first commit).
    async fn batch_done(&self, jobs: &[&Prepared]) -> Result<usize, tokio_postgres::Error> {
        let done = if self.native {
            NATIVE_BATCH_DONE
        } else {
            BATCH_DONE
        };
        let row = self.client.query_one(done, &[]).await?;
        let last = row.get::<_, i64>(0);
        Ok(jobs
            .iter()
            .position(|p| p.commit_lsn as i64 == last)
            .map_or(0, |i| i + 1))
    }

    /// `sql` prepared on this session, once.
    async fn statement(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        let cached = self
            .statements
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(sql)
            .cloned();
        if let Some(statement) = cached {
            return Ok(statement);
        }
        let statement = self.client.prepare(sql).await?;
        let mut statements = self.statements.lock().unwrap_or_else(|p| p.into_inner());
        if statements.len() >= MAX_STATEMENTS {
            statements.clear();
        }
        statements.insert(sql.to_string(), statement.clone());
        Ok(statement)
    }

    pub(super) async fn reset(&self) -> Result<(), tokio_postgres::Error> {
        self.client
            .batch_execute("SELECT pg_catalog.pg_replication_origin_session_reset()")
            .await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the client ends the connection task by itself; this only hurries it up.
        self.connection.abort();
    }
}
