//! Reading the plugin's environment variables in one place: a value that is not UTF-8 is an
//! error naming the variable, never taken as unset (a run that asked to wrap a plugin must not
//! silently run over sockets; docs/transport.md).

use crate::error::{Error, Result};

/// The value of the variable `name`: `None` when it is unset, an error naming it when its
/// value is not UTF-8.
pub fn var(name: &str) -> Result<Option<String>> {
    match std::env::var_os(name) {
        None => Ok(None),
        Some(value) => value.into_string().map(Some).map_err(|_| {
            Error::invalid_argument(format!(
                "{name} is not valid UTF-8: give it a UTF-8 value, or unset it"
            ))
        }),
    }
}

/// The variables named `NCCL_LOSSY_*` that this project reads: the plugin's, the `lossy`
/// command's (`NCCL_LOSSY_RENDEZVOUS*`) and the Python helper's and its tests'
/// (`NCCL_LOSSY_LIBRARY`, `NCCL_LOSSY_CLI`, `NCCL_LOSSY_CI_VENV`).
pub const KNOWN_VARS: [&str; 17] = [
    "NCCL_LOSSY_PROFILE",
    "NCCL_LOSSY_SET",
    "NCCL_LOSSY_STATS",
    "NCCL_LOSSY_TRACE",
    "NCCL_LOSSY_TRACE_EVENTS",
    "NCCL_LOSSY_INNER",
    "NCCL_LOSSY_NSOCKS",
    "NCCL_LOSSY_TIMEOUT",
    "NCCL_LOSSY_DELAYED_ACKS",
    "NCCL_LOSSY_SOCKBUF",
    "NCCL_LOSSY_SPEED_MBPS",
    "NCCL_LOSSY_IO_THREADS",
    "NCCL_LOSSY_RENDEZVOUS",
    "NCCL_LOSSY_RENDEZVOUS_PORT",
    "NCCL_LOSSY_LIBRARY",
    "NCCL_LOSSY_CLI",
    "NCCL_LOSSY_CI_VENV",
];

/// A warning for each variable of the environment named `NCCL_LOSSY_*` that is none of
/// [`KNOWN_VARS`] (a misspelt `NCCL_LOSSY_PROFIL` was ignored without a word, and the run
/// used the embedded default), with the known name it is closest to.
pub fn unknown_var_warnings() -> Vec<String> {
    let mut names: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| name.starts_with("NCCL_LOSSY_") && !KNOWN_VARS.contains(&name.as_str()))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let value = std::env::var_os(&name).unwrap_or_default();
            let closest = KNOWN_VARS
                .iter()
                .map(|known| (edit_distance(&name, known), *known))
                .min()
                .filter(|(distance, _)| *distance <= 3)
                .map(|(_, known)| format!(": did you mean {known}?"))
                .unwrap_or_default();
            format!(
                "{}={} is not a variable of nccl-net-lossy and is ignored{closest} (its \
                 variables: {})",
                crate::error::echo(&name, str::to_string),
                crate::error::echo(&value.to_string_lossy(), str::to_string),
                KNOWN_VARS.join(", ")
            )
        })
        .collect()
}

/// Levenshtein distance between `a` and `b` (by bytes: the names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, &ca) in a.as_bytes().iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::{edit_distance, KNOWN_VARS};

    /// The `"NCCL_LOSSY_..."` names quoted in `text`.
    fn quoted_names(text: &str) -> Vec<String> {
        text.split("\"NCCL_LOSSY_")
            .skip(1)
            .filter_map(|rest| {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                rest[name.len()..]
                    .starts_with('"')
                    .then(|| format!("NCCL_LOSSY_{name}"))
            })
            .collect()
    }

    #[test]
    fn every_variable_the_project_reads_is_a_known_one() {
        // A variable read somewhere but missing from KNOWN_VARS would be warned about as
        // misspelt at every init that has it set.
        fn walk(dir: &std::path::Path, found: &mut Vec<(String, String)>) {
            for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|e| e == "rs" || e == "py")
                    && !path.ends_with("src/env.rs")
                {
                    let text = std::fs::read_to_string(&path).expect("read source");
                    for name in quoted_names(&text) {
                        found.push((name, path.display().to_string()));
                    }
                }
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut found = Vec::new();
        for dir in ["src", "cli/src", "python/src"] {
            walk(&root.join(dir), &mut found);
        }
        assert!(
            found.iter().any(|(name, _)| name == "NCCL_LOSSY_NSOCKS"),
            "{found:?}"
        );
        let unknown: Vec<_> = found
            .iter()
            .filter(|(name, _)| !KNOWN_VARS.contains(&name.as_str()))
            .collect();
        assert!(
            unknown.is_empty(),
            "read but not in KNOWN_VARS: {unknown:?}"
        );
    }

    #[test]
    fn edit_distance_counts_single_letter_changes() {
        assert_eq!(edit_distance("NCCL_LOSSY_PROFIL", "NCCL_LOSSY_PROFILE"), 1);
        assert_eq!(edit_distance("NCCL_LOSSY_NSOKS", "NCCL_LOSSY_NSOCKS"), 1);
        assert_eq!(edit_distance("abc", "abc"), 0);
        assert_eq!(edit_distance("", "ab"), 2);
    }
}
