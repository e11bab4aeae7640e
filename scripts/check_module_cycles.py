#!/usr/bin/env python3
"""Fails when the production module graph of a Rust crate has a cycle.

Usage:
    scripts/check_module_cycles.py [CRATE_SRC_DIR ...]   (default: pg_remus/src)
    scripts/check_module_cycles.py --self-test

The aim is the layering rule of decision 0009: modules import only downward, so the import graph
of each crate is a DAG. Exit status 1 when any crate has a cycle, 0 otherwise, 2 on bad input.

What a node is. Every file module and folder module reachable from a crate root through `mod x;`
declarations is one node, named by its path (`router::planner`; the root is `crate`). Roots are
`lib.rs`, `main.rs` and every `bin/*.rs` / `bin/*/main.rs`; each root is its own crate (a binary's
`crate::` is the binary). Inline `mod x { ... }` blocks of production code belong to the file that
holds them.

What an edge is. Module M depends on module N when M's production code names N by a path:
  - a `use` tree (`use crate::a::{b, c::d};`, `use super::x;`, `use self::y::*;`, `pub use` too),
  - a path anywhere in code: `crate::a::b::f()`, `$crate::a::X`, `super::f()`, `super::super::g`,
    `self::child::h()`, and a bare `child::h()` where `child` is a module M declares.
A path resolves to the deepest existing module on it: `crate::router::planner::route` is an edge
to `router::planner`, `crate::SOMETHING` (an item of the root file) to `crate`. Paths into other
crates (`pgrx::`, `std::`) are not edges.

Re-exports are transparent. A named `pub use` (any visibility: `pub`, `pub(crate)`, ...) is no
edge of its own; a path through it is an edge to the module that defines the item
(`crate::apply::ShadowApplier`, re-exported by `apply` from `apply::applier`, is an edge to
`apply::applier`); and the re-exporting module depends on the defining one only where its own
code uses the name. So a folder's `mod.rs` may be a facade over its children. A glob `pub use
x::*` cannot be seen through and is an ordinary edge to `x`.

Parent and child. Declaring a child (`mod x;`) is containment, not a dependency, so it is no edge.
Any other reference is an edge, in either direction: a child using `super::helper` (an item the
parent defines) depends on its parent, and a parent calling `child::f()` depends on the child.
So a parent may call its children, or its children may use the parent, but not both: an item
both need belongs in a lower module (a sibling, or `pg::`), which is exactly the "only import
downward" rule applied inside a folder.

Production code only. Before edges are read, the script blanks `//`, `///`, `//!` and `/* */`
comments and the contents of string and char literals (so a path in a comment, doc example or SQL
text is not an edge), and removes every item whose `#[cfg(...)]` is false in a production build,
where `test` and `feature = "pg_test"` are off and every other cfg is taken as on: so
`#[cfg(test)] mod tests { ... }`, `#[cfg(any(test, feature = "pg_test"))] mod tests { ... }`
(removed by brace matching), `#[cfg(test)] mod tests;` and `#[cfg(test)] use ...;` are dropped,
while `#[cfg(not(test))]` items stay. A file starting with `#![cfg(test)]` is dropped whole.

Output: for every strongly connected component with more than one module, its modules and every
edge inside it with the file:line that makes it; a shortest cycle through the component is shown
first, to read the loop at a glance.
"""

import bisect
import os
import re
import sys
import tempfile
from collections import defaultdict, deque

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH_RE = re.compile(r"(?<![A-Za-z0-9_:])((?:r#)?" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)")
USE_RE = re.compile(r"(?<![A-Za-z0-9_])use\s+")
MOD_DECL_RE = re.compile(
    r"(?<![A-Za-z0-9_])(?:pub\s*(?:\([^)]*\))?\s*)?mod\s+(" + IDENT + r")\s*;")
PATH_ATTR_RE = re.compile(r'#\[\s*path\s*=\s*"([^"]*)"\s*\]\s*$')
CFG_RE = re.compile(r"#\s*(!?)\s*\[\s*cfg\s*\(")
INLINE_MOD_RE = re.compile(r"(?<![A-Za-z0-9_])mod\s+(" + IDENT + r")\s*\{")
KEYWORDS_FIRST = {"crate", "super", "self"}


# --------------------------------------------------------------------------------------------
# Lexing: blank comments and literal contents, keeping every offset and newline in place.
# --------------------------------------------------------------------------------------------

def blank(chars, start, end):
    for i in range(start, end):
        if chars[i] != "\n":
            chars[i] = " "


def strip_comments_and_literals(text):
    """Returns text of the same length with comments and literal contents replaced by spaces."""
    out = list(text)
    n = len(text)
    i = 0
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(out, i, j)
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(out, i, j)
            i = j
        elif c in "rbc" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            # Raw strings r"..", r#".."#, br#".."#, cr".."; plain b".." and c"..".
            m = re.compile(r'(?:br|cr|r)(#*)"').match(text, i)
            if m:
                close = '"' + m.group(1)
                j = text.find(close, m.end())
                j = n if j < 0 else j + len(close)
                blank(out, m.end(), j - len(close))
                i = j
            elif nxt == '"' and c in "bc":
                i = skip_string(text, out, i + 1)
            else:
                i += 1
        elif c == '"':
            i = skip_string(text, out, i)
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}', '"') or a lifetime ('a).
            if nxt == "\\":
                j = text.find("'", i + 3)
                j = n if j < 0 else j + 1
                blank(out, i + 1, j - 1)
                i = j
            elif i + 2 < n and text[i + 2] == "'":
                blank(out, i + 1, i + 2)
                i += 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def skip_string(text, out, i):
    """i is at the opening quote; blanks the contents and returns the index after the close."""
    j = i + 1
    n = len(text)
    while j < n and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    blank(out, i + 1, min(j, n))
    return min(j + 1, n)


# --------------------------------------------------------------------------------------------
# cfg: drop items that a production build does not compile.
# --------------------------------------------------------------------------------------------

def match_close(text, i, open_ch, close_ch):
    """i is at open_ch; returns the index just after its matching close_ch."""
    depth = 0
    n = len(text)
    while i < n:
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def cfg_is_on(pred):
    """Evaluates a cfg predicate for a production build: test and pg_test off, the rest on."""
    tokens = re.findall(r'[A-Za-z_][A-Za-z0-9_]*|"[^"]*"|[(),=]', pred)
    pos = 0

    def parse():
        nonlocal pos
        name = tokens[pos]
        pos += 1
        if name in ("any", "all", "not") and pos < len(tokens) and tokens[pos] == "(":
            pos += 1
            vals = []
            while tokens[pos] != ")":
                vals.append(parse())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            if name == "any":
                return any(vals)
            if name == "all":
                return all(vals)
            return not vals[0]
        if pos < len(tokens) and tokens[pos] == "=":
            value = tokens[pos + 1].strip('"')
            pos += 2
            return not (name == "feature" and value == "pg_test")
        return name != "test"

    try:
        return parse()
    except IndexError:
        return True


def item_end(text, i):
    """i is at the start of an item (after its attributes); returns the index after it."""
    n = len(text)
    depth = 0
    while i < n:
        c = text[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c == ";":
            return i + 1
        elif depth == 0 and c == "{":
            return match_close(text, i, "{", "}")
        i += 1
    return n


def strip_cfg_off_items(code, original):
    """Blanks every item whose cfg is off in production. Returns (code, whole_file_off).

    `code` has literals blanked, so cfg predicates are read from `original` at the same offsets.
    """
    out = list(code)
    pos = 0
    while True:
        m = CFG_RE.search(code, pos)
        if not m:
            break
        paren = m.end() - 1
        close = match_close(code, paren, "(", ")")
        pred = original[paren + 1:close - 1]
        attr_end = code.find("]", close)
        attr_end = len(code) if attr_end < 0 else attr_end + 1
        if cfg_is_on(pred):
            pos = attr_end
            continue
        if m.group(1) == "!":
            return code, True
        # Skip the item's other attributes, then blank attributes and item.
        j = attr_end
        while True:
            while j < len(code) and code[j].isspace():
                j += 1
            if code.startswith("#", j) and code[j + 1:].lstrip().startswith("["):
                j = match_close(code, code.index("[", j), "[", "]")
            else:
                break
        end = item_end(code, j)
        blank(out, m.start(), end)
        code = "".join(out)
        pos = end
    return code, False


# --------------------------------------------------------------------------------------------
# The crate: module tree from `mod x;` declarations, then edges.
# --------------------------------------------------------------------------------------------

class Module:
    def __init__(self, path, file, code, lines):
        self.path = path  # tuple of names; () is the crate root
        self.file = file
        self.code = code
        self.lines = lines  # offsets of newlines, for line numbers
        self.children = set()
        # Inline `mod x { ... }` blocks: (start, end, name), so `super::` inside one is resolved
        # from the right place.
        self.inline = [(m.start(), match_close(code, m.end() - 1, "{", "}"), m.group(1))
                       for m in INLINE_MOD_RE.finditer(code)]

    def inline_at(self, offset):
        return tuple(name for (s, e, name) in self.inline if s < offset < e)

    def line_of(self, offset):
        return bisect.bisect_right(self.lines, offset) + 1


def name_of(path):
    return "::".join(path) if path else "crate"


def load(file):
    with open(file, encoding="utf-8") as f:
        original = f.read()
    code = strip_comments_and_literals(original)
    code, off = strip_cfg_off_items(code, original)
    return original, code, off


def child_file(parent_file, parent_is_dir_owner, name, path_attr):
    base = os.path.dirname(parent_file)
    if path_attr is not None:
        return os.path.join(base, path_attr)
    if not parent_is_dir_owner:
        base = os.path.join(base, os.path.splitext(os.path.basename(parent_file))[0])
    for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
        if os.path.isfile(cand):
            return cand
    return None


def build_tree(root_file):
    """Returns {path: Module} for every production module reachable from root_file."""
    modules = {}
    queue = deque([((), root_file, True)])
    while queue:
        path, file, owns_dir = queue.popleft()
        original, code, off = load(file)
        if off:
            continue
        lines = [i for i, ch in enumerate(code) if ch == "\n"]
        mod = Module(path, file, code, lines)
        modules[path] = mod
        for m in MOD_DECL_RE.finditer(code):
            name = m.group(1)
            before = original[:m.start()].rstrip()
            attr = PATH_ATTR_RE.search(before[-300:]) if before.endswith("]") else None
            cf = child_file(file, owns_dir, name, attr.group(1) if attr else None)
            if cf is None:
                print(f"warning: {file}:{mod.line_of(m.start())}: no file for mod {name}",
                      file=sys.stderr)
                continue
            mod.children.add(name)
            owns = os.path.basename(cf) == "mod.rs" or attr is not None
            queue.append((path + (name,), cf, owns))
    return modules


def parse_use_tree(text, start):
    """Parses the use tree at text[start:] up to ';'.

    Returns ([(segments, offset, bound name)], end); the bound name is the last segment, its
    `as` rename, or `*` for a glob.
    """
    end = text.find(";", start)
    end = len(text) if end < 0 else end
    tokens = [(m.group(0), start + m.start())
              for m in re.finditer(r"::|[{},*]|" + IDENT, text[start:end])]
    pos = 0
    paths = []

    def tree(prefix):
        nonlocal pos
        segs = list(prefix)
        if pos < len(tokens) and tokens[pos][0] == "::":
            pos += 1
        while pos < len(tokens):
            tok, off = tokens[pos]
            if tok == "{":
                pos += 1
                while pos < len(tokens) and tokens[pos][0] != "}":
                    tree(segs)
                    if pos < len(tokens) and tokens[pos][0] == ",":
                        pos += 1
                pos += 1
                return
            if tok == "*":
                pos += 1
                paths.append((segs, off, "*"))
                return
            if tok in (",", "}"):
                return
            pos += 1
            is_self = tok == "self" and bool(segs)
            if not is_self:
                segs = segs + [tok]
            if pos < len(tokens) and tokens[pos][0] == "::":
                pos += 1
                continue
            name = segs[-1] if segs else tok
            if pos + 1 < len(tokens) and tokens[pos][0] == "as":
                name = tokens[pos + 1][0]
                pos += 2
            paths.append((segs, off, name))
            return

    tree([])
    return paths, end


def resolve(modules, here, segs, inline=(), reexports=None):
    """Returns the module that defines what the path names, or None (another crate): the
    deepest existing module on the path, then through that module's re-exports (`pub use`).

    `inline` names the inline modules of file module `here` that the path sits in.
    """
    segs = [s.replace("r#", "") for s in segs]
    if not segs:
        return None
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] == "super":
        base, rest = here + inline, segs
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    elif segs[0] == "self":
        base, rest = here + inline, segs[1:]
    elif not inline and segs[0] in modules[here].children:
        base, rest = here, segs
    else:
        return None
    base = tuple(base)
    for k in range(len(rest), -1, -1):
        cand = base + tuple(rest[:k])
        if cand in modules:
            seen = set()
            while reexports and k < len(rest) and rest[k] in reexports.get(cand, {}) \
                    and (cand, rest[k]) not in seen:
                seen.add((cand, rest[k]))
                cand = reexports[cand][rest[k]]
                k += 1
            return cand
    return None


PUB_BEFORE_RE = re.compile(r"pub\s*(?:\([^)]*\))?\s*$")


def use_statements(mod):
    """Yields (is_pub, [(segments, offset, bound name)], start, end) for each `use` of mod."""
    for m in USE_RE.finditer(mod.code):
        paths, end = parse_use_tree(mod.code, m.end())
        is_pub = PUB_BEFORE_RE.search(mod.code[max(0, m.start() - 40):m.start()]) is not None
        yield is_pub, paths, m.start(), end


def reexports_of(modules):
    """{module: {name: defining module}} for every named `pub use` (any visibility) of the crate.

    Deepest modules first, so that a name re-exported twice resolves to where it is defined.
    """
    reexports = {}
    for here in sorted(modules, key=len, reverse=True):
        mod = modules[here]
        for is_pub, paths, _, _ in use_statements(mod):
            if not is_pub:
                continue
            for segs, off, name in paths:
                if name == "*":
                    continue
                dst = resolve(modules, here, segs, mod.inline_at(off), reexports)
                if dst is not None and dst != here:
                    reexports.setdefault(here, {})[name] = dst
    return reexports


def edges_of(modules):
    """Returns {(src, dst): [line, ...]} over the production code of every module.

    A named `pub use` is transparent: it is no edge of its own, a path through it is an edge to
    the module that defines the item, and the re-exporting module depends on that module only
    where its own code uses the name.
    """
    reexports = reexports_of(modules)
    edges = defaultdict(set)
    for here, mod in modules.items():
        code = list(mod.code)
        for is_pub, paths, start, end in use_statements(mod):
            for segs, off, name in paths:
                if is_pub and name != "*" and name in reexports.get(here, {}):
                    continue
                dst = resolve(modules, here, segs, mod.inline_at(off), reexports)
                if dst is not None and dst != here:
                    edges[(here, dst)].add(mod.line_of(off))
            blank(code, start, end)
        text = "".join(code)
        # `mod x;` declarations are containment: blank them before reading paths.
        text = MOD_DECL_RE.sub(lambda mm: " " * len(mm.group(0)), text)
        for m in PATH_RE.finditer(text):
            segs = re.split(r"\s*::\s*", m.group(1))
            if segs[0] not in KEYWORDS_FIRST and segs[0] not in mod.children:
                continue
            dst = resolve(modules, here, segs, mod.inline_at(m.start()), reexports)
            if dst is not None and dst != here:
                edges[(here, dst)].add(mod.line_of(m.start()))
        # A re-exported name that this module's own code uses.
        for name, dst in reexports.get(here, {}).items():
            for m in re.finditer(r"(?<![A-Za-z0-9_:])" + re.escape(name) + r"(?![A-Za-z0-9_])", text):
                edges[(here, dst)].add(mod.line_of(m.start()))
    return edges


def sccs(nodes, adj):
    """Tarjan's algorithm, iterative. Returns the components with more than one node."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(adj[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def shortest_cycle(comp, adj):
    members = set(comp)
    best = None
    for s in comp:
        prev = {s: None}
        q = deque([s])
        found = None
        while q and found is None:
            v = q.popleft()
            for w in sorted(adj[v]):
                if w not in members:
                    continue
                if w == s:
                    found = v
                    break
                if w not in prev:
                    prev[w] = v
                    q.append(w)
        if found is not None:
            cyc = [found]
            while prev[cyc[-1]] is not None:
                cyc.append(prev[cyc[-1]])
            cyc.reverse()
            if best is None or len(cyc) < len(best):
                best = cyc
    return best


def crate_roots(src):
    roots = []
    for name in ("lib.rs", "main.rs"):
        if os.path.isfile(os.path.join(src, name)):
            roots.append((name[:-3], os.path.join(src, name)))
    bindir = os.path.join(src, "bin")
    if os.path.isdir(bindir):
        for entry in sorted(os.listdir(bindir)):
            p = os.path.join(bindir, entry)
            if entry.endswith(".rs"):
                roots.append(("bin " + entry[:-3], p))
            elif os.path.isfile(os.path.join(p, "main.rs")):
                roots.append(("bin " + entry, os.path.join(p, "main.rs")))
    return roots


def check(src, out=sys.stdout):
    """Checks every crate rooted in src. Returns the number of cycles found."""
    roots = crate_roots(src)
    if not roots:
        print(f"{src}: no lib.rs, main.rs or bin/ here", file=sys.stderr)
        return -1
    found = 0
    for label, root in roots:
        modules = build_tree(root)
        edges = edges_of(modules)
        adj = defaultdict(set)
        for (a, b) in edges:
            adj[a].add(b)
        comps = sccs(modules.keys(), adj)
        where = f"{src} ({label})"
        if not comps:
            print(f"ok: {where}: {len(modules)} modules, {len(edges)} edges, no cycle", file=out)
            continue
        found += len(comps)
        print(f"CYCLES: {where}: {len(modules)} modules, {len(comps)} strongly connected "
              f"component(s)", file=out)
        for n, comp in enumerate(comps, 1):
            members = set(comp)
            print(f"\n  component {n}: {len(comp)} modules: "
                  + ", ".join(name_of(c) for c in comp), file=out)
            cyc = shortest_cycle(comp, adj)
            if cyc:
                print("  shortest cycle: " + " -> ".join(name_of(c) for c in cyc + [cyc[0]]),
                      file=out)
            print("  edges inside it:", file=out)
            for (a, b) in sorted(edges):
                if a in members and b in members:
                    locs = sorted(edges[(a, b)])
                    rel = os.path.relpath(modules[a].file)
                    shown = ", ".join(f"{rel}:{ln}" for ln in locs[:4])
                    more = f" (+{len(locs) - 4} more)" if len(locs) > 4 else ""
                    print(f"    {name_of(a)} -> {name_of(b)}: {shown}{more}", file=out)
        print(file=out)
    return found


# --------------------------------------------------------------------------------------------
# Self-test
# --------------------------------------------------------------------------------------------

SELF_TEST_CRATES = {
    # a -> b -> c -> a, closed in three different ways (use tree, path in code, super::).
    "cyclic": {
        "lib.rs": "//! root\nmod a;\npub mod b;\nmod c;\n",
        "a.rs": "use crate::{b::{self, X}, c as _};\n",
        "b.rs": "pub struct X;\npub fn f() { crate::c::g(); }\n",
        "c/mod.rs": "mod inner;\npub fn g() { inner::h(); }\n",
        "c/inner.rs": "pub fn h() { super::super::a::k(); }\n",
    },
    # Only downward edges; every trap that must not make an edge.
    "acyclic": {
        "lib.rs": ("mod a;\nmod b;\n"
                   "pub fn root() { a::f(); }\n"),
        "a.rs": ("//! Uses [`crate::b`] only in docs: crate::lib_item\n"
                 "mod child;\n"
                 "use crate::b::B;\n"
                 "pub fn f() { let _ = \"crate::root()\"; let _ = r#\"super::x\"#; "
                 "let _c = '\"'; child::leaf(); }\n"
                 "/* crate::root() */\n"
                 "#[cfg(test)]\nmod tests { use crate::root; fn t() { crate::root(); } }\n"
                 "#[cfg(any(test, feature = \"pg_test\"))]\n#[pg_schema]\n"
                 "mod pg_tests { use super::super::root; }\n"
                 "#[cfg(test)]\nmod tests_file;\n"),
        "a/child.rs": "pub fn leaf() {}\n",
        "a/tests_file.rs": "use crate::root;\n",
        "b.rs": ("pub struct B;\n"
                 "#[cfg(not(test))]\npub fn prod() -> u8 { 1 }\n"
                 "fn lifetimes<'a>(x: &'a str) -> &'a str { x }\n"
                 # super:: in an inline module is this file's module, not the root.
                 "#[pg_schema]\nmod remus { use super::*; fn x() { super::prod(); } }\n"),
    },
    # A facade mod.rs: re-exports its children, whose items the children share through it.
    "facade": {
        "lib.rs": "mod p;\nmod q;\n",
        "p/mod.rs": ("mod a;\nmod b;\npub use a::A;\npub(crate) use b::{helper as h, B};\n"
                     "pub struct Shared;\n"),
        "p/a.rs": "use super::{Shared, B};\npub struct A;\n",
        "p/b.rs": "use super::Shared;\npub struct B;\npub fn helper() {}\n",
        "q.rs": "use crate::p::A;\nfn f() { crate::p::h(); }\n",
    },
    # A cycle hidden behind a re-export: q -> p::a (through p's `pub use`) -> q.
    "through_reexport": {
        "lib.rs": "mod p;\nmod q;\n",
        "p/mod.rs": "mod a;\npub use a::A;\n",
        "p/a.rs": "pub struct A;\nfn f() { crate::q::g(); }\n",
        "q.rs": "pub fn g() {}\nfn k(_: crate::p::A) {}\n",
    },
    # A child that uses super:: while the parent calls the child: a parent/child cycle, also
    # when the parent calls it through its own re-export.
    "parent_child": {
        "lib.rs": "mod p;\n",
        "p/mod.rs": ("mod q;\nmod r;\npub use r::other;\npub fn shared() {}\n"
                     "pub fn go() { q::run(); other(); }\n"),
        "p/q.rs": "pub fn run() { super::shared(); }\n",
        "p/r.rs": "pub fn other() { super::shared(); }\n",
    },
}


def self_test():
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, files in SELF_TEST_CRATES.items():
            src = os.path.join(tmp, name, "src")
            for rel, text in files.items():
                p = os.path.join(src, rel)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "w", encoding="utf-8") as f:
                    f.write(text)
        import io
        buf = io.StringIO()
        n = check(os.path.join(tmp, "cyclic", "src"), buf)
        report = buf.getvalue()
        if n != 1 or "component 1: 4 modules: a, b, c, c::inner" not in report \
                or "c::inner -> a" not in report or "a -> b" not in report:
            print("self-test FAILED: the cycle a -> b -> c -> c::inner -> a was not reported:\n"
                  + report)
            ok = False
        buf = io.StringIO()
        n = check(os.path.join(tmp, "acyclic", "src"), buf)
        if n != 0:
            print("self-test FAILED: an acyclic crate was reported:\n" + buf.getvalue())
            ok = False
        buf = io.StringIO()
        n = check(os.path.join(tmp, "parent_child", "src"), buf)
        out = buf.getvalue()
        if n != 1 or "component 1: 3 modules: p, p::q, p::r" not in out or "p -> p::q" not in out \
                or "p::q -> p" not in out or "p -> p::r" not in out:
            print("self-test FAILED: the parent/child cycles were not reported:\n" + out)
            ok = False
        buf = io.StringIO()
        n = check(os.path.join(tmp, "facade", "src"), buf)
        if n != 0:
            print("self-test FAILED: a facade mod.rs was reported:\n" + buf.getvalue())
            ok = False
        buf = io.StringIO()
        n = check(os.path.join(tmp, "through_reexport", "src"), buf)
        out = buf.getvalue()
        if n != 1 or "q -> p::a" not in out or "p::a -> q" not in out:
            print("self-test FAILED: the cycle through a re-export was not reported:\n" + out)
            ok = False
    print("self-test passed" if ok else "self-test failed")
    return 0 if ok else 1


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if any(a.startswith("-") for a in argv[1:]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    srcs = argv[1:] or [os.path.join(repo, "pg_remus", "src")]
    total = 0
    for src in srcs:
        n = check(src)
        if n < 0:
            return 2
        total += n
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
