//! Per-rank statistics files: one JSON document per process, replaced atomically (written to
//! a temporary name, then renamed) so a reader never sees half a file, even after a crash.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
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

/// The content of one rank's statistics file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatsFile {
    /// Layout version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Rank from `RANK` / `OMPI_COMM_WORLD_RANK`, when the launcher set one.
    pub rank: Option<u64>,
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

    /// Creates `dir` when missing and checks that a file can be created in it (a probe file,
    /// removed again), so a directory that cannot take statistics is found at `init`, not at
    /// every write.
    pub fn check_dir(dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).map_err(|e| {
            Error::system(format!(
                "cannot create stats directory {}: {e}",
                dir.display()
            ))
        })?;
        let probe = dir.join(format!(".lossy-stats-probe-{}.tmp", std::process::id()));
        fs::File::create(&probe)
            .and_then(|_| fs::remove_file(&probe))
            .map_err(|e| {
                Error::system(format!(
                    "cannot write a file in stats directory {}: {e}",
                    dir.display()
                ))
            })
    }

    /// Reads a statistics file: a regular file of at most [`MAX_STATS_FILE_BYTES`] (a FIFO
    /// or `/dev/zero` in a run directory is refused, not read forever).
    pub fn read(path: &Path) -> Result<StatsFile> {
        let text = read_regular_file(path, MAX_STATS_FILE_BYTES, "statistics file")
            .map_err(Error::invalid_argument)?;
        let file: StatsFile = serde_json::from_str(&text).map_err(|e| {
            Error::invalid_argument(format!("{} is not a statistics file: {e}", path.display()))
        })?;
        file.check()
            .map_err(|why| Error::invalid_argument(format!("{}: {why}", path.display())))?;
        Ok(file)
    }

    /// What a file this version wrote always holds: its version, and no count of lost packets
    /// above the packets sent.
    fn check(&self) -> std::result::Result<(), String> {
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format_version = {}: this lossy reads version {FORMAT_VERSION}",
                self.format_version
            ));
        }
        let cells = std::iter::once(("total".to_string(), &self.total)).chain(
            self.connections.iter().enumerate().flat_map(|(i, c)| {
                std::iter::once((format!("connections.{i}.total"), &c.total)).chain(
                    c.by_op
                        .iter()
                        .enumerate()
                        .map(move |(j, o)| (format!("connections.{i}.by_op.{j}"), &o.counts)),
                )
            }),
        );
        for (at, c) in cells {
            if c.lost_packets > c.packets {
                return Err(format!(
                    "{at}: lost_packets = {} is more than packets = {}",
                    c.lost_packets, c.packets
                ));
            }
        }
        Ok(())
    }
}

/// The rank the launcher gave this process, if any.
pub fn launcher_rank() -> Option<u64> {
    ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"]
        .iter()
        .find_map(|var| crate::env::var(var).ok()??.trim().parse().ok())
}

/// Writes `bytes` to `dir/name` so a reader sees the old file or the whole new one, never
/// part of it: a hidden temporary file next to it, synced, then renamed over it.
pub(crate) fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, &path)
    };
    write().map_err(|e| Error::system(format!("cannot write {}: {e}", path.display())))?;
    Ok(path)
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
        let err = edit(&|v| v["connections"][0]["by_op"][0]["lost_packets"] = 5.into());
        assert!(
            err.contains("connections.0.by_op.0: lost_packets = 5 is more than packets = 2"),
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
