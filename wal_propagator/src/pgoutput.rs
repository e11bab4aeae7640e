//! Decoding of the walsender's logical replication stream: pgoutput protocol version 1, as sent
//! by PostgreSQL 15.
//!
//! The propagator reads the source through the built-in `pgoutput` plugin rather than a plugin of
//! its own, so the source needs nothing installed beyond a publication and a slot, and the wire
//! format is the documented, stable one ("Logical Replication Message Formats"). Protocol version
//! 1 is deliberate: without streaming of in-progress transactions every transaction arrives whole
//! and already committed, which is exactly the unit the replay worker applies.
//!
//! Decoding is kept free of I/O so that every byte-level case (truncated frames, unchanged TOAST,
//! binary columns, ...) is tested without a server. The bytes come off the network, so anything
//! malformed is a [`DecodeError`], never a panic: a bad frame has to stop a migration cleanly, not
//! take down the process that holds the replication slot. Column values are [`Bytes`] slices of
//! the received frame, so decoding a wide row does not copy it.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;

/// A position in the write-ahead log.
///
/// Displayed and parsed in PostgreSQL's `pg_lsn` text form, two hexadecimal halves separated by a
/// slash (`16/B374D848`), so values can be copied between logs, SQL and the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `InvalidXLogRecPtr`; also what the server treats as "no position" in status updates.
    pub const INVALID: Lsn = Lsn(0);

    pub fn is_valid(self) -> bool {
        self != Self::INVALID
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl From<u64> for Lsn {
    fn from(value: u64) -> Self {
        Lsn(value)
    }
}

impl From<Lsn> for u64 {
    fn from(value: Lsn) -> Self {
        value.0
    }
}

/// Text that is not an LSN in PostgreSQL's `X/X` form.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "invalid LSN {input:?}: expected two hexadecimal numbers of 1 to 8 digits separated by '/'"
)]
pub struct LsnParseError {
    pub input: String,
}

impl FromStr for Lsn {
    type Err = LsnParseError;

    /// Accepts exactly what `pg_lsn_in` accepts: 1 to 8 hex digits, `/`, 1 to 8 hex digits.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || LsnParseError {
            input: s.to_owned(),
        };
        let half = |part: &str| -> Result<u64, LsnParseError> {
            if part.is_empty() || part.len() > 8 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            u64::from_str_radix(part, 16).map_err(|_| err())
        };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        Ok(Lsn((half(hi)? << 32) | half(lo)?))
    }
}

/// Seconds from the Unix epoch to the PostgreSQL epoch, 2000-01-01 00:00:00 UTC.
pub const PG_EPOCH_UNIX_SECS: u64 = 946_684_800;

fn pg_epoch() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS)
}

/// Converts a PostgreSQL timestamp (microseconds since 2000-01-01 UTC) to a [`SystemTime`].
///
/// `None` only if the platform's `SystemTime` cannot represent the instant.
pub fn pg_timestamp_to_system_time(us: i64) -> Option<SystemTime> {
    let offset = Duration::from_micros(us.unsigned_abs());
    if us >= 0 {
        pg_epoch().checked_add(offset)
    } else {
        pg_epoch().checked_sub(offset)
    }
}

/// Converts a [`SystemTime`] to a PostgreSQL timestamp (microseconds since 2000-01-01 UTC).
///
/// Sub-microsecond precision is rounded down (towards the past); instants beyond the range of
/// `i64` microseconds saturate.
pub fn system_time_to_pg_timestamp(t: SystemTime) -> i64 {
    match t.duration_since(pg_epoch()) {
        Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
        Err(before) => {
            let before = before.duration();
            let mut us = before.as_micros();
            if before.subsec_nanos() % 1_000 != 0 {
                us += 1;
            }
            i64::try_from(us).map(|us| -us).unwrap_or(i64::MIN)
        }
    }
}

/// Why a frame could not be decoded. Every variant means the stream is unusable from here on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error(
        "message truncated: {what} needs {needed} bytes at offset {offset}, only {available} left"
    )]
    Truncated {
        what: &'static str,
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("{what} at offset {offset} is not NUL-terminated")]
    UnterminatedString { what: &'static str, offset: usize },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str, offset: usize },
    #[error("negative {what} {value} at offset {offset}")]
    NegativeLength {
        what: &'static str,
        value: i64,
        offset: usize,
    },
    #[error("unknown pgoutput message type {}", show_tag(.0))]
    UnknownMessageType(u8),
    #[error("pgoutput message type {} ({feature}) is not used by protocol version 1", show_tag(.tag))]
    UnsupportedMessageType { tag: u8, feature: &'static str },
    #[error("unknown replication message type {} in CopyData", show_tag(.0))]
    UnknownReplicationMessageType(u8),
    #[error("unknown tuple column kind {} at offset {offset}", show_tag(.kind))]
    UnknownColumnKind { kind: u8, offset: usize },
    #[error("expected {expected} at offset {offset}, found {}", show_tag(.found))]
    UnexpectedMarker {
        expected: &'static str,
        found: u8,
        offset: usize,
    },
    #[error("unknown replica identity {} at offset {offset}", show_tag(.found))]
    UnknownReplicaIdentity { found: u8, offset: usize },
    #[error("invalid {what} {value} at offset {offset}")]
    InvalidValue {
        what: &'static str,
        value: u64,
        offset: usize,
    },
    #[error("{count} unexpected trailing bytes after {what}")]
    TrailingBytes { what: &'static str, count: usize },
}

fn show_tag(tag: &u8) -> String {
    if tag.is_ascii_graphic() {
        format!("'{}'", *tag as char)
    } else {
        format!("0x{tag:02x}")
    }
}

/// Bounds-checked big-endian reader over a received frame. Shared with the assembler's spill
/// files so both formats get the same never-panic guarantees.
pub(crate) struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a Bytes) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn check(&self, needed: usize, what: &'static str) -> Result<(), DecodeError> {
        if needed > self.remaining() {
            return Err(DecodeError::Truncated {
                what,
                offset: self.pos,
                needed,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        self.check(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.pos..self.pos + N]);
        self.pos += N;
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn i16(&mut self, what: &'static str) -> Result<i16, DecodeError> {
        Ok(i16::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn lsn(&mut self, what: &'static str) -> Result<Lsn, DecodeError> {
        self.u64(what).map(Lsn)
    }

    /// A signed 16-bit count that must not be negative.
    pub(crate) fn count16(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let value = self.i16(what)?;
        usize::try_from(value).map_err(|_| DecodeError::NegativeLength {
            what,
            value: value.into(),
            offset,
        })
    }

    /// A signed 32-bit count or length that must not be negative.
    pub(crate) fn count32(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let value = self.i32(what)?;
        usize::try_from(value).map_err(|_| DecodeError::NegativeLength {
            what,
            value: value.into(),
            offset,
        })
    }

    pub(crate) fn bytes(&mut self, len: usize, what: &'static str) -> Result<Bytes, DecodeError> {
        self.check(len, what)?;
        let out = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    /// A NUL-terminated string. Names are required to be UTF-8: pg_remus runs on UTF-8 databases
    /// and a name that is not is a sign of a desynchronised stream.
    pub(crate) fn cstring(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let offset = self.pos;
        let rest = &self.buf[self.pos..];
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString { what, offset })?;
        let s = std::str::from_utf8(&rest[..len])
            .map_err(|_| DecodeError::InvalidUtf8 { what, offset })?
            .to_owned();
        self.pos += len + 1;
        Ok(s)
    }

    pub(crate) fn rest(&mut self) -> Bytes {
        let out = self.buf.slice(self.pos..);
        self.pos = self.buf.len();
        out
    }

    pub(crate) fn finish(&self, what: &'static str) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(DecodeError::TrailingBytes { what, count }),
        }
    }
}

/// One column of a row as sent in TupleData.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ColumnValue {
    /// `'n'`: SQL NULL.
    Null,
    /// `'u'`: an unchanged TOASTed value whose content is not sent; the destination keeps its
    /// current value.
    UnchangedToast,
    /// `'t'`: the value in the type's text output format.
    Text(Bytes),
    /// `'b'`: the value in the type's binary send format (only with the `binary` option).
    Binary(Bytes),
}

impl ColumnValue {
    pub fn is_null(&self) -> bool {
        matches!(self, ColumnValue::Null)
    }

    /// The raw bytes of a text or binary value.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            ColumnValue::Text(b) | ColumnValue::Binary(b) => Some(b),
            ColumnValue::Null | ColumnValue::UnchangedToast => None,
        }
    }

    /// A text-format value as `&str`, if it is one and is valid UTF-8.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            ColumnValue::Text(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// Size of the value's payload in bytes (0 for NULL and unchanged TOAST).
    pub fn payload_len(&self) -> usize {
        self.as_bytes().map_or(0, <[u8]>::len)
    }
}

/// A row: one [`ColumnValue`] per column of the relation, in the Relation message's order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct TupleData {
    pub columns: Vec<ColumnValue>,
}

impl TupleData {
    pub fn new(columns: Vec<ColumnValue>) -> Self {
        Self { columns }
    }

    pub fn len(&self) -> usize {
        self.columns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    pub fn get(&self, index: usize) -> Option<&ColumnValue> {
        self.columns.get(index)
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = r.count16("tuple column count")?;
        // Every column takes at least one byte, so a lying count cannot force a huge allocation.
        let mut columns = Vec::with_capacity(n.min(r.remaining()));
        for _ in 0..n {
            let offset = r.pos();
            let value = match r.u8("tuple column kind")? {
                b'n' => ColumnValue::Null,
                b'u' => ColumnValue::UnchangedToast,
                b't' => {
                    let len = r.count32("text column length")?;
                    ColumnValue::Text(r.bytes(len, "text column value")?)
                }
                b'b' => {
                    let len = r.count32("binary column length")?;
                    ColumnValue::Binary(r.bytes(len, "binary column value")?)
                }
                kind => return Err(DecodeError::UnknownColumnKind { kind, offset }),
            };
            columns.push(value);
        }
        Ok(Self { columns })
    }
}

/// Begin (`'B'`) of a committed transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the transaction's commit record.
    pub final_lsn: Lsn,
    /// Commit timestamp, microseconds since 2000-01-01.
    pub commit_time_us: i64,
    pub xid: u32,
}

/// Commit (`'C'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Currently unused by PostgreSQL (always 0).
    pub flags: u8,
    /// LSN of the commit record; equals the Begin's `final_lsn`.
    pub commit_lsn: Lsn,
    /// End of the commit record: the position to confirm once the transaction is applied.
    pub end_lsn: Lsn,
    /// Commit timestamp, microseconds since 2000-01-01.
    pub commit_time_us: i64,
}

/// Origin (`'O'`): the transaction was itself replicated into the source from another node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// LSN of the commit on the origin server.
    pub commit_lsn: Lsn,
    pub name: String,
}

/// Logical decoding message (`'M'`), written on the source by `pg_logical_emit_message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalMessage {
    pub flags: u8,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Bytes,
}

impl LogicalMessage {
    /// Flag bit: the message was emitted transactionally and belongs to the enclosing transaction.
    pub const TRANSACTIONAL: u8 = 1;

    pub fn is_transactional(&self) -> bool {
        self.flags & Self::TRANSACTIONAL != 0
    }
}

/// `pg_class.relreplident` of a relation: which old values UPDATE and DELETE carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaIdentity {
    /// `'d'`: the primary key.
    Default,
    /// `'n'`: nothing.
    Nothing,
    /// `'f'`: all columns.
    Full,
    /// `'i'`: a chosen unique index.
    Index,
}

impl ReplicaIdentity {
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            b'd' => Some(Self::Default),
            b'n' => Some(Self::Nothing),
            b'f' => Some(Self::Full),
            b'i' => Some(Self::Index),
            _ => None,
        }
    }

    pub fn as_byte(self) -> u8 {
        match self {
            Self::Default => b'd',
            Self::Nothing => b'n',
            Self::Full => b'f',
            Self::Index => b'i',
        }
    }
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Column {
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    /// `atttypmod`, -1 if none.
    pub type_modifier: i32,
}

impl Column {
    /// Flag bit: the column is part of the replica identity (the key).
    pub const KEY: u8 = 1;

    pub fn is_key(&self) -> bool {
        self.flags & Self::KEY != 0
    }
}

/// Relation (`'R'`): the shape of a table, sent before the first change to it in a session and
/// again after every schema change. Changes refer to it by OID only.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Relation {
    pub oid: u32,
    /// Schema name; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    pub replica_identity: ReplicaIdentity,
    /// The published columns, in the order tuples carry them.
    pub columns: Vec<Column>,
}

impl Relation {
    /// Positions of the replica-identity columns (all columns with `REPLICA IDENTITY FULL`).
    pub fn key_column_indexes(&self) -> impl Iterator<Item = usize> + '_ {
        self.columns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_key())
            .map(|(i, _)| i)
    }

    /// The key columns of `tuple`, paired with their descriptions.
    pub fn key_values<'a>(&'a self, tuple: &'a TupleData) -> Vec<(&'a Column, &'a ColumnValue)> {
        self.columns
            .iter()
            .zip(&tuple.columns)
            .filter(|(c, _)| c.is_key())
            .collect()
    }
}

/// Type (`'Y'`): name of a non-built-in data type used by a following Relation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TypeInfo {
    pub oid: u32,
    pub namespace: String,
    pub name: String,
}

/// The old row carried by an UPDATE or DELETE.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum OldTuple {
    /// `'K'`: only the replica-identity columns are set; the others are NULL.
    Key(TupleData),
    /// `'O'`: the whole old row (`REPLICA IDENTITY FULL`).
    Full(TupleData),
}

impl OldTuple {
    pub fn tuple(&self) -> &TupleData {
        match self {
            OldTuple::Key(t) | OldTuple::Full(t) => t,
        }
    }
}

/// Insert (`'I'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub relation_oid: u32,
    pub new: TupleData,
}

/// Update (`'U'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub relation_oid: u32,
    /// Present if the key changed (`'K'`) or the relation has `REPLICA IDENTITY FULL` (`'O'`).
    pub old: Option<OldTuple>,
    pub new: TupleData,
}

/// Delete (`'D'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub relation_oid: u32,
    pub old: OldTuple,
}

/// Truncate (`'T'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    pub options: u8,
    pub relation_oids: Vec<u32>,
}

impl Truncate {
    pub const CASCADE: u8 = 1;
    pub const RESTART_IDENTITY: u8 = 2;

    pub fn cascade(&self) -> bool {
        self.options & Self::CASCADE != 0
    }

    pub fn restart_identity(&self) -> bool {
        self.options & Self::RESTART_IDENTITY != 0
    }
}

/// One pgoutput message, i.e. the payload of one XLogData.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgOutputMessage {
    Begin(Begin),
    Message(LogicalMessage),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(TypeInfo),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
}

impl PgOutputMessage {
    /// Decodes one message. The whole input must be consumed; trailing bytes are an error
    /// because they mean the decoder and the server disagree about the format.
    pub fn decode(data: impl Into<Bytes>) -> Result<Self, DecodeError> {
        let data = data.into();
        let mut r = Reader::new(&data);
        let tag = r.u8("message type").map_err(|_| DecodeError::Empty)?;
        let msg = match tag {
            b'B' => {
                let final_lsn = r.lsn("Begin final LSN")?;
                let commit_time_us = r.i64("Begin commit timestamp")?;
                let xid = r.u32("Begin xid")?;
                Self::Begin(Begin {
                    final_lsn,
                    commit_time_us,
                    xid,
                })
            }
            b'M' => {
                let flags = r.u8("Message flags")?;
                let lsn = r.lsn("Message LSN")?;
                let prefix = r.cstring("Message prefix")?;
                let len = r.count32("Message content length")?;
                let content = r.bytes(len, "Message content")?;
                Self::Message(LogicalMessage {
                    flags,
                    lsn,
                    prefix,
                    content,
                })
            }
            b'C' => {
                let flags = r.u8("Commit flags")?;
                let commit_lsn = r.lsn("Commit LSN")?;
                let end_lsn = r.lsn("Commit end LSN")?;
                let commit_time_us = r.i64("Commit timestamp")?;
                Self::Commit(Commit {
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time_us,
                })
            }
            b'O' => {
                let commit_lsn = r.lsn("Origin commit LSN")?;
                let name = r.cstring("Origin name")?;
                Self::Origin(Origin { commit_lsn, name })
            }
            b'R' => Self::Relation(decode_relation(&mut r)?),
            b'Y' => {
                let oid = r.u32("Type OID")?;
                let namespace = r.cstring("Type namespace")?;
                let name = r.cstring("Type name")?;
                Self::Type(TypeInfo {
                    oid,
                    namespace,
                    name,
                })
            }
            b'I' => {
                let relation_oid = r.u32("Insert relation OID")?;
                expect_marker(&mut r, b'N', "'N' (new tuple)")?;
                let new = TupleData::decode(&mut r)?;
                Self::Insert(Insert { relation_oid, new })
            }
            b'U' => {
                let relation_oid = r.u32("Update relation OID")?;
                let offset = r.pos();
                let old = match r.u8("Update tuple marker")? {
                    b'K' => Some(OldTuple::Key(TupleData::decode(&mut r)?)),
                    b'O' => Some(OldTuple::Full(TupleData::decode(&mut r)?)),
                    b'N' => None,
                    found => {
                        return Err(DecodeError::UnexpectedMarker {
                            expected: "'K', 'O' or 'N'",
                            found,
                            offset,
                        })
                    }
                };
                if old.is_some() {
                    expect_marker(&mut r, b'N', "'N' (new tuple)")?;
                }
                let new = TupleData::decode(&mut r)?;
                Self::Update(Update {
                    relation_oid,
                    old,
                    new,
                })
            }
            b'D' => {
                let relation_oid = r.u32("Delete relation OID")?;
                let offset = r.pos();
                let old = match r.u8("Delete tuple marker")? {
                    b'K' => OldTuple::Key(TupleData::decode(&mut r)?),
                    b'O' => OldTuple::Full(TupleData::decode(&mut r)?),
                    found => {
                        return Err(DecodeError::UnexpectedMarker {
                            expected: "'K' or 'O'",
                            found,
                            offset,
                        })
                    }
                };
                Self::Delete(Delete { relation_oid, old })
            }
            b'T' => {
                let n = r.count32("Truncate relation count")?;
                let options = r.u8("Truncate options")?;
                let mut relation_oids = Vec::with_capacity(n.min(r.remaining() / 4));
                for _ in 0..n {
                    relation_oids.push(r.u32("Truncate relation OID")?);
                }
                Self::Truncate(Truncate {
                    options,
                    relation_oids,
                })
            }
            b'S' | b'E' | b'c' | b'A' => {
                return Err(DecodeError::UnsupportedMessageType {
                    tag,
                    feature: "streamed transactions, protocol version 2",
                })
            }
            b'b' | b'P' | b'K' | b'r' | b'p' => {
                return Err(DecodeError::UnsupportedMessageType {
                    tag,
                    feature: "two-phase commit, protocol version 3",
                })
            }
            other => return Err(DecodeError::UnknownMessageType(other)),
        };
        r.finish(msg.kind())?;
        Ok(msg)
    }

    /// The message type's name, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Begin(_) => "Begin",
            Self::Message(_) => "Message",
            Self::Commit(_) => "Commit",
            Self::Origin(_) => "Origin",
            Self::Relation(_) => "Relation",
            Self::Type(_) => "Type",
            Self::Insert(_) => "Insert",
            Self::Update(_) => "Update",
            Self::Delete(_) => "Delete",
            Self::Truncate(_) => "Truncate",
        }
    }
}

fn expect_marker(
    r: &mut Reader<'_>,
    marker: u8,
    expected: &'static str,
) -> Result<(), DecodeError> {
    let offset = r.pos();
    match r.u8(expected)? {
        found if found == marker => Ok(()),
        found => Err(DecodeError::UnexpectedMarker {
            expected,
            found,
            offset,
        }),
    }
}

fn decode_relation(r: &mut Reader<'_>) -> Result<Relation, DecodeError> {
    let oid = r.u32("Relation OID")?;
    let namespace = r.cstring("Relation namespace")?;
    let name = r.cstring("Relation name")?;
    let offset = r.pos();
    let found = r.u8("Relation replica identity")?;
    let replica_identity = ReplicaIdentity::from_byte(found)
        .ok_or(DecodeError::UnknownReplicaIdentity { found, offset })?;
    let n = r.count16("Relation column count")?;
    // A column needs at least 10 bytes (flags, empty name, type OID, typmod).
    let mut columns = Vec::with_capacity(n.min(r.remaining() / 10));
    for _ in 0..n {
        let flags = r.u8("column flags")?;
        let name = r.cstring("column name")?;
        let type_oid = r.u32("column type OID")?;
        let type_modifier = r.i32("column type modifier")?;
        columns.push(Column {
            flags,
            name,
            type_oid,
            type_modifier,
        });
    }
    Ok(Relation {
        oid,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

/// XLogData (`'w'`): a chunk of the decoded stream, here exactly one pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XLogData {
    /// WAL position of the start of the data.
    pub wal_start: Lsn,
    /// Current end of WAL on the server.
    pub wal_end: Lsn,
    /// Server clock at transmission, microseconds since 2000-01-01.
    pub send_time_us: i64,
    /// The pgoutput message; decode it with [`PgOutputMessage::decode`].
    pub data: Bytes,
}

/// Primary keepalive (`'k'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimaryKeepalive {
    /// Current end of WAL on the server.
    pub wal_end: Lsn,
    /// Server clock at transmission, microseconds since 2000-01-01.
    pub send_time_us: i64,
    /// The server asks for a Standby Status Update right away (it is about to time us out).
    pub reply_requested: bool,
}

/// A message from the server inside the CopyBoth stream of `START_REPLICATION`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    XLogData(XLogData),
    PrimaryKeepalive(PrimaryKeepalive),
}

impl ReplicationMessage {
    /// Decodes the contents of one CopyData message.
    pub fn decode(data: impl Into<Bytes>) -> Result<Self, DecodeError> {
        let data = data.into();
        let mut r = Reader::new(&data);
        let tag = r
            .u8("replication message type")
            .map_err(|_| DecodeError::Empty)?;
        match tag {
            b'w' => {
                let wal_start = r.lsn("XLogData start LSN")?;
                let wal_end = r.lsn("XLogData end LSN")?;
                let send_time_us = r.i64("XLogData send time")?;
                let data = r.rest();
                Ok(Self::XLogData(XLogData {
                    wal_start,
                    wal_end,
                    send_time_us,
                    data,
                }))
            }
            b'k' => {
                let wal_end = r.lsn("keepalive end LSN")?;
                let send_time_us = r.i64("keepalive send time")?;
                let reply_requested = r.u8("keepalive reply flag")? != 0;
                r.finish("primary keepalive")?;
                Ok(Self::PrimaryKeepalive(PrimaryKeepalive {
                    wal_end,
                    send_time_us,
                    reply_requested,
                }))
            }
            other => Err(DecodeError::UnknownReplicationMessageType(other)),
        }
    }
}

/// Standby status update (`'r'`), the client's feedback. The server may recycle WAL and advance
/// the slot up to `flushed`, so only positions whose transactions are durably applied on the
/// destination may be reported there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    /// Last WAL byte + 1 received and written.
    pub written: Lsn,
    /// Last WAL byte + 1 durably stored (for us: durably applied on the destination).
    pub flushed: Lsn,
    /// Last WAL byte + 1 applied.
    pub applied: Lsn,
    /// Client clock, microseconds since 2000-01-01.
    pub client_time_us: i64,
    /// Ask the server to answer with a keepalive immediately.
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    pub const ENCODED_LEN: usize = 34;

    /// The contents of the CopyData message to send.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(Self::ENCODED_LEN);
        b.put_u8(b'r');
        b.put_u64(self.written.0);
        b.put_u64(self.flushed.0);
        b.put_u64(self.applied.0);
        b.put_i64(self.client_time_us);
        b.put_u8(u8::from(self.reply_requested));
        b.freeze()
    }
}

/// Test-only encoder producing the wire format from raw parameters (deliberately not from the
/// decoder's types, so a misunderstanding of the format is not simply mirrored).
#[cfg(test)]
pub(crate) mod test_encode {
    pub(crate) enum Val<'a> {
        N,
        U,
        T(&'a str),
        B(&'a [u8]),
    }

    pub(crate) struct Enc(pub(crate) Vec<u8>);

    impl Enc {
        pub(crate) fn new(tag: u8) -> Self {
            Enc(vec![tag])
        }
        pub(crate) fn u8(mut self, v: u8) -> Self {
            self.0.push(v);
            self
        }
        pub(crate) fn i16(mut self, v: i16) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn u32(mut self, v: u32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn i32(mut self, v: i32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn u64(mut self, v: u64) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn i64(mut self, v: i64) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub(crate) fn cstr(mut self, s: &str) -> Self {
            self.0.extend_from_slice(s.as_bytes());
            self.0.push(0);
            self
        }
        pub(crate) fn raw(mut self, b: &[u8]) -> Self {
            self.0.extend_from_slice(b);
            self
        }
        pub(crate) fn tuple(mut self, vals: &[Val<'_>]) -> Self {
            self = self.i16(vals.len() as i16);
            for v in vals {
                self = match v {
                    Val::N => self.u8(b'n'),
                    Val::U => self.u8(b'u'),
                    Val::T(s) => self.u8(b't').i32(s.len() as i32).raw(s.as_bytes()),
                    Val::B(b) => self.u8(b'b').i32(b.len() as i32).raw(b),
                };
            }
            self
        }
        pub(crate) fn done(self) -> Vec<u8> {
            self.0
        }
    }

    pub(crate) fn begin(final_lsn: u64, commit_time_us: i64, xid: u32) -> Vec<u8> {
        Enc::new(b'B')
            .u64(final_lsn)
            .i64(commit_time_us)
            .u32(xid)
            .done()
    }

    pub(crate) fn commit(commit_lsn: u64, end_lsn: u64, commit_time_us: i64) -> Vec<u8> {
        Enc::new(b'C')
            .u8(0)
            .u64(commit_lsn)
            .u64(end_lsn)
            .i64(commit_time_us)
            .done()
    }

    pub(crate) fn origin(commit_lsn: u64, name: &str) -> Vec<u8> {
        Enc::new(b'O').u64(commit_lsn).cstr(name).done()
    }

    pub(crate) fn message(transactional: bool, lsn: u64, prefix: &str, content: &[u8]) -> Vec<u8> {
        Enc::new(b'M')
            .u8(u8::from(transactional))
            .u64(lsn)
            .cstr(prefix)
            .i32(content.len() as i32)
            .raw(content)
            .done()
    }

    /// `cols`: (flags, name, type OID, typmod).
    pub(crate) fn relation(
        oid: u32,
        namespace: &str,
        name: &str,
        replica_identity: u8,
        cols: &[(u8, &str, u32, i32)],
    ) -> Vec<u8> {
        let mut e = Enc::new(b'R')
            .u32(oid)
            .cstr(namespace)
            .cstr(name)
            .u8(replica_identity)
            .i16(cols.len() as i16);
        for &(flags, name, type_oid, typmod) in cols {
            e = e.u8(flags).cstr(name).u32(type_oid).i32(typmod);
        }
        e.done()
    }

    pub(crate) fn type_msg(oid: u32, namespace: &str, name: &str) -> Vec<u8> {
        Enc::new(b'Y').u32(oid).cstr(namespace).cstr(name).done()
    }

    pub(crate) fn insert(oid: u32, new: &[Val<'_>]) -> Vec<u8> {
        Enc::new(b'I').u32(oid).u8(b'N').tuple(new).done()
    }

    /// `old`: marker (`b'K'` or `b'O'`) and tuple.
    pub(crate) fn update(oid: u32, old: Option<(u8, &[Val<'_>])>, new: &[Val<'_>]) -> Vec<u8> {
        let mut e = Enc::new(b'U').u32(oid);
        if let Some((marker, old)) = old {
            e = e.u8(marker).tuple(old);
        }
        e.u8(b'N').tuple(new).done()
    }

    pub(crate) fn delete(oid: u32, marker: u8, old: &[Val<'_>]) -> Vec<u8> {
        Enc::new(b'D').u32(oid).u8(marker).tuple(old).done()
    }

    pub(crate) fn truncate(options: u8, oids: &[u32]) -> Vec<u8> {
        let mut e = Enc::new(b'T').i32(oids.len() as i32).u8(options);
        for &oid in oids {
            e = e.u32(oid);
        }
        e.done()
    }

    pub(crate) fn xlog_data(start: u64, end: u64, send_time_us: i64, payload: &[u8]) -> Vec<u8> {
        Enc::new(b'w')
            .u64(start)
            .u64(end)
            .i64(send_time_us)
            .raw(payload)
            .done()
    }

    pub(crate) fn keepalive(end: u64, send_time_us: i64, reply: bool) -> Vec<u8> {
        Enc::new(b'k')
            .u64(end)
            .i64(send_time_us)
            .u8(u8::from(reply))
            .done()
    }
}

#[cfg(test)]
mod tests {
    use super::test_encode::{self as enc, Enc, Val};
    use super::*;

    fn decode(bytes: Vec<u8>) -> PgOutputMessage {
        PgOutputMessage::decode(bytes).expect("valid message")
    }

    fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn binary(b: &[u8]) -> ColumnValue {
        ColumnValue::Binary(Bytes::copy_from_slice(b))
    }

    /// One valid encoding of every message type, for the exhaustive truncation tests.
    fn every_message() -> Vec<Vec<u8>> {
        vec![
            enc::begin(0x16_B374_D848, 1, 7),
            enc::commit(0x10, 0x20, 3),
            enc::origin(0x99, "node_a"),
            enc::message(true, 0x40, "remus", b"shadow\0applied"),
            enc::message(false, 0x40, "p", b""),
            enc::relation(
                16384,
                "public",
                "accounts",
                b'd',
                &[(1, "id", 20, -1), (0, "note", 1043, 68)],
            ),
            enc::relation(16385, "", "empty", b'n', &[]),
            enc::type_msg(70000, "public", "mood"),
            enc::insert(16384, &[Val::T("1"), Val::N, Val::U, Val::B(&[0, 1, 2])]),
            enc::insert(16384, &[]),
            enc::update(16384, None, &[Val::T("1"), Val::T("x")]),
            enc::update(
                16384,
                Some((b'K', &[Val::T("1"), Val::N])),
                &[Val::T("2"), Val::U],
            ),
            enc::update(
                16384,
                Some((b'O', &[Val::T("1"), Val::T("a")])),
                &[Val::T("1"), Val::T("b")],
            ),
            enc::delete(16384, b'K', &[Val::T("1"), Val::N]),
            enc::delete(16384, b'O', &[Val::T("1"), Val::B(b"")]),
            enc::truncate(3, &[1, 2, 3]),
        ]
    }

    #[test]
    fn lsn_display_uses_postgres_format() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(0x0000_0001_0000_000A).to_string(), "1/A");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn lsn_parses_postgres_format() {
        assert_eq!("16/B374D848".parse::<Lsn>(), Ok(Lsn(0x16_B374_D848)));
        assert_eq!("16/b374d848".parse::<Lsn>(), Ok(Lsn(0x16_B374_D848)));
        assert_eq!("0/0".parse::<Lsn>(), Ok(Lsn::INVALID));
        assert_eq!("FFFFFFFF/FFFFFFFF".parse::<Lsn>(), Ok(Lsn(u64::MAX)));
        for v in [
            0u64,
            1,
            0xFFFF_FFFF,
            0x1_0000_0000,
            0xDEAD_BEEF_0000_0001,
            u64::MAX,
        ] {
            assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }
    }

    #[test]
    fn lsn_rejects_malformed_text() {
        for bad in [
            "",
            "/",
            "0/",
            "/0",
            "0",
            "16B374D848",
            "1/2/3",
            "100000000/0",
            "0/100000000",
            "g/0",
            " 0/0",
            "0/0 ",
            "+1/0",
            "-1/0",
            "0x1/0",
        ] {
            let err = bad.parse::<Lsn>().expect_err(bad);
            assert_eq!(err.input, bad);
        }
    }

    #[test]
    fn lsn_helpers() {
        assert!(!Lsn::INVALID.is_valid());
        assert!(Lsn(1).is_valid());
        assert_eq!(u64::from(Lsn::from(42u64)), 42);
        assert!(Lsn(1) < Lsn(2));
    }

    #[test]
    fn pg_timestamps_convert_to_and_from_system_time() {
        let pg_epoch = UNIX_EPOCH + Duration::from_secs(946_684_800);
        assert_eq!(pg_timestamp_to_system_time(0), Some(pg_epoch));
        assert_eq!(system_time_to_pg_timestamp(pg_epoch), 0);
        assert_eq!(
            system_time_to_pg_timestamp(UNIX_EPOCH),
            -946_684_800_000_000
        );
        assert_eq!(
            pg_timestamp_to_system_time(-946_684_800_000_000),
            Some(UNIX_EPOCH)
        );
        // 2023-11-14 22:13:20.123456 UTC
        let unix_us: u64 = 1_700_000_000_123_456;
        let t = UNIX_EPOCH + Duration::from_micros(unix_us);
        let pg = system_time_to_pg_timestamp(t);
        assert_eq!(pg, unix_us as i64 - 946_684_800_000_000);
        assert_eq!(pg_timestamp_to_system_time(pg), Some(t));
        for us in [
            1i64,
            -1,
            123_456_789,
            -123_456_789,
            86_400_000_000 * 365 * 100,
        ] {
            assert_eq!(
                system_time_to_pg_timestamp(pg_timestamp_to_system_time(us).unwrap()),
                us
            );
        }
    }

    #[test]
    fn pg_timestamps_round_sub_microseconds_down() {
        let pg_epoch = UNIX_EPOCH + Duration::from_secs(946_684_800);
        assert_eq!(
            system_time_to_pg_timestamp(pg_epoch + Duration::from_nanos(1_999)),
            1
        );
        assert_eq!(
            system_time_to_pg_timestamp(pg_epoch - Duration::from_nanos(1)),
            -1
        );
        assert_eq!(
            system_time_to_pg_timestamp(pg_epoch - Duration::from_nanos(1_000)),
            -1
        );
        assert_eq!(
            system_time_to_pg_timestamp(pg_epoch - Duration::from_nanos(1_001)),
            -2
        );
    }

    #[test]
    fn decodes_begin_from_literal_bytes() {
        let bytes = vec![
            b'B', // type
            0, 0, 0, 0x16, 0xB3, 0x74, 0xD8, 0x48, // final LSN
            0, 0, 0, 0, 0, 0, 0x01, 0x00, // commit timestamp = 256
            0, 0, 0x02, 0x9A, // xid = 666
        ];
        assert_eq!(
            decode(bytes),
            PgOutputMessage::Begin(Begin {
                final_lsn: Lsn(0x16_B374_D848),
                commit_time_us: 256,
                xid: 666,
            })
        );
    }

    #[test]
    fn decodes_commit_from_literal_bytes() {
        let mut bytes = vec![b'C', 0];
        bytes.extend_from_slice(&0x100u64.to_be_bytes());
        bytes.extend_from_slice(&0x138u64.to_be_bytes());
        bytes.extend_from_slice(&(-5i64).to_be_bytes());
        assert_eq!(
            decode(bytes),
            PgOutputMessage::Commit(Commit {
                flags: 0,
                commit_lsn: Lsn(0x100),
                end_lsn: Lsn(0x138),
                commit_time_us: -5,
            })
        );
    }

    #[test]
    fn decodes_origin() {
        assert_eq!(
            decode(enc::origin(0xABCD, "node_a")),
            PgOutputMessage::Origin(Origin {
                commit_lsn: Lsn(0xABCD),
                name: "node_a".into(),
            })
        );
    }

    #[test]
    fn decodes_logical_messages() {
        let PgOutputMessage::Message(m) = decode(enc::message(true, 0x77, "remus", b"a\0b\xff"))
        else {
            panic!("not a Message");
        };
        assert!(m.is_transactional());
        assert_eq!(m.flags, 1);
        assert_eq!(m.lsn, Lsn(0x77));
        assert_eq!(m.prefix, "remus");
        assert_eq!(&m.content[..], b"a\0b\xff");

        let PgOutputMessage::Message(m) = decode(enc::message(false, 0x78, "", b"")) else {
            panic!("not a Message");
        };
        assert!(!m.is_transactional());
        assert_eq!(m.prefix, "");
        assert!(m.content.is_empty());
    }

    #[test]
    fn decodes_relation_with_key_flags() {
        let bytes = enc::relation(
            16384,
            "public",
            "accounts",
            b'i',
            &[
                (1, "tenant", 23, -1),
                (0, "note", 1043, 36),
                (1, "id", 20, -1),
            ],
        );
        let PgOutputMessage::Relation(rel) = decode(bytes) else {
            panic!("not a Relation");
        };
        assert_eq!(rel.oid, 16384);
        assert_eq!(rel.namespace, "public");
        assert_eq!(rel.name, "accounts");
        assert_eq!(rel.replica_identity, ReplicaIdentity::Index);
        assert_eq!(
            rel.columns[1],
            Column {
                flags: 0,
                name: "note".into(),
                type_oid: 1043,
                type_modifier: 36,
            }
        );
        assert_eq!(rel.key_column_indexes().collect::<Vec<_>>(), vec![0, 2]);
        let row = TupleData::new(vec![text("7"), ColumnValue::Null, text("42")]);
        let keys: Vec<_> = rel
            .key_values(&row)
            .into_iter()
            .map(|(c, v)| (c.name.as_str(), v.as_text().unwrap()))
            .collect();
        assert_eq!(keys, vec![("tenant", "7"), ("id", "42")]);
    }

    #[test]
    fn decodes_every_replica_identity() {
        for (byte, ri) in [
            (b'd', ReplicaIdentity::Default),
            (b'n', ReplicaIdentity::Nothing),
            (b'f', ReplicaIdentity::Full),
            (b'i', ReplicaIdentity::Index),
        ] {
            let PgOutputMessage::Relation(rel) = decode(enc::relation(1, "", "t", byte, &[]))
            else {
                panic!("not a Relation");
            };
            assert_eq!(rel.replica_identity, ri);
            assert_eq!(ri.as_byte(), byte);
            assert!(rel.columns.is_empty());
        }
        assert_eq!(
            PgOutputMessage::decode(enc::relation(1, "s", "t", b'x', &[])),
            Err(DecodeError::UnknownReplicaIdentity {
                found: b'x',
                offset: 9
            })
        );
    }

    #[test]
    fn decodes_type() {
        assert_eq!(
            decode(enc::type_msg(70000, "public", "mood")),
            PgOutputMessage::Type(TypeInfo {
                oid: 70000,
                namespace: "public".into(),
                name: "mood".into(),
            })
        );
    }

    #[test]
    fn decodes_insert_with_every_column_kind() {
        let bytes = enc::insert(
            16384,
            &[
                Val::T("héllo"),
                Val::N,
                Val::U,
                Val::B(&[0, 0xFF, 7]),
                Val::T(""),
            ],
        );
        let PgOutputMessage::Insert(ins) = decode(bytes) else {
            panic!("not an Insert");
        };
        assert_eq!(ins.relation_oid, 16384);
        assert_eq!(
            ins.new.columns,
            vec![
                text("héllo"),
                ColumnValue::Null,
                ColumnValue::UnchangedToast,
                binary(&[0, 0xFF, 7]),
                text(""),
            ]
        );
        assert_eq!(ins.new.get(0).unwrap().as_text(), Some("héllo"));
        assert_eq!(ins.new.get(3).unwrap().as_bytes(), Some(&[0, 0xFF, 7][..]));
        assert_eq!(ins.new.get(3).unwrap().as_text(), None);
        assert!(ins.new.get(1).unwrap().is_null());
        assert_eq!(ins.new.get(2).unwrap().as_bytes(), None);
        assert_eq!(ins.new.get(0).unwrap().payload_len(), "héllo".len());
        assert_eq!(ins.new.len(), 5);
    }

    #[test]
    fn insert_requires_new_tuple_marker() {
        let bytes = Enc::new(b'I').u32(1).u8(b'K').tuple(&[]).done();
        assert_eq!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::UnexpectedMarker {
                expected: "'N' (new tuple)",
                found: b'K',
                offset: 5
            })
        );
    }

    #[test]
    fn decodes_update_variants() {
        let PgOutputMessage::Update(u) = decode(enc::update(5, None, &[Val::T("1"), Val::U]))
        else {
            panic!("not an Update");
        };
        assert_eq!(u.relation_oid, 5);
        assert_eq!(u.old, None);
        assert_eq!(u.new.columns, vec![text("1"), ColumnValue::UnchangedToast]);

        let PgOutputMessage::Update(u) = decode(enc::update(
            5,
            Some((b'K', &[Val::T("1"), Val::N])),
            &[Val::T("2"), Val::T("x")],
        )) else {
            panic!("not an Update");
        };
        assert_eq!(
            u.old,
            Some(OldTuple::Key(TupleData::new(vec![
                text("1"),
                ColumnValue::Null
            ])))
        );
        assert_eq!(u.new.columns, vec![text("2"), text("x")]);

        let PgOutputMessage::Update(u) = decode(enc::update(
            5,
            Some((b'O', &[Val::T("1"), Val::B(b"\x01")])),
            &[Val::T("1"), Val::B(b"\x02")],
        )) else {
            panic!("not an Update");
        };
        assert_eq!(
            u.old,
            Some(OldTuple::Full(TupleData::new(vec![
                text("1"),
                binary(b"\x01")
            ])))
        );
        assert_eq!(u.old.as_ref().unwrap().tuple().len(), 2);
    }

    #[test]
    fn update_rejects_bad_markers() {
        let bytes = Enc::new(b'U').u32(5).u8(b'X').tuple(&[]).done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::UnexpectedMarker {
                found: b'X',
                offset: 5,
                ..
            })
        ));
        // Old tuple followed by something other than 'N'.
        let bytes = Enc::new(b'U')
            .u32(5)
            .u8(b'K')
            .tuple(&[Val::N])
            .u8(b'K')
            .tuple(&[Val::N])
            .done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::UnexpectedMarker {
                found: b'K',
                offset: 9,
                ..
            })
        ));
    }

    #[test]
    fn decodes_delete_variants() {
        let PgOutputMessage::Delete(d) = decode(enc::delete(9, b'K', &[Val::T("1"), Val::N]))
        else {
            panic!("not a Delete");
        };
        assert_eq!(d.relation_oid, 9);
        assert_eq!(
            d.old,
            OldTuple::Key(TupleData::new(vec![text("1"), ColumnValue::Null]))
        );

        let PgOutputMessage::Delete(d) = decode(enc::delete(9, b'O', &[Val::T("1"), Val::T("z")]))
        else {
            panic!("not a Delete");
        };
        assert_eq!(
            d.old,
            OldTuple::Full(TupleData::new(vec![text("1"), text("z")]))
        );

        assert!(matches!(
            PgOutputMessage::decode(enc::delete(9, b'N', &[Val::T("1")])),
            Err(DecodeError::UnexpectedMarker {
                found: b'N',
                offset: 5,
                ..
            })
        ));
    }

    #[test]
    fn decodes_truncate() {
        let PgOutputMessage::Truncate(t) = decode(enc::truncate(3, &[10, 11])) else {
            panic!("not a Truncate");
        };
        assert_eq!(t.relation_oids, vec![10, 11]);
        assert!(t.cascade());
        assert!(t.restart_identity());

        let PgOutputMessage::Truncate(t) = decode(enc::truncate(0, &[10])) else {
            panic!("not a Truncate");
        };
        assert!(!t.cascade());
        assert!(!t.restart_identity());

        let PgOutputMessage::Truncate(t) = decode(enc::truncate(Truncate::RESTART_IDENTITY, &[]))
        else {
            panic!("not a Truncate");
        };
        assert!(t.relation_oids.is_empty());
        assert!(!t.cascade());
        assert!(t.restart_identity());
    }

    #[test]
    fn every_strict_prefix_of_every_message_is_an_error() {
        for full in every_message() {
            decode(full.clone());
            for len in 0..full.len() {
                let prefix = full[..len].to_vec();
                let err = PgOutputMessage::decode(prefix)
                    .expect_err(&format!("prefix {len} of {full:?} decoded"));
                if len == 0 {
                    assert_eq!(err, DecodeError::Empty);
                } else {
                    assert!(
                        matches!(
                            err,
                            DecodeError::Truncated { .. } | DecodeError::UnterminatedString { .. }
                        ),
                        "prefix {len} of {full:?}: {err:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        for mut full in every_message() {
            let kind = decode(full.clone()).kind();
            full.push(0);
            assert_eq!(
                PgOutputMessage::decode(full),
                Err(DecodeError::TrailingBytes {
                    what: kind,
                    count: 1
                })
            );
        }
    }

    #[test]
    fn truncated_error_reports_position() {
        let mut bytes = enc::begin(1, 2, 3);
        bytes.truncate(10);
        assert_eq!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::Truncated {
                what: "Begin commit timestamp",
                offset: 9,
                needed: 8,
                available: 1
            })
        );
        // A column claiming more bytes than the frame holds.
        let bytes = Enc::new(b'I')
            .u32(1)
            .u8(b'N')
            .i16(1)
            .u8(b't')
            .i32(100)
            .raw(b"abc")
            .done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::Truncated {
                what: "text column value",
                needed: 100,
                available: 3,
                ..
            })
        ));
    }

    #[test]
    fn unknown_and_unsupported_message_types() {
        assert_eq!(
            PgOutputMessage::decode(vec![b'Z']),
            Err(DecodeError::UnknownMessageType(b'Z'))
        );
        assert_eq!(
            PgOutputMessage::decode(vec![0x00]),
            Err(DecodeError::UnknownMessageType(0))
        );
        for tag in [b'S', b'E', b'c', b'A', b'b', b'P', b'K', b'r', b'p'] {
            assert!(matches!(
                PgOutputMessage::decode(vec![tag, 0, 0, 0, 0]),
                Err(DecodeError::UnsupportedMessageType { tag: t, .. }) if t == tag
            ));
        }
        assert_eq!(PgOutputMessage::decode(Vec::new()), Err(DecodeError::Empty));
        assert_eq!(
            DecodeError::UnknownMessageType(b'Z').to_string(),
            "unknown pgoutput message type 'Z'"
        );
        assert_eq!(
            DecodeError::UnknownMessageType(0x01).to_string(),
            "unknown pgoutput message type 0x01"
        );
    }

    #[test]
    fn unknown_column_kind_is_an_error() {
        let bytes = Enc::new(b'I')
            .u32(1)
            .u8(b'N')
            .i16(2)
            .u8(b'n')
            .u8(b'x')
            .done();
        assert_eq!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::UnknownColumnKind {
                kind: b'x',
                offset: 9
            })
        );
    }

    #[test]
    fn negative_counts_and_lengths_are_errors() {
        let bytes = Enc::new(b'I').u32(1).u8(b'N').i16(-1).done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::NegativeLength {
                what: "tuple column count",
                value: -1,
                offset: 6
            })
        ));
        let bytes = Enc::new(b'I')
            .u32(1)
            .u8(b'N')
            .i16(1)
            .u8(b'b')
            .i32(-4)
            .done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::NegativeLength {
                what: "binary column length",
                value: -4,
                ..
            })
        ));
        let bytes = Enc::new(b'M').u8(1).u64(1).cstr("p").i32(i32::MIN).done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::NegativeLength {
                what: "Message content length",
                ..
            })
        ));
        let bytes = Enc::new(b'T').i32(-2).u8(0).done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::NegativeLength {
                what: "Truncate relation count",
                ..
            })
        ));
        let bytes = Enc::new(b'R')
            .u32(1)
            .cstr("")
            .cstr("t")
            .u8(b'd')
            .i16(-3)
            .done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::NegativeLength {
                what: "Relation column count",
                ..
            })
        ));
    }

    #[test]
    fn huge_counts_in_short_frames_fail_without_allocating() {
        let bytes = Enc::new(b'T').i32(i32::MAX).u8(0).u32(1).done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::Truncated {
                what: "Truncate relation OID",
                ..
            })
        ));
        let bytes = Enc::new(b'I').u32(1).u8(b'N').i16(i16::MAX).u8(b'n').done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::Truncated {
                what: "tuple column kind",
                ..
            })
        ));
        let bytes = Enc::new(b'R')
            .u32(1)
            .cstr("")
            .cstr("t")
            .u8(b'd')
            .i16(i16::MAX)
            .done();
        assert!(matches!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::Truncated {
                what: "column flags",
                ..
            })
        ));
    }

    #[test]
    fn names_must_be_terminated_utf8() {
        let bytes = Enc::new(b'O').u64(1).raw(b"no-nul").done();
        assert_eq!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::UnterminatedString {
                what: "Origin name",
                offset: 9
            })
        );
        let bytes = Enc::new(b'Y').u32(1).raw(b"\xff\xfe\0").cstr("t").done();
        assert_eq!(
            PgOutputMessage::decode(bytes),
            Err(DecodeError::InvalidUtf8 {
                what: "Type namespace",
                offset: 5
            })
        );
    }

    #[test]
    fn decoded_values_share_the_frame_buffer() {
        let frame = Bytes::from(enc::insert(1, &[Val::T("shared")]));
        let PgOutputMessage::Insert(ins) = PgOutputMessage::decode(frame.clone()).unwrap() else {
            panic!("not an Insert");
        };
        let ColumnValue::Text(value) = &ins.new.columns[0] else {
            panic!("not text");
        };
        let frame_range = frame.as_ptr_range();
        assert!(frame_range.contains(&value.as_ptr()));
    }

    #[test]
    fn decodes_xlog_data() {
        let payload = enc::begin(0x500, 9, 77);
        let bytes = enc::xlog_data(0x400, 0x600, 12345, &payload);
        let ReplicationMessage::XLogData(x) = ReplicationMessage::decode(bytes).unwrap() else {
            panic!("not XLogData");
        };
        assert_eq!(x.wal_start, Lsn(0x400));
        assert_eq!(x.wal_end, Lsn(0x600));
        assert_eq!(x.send_time_us, 12345);
        assert_eq!(&x.data[..], &payload[..]);
        assert_eq!(
            PgOutputMessage::decode(x.data).unwrap(),
            PgOutputMessage::Begin(Begin {
                final_lsn: Lsn(0x500),
                commit_time_us: 9,
                xid: 77
            })
        );
        // An XLogData without payload is well-formed framing (the payload then fails to decode).
        let ReplicationMessage::XLogData(x) =
            ReplicationMessage::decode(enc::xlog_data(1, 2, 3, &[])).unwrap()
        else {
            panic!("not XLogData");
        };
        assert!(x.data.is_empty());
        assert_eq!(PgOutputMessage::decode(x.data), Err(DecodeError::Empty));
    }

    #[test]
    fn decodes_primary_keepalive() {
        for reply in [false, true] {
            let bytes = enc::keepalive(0xABCDEF, -7, reply);
            assert_eq!(bytes.len(), 18);
            assert_eq!(
                ReplicationMessage::decode(bytes).unwrap(),
                ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
                    wal_end: Lsn(0xABCDEF),
                    send_time_us: -7,
                    reply_requested: reply,
                })
            );
        }
        let mut bytes = enc::keepalive(1, 1, false);
        bytes.push(0);
        assert_eq!(
            ReplicationMessage::decode(bytes),
            Err(DecodeError::TrailingBytes {
                what: "primary keepalive",
                count: 1
            })
        );
    }

    #[test]
    fn replication_message_framing_errors() {
        assert_eq!(
            ReplicationMessage::decode(Vec::new()),
            Err(DecodeError::Empty)
        );
        assert_eq!(
            ReplicationMessage::decode(vec![b'r', 0]),
            Err(DecodeError::UnknownReplicationMessageType(b'r'))
        );
        for full in [enc::keepalive(1, 2, true), enc::xlog_data(1, 2, 3, b"")] {
            for len in 1..full.len() {
                assert!(matches!(
                    ReplicationMessage::decode(full[..len].to_vec()),
                    Err(DecodeError::Truncated { .. })
                ));
            }
        }
    }

    #[test]
    fn encodes_standby_status_update() {
        let update = StandbyStatusUpdate {
            written: Lsn(0x0102_0304_0506_0708),
            flushed: Lsn(0x10),
            applied: Lsn(0x0F),
            client_time_us: -2,
            reply_requested: true,
        };
        let mut expected = vec![b'r'];
        expected.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0x10]);
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0x0F]);
        expected.extend_from_slice(&[0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFE]);
        expected.push(1);
        assert_eq!(&update.encode()[..], &expected[..]);
        assert_eq!(update.encode().len(), StandbyStatusUpdate::ENCODED_LEN);

        let quiet = StandbyStatusUpdate {
            reply_requested: false,
            ..update
        };
        assert_eq!(quiet.encode()[33], 0);
    }
}
