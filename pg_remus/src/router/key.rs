//! The shard key of a statement: `key = value` clauses, routable values, and the placement a
//! value maps to.

use std::ffi::CStr;

use pgrx::pg_sys;

use crate::catalog::{DistTable, ShardPlacement};
use crate::error::RemusError;
use crate::pg::list::{is_tag, list_ptrs, strip_relabel};

/// The placement that a key value (of any type convertible to the key type) maps to.
///
/// # Safety
/// `value` must be a valid datum of type `value_type`.
pub(crate) unsafe fn placement_for(
    table: &DistTable,
    placements: &[ShardPlacement],
    value: pg_sys::Datum,
    value_type: pg_sys::Oid,
) -> Result<ShardPlacement, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let index = shard_index_of(table, value, value_type)?;
        super::placement::placement_in(table, placements, index)
    }
}

/// The placement that a key value maps to, pinned ([`super::placement::placement_at_index`]).
///
/// # Safety
/// `value` must be a valid datum of type `value_type`.
pub(crate) unsafe fn placement_by_key(
    table: &DistTable,
    value: pg_sys::Datum,
    value_type: pg_sys::Oid,
) -> Result<ShardPlacement, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    let index = unsafe { shard_index_of(table, value, value_type)? };
    super::placement::placement_at_index(table, index)
}

/// The index of the shard of `table` that a key value (of any type convertible to the key type)
/// maps to.
///
/// # Safety
/// `value` must be a valid datum of type `value_type`.
pub(crate) unsafe fn shard_index_of(
    table: &DistTable,
    value: pg_sys::Datum,
    value_type: pg_sys::Oid,
) -> Result<usize, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let d = crate::pg::datum::coerce_via_text(value, value_type, table.key_type);
        let hash = crate::catalog::hashing::hash_datum(d, table.key_type, pg_sys::InvalidOid)?;
        Ok(crate::catalog::hashing::shard_index(hash, table.shard_count as u32) as usize)
    }
}

/// A value usable for routing: constants, external parameters, and casts of those.
///
/// # Safety
/// `node` must be NULL or a valid expression node.
pub(crate) unsafe fn is_routable_value(node: *mut pg_sys::Node) -> bool {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        use pg_sys::NodeTag::*;
        if node.is_null() {
            return false;
        }
        match (*node).type_ {
            T_Const => true,
            T_Param => (*(node as *mut pg_sys::Param)).paramkind == pg_sys::ParamKind::PARAM_EXTERN,
            T_RelabelType => is_routable_value((*(node as *mut pg_sys::RelabelType)).arg as *mut _),
            T_CoerceViaIO => is_routable_value((*(node as *mut pg_sys::CoerceViaIO)).arg as *mut _),
            T_FuncExpr => {
                let f = node as *mut pg_sys::FuncExpr;
                let args = list_ptrs::<pg_sys::Node>((*f).args);
                matches!(
                    (*f).funcformat,
                    pg_sys::CoercionForm::COERCE_IMPLICIT_CAST
                        | pg_sys::CoercionForm::COERCE_EXPLICIT_CAST
                ) && args.len() == 1
                    && is_routable_value(args[0])
            }
            _ => false,
        }
    }
}

/// If `clause` is `key = value` (either order) on range-table entry `varno`, the value side.
///
/// # Safety
/// `clause` must be a valid expression node.
pub(crate) unsafe fn key_equality_value(
    clause: *mut pg_sys::Node,
    varno: i32,
    key_attno: i16,
) -> Option<*mut pg_sys::Expr> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if !is_tag(clause, pg_sys::NodeTag::T_OpExpr) {
            return None;
        }
        let op = clause as *mut pg_sys::OpExpr;
        let args = list_ptrs::<pg_sys::Node>((*op).args);
        if args.len() != 2 || (*op).opno.to_u32() >= pg_sys::FirstNormalObjectId {
            return None;
        }
        let name = pg_sys::get_opname((*op).opno);
        if name.is_null() || CStr::from_ptr(name).to_bytes() != b"=" {
            return None;
        }
        for (a, b) in [(args[0], args[1]), (args[1], args[0])] {
            let v = strip_relabel(a);
            if is_tag(v, pg_sys::NodeTag::T_Var) {
                let var = v as *mut pg_sys::Var;
                if (*var).varno == varno
                    && (*var).varattno == key_attno
                    && (*var).varlevelsup == 0
                    && is_routable_value(b)
                {
                    return Some(b as *mut pg_sys::Expr);
                }
            }
        }
        None
    }
}

/// The key's attribute number in the shell.
pub(crate) fn key_attno(table: &DistTable) -> Result<i16, RemusError> {
    if table.key_attno <= 0 {
        return Err(RemusError::ShardKeyGone {
            key: table.shard_key.as_deref().unwrap_or_default().to_string(),
            table: table.qualified_name.to_string(),
        });
    }
    Ok(table.key_attno)
}
