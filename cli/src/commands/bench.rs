//! `lossy bench`: an nccl-tests-style all-reduce table for the plugin and, in the same run
//! and the same worker processes, plain loopback TCP with as many streams, with the ratio:
//! per size the mean time, the p50 and p99 of the per-iteration times (slowest rank of each
//! iteration), algbw and busbw, over `--comms` ring channels; `--vs-library` adds another net
//! plugin library as one more link, timed in the same alternation.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::harness::cluster::{detect, rank_lines, run_ranks, ClusterArgs, Ranks};
use crate::harness::collectives::{Collective, DataType};
use crate::harness::launch::Launch;
use crate::harness::plugin_client::{default_library_path, MAX_VERSION, MIN_VERSION};
use crate::harness::worker::{raw_streams_default, Job, LinkKind, RunSpec, Task, WorkerReport};
use nccl_net_lossy::profile::Profile;
use nccl_net_lossy::Result;

use super::bench_runs::MAX_RUNS;
use super::sizes::{fmt_bytes, parse_bench_sizes, parse_size, MAX_SIZE};

/// Arguments of `lossy bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Local ranks (processes).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Sizes: a comma-separated list (`64K,1M,64M`), `small` (8 B to 1 MiB, doubling),
    /// `large` (1 MiB to 128 MiB: 1, 4, 16, 64, 128 MiB) or `all` (8 B to 256 MiB, doubling).
    #[arg(long, default_value = "large")]
    pub sizes: String,
    /// Turn loss injection off (through the plugin's control API).
    #[arg(long)]
    pub lossless: bool,
    /// Also time the plugin with loss switched off, interleaved in the same run, and print
    /// lossy/lossless: what the profile's loss costs in bandwidth.
    #[arg(long, conflicts_with = "lossless")]
    pub vs_lossless: bool,
    /// Timed iterations per size (default: 64 MiB / size, within 5 to 1000).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Ring channels (NCCL's channels): send/receive comm pairs per neighbour, each carrying
    /// a contiguous slice of the buffer; the raw TCP baseline opens as many. 1 to 64 (NCCL's
    /// most channels).
    #[arg(long, default_value_t = 1)]
    pub comms: usize,
    /// Streams per comm of the raw TCP baseline (default: the plugin's sockets per
    /// connection, `NCCL_LOSSY_NSOCKS` as the plugin reads it); 1 to 64, as NCCL's Socket transport.
    #[arg(long)]
    pub raw_streams: Option<usize>,
    /// Untimed iterations per size.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Largest message (chunk) size.
    #[arg(long, default_value = "512K")]
    pub chunk: String,
    /// Newest net plugin ABI version to drive (8 to 12): the library's newest table up to it
    /// (down to v6), as NCCL takes the newest it knows.
    #[arg(long, default_value_t = 12)]
    pub net_version: u32,
    /// Element type: f32 or u8.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// The net plugin library to drive: any NCCL net plugin (default: `NCCL_NET_PLUGIN` when
    /// it is a path, else this command's plugin library).
    #[arg(long, value_name = "PATH")]
    pub library: Option<PathBuf>,
    /// Also drive another net plugin library (NCCL's own Socket transport built as a plugin,
    /// say) on its own connections, interleaved iteration by iteration with the plugin and
    /// raw TCP in the same worker processes, and print its columns and its time over the
    /// plugin's: a comparison the machine's noise cannot tilt, since both see the same moments.
    /// Give it again for more libraries (the build before a change and NCCL's transport, say:
    /// columns `peer1`, `peer2`, ... in that order). Another build of this plugin follows
    /// `--lossless` too.
    #[arg(long, value_name = "PATH")]
    pub vs_library: Vec<PathBuf>,
    /// Also write every timed iteration to PATH as CSV: size, link (`plugin`, `raw`,
    /// `lossless`, `peer`...), iteration, the slowest rank's time and each rank's, in
    /// microseconds, grouped by size and link. The links take turns within each round, so
    /// iteration i of every link ran in the same round. The table's percentiles summarize
    /// these; the file shows when a link changed speed within a run, to plot beside a
    /// training log. PATH must be a regular file (created or replaced) in an existing
    /// directory; rank 0 writes it
    #[arg(long, value_name = "PATH")]
    pub samples: Option<PathBuf>,
    /// Repeat the whole measurement N times (1 to 1000), each with new worker processes and
    /// connections, the links' order rotated from run to run, and print one table instead:
    /// per size each link's p50 as the median over the runs, and each link's p50 over the
    /// plugin's as the median over the runs with its range, and as the geometric mean with
    /// its 95% confidence interval (an interval that leaves out 100% is a difference the runs
    /// resolve). A TCP connection keeps the pace it found for its life, so one run's rows can
    /// sit a few percent apart where the median of several does not. Each run's p50s go to
    /// stderr as it ends. Local runs only (not
    /// with `--rank`/`--world` or a launcher's ranks), and not with `--samples`.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Running as one rank of a multi-process job (torchrun, mpirun, srun, or by hand).
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// The net plugin library `bench` and `demo` drive: `--library`, else `NCCL_NET_PLUGIN` when
/// it is a path (a name is NCCL's to resolve, and `lossy` stands for this plugin), else this
/// command's plugin library.
pub fn plugin_library(arg: Option<&Path>) -> Result<PathBuf> {
    let from_env = std::env::var_os("NCCL_NET_PLUGIN")
        .map(PathBuf::from)
        .filter(|p| p.components().count() > 1);
    match arg.map(Path::to_path_buf).or(from_env) {
        // Absolute: the ranks dlopen it, and dlopen looks a name without a slash up on the
        // loader's search path, not in the current directory where the user found it.
        Some(path) if path.is_file() => std::path::absolute(&path).map_err(|e| {
            nccl_net_lossy::Error::invalid_argument(format!(
                "net plugin library {}: {e}",
                path.display()
            ))
        }),
        Some(path) => Err(nccl_net_lossy::Error::invalid_argument(format!(
            "net plugin library {} {}",
            path.display(),
            nccl_net_lossy::files::why_not_a_file(&path)
        ))),
        None => default_library_path(),
    }
}

/// Most ring channels `--comms` takes: NCCL's `MAXCHANNELS` (src/include/device.h).
pub const MAX_COMMS: usize = 64;

/// Most streams per comm `--raw-streams` takes: the most sockets NCCL's Socket transport gives
/// one connection (`MAX_SOCKETS`, src/transport/net_socket.cc).
pub const MAX_RAW_STREAMS: usize = 64;

/// Most timed iterations `--iters` takes (each keeps a time sample per link and rank).
pub const MAX_ITERS_ARG: usize = 1_000_000;

/// Bytes the default iteration count aims to move per size and link.
const ITER_BYTES: usize = 64 << 20;
/// Fewest and most timed iterations the default gives a size.
const MIN_ITERS: usize = 5;
const MAX_ITERS: usize = 1000;

/// The default timed iterations for `bytes`: as many as move [`ITER_BYTES`], within
/// [`MIN_ITERS`] to [`MAX_ITERS`], so that a size costs about the same bounded time whether
/// latency (small sizes, many iterations) or bandwidth (large sizes, few) dominates.
pub fn default_iters(bytes: usize) -> usize {
    (ITER_BYTES / bytes.max(1)).clamp(MIN_ITERS, MAX_ITERS)
}

/// A size as the run uses it: whole elements, at least one.
pub fn element_bytes(bytes: usize, dtype: DataType) -> usize {
    (bytes / dtype.size()).max(1) * dtype.size()
}

/// The `p`-th percentile (0 < p <= 100) of `sorted` by the nearest-rank rule: the smallest
/// sample with at least p% of the samples at or below it (so p99 of fewer than 100 samples
/// is the maximum). 0 for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Each rank's per-iteration times of result `index`, in the order the iterations ran
/// (ranks without that result are left out).
fn rank_samples(reports: &[WorkerReport], index: usize) -> Vec<&[f64]> {
    reports
        .iter()
        .filter_map(|r| r.results.get(index))
        .map(|r| r.samples.as_slice())
        .collect()
}

/// Per-iteration times of result `index`, each the slowest rank's (as nccl-tests reports
/// the maximum over ranks), sorted.
pub fn slowest_samples(reports: &[WorkerReport], index: usize) -> Vec<f64> {
    let per_rank = rank_samples(reports, index);
    let iters = per_rank.iter().map(|s| s.len()).min().unwrap_or(0);
    let mut out: Vec<f64> = (0..iters)
        .map(|i| per_rank.iter().map(|s| s[i]).fold(0.0, f64::max))
        .collect();
    out.sort_by(f64::total_cmp);
    out
}

/// Parses an element type name.
pub fn parse_dtype(text: &str) -> std::result::Result<DataType, String> {
    match text {
        "f32" | "float" | "float32" => Ok(DataType::F32),
        "u8" | "uint8" | "bytes" => Ok(DataType::U8),
        _ => Err(format!("unknown element type `{text}` (f32 or u8)")),
    }
}

/// How a row's data came through: bit-exact, damaged by a profile whose effect is meant to
/// change data, or wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Every rank got exactly what was sent.
    Exact,
    /// Some data changed, as the profile's effect intends.
    Damaged,
    /// Some data changed that should not have.
    Wrong,
}

impl Check {
    /// The check of a result that was bit-exact or not, under a profile that corrupts data
    /// or not.
    pub fn of(exact: bool, corrupts_data: bool) -> Check {
        match (exact, corrupts_data) {
            (true, _) => Check::Exact,
            (false, true) => Check::Damaged,
            (false, false) => Check::Wrong,
        }
    }

    /// False for [`Check::Wrong`].
    pub fn passed(self) -> bool {
        self != Check::Wrong
    }
}

/// Slowest rank's time for result `index` (every rank runs the same list).
pub fn slowest(reports: &[WorkerReport], index: usize) -> f64 {
    reports
        .iter()
        .filter_map(|r| r.results.get(index))
        .map(|r| r.seconds)
        .fold(0.0, f64::max)
}

/// Runs `lossy bench`.
pub fn run(args: Args) -> ExitCode {
    match bench(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lossy bench: {err}");
            ExitCode::FAILURE
        }
    }
}

/// One link's columns of a row: mean, p50, p99 (us), algbw, busbw (GB/s).
fn link_columns(reports: &[WorkerReport], index: usize, bytes: usize, factor: f64) -> String {
    let mean = slowest(reports, index);
    let samples = slowest_samples(reports, index);
    let algbw = if mean > 0.0 {
        bytes as f64 / mean / 1e9
    } else {
        0.0
    };
    format!(
        "{:>10.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2}",
        mean * 1e6,
        percentile(&samples, 50.0) * 1e6,
        percentile(&samples, 99.0) * 1e6,
        algbw,
        algbw * factor
    )
}

/// Header cells matching [`link_columns`].
fn link_head(name: &str) -> (String, String) {
    (
        format!(
            "{:>10} {:>9} {:>9} {:>8} {:>8}",
            format!("{name} us"),
            "p50",
            "p99",
            "algbw",
            "busbw"
        ),
        format!(
            "{:>10} {:>9} {:>9} {:>8} {:>8}",
            "(mean)", "(us)", "(us)", "(GB/s)", "(GB/s)"
        ),
    )
}

fn bench(args: &Args) -> Result<()> {
    let bad = nccl_net_lossy::Error::invalid_argument;
    // Each error names the option too: two take sizes, and a list holds several.
    let chunk = parse_size(&args.chunk).map_err(|e| bad(format!("--chunk {}: {e}", args.chunk)))?;
    let dtype = parse_dtype(&args.dtype).map_err(bad)?;
    let sizes: Vec<usize> = parse_bench_sizes(&args.sizes)
        .map_err(|e| bad(format!("--sizes {}: {e}", args.sizes)))?
        .into_iter()
        .map(|b| element_bytes(b, dtype))
        .collect();
    // Beyond NCCL's channels a run spent minutes opening connections before it ran out of
    // descriptors, and streams beyond the plugin's sockets per connection failed as a
    // connection timeout naming neither.
    if args.comms == 0 || args.comms > MAX_COMMS {
        return Err(bad(format!(
            "--comms {}: allowed: at least 1 and at most {MAX_COMMS} (ring channels, as NCCL \
             has at most {MAX_COMMS})",
            args.comms
        )));
    }
    // Counts that would run something else than asked are refused: `--iters 0` ran one
    // iteration, `--raw-streams 0` one stream, a chunk under one element one element, and a
    // huge `--warmup` ran for days.
    if let Some(iters) = args.iters.filter(|&n| n == 0 || n > MAX_ITERS_ARG) {
        return Err(bad(format!(
            "--iters {iters}: allowed: at least 1 and at most {MAX_ITERS_ARG}"
        )));
    }
    if args.warmup > MAX_ITERS_ARG {
        return Err(bad(format!(
            "--warmup {}: allowed: 0 to {MAX_ITERS_ARG} (at most {MAX_ITERS_ARG})",
            args.warmup
        )));
    }
    // Checked here, not by each rank after the launch (every rank failed, naming no option).
    if !(MIN_VERSION..=MAX_VERSION).contains(&args.net_version) {
        return Err(bad(format!(
            "--net-version {}: allowed: {MIN_VERSION} to {MAX_VERSION} (the net plugin ABI \
             versions the harness drives)",
            args.net_version
        )));
    }
    if let Some(streams) = args.raw_streams.filter(|&n| n == 0 || n > MAX_RAW_STREAMS) {
        return Err(bad(format!(
            "--raw-streams {streams}: allowed: at least 1 and at most {MAX_RAW_STREAMS} \
             (streams per comm of the raw TCP baseline, as NCCL's Socket transport's sockets \
             per connection)"
        )));
    }
    if chunk < dtype.size() {
        return Err(bad(format!(
            "--chunk {}: allowed: at least one element ({} bytes for {dtype}) and at most {}",
            args.chunk,
            dtype.size(),
            fmt_bytes(MAX_SIZE)
        )));
    }
    if args.runs == 0 || args.runs > MAX_RUNS {
        return Err(bad(format!(
            "--runs {}: allowed: at least 1 and at most {MAX_RUNS}",
            args.runs
        )));
    }
    if args.runs > 1 && args.samples.is_some() {
        return Err(bad(format!(
            "--samples with --runs {}: the samples file holds one run's iterations (each run \
             would replace it); give --samples to a single run",
            args.runs
        )));
    }
    if args.runs > 1 && detect(&args.cluster, &|k| std::env::var(k).ok())?.is_some() {
        return Err(bad(format!(
            "--runs {}: repeats a local run (the ranks this command starts); as one rank of a \
             multi-process job, run the job again instead",
            args.runs
        )));
    }
    // Only rank 0 writes the file: another rank of a multi-process job does not look.
    let this_rank = args
        .cluster
        .rank
        .or_else(|| nccl_net_lossy::stats::writer::launcher_rank().map(|r| r as usize));
    if let Some(path) = args
        .samples
        .as_ref()
        .filter(|_| this_rank.unwrap_or(0) == 0)
    {
        check_samples_path(path)?;
    }
    let runs: Vec<RunSpec> = sizes
        .iter()
        .map(|&bytes| RunSpec {
            collective: Collective::AllReduce,
            dtype,
            bytes,
            iters: args.iters.unwrap_or_else(|| default_iters(bytes)),
            warmup: args.warmup,
        })
        .collect();
    let mut links = vec![LinkKind::Plugin, LinkKind::RawTcp];
    if args.vs_lossless {
        links.push(LinkKind::PluginLossless);
    }
    let peer_libraries = args
        .vs_library
        .iter()
        .map(|path| plugin_library(Some(path)))
        .collect::<Result<Vec<_>>>()?;
    links.extend((0..peer_libraries.len()).map(LinkKind::Peer));
    let per_size = links.len();
    let library = plugin_library(args.library.as_deref())?;
    let mut job = Job::collectives(library.clone(), links, runs.clone());
    job.peer_libraries = peer_libraries.clone();
    job.chunk = chunk;
    job.version = args.net_version;
    job.lossless = args.lossless;
    job.verify = true;
    job.comms = args.comms;
    let streams = args.raw_streams.unwrap_or_else(raw_streams_default);
    job.raw_streams = streams;
    // Damage is the expected outcome of a profile whose effects change data (and loss is on).
    let corrupts_data = !args.lossless && Profile::from_env()?.corrupts_data();
    if args.runs > 1 {
        let mut names = vec!["plugin".to_string(), "raw".to_string()];
        if args.vs_lossless {
            names.push("lossless".to_string());
        }
        names.extend(peer_names(peer_libraries.len()));
        let links = match &job.task {
            Task::Collectives { links, .. } => links.clone(),
            _ => Vec::new(),
        };
        return super::bench_runs::many(&super::bench_runs::Plan {
            args,
            job,
            links,
            names,
            specs: runs,
            library: &library,
            peers: &peer_libraries,
            corrupts_data,
            chunk,
        });
    }
    let Some(Ranks { reports, members }) =
        run_ranks(&args.cluster, "bench", &Launch::new(args.ranks, job)?)?
    else {
        return Ok(());
    };
    let n = reports.len();
    let factor = Collective::AllReduce.bus_factor(n);
    // The table goes out in one write: a reader that closed the pipe (`lossy bench | head`)
    // takes what it read, and the command ends as it would have.
    let mut out = String::new();
    macro_rules! say {
        ($($arg:tt)*) => {{
            out.push_str(&format!($($arg)*));
            out.push('\n');
        }};
    }
    let opened = |k: usize| reports.first().and_then(|r| r.results.get(k));
    say!(
        "# all_reduce, {n} ranks, {dtype}, chunk {}, loss {}",
        fmt_bytes(chunk),
        if args.lossless { "off" } else { "as profiled" }
    );
    let peer_names = peer_names(peer_libraries.len());
    out.push_str(&library_lines(
        &reports,
        &library,
        &peer_libraries,
        &peer_names,
    ));
    if let Some(members) = &members {
        out.push_str(&rank_lines(members));
    }
    say!(
        "# plugin: {} send comms per rank",
        opened(0).map_or(0, |r| r.comms)
    );
    say!(
        "# raw TCP: {} comms x {} streams per rank, inline non-blocking",
        opened(1).map_or(0, |r| r.comms),
        opened(1).map_or(0, |r| r.streams)
    );
    say!(
        "# TCP congestion control on this host: {}",
        congestion_control()
    );
    say!(
        "# times: mean of the slowest rank; p50/p99 over iterations of the slowest rank per \
         iteration (nearest rank: p99 of under 100 iterations is the maximum)"
    );
    let (plugin_head, plugin_units) = link_head("plugin");
    let (raw_head, raw_units) = link_head("raw");
    // Links shown beside the plugin with their mean time over the plugin's (above 100%: the
    // plugin is faster): the lossless plugin (third result of a size), the peers (last ones,
    // in the order given).
    let mut compared: Vec<(usize, &str)> = Vec::new();
    if args.vs_lossless {
        compared.push((2, "lossless"));
    }
    let first_peer = per_size - peer_libraries.len();
    for (i, name) in peer_names.iter().enumerate() {
        compared.push((first_peer + i, name));
    }
    let (mut extra_head, mut extra_units) = (String::new(), String::new());
    for &(_, name) in &compared {
        let (h, u) = link_head(name);
        extra_head += &format!(" | {h} {:>8}", "vs");
        extra_units += &format!(" | {u} {name:>8}");
    }
    say!(
        "# {:>10} {:>10} {:>5} | {plugin_head} | {raw_head} | {:>6}{extra_head} | {:>5}",
        "size",
        "count",
        "iters",
        "ratio",
        "check"
    );
    say!(
        "# {:>10} {:>10} {:>5} | {plugin_units} | {raw_units} | {:>6}{extra_units} | {:>5}",
        "(B)",
        "(elems)",
        "",
        "vs raw",
        ""
    );
    let mut all_ok = true;
    for (i, run) in runs.iter().enumerate() {
        let bytes = run.bytes;
        let first = per_size * i;
        let (plugin, raw) = (slowest(&reports, first), slowest(&reports, first + 1));
        // Damage is judged on the lossy plugin link only; the others must be bit-exact.
        let exact = |k: usize| {
            reports
                .iter()
                .all(|r| r.results.get(first + k).is_some_and(|x| x.ok))
        };
        let check = if (1..per_size).all(exact) {
            Check::of(exact(0), corrupts_data)
        } else {
            Check::Wrong
        };
        all_ok &= check.passed();
        let ratio = |base: f64, t: f64| {
            if base > 0.0 {
                100.0 * base / t.max(1e-12)
            } else {
                0.0
            }
        };
        let extra: String = compared
            .iter()
            .map(|&(k, _)| {
                format!(
                    " | {} {:>7.0}%",
                    link_columns(&reports, first + k, bytes, factor),
                    ratio(slowest(&reports, first + k), plugin)
                )
            })
            .collect();
        say!(
            "  {:>10} {:>10} {:>5} | {} | {} | {:>5.0}%{extra} | {:>5}",
            bytes,
            bytes / dtype.size(),
            run.iters,
            link_columns(&reports, first, bytes, factor),
            link_columns(&reports, first + 1, bytes, factor),
            ratio(raw, plugin),
            match check {
                Check::Exact => "ok",
                Check::Damaged => "dmg",
                Check::Wrong => "WRONG",
            }
        );
    }
    if corrupts_data {
        say!("# dmg: the profile's effect changed data, as it is meant to");
    }
    super::write_stdout(&out)
        .map_err(|e| nccl_net_lossy::Error::system(format!("cannot write the table: {e}")))?;
    // After the table, so a file that cannot be written costs the samples, not the run.
    if let Some(path) = &args.samples {
        // The table's links, in result order: the plugin, raw TCP, then the compared ones.
        let mut names = vec!["plugin", "raw"];
        names.extend(compared.iter().map(|&(_, name)| name));
        debug_assert_eq!(names.len(), per_size);
        write_samples(path, &reports, &runs, &names)?;
    }
    if all_ok {
        Ok(())
    } else {
        Err(nccl_net_lossy::Error::remote(
            "some results were not bit-exact",
        ))
    }
}

/// The header lines naming the plugin and each peer library (`names`: the peers' names in
/// the table) as the libraries report themselves, and where they were loaded from.
pub(super) fn library_lines(
    reports: &[WorkerReport],
    library: &Path,
    peers: &[PathBuf],
    names: &[String],
) -> String {
    let first = reports.first();
    let mut out = format!(
        "# plugin {} from {}\n",
        first.map_or("?", |r| r.plugin.as_str()),
        library.display()
    );
    for (i, (peer, name)) in peers.iter().zip(names).enumerate() {
        out += &format!(
            "# {name} {} from {}\n",
            first
                .and_then(|r| r.peers.get(i))
                .map_or("?", String::as_str),
            peer.display()
        );
    }
    out
}

/// The table's names of `n` peer libraries: one is `peer`; several are `peer1`, `peer2`, ...
/// in the order given.
fn peer_names(n: usize) -> Vec<String> {
    match n {
        1 => vec!["peer".to_string()],
        n => (1..=n).map(|i| format!("peer{i}")).collect(),
    }
}

/// What `--samples` may name: an existing regular file, or a new one in an existing
/// directory. Checked before any rank starts, so a run is not lost to a path that cannot
/// take its samples; nothing is created here.
fn check_samples_path(path: &Path) -> Result<()> {
    let refuse = |why: String| {
        nccl_net_lossy::Error::invalid_argument(format!(
            "--samples {}: {why}; the samples go to a regular file, created or replaced, in \
             an existing directory",
            path.display()
        ))
    };
    if path.file_name().is_none() || path.as_os_str().as_encoded_bytes().ends_with(b"/") {
        return Err(refuse("names a directory (it ends in `/` or `..`)".into()));
    }
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(()),
        Ok(meta) => Err(refuse(format!(
            "not a regular file ({})",
            nccl_net_lossy::files::file_kind(&meta.file_type())
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            match std::fs::metadata(dir) {
                Ok(meta) if meta.is_dir() => Ok(()),
                Ok(_) => Err(refuse(format!("{} is not a directory", dir.display()))),
                Err(e) => Err(refuse(format!("cannot create it: {}: {e}", dir.display()))),
            }
        }
        Err(e) => Err(refuse(e.to_string())),
    }
}

/// Writes every timed iteration of every link (`names`, in result order within a size) as
/// CSV to `path`, opened without blocking and checked again on the open descriptor (a FIFO
/// put there since the first check is refused, not waited on).
fn write_samples(
    path: &Path,
    reports: &[WorkerReport],
    runs: &[RunSpec],
    names: &[&str],
) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |e: std::io::Error| {
        nccl_net_lossy::Error::system(format!("--samples {}: {e}", path.display()))
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(fail)?;
    let kind = file.metadata().map_err(fail)?.file_type();
    if !kind.is_file() {
        return Err(nccl_net_lossy::Error::invalid_argument(format!(
            "--samples {}: not a regular file ({})",
            path.display(),
            nccl_net_lossy::files::file_kind(&kind)
        )));
    }
    file.set_len(0).map_err(fail)?;
    let mut out = std::io::BufWriter::new(file);
    let ranks: String = (0..reports.len()).map(|r| format!(",rank{r}_us")).collect();
    writeln!(out, "size_bytes,link,iteration,slowest_us{ranks}").map_err(fail)?;
    for (i, run) in runs.iter().enumerate() {
        for (k, name) in names.iter().enumerate() {
            let per_rank = rank_samples(reports, i * names.len() + k);
            if per_rank.len() != reports.len() {
                return Err(nccl_net_lossy::Error::internal(format!(
                    "--samples {}: {} of {} ranks reported {name} at {} bytes",
                    path.display(),
                    per_rank.len(),
                    reports.len(),
                    run.bytes
                )));
            }
            let iters = per_rank.iter().map(|s| s.len()).min().unwrap_or(0);
            for it in 0..iters {
                let times: Vec<f64> = per_rank.iter().map(|s| s[it] * 1e6).collect();
                let slowest = times.iter().copied().fold(0.0, f64::max);
                let cells: String = times.iter().map(|t| format!(",{t:.3}")).collect();
                writeln!(out, "{},{name},{it},{slowest:.3}{cells}", run.bytes).map_err(fail)?;
            }
        }
    }
    out.flush().map_err(fail)
}

/// The TCP congestion control new connections of this host get, as the kernel reports it,
/// with what it means for the table: BBR paces each connection at its own estimate of the
/// path, and on loopback those estimates settle differently from one connection to the next
/// (docs/calibration.md, "Congestion control").
pub(super) fn congestion_control() -> String {
    match std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control") {
        Ok(cc) if cc.trim() == "bbr" => "bbr (paces each connection at its own rate: one \
            connection can run up to a third slower than another in the same run, so compare \
            interleaved links over several runs, not one row)"
            .to_string(),
        Ok(cc) => cc.trim().to_string(),
        Err(_) => "unknown".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::sizes::parse_sizes;

    /// The `--sizes` help of `command` (`bench` or `demo`), as `--help` prints it.
    fn sizes_help(command: &str) -> String {
        use clap::CommandFactory;
        let cli = crate::commands::Cli::command();
        let sub = cli.find_subcommand(command).expect("subcommand");
        let arg = sub
            .get_arguments()
            .find(|a| a.get_id() == "sizes")
            .expect("--sizes");
        arg.get_help().expect("help").to_string()
    }

    /// Each preset `--help` names states the first and last size it runs, in the words
    /// between its name and the next preset's.
    fn assert_help_states_presets(help: &str, presets: &[&str], parse: fn(&str) -> Vec<usize>) {
        for preset in presets {
            let name = format!("`{preset}`");
            let start = help
                .find(&name)
                .unwrap_or_else(|| panic!("{help}: no {name}"));
            let rest = &help[start + name.len()..];
            let words = &rest[..rest.find('`').unwrap_or(rest.len())];
            let sizes = parse(preset);
            for size in [sizes[0], sizes[sizes.len() - 1]] {
                let size = fmt_bytes(size);
                assert!(words.contains(&size), "{help}: {name} does not say {size}");
            }
        }
    }

    #[test]
    fn sizes_help_states_what_each_preset_runs() {
        assert_help_states_presets(&sizes_help("bench"), &["small", "large", "all"], |p| {
            parse_bench_sizes(p).expect("preset")
        });
        assert_help_states_presets(&sizes_help("demo"), &["small", "large"], |p| {
            parse_sizes(p).expect("preset")
        });
    }

    #[test]
    fn damage_passes_only_under_a_profile_that_corrupts_data() {
        assert_eq!(Check::of(true, false), Check::Exact);
        assert_eq!(Check::of(true, true), Check::Exact);
        assert_eq!(Check::of(false, true), Check::Damaged);
        assert_eq!(Check::of(false, false), Check::Wrong);
        assert!(Check::Exact.passed() && Check::Damaged.passed());
        assert!(!Check::Wrong.passed());
    }

    #[test]
    fn iterations_fall_with_size_within_bounds_and_sizes_are_whole_elements() {
        assert_eq!(default_iters(8), MAX_ITERS);
        assert_eq!(default_iters(1 << 20), 64);
        assert_eq!(default_iters(256 << 20), MIN_ITERS);
        assert_eq!(element_bytes(1, DataType::F32), 4);
        assert_eq!(element_bytes(6, DataType::F32), 4);
        assert_eq!(element_bytes(1, DataType::U8), 1);
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let five = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&five, 50.0), 3.0);
        assert_eq!(percentile(&five, 99.0), 5.0);
        let hundred: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(percentile(&hundred, 99.0), 198.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
