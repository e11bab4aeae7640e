//! Indexes and index-backed constraints of shells and their twins on the shard tables.
//!
//! Index names are per schema, and every shard table of a node lives in `remus_shards`: a
//! shard's index is therefore named after its shard table (PostgreSQL's default name), not
//! after the shell's index. The twin of a shell's index on a shard is found by its definition
//! (method, columns or expressions, predicate, uniqueness), which is the same on both since the
//! shard has the shell's columns.

use std::ffi::{c_char, CStr, CString};

use pgrx::pg_sys;
use pgrx::pg_sys::panic::CaughtError;
use pgrx::PgTryBuilder;

use super::target::{copy_node, shard_range_var, target, ShardWork, Target};
use crate::cluster::remote::{self, NodeAddr};
use crate::error::RemusError;
use crate::pg::list::list_ptrs;

/// CREATE INDEX on a shell: the copies for the shard tables (their names left to PostgreSQL).
/// With CONCURRENTLY, each copy is its own concurrent build ([`finish_concurrently`]).
///
/// # Safety
/// `i` must be the statement about to run, `t` its table.
pub(super) unsafe fn create_index(
    i: *mut pg_sys::IndexStmt,
    t: &Target,
) -> Result<Vec<ShardWork>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if (*i).unique && !t.is_reference() {
            let key = t.table.shard_key.as_deref().unwrap_or_default();
            let has_key = list_ptrs::<pg_sys::IndexElem>((*i).indexParams)
                .into_iter()
                .any(|e| {
                    !(*e).name.is_null() && CStr::from_ptr((*e).name).to_bytes() == key.as_bytes()
                });
            if !has_key {
                return Err(RemusError::UniqueIndexWithoutShardKey {
                    table: t.table.qualified_name.to_string(),
                    key: key.to_string(),
                });
            }
        }
        // IF NOT EXISTS of an index the shell has: nothing to do anywhere (a shard copy has
        // no name to find it by).
        if (*i).if_not_exists && !(*i).idxname.is_null() {
            let nsp = pg_sys::get_rel_namespace(t.table.relid);
            if pg_sys::get_relname_relid((*i).idxname, nsp) != pg_sys::InvalidOid {
                return Ok(Vec::new());
            }
        }
        Ok(t.local_shards
            .iter()
            .map(|(_, name)| {
                let copy = copy_node(i);
                (*copy).relation = shard_range_var(name);
                (*copy).idxname = std::ptr::null_mut();
                (*copy).if_not_exists = false;
                ShardWork::Tree(copy as *mut pg_sys::Node)
            })
            .collect())
    }
}

/// The qualified names of the twins of shell index `index` on this node's shard tables.
pub(super) fn index_twins(index: pg_sys::Oid, t: &Target) -> Result<Vec<String>, RemusError> {
    let mut twins = Vec::new();
    for (_, shard) in &t.local_shards {
        let twin = crate::pg::spi::read_one::<String>(
            "SELECT min(format('remus_shards.%I', c.relname))
               FROM pg_index i
               JOIN pg_class c ON c.oid = i.indexrelid
               JOIN pg_index s ON s.indexrelid = $1
              WHERE i.indrelid = format('remus_shards.%I', $2::text)::regclass
                AND i.indisunique = s.indisunique
                AND substring(pg_get_indexdef(i.indexrelid) FROM ' USING .*$')
                  = substring(pg_get_indexdef(s.indexrelid) FROM ' USING .*$')",
            &[index.into(), shard.as_str().into()],
        )?;
        twins.extend(twin);
    }
    Ok(twins)
}

/// The kind (`pg_constraint.contype`) of the shell's constraint `name`, if it has one.
pub(super) fn constraint_kind(relid: pg_sys::Oid, name: &str) -> Result<Option<char>, RemusError> {
    Ok(crate::pg::spi::read_one::<String>(
        "SELECT min(contype::text) FROM pg_constraint WHERE conrelid = $1 AND conname = $2",
        &[relid.into(), name.into()],
    )?
    .and_then(|s| s.chars().next()))
}

/// The name on shard `shard_id` of the shell's index-backed constraint `name` (PRIMARY KEY,
/// UNIQUE, EXCLUDE); None for other constraints (same name) or a name the shell lacks.
pub(super) fn constraint_twin(
    t: &Target,
    name: &str,
    shard_id: i64,
) -> Result<Option<String>, RemusError> {
    let shard = format!("{}_{shard_id}", t.table.rel_name);
    Ok(crate::pg::spi::read_one::<String>(
        "SELECT min(sc.conname::text)
           FROM pg_constraint c
           JOIN pg_constraint sc ON sc.conrelid = format('remus_shards.%I', $3::text)::regclass
                                AND sc.contype = c.contype AND sc.conkey = c.conkey
          WHERE c.conrelid = $1 AND c.conname = $2 AND c.contype IN ('p', 'u', 'x')",
        &[t.table.relid.into(), name.into(), shard.as_str().into()],
    )?)
}

/// The copy of DROP INDEX `d` (CONCURRENTLY) aimed at the shard's twin `twin` (a qualified,
/// quoted name from [`index_twins`]).
///
/// # Safety
/// `d` must be the statement about to run.
pub(super) unsafe fn drop_twin(d: *mut pg_sys::DropStmt, twin: &str) -> ShardWork {
    let name = CString::new(twin).expect("no NUL in names");
    // SAFETY: the caller upholds this function's `# Safety` contract; the name list and the
    // list holding it are palloc'd in the current (the statement's) memory context.
    unsafe {
        let c = copy_node(d);
        let names = pg_sys::stringToQualifiedNameList(name.as_ptr());
        (*c).objects = pg_sys::lappend(std::ptr::null_mut(), names as *mut std::ffi::c_void);
        ShardWork::Tree(c as *mut pg_sys::Node)
    }
}

/// CREATE / DROP INDEX CONCURRENTLY on a shell (decision 0021). Neither can run in a transaction
/// block, so neither can join the caller's two-phase commit: after PostgreSQL's own run on the
/// shell, each shard table of this node gets its own concurrent build or drop (each in
/// transactions of its own, as PostgreSQL's), then every other node gets the statement in
/// autocommit over its node connection, where it arrives forwarded: that node does its shell
/// and shards and sends it nowhere. The first failure stops it there, as a failed CONCURRENTLY
/// on one PostgreSQL: what was built stays (an INVALID index where the build failed), and the
/// error says where it failed and how to remove what is left.
pub(super) struct Concurrently {
    what: &'static str,
    table: String,
    shard_ids: Vec<i64>,
    /// The shell's index as the statement names it (None: PostgreSQL chooses the name).
    index: Option<String>,
    /// The other nodes, read while the statement's snapshot is there (none when forwarded).
    others: Vec<NodeAddr>,
}

/// The [`Concurrently`] of `stmt`, a statement on a shell that [`super::prepare`] accepted, if
/// it is CREATE or DROP INDEX CONCURRENTLY.
///
/// # Safety
/// `stmt` must be the statement about to run.
pub(super) unsafe fn concurrently(
    stmt: *mut pg_sys::Node,
) -> Result<Option<Concurrently>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the nodes read below are
    // part of the statement's tree.
    let (what, table, index) = unsafe {
        match (*stmt).type_ {
            pg_sys::NodeTag::T_IndexStmt => {
                let i = stmt as *mut pg_sys::IndexStmt;
                if !(*i).concurrent {
                    return Ok(None);
                }
                let index = (!(*i).idxname.is_null())
                    .then(|| CStr::from_ptr((*i).idxname).to_string_lossy().into_owned());
                (
                    "CREATE INDEX CONCURRENTLY",
                    super::target::relid_of((*i).relation),
                    index,
                )
            }
            pg_sys::NodeTag::T_DropStmt => {
                let d = stmt as *mut pg_sys::DropStmt;
                let Some(&name) = list_ptrs::<pg_sys::List>((*d).objects).first() else {
                    return Ok(None);
                };
                if !(*d).concurrent {
                    return Ok(None);
                }
                let relid = super::target::relid_of(pg_sys::makeRangeVarFromNameList(name));
                if relid == pg_sys::InvalidOid {
                    return Ok(None);
                }
                let text = CStr::from_ptr(pg_sys::NameListToString(name))
                    .to_string_lossy()
                    .into_owned();
                (
                    "DROP INDEX CONCURRENTLY",
                    pg_sys::IndexGetRelation(relid, true),
                    Some(text),
                )
            }
            _ => return Ok(None),
        }
    };
    let Some(t) = target(table)? else {
        return Ok(None);
    };
    let others = if crate::guc::FORWARDED.get() {
        Vec::new()
    } else {
        crate::cluster::nodes::all_nodes()?
            .into_iter()
            .filter(|n| !crate::guc::is_this_node(&n.name))
            .collect()
    };
    Ok(Some(Concurrently {
        what,
        table: t.table.qualified_name.to_string(),
        shard_ids: t.shard_ids,
        index,
        others,
    }))
}

impl Concurrently {
    /// The error of a step that failed on `node` (on its shard table `shard`, or on the node as
    /// a whole), with the step's own SQLSTATE and what to do about what it left.
    fn failed(&self, node: &str, shard: Option<&str>, e: RemusError) -> RemusError {
        let place = match shard {
            Some(s) => format!("node {node}, shard table {s}"),
            None => format!("node {node}"),
        };
        let index = match &self.index {
            Some(name) => format!("DROP INDEX {name}"),
            None => format!("DROP INDEX of the index it made on {}", self.table),
        };
        let hint = if self.what.starts_with("CREATE") {
            format!(
                "Where a concurrent build failed PostgreSQL leaves the index INVALID, and the nodes after {node} were not reached. {index} on the node where this statement ran removes it and its twins, valid or not, on every node and shard table."
            )
        } else {
            // The shell goes first (PostgreSQL's own run), so the shell of the node that
            // failed may be without the index while one of its shard tables still has it.
            format!(
                "What was dropped stays dropped, and the nodes after {node} were not reached. Where a shell still has the index, DROP INDEX {} there drops the rest; a shard table's index left without it (named above) is dropped by a superuser on that node.",
                self.index.as_deref().unwrap_or("…")
            )
        };
        let (sqlstate, message, detail) = match e {
            RemusError::Remote {
                sqlstate,
                message,
                detail,
                ..
            } => (sqlstate, message, detail),
            other => (other.sqlstate().to_string(), other.to_string(), None),
        };
        // A node's own failure of the forwarded statement already names its shard table.
        let message = if message.starts_with(&format!("{} failed on node ", self.what)) {
            message
        } else {
            format!("{} failed on {place}: {message}", self.what)
        };
        RemusError::Remote {
            node: node.to_string(),
            sqlstate,
            message,
            detail,
            hint: Some(hint),
        }
    }
}

/// Step 3 of CREATE / DROP INDEX CONCURRENTLY (see [`Concurrently`]): this node's shard tables
/// (`work`, one [`ShardWork::Tree`] each), then the statement `propagate` on every other node.
pub(super) fn finish_concurrently(
    c: Concurrently,
    work: Vec<ShardWork>,
    propagate: Option<String>,
    query_string: *const c_char,
) -> Result<(), RemusError> {
    let here = crate::guc::node_name().unwrap_or_else(|| "(this node)".into());
    for w in work {
        let ShardWork::Tree(node) = w else {
            continue;
        };
        next_transaction();
        // SAFETY: `node` is one of the copies `prepare` made for this statement.
        let shard = unsafe { shard_of(node) };
        // A migration registered since `prepare` (the build can take long): its shard table
        // must keep the shape the copy started with.
        crate::migration::copy::check_ddl(&c.table, &c.shard_ids)
            .map_err(|e| c.failed(&here, Some(&shard), e))?;
        // SAFETY: as above; a fresh transaction with no snapshot, outside any block.
        unsafe { run_concurrently(node, query_string) }
            .map_err(|e| c.failed(&here, Some(&shard), e))?;
    }
    let Some(sql) = propagate else {
        return Ok(());
    };
    // What this node did stays, whatever happens on the others.
    next_transaction();
    for node in &c.others {
        remote::with_connection(node, |conn| {
            if conn.in_transaction {
                return Err(RemusError::Unsupported(
                    "CREATE / DROP INDEX CONCURRENTLY with a remote transaction open",
                ));
            }
            conn.act_as_caller()?;
            // A cancel here goes to that node's build, which stops there as it would here.
            conn.exec_forwarding_cancel(&sql)
        })
        .map_err(|e| c.failed(&node.name, None, e))?;
    }
    Ok(())
}

/// Commits the transaction the previous step left open (PostgreSQL's last one on the shell, or
/// a shard's) and starts the next step's, as PostgreSQL does between the phases of a
/// concurrent build.
fn next_transaction() {
    // SAFETY: only reached after PostgreSQL ran CREATE / DROP INDEX CONCURRENTLY on the shell,
    // so the statement is at top level outside any transaction block (its
    // PreventInTransactionBlock passed) and PostgreSQL itself committed between its phases; no
    // relation, SPI connection or snapshot of ours is open here. The statement's trees and text
    // live in the portal's memory, which outlives the transactions.
    unsafe {
        while pg_sys::ActiveSnapshotSet() {
            pg_sys::PopActiveSnapshot();
        }
        pg_sys::CommitTransactionCommand();
        pg_sys::StartTransactionCommand();
    }
}

/// The shard table (CREATE) or twin (DROP) that `node` works on, for messages.
///
/// # Safety
/// `node` must be a tree made by `create_index` or [`drop_twin`].
unsafe fn shard_of(node: *mut pg_sys::Node) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if (*node).type_ == pg_sys::NodeTag::T_IndexStmt {
            let rv = (*(node as *mut pg_sys::IndexStmt)).relation;
            format!(
                "remus_shards.{}",
                CStr::from_ptr((*rv).relname).to_string_lossy()
            )
        } else {
            let d = node as *mut pg_sys::DropStmt;
            match list_ptrs::<pg_sys::List>((*d).objects).first() {
                Some(&n) => CStr::from_ptr(pg_sys::NameListToString(n))
                    .to_string_lossy()
                    .into_owned(),
                None => String::new(),
            }
        }
    }
}

extern "C-unwind" {
    /// parser/parse_utilcmd.h (not in pgrx's bindings): parse analysis of CREATE INDEX. Called
    /// only through `pg_guard_ffi_boundary`, which turns its ERROR into a Rust unwind.
    fn transformIndexStmt(
        relid: pg_sys::Oid,
        stmt: *mut pg_sys::IndexStmt,
        query_string: *const c_char,
    ) -> *mut pg_sys::IndexStmt;
}

/// One shard's concurrent build or drop, in the current (fresh) transaction; PostgreSQL's
/// error, if it raises one, as a [`RemusError::Remote`] of this node.
///
/// The shard table is the extension owner's, and the caller's role is not: the ownership check
/// of ProcessUtility is left out (the caller passed it on the shell, whose twin this is), and
/// the role stays the caller's. Switching to the owner around the internal commits would not
/// do: an error in a later internal transaction would leave the session as the owner (an abort
/// restores the user of its own transaction's start). PostgreSQL runs the build itself as the
/// table's owner, as for every index.
///
/// # Safety
/// `node` must be a tree made by `create_index` (CONCURRENTLY) or [`drop_twin`]; the
/// transaction must be fresh (no snapshot, no XID), outside any block.
unsafe fn run_concurrently(
    node: *mut pg_sys::Node,
    query_string: *const c_char,
) -> Result<(), RemusError> {
    PgTryBuilder::new(|| {
        // SAFETY: the caller upholds this function's `# Safety` contract. The snapshot pushed
        // here is the one PostgreSQL's concurrent build / drop pops before its first internal
        // commit (as it pops the portal's when run from SQL); the relation is locked as
        // ProcessUtility locks it before DefineIndex / index_drop, heap before index.
        unsafe {
            // What the step allocates must outlive its internal commits (DefineIndex and
            // index_drop use it across them), as in PostgreSQL's own run from SQL: the portal's
            // memory, not the transaction's.
            if !pg_sys::PortalContext.is_null() {
                pg_sys::MemoryContextSwitchTo(pg_sys::PortalContext);
            }
            pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
            if (*node).type_ == pg_sys::NodeTag::T_IndexStmt {
                let i = node as *mut pg_sys::IndexStmt;
                let relid = pg_sys::RangeVarGetRelidExtended(
                    (*i).relation,
                    pg_sys::ShareUpdateExclusiveLock as i32,
                    0,
                    None,
                    std::ptr::null_mut(),
                );
                let analyzed = pg_sys::ffi::pg_guard_ffi_boundary(|| {
                    transformIndexStmt(relid, i, query_string)
                });
                pg_sys::DefineIndex(
                    relid,
                    analyzed,
                    pg_sys::InvalidOid,
                    pg_sys::InvalidOid,
                    pg_sys::InvalidOid,
                    false,
                    false, // check_rights: CREATE on remus_shards is the owner's, not the caller's
                    true,
                    false,
                    false,
                );
            } else {
                drop_index_concurrently(node as *mut pg_sys::DropStmt);
            }
            // Left by a step that ended before its first commit.
            if pg_sys::ActiveSnapshotSet() {
                pg_sys::PopActiveSnapshot();
            }
            // Where PostgreSQL's own steps leave it: the transaction they started last.
            pg_sys::MemoryContextSwitchTo(pg_sys::TopTransactionContext);
        }
        Ok(())
    })
    .catch_others(|e| Err(caught(e)))
    .execute()
}

/// DROP INDEX CONCURRENTLY of the twin `d` names, if it is still there.
///
/// # Safety
/// As [`run_concurrently`]'s, with an active snapshot pushed.
unsafe fn drop_index_concurrently(d: *mut pg_sys::DropStmt) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let Some(&name) = list_ptrs::<pg_sys::List>((*d).objects).first() else {
            return;
        };
        let index = super::target::relid_of(pg_sys::makeRangeVarFromNameList(name));
        if index == pg_sys::InvalidOid {
            return;
        }
        let heap = pg_sys::IndexGetRelation(index, true);
        if heap == pg_sys::InvalidOid {
            return;
        }
        pg_sys::LockRelationOid(heap, pg_sys::ShareUpdateExclusiveLock as i32);
        pg_sys::LockRelationOid(index, pg_sys::ShareUpdateExclusiveLock as i32);
        // Dropped while we waited for the locks: nothing left to do.
        if pg_sys::IndexGetRelation(index, true) != heap {
            return;
        }
        let address = pg_sys::ObjectAddress {
            classId: pg_sys::RelationRelationId,
            objectId: index,
            objectSubId: 0,
        };
        // As RemoveRelations does: performDeletion would take an AccessExclusiveLock on the
        // index, and logging that for hot standby assigns an XID, which a concurrent drop
        // refuses ("must be first action in transaction").
        let addresses = pg_sys::new_object_addresses();
        pg_sys::add_exact_object_address(&address, addresses);
        pg_sys::performMultipleDeletions(
            addresses,
            pg_sys::DropBehavior::DROP_RESTRICT,
            pg_sys::PERFORM_DELETION_CONCURRENTLY as i32,
        );
    }
}

/// A PostgreSQL error caught from a shard's step, with its SQLSTATE.
fn caught(e: CaughtError) -> RemusError {
    let node = crate::guc::node_name().unwrap_or_default();
    match e {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => RemusError::Remote {
            node,
            sqlstate: sqlstate_text(r.sql_error_code() as i32),
            message: r.message().to_string(),
            detail: r.detail().map(str::to_string),
            hint: None,
        },
        CaughtError::RustPanic { ereport, .. } => RemusError::Remote {
            node,
            sqlstate: "XX000".into(),
            message: ereport.message().to_string(),
            detail: None,
            hint: None,
        },
    }
}

/// The five characters of a SQLSTATE PostgreSQL encoded with MAKE_SQLSTATE.
fn sqlstate_text(code: i32) -> String {
    (0..5)
        .map(|i| char::from((((code >> (6 * i)) & 0x3F) as u8) + b'0'))
        .collect()
}
