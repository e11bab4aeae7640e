//! A statement with constants on one shard group, sent in the simple protocol, planned once per
//! shape in a backend (decision 0037).
//!
//! A prepared statement's router plan is made once and reused: its key is a parameter, the owner
//! is decided at each execution, and its local plan is made at execution and kept per shard
//! (`local::local_plan_at_execution`). A statement sent as text with its constants
//! (`SELECT abalance FROM pgbench_accounts WHERE aid = 42`) had none of that: every execution
//! ran the router's analysis and PostgreSQL's planner on the local shard table, which plain
//! PostgreSQL does once and the router does on top (issue 16: the owner's select-only in the
//! simple protocol at 0.71-0.86× plain, the prepared one at 0.94-1.05×).
//!
//! Here, before the router's planner runs, the statement's shard-key constants (`key = 42` among
//! the top-level conjuncts of its WHERE) and the values it writes (an UPDATE's SET values and a
//! one-row INSERT's values) are lifted into `$n` parameters of a copy (`lift`). That copy is
//! routed once, as a prepared statement with those parameters would be, and kept with the copy
//! itself ([`Shape`]). A later statement whose lifted copy is `equal()` to a kept one (the same
//! tree but for the lifted values, so the same relations, operators, other constants and
//! everything the rewriter added) reuses its router plan, with its own values carried in the
//! plan node's `custom_exprs`; `ExecutorStart` binds them as the statement's parameters
//! ([`bind`]). From there the execution is a prepared statement's: the owner decided with the
//! statement's snapshot and pinned, its local plan kept per shard, the remote text deparsed once.
//!
//! What is lifted is chosen so that no plan changes but the key's: constants elsewhere in WHERE,
//! in LIMIT or in the target list stay in the tree and must be equal for a match, so the planner
//! keeps seeing them (partial indexes, selectivity). The key's selectivity is then estimated as
//! a prepared statement's generic plan estimates it. `plan_cache_mode = force_custom_plan` turns
//! the cache off, as it turns generic plans off.
//!
//! Only a statement planned at the top level (no portal running: the simple protocol, or the
//! Bind of a statement without parameters) is looked up: EXPLAIN, cursors, functions and
//! PL/pgSQL keep their plans as they are. A shape whose text keeps changing its other constants
//! (more misses than hits after [`GIVE_UP_AFTER`] misses) is left to the planner. Every relcache
//! invalidation (and a change of any function) drops the kept shapes, as it drops the local plans made at
//! execution; their memory is freed when the transaction ends, since a running statement may
//! still use it.

use std::cell::RefCell;
use std::ffi::{c_void, CStr};

use pgrx::pg_sys;

use crate::pg::fast_map::{fast_map, FastMap};
use crate::pg::list::{is_tag, list_ptrs};
use crate::router::execute::Params;
use crate::router::local::PlanContext;

/// Shapes kept per backend; past it, every one is dropped and the cache starts again.
const MAX_SHAPES: usize = 256;
/// Texts remembered per backend (with their shapes, or as planned as they come); past it,
/// every one is forgotten.
const MAX_TEXTS: usize = 4096;
/// Shapes kept per text (the same text with other constants elsewhere: one shape each).
const PER_TEXT: usize = 16;
/// Misses after which a text that misses more often than it hits is planned as it comes.
const GIVE_UP_AFTER: u32 = 16;

/// One statement shape: its lifted Query (compared with `equal()`) and its router plan, in a
/// memory context of their own.
struct Shape {
    cxt: pg_sys::MemoryContext,
    lifted: *mut pg_sys::Query,
    stmt: *mut pg_sys::PlannedStmt,
}

/// The shapes of one statement text, its constants masked ([`text_hash`]).
#[derive(Default)]
struct Text {
    /// Most recently used last.
    shapes: Vec<Shape>,
    hits: u32,
    misses: u32,
    /// Not a routed statement on one shard group, or its other constants keep changing.
    planned_as_it_comes: bool,
}

struct Cache {
    epoch: u64,
    texts: FastMap<u64, Text>,
    shapes: usize,
    /// Contexts of dropped shapes, deleted when the transaction ends.
    retired: Vec<pg_sys::MemoryContext>,
}

thread_local! {
    static CACHE: RefCell<Cache> = const { RefCell::new(Cache {
        epoch: 0,
        texts: fast_map(),
        shapes: 0,
        retired: Vec::new(),
    }) };
}

impl Cache {
    fn retire_all(&mut self) {
        for (_, text) in self.texts.drain() {
            self.retired.extend(text.shapes.into_iter().map(|s| s.cxt));
        }
        self.shapes = 0;
    }
}

/// The plan of `parse` from a kept shape, or from a shape made now; None: plan it as usual.
///
/// # Safety
/// As for the planner hook: `parse` is the planner's rewritten Query, `ctx` its arguments.
pub(crate) unsafe fn planned(
    parse: *mut pg_sys::Query,
    ctx: &PlanContext,
) -> Option<*mut pg_sys::PlannedStmt> {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        if !eligible(parse, ctx) {
            return None;
        }
        let text = statement_text(ctx.query_string, parse)?;
        if text.contains(&b'$') {
            // Parameters of its own (a generic plan of a prepared statement), or dollar quotes.
            return None;
        }
        let key = text_hash(text);
        let epoch = crate::router::local::epoch();
        let skip = CACHE.with(|c| {
            let mut c = c.borrow_mut();
            if c.epoch != epoch || c.texts.len() >= MAX_TEXTS {
                c.retire_all();
                c.epoch = epoch;
            }
            c.texts.get(&key).is_some_and(|t| t.planned_as_it_comes)
        });
        if skip {
            return None;
        }
        let Some((lifted, params)) = lift(parse) else {
            // No key constant and nothing written: as plain a statement as it will ever be.
            CACHE.with(|c| {
                c.borrow_mut()
                    .texts
                    .entry(key)
                    .or_default()
                    .planned_as_it_comes = true
            });
            return None;
        };
        let hit = CACHE.with(|c| {
            let mut c = c.borrow_mut();
            let t = c.texts.entry(key).or_default();
            let i = t
                .shapes
                .iter()
                .position(|s| pg_sys::equal(lifted as *const c_void, s.lifted as *const c_void))?;
            t.hits += 1;
            let s = t.shapes.remove(i);
            let stmt = s.stmt;
            t.shapes.push(s);
            Some(stmt)
        });
        let stmt = match hit {
            Some(stmt) => stmt,
            None => {
                let shape = make_shape(lifted, ctx);
                let made = shape.as_ref().map(|s| s.stmt);
                CACHE.with(|c| {
                    let mut c = c.borrow_mut();
                    let c = &mut *c;
                    if c.shapes >= MAX_SHAPES {
                        c.retire_all();
                    }
                    let t = c.texts.entry(key).or_default();
                    t.misses += 1;
                    match shape {
                        Some(s) if !(t.misses >= GIVE_UP_AFTER && t.misses > t.hits) => {
                            if t.shapes.len() >= PER_TEXT {
                                c.retired.push(t.shapes.remove(0).cxt);
                                c.shapes -= 1;
                            }
                            t.shapes.push(s);
                            c.shapes += 1;
                        }
                        other => {
                            // Not a routed single-group statement, or a text whose other
                            // constants keep changing: its shapes go, and it is planned as
                            // it comes from now on.
                            t.planned_as_it_comes = true;
                            let n = t.shapes.len();
                            c.retired.extend(t.shapes.drain(..).map(|s| s.cxt));
                            c.retired.extend(other.map(|s| s.cxt));
                            c.shapes -= n;
                        }
                    }
                });
                // The shape just made serves this statement too (its context is retired, not
                // freed, if it was not kept).
                made?
            }
        };
        Some(for_execution(stmt, parse, &params))
    }
}

/// Is `parse` a statement this cache takes? Planned at the top level (no portal running, not
/// a background worker), without bound parameters, generic plans allowed, no scrolling cursor,
/// the statement itself (not one a rule added), on a node where the extension is created.
unsafe fn eligible(parse: *mut pg_sys::Query, ctx: &PlanContext) -> bool {
    // SAFETY: reading backend globals and the planner's Query.
    unsafe {
        crate::guc::SHAPE_CACHE.get()
            && !parse.is_null()
            && ctx.bound_params.is_null()
            && !ctx.query_string.is_null()
            && pg_sys::ActivePortal.is_null()
            && !pg_sys::IsBackgroundWorker
            && pg_sys::plan_cache_mode
                != pg_sys::PlanCacheMode::PLAN_CACHE_MODE_FORCE_CUSTOM_PLAN as i32
            && ctx.cursor_options & pg_sys::CURSOR_OPT_SCROLL as i32 == 0
            && matches!(
                (*parse).commandType,
                pg_sys::CmdType::CMD_SELECT
                    | pg_sys::CmdType::CMD_UPDATE
                    | pg_sys::CmdType::CMD_DELETE
                    | pg_sys::CmdType::CMD_INSERT
            )
            && (*parse).canSetTag
            && (*parse).querySource == pg_sys::QuerySource::QSRC_ORIGINAL
            && crate::router::marker::marked_shard(ctx.query_string).is_none()
            && crate::pg::extension::extension_present()
    }
}

/// The statement's own text within the query string (several statements may share one).
unsafe fn statement_text<'a>(
    query_string: *const std::ffi::c_char,
    parse: *mut pg_sys::Query,
) -> Option<&'a [u8]> {
    // SAFETY: `query_string` is the NUL-terminated text the statement was parsed from, and its
    // location and length are offsets into it.
    unsafe {
        let all = CStr::from_ptr(query_string).to_bytes();
        let start = usize::try_from((*parse).stmt_location).unwrap_or(0);
        let len = usize::try_from((*parse).stmt_len).unwrap_or(0);
        let end = if len == 0 { all.len() } else { start + len };
        all.get(start..end)
    }
}

/// A hash of `text` with its numbers and quoted strings masked: texts that differ only in
/// their constants share it. Only a bucket: a match is decided by `equal()` on the trees.
fn text_hash(text: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;
    let mut h = OFFSET;
    let mut quoted = false;
    let mut i = 0;
    while i < text.len() {
        let b = text[i];
        i += 1;
        if quoted {
            if b == b'\'' {
                // `''` inside a literal is a quote, not its end.
                if text.get(i) == Some(&b'\'') {
                    i += 1;
                } else {
                    quoted = false;
                }
            }
            continue;
        }
        let b = match b {
            b'\'' => {
                quoted = true;
                b'?'
            }
            b'0'..=b'9' => continue,
            _ => b,
        };
        h = (h ^ u64::from(b)).wrapping_mul(PRIME);
    }
    h
}

/// A copy of `parse` whose shard-key constants (the `key <op> constant` top-level conjuncts of
/// its WHERE, on a distributed table of the statement's own level) and written values (an
/// UPDATE's SET values, a one-row INSERT's values) are `$1…$n`, with their values; its text
/// position cleared, so that two statements of one shape compare `equal()`. None when nothing
/// was lifted. Only constants of the types the router sends as parameters are lifted
/// (`deparse::as_param`).
unsafe fn lift(parse: *mut pg_sys::Query) -> Option<(*mut pg_sys::Query, Params)> {
    // SAFETY: `parse` is the planner's Query; every node changed is one of the copy's.
    unsafe {
        let copy = pg_sys::copyObjectImpl(parse as *const c_void) as *mut pg_sys::Query;
        (*copy).stmt_location = -1;
        (*copy).stmt_len = 0;
        let mut params = Params::none();
        let jointree = (*copy).jointree;
        if !jointree.is_null() && !(*jointree).quals.is_null() {
            let quals = (*jointree).quals;
            if is_tag(quals, pg_sys::NodeTag::T_BoolExpr)
                && (*(quals as *mut pg_sys::BoolExpr)).boolop == pg_sys::BoolExprType::AND_EXPR
            {
                for conjunct in list_ptrs::<pg_sys::Node>((*(quals as *mut pg_sys::BoolExpr)).args)
                {
                    lift_key_constant(copy, conjunct, &mut params);
                }
            } else {
                lift_key_constant(copy, quals, &mut params);
            }
        }
        if matches!(
            (*copy).commandType,
            pg_sys::CmdType::CMD_UPDATE | pg_sys::CmdType::CMD_INSERT
        ) {
            crate::router::deparse::lift_written_values(copy, &mut params);
        }
        (!params.values.is_empty()).then_some((copy, params))
    }
}

/// Lifts the constant of `conjunct` when it is `key <op> constant` (either side) on the shard
/// key of a distributed table of `q`'s range table.
unsafe fn lift_key_constant(
    q: *mut pg_sys::Query,
    conjunct: *mut pg_sys::Node,
    params: &mut Params,
) {
    // SAFETY: `conjunct` is a node of `q`, a valid Query; its argument cell is replaced in place.
    unsafe {
        if !is_tag(conjunct, pg_sys::NodeTag::T_OpExpr) {
            return;
        }
        let args = (*(conjunct as *mut pg_sys::OpExpr)).args;
        if pg_sys::list_length(args) != 2 {
            return;
        }
        let nodes = list_ptrs::<pg_sys::Node>(args);
        let (var_at, const_at) = if is_tag(nodes[1], pg_sys::NodeTag::T_Const) {
            (0, 1)
        } else {
            (1, 0)
        };
        let mut var = nodes[var_at];
        while is_tag(var, pg_sys::NodeTag::T_RelabelType) {
            var = (*(var as *mut pg_sys::RelabelType)).arg as *mut pg_sys::Node;
        }
        if !is_tag(var, pg_sys::NodeTag::T_Var) {
            return;
        }
        let var = var as *mut pg_sys::Var;
        if (*var).varlevelsup != 0 || (*var).varattno <= 0 {
            return;
        }
        let rtes = list_ptrs::<pg_sys::RangeTblEntry>((*q).rtable);
        let Some(&rte) = rtes.get(((*var).varno as usize).wrapping_sub(1)) else {
            return;
        };
        if (*rte).rtekind != pg_sys::RTEKind::RTE_RELATION {
            return;
        }
        let Ok(Some(table)) = crate::router::placement::dist_table((*rte).relid) else {
            return;
        };
        if table.kind != 'h' || table.key_attno != (*var).varattno {
            return;
        }
        if let Some(p) = crate::router::deparse::as_param(nodes[const_at], params) {
            (*(*args).elements.add(const_at)).ptr_value = p as *mut c_void;
        }
    }
}

/// Routes `lifted` as a prepared statement with its parameters would be routed, in a memory
/// context of its own. None: it is not a single-group router plan (or the router refused it,
/// which the statement's own planning then reports).
unsafe fn make_shape(lifted: *mut pg_sys::Query, ctx: &PlanContext) -> Option<Shape> {
    // SAFETY: memory contexts are PostgreSQL's, switched and restored around the planning; the
    // context starts under the current one, so an ERROR raised while planning frees it, and
    // moves under TopMemoryContext once the shape is made.
    unsafe {
        let cxt = pg_sys::AllocSetContextCreateInternal(
            pg_sys::CurrentMemoryContext,
            c"pg_remus statement shape".as_ptr(),
            0,
            1024,
            8 * 1024,
        );
        let old = pg_sys::MemoryContextSwitchTo(cxt);
        let kept = pg_sys::copyObjectImpl(lifted as *const c_void) as *mut pg_sys::Query;
        let input = pg_sys::copyObjectImpl(lifted as *const c_void) as *mut pg_sys::Query;
        let routed = crate::router::planner::route(
            input,
            &PlanContext {
                bound_params: std::ptr::null_mut(),
                ..*ctx
            },
        );
        pg_sys::MemoryContextSwitchTo(old);
        let stmt = match routed {
            Ok(Some(stmt)) if reusable(stmt) => stmt,
            _ => {
                pg_sys::MemoryContextDelete(cxt);
                return None;
            }
        };
        pg_sys::MemoryContextSetParent(cxt, pg_sys::TopMemoryContext);
        Some(Shape {
            cxt,
            lifted: kept,
            stmt,
        })
    }
}

/// A router plan whose node is the whole plan and carries no local plan made at plan time:
/// what a prepared statement's generic plan is.
unsafe fn reusable(stmt: *mut pg_sys::PlannedStmt) -> bool {
    // SAFETY: `stmt` is a valid PlannedStmt.
    unsafe {
        crate::router::modify::is_router_plan(stmt)
            && (*((*stmt).planTree as *mut pg_sys::CustomScan))
                .custom_plans
                .is_null()
            && (*((*stmt).planTree as *mut pg_sys::CustomScan))
                .custom_exprs
                .is_null()
    }
}

/// The statement's plan: a copy of the shape's header and router node (the tree under them is
/// shared, read only) carrying the statement's own values as constants in `custom_exprs`, and
/// its query id, text location and command-tag flag.
unsafe fn for_execution(
    shape: *mut pg_sys::PlannedStmt,
    parse: *mut pg_sys::Query,
    params: &Params,
) -> *mut pg_sys::PlannedStmt {
    // SAFETY: `shape` is a kept router plan; the copies are palloc'd in the planner's current
    // memory context, as the plan it returns; bitwise copies share lists the executor reads.
    unsafe {
        let stmt =
            pg_sys::palloc(std::mem::size_of::<pg_sys::PlannedStmt>()) as *mut pg_sys::PlannedStmt;
        stmt.write(shape.read());
        let node = (*shape).planTree as *mut pg_sys::CustomScan;
        let cscan =
            pg_sys::palloc(std::mem::size_of::<pg_sys::CustomScan>()) as *mut pg_sys::CustomScan;
        cscan.write(node.read());
        let mut values: *mut pg_sys::List = std::ptr::null_mut();
        for (ty, value) in params.types.iter().zip(&params.values) {
            let (mut len, mut byval) = (0i16, false);
            pg_sys::get_typlenbyval(*ty, &mut len, &mut byval);
            let c = pg_sys::makeConst(
                *ty,
                -1,
                pg_sys::InvalidOid,
                len.into(),
                *value,
                false,
                byval,
            );
            values = pg_sys::lappend(values, c as *mut c_void);
        }
        (*cscan).custom_exprs = values;
        (*stmt).planTree = cscan as *mut pg_sys::Plan;
        (*stmt).queryId = (*parse).queryId;
        (*stmt).canSetTag = (*parse).canSetTag;
        (*stmt).stmt_location = (*parse).stmt_location;
        (*stmt).stmt_len = (*parse).stmt_len;
        stmt
    }
}

/// At `ExecutorStart`: a plan from a shape gets its values as the statement's parameters.
///
/// # Safety
/// `query_desc` must be the QueryDesc being started, its executor not built.
pub(crate) unsafe fn bind(query_desc: *mut pg_sys::QueryDesc) {
    // SAFETY: the caller upholds this function's `# Safety` contract; the parameter list is
    // palloc'd in the current memory context, the portal's, as long-lived as the execution.
    unsafe {
        let stmt = (*query_desc).plannedstmt;
        if stmt.is_null() || !crate::router::modify::is_router_plan(stmt) {
            return;
        }
        let cscan = (*stmt).planTree as *mut pg_sys::CustomScan;
        if (*cscan).custom_exprs.is_null() {
            return;
        }
        let values = list_ptrs::<pg_sys::Const>((*cscan).custom_exprs);
        let list = pg_sys::makeParamList(values.len() as i32);
        let slots = (*list).params.as_mut_slice(values.len());
        for (slot, c) in slots.iter_mut().zip(values) {
            slot.value = (*c).constvalue;
            slot.isnull = (*c).constisnull;
            slot.pflags = pg_sys::PARAM_FLAG_CONST as u16;
            slot.ptype = (*c).consttype;
        }
        (*query_desc).params = list;
    }
}

/// At the end of a (top-level) transaction: the memory of dropped shapes goes.
pub(crate) fn end_of_transaction() {
    let retired = CACHE.with(|c| std::mem::take(&mut c.borrow_mut().retired));
    for cxt in retired {
        // SAFETY: a context this module made and no longer refers to; no statement of the
        // ended transaction runs any more.
        unsafe { pg_sys::MemoryContextDelete(cxt) };
    }
}

#[cfg(test)]
mod tests {
    use super::text_hash;

    #[test]
    fn texts_that_differ_in_constants_share_a_hash() {
        assert_eq!(
            text_hash(b"SELECT v FROM t WHERE k = 42"),
            text_hash(b"SELECT v FROM t WHERE k = 7")
        );
        assert_eq!(
            text_hash(b"UPDATE t SET s = 'a' WHERE k = 1"),
            text_hash(b"UPDATE t SET s = 'it''s' WHERE k = 1234")
        );
        assert_ne!(
            text_hash(b"SELECT v FROM t WHERE k = 42"),
            text_hash(b"SELECT w FROM t WHERE k = 42")
        );
    }
}
