//! Aggregates over every shard, computed per shard and combined (issue 16, item 6).
//!
//! A SELECT over one hash-distributed table whose output is `count`, `sum`, `min`, `max` and
//! `avg` of its rows, optionally per GROUP BY column, with ORDER BY and LIMIT on top, would
//! otherwise read every row of every shard into this node. Instead it is rewritten into two
//! statements:
//!
//! - the per-shard statement, `SELECT <groups>, <partial aggregates> FROM <table> WHERE … GROUP
//!   BY <groups>`, run on every shard where it lives (`remus.fanout`, inside the transaction,
//!   as any routed statement: shard marker, pinned owners);
//! - the combining statement, `SELECT <final aggregates> FROM remus.fanout(...) AS p(...) GROUP
//!   BY … ORDER BY … LIMIT …`, which PostgreSQL parses and plans in place of the original; its
//!   output columns have the original's names and types (count is the sum of the counts, avg
//!   the sum of sums over the sum of counts).
//!
//! Anything else (other aggregates, DISTINCT or FILTER in an aggregate, HAVING, expressions
//! around aggregates, joins, parameters) keeps the general path: every shard's rows read into a
//! `RemusShardScan` and PostgreSQL aggregating them here, slower but the same answer.

use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt::Write as _;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::catalog::DistTable;
use crate::error::RemusError;
use crate::pg::list::{is_tag, list_ptrs};
use crate::pg::sql::{quote_ident, quote_literal};
use crate::router::local::PlanContext;
use crate::router::placement::dist_table;

/// One output column of the original statement.
enum Output {
    /// The `i`-th GROUP BY column.
    Group(usize),
    /// An aggregate over the partial columns starting at `first`.
    Agg { kind: Agg, first: usize, ty: String },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Agg {
    Count,
    Sum,
    Min,
    Max,
    Avg,
}

/// If `parse` is an aggregate over one distributed table that can be computed per shard, its
/// plan: the combining statement over `remus.fanout`. None: plan it the general way.
///
/// # Safety
/// `parse` must be the planner's rewritten SELECT.
pub(crate) unsafe fn plan(
    parse: *mut pg_sys::Query,
    ctx: &PlanContext,
) -> Result<Option<*mut pg_sys::PlannedStmt>, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let Some((table, sql)) = combining_sql(parse)? else {
            return Ok(None);
        };
        let text = CString::new(sql).map_err(|_| RemusError::NulIn { what: "statement" })?;
        let raw = list_ptrs::<pg_sys::RawStmt>(pg_sys::pg_parse_query(text.as_ptr()));
        if raw.len() != 1 {
            return Ok(None);
        }
        // Analysed as the extension owner: the text is ours, and it names `remus.fanout`, in a
        // schema application roles have no USAGE on (they cannot call it themselves). What it
        // runs on the shards is checked as the calling role: the shell's entry kept below, and
        // each shard's statement (`router::privileges`).
        let queries = list_ptrs::<pg_sys::Query>(crate::pg::spi::as_extension_owner(|| {
            pg_sys::pg_analyze_and_rewrite_fixedparams(
                raw[0],
                text.as_ptr(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        }));
        let [q] = queries[..] else {
            return Ok(None);
        };
        (*q).canSetTag = (*parse).canSetTag;
        (*q).queryId = (*parse).queryId;
        let options = ctx.cursor_options & !(pg_sys::CURSOR_OPT_PARALLEL_OK as c_int);
        let stmt = (ctx.next)(q, text.as_ptr(), options, std::ptr::null_mut());
        // The original's range-table entry is kept for its permission check (the combining
        // statement does not name the table), and its relation for plan invalidation.
        let shell = pg_sys::copyObjectImpl(
            list_ptrs::<pg_sys::RangeTblEntry>((*parse).rtable)[0] as *const std::ffi::c_void,
        );
        (*stmt).rtable = pg_sys::lappend((*stmt).rtable, shell);
        (*stmt).relationOids = pg_sys::lappend_oid((*stmt).relationOids, table.relid);
        (*stmt).stmt_location = (*parse).stmt_location;
        (*stmt).stmt_len = (*parse).stmt_len;
        Ok(Some(stmt))
    }
}

/// The combining statement for `parse`, or None when it is not an aggregate this module handles.
unsafe fn combining_sql(
    parse: *mut pg_sys::Query,
) -> Result<Option<(DistTable, String)>, RemusError> {
    // SAFETY: `parse` is a valid Query (the caller's contract).
    unsafe {
        let q = &*parse;
        if q.commandType != pg_sys::CmdType::CMD_SELECT
            || !q.hasAggs
            || !q.cteList.is_null()
            || q.hasSubLinks
            || !q.setOperations.is_null()
            || q.hasTargetSRFs
            || q.hasWindowFuncs
            || !q.distinctClause.is_null()
            || !q.rowMarks.is_null()
            || !q.groupingSets.is_null()
            || !q.havingQual.is_null()
            || q.limitOption == pg_sys::LimitOption::LIMIT_OPTION_WITH_TIES
        {
            return Ok(None);
        }
        let rtes = list_ptrs::<pg_sys::RangeTblEntry>(q.rtable);
        if rtes.len() != 1 || (*rtes[0]).rtekind != pg_sys::RTEKind::RTE_RELATION {
            return Ok(None);
        }
        let Some(table) = dist_table((*rtes[0]).relid)? else {
            return Ok(None);
        };
        if table.kind != 'h' {
            return Ok(None);
        }
        let name =
            CString::new(&*table.rel_name).map_err(|_| RemusError::NulIn { what: "table name" })?;
        let dpcontext = pg_sys::deparse_context_for(name.as_ptr(), table.relid);
        let text_of = |node: *mut pg_sys::Node| -> String {
            let s = pg_sys::deparse_expression(node, dpcontext, false, false);
            CStr::from_ptr(s).to_string_lossy().into_owned()
        };

        // GROUP BY: plain columns only, by sort/group reference.
        let mut groups: Vec<(u32, String, String)> = Vec::new();
        for sgc in list_ptrs::<pg_sys::SortGroupClause>(q.groupClause) {
            let Some(te) = list_ptrs::<pg_sys::TargetEntry>(q.targetList)
                .into_iter()
                .find(|te| (**te).ressortgroupref == (*sgc).tleSortGroupRef)
            else {
                return Ok(None);
            };
            let e = (*te).expr as *mut pg_sys::Node;
            if !is_tag(e, pg_sys::NodeTag::T_Var) {
                return Ok(None);
            }
            let ty = type_name(e);
            groups.push(((*sgc).tleSortGroupRef, text_of(e), ty));
        }

        // Outputs: group columns and top-level aggregates, nothing else.
        let mut partials: Vec<(String, String)> = Vec::new();
        let mut outputs: Vec<(Output, String)> = Vec::new();
        for te in list_ptrs::<pg_sys::TargetEntry>(q.targetList) {
            if (*te).resjunk {
                return Ok(None);
            }
            let name = if (*te).resname.is_null() {
                "?column?".to_string()
            } else {
                CStr::from_ptr((*te).resname).to_string_lossy().into_owned()
            };
            let e = (*te).expr as *mut pg_sys::Node;
            // A GROUP BY column (an ORDER BY reference alone does not make one).
            if let Some(i) = groups
                .iter()
                .position(|(r, _, _)| (*te).ressortgroupref != 0 && *r == (*te).ressortgroupref)
            {
                if !is_tag(e, pg_sys::NodeTag::T_Var) {
                    return Ok(None);
                }
                outputs.push((Output::Group(i), name));
                continue;
            }
            if !is_tag(e, pg_sys::NodeTag::T_Aggref) {
                return Ok(None);
            }
            let a = e as *mut pg_sys::Aggref;
            if !(*a).aggdistinct.is_null()
                || !(*a).aggorder.is_null()
                || !(*a).aggfilter.is_null()
                || (*a).aggkind != b'n' as c_char
                || pg_sys::get_func_namespace((*a).aggfnoid)
                    != pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE)
            {
                return Ok(None);
            }
            let fname = CStr::from_ptr(pg_sys::get_func_name((*a).aggfnoid)).to_bytes();
            let args = list_ptrs::<pg_sys::TargetEntry>((*a).args);
            let arg = match args.len() {
                0 if (*a).aggstar && fname == b"count" => "*".to_string(),
                1 => text_of((*args[0]).expr as *mut pg_sys::Node),
                _ => return Ok(None),
            };
            let ty = CStr::from_ptr(pg_sys::format_type_be((*a).aggtype))
                .to_string_lossy()
                .into_owned();
            let first = partials.len();
            let kind = match fname {
                b"count" => {
                    partials.push((format!("count({arg})"), "bigint".into()));
                    Agg::Count
                }
                b"sum" if SUMMABLE.contains(&ty.as_str()) => {
                    partials.push((format!("sum({arg})"), ty.clone()));
                    Agg::Sum
                }
                b"min" | b"max" if ORDERED.contains(&ty.as_str()) => {
                    let f = String::from_utf8_lossy(fname).into_owned();
                    partials.push((format!("{f}({arg})"), ty.clone()));
                    if fname == b"min" {
                        Agg::Min
                    } else {
                        Agg::Max
                    }
                }
                b"avg" if ty == "numeric" || ty == "double precision" => {
                    partials.push((format!("sum({arg})::{ty}"), ty.clone()));
                    partials.push((format!("count({arg})"), "bigint".into()));
                    Agg::Avg
                }
                _ => return Ok(None),
            };
            outputs.push((Output::Agg { kind, first, ty }, name));
        }

        // The per-shard statement.
        let mut shard_sql = String::from("SELECT ");
        let cols: Vec<String> = groups
            .iter()
            .map(|(_, g, _)| g.clone())
            .chain(partials.iter().map(|(p, _)| p.clone()))
            .collect();
        shard_sql.push_str(&cols.join(", "));
        let _ = write!(shard_sql, " FROM {}", table.qualified_name);
        let quals = if q.jointree.is_null() {
            std::ptr::null_mut()
        } else {
            (*q.jointree).quals
        };
        if !quals.is_null() {
            let _ = write!(shard_sql, " WHERE {}", text_of(quals));
        }
        if !groups.is_empty() {
            let positions: Vec<String> = (1..=groups.len()).map(|i| i.to_string()).collect();
            let _ = write!(shard_sql, " GROUP BY {}", positions.join(", "));
        }
        // Parameters would have to travel with it: not handled here.
        if has_parameter(&shard_sql) {
            return Ok(None);
        }

        // The combining statement.
        let coldefs: Vec<String> = groups
            .iter()
            .enumerate()
            .map(|(i, (_, _, ty))| format!("g{i} {ty}"))
            .chain(
                partials
                    .iter()
                    .enumerate()
                    .map(|(i, (_, ty))| format!("a{i} {ty}")),
            )
            .collect();
        let finals: Vec<String> = outputs
            .iter()
            .map(|(o, name)| {
                let e = match o {
                    Output::Group(i) => format!("g{i}"),
                    Output::Agg { kind, first, ty } => match kind {
                        Agg::Count => format!("coalesce(sum(a{first}), 0)::bigint"),
                        Agg::Sum => format!("sum(a{first})::{ty}"),
                        Agg::Min => format!("min(a{first})"),
                        Agg::Max => format!("max(a{first})"),
                        Agg::Avg => {
                            format!("(sum(a{first}) / nullif(sum(a{}), 0))::{ty}", first + 1)
                        }
                    },
                };
                format!("{e} AS {}", quote_ident(name))
            })
            .collect();
        let mut sql = format!(
            "SELECT {} FROM remus.fanout({}::regclass, {}) AS p({})",
            finals.join(", "),
            table.relid.to_u32(),
            quote_literal(&shard_sql),
            coldefs.join(", ")
        );
        if !groups.is_empty() {
            let g: Vec<String> = (0..groups.len()).map(|i| format!("g{i}")).collect();
            let _ = write!(sql, " GROUP BY {}", g.join(", "));
        }
        let tlist = list_ptrs::<pg_sys::TargetEntry>(q.targetList);
        let mut order = Vec::new();
        for sgc in list_ptrs::<pg_sys::SortGroupClause>(q.sortClause) {
            let Some(pos) = tlist
                .iter()
                .position(|te| (**te).ressortgroupref == (*sgc).tleSortGroupRef)
            else {
                return Ok(None);
            };
            let op = pg_sys::get_opname((*sgc).sortop);
            let desc = !op.is_null() && CStr::from_ptr(op).to_bytes() == b">";
            order.push(format!(
                "{} {} NULLS {}",
                pos + 1,
                if desc { "DESC" } else { "ASC" },
                if (*sgc).nulls_first { "FIRST" } else { "LAST" }
            ));
        }
        if !order.is_empty() {
            let _ = write!(sql, " ORDER BY {}", order.join(", "));
        }
        for (clause, expr) in [("LIMIT", q.limitCount), ("OFFSET", q.limitOffset)] {
            if !expr.is_null() {
                // `LIMIT 3` arrives as a cast of an int4 constant to bigint.
                let copy = pg_sys::copyObjectImpl(expr as *const std::ffi::c_void);
                let folded = pg_sys::eval_const_expressions(std::ptr::null_mut(), copy as *mut _);
                if !is_tag(folded, pg_sys::NodeTag::T_Const) {
                    return Ok(None);
                }
                let _ = write!(sql, " {clause} {}", text_of(folded));
            }
        }
        Ok(Some((table, sql)))
    }
}

/// Result types whose per-shard sums add up with `sum` into the same type.
const SUMMABLE: &[&str] = &["bigint", "numeric", "real", "double precision"];
/// Types whose per-shard minima and maxima combine with `min` / `max`.
const ORDERED: &[&str] = &[
    "smallint",
    "integer",
    "bigint",
    "numeric",
    "real",
    "double precision",
    "text",
    "date",
    "timestamp without time zone",
    "timestamp with time zone",
];

unsafe fn type_name(e: *mut pg_sys::Node) -> String {
    // SAFETY: `e` is a valid expression; format_type returns a palloc'd string.
    unsafe {
        CStr::from_ptr(pg_sys::format_type_with_typemod(
            pg_sys::exprType(e),
            pg_sys::exprTypmod(e),
        ))
        .to_string_lossy()
        .into_owned()
    }
}

/// Does deparsed SQL use a `$n` parameter (or a literal that looks like one: then it is only
/// planned the general way)?
fn has_parameter(sql: &str) -> bool {
    let b = sql.as_bytes();
    b.windows(2).any(|w| w[0] == b'$' && w[1].is_ascii_digit())
}

/// `remus.fanout(table, sql)`: runs `sql` (a statement on `table`, see the module doc) on every
/// shard of the table where it lives, inside the current transaction, and returns all rows, of
/// the caller's column definition list.
#[pg_guard]
#[no_mangle]
pub unsafe extern "C-unwind" fn remus_fanout(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: called by the function manager with a valid fcinfo for
    // `remus.fanout(regclass, text)`; both arguments are strict.
    unsafe {
        if let Err(e) = fanout(fcinfo) {
            e.raise();
        }
        pg_sys::Datum::from(0usize)
    }
}

unsafe fn fanout(fcinfo: pg_sys::FunctionCallInfo) -> Result<(), RemusError> {
    // SAFETY: see `remus_fanout`.
    unsafe {
        let args = (*fcinfo).args.as_slice(2);
        let relid = pg_sys::Oid::from(args[0].value.value() as u32);
        let sql_text = pg_sys::pg_detoast_datum(args[1].value.cast_mut_ptr());
        let sql = CStr::from_ptr(pg_sys::text_to_cstring(sql_text as *const pg_sys::text))
            .to_string_lossy()
            .into_owned();
        let rsinfo = (*fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
        if rsinfo.is_null()
            || !is_tag(
                rsinfo as *mut pg_sys::Node,
                pg_sys::NodeTag::T_ReturnSetInfo,
            )
            || (*rsinfo).allowedModes & pg_sys::SetFunctionReturnMode::SFRM_Materialize as c_int
                == 0
            || (*rsinfo).expectedDesc.is_null()
        {
            return Err(RemusError::Unsupported(
                "remus.fanout must be called in FROM with a column definition list",
            ));
        }
        dist_table(relid)?.ok_or(RemusError::TableDisappeared)?;
        let desc = (*rsinfo).expectedDesc;
        let natts = (*desc).natts as usize;
        let types: Vec<(pg_sys::Oid, i32)> = (0..natts)
            .map(|i| {
                let a = (*desc).attrs.as_ptr().add(i);
                ((*a).atttypid, (*a).atttypmod)
            })
            .collect();
        let old = pg_sys::MemoryContextSwitchTo((*(*rsinfo).econtext).ecxt_per_query_memory);
        let store = pg_sys::tuplestore_begin_heap(true, false, pg_sys::work_mem);
        let tupdesc = pg_sys::CreateTupleDescCopy(desc);
        pg_sys::MemoryContextSwitchTo(old);
        // The shards of other nodes are queried concurrently, one statement per shard, while
        // this node's own run here.
        let placements = super::placement::placements(relid)?;
        super::execute::read_every_shard(&placements, &sql, &types, |rows| {
            super::modify::store_rows(store, tupdesc, rows, natts);
            Ok(())
        })?;
        (*rsinfo).returnMode = pg_sys::SetFunctionReturnMode::SFRM_Materialize;
        (*rsinfo).setResult = store;
        (*rsinfo).setDesc = tupdesc;
        Ok(())
    }
}

/// Version-1 calling convention marker for [`remus_fanout`].
#[no_mangle]
pub extern "C" fn pg_finfo_remus_fanout() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

pgrx::extension_sql!(
    r#"
CREATE FUNCTION remus.fanout(shell regclass, sql text) RETURNS SETOF record
    STRICT VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'remus_fanout';
COMMENT ON FUNCTION remus.fanout(regclass, text) IS
    'Runs a per-shard aggregate statement on every shard of a distributed table (used by the router; see router/fanout.rs)';
"#,
    name = "fanout_function",
    requires = ["distribution_catalog"]
);
