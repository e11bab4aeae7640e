//! The one key a statement reads or writes in a shard table, found in its plan, so that a
//! statement on a shard still being pulled waits for the chunk that holds its key rather than
//! for the whole shard (Squall's reactive pull, issue 19 item 1).
//!
//! The plan, not the router, is where the key is taken from: every statement that reaches a
//! shard table on this node (the router's spliced or nested local plan, a marked statement
//! another node sent, a prepared statement's generic plan) has one, with its parameters bound
//! at `ExecutorStart`. A shard table is narrowed to a key when each place the plan touches it is
//! restricted to one value of the shard key:
//! - a scan (sequential, index, index-only, bitmap, TID) with a `key = constant or parameter`
//!   clause among its quals or index quals (the quals of one scan are ANDed);
//! - an INSERT of one row (`VALUES` of one row: a `Result` without input) with a constant or
//!   parameter as the key.
//!
//! Anything else leaves the table un-narrowed, and the statement waits for the whole shard (as
//! before this narrowing): an UPDATE or an `ON CONFLICT DO UPDATE` that sets the key (the new row
//! could land in another chunk), MERGE, a multi-row or `INSERT … SELECT`, a scan without a key
//! clause, a node this walk does not know. Narrowing to a chunk is safe because a statement
//! whose every access to the table is restricted to one key value only reads or writes rows of
//! that key, all in one chunk.

use std::collections::HashMap;

use pgrx::pg_sys;

use crate::pg::list::{is_tag, list_ints, list_ptrs, strip_relabel};

/// What the walk found for one shard table of the statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// Every access seen is restricted to the key with this hash.
    Key(i32),
    /// Some access is not restricted to one key.
    Any,
}

impl Access {
    fn and(self, other: Access) -> Access {
        match (self, other) {
            (Access::Key(a), Access::Key(b)) if a == b => Access::Key(a),
            _ => Access::Any,
        }
    }
}

/// A shard table of the statement: its range-table index and the shard key's attribute number
/// and type in that table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ShardRel {
    pub rti: i32,
    pub key_attno: i16,
    pub key_type: pg_sys::Oid,
}

/// The key hash each of `rels` is restricted to in `stmt` (`None`: not narrowed), by range-table
/// index.
///
/// # Safety
/// `stmt` must be a valid PlannedStmt; `params` NULL or its live parameter list.
pub(crate) unsafe fn key_hashes(
    stmt: *mut pg_sys::PlannedStmt,
    params: pg_sys::ParamListInfo,
    rels: &[ShardRel],
) -> HashMap<i32, Option<i32>> {
    let mut walk = Walk {
        params,
        rels,
        seen: HashMap::new(),
    };
    // SAFETY: the caller upholds this function's `# Safety` contract; the walk only reads the
    // plan's nodes.
    unsafe {
        walk.plan((*stmt).planTree);
        for sub in list_ptrs::<pg_sys::Plan>((*stmt).subplans) {
            walk.plan(sub);
        }
    }
    rels.iter()
        .map(|r| {
            let hash = match walk.seen.get(&r.rti) {
                Some(Access::Key(h)) => Some(*h),
                _ => None,
            };
            (r.rti, hash)
        })
        .collect()
}

struct Walk<'a> {
    params: pg_sys::ParamListInfo,
    rels: &'a [ShardRel],
    seen: HashMap<i32, Access>,
}

impl Walk<'_> {
    fn rel(&self, rti: u32) -> Option<ShardRel> {
        self.rels.iter().copied().find(|r| r.rti as u32 == rti)
    }

    fn note(&mut self, rti: i32, access: Access) {
        let a = match self.seen.get(&rti) {
            Some(prev) => prev.and(access),
            None => access,
        };
        self.seen.insert(rti, a);
    }

    /// # Safety
    /// `plan` must be NULL or a valid plan node.
    unsafe fn plan(&mut self, plan: *mut pg_sys::Plan) {
        use pg_sys::NodeTag::*;
        if plan.is_null() {
            return;
        }
        // SAFETY: each node is read as the type its tag names.
        unsafe {
            let node = plan as *mut pg_sys::Node;
            match (*node).type_ {
                T_SeqScan | T_TidScan | T_TidRangeScan => {
                    let scan = plan as *mut pg_sys::Scan;
                    self.scan(scan, &[(*plan).qual]);
                }
                T_IndexScan => {
                    let s = plan as *mut pg_sys::IndexScan;
                    self.scan(s as *mut pg_sys::Scan, &[(*s).indexqualorig, (*plan).qual]);
                }
                T_BitmapHeapScan => {
                    let s = plan as *mut pg_sys::BitmapHeapScan;
                    self.scan(s as *mut pg_sys::Scan, &[(*s).bitmapqualorig, (*plan).qual]);
                }
                T_IndexOnlyScan => self.index_only_scan(plan as *mut pg_sys::IndexOnlyScan),
                T_ModifyTable => self.modify_table(plan as *mut pg_sys::ModifyTable),
                T_SampleScan | T_FunctionScan | T_ForeignScan => {
                    let rti = (*(plan as *mut pg_sys::Scan)).scanrelid;
                    if let Some(r) = self.rel(rti) {
                        self.note(r.rti, Access::Any);
                    }
                }
                T_Append => {
                    for p in list_ptrs((*(plan as *mut pg_sys::Append)).appendplans) {
                        self.plan(p);
                    }
                }
                T_MergeAppend => {
                    for p in list_ptrs((*(plan as *mut pg_sys::MergeAppend)).mergeplans) {
                        self.plan(p);
                    }
                }
                T_BitmapAnd => {
                    for p in list_ptrs((*(plan as *mut pg_sys::BitmapAnd)).bitmapplans) {
                        self.plan(p);
                    }
                }
                T_BitmapOr => {
                    for p in list_ptrs((*(plan as *mut pg_sys::BitmapOr)).bitmapplans) {
                        self.plan(p);
                    }
                }
                T_SubqueryScan => self.plan((*(plan as *mut pg_sys::SubqueryScan)).subplan),
                T_CustomScan => {
                    let c = plan as *mut pg_sys::CustomScan;
                    if let Some(r) = self.rel((*c).scan.scanrelid) {
                        self.note(r.rti, Access::Any);
                    }
                    for p in list_ptrs((*c).custom_plans) {
                        self.plan(p);
                    }
                }
                _ => {}
            }
            self.plan((*plan).lefttree);
            self.plan((*plan).righttree);
        }
    }

    /// A scan of range-table entry `scan.scanrelid` with the ANDed clause lists `quals`.
    ///
    /// # Safety
    /// `scan` must be a valid scan node whose quals name its relation by `scanrelid`.
    unsafe fn scan(&mut self, scan: *mut pg_sys::Scan, quals: &[*mut pg_sys::List]) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let Some(r) = self.rel((*scan).scanrelid) else {
                return;
            };
            let hash = quals
                .iter()
                .flat_map(|q| list_ptrs::<pg_sys::Node>(*q))
                .find_map(|clause| {
                    crate::router::key::key_equality_value(clause, r.rti, r.key_attno)
                        .and_then(|v| self.hash_of(v as *mut pg_sys::Node, r.key_type))
                });
            self.note(r.rti, hash.map_or(Access::Any, Access::Key));
        }
    }

    /// An index-only scan: its index quals name index columns (`INDEX_VAR`), which its index
    /// target list maps to the table's columns.
    ///
    /// # Safety
    /// `s` must be a valid IndexOnlyScan.
    unsafe fn index_only_scan(&mut self, s: *mut pg_sys::IndexOnlyScan) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let Some(r) = self.rel((*s).scan.scanrelid) else {
                return;
            };
            // The index column that is the key, as a Var of the index.
            let key_column = list_ptrs::<pg_sys::TargetEntry>((*s).indextlist)
                .iter()
                .position(|te| {
                    let v = strip_relabel((**te).expr as *mut pg_sys::Node);
                    is_tag(v, pg_sys::NodeTag::T_Var)
                        && (*(v as *mut pg_sys::Var)).varattno == r.key_attno
                });
            let hash = key_column.and_then(|i| {
                list_ptrs::<pg_sys::Node>((*s).indexqual)
                    .into_iter()
                    .find_map(|clause| {
                        crate::router::key::key_equality_value(
                            clause,
                            pg_sys::INDEX_VAR,
                            (i + 1) as i16,
                        )
                        .and_then(|v| self.hash_of(v as *mut pg_sys::Node, r.key_type))
                    })
            });
            self.note(r.rti, hash.map_or(Access::Any, Access::Key));
        }
    }

    /// A write: INSERT of one row with the key given; UPDATE / DELETE through their scan
    /// (below), unless the UPDATE or the ON CONFLICT action sets the key.
    ///
    /// # Safety
    /// `m` must be a valid ModifyTable.
    unsafe fn modify_table(&mut self, m: *mut pg_sys::ModifyTable) {
        use pg_sys::CmdType::*;
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let results = list_ints((*m).resultRelations);
            for (i, &rti) in results.iter().enumerate() {
                let Some(r) = self.rel(rti as u32) else {
                    continue;
                };
                match (*m).operation {
                    CMD_INSERT => {
                        let sets_key =
                            list_ints((*m).onConflictCols).contains(&(r.key_attno as i32));
                        let hash = if sets_key {
                            None
                        } else {
                            self.inserted_key((*m).plan.lefttree, r)
                        };
                        self.note(r.rti, hash.map_or(Access::Any, Access::Key));
                    }
                    CMD_UPDATE => {
                        let colnos = list_ptrs::<pg_sys::List>((*m).updateColnosLists);
                        let sets_key = colnos
                            .get(i)
                            .is_none_or(|l| list_ints(*l).contains(&(r.key_attno as i32)));
                        if sets_key {
                            self.note(r.rti, Access::Any);
                        }
                    }
                    CMD_DELETE => {}
                    _ => self.note(r.rti, Access::Any),
                }
            }
        }
    }

    /// The key hash of the one row an INSERT's input produces: a `Result` without input whose
    /// target list gives the key (by attribute number) a constant or parameter.
    ///
    /// # Safety
    /// `input` must be NULL or a valid plan node.
    unsafe fn inserted_key(&self, input: *mut pg_sys::Plan, r: ShardRel) -> Option<i32> {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            if !is_tag(input as *mut pg_sys::Node, pg_sys::NodeTag::T_Result)
                || !(*input).lefttree.is_null()
            {
                return None;
            }
            let te = list_ptrs::<pg_sys::TargetEntry>((*input).targetlist)
                .into_iter()
                .find(|te| (**te).resno == r.key_attno && !(**te).resjunk)?;
            self.hash_of((*te).expr as *mut pg_sys::Node, r.key_type)
        }
    }

    /// The key hash of a routable value (a constant, a bound parameter, casts of those), as the
    /// router computes it; `None` when the value is not known here or is NULL.
    ///
    /// # Safety
    /// `value` must be a valid expression node.
    unsafe fn hash_of(&self, value: *mut pg_sys::Node, key_type: pg_sys::Oid) -> Option<i32> {
        // SAFETY: the caller upholds this function's `# Safety` contract; the datum is read as
        // the type its node names.
        unsafe {
            let node = strip_relabel(value);
            let (datum, isnull, ty) = if is_tag(node, pg_sys::NodeTag::T_Const) {
                let c = node as *mut pg_sys::Const;
                ((*c).constvalue, (*c).constisnull, (*c).consttype)
            } else if is_tag(node, pg_sys::NodeTag::T_Param) {
                let p = node as *mut pg_sys::Param;
                let prm = crate::router::execute::extern_param(self.params, p, false)?;
                (prm.value, prm.isnull, (*p).paramtype)
            } else {
                // Casts of a value: not evaluated here (the statement waits for the shard).
                return None;
            };
            // A value of another type is not converted here: a conversion the statement itself
            // never makes could fail (an int8 parameter out of an int4 key's range).
            if isnull || ty != key_type {
                return None;
            }
            crate::catalog::hashing::hash_datum(datum, key_type, pg_sys::InvalidOid).ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Access;

    #[test]
    fn one_key_everywhere_narrows_anything_else_does_not() {
        assert_eq!(Access::Key(7).and(Access::Key(7)), Access::Key(7));
        assert_eq!(Access::Key(7).and(Access::Key(8)), Access::Any);
        assert_eq!(Access::Key(7).and(Access::Any), Access::Any);
        assert_eq!(Access::Any.and(Access::Key(7)), Access::Any);
    }
}
