//! The walsender connection to the source: slot management with an exported snapshot, and the
//! pgoutput stream (DESIGN.md 3.1-3.2, MOCC-ON-PG15.md Q2).
//!
//! Blocking API for a dedicated thread, but no call can hang: connecting, every command and
//! every write has the connection's timeout ([`ReplicationOptions`]), [`ReplicationStream::recv`]
//! takes its own, and the [`CancelToken`] of the connection stops any of them from another
//! thread. A timed out or cancelled command is also cancelled on the server (this matters for
//! `CREATE_REPLICATION_SLOT`, which waits for every running transaction on the source) and
//! leaves the connection unusable: drop it and reconnect.
//!
//! Typical use, mirroring the migration phases:
//!
//! ```no_run
//! # use wal_propagator::{ReplicationConnection, copy_tables, PgOutputMessage, ReplicationMessage};
//! # use std::time::Duration;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut conn = ReplicationConnection::connect("host=a dbname=app")?;
//! let snapshot = conn.create_slot_exporting_snapshot("remus_m1")?;
//! let tables = vec![("public.s1".to_string(), "public.s1".to_string())];
//! copy_tables("host=a dbname=app", snapshot.snapshot_name(), "host=b dbname=app", &tables, 4)?;
//! let slot = snapshot.release(); // the copy sessions are done with the snapshot
//! let mut stream = conn.start_streaming("remus_m1", slot.consistent_point, "remus_m1")?;
//! while let Some(msg) = stream.recv(Duration::from_secs(1))? {
//!     if let ReplicationMessage::XLogData(x) = msg {
//!         let _decoded = PgOutputMessage::decode(x.data)?;
//!     }
//! }
//! # Ok(()) }
//! ```

use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use thiserror::Error;
use tracing::{debug, info};

use crate::libpq::ResultStatus;
use crate::pgoutput::{
    system_time_to_pg_timestamp, DecodeError, Lsn, ReplicationMessage, StandbyStatusUpdate,
};
use crate::session::{CancelToken, CopyRead, Deadline, PgError, Session};

/// Why a replication operation failed.
#[derive(Debug, Error)]
pub enum ReplicationError {
    /// The connection, the server or a wait failed (timeouts and cancellation included).
    #[error(transparent)]
    Pg(#[from] PgError),
    /// A CopyData message of the stream could not be decoded. The stream position is unknown
    /// from here on: restart streaming from the last confirmed LSN.
    #[error("undecodable replication message: {0}")]
    Decode(#[from] DecodeError),
    /// The server ended the replication stream without an error (e.g. it is shutting down).
    #[error("the server ended the replication stream")]
    StreamEnded,
    /// A command's answer does not have the documented shape.
    #[error("unexpected reply to {command}: {detail}")]
    UnexpectedReply {
        command: &'static str,
        detail: String,
    },
    #[error("invalid {what} {name:?}: {reason}")]
    InvalidName {
        what: &'static str,
        name: String,
        reason: &'static str,
    },
}

impl ReplicationError {
    /// The SQLSTATE of a server error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            ReplicationError::Pg(e) => e.sqlstate(),
            _ => None,
        }
    }
}

/// Timeouts and cancellation of a [`ReplicationConnection`].
#[derive(Debug, Clone)]
pub struct ReplicationOptions {
    pub connect_timeout: Duration,
    /// Budget of every command, including `CREATE_REPLICATION_SLOT`'s wait for the running
    /// transactions on the source and `DROP_REPLICATION_SLOT ... WAIT`, and of every write.
    pub command_timeout: Duration,
    /// While streaming, a status update with the last reported positions is sent at least this
    /// often (the server also asks for one before `wal_sender_timeout` runs out).
    pub status_interval: Duration,
    /// Stops every wait of the connection from another thread.
    pub cancel: CancelToken,
}

impl Default for ReplicationOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(30),
            command_timeout: Duration::from_secs(300),
            status_interval: Duration::from_secs(10),
            cancel: CancelToken::new(),
        }
    }
}

/// `IDENTIFY_SYSTEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemIdentity {
    pub system_id: String,
    pub timeline: u32,
    /// Current WAL flush position.
    pub xlog_pos: Lsn,
    pub dbname: Option<String>,
}

/// A slot just created by [`ReplicationConnection::create_slot_exporting_snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSlot {
    pub slot_name: String,
    /// Streaming from here yields exactly the transactions the exported snapshot does not see.
    pub consistent_point: Lsn,
    pub output_plugin: String,
    /// How long creation took: it waits for every transaction running on the source when it
    /// starts (snapbuild), so this is the migration's start-up stall to report.
    pub creation_time: Duration,
}

/// The snapshot exported by `CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')`.
///
/// The server keeps an exported snapshot only until the next command on the walsender
/// connection. This guard therefore holds the connection mutably borrowed: while it exists no
/// command can be sent, and [`ExportedSnapshot::release`] (or dropping it) is the caller saying
/// that every copy session has imported the snapshot with `SET TRANSACTION SNAPSHOT` (an
/// importing transaction keeps it alive by itself; [`crate::copy_tables`] imports it in all its
/// sessions before it returns). Copy sessions that start later fail with "invalid snapshot
/// identifier".
#[must_use = "the snapshot is only valid while this guard keeps the connection idle"]
pub struct ExportedSnapshot<'c> {
    _conn: &'c mut ReplicationConnection,
    slot: CreatedSlot,
    snapshot_name: String,
}

impl ExportedSnapshot<'_> {
    /// The name to pass to `SET TRANSACTION SNAPSHOT`.
    pub fn snapshot_name(&self) -> &str {
        &self.snapshot_name
    }

    pub fn consistent_point(&self) -> Lsn {
        self.slot.consistent_point
    }

    pub fn slot(&self) -> &CreatedSlot {
        &self.slot
    }

    /// Gives the connection back; the snapshot dies with the next command on it.
    pub fn release(self) -> CreatedSlot {
        self.slot
    }
}

/// A `replication=database` connection to the walsender of the source.
pub struct ReplicationConnection {
    session: Session,
    options: ReplicationOptions,
}

impl ReplicationConnection {
    /// Connects with `conninfo` (key=value string or URI) and `replication=database`, with
    /// default [`ReplicationOptions`]. To raise `logical_decoding_work_mem` for this walsender,
    /// put it into `conninfo`'s `options` (`options='-c logical_decoding_work_mem=256MB'`).
    pub fn connect(conninfo: &str) -> Result<Self, ReplicationError> {
        Self::connect_with(conninfo, ReplicationOptions::default())
    }

    pub fn connect_with(
        conninfo: &str,
        options: ReplicationOptions,
    ) -> Result<Self, ReplicationError> {
        let session = Session::connect(
            conninfo,
            &[
                ("replication", "database"),
                ("fallback_application_name", "pg_remus_propagator"),
            ],
            options.connect_timeout,
            options.command_timeout,
            vec![options.cancel.clone()],
        )?;
        Ok(Self { session, options })
    }

    /// The token that stops this connection's waits (and those of its stream).
    pub fn cancel_token(&self) -> CancelToken {
        self.options.cancel.clone()
    }

    pub fn options(&self) -> &ReplicationOptions {
        &self.options
    }

    /// Changes the budget of subsequent commands and writes.
    pub fn set_command_timeout(&mut self, timeout: Duration) {
        self.options.command_timeout = timeout;
        self.session.timeout = timeout;
    }

    pub fn identify_system(&mut self) -> Result<SystemIdentity, ReplicationError> {
        const CMD: &str = "IDENTIFY_SYSTEM";
        let r = self.session.exec_ok(CMD, CMD)?;
        if r.ntuples() != 1 || r.nfields() < 4 {
            return Err(shape_error(CMD, r.ntuples(), r.nfields()));
        }
        let field = |col: usize, name: &str| {
            r.value(0, col)
                .ok_or_else(|| ReplicationError::UnexpectedReply {
                    command: CMD,
                    detail: format!("{name} is NULL"),
                })
        };
        let system_id = field(0, "systemid")?;
        let timeline = field(1, "timeline")?;
        let xlog_pos = field(2, "xlogpos")?;
        Ok(SystemIdentity {
            system_id,
            timeline: timeline
                .parse()
                .map_err(|_| ReplicationError::UnexpectedReply {
                    command: CMD,
                    detail: format!("timeline {timeline:?}"),
                })?,
            xlog_pos: parse_lsn(CMD, &xlog_pos)?,
            dbname: r.value(0, 3),
        })
    }

    /// `CREATE_REPLICATION_SLOT <slot> LOGICAL pgoutput (SNAPSHOT 'export')`: a permanent slot
    /// and a snapshot that sees exactly what the slot will not stream.
    ///
    /// The server waits for every transaction that holds an xid when creation starts (a long
    /// batch or a forgotten prepared transaction stalls it); the wait is bounded by the command
    /// timeout and the cancel token, and on either the server aborts the creation, leaving no
    /// slot.
    pub fn create_slot_exporting_snapshot(
        &mut self,
        slot_name: &str,
    ) -> Result<ExportedSnapshot<'_>, ReplicationError> {
        const CMD: &str = "CREATE_REPLICATION_SLOT";
        validate_slot_name(slot_name)?;
        let started = Instant::now();
        let r = self.session.exec_ok(
            &format!("CREATE_REPLICATION_SLOT {slot_name} LOGICAL pgoutput (SNAPSHOT 'export')"),
            CMD,
        )?;
        let creation_time = started.elapsed();
        if r.ntuples() != 1 || r.nfields() < 4 {
            return Err(shape_error(CMD, r.ntuples(), r.nfields()));
        }
        let field = |col: usize, name: &str| {
            r.value(0, col)
                .ok_or_else(|| ReplicationError::UnexpectedReply {
                    command: CMD,
                    detail: format!("{name} is NULL"),
                })
        };
        let consistent_point = parse_lsn(CMD, &field(1, "consistent_point")?)?;
        let snapshot_name = field(2, "snapshot_name")?;
        let slot = CreatedSlot {
            slot_name: field(0, "slot_name")?,
            consistent_point,
            output_plugin: field(3, "output_plugin")?,
            creation_time,
        };
        info!(
            slot = %slot.slot_name,
            consistent_point = %consistent_point,
            snapshot = %snapshot_name,
            creation_ms = creation_time.as_millis() as u64,
            "replication slot created with exported snapshot"
        );
        Ok(ExportedSnapshot {
            _conn: self,
            slot,
            snapshot_name,
        })
    }

    /// `DROP_REPLICATION_SLOT <slot> WAIT`: waits (within the command timeout) for a walsender
    /// still using the slot to let go of it.
    pub fn drop_slot(&mut self, slot_name: &str) -> Result<(), ReplicationError> {
        validate_slot_name(slot_name)?;
        self.session.exec_ok(
            &format!("DROP_REPLICATION_SLOT {slot_name} WAIT"),
            "DROP_REPLICATION_SLOT",
        )?;
        info!(slot = slot_name, "replication slot dropped");
        Ok(())
    }

    /// `START_REPLICATION SLOT <slot> LOGICAL <start_lsn> (proto_version '1',
    /// publication_names '<publication>', messages 'true')`.
    ///
    /// The server starts at the slot's `confirmed_flush_lsn` if `start_lsn` is older. Get the
    /// connection back with [`ReplicationStream::stop`].
    pub fn start_streaming(
        mut self,
        slot_name: &str,
        start_lsn: Lsn,
        publication: &str,
    ) -> Result<ReplicationStream, ReplicationError> {
        const CMD: &str = "START_REPLICATION";
        validate_slot_name(slot_name)?;
        if publication.is_empty() || publication.contains('\0') {
            return Err(ReplicationError::InvalidName {
                what: "publication",
                name: publication.into(),
                reason: "empty or contains a NUL byte",
            });
        }
        // publication_names is a string literal holding a list of identifiers: quote the name
        // as an identifier, then the whole as a literal (the replication grammar has no E''
        // strings; a quote is escaped by doubling).
        let names = quote_literal(&quote_ident(publication));
        let sql = format!(
            "START_REPLICATION SLOT {slot_name} LOGICAL {start_lsn} \
             (proto_version '1', publication_names {names}, messages 'true')"
        );
        let r = self.session.exec(&sql, CMD)?;
        if r.status() != ResultStatus::CopyBoth {
            return Err(self.session.unexpected(&r, CMD, "COPY BOTH").into());
        }
        info!(slot = slot_name, start = %start_lsn, publication, "streaming started");
        Ok(ReplicationStream {
            conn: self,
            written: start_lsn,
            flushed: start_lsn,
            applied: start_lsn,
            server_wal_end: Lsn::INVALID,
            last_status: Instant::now(),
            finished: false,
        })
    }
}

/// The CopyBoth stream of `START_REPLICATION`.
pub struct ReplicationStream {
    conn: ReplicationConnection,
    written: Lsn,
    flushed: Lsn,
    applied: Lsn,
    server_wal_end: Lsn,
    last_status: Instant,
    /// The server left COPY mode; nothing more can be read.
    finished: bool,
}

impl ReplicationStream {
    /// The next message, waiting at most `timeout` for one (`Ok(None)` when none came).
    ///
    /// A keepalive that asks for a reply is answered with the last reported positions before it
    /// is returned, and a status update is sent every `status_interval` while waiting.
    /// Decode pgoutput payloads with [`crate::PgOutputMessage::decode`] on
    /// [`crate::XLogData::data`].
    pub fn recv(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<ReplicationMessage>, ReplicationError> {
        const OP: &str = "reading the replication stream";
        if self.finished {
            return Err(ReplicationError::StreamEnded);
        }
        let deadline = Deadline::after(timeout);
        loop {
            if self.last_status.elapsed() >= self.conn.options.status_interval {
                self.send_status(false)?;
            }
            let read = match self.conn.session.try_read_copy(OP) {
                Ok(read) => read,
                Err(e) => {
                    if e.server_error().is_some() {
                        // The server ended the stream with an error; the connection itself
                        // is back in command mode, but there is nothing more to read.
                        self.finished = true;
                    }
                    return Err(e.into());
                }
            };
            match read {
                CopyRead::Data(buf) => {
                    let msg = ReplicationMessage::decode(Bytes::from_owner(buf))?;
                    match &msg {
                        ReplicationMessage::XLogData(x) => {
                            self.server_wal_end = self.server_wal_end.max(x.wal_end);
                        }
                        ReplicationMessage::PrimaryKeepalive(k) => {
                            self.server_wal_end = self.server_wal_end.max(k.wal_end);
                            if k.reply_requested {
                                self.send_status(false)?;
                            }
                        }
                    }
                    return Ok(Some(msg));
                }
                CopyRead::WouldBlock => {
                    let status_due = self.last_status + self.conn.options.status_interval;
                    let until = deadline.at.min(status_due);
                    if !self.conn.session.wait_for_input(until, OP)?
                        && Instant::now() >= deadline.at
                    {
                        return Ok(None);
                    }
                }
                CopyRead::Done(result) => {
                    self.finished = true;
                    if result.status() == ResultStatus::CopyIn {
                        // Server sent CopyDone: answer with ours to get back to command mode.
                        self.conn.session.put_copy_end(OP)?;
                        self.conn.session.finish_command(OP)?;
                    }
                    return Err(ReplicationError::StreamEnded);
                }
            }
        }
    }

    /// Reports progress (a Standby Status Update). `flushed` is what the server may treat as
    /// durably consumed: it becomes the slot's `confirmed_flush_lsn`, WAL before it can be
    /// recycled and streaming restarts there, so report only positions whose transactions are
    /// applied and committed on the destination. Positions never move backwards: a value lower
    /// than one reported before is ignored.
    pub fn send_feedback(
        &mut self,
        written: Lsn,
        flushed: Lsn,
        applied: Lsn,
    ) -> Result<(), ReplicationError> {
        self.written = self.written.max(written);
        self.flushed = self.flushed.max(flushed);
        self.applied = self.applied.max(applied);
        self.send_status(false)
    }

    /// Positions last reported (written, flushed, applied).
    pub fn feedback(&self) -> (Lsn, Lsn, Lsn) {
        (self.written, self.flushed, self.applied)
    }

    /// The highest server WAL end seen in XLogData and keepalives.
    pub fn server_wal_end(&self) -> Lsn {
        self.server_wal_end
    }

    pub fn cancel_token(&self) -> CancelToken {
        self.conn.cancel_token()
    }

    fn send_status(&mut self, reply_requested: bool) -> Result<(), ReplicationError> {
        let update = StandbyStatusUpdate {
            written: self.written,
            flushed: self.flushed,
            applied: self.applied,
            client_time_us: system_time_to_pg_timestamp(SystemTime::now()),
            reply_requested,
        };
        self.conn
            .session
            .write_copy(&update.encode(), "sending a standby status update")?;
        self.last_status = Instant::now();
        debug!(written = %self.written, flushed = %self.flushed, applied = %self.applied, "status sent");
        Ok(())
    }

    /// Ends streaming (CopyDone both ways) and returns the connection in command mode, e.g. to
    /// drop the slot. Messages still in flight are discarded; they are sent again by the next
    /// `START_REPLICATION` because they were not confirmed.
    pub fn stop(mut self) -> Result<ReplicationConnection, ReplicationError> {
        const OP: &str = "ending the replication stream";
        if self.finished {
            return Ok(self.conn);
        }
        // Report the final positions, then CopyDone.
        self.send_status(false)?;
        self.conn.session.put_copy_end(OP)?;
        let budget = self.conn.options.command_timeout;
        let deadline = Deadline::after(budget);
        loop {
            let left = deadline.at.saturating_duration_since(Instant::now());
            match self.conn.session.read_copy(left, OP)? {
                CopyRead::Data(_) | CopyRead::WouldBlock => {}
                CopyRead::Done(result) => {
                    if !matches!(
                        result.status(),
                        ResultStatus::CommandOk | ResultStatus::TuplesOk
                    ) {
                        return Err(self
                            .conn
                            .session
                            .unexpected(&result, OP, "command completion")
                            .into());
                    }
                    break;
                }
            }
        }
        info!("streaming stopped");
        Ok(self.conn)
    }
}

fn shape_error(command: &'static str, rows: usize, cols: usize) -> ReplicationError {
    ReplicationError::UnexpectedReply {
        command,
        detail: format!("{rows} rows of {cols} columns"),
    }
}

fn parse_lsn(command: &'static str, s: &str) -> Result<Lsn, ReplicationError> {
    s.parse().map_err(|_| ReplicationError::UnexpectedReply {
        command,
        detail: format!("{s:?} is not an LSN"),
    })
}

/// Slot names are what the server accepts (ReplicationSlotValidateName): 1-63 characters of
/// `[a-z0-9_]`. Checking here also makes them safe to put into commands unquoted.
fn validate_slot_name(name: &str) -> Result<(), ReplicationError> {
    let bad = |reason| ReplicationError::InvalidName {
        what: "slot name",
        name: name.into(),
        reason,
    };
    if name.is_empty() || name.len() > 63 {
        return Err(bad("must be 1 to 63 characters long"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(bad(
            "may contain only lower case letters, digits and underscores",
        ));
    }
    Ok(())
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_validated() {
        assert!(validate_slot_name("remus_m1").is_ok());
        assert!(validate_slot_name(&"a".repeat(63)).is_ok());
        for bad in ["", "Remus", "a-b", "a b", "x;DROP", &"a".repeat(64)] {
            assert!(
                matches!(
                    validate_slot_name(bad),
                    Err(ReplicationError::InvalidName {
                        what: "slot name",
                        ..
                    })
                ),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn publication_names_are_quoted_as_identifier_inside_literal() {
        assert_eq!(quote_literal(&quote_ident("remus_m1")), "'\"remus_m1\"'");
        assert_eq!(
            quote_literal(&quote_ident("it's \"x\"")),
            "'\"it''s \"\"x\"\"\"'"
        );
    }
}
