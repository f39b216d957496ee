//! The user-facing commands run and print their tables.

mod common;

use std::process::Command;

use common::lossy_exe;
use lossy_cli::harness::plugin_client::{PluginLibrary, NCCL_LIBRARY_NAME};

fn lossy(args: &[&str]) -> String {
    lossy_env(args, &[])
}

fn lossy_env(args: &[&str], env: &[(&str, &str)]) -> String {
    common::lossy_stdout(args, env)
}

#[test]
fn demo_prints_a_bit_exact_table_and_the_loss_per_collective() {
    let out = lossy(&["demo", "--sizes", "small"]);
    for name in ["all_reduce", "all_gather", "reduce_scatter"] {
        assert_eq!(
            out.lines()
                .filter(|l| l.starts_with(name) && l.ends_with("bit-exact"))
                .count(),
            3,
            "{out}"
        );
    }
    for op in ["AllReduce", "AllGather", "ReduceScatter"] {
        assert!(out.lines().any(|l| l.starts_with(op)), "{out}");
    }
}

#[test]
fn demo_under_a_zeroing_profile_marks_damage_as_expected_and_succeeds() {
    // 1% uniform loss with zeros: a 1 MiB message is 256 packets of 4 KiB, so a message is
    // untouched with probability 0.99^256 = 7.6%; each collective moves many messages per
    // iteration, so every row is damaged with overwhelming probability (and the seed is fixed).
    let stdout = lossy_env(
        &["demo", "--sizes", "1M"],
        &[("NCCL_LOSSY_PROFILE", "configs/uniform-1pct.toml")],
    );
    let damaged = stdout
        .lines()
        .filter(|l| l.trim_end().ends_with("damaged"))
        .count();
    assert_eq!(damaged, 3, "{stdout}");
    assert!(!stdout.contains("WRONG"), "{stdout}");
}

#[test]
fn demo_names_the_profile_the_plugin_loaded() {
    // An empty NCCL_LOSSY_PROFILE is the embedded default to the plugin; the demo printed
    // "profile: " with nothing after it.
    let stdout = lossy_env(&["demo", "--sizes", "4096"], &[("NCCL_LOSSY_PROFILE", "")]);
    assert!(stdout.contains("profile: embedded default\n"), "{stdout}");
    let stdout = lossy_env(
        &["demo", "--sizes", "4096"],
        &[("NCCL_LOSSY_PROFILE", "configs/lossless.toml")],
    );
    assert!(
        stdout.contains("profile: configs/lossless.toml\n"),
        "{stdout}"
    );
}

#[test]
fn demo_names_the_overrides_it_ran_with() {
    // NCCL_LOSSY_SET=model.rate=0.05 on a 1% profile: the demo's header said only
    // "profile: configs/uniform-1pct.toml", the condition the user did not run, while
    // `lossy validate` and `lossy report` named the override.
    let stdout = lossy_env(
        &["demo", "--ranks", "2", "--sizes", "4096"],
        &[
            ("NCCL_LOSSY_PROFILE", "configs/uniform-1pct.toml"),
            ("NCCL_LOSSY_SET", "model.rate=0.05"),
        ],
    );
    let header = stdout.lines().next().unwrap_or_default();
    assert!(
        header.ends_with("profile: configs/uniform-1pct.toml (NCCL_LOSSY_SET: model.rate=0.05)"),
        "{stdout}"
    );
}

#[test]
fn demo_says_which_rules_matched_nothing() {
    // configs/allreduce-only.toml's rule needs phase = "backward", which the demo never sets:
    // the demo printed 0.000% loss everywhere and nothing else, so the user took it for the
    // rule's condition having run without loss.
    let stdout = lossy_env(
        &["demo", "--ranks", "2", "--sizes", "64K"],
        &[("NCCL_LOSSY_PROFILE", "configs/allreduce-only.toml")],
    );
    let notes: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("matched no message"))
        .collect();
    assert_eq!(notes.len(), 1, "{stdout}");
    assert!(
        notes[0].contains("rules.0 gradient all-reduce") && notes[0].contains("phase"),
        "{stdout}"
    );
    // A rule that decided messages is not named.
    let stdout = lossy_env(
        &["demo", "--ranks", "2", "--sizes", "64K"],
        &[("NCCL_LOSSY_PROFILE", "configs/one-collective.toml")],
    );
    assert!(!stdout.contains("matched no message"), "{stdout}");
}

/// `lossy demo | head -1`, `lossy validate ... | head -1`: a reader that closes the pipe early
/// stops the command quietly, as it does `lossy report`, with no panic and backtrace.
#[test]
fn commands_stop_quietly_when_the_reader_closes_the_pipe() {
    let runs: [&[&str]; 4] = [
        &["demo", "--ranks", "2", "--sizes", "4096"],
        &[
            "bench",
            "--ranks",
            "2",
            "--sizes",
            "4096",
            "--iters",
            "2",
            "--lossless",
        ],
        &["validate", "configs/uniform-1pct.toml"],
        &["simulate", "configs/uniform-1pct.toml", "--packets", "1000"],
    ];
    for args in runs {
        let mut child = Command::new(lossy_exe())
            .args(args)
            .env_remove("NCCL_LOSSY_PROFILE")
            .env_remove("NCCL_LOSSY_SET")
            .env_remove("NCCL_LOSSY_STATS")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run lossy");
        // Close the reading end before the command writes anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("wait for lossy");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn bench_prints_plugin_and_raw_tcp_side_by_side() {
    let out = lossy(&["bench", "--sizes", "small", "--iters", "2", "--lossless"]);
    let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 18, "{out}");
    assert!(rows.iter().all(|r| r.trim_end().ends_with("ok")), "{out}");
    assert!(out.contains("raw us") && out.contains("ratio"), "{out}");
}

#[test]
fn bench_vs_lossless_switches_loss_off_for_the_baseline_only() {
    // Under 1% zero loss a 4 MiB all-reduce (1024 packets of 4 KiB per message) is damaged
    // with probability 1 - 0.99^1024 ~ 1 - 3e-5; the interleaved lossless link must stay
    // bit-exact, or the row says WRONG and the command fails.
    let stdout = lossy_env(
        &["bench", "--vs-lossless", "--sizes", "4M", "--iters", "2"],
        &[("NCCL_LOSSY_PROFILE", "configs/uniform-1pct.toml")],
    );
    let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert!(rows[0].trim_end().ends_with("dmg"), "{stdout}");
    assert_eq!(rows[0].matches('%').count(), 2, "{stdout}");
}

#[test]
fn install_puts_the_library_under_the_nccl_name_with_all_five_tables() {
    let prefix = std::env::temp_dir().join(format!("lossy-install-test-{}", std::process::id()));
    let out = lossy(&["install", "--prefix", prefix.to_str().expect("utf-8 path")]);
    let lib = prefix.join("lib").join(NCCL_LIBRARY_NAME);
    assert!(out.contains("NCCL_NET_PLUGIN=lossy"), "{out}");
    assert!(prefix.join("bin").join("lossy").is_file());
    let loaded = PluginLibrary::open(&lib).expect("dlopen the installed library");
    assert_eq!(loaded.net_versions(), vec![12, 11, 10, 9, 8]);
    for v in 8..=12 {
        assert!(loaded.exports(&format!("ncclNetPlugin_v{v}")));
    }
    drop(loaded);
    std::fs::remove_dir_all(&prefix).expect("clean up");
}

#[test]
fn install_prints_commands_a_shell_takes_as_they_are() {
    // The printed export lines are pasted into a shell: a prefix with a quote or a `$` must
    // survive, and a relative prefix must not make them work only from this directory.
    let base = std::env::temp_dir().join(format!("lossy-install-quote-{}", std::process::id()));
    let prefix = base.join("a \"b\" $HOME 'c'");
    let out = lossy(&["install", "--prefix", prefix.to_str().expect("utf-8 path")]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("export NCCL_NET_PLUGIN="))
        .unwrap_or_else(|| panic!("{out}"));
    let shown = Command::new("sh")
        .arg("-c")
        .arg(format!("{line}; printf %s \"$NCCL_NET_PLUGIN\""))
        .output()
        .expect("sh");
    assert_eq!(
        String::from_utf8_lossy(&shown.stdout),
        prefix
            .join("lib")
            .join(NCCL_LIBRARY_NAME)
            .to_str()
            .expect("utf-8"),
        "{line}"
    );
    // relative: the printed paths are absolute
    let rel = Command::new(lossy_exe())
        .args(["install", "--prefix", "rel prefix"])
        .current_dir(&base)
        .output()
        .expect("lossy install");
    let out = String::from_utf8_lossy(&rel.stdout);
    assert!(rel.status.success(), "{out}");
    assert!(
        out.contains(base.join("rel prefix").join("lib").to_str().expect("utf-8")),
        "{out}"
    );
    std::fs::remove_dir_all(&base).expect("clean up");
}

#[test]
fn demo_and_a_rank_leave_no_temporary_directory_behind_when_they_fail() {
    // `lossy demo` made `lossy-demo-PID` in the temporary directory before it looked at its
    // library, and left it there when the library was refused; a rank of a multi-process job
    // (`--rank`) made `lossy-rank-PID` before it resolved its rendezvous.
    let tmp = common::fresh_dir("demo-tmp");
    let tmp_str = tmp.to_str().expect("utf-8 path");
    let missing = tmp.join("no-such-plugin.so");
    let runs: [(&[&str], &str); 2] = [
        (
            &[
                "demo",
                "--ranks",
                "2",
                "--library",
                missing.to_str().expect("utf-8"),
            ],
            "lossy demo --library naming a missing file",
        ),
        (
            &[
                "demo",
                "--rank",
                "1",
                "--world",
                "2",
                "--rendezvous",
                "no-port-given",
            ],
            "lossy demo as a rank whose rendezvous address has no port",
        ),
    ];
    for (args, what) in runs {
        let out = common::output_within_10s(
            Command::new(lossy_exe())
                .args(args)
                .env("TMPDIR", tmp_str)
                .env_remove("NCCL_LOSSY_STATS"),
            what,
        );
        assert!(!out.status.success(), "{what} succeeded");
        let left: Vec<_> = std::fs::read_dir(&tmp)
            .expect("read temporary directory")
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .filter(|name| name.to_string_lossy().starts_with("lossy-"))
            .collect();
        assert!(left.is_empty(), "{what} left {left:?} behind");
    }
}

/// The tests' runner of commands reads a child's output as it comes: a child that writes more
/// than a pipe holds (64 KiB) on both streams finishes, and every byte comes back (the runner
/// used to wait for the exit first, so such a child blocked on its write and the test failed
/// as a 10 s hang instead of with what the child said).
#[test]
fn the_test_runner_of_commands_takes_more_output_than_a_pipe_holds() {
    let out = common::output_within_10s(
        Command::new("sh").args([
            "-c",
            "head -c 300000 /dev/zero; head -c 200000 /dev/zero >&2; exit 3",
        ]),
        "a child writing 500 KB",
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!((out.stdout.len(), out.stderr.len()), (300_000, 200_000));
}
