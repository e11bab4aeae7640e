//! GRANT and REVOKE on distributed and reference tables, and on the sequences their columns own,
//! on every node at once.
//!
//! Privileges are checked on the shell of the node a statement enters through, and again on
//! the shell of each node that runs part of it (`router::privileges`), so every node's shell
//! must carry the same grants. A GRANT or REVOKE naming distributed or reference tables runs
//! here and then, as the same text and as the same role (`cluster::forwarded_role`), on every
//! other node inside the same transaction: the remote transactions join its two-phase commit,
//! so it takes effect everywhere or nowhere (a role missing on one node fails it everywhere).
//! Statements that would act on distributed tables on this node only are refused (0A000).

use std::ffi::CStr;

use pgrx::pg_sys;

use crate::error::RemusError;
use crate::pg::list::list_ptrs;

/// The text of a GRANT / REVOKE on distributed or reference tables, for [`propagate`] once it
/// ran here; None for any other statement.
///
/// # Safety
/// `pstmt` and `query_string` must be the ProcessUtility hook's arguments.
pub(crate) unsafe fn to_propagate(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
) -> Result<Option<String>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null()
            || (*stmt).type_ != pg_sys::NodeTag::T_GrantStmt
            || crate::guc::FORWARDED.get()
            || crate::guc::MIGRATION_SESSION.get()
            || !crate::pg::extension::extension_present()
        {
            return Ok(None);
        }
        let grant = stmt as *mut pg_sys::GrantStmt;
        let sequences = match (*grant).objtype {
            pg_sys::ObjectType::OBJECT_TABLE => false,
            pg_sys::ObjectType::OBJECT_SEQUENCE => true,
            _ => return Ok(None),
        };
        match (*grant).targtype {
            pg_sys::GrantTargetType::ACL_TARGET_OBJECT => {
                let mut distributed = 0;
                let objects = list_ptrs::<pg_sys::RangeVar>((*grant).objects);
                for rv in &objects {
                    let relid = pg_sys::RangeVarGetRelidExtended(
                        *rv,
                        pg_sys::NoLock as i32,
                        pg_sys::RVROption::RVR_MISSING_OK,
                        None,
                        std::ptr::null_mut(),
                    );
                    let is_distributed = relid != pg_sys::InvalidOid
                        && if sequences {
                            sequence_of_distributed_table(relid)?
                        } else {
                            super::placement::dist_table(relid)?.is_some()
                        };
                    if is_distributed {
                        distributed += 1;
                    }
                }
                if distributed == 0 {
                    return Ok(None);
                }
                if distributed != objects.len() {
                    return Err(RemusError::Unsupported(if sequences {
                        "GRANT or REVOKE on sequences of distributed tables and other sequences in one statement"
                    } else {
                        "GRANT or REVOKE on distributed and local tables in one statement"
                    }));
                }
            }
            pg_sys::GrantTargetType::ACL_TARGET_ALL_IN_SCHEMA => {
                let schemas: Vec<String> = list_ptrs::<pg_sys::String>((*grant).objects)
                    .into_iter()
                    .map(|s| CStr::from_ptr((*s).sval).to_string_lossy().into_owned())
                    .collect();
                let holds_distributed = crate::pg::spi::read_one::<bool>(
                    "SELECT EXISTS (SELECT FROM remus.distributed_tables d
                                      JOIN pg_catalog.pg_class c ON c.oid = d.logicalrelid
                                      JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                                     WHERE n.nspname = ANY ($1))",
                    &[schemas.into()],
                )?;
                if holds_distributed == Some(true) {
                    return Err(RemusError::Unsupported(if sequences {
                        "GRANT or REVOKE ON ALL SEQUENCES IN SCHEMA of a schema holding distributed tables (name the sequences)"
                    } else {
                        "GRANT or REVOKE ON ALL TABLES IN SCHEMA of a schema holding distributed tables (name the tables)"
                    }));
                }
                return Ok(None);
            }
            _ => return Ok(None),
        }
        // The statement's own text (a multi-statement string holds others).
        Ok(Some(crate::pg::query_tree::statement_text(
            pstmt,
            query_string,
        )))
    }
}

/// Is sequence `relid` one that a distributed table's column owns (`bigserial`, OWNED BY, or an
/// identity's)?
/// Such a sequence exists on every node, each drawing its own range (decision 0019), so a
/// grant on it must reach every node as the table's do.
fn sequence_of_distributed_table(relid: pg_sys::Oid) -> Result<bool, RemusError> {
    Ok(crate::pg::spi::read_one::<bool>(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_depend d
                          JOIN remus.distributed_tables t ON t.logicalrelid = d.refobjid
                         WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.objid = $1
                           AND d.refclassid = 'pg_catalog.pg_class'::regclass
                           AND d.deptype IN ('a', 'i'))",
        &[relid.into()],
    )?
    .unwrap_or(false))
}

/// Runs `sql` (a GRANT / REVOKE that ran here) on every other node, in this transaction.
pub(crate) fn propagate(sql: &str) -> Result<(), RemusError> {
    for node in crate::cluster::nodes::all_nodes()? {
        if !crate::guc::is_this_node(&node.name) {
            crate::twophase::exec_in_transaction(&node, sql, true)?;
        }
    }
    Ok(())
}
