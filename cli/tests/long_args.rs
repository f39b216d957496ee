//! A command-line argument of 100,000 characters that `lossy` refuses: the error names the
//! option or argument it came from and echoes the value cut (its first characters and how
//! long it is), never the whole value (an error of 100 KB each).

mod common;

use std::path::Path;
use std::process::Command;

use common::{demo_stats, fresh_dir, lossy_exe, output_within_10s};

/// The long argument.
fn long() -> String {
    "a".repeat(100_000)
}

/// Runs `lossy args` in `dir` (none of our variables from the shell) and returns its exit
/// code and stderr.
fn refused(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args)
        .current_dir(dir)
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_NET_PLUGIN");
    let out = output_within_10s(&mut cmd, "lossy with a long argument");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that `err` is a refusal naming `name`, echoing the value once and cut: "`aaa…`
/// (N bytes in all)".
fn assert_cut(what: &str, code: Option<i32>, err: &str, name: &str, bytes: usize) {
    assert!(code.is_some_and(|c| c != 0), "{what}: {code:?} {err:.300}");
    assert!(err.len() < 1000, "{what}: {} bytes: {err:.300}", err.len());
    assert!(err.contains(name), "{what}: does not name {name}: {err}");
    let all = format!("({bytes} bytes in all)");
    assert_eq!(err.matches(&all).count(), 1, "{what}: {err}");
}

#[test]
fn a_long_run_directory_is_echoed_cut() {
    let dir = fresh_dir("long-args-report");
    let long = long();
    let (code, err) = refused(&dir, &["report", &long]);
    assert_cut("report DIR", code, &err, "run directory", 100_000);
    let (code, err) = refused(&dir, &["report", &long, "--per-step"]);
    assert_cut(
        "report DIR --per-step",
        code,
        &err,
        "run directory",
        100_000,
    );
}

#[test]
fn a_long_plot_file_is_echoed_cut_under_its_option() {
    let dir = fresh_dir("long-args-plot");
    demo_stats(&dir);
    let plot = format!("{}.png", long());
    let (code, err) = refused(&dir, &["report", "run", "--plot", &plot]);
    assert_cut("report --plot", code, &err, "--plot", 100_004);
    // Refused before the report, as any other plot target that cannot be written.
    assert_eq!(code, Some(2), "{err}");
}

#[test]
fn a_long_install_prefix_is_echoed_cut_under_its_option() {
    let dir = fresh_dir("long-args-install");
    let prefix = format!("/dev/null/{}", long());
    let (code, err) = refused(&dir, &["install", "--prefix", &prefix]);
    assert_cut("install --prefix", code, &err, "--prefix", 100_010);
}

#[test]
fn a_long_program_to_run_is_echoed_cut() {
    let dir = fresh_dir("long-args-run");
    let long = long();
    let (code, err) = refused(&dir, &["run", "--", &long]);
    assert_cut("run -- CMD", code, &err, "cannot run the command", 100_000);
}

#[test]
fn a_long_stats_directory_of_run_is_echoed_once_cut_under_its_option() {
    let dir = fresh_dir("long-args-stats");
    let long = long();
    let (code, err) = refused(&dir, &["run", "--stats", &long, "--", "true"]);
    assert_cut("run --stats", code, &err, "--stats", 100_000);
}
