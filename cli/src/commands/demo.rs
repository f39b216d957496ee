//! `lossy demo`: the README's main job on a machine without a GPU. Four local ranks run
//! all-reduce, all-gather and reduce-scatter through the plugin (under the embedded default
//! profile unless `NCCL_LOSSY_PROFILE` says otherwise) and print what happened.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::SystemTime;

use super::bench::{element_bytes, plugin_library, slowest, Check};
use super::sizes::{fmt_bytes, parse_sizes};
use crate::harness::cluster::{rank_lines, run_ranks, ClusterArgs, Ranks};
use crate::harness::collectives::{Collective, DataType};
use crate::harness::launch::Launch;
use crate::harness::scratch::ScratchDir;
use crate::harness::worker::{Job, LinkKind, RunSpec};
use nccl_net_lossy::profile::Profile;
use nccl_net_lossy::stats::report::{stats_files, summarize_run, RunSummary};
use nccl_net_lossy::stats::writer::{check_output_dir, dir_setting, StatsFile, STATS_DIR_ENV};
use nccl_net_lossy::{check_stats_dir, Result};

/// Arguments of `lossy demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Local ranks (processes).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Sizes: a comma-separated list (`64K,1M`), `small` (4 KiB, 64 KiB and 1 MiB) or `large`
    /// (1 MiB to 128 MiB: 1, 4, 16, 64, 128 MiB); each run as whole f32 elements, at least one.
    #[arg(long, default_value = "64K,1M,16M")]
    pub sizes: String,
    /// Keep the per-rank statistics files in this directory (default: `NCCL_LOSSY_STATS`,
    /// else a temporary one).
    #[arg(long)]
    pub stats_dir: Option<PathBuf>,
    /// The net plugin library to drive: any NCCL net plugin (default: `NCCL_NET_PLUGIN` when
    /// it is a path, else this command's plugin library).
    #[arg(long, value_name = "PATH")]
    pub library: Option<PathBuf>,
    /// Running as one rank of a multi-process job (torchrun, mpirun, srun, or by hand).
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// Runs `lossy demo`: exit 1 when data came out wrong although the profile never changes data.
pub fn run(args: Args) -> ExitCode {
    match demo(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(err) => {
            eprintln!("lossy demo: {err}");
            ExitCode::FAILURE
        }
    }
}

fn demo(args: &Args) -> Result<bool> {
    // Whole f32 elements, at least one, as bench runs them: the table says what ran (`5`
    // moved 4 bytes and `3` none while the table said 5 B and 3 B).
    let sizes: Vec<usize> = parse_sizes(&args.sizes)
        .map_err(|e| {
            nccl_net_lossy::Error::invalid_argument(format!("--sizes {}: {e}", args.sizes))
        })?
        .into_iter()
        .map(|bytes| element_bytes(bytes, DataType::F32))
        .collect();
    let mut runs = Vec::new();
    for collective in Collective::ALL {
        for &bytes in &sizes {
            runs.push(RunSpec {
                collective,
                dtype: DataType::F32,
                bytes,
                iters: 3,
                warmup: 1,
            });
        }
    }
    // Under `lossy run --stats DIR` (a sweep) the statistics belong in the run's directory.
    // A blank value is unset, as the plugin reads it.
    let inherited = dir_setting(std::env::var_os(STATS_DIR_ENV)).map(PathBuf::from);
    // A temporary directory goes when the demo ends, whichever way it ends.
    // Checked as `run --stats` and the plugin's init check theirs (created, a file can be
    // written in it), naming what is in the way and the option or variable that named it.
    let (stats_dir, scratch) = match (args.stats_dir.clone(), inherited) {
        (Some(dir), _) => {
            check_output_dir(&dir, "stats").map_err(|e| {
                e.context(format!(
                    "--stats-dir {}: statistics cannot be written there",
                    dir.display()
                ))
            })?;
            (dir, None)
        }
        (None, Some(dir)) => {
            check_stats_dir()?;
            (dir, None)
        }
        (None, None) => {
            let scratch = ScratchDir::new("lossy-demo")?;
            (scratch.path().to_path_buf(), Some(scratch))
        }
    };
    let job = Job::collectives(
        plugin_library(args.library.as_deref())?,
        vec![LinkKind::Plugin],
        runs.clone(),
    );
    let mut launch = Launch::new(args.ranks, job)?;
    launch
        .env
        .push((STATS_DIR_ENV.to_string(), stats_dir.display().to_string()));
    // A profile whose effects damage data makes "not bit-exact" the expected outcome, not a
    // failure; read it as the plugin will (a broken profile stops the demo here, loudly).
    let loaded = Profile::from_env()?;
    let corrupts_data = loaded.corrupts_data();
    // Named as the plugin names it (an unset or empty NCCL_LOSSY_PROFILE: the embedded
    // default), with the overrides it ran under, as `lossy validate` and `lossy report` say.
    let profile = if loaded.overrides_shown.is_empty() {
        loaded.origin
    } else {
        format!("{} ({})", loaded.origin, loaded.overrides_shown)
    };
    // A directory kept from an earlier run (`--stats-dir`, `NCCL_LOSSY_STATS`) holds its
    // files: the loss below is this run's alone (they were summed in, without a word).
    let earlier = stats_files_now(&stats_dir);
    let ranks = run_ranks(&args.cluster, "demo", &launch);
    let stats = load_own_stats(&stats_dir, &earlier);
    drop(scratch);
    let Some(Ranks { reports, members }) = ranks? else {
        return Ok(true);
    };
    let n = reports.len();
    // One text, written at the end: a reader that closed the pipe (`lossy demo | head`)
    // ends the output quietly, as `lossy report`'s.
    let mut out = String::new();
    let _ = writeln!(
        out,
        "lossy demo: {n} {}ranks, ring collectives through the plugin, profile: {profile}",
        if members.is_some() { "" } else { "local " }
    );
    if let Some(members) = &members {
        out += &rank_lines(members);
    }
    let _ = writeln!(
        out,
        "{:<15} {:>9} {:>10} {:>8} {:>8}  {:<9}",
        "collective", "size", "time (us)", "algbw", "busbw", "result"
    );
    let mut all_ok = true;
    for (i, run) in runs.iter().enumerate() {
        let t = slowest(&reports, i);
        let ok = reports
            .iter()
            .all(|r| r.results.get(i).is_some_and(|x| x.ok));
        let check = Check::of(ok, corrupts_data);
        all_ok &= check.passed();
        let algbw = if t > 0.0 {
            run.bytes as f64 / t / 1e9
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "{:<15} {:>9} {:>10.1} {:>8.2} {:>8.2}  {:<9}",
            run.collective.to_string(),
            fmt_bytes(run.bytes),
            t * 1e6,
            algbw,
            algbw * run.collective.bus_factor(n),
            match check {
                Check::Exact => "bit-exact",
                Check::Damaged => "damaged",
                Check::Wrong => "WRONG",
            }
        );
    }
    let _ = writeln!(out, "(GB/s; busbw as nccl-tests computes it)");
    if corrupts_data {
        let _ = writeln!(
            out,
            "(\"damaged\": the profile's effect changed data, as it is meant to)"
        );
    }
    if members.is_some() {
        let _ = writeln!(
            out,
            "(the loss below is rank 0's own; the rank lines above give every rank's)"
        );
    }
    out += &loss_lines(stats.as_ref());
    super::write_stdout(&out)
        .map_err(|e| nccl_net_lossy::Error::system(format!("cannot write the table: {e}")))?;
    Ok(all_ok)
}

/// The statistics files in `dir` now, each with when it was last written.
fn stats_files_now(dir: &Path) -> Vec<(PathBuf, Option<SystemTime>)> {
    stats_files(dir)
        .unwrap_or_default()
        .into_iter()
        .map(|path| {
            let written = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
            (path, written)
        })
        .collect()
}

/// The summary of the statistics files in `dir` that are not among `earlier` (or were
/// written again since), with how many earlier ones were left out; why there is none when
/// this run wrote none, or one that cannot be read.
fn load_own_stats(
    dir: &Path,
    earlier: &[(PathBuf, Option<SystemTime>)],
) -> std::result::Result<(RunSummary, usize), String> {
    let now = stats_files_now(dir);
    let (old, own): (Vec<_>, Vec<_>) = now
        .into_iter()
        .partition(|file| earlier.iter().any(|e| e == file && e.1.is_some()));
    if own.is_empty() {
        return Err("no statistics files were written".to_string());
    }
    let files = own
        .iter()
        .map(|(path, _)| StatsFile::read(path))
        .collect::<Result<Vec<_>>>()
        .map_err(|err| format!("a statistics file cannot be read ({err})"))?;
    let name = dir.display().to_string();
    Ok((summarize_run(&name, &files), old.len()))
}

/// The loss each collective saw, from the statistics files the ranks wrote.
fn loss_lines(stats: std::result::Result<&(RunSummary, usize), &String>) -> String {
    let mut out = String::new();
    let (run, left_out) = match stats {
        Ok(stats) => stats,
        Err(why) => return format!("{why}, so no loss counts\n"),
    };
    let _ = writeln!(
        out,
        "\n{:<15} {:>10} {:>12} {:>12} {:>9}",
        "collective", "messages", "packets", "lost", "loss"
    );
    for op in run.by_op.iter().chain(std::iter::once(&run.total)) {
        let _ = writeln!(
            out,
            "{:<15} {:>10} {:>12} {:>12} {:>8.3}%",
            op.op,
            op.counts.messages,
            op.counts.packets,
            op.counts.lost_packets,
            100.0 * op.loss_rate
        );
    }
    if *left_out > 0 {
        let _ = writeln!(
            out,
            "(this run's {} statistics files only: {left_out} from earlier runs in {} left \
             out)",
            run.files, run.run
        );
    }
    // A rule that decided no message set a condition that never ran (`lossy report` shows it
    // as 0 messages); the demo moves collectives only, with no training phase or step.
    for rule in run.by_rule.iter().filter(|r| r.rule.is_some()) {
        if rule.counts.messages == 0 {
            let _ = writeln!(
                out,
                "note: {} matched no message, so the condition it sets never ran (the demo \
                 sets no training phase or step)",
                rule.label()
            );
        }
    }
    for warning in &run.warnings {
        let _ = writeln!(out, "warning: {warning}");
    }
    out
}
