//! `lossy report` over counts whose sum passes 2^64-1 (files edited by hand, or of a broken
//! writer): each sum stops at 18446744073709551615, and the report says that it did, in the
//! table, the CSV and the JSON, instead of showing the cap as if it were the total.

mod common;

use std::path::Path;
use std::process::Command;

use common::{fresh_dir, lossy_exe, output_within_10s};

const MAX: u64 = u64::MAX;

/// A statistics file of rank `rank` whose one connection sent `messages` messages of
/// `bytes` bytes in all, on AllReduce, decided by the profile's defaults.
fn write_rank(dir: &Path, rank: u64, messages: u64, bytes: u64) {
    write_rank_with_steps(dir, rank, messages, bytes, serde_json::json!([]));
}

/// As [`write_rank`], with the per-step series `by_step`.
fn write_rank_with_steps(
    dir: &Path,
    rank: u64,
    messages: u64,
    bytes: u64,
    by_step: serde_json::Value,
) {
    let counts = serde_json::json!({
        "messages": messages, "bytes": bytes, "packets": 0, "lost_packets": 0,
        "loss_events": 0, "retransmit_delay_ns": 0, "packets_injection_off": 0,
    });
    let mut op = counts.clone();
    op["op"] = "AllReduce".into();
    op["phase"] = "any".into();
    let mut rule = counts.clone();
    rule["rule"] = serde_json::Value::Null;
    let file = serde_json::json!({
        "format_version": 1, "rank": rank, "world_size": 2, "host": "h", "pid": 100 + rank,
        "written_at_unix_ms": 0,
        "profile": {"origin": "embedded default", "overrides": "", "seed": 1, "rules": []},
        "total": counts,
        "connections": [{
            "comm_id": 1, "index": 0, "total": counts, "by_op": [op], "by_rule": [rule],
            "histograms": [],
        }],
        "by_step": by_step,
    });
    std::fs::write(
        dir.join(format!("lossy-stats-rank{rank}-h-{}.json", 100 + rank)),
        file.to_string(),
    )
    .expect("write a statistics file");
}

/// `lossy report DIR args` (it must succeed): its stdout and stderr.
fn report(dir: &Path, args: &[&str]) -> (String, String) {
    let mut cmd = Command::new(lossy_exe());
    cmd.arg("report").arg(dir).args(args);
    let out = output_within_10s(&mut cmd, "lossy report");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), stderr)
}

/// A run of two ranks that each sent 2^64-1 messages and bytes.
fn saturated_run(name: &str) -> std::path::PathBuf {
    let dir = fresh_dir(name).join("run");
    std::fs::create_dir_all(&dir).expect("mkdir");
    write_rank(&dir, 0, MAX, MAX);
    write_rank(&dir, 1, MAX, MAX);
    dir
}

#[test]
fn a_table_total_past_2_to_the_64_is_shown_as_a_lower_bound() {
    let dir = saturated_run("report-saturated-table");
    let (table, _) = report(&dir, &[]);
    let all = table
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("all"))
        .expect("the all row");
    assert!(all.contains(&format!("≥{MAX}")), "{table}");
    assert!(all.contains("≥16777216.0 TiB"), "{table}");
    assert!(
        table.contains("warning:") && table.contains("stopped at"),
        "{table}"
    );
}

#[test]
fn csv_and_json_say_which_sums_stopped_at_2_to_the_64() {
    let dir = saturated_run("report-saturated-formats");
    let (csv, stderr) = report(&dir, &["--csv"]);
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let at = |name: &str| header.iter().position(|h| *h == name).expect(name);
    for line in lines {
        let row: Vec<&str> = line.split(',').collect();
        // The numbers stay numbers (what a reader of the column parses), the cap.
        assert_eq!(row[at("messages")], MAX.to_string(), "{csv}");
        assert_eq!(row[at("saturated")], "messages;bytes", "{csv}");
    }
    assert!(stderr.contains("stopped at"), "{stderr}");
    let (json, _) = report(&dir, &["--json"]);
    let runs: serde_json::Value = serde_json::from_str(&json).expect("report --json");
    let run = &runs[0];
    let saturated = serde_json::json!(["messages", "bytes"]);
    assert_eq!(run["total"]["saturated"], saturated, "{json}");
    assert_eq!(run["by_op"][0]["saturated"], saturated, "{json}");
    assert_eq!(run["by_rule"][0]["saturated"], saturated, "{json}");
    assert!(run["warnings"][0]
        .as_str()
        .is_some_and(|w| w.contains("stopped at")));
}

#[test]
fn a_sum_that_only_reaches_2_to_the_64_minus_1_is_exact() {
    // One file at the largest count, one at 0: the sum is exact, and shown as it is.
    let dir = fresh_dir("report-saturated-exact").join("run");
    std::fs::create_dir_all(&dir).expect("mkdir");
    write_rank(&dir, 0, MAX, MAX);
    write_rank(&dir, 1, 0, 0);
    let (table, _) = report(&dir, &[]);
    assert!(
        table.contains(&MAX.to_string()) && !table.contains('≥') && !table.contains("warning"),
        "{table}"
    );
    let (json, _) = report(&dir, &["--json"]);
    let runs: serde_json::Value = serde_json::from_str(&json).expect("report --json");
    assert_eq!(
        runs[0]["total"]["saturated"],
        serde_json::json!([]),
        "{json}"
    );
}

#[test]
fn per_step_sums_past_2_to_the_64_are_warned_of() {
    // The series of steps (`by_step` in --json, the plot) is summed over ranks the same way.
    let dir = fresh_dir("report-saturated-steps").join("run");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let steps = serde_json::json!([{"step": 1, "packets": MAX, "lost_packets": 0}]);
    write_rank_with_steps(&dir, 0, 1, 1, steps.clone());
    write_rank_with_steps(&dir, 1, 1, 1, steps);
    let (json, _) = report(&dir, &["--json"]);
    let runs: serde_json::Value = serde_json::from_str(&json).expect("report --json");
    let warnings = runs[0]["warnings"].to_string();
    assert!(
        warnings.contains("by_step") && warnings.contains("stopped at"),
        "{json}"
    );
}
