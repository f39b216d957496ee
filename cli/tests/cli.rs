//! The user-facing commands run and print their tables.

mod common;

use std::process::Command;

use common::lossy_exe;
use lossy_cli::harness::plugin_client::{PluginLibrary, NCCL_LIBRARY_NAME};

fn lossy(args: &[&str]) -> String {
    lossy_env(args, &[])
}

/// Runs `lossy args` from the repository's top with `env` added (and no statistics unless
/// `env` asks); asserts it succeeded and returns its stdout.
fn lossy_env(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(lossy_exe())
        .args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_LOSSY_STATS")
        .envs(env.iter().copied())
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run lossy");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "lossy {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
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
