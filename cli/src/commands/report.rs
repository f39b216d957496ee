//! `lossy report DIR [DIR...]`: one table over every rank of one or more runs; with
//! `--per-step`, lost packets per training step by collective (see [`super::report_steps`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;

use super::report_steps::{self, RunSteps};
use nccl_net_lossy::loss::model::binary_size;
use nccl_net_lossy::stats::report::{load_run, OpSummary, RunSummary};
use nccl_net_lossy::stats::writer::replace_atomically;

/// Arguments of `lossy report`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Run directories (each holds one run's `lossy-stats-*.json` files).
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Print comma-separated values instead of a table.
    #[arg(long, conflicts_with = "json")]
    pub csv: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw the burst-length distribution and loss per collective (.svg or .png); with
    /// `--per-step`, lost packets and the training metric per step.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Lost packets per training step by collective instead of the totals.
    #[arg(long)]
    pub per_step: bool,
    /// The training log's column to show beside the packet loss per step (default `loss`);
    /// without `--train-log`, each run's directory must hold a training log with it.
    #[arg(long, requires = "per_step")]
    pub metric: Option<String>,
    /// A training log (CSV or JSON lines with `step` and the metric), one per run in the
    /// order of the runs.
    #[arg(long, value_name = "FILE", requires = "per_step")]
    pub train_log: Vec<PathBuf>,
}

/// Runs `lossy report`.
pub fn run(args: Args) -> ExitCode {
    if let Some(path) = &args.plot {
        if let Err(err) = check_plot_target(path) {
            eprintln!("lossy report: --plot {}: {err}", shown(path));
            return ExitCode::from(2);
        }
    }
    if args.per_step {
        return per_step(&args);
    }
    let mut runs = Vec::new();
    for dir in &args.dirs {
        match load_run(dir) {
            Ok(run) => runs.push(run),
            Err(err) => {
                eprintln!("lossy report: {err}");
                return ExitCode::from(2);
            }
        }
    }
    tell_apart(runs.iter_mut().map(|r| &mut r.run), &args.dirs);
    // The table prints them beside the totals and JSON holds them; CSV has no place for
    // them: they go to stderr, or two runs summed as one would pass unsaid.
    if args.csv {
        for run in &runs {
            for warning in &run.warnings {
                eprintln!("lossy report: run {}: warning: {warning}", run.run);
            }
        }
    }
    emit(
        &args,
        &runs,
        || csv(&runs),
        || table(&runs),
        |path| plot(&runs, path),
    )
}

/// Names runs by their directory's name, and, where two directories share one
/// (`sweep1/rate-1 sweep2/rate-1`), by the directory as given: the table, the CSV rows and the
/// plot's legend must say whose numbers they are. `names` are the runs' names, one per `dirs`.
fn tell_apart<'a>(names: impl Iterator<Item = &'a mut String>, dirs: &[PathBuf]) {
    let mut names: Vec<&mut String> = names.collect();
    let shared: Vec<bool> = names
        .iter()
        .map(|name| names.iter().filter(|other| ***other == ***name).count() > 1)
        .collect();
    for ((name, dir), shared) in names.iter_mut().zip(dirs).zip(shared) {
        if shared {
            **name = dir.display().to_string();
        }
    }
}

/// Prints `runs` as `--json`, `--csv` or the table, then draws `--plot` if asked.
fn emit<T: serde::Serialize>(
    args: &Args,
    runs: &T,
    csv: impl FnOnce() -> String,
    table: impl FnOnce() -> String,
    plot: impl FnOnce(&Path) -> Result<(), String>,
) -> ExitCode {
    let text = if args.json {
        match serde_json::to_string_pretty(runs) {
            Ok(text) => text + "\n",
            Err(err) => {
                eprintln!("lossy report: {err}");
                return ExitCode::FAILURE;
            }
        }
    } else if args.csv {
        csv()
    } else {
        table()
    };
    if let Err(err) = super::write_stdout(&text) {
        eprintln!("lossy report: cannot write the report: {err}");
        return ExitCode::FAILURE;
    }
    if let Some(path) = &args.plot {
        // Drawn into a temporary renamed over the file: a write that fails (a full disk)
        // leaves an older plot as it was, not a part of the new one.
        if let Err(err) = replace_atomically(path, plot) {
            eprintln!("lossy report: cannot draw {}: {err}", shown(path));
            return ExitCode::FAILURE;
        }
        eprintln!("lossy report: wrote {}", path.display());
    }
    ExitCode::SUCCESS
}

/// `lossy report --per-step`.
fn per_step(args: &Args) -> ExitCode {
    if !args.train_log.is_empty() && args.train_log.len() != args.dirs.len() {
        eprintln!(
            "lossy report: {} training logs for {} runs: give one per run, in the runs' order",
            args.train_log.len(),
            args.dirs.len()
        );
        return ExitCode::from(2);
    }
    let metric = args.metric.as_deref().unwrap_or("loss");
    let mut runs: Vec<RunSteps> = Vec::new();
    for (i, dir) in args.dirs.iter().enumerate() {
        let loaded = report_steps::load_run_steps(dir).and_then(|mut run| {
            let log = match args.train_log.get(i) {
                Some(log) => Some(log.clone()),
                None if args.metric.is_some() => Some(report_steps::find_train_log(dir, metric)?),
                None => None,
            };
            if let Some(log) = log {
                let (values, note) = report_steps::read_train_log_noting(&log, metric)?;
                run.metric = values;
                run.warnings.extend(note);
            }
            Ok(run)
        });
        match loaded {
            Ok(run) => runs.push(run),
            Err(err) => {
                eprintln!("lossy report: {err}");
                return ExitCode::from(2);
            }
        }
    }
    tell_apart(runs.iter_mut().map(|r| &mut r.run), &args.dirs);
    for note in report_steps::notes(&runs, metric) {
        eprintln!("lossy report: note: {note}");
    }
    emit(
        args,
        &runs,
        || report_steps::csv(&runs, metric),
        || report_steps::table(&runs, metric),
        |path| {
            let size = (1200, 600);
            register_font()?;
            match plot_kind(path) {
                Some(PlotKind::Svg) => report_steps::draw(
                    &runs,
                    metric,
                    SVGBackend::new(path, size).into_drawing_area(),
                ),
                Some(PlotKind::Png) => report_steps::draw(
                    &runs,
                    metric,
                    BitMapBackend::new(path, size).into_drawing_area(),
                ),
                None => Err("the plot file must end in .svg or .png".to_string()),
            }
        },
    )
}

/// Refuses a `--plot` file before the report is computed or printed: a name without a plot
/// extension, or an existing path that is no regular file (opening a FIFO for writing blocks
/// until a reader comes; a directory cannot be written).
fn check_plot_target(path: &Path) -> Result<(), String> {
    if plot_kind(path).is_none() {
        return Err("allowed: a file name ending in .svg or .png".to_string());
    }
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => {
            return Err(format!(
                "not a regular file ({}); allowed: a new or regular file ending in .svg or .png",
                nccl_net_lossy::files::file_kind(&meta.file_type())
            ))
        }
        Ok(_) => return Ok(()),
        // Missing is a new file; anything else (a name too long) would fail the drawing.
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!(
                "{e}; allowed: a new or regular file ending in .svg or .png"
            ))
        }
        Err(_) => {}
    }
    // A new file: its directory must be there (the plot is drawn after the table is printed,
    // and the image library's error was its debug text).
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(meta) => Err(format!(
            "{} is not a directory ({}); allowed: a file in an existing directory",
            shown(dir),
            nccl_net_lossy::files::file_kind(&meta.file_type())
        )),
        Err(e) => Err(format!(
            "directory {}: {e}; allowed: a file in an existing directory",
            shown(dir)
        )),
    }
}

/// A path as a message names it, cut past [`nccl_net_lossy::error::ECHO_CHARS`] characters.
fn shown(path: &Path) -> String {
    nccl_net_lossy::error::echo(&path.display().to_string(), str::to_string)
}

enum PlotKind {
    Svg,
    Png,
}

fn plot_kind(path: &Path) -> Option<PlotKind> {
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("svg") => Some(PlotKind::Svg),
        Some("png") => Some(PlotKind::Png),
        _ => None,
    }
}

fn rows(run: &RunSummary) -> impl Iterator<Item = &OpSummary> {
    run.by_op.iter().chain(std::iter::once(&run.total))
}

fn fmt_opt(value: Option<f64>, digits: usize) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
}

/// A count of the table as `show` writes it, after "≥" when its sum stopped at 2^64-1
/// (`name` is in `saturated`): the total is more than that.
fn count(value: u64, name: &str, saturated: &[&str], show: impl Fn(u64) -> String) -> String {
    let shown = show(value);
    if saturated.contains(&name) {
        format!("≥{shown}")
    } else {
        shown
    }
}

/// A count as it is written.
fn plain(value: u64) -> String {
    value.to_string()
}

/// The human-readable table.
fn table(runs: &[RunSummary]) -> String {
    let mut out = format!(
        "{:<20} {:<14} {:>5} {:>9} {:>11} {:>12} {:>10} {:>8} {:>10} {:>10} {:>10}\n",
        "run",
        "collective",
        "ranks",
        "messages",
        "bytes",
        "packets",
        "lost",
        "loss %",
        "mean burst",
        "p50 us",
        "p99 us"
    );
    for run in runs {
        for row in rows(run) {
            let latency = row.latency_us;
            out += &format!(
                "{:<20} {:<14} {:>5} {:>9} {:>11} {:>12} {:>10} {:>8.4} {:>10} {:>10} {:>10}\n",
                run.run,
                row.op,
                run.ranks,
                count(row.counts.messages, "messages", &row.saturated, plain),
                count(row.counts.bytes, "bytes", &row.saturated, binary_size),
                count(row.counts.packets, "packets", &row.saturated, plain),
                count(
                    row.counts.lost_packets,
                    "lost_packets",
                    &row.saturated,
                    plain
                ),
                row.loss_rate * 100.0,
                fmt_opt(row.mean_burst, 2),
                fmt_opt(latency.map(|l| l[0]), 1),
                fmt_opt(latency.map(|l| l[2]), 1),
            );
        }
        if let Some(profile) = describe_profile(&run.profile) {
            out += &format!("{:<20} profile {profile}\n", run.run);
        }
        let total = &run.total.counts;
        if total.packets_injection_off > 0 {
            let share = total.packets_injection_off as f64 / total.packets.max(1) as f64;
            out += &format!(
                "{:<20} injection off for {:.2} % of the packets (ncclLossySetEnabled(0)): \
                 loss over the packets sent with it on: {}\n",
                run.run,
                share * 100.0,
                run.total
                    .loss_rate_injecting
                    .map_or("- (none was)".to_string(), |r| format!(
                        "{:.4} %",
                        r * 100.0
                    )),
            );
        }
        if run.by_rule.iter().any(|r| r.rule.is_some()) {
            out += &rule_table(run);
        } else if let Some(expected) = run.expected {
            out += &format!(
                "{:<20} model closed form: loss {:.4} %, mean burst {:.2}\n",
                run.run,
                expected.loss_rate * 100.0,
                expected.mean_burst
            );
        }
        for warning in &run.warnings {
            out += &format!("{:<20} warning: {warning}\n", run.run);
        }
    }
    out
}

/// The run's messages by the rule of the profile that decided them, each rule's loss beside
/// its own model's closed form (loss over the packets sent with injection on). A rule that
/// matched nothing shows 0 messages: the condition it sets never ran.
fn rule_table(run: &RunSummary) -> String {
    let mut out = format!(
        "{:<20} {:<24} {:>9} {:>12} {:>10} {:>8} {:>10} {:>8} {:>10}\n",
        run.run,
        "rule",
        "messages",
        "packets",
        "lost",
        "loss %",
        "model %",
        "mean run",
        "model run"
    );
    for rule in &run.by_rule {
        let label: String = rule.label().chars().take(24).collect();
        out += &format!(
            "{:<20} {:<24} {:>9} {:>12} {:>10} {:>8} {:>10} {:>8} {:>10}\n",
            run.run,
            label,
            count(rule.counts.messages, "messages", &rule.saturated, plain),
            count(rule.counts.packets, "packets", &rule.saturated, plain),
            count(
                rule.counts.lost_packets,
                "lost_packets",
                &rule.saturated,
                plain
            ),
            fmt_opt(rule.loss_rate_injecting.map(|r| r * 100.0), 4),
            fmt_opt(rule.expected.map(|e| e.loss_rate * 100.0), 4),
            fmt_opt(rule.mean_run, 2),
            fmt_opt(
                rule.expected
                    .map(|e| e.mean_burst)
                    .filter(|b| b.is_finite() && *b > 0.0),
                2
            ),
        );
    }
    out
}

/// The profile a run's files say produced it, in one line: where it came from, the overrides
/// and seed, the default model and effect, and how many rules (`None` without a profile).
fn describe_profile(profile: &serde_json::Value) -> Option<String> {
    let origin = profile.get("origin")?.as_str()?;
    let mut text = origin.to_string();
    match profile.get("overrides").and_then(|v| v.as_str()) {
        Some(set) if !set.trim().is_empty() => text += &format!(" (overrides `{}`)", set.trim()),
        _ => {}
    }
    if let Some(seed) = profile.get("seed") {
        text += &format!(", seed {seed}");
    }
    let defaults = profile.get("defaults");
    if let Some(model) = defaults.and_then(|d| d.get("model")) {
        text += &format!(", default model {}", describe_model(model));
    }
    if let Some(effect) = defaults
        .and_then(|d| d.get("effect"))
        .and_then(|e| e.as_str())
    {
        text += &format!(", effect {effect}");
    }
    if let Some(rules) = profile.get("rules").and_then(|r| r.as_array()) {
        let n = rules.len();
        text += &format!(", {n} rule{}", if n == 1 { "" } else { "s" });
    }
    Some(text)
}

/// A model of a statistics file's profile as `kind(key=value, ...)`.
fn describe_model(model: &serde_json::Value) -> String {
    let Some(map) = model.as_object() else {
        return model.to_string();
    };
    let kind = map.get("kind").and_then(|k| k.as_str()).unwrap_or("?");
    let params: Vec<String> = map
        .iter()
        .filter(|(key, _)| key.as_str() != "kind")
        .map(|(key, value)| match value.as_str() {
            Some(text) => format!("{key}={text}"),
            None => format!("{key}={value}"),
        })
        .collect();
    if params.is_empty() {
        kind.to_string()
    } else {
        format!("{kind}({})", params.join(", "))
    }
}

/// Comma-separated values, one line per (run, collective).
fn csv(runs: &[RunSummary]) -> String {
    let mut out = String::from(
        "run,collective,ranks,messages,bytes,packets,lost_packets,loss_events,loss_rate,mean_burst,retransmit_delay_ns,latency_p50_us,latency_p90_us,latency_p99_us,files,packets_injection_off,loss_rate_injecting,saturated\n",
    );
    for run in runs {
        for row in rows(run) {
            let l = row.latency_us;
            let opt = |v: Option<f64>| v.map_or_else(String::new, |v| v.to_string());
            out += &format!(
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                report_steps::csv_field(&run.run),
                report_steps::csv_field(&row.op),
                run.ranks,
                row.counts.messages,
                row.counts.bytes,
                row.counts.packets,
                row.counts.lost_packets,
                row.counts.loss_events,
                row.loss_rate,
                opt(row.mean_burst),
                row.counts.retransmit_delay_ns,
                opt(l.map(|l| l[0])),
                opt(l.map(|l| l[1])),
                opt(l.map(|l| l[2])),
                run.files,
                row.counts.packets_injection_off,
                opt(row.loss_rate_injecting),
                row.saturated.join(";"),
            );
        }
    }
    out
}

/// Where a TrueType font may live: the plots measure their text with it (SVG and PNG alike).
const FONT_CANDIDATES: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers the first TrueType font found as `sans-serif`, which plotters measures text with.
pub fn register_font() -> Result<(), String> {
    let bytes = FONT_CANDIDATES
        .iter()
        .find_map(|path| std::fs::read(path).ok())
        .ok_or_else(|| {
            "plots need a TrueType font (e.g. Debian's fonts-dejavu-core)".to_string()
        })?;
    // Registered once per process; the CLI exits soon after, so leaking the bytes is fine.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| "the font file is not a usable TrueType font".to_string())
}

fn plot(runs: &[RunSummary], path: &Path) -> Result<(), String> {
    let height = if runs.iter().any(|r| !r.by_step.is_empty()) {
        900
    } else {
        520
    };
    let size = (1200, height);
    register_font()?;
    match plot_kind(path) {
        Some(PlotKind::Svg) => draw(runs, SVGBackend::new(path, size).into_drawing_area()),
        Some(PlotKind::Png) => draw(runs, BitMapBackend::new(path, size).into_drawing_area()),
        None => Err("the plot file must end in .svg or .png".to_string()),
    }
}

fn draw<DB: DrawingBackend>(
    runs: &[RunSummary],
    root: DrawingArea<DB, Shift>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let has_steps = runs.iter().any(|r| !r.by_step.is_empty());
    let (top, bottom) = if has_steps {
        let (top, bottom) = root.split_vertically(520);
        (top, Some(bottom))
    } else {
        (root.clone(), None)
    };
    let (left, right) = top.split_horizontally(620);
    draw_bursts(runs, &left).map_err(err)?;
    draw_loss_per_collective(runs, &right).map_err(err)?;
    if let Some(bottom) = bottom {
        draw_loss_per_step(runs, &bottom).map_err(err)?;
    }
    root.present().map_err(err)
}

/// Empirical burst-length distribution per run, against the closed form of the run's model:
/// the geometric law with the model's mean burst length (exact for uniform and simple Gilbert
/// models; for other models a geometric law of the same mean). Without the model's numbers in
/// the files, the measured mean stands in and the legend says so.
fn draw_bursts<DB: DrawingBackend>(
    runs: &[RunSummary],
    area: &DrawingArea<DB, Shift>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let max_len = runs
        .iter()
        .flat_map(|r| r.total.bursts.keys().copied())
        .max()
        .unwrap_or(1)
        .clamp(2, 64);
    let mut chart = ChartBuilder::on(area)
        .caption("Burst length distribution", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(1u64..max_len + 1, (1e-6f64..1.0f64).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("burst length (packets)")
        .y_desc("fraction of bursts")
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let count: u64 = run.total.bursts.values().sum();
        if count == 0 {
            continue;
        }
        let points: Vec<(u64, f64)> = run
            .total
            .bursts
            .iter()
            .filter(|(len, _)| **len <= max_len)
            .map(|(&len, &n)| (len, n as f64 / count as f64))
            .collect();
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?
            .label(format!("{} (measured)", run.run))
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
        let (mean, source) = match run.expected {
            Some(expected) if expected.mean_burst >= 1.0 => (Some(expected.mean_burst), "model"),
            _ => (run.total.mean_burst, "measured mean"),
        };
        if let Some(mean) = mean.filter(|m| *m >= 1.0) {
            // Geometric law on 1, 2, ... with mean m: P(L = l) = (1/m) (1 - 1/m)^(l - 1).
            let q = 1.0 / mean;
            let line: Vec<(u64, f64)> = (1..=max_len)
                .map(|l| (l, q * (1.0 - q).powi(l as i32 - 1)))
                .filter(|&(_, p)| p >= 1e-6)
                .collect();
            chart
                .draw_series(DashedLineSeries::new(line, 6, 4, color.stroke_width(2)))?
                .label(format!("{} ({source}: geometric, mean {mean:.2})", run.run))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerLeft)
}

/// Draws the legend of `chart` at `position`, the same box on every plot.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(position)
        .draw()
}

/// Loss rate of each collective, one group of bars per collective, one bar per run.
fn draw_loss_per_collective<DB: DrawingBackend>(
    runs: &[RunSummary],
    area: &DrawingArea<DB, Shift>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mut ops: Vec<String> = runs
        .iter()
        .flat_map(|r| r.by_op.iter().map(|o| o.op.clone()))
        .collect();
    ops.sort();
    ops.dedup();
    let top = runs
        .iter()
        .flat_map(|r| r.by_op.iter().map(|o| o.loss_rate * 100.0))
        .fold(0.0f64, f64::max)
        .max(0.01)
        * 1.2;
    let groups = ops.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption("Loss per collective", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..groups, 0f64..top)?;
    let labels = ops.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(ops.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.26 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("lost packets (%)")
        .draw()?;
    let width = 0.8 / runs.len().max(1) as f64;
    for (i, run) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let bars: Vec<Rectangle<(f64, f64)>> = run
            .by_op
            .iter()
            .filter_map(|o| {
                let g = ops.iter().position(|name| *name == o.op)? as f64;
                let x0 = g + 0.1 + width * i as f64;
                Some(Rectangle::new(
                    [(x0, 0.0), (x0 + width, o.loss_rate * 100.0)],
                    color.filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(run.run.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight)
}

/// Loss rate per training step, one line per run (steps come from the control API).
fn draw_loss_per_step<DB: DrawingBackend>(
    runs: &[RunSummary],
    area: &DrawingArea<DB, Shift>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let last = runs
        .iter()
        .flat_map(|r| r.by_step.iter().map(|s| s.step))
        .max()
        .unwrap_or(1)
        .max(1);
    // Over the packets sent with injection on: a phase kept lossless must not dilute it.
    let rate =
        |s: &nccl_net_lossy::stats::StepCounts| s.loss_rate_injecting().unwrap_or(0.0) * 100.0;
    let top = runs
        .iter()
        .flat_map(|r| r.by_step.iter().map(rate))
        .fold(0.0f64, f64::max)
        .max(0.01)
        * 1.2;
    let mut chart = ChartBuilder::on(area)
        .caption("Loss per training step", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0u64..last + 1, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("lost packets (%)")
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        if run.by_step.is_empty() {
            continue;
        }
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                run.by_step.iter().map(|s| (s.step, rate(s))),
                color.stroke_width(2),
            ))?
            .label(run.run.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight)
}
