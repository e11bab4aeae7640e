//! SELECTs over co-located distributed tables whose shard keys are all tied to one value: they
//! read a single shard group and run there as one statement.

use std::ffi::CStr;

use pgrx::pg_sys;

use crate::catalog::DistTable;
use crate::error::RemusError;
use crate::pg::list::{is_tag, list_ptrs, strip_relabel};
use crate::router::key::{key_attno, key_equality_value};
use crate::router::placement::dist_table;

/// Collects the conjuncts of a query's WHERE and of its inner joins' ON clauses; `None` when
/// the FROM clause holds anything but plain relations and inner joins.
unsafe fn inner_conjuncts(node: *mut pg_sys::Node, out: &mut Vec<*mut pg_sys::Node>) -> bool {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        if node.is_null() {
            return true;
        }
        match (*node).type_ {
            pg_sys::NodeTag::T_RangeTblRef => true,
            pg_sys::NodeTag::T_FromExpr => {
                let f = node as *mut pg_sys::FromExpr;
                for item in list_ptrs::<pg_sys::Node>((*f).fromlist) {
                    if !inner_conjuncts(item, out) {
                        return false;
                    }
                }
                flatten_and((*f).quals, out);
                true
            }
            pg_sys::NodeTag::T_JoinExpr => {
                let j = node as *mut pg_sys::JoinExpr;
                if (*j).jointype != pg_sys::JoinType::JOIN_INNER {
                    return false;
                }
                if !inner_conjuncts((*j).larg, out) || !inner_conjuncts((*j).rarg, out) {
                    return false;
                }
                flatten_and((*j).quals, out);
                true
            }
            _ => false,
        }
    }
}

unsafe fn flatten_and(node: *mut pg_sys::Node, out: &mut Vec<*mut pg_sys::Node>) {
    // SAFETY: the pointers this private function takes come from its callers in this module,
    // which pass what PostgreSQL handed them for the current call; they are live throughout.
    unsafe {
        if node.is_null() {
            return;
        }
        if is_tag(node, pg_sys::NodeTag::T_BoolExpr)
            && (*(node as *mut pg_sys::BoolExpr)).boolop == pg_sys::BoolExprType::AND_EXPR
        {
            for a in list_ptrs::<pg_sys::Node>((*(node as *mut pg_sys::BoolExpr)).args) {
                flatten_and(a, out);
            }
        } else if !is_tag(node, pg_sys::NodeTag::T_List) {
            out.push(node);
        } else {
            for a in list_ptrs::<pg_sys::Node>(node as *mut pg_sys::List) {
                flatten_and(a, out);
            }
        }
    }
}

/// A SELECT over one or more co-located distributed tables whose shard keys are all tied
/// together by equalities and to one routable value: it reads a single shard group, so it can
/// run there as one statement. Returns the table and value that pick the group.
///
/// # Safety
/// `parse` must be a valid rewritten Query.
pub(crate) unsafe fn colocated_anchor(
    parse: *mut pg_sys::Query,
) -> Result<Option<(DistTable, *mut pg_sys::Expr)>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let q = &*parse;
        if !q.cteList.is_null() || q.hasSubLinks || !q.setOperations.is_null() || q.hasTargetSRFs {
            return Ok(None);
        }
        let mut rels = Vec::new();
        for (i, rte) in list_ptrs::<pg_sys::RangeTblEntry>(q.rtable)
            .into_iter()
            .enumerate()
        {
            match (*rte).rtekind {
                pg_sys::RTEKind::RTE_JOIN => {}
                pg_sys::RTEKind::RTE_RELATION => match dist_table((*rte).relid)? {
                    Some(t) if t.kind == 'h' => rels.push((i + 1, t)),
                    _ => return Ok(None),
                },
                _ => return Ok(None),
            }
        }
        if rels.is_empty()
            || rels
                .iter()
                .any(|(_, t)| t.colocation_id != rels[0].1.colocation_id)
        {
            return Ok(None);
        }
        let mut quals = Vec::new();
        if !inner_conjuncts(q.jointree as *mut pg_sys::Node, &mut quals) {
            return Ok(None);
        }
        let keys: Vec<(usize, i16)> = rels
            .iter()
            .map(|(rti, t)| Ok((*rti, key_attno(t)?)))
            .collect::<Result<_, RemusError>>()?;
        // Union-find over the tables' shard keys.
        let mut parent: Vec<usize> = (0..rels.len()).collect();
        fn find(p: &mut [usize], i: usize) -> usize {
            if p[i] == i {
                i
            } else {
                let r = find(p, p[i]);
                p[i] = r;
                r
            }
        }
        let key_of = |var: *mut pg_sys::Var| -> Option<usize> {
            keys.iter().position(|(rti, attno)| {
                (*var).varno as usize == *rti
                    && (*var).varattno == *attno
                    && (*var).varlevelsup == 0
            })
        };
        let mut anchor = None;
        // Tables whose keys equal the same value (`a.k = $1 AND b.k = $1`, TPC-C's stock
        // level) are tied together as if joined on their keys.
        let mut valued: Vec<(usize, *mut pg_sys::Expr)> = Vec::new();
        for c in quals {
            for (i, (rti, attno)) in keys.iter().enumerate() {
                if let Some(v) = key_equality_value(c, *rti as i32, *attno) {
                    if anchor.is_none() {
                        anchor = Some((i, v));
                    }
                    if let Some((j, _)) = valued.iter().find(|(_, w)| {
                        pg_sys::equal(*w as *const std::ffi::c_void, v as *const std::ffi::c_void)
                    }) {
                        let (ri, rj) = (find(&mut parent, i), find(&mut parent, *j));
                        parent[ri] = rj;
                    }
                    valued.push((i, v));
                }
            }
            if !is_tag(c, pg_sys::NodeTag::T_OpExpr) {
                continue;
            }
            let op = c as *mut pg_sys::OpExpr;
            let args = list_ptrs::<pg_sys::Node>((*op).args);
            if args.len() != 2 || (*op).opno.to_u32() >= pg_sys::FirstNormalObjectId {
                continue;
            }
            let name = pg_sys::get_opname((*op).opno);
            if name.is_null() || CStr::from_ptr(name).to_bytes() != b"=" {
                continue;
            }
            let (a, b) = (strip_relabel(args[0]), strip_relabel(args[1]));
            if is_tag(a, pg_sys::NodeTag::T_Var) && is_tag(b, pg_sys::NodeTag::T_Var) {
                if let (Some(x), Some(y)) = (key_of(a as *mut _), key_of(b as *mut _)) {
                    let (rx, ry) = (find(&mut parent, x), find(&mut parent, y));
                    parent[rx] = ry;
                }
            }
        }
        let Some((i, value)) = anchor else {
            return Ok(None);
        };
        let root = find(&mut parent, 0);
        if (0..rels.len()).any(|k| find(&mut parent, k) != root) {
            return Ok(None);
        }
        Ok(Some((rels[i].1.clone(), value)))
    }
}
