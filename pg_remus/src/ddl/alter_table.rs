//! ALTER TABLE on a distributed or reference table: which subcommands are propagated, and the
//! copy of the statement each shard table gets.

use std::ffi::CStr;

use pgrx::pg_sys;

use super::target::{copy_node, refused, shard_range_var, ShardWork, Target};
use super::{foreign_key, objects};
use crate::error::RemusError;
use crate::pg::list::list_ptrs;

/// Where a subcommand applies.
#[derive(PartialEq)]
enum Reach {
    /// The shell and every shard table.
    Everywhere,
    /// The shell only (shard tables are the extension's: owner, comments).
    ShellOnly,
}

/// The shard tables' copies of `a`, or the refusal of its first subcommand that is not
/// propagated.
///
/// # Safety
/// `a` must be the statement about to run, `t` its table.
pub(super) unsafe fn plan(
    a: *mut pg_sys::AlterTableStmt,
    t: &Target,
) -> Result<(Vec<ShardWork>, Vec<String>), RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract; the subcommands are
    // nodes of the statement.
    unsafe {
        let cmds = list_ptrs::<pg_sys::AlterTableCmd>((*a).cmds);
        let mut reaches = Vec::with_capacity(cmds.len());
        // The foreign keys the statement adds, by subcommand.
        let mut foreign_keys: Vec<Option<foreign_key::ForeignKey>> = Vec::with_capacity(cmds.len());
        for &cmd in &cmds {
            reaches.push(classify(cmd, t)?);
            foreign_keys.push(match added_foreign_key(cmd) {
                Some(c) => Some(foreign_key::check(c, t)?),
                None => None,
            });
        }
        let mut work = Vec::new();
        let catalog: Vec<String> = foreign_keys
            .iter()
            .flatten()
            .filter_map(|fk| foreign_key::mark_shell_validated(t, fk))
            .collect();
        if !reaches.contains(&Reach::Everywhere) {
            return Ok((work, catalog));
        }
        for (shard_id, name) in &t.local_shards {
            let copy = copy_node(a);
            (*copy).relation = shard_range_var(name);
            let mut kept: *mut pg_sys::List = std::ptr::null_mut();
            for (i, cmd) in list_ptrs::<pg_sys::AlterTableCmd>((*copy).cmds)
                .into_iter()
                .enumerate()
            {
                if reaches[i] != Reach::Everywhere {
                    continue;
                }
                if (*cmd).subtype == pg_sys::AlterTableType::AT_DropConstraint {
                    // An index-backed constraint's twin on the shard has its own name.
                    let shell_name = CStr::from_ptr((*cmd).name).to_string_lossy();
                    if let Some(twin) = objects::constraint_twin(t, &shell_name, *shard_id)? {
                        (*cmd).name = pg_sys::pstrdup(
                            std::ffi::CString::new(twin)
                                .expect("no NUL in names")
                                .as_ptr(),
                        );
                    }
                }
                if let Some(fk) = &foreign_keys[i] {
                    foreign_key::aim_at_shard(
                        (*cmd).def as *mut pg_sys::Constraint,
                        fk,
                        *shard_id,
                    )?;
                }
                if (*cmd).subtype == pg_sys::AlterTableType::AT_AddConstraint {
                    // A named PRIMARY KEY / UNIQUE builds an index named after it, and index
                    // names are per schema: each shard's is named after its table instead.
                    let c = (*cmd).def as *mut pg_sys::Constraint;
                    if matches!(
                        (*c).contype,
                        pg_sys::ConstrType::CONSTR_PRIMARY | pg_sys::ConstrType::CONSTR_UNIQUE
                    ) {
                        (*c).conname = std::ptr::null_mut();
                    }
                }
                kept = pg_sys::lappend(kept, cmd as *mut std::ffi::c_void);
            }
            (*copy).cmds = kept;
            work.push(ShardWork::Tree(copy as *mut pg_sys::Node));
        }
        Ok((work, catalog))
    }
}

/// The constraint `cmd` adds if it is a FOREIGN KEY.
unsafe fn added_foreign_key(cmd: *mut pg_sys::AlterTableCmd) -> Option<*mut pg_sys::Constraint> {
    // SAFETY: `cmd` is a subcommand of the statement about to run.
    unsafe {
        let c = (*cmd).def as *mut pg_sys::Constraint;
        ((*cmd).subtype == pg_sys::AlterTableType::AT_AddConstraint
            && !c.is_null()
            && (*c).contype == pg_sys::ConstrType::CONSTR_FOREIGN)
            .then_some(c)
    }
}

/// Where `cmd` applies, or why it is refused.
unsafe fn classify(cmd: *mut pg_sys::AlterTableCmd, t: &Target) -> Result<Reach, RemusError> {
    use pg_sys::AlterTableType as T;
    // SAFETY: `cmd` is a subcommand of the statement about to run.
    unsafe {
        let column = || -> Option<String> {
            (!(*cmd).name.is_null())
                .then(|| CStr::from_ptr((*cmd).name).to_string_lossy().into_owned())
        };
        let is_key = |name: Option<String>| -> bool {
            !t.is_reference() && name.is_some() && name.as_deref() == t.table.shard_key.as_deref()
        };
        match (*cmd).subtype {
            T::AT_AddColumn => {
                add_column((*cmd).def as *mut pg_sys::ColumnDef, t)?;
                Ok(Reach::Everywhere)
            }
            T::AT_DropColumn if is_key(column()) => Err(refused("DROP COLUMN of the shard key", t)),
            T::AT_AlterColumnType if is_key(column()) => {
                Err(refused("ALTER COLUMN … TYPE of the shard key", t))
            }
            T::AT_AddConstraint => {
                add_constraint((*cmd).def as *mut pg_sys::Constraint, t)?;
                Ok(Reach::Everywhere)
            }
            T::AT_DropColumn
            | T::AT_AlterColumnType
            | T::AT_ColumnDefault
            | T::AT_DropNotNull
            | T::AT_SetNotNull
            | T::AT_SetStatistics
            | T::AT_SetOptions
            | T::AT_ResetOptions
            | T::AT_SetStorage
            | T::AT_SetCompression
            | T::AT_ValidateConstraint
            | T::AT_DropConstraint
            | T::AT_SetRelOptions
            | T::AT_ResetRelOptions => Ok(Reach::Everywhere),
            T::AT_ChangeOwner | T::AT_DisableRowSecurity | T::AT_NoForceRowSecurity => {
                Ok(Reach::ShellOnly)
            }
            T::AT_AddIdentity | T::AT_SetIdentity | T::AT_DropIdentity => {
                Err(refused("ALTER COLUMN … IDENTITY", t))
            }
            T::AT_DropExpression => Err(refused("ALTER COLUMN … DROP EXPRESSION", t)),
            T::AT_AlterConstraint => Err(refused("ALTER CONSTRAINT", t)),
            T::AT_ClusterOn | T::AT_DropCluster => {
                Err(refused("CLUSTER ON / SET WITHOUT CLUSTER", t))
            }
            T::AT_SetLogged | T::AT_SetUnLogged => Err(refused("SET LOGGED / UNLOGGED", t)),
            T::AT_SetAccessMethod => Err(refused("SET ACCESS METHOD", t)),
            T::AT_SetTableSpace => Err(refused("SET TABLESPACE", t)),
            T::AT_ReplicaIdentity => Err(refused("REPLICA IDENTITY", t)),
            T::AT_EnableTrig
            | T::AT_EnableAlwaysTrig
            | T::AT_EnableReplicaTrig
            | T::AT_DisableTrig
            | T::AT_EnableTrigAll
            | T::AT_DisableTrigAll
            | T::AT_EnableTrigUser
            | T::AT_DisableTrigUser => Err(refused("ENABLE / DISABLE TRIGGER", t)),
            T::AT_EnableRule
            | T::AT_EnableAlwaysRule
            | T::AT_EnableReplicaRule
            | T::AT_DisableRule => Err(refused("ENABLE / DISABLE RULE", t)),
            T::AT_AddInherit | T::AT_DropInherit => Err(refused("INHERIT / NO INHERIT", t)),
            T::AT_AddOf | T::AT_DropOf => Err(refused("OF / NOT OF", t)),
            T::AT_AttachPartition | T::AT_DetachPartition | T::AT_DetachPartitionFinalize => {
                Err(refused("ATTACH / DETACH PARTITION", t))
            }
            _ => Err(refused("this ALTER TABLE form", t)),
        }
    }
}

/// ADD COLUMN: what its definition may hold.
unsafe fn add_column(def: *mut pg_sys::ColumnDef, t: &Target) -> Result<(), RemusError> {
    // SAFETY: `def` is the subcommand's column definition.
    unsafe {
        if def.is_null() {
            return Ok(());
        }
        if (*def).identity != 0 {
            return Err(refused("ADD COLUMN … GENERATED AS IDENTITY", t));
        }
        let type_name = list_ptrs::<pg_sys::String>((*(*def).typeName).names)
            .last()
            .map(|s| CStr::from_ptr((**s).sval).to_string_lossy().into_owned())
            .unwrap_or_default();
        if matches!(
            type_name.as_str(),
            "serial" | "serial4" | "bigserial" | "serial8" | "smallserial" | "serial2"
        ) {
            return Err(refused("ADD COLUMN of a serial type", t));
        }
        for c in list_ptrs::<pg_sys::Constraint>((*def).constraints) {
            match (*c).contype {
                pg_sys::ConstrType::CONSTR_FOREIGN => {
                    return Err(refused("ADD COLUMN … REFERENCES", t))
                }
                pg_sys::ConstrType::CONSTR_PRIMARY | pg_sys::ConstrType::CONSTR_UNIQUE
                    if !t.is_reference() =>
                {
                    return Err(refused(
                        "ADD COLUMN … UNIQUE / PRIMARY KEY (the new column is not the shard key)",
                        t,
                    ))
                }
                pg_sys::ConstrType::CONSTR_PRIMARY | pg_sys::ConstrType::CONSTR_UNIQUE
                    if !(*c).conname.is_null() =>
                {
                    return Err(refused(
                        "a named UNIQUE / PRIMARY KEY column constraint (name the index with ALTER TABLE … ADD CONSTRAINT)",
                        t,
                    ))
                }
                pg_sys::ConstrType::CONSTR_IDENTITY => {
                    return Err(refused("ADD COLUMN … GENERATED AS IDENTITY", t))
                }
                pg_sys::ConstrType::CONSTR_EXCLUSION => {
                    return Err(refused("an EXCLUDE constraint", t))
                }
                // Each copy of a reference table would compute its own value.
                pg_sys::ConstrType::CONSTR_DEFAULT
                    if t.is_reference() && !is_literal((*c).raw_expr) =>
                {
                    return Err(refused(
                        "ADD COLUMN with a DEFAULT that is not a literal on a reference table (its copies would differ)",
                        t,
                    ))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Is `expr` a literal (a constant, maybe cast)?
unsafe fn is_literal(expr: *mut pg_sys::Node) -> bool {
    // SAFETY: `expr` is a raw (untransformed) expression of the statement.
    unsafe {
        if expr.is_null() {
            return true;
        }
        match (*expr).type_ {
            pg_sys::NodeTag::T_A_Const => true,
            pg_sys::NodeTag::T_TypeCast => is_literal((*(expr as *mut pg_sys::TypeCast)).arg),
            _ => false,
        }
    }
}

/// ADD CONSTRAINT: CHECK anywhere; PRIMARY KEY / UNIQUE only over the shard key (on a
/// distributed table each shard enforces uniqueness among its own rows, which is the table's
/// only when the key is among the columns); FOREIGN KEY as `foreign_key` allows; no exclusion
/// constraints yet.
unsafe fn add_constraint(c: *mut pg_sys::Constraint, t: &Target) -> Result<(), RemusError> {
    // SAFETY: `c` is the subcommand's constraint.
    unsafe {
        if c.is_null() {
            return Ok(());
        }
        match (*c).contype {
            pg_sys::ConstrType::CONSTR_CHECK => Ok(()),
            pg_sys::ConstrType::CONSTR_PRIMARY | pg_sys::ConstrType::CONSTR_UNIQUE => {
                if !(*c).indexname.is_null() {
                    return Err(refused("ADD CONSTRAINT … USING INDEX", t));
                }
                if t.is_reference() {
                    return Ok(());
                }
                let key = t.table.shard_key.as_deref().unwrap_or_default();
                let has_key = list_ptrs::<pg_sys::String>((*c).keys)
                    .into_iter()
                    .any(|s| CStr::from_ptr((*s).sval).to_bytes() == key.as_bytes());
                if has_key {
                    Ok(())
                } else {
                    Err(RemusError::UniqueIndexWithoutShardKey {
                        table: t.table.qualified_name.to_string(),
                        key: key.to_string(),
                    })
                }
            }
            // Checked (and named) by `foreign_key::check`.
            pg_sys::ConstrType::CONSTR_FOREIGN => Ok(()),
            pg_sys::ConstrType::CONSTR_EXCLUSION => Err(refused("ADD CONSTRAINT … EXCLUDE", t)),
            _ => Err(refused("this constraint", t)),
        }
    }
}
