//! Statements that touch a single shard group: every distributed table they name, at any depth
//! (joins, FROM subqueries, WITH queries, sublinks, the target of an UPDATE … FROM, DELETE …
//! USING or INSERT … SELECT), is co-located with the others and tied to one shard-key value.
//! Such a statement reads and writes only that group, so it runs there whole, as one statement;
//! reference tables in it read the owner's copy.
//!
//! A table is tied to the value when its key is equal to it, or to the key of a table already
//! tied, in a conjunct every row of it that can reach the result satisfies: the WHERE of its own
//! query level and the ON clauses of inner joins (the ON clause of an outer join does not filter
//! its preserved side, so it ties nothing). A correlated sublink's `inner.k = outer.k` ties the
//! inner table to the outer one. An INSERT's target is tied by the value, or the column of its
//! SELECT, that fills its key.

use std::ffi::CStr;

use pgrx::pg_sys;

use crate::catalog::DistTable;
use crate::error::RemusError;
use crate::pg::list::{is_tag, list_ptrs, strip_relabel};
use crate::pg::query_tree::{ancestor, levels, Level};
use crate::router::key::{is_routable_value, key_attno};
use crate::router::placement::dist_table;

/// A distributed table's appearance in the statement.
struct Appearance {
    level: usize,
    rti: usize,
    key: i16,
    table: DistTable,
}

/// The table and value that pick the one shard group a statement touches, if it touches one
/// (module doc). The table is the statement's target when it writes.
///
/// # Safety
/// `parse` must be a valid rewritten Query, not yet planned.
pub(crate) unsafe fn colocated_anchor(
    parse: *mut pg_sys::Query,
) -> Result<Option<(DistTable, *mut pg_sys::Expr)>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        if let Some(found) = one_table_anchor(parse)? {
            return Ok(found);
        }
        let levels = levels(parse);
        let Some(tables) = appearances(&levels)? else {
            return Ok(None);
        };
        if tables.is_empty()
            || tables
                .iter()
                .any(|t| t.table.colocation_id != tables[0].table.colocation_id)
        {
            return Ok(None);
        }
        let mut ties = Ties::new(tables.len());
        for (l, level) in levels.iter().enumerate() {
            let q = &*level.query;
            let mut quals = Vec::new();
            if !q.jointree.is_null() {
                filtering_conjuncts(q.jointree as *mut pg_sys::Node, &mut quals);
            }
            for c in quals {
                tie_conjunct(c, l, &levels, &tables, &mut ties);
            }
            if q.commandType == pg_sys::CmdType::CMD_INSERT {
                tie_insert_key(level, l, &levels, &tables, &mut ties);
            }
        }
        let Some((anchor, value)) = ties.tied_to_first_value() else {
            return Ok(None);
        };
        if !ties.all_tied() {
            return Ok(None);
        }
        // A write runs where its target's shard is: that table is the anchor.
        let top = &*parse;
        let picked = if top.commandType == pg_sys::CmdType::CMD_SELECT {
            anchor
        } else {
            match tables
                .iter()
                .position(|t| t.level == 0 && t.rti == top.resultRelation as usize)
            {
                Some(i) => i,
                None => return Ok(None),
            }
        };
        Ok(Some((tables[picked].table.clone(), value)))
    }
}

/// [`colocated_anchor`] of the commonest statement, a SELECT of one table with no subquery,
/// WITH or set operation (a point query), without walking levels or tying tables: its table,
/// if distributed, and the value its key equals in a conjunct of the WHERE. None: not that
/// shape (or its table's key is gone), ask the general walk.
///
/// # Safety
/// `parse` must be a valid rewritten Query, not yet planned.
unsafe fn one_table_anchor(
    parse: *mut pg_sys::Query,
) -> Result<Option<Option<(DistTable, *mut pg_sys::Expr)>>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let q = &*parse;
        if q.commandType != pg_sys::CmdType::CMD_SELECT
            || pg_sys::list_length(q.rtable) != 1
            || q.hasSubLinks
            || !q.cteList.is_null()
            || !q.setOperations.is_null()
            || q.jointree.is_null()
        {
            return Ok(None);
        }
        let rte = list_ptrs::<pg_sys::RangeTblEntry>(q.rtable)[0];
        if (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION {
            return Ok(None);
        }
        let table = match dist_table((*rte).relid)? {
            Some(t) if t.kind == 'h' => t,
            // A local table, or a reference table alone: no shard group.
            _ => return Ok(Some(None)),
        };
        if table.key_attno <= 0 {
            return Ok(None);
        }
        let mut quals = Vec::new();
        filtering_conjuncts(q.jointree as *mut pg_sys::Node, &mut quals);
        let value = quals
            .into_iter()
            .find_map(|c| crate::router::key::key_equality_value(c, 1, table.key_attno));
        Ok(Some(value.map(|v| (table, v))))
    }
}

/// The distributed tables of every level; None when the statement names anything that cannot
/// run on a shard group's owner (a local table, a trigger's transition table) or a shard group
/// is not what it reads (a reference-table target).
unsafe fn appearances(levels: &[Level]) -> Result<Option<Vec<Appearance>>, RemusError> {
    // SAFETY: the levels are valid Queries of the caller's statement.
    unsafe {
        let mut out = Vec::new();
        for (l, level) in levels.iter().enumerate() {
            let q = &*level.query;
            let excluded = if q.onConflict.is_null() {
                0
            } else {
                (*q.onConflict).exclRelIndex as usize
            };
            for (i, rte) in list_ptrs::<pg_sys::RangeTblEntry>(q.rtable)
                .into_iter()
                .enumerate()
            {
                use pg_sys::RTEKind::*;
                match (*rte).rtekind {
                    RTE_JOIN | RTE_SUBQUERY | RTE_CTE | RTE_VALUES | RTE_RESULT | RTE_FUNCTION
                    | RTE_TABLEFUNC => {}
                    // ON CONFLICT's `excluded` is the inserted row, not a table read.
                    RTE_RELATION if i + 1 == excluded => {}
                    RTE_RELATION => match dist_table((*rte).relid)? {
                        Some(t) if t.kind == 'h' => out.push(Appearance {
                            level: l,
                            rti: i + 1,
                            key: key_attno(&t)?,
                            table: t,
                        }),
                        // Every node has the whole table; but a write to one goes to all.
                        Some(_) if !(l == 0 && i + 1 == q.resultRelation as usize) => {}
                        _ => return Ok(None),
                    },
                    _ => return Ok(None),
                }
            }
        }
        Ok(Some(out))
    }
}

/// What ties the appearances together: equal keys within one level (symmetric: a union-find),
/// an inner level's key equal to an outer one's (directed: a correlated sublink is filtered by
/// its outer row, never the reverse), and keys equal to values.
struct Ties {
    parent: Vec<usize>,
    /// (outer, inner): the inner appearance is tied if the outer one is.
    directed: Vec<(usize, usize)>,
    values: Vec<(usize, *mut pg_sys::Expr)>,
    tied: Vec<bool>,
}

impl Ties {
    fn new(n: usize) -> Self {
        Ties {
            parent: (0..n).collect(),
            directed: Vec::new(),
            values: Vec::new(),
            tied: vec![false; n],
        }
    }

    fn find(&mut self, i: usize) -> usize {
        let p = self.parent[i];
        if p == i {
            return i;
        }
        let r = self.find(p);
        self.parent[i] = r;
        r
    }

    fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.find(a), self.find(b));
        self.parent[ra] = rb;
    }

    /// Marks tied every appearance whose key equals the first value seen (the statement's own
    /// level comes first), or, through the ties, one that does; returns that appearance and
    /// value. A different value ties nothing (unless a key equality ties its table anyway: then
    /// that conjunct selects nothing in the group, as it selects nothing anywhere).
    unsafe fn tied_to_first_value(&mut self) -> Option<(usize, *mut pg_sys::Expr)> {
        let (first, value) = *self.values.first()?;
        for k in 0..self.values.len() {
            let (i, v) = self.values[k];
            // SAFETY: both are valid expression trees of the statement.
            if unsafe { pg_sys::equal(v as *const _, value as *const _) } {
                let r = self.find(i);
                self.tied[r] = true;
            }
        }
        loop {
            let mut more = false;
            for k in 0..self.directed.len() {
                let (outer, inner) = self.directed[k];
                let (ro, ri) = (self.find(outer), self.find(inner));
                if self.tied[ro] && !self.tied[ri] {
                    self.tied[ri] = true;
                    more = true;
                }
            }
            if !more {
                return Some((first, value));
            }
        }
    }

    fn all_tied(&mut self) -> bool {
        (0..self.parent.len()).all(|i| {
            let r = self.find(i);
            self.tied[r]
        })
    }
}

/// The appearance of range-table entry `rti` of level `level` whose key column is `attno`.
fn appearance_at(tables: &[Appearance], level: usize, rti: usize, attno: i16) -> Option<usize> {
    tables
        .iter()
        .position(|t| t.level == level && t.rti == rti && t.key == attno)
}

/// The appearance whose key `node` (a Var, relabels stripped) is, seen from level `level`, and
/// how many levels up it is.
unsafe fn key_var(
    node: *mut pg_sys::Node,
    level: usize,
    levels: &[Level],
    tables: &[Appearance],
) -> Option<(usize, u32)> {
    // SAFETY: `node` is a valid expression of level `level`.
    unsafe {
        let v = strip_relabel(node);
        if !is_tag(v, pg_sys::NodeTag::T_Var) {
            return None;
        }
        let var = v as *mut pg_sys::Var;
        let at = ancestor(levels, level, (*var).varlevelsup)?;
        appearance_at(tables, at, (*var).varno as usize, (*var).varattno)
            .map(|i| (i, (*var).varlevelsup))
    }
}

/// Ties what one conjunct of level `level` ties: `key = value` or `key = key`.
unsafe fn tie_conjunct(
    c: *mut pg_sys::Node,
    level: usize,
    levels: &[Level],
    tables: &[Appearance],
    ties: &mut Ties,
) {
    // SAFETY: `c` is a valid expression of level `level`.
    unsafe {
        if !is_tag(c, pg_sys::NodeTag::T_OpExpr) {
            return;
        }
        let op = c as *mut pg_sys::OpExpr;
        let args = list_ptrs::<pg_sys::Node>((*op).args);
        if args.len() != 2 || (*op).opno.to_u32() >= pg_sys::FirstNormalObjectId {
            return;
        }
        let name = pg_sys::get_opname((*op).opno);
        if name.is_null() || CStr::from_ptr(name).to_bytes() != b"=" {
            return;
        }
        let (a, b) = (
            key_var(args[0], level, levels, tables),
            key_var(args[1], level, levels, tables),
        );
        // Only this level's own tables are filtered by its conjuncts; an outer table's key in
        // them ties this level's table to it, not the reverse.
        match (a, b) {
            (Some((x, 0)), Some((y, 0))) => ties.union(x, y),
            (Some((outer, u)), Some((inner, 0))) | (Some((inner, 0)), Some((outer, u)))
                if u > 0 =>
            {
                ties.directed.push((outer, inner))
            }
            (Some((x, 0)), None) if is_routable_value(args[1]) => {
                ties.values.push((x, args[1] as *mut pg_sys::Expr))
            }
            (None, Some((y, 0))) if is_routable_value(args[0]) => {
                ties.values.push((y, args[0] as *mut pg_sys::Expr))
            }
            _ => {}
        }
    }
}

/// An INSERT's target is tied by what fills its key: a value, or a column of its SELECT that
/// is a key (followed into the SELECT).
unsafe fn tie_insert_key(
    level: &Level,
    l: usize,
    levels: &[Level],
    tables: &[Appearance],
    ties: &mut Ties,
) {
    // SAFETY: `level.query` is a valid INSERT of the statement.
    unsafe {
        let q = &*level.query;
        let Some(target) = tables
            .iter()
            .position(|t| t.level == l && t.rti == q.resultRelation as usize)
        else {
            return;
        };
        let Some(te) = list_ptrs::<pg_sys::TargetEntry>(q.targetList)
            .into_iter()
            .find(|te| (**te).resno == tables[target].key)
        else {
            return;
        };
        let (mut expr, mut at) = ((*te).expr as *mut pg_sys::Node, l);
        // Through the SELECT (and any subquery it reads the key from) to where the key comes.
        loop {
            if is_routable_value(expr) {
                ties.values.push((target, expr as *mut pg_sys::Expr));
                return;
            }
            if let Some((source, 0)) = key_var(expr, at, levels, tables) {
                // The target holds only rows its SELECT produced.
                ties.directed.push((source, target));
                return;
            }
            let v = strip_relabel(expr);
            if !is_tag(v, pg_sys::NodeTag::T_Var) || (*(v as *mut pg_sys::Var)).varlevelsup != 0 {
                return;
            }
            let var = v as *mut pg_sys::Var;
            let rtes = list_ptrs::<pg_sys::RangeTblEntry>((*levels[at].query).rtable);
            let Some(rte) = rtes.get((*var).varno as usize - 1) else {
                return;
            };
            if (**rte).rtekind != pg_sys::RTEKind::RTE_SUBQUERY {
                return;
            }
            let sub = (**rte).subquery;
            let Some(sub_level) = levels.iter().position(|x| x.query == sub) else {
                return;
            };
            let Some(inner) = list_ptrs::<pg_sys::TargetEntry>((*sub).targetList)
                .into_iter()
                .find(|te| (**te).resno == (*var).varattno)
            else {
                return;
            };
            expr = (*inner).expr as *mut pg_sys::Node;
            at = sub_level;
        }
    }
}

/// The conjuncts of a FROM tree that filter every row of the tables under them: its WHERE and
/// its inner joins' ON clauses, at any depth (an outer join's own ON clause is left out).
unsafe fn filtering_conjuncts(node: *mut pg_sys::Node, out: &mut Vec<*mut pg_sys::Node>) {
    // SAFETY: `node` is a valid jointree node of the statement.
    unsafe {
        if node.is_null() {
            return;
        }
        match (*node).type_ {
            pg_sys::NodeTag::T_FromExpr => {
                let f = node as *mut pg_sys::FromExpr;
                for item in list_ptrs::<pg_sys::Node>((*f).fromlist) {
                    filtering_conjuncts(item, out);
                }
                flatten_and((*f).quals, out);
            }
            pg_sys::NodeTag::T_JoinExpr => {
                let j = node as *mut pg_sys::JoinExpr;
                filtering_conjuncts((*j).larg, out);
                filtering_conjuncts((*j).rarg, out);
                if (*j).jointype == pg_sys::JoinType::JOIN_INNER {
                    flatten_and((*j).quals, out);
                }
            }
            _ => {}
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
