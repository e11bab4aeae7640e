//! The SQL text a statement is sent to its shard as.

use std::ffi::{c_void, CStr};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::pg::list::{is_tag, list_ptrs};
use crate::router::execute::Params;

/// Deparses a Query to SQL text that any node reads the same way: schema-qualified names and
/// locale-independent literals.
///
/// A copy is deparsed: `pg_get_querydef` takes the rewrite locks on what it is given
/// (`AcquireRewriteLocks`), which rebuilds a join's alias variables in the current memory
/// context. On a Query kept with a plan (a prepared statement's, a statement shape's) that left
/// a list freed with the first execution's memory, which the next execution walked.
///
/// # Safety
/// `query` must be a valid, rewritten Query.
pub unsafe fn deparse(query: *mut pg_sys::Query) -> String {
    // SAFETY: the caller upholds this function's `# Safety` contract; the copy lives in the
    // current memory context.
    portable(|| unsafe {
        let copy = pg_sys::copyObjectImpl(query as *const c_void) as *mut pg_sys::Query;
        pg_sys::pg_get_querydef(copy, false)
    })
}

/// Deparses `expr`, an expression over the columns of relation `relid` alone, as a shard of it
/// reads it (`SELECT … FROM <shell> WHERE <expr>`): unqualified column names, otherwise as
/// [`deparse`].
///
/// # Safety
/// `expr` must be a valid expression whose Vars are all of range-table entry 1 (or of the
/// relation's own entry: their varno is not printed when there is one relation).
pub unsafe fn deparse_filter(
    expr: *mut pg_sys::Node,
    relid: pg_sys::Oid,
    rel_name: &str,
) -> String {
    let name = std::ffi::CString::new(rel_name).unwrap_or_default();
    // SAFETY: the caller upholds this function's `# Safety` contract; a one-relation deparse
    // context for an existing relation.
    portable(|| unsafe {
        let cx = pg_sys::deparse_context_for(name.as_ptr(), relid);
        pg_sys::deparse_expression(expr, cx, false, false)
    })
}

/// Runs `f` (which returns palloc'd text) with the settings under which text reads the same on
/// every node.
fn portable(f: impl FnOnce() -> *mut std::ffi::c_char) -> String {
    crate::pg::datum::with_portable_settings(|| {
        let text = f();
        // SAFETY: `f` returns a NUL-terminated palloc'd string.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    })
}

/// The text and parameters `query` goes to `placement`'s node with when its constants are
/// lifted ([`lift_constants`]): only a statement that goes to another node and has no
/// parameters of its own (`params`), with `remus.enable_constant_lifting` on. None: send it as
/// it is.
///
/// # Safety
/// As [`lift_constants`]; `params` are the executing statement's.
pub unsafe fn lifted_for(
    placement: &crate::catalog::ShardPlacement,
    query: *mut pg_sys::Query,
    params: &Params,
) -> Option<(String, Params)> {
    if !params.values.is_empty()
        || !crate::guc::LIFT_CONSTANTS.get()
        || crate::guc::is_this_node(&placement.node_name)
    {
        return None;
    }
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let (copy, lifted) = lift_constants(query)?;
        Some((deparse(copy), lifted))
    }
}

/// A copy of `query` whose constants in the positions below are `$1…$n` parameters, with their
/// values; None when it has none. Sent that way, a statement with constants (a simple-protocol
/// client's) has the same text at every execution, so its owner prepares it once per session
/// and then only binds and executes it, as for a client's own prepared statement, instead of
/// parsing, analysing and planning it every time (design note 0002).
///
/// Only constants whose parameter the owner resolves exactly as the constant are lifted:
/// - a direct argument of an operator (`k = 42`, `v + 1`, `name LIKE 'a%'`) anywhere in WHERE
///   and JOIN … ON (not inside a sublink, which stays as it is);
/// - a SET value of an UPDATE, a value of a one-row INSERT;
/// - a LIMIT / OFFSET count;
///
/// and only of the built-in types of [`liftable`], with no type modifier, their default
/// collation, not NULL. The analysed constant already has the type the operator or column
/// wanted, and the parameter is declared with that type, so the owner picks the same operator.
/// Everything else (target lists of SELECT, GROUP BY / ORDER BY, VALUES lists, ON CONFLICT,
/// RETURNING, function arguments printed in SQL syntax such as EXTRACT's field) keeps its
/// literal.
///
/// # Safety
/// `query` must be a valid, rewritten Query with no parameters of its own; the copy lives in
/// the current memory context, and so do the values (they point into it).
pub unsafe fn lift_constants(query: *mut pg_sys::Query) -> Option<(*mut pg_sys::Query, Params)> {
    // SAFETY: the caller upholds this function's `# Safety` contract; every node reached is
    // one of the copy's, changed in place.
    unsafe {
        let copy = pg_sys::copyObjectImpl(query as *const c_void) as *mut pg_sys::Query;
        let mut params = Params::none();
        let cx = (&raw mut params).cast::<c_void>();
        lift_operator_arguments((*copy).jointree as *mut pg_sys::Node, cx);
        lift_written_values(copy, &mut params);
        if (*copy).limitOption == pg_sys::LimitOption::LIMIT_OPTION_COUNT {
            for count in [&raw mut (*copy).limitOffset, &raw mut (*copy).limitCount] {
                if let Some(p) = as_param(*count, &mut params) {
                    *count = p;
                }
            }
        }
        (!params.values.is_empty()).then_some((copy, params))
    }
}

/// Lifts the values an UPDATE or a one-row INSERT `q` writes: a target entry that is a constant,
/// or the operator arguments within one (`SET v = v + 1`). A multi-row INSERT's VALUES stay
/// literal; other statements are left as they are.
///
/// # Safety
/// `q` must be a valid Query the caller may change in place (a copy) with no parameters of its
/// own but those already in `params`.
pub(crate) unsafe fn lift_written_values(q: *mut pg_sys::Query, params: &mut Params) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if !matches!(
            (*q).commandType,
            pg_sys::CmdType::CMD_UPDATE | pg_sys::CmdType::CMD_INSERT
        ) || has_values_list(q)
        {
            return;
        }
        for te in list_ptrs::<pg_sys::TargetEntry>((*q).targetList) {
            if let Some(p) = as_param((*te).expr as *mut pg_sys::Node, params) {
                (*te).expr = p as *mut pg_sys::Expr;
            } else {
                let cx = (params as *mut Params).cast::<c_void>();
                lift_operator_arguments((*te).expr as *mut pg_sys::Node, cx);
            }
        }
    }
}

/// Does the statement read a VALUES list (a multi-row INSERT)? Its rows stay literal.
unsafe fn has_values_list(q: *mut pg_sys::Query) -> bool {
    // SAFETY: `q` is a valid Query.
    unsafe {
        list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable)
            .into_iter()
            .any(|r| (*r).rtekind == pg_sys::RTEKind::RTE_VALUES)
    }
}

/// Lifts the operator arguments of `node`'s expressions (see [`lift_constants`]); the
/// expression walker's callback.
#[pg_guard]
unsafe extern "C-unwind" fn lift_operator_arguments(
    node: *mut pg_sys::Node,
    cx: *mut c_void,
) -> bool {
    // SAFETY: PostgreSQL's expression walker calls this with the nodes of the copy
    // `lift_constants` made and the Params it passed as context; an argument's list cell is
    // replaced in place, in a List of that copy.
    unsafe {
        if node.is_null()
            || is_tag(node, pg_sys::NodeTag::T_Query)
            || is_tag(node, pg_sys::NodeTag::T_SubLink)
        {
            return false;
        }
        if is_tag(node, pg_sys::NodeTag::T_OpExpr) {
            let args = (*(node as *mut pg_sys::OpExpr)).args;
            let params = &mut *(cx as *mut Params);
            for i in 0..pg_sys::list_length(args) as usize {
                let cell = (*args).elements.add(i);
                if let Some(p) = as_param((*cell).ptr_value as *mut pg_sys::Node, params) {
                    (*cell).ptr_value = p as *mut c_void;
                }
            }
        }
        pg_sys::expression_tree_walker(node, Some(lift_operator_arguments), cx)
    }
}

/// `node` as the next parameter of `params` when it is a constant that can be lifted.
///
/// # Safety
/// `node` must be NULL or a valid node.
pub(crate) unsafe fn as_param(
    node: *mut pg_sys::Node,
    params: &mut Params,
) -> Option<*mut pg_sys::Node> {
    // SAFETY: `node` is NULL or a valid node of the copy.
    unsafe {
        if !is_tag(node, pg_sys::NodeTag::T_Const) {
            return None;
        }
        let c = node as *mut pg_sys::Const;
        if !liftable(&*c) {
            return None;
        }
        params.types.push((*c).consttype);
        params.values.push((*c).constvalue);
        params.nulls.push(false);
        let mut p = PgBox::<pg_sys::Param>::alloc_node(pg_sys::NodeTag::T_Param);
        p.paramkind = pg_sys::ParamKind::PARAM_EXTERN;
        p.paramid = params.values.len() as i32;
        p.paramtype = (*c).consttype;
        p.paramtypmod = -1;
        p.paramcollid = (*c).constcollid;
        p.location = -1;
        Some(p.into_pg() as *mut pg_sys::Node)
    }
}

/// A constant whose `$n`, declared with its type, any node reads as the same value of the same
/// type: not NULL, no type modifier, the type's own collation, and a built-in type whose text
/// form [`Params::as_text`] writes portably.
fn liftable(c: &pg_sys::Const) -> bool {
    let collation = match c.consttype {
        pg_sys::TEXTOID | pg_sys::VARCHAROID => pg_sys::DEFAULT_COLLATION_OID,
        pg_sys::INT2OID
        | pg_sys::INT4OID
        | pg_sys::INT8OID
        | pg_sys::NUMERICOID
        | pg_sys::FLOAT4OID
        | pg_sys::FLOAT8OID
        | pg_sys::BOOLOID
        | pg_sys::DATEOID
        | pg_sys::TIMESTAMPOID
        | pg_sys::TIMESTAMPTZOID
        | pg_sys::UUIDOID => pg_sys::InvalidOid,
        _ => return false,
    };
    !c.constisnull && c.consttypmod == -1 && c.constcollid == collation
}
