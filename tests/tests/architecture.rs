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

/// Module paths this file refers to (`crate::a::b`, `super::x`, `self::y`), resolved against
/// the crate's modules.
fn references(
    code: &str,
    me: &[String],
    is_mod_file: bool,
    modules: &BTreeSet<Vec<String>>,
) -> BTreeSet<Vec<String>> {
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
        // The module a bare name in this file lives in: for `mod.rs` files, their own path.
        let here: Vec<String> = if is_mod_file || me.is_empty() {
            me.to_vec()
        } else {
            me[..me.len() - 1].to_vec()
        };
        let mut base = match kw {
            "crate::" => Vec::new(),
            "super::" => here[..here.len().saturating_sub(1)].to_vec(),
            _ => here.clone(),
        };
        let rest = &code[start + kw.len()..];
        let mut segs = rest.split("::").map(|s| {
            s.chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        });
        // Also `super::super::`.
        let mut first = segs.next().unwrap_or_default();
        while first == "super" {
            base.pop();
            first = segs.next().unwrap_or_default();
        }
        let mut path = base;
        let mut best = None;
        for seg in std::iter::once(first).chain(segs) {
            if seg.is_empty() {
                break;
            }
            path.push(seg);
            if modules.contains(&path) {
                best = Some(path.clone());
            } else {
                break;
            }
        }
        if let Some(b) = best {
            out.insert(b);
        }
    }
    out
}

/// Cycles among the children of each module: each edge between two modules is lifted to the
/// children of their deepest common ancestor.
fn cycles(edges: &BTreeSet<(Vec<String>, Vec<String>)>) -> Vec<String> {
    let mut graphs: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
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
    let mut found = Vec::new();
    for (parent, g) in &graphs {
        // Depth-first search for a back edge.
        fn visit(
            n: &str,
            g: &BTreeMap<String, BTreeSet<String>>,
            stack: &mut Vec<String>,
            done: &mut BTreeSet<String>,
        ) -> Option<Vec<String>> {
            if let Some(i) = stack.iter().position(|s| s == n) {
                let mut c = stack[i..].to_vec();
                c.push(n.to_owned());
                return Some(c);
            }
            if done.contains(n) {
                return None;
            }
            stack.push(n.to_owned());
            for m in g.get(n).into_iter().flatten() {
                if let Some(c) = visit(m, g, stack, done) {
                    return Some(c);
                }
            }
            stack.pop();
            done.insert(n.to_owned());
            None
        }
        let mut done = BTreeSet::new();
        for n in g.keys() {
            if let Some(c) = visit(n, g, &mut Vec::new(), &mut done) {
                found.push(format!(
                    "in {}: {}",
                    if parent.is_empty() {
                        "crate root".into()
                    } else {
                        parent.join("::")
                    },
                    c.join(" -> ")
                ));
                break;
            }
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
            let is_mod_file = rel
                .file_name()
                .is_some_and(|n| n == "mod.rs" || n == "lib.rs" || n == "main.rs");
            parsed.push((m, is_mod_file, product));
        }
        let mut edges = BTreeSet::new();
        for (m, is_mod_file, code) in &parsed {
            for r in references(code, m, *is_mod_file, &modules) {
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
    assert!(c[0].contains("a -> b -> a"), "{c:?}");
    let body = format!(
        "fn long() {{\n{}}}\nfn short() {{ let s = \"}}\"; }}\n",
        "    x();\n".repeat(130)
    );
    let long = long_functions(&code_only(&body));
    assert_eq!(long.len(), 1);
    assert_eq!(long[0].0, "long");
}
