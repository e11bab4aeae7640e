//! Utility statements on distributed tables: COPY FROM is routed row by row, TRUNCATE goes to
//! every shard, COPY TO (which would read the empty shell) is refused with 0A000, as is turning
//! row-level security on (ENABLE / FORCE ROW LEVEL SECURITY, CREATE / ALTER POLICY), which the
//! shards would not enforce. Schema changes are `ddl`'s.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::catalog::{shard_table_name, DistTable, ShardPlacement};
use crate::error::RemusError;
use crate::pg::list::list_ptrs;

const FLUSH_BYTES: usize = 4 << 20;

thread_local! {
    /// COPY text handed to a local `CopyFrom` through its data-source callback (which takes no
    /// argument, hence a backend-global buffer).
    static LOCAL_COPY: RefCell<(Vec<u8>, usize)> = const { RefCell::new((Vec::new(), 0)) };
}

unsafe fn shell_of(rv: *mut pg_sys::RangeVar) -> Result<Option<DistTable>, RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let relid = crate::pg::relation::relid_of(rv);
        if relid == pg_sys::InvalidOid {
            return Ok(None);
        }
        super::placement::dist_table(relid)
    }
}

/// The ProcessUtility hook's work before the statement runs (the hook is
/// `hooks::process_utility`). `Ok(true)`: handled here.
///
/// # Safety
/// `pstmt`, `query_string` and `qc` must be the hook's arguments.
pub(crate) unsafe fn intercept(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
    qc: *mut pg_sys::QueryCompletion,
) -> Result<bool, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null() || !crate::pg::extension::extension_present() {
            return Ok(false);
        }
        // ROLLBACK ends the transaction anyway: never held at the gate, never failed for a
        // migration (that would leave the block open and failed); its marks go at transaction end.
        let rollback = (*stmt).type_ == pg_sys::NodeTag::T_TransactionStmt
            && (*(stmt as *mut pg_sys::TransactionStmt)).kind
                == pg_sys::TransactionStmtKind::TRANS_STMT_ROLLBACK;
        if !rollback {
            crate::migration::handover::admit_statement()?;
        }
        if crate::migration::state::active() && !crate::guc::MIGRATION_SESSION.get() {
            guard_migrating(stmt)?;
        }
        match (*stmt).type_ {
            pg_sys::NodeTag::T_CopyStmt => {
                let copy = stmt as *mut pg_sys::CopyStmt;
                let Some(table) = shell_of((*copy).relation)? else {
                    return Ok(false);
                };
                if !(*copy).is_from {
                    return Err(RemusError::CopyToUnsupported {
                        table: table.qualified_name.to_string(),
                    });
                }
                if !(*copy).whereClause.is_null() {
                    return Err(RemusError::Unsupported(
                        "COPY … FROM … WHERE on a distributed table",
                    ));
                }
                // A node's COPY into one of this node's shards (`flush`): rows into the
                // shard table, privileges checked on the shell.
                if let Some(shard_id) = super::marker::marked_shard(query_string) {
                    let n = copy_into_shard(&table, shard_id, (*copy).attlist, None)?;
                    if !qc.is_null() {
                        pg_sys::SetQueryCompletion(qc, pg_sys::CommandTag::CMDTAG_COPY, n);
                    }
                    return Ok(true);
                }
                let n = copy_from(copy, &table, query_string)?;
                if !qc.is_null() {
                    pg_sys::SetQueryCompletion(qc, pg_sys::CommandTag::CMDTAG_COPY, n);
                }
                Ok(true)
            }
            pg_sys::NodeTag::T_TruncateStmt => {
                let t = stmt as *mut pg_sys::TruncateStmt;
                let rels = list_ptrs::<pg_sys::RangeVar>((*t).relations);
                let mut shells = Vec::new();
                for rv in &rels {
                    if let Some(d) = shell_of(*rv)? {
                        shells.push(d);
                    }
                }
                if shells.is_empty() {
                    return Ok(false);
                }
                if shells.len() != rels.len() {
                    return Err(RemusError::Unsupported(
                        "TRUNCATE of distributed and local tables in one statement",
                    ));
                }
                for d in &shells {
                    check_truncate_on_shell(d);
                }
                // A node's TRUNCATE of one of this node's shards (below).
                let marked = super::marker::marked_shard(query_string);
                match (marked, &shells[..]) {
                    (Some(shard_id), [d]) => truncate_local_shard(d, shard_id)?,
                    (Some(_), _) => {
                        return Err(RemusError::Unsupported(
                            "a marked TRUNCATE of more than one table",
                        ))
                    }
                    (None, _) => {
                        for d in &shells {
                            for p in super::placement::placements(d.relid)? {
                                truncate_shard(d, &p)?;
                            }
                        }
                    }
                }
                if !qc.is_null() {
                    pg_sys::SetQueryCompletion(qc, pg_sys::CommandTag::CMDTAG_TRUNCATE_TABLE, 0);
                }
                Ok(true)
            }
            pg_sys::NodeTag::T_AlterTableStmt => {
                let a = stmt as *mut pg_sys::AlterTableStmt;
                if let Some(d) = shell_of((*a).relation)? {
                    for cmd in list_ptrs::<pg_sys::AlterTableCmd>((*a).cmds) {
                        let what = match (*cmd).subtype {
                            pg_sys::AlterTableType::AT_EnableRowSecurity => {
                                "ALTER TABLE … ENABLE ROW LEVEL SECURITY"
                            }
                            pg_sys::AlterTableType::AT_ForceRowSecurity => {
                                "ALTER TABLE … FORCE ROW LEVEL SECURITY"
                            }
                            _ => continue,
                        };
                        return Err(row_security_refused(what, &d));
                    }
                }
                // Propagated to every node and shard by `ddl`.
                Ok(false)
            }
            pg_sys::NodeTag::T_CreatePolicyStmt => {
                let p = stmt as *mut pg_sys::CreatePolicyStmt;
                match shell_of((*p).table)? {
                    Some(d) => Err(row_security_refused("CREATE POLICY", &d)),
                    None => Ok(false),
                }
            }
            pg_sys::NodeTag::T_AlterPolicyStmt => {
                let p = stmt as *mut pg_sys::AlterPolicyStmt;
                match shell_of((*p).table)? {
                    Some(d) => Err(row_security_refused("ALTER POLICY", &d)),
                    None => Ok(false),
                }
            }
            _ => Ok(false),
        }
    }
}

/// Row-level security on a distributed or reference table is refused until it is propagated to
/// the shards (issue 18): the router reads and writes the shard tables, where the shell's
/// policies would not apply. Dropping a policy, or disabling row security, loses nothing.
fn row_security_refused(what: &'static str, table: &DistTable) -> RemusError {
    RemusError::RowSecurityOnDistributed {
        what,
        kind: if table.kind == 'r' {
            "reference"
        } else {
            "distributed"
        },
        table: table.qualified_name.to_string(),
    }
}

/// While a migration runs, DDL on its shard tables or their distributed tables is refused, and
/// a COPY FROM straight into a fenced shard table fails like any other stale write.
unsafe fn guard_migrating(stmt: *mut pg_sys::Node) -> Result<(), RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let mut targets: Vec<*mut pg_sys::RangeVar> = Vec::new();
        match (*stmt).type_ {
            pg_sys::NodeTag::T_AlterTableStmt => {
                targets.push((*(stmt as *mut pg_sys::AlterTableStmt)).relation)
            }
            pg_sys::NodeTag::T_IndexStmt => {
                targets.push((*(stmt as *mut pg_sys::IndexStmt)).relation)
            }
            pg_sys::NodeTag::T_CreateTrigStmt => {
                targets.push((*(stmt as *mut pg_sys::CreateTrigStmt)).relation)
            }
            pg_sys::NodeTag::T_RenameStmt => {
                targets.push((*(stmt as *mut pg_sys::RenameStmt)).relation)
            }
            pg_sys::NodeTag::T_TruncateStmt => targets.extend(list_ptrs::<pg_sys::RangeVar>(
                (*(stmt as *mut pg_sys::TruncateStmt)).relations,
            )),
            pg_sys::NodeTag::T_DropStmt => {
                let d = stmt as *mut pg_sys::DropStmt;
                if (*d).removeType == pg_sys::ObjectType::OBJECT_TABLE {
                    for obj in list_ptrs::<pg_sys::List>((*d).objects) {
                        targets.push(pg_sys::makeRangeVarFromNameList(obj));
                    }
                }
            }
            pg_sys::NodeTag::T_VacuumStmt => {
                let v = stmt as *mut pg_sys::VacuumStmt;
                if !(*v).is_vacuumcmd || !vacuum_freezes(v) {
                    return Ok(());
                }
                let rels = list_ptrs::<pg_sys::VacuumRelation>((*v).rels);
                if rels.is_empty() {
                    return crate::migration::copy::check_freeze(None, &[]);
                }
                for r in rels {
                    if let Some((name, ids)) = relation_shards((*r).relation, true)? {
                        crate::migration::copy::check_freeze(Some(&name), &ids)?;
                    }
                }
                return Ok(());
            }
            pg_sys::NodeTag::T_CopyStmt => {
                let copy = stmt as *mut pg_sys::CopyStmt;
                if (*copy).is_from {
                    if let Some((_, ids)) = relation_shards((*copy).relation, false)? {
                        crate::migration::handover::lock_abort::check_write(&ids)?;
                    }
                }
                return Ok(());
            }
            _ => return Ok(()),
        }
        for rv in targets {
            if let Some((name, ids)) = relation_shards(rv, true)? {
                crate::migration::copy::check_ddl(&name, &ids)?;
            }
        }
        Ok(())
    }
}

/// Does this VACUUM freeze every row it can: the FREEZE option, or `vacuum_freeze_min_age = 0`
/// (what FREEZE sets)?
///
/// # Safety
/// `v` must be the statement about to run.
unsafe fn vacuum_freezes(v: *mut pg_sys::VacuumStmt) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract; the option list and its
    // DefElems belong to the statement; the setting is a plain read of a backend global.
    unsafe {
        pg_sys::vacuum_freeze_min_age == 0
            || list_ptrs::<pg_sys::DefElem>((*v).options)
                .into_iter()
                .any(|d| {
                    !(*d).defname.is_null()
                        && CStr::from_ptr((*d).defname).to_bytes() == b"freeze"
                        && pg_sys::defGetBoolean(d)
                })
    }
}

/// The shards behind `rv`: itself if it is a shard table, all of its shards if it is a
/// distributed table (only when `with_shells`).
unsafe fn relation_shards(
    rv: *mut pg_sys::RangeVar,
    with_shells: bool,
) -> Result<Option<(String, Vec<i64>)>, RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let relid = crate::pg::relation::relid_of(rv);
        if relid == pg_sys::InvalidOid {
            return Ok(None);
        }
        if with_shells {
            if let Some(d) = super::placement::dist_table(relid)? {
                let ids = super::placement::placements(d.relid)?
                    .iter()
                    .map(|p| p.shard_id)
                    .collect();
                return Ok(Some((d.qualified_name.to_string(), ids)));
            }
        }
        let shard_nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), true);
        if shard_nsp == pg_sys::InvalidOid || pg_sys::get_rel_namespace(relid) != shard_nsp {
            return Ok(None);
        }
        let name = pg_sys::get_rel_name(relid);
        if name.is_null() {
            return Ok(None);
        }
        let name = CStr::from_ptr(name).to_string_lossy().into_owned();
        Ok(name
            .rsplit('_')
            .next()
            .and_then(|s| s.parse::<i64>().ok())
            .map(|id| (format!("remus_shards.{name}"), vec![id])))
    }
}

/// TRUNCATE privilege on the shell, as PostgreSQL checks it (an ERROR 42501 if missing): the
/// shard tables carry no grants of their own (`router::privileges`).
unsafe fn check_truncate_on_shell(table: &DistTable) {
    // SAFETY: an ACL check of an existing relation; the name outlives the call.
    unsafe {
        let acl = pg_sys::pg_class_aclcheck(table.relid, pg_sys::GetUserId(), pg_sys::ACL_TRUNCATE);
        if acl != pg_sys::AclResult::ACLCHECK_OK {
            let name = CString::new(table.rel_name.as_ref()).expect("no NUL in names");
            pg_sys::aclcheck_error(acl, pg_sys::ObjectType::OBJECT_TABLE, name.as_ptr());
        }
    }
}

/// Empties one shard of `table` where it lives, inside the current transaction: here, or on
/// its owner as the marked `TRUNCATE <shell>` that [`truncate_local_shard`] runs there.
unsafe fn truncate_shard(table: &DistTable, p: &ShardPlacement) -> Result<(), RemusError> {
    // SAFETY: see `truncate_local_shard`.
    unsafe {
        if crate::guc::is_this_node(&p.node_name) {
            return truncate_local_shard(table, p.shard_id);
        }
        let addr = crate::cluster::nodes::lookup(&p.node_name)?;
        let sql = crate::cluster::shard_marker::marked(
            p.shard_id,
            &format!("TRUNCATE {}", table.qualified_name),
        );
        crate::twophase::exec_in_transaction(&addr, &sql, true)?;
        Ok(())
    }
}

/// Empties this node's shard `shard_id` of `table`, whose TRUNCATE privilege the caller checked
/// on the shell. The shard table is the extension's: truncated as its owner (no user code runs:
/// shard tables have no TRUNCATE triggers).
unsafe fn truncate_local_shard(table: &DistTable, shard_id: i64) -> Result<(), RemusError> {
    let sql = format!("TRUNCATE {}", shard_table_name(&table.rel_name, shard_id));
    crate::pg::spi::as_extension_owner(|| Spi::run(&sql))?;
    Ok(())
}

fn escape_into(v: &[u8], out: &mut Vec<u8>) {
    for &b in v {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            _ => out.push(b),
        }
    }
}

/// Parses the client's COPY data on this node (any format and options the user gave), routes
/// each row by its shard key, and streams the rows to their shards as COPY text.
unsafe fn copy_from(
    copy: *mut pg_sys::CopyStmt,
    table: &DistTable,
    query_string: *const std::ffi::c_char,
) -> Result<u64, RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        let rel = pg_sys::table_open(table.relid, pg_sys::RowExclusiveLock as i32);
        check_copy_from(copy, rel)?;
        let desc = (*rel).rd_att;
        let natts = (*desc).natts as usize;
        let key_attno = if table.kind == 'r' {
            0
        } else {
            super::key::key_attno(table)? as usize
        };
        // Columns carried to the shards: live, not generated (the shard computes those).
        let mut cols = Vec::new();
        let mut out_fns = Vec::new();
        for i in 0..natts {
            let a = (*desc).attrs.as_ptr().add(i);
            if (*a).attisdropped || (*a).attgenerated != 0 {
                continue;
            }
            let mut f = pg_sys::InvalidOid;
            let mut varlena = false;
            pg_sys::getTypeOutputInfo((*a).atttypid, &mut f, &mut varlena);
            cols.push((
                i,
                CStr::from_ptr((*a).attname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
            ));
            out_fns.push(f);
        }
        let col_list = cols
            .iter()
            .map(|(_, n)| crate::pg::sql::quote_ident(n))
            .collect::<Vec<_>>()
            .join(", ");

        let pstate = pg_sys::make_parsestate(std::ptr::null_mut());
        (*pstate).p_sourcetext = query_string;
        let cstate = pg_sys::BeginCopyFrom(
            pstate,
            rel,
            std::ptr::null_mut(),
            (*copy).filename,
            (*copy).is_program,
            None,
            (*copy).attlist,
            (*copy).options,
        );
        let estate = pg_sys::CreateExecutorState();
        let econtext = pg_sys::CreateExprContext(estate);
        let all = super::placement::placements(table.relid)?;
        let mut values = vec![pg_sys::Datum::from(0usize); natts];
        let mut nulls = vec![false; natts];
        let mut buffers: BTreeMap<(i64, String), (ShardPlacement, Vec<u8>)> = BTreeMap::new();
        let mut rows = 0u64;
        while pg_sys::NextCopyFrom(cstate, econtext, values.as_mut_ptr(), nulls.as_mut_ptr()) {
            pgrx::check_for_interrupts!();
            if table.kind != 'r' && nulls[key_attno - 1] {
                return Err(RemusError::NullShardKey {
                    column: table.shard_key.as_deref().unwrap_or_default().to_string(),
                    table: table.qualified_name.to_string(),
                });
            }
            let mut line = Vec::new();
            for (j, (i, _)) in cols.iter().enumerate() {
                if j > 0 {
                    line.push(b'\t');
                }
                if nulls[*i] {
                    line.extend_from_slice(b"\\N");
                } else {
                    let s = pg_sys::OidOutputFunctionCall(out_fns[j], values[*i]);
                    escape_into(CStr::from_ptr(s).to_bytes(), &mut line);
                }
            }
            line.push(b'\n');
            // A reference table's row goes to every copy; a distributed table's to its shard.
            let targets: Vec<ShardPlacement> = if table.kind == 'r' {
                all.clone()
            } else {
                let key_type = (*(*desc).attrs.as_ptr().add(key_attno - 1)).atttypid;
                vec![super::key::placement_for(
                    table,
                    &all,
                    values[key_attno - 1],
                    key_type,
                )?]
            };
            for p in targets {
                let key = (p.shard_id, p.node_name.clone());
                let entry = buffers
                    .entry(key)
                    .or_insert_with(|| (p.clone(), Vec::new()));
                entry.1.extend_from_slice(&line);
                if entry.1.len() >= FLUSH_BYTES {
                    let data = std::mem::take(&mut entry.1);
                    let placement = entry.0.clone();
                    flush(table, &placement, &col_list, &data)?;
                }
            }
            rows += 1;
            pg_sys::MemoryContextReset((*econtext).ecxt_per_tuple_memory);
        }
        pg_sys::EndCopyFrom(cstate);
        pg_sys::FreeExecutorState(estate);
        for (_, (placement, data)) in buffers {
            if !data.is_empty() {
                flush(table, &placement, &col_list, &data)?;
            }
        }
        pg_sys::table_close(rel, pg_sys::NoLock as i32);
        Ok(rows)
    }
}

unsafe fn flush(
    table: &DistTable,
    p: &ShardPlacement,
    cols: &str,
    data: &[u8],
) -> Result<(), RemusError> {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        if crate::guc::node_name().as_deref() != Some(p.node_name.as_str()) {
            // The shell's name and a marker, as every statement on a shard: the owner copies
            // into its shard table as this role, checking the shell's privileges.
            let addr = crate::cluster::nodes::lookup(&p.node_name)?;
            let sql = crate::cluster::shard_marker::marked(
                p.shard_id,
                &format!("COPY {} ({cols}) FROM STDIN", table.qualified_name),
            );
            return crate::twophase::copy_in_transaction(&addr, &sql, data);
        }
        // Local shard: PostgreSQL's own COPY into the shard table, fed from memory.
        let mut attlist: *mut pg_sys::List = std::ptr::null_mut();
        for c in cols.split(", ") {
            let c =
                CString::new(c.trim_matches('"').replace("\"\"", "\"")).expect("no NUL in names");
            attlist = pg_sys::lappend(
                attlist,
                pg_sys::makeString(pg_sys::pstrdup(c.as_ptr())) as *mut std::ffi::c_void,
            );
        }
        LOCAL_COPY.with(|b| *b.borrow_mut() = (data.to_vec(), 0));
        let copied = copy_into_shard(table, p.shard_id, attlist, Some(local_source));
        LOCAL_COPY.with(|b| *b.borrow_mut() = (Vec::new(), 0));
        copied.map(|_| ())
    }
}

/// What PostgreSQL's COPY FROM checks before it reads rows into `rel` (the shell), as the
/// calling role: reading a server file or running a program needs the role that allows it,
/// and the table (or each column copied) needs INSERT. The shard tables it then writes carry
/// no grants of their own (`router::privileges`).
unsafe fn check_copy_from(
    copy: *mut pg_sys::CopyStmt,
    rel: pg_sys::Relation,
) -> Result<(), RemusError> {
    // SAFETY: `copy` is the statement being run and `rel` the shell it names, open.
    unsafe {
        let user = pg_sys::GetUserId();
        if !(*copy).filename.is_null() {
            let (role, what) = if (*copy).is_program {
                (
                    pg_sys::ROLE_PG_EXECUTE_SERVER_PROGRAM,
                    "pg_execute_server_program role to COPY to or from an external program",
                )
            } else {
                (
                    pg_sys::ROLE_PG_READ_SERVER_FILES,
                    "pg_read_server_files role to COPY from a file",
                )
            };
            if !pg_sys::has_privs_of_role(user, pg_sys::Oid::from(role)) {
                pgrx::ereport!(
                    ERROR,
                    PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
                    format!("must be superuser or have privileges of the {what}")
                );
            }
        }
        check_insert_on_shell(rel, (*copy).attlist);
        Ok(())
    }
}

/// INSERT on the shell `rel` for the columns of `attlist` (all when NULL), checked as
/// PostgreSQL checks a COPY FROM (an ERROR 42501 if missing).
unsafe fn check_insert_on_shell(rel: pg_sys::Relation, attlist: *mut pg_sys::List) {
    // SAFETY: `rel` is open; the entry and bitmap are palloc'd in the current context.
    unsafe {
        let rte = pg_sys::palloc0(std::mem::size_of::<pg_sys::RangeTblEntry>())
            as *mut pg_sys::RangeTblEntry;
        (*rte).type_ = pg_sys::NodeTag::T_RangeTblEntry;
        (*rte).rtekind = pg_sys::RTEKind::RTE_RELATION;
        (*rte).relid = (*rel).rd_id;
        (*rte).relkind = (*(*rel).rd_rel).relkind;
        (*rte).rellockmode = pg_sys::RowExclusiveLock as i32;
        (*rte).requiredPerms = pg_sys::ACL_INSERT;
        for attno in crate::pg::list::list_ints(pg_sys::CopyGetAttnums((*rel).rd_att, rel, attlist))
        {
            (*rte).insertedCols = pg_sys::bms_add_member(
                (*rte).insertedCols,
                attno - pg_sys::FirstLowInvalidHeapAttributeNumber,
            );
        }
        pg_sys::ExecCheckRTPerms(
            pg_sys::lappend(std::ptr::null_mut(), rte as *mut std::ffi::c_void),
            true,
        );
    }
}

/// COPY into this node's shard `shard_id` of `table`: from `source` (rows in memory), or from
/// the client (a node streaming a shard's rows, `flush`). The node the COPY entered checked
/// INSERT on the shell for the columns the user named (`check_copy_from`), once; the shard's
/// rows carry every column, for which the user may hold no column privilege.
unsafe fn copy_into_shard(
    table: &DistTable,
    shard_id: i64,
    attlist: *mut pg_sys::List,
    source: pg_sys::copy_data_source_cb,
) -> Result<u64, RemusError> {
    // SAFETY: catalog lookups by name and OID, relations opened and closed here.
    unsafe {
        let name =
            CString::new(format!("{}_{}", table.rel_name, shard_id)).expect("no NUL in names");
        let nsp = pg_sys::get_namespace_oid(c"remus_shards".as_ptr(), false);
        let shard_relid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
        if shard_relid == pg_sys::InvalidOid {
            return Err(RemusError::NotShardOwner {
                shard_id,
                node: crate::guc::node_name().unwrap_or_default(),
            });
        }
        let rel = pg_sys::table_open(shard_relid, pg_sys::RowExclusiveLock as i32);
        let pstate = pg_sys::make_parsestate(std::ptr::null_mut());
        // CopyFrom finds its target through the parse state's range table, as for a COPY
        // command; the permission check was the shell's, where the COPY entered.
        pg_sys::addRangeTableEntryForRelation(
            pstate,
            rel,
            pg_sys::RowExclusiveLock as i32,
            std::ptr::null_mut(),
            false,
            false,
        );
        let cstate = pg_sys::BeginCopyFrom(
            pstate,
            rel,
            std::ptr::null_mut(),
            std::ptr::null(),
            false,
            source,
            attlist,
            std::ptr::null_mut(),
        );
        let n = pg_sys::CopyFrom(cstate);
        pg_sys::EndCopyFrom(cstate);
        pg_sys::table_close(rel, pg_sys::NoLock as i32);
        Ok(n)
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn local_source(
    outbuf: *mut std::ffi::c_void,
    _minread: i32,
    maxread: i32,
) -> i32 {
    // SAFETY: PostgreSQL calls this hook with the arguments its API defines, valid for the
    // duration of the call; the body passes them to pg_sys as that API documents.
    unsafe {
        LOCAL_COPY.with(|b| {
            let mut b = b.borrow_mut();
            let (data, pos) = &mut *b;
            let n = (data.len() - *pos).min(maxread as usize);
            std::ptr::copy_nonoverlapping(data.as_ptr().add(*pos), outbuf as *mut u8, n);
            *pos += n;
            n as i32
        })
    }
}
