//! A libpq connection driven without ever blocking inside libpq: every wait is a `poll(2)` on
//! the socket with a deadline, sliced so that a [`CancelToken`] is noticed within
//! [`POLL_SLICE`]. Shared by the replication client and the snapshot copy.
//!
//! When a command times out or is cancelled, the server is asked to cancel it (from a helper
//! thread, since `PQcancel` itself blocks) and the session is marked broken: its protocol state
//! is unknown, so the only thing left to do with it is to drop it. Dropping closes the
//! connection, which ends the server backend and rolls back its open transaction.

use std::ffi::CString;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, warn};

use crate::libpq::{
    poll_socket, Conn, ConnectPoll, CopyBuf, CopyData, PgResult, Put, ResultStatus,
};

/// Longest stretch a wait sleeps before it looks at the cancel tokens again.
pub(crate) const POLL_SLICE: Duration = Duration::from_millis(50);

/// A cloneable flag that stops every wait of the connections it was given to, from any thread,
/// within about 50 ms. Waits that see it fail with [`PgError::Cancelled`]. Once set it stays
/// set.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// An error reported by the server (an ErrorResponse).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    /// `ERROR`, `FATAL`, `PANIC`.
    pub severity: String,
    /// The five-character SQLSTATE, e.g. `42P01` (undefined table).
    pub sqlstate: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} (SQLSTATE {})",
            self.severity, self.message, self.sqlstate
        )?;
        if let Some(d) = &self.detail {
            write!(f, "; DETAIL: {d}")?;
        }
        if let Some(h) = &self.hint {
            write!(f, "; HINT: {h}")?;
        }
        Ok(())
    }
}

/// Why an operation on a PostgreSQL connection failed.
#[derive(Debug, Error)]
pub enum PgError {
    #[error("could not connect: {message}")]
    Connect { message: String },
    #[error("{operation} failed: {error}")]
    Server {
        operation: String,
        error: Box<ServerError>,
    },
    #[error("connection lost during {operation}: {message}")]
    ConnectionLost { operation: String, message: String },
    #[error("{operation} timed out after {after:?}")]
    Timeout { operation: String, after: Duration },
    #[error("{operation} was cancelled")]
    Cancelled { operation: String },
    #[error("{operation} returned {status}, expected {expected}")]
    UnexpectedResult {
        operation: String,
        status: String,
        expected: &'static str,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("connection unusable after an earlier timeout, cancellation or failure")]
    Broken,
}

impl PgError {
    /// The SQLSTATE of a server error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            PgError::Server { error, .. } => Some(&error.sqlstate),
            _ => None,
        }
    }

    pub fn server_error(&self) -> Option<&ServerError> {
        match self {
            PgError::Server { error, .. } => Some(error),
            _ => None,
        }
    }

    pub fn is_timeout(&self) -> bool {
        matches!(self, PgError::Timeout { .. })
    }

    pub fn is_cancelled(&self) -> bool {
        matches!(self, PgError::Cancelled { .. })
    }
}

/// A point in time by which a wait must end, and the budget it came from (for messages).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    pub(crate) at: Instant,
    pub(crate) budget: Duration,
}

impl Deadline {
    pub(crate) fn after(budget: Duration) -> Self {
        let now = Instant::now();
        // Absurdly large budgets mean "practically never"; Instant cannot represent them.
        let at = now
            .checked_add(budget)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600));
        Self { at, budget }
    }
}

/// What the next read from a COPY OUT / CopyBoth stream produced.
pub(crate) enum CopyRead {
    Data(CopyBuf),
    /// Nothing buffered yet (only from [`Session::try_read_copy`]).
    WouldBlock,
    /// The server ended the copy; the final result (for CopyBoth: `CopyIn`, meaning the client
    /// must still end its side).
    Done(PgResult),
}

pub(crate) struct Session {
    conn: Conn,
    cancels: Vec<CancelToken>,
    /// Budget for each command and each internal wait that has no explicit one.
    pub(crate) timeout: Duration,
    broken: bool,
}

impl Session {
    /// Connects with `conninfo` (key=value string or URI) plus `extra` parameters, which
    /// override it. Any token in `cancels` aborts every wait of the session.
    pub(crate) fn connect(
        conninfo: &str,
        extra: &[(&str, &str)],
        connect_timeout: Duration,
        command_timeout: Duration,
        cancels: Vec<CancelToken>,
    ) -> Result<Session, PgError> {
        let mut params = vec![("dbname", conninfo)];
        params.extend_from_slice(extra);
        let conn = Conn::start(&params, true).map_err(|message| PgError::Connect { message })?;
        let mut session = Session {
            conn,
            cancels,
            timeout: command_timeout,
            broken: false,
        };
        let deadline = Deadline::after(connect_timeout);
        // libpq: after PQconnectStart, wait until the socket is writable, then poll.
        let mut want = ConnectPoll::Writing;
        loop {
            let ready = session.wait_raw(
                want == ConnectPoll::Reading,
                want == ConnectPoll::Writing,
                deadline.at,
            );
            match ready {
                Ok(true) => {}
                Ok(false) => {
                    return Err(PgError::Timeout {
                        operation: "connecting".into(),
                        after: deadline.budget,
                    })
                }
                Err(WaitError::Cancelled) => {
                    return Err(PgError::Cancelled {
                        operation: "connecting".into(),
                    })
                }
                Err(WaitError::Io(message)) => return Err(PgError::Connect { message }),
            }
            match session.conn.connect_poll() {
                ConnectPoll::Ok => break,
                ConnectPoll::Failed => {
                    return Err(PgError::Connect {
                        message: session.conn.error_message(),
                    })
                }
                w => want = w,
            }
        }
        session
            .conn
            .set_nonblocking()
            .map_err(|message| PgError::Connect { message })?;
        Ok(session)
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancels.iter().any(CancelToken::is_cancelled)
    }

    fn check_usable(&self) -> Result<(), PgError> {
        if self.broken {
            Err(PgError::Broken)
        } else {
            Ok(())
        }
    }

    /// Fails with [`PgError::Cancelled`] (and aborts the server command) if a token is set. For
    /// loops that make progress without ever waiting.
    pub(crate) fn check_cancelled(&mut self, operation: &str) -> Result<(), PgError> {
        if self.is_cancelled() {
            Err(self.abort(PgError::Cancelled {
                operation: operation.into(),
            }))
        } else {
            Ok(())
        }
    }

    /// Polls the socket until it is ready as asked (`Ok(true)`) or `until` passes (`Ok(false)`).
    fn wait_raw(&self, read: bool, write: bool, until: Instant) -> Result<bool, WaitError> {
        loop {
            if self.is_cancelled() {
                return Err(WaitError::Cancelled);
            }
            let now = Instant::now();
            if now >= until {
                return Ok(false);
            }
            let Some(fd) = self.conn.socket() else {
                return Err(WaitError::Io("connection has no socket".into()));
            };
            let slice = (until - now).min(POLL_SLICE);
            // Round up so that a sub-millisecond remainder does not turn into a busy loop.
            let ms = slice.as_micros().div_ceil(1000).max(1) as i32;
            match poll_socket(fd, read, write, ms) {
                Ok(r) if r.any() => return Ok(true),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(WaitError::Io(e.to_string())),
            }
        }
    }

    /// Waits for the socket as asked; a timeout or cancellation aborts the running command.
    fn wait(
        &mut self,
        read: bool,
        write: bool,
        deadline: Deadline,
        operation: &str,
    ) -> Result<(), PgError> {
        match self.wait_raw(read, write, deadline.at) {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.abort(PgError::Timeout {
                operation: operation.into(),
                after: deadline.budget,
            })),
            Err(WaitError::Cancelled) => Err(self.abort(PgError::Cancelled {
                operation: operation.into(),
            })),
            Err(WaitError::Io(message)) => {
                self.broken = true;
                Err(PgError::ConnectionLost {
                    operation: operation.into(),
                    message,
                })
            }
        }
    }

    /// Waits until input arrives (and reads it into libpq: `Ok(true)`) or `until` passes
    /// (`Ok(false)`, not an error). Cancellation is an error and aborts the command.
    pub(crate) fn wait_for_input(
        &mut self,
        until: Instant,
        operation: &str,
    ) -> Result<bool, PgError> {
        self.check_usable()?;
        match self.wait_raw(true, false, until) {
            Ok(true) => {
                self.consume_input(operation)?;
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(WaitError::Cancelled) => Err(self.abort(PgError::Cancelled {
                operation: operation.into(),
            })),
            Err(WaitError::Io(message)) => {
                self.broken = true;
                Err(PgError::ConnectionLost {
                    operation: operation.into(),
                    message,
                })
            }
        }
    }

    fn consume_input(&mut self, operation: &str) -> Result<(), PgError> {
        if self.conn.consume_input() {
            Ok(())
        } else {
            Err(self.lost(operation))
        }
    }

    /// Marks the session broken and asks the server to cancel what it is running, without
    /// waiting for the answer (PQcancel opens a connection of its own and may block).
    fn abort(&mut self, err: PgError) -> PgError {
        if !self.broken {
            self.broken = true;
            if let Some(handle) = self.conn.cancel_handle() {
                let spawned = thread::Builder::new()
                    .name("pg-cancel".into())
                    .spawn(move || {
                        if let Err(e) = handle.send() {
                            debug!(error = %e, "cancel request failed");
                        }
                    });
                if let Err(e) = spawned {
                    warn!(error = %e, "could not start a thread to send a cancel request");
                }
            }
        }
        err
    }

    fn lost(&mut self, operation: &str) -> PgError {
        self.broken = true;
        PgError::ConnectionLost {
            operation: operation.into(),
            message: self.conn.error_message(),
        }
    }

    /// Sends everything libpq has queued.
    fn flush_all(&mut self, deadline: Deadline, operation: &str) -> Result<(), PgError> {
        loop {
            match self.conn.flush() {
                Ok(true) => return Ok(()),
                // libpq: wait for write-ready, but also read input meanwhile so the server,
                // which may itself be blocked sending to us, can make progress.
                Ok(false) => {
                    self.wait(true, true, deadline, operation)?;
                    self.consume_input(operation)?;
                }
                Err(()) => return Err(self.lost(operation)),
            }
        }
    }

    /// Runs one simple-protocol command and returns its last result. A COPY command returns
    /// its `CopyOut` / `CopyIn` / `CopyBoth` result, and the connection is then in copy mode.
    pub(crate) fn exec(&mut self, sql: &str, operation: &str) -> Result<PgResult, PgError> {
        self.check_usable()?;
        let deadline = Deadline::after(self.timeout);
        let query = CString::new(sql).map_err(|_| {
            PgError::InvalidArgument(format!("NUL byte in the {operation} command"))
        })?;
        if !self.conn.send_query(&query) {
            return Err(self.lost(operation));
        }
        self.flush_all(deadline, operation)?;
        self.collect(deadline, operation)
    }

    /// [`Session::exec`] that must succeed with `CommandOk` or `TuplesOk`.
    pub(crate) fn exec_ok(&mut self, sql: &str, operation: &str) -> Result<PgResult, PgError> {
        let r = self.exec(sql, operation)?;
        match r.status() {
            ResultStatus::CommandOk | ResultStatus::TuplesOk => Ok(r),
            _ => Err(self.unexpected(&r, operation, "a completed command")),
        }
    }

    /// Reports a result of the wrong kind; the protocol state is then unknown.
    pub(crate) fn unexpected(
        &mut self,
        r: &PgResult,
        operation: &str,
        expected: &'static str,
    ) -> PgError {
        self.broken = true;
        PgError::UnexpectedResult {
            operation: operation.into(),
            status: r.status_name(),
            expected,
        }
    }

    /// Reads the results of the current command until libpq has no more, returning the last
    /// one, the first error, or a copy-mode result (which ends the command's result sequence).
    fn collect(&mut self, deadline: Deadline, operation: &str) -> Result<PgResult, PgError> {
        let mut last = None;
        let mut error = None;
        loop {
            while self.conn.is_busy() {
                self.wait(true, false, deadline, operation)?;
                self.consume_input(operation)?;
            }
            let Some(r) = self.conn.get_result() else {
                break;
            };
            match r.status() {
                ResultStatus::CopyIn | ResultStatus::CopyOut | ResultStatus::CopyBoth => {
                    return Ok(r)
                }
                ResultStatus::FatalError | ResultStatus::BadResponse => {
                    if error.is_none() {
                        error = Some(self.error_from(&r, operation));
                    }
                }
                _ => last = Some(r),
            }
        }
        if let Some(e) = error {
            return Err(e);
        }
        last.ok_or_else(|| {
            self.broken = true;
            PgError::UnexpectedResult {
                operation: operation.into(),
                status: "no result".into(),
                expected: "a result",
            }
        })
    }

    /// A server error if the result carries a SQLSTATE; otherwise libpq's own failure, which
    /// means the connection is gone.
    fn error_from(&mut self, r: &PgResult, operation: &str) -> PgError {
        match r.error_field(pq_sys::PG_DIAG_SQLSTATE) {
            Some(sqlstate) => PgError::Server {
                operation: operation.into(),
                error: Box::new(ServerError {
                    severity: r
                        .error_field(pq_sys::PG_DIAG_SEVERITY_NONLOCALIZED)
                        .or_else(|| r.error_field(pq_sys::PG_DIAG_SEVERITY))
                        .unwrap_or_else(|| "ERROR".into()),
                    sqlstate,
                    message: r
                        .error_field(pq_sys::PG_DIAG_MESSAGE_PRIMARY)
                        .unwrap_or_else(|| r.error_message()),
                    detail: r.error_field(pq_sys::PG_DIAG_MESSAGE_DETAIL),
                    hint: r.error_field(pq_sys::PG_DIAG_MESSAGE_HINT),
                }),
            },
            None => {
                self.broken = true;
                let mut message = r.error_message();
                if message.is_empty() {
                    message = self.conn.error_message();
                }
                PgError::ConnectionLost {
                    operation: operation.into(),
                    message,
                }
            }
        }
    }

    /// Takes the next CopyData message if one is buffered, without waiting.
    pub(crate) fn try_read_copy(&mut self, operation: &str) -> Result<CopyRead, PgError> {
        self.check_usable()?;
        match self.conn.get_copy_data() {
            CopyData::Row(buf) => Ok(CopyRead::Data(buf)),
            CopyData::WouldBlock => Ok(CopyRead::WouldBlock),
            CopyData::Done => {
                let deadline = Deadline::after(self.timeout);
                self.collect(deadline, operation).map(CopyRead::Done)
            }
            CopyData::Failed => Err(self.lost(operation)),
        }
    }

    /// The next CopyData message or the end of the copy, waiting at most `budget` for it.
    pub(crate) fn read_copy(
        &mut self,
        budget: Duration,
        operation: &str,
    ) -> Result<CopyRead, PgError> {
        let deadline = Deadline::after(budget);
        loop {
            match self.try_read_copy(operation)? {
                CopyRead::WouldBlock => {
                    if !self.wait_for_input(deadline.at, operation)? {
                        return Err(self.abort(PgError::Timeout {
                            operation: operation.into(),
                            after: deadline.budget,
                        }));
                    }
                }
                other => return Ok(other),
            }
        }
    }

    /// Sends one CopyData message and flushes it, so at most one message is buffered.
    pub(crate) fn write_copy(&mut self, data: &[u8], operation: &str) -> Result<(), PgError> {
        self.check_usable()?;
        let deadline = Deadline::after(self.timeout);
        loop {
            match self.conn.put_copy_data(data) {
                Put::Queued => break,
                Put::WouldBlock => {
                    self.wait(true, true, deadline, operation)?;
                    self.consume_input(operation)?;
                }
                Put::Failed => return Err(self.lost(operation)),
            }
        }
        self.flush_all(deadline, operation)
    }

    /// Sends CopyDone (ends a COPY FROM STDIN, or the client's side of a CopyBoth stream).
    pub(crate) fn put_copy_end(&mut self, operation: &str) -> Result<(), PgError> {
        self.check_usable()?;
        let deadline = Deadline::after(self.timeout);
        loop {
            match self.conn.put_copy_end() {
                Put::Queued => break,
                Put::WouldBlock => {
                    self.wait(true, true, deadline, operation)?;
                    self.consume_input(operation)?;
                }
                Put::Failed => return Err(self.lost(operation)),
            }
        }
        self.flush_all(deadline, operation)
    }

    /// The results that follow a COPY FROM STDIN once [`Session::put_copy_end`] was sent.
    pub(crate) fn finish_command(&mut self, operation: &str) -> Result<PgResult, PgError> {
        self.check_usable()?;
        let deadline = Deadline::after(self.timeout);
        self.collect(deadline, operation)
    }

    pub(crate) fn escape_literal(&mut self, s: &str) -> Result<String, PgError> {
        if s.contains('\0') {
            return Err(PgError::InvalidArgument(format!("NUL byte in {s:?}")));
        }
        self.conn
            .escape_literal(s)
            .map_err(PgError::InvalidArgument)
    }
}

enum WaitError {
    Cancelled,
    Io(String),
}
