//! `lossy install` into prefixes as users have them: a file where one of its directories
//! should be. An install that cannot finish must leave nothing half done, and say what is in
//! the way.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe, output_within_10s};

fn install(prefix: &Path) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.arg("install").arg("--prefix").arg(prefix);
    output_within_10s(&mut cmd, "lossy install")
}

#[test]
fn install_with_a_file_in_the_way_installs_nothing_and_names_it() {
    // PREFIX/bin a file: the library was copied into PREFIX/lib first, so the failed install
    // left a new library beside an older `lossy` (or none), and the error said only "File
    // exists (os error 17)".
    let top = fresh_dir("install-in-the-way");
    for (in_the_way, other) in [("bin", "lib/libnccl-net-lossy.so"), ("lib", "bin/lossy")] {
        let prefix = top.join(in_the_way);
        std::fs::create_dir_all(&prefix).expect("prefix");
        let blocker = prefix.join(in_the_way);
        std::fs::write(&blocker, "a file").expect("write");
        let out = install(&prefix);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{in_the_way}: {stderr}");
        assert!(
            stderr.contains(&format!("{} is not a directory", blocker.display())),
            "{in_the_way}: {stderr}"
        );
        assert!(
            !prefix.join(other).exists(),
            "{in_the_way} in the way: {other} was installed anyway"
        );
        assert_eq!(
            std::fs::read_to_string(&blocker).expect("the file is left alone"),
            "a file"
        );
    }
}

#[test]
fn install_does_not_print_a_line_to_paste_that_cannot_work_for_its_prefix() {
    // A prefix with a `:` got `export LD_LIBRARY_PATH=PREFIX/lib...`, which the loader cuts at
    // the `:`; one with a `,` got `NCCL_NET_PLUGIN=PREFIX/lib/...`, which NCCL cuts into a list
    // of plugins: both printed as if they worked. Each is left out, saying why, and the other
    // way is offered.
    let top = fresh_dir("install-odd-prefix");
    // (prefix, the start of the export that cannot work, the start of the one that can)
    for (name, cut, kept) in [
        (
            "a:b",
            ["LD_LIBRARY_PATH="; 2],
            ["NCCL_NET_PLUGIN='", "NCCL_NET_PLUGIN=/"],
        ),
        (
            "a,b",
            ["NCCL_NET_PLUGIN='", "NCCL_NET_PLUGIN=/"],
            ["LD_LIBRARY_PATH="; 2],
        ),
    ] {
        let prefix = top.join(name);
        let out = install(&prefix);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name}: {out:?}");
        let exports: Vec<&str> = stdout.lines().filter(|l| l.contains("export")).collect();
        assert!(
            exports.iter().all(|l| cut.iter().all(|c| !l.contains(c))),
            "{name}: a line that cannot work: {stdout}"
        );
        assert!(
            exports.iter().any(|l| kept.iter().any(|k| l.contains(k))),
            "{name}: the way that works is missing: {stdout}"
        );
        assert!(
            stdout.contains(&format!("not with this prefix: {}", prefix.display())),
            "{name}: {stdout}"
        );
    }
}
