//! Per-rank statistics files: one JSON document per process, replaced atomically (written to
//! a temporary name of its own, then renamed) so a reader never sees half a file, even after a
//! crash or with two writes of the file at once.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{ConnectionSnapshot, Counts, StepCounts};
use crate::files::read_regular_file;
use crate::{Error, Result};

/// Version of the statistics file layout.
pub const FORMAT_VERSION: u32 = 1;

/// Largest statistics (or per-step) file `lossy report` reads, in bytes: a file lists at most
/// 1024 rules and the counts of each connection and step, a few MiB for a large job.
pub const MAX_STATS_FILE_BYTES: u64 = 256 << 20;

/// Environment variable naming the directory statistics files go to.
pub const STATS_DIR_ENV: &str = "NCCL_LOSSY_STATS";

/// A directory variable's value, None when unset or blank (as `NCCL_LOSSY_TRACE` and the
/// launchers read a blank one: not a directory named by spaces). The plugin and the `lossy`
/// commands read `NCCL_LOSSY_STATS` through this, so they agree on whether it is set.
pub fn dir_setting(value: Option<std::ffi::OsString>) -> Option<std::ffi::OsString> {
    value.filter(|dir| !dir.to_string_lossy().trim().is_empty())
}

/// The content of one rank's statistics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatsFile {
    /// Layout version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Rank from `RANK` / `OMPI_COMM_WORLD_RANK`, when the launcher set one.
    pub rank: Option<u64>,
    /// The number of ranks the launcher started (`WORLD_SIZE`, or the size beside the rank
    /// variable it used), so that a report can name the ranks that wrote no file. Absent when
    /// the launcher set none (and in files written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u64>,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// When the file was written, in milliseconds since the Unix epoch.
    pub written_at_unix_ms: u64,
    /// The resolved profile that produced these numbers (seed included).
    pub profile: serde_json::Value,
    /// Totals over every connection.
    pub total: Counts,
    /// Per-connection statistics.
    pub connections: Vec<ConnectionSnapshot>,
    /// Packets and losses per training step (when the training script sets steps).
    #[serde(default)]
    pub by_step: Vec<StepCounts>,
    /// Packets and losses at the steps past the per-step series (from
    /// [`super::STEP_SLOTS`] on), summed: `step` is the first of them. Absent when there
    /// were none (and in files written before it was counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_beyond: Option<StepCounts>,
}

impl StatsFile {
    /// Assembles a file from connection snapshots.
    pub fn new(profile: serde_json::Value, connections: Vec<ConnectionSnapshot>) -> Self {
        let mut total = Counts::default();
        for c in &connections {
            total.add(&c.total);
        }
        StatsFile {
            format_version: FORMAT_VERSION,
            rank: launcher_rank(),
            world_size: launcher_world_size(),
            host: host_name(),
            pid: std::process::id(),
            written_at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            profile,
            total,
            connections,
            by_step: super::step_snapshot(),
            steps_beyond: super::steps_beyond(),
        }
    }

    /// The file name for this process: rank, host and pid keep ranks of one run apart.
    pub fn file_name(&self) -> String {
        let rank = self.rank.map_or_else(|| "x".to_string(), |r| r.to_string());
        format!(
            "lossy-stats-rank{rank}-{}-{}.json",
            sanitize(&self.host),
            self.pid
        )
    }

    /// Writes the file into `dir` atomically and returns its path.
    pub fn write_to(&self, dir: &Path) -> Result<PathBuf> {
        fs::create_dir_all(dir).map_err(|e| {
            Error::system(format!(
                "cannot create stats directory {}: {e}",
                dir.display()
            ))
        })?;
        let json = serde_json::to_vec_pretty(self)
            .map_err(|e| Error::internal(format!("cannot encode statistics: {e}")))?;
        write_atomically(dir, &self.file_name(), &json)
    }

    /// Reads a statistics file: a regular file of at most [`MAX_STATS_FILE_BYTES`] (a FIFO
    /// or `/dev/zero` in a run directory is refused, not read forever).
    pub fn read(path: &Path) -> Result<StatsFile> {
        let text = read_regular_file(path, MAX_STATS_FILE_BYTES, "statistics file")
            .map_err(Error::invalid_argument)?;
        // The parser's message quotes the value it refused whole: cut, the place kept.
        let not_stats = |e: serde_json::Error| {
            let said = e.to_string();
            let at = format!(" at line {} column {}", e.line(), e.column());
            let why = crate::error::echo_at_most(
                said.strip_suffix(&at).unwrap_or(&said),
                crate::error::SHOWN_CHARS / 16,
                str::to_string,
            );
            let at = if e.line() > 0 { at } else { String::new() };
            Error::invalid_argument(format!(
                "{} is not a statistics file: {why}{at}",
                path.display()
            ))
        };
        // The version first: a newer version's layout may differ anywhere, and its version is
        // what to report, not the first field this one misses.
        #[derive(Deserialize)]
        struct Version {
            format_version: Option<serde_json::Value>,
        }
        if let Ok(Version {
            format_version: Some(version),
        }) = serde_json::from_str::<Version>(&text)
        {
            if version.as_u64() != Some(u64::from(FORMAT_VERSION)) {
                return Err(Error::invalid_argument(format!(
                    "{}: format_version = {version}: this lossy reads version \
                     {FORMAT_VERSION} (a file of another lossy release: read it with that one)",
                    path.display()
                )));
            }
        }
        let file: StatsFile = serde_json::from_str(&text).map_err(not_stats)?;
        file.check()
            .map_err(|why| Error::invalid_argument(format!("{}: {why}", path.display())))?;
        Ok(file)
    }

    /// What a file this version wrote always holds: its version, no count of lost packets
    /// (or of packets sent with injection off) above the packets sent, in any cell (the
    /// totals, each connection's collectives and rules, and each step), no more loss events
    /// than lost packets, and burst-length histograms that fit the lost packets
    /// ([`check_bursts`]).
    fn check(&self) -> std::result::Result<(), String> {
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format_version = {}: this lossy reads version {FORMAT_VERSION}",
                self.format_version
            ));
        }
        // Every cell of counters: the totals, each connection's and its collectives' and rules'.
        let counters = std::iter::once(("total".to_string(), &self.total)).chain(
            self.connections.iter().enumerate().flat_map(|(i, c)| {
                let ops = c
                    .by_op
                    .iter()
                    .enumerate()
                    .map(move |(j, o)| (format!("connections.{i}.by_op.{j}"), &o.counts));
                let rules = c
                    .by_rule
                    .iter()
                    .enumerate()
                    .map(move |(j, r)| (format!("connections.{i}.by_rule.{j}"), &r.counts));
                std::iter::once((format!("connections.{i}.total"), &c.total))
                    .chain(ops)
                    .chain(rules)
            }),
        );
        let steps = self
            .by_step
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("by_step.{i} (step {})", s.step), s))
            .chain(
                self.steps_beyond
                    .iter()
                    .map(|s| (format!("steps_beyond (steps from {} on)", s.step), s)),
            );
        let more_than = |at: &str, parts: &[(&str, u64)], whole: (&str, u64)| match parts
            .iter()
            .find(|(_, count)| *count > whole.1)
        {
            Some((name, count)) => Err(format!(
                "{at}: {name} = {count} is more than {} = {}",
                whole.0, whole.1
            )),
            None => Ok(()),
        };
        for (at, c) in counters {
            let parts = [
                ("lost_packets", c.lost_packets),
                ("packets_injection_off", c.packets_injection_off),
            ];
            more_than(&at, &parts, ("packets", c.packets))?;
            // Loss events are runs of lost packets within a message: never more than those
            // (a live snapshot reads the events before the lost packets they are runs of).
            more_than(
                &at,
                &[("loss_events", c.loss_events)],
                ("lost_packets", c.lost_packets),
            )?;
        }
        for (at, s) in steps {
            let parts = [
                ("lost_packets", s.lost_packets),
                ("packets_injection_off", s.packets_injection_off),
            ];
            more_than(&at, &parts, ("packets", s.packets))?;
        }
        for (i, conn) in self.connections.iter().enumerate() {
            check_bursts(i, conn)?;
        }
        Ok(())
    }
}

/// What the burst-length histograms of connection `i` always hold, as the plugin records
/// them: bursts of at least one packet; per collective, no more bursts than the packets it
/// lost on the connection (a burst is counted under the collective of the message it ends
/// in, which lost at least its last packet); and in all no more lost packets than the
/// connection lost. The bins are those of a histogram of two significant digits, whose
/// values are the top of their bucket, less than 1/128 above the lengths recorded in them
/// ([`super::tests`] checks the bound), hence the allowance of 1/128.
fn check_bursts(i: usize, conn: &ConnectionSnapshot) -> std::result::Result<(), String> {
    let lost_by = |op: &str| {
        conn.by_op
            .iter()
            .filter(|cell| cell.op == op)
            .fold(0u64, |sum, cell| {
                sum.saturating_add(cell.counts.lost_packets)
            })
    };
    let lost = conn.by_op.iter().fold(0u64, |sum, cell| {
        sum.saturating_add(cell.counts.lost_packets)
    });
    let mut burst_packets = 0u128;
    for (j, h) in conn.histograms.iter().enumerate() {
        let at = format!("connections.{i}.histograms.{j} ({})", h.op);
        if let Some(&(_, n)) = h.burst_lengths.iter().find(|(len, _)| *len == 0) {
            return Err(format!(
                "{at}: burst_lengths holds a burst of length 0 ({n} of them): a burst is at \
                 least one lost packet"
            ));
        }
        // Every histogram of the collective: a file edited by hand may list it twice.
        let bursts = conn
            .histograms
            .iter()
            .filter(|other| other.op == h.op)
            .flat_map(|other| &other.burst_lengths)
            .fold(0u64, |sum, &(_, n)| sum.saturating_add(n));
        let op_lost = lost_by(&h.op);
        if bursts > op_lost {
            return Err(format!(
                "{at}: {bursts} bursts, but {} lost {op_lost} packets on this connection \
                 (connections.{i}.by_op): each burst holds at least one of them",
                h.op
            ));
        }
        for &(len, n) in &h.burst_lengths {
            burst_packets = burst_packets.saturating_add(u128::from(len) * u128::from(n));
        }
    }
    if burst_packets.saturating_mul(128) > u128::from(lost) * 129 {
        return Err(format!(
            "connections.{i}.histograms: bursts of {burst_packets} packets in all, but the \
             connection lost {lost} packets (connections.{i}.by_op)"
        ));
    }
    Ok(())
}

/// The variables launchers give a process its rank in (torchrun, Open MPI, PMI, Slurm), in
/// the order they are read: the first of each of [`LAUNCHER_VARIABLES`].
pub const LAUNCHER_RANK_VARS: [&str; 4] = [
    LAUNCHER_VARIABLES[0].0,
    LAUNCHER_VARIABLES[1].0,
    LAUNCHER_VARIABLES[2].0,
    LAUNCHER_VARIABLES[3].0,
];

/// The rank the launcher gave this process, if any.
pub fn launcher_rank() -> Option<u64> {
    LAUNCHER_VARIABLES
        .iter()
        .find_map(|(rank, _)| number_variable(rank))
}

/// The launchers' (rank, number of ranks) variables, in the order they are looked at:
/// torchrun, Open MPI, PMI (MPICH, Intel MPI), Slurm.
pub const LAUNCHER_VARIABLES: [(&str, &str); 4] = [
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
];

fn number_variable(name: &str) -> Option<u64> {
    crate::env::var(name).ok()??.trim().parse().ok()
}

/// The number of ranks of the launcher whose rank [`launcher_rank`] took, if it says.
pub fn launcher_world_size() -> Option<u64> {
    LAUNCHER_VARIABLES
        .iter()
        .find(|(rank, _)| number_variable(rank).is_some())
        .and_then(|(_, size)| number_variable(size))
        .filter(|&size| size > 0)
}

/// Creates `dir` when missing and checks that a file can be created in it (a probe file,
/// removed again), so a directory that cannot take statistics or the trace is found at `init`,
/// not at every write. `what` names the directory's role in errors ("stats", "trace").
pub fn check_output_dir(dir: &Path, what: &str) -> Result<()> {
    crate::files::check_path_length(dir).map_err(Error::invalid_argument)?;
    fs::create_dir_all(dir).map_err(|e| {
        // "File exists" or "Not a directory" says nothing about what is in the way: say what
        // it is, and where (the directory itself, or a file among its ancestors).
        output_dir_in_the_way(dir, what).err().unwrap_or_else(|| {
            Error::system(format!(
                "cannot create {what} directory {}: {e}",
                dir.display()
            ))
        })
    })?;
    let probe = dir.join(format!(".lossy-{what}-probe-{}.tmp", std::process::id()));
    fs::File::create(&probe)
        .and_then(|_| fs::remove_file(&probe))
        .map_err(|e| {
            Error::system(format!(
                "cannot write a file in {what} directory {}: {e}",
                dir.display()
            ))
        })
}

/// What [`check_output_dir`] would refuse of `dir` that shows without creating or writing
/// anything: the directory, or the nearest of its ancestors that exists, is not a directory.
/// `lossy validate` judges with it the directories `init` creates.
pub fn output_dir_in_the_way(dir: &Path, what: &str) -> Result<()> {
    let mut at = Some(dir);
    while let Some(path) = at {
        match fs::metadata(path) {
            Ok(meta) if meta.is_dir() => return Ok(()),
            Ok(meta) => {
                return Err(Error::system(format!(
                    "cannot create {what} directory {}: {} is not a directory ({})",
                    dir.display(),
                    path.display(),
                    crate::files::file_kind(&meta.file_type())
                )))
            }
            // Missing (created at init), or below a file (seen at that file).
            Err(_) => at = path.parent().filter(|p| !p.as_os_str().is_empty()),
        }
    }
    Ok(())
}

/// What [`check_output_dir`] would refuse of `dir` beyond [`output_dir_in_the_way`], found
/// without creating a directory: the directory, or the nearest of its ancestors that exists
/// (where `init` would create it), takes no new file (a read-only file system, a directory
/// without write permission, /proc). A probe file is created there and removed at once.
/// `lossy validate` judges with it the directories `init` creates and writes in.
pub fn output_dir_writable_in_place(dir: &Path, what: &str) -> Result<()> {
    crate::files::check_path_length(dir).map_err(Error::invalid_argument)?;
    output_dir_in_the_way(dir, what)?;
    let Some(existing) = dir
        .ancestors()
        .find(|path| !path.as_os_str().is_empty() && path.is_dir())
        .or_else(|| dir.is_relative().then_some(Path::new(".")))
    else {
        return Ok(());
    };
    let probe = existing.join(format!(
        ".lossy-{what}-check-{}-{}.tmp",
        std::process::id(),
        TEMPORARIES.fetch_add(1, Ordering::Relaxed)
    ));
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            // Nothing is left behind; a probe that cannot be removed is no verdict on the run.
            let _ = fs::remove_file(&probe);
            Ok(())
        }
        Err(e) if existing == dir => Err(Error::system(format!(
            "cannot write a file in {what} directory {}: {e}",
            dir.display()
        ))),
        Err(e) => Err(Error::system(format!(
            "cannot create {what} directory {}: nothing can be written in {}: {e}",
            dir.display(),
            existing.display()
        ))),
    }
}

/// Temporaries this process created: with the pid, it gives each write a temporary name no
/// other write (of this process or another) shares.
static TEMPORARIES: AtomicU64 = AtomicU64::new(0);

/// Names taken (a leftover of a crashed process whose pid came back) skipped before giving up.
const TEMPORARY_ATTEMPTS: u32 = 16;

/// Writes `bytes` to `dir/name` so a reader sees the old file or the whole new one, never
/// part of it: a hidden temporary file next to it, synced, then renamed over it.
///
/// Each write has a temporary of its own (pid and a process-wide counter in its name, created
/// only if new), so two writes of one file at once (the periodic writer and
/// `ncclLossyWriteStats`) never write into each other's temporary: each rename replaces the
/// file with a whole document, and the last rename wins. Which snapshot that is, is the
/// caller's to order (the runtime writes one file at a time). A write that fails removes its
/// temporary (best effort: a full disk leaves no partial file behind).
pub(crate) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    write_atomically_with(dir, name, |out| out.write_all(bytes))
}

/// As [`write_atomically`], with the bytes `encode` writes as it goes (through a buffer), so
/// a large document never has to be held whole in memory.
pub(crate) fn write_atomically_with(
    dir: &Path,
    name: &str,
    encode: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<PathBuf> {
    let path = dir.join(name);
    let failed = |e: std::io::Error| Error::system(format!("cannot write {}: {e}", path.display()));
    let (tmp, file) = create_temporary(dir, name, ".tmp").map_err(failed)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, file);
    let written = encode(&mut out).and_then(|()| out.into_inner().map_err(|e| e.into_error()));
    commit(&tmp, &path, written).map_err(failed)?;
    Ok(path)
}

/// Syncs the temporary `tmp` (`written`: its file, or why writing it failed) and renames it
/// over `path`; any failure removes the temporary (best effort: the error that matters is
/// the write's), so a full disk leaves no partial file behind.
fn commit(tmp: &Path, path: &Path, written: std::io::Result<fs::File>) -> std::io::Result<()> {
    let done = written.and_then(|file| {
        file.sync_all()?;
        drop(file);
        fs::rename(tmp, path)
    });
    if done.is_err() {
        let _ = fs::remove_file(tmp);
    }
    done
}

/// Replaces the file at `path` as [`write_atomically`] does, for a writer that insists on a
/// path (an image library): `write` writes a new hidden temporary beside `path` that ends in
/// `path`'s extension (such a writer may take the format from it), which is then synced and
/// renamed over `path`. A write or rename that fails removes the temporary, and a file that
/// was at `path` stays as it was. The error is the cause alone (`write`'s own, or the
/// system's): the caller names the file.
pub fn replace_atomically(
    path: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    let name = path
        .file_name()
        .ok_or_else(|| "not a file name".to_string())?
        .to_string_lossy();
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let suffix = match path.extension() {
        Some(ext) => format!(".tmp.{}", ext.to_string_lossy()),
        None => ".tmp".to_string(),
    };
    let (tmp, file) = create_temporary(dir, &name, &suffix)
        .map_err(|e| format!("cannot create a temporary file in {}: {e}", dir.display()))?;
    drop(file);
    if let Err(e) = write(&tmp) {
        // Best effort: the error that matters is the write's.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    commit(&tmp, path, fs::File::open(&tmp)).map_err(|e| e.to_string())
}

/// Creates a new hidden temporary for `dir/name`, a name no other write uses, ending in
/// `suffix`.
fn create_temporary(dir: &Path, name: &str, suffix: &str) -> std::io::Result<(PathBuf, fs::File)> {
    let pid = std::process::id();
    let mut attempt = 0;
    loop {
        let n = TEMPORARIES.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{pid}-{n}{suffix}"));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                attempt += 1;
                if attempt >= TEMPORARY_ATTEMPTS {
                    return Err(e);
                }
            }
            opened => return opened.map(|file| (tmp, file)),
        }
    }
}

pub(crate) fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_string())
}

pub(crate) fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{ConnectionStats, MessageRecord};

    /// A file of one connection that sent one message of `packets` packets, one of them lost.
    fn one_message_file(packets: u64) -> StatsFile {
        let stats = ConnectionStats::new(3, 0);
        stats.record_message(&MessageRecord {
            op: 5,
            phase: 0,
            bytes: 100,
            packets,
            lost_packets: 1,
            loss_events: 1,
            retransmit_delay_ns: 0,
            packets_injection_off: 0,
            rule: None,
        });
        StatsFile::new(serde_json::json!({"seed": 1}), vec![stats.snapshot()])
    }

    #[test]
    fn file_round_trips_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("lossy-stats-test-{}", std::process::id()));
        let file = one_message_file(1);
        let path = file.write_to(&dir).expect("write stats");
        let back = StatsFile::read(&path).expect("read stats");
        assert_eq!(back, file);
        assert_eq!(back.total.lost_packets, 1);
        let leftovers: Vec<_> = fs::read_dir(&dir)
            .expect("list dir")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        fs::remove_dir_all(&dir).ok();
    }

    /// The names in `dir` that end in `.tmp`.
    fn temporaries(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .expect("list dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn concurrent_writers_of_one_file_never_fail_and_a_reader_always_sees_a_whole_file() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        const WRITERS: usize = 3;
        const WRITES: usize = 1000;
        let dir = std::env::temp_dir().join(format!("lossy-stats-race-{}", std::process::id()));
        fs::remove_dir_all(&dir).ok();
        let file = one_message_file(4);
        let path = file.write_to(&dir).expect("first write");
        let done = AtomicBool::new(false);
        let reads = AtomicUsize::new(0);
        let (write_errors, bad_reads) = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut bad = Vec::new();
                while !done.load(Ordering::Acquire) {
                    reads.fetch_add(1, Ordering::Relaxed);
                    match StatsFile::read(&path) {
                        Ok(back) if back == file => {}
                        Ok(_) => bad.push("a file of other content".to_string()),
                        Err(err) => bad.push(err.message),
                    }
                }
                bad
            });
            let writers: Vec<_> = (0..WRITERS)
                .map(|_| {
                    s.spawn(|| {
                        (0..WRITES)
                            .filter_map(|_| file.write_to(&dir).err().map(|e| e.message))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            let write_errors: Vec<String> = writers
                .into_iter()
                .flat_map(|w| w.join().expect("writer thread"))
                .collect();
            done.store(true, Ordering::Release);
            (write_errors, reader.join().expect("reader thread"))
        });
        assert!(
            write_errors.is_empty(),
            "{} of {} writes failed, first: {:?}",
            write_errors.len(),
            WRITERS * WRITES,
            write_errors.first()
        );
        assert!(
            bad_reads.is_empty(),
            "{} of {} reads saw no whole file, first: {:?}",
            bad_reads.len(),
            reads.load(Ordering::Relaxed),
            bad_reads.first()
        );
        assert_eq!(StatsFile::read(&path).expect("read stats"), file);
        assert_eq!(temporaries(&dir), Vec::<String>::new());
        fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_snapshot_taken_while_messages_flow_passes_the_readers_checks() {
        // `lossy report` refuses a cell losing more packets than it sent, and bursts holding
        // packets their collective's cells do not count. A periodic write snapshots the
        // counters while NCCL's progress thread adds to them: every snapshot must pass, or a
        // run's own file is refused. Each message here loses its one packet (100 % loss: the
        // lost count equals the packets, so a lost count read newer than the packets count
        // breaks the check at once), and ends a burst, as the data path records it.
        use std::sync::atomic::{AtomicBool, Ordering};
        const MESSAGES: u64 = 2_000_000;
        let stats = ConnectionStats::new(3, 0);
        let steps = crate::stats::StepSeries::new();
        let done = AtomicBool::new(false);
        let (snapshots, failures) = std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..MESSAGES {
                    stats.record_message(&MessageRecord {
                        op: 5,
                        bytes: 64,
                        packets: 1,
                        lost_packets: 1,
                        loss_events: 1,
                        packets_injection_off: 1,
                        ..MessageRecord::default()
                    });
                    steps.record(7, 1, 1, true);
                    stats.record_burst(5, 1);
                }
                done.store(true, Ordering::Release);
            });
            let mut snapshots = 0u64;
            let mut failures = Vec::new();
            while !done.load(Ordering::Acquire) {
                // The step series is 65,536 slots long: read it once for 64 connection reads.
                for i in 0..64 {
                    let mut file = StatsFile::new(serde_json::json!({}), vec![stats.snapshot()]);
                    file.by_step = if i == 0 { steps.snapshot() } else { Vec::new() };
                    snapshots += 1;
                    if let Err(why) = file.check() {
                        failures.push(why);
                    }
                }
            }
            (snapshots, failures)
        });
        assert!(
            failures.is_empty(),
            "{} of {snapshots} snapshots refused: {:?}",
            failures.len(),
            failures
        );
    }

    #[test]
    fn a_failed_write_removes_its_temporary_and_names_the_file() {
        let dir = std::env::temp_dir().join(format!("lossy-stats-fail-{}", std::process::id()));
        fs::remove_dir_all(&dir).ok();
        let file = one_message_file(1);
        // A non-empty directory where the file should go: the rename over it fails after the
        // temporary is written.
        let target = dir.join(file.file_name());
        fs::create_dir_all(target.join("in-the-way")).expect("create dir");
        let err = file.write_to(&dir).expect_err("rename over a directory");
        assert!(
            err.message
                .contains(&format!("cannot write {}", target.display())),
            "{err}"
        );
        assert_eq!(temporaries(&dir), Vec::<String>::new());
        fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_file_of_another_version_or_with_more_lost_than_sent_is_refused_naming_it() {
        let dir = std::env::temp_dir().join(format!("lossy-stats-bad-{}", std::process::id()));
        let file = one_message_file(2);
        let path = file.write_to(&dir).expect("write stats");
        let good: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("json");
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            fs::write(&path, v.to_string()).expect("write");
            StatsFile::read(&path).expect_err("refused").message
        };
        let err = edit(&|v| v["format_version"] = 99.into());
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(
            err.contains("format_version = 99") && err.contains("reads version 1"),
            "{err}"
        );
        // A newer version may have changed the layout: the version is what to report, not
        // the first field this one misses ("not a statistics file: missing field `total`").
        let err = edit(&|v| {
            v["format_version"] = 2.into();
            v.as_object_mut().expect("object").remove("total");
            v["connections"] = "moved elsewhere".into();
        });
        assert!(
            err.contains("format_version = 2")
                && err.contains("reads version 1")
                && !err.contains("missing field"),
            "{err}"
        );
        let err = edit(&|v| v["connections"][0]["by_op"][0]["lost_packets"] = 5.into());
        assert!(
            err.contains("connections.0.by_op.0: lost_packets = 5 is more than packets = 2"),
            "{err}"
        );
        let err = edit(&|v| v["connections"][0]["by_op"][0]["packets_injection_off"] = 3.into());
        assert!(
            err.contains(
                "connections.0.by_op.0: packets_injection_off = 3 is more than packets = 2"
            ),
            "{err}"
        );
        // Loss events are runs of lost packets within a message: never more than those.
        let err = edit(&|v| {
            v["connections"][0]["by_op"][0]["lost_packets"] = 1.into();
            v["connections"][0]["by_op"][0]["loss_events"] = 2.into();
        });
        assert!(
            err.contains("connections.0.by_op.0: loss_events = 2 is more than lost_packets = 1"),
            "{err}"
        );
        let err = edit(&|v| v["total"]["lost_packets"] = u64::MAX.into());
        assert!(
            err.contains("total: lost_packets = 18446744073709551615"),
            "{err}"
        );
        fs::remove_dir_all(&dir).ok();
    }
}
