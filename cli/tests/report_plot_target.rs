//! `lossy report --plot FILE` with a FILE that cannot take a plot: refused at once, before the
//! report is printed, naming the file and what is allowed; never a hang on a FIFO. A plot
//! whose write fails leaves the older plot as it was, and no part of the new one.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{demo_stats, fresh_dir, lossy_exe, make_fifo, output_within_10s};
use nccl_net_lossy::stats::writer::replace_atomically;

#[test]
fn a_plot_target_that_is_no_file_or_has_no_plot_extension_is_refused_before_the_report() {
    // Opening a FIFO for writing blocks until a reader comes: `--plot x.png` on a FIFO hung
    // after printing the table; a wrong extension or a directory was found only after the
    // whole report had been printed; a file in a directory that does not exist, too.
    let dir = fresh_dir("report-plot-target");
    let stats = demo_stats(&dir);
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

#[test]
fn a_plot_whose_write_fails_leaves_the_older_plot_whole_and_no_part_of_the_new_one() {
    // The plot was written in place: a write that failed part way (a full file system) left
    // a truncated file where a good older plot had been. The write fails here at the file
    // size limit (`ulimit -f`, its signal ignored so that the write returns EFBIG), as it does
    // on a full disk.
    let dir = fresh_dir("report-plot-fails");
    let stats = demo_stats(&dir);
    let plots = dir.join("plots");
    std::fs::create_dir(&plots).expect("mkdir");
    let older: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    for name in ["loss.png", "loss.svg"] {
        let path = plots.join(name);
        std::fs::write(&path, &older).expect("the older plot");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("trap '' XFSZ; ulimit -f 2; exec \"$0\" \"$@\"")
            .arg(lossy_exe())
            .arg("report")
            .arg(&stats)
            .arg("--plot")
            .arg(&path);
        let out = output_within_10s(&mut cmd, "lossy report --plot under ulimit -f");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("cannot draw"),
            "{name}: the write did not fail: {err}"
        );
        assert!(
            std::fs::read(&path).expect("the older plot") == older,
            "{name}: the older plot was replaced by a part of the new one ({err})"
        );
        let left: Vec<_> = std::fs::read_dir(&plots)
            .expect("dir")
            .map(|e| e.expect("entry").file_name())
            .filter(|n| n != "loss.png" && n != "loss.svg")
            .collect();
        assert!(left.is_empty(), "{name}: left behind: {left:?}");
        // Without the limit it is replaced by the whole plot.
        let out = output_within_10s(
            Command::new(lossy_exe())
                .arg("report")
                .arg(&stats)
                .arg("--plot")
                .arg(&path),
            "lossy report --plot",
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let new = std::fs::read(&path).expect("the new plot");
        assert!(
            new != older && new.len() > 1024,
            "{name}: {} bytes",
            new.len()
        );
    }
}

#[test]
fn a_plot_whose_rename_fails_leaves_what_was_there_and_no_temporary() {
    // The last step, the rename over the target, fails when a directory has taken its place
    // since `lossy report` checked it: the directory stays, and so does nothing else.
    let dir = fresh_dir("report-plot-rename");
    let target = dir.join("loss.png");
    std::fs::create_dir(&target).expect("mkdir");
    std::fs::write(target.join("kept"), "x").expect("write");
    let mut given = PathBuf::new();
    let err = replace_atomically(&target, |tmp| {
        given = tmp.to_path_buf();
        std::fs::write(tmp, "the new plot").map_err(|e| e.to_string())
    })
    .expect_err("a file cannot be renamed over a directory");
    assert!(
        given.parent() == Some(dir.as_path())
            && given.extension().is_some_and(|e| e == "png")
            && given != target,
        "the temporary {} is not beside the target with its extension",
        given.display()
    );
    assert!(target.join("kept").is_file(), "{err}");
    let names: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["loss.png"], "{err}");
    // A write that fails part way leaves an older file as it was.
    let file = dir.join("loss.svg");
    std::fs::write(&file, "older").expect("write");
    let err = replace_atomically(&file, |tmp| {
        std::fs::write(tmp, "<svg").map_err(|e| e.to_string())?;
        Err("backend error".to_string())
    })
    .expect_err("the write failed");
    assert_eq!(err, "backend error");
    assert_eq!(std::fs::read_to_string(&file).expect("read"), "older");
    assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 2);
    // One that succeeds replaces it whole.
    replace_atomically(&file, |tmp| {
        std::fs::write(tmp, "<svg/>").map_err(|e| e.to_string())
    })
    .expect("written");
    assert_eq!(std::fs::read_to_string(&file).expect("read"), "<svg/>");
    assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 2);
}
