//! The `lossy` binary on the shipped profiles: every one validates, a broken one fails with
//! exit 2 and a message naming the file and key, and `simulate` agrees with the closed forms.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe, repo_file};

fn lossy(args: &[&str]) -> Output {
    lossy_with(args, &[])
}

/// Runs `lossy` from the repository root with the environment's profile settings cleared,
/// then `env` set.
fn lossy_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run lossy")
}

fn configs() -> Vec<PathBuf> {
    let dir = repo_file("configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("configs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_shipped_profile_validates() {
    let files = configs();
    assert!(files.len() >= 6, "{files:?}");
    let mut args = vec!["validate"];
    let names: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    args.extend(names.iter().map(String::as_str));
    let out = lossy(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().count(), files.len(), "{stdout}");
    for name in &names {
        assert!(
            stdout.contains(name.as_str()),
            "{name} missing from\n{stdout}"
        );
    }
}

#[test]
fn validate_without_a_file_checks_the_embedded_default() {
    let out = lossy(&["validate", "--set", "effect=zero"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("embedded default: ")
            && stdout.contains("uniform(rate=0.01), effect zero"),
        "{stdout}"
    );
}

#[test]
fn broken_profile_exits_2_naming_file_line_and_key() {
    let dir = fresh_dir("cli-test");
    let bad = dir.join("broken.toml");
    std::fs::write(&bad, "seed = 1\n[[rules]]\ncollective = \"AllReduce\"\nmodel = { kind = \"uniform\", rate = 1.5 }\n")
        .expect("write");
    let bad = bad.display().to_string();
    let out = lossy(&["validate", &bad]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{bad}:4: rules.0.model.rate = 1.5: must be a probability in [0, 1]"
        )),
        "{stderr}"
    );
    // A bad override names where it came from (the command line) and its key.
    let out = lossy(&[
        "validate",
        "configs/uniform-1pct.toml",
        "--set",
        "model.rate=2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("--set: model.rate = 2: must be a probability"),
        "{stderr}"
    );
    // A good override shows in the summary.
    let out = lossy(&[
        "validate",
        "configs/uniform-1pct.toml",
        "--set",
        "model.rate=0.05",
        "--set",
        "seed=3",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("seed 3") && stdout.contains("uniform(rate=0.05)"),
        "{stdout}"
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn simulate_matches_the_closed_forms() {
    let out = lossy(&[
        "simulate",
        "configs/bursty-ge-1pct.toml",
        "--packets",
        "20000000",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let r = &v["rules"][0];
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!((f("expected_loss_rate") - 0.01).abs() < 1e-12);
    assert!((f("expected_mean_burst") - 8.0).abs() < 1e-9);
    // n = 2e7 packets, m = n·0.01/8 = 25k bursts. Delta method for a renewal process with
    // geometric sojourns (CV ≤ 1): σ_rate ≤ rate·sqrt(2/m) ≈ 9e-5, σ_burst ≤ 8·sqrt(2/m) ≈ 0.072;
    // allow 5σ.
    assert!((f("loss_rate") - 0.01).abs() < 4.5e-4, "{r}");
    assert!((f("mean_burst") - 8.0).abs() < 0.36, "{r}");
    assert_eq!(v["profile"]["seed"], 1);

    // Per rule: the all-reduce rule loses, the default does not.
    let out = lossy(&[
        "simulate",
        "configs/allreduce-only.toml",
        "--packets",
        "1000000",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["rules"][0]["lost"], 0);
    // Binomial: σ = sqrt(0.01·0.99/1e6) ≈ 1e-4; 5σ.
    let rate = v["rules"][1]["loss_rate"].as_f64().expect("rate");
    assert!((rate - 0.01).abs() < 5e-4, "{rate}");

    // The table form names the rows and the expected values.
    let out = lossy(&[
        "simulate",
        "configs/uniform-1pct.toml",
        "--packets",
        "100000",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        stdout.contains("loss rate") && stdout.contains("expected 0.01"),
        "{stdout}"
    );
    let out = lossy(&["simulate", "configs/does-not-exist.toml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn validate_shows_the_transport_and_names_a_bad_one() {
    let dir = fresh_dir("validate-wrap");
    let good = dir.join("wrap.toml");
    std::fs::write(&good, "transport = \"wrap\"\ninner = \"ofi\"\n").expect("write");
    let out = lossy(&["validate", &good.display().to_string()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("; transport wrap (inner ofi)"), "{stdout}");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "seed = 3\ntransport = \"rdma\"\n").expect("write");
    let out = lossy(&["validate", &bad.display().to_string()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{}:2: transport = \"rdma\": allowed: \"socket\", \"wrap\"",
            bad.display()
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_bounds_its_work_and_applies_the_environments_overrides() {
    // An explicit --packets beyond the bound is refused before any work is done.
    let out = lossy_with(
        &[
            "simulate",
            "configs/uniform-1pct.toml",
            "--packets",
            "18446744073709551615",
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--packets") && stderr.contains("at most 1000000000"),
        "{stderr}"
    );

    // Many rules: the default packets per model shrink so the total stays within the bound
    // (10,000,000 for each of 1,025 models would be ten times it).
    let dir = fresh_dir("simulate-many-rules");
    let file = dir.join("many.toml");
    let mut text = String::from("model = { kind = \"uniform\", rate = 0.001 }\n");
    for _ in 0..1024 {
        text.push_str("[[rules]]\nmodel = { kind = \"uniform\", rate = 0.001 }\n");
    }
    std::fs::write(&file, text).expect("write profile");
    let out = lossy_with(&["simulate", file.to_str().expect("utf-8"), "--json"], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rules = v["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 1025);
    assert!(
        rules
            .iter()
            .all(|r| r["packets"] == 1_000_000_000u64 / 1025),
        "{}",
        rules[0]
    );

    // NCCL_LOSSY_SET applies as in `lossy validate` and the plugin, through the same checks.
    let out = lossy_with(
        &["simulate", "configs/uniform-1pct.toml"],
        &[("NCCL_LOSSY_SET", "model.rate=7")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("NCCL_LOSSY_SET") && stderr.contains("model.rate = 7"),
        "{stderr}"
    );
    let out = lossy_with(
        &[
            "simulate",
            "configs/uniform-1pct.toml",
            "--packets",
            "1000",
            "--json",
        ],
        &[("NCCL_LOSSY_SET", "model.rate=0.5")],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["rules"][0]["expected_loss_rate"], 0.5, "{v}");
    assert_eq!(v["profile"]["overrides"], "model.rate=0.5", "{v}");
}

#[test]
fn a_blank_profile_variable_is_refused_naming_it() {
    // NCCL_LOSSY_PROFILE=" " names no file: say so, naming the variable, rather than failing
    // to read a file called " " (the plugin's init reads the variable the same way).
    for args in [&["validate"][..], &["run", "--print-env"][..]] {
        let out = lossy_with(args, &[("NCCL_LOSSY_PROFILE", " ")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("NCCL_LOSSY_PROFILE = \" \": must name a profile file"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn simulate_refuses_zero_packets_instead_of_reporting_no_loss() {
    // `--packets 0` printed "loss rate 0   expected 0.01" and exited 0: a measurement of
    // nothing shown as a model that never loses.
    let out = lossy(&["simulate", "configs/uniform-1pct.toml", "--packets", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains("--packets 0") && stderr.contains("at least 1"),
        "{stderr}"
    );
}

#[test]
fn a_stopping_trace_replays_one_whole_pass_from_its_random_start() {
    // `at_end = "stop"` with the default `start = "random"`: each stream started at a random
    // packet of the trace and stopped at the trace's last packet, so it replayed only the part
    // after its start. A recording whose 10 losses open its 1000 packets lost nothing on 99 of
    // 100 streams, while validate and simulate said "expected loss 1%". A stream replays one
    // whole pass (length packets) from its start, then loses nothing: every seed loses all 10.
    let dir = fresh_dir("trace-stop-random");
    let mut bitmap = "1".repeat(10);
    bitmap.push_str(&"0".repeat(990));
    std::fs::write(dir.join("drops.txt"), bitmap).expect("write trace");
    let file = dir.join("p.toml");
    std::fs::write(
        &file,
        "model = { kind = \"trace\", file = \"drops.txt\", format = \"bitmap\", \
         at_end = \"stop\" }\n",
    )
    .expect("write profile");
    let file = file.display().to_string();
    for seed in 1..=8 {
        let seed = format!("seed={seed}");
        let out = lossy(&[
            "simulate",
            &file,
            "--packets",
            "3000",
            "--json",
            "--set",
            &seed,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let rule = &v["rules"][0];
        assert_eq!(rule["expected_loss_rate"], 0.01, "{rule}");
        // one pass: every lost packet of the trace once, none after it
        assert_eq!(rule["lost"], 10, "{seed}: {rule}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
