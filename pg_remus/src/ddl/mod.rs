//! Distributed DDL: schema changes of distributed and reference tables, on every node and every
//! shard at once (decision 0021).
//!
//! A supported statement on a shell runs in three steps inside the caller's transaction:
//! 1. [`prepare`], before PostgreSQL runs it: the form is checked (what is not propagated is
//!    refused with 0A000 naming it, before anything ran), and the work for this node's shard
//!    tables is computed while the shell's catalog still shows the objects the statement names
//!    (the shard's twin of an index or of an index-backed constraint has its own name).
//! 2. PostgreSQL runs the statement on the shell, as the caller: its own checks (ownership,
//!    existence, dependencies) decide.
//! 3. [`finish`]: the same change on each shard table this node holds (as the extension owner,
//!    which owns them), the extension catalog's rows it affects (a renamed shard key, a dropped
//!    table), and then, on the node the statement entered, the statement's text on every other
//!    node as the same role; those nodes do steps 1–3 for their shell and shards. The remote
//!    transactions join the caller's two-phase commit: the change is made everywhere or nowhere.
//!    CREATE / DROP INDEX CONCURRENTLY cannot: they run step by step outside any transaction
//!    block ([`objects::finish_concurrently`]).
//!
//! The shard tables of a node must keep the column numbers of that node's shell (the router
//! plans on the shell and runs the plan on a shard), which the same ALTER on both keeps; a
//! migration's target builds its shard table with the shell's numbering (dropped columns
//! included, `coordinator::driver::copy`).

use std::ffi::{c_char, CStr};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::RemusError;
use crate::pg::list::list_ptrs;

mod alter_table;
mod foreign_key;
mod objects;
mod target;

use target::{copy_node, refused, relid_of, shard_range_var, target, ShardWork, Target};

/// A statement on a shell, between [`prepare`] and [`finish`].
pub(crate) struct Pending {
    shard_work: Vec<ShardWork>,
    /// Statements on the extension's catalog, after the shards.
    catalog: Vec<String>,
    /// The statement's text for the other nodes; None where it arrived from another node.
    propagate: Option<String>,
    query_string: *const c_char,
    /// CREATE / DROP INDEX CONCURRENTLY: finished outside any transaction block.
    concurrently: Option<objects::Concurrently>,
}

/// Step 1 (before PostgreSQL runs the statement): None for a statement that is not DDL on a
/// distributed or reference table; an error for a form that is not propagated.
///
/// # Safety
/// `pstmt` and `query_string` must be the ProcessUtility hook's arguments.
pub(crate) unsafe fn prepare(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const c_char,
) -> Result<Option<Pending>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract; every node below is
    // part of the statement's tree, live for the call.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null()
            || crate::guc::MIGRATION_SESSION.get()
            || !crate::pg::extension::extension_present()
        {
            return Ok(None);
        }
        let planned =
            match (*stmt).type_ {
                pg_sys::NodeTag::T_AlterTableStmt => {
                    let a = stmt as *mut pg_sys::AlterTableStmt;
                    if (*a).objtype != pg_sys::ObjectType::OBJECT_TABLE {
                        return Ok(None);
                    }
                    let Some(t) = target(relid_of((*a).relation))? else {
                        for cmd in list_ptrs::<pg_sys::AlterTableCmd>((*a).cmds) {
                            if (*cmd).subtype == pg_sys::AlterTableType::AT_AddConstraint {
                                foreign_key::refuse_from_plain_table(
                                    (*cmd).def as *mut pg_sys::Constraint,
                                )?;
                            }
                        }
                        return Ok(None);
                    };
                    check_not_migrating(&t)?;
                    Some(alter_table::plan(a, &t)?)
                }
                pg_sys::NodeTag::T_IndexStmt => {
                    let i = stmt as *mut pg_sys::IndexStmt;
                    let Some(t) = target(relid_of((*i).relation))? else {
                        return Ok(None);
                    };
                    check_not_migrating(&t)?;
                    Some((objects::create_index(i, &t)?, Vec::new()))
                }
                pg_sys::NodeTag::T_CreateStmt => {
                    let c = stmt as *mut pg_sys::CreateStmt;
                    for constraint in list_ptrs::<pg_sys::Constraint>((*c).constraints) {
                        foreign_key::refuse_from_plain_table(constraint)?;
                    }
                    for element in list_ptrs::<pg_sys::Node>((*c).tableElts) {
                        if (*element).type_ != pg_sys::NodeTag::T_ColumnDef {
                            continue;
                        }
                        let column = element as *mut pg_sys::ColumnDef;
                        for constraint in list_ptrs::<pg_sys::Constraint>((*column).constraints) {
                            foreign_key::refuse_from_plain_table(constraint)?;
                        }
                    }
                    return Ok(None);
                }
                pg_sys::NodeTag::T_DropStmt => drop_stmt(stmt as *mut pg_sys::DropStmt)?,
                pg_sys::NodeTag::T_RenameStmt => rename(stmt as *mut pg_sys::RenameStmt)?,
                pg_sys::NodeTag::T_CommentStmt => comment(stmt as *mut pg_sys::CommentStmt)?,
                pg_sys::NodeTag::T_AlterObjectSchemaStmt => {
                    let a = stmt as *mut pg_sys::AlterObjectSchemaStmt;
                    if (*a).objectType != pg_sys::ObjectType::OBJECT_TABLE {
                        return Ok(None);
                    }
                    let Some(t) = target(relid_of((*a).relation))? else {
                        return Ok(None);
                    };
                    check_not_migrating(&t)?;
                    // The shell moves on every node; shard tables stay in `remus_shards`.
                    Some((Vec::new(), Vec::new()))
                }
                // The rows are in the shard tables: a trigger or rule on the shell would never act.
                pg_sys::NodeTag::T_CreateTrigStmt => {
                    let c = stmt as *mut pg_sys::CreateTrigStmt;
                    let own = !(*c).trigname.is_null()
                        && CStr::from_ptr((*c).trigname)
                            .to_bytes()
                            .starts_with(b"remus_");
                    match target(relid_of((*c).relation))? {
                    Some(t) if !own => return Err(refused(
                        "CREATE TRIGGER (rows live in the shard tables, where it would not fire)",
                        &t,
                    )),
                    _ => return Ok(None),
                }
                }
                pg_sys::NodeTag::T_RuleStmt => {
                    let r = stmt as *mut pg_sys::RuleStmt;
                    match target(relid_of((*r).relation))? {
                        Some(t) => return Err(refused(
                            "CREATE RULE (rows live in the shard tables, where it would not act)",
                            &t,
                        )),
                        None => return Ok(None),
                    }
                }
                _ => None,
            };
        let Some((shard_work, catalog)) = planned else {
            return Ok(None);
        };
        let propagate = if crate::guc::FORWARDED.get() {
            None
        } else {
            Some(crate::pg::query_tree::statement_text(pstmt, query_string))
        };
        Ok(Some(Pending {
            shard_work,
            catalog,
            propagate,
            query_string,
            concurrently: objects::concurrently(stmt)?,
        }))
    }
}

/// Step 3 (after PostgreSQL ran the statement on the shell): the shards, the catalog, the other
/// nodes.
pub(crate) fn finish(p: Pending) -> Result<(), RemusError> {
    if let Some(c) = p.concurrently {
        return objects::finish_concurrently(c, p.shard_work, p.propagate, p.query_string);
    }
    for work in p.shard_work {
        match work {
            ShardWork::Tree(node) => crate::pg::spi::as_extension_owner(|| {
                // SAFETY: the tree is our copy of the user's statement, aimed at a shard
                // table; PostgreSQL runs it as it would from SQL, as the table's owner.
                unsafe { run_utility(node, p.query_string) }
            }),
            ShardWork::Sql(sql) => crate::pg::spi::as_extension_owner(|| Spi::run(&sql))?,
        }
        // SAFETY: makes this statement's catalog changes visible to the next.
        unsafe { pg_sys::CommandCounterIncrement() };
    }
    for sql in p.catalog {
        crate::pg::spi::as_extension_owner(|| Spi::run(&sql))?;
    }
    if let Some(sql) = p.propagate {
        for node in crate::cluster::nodes::all_nodes()? {
            if !crate::guc::is_this_node(&node.name) {
                crate::twophase::exec_in_transaction(&node, &sql, true)?;
            }
        }
    }
    Ok(())
}

/// Runs the utility statement `node` as a subcommand of the current one.
///
/// # Safety
/// `node` must be a valid utility statement tree that may be scribbled on; `query_string` the
/// text it came from.
unsafe fn run_utility(node: *mut pg_sys::Node, query_string: *const c_char) {
    // SAFETY: the caller upholds this function's `# Safety` contract; the PlannedStmt is a
    // zeroed node of the current memory context, filled as PostgreSQL fills a utility wrapper.
    unsafe {
        let p =
            pg_sys::palloc0(std::mem::size_of::<pg_sys::PlannedStmt>()) as *mut pg_sys::PlannedStmt;
        (*p).type_ = pg_sys::NodeTag::T_PlannedStmt;
        (*p).commandType = pg_sys::CmdType::CMD_UTILITY;
        (*p).canSetTag = false;
        (*p).utilityStmt = node;
        (*p).stmt_location = -1;
        pg_sys::standard_ProcessUtility(
            p,
            query_string,
            false,
            pg_sys::ProcessUtilityContext::PROCESS_UTILITY_SUBCOMMAND,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            pg_sys::None_Receiver,
            std::ptr::null_mut(),
        );
    }
}

/// DDL on a table with a shard that a migration is moving: 55006 (the migration's copy and
/// replay work on the shard's current shape).
fn check_not_migrating(t: &Target) -> Result<(), RemusError> {
    crate::migration::copy::check_ddl(&t.table.qualified_name, &t.shard_ids)
}

type Planned = Option<(Vec<ShardWork>, Vec<String>)>;

/// DROP TABLE and DROP INDEX naming distributed or reference tables (or their indexes).
unsafe fn drop_stmt(d: *mut pg_sys::DropStmt) -> Result<Planned, RemusError> {
    // SAFETY: `d` is the statement's node; its object lists are name lists.
    unsafe {
        let kind = (*d).removeType;
        if kind != pg_sys::ObjectType::OBJECT_TABLE && kind != pg_sys::ObjectType::OBJECT_INDEX {
            return Ok(None);
        }
        // A DROP INDEX from another node, which found the index on its shell: a node that a
        // failed CREATE INDEX CONCURRENTLY did not reach has none, and skips it. (The tree is
        // a simple query's, never a cached plan's: nodes send their statements as text.)
        let forwarded_index =
            kind == pg_sys::ObjectType::OBJECT_INDEX && crate::guc::FORWARDED.get();
        if forwarded_index {
            (*d).missing_ok = true;
        }
        let objects = list_ptrs::<pg_sys::List>((*d).objects);
        let mut targets = Vec::new();
        let mut indexes = Vec::new();
        let mut missing = 0;
        for obj in &objects {
            let relid = relid_of(pg_sys::makeRangeVarFromNameList(*obj));
            if forwarded_index && relid == pg_sys::InvalidOid {
                missing += 1;
                continue;
            }
            let table = if kind == pg_sys::ObjectType::OBJECT_INDEX && relid != pg_sys::InvalidOid {
                pg_sys::IndexGetRelation(relid, true)
            } else {
                relid
            };
            if let Some(t) = target(table)? {
                indexes.push(relid);
                targets.push(t);
            }
        }
        if targets.is_empty() {
            return Ok(None);
        }
        if targets.len() + missing != objects.len() {
            return Err(RemusError::Unsupported(
                "DROP of distributed and local objects in one statement (drop them apart)",
            ));
        }
        let mut work = Vec::new();
        let mut catalog = Vec::new();
        for (t, index) in targets.iter().zip(indexes) {
            check_not_migrating(t)?;
            if kind == pg_sys::ObjectType::OBJECT_TABLE {
                // CASCADE: the only objects that depend on a shard table are its co-located
                // shards' foreign keys, whose shells' keys PostgreSQL has just dropped with
                // this statement (or it would have refused it).
                for (_, name) in &t.local_shards {
                    work.push(ShardWork::Sql(format!(
                        "DROP TABLE remus_shards.{} CASCADE",
                        crate::pg::sql::quote_ident(name)
                    )));
                }
                // The shards and their owners go with it (ON DELETE CASCADE).
                catalog.push(format!(
                    "DELETE FROM remus.distributed_tables WHERE logicalrelid::oid = {}",
                    u32::from(t.table.relid)
                ));
            } else {
                for name in objects::index_twins(index, t)? {
                    work.push(if (*d).concurrent {
                        objects::drop_twin(d, &name)
                    } else {
                        ShardWork::Sql(format!("DROP INDEX {name}"))
                    });
                }
            }
        }
        Ok(Some((work, catalog)))
    }
}

/// ALTER TABLE … RENAME (the table, a column, a constraint) and ALTER INDEX … RENAME.
unsafe fn rename(r: *mut pg_sys::RenameStmt) -> Result<Planned, RemusError> {
    // SAFETY: `r` is the statement's node.
    unsafe {
        let relid = relid_of((*r).relation);
        let (table, shell_only) = match (*r).renameType {
            pg_sys::ObjectType::OBJECT_TABLE
            | pg_sys::ObjectType::OBJECT_COLUMN
            | pg_sys::ObjectType::OBJECT_TABCONSTRAINT => (relid, false),
            // The shard's twin of an index has its own name.
            pg_sys::ObjectType::OBJECT_INDEX if relid != pg_sys::InvalidOid => {
                (pg_sys::IndexGetRelation(relid, true), true)
            }
            _ => return Ok(None),
        };
        let Some(t) = target(table)? else {
            return Ok(None);
        };
        check_not_migrating(&t)?;
        if shell_only {
            return Ok(Some((Vec::new(), Vec::new())));
        }
        let newname = CStr::from_ptr((*r).newname).to_string_lossy().into_owned();
        let mut work = Vec::new();
        let mut catalog = Vec::new();
        match (*r).renameType {
            pg_sys::ObjectType::OBJECT_TABLE => {
                for (id, name) in &t.local_shards {
                    work.push(ShardWork::Sql(format!(
                        "ALTER TABLE remus_shards.{} RENAME TO {}",
                        crate::pg::sql::quote_ident(name),
                        crate::pg::sql::quote_ident(&format!("{newname}_{id}"))
                    )));
                }
            }
            pg_sys::ObjectType::OBJECT_COLUMN => {
                let old = CStr::from_ptr((*r).subname).to_string_lossy();
                for (_, name) in &t.local_shards {
                    let c = copy_node(r);
                    (*c).relation = shard_range_var(name);
                    work.push(ShardWork::Tree(c as *mut pg_sys::Node));
                }
                if t.table.shard_key.as_deref() == Some(old.as_ref()) {
                    catalog.push(format!(
                        "UPDATE remus.distributed_tables SET shard_key = {} WHERE logicalrelid::oid = {}",
                        crate::pg::sql::quote_literal(&newname),
                        u32::from(t.table.relid)
                    ));
                }
            }
            _ => {
                // A constraint: CHECK and FOREIGN KEY constraints keep their names on the
                // shards; an index-backed one's twin has its own (left as it is).
                let old = CStr::from_ptr((*r).subname).to_string_lossy();
                if matches!(
                    objects::constraint_kind(t.table.relid, &old)?,
                    Some('c') | Some('f')
                ) {
                    for (_, name) in &t.local_shards {
                        let c = copy_node(r);
                        (*c).relation = shard_range_var(name);
                        work.push(ShardWork::Tree(c as *mut pg_sys::Node));
                    }
                }
            }
        }
        Ok(Some((work, catalog)))
    }
}

/// COMMENT ON TABLE / COLUMN of a distributed or reference table: on every node's shell.
unsafe fn comment(c: *mut pg_sys::CommentStmt) -> Result<Planned, RemusError> {
    // SAFETY: `c` is the statement's node; get_object_address resolves its object name.
    unsafe {
        if (*c).objtype != pg_sys::ObjectType::OBJECT_TABLE
            && (*c).objtype != pg_sys::ObjectType::OBJECT_COLUMN
        {
            return Ok(None);
        }
        let mut rel: pg_sys::Relation = std::ptr::null_mut();
        let address = pg_sys::get_object_address(
            (*c).objtype,
            (*c).object,
            &mut rel,
            pg_sys::AccessShareLock as i32,
            true,
        );
        if !rel.is_null() {
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
        }
        if address.classId != pg_sys::RelationRelationId {
            return Ok(None);
        }
        match target(address.objectId)? {
            Some(_) => Ok(Some((Vec::new(), Vec::new()))),
            None => Ok(None),
        }
    }
}
