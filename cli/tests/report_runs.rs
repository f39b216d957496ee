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

#[test]
fn per_step_report_names_the_processes_without_a_per_step_file() {
    // The per-step rows come from the Python integration's per-step files, which a process
    // writes at disable() / write_stats(): one killed before that left its statistics file (the
    // plugin writes it as it goes) and no per-step file, and the per-step report summed the
    // other ranks' rows as if they were the whole run.
    let run = fresh_dir("report-missing-steps").join("run");
    demo_into(&run, 1);
    let mut files: Vec<_> = std::fs::read_dir(&run)
        .expect("run dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    let docs: Vec<serde_json::Value> = files
        .iter()
        .map(|f| serde_json::from_str(&std::fs::read_to_string(f).expect("read")).expect("JSON"))
        .collect();
    let rank0 = docs.iter().find(|d| d["rank"] == 0).expect("rank 0's file");
    let rank1 = docs.iter().find(|d| d["rank"] == 1).expect("rank 1's file");
    // Rank 0's recorder wrote its rows, as the integration does; rank 1 wrote none.
    let packets = rank0["total"]["packets"].as_u64().expect("packets");
    let steps = serde_json::json!({"format_version": 1, "rank": 0, "host": rank0["host"],
        "pid": rank0["pid"], "written_at_unix_ms": 0, "steps": [{"step": 0, "op": "AllReduce",
        "phase": "any", "messages": 1, "bytes": 1, "packets": packets, "lost_packets": 0,
        "loss_events": 0}]});
    std::fs::write(
        run.join(format!("lossy-steps-rank0-x-{}.json", rank0["pid"])),
        steps.to_string(),
    )
    .expect("write");
    let out = lossy(&["report", run.to_str().expect("utf-8"), "--per-step"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rank1_pid = format!("{}:{}", rank1["host"].as_str().expect("host"), rank1["pid"]);
    assert!(
        stderr.contains("no per-step file") && stderr.contains(&rank1_pid),
        "{stderr}"
    );
    // Rank 0, which wrote one, is not named.
    let rank0_pid = format!("{}:{}", rank0["host"].as_str().expect("host"), rank0["pid"]);
    assert!(!stderr.contains(&rank0_pid), "{stderr}");
    // Rank 1's per-step file, its process's host name read differently (same pid and rank):
    // every process has one.
    let mut steps1 = steps.clone();
    steps1["rank"] = 1.into();
    steps1["pid"] = rank1["pid"].clone();
    steps1["host"] = "read-differently".into();
    std::fs::write(
        run.join(format!("lossy-steps-rank1-x-{}.json", rank1["pid"])),
        steps1.to_string(),
    )
    .expect("write");
    let out = lossy(&["report", run.to_str().expect("utf-8"), "--per-step"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("no per-step file"), "{stderr}");
}

#[test]
fn report_names_the_ranks_of_the_run_that_left_no_statistics_file() {
    // A rank killed (or OOM-killed) before it wrote its statistics leaves no file at all: the
    // report summed the other ranks as the whole run, `ranks` one less and no word said.
    let run = fresh_dir("report-missing-rank").join("run");
    demo_into(&run, 1);
    let last = std::fs::read_dir(&run)
        .expect("run dir")
        .map(|e| e.expect("entry").path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("lossy-stats-rank1-"))
        })
        .expect("rank 1's file");
    std::fs::remove_file(&last).expect("remove");
    let dir = run.to_str().expect("utf-8");
    for args in [
        vec!["report", dir],
        vec!["report", dir, "--csv"],
        vec!["report", dir, "--per-step"],
    ] {
        let out = lossy(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        let said = format!("{}{stderr}", String::from_utf8_lossy(&out.stdout));
        assert!(
            said.contains("no statistics file from rank 1 of the 2"),
            "{args:?}: {said}"
        );
    }
    // The whole run: nothing to say.
    let whole = fresh_dir("report-whole-run").join("run");
    demo_into(&whole, 1);
    let out = lossy(&["report", whole.to_str().expect("utf-8")]);
    assert!(out.status.success());
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!said.contains("no statistics file"), "{said}");
}

#[test]
fn runs_whose_directories_share_a_name_are_told_apart() {
    // `lossy report sweep1/rate-1 sweep2/rate-1` named both runs `rate-1`: the table, the
    // CSV rows and the plot's legend could not say which numbers were whose.
    let top = fresh_dir("report-same-name");
    let (a, b) = (top.join("a").join("run"), top.join("b").join("run"));
    demo_into(&a, 1);
    demo_into(&b, 2);
    let (a, b) = (a.to_str().expect("utf-8"), b.to_str().expect("utf-8"));
    for per_step in [false, true] {
        let mut args = vec!["report", a, b, "--csv"];
        if per_step {
            args.push("--per-step");
        }
        let out = lossy(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let names: std::collections::BTreeSet<&str> = stdout
            .lines()
            .skip(1)
            .filter_map(|l| l.split(',').next())
            .collect();
        if per_step {
            // No per-step data in a demo: no rows, a note per run naming it.
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                stderr.contains(&format!("run {a}:")) && stderr.contains(&format!("run {b}:")),
                "{stderr}"
            );
        } else {
            assert_eq!(names, std::collections::BTreeSet::from([a, b]), "{stdout}");
        }
    }
    // Names that differ stay short.
    let c = top.join("c").join("other");
    demo_into(&c, 3);
    let out = lossy(&["report", a, c.to_str().expect("utf-8"), "--csv"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .lines()
            .skip(1)
            .all(|l| l.starts_with("run,") || l.starts_with("other,")),
        "{stdout}"
    );
}

/// Fields of one CSV record as RFC 4180 reads them (quoted fields may hold commas and doubled
/// quotes; a record ends at a newline outside quotes).
fn csv_fields(record: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = record.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (false, '"') if field.is_empty() => quoted = true,
            (false, ',') => fields.push(std::mem::take(&mut field)),
            (_, c) => field.push(c),
        }
    }
    fields.push(field);
    fields
}

#[test]
fn csv_reports_quote_a_run_name_that_holds_commas_or_quotes() {
    // A run directory named for its condition (`rate,0.01 "bursty"`) came out of `--csv`
    // with its commas turned into underscores (and its quotes as they were): a name no
    // longer the directory's, and a quote a CSV reader takes for the start of a field.
    // RFC 4180: a field with a comma, a quote or a line break is quoted, quotes doubled.
    let name = "rate,0.01 \"bursty\"";
    let run = fresh_dir("report-csv-quoting").join(name);
    demo_into(&run, 3);
    let dir = run.to_str().expect("utf-8");
    for args in [
        vec!["report", dir, "--csv"],
        vec!["report", dir, "--per-step", "--csv"],
    ] {
        let out = lossy(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let mut lines = text.lines().filter(|l| !l.starts_with('#'));
        let header = csv_fields(lines.next().expect("a header"));
        let records: Vec<Vec<String>> = lines.map(csv_fields).collect();
        // The demo sets no training step: the per-step report has its header alone.
        assert!(
            !records.is_empty() || args.contains(&"--per-step"),
            "{args:?}: {text}"
        );
        for record in &records {
            assert_eq!(record.len(), header.len(), "{args:?}: {record:?}\n{text}");
            assert_eq!(record[0], name, "{args:?}: {text}");
        }
    }
}

#[test]
fn a_statistics_file_with_a_value_of_kilobytes_is_refused_with_the_value_cut() {
    // A hand-edited or broken statistics file holding a string of 100 KB where a number goes
    // was refused with the whole string echoed (100 KB of error); cut as every other echo,
    // the file and the place in it still named.
    let dir = fresh_dir("report-long-value");
    demo_into(&dir, 3);
    let file = std::fs::read_dir(&dir)
        .expect("read run directory")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains("lossy-stats-rank0"))
        .expect("rank 0's statistics file");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("read")).expect("json");
    value["total"]["messages"] = "9".repeat(100_000).into();
    std::fs::write(&file, serde_json::to_string_pretty(&value).expect("json")).expect("write");
    let out = lossy(&["report", dir.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.len() < 2_000
            && stderr.contains(&file.display().to_string())
            && stderr.contains("bytes in all")
            && stderr.contains("at line"),
        "{} bytes: {}",
        stderr.len(),
        &stderr[..stderr.len().min(300)]
    );
    std::fs::remove_dir_all(&dir).ok();
}
