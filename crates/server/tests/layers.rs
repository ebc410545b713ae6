//! Keeps the layer rule of `src/lib.rs` (in the spirit of Firecracker's
//! `verify_dependencies.rs`): a source scan that fails, naming the file and
//! the line, when a file of one layer reaches where its layer may not, when a
//! file sits outside the layers, or when modules import each other in a
//! circle.
//!
//! - `domain/` imports nothing of the crate but `domain`; no axum, store,
//!   host, file system or task.
//! - `store/` may use `domain` and `error`, never `service` or `http`.
//! - `service/` never names `http` or HTTP types.
//! - `http/routes/` reach the store and the host only through services.
//! - Outside `http/` nothing names axum, `StatusCode` or `Bytes`.

#![allow(clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Root files not yet split into the layers (none since issue 12 moved the
/// last): a file here that no longer exists fails the test, so a list made
/// for a later move can only shrink.
const PENDING: &[&str] = &[];

/// Files at the root that belong to every layer.
const ROOT: &[&str] = &["lib.rs", "error.rs"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's text without its `#[cfg(test)] mod tests` and comments.
fn code(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_tests = false;
    for (i, line) in text.lines().enumerate() {
        if line.starts_with("#[cfg(test)]") {
            in_tests = true;
        }
        if in_tests {
            continue;
        }
        let l = line.trim_start();
        if l.starts_with("//") {
            continue;
        }
        let l = match l.find(" //") {
            Some(k) => &l[..k],
            None => l,
        };
        out.push((i + 1, l.to_string()));
    }
    out
}

/// `domain/lifecycle.rs` → `domain::lifecycle`; `http/mod.rs` → `http`.
fn module_of(rel: &str) -> String {
    let m = rel.trim_end_matches(".rs").trim_end_matches("/mod");
    m.replace('/', "::")
}

/// The crate modules a line names (`crate::a::b::c` gives every prefix
/// that is a module of the crate, longest first).
fn crate_paths(line: &str, modules: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(k) = rest.find("crate::") {
        rest = &rest[k + "crate::".len()..];
        let path: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let mut parts: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        // `use crate::{a, b::c}` names several.
        if rest[path.len()..].starts_with('{') || path.is_empty() {
            let inner: String = rest[path.len()..]
                .trim_start_matches('{')
                .chars()
                .take_while(|c| *c != '}')
                .collect();
            for item in inner.split(',') {
                let mut p = parts.clone();
                p.extend(item.trim().split("::").filter(|s| !s.is_empty()));
                if let Some(m) = longest_module(&p, modules) {
                    out.push(m);
                }
            }
            continue;
        }
        while parts.len() > 1 && !modules.contains(&parts.join("::")) {
            parts.pop();
        }
        if let Some(m) = longest_module(&parts, modules) {
            out.push(m);
        }
    }
    out.dedup();
    out
}

fn longest_module(parts: &[&str], modules: &BTreeSet<String>) -> Option<String> {
    (1..=parts.len())
        .rev()
        .map(|n| parts[..n].join("::"))
        .find(|m| modules.contains(m))
}

struct Tree {
    /// Relative path → code lines.
    files: BTreeMap<String, Vec<(usize, String)>>,
    modules: BTreeSet<String>,
}

fn tree() -> Tree {
    let root = src();
    let mut paths = Vec::new();
    rust_files(&root, &mut paths);
    let mut files = BTreeMap::new();
    let mut modules = BTreeSet::new();
    for p in paths {
        let rel = p
            .strip_prefix(&root)
            .expect("under src")
            .to_string_lossy()
            .replace('\\', "/");
        if rel == "lib.rs" {
            continue;
        }
        modules.insert(module_of(&rel));
        let text = std::fs::read_to_string(&p).expect("read a source file");
        files.insert(rel, code(&text));
    }
    Tree { files, modules }
}

fn layer(rel: &str) -> &str {
    rel.split('/').next().unwrap_or(rel)
}

#[test]
fn every_file_is_in_a_layer_or_still_pending() {
    let t = tree();
    let mut wrong = Vec::new();
    for rel in t.files.keys() {
        if rel.contains('/') || ROOT.contains(&rel.as_str()) || PENDING.contains(&rel.as_str()) {
            continue;
        }
        wrong.push(format!(
            "{rel}: a root file outside the layers (http/, service/, domain/, store/)"
        ));
    }
    for p in PENDING {
        if !t.files.contains_key(*p) {
            wrong.push(format!(
                "{p}: listed as pending but gone; take it off PENDING"
            ));
        }
    }
    for rel in t.files.keys() {
        let l = layer(rel);
        if rel.contains('/') && !["http", "service", "domain", "store"].contains(&l) {
            wrong.push(format!("{rel}: {l}/ is not a layer"));
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

#[test]
fn each_layer_reaches_only_where_it_may() {
    let t = tree();
    let mut wrong = Vec::new();
    for (rel, lines) in &t.files {
        let l = layer(rel);
        let pending = PENDING.contains(&rel.as_str());
        for (n, line) in lines {
            let named = crate_paths(line, &t.modules);
            let mut refuse = |why: String| wrong.push(format!("{rel}:{n}: {why}: {line}"));
            let http_types = ["axum", "StatusCode", "Bytes", "HeaderMap"];
            if l != "http" && !pending && rel != "lib.rs" {
                for w in http_types {
                    if line
                        .split(|c: char| !c.is_alphanumeric() && c != '_')
                        .any(|x| x == w)
                    {
                        refuse(format!("names {w} outside http/"));
                    }
                }
            }
            for m in &named {
                let target = m.split("::").next().unwrap_or(m);
                match l {
                    "domain" if target != "domain" => refuse(format!("domain/ imports crate::{m}")),
                    "store" if !["domain", "error", "store"].contains(&target) => {
                        refuse(format!("store/ imports crate::{m}"))
                    }
                    "service" if target == "http" => refuse(format!("service/ imports crate::{m}")),
                    _ => {}
                }
            }
            if l == "domain" {
                // The host crate by path (`runtime_host::…`, `use
                // runtime_host`), not a metric's name that starts alike.
                for w in [
                    "rusqlite",
                    "runtime_host::",
                    "use runtime_host",
                    "tokio",
                    "std::fs",
                    "AppState",
                ] {
                    if line.contains(w) {
                        refuse(format!("domain/ names {w}"));
                    }
                }
            }
            if rel.starts_with("http/routes/") {
                for w in [".store()", ".host()", "crate::store", "runtime_host::Host"] {
                    if line.contains(w) {
                        refuse(format!("a route reaches {w} itself"));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

#[test]
fn no_modules_import_each_other_in_a_circle() {
    let t = tree();
    // Edges between layered files (pending files are left out until moved).
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let layered: BTreeMap<String, &String> = t
        .files
        .keys()
        .filter(|r| !PENDING.contains(&r.as_str()))
        .map(|r| (module_of(r), r))
        .collect();
    for (m, rel) in &layered {
        let e = edges.entry(m.clone()).or_default();
        for (_, line) in &t.files[*rel] {
            for target in crate_paths(line, &t.modules) {
                if &target != m
                    && layered.contains_key(&target)
                    && !m.starts_with(&format!("{target}::"))
                {
                    e.insert(target);
                }
            }
        }
    }
    let cycles = strongly_connected(&edges);
    let shown: Vec<String> = cycles.iter().map(|c| c.join(" <-> ")).collect();
    assert!(
        shown.is_empty(),
        "modules in a circle:\n{}",
        shown.join("\n")
    );
}

/// Tarjan's algorithm: the components of more than one module.
fn strongly_connected(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct S<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        n: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut S<'a>, v: &'a str) {
        s.index.insert(v, s.n);
        s.low.insert(v, s.n);
        s.n += 1;
        s.stack.push(v);
        s.on.insert(v);
        if let Some(ws) = s.edges.get(v) {
            for w in ws {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let lw = s.low[w];
                    let lv = s.low[v];
                    s.low.insert(v, lv.min(lw));
                } else if s.on.contains(w) {
                    let iw = s.index[w];
                    let lv = s.low[v];
                    s.low.insert(v, lv.min(iw));
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = S {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        n: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[test]
fn the_scan_sees_what_it_checks() {
    // The scan itself: a crate path resolves to the longest module it names.
    let modules: BTreeSet<String> = ["domain", "domain::lifecycle", "http", "http::extract"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        crate_paths("use crate::domain::lifecycle::{next, Event};", &modules),
        vec!["domain::lifecycle".to_string()]
    );
    assert_eq!(
        crate_paths(
            "use crate::{domain::lifecycle, http::extract::Fields};",
            &modules
        ),
        vec!["domain::lifecycle".to_string(), "http::extract".to_string()]
    );
    let mut e = BTreeMap::new();
    e.insert("a".to_string(), ["b".to_string()].into_iter().collect());
    e.insert("b".to_string(), ["a".to_string()].into_iter().collect());
    e.insert("c".to_string(), ["a".to_string()].into_iter().collect());
    assert_eq!(
        strongly_connected(&e),
        vec![vec!["a".to_string(), "b".to_string()]]
    );
    assert_eq!(module_of("http/mod.rs"), "http");
    assert_eq!(module_of("domain/image/recipe.rs"), "domain::image::recipe");
}

#[test]
fn every_error_code_is_a_constant_of_the_contract() {
    // `code: "..."` outside tests: a code the contract crate does not name.
    let t = tree();
    let mut wrong = Vec::new();
    for (rel, lines) in &t.files {
        for (n, line) in lines {
            if let Some(k) = line.find("code: \"") {
                let rest = &line[k + 7..];
                if rest.starts_with(|c: char| c.is_ascii_lowercase()) {
                    wrong.push(format!("{rel}:{n}: use runtime_api::codes: {line}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

/// The values of `runtime_api::codes`, read from its source.
fn contract_codes() -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../api/src/lib.rs");
    let text = std::fs::read_to_string(path).expect("read the contract crate");
    let start = text.find("pub mod codes {").expect("a codes module");
    let body = &text[start..start + text[start..].find("\n}").expect("its end")];
    body.lines()
        .filter_map(|l| l.trim().strip_prefix("pub const "))
        .filter_map(|l| l.split('"').nth(1))
        .map(String::from)
        .collect()
}

#[test]
fn no_code_of_the_contract_is_written_as_a_literal() {
    // Codes of one word ("busy", "conflict") are words of other strings too.
    let codes: Vec<String> = contract_codes()
        .into_iter()
        .filter(|c| c.contains('_'))
        .collect();
    assert!(
        codes.iter().any(|c| c == "preview_unreachable") && codes.len() > 40,
        "the scan of runtime_api::codes found {codes:?}"
    );
    let t = tree();
    let mut wrong = Vec::new();
    for (rel, lines) in &t.files {
        for (n, line) in lines {
            for c in &codes {
                if line.contains(&format!("\"{c}\"")) {
                    wrong.push(format!(
                        "{rel}:{n}: use runtime_api::codes for {c:?}: {line}"
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}
