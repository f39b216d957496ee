//! `lossy report` on directories that hold other than one whole run: two runs written into one
//! directory, a process whose per-step file is missing. The statistics files are real: `lossy
//! demo` under `lossy run --stats`, one file per rank.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe};

fn lossy(args: &[&str]) -> Output {
    Command::new(lossy_exe())
        .args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_PROTO")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_TRACE")
        .output()
        .expect("run lossy")
}

/// A two-rank demo with `seed` whose statistics go to `stats`.
fn demo_into(stats: &Path, seed: u32) {
    let exe = lossy_exe();
    let out = lossy(&[
        "run",
        "--stats",
        stats.to_str().expect("utf-8"),
        "--set",
        &format!("seed={seed}"),
        "--",
        exe.to_str().expect("utf-8"),
        "demo",
        "--ranks",
        "2",
        "--sizes",
        "1M",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn per_step_and_csv_reports_say_when_two_runs_share_a_directory() {
    // The table of `lossy report` warned that the files come from two runs (each rank in two
    // files, two profiles); `--per-step` and `--csv` summed the same files without a word.
    let run = fresh_dir("report-two-runs").join("run");
    demo_into(&run, 1);
    demo_into(&run, 2);
    let dir = run.to_str().expect("utf-8");
    for args in [
        vec!["report", dir],
        vec!["report", dir, "--per-step"],
        vec!["report", dir, "--csv"],
        vec!["report", dir, "--per-step", "--csv"],
    ] {
        let out = lossy(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        let said = format!("{}{stderr}", String::from_utf8_lossy(&out.stdout));
        assert!(
            said.contains("rank(s) are each in several files")
                && said.contains("2 different profiles"),
            "{args:?}: {said}"
        );
    }
}
