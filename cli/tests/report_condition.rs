//! `lossy report` answers "is the condition I set the condition that ran?": traffic sent with
//! injection switched off is counted apart, and a directory that holds several runs says so
//! instead of summing them as one.

mod common;

use std::path::Path;

use common::fresh_dir;

use common::lossy_stdout as lossy;

fn report_json(dir: &Path) -> serde_json::Value {
    let text = lossy(&["report", "--json", dir.to_str().expect("utf-8")], &[]);
    let runs: serde_json::Value = serde_json::from_str(&text).expect("report --json");
    runs[0].clone()
}

fn count(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

#[test]
fn traffic_sent_with_injection_off_is_counted_apart_and_the_report_says_so() {
    // `--lossless` switches injection off (ncclLossySetEnabled(0)) for every iteration: under
    // the default profile (1% loss) nothing is lost, and the file must say why.
    let off = fresh_dir("report-injection-off");
    let stats = off.to_str().expect("utf-8");
    lossy(
        &["bench", "--sizes", "64K", "--iters", "5", "--lossless"],
        &[("NCCL_LOSSY_STATS", stats)],
    );
    let run = report_json(&off);
    let total = &run["total"];
    assert!(count(total, "packets") > 0, "{total}");
    assert_eq!(count(total, "lost_packets"), 0, "{total}");
    assert_eq!(
        count(total, "packets_injection_off"),
        count(total, "packets"),
        "{total}"
    );
    assert!(total["loss_rate_injecting"].is_null(), "{total}");
    let table = lossy(&["report", stats], &[]);
    assert!(
        table.contains("injection off for 100.00 % of the packets"),
        "{table}"
    );

    // `--vs-lossless`: the plugin's link injects, the lossless link does not; the loss rate
    // over the injecting packets leaves the others out.
    let mixed = fresh_dir("report-injection-mixed");
    let stats = mixed.to_str().expect("utf-8");
    lossy(
        &["bench", "--sizes", "64K", "--iters", "20", "--vs-lossless"],
        &[("NCCL_LOSSY_STATS", stats)],
    );
    let run = report_json(&mixed);
    let total = &run["total"];
    let (packets, off, lost) = (
        count(total, "packets"),
        count(total, "packets_injection_off"),
        count(total, "lost_packets"),
    );
    // The two links carry the same traffic: half the packets each.
    assert_eq!(off * 2, packets, "{total}");
    let on_rate = total["loss_rate_injecting"].as_f64().expect("a rate");
    assert!((on_rate - lost as f64 / (packets - off) as f64).abs() < 1e-12);
    let table = lossy(&["report", stats], &[]);
    assert!(
        table.contains("injection off for 50.00 % of the packets"),
        "{table}"
    );
    // --csv carries the counter and the rate too, in columns of their own at the end
    let csv = lossy(&["report", "--csv", stats], &[]);
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let all: Vec<&str> = lines
        .find(|l| l.split(',').nth(1) == Some("all"))
        .expect("the all row")
        .split(',')
        .collect();
    let at = |name: &str| header.iter().position(|h| *h == name).expect(name);
    assert_eq!(all[at("packets_injection_off")], off.to_string(), "{csv}");
    let csv_rate: f64 = all[at("loss_rate_injecting")].parse().expect("a rate");
    assert!((csv_rate - on_rate).abs() < 1e-12, "{csv}");
    assert_eq!(all[at("files")], "2", "{csv}");
}

#[test]
fn a_directory_holding_two_runs_is_not_summed_as_one_without_a_warning() {
    let dir = fresh_dir("report-two-runs");
    let stats = dir.to_str().expect("utf-8");
    lossy(&["demo", "--sizes", "64K"], &[("NCCL_LOSSY_STATS", stats)]);
    lossy(
        &["demo", "--sizes", "64K"],
        &[
            ("NCCL_LOSSY_STATS", stats),
            ("NCCL_LOSSY_SET", "model.rate=0.2"),
        ],
    );
    let run = report_json(&dir);
    // 8 files of 4 ranks: the ranks are counted once each
    assert_eq!(count(&run, "ranks"), 4, "{run}");
    assert_eq!(count(&run, "files"), 8, "{run}");
    let warnings: Vec<String> = run["warnings"]
        .as_array()
        .expect("warnings")
        .iter()
        .map(|w| w.as_str().expect("text").to_string())
        .collect();
    assert!(
        warnings.iter().any(|w| w.contains("different profiles")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("rank 0") && w.contains("2 files")),
        "{warnings:?}"
    );
    let table = lossy(&["report", stats], &[]);
    assert!(table.contains("warning: "), "{table}");

    // One run alone: no warning.
    let one = fresh_dir("report-one-run");
    lossy(
        &["demo", "--sizes", "64K"],
        &[("NCCL_LOSSY_STATS", one.to_str().expect("utf-8"))],
    );
    let run = report_json(&one);
    assert_eq!(run["warnings"].as_array().map(Vec::len), Some(0), "{run}");
    assert_eq!(count(&run, "ranks"), 4, "{run}");
}

/// `lossy report RUN | head -1`: a reader that stops early closes the pipe; the report stops
/// quietly (no panic, no backtrace on the terminal) and still draws `--plot`.
#[test]
fn a_reader_that_closes_the_pipe_early_gets_no_panic() {
    let dir = fresh_dir("report-closed-pipe");
    let stats = dir.to_str().expect("utf-8");
    lossy(
        &["demo", "--ranks", "2", "--sizes", "64K"],
        &[("NCCL_LOSSY_STATS", stats)],
    );
    let plot = dir.join("plot.svg");
    for format in ["--csv", "--json", "--plot"] {
        let mut args = vec!["report", stats, format];
        if format == "--plot" {
            args.push(plot.to_str().expect("utf-8"));
        }
        let mut child = std::process::Command::new(common::lossy_exe())
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run lossy report");
        // Close the reading end before the report writes anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("wait for lossy report");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{format}: {stderr}");
        assert!(out.status.success(), "{format}: {:?} {stderr}", out.status);
    }
    assert!(plot.is_file(), "the plot was not drawn");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn each_rule_is_counted_and_reported_with_its_own_expected_loss() {
    // Two rules with different models and the defaults: which rule decided each message is
    // counted, and the report sets each rule's loss next to its own closed form (before, only
    // the first lossy model's expectation was shown, for the whole run).
    let dir = fresh_dir("report-by-rule");
    let profile = dir.join("rules.toml");
    std::fs::write(
        &profile,
        "seed = 3\nmtu = 1024\nmodel = { kind = \"none\" }\n\
         [[rules]]\nname = \"ar five\"\ncollective = \"AllReduce\"\neffect = \"zero\"\n\
         model = { kind = \"uniform\", rate = 0.05 }\n\
         [[rules]]\ncollective = \"AllGather\"\neffect = \"zero\"\n\
         model = { kind = \"gilbert_elliott\", p = 0.01, r = 0.25 }\n",
    )
    .expect("profile");
    let stats = dir.join("stats");
    lossy(
        &[
            "demo",
            "--sizes",
            "1M",
            "--stats-dir",
            stats.to_str().expect("utf-8"),
        ],
        &[("NCCL_LOSSY_PROFILE", profile.to_str().expect("utf-8"))],
    );
    let run = report_json(&stats);
    let rules = run["by_rule"].as_array().expect("by_rule");
    let row = |rule: Option<u64>| -> &serde_json::Value {
        rules
            .iter()
            .find(|r| r["rule"].as_u64() == rule)
            .unwrap_or_else(|| panic!("no rule {rule:?} in {rules:?}"))
    };
    // Rules are numbered as in the profile's keys (`rules.0`), the defaults have none.
    let (ar, ag, defaults) = (row(Some(0)), row(Some(1)), row(None));
    assert_eq!(ar["name"], "ar five");
    assert!(
        ag["name"].is_null() && defaults["name"].is_null(),
        "{ag} {defaults}"
    );
    // Each rule decided exactly its collective's messages: AllReduce, AllGather, and
    // ReduceScatter under the defaults.
    let op = |name: &str| -> &serde_json::Value {
        run["by_op"]
            .as_array()
            .and_then(|ops| ops.iter().find(|o| o["op"] == name))
            .unwrap_or_else(|| panic!("no {name} in {run}"))
    };
    for (r, name) in [
        (ar, "AllReduce"),
        (ag, "AllGather"),
        (defaults, "ReduceScatter"),
    ] {
        for key in ["messages", "packets", "lost_packets"] {
            assert_eq!(count(r, key), count(op(name), key), "{key}: {r}");
        }
    }
    assert_eq!(count(defaults, "lost_packets"), 0, "{defaults}");
    // Expected: 5% uniform; Gilbert-Elliott p/(p+r) = 0.01/0.26 = 3.85%, mean burst 1/r = 4.
    let expected = |r: &serde_json::Value, key: &str| r["expected"][key].as_f64().expect(key);
    assert!((expected(ar, "loss_rate") - 0.05).abs() < 1e-12, "{ar}");
    assert!(
        (expected(ag, "loss_rate") - 0.01 / 0.26).abs() < 1e-12,
        "{ag}"
    );
    assert!((expected(ag, "mean_burst") - 4.0).abs() < 1e-12, "{ag}");
    assert!(
        defaults["expected"]["loss_rate"].as_f64() == Some(0.0),
        "{defaults}"
    );
    // Observed: the AllReduce rule saw at least 16,384 packets of 1 KiB (asserted); over n
    // packets the uniform rate's standard deviation is sqrt(0.05 * 0.95 / n) <= 0.0017, so
    // 5% +- 1 point is 5.8 sd. The seed is fixed: the counts repeat exactly.
    let rate = |r: &serde_json::Value| count(r, "lost_packets") as f64 / count(r, "packets") as f64;
    assert!(count(ar, "packets") >= 16_384, "{ar}");
    assert!(
        (rate(ar) - 0.05).abs() < 0.01,
        "AllReduce rule lost {}",
        rate(ar)
    );
    assert!(rate(ag) > 0.0, "{ag}");
    // The table: a row per rule, its loss beside its model's.
    let table = lossy(&["report", stats.to_str().expect("utf-8")], &[]);
    let line = |name: &str| {
        table
            .lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no row {name} in\n{table}"))
            .to_string()
    };
    assert!(line("rules.0 ar five").contains("5.0000"), "{table}");
    assert!(line("rules.1 ").contains("3.8462"), "{table}");
    assert!(line("defaults").contains("0.0000"), "{table}");
}

#[test]
fn the_table_names_the_profile_its_overrides_and_seed() {
    // The table gave the counts and the model's closed form, but not which profile ran nor
    // with which overrides and seed: the runs of a sweep (`--set model.rate=$rate`) were told
    // apart by their directory names alone (`--json` had it all).
    let dir = fresh_dir("report-names-profile");
    let stats = dir.to_str().expect("utf-8");
    let profile = common::repo_file("configs/uniform-1pct.toml");
    lossy(
        &["demo", "--ranks", "2", "--sizes", "64K"],
        &[
            ("NCCL_LOSSY_STATS", stats),
            ("NCCL_LOSSY_PROFILE", profile.to_str().expect("utf-8")),
            ("NCCL_LOSSY_SET", "model.rate=0.02;seed=7"),
        ],
    );
    let table = lossy(&["report", stats], &[]);
    let line = table
        .lines()
        .find(|l| l.contains(" profile "))
        .unwrap_or_else(|| panic!("no profile line: {table}"));
    for word in [
        "uniform-1pct.toml",
        "overrides `model.rate=0.02;seed=7`",
        "seed 7",
        "uniform(rate=0.02)",
        "effect zero",
    ] {
        assert!(line.contains(word), "no `{word}` in: {line}");
    }
}
