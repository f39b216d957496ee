//! `lossy report RUN... --per-step`: lost packets per training step by collective, and with
//! `--train-log` the training loss (or another metric) beside it on a shared step axis.
//!
//! Per collective, the counts come from the per-step files the Python integration writes
//! next to the statistics (`lossy-steps-rank*.json`: step x collective x phase); without
//! them, from the plugin's own per-step series (`by_step` of `lossy-stats-*.json`), as one
//! collective `all`.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use nccl_net_lossy::files::read_regular_file;
use nccl_net_lossy::stats::report::{bump, load_run_files};
use nccl_net_lossy::stats::writer::{StatsFile, MAX_STATS_FILE_BYTES};
use nccl_net_lossy::stats::{loss_rate_injecting, StepCounts};

/// The per-step files of the Python integration.
const STEP_FILE_PREFIX: &str = "lossy-steps-rank";

/// The `format_version` of the per-step files this report reads (the Python helper's
/// `STEP_FORMAT_VERSION`).
const STEP_FORMAT_VERSION: u64 = 1;

/// Largest training log read, in bytes: a JSON line or CSV row per logged step.
const MAX_TRAIN_LOG_BYTES: u64 = 1 << 30;

/// One (step, collective) of a run, summed over ranks and phases.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepRow {
    /// Training step.
    pub step: u64,
    /// Collective (`all` when only the plugin's per-step series is there).
    pub op: String,
    /// Packets sent.
    pub packets: u64,
    /// Packets lost.
    pub lost_packets: u64,
    /// Of `packets`, those sent with injection switched off (never exposed to loss).
    pub packets_injection_off: u64,
}

impl StepRow {
    /// Lost packets over the packets sent with injection on, the rate to hold against the
    /// model (0 when none was).
    pub fn loss_rate(&self) -> f64 {
        loss_rate_injecting(self.packets, self.lost_packets, self.packets_injection_off)
            .unwrap_or(0.0)
    }
}

/// One run's per-step counts and, when given, its training metric per step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSteps {
    /// The run's name (its directory name).
    pub run: String,
    /// Where the rows came from: `steps files` or `by_step`.
    pub source: &'static str,
    /// Rows by step, then collective.
    pub rows: Vec<StepRow>,
    /// The training metric by step (from `--train-log`); in JSON a value that is not finite
    /// is the string `"inf"`, `"-inf"` or `"nan"`, as the training monitor writes it.
    #[serde(serialize_with = "metric_as_json")]
    pub metric: BTreeMap<u64, f64>,
    /// With rows from `by_step`: what the statistics files count at the steps past the
    /// plugin's per-step series (`step`: the first of them), which no row shows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps_beyond: Option<StepCounts>,
    /// What makes the sums doubtful, as `lossy report` says it of the statistics files
    /// (several runs or profiles in one directory).
    pub warnings: Vec<String>,
}

/// `metric` with the values that are not finite as strings (JSON numbers cannot be).
fn metric_as_json<S: serde::Serializer>(
    metric: &BTreeMap<u64, f64>,
    out: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = out.serialize_map(Some(metric.len()))?;
    for (step, &value) in metric {
        if value.is_finite() {
            map.serialize_entry(step, &value)?;
        } else {
            map.serialize_entry(step, &format!("{value}").to_lowercase())?;
        }
    }
    map.end()
}

/// A metric's value in the table: six decimals, an exponent from 1e9 on, `inf`/`NaN` as is.
fn metric_cell(value: f64) -> String {
    if value.is_finite() && value.abs() >= 1e9 {
        format!("{value:.6e}")
    } else {
        format!("{value:.6}")
    }
}

impl RunSteps {
    /// Lost packets per step, over every collective.
    pub fn lost_by_step(&self) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        for row in &self.rows {
            bump(out.entry(row.step).or_default(), row.lost_packets);
        }
        out
    }
}

/// Reads a per-step file, a regular file no larger than a statistics file.
fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let text = read_regular_file(path, MAX_STATS_FILE_BYTES, "per-step file")?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))
}

fn as_u64(value: &serde_json::Value, key: &str, path: &Path) -> Result<u64, String> {
    value
        .get(key)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("{}: a row without an integer {key}", path.display()))
}

/// The per-step counts of the run in `dir`.
pub fn load_run_steps(dir: &Path) -> Result<RunSteps, String> {
    let (summary, files) = load_run_files(dir).map_err(|e| e.to_string())?;
    let mut step_files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(STEP_FILE_PREFIX) && n.ends_with(".json"))
        })
        .collect();
    step_files.sort();
    let mut cells: BTreeMap<(u64, String), (u64, u64, u64)> = BTreeMap::new();
    // The processes that wrote a per-step file, as (host, pid, rank).
    let mut writers: Vec<(String, u64, Option<u64>)> = Vec::new();
    for path in &step_files {
        let doc = read_json(path)?;
        if let (Some(host), Some(pid)) = (
            doc.get("host").and_then(serde_json::Value::as_str),
            doc.get("pid").and_then(serde_json::Value::as_u64),
        ) {
            let rank = doc.get("rank").and_then(serde_json::Value::as_u64);
            writers.push((host.to_string(), pid, rank));
        }
        match doc.get("format_version") {
            Some(v) if v.as_u64() == Some(STEP_FORMAT_VERSION) => {}
            Some(v) => {
                return Err(format!(
                    "{}: format_version = {v}: this lossy reads version {STEP_FORMAT_VERSION} \
                     of the per-step files",
                    path.display()
                ))
            }
            None => {
                return Err(format!(
                    "{} is not a per-step file (no format_version)",
                    path.display()
                ))
            }
        }
        let rows = doc
            .get("steps")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| format!("{} is not a per-step file (no steps)", path.display()))?;
        for (i, row) in rows.iter().enumerate() {
            let op = row
                .get("op")
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| format!("{}: a row without op", path.display()))?;
            let step = as_u64(row, "step", path)?;
            let (packets, lost) = (
                as_u64(row, "packets", path)?,
                as_u64(row, "lost_packets", path)?,
            );
            // Written by recorders that predate it: none then.
            let off = row
                .get("packets_injection_off")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0);
            // As the statistics reader refuses its files: no cell loses, or keeps out of
            // injection, more than it sent.
            for (name, part) in [("lost_packets", lost), ("packets_injection_off", off)] {
                if part > packets {
                    return Err(format!(
                        "{}: steps.{i} (step {step}, {op}): {name} = {part} is more than \
                         packets = {packets}; {name} must be at most packets",
                        path.display()
                    ));
                }
            }
            let cell = cells.entry((step, op.to_string())).or_default();
            bump(&mut cell.0, packets);
            bump(&mut cell.1, lost);
            bump(&mut cell.2, off);
        }
    }
    let (source, rows) = if step_files.is_empty() {
        let rows = summary.by_step.iter().map(|s| StepRow {
            step: s.step,
            op: "all".to_string(),
            packets: s.packets,
            lost_packets: s.lost_packets,
            packets_injection_off: s.packets_injection_off,
        });
        ("by_step", rows.collect())
    } else {
        let rows = cells
            .into_iter()
            .map(|((step, op), (packets, lost, off))| StepRow {
                step,
                op,
                packets,
                lost_packets: lost,
                packets_injection_off: off,
            });
        ("steps files", rows.collect())
    };
    let mut warnings = summary.warnings;
    if !step_files.is_empty() {
        warnings.extend(without_step_file(&files, &writers));
    }
    Ok(RunSteps {
        run: summary.run,
        source,
        // The per-step files of the integration keep every step.
        steps_beyond: summary.steps_beyond.filter(|_| step_files.is_empty()),
        rows,
        metric: BTreeMap::new(),
        warnings,
    })
}

/// A warning naming the processes of a run (its statistics `files`) that wrote a statistics
/// file but no per-step file (`writers`: those that wrote one, as (host, pid, rank); one
/// process is one pid with the same host or, should the two writers read the host name
/// differently, the same rank). The integration writes its per-step file at `disable()` / `write_stats()`, the plugin its statistics as it goes: a rank
/// killed before the end leaves only the second, and the rows would pass for the whole run.
fn without_step_file(
    files: &[StatsFile],
    writers: &[(String, u64, Option<u64>)],
) -> Option<String> {
    let mut missing = Vec::new();
    let (mut packets, mut lost) = (0u64, 0u64);
    for file in files {
        let wrote = writers.iter().any(|(host, pid, rank)| {
            *pid == u64::from(file.pid)
                && (*host == file.host || (rank.is_some() && *rank == file.rank))
        });
        if !wrote {
            let rank = file.rank.map_or_else(|| "?".to_string(), |r| r.to_string());
            missing.push(format!("rank {rank} ({}:{})", file.host, file.pid));
            bump(&mut packets, file.total.packets);
            bump(&mut lost, file.total.lost_packets);
        }
    }
    (!missing.is_empty()).then(|| {
        format!(
            "{} process(es) wrote a statistics file and no per-step file: {}; the per-step \
             rows leave out their {packets} packets ({lost} lost), which the totals of `lossy \
             report` hold (the integration writes the per-step file at disable() or \
             write_stats(): a process killed before that writes none)",
            missing.len(),
            missing.join(", ")
        )
    })
}

/// `metric` by step from a training log: JSON lines (objects with `step` and `metric`) or CSV
/// with a header naming both columns. Lines without the metric (or with `null`) are skipped.
/// Of several lines for one step the lowest `rank`'s wins (every rank's `performance_monitor`
/// may append to one file, in the order the ranks finish), and among lines of one rank, or
/// without one, the later. Values that are not finite are kept: CSV's `inf` and
/// `nan`; in JSON, the strings `"inf"`, `"-inf"`, `"nan"` (as the training monitor writes
/// them) and the bare `Infinity`, `-Infinity`, `NaN` of Python's `json.dumps`.
pub fn read_train_log(path: &Path, metric: &str) -> Result<BTreeMap<u64, f64>, String> {
    read_train_log_noting(path, metric).map(|(values, _)| values)
}

/// [`read_train_log`], with a note when the file ends in an unfinished line (no newline after
/// it: a log the run is still appending to, or one killed mid-line), which is left out: a CSV
/// line cut short (`3,0.75` as `3,0.`) reads as another value, and a JSON line cut short is
/// no JSON. A last JSON line that parses whole is kept.
pub fn read_train_log_noting(
    path: &Path,
    metric: &str,
) -> Result<(BTreeMap<u64, f64>, Option<String>), String> {
    let text = read_regular_file(path, MAX_TRAIN_LOG_BYTES, "training log")?;
    // A byte-order mark (spreadsheets' "CSV UTF-8", some editors) is no part of the header or
    // of the first JSON line.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let is_csv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    let mut note = None;
    let mut text = text;
    if !text.is_empty() && !text.ends_with('\n') {
        let start = text.rfind('\n').map_or(0, |i| i + 1);
        let last = &text[start..];
        let whole_json = !is_csv
            && serde_json::from_str::<serde_json::Value>(&python_tokens_as_strings(last))
                .is_ok_and(|v| v.is_object());
        if !last.trim().is_empty() && !whole_json {
            let line = text[..start].lines().count() + 1;
            note = Some(format!(
                "{}:{line}: unfinished last line (no newline after it: the run is still \
                 writing the log, or was stopped mid-line), left out",
                path.display()
            ));
            text = &text[..start];
        }
    }
    match parse_train_log(path, text, metric, is_csv) {
        Ok(values) => Ok((values, note)),
        // What was refused may be only what is left once the unfinished line is out (a log
        // of one line, still being written): say that it was there.
        Err(err) => Err(match note {
            Some(note) => format!("{err} ({note})"),
            None => err,
        }),
    }
}

/// `metric` by step from the text of a training log (see [`read_train_log`]).
fn parse_train_log(
    path: &Path,
    text: &str,
    metric: &str,
    is_csv: bool,
) -> Result<BTreeMap<u64, f64>, String> {
    // Per step: the value and the rank of the line it came from (none: after every rank).
    let mut by_step: BTreeMap<u64, (u64, f64)> = BTreeMap::new();
    let mut keep = |step: u64, rank: Option<u64>, value: f64| {
        let rank = rank.unwrap_or(u64::MAX);
        if by_step.get(&step).map_or(true, |&(kept, _)| rank <= kept) {
            by_step.insert(step, (rank, value));
        }
    };
    let bad = |line: usize, what: &str| format!("{}:{line}: {what}", path.display());
    let no_step = |line: usize, step: &str| {
        let step = nccl_net_lossy::error::echo(step, str::to_string);
        bad(
            line,
            &format!("step = {step}: must be an integer from 0 to {}", u64::MAX),
        )
    };
    if is_csv {
        let records = csv_records(text).map_err(|(line, what)| bad(line, &what))?;
        let mut records = records
            .into_iter()
            .filter(|(_, fields)| fields.iter().any(|f| !f.is_empty()));
        let (header_line, names) = records.next().ok_or_else(|| bad(1, "empty CSV file"))?;
        let column = |name: &str| {
            names
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| bad(header_line, &format!("no column {name:?} in the header")))
        };
        let (step_col, metric_col) = (column("step")?, column(metric)?);
        let rank_col = names.iter().position(|n| *n == "rank");
        for (line, fields) in records {
            let step_text = fields.get(step_col).map_or("", String::as_str);
            let step = step_text.parse::<u64>().ok();
            let value = fields.get(metric_col).and_then(|s| s.parse::<f64>().ok());
            let rank = rank_col.and_then(|c| fields.get(c)?.parse::<u64>().ok());
            match (step, value) {
                (Some(step), Some(value)) => keep(step, rank, value),
                (None, _) => return Err(no_step(line, &format!("`{step_text}`"))),
                (Some(_), None) => {}
            }
        }
    } else {
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let row: serde_json::Value = serde_json::from_str(&python_tokens_as_strings(line))
                .map_err(|e| bad(i + 1, &format!("not a JSON object: {e}")))?;
            let step = row.get("step").unwrap_or(&serde_json::Value::Null);
            let step = step
                .as_u64()
                .ok_or_else(|| no_step(i + 1, &step.to_string()))?;
            if let Some(value) = row.get(metric).and_then(metric_value) {
                let rank = row.get("rank").and_then(serde_json::Value::as_u64);
                keep(step, rank, value);
            }
        }
    }
    let out: BTreeMap<u64, f64> = by_step
        .into_iter()
        .map(|(step, (_, value))| (step, value))
        .collect();
    if out.is_empty() {
        return Err(format!(
            "{}: no step has a {metric:?} value",
            path.display()
        ));
    }
    Ok(out)
}

/// A CSV record: the line it starts on, its fields.
type CsvRecord = (usize, Vec<String>);

/// The records of CSV text as (the line each starts on, its fields trimmed), as Python's csv
/// module and pandas write them (RFC 4180): a field in double quotes may hold commas, line
/// breaks and quotes (doubled); the quotes are not part of the field. A quote never closed is
/// an error naming the line it opens on.
fn csv_records(text: &str) -> Result<Vec<CsvRecord>, (usize, String)> {
    let mut records = Vec::new();
    let (mut fields, mut field) = (Vec::new(), String::new());
    let (mut line, mut start) = (1, 1);
    let mut quoted_from: Option<usize> = None;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted_from, c) {
            (Some(_), '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (Some(_), '"') => quoted_from = None,
            (Some(_), c) => {
                line += usize::from(c == '\n');
                field.push(c);
            }
            (None, '"') if field.trim().is_empty() => {
                field.clear();
                quoted_from = Some(line);
            }
            (None, ',') => fields.push(std::mem::take(&mut field).trim().to_string()),
            (None, '\n') => {
                fields.push(std::mem::take(&mut field).trim().to_string());
                records.push((start, std::mem::take(&mut fields)));
                line += 1;
                start = line;
            }
            (None, c) => field.push(c),
        }
    }
    if let Some(opened) = quoted_from {
        return Err((
            opened,
            "a quote (\") opened here is never closed".to_string(),
        ));
    }
    if !field.is_empty() || !fields.is_empty() {
        fields.push(field.trim().to_string());
        records.push((start, fields));
    }
    Ok(records)
}

/// A JSON metric's value: a number, or a string naming a value that is not finite (`"inf"`,
/// `"-Infinity"`, `"nan"`, ...). Anything else (`null`, other text) is no value.
fn metric_value(value: &serde_json::Value) -> Option<f64> {
    match value {
        serde_json::Value::String(text) => {
            text.trim().parse::<f64>().ok().filter(|v| !v.is_finite())
        }
        _ => value.as_f64(),
    }
}

/// `line` with the bare `NaN`, `Infinity` and `-Infinity` that Python's `json.dumps` writes
/// (not JSON) as the strings `"nan"`, `"inf"` and `"-inf"`. Outside strings these words are
/// never valid JSON, so valid JSON is left as it is.
fn python_tokens_as_strings(line: &str) -> std::borrow::Cow<'_, str> {
    if !line.contains("NaN") && !line.contains("Infinity") {
        return line.into();
    }
    let mut out = String::with_capacity(line.len() + 16);
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            in_string = escaped || c != '"';
            escaped = !escaped && c == '\\';
        } else if c == '"' {
            in_string = true;
        } else if let Some((token, text)) = [
            ("NaN", "\"nan\""),
            ("-Infinity", "\"-inf\""),
            ("Infinity", "\"inf\""),
        ]
        .into_iter()
        .find(|(token, _)| rest.starts_with(token))
        {
            out.push_str(text);
            rest = &rest[token.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out.into()
}

/// The training log in a run's directory: its first `.jsonl` or `.csv` file (by name) with
/// `step` and `metric`.
pub fn find_train_log(dir: &Path, metric: &str) -> Result<std::path::PathBuf, String> {
    let mut candidates: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("csv"))
        })
        .collect();
    candidates.sort();
    let mut why = Vec::new();
    for path in candidates {
        match read_train_log(&path, metric) {
            Ok(_) => return Ok(path),
            Err(err) => why.push(err),
        }
    }
    let mut err = format!(
        "{} holds no training log (.jsonl or .csv with step and {metric:?}): give --train-log",
        dir.display()
    );
    if !why.is_empty() {
        err += &format!(" ({})", why.join("; "));
    }
    Err(err)
}

/// The per-step table: one line per (run, step, collective), the metric when given.
pub fn table(runs: &[RunSteps], metric: &str) -> String {
    let with_metric = runs.iter().any(|r| !r.metric.is_empty());
    let mut out = format!(
        "{:<20} {:>8} {:<14} {:>12} {:>10} {:>8}",
        "run", "step", "collective", "packets", "lost", "loss %"
    );
    if with_metric {
        out += &format!(" {metric:>12}");
    }
    out.push('\n');
    for run in runs {
        for row in &run.rows {
            let rate = row.loss_rate() * 100.0;
            out += &format!(
                "{:<20} {:>8} {:<14} {:>12} {:>10} {:>8.4}",
                run.run, row.step, row.op, row.packets, row.lost_packets, rate
            );
            if with_metric {
                let value = run.metric.get(&row.step);
                out += &format!(
                    " {:>12}",
                    value.map_or("-".to_string(), |&v| metric_cell(v))
                );
            }
            out.push('\n');
        }
    }
    out
}

/// Comma-separated values: `run,step,collective,packets,lost_packets,loss_rate[,METRIC]`.
/// `text` as one CSV field (RFC 4180): quoted, its quotes doubled, when it holds a comma, a
/// quote or a line break, so a reader gets it back whole; as it is otherwise.
pub fn csv_field(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\"")).into()
    } else {
        text.into()
    }
}

pub fn csv(runs: &[RunSteps], metric: &str) -> String {
    let with_metric = runs.iter().any(|r| !r.metric.is_empty());
    let mut out = String::from("run,step,collective,packets,lost_packets,loss_rate");
    if with_metric {
        out += &format!(",{}", csv_field(metric));
    }
    out.push('\n');
    for run in runs {
        for row in &run.rows {
            let rate = row.loss_rate();
            out += &format!(
                "{},{},{},{},{},{rate}",
                csv_field(&run.run),
                row.step,
                csv_field(&row.op),
                row.packets,
                row.lost_packets
            );
            if with_metric {
                out += &format!(
                    ",{}",
                    run.metric
                        .get(&row.step)
                        .map_or(String::new(), f64::to_string)
                );
            }
            out.push('\n');
        }
    }
    out
}

/// One figure, shared step axis: lost packets per step of each run (solid, left axis) and,
/// when given, each run's training metric (dashed, right axis).
pub fn draw<DB: DrawingBackend>(
    runs: &[RunSteps],
    metric: &str,
    root: DrawingArea<DB, Shift>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let steps = runs.iter().flat_map(|r| {
        r.rows
            .iter()
            .map(|s| s.step)
            .chain(r.metric.keys().copied())
    });
    let (first, last) = steps.fold((u64::MAX, 0), |(lo, hi), s| (lo.min(s), hi.max(s)));
    let (first, last) = if first > last {
        (0, 1)
    } else {
        (first, last.max(first + 1))
    };
    let lost_top = runs
        .iter()
        .flat_map(|r| r.lost_by_step().into_values())
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.15;
    // Values that are not finite have no place on an axis (see `notes`).
    let values = runs
        .iter()
        .flat_map(|r| r.metric.values().copied())
        .filter(|v| v.is_finite());
    let range = values.fold(None, |acc: Option<(f64, f64)>, v| {
        Some(acc.map_or((v, v), |(lo, hi)| (lo.min(v), hi.max(v))))
    });
    let (axis_lo, axis_hi) = metric_axis(range);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Packet loss and {metric} per training step"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .right_y_label_area_size(70)
        .build_cartesian_2d(first..last + 1, 0f64..lost_top)
        .map_err(err)?
        .set_secondary_coord(first..last + 1, axis_lo..axis_hi);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("lost packets")
        .draw()
        .map_err(err)?;
    chart
        .configure_secondary_axes()
        .y_desc(metric)
        .draw()
        .map_err(err)?;
    for (i, run) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                run.lost_by_step().into_iter().map(|(s, n)| (s, n as f64)),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("{}: lost packets", run.run))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        let points: Vec<(u64, f64)> = run
            .metric
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(&s, &v)| (s, v.clamp(axis_lo, axis_hi)))
            .collect();
        if run.metric.is_empty() {
            continue;
        }
        chart
            .draw_secondary_series(DashedLineSeries::new(points, 6, 4, color.stroke_width(2)))
            .map_err(err)?
            .label(format!("{}: {metric}", run.run))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// What the reader should know beside the table: a run with no per-step data (and how to get
/// it), and the steps whose metric is not finite (shown as they are, left out of the plot).
pub fn notes(runs: &[RunSteps], metric: &str) -> Vec<String> {
    let mut out = Vec::new();
    for run in runs {
        // The table of `lossy report` shows them beside the totals; the per-step rows sum the
        // same files, so two runs in one directory are as doubtful here.
        for warning in &run.warnings {
            out.push(format!("run {}: warning: {warning}", run.run));
        }
        if run.rows.is_empty() {
            out.push(format!(
                "run {}: no per-step data: no {STEP_FILE_PREFIX}*.json files and no by_step \
                 series in its statistics files. LossyMegatronIntegration(..., stats_dir=...) \
                 writes the per-step files; the plugin keeps by_step once the training script \
                 sets steps (nccl_lossy.set_step, or the integration)",
                run.run
            ));
        }
        if let Some(beyond) = &run.steps_beyond {
            out.push(format!(
                "run {}: {} packets ({} lost) were sent at steps from {} on, which the \
                 plugin's per-step series does not break down: no row shows them; they are \
                 in the totals of `lossy report` (the Python integration's per-step files, \
                 stats_dir, keep every step)",
                run.run, beyond.packets, beyond.lost_packets, beyond.step
            ));
        }
        let odd: Vec<String> = run
            .metric
            .iter()
            .filter(|(_, v)| !v.is_finite())
            .map(|(step, v)| format!("step {step} ({v})"))
            .collect();
        if !odd.is_empty() {
            let shown = odd.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
            let more = odd.len().saturating_sub(5);
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            out.push(format!(
                "run {}: {metric} is not finite at {shown}{more}: the table shows it as it is; \
                 it is left out of the plot",
                run.run
            ));
        }
    }
    out
}

/// Largest magnitude on the metric's axis: values beyond it are drawn at its edge. Kept far
/// below `f64::MAX` so the axis' span and plotters' tick spacing (ten times a power of ten
/// near the span) stay finite; an infinite or NaN range never ends its tick search.
const AXIS_LIMIT: f64 = 1e300;

/// The metric's axis for values from `lo` to `hi` (both finite, `lo <= hi`; `None`: no values):
/// a tenth of the span added on each side, finite and never empty.
fn metric_axis(range: Option<(f64, f64)>) -> (f64, f64) {
    let Some((lo, hi)) = range else {
        return (0.0, 1.0);
    };
    let (lo, hi) = (
        lo.clamp(-AXIS_LIMIT, AXIS_LIMIT),
        hi.clamp(-AXIS_LIMIT, AXIS_LIMIT),
    );
    // hi / 10 - lo / 10, not (hi - lo) / 10: the difference of two huge values overflows.
    let pad = if hi > lo {
        hi / 10.0 - lo / 10.0
    } else {
        (lo.abs() / 10.0).max(1.0)
    };
    (
        (lo - pad).max(-2.0 * AXIS_LIMIT),
        (hi + pad).min(2.0 * AXIS_LIMIT),
    )
}

#[cfg(test)]
mod tests {
    use super::{csv_field, csv_records};

    #[test]
    fn a_field_written_for_csv_reads_back_whole() {
        // Written with `csv_field`, read back with the reader `--train-log` uses.
        let fields = ["plain", "a,b", "say \"hi\"", "two\nlines", "", "\"", "x\ry"];
        let line: Vec<String> = fields.iter().map(|f| csv_field(f).into_owned()).collect();
        let records = csv_records(&format!("{}\n", line.join(","))).expect("well-formed");
        assert_eq!(records.len(), 1, "{records:?}");
        // The reader trims unquoted fields; every field here is either quoted or trimmed.
        assert_eq!(records[0].1, fields.map(str::to_string), "{line:?}");
    }
}
