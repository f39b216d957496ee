//! `lossy bench`: an nccl-tests-style all-reduce table for the plugin and, in the same run
//! and the same worker processes, plain loopback TCP with as many streams, with the ratio.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::harness::cluster::{print_ranks, run_ranks, ClusterArgs, Ranks};
use crate::harness::collectives::{Collective, DataType};
use crate::harness::launch::Launch;
use crate::harness::plugin_client::default_library_path;
use crate::harness::worker::{raw_streams_default, Job, LinkKind, RunSpec, WorkerReport};
use nccl_net_lossy::profile::Profile;
use nccl_net_lossy::Result;

/// Arguments of `lossy bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Local ranks (processes).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Sizes: a comma-separated list (`64K,1M,64M`), `small` or `large`.
    #[arg(long, default_value = "large")]
    pub sizes: String,
    /// Turn loss injection off (through the plugin's control API).
    #[arg(long)]
    pub lossless: bool,
    /// Also time the plugin with loss switched off, interleaved in the same run, and print
    /// lossy/lossless: what the profile's loss costs in bandwidth.
    #[arg(long, conflicts_with = "lossless")]
    pub vs_lossless: bool,
    /// Timed iterations per size (default: more for small sizes).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Untimed iterations per size.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Largest message (chunk) size.
    #[arg(long, default_value = "512K")]
    pub chunk: String,
    /// Net plugin ABI version to drive (8 to 12).
    #[arg(long, default_value_t = 12)]
    pub net_version: u32,
    /// Element type: f32 or u8.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// The net plugin library to drive: any NCCL net plugin (default: `NCCL_NET_PLUGIN` when
    /// it is a path, else this command's plugin library).
    #[arg(long, value_name = "PATH")]
    pub library: Option<PathBuf>,
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
        Some(path) if path.is_file() => Ok(path),
        Some(path) => Err(nccl_net_lossy::Error::invalid_argument(format!(
            "net plugin library {} does not exist",
            path.display()
        ))),
        None => default_library_path(),
    }
}

/// Parses `4096`, `4K`, `1M`, `64MiB`, `1G` into bytes.
pub fn parse_size(text: &str) -> std::result::Result<usize, String> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(1usize << shift))
        .ok_or_else(|| format!("bad size `{text}` (e.g. 4096, 64K, 1M, 1G)"))
}

/// Parses a size list or preset.
pub fn parse_sizes(text: &str) -> std::result::Result<Vec<usize>, String> {
    match text {
        "small" => Ok(vec![4 << 10, 64 << 10, 1 << 20]),
        "large" => Ok(vec![1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20]),
        list => list.split(',').map(parse_size).collect(),
    }
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

/// Human-readable bytes (`64 MiB`).
pub fn fmt_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
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

fn bench(args: &Args) -> Result<()> {
    let bad = nccl_net_lossy::Error::invalid_argument;
    let sizes = parse_sizes(&args.sizes).map_err(bad)?;
    let chunk = parse_size(&args.chunk).map_err(bad)?;
    let dtype = parse_dtype(&args.dtype).map_err(bad)?;
    let runs: Vec<RunSpec> = sizes
        .iter()
        .map(|&bytes| RunSpec {
            collective: Collective::AllReduce,
            dtype,
            bytes,
            iters: args
                .iters
                .unwrap_or(if bytes >= 16 << 20 { 5 } else { 20 })
                .max(1),
            warmup: args.warmup,
        })
        .collect();
    let mut links = vec![LinkKind::Plugin, LinkKind::RawTcp];
    if args.vs_lossless {
        links.push(LinkKind::PluginLossless);
    }
    let per_size = links.len();
    let library = plugin_library(args.library.as_deref())?;
    let mut job = Job::collectives(library.clone(), links, runs);
    job.chunk = chunk.max(dtype.size());
    job.version = args.net_version;
    job.lossless = args.lossless;
    job.verify = true;
    let streams = raw_streams_default();
    job.raw_streams = streams;
    // Damage is the expected outcome of a profile whose effects change data (and loss is on).
    let corrupts_data = !args.lossless && Profile::from_env()?.corrupts_data();
    let Some(Ranks { reports, members }) =
        run_ranks(&args.cluster, "bench", &Launch::new(args.ranks, job)?)?
    else {
        return Ok(());
    };
    let n = reports.len();
    let factor = Collective::AllReduce.bus_factor(n);
    println!(
        "# all_reduce, {n} ranks, {dtype}, chunk {}, {streams} streams per connection, loss {}",
        fmt_bytes(chunk),
        if args.lossless { "off" } else { "as profiled" }
    );
    println!(
        "# plugin {} from {}",
        reports.first().map_or("?", |r| r.plugin.as_str()),
        library.display()
    );
    if let Some(members) = &members {
        print_ranks(members);
    }
    let (extra_head, extra_units) = if args.vs_lossless {
        (
            format!(" | {:>10} {:>8} {:>8}", "lossless", "busbw", "vs"),
            format!(" | {:>10} {:>8} {:>8}", "us", "(GB/s)", "lossless"),
        )
    } else {
        (String::new(), String::new())
    };
    println!(
        "# {:>10} {:>10} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>6}{extra_head} | {:>5}",
        "size",
        "count",
        "plugin us",
        "algbw",
        "busbw",
        "raw us",
        "algbw",
        "busbw",
        "ratio",
        "check"
    );
    println!(
        "# {:>10} {:>10} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>6}{extra_units} | {:>5}",
        "(B)", "(elems)", "", "(GB/s)", "(GB/s)", "", "(GB/s)", "(GB/s)", "vs raw", ""
    );
    let mut all_ok = true;
    for (i, &bytes) in sizes.iter().enumerate() {
        let bytes = bytes / dtype.size() * dtype.size();
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
        let algbw = |t: f64| if t > 0.0 { bytes as f64 / t / 1e9 } else { 0.0 };
        let ratio = |base: f64, t: f64| {
            if base > 0.0 {
                100.0 * base / t.max(1e-12)
            } else {
                0.0
            }
        };
        let extra = if args.vs_lossless {
            let lossless = slowest(&reports, first + 2);
            format!(
                " | {:>10.1} {:>8.2} {:>7.0}%",
                lossless * 1e6,
                algbw(lossless) * factor,
                ratio(lossless, plugin)
            )
        } else {
            String::new()
        };
        println!(
            "  {:>10} {:>10} | {:>10.1} {:>8.2} {:>8.2} | {:>10.1} {:>8.2} {:>8.2} | {:>5.0}%{extra} | {:>5}",
            bytes,
            bytes / dtype.size(),
            plugin * 1e6,
            algbw(plugin),
            algbw(plugin) * factor,
            raw * 1e6,
            algbw(raw),
            algbw(raw) * factor,
            ratio(raw, plugin),
            match check {
                Check::Exact => "ok",
                Check::Damaged => "dmg",
                Check::Wrong => "WRONG",
            }
        );
    }
    if corrupts_data {
        println!("# dmg: the profile's effect changed data, as it is meant to");
    }
    if all_ok {
        Ok(())
    } else {
        Err(nccl_net_lossy::Error::remote(
            "some results were not bit-exact",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn sizes_parse_with_units_and_presets() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert!(parse_size("lots").is_err());
        assert_eq!(parse_sizes("small").map(|v| v.len()), Ok(3));
        assert_eq!(parse_sizes("1K,2K"), Ok(vec![1024, 2048]));
        assert_eq!(fmt_bytes(64 << 20), "64 MiB");
        assert_eq!(fmt_bytes(1027), "1027 B");
    }
}
