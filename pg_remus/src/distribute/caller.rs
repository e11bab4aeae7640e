//! Who may convert a table, and with whose rights the conversion runs (decision 0016).
//!
//! `remus_create_distributed_table` and `remus_create_reference_table` can be executed by
//! superusers and members of `remus_admin` (`api::privileges`). They run as their caller
//! (SECURITY INVOKER), so that the caller can be checked: converting a table is an ALTER TABLE
//! of it, its owner's to do (42501 otherwise, as ALTER TABLE says). The conversion itself writes
//! the catalog of every node, creates shard tables in `remus_shards`, puts the extension's
//! triggers on them and on the shell, and reaches the other nodes as the node user: nothing a
//! `remus_admin` member holds a privilege for. So, once checked, it runs as the bootstrap
//! superuser ([`crate::pg::spi::as_extension_owner`]), with the search_path its function's
//! definition pins (`pg_catalog, pg_temp`).
//!
//! While its rows move, the table's own code runs with those rights: its CHECK constraints,
//! generated columns, index expressions, the constraints of its columns' domains (COPY on the
//! other nodes), its TRUNCATE triggers. For a caller who is not superuser, [`check`] therefore
//! refuses a table whose definition reaches a function that a role other than a superuser owns
//! and that would run as the caller (SECURITY DEFINER functions run as their owner anyway):
//! that role could make it do anything a superuser can.

use pgrx::prelude::*;

use crate::error::RemusError;

/// The conversion's checks of its caller: owner of `relid` (or superuser), and, if not a
/// superuser, a table whose code is only superusers'.
pub(crate) fn check(relid: pg_sys::Oid) -> Result<(), RemusError> {
    // SAFETY: reads a backend global inside a transaction.
    let caller = unsafe { pg_sys::GetUserId() };
    // SAFETY: catalog lookups for an existing role.
    if unsafe { pg_sys::superuser_arg(caller) } {
        return Ok(());
    }
    let table = Spi::get_one_with_args::<String>(
        "SELECT format('%I.%I', n.nspname, c.relname)
           FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = $1",
        &[relid.into()],
    )?
    .ok_or(RemusError::NoSuchRelation {
        oid: relid.to_u32(),
    })?;
    // SAFETY: a catalog lookup of an existing relation (found just above, in this snapshot).
    if !unsafe { pg_sys::pg_class_ownercheck(relid, caller) } {
        return Err(RemusError::NotTableOwner { table });
    }
    match Spi::get_two_with_args::<String, String>(UNTRUSTED_CODE, &[relid.into()])? {
        (Some(function), Some(owner)) => Err(RemusError::TableCodeNotTrusted {
            table,
            function,
            owner,
        }),
        _ => Ok(()),
    }
}

/// The first function (`regprocedure`, owner) the table's definition reaches that a role other
/// than a superuser owns and that runs as its caller; one row of NULLs if there is none. Reached: what the table and everything
/// belonging to it (defaults, constraints, indexes, triggers, rules, policies, statistics, its
/// row type; pg_depend's automatic and internal dependents) depend on, and so on through
/// types (a domain's constraints, a range's subtype_diff, a composite's columns), operators and
/// functions. Built-in objects (below FirstNormalObjectId) are superusers' and not followed.
const UNTRUSTED_CODE: &str = "
WITH RECURSIVE reached(classid, objid) AS (
    SELECT 'pg_catalog.pg_class'::pg_catalog.regclass::pg_catalog.oid, $1::pg_catalog.oid
  UNION
    SELECT x.classid, x.objid
      FROM reached r,
           LATERAL (SELECT d.refclassid, d.refobjid FROM pg_catalog.pg_depend d
                     WHERE d.classid = r.classid AND d.objid = r.objid
                    UNION ALL
                    SELECT d.classid, d.objid FROM pg_catalog.pg_depend d
                     WHERE d.refclassid = r.classid AND d.refobjid = r.objid
                       AND d.deptype IN ('a', 'i')) x(classid, objid)
     WHERE x.objid >= 16384
)
SELECT u.proc, u.proc_owner
  FROM (VALUES (1)) one
  LEFT JOIN (SELECT p.oid::pg_catalog.regprocedure::pg_catalog.text, o.rolname::pg_catalog.text
               FROM reached r
               JOIN pg_catalog.pg_proc p
                 ON r.classid = 'pg_catalog.pg_proc'::pg_catalog.regclass AND p.oid = r.objid
               JOIN pg_catalog.pg_roles o ON o.oid = p.proowner
              WHERE NOT o.rolsuper AND NOT p.prosecdef
              ORDER BY 1
              LIMIT 1) u(proc, proc_owner) ON true";

/// Runs a conversion `f` of `relid` for the caller: [`check`], then `f` as the bootstrap
/// superuser (the module doc says why).
pub(crate) fn convert(
    relid: pg_sys::Oid,
    f: impl FnOnce() -> Result<(), RemusError>,
) -> Result<(), RemusError> {
    check(relid)?;
    crate::pg::spi::as_extension_owner(f)
}
