//! The loss, profile and statistics modules import one way only (runtime -> loss -> stats,
//! profile -> loss), the shared names sit in a leaf module, and the plugin library does not
//! depend on the command line's crates or on a TOML editor.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `path` (or `path` itself), with its text.
fn sources(path: &Path) -> Vec<(PathBuf, String)> {
    if path.is_file() {
        let text = std::fs::read_to_string(path).expect("source file");
        return vec![(path.to_path_buf(), text)];
    }
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(path)
        .expect("source directory")
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for entry in entries {
        if entry.is_dir() || entry.extension().is_some_and(|e| e == "rs") {
            out.extend(sources(&entry));
        }
    }
    out
}

/// The top modules of the crate that `text` names as `crate::<module>`, outside comments.
fn crate_paths(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `crate::{a, b::c, d::{e, f}}`: the first segment of each top-level item.
            let (mut depth, mut item) = (0usize, String::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            out.push(item);
        } else {
            out.push(
                rest.chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    out.into_iter()
        .map(|s| s.trim().split("::").next().unwrap_or("").trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Files under `dir` (relative to `src/`) that name one of `forbidden` modules of the crate.
fn violations(dir: &str, forbidden: &[&str]) -> Vec<String> {
    sources(&root().join("src").join(dir))
        .into_iter()
        .flat_map(|(path, text)| {
            crate_paths(&text)
                .into_iter()
                .filter(|m| forbidden.contains(&m.as_str()))
                .map(move |m| format!("{} uses crate::{m}", path.display()))
        })
        .collect()
}

#[test]
fn loss_imports_neither_profile_nor_stats_nor_the_layers_above() {
    let bad = violations(
        "loss",
        &[
            "profile",
            "stats",
            "plugin",
            "runtime",
            "abi",
            "transport",
            "control",
        ],
    );
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn stats_imports_neither_loss_nor_profile_nor_the_layers_above() {
    let bad = violations(
        "stats",
        &[
            "loss",
            "profile",
            "plugin",
            "runtime",
            "abi",
            "transport",
            "control",
        ],
    );
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn the_shared_names_are_a_leaf() {
    let used: Vec<String> = sources(&root().join("src/ids.rs"))
        .into_iter()
        .flat_map(|(_, text)| crate_paths(&text))
        .collect();
    assert!(used.is_empty(), "src/ids.rs uses {used:?}");
}

#[test]
fn the_finder_sees_imports() {
    // The scanner above must see the forms imports take, or the tests prove nothing.
    let text = "use crate::profile::Profile;\nuse crate::{\n    stats::{a, b},\n    Error,\n};\n// crate::abi\nx(crate::loss::f);";
    assert_eq!(crate_paths(text), ["profile", "stats", "Error", "loss"]);
}

#[test]
fn the_library_depends_on_no_cli_crate_or_toml_editor() {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-e", "normal", "--prefix", "none"])
        .args(["-p", "nccl-net-lossy", "--manifest-path"])
        .arg(root().join("Cargo.toml"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    for krate in ["toml_edit", "clap", "plotters"] {
        assert!(
            !tree.lines().any(|l| l.split(' ').next() == Some(krate)),
            "nccl-net-lossy depends on {krate}:\n{tree}"
        );
    }
    assert!(tree.lines().any(|l| l.starts_with("toml ")), "{tree}");
}
