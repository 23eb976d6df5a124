//! The rules of the layout (see `docs/architecture.md`), checked on the sources:
//!
//! 1. Dependency arrows between crates: a shard node never imports the coordinator, the model
//!    worker imports neither, proto, common and the Raft core import no process crate, and
//!    `ragctl` talks to the cluster only through the public gRPC API.
//! 2. No import cycle between the modules of a product crate: for every module, the graph of
//!    its children's references to each other (through `crate::`, `super::` and `self::`
//!    paths) has no cycle. A child using its parent's items is containment, not a cycle.
//! 3. No function over 120 lines and no file over 800 lines outside tests.
//! 4. No shard error recognised by its message, no Raft role compared as a string.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ragcluster_tests::workspace;

/// Product crates: (directory, package name).
const CRATES: &[(&str, &str)] = &[
    ("proto", "ragcluster-proto"),
    ("common", "ragcluster-common"),
    ("raft-core", "ragcluster-raft"),
    ("shard-node", "shard-node"),
    ("coordinator", "coordinator"),
    ("colocated", "colocated"),
    ("model-worker", "model-worker"),
    ("ragctl", "ragctl"),
];

/// Arrows that must never exist: (crate, crates it must not depend on).
const FORBIDDEN: &[(&str, &[&str])] = &[
    (
        "ragcluster-proto",
        &[
            "ragcluster-common",
            "ragcluster-raft",
            "shard-node",
            "coordinator",
            "model-worker",
            "ragctl",
        ],
    ),
    (
        "ragcluster-common",
        &[
            "ragcluster-raft",
            "shard-node",
            "coordinator",
            "model-worker",
            "ragctl",
        ],
    ),
    (
        "ragcluster-raft",
        &[
            "ragcluster-proto",
            "ragcluster-common",
            "shard-node",
            "coordinator",
            "model-worker",
            "ragctl",
        ],
    ),
    (
        "shard-node",
        &["coordinator", "colocated", "model-worker", "ragctl"],
    ),
    // Composes the coordinator and a shard node in one process; nothing imports it.
    ("colocated", &["model-worker", "ragctl"]),
    (
        "model-worker",
        &["coordinator", "shard-node", "ragcluster-raft", "ragctl"],
    ),
    (
        "coordinator",
        &["shard-node", "colocated", "model-worker", "ragctl"],
    ),
    (
        "ragctl",
        &[
            "coordinator",
            "shard-node",
            "model-worker",
            "ragcluster-raft",
        ],
    ),
];

/// What Raft roles and member kinds were once spelled as.
const RAFT_ROLES: &[&str] = &[
    "leader",
    "follower",
    "learner",
    "candidate",
    "pre-candidate",
    "unreachable",
    "stopped",
    "removed",
    "shard-node",
    "model-worker",
];

const MAX_FN_LINES: usize = 120;
const MAX_FILE_LINES: usize = 800;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| dir.display().to_string())? {
        let p = e?.path();
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// The source with comments, string and char literals blanked out (same length, newlines
/// kept), so braces and paths can be counted.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = src[i..].find('\n').map_or(b.len(), |n| i + n);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let end = src[i + 2..].find("*/").map_or(b.len(), |n| i + 2 + n + 2);
                blank(&mut out, i, end);
                i = end;
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|c| **c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let start = i + 2 + hashes;
                let end = src[start..]
                    .find(&close)
                    .map_or(b.len(), |n| start + n + close.len());
                blank(&mut out, i, end);
                i = end;
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i, j + 1);
                i = j + 1;
            }
            b'\'' => {
                // A char literal ('x', '\n', '\u{1f}'), not a lifetime ('a).
                if b.get(i + 1) == Some(&b'\\') {
                    let end = src[i + 2..].find('\'').map_or(b.len(), |n| i + 2 + n + 1);
                    blank(&mut out, i, end);
                    i = end;
                } else if let Some(c) = src[i + 1..].chars().next()
                    && src[i + 1 + c.len_utf8()..].starts_with('\'')
                {
                    let end = i + 1 + c.len_utf8() + 1;
                    blank(&mut out, i, end);
                    i = end;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).unwrap_or_default()
}

/// The code before a file's `#[cfg(test)]` module (tests may be long).
fn product_part(code: &str) -> &str {
    let mut at = 0;
    for line in code.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            return &code[..at];
        }
        at += line.len() + 1;
    }
    code
}

/// Functions longer than the limit: (name, first line, lines).
fn long_functions(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(at) = t.find("fn ") else {
            continue;
        };
        let before = &t[..at];
        let is_decl = before.split_whitespace().all(|w| {
            matches!(w, "pub" | "async" | "const" | "unsafe" | "extern") || w.starts_with("pub(")
        });
        if !is_decl {
            continue;
        }
        let name: String = t[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body: from the first `{` after the signature to its match.
        let mut depth = 0i32;
        let mut started = false;
        let mut end = None;
        'scan: for (m, l) in lines.iter().enumerate().skip(n) {
            for c in l.chars() {
                match c {
                    ';' if !started && depth == 0 => break 'scan,
                    '{' => {
                        depth += 1;
                        started = true;
                    }
                    '}' => {
                        depth -= 1;
                        if started && depth == 0 {
                            end = Some(m);
                            break 'scan;
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(e) = end
            && e + 1 - n > MAX_FN_LINES
        {
            out.push((name, n + 1, e + 1 - n));
        }
    }
    out
}

/// The module path of a source file relative to its crate's `src`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts
}

/// The paths a use tree or an expression path spells from `rest` on (the text after its
/// `crate::`, `super::` or `self::`): `a::b::{c, d::{e, self}}` gives `a::b::c`, `a::b::d::e`
/// and `a::b::d`. A path ends at the first token that is neither a name nor `::`, so an
/// expression path (`super::x::f(..)`) and a glob (`a::*`) both give their names.
fn path_tree(rest: &str) -> Vec<Vec<String>> {
    fn name(s: &str) -> (&str, &str) {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        (&s[..end], &s[end..])
    }
    /// Parses one tree at `s`, with `prefix` before it; returns the rest of the text.
    fn tree<'a>(mut s: &'a str, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> &'a str {
        let mut path = prefix;
        loop {
            s = s.trim_start();
            if let Some(group) = s.strip_prefix('{') {
                s = group;
                loop {
                    s = s.trim_start();
                    if let Some(after) = s.strip_prefix('}') {
                        return after;
                    }
                    if s.is_empty() {
                        return s;
                    }
                    let before = s.len();
                    s = tree(s, path.clone(), out);
                    s = s.trim_start();
                    s = s.strip_prefix(',').unwrap_or(s);
                    if s.len() == before {
                        // Not a tree (a stray token): step over it.
                        s = &s[s.chars().next().map_or(0, char::len_utf8)..];
                    }
                }
            }
            let (n, after) = name(s);
            if n.is_empty() {
                out.push(path);
                return s.strip_prefix('*').unwrap_or(s);
            }
            s = after;
            if n != "self" {
                path.push(n.to_owned());
            }
            match s.trim_start().strip_prefix("::") {
                Some(more) => s = more,
                None => {
                    // `as alias` ends the tree; so does anything else.
                    let t = s.trim_start();
                    if let Some(alias) = t.strip_prefix("as ") {
                        s = name(alias.trim_start()).1;
                    }
                    out.push(path);
                    return s;
                }
            }
        }
    }
    let mut out = Vec::new();
    tree(rest, Vec::new(), &mut out);
    out
}

/// Module paths this file refers to (`crate::a::b`, `super::x`, `self::y`, grouped imports
/// included), resolved against the crate's modules. `me` is the module the file is (a
/// `mod.rs` and a `name.rs` alike: `module_of` already names both by their module), so
/// `super::` is `me`'s parent and `self::` is `me`.
fn references(code: &str, me: &[String], modules: &BTreeSet<Vec<String>>) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    let bytes = code.as_bytes();
    for (start, kw) in ["crate::", "super::", "self::"]
        .iter()
        .flat_map(|kw| code.match_indices(kw).map(move |(i, _)| (i, *kw)))
    {
        if start > 0
            && (bytes[start - 1].is_ascii_alphanumeric()
                || bytes[start - 1] == b'_'
                || bytes[start - 1] == b':')
        {
            continue;
        }
        let mut base = match kw {
            "crate::" => Vec::new(),
            "super::" => me[..me.len().saturating_sub(1)].to_vec(),
            _ => me.to_vec(),
        };
        for mut path in path_tree(&code[start + kw.len()..]) {
            // `super::super::`.
            let mut ups = 0;
            while path.first().is_some_and(|s| s == "super") {
                path.remove(0);
                ups += 1;
            }
            let mut at = base.clone();
            at.truncate(at.len().saturating_sub(ups));
            // `super::{self, ..}` or `super::*`: the module itself.
            let mut best = (path.is_empty() && modules.contains(&at)).then(|| at.clone());
            for seg in path {
                at.push(seg);
                if modules.contains(&at) {
                    best = Some(at.clone());
                } else {
                    break;
                }
            }
            if let Some(b) = best {
                out.insert(b);
            }
        }
        base.clear();
    }
    out
}

/// Import circles among the children of each module: each edge between two modules is
/// lifted to the children of their deepest common ancestor, and every strongly connected
/// group of two or more children is one circle, reported with its members and one cycle
/// through them.
fn cycles(edges: &BTreeSet<(Vec<String>, Vec<String>)>) -> Vec<String> {
    type Graph = BTreeMap<String, BTreeSet<String>>;
    let mut graphs: BTreeMap<Vec<String>, Graph> = BTreeMap::new();
    for (a, b) in edges {
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        if common == a.len() || common == b.len() {
            continue; // parent and descendant
        }
        graphs
            .entry(a[..common].to_vec())
            .or_default()
            .entry(a[common].clone())
            .or_default()
            .insert(b[common].clone());
    }
    /// Nodes reachable from `n` (itself included).
    fn reach(n: &str, g: &Graph) -> BTreeSet<String> {
        let mut seen = BTreeSet::from([n.to_owned()]);
        let mut stack = vec![n.to_owned()];
        while let Some(x) = stack.pop() {
            for m in g.get(&x).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    stack.push(m.clone());
                }
            }
        }
        seen
    }
    /// A shortest path from `from` back to itself inside `group`.
    fn cycle_through(from: &str, g: &Graph, group: &BTreeSet<String>) -> Vec<String> {
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([from.to_owned()]);
        while let Some(x) = queue.pop_front() {
            for m in g.get(&x).into_iter().flatten() {
                if m == from {
                    let mut path = vec![x.clone()];
                    while let Some(p) = prev.get(path.last().map_or("", |s| s.as_str())) {
                        path.push(p.clone());
                    }
                    path.reverse();
                    path.push(from.to_owned());
                    return path;
                }
                if group.contains(m) && m != from && !prev.contains_key(m) {
                    prev.insert(m.clone(), x.clone());
                    queue.push_back(m.clone());
                }
            }
        }
        Vec::new()
    }
    let mut found = Vec::new();
    for (parent, g) in &graphs {
        let reaches: BTreeMap<&String, BTreeSet<String>> =
            g.keys().map(|n| (n, reach(n, g))).collect();
        let mut placed = BTreeSet::new();
        for n in g.keys() {
            if placed.contains(n) {
                continue;
            }
            // n's group: the nodes n reaches that reach n back.
            let group: BTreeSet<String> = reaches[n]
                .iter()
                .filter(|m| reaches.get(m).is_some_and(|r| r.contains(n)))
                .cloned()
                .collect();
            placed.extend(group.iter().cloned());
            if group.len() < 2 {
                continue;
            }
            let members: Vec<&str> = group.iter().map(String::as_str).collect();
            found.push(format!(
                "in {}: {{{}}}, e.g. {}",
                if parent.is_empty() {
                    "crate root".into()
                } else {
                    parent.join("::")
                },
                members.join(", "),
                cycle_through(n, g, &group).join(" -> ")
            ));
        }
    }
    found
}

#[test]
fn dependency_arrows() -> Result<()> {
    let root = workspace();
    let mut problems = Vec::new();
    for (dir, name) in CRATES {
        let text = std::fs::read_to_string(root.join(dir).join("Cargo.toml"))?;
        let manifest: toml::Table = text.parse()?;
        let deps: BTreeSet<String> = ["dependencies", "build-dependencies", "dev-dependencies"]
            .iter()
            .filter_map(|s| manifest.get(*s)?.as_table())
            .flat_map(|t| t.keys().cloned())
            .collect();
        let forbidden = FORBIDDEN
            .iter()
            .find(|(n, _)| n == name)
            .map_or(&[][..], |(_, f)| *f);
        for f in forbidden {
            if deps.contains(*f) {
                problems.push(format!("{name} depends on {f}"));
            }
        }
    }
    if !problems.is_empty() {
        bail!("forbidden dependencies:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

#[test]
fn no_import_cycles_and_no_oversized_code() -> Result<()> {
    let root = workspace();
    let mut problems = Vec::new();
    for (dir, _) in CRATES {
        let src = root.join(dir).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files)?;
        let mut parsed = Vec::new();
        let mut modules = BTreeSet::new();
        for f in &files {
            let rel = f.strip_prefix(&src)?.to_path_buf();
            if rel.starts_with("bin") {
                continue;
            }
            let m = module_of(&rel);
            // A `tests.rs` is a `#[cfg(test)] mod tests;` moved out of its parent: test code.
            if m.last().is_some_and(|s| s == "tests") {
                continue;
            }
            modules.insert(m.clone());
            let text = std::fs::read_to_string(f)?;
            let code = code_only(&text);
            let product = product_part(&code).to_owned();
            let lines = product.lines().count();
            if lines > MAX_FILE_LINES {
                problems.push(format!(
                    "{}: {lines} lines outside tests (at most {MAX_FILE_LINES})",
                    f.display()
                ));
            }
            for (name, at, n) in long_functions(&product) {
                problems.push(format!(
                    "{}:{at}: fn {name} has {n} lines (at most {MAX_FN_LINES})",
                    f.display()
                ));
            }
            if product.contains("contains(\"not the") || text.contains("contains(\"not the") {
                problems.push(format!(
                    "{}: an error recognised by its message",
                    f.display()
                ));
            }
            for role in RAFT_ROLES {
                for op in ["==", "!="] {
                    if text.contains(&format!("role {op} \"{role}\"")) {
                        problems.push(format!("{}: a role compared as a string", f.display()));
                    }
                }
            }
            if text.contains("impl State {") || text.contains("impl crate::State") {
                problems.push(format!("{}: impl State", f.display()));
            }
            parsed.push((m, product));
        }
        let mut edges = BTreeSet::new();
        for (m, code) in &parsed {
            for r in references(code, m, &modules) {
                if &r != m {
                    edges.insert((m.clone(), r));
                }
            }
        }
        for c in cycles(&edges) {
            problems.push(format!("{dir}: import cycle {c}"));
        }
    }
    if !problems.is_empty() {
        bail!(
            "{} layout problems:\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    Ok(())
}

#[test]
fn the_checker_sees_cycles_and_long_functions() {
    let m = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    let edges: BTreeSet<_> = [
        (m("a"), m("b::x")),
        (m("b::y"), m("a")),
        (m("c::d"), m("c")),
    ]
    .into_iter()
    .collect();
    let c = cycles(&edges);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].contains("{a, b}, e.g. a -> b -> a"), "{c:?}");
    let body = format!(
        "fn long() {{\n{}}}\nfn short() {{ let s = \"}}\"; }}\n",
        "    x();\n".repeat(130)
    );
    let long = long_functions(&code_only(&body));
    assert_eq!(long.len(), 1);
    assert_eq!(long[0].0, "long");
}

/// The modules of a small crate: `a` (a folder: `a/mod.rs`) with children `x` and `y`, and
/// `b`, `c` beside it.
fn toy_modules() -> BTreeSet<Vec<String>> {
    ["", "a", "a::x", "a::y", "a::y::z", "b", "c"]
        .iter()
        .map(|m| {
            m.split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .collect()
}

fn refs(code: &str, me: &str) -> Vec<String> {
    let me: Vec<String> = me.split("::").map(str::to_owned).collect();
    references(code, &me, &toy_modules())
        .into_iter()
        .map(|p| p.join("::"))
        .collect()
}

#[test]
fn resolver_super_from_mod_rs_and_from_named_files() {
    // `a/mod.rs` is module `a`: its `super::` is the crate root.
    assert_eq!(refs("use super::b::Thing;", "a"), ["b"]);
    assert_eq!(refs("use self::x::Thing;", "a"), ["a::x"]);
    // `a/x.rs` is module `a::x`: its `super::` is `a`, not the crate root.
    assert_eq!(refs("use super::y::Thing;", "a::x"), ["a::y"]);
    assert_eq!(refs("let v = super::y::make();", "a::x"), ["a::y"]);
    assert_eq!(refs("use super::super::b::T;", "a::x"), ["b"]);
    // `a/y/z.rs`: two levels up is `a`, three the root.
    assert_eq!(refs("use super::super::x::T;", "a::y::z"), ["a::x"]);
    assert_eq!(refs("use super::super::super::c;", "a::y::z"), ["c"]);
    assert_eq!(refs("use crate::a::y::z::T;", "b"), ["a::y::z"]);
}

#[test]
fn resolver_reads_grouped_imports() {
    assert_eq!(refs("use super::{x::T, y};", "a::x"), ["a::x", "a::y"]);
    assert_eq!(
        refs(
            "use crate::{\n    a::{self, x::{T, U}},\n    b::V as W,\n    c,\n};",
            "a::y"
        ),
        ["a", "a::x", "b", "c"]
    );
    assert_eq!(
        refs("use crate::a::{x, y::{z::*}};", "b"),
        ["a::x", "a::y::z"]
    );
    assert_eq!(refs("use super::{self, y};", "a::x"), ["a", "a::y"]);
}

#[test]
fn a_circle_through_grouped_imports_and_super_is_caught() {
    let modules = toy_modules();
    let m = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    // a/x.rs and a/y.rs import each other, one through a group and one through `super::`.
    let mut edges = BTreeSet::new();
    for (me, code) in [
        ("a::x", "use super::{y::Thing, Other};"),
        ("a::y", "use super::x::Thing;"),
    ] {
        for r in references(code, &m(me), &modules) {
            if r != m(me) {
                edges.insert((m(me), r));
            }
        }
    }
    let c = cycles(&edges);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].starts_with("in a: {x, y}"), "{c:?}");
}
