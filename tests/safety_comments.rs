//! Every `unsafe` block and `unsafe impl` in the project carries a `// SAFETY:` comment (on
//! its line or in the comment lines right above its statement), and every `unsafe fn` a
//! `# Safety` section in its documentation, so a reader can check each one.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() && name != "target" && !name.starts_with('.') {
            rust_files(&p, out);
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The code part of a line: without a trailing `//` comment and without string literals.
fn code(line: &str) -> String {
    let mut out = String::new();
    let mut in_str = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => in_str = !in_str,
            '\\' if in_str => {
                chars.next();
            }
            '/' if !in_str && chars.peek() == Some(&'/') => break,
            _ if !in_str => out.push(c),
            _ => {}
        }
    }
    out
}

/// Looks for `marker` on line `i` or above it: through comment and attribute lines, and
/// through the earlier lines of the same statement (lines not ending a statement).
fn justified(lines: &[&str], i: usize, marker: &str) -> bool {
    if lines[i].contains(marker) {
        return true;
    }
    for j in (i.saturating_sub(15)..i).rev() {
        let s = lines[j].trim();
        if s.contains(marker) {
            return true;
        }
        if s.starts_with("//") || s.starts_with("#[") {
            continue;
        }
        if s.is_empty() || s.ends_with(';') || s.ends_with('{') || s.ends_with('}') {
            return false;
        }
    }
    false
}

#[test]
fn every_unsafe_is_justified() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        "src",
        "tests",
        "examples",
        "benches",
        "fuzz",
        "cli/src",
        "cli/tests",
    ] {
        rust_files(&root.join(dir), &mut files);
    }
    files.push(root.join("build.rs"));
    let (mut blocks, mut fns, mut missing) = (0, 0, Vec::new());
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let c = code(line);
            let words: Vec<&str> = c
                .split(|ch: char| !(ch.is_alphanumeric() || ch == '_'))
                .filter(|w| !w.is_empty())
                .collect();
            let Some(at) = words.iter().position(|w| *w == "unsafe") else {
                continue;
            };
            let next = words.get(at + 1).copied().unwrap_or("");
            let where_ = format!("{}:{}: {}", f.display(), i + 1, line.trim());
            let continues_type = i > 0 && code(lines[i - 1]).trim_end().ends_with('=');
            if words.first() == Some(&"type") || continues_type {
                continue; // a function pointer type, not code
            }
            if next == "fn" || (next == "extern" && words.contains(&"fn")) {
                fns += 1;
                if !justified(&lines, i, "# Safety") {
                    missing.push(format!("{where_} (no `# Safety` doc)"));
                }
            } else {
                blocks += 1;
                if !justified(&lines, i, "SAFETY:") {
                    missing.push(format!("{where_} (no `// SAFETY:`)"));
                }
            }
        }
    }
    assert!(
        blocks > 50,
        "the scan found only {blocks} unsafe blocks: is it broken?"
    );
    assert!(
        missing.is_empty(),
        "unjustified unsafe:\n{}",
        missing.join("\n")
    );
    println!("SAFETY {blocks} unsafe blocks/impls and {fns} unsafe fns, each justified");
}
