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
use nccl_net_lossy::stats::report::load_run;
use nccl_net_lossy::stats::writer::MAX_STATS_FILE_BYTES;

/// The per-step files of the Python integration.
const STEP_FILE_PREFIX: &str = "lossy-steps-rank";

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
    /// The training metric by step (from `--train-log`).
    pub metric: BTreeMap<u64, f64>,
}

impl RunSteps {
    /// Lost packets per step, over every collective.
    pub fn lost_by_step(&self) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        for row in &self.rows {
            *out.entry(row.step).or_default() += row.lost_packets;
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
    let summary = load_run(dir).map_err(|e| e.to_string())?;
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
    let mut cells: BTreeMap<(u64, String), (u64, u64)> = BTreeMap::new();
    for path in &step_files {
        let doc = read_json(path)?;
        let rows = doc
            .get("steps")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| format!("{} is not a per-step file (no steps)", path.display()))?;
        for row in rows {
            let op = row
                .get("op")
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| format!("{}: a row without op", path.display()))?;
            let cell = cells
                .entry((as_u64(row, "step", path)?, op.to_string()))
                .or_default();
            cell.0 += as_u64(row, "packets", path)?;
            cell.1 += as_u64(row, "lost_packets", path)?;
        }
    }
    let (source, rows) = if step_files.is_empty() {
        let rows = summary.by_step.iter().map(|s| StepRow {
            step: s.step,
            op: "all".to_string(),
            packets: s.packets,
            lost_packets: s.lost_packets,
        });
        ("by_step", rows.collect())
    } else {
        let rows = cells
            .into_iter()
            .map(|((step, op), (packets, lost))| StepRow {
                step,
                op,
                packets,
                lost_packets: lost,
            });
        ("steps files", rows.collect())
    };
    Ok(RunSteps {
        run: summary.run,
        source,
        rows,
        metric: BTreeMap::new(),
    })
}

/// `metric` by step from a training log: JSON lines (objects with `step` and `metric`) or CSV
/// with a header naming both columns. Lines without the metric are skipped; a later line for
/// the same step wins.
pub fn read_train_log(path: &Path, metric: &str) -> Result<BTreeMap<u64, f64>, String> {
    let text = read_regular_file(path, MAX_TRAIN_LOG_BYTES, "training log")?;
    let is_csv = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    let mut out = BTreeMap::new();
    let bad = |line: usize, what: &str| format!("{}:{line}: {what}", path.display());
    if is_csv {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let (_, header) = lines.next().ok_or_else(|| bad(1, "empty CSV file"))?;
        let names: Vec<&str> = header.split(',').map(str::trim).collect();
        let column = |name: &str| {
            names
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| bad(1, &format!("no column {name:?} in the header")))
        };
        let (step_col, metric_col) = (column("step")?, column(metric)?);
        for (i, line) in lines {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let step = fields.get(step_col).and_then(|s| s.parse::<u64>().ok());
            let value = fields.get(metric_col).and_then(|s| s.parse::<f64>().ok());
            match (step, value) {
                (Some(step), Some(value)) => {
                    out.insert(step, value);
                }
                (None, _) => return Err(bad(i + 1, "no integer step")),
                (Some(_), None) => {}
            }
        }
    } else {
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let row: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| bad(i + 1, &format!("not a JSON object: {e}")))?;
            let step = row
                .get("step")
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| bad(i + 1, "no integer step"))?;
            if let Some(value) = row.get(metric).and_then(serde_json::Value::as_f64) {
                out.insert(step, value);
            }
        }
    }
    if out.is_empty() {
        return Err(format!(
            "{}: no step has a {metric:?} value",
            path.display()
        ));
    }
    Ok(out)
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
    candidates
        .into_iter()
        .find(|p| read_train_log(p, metric).is_ok())
        .ok_or_else(|| {
            format!(
                "{} holds no training log (.jsonl or .csv with step and {metric:?}): give --train-log",
                dir.display()
            )
        })
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
            let rate = if row.packets == 0 {
                0.0
            } else {
                row.lost_packets as f64 / row.packets as f64 * 100.0
            };
            out += &format!(
                "{:<20} {:>8} {:<14} {:>12} {:>10} {:>8.4}",
                run.run, row.step, row.op, row.packets, row.lost_packets, rate
            );
            if with_metric {
                let value = run.metric.get(&row.step);
                out += &format!(
                    " {:>12}",
                    value.map_or("-".to_string(), |v| format!("{v:.6}"))
                );
            }
            out.push('\n');
        }
    }
    out
}

/// Comma-separated values: `run,step,collective,packets,lost_packets,loss_rate[,METRIC]`.
pub fn csv(runs: &[RunSteps], metric: &str) -> String {
    let with_metric = runs.iter().any(|r| !r.metric.is_empty());
    let mut out = String::from("run,step,collective,packets,lost_packets,loss_rate");
    if with_metric {
        out += &format!(",{}", metric.replace(',', "_"));
    }
    out.push('\n');
    for run in runs {
        for row in &run.rows {
            let rate = if row.packets == 0 {
                0.0
            } else {
                row.lost_packets as f64 / row.packets as f64
            };
            out += &format!(
                "{},{},{},{},{},{rate}",
                run.run.replace(',', "_"),
                row.step,
                row.op,
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
    let values = runs.iter().flat_map(|r| r.metric.values().copied());
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo > hi {
        (0.0, 1.0)
    } else {
        (lo, if hi > lo { hi } else { lo + 1.0 })
    };
    let pad = (hi - lo) * 0.1;
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
        .set_secondary_coord(first..last + 1, (lo - pad)..(hi + pad));
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
        if run.metric.is_empty() {
            continue;
        }
        let points: Vec<(u64, f64)> = run.metric.iter().map(|(&s, &v)| (s, v)).collect();
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
