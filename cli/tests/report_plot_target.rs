//! `lossy report --plot FILE` with a FILE that cannot take a plot: refused at once, before the
//! report is printed, naming the file and what is allowed; never a hang on a FIFO.

mod common;

use std::process::Command;

use common::{fresh_dir, lossy_exe, make_fifo, output_within_10s};

#[test]
fn a_plot_target_that_is_no_file_or_has_no_plot_extension_is_refused_before_the_report() {
    // Opening a FIFO for writing blocks until a reader comes: `--plot x.png` on a FIFO hung
    // after printing the table; a wrong extension or a directory was found only after the
    // whole report had been printed; a file in a directory that does not exist, too.
    let dir = fresh_dir("report-plot-target");
    let stats = dir.join("run");
    let demo = Command::new(lossy_exe())
        .args(["demo", "--ranks", "2", "--sizes", "64K", "--stats-dir"])
        .arg(&stats)
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_NET_PLUGIN")
        .output()
        .expect("lossy demo");
    assert!(
        demo.status.success(),
        "{}",
        String::from_utf8_lossy(&demo.stderr)
    );
    make_fifo(&dir.join("fifo.png"));
    std::fs::create_dir(dir.join("dir.svg")).expect("mkdir");
    for (target, why) in [
        ("fifo.png", "not a regular file (a FIFO)"),
        ("dir.svg", "not a regular file (a directory)"),
        ("plot.pdf", "allowed: a file name ending in .svg or .png"),
        // Drawn after the table, failing with the image library's debug text.
        (
            "missing/plot.png",
            "allowed: a file in an existing directory",
        ),
        (
            "missing/plot.svg",
            "allowed: a file in an existing directory",
        ),
    ] {
        for per_step in [false, true] {
            let path = dir.join(target);
            let mut cmd = Command::new(lossy_exe());
            cmd.arg("report").arg(&stats).arg("--plot").arg(&path);
            if per_step {
                cmd.arg("--per-step");
            }
            let out = output_within_10s(&mut cmd, "lossy report --plot");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{target}: {err}");
            assert!(
                out.stdout.is_empty(),
                "{target}: report printed before the refusal"
            );
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(
                err.contains(path.to_str().expect("utf-8")) && err.contains(why),
                "{target}: {err}"
            );
        }
    }
}
