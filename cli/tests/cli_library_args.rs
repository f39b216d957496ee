//! `--library` and `--ranks` as a user types them: a FIFO, a bare file name in the current
//! directory, a number of ranks far beyond one machine. Each must work as asked or stop at once
//! with one line naming the value and what is allowed, never hang or fork without end.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fresh_dir, library, lossy_exe, make_fifo, output_within_10s};

fn lossy_in(dir: &Path, args: &[&str], what: &str) -> Output {
    let mut cmd = Command::new(lossy_exe());
    // As from a user's shell: cargo's LD_LIBRARY_PATH holds the build's own folders, where
    // the loader would find a library of the same name whatever the command was given.
    cmd.args(args)
        .current_dir(dir)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("NCCL_NET_PLUGIN")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_STATS");
    output_within_10s(&mut cmd, what)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn install_refuses_a_fifo_as_the_library_at_once() {
    // dlopen of a FIFO blocks until a writer comes: `lossy install --library ./fifo` hung.
    let dir = fresh_dir("install-fifo");
    make_fifo(&dir.join("fifo"));
    let out = lossy_in(
        &dir,
        &["install", "--prefix", "prefix", "--library", "./fifo"],
        "lossy install --library FIFO",
    );
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("./fifo") && err.contains("not a regular file (a FIFO)"),
        "{err}"
    );
    assert!(!dir.join("prefix").exists(), "nothing installed");
}

#[test]
fn a_library_named_by_a_bare_file_name_is_the_file_in_the_current_directory() {
    // `--library libnccl_net_lossy.so` went to dlopen as it was, and dlopen looks a name
    // without a slash up on the loader's search path, not in the current directory: install
    // and the demo's ranks failed with "cannot open shared object file" next to the file.
    let dir = fresh_dir("library-bare-name");
    std::fs::copy(library(), dir.join("libnccl_net_lossy.so")).expect("copy the library");
    let out = lossy_in(
        &dir,
        &[
            "install",
            "--prefix",
            "prefix",
            "--library",
            "libnccl_net_lossy.so",
        ],
        "lossy install --library NAME",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let installed = dir.join("prefix/lib/libnccl-net-lossy.so");
    assert_eq!(
        std::fs::read(&installed).expect("installed library"),
        std::fs::read(library()).expect("built library")
    );
    let out = lossy_in(
        &dir,
        &[
            "demo",
            "--ranks",
            "2",
            "--sizes",
            "64K",
            "--library",
            "libnccl_net_lossy.so",
        ],
        "lossy demo --library NAME",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("all_reduce"), "{table}");
}

#[test]
fn demo_refuses_more_ranks_than_one_machine_runs_before_starting_any() {
    // `--ranks 100000` (a typo for 10, say) started worker processes one after another until
    // the machine ran out, for minutes: a fork flood, not an error.
    let dir = fresh_dir("demo-many-ranks");
    for ranks in ["100000", "257"] {
        let out = lossy_in(
            &dir,
            &["demo", "--ranks", ranks, "--sizes", "64K"],
            "lossy demo --ranks HUGE",
        );
        let err = stderr(&out);
        assert!(!out.status.success(), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("--ranks {ranks}")) && err.contains("2 to 256"),
            "{err}"
        );
    }
}
