//! The architecture as a test: the plugin library depends on no command-line or plotting
//! crate, its top modules import each other in one direction only, and no source file grows
//! past what a reader can hold (docs/architecture.md).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Longest non-test source file, in lines (the code before its `#[cfg(test)]` part).
const MAX_LINES: usize = 800;

/// Imports that would reverse the direction data flows in (abi -> runtime -> loss /
/// transport -> stats), each with why it is wrong, checked on top of "no circle".
const FORBIDDEN: &[(&str, &str, &str)] = &[
    (
        "loss",
        "profile",
        "the loss engine takes rules and defaults, not a profile",
    ),
    (
        "stats",
        "loss",
        "statistics take runs of lost packets, not loss types",
    ),
    (
        "transport",
        "abi",
        "transports use the ABI as data (ffi), never the exported edge",
    ),
    (
        "transport",
        "runtime",
        "the runtime drives transports, not the reverse",
    ),
    ("loss", "runtime", "loss models are pure"),
    (
        "stats",
        "runtime",
        "statistics are fed by the runtime, not the reverse",
    ),
];

/// Modules that import no other module of the crate: the names shared across layers, and
/// the error type.
const LEAVES: &[&str] = &["ids", "error"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a source file without its test part: files named `tests.rs` (or under a
/// `tests/` folder) are all test; elsewhere the test part starts at the first `#[cfg(test)]`.
fn production_code(path: &Path) -> Option<String> {
    if path.file_name().is_some_and(|n| n == "tests.rs")
        || path.components().any(|c| c.as_os_str() == "tests")
    {
        return None;
    }
    let text = std::fs::read_to_string(path).expect("read a source file");
    let code: Vec<&str> = text
        .lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .collect();
    Some(code.join("\n"))
}

/// The top module a file of `src/` belongs to (`src/loss/engine.rs` -> `loss`).
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib").then(|| name.to_string())
}

/// The top modules that `code` names as `crate::<module>` (also inside grouped imports such
/// as `crate::{a, b::c}`), comments left out.
fn crate_imports(code: &str) -> BTreeSet<String> {
    let code: String = code
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut items = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The first path segment of each top-level item of the group.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            items.push(item);
        } else {
            items.push(
                rest.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    items
        .iter()
        .map(|s| s.trim().split("::").next().unwrap_or("").trim().to_string())
        .filter(|s| s.chars().next().is_some_and(|c| c.is_ascii_lowercase()))
        .collect()
}

/// Which top module of the library imports which (production code only).
fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut modules = BTreeSet::new();
    for f in &files {
        if let Some(m) = top_module(&src, f) {
            modules.insert(m);
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let (Some(from), Some(code)) = (top_module(&src, f), production_code(f)) else {
            continue;
        };
        for to in crate_imports(&code) {
            if to != from && modules.contains(&to) {
                graph.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    graph
}

/// A circle in `graph`, if there is one, as the list of modules around it.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        stack.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == next).unwrap_or(0);
                    let mut circle = stack[at..].to_vec();
                    circle.push(next.clone());
                    return Some(circle);
                }
                0 => {
                    if let Some(c) = visit(next, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if state.get(node.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(node, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn circle_finder_finds_a_circle() {
    // The check below is only as good as this: a graph with a circle must be caught.
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("c".into());
    assert_eq!(find_circle(&g), None);
    g.entry("c".into()).or_default().insert("a".into());
    assert_eq!(
        find_circle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let text = "use crate::loss::plan; // crate::abi\nuse crate::{\n    stats::{a, b},\n    Error,\n    log,\n};\nx(crate::profile::f);";
    assert_eq!(
        crate_imports(text),
        BTreeSet::from(["loss", "stats", "log", "profile"].map(String::from))
    );
}

#[test]
fn top_modules_import_in_one_direction() {
    let graph = import_graph();
    assert!(
        graph.values().any(|to| !to.is_empty()),
        "no imports found: is the scan broken? {graph:?}"
    );
    if let Some(circle) = find_circle(&graph) {
        panic!(
            "import circle: {}\nfull graph: {graph:#?}",
            circle.join(" -> ")
        );
    }
    for leaf in LEAVES {
        let used = graph.get(*leaf).cloned().unwrap_or_default();
        assert!(
            used.is_empty(),
            "`{leaf}` must be a leaf but imports {used:?}"
        );
    }
    let ffi = graph.get("ffi").cloned().unwrap_or_default();
    assert!(
        ffi.iter().all(|m| m == "error"),
        "`ffi` (the ABI as data) may use only the error type, but imports {ffi:?}"
    );
    for (from, to, why) in FORBIDDEN {
        assert!(
            !graph.get(*from).is_some_and(|s| s.contains(*to)),
            "`{from}` imports `{to}`: {why}"
        );
    }
}

#[test]
fn no_source_file_is_too_long() {
    let mut files = Vec::new();
    for dir in ["src", "cli/src"] {
        rust_files(&root().join(dir), &mut files);
    }
    assert!(files.len() > 10, "found only {} source files", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = production_code(f)?.lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "over {MAX_LINES} lines: {long:?}");
}

#[test]
fn the_plugin_library_has_no_cli_dependencies() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root())
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "-p",
            "nccl-net-lossy",
            "--prefix",
            "none",
        ])
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: BTreeSet<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        crates.contains("libc"),
        "unexpected cargo tree output: {tree}"
    );
    for unwanted in ["clap", "plotters", "toml_edit", "lossy-cli"] {
        assert!(
            !crates.contains(unwanted),
            "the plugin library depends on {unwanted}:\n{tree}"
        );
    }
}
