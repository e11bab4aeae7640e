//! FOREIGN KEY constraints of distributed and reference tables (decision 0021, amended).
//!
//! A foreign key is enforced where the rows are, by PostgreSQL's own triggers on the shard
//! tables, so it is accepted only where both ends of every referencing row live on one node:
//! - between co-located distributed tables whose shard keys are tied together (the referencing
//!   table's shard key references the referenced table's shard key): shard `i` of one
//!   references shard `i` of the other, which every migration moves with it;
//! - from a distributed or a reference table to a reference table, whose copy is on every node.
//!
//! The shell gets the constraint too (catalogs, `\d`, dependencies, DROP … CASCADE), without
//! PostgreSQL's validation query (it would read the shells, which are empty, through the
//! router); it is marked validated once every shard table has validated its copy, in the same
//! transaction. Each shard's copy has the shell's constraint name.
//!
//! Refused with 0A000: a key to or from a plain table, between tables that are not co-located
//! or whose shard keys are not tied, from a reference table to a distributed one, SET NULL /
//! SET DEFAULT actions that would change a shard key, and referential actions of a key to a
//! reference table (a migrating shard's two copies would both see the action: one from the
//! reference table's write, one from the source's replayed change).

use std::ffi::{CStr, CString};

use pgrx::pg_sys;

use super::target::{refused, relid_of, shard_range_var, target, Target};
use crate::error::RemusError;
use crate::pg::list::list_ptrs;

/// What a shard's copy of a foreign key references.
pub(super) enum Referenced {
    /// The reference table's shard table (one per node), unquoted.
    Reference(String),
    /// The co-located table: its shard table for each shard index.
    CoLocated {
        rel_name: String,
        shard_by_index: Vec<(i32, i64)>,
        own_index_by_shard: Vec<(i64, i32)>,
    },
}

impl Referenced {
    /// The unquoted shard table that shard `shard_id` of the referencing table references.
    pub(super) fn shard_table_for(&self, shard_id: i64) -> Option<String> {
        match self {
            Self::Reference(name) => Some(name.clone()),
            Self::CoLocated {
                rel_name,
                shard_by_index,
                own_index_by_shard,
            } => {
                let index = own_index_by_shard.iter().find(|(id, _)| *id == shard_id)?.1;
                let referenced = shard_by_index.iter().find(|(i, _)| *i == index)?.1;
                Some(format!("{rel_name}_{referenced}"))
            }
        }
    }
}

/// An ADD CONSTRAINT … FOREIGN KEY on a distributed or reference table, between `check` and
/// the shards' copies.
pub(super) struct ForeignKey {
    pub(super) referenced: Referenced,
    /// The constraint's name (chosen here when the statement gave none, as PostgreSQL would).
    pub(super) name: String,
    /// NOT VALID as the user wrote it: the shards' copies skip validation too, and the shell's
    /// stays not validated.
    pub(super) not_valid: bool,
}

/// Checks the foreign key `c` of table `t`, names it, and makes the shell's run skip the
/// validation query (see the module comment).
///
/// # Safety
/// `c` must be a FOREIGN KEY constraint node of the statement about to run on `t`'s shell.
pub(super) unsafe fn check(
    c: *mut pg_sys::Constraint,
    t: &Target,
) -> Result<ForeignKey, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the lists are the
    // constraint's column name lists.
    unsafe {
        let referenced_relid = relid_of((*c).pktable);
        let Some(r) = target(referenced_relid)? else {
            return Err(refused(
                "FOREIGN KEY to a table that is neither distributed nor a reference table",
                t,
            ));
        };
        let fk_columns = names((*c).fk_attrs);
        // `FKCONSTR_ACTION_*`: a no action, r restrict, c cascade, n set null, d set default.
        let changes_key = |action: u8| -> bool {
            matches!(action, b'n' | b'd')
                && !t.is_reference()
                && fk_columns
                    .iter()
                    .any(|col| Some(col.as_str()) == t.table.shard_key.as_deref())
        };
        if changes_key((*c).fk_del_action as u8) || changes_key((*c).fk_upd_action as u8) {
            return Err(refused(
                "FOREIGN KEY … ON DELETE / ON UPDATE SET NULL or SET DEFAULT over the shard key",
                t,
            ));
        }
        let referenced = if r.is_reference() {
            if (*c).fk_del_action as u8 != b'a' && (*c).fk_del_action as u8 != b'r'
                || (*c).fk_upd_action as u8 != b'a' && (*c).fk_upd_action as u8 != b'r'
            {
                return Err(refused(
                    "a referential action (CASCADE, SET NULL, SET DEFAULT) on a FOREIGN KEY to a reference table (use NO ACTION or RESTRICT)",
                    t,
                ));
            }
            let shard = crate::catalog::reference_shard(referenced_relid)?;
            Referenced::Reference(format!("{}_{shard}", r.table.rel_name))
        } else if t.is_reference() {
            return Err(refused(
                "FOREIGN KEY from a reference table to a distributed table",
                t,
            ));
        } else {
            if r.table.colocation_id != t.table.colocation_id {
                return Err(refused(
                    "FOREIGN KEY between distributed tables that are not co-located",
                    t,
                ));
            }
            let pk_columns = match names((*c).pk_attrs) {
                v if v.is_empty() => primary_key_columns(referenced_relid)?,
                v => v,
            };
            let own_key = fk_columns
                .iter()
                .position(|col| Some(col.as_str()) == t.table.shard_key.as_deref());
            let their_key = pk_columns
                .iter()
                .position(|col| Some(col.as_str()) == r.table.shard_key.as_deref());
            if own_key.is_none() || own_key != their_key {
                return Err(refused(
                    "FOREIGN KEY between distributed tables that does not reference the shard key with the shard key",
                    t,
                ));
            }
            Referenced::CoLocated {
                rel_name: r.table.rel_name.to_string(),
                shard_by_index: crate::catalog::shard_ids(referenced_relid)?,
                own_index_by_shard: crate::catalog::shard_ids(t.table.relid)?
                    .into_iter()
                    .map(|(index, id)| (id, index))
                    .collect(),
            }
        };
        if (*c).conname.is_null() {
            (*c).conname = choose_name(t, &fk_columns)?;
        }
        let name = CStr::from_ptr((*c).conname).to_string_lossy().into_owned();
        let not_valid = (*c).skip_validation;
        (*c).skip_validation = true;
        Ok(ForeignKey {
            referenced,
            name,
            not_valid,
        })
    }
}

/// Points a shard's copy of the constraint at the shard table it references, with the user's
/// validation.
///
/// # Safety
/// `c` must be the shard copy's FOREIGN KEY constraint node.
pub(super) unsafe fn aim_at_shard(
    c: *mut pg_sys::Constraint,
    fk: &ForeignKey,
    shard_id: i64,
) -> Result<(), RemusError> {
    let referenced = fk
        .referenced
        .shard_table_for(shard_id)
        .ok_or(RemusError::Unsupported(
            "a FOREIGN KEY whose referenced shard is not in the catalog",
        ))?;
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        (*c).pktable = shard_range_var(&referenced);
        (*c).skip_validation = fk.not_valid;
        (*c).initially_valid = !fk.not_valid;
    }
    Ok(())
}

/// The statement marking the shell's copy validated, once the shards validated theirs.
pub(super) fn mark_shell_validated(t: &Target, fk: &ForeignKey) -> Option<String> {
    (!fk.not_valid).then(|| {
        format!(
            "UPDATE pg_catalog.pg_constraint SET convalidated = true \
              WHERE conrelid = {} AND conname = {} AND contype = 'f'",
            u32::from(t.table.relid),
            crate::pg::sql::quote_literal(&fk.name)
        )
    })
}

/// Refuses a FOREIGN KEY of a plain table (one being created or altered) that references a
/// distributed or reference table: the shell it would reference holds no rows.
///
/// # Safety
/// `c` must be NULL or a constraint node of the statement about to run.
pub(super) unsafe fn refuse_from_plain_table(c: *mut pg_sys::Constraint) -> Result<(), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if c.is_null() || (*c).contype != pg_sys::ConstrType::CONSTR_FOREIGN {
            return Ok(());
        }
        match target(relid_of((*c).pktable))? {
            Some(r) => Err(RemusError::DdlNotPropagated {
                what: "a FOREIGN KEY of a plain table to a distributed or reference table (create the table without it, distribute it, then ALTER TABLE … ADD FOREIGN KEY)",
                table: r.table.qualified_name.to_string(),
            }),
            None => Ok(()),
        }
    }
}

/// The names of a list of String nodes.
unsafe fn names(list: *mut pg_sys::List) -> Vec<String> {
    // SAFETY: `list` is a column name list of the statement.
    unsafe {
        list_ptrs::<pg_sys::String>(list)
            .into_iter()
            .map(|s| CStr::from_ptr((*s).sval).to_string_lossy().into_owned())
            .collect()
    }
}

/// The primary key's columns of `relid`, in key order (what `REFERENCES t` without columns
/// references).
fn primary_key_columns(relid: pg_sys::Oid) -> Result<Vec<String>, RemusError> {
    let columns = crate::pg::spi::read_one::<Vec<String>>(
        "SELECT array_agg(a.attname::text ORDER BY k.ord)
           FROM pg_index i
           CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
          WHERE i.indrelid = $1 AND i.indisprimary",
        &[relid.into()],
    )?;
    Ok(columns.unwrap_or_default())
}

/// The name PostgreSQL gives an unnamed foreign key (`<table>_<columns>_fkey`, a number added to
/// the label until no constraint of the schema has it; the parts shortened, the longer first,
/// to fit NAMEDATALEN), chosen here so that the shell and every shard's copy carry the same one.
fn choose_name(t: &Target, columns: &[String]) -> Result<*mut std::ffi::c_char, RemusError> {
    // SAFETY: a catalog lookup of an existing relation.
    let namespace = unsafe { pg_sys::get_rel_namespace(t.table.relid) };
    let addition = columns.join("_");
    for pass in 0.. {
        let label = if pass == 0 {
            "fkey".to_string()
        } else {
            format!("fkey{pass}")
        };
        let name = object_name(&t.table.rel_name, &addition, &label);
        let taken = crate::pg::spi::read_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_constraint
                             WHERE conname = $1 AND connamespace = $2)",
            &[name.as_str().into(), namespace.into()],
        )?
        .unwrap_or(false);
        if !taken {
            let c = CString::new(name).expect("no NUL in names");
            // SAFETY: copies the name into the current memory context, where the statement
            // that will carry it lives.
            return Ok(unsafe { pg_sys::pstrdup(c.as_ptr()) });
        }
    }
    unreachable!("the passes are unbounded")
}

/// `name1_name2_label` within NAMEDATALEN - 1 bytes, the longer of the first two parts cut
/// first (PostgreSQL's makeObjectName).
fn object_name(name1: &str, name2: &str, label: &str) -> String {
    let max = pg_sys::NAMEDATALEN as usize - 1;
    let overhead = label.len() + 1 + usize::from(!name2.is_empty());
    let (mut l1, mut l2) = (name1.len(), name2.len());
    while l1 + l2 + overhead > max && l1 + l2 > 0 {
        if l1 > l2 {
            l1 -= 1;
        } else {
            l2 -= 1;
        }
    }
    let cut = |s: &str, mut n: usize| -> String {
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        s[..n].to_string()
    };
    let mut name = cut(name1, l1);
    if !name2.is_empty() {
        name.push('_');
        name.push_str(&cut(name2, l2));
    }
    name.push('_');
    name.push_str(label);
    name
}
