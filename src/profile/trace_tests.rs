//! Unit tests of how a profile loads its loss traces: one copy of each file, whatever path
//! names it, and a limit on what a profile's traces keep together.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::loss::model::ModelSpec;
use crate::loss::trace::TraceData;
use crate::profile::Profile;

/// A fresh directory under the temporary one, named for the test and this process.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lossy-traces-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("create a test directory");
    dir
}

/// A profile of one rule per `(file, format, length)`, written as `p.toml` in `dir`.
fn profile_of(dir: &Path, rules: &[(&str, &str, Option<u64>)]) -> PathBuf {
    let mut text = String::new();
    for (peer, (file, format, length)) in rules.iter().enumerate() {
        let length = length.map_or(String::new(), |n| format!(", length = {n}"));
        text.push_str(&format!(
            "[[rules]]\npeer = {peer}\nmodel = {{ kind = \"trace\", file = \"{file}\", \
             format = \"{format}\"{length} }}\n"
        ));
    }
    let path = dir.join("p.toml");
    std::fs::write(&path, text).expect("write the profile");
    path
}

/// The loaded trace of each rule.
fn traces(profile: &Profile) -> Vec<Arc<TraceData>> {
    profile
        .rules
        .iter()
        .map(|rule| match &rule.action.model {
            ModelSpec::Trace(t) => Arc::clone(t.data.as_ref().expect("loaded")),
            other => panic!("not a trace: {other:?}"),
        })
        .collect()
}

#[test]
fn one_file_reached_by_links_and_other_spellings_is_loaded_once() {
    // Each symbolic link, hard link or spelling (`sub/../x`) of one file loaded another copy:
    // 12 links to one 16 MiB bitmap held 1.7 GB, and 1024 rules would have asked for 140 GB.
    let dir = fresh_dir("links");
    std::fs::write(dir.join("drops.txt"), "0110\n").expect("write the trace");
    std::os::unix::fs::symlink(dir.join("drops.txt"), dir.join("sym.txt")).expect("symlink");
    std::os::unix::fs::symlink("sym.txt", dir.join("sym2.txt")).expect("symlink");
    std::fs::hard_link(dir.join("drops.txt"), dir.join("hard.txt")).expect("hard link");
    std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
    let absolute = dir.join("drops.txt").display().to_string();
    let path = profile_of(
        &dir,
        &[
            ("drops.txt", "bitmap", None),
            ("sym.txt", "bitmap", None),
            ("sym2.txt", "bitmap", None),
            ("hard.txt", "bitmap", None),
            ("sub/../drops.txt", "bitmap", None),
            ("./drops.txt", "bitmap", None),
            (&absolute, "bitmap", None),
        ],
    );
    let p = Profile::load(Some(&path), "").expect("valid profile");
    let all = traces(&p);
    for (i, t) in all.iter().enumerate() {
        assert!(Arc::ptr_eq(&all[0], t), "rule {i} loaded its own copy");
    }
    assert_eq!(all[0].runs.to_vec(), vec![(1, 2)]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn rules_that_differ_in_length_only_share_the_files_runs() {
    // Each `length` loaded the file again: as many copies as lengths.
    let dir = fresh_dir("lengths");
    std::fs::write(dir.join("drops.txt"), "1\n2\n7\n").expect("write the trace");
    std::os::unix::fs::symlink(dir.join("drops.txt"), dir.join("sym.txt")).expect("symlink");
    let path = profile_of(
        &dir,
        &[
            ("drops.txt", "indices", None),
            ("sym.txt", "indices", Some(10)),
            ("drops.txt", "indices", Some(1000)),
            ("sym.txt", "indices", Some(10)),
        ],
    );
    let p = Profile::load(Some(&path), "").expect("valid profile");
    let all = traces(&p);
    let lengths: Vec<u64> = all.iter().map(|t| t.length).collect();
    assert_eq!(lengths, vec![8, 10, 1000, 10]);
    for t in &all {
        assert!(Arc::ptr_eq(&all[0].runs, &t.runs), "a copy of the runs");
    }
    assert!(Arc::ptr_eq(&all[1], &all[3]));
    std::fs::remove_dir_all(&dir).ok();
}
