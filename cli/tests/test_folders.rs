//! The suite's own hygiene: the folders a test process makes for itself (plugin copies,
//! fixtures, statistics) are gone once it exits, whether its tests passed or failed, so runs
//! of the suite do not fill the temporary folder.

mod common;

use std::path::PathBuf;
use std::process::Command;

const CHILD_ENV: &str = "LOSSY_TEST_FOLDERS_CHILD";

/// Runs this binary's ignored test `name` in a process of its own: the folder it made, and
/// whether the child passed.
fn child_folder(name: &str) -> (PathBuf, bool) {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", name, "--ignored", "--nocapture"])
        .env(CHILD_ENV, "1")
        .output()
        .expect("run the child");
    let text = String::from_utf8_lossy(&out.stdout);
    let dir = text
        .lines()
        .find_map(|l| l.strip_prefix("made "))
        .unwrap_or_else(|| panic!("the child made no folder:\n{text}"));
    (PathBuf::from(dir), out.status.success())
}

#[test]
fn a_test_process_removes_its_folders_when_it_exits() {
    for (name, passes) in [("child_passes", true), ("child_fails", false)] {
        let (dir, passed) = child_folder(name);
        assert_eq!(passed, passes, "{name}");
        assert!(!dir.exists(), "{name} left {} behind", dir.display());
    }
}

/// Makes a folder with a file in it, and prints where.
fn make() {
    let dir = common::fresh_dir("folders-child");
    std::fs::write(dir.join("library.so"), b"bytes").expect("write");
    assert!(dir.exists());
    println!("made {}", dir.display());
}

#[test]
#[ignore = "run in a process of its own by a_test_process_removes_its_folders_when_it_exits"]
fn child_passes() {
    if std::env::var_os(CHILD_ENV).is_some() {
        make();
    }
}

#[test]
#[ignore = "run in a process of its own by a_test_process_removes_its_folders_when_it_exits"]
fn child_fails() {
    if std::env::var_os(CHILD_ENV).is_some() {
        make();
        panic!("this child fails on purpose");
    }
}
