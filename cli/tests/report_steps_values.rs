//! `lossy report --per-step` on values a diverging or hand-edited run leaves: a training loss
//! of `inf`, `NaN` or near `f64::MAX` (in CSV, and in JSON lines with Python's bare `NaN` and
//! `Infinity` tokens), per-step counts that would overflow, a cell losing more packets than it
//! sent, and a run with no per-step data at all.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use common::{fresh_dir, lossy_exe};
use lossy_cli::commands::report::register_font;
use lossy_cli::commands::report_steps::{
    draw, find_train_log, load_run_steps, notes, read_train_log, table, RunSteps, StepRow,
};
use nccl_net_lossy::stats::writer::StatsFile;
use plotters::prelude::{IntoDrawingArea, SVGBackend};

/// A run directory holding one statistics file with no per-step series.
fn run_dir(name: &str) -> std::path::PathBuf {
    let dir = fresh_dir(name);
    let stats = StatsFile::new(serde_json::json!({"seed": 1}), vec![]);
    std::fs::write(
        dir.join("lossy-stats-rank0-x-1.json"),
        serde_json::to_string(&stats).expect("JSON"),
    )
    .expect("write");
    dir
}

/// Writes a per-step file of the Python integration with `steps` as its rows.
fn write_steps(dir: &Path, name: &str, steps: serde_json::Value) {
    let doc = serde_json::json!({"format_version": 1, "rank": 0, "host": "h", "pid": 0,
        "steps": steps});
    std::fs::write(dir.join(name), doc.to_string()).expect("write");
}

fn row(step: u64, op: &str, packets: u64, lost: u64) -> serde_json::Value {
    serde_json::json!({"step": step, "op": op, "phase": "any", "messages": 1, "bytes": 8,
        "packets": packets, "lost_packets": lost, "loss_events": 1})
}

fn run_with_metric(metric: &[(u64, f64)]) -> RunSteps {
    RunSteps {
        run: "r".to_string(),
        source: "steps files",
        rows: vec![
            StepRow {
                step: 1,
                op: "AllReduce".to_string(),
                packets: 100,
                lost_packets: 1,
                packets_injection_off: 0,
            },
            StepRow {
                step: 2,
                op: "AllReduce".to_string(),
                packets: 100,
                lost_packets: 2,
                packets_injection_off: 0,
            },
        ],
        metric: metric.iter().copied().collect(),
        steps_beyond: None,
        warnings: Vec::new(),
    }
}

/// Draws `run` into an SVG string on another thread; a drawing still going after 20 s is a
/// hang, and fails the test instead of stalling it.
fn draw_within_20s(run: RunSteps) -> Result<String, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut svg = String::new();
        let drawn = draw(
            &[run],
            "loss",
            SVGBackend::with_string(&mut svg, (1200, 600)).into_drawing_area(),
        );
        tx.send(drawn.map(|()| svg)).ok();
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the plot did not finish within 20 s")
}

#[test]
fn draw_ends_on_infinite_nan_and_huge_metric_values() {
    register_font().expect("a font");
    for metric in [
        vec![(1, 2.5), (2, f64::INFINITY)],
        vec![(2, 1e308), (3, -1e308)],
        vec![(1, f64::NAN), (2, f64::NEG_INFINITY)],
        vec![(1, f64::MAX), (2, f64::MAX)],
        vec![(1, f64::MIN), (2, f64::MAX)],
        vec![(1, 1e300), (2, 1e300)],
    ] {
        let svg =
            draw_within_20s(run_with_metric(&metric)).unwrap_or_else(|e| panic!("{metric:?}: {e}"));
        assert!(svg.contains("r: loss"), "{metric:?}: no metric in the plot");
        assert!(svg.contains("r: lost packets"), "{metric:?}");
    }
}

#[test]
fn table_shows_non_finite_values_as_they_are_and_a_note_says_the_plot_leaves_them_out() {
    let run = run_with_metric(&[(1, 2.5), (2, f64::INFINITY)]);
    let text = table(std::slice::from_ref(&run), "loss");
    let last = text.lines().last().expect("a row");
    assert_eq!(last.split_whitespace().last(), Some("inf"), "{text}");
    let said = notes(&[run], "loss");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0].contains("run r")
            && said[0].contains("step 2 (inf)")
            && said[0].contains("left out of the plot"),
        "{said:?}"
    );
    // finite values need no note; a huge one is printed short
    let huge = run_with_metric(&[(1, 2.5), (2, -1e308)]);
    assert!(notes(std::slice::from_ref(&huge), "loss").is_empty());
    let text = table(&[huge], "loss");
    let last = text.lines().last().expect("a row");
    assert_eq!(
        last.split_whitespace().last(),
        Some("-1.000000e308"),
        "{text}"
    );
}

#[test]
fn json_output_spells_non_finite_values_as_the_monitor_does() {
    let run = run_with_metric(&[
        (1, 2.5),
        (2, f64::INFINITY),
        (3, f64::NAN),
        (4, f64::NEG_INFINITY),
    ]);
    let doc = serde_json::to_value(&run).expect("JSON");
    assert_eq!(
        doc["metric"],
        serde_json::json!({"1": 2.5, "2": "inf", "3": "nan", "4": "-inf"})
    );
}

#[test]
fn csv_training_log_keeps_inf_and_nan() {
    let dir = fresh_dir("steps-csv-inf");
    let log = dir.join("train.csv");
    std::fs::write(
        &log,
        "step,loss\n1,2.5\n2,inf\n3,nan\n4,-inf\n5,1e308\n6,\n",
    )
    .expect("write");
    let got = read_train_log(&log, "loss").expect("a training log");
    assert_eq!(got.len(), 5, "{got:?}");
    assert_eq!(got[&1], 2.5);
    assert_eq!(got[&2], f64::INFINITY);
    assert!(got[&3].is_nan());
    assert_eq!(got[&4], f64::NEG_INFINITY);
    assert_eq!(got[&5], 1e308);
}

#[test]
fn jsonl_training_log_takes_python_nan_and_infinity_tokens_and_null_as_no_value() {
    let dir = fresh_dir("steps-jsonl-nan");
    let log = dir.join("perf.jsonl");
    std::fs::write(
        &log,
        concat!(
            "{\"step\": 1, \"loss\": NaN, \"note\": \"say \\\"NaN\\\" or Infinity\"}\n",
            "{\"step\": 2, \"loss\": Infinity, \"by_op\": [{\"x\": -Infinity}]}\n",
            "{\"step\": 3, \"loss\": -Infinity}\n",
            "{\"step\": 4, \"loss\": \"inf\"}\n",
            "{\"step\": 5, \"loss\": null}\n",
            "{\"step\": 6, \"loss\": 1.5}\n",
            "{\"step\": 7, \"loss\": \"nan\"}\n",
        ),
    )
    .expect("write");
    let got = read_train_log(&log, "loss").expect("a training log");
    let keys: Vec<u64> = got.keys().copied().collect();
    assert_eq!(keys, [1, 2, 3, 4, 6, 7], "{got:?}");
    assert!(got[&1].is_nan());
    assert_eq!(got[&2], f64::INFINITY);
    assert_eq!(got[&3], f64::NEG_INFINITY);
    assert_eq!(got[&4], f64::INFINITY);
    assert_eq!(got[&6], 1.5);
    assert!(got[&7].is_nan());
    // a run directory holding it finds it
    assert_eq!(find_train_log(&dir, "loss").expect("found"), log);
}

#[test]
fn a_training_log_all_ranks_append_to_gives_each_step_the_lowest_ranks_value() {
    // `performance_monitor` in every rank of a job appends to one file, each line with its
    // rank, in whatever order the ranks finish; the lowest rank's value is the step's,
    // whichever line came last. Lines without a rank keep the last one.
    let dir = fresh_dir("steps-jsonl-ranks");
    let log = dir.join("perf.jsonl");
    std::fs::write(
        &log,
        concat!(
            "{\"step\": 0, \"rank\": 0, \"loss\": 1.0}\n",
            "{\"step\": 0, \"rank\": 1, \"loss\": 9.0}\n",
            "{\"step\": 1, \"rank\": 1, \"loss\": 8.0}\n",
            "{\"step\": 1, \"rank\": 0, \"loss\": 2.0}\n",
            "{\"step\": 2, \"rank\": 1, \"loss\": 7.0}\n",
            "{\"step\": 3, \"loss\": 4.0}\n",
            "{\"step\": 3, \"loss\": 3.0}\n",
        ),
    )
    .expect("write");
    let got = read_train_log(&log, "loss").expect("a training log");
    let want = BTreeMap::from([(0, 1.0), (1, 2.0), (2, 7.0), (3, 3.0)]);
    assert_eq!(got, want);
}

#[test]
fn a_run_directory_without_a_usable_training_log_says_why_each_file_was_not_one() {
    let dir = fresh_dir("steps-jsonl-broken");
    std::fs::write(dir.join("perf.jsonl"), "{\"step\": 1, \"loss\": nope}\n").expect("write");
    let err = find_train_log(&dir, "loss").expect_err("no training log");
    assert!(
        err.contains("holds no training log") && err.contains("perf.jsonl:1: not a JSON object"),
        "{err}"
    );
}

#[test]
fn per_step_sums_stop_at_the_largest_count() {
    let dir = run_dir("steps-saturate");
    let max = u64::MAX;
    write_steps(
        &dir,
        "lossy-steps-rank0-h-1.json",
        serde_json::json!([
            row(1, "AllReduce", max, max - 1),
            row(1, "AllGather", max, max)
        ]),
    );
    write_steps(
        &dir,
        "lossy-steps-rank1-h-1.json",
        serde_json::json!([row(1, "AllReduce", max, max - 1)]),
    );
    let run = load_run_steps(&dir).expect("the run");
    let cells: Vec<(&str, u64, u64)> = run
        .rows
        .iter()
        .map(|r| (r.op.as_str(), r.packets, r.lost_packets))
        .collect();
    assert_eq!(
        cells,
        [("AllGather", max, max), ("AllReduce", max, max)],
        "{run:?}"
    );
    assert_eq!(run.lost_by_step(), BTreeMap::from([(1, max)]));
}

#[test]
fn a_per_step_file_losing_more_packets_than_it_sent_is_refused_naming_the_file_and_cell() {
    let dir = run_dir("steps-lost-above-sent");
    write_steps(
        &dir,
        "lossy-steps-rank0-h-1.json",
        serde_json::json!([row(1, "AllReduce", 100, 1), row(2, "AllReduce", 100, 500)]),
    );
    let err = load_run_steps(&dir).expect_err("refused");
    assert!(
        err.contains("lossy-steps-rank0-h-1.json")
            && err.contains("steps.1 (step 2, AllReduce)")
            && err.contains("lost_packets = 500 is more than packets = 100"),
        "{err}"
    );
}

#[test]
fn per_step_report_without_per_step_data_says_so_and_how_to_get_it() {
    let dir = run_dir("steps-none");
    let out = common::output_within_10s(
        Command::new(lossy_exe()).args(["report", dir.to_str().expect("utf-8"), "--per-step"]),
        "lossy report --per-step",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no per-step data")
            && stderr.contains("lossy-steps-rank*.json")
            && stderr.contains("LossyMegatronIntegration")
            && stderr.contains("by_step"),
        "{stderr}"
    );
    // the header alone, no rows
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
}

#[test]
fn per_step_rates_leave_out_the_packets_sent_with_injection_off() {
    // A backward phase kept lossless: half of step 1's packets were never exposed to loss,
    // and its rate is over the other half, as the report's per-step plot draws it.
    let dir = run_dir("steps-injection-off");
    let mut off = row(1, "AllReduce", 100, 0);
    off["phase"] = "backward".into();
    off["packets_injection_off"] = 100.into();
    write_steps(
        &dir,
        "lossy-steps-rank0-h-1.json",
        serde_json::json!([row(1, "AllReduce", 100, 5), off]),
    );
    let run = load_run_steps(&dir).expect("the run");
    assert_eq!(run.rows.len(), 1, "{run:?}");
    let r = &run.rows[0];
    assert_eq!(
        (r.packets, r.lost_packets, r.packets_injection_off),
        (200, 5, 100)
    );
    let text = table(std::slice::from_ref(&run), "loss");
    assert!(text.contains("5.0000"), "{text}");
    // A file claiming more packets off than sent is refused, naming it.
    let mut bad = row(2, "AllReduce", 10, 0);
    bad["packets_injection_off"] = 11.into();
    write_steps(&dir, "lossy-steps-rank1-h-1.json", serde_json::json!([bad]));
    let err = load_run_steps(&dir).expect_err("refused");
    assert!(
        err.contains("lossy-steps-rank1-h-1.json")
            && err.contains("packets_injection_off = 11 is more than packets = 10"),
        "{err}"
    );
}

#[test]
fn a_per_step_file_of_another_or_no_format_version_is_refused_naming_the_file_and_version() {
    // The per-step reader never looked at format_version: a newer file whose rows mean
    // something else, or a file with none, was summed as ours.
    for (version, expect) in [
        (
            serde_json::json!(2),
            "format_version = 2: this lossy reads version 1",
        ),
        (
            serde_json::json!("1"),
            "format_version = \"1\": this lossy reads version 1",
        ),
        (serde_json::Value::Null, "no format_version"),
    ] {
        let dir = run_dir("steps-version");
        let mut doc = serde_json::json!({"rank": 0, "host": "h", "pid": 0,
            "steps": [row(1, "AllReduce", 100, 1)]});
        if !version.is_null() {
            doc["format_version"] = version.clone();
        }
        std::fs::write(dir.join("lossy-steps-rank0-h-1.json"), doc.to_string()).expect("write");
        let err = load_run_steps(&dir).expect_err("refused");
        assert!(
            err.contains("lossy-steps-rank0-h-1.json") && err.contains(expect),
            "for {version}: {err}"
        );
    }
}

#[test]
fn a_statistics_file_whose_steps_or_rules_lose_more_than_they_sent_is_refused() {
    // The reader checked the totals and the collectives' cells, not `by_step` nor a
    // connection's `by_rule`: `lossy report --per-step` printed a loss of 200.0000 % for a
    // hand-edited statistics file, where a per-step file with the same row is refused.
    let counts = |packets: u64, lost: u64| {
        serde_json::json!({"messages": 1, "bytes": 8, "packets": packets, "lost_packets": lost,
            "loss_events": lost.min(1), "retransmit_delay_ns": 0, "packets_injection_off": 0})
    };
    let stats = StatsFile::new(serde_json::json!({"seed": 1}), vec![]);
    let base = serde_json::to_value(&stats).expect("JSON");
    let mut steps = base.clone();
    steps["by_step"] = serde_json::json!([{"step": 1, "packets": 10, "lost_packets": 1},
        {"step": 2, "packets": 10, "lost_packets": 20}]);
    let mut rules = base;
    let mut by_rule = counts(1, 99);
    by_rule["rule"] = serde_json::Value::Null;
    rules["connections"] = serde_json::json!([{"comm_id": 1, "index": 0, "total": counts(1, 0),
        "by_op": [], "by_rule": [by_rule], "histograms": []}]);
    for (doc, args, want) in [
        (
            steps,
            &["--per-step"][..],
            "by_step.1 (step 2): lost_packets = 20 is more than packets = 10",
        ),
        (
            rules,
            &[][..],
            "connections.0.by_rule.0: lost_packets = 99 is more than packets = 1",
        ),
    ] {
        let dir = fresh_dir("stats-file-cells");
        let file = dir.join("lossy-stats-rank0-h-1.json");
        std::fs::write(&file, doc.to_string()).expect("write");
        let out = common::output_within_10s(
            Command::new(lossy_exe())
                .args(["report", dir.to_str().expect("utf-8")])
                .args(args),
            "lossy report",
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{want}: {stdout}{stderr}");
        assert!(
            stderr.contains("lossy-stats-rank0-h-1.json") && stderr.contains(want),
            "{stderr}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn a_training_log_still_being_written_leaves_out_its_unfinished_last_line() {
    // A log read while the run appends to it (or after it was killed mid-line) ends in part
    // of a line: `3,0.75` cut to `3,0.` was read as a loss of 0 at step 3, and a JSON line cut
    // short failed the whole report.
    let dir = run_dir("steps-log-unfinished");
    write_steps(
        &dir,
        "lossy-steps-rank0-h-0.json",
        serde_json::json!([row(1, "AllReduce", 10, 1), row(3, "AllReduce", 10, 2)]),
    );
    let csv = dir.join("train.csv");
    std::fs::write(&csv, "step,loss\n1,2.5\n2,1.25\n3,0.").expect("write");
    let jsonl = dir.join("perf.jsonl");
    std::fs::write(
        &jsonl,
        "{\"step\": 1, \"loss\": 2.5}\n{\"step\": 2, \"loss\": 1.25}\n{\"step\": 3, \"lo",
    )
    .expect("write");
    for (log, line) in [(&csv, "train.csv:4"), (&jsonl, "perf.jsonl:3")] {
        let out = Command::new(lossy_exe())
            .arg("report")
            .arg(&dir)
            .args(["--per-step", "--csv", "--train-log"])
            .arg(log)
            .output()
            .expect("run lossy");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{line}: {stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let metric_of = |step: &str| {
            stdout
                .lines()
                .map(|l| l.split(',').collect::<Vec<_>>())
                .find(|f| f.get(1) == Some(&step))
                .map(|f| f.last().copied().unwrap_or_default().to_string())
        };
        assert_eq!(metric_of("1").as_deref(), Some("2.5"), "{line}: {stdout}");
        assert_eq!(metric_of("3").as_deref(), Some(""), "{line}: {stdout}");
        assert!(
            stderr.contains(line) && stderr.contains("unfinished"),
            "{line}: {stderr}"
        );
    }
    // A line that ends the file without a newline but is whole JSON is kept.
    std::fs::write(
        &jsonl,
        "{\"step\": 1, \"loss\": 2.5}\n{\"step\": 3, \"loss\": 0.75}",
    )
    .expect("write");
    let got = read_train_log(&jsonl, "loss").expect("a training log");
    assert_eq!(got, BTreeMap::from([(1, 2.5), (3, 0.75)]));
}

#[test]
fn a_training_log_of_one_unfinished_line_is_refused_saying_so_not_as_empty() {
    // A CSV log whose only line has no newline yet (a run that just started) was refused as
    // "empty CSV file", with nothing about the line that was there and left out.
    let dir = run_dir("steps-log-one-line");
    let csv = dir.join("train.csv");
    std::fs::write(&csv, "step,loss").expect("write");
    let err = read_train_log(&csv, "loss").expect_err("no step in the log");
    assert!(
        err.contains("train.csv:1") && err.contains("unfinished last line"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_training_log_saved_with_a_byte_order_mark_is_read_as_without() {
    // Spreadsheets' "CSV UTF-8" and some editors write a byte-order mark first: the CSV
    // header's first column read as "\u{feff}step", refused as `no column "step"`, and the
    // first JSON line as no JSON.
    let dir = fresh_dir("steps-bom");
    let csv = dir.join("train.csv");
    std::fs::write(&csv, "\u{feff}step,loss\r\n0,1.5\r\n1,1.25\r\n").expect("write");
    let jsonl = dir.join("perf.jsonl");
    std::fs::write(
        &jsonl,
        "\u{feff}{\"step\": 0, \"loss\": 1.5}\n{\"step\": 1, \"loss\": 1.25}\n",
    )
    .expect("write");
    let want = BTreeMap::from([(0, 1.5), (1, 1.25)]);
    for log in [&csv, &jsonl] {
        let got = read_train_log(log, "loss");
        assert_eq!(got, Ok(want.clone()), "{}", log.display());
    }
}

#[test]
fn a_csv_training_log_with_quoted_fields_is_read_column_by_column() {
    // Python's csv module and pandas quote a field holding a comma or a quote (and
    // QUOTE_ALL every field): the quotes were kept (`"step"` is no column "step") and a comma
    // inside quotes split the row, moving every later column: `lr` read the loss.
    let dir = fresh_dir("steps-csv-quoted");
    let log = dir.join("train.csv");
    std::fs::write(
        &log,
        concat!(
            "\"step\",\"note\",\"loss\",\"lr\"\n",
            "0,\"warmup, epoch 1\",1.5,0.001\n",
            "1,\"said \"\"hi\"\", then\nwent on\",1.25,0.002\n",
            "\"2\",plain,\"1.0\",\"0.003\"\n",
        ),
    )
    .expect("write");
    let got = read_train_log(&log, "lr");
    assert_eq!(
        got,
        Ok(BTreeMap::from([(0, 0.001), (1, 0.002), (2, 0.003)]))
    );
    let got = read_train_log(&log, "loss");
    assert_eq!(got, Ok(BTreeMap::from([(0, 1.5), (1, 1.25), (2, 1.0)])));
    // a quote never closed is an error naming the line it opens on
    std::fs::write(&log, "step,note,loss\n0,ok,1.0\n1,\"open,2.0\n2,x,3.0\n").expect("write");
    let err = read_train_log(&log, "loss").expect_err("an unclosed quote");
    assert!(
        err.contains("train.csv:3:") && err.contains("quote"),
        "{err}"
    );
}

#[test]
fn a_training_log_step_that_is_no_step_number_is_named_with_what_is_allowed() {
    // "LOG:2: no integer step" named neither the value (a negative step, one past 64 bits, a
    // fraction) nor what a step may be.
    let dir = fresh_dir("train-log-bad-step");
    let long = "9".repeat(100_000);
    for (name, text, shown) in [
        ("neg.csv", "step,loss\n-1,2.5\n".to_string(), "`-1`"),
        (
            "big.csv",
            "step,loss\n99999999999999999999,2.5\n".to_string(),
            "`99999999999999999999`",
        ),
        (
            "long.csv",
            format!("step,loss\n{long},2.5\n"),
            "bytes in all",
        ),
        (
            "frac.jsonl",
            "{\"step\": 1.5, \"loss\": 2.5}\n".to_string(),
            "1.5",
        ),
        (
            "text.jsonl",
            "{\"step\": \"one\", \"loss\": 2.5}\n".to_string(),
            "\"one\"",
        ),
    ] {
        let log = dir.join(name);
        std::fs::write(&log, text).expect("write");
        let err = read_train_log(&log, "loss").expect_err("a bad step is refused");
        assert!(
            err.contains(&format!("{}:", log.display()))
                && err.contains("step = ")
                && err.contains(shown)
                && err.contains("an integer from 0 to 18446744073709551615")
                && err.len() < 500,
            "{name}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
