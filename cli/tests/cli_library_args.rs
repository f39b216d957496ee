//! `--library` and `--ranks` as a user types them: a FIFO, a bare file name in the current
//! directory, a number of ranks far beyond one machine. Each must work as asked or stop at once
//! with one line naming the value and what is allowed, never hang or fork without end.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe, make_fifo, output_within_10s};

fn lossy_in(dir: &Path, args: &[&str], what: &str) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args)
        .current_dir(dir)
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
