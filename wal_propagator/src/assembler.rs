//! Assembly of the pgoutput message stream into whole, self-contained committed transactions.
//!
//! The replay worker applies every source transaction as one shadow transaction on the
//! destination, and its scheduler needs each transaction's complete row set before it can decide
//! what may run in parallel. pgoutput, however, sends a flat stream in which a table's shape is
//! sent once per session and changes refer to it by OID only. [`TxnAssembler`] therefore keeps
//! the relation cache and turns Begin .. Commit into one [`CommittedTxn`] whose changes carry
//! the relation description that was current when they were made (so a schema change inside the
//! transaction is honoured), and can be shipped and applied without any session state.
//!
//! A bulk load on the source can be a single transaction of millions of rows, and nothing is
//! emitted before its Commit arrives. So that one statement cannot exhaust the propagator's
//! memory while the transaction streams in, a transaction whose buffered changes exceed a
//! threshold is moved to an anonymous temporary file and read back only at Commit.
//!
//! Logical messages with the prefix [`MESSAGE_PREFIX`] (`remus_proto::names`) mark transactions
//! that pg_remus already applied on the destination itself (shadow-applied writes); applying
//! them again would duplicate rows, so they are surfaced on the transaction for the caller to
//! skip it. Such a message names one migration (its content is that migration's shadow gid),
//! and it marks the transaction only for that migration's stream
//! ([`CommittedTxn::is_remus_marked`]): every slot on the source receives it. pgoutput only
//! sends logical messages when `START_REPLICATION` passes the option `messages 'true'`; without
//! it these markers are silently missing.
//!
//! Protocol violations are errors rather than repaired: after any error the stream position is
//! unknown, and the only safe recovery is to [`TxnAssembler::reset`] and restart streaming from
//! the last confirmed LSN.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::mem;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use remus_proto::names::{parse_shadow_gid, MESSAGE_PREFIX};
use thiserror::Error;
use tracing::{debug, trace};

use crate::pgoutput::{
    pg_timestamp_to_system_time, Begin, Column, ColumnValue, Commit, DecodeError, LogicalMessage,
    Lsn, OldTuple, Origin, PgOutputMessage, Reader, Relation, TupleData, TypeInfo,
};

/// Tuning of a [`TxnAssembler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssemblerConfig {
    /// A transaction is spilled to disk once its buffered changes exceed this many bytes
    /// (an estimate of their in-memory size).
    pub spill_threshold_bytes: usize,
    /// Directory for spill files; the system temporary directory if `None`.
    pub spill_dir: Option<PathBuf>,
}

impl Default for AssemblerConfig {
    fn default() -> Self {
        Self {
            spill_threshold_bytes: 64 * 1024 * 1024,
            spill_dir: None,
        }
    }
}

/// One row change of a committed transaction, with the shape of the relation(s) it touched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Insert {
        relation: Arc<Relation>,
        new: TupleData,
    },
    Update {
        relation: Arc<Relation>,
        /// See [`crate::pgoutput::Update::old`].
        old: Option<OldTuple>,
        new: TupleData,
    },
    Delete {
        relation: Arc<Relation>,
        old: OldTuple,
    },
    Truncate {
        relations: Vec<Arc<Relation>>,
        /// [`crate::pgoutput::Truncate::CASCADE`] and/or
        /// [`crate::pgoutput::Truncate::RESTART_IDENTITY`].
        options: u8,
    },
}

impl Change {
    /// The relations the change touches (exactly one except for TRUNCATE).
    pub fn relations(&self) -> &[Arc<Relation>] {
        match self {
            Change::Insert { relation, .. }
            | Change::Update { relation, .. }
            | Change::Delete { relation, .. } => std::slice::from_ref(relation),
            Change::Truncate { relations, .. } => relations,
        }
    }

    /// Key columns identifying the row as it was before the change: the old tuple's for DELETE
    /// and for an UPDATE that carries one, otherwise (UPDATE that left the key alone) the new
    /// tuple's. `None` for INSERT and TRUNCATE. Empty if the relation has no replica identity.
    /// Values of the new tuple may be [`ColumnValue::UnchangedToast`].
    pub fn old_key(&self) -> Option<Vec<(&Column, &ColumnValue)>> {
        match self {
            Change::Update { relation, old, new } => {
                Some(relation.key_values(old.as_ref().map_or(new, OldTuple::tuple)))
            }
            Change::Delete { relation, old } => Some(relation.key_values(old.tuple())),
            Change::Insert { .. } | Change::Truncate { .. } => None,
        }
    }

    /// Key columns of the row after the change (INSERT and UPDATE).
    pub fn new_key(&self) -> Option<Vec<(&Column, &ColumnValue)>> {
        match self {
            Change::Insert { relation, new } | Change::Update { relation, new, .. } => {
                Some(relation.key_values(new))
            }
            Change::Delete { .. } | Change::Truncate { .. } => None,
        }
    }

    /// Rough in-memory footprint, for the spill threshold.
    fn approx_size(&self) -> usize {
        fn tuple(t: &TupleData) -> usize {
            mem::size_of::<TupleData>()
                + t.columns
                    .iter()
                    .map(|c| mem::size_of::<ColumnValue>() + c.payload_len())
                    .sum::<usize>()
        }
        mem::size_of::<Change>()
            + match self {
                Change::Insert { new, .. } => tuple(new),
                Change::Update { old, new, .. } => {
                    old.as_ref().map_or(0, |o| tuple(o.tuple())) + tuple(new)
                }
                Change::Delete { old, .. } => tuple(old.tuple()),
                Change::Truncate { relations, .. } => relations.len() * mem::size_of::<usize>(),
            }
    }
}

/// A transactional logical message, in its place among the transaction's changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnMessage {
    /// Number of changes of the transaction that precede the message.
    pub after_changes: usize,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Bytes,
}

impl TxnMessage {
    /// The message has pg_remus's prefix, whichever migration it names.
    pub fn is_remus(&self) -> bool {
        self.prefix == MESSAGE_PREFIX
    }

    /// The shadow gid this message names if it is a `remus` message of migration
    /// `migration_id` (content `remus:<migration_id>:<xid>`); `None` for any other message,
    /// including the `remus` messages of other migrations from the same source.
    pub fn shadow_gid_of(&self, migration_id: u64) -> Option<&str> {
        if !self.is_remus() {
            return None;
        }
        let gid = std::str::from_utf8(&self.content).ok()?;
        match parse_shadow_gid(gid) {
            Some((m, _)) if m == migration_id => Some(gid),
            _ => None,
        }
    }

    fn approx_size(&self) -> usize {
        mem::size_of::<TxnMessage>() + self.prefix.len() + self.content.len()
    }
}

/// A whole committed source transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedTxn {
    pub xid: u32,
    /// The Begin's final LSN (equal to `commit_lsn`).
    pub begin_final_lsn: Lsn,
    pub commit_lsn: Lsn,
    /// End of the commit record: what may be confirmed to the source once this is applied.
    pub end_lsn: Lsn,
    /// Microseconds since 2000-01-01.
    pub commit_time_us: i64,
    /// Set if the transaction was replicated into the source from elsewhere.
    pub origin: Option<Origin>,
    pub changes: Vec<Change>,
    /// Transactional logical messages, all prefixes, in stream order.
    pub messages: Vec<TxnMessage>,
}

impl CommittedTxn {
    /// The transaction carries a `remus` message of migration `migration_id`: pg_remus already
    /// prepared it as a shadow on that migration's destination, and that migration's stream
    /// must not replay it. PG 15's pgoutput sends every transactional message to every slot,
    /// so a transaction validated for another migration from the same source also carries that
    /// migration's message; it does not mark the transaction for this one.
    pub fn is_remus_marked(&self, migration_id: u64) -> bool {
        self.shadow_gid(migration_id).is_some()
    }

    /// The gid of the prepared shadow of migration `migration_id` that this transaction names:
    /// the first `remus` message naming that migration, skipping those of other migrations.
    pub fn shadow_gid(&self, migration_id: u64) -> Option<&str> {
        self.messages
            .iter()
            .find_map(|m| m.shadow_gid_of(migration_id))
    }

    /// Every `remus` message of the transaction, whichever migration it names.
    pub fn remus_messages(&self) -> impl Iterator<Item = &TxnMessage> {
        self.messages.iter().filter(|m| m.is_remus())
    }

    pub fn commit_time(&self) -> Option<SystemTime> {
        pg_timestamp_to_system_time(self.commit_time_us)
    }
}

/// What [`TxnAssembler::push`] produces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assembled {
    /// A transaction's Commit arrived.
    Txn(CommittedTxn),
    /// A non-transactional logical message; it belongs to no transaction and is delivered as
    /// soon as it is decoded.
    Message(LogicalMessage),
}

/// A stream that does not follow the protocol, or a spill file that failed.
#[derive(Debug, Error)]
pub enum AssembleError {
    #[error("{message} outside a transaction")]
    OutsideTransaction { message: &'static str },
    #[error("Begin of transaction {new_xid} while transaction {open_xid} is still open")]
    NestedBegin { open_xid: u32, new_xid: u32 },
    #[error("change refers to relation {0}, for which no Relation message was received")]
    UnknownRelation(u32),
    #[error(
        "tuple of relation {relation_oid} has {found} columns, its Relation message {expected}"
    )]
    ColumnCountMismatch {
        relation_oid: u32,
        expected: usize,
        found: usize,
    },
    #[error("Commit at {commit_lsn} does not match the final LSN {begin_final_lsn} of transaction {xid}")]
    CommitMismatch {
        xid: u32,
        begin_final_lsn: Lsn,
        commit_lsn: Lsn,
    },
    #[error("spill file I/O failed")]
    SpillIo(#[from] io::Error),
    #[error("spill file is corrupt")]
    SpillCorrupt(#[source] DecodeError),
}

enum Entry {
    Change(Change),
    Message(TxnMessage),
}

impl Entry {
    fn approx_size(&self) -> usize {
        match self {
            Entry::Change(c) => c.approx_size(),
            Entry::Message(m) => m.approx_size(),
        }
    }
}

struct OpenTxn {
    begin: Begin,
    origin: Option<Origin>,
    change_count: usize,
    buffer: Vec<Entry>,
    buffered_bytes: usize,
    spill: Option<SpillFile>,
}

impl OpenTxn {
    fn add(&mut self, entry: Entry, config: &AssemblerConfig) -> Result<(), AssembleError> {
        if matches!(entry, Entry::Change(_)) {
            self.change_count += 1;
        }
        if let Some(spill) = &mut self.spill {
            spill.write(&entry)?;
            return Ok(());
        }
        self.buffered_bytes += entry.approx_size();
        self.buffer.push(entry);
        if self.buffered_bytes > config.spill_threshold_bytes {
            let mut spill = SpillFile::create(config)?;
            for entry in mem::take(&mut self.buffer) {
                spill.write(&entry)?;
            }
            debug!(
                xid = self.begin.xid,
                bytes = self.buffered_bytes,
                entries = spill.entries,
                "transaction exceeds the spill threshold, spilling to disk"
            );
            self.buffered_bytes = 0;
            self.spill = Some(spill);
        }
        Ok(())
    }

    fn finish(self, commit: Commit) -> Result<CommittedTxn, AssembleError> {
        let mut changes = Vec::with_capacity(self.change_count);
        let mut messages = Vec::new();
        let mut sort = |entry: Entry| match entry {
            Entry::Change(c) => changes.push(c),
            Entry::Message(m) => messages.push(m),
        };
        match self.spill {
            Some(spill) => spill.read_back(&mut sort)?,
            None => self.buffer.into_iter().for_each(sort),
        }
        Ok(CommittedTxn {
            xid: self.begin.xid,
            begin_final_lsn: self.begin.final_lsn,
            commit_lsn: commit.commit_lsn,
            end_lsn: commit.end_lsn,
            commit_time_us: commit.commit_time_us,
            origin: self.origin,
            changes,
            messages,
        })
    }
}

/// Turns the pgoutput message stream into [`CommittedTxn`]s.
///
/// Feed it every decoded message in stream order with [`push`](Self::push). After an error,
/// call [`reset`](Self::reset) and restart streaming from the last confirmed LSN.
pub struct TxnAssembler {
    config: AssemblerConfig,
    relations: HashMap<u32, Arc<Relation>>,
    types: HashMap<u32, TypeInfo>,
    open: Option<OpenTxn>,
}

impl TxnAssembler {
    pub fn new(config: AssemblerConfig) -> Self {
        Self {
            config,
            relations: HashMap::new(),
            types: HashMap::new(),
            open: None,
        }
    }

    pub fn config(&self) -> &AssemblerConfig {
        &self.config
    }

    /// Consumes the next message of the stream. Returns a transaction when its Commit arrives
    /// and a non-transactional logical message as soon as it is seen.
    pub fn push(&mut self, msg: PgOutputMessage) -> Result<Option<Assembled>, AssembleError> {
        let kind = msg.kind();
        let entry = match msg {
            PgOutputMessage::Begin(begin) => {
                if let Some(open) = &self.open {
                    return Err(AssembleError::NestedBegin {
                        open_xid: open.begin.xid,
                        new_xid: begin.xid,
                    });
                }
                trace!(xid = begin.xid, final_lsn = %begin.final_lsn, "begin");
                self.open = Some(OpenTxn {
                    begin,
                    origin: None,
                    change_count: 0,
                    buffer: Vec::new(),
                    buffered_bytes: 0,
                    spill: None,
                });
                return Ok(None);
            }
            PgOutputMessage::Commit(commit) => {
                let open = self.open_txn("Commit")?;
                if open.begin.final_lsn != commit.commit_lsn {
                    return Err(AssembleError::CommitMismatch {
                        xid: open.begin.xid,
                        begin_final_lsn: open.begin.final_lsn,
                        commit_lsn: commit.commit_lsn,
                    });
                }
                let Some(open) = self.open.take() else {
                    return Err(AssembleError::OutsideTransaction { message: kind });
                };
                let txn = open.finish(commit)?;
                trace!(
                    xid = txn.xid,
                    end_lsn = %txn.end_lsn,
                    changes = txn.changes.len(),
                    "commit"
                );
                return Ok(Some(Assembled::Txn(txn)));
            }
            PgOutputMessage::Origin(origin) => {
                self.open_txn("Origin")?.origin = Some(origin);
                return Ok(None);
            }
            PgOutputMessage::Relation(relation) => {
                self.relations.insert(relation.oid, Arc::new(relation));
                return Ok(None);
            }
            PgOutputMessage::Type(info) => {
                self.types.insert(info.oid, info);
                return Ok(None);
            }
            PgOutputMessage::Message(message) => {
                if !message.is_transactional() {
                    return Ok(Some(Assembled::Message(message)));
                }
                let open = self.open_txn("transactional Message")?;
                Entry::Message(TxnMessage {
                    after_changes: open.change_count,
                    lsn: message.lsn,
                    prefix: message.prefix,
                    content: message.content,
                })
            }
            PgOutputMessage::Insert(insert) => {
                self.open_txn("Insert")?;
                let relation = self.relation(insert.relation_oid, [Some(&insert.new)])?;
                Entry::Change(Change::Insert {
                    relation,
                    new: insert.new,
                })
            }
            PgOutputMessage::Update(update) => {
                self.open_txn("Update")?;
                let old = update.old.as_ref().map(OldTuple::tuple);
                let relation = self.relation(update.relation_oid, [old, Some(&update.new)])?;
                Entry::Change(Change::Update {
                    relation,
                    old: update.old,
                    new: update.new,
                })
            }
            PgOutputMessage::Delete(delete) => {
                self.open_txn("Delete")?;
                let relation = self.relation(delete.relation_oid, [Some(delete.old.tuple())])?;
                Entry::Change(Change::Delete {
                    relation,
                    old: delete.old,
                })
            }
            PgOutputMessage::Truncate(truncate) => {
                self.open_txn("Truncate")?;
                let relations = truncate
                    .relation_oids
                    .iter()
                    .map(|&oid| self.relation(oid, []))
                    .collect::<Result<Vec<_>, _>>()?;
                Entry::Change(Change::Truncate {
                    relations,
                    options: truncate.options,
                })
            }
        };
        // Every arm that yields an entry has already checked for an open transaction.
        let Some(open) = self.open.as_mut() else {
            return Err(AssembleError::OutsideTransaction { message: kind });
        };
        open.add(entry, &self.config)?;
        Ok(None)
    }

    fn open_txn(&mut self, message: &'static str) -> Result<&mut OpenTxn, AssembleError> {
        self.open
            .as_mut()
            .ok_or(AssembleError::OutsideTransaction { message })
    }

    /// The current description of `oid`, checked against the tuples that refer to it.
    fn relation<const N: usize>(
        &self,
        oid: u32,
        tuples: [Option<&TupleData>; N],
    ) -> Result<Arc<Relation>, AssembleError> {
        let relation = self
            .relations
            .get(&oid)
            .ok_or(AssembleError::UnknownRelation(oid))?;
        for tuple in tuples.into_iter().flatten() {
            if tuple.len() != relation.columns.len() {
                return Err(AssembleError::ColumnCountMismatch {
                    relation_oid: oid,
                    expected: relation.columns.len(),
                    found: tuple.len(),
                });
            }
        }
        Ok(Arc::clone(relation))
    }

    /// The latest Relation message received for `oid`.
    pub fn relation_by_oid(&self, oid: u32) -> Option<&Arc<Relation>> {
        self.relations.get(&oid)
    }

    /// The latest Type message received for `oid`.
    pub fn type_by_oid(&self, oid: u32) -> Option<&TypeInfo> {
        self.types.get(&oid)
    }

    /// Whether a Begin has been seen without its Commit yet.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// Whether the open transaction has been moved to a spill file.
    pub fn is_spilling(&self) -> bool {
        self.open.as_ref().is_some_and(|o| o.spill.is_some())
    }

    /// Forgets the open transaction (deleting its spill file) and the relation and type caches,
    /// as needed before streaming restarts: the server sends Relation messages again in every
    /// new session.
    pub fn reset(&mut self) {
        if let Some(open) = self.open.take() {
            debug!(xid = open.begin.xid, "discarding incomplete transaction");
        }
        self.relations.clear();
        self.types.clear();
    }
}

/// A transaction's entries on disk.
///
/// Relation descriptions are not written: they stay in memory (one `Arc` per distinct version,
/// few per transaction) and entries refer to them by index. Each entry is a frame: a `u32`
/// length followed by the body, all big-endian, tuples in the pgoutput TupleData layout but
/// with `u32` counts and lengths.
struct SpillFile {
    writer: BufWriter<File>,
    relations: Vec<Arc<Relation>>,
    /// `Arc::as_ptr` of each element of `relations`. The pointers stay unique because
    /// `relations` keeps every allocation alive for the life of the file.
    relation_index: HashMap<usize, u32>,
    entries: usize,
    frame: Vec<u8>,
}

const SPILL_INSERT: u8 = b'I';
const SPILL_UPDATE: u8 = b'U';
const SPILL_DELETE: u8 = b'D';
const SPILL_TRUNCATE: u8 = b'T';
const SPILL_MESSAGE: u8 = b'M';
const SPILL_NO_OLD: u8 = 0;

impl SpillFile {
    fn create(config: &AssemblerConfig) -> io::Result<Self> {
        // Anonymous: the file is unlinked at once, so nothing is left behind on any exit path.
        let file = match &config.spill_dir {
            Some(dir) => tempfile::tempfile_in(dir)?,
            None => tempfile::tempfile()?,
        };
        Ok(Self {
            writer: BufWriter::new(file),
            relations: Vec::new(),
            relation_index: HashMap::new(),
            entries: 0,
            frame: Vec::new(),
        })
    }

    fn relation_ref(&mut self, relation: &Arc<Relation>) -> u32 {
        let key = Arc::as_ptr(relation) as usize;
        if let Some(&index) = self.relation_index.get(&key) {
            return index;
        }
        let index = self.relations.len() as u32;
        self.relations.push(Arc::clone(relation));
        self.relation_index.insert(key, index);
        index
    }

    fn write(&mut self, entry: &Entry) -> io::Result<()> {
        let mut frame = mem::take(&mut self.frame);
        frame.clear();
        let result = self.encode(entry, &mut frame).and_then(|()| {
            let len = len_u32(frame.len())?;
            self.writer.write_all(&len.to_be_bytes())?;
            self.writer.write_all(&frame)
        });
        self.frame = frame;
        self.entries += 1;
        result
    }

    fn encode(&mut self, entry: &Entry, out: &mut Vec<u8>) -> io::Result<()> {
        match entry {
            Entry::Change(Change::Insert { relation, new }) => {
                out.push(SPILL_INSERT);
                out.extend_from_slice(&self.relation_ref(relation).to_be_bytes());
                encode_tuple(new, out)?;
            }
            Entry::Change(Change::Update { relation, old, new }) => {
                out.push(SPILL_UPDATE);
                out.extend_from_slice(&self.relation_ref(relation).to_be_bytes());
                match old {
                    None => out.push(SPILL_NO_OLD),
                    Some(old) => encode_old(old, out)?,
                }
                encode_tuple(new, out)?;
            }
            Entry::Change(Change::Delete { relation, old }) => {
                out.push(SPILL_DELETE);
                out.extend_from_slice(&self.relation_ref(relation).to_be_bytes());
                encode_old(old, out)?;
            }
            Entry::Change(Change::Truncate { relations, options }) => {
                out.push(SPILL_TRUNCATE);
                out.push(*options);
                out.extend_from_slice(&len_u32(relations.len())?.to_be_bytes());
                for relation in relations {
                    out.extend_from_slice(&self.relation_ref(relation).to_be_bytes());
                }
            }
            Entry::Message(m) => {
                out.push(SPILL_MESSAGE);
                out.extend_from_slice(&(m.after_changes as u64).to_be_bytes());
                out.extend_from_slice(&m.lsn.0.to_be_bytes());
                encode_bytes(m.prefix.as_bytes(), out)?;
                encode_bytes(&m.content, out)?;
            }
        }
        Ok(())
    }

    fn read_back(self, mut sink: impl FnMut(Entry)) -> Result<(), AssembleError> {
        let mut file = self
            .writer
            .into_inner()
            .map_err(io::IntoInnerError::into_error)?;
        file.seek(SeekFrom::Start(0))?;
        let mut reader = BufReader::new(file);
        for _ in 0..self.entries {
            let mut len = [0u8; 4];
            reader.read_exact(&mut len)?;
            let len = u32::from_be_bytes(len) as usize;
            // Read through `take` so a corrupt length cannot make us allocate gigabytes up front.
            let mut frame = Vec::new();
            (&mut reader).take(len as u64).read_to_end(&mut frame)?;
            if frame.len() != len {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
            let entry = decode_entry(&Bytes::from(frame), &self.relations)
                .map_err(AssembleError::SpillCorrupt)?;
            sink(entry);
        }
        Ok(())
    }
}

fn len_u32(len: usize) -> io::Result<u32> {
    u32::try_from(len).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{len} bytes do not fit a spill frame"),
        )
    })
}

fn encode_bytes(bytes: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
    out.extend_from_slice(&len_u32(bytes.len())?.to_be_bytes());
    out.extend_from_slice(bytes);
    Ok(())
}

fn encode_old(old: &OldTuple, out: &mut Vec<u8>) -> io::Result<()> {
    match old {
        OldTuple::Key(_) => out.push(b'K'),
        OldTuple::Full(_) => out.push(b'O'),
    }
    encode_tuple(old.tuple(), out)
}

fn encode_tuple(tuple: &TupleData, out: &mut Vec<u8>) -> io::Result<()> {
    out.extend_from_slice(&len_u32(tuple.columns.len())?.to_be_bytes());
    for value in &tuple.columns {
        match value {
            ColumnValue::Null => out.push(b'n'),
            ColumnValue::UnchangedToast => out.push(b'u'),
            ColumnValue::Text(b) => {
                out.push(b't');
                encode_bytes(b, out)?;
            }
            ColumnValue::Binary(b) => {
                out.push(b'b');
                encode_bytes(b, out)?;
            }
        }
    }
    Ok(())
}

fn decode_entry(frame: &Bytes, relations: &[Arc<Relation>]) -> Result<Entry, DecodeError> {
    let mut r = Reader::new(frame);
    let relation = |r: &mut Reader<'_>| -> Result<Arc<Relation>, DecodeError> {
        let offset = r.pos();
        let index = r.u32("spilled relation index")?;
        relations
            .get(index as usize)
            .cloned()
            .ok_or(DecodeError::InvalidValue {
                what: "spilled relation index",
                value: index.into(),
                offset,
            })
    };
    let offset = r.pos();
    let entry = match r.u8("spilled entry type")? {
        SPILL_INSERT => {
            let relation = relation(&mut r)?;
            let new = decode_tuple(&mut r)?;
            Entry::Change(Change::Insert { relation, new })
        }
        SPILL_UPDATE => {
            let relation = relation(&mut r)?;
            let old = decode_old(&mut r)?;
            let new = decode_tuple(&mut r)?;
            Entry::Change(Change::Update { relation, old, new })
        }
        SPILL_DELETE => {
            let relation = relation(&mut r)?;
            let old = decode_old(&mut r)?.ok_or(DecodeError::InvalidValue {
                what: "missing old tuple of a spilled Delete",
                value: 0,
                offset,
            })?;
            Entry::Change(Change::Delete { relation, old })
        }
        SPILL_TRUNCATE => {
            let options = r.u8("spilled Truncate options")?;
            let n = r.u32("spilled Truncate relation count")? as usize;
            let mut list = Vec::with_capacity(n.min(r.remaining() / 4));
            for _ in 0..n {
                list.push(relation(&mut r)?);
            }
            Entry::Change(Change::Truncate {
                relations: list,
                options,
            })
        }
        SPILL_MESSAGE => {
            let after_changes = r.u64("spilled Message position")? as usize;
            let lsn = r.lsn("spilled Message LSN")?;
            let prefix_offset = r.pos();
            let prefix = decode_bytes(&mut r, "spilled Message prefix")?;
            let prefix =
                String::from_utf8(prefix.to_vec()).map_err(|_| DecodeError::InvalidUtf8 {
                    what: "spilled Message prefix",
                    offset: prefix_offset,
                })?;
            let content = decode_bytes(&mut r, "spilled Message content")?;
            Entry::Message(TxnMessage {
                after_changes,
                lsn,
                prefix,
                content,
            })
        }
        found => {
            return Err(DecodeError::UnexpectedMarker {
                expected: "a spilled entry type",
                found,
                offset,
            })
        }
    };
    r.finish("spilled entry")?;
    Ok(entry)
}

fn decode_bytes(r: &mut Reader<'_>, what: &'static str) -> Result<Bytes, DecodeError> {
    let len = r.u32(what)? as usize;
    r.bytes(len, what)
}

fn decode_old(r: &mut Reader<'_>) -> Result<Option<OldTuple>, DecodeError> {
    let offset = r.pos();
    match r.u8("spilled old tuple marker")? {
        b'K' => Ok(Some(OldTuple::Key(decode_tuple(r)?))),
        b'O' => Ok(Some(OldTuple::Full(decode_tuple(r)?))),
        SPILL_NO_OLD => Ok(None),
        found => Err(DecodeError::UnexpectedMarker {
            expected: "a spilled old tuple marker",
            found,
            offset,
        }),
    }
}

fn decode_tuple(r: &mut Reader<'_>) -> Result<TupleData, DecodeError> {
    let n = r.u32("spilled tuple column count")? as usize;
    let mut columns = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        let offset = r.pos();
        let value = match r.u8("spilled column kind")? {
            b'n' => ColumnValue::Null,
            b'u' => ColumnValue::UnchangedToast,
            b't' => ColumnValue::Text(decode_bytes(r, "spilled text value")?),
            b'b' => ColumnValue::Binary(decode_bytes(r, "spilled binary value")?),
            kind => return Err(DecodeError::UnknownColumnKind { kind, offset }),
        };
        columns.push(value);
    }
    Ok(TupleData { columns })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::test_encode::{self as enc, Val};

    const ACCOUNTS: u32 = 16384;
    const EVENTS: u32 = 16390;

    fn accounts_relation() -> Vec<u8> {
        enc::relation(
            ACCOUNTS,
            "public",
            "accounts",
            b'd',
            &[
                (1, "id", 20, -1),
                (0, "balance", 1700, -1),
                (0, "doc", 17, -1),
            ],
        )
    }

    fn events_relation() -> Vec<u8> {
        enc::relation(
            EVENTS,
            "audit",
            "events",
            b'f',
            &[(1, "at", 1184, -1), (1, "what", 25, -1)],
        )
    }

    fn decode(bytes: Vec<u8>) -> PgOutputMessage {
        PgOutputMessage::decode(bytes).expect("test message decodes")
    }

    fn feed(asm: &mut TxnAssembler, bytes: Vec<u8>) -> Result<Option<Assembled>, AssembleError> {
        asm.push(decode(bytes))
    }

    /// Feeds every message; all but the last must produce nothing; the last must produce a
    /// transaction.
    fn feed_txn(asm: &mut TxnAssembler, stream: Vec<Vec<u8>>) -> CommittedTxn {
        let last = stream.len() - 1;
        for (i, bytes) in stream.into_iter().enumerate() {
            let out = feed(asm, bytes).expect("valid stream");
            if i < last {
                assert_eq!(out, None, "message {i} produced output");
            } else {
                match out {
                    Some(Assembled::Txn(txn)) => return txn,
                    other => panic!("commit produced {other:?}"),
                }
            }
        }
        unreachable!("the loop returns at the last message")
    }

    fn assembler() -> TxnAssembler {
        TxnAssembler::new(AssemblerConfig::default())
    }

    fn spilling_assembler(threshold: usize) -> TxnAssembler {
        TxnAssembler::new(AssemblerConfig {
            spill_threshold_bytes: threshold,
            spill_dir: None,
        })
    }

    fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn key_texts(key: Option<Vec<(&Column, &ColumnValue)>>) -> Option<Vec<(String, String)>> {
        key.map(|k| {
            k.into_iter()
                .map(|(c, v)| {
                    (
                        c.name.clone(),
                        v.as_text().unwrap_or("<not text>").to_owned(),
                    )
                })
                .collect()
        })
    }

    /// A transaction exercising every change kind, every column kind, an origin, messages and a
    /// schema change halfway through.
    fn rich_txn_stream() -> Vec<Vec<u8>> {
        let blob: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
        let mut stream = vec![
            accounts_relation(),
            enc::begin(0x9000, 1_000_000, 742),
            enc::origin(0x77, "node_b"),
            events_relation(),
            enc::message(true, 0x8001, "remus", b"remus:7:742"),
            enc::insert(ACCOUNTS, &[Val::T("1"), Val::T("10.00"), Val::B(&blob)]),
            enc::insert(ACCOUNTS, &[Val::T("2"), Val::N, Val::B(b"")]),
            enc::update(ACCOUNTS, None, &[Val::T("1"), Val::T("11.00"), Val::U]),
            enc::update(
                ACCOUNTS,
                Some((b'K', &[Val::T("2"), Val::N, Val::N])),
                &[Val::T("3"), Val::N, Val::U],
            ),
            enc::insert(EVENTS, &[Val::T("2024-01-01"), Val::T("x")]),
            enc::update(
                EVENTS,
                Some((b'O', &[Val::T("2024-01-01"), Val::T("x")])),
                &[Val::T("2024-01-01"), Val::T("y")],
            ),
            enc::message(true, 0x8002, "other", &[0, 1, 2]),
            enc::delete(EVENTS, b'O', &[Val::T("2024-01-01"), Val::T("y")]),
            enc::delete(ACCOUNTS, b'K', &[Val::T("3"), Val::N, Val::N]),
            // ALTER TABLE accounts ADD COLUMN inside the transaction.
            enc::relation(
                ACCOUNTS,
                "public",
                "accounts",
                b'd',
                &[
                    (1, "id", 20, -1),
                    (0, "balance", 1700, -1),
                    (0, "doc", 17, -1),
                    (0, "tag", 25, -1),
                ],
            ),
            enc::insert(ACCOUNTS, &[Val::T("4"), Val::T("0"), Val::N, Val::T("new")]),
            enc::truncate(1, &[EVENTS, ACCOUNTS]),
        ];
        for i in 0..50 {
            let id = (100 + i).to_string();
            stream.push(enc::insert(
                ACCOUNTS,
                &[Val::T(&id), Val::T("1"), Val::N, Val::N],
            ));
        }
        stream.push(enc::commit(0x9000, 0x9040, 1_000_000));
        stream
    }

    #[test]
    fn assembles_a_simple_transaction_on_commit() {
        let mut asm = assembler();
        assert!(!asm.in_transaction());
        let txn = feed_txn(
            &mut asm,
            vec![
                accounts_relation(),
                enc::begin(0x1_0000_0100, 123_456, 900),
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::T("5.00"), Val::N]),
                enc::commit(0x1_0000_0100, 0x1_0000_0138, 123_456),
            ],
        );
        assert!(!asm.in_transaction());
        assert_eq!(txn.xid, 900);
        assert_eq!(txn.begin_final_lsn, Lsn(0x1_0000_0100));
        assert_eq!(txn.commit_lsn, Lsn(0x1_0000_0100));
        assert_eq!(txn.end_lsn, Lsn(0x1_0000_0138));
        assert_eq!(txn.commit_time_us, 123_456);
        assert_eq!(txn.commit_time(), pg_timestamp_to_system_time(123_456));
        assert_eq!(txn.origin, None);
        assert!(txn.messages.is_empty());
        assert!(!txn.is_remus_marked(7));
        assert_eq!(txn.changes.len(), 1);
        let Change::Insert { relation, new } = &txn.changes[0] else {
            panic!("not an insert: {:?}", txn.changes[0]);
        };
        assert_eq!(relation.oid, ACCOUNTS);
        assert_eq!(relation.namespace, "public");
        assert_eq!(relation.name, "accounts");
        assert_eq!(relation.key_column_indexes().collect::<Vec<_>>(), vec![0]);
        assert_eq!(
            new.columns,
            vec![text("1"), text("5.00"), ColumnValue::Null]
        );
    }

    #[test]
    fn nothing_is_emitted_before_commit() {
        let mut asm = assembler();
        feed(&mut asm, accounts_relation()).unwrap();
        assert_eq!(feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap(), None);
        assert!(asm.in_transaction());
        for i in 0..10 {
            let id = i.to_string();
            let out = feed(
                &mut asm,
                enc::insert(ACCOUNTS, &[Val::T(&id), Val::N, Val::N]),
            )
            .unwrap();
            assert_eq!(out, None);
        }
        assert!(asm.in_transaction());
        let Some(Assembled::Txn(txn)) = feed(&mut asm, enc::commit(0x10, 0x20, 0)).unwrap() else {
            panic!("no transaction at commit");
        };
        assert_eq!(txn.changes.len(), 10);
    }

    #[test]
    fn consecutive_transactions_are_independent() {
        let mut asm = assembler();
        feed(&mut asm, accounts_relation()).unwrap();
        let first = feed_txn(
            &mut asm,
            vec![
                enc::begin(0x10, 0, 1),
                enc::origin(5, "elsewhere"),
                enc::message(true, 0x11, "remus", b"remus:7:1"),
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        let second = feed_txn(
            &mut asm,
            vec![
                enc::begin(0x20, 0, 2),
                enc::delete(ACCOUNTS, b'K', &[Val::T("1"), Val::N, Val::N]),
                enc::commit(0x20, 0x28, 0),
            ],
        );
        assert!(first.is_remus_marked(7));
        assert!(first.origin.is_some());
        assert_eq!(second.xid, 2);
        assert_eq!(second.origin, None);
        assert!(second.messages.is_empty());
        assert!(!second.is_remus_marked(7));
        assert_eq!(second.changes.len(), 1);
        assert!(matches!(second.changes[0], Change::Delete { .. }));
    }

    #[test]
    fn captures_origin() {
        let mut asm = assembler();
        let txn = feed_txn(
            &mut asm,
            vec![
                enc::begin(0x10, 0, 1),
                enc::origin(0xABC, "node_b"),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        assert_eq!(
            txn.origin,
            Some(Origin {
                commit_lsn: Lsn(0xABC),
                name: "node_b".into()
            })
        );
        assert!(txn.changes.is_empty());
    }

    #[test]
    fn remus_message_marks_the_transaction() {
        let mut asm = assembler();
        feed(&mut asm, accounts_relation()).unwrap();
        let txn = feed_txn(
            &mut asm,
            vec![
                enc::begin(0x10, 0, 1),
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
                enc::message(true, 0x15, "remus", b"remus:7:1"),
                enc::insert(ACCOUNTS, &[Val::T("2"), Val::N, Val::N]),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        assert!(txn.is_remus_marked(7));
        assert_eq!(txn.shadow_gid(7), Some("remus:7:1"));
        // PG 15's pgoutput sends a transactional message to every slot: the stream of
        // migration 8 from the same source sees the message migration 7's validation wrote,
        // and it does not mark the transaction for migration 8 (nor 70: no prefix match).
        for other in [8, 70] {
            assert!(!txn.is_remus_marked(other));
            assert_eq!(txn.shadow_gid(other), None);
        }
        assert_eq!(
            txn.messages,
            vec![TxnMessage {
                after_changes: 1,
                lsn: Lsn(0x15),
                prefix: "remus".into(),
                content: Bytes::from_static(b"remus:7:1"),
            }]
        );
        assert_eq!(txn.remus_messages().count(), 1);
        assert_eq!(txn.changes.len(), 2);
    }

    #[test]
    fn each_migration_finds_its_own_remus_message() {
        // Validated for two migrations from the same source: the transaction carries both
        // messages, and each stream picks its own gid rather than the first.
        let txn = feed_txn(
            &mut assembler(),
            vec![
                enc::begin(0x20, 0, 2),
                enc::message(true, 0x21, "remus", b"remus:7:1"),
                enc::message(true, 0x22, "remus", b"remus:8:1"),
                enc::commit(0x20, 0x28, 0),
            ],
        );
        assert_eq!(txn.shadow_gid(8), Some("remus:8:1"));
        assert_eq!(txn.shadow_gid(7), Some("remus:7:1"));
        assert_eq!(txn.shadow_gid(9), None);
        assert_eq!(txn.remus_messages().count(), 2);

        // Malformed contents name no shadow of any migration.
        for content in [
            &b"remus:8:"[..],
            b"remus:8",
            b"remus:8:x1",
            b"remus::1",
            b"remus:8:1:2",
            b"8:1",
            b"\xff",
        ] {
            let t = CommittedTxn {
                messages: vec![TxnMessage {
                    after_changes: 0,
                    lsn: Lsn(0x31),
                    prefix: "remus".into(),
                    content: Bytes::copy_from_slice(content),
                }],
                ..txn.clone()
            };
            assert!(!t.is_remus_marked(8), "{content:?}");
        }
    }

    #[test]
    fn other_prefixes_do_not_mark_the_transaction() {
        let mut asm = assembler();
        let txn = feed_txn(
            &mut asm,
            vec![
                enc::begin(0x10, 0, 1),
                enc::message(true, 0x11, "remusx", b"remus:7:1"),
                enc::message(true, 0x12, "Remus", b"remus:7:1"),
                enc::message(true, 0x13, "", b"remus:7:1"),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        assert_eq!(txn.messages.len(), 3);
        assert!(txn
            .messages
            .iter()
            .all(|m| !m.is_remus() && m.after_changes == 0));
        assert!(!txn.is_remus_marked(7));
        assert_eq!(txn.remus_messages().count(), 0);
    }

    #[test]
    fn non_transactional_messages_are_delivered_at_once() {
        let mut asm = assembler();
        let out = feed(&mut asm, enc::message(false, 0x50, "remus", b"handover")).unwrap();
        let Some(Assembled::Message(m)) = out else {
            panic!("expected a message, got {out:?}");
        };
        assert!(!m.is_transactional());
        assert_eq!(m.prefix, "remus");
        assert_eq!(&m.content[..], b"handover");
        assert!(!asm.in_transaction());

        // Even inside a transaction it is not part of it.
        feed(&mut asm, enc::begin(0x60, 0, 3)).unwrap();
        let out = feed(&mut asm, enc::message(false, 0x61, "remus", b"x")).unwrap();
        assert!(matches!(out, Some(Assembled::Message(_))));
        let Some(Assembled::Txn(txn)) = feed(&mut asm, enc::commit(0x60, 0x68, 0)).unwrap() else {
            panic!("no transaction");
        };
        assert!(txn.messages.is_empty());
        assert!(!txn.is_remus_marked(7));
    }

    #[test]
    fn changes_carry_key_columns() {
        let mut asm = assembler();
        let txn = feed_txn(
            &mut asm,
            vec![
                accounts_relation(),
                events_relation(),
                enc::relation(16400, "public", "nokey", b'n', &[(0, "a", 23, -1)]),
                enc::begin(0x10, 0, 1),
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::T("2"), Val::N]),
                enc::update(ACCOUNTS, None, &[Val::T("1"), Val::T("3"), Val::U]),
                enc::update(
                    ACCOUNTS,
                    Some((b'K', &[Val::T("1"), Val::N, Val::N])),
                    &[Val::T("9"), Val::T("3"), Val::U],
                ),
                enc::delete(ACCOUNTS, b'K', &[Val::T("9"), Val::N, Val::N]),
                enc::delete(EVENTS, b'O', &[Val::T("t0"), Val::T("w")]),
                enc::insert(16400, &[Val::T("5")]),
                enc::truncate(0, &[ACCOUNTS]),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        let kv = |pairs: &[(&str, &str)]| {
            Some(
                pairs
                    .iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect::<Vec<_>>(),
            )
        };
        let c = &txn.changes;
        assert_eq!(key_texts(c[0].old_key()), None);
        assert_eq!(key_texts(c[0].new_key()), kv(&[("id", "1")]));
        // Key unchanged: the old key is the new tuple's.
        assert_eq!(key_texts(c[1].old_key()), kv(&[("id", "1")]));
        assert_eq!(key_texts(c[1].new_key()), kv(&[("id", "1")]));
        // Key changed: both rows are known.
        assert_eq!(key_texts(c[2].old_key()), kv(&[("id", "1")]));
        assert_eq!(key_texts(c[2].new_key()), kv(&[("id", "9")]));
        assert_eq!(key_texts(c[3].old_key()), kv(&[("id", "9")]));
        assert_eq!(key_texts(c[3].new_key()), None);
        // REPLICA IDENTITY FULL flags every column.
        assert_eq!(
            key_texts(c[4].old_key()),
            kv(&[("at", "t0"), ("what", "w")])
        );
        assert_eq!(c[4].relations()[0].namespace, "audit");
        // REPLICA IDENTITY NOTHING: no key at all.
        assert_eq!(key_texts(c[5].new_key()), kv(&[]));
        assert_eq!(c[6].old_key(), None);
        assert_eq!(c[6].new_key(), None);
        assert_eq!(c[6].relations().len(), 1);
    }

    #[test]
    fn truncate_resolves_every_relation() {
        let mut asm = assembler();
        let txn = feed_txn(
            &mut asm,
            vec![
                accounts_relation(),
                events_relation(),
                enc::begin(0x10, 0, 1),
                enc::truncate(3, &[EVENTS, ACCOUNTS]),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        let Change::Truncate { relations, options } = &txn.changes[0] else {
            panic!("not a truncate");
        };
        assert_eq!(*options, 3);
        let names: Vec<_> = relations.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, vec!["events", "accounts"]);
        assert_eq!(txn.changes[0].relations().len(), 2);
    }

    #[test]
    fn changes_keep_the_relation_version_they_were_made_with() {
        let mut asm = assembler();
        let txn = feed_txn(&mut asm, rich_txn_stream());
        let before = &txn.changes[0].relations()[0];
        let after = txn
            .changes
            .iter()
            .find(|c| matches!(c, Change::Insert { new, .. } if new.len() == 4))
            .expect("insert after the schema change");
        assert_eq!(before.columns.len(), 3);
        assert_eq!(after.relations()[0].columns.len(), 4);
        assert_eq!(asm.relation_by_oid(ACCOUNTS).unwrap().columns.len(), 4);
    }

    #[test]
    fn relation_and_type_caches_persist_across_transactions() {
        let mut asm = assembler();
        feed(&mut asm, enc::type_msg(70000, "public", "mood")).unwrap();
        feed(&mut asm, accounts_relation()).unwrap();
        assert_eq!(asm.type_by_oid(70000).unwrap().name, "mood");
        assert_eq!(asm.type_by_oid(70001), None);
        assert_eq!(asm.relation_by_oid(ACCOUNTS).unwrap().name, "accounts");
        for xid in 1..=3u32 {
            let lsn = u64::from(xid) * 0x100;
            let txn = feed_txn(
                &mut asm,
                vec![
                    enc::begin(lsn, 0, xid),
                    enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
                    enc::commit(lsn, lsn + 8, 0),
                ],
            );
            assert_eq!(txn.xid, xid);
        }
    }

    #[test]
    fn reset_forgets_the_open_transaction_and_the_caches() {
        let mut asm = spilling_assembler(0);
        feed(&mut asm, accounts_relation()).unwrap();
        feed(&mut asm, enc::type_msg(70000, "public", "mood")).unwrap();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        feed(
            &mut asm,
            enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
        )
        .unwrap();
        assert!(asm.is_spilling());
        asm.reset();
        assert!(!asm.in_transaction());
        assert!(!asm.is_spilling());
        assert!(asm.relation_by_oid(ACCOUNTS).is_none());
        assert!(asm.type_by_oid(70000).is_none());
        assert!(matches!(
            feed(&mut asm, enc::commit(0x10, 0x18, 0)),
            Err(AssembleError::OutsideTransaction { message: "Commit" })
        ));
        // A fresh session works normally.
        let txn = feed_txn(
            &mut asm,
            vec![
                accounts_relation(),
                enc::begin(0x20, 0, 2),
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
                enc::commit(0x20, 0x28, 0),
            ],
        );
        assert_eq!(txn.changes.len(), 1);
    }

    #[test]
    fn changes_outside_a_transaction_are_errors() {
        let mut asm = assembler();
        feed(&mut asm, accounts_relation()).unwrap();
        for (bytes, name) in [
            (
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
                "Insert",
            ),
            (
                enc::update(ACCOUNTS, None, &[Val::T("1"), Val::N, Val::N]),
                "Update",
            ),
            (
                enc::delete(ACCOUNTS, b'K', &[Val::T("1"), Val::N, Val::N]),
                "Delete",
            ),
            (enc::truncate(0, &[ACCOUNTS]), "Truncate"),
            (enc::origin(1, "x"), "Origin"),
            (enc::message(true, 1, "remus", b""), "transactional Message"),
            (enc::commit(0x10, 0x18, 0), "Commit"),
            // Checked before the relation: an unknown OID outside a transaction is still
            // reported as being outside a transaction.
            (enc::insert(999, &[]), "Insert"),
        ] {
            match feed(&mut asm, bytes) {
                Err(AssembleError::OutsideTransaction { message }) => assert_eq!(message, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn begin_inside_a_transaction_is_an_error() {
        let mut asm = assembler();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        assert!(matches!(
            feed(&mut asm, enc::begin(0x20, 0, 2)),
            Err(AssembleError::NestedBegin {
                open_xid: 1,
                new_xid: 2
            })
        ));
    }

    #[test]
    fn unknown_relations_are_errors() {
        let mut asm = assembler();
        feed(&mut asm, accounts_relation()).unwrap();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        for bytes in [
            enc::insert(4242, &[Val::T("1")]),
            enc::update(4242, None, &[Val::T("1")]),
            enc::delete(4242, b'K', &[Val::T("1")]),
            enc::truncate(0, &[ACCOUNTS, 4242]),
        ] {
            assert!(matches!(
                feed(&mut asm, bytes),
                Err(AssembleError::UnknownRelation(4242))
            ));
        }
        assert_eq!(
            AssembleError::UnknownRelation(4242).to_string(),
            "change refers to relation 4242, for which no Relation message was received"
        );
    }

    #[test]
    fn tuples_must_match_the_relation() {
        let mut asm = assembler();
        feed(&mut asm, accounts_relation()).unwrap();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        for bytes in [
            enc::insert(ACCOUNTS, &[Val::T("1")]),
            enc::update(ACCOUNTS, None, &[Val::T("1"), Val::N, Val::N, Val::N]),
            enc::update(
                ACCOUNTS,
                Some((b'K', &[Val::T("1")])),
                &[Val::T("1"), Val::N, Val::N],
            ),
            enc::delete(ACCOUNTS, b'O', &[Val::T("1"), Val::N]),
        ] {
            assert!(matches!(
                feed(&mut asm, bytes),
                Err(AssembleError::ColumnCountMismatch {
                    relation_oid: ACCOUNTS,
                    expected: 3,
                    ..
                })
            ));
        }
    }

    #[test]
    fn commit_must_match_begin() {
        let mut asm = assembler();
        feed(&mut asm, enc::begin(0x10, 0, 7)).unwrap();
        let err = feed(&mut asm, enc::commit(0x11, 0x18, 0)).unwrap_err();
        assert!(matches!(
            err,
            AssembleError::CommitMismatch {
                xid: 7,
                begin_final_lsn: Lsn(0x10),
                commit_lsn: Lsn(0x11)
            }
        ));
        assert_eq!(
            err.to_string(),
            "Commit at 0/11 does not match the final LSN 0/10 of transaction 7"
        );
    }

    #[test]
    fn spilling_gives_the_same_transaction_as_memory() {
        let in_memory = feed_txn(&mut assembler(), rich_txn_stream());
        assert!(!in_memory.changes.is_empty());
        assert_eq!(in_memory.messages.len(), 2);
        assert!(in_memory.is_remus_marked(7));

        for threshold in [0, 1, 200, 2_000, 10_000] {
            let mut asm = spilling_assembler(threshold);
            let stream = rich_txn_stream();
            let last = stream.len() - 1;
            let mut spilled = false;
            let mut txn = None;
            for (i, bytes) in stream.into_iter().enumerate() {
                let out = feed(&mut asm, bytes).unwrap();
                spilled |= asm.is_spilling();
                if i == last {
                    txn = out;
                }
            }
            assert!(spilled, "threshold {threshold} never spilled");
            assert!(!asm.is_spilling());
            let Some(Assembled::Txn(txn)) = txn else {
                panic!("no transaction at threshold {threshold}");
            };
            assert_eq!(txn, in_memory, "threshold {threshold}");
        }
    }

    #[test]
    fn threshold_decides_when_to_spill() {
        let mut asm = spilling_assembler(100_000);
        feed(&mut asm, accounts_relation()).unwrap();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        feed(
            &mut asm,
            enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
        )
        .unwrap();
        assert!(!asm.is_spilling());
        let big = vec![7u8; 100_000];
        feed(
            &mut asm,
            enc::insert(ACCOUNTS, &[Val::T("2"), Val::N, Val::B(&big)]),
        )
        .unwrap();
        assert!(asm.is_spilling());
        feed(
            &mut asm,
            enc::insert(ACCOUNTS, &[Val::T("3"), Val::N, Val::N]),
        )
        .unwrap();
        let Some(Assembled::Txn(txn)) = feed(&mut asm, enc::commit(0x10, 0x18, 0)).unwrap() else {
            panic!("no transaction");
        };
        assert_eq!(txn.changes.len(), 3);
        let Change::Insert { new, .. } = &txn.changes[1] else {
            panic!("not an insert");
        };
        assert_eq!(new.columns[2], ColumnValue::Binary(Bytes::from(big)));
        // The next transaction starts in memory again.
        feed(&mut asm, enc::begin(0x20, 0, 2)).unwrap();
        feed(
            &mut asm,
            enc::insert(ACCOUNTS, &[Val::T("4"), Val::N, Val::N]),
        )
        .unwrap();
        assert!(!asm.is_spilling());
    }

    #[test]
    fn spilled_large_transaction_keeps_order() {
        let mut asm = spilling_assembler(4096);
        feed(&mut asm, accounts_relation()).unwrap();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        for i in 0..5_000u32 {
            let id = i.to_string();
            feed(
                &mut asm,
                enc::insert(ACCOUNTS, &[Val::T(&id), Val::T("0"), Val::N]),
            )
            .unwrap();
            if i % 1000 == 0 {
                feed(
                    &mut asm,
                    enc::message(true, u64::from(i), "remus", id.as_bytes()),
                )
                .unwrap();
            }
        }
        assert!(asm.is_spilling());
        let Some(Assembled::Txn(txn)) = feed(&mut asm, enc::commit(0x10, 0x18, 0)).unwrap() else {
            panic!("no transaction");
        };
        assert_eq!(txn.changes.len(), 5_000);
        for (i, change) in txn.changes.iter().enumerate() {
            let Change::Insert { new, .. } = change else {
                panic!("not an insert");
            };
            assert_eq!(new.columns[0].as_text(), Some(i.to_string().as_str()));
        }
        let positions: Vec<_> = txn.messages.iter().map(|m| m.after_changes).collect();
        assert_eq!(positions, vec![1, 1001, 2001, 3001, 4001]);
        // All changes share the single relation version.
        assert!(txn
            .changes
            .windows(2)
            .all(|w| Arc::ptr_eq(&w[0].relations()[0], &w[1].relations()[0])));
    }

    #[test]
    fn spill_dir_is_used() {
        let missing = std::env::temp_dir().join("wal_propagator-test-no-such-dir/nested");
        let mut asm = TxnAssembler::new(AssemblerConfig {
            spill_threshold_bytes: 0,
            spill_dir: Some(missing),
        });
        feed(&mut asm, accounts_relation()).unwrap();
        feed(&mut asm, enc::begin(0x10, 0, 1)).unwrap();
        assert!(matches!(
            feed(
                &mut asm,
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N])
            ),
            Err(AssembleError::SpillIo(_))
        ));

        let dir = tempfile::tempdir().unwrap();
        let mut asm = TxnAssembler::new(AssemblerConfig {
            spill_threshold_bytes: 0,
            spill_dir: Some(dir.path().to_owned()),
        });
        let txn = feed_txn(
            &mut asm,
            vec![
                accounts_relation(),
                enc::begin(0x10, 0, 1),
                enc::insert(ACCOUNTS, &[Val::T("1"), Val::N, Val::N]),
                enc::commit(0x10, 0x18, 0),
            ],
        );
        assert_eq!(txn.changes.len(), 1);
        // The spill file is anonymous and leaves nothing behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn spill_frames_round_trip_and_reject_corruption() {
        let relation = Arc::new(Relation {
            oid: 1,
            namespace: "s".into(),
            name: "t".into(),
            replica_identity: crate::pgoutput::ReplicaIdentity::Default,
            columns: vec![],
        });
        let entries = vec![
            Entry::Change(Change::Update {
                relation: Arc::clone(&relation),
                old: Some(OldTuple::Full(TupleData::new(vec![ColumnValue::Null]))),
                new: TupleData::new(vec![ColumnValue::Binary(Bytes::from_static(b"\0\xff"))]),
            }),
            Entry::Change(Change::Delete {
                relation: Arc::clone(&relation),
                old: OldTuple::Key(TupleData::new(vec![text("k"), ColumnValue::UnchangedToast])),
            }),
            Entry::Change(Change::Truncate {
                relations: vec![Arc::clone(&relation), Arc::clone(&relation)],
                options: 2,
            }),
            Entry::Message(TxnMessage {
                after_changes: 3,
                lsn: Lsn(9),
                prefix: "remus".into(),
                content: Bytes::from_static(b"c"),
            }),
        ];
        let mut spill = SpillFile::create(&AssemblerConfig::default()).unwrap();
        for entry in &entries {
            let mut frame = Vec::new();
            spill.encode(entry, &mut frame).unwrap();
            let frame = Bytes::from(frame);
            let decoded = decode_entry(&frame, &spill.relations).unwrap();
            match (entry, &decoded) {
                (Entry::Change(a), Entry::Change(b)) => assert_eq!(a, b),
                (Entry::Message(a), Entry::Message(b)) => assert_eq!(a, b),
                _ => panic!("entry kind changed"),
            }
            // Every truncation is detected, and so is a trailing byte.
            for len in 0..frame.len() {
                assert!(decode_entry(&frame.slice(..len), &spill.relations).is_err());
            }
            let mut longer = frame.to_vec();
            longer.push(0);
            assert!(matches!(
                decode_entry(&Bytes::from(longer), &spill.relations),
                Err(DecodeError::TrailingBytes { .. })
            ));
        }
        // Relations are stored once per version.
        assert_eq!(spill.relations.len(), 1);
        // Unknown entry types and relation indexes are rejected.
        assert!(matches!(
            decode_entry(&Bytes::from_static(b"X"), &spill.relations),
            Err(DecodeError::UnexpectedMarker { found: b'X', .. })
        ));
        assert!(matches!(
            decode_entry(
                &Bytes::from_static(b"I\0\0\0\x05\0\0\0\0"),
                &spill.relations
            ),
            Err(DecodeError::InvalidValue { value: 5, .. })
        ));
        assert!(matches!(
            decode_entry(&Bytes::from_static(b"D\0\0\0\0\0"), &spill.relations),
            Err(DecodeError::InvalidValue { .. })
        ));
    }

    #[test]
    fn end_to_end_from_copy_data() {
        use crate::pgoutput::ReplicationMessage;

        let mut asm = spilling_assembler(0);
        let mut lsn = 0x100;
        let mut out = Vec::new();
        let mut keepalives = 0;
        let mut frames = Vec::new();
        for payload in rich_txn_stream() {
            frames.push(enc::xlog_data(lsn, lsn + 0x1000, 42, &payload));
            lsn += 0x10;
            frames.push(enc::keepalive(lsn, 43, false));
        }
        for frame in frames {
            match ReplicationMessage::decode(frame).unwrap() {
                ReplicationMessage::XLogData(x) => {
                    if let Some(a) = asm.push(PgOutputMessage::decode(x.data).unwrap()).unwrap() {
                        out.push(a);
                    }
                }
                ReplicationMessage::PrimaryKeepalive(_) => keepalives += 1,
            }
        }
        assert_eq!(keepalives, rich_txn_stream().len());
        assert_eq!(out.len(), 1);
        let Assembled::Txn(txn) = &out[0] else {
            panic!("not a transaction");
        };
        assert_eq!(*txn, feed_txn(&mut assembler(), rich_txn_stream()));
        assert_eq!(txn.end_lsn, Lsn(0x9040));
        assert_eq!(txn.origin.as_ref().unwrap().name, "node_b");
    }
}
