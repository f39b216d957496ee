//! Aggregating the per-rank statistics files of one or more runs: what `lossy report` prints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::writer::StatsFile;
use super::{Counts, StepCounts};
use crate::{Error, Result};

/// One collective (or the whole run, as `op = "all"`) summed over every rank of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpSummary {
    /// Collective name, or `all`.
    pub op: String,
    /// Summed counters.
    #[serde(flatten)]
    pub counts: Counts,
    /// The counters of `counts` whose sum passed 2^64-1 and stopped there (`messages`,
    /// `bytes`, ...): each is a lower bound, not the total.
    pub saturated: Vec<&'static str>,
    /// Lost packets over packets.
    pub loss_rate: f64,
    /// Lost packets over the packets sent with injection on (`counts.packets_injection_off`
    /// left out): the rate to hold against the model. None when none was sent with it on.
    pub loss_rate_injecting: Option<f64>,
    /// Mean length of a burst of consecutive lost packets (None when nothing was lost).
    pub mean_burst: Option<f64>,
    /// Burst length histogram, length -> count.
    pub bursts: BTreeMap<u64, u64>,
    /// Message latency percentiles in microseconds (p50, p90, p99), when measured.
    pub latency_us: Option<[f64; 3]>,
}

/// Everything one run's directory holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSummary {
    /// The run's name (its directory name).
    pub run: String,
    /// Distinct ranks among the files (files without a rank count one each).
    pub ranks: usize,
    /// Statistics files found (one per process of a run).
    pub files: usize,
    /// What makes the sums doubtful: files of different profiles, a rank written by several
    /// processes (several runs in one directory).
    pub warnings: Vec<String>,
    /// The profile the first file says produced the run.
    pub profile: serde_json::Value,
    /// The whole run (`op = "all"`).
    pub total: OpSummary,
    /// Per collective, by name.
    pub by_op: Vec<OpSummary>,
    /// Loss rate and mean burst length the profile's lossy model predicts (its closed form),
    /// when the statistics files say.
    pub expected: Option<ModelExpectation>,
    /// Packets and losses per training step, summed over ranks (empty when no step was set).
    pub by_step: Vec<StepCounts>,
    /// Packets and losses at the steps past the plugin's per-step series, summed over ranks
    /// (`step`: the first of them), which `by_step` leaves out; None when there were none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps_beyond: Option<StepCounts>,
    /// Per rule of the profile (in its order, then its defaults), the messages it decided:
    /// every rule the profile has, those that matched nothing too (empty when the files
    /// predate this breakdown).
    pub by_rule: Vec<RuleSummary>,
}

/// The messages one rule of the profile decided, summed over every rank of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleSummary {
    /// The rule's index in the profile's `rules` (`rules.0` is 0), `None` for the defaults.
    pub rule: Option<usize>,
    /// The rule's `name`, when the profile gives one.
    pub name: Option<String>,
    /// Summed counters.
    #[serde(flatten)]
    pub counts: Counts,
    /// The counters of `counts` whose sum stopped at 2^64-1, as [`OpSummary::saturated`].
    pub saturated: Vec<&'static str>,
    /// Lost packets over the packets sent with injection on (None when there were none).
    pub loss_rate_injecting: Option<f64>,
    /// Lost packets over loss events: the mean run of consecutive lost packets inside a
    /// message (a burst that crosses into the next message counts as two runs here).
    pub mean_run: Option<f64>,
    /// What the rule's model predicts (its closed form).
    pub expected: Option<ModelExpectation>,
}

impl RuleSummary {
    /// A row for `rule` with nothing counted, no name and no expectation yet.
    fn empty(rule: Option<usize>) -> Self {
        RuleSummary {
            rule,
            name: None,
            counts: Counts::default(),
            saturated: Vec::new(),
            loss_rate_injecting: None,
            mean_run: None,
            expected: None,
        }
    }

    /// How the rule is named in tables: `rules.N` and its name, or `defaults`.
    pub fn label(&self) -> String {
        match (self.rule, &self.name) {
            (Some(i), Some(name)) => format!("rules.{i} {name}"),
            (Some(i), None) => format!("rules.{i}"),
            (None, _) => "defaults".to_string(),
        }
    }
}

/// Every rule's counts of `files`, in the profile's order (`expected_by_rule` of the first
/// file's profile), with the rules only the counts name (files of another profile) after.
fn rule_summaries(files: &[StatsFile], profile: &serde_json::Value) -> Vec<RuleSummary> {
    let declared = profile
        .get("expected_by_rule")
        .and_then(|v| v.as_array())
        .cloned()
        .unwrap_or_default();
    let mut rows: Vec<RuleSummary> = declared
        .iter()
        .map(|entry| {
            let rule = entry
                .get("rule")
                .and_then(|v| v.as_u64())
                .and_then(|i| usize::try_from(i).ok());
            let mut row = RuleSummary::empty(rule);
            row.name = entry
                .get("name")
                .and_then(|v| v.as_str())
                .map(str::to_string);
            row.expected = entry
                .get("loss_rate")
                .and_then(|v| v.as_f64())
                .map(|loss_rate| ModelExpectation {
                    loss_rate,
                    mean_burst: entry
                        .get("mean_burst")
                        .and_then(|v| v.as_f64())
                        .unwrap_or(f64::INFINITY),
                });
            row
        })
        .collect();
    for conn in files.iter().flat_map(|f| &f.connections) {
        for counted in &conn.by_rule {
            let i = match rows.iter().position(|r| r.rule == counted.rule) {
                Some(i) => i,
                None => {
                    rows.push(RuleSummary::empty(counted.rule));
                    rows.len() - 1
                }
            };
            let row = &mut rows[i];
            add_counts(&mut row.counts, &counted.counts, &mut row.saturated);
        }
    }
    for row in &mut rows {
        row.loss_rate_injecting = row.counts.loss_rate_injecting();
        let c = &row.counts;
        row.mean_run = (c.loss_events > 0).then(|| c.lost_packets as f64 / c.loss_events as f64);
    }
    rows
}

/// What a loss model predicts in the long run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelExpectation {
    /// Stationary loss rate.
    pub loss_rate: f64,
    /// Mean length of a burst of consecutive lost packets.
    pub mean_burst: f64,
}

/// The closed-form expectation the plugin embedded in a profile (`expected`: the first model
/// of the profile that loses packets).
fn expectation(profile: &serde_json::Value) -> Option<ModelExpectation> {
    let expected = profile.get("expected")?;
    Some(ModelExpectation {
        loss_rate: expected.get("loss_rate")?.as_f64()?,
        mean_burst: expected.get("mean_burst")?.as_f64()?,
    })
}

#[derive(Default)]
struct Accumulator {
    counts: Counts,
    saturated: Vec<&'static str>,
    bursts: BTreeMap<u64, u64>,
    latency_ns: BTreeMap<u64, u64>,
}

impl Accumulator {
    fn finish(self, op: &str) -> OpSummary {
        let burst_count: f64 = self.bursts.values().map(|&n| n as f64).sum();
        let burst_packets: f64 = self
            .bursts
            .iter()
            .map(|(&len, &n)| len as f64 * n as f64)
            .sum();
        OpSummary {
            op: op.to_string(),
            counts: self.counts,
            saturated: self.saturated,
            loss_rate: self.counts.loss_rate(),
            loss_rate_injecting: self.counts.loss_rate_injecting(),
            mean_burst: (burst_count > 0.0).then(|| burst_packets / burst_count),
            latency_us: percentiles(&self.latency_ns, [0.5, 0.9, 0.99])
                .map(|p| p.map(|ns| ns as f64 / 1000.0)),
            bursts: self.bursts,
        }
    }
}

/// The values at quantiles `qs` of a histogram given as value -> count.
fn percentiles(bins: &BTreeMap<u64, u64>, qs: [f64; 3]) -> Option<[u64; 3]> {
    let total = bins.values().fold(0u64, |a, &n| a.saturating_add(n));
    if total == 0 {
        return None;
    }
    let mut out = [0u64; 3];
    for (slot, q) in out.iter_mut().zip(qs) {
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (&value, &count) in bins {
            bump(&mut seen, count);
            if seen >= rank {
                *slot = value;
                break;
            }
        }
    }
    Some(out)
}

/// The statistics files in `dir` (`lossy-stats-*.json`), sorted by name.
pub fn stats_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        Error::invalid_argument(format!("cannot read run directory {}: {e}", shown(dir)))
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("lossy-stats-") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// A run directory as an error names it: cut past [`crate::error::ECHO_CHARS`] characters (a
/// directory named on the command line can be of any length).
fn shown(dir: &Path) -> String {
    crate::error::echo(&dir.display().to_string(), str::to_string)
}

/// Adds `n` into `slot`, stopping at `u64::MAX`: a file edited by hand can hold any count.
/// `lossy report --per-step` sums the per-step files with it too.
/// Says whether it stopped there (the sum is then a lower bound).
pub fn bump(slot: &mut u64, n: u64) -> bool {
    let sum = slot.checked_add(n);
    *slot = sum.unwrap_or(u64::MAX);
    sum.is_none()
}

/// Adds `other` into `sum` as [`Counts::add`] does (each count stopping at `u64::MAX`),
/// and adds to `saturated` the name of each counter whose sum stopped there: a sum that
/// passed 2^64-1 (a file edited by hand) must not be shown as if it were the total.
fn add_counts(sum: &mut Counts, other: &Counts, saturated: &mut Vec<&'static str>) {
    let slots: [(&mut u64, u64); 7] = [
        (&mut sum.messages, other.messages),
        (&mut sum.bytes, other.bytes),
        (&mut sum.packets, other.packets),
        (&mut sum.lost_packets, other.lost_packets),
        (&mut sum.loss_events, other.loss_events),
        (&mut sum.retransmit_delay_ns, other.retransmit_delay_ns),
        (&mut sum.packets_injection_off, other.packets_injection_off),
    ];
    for ((slot, n), name) in slots.into_iter().zip(COUNTER_NAMES) {
        if let Some(value) = slot.checked_add(n) {
            *slot = value;
        } else {
            *slot = u64::MAX;
            if !saturated.contains(&name) {
                saturated.push(name);
            }
        }
    }
    // In the order of the counters, whichever passed the cap first.
    saturated.sort_by_key(|name| COUNTER_NAMES.iter().position(|n| n == name));
}

/// The counters of [`Counts`], in their order (and their names in its JSON).
pub const COUNTER_NAMES: [&str; 7] = [
    "messages",
    "bytes",
    "packets",
    "lost_packets",
    "loss_events",
    "retransmit_delay_ns",
    "packets_injection_off",
];

/// The warning of a run whose sums in `total` stopped at 2^64-1, if any did.
fn saturated_warning(total: &OpSummary) -> Option<String> {
    (!total.saturated.is_empty()).then(|| {
        format!(
            "the sum of {} passed {} and stopped at it (shown as a lower bound, `≥`; `saturated` \
             in --json and --csv): the files hold more than 64 bits can count (edited by hand?)",
            total.saturated.join(", "),
            u64::MAX
        )
    })
}

/// Sums every rank's file of one run.
pub fn summarize_run(name: &str, files: &[StatsFile]) -> RunSummary {
    let mut total = Accumulator::default();
    // Whether a sum of the bursts, latency, by_step, steps_beyond stopped at 2^64-1.
    let mut capped = [false; 4];
    let mut per_op: BTreeMap<String, Accumulator> = BTreeMap::new();
    for file in files {
        for conn in &file.connections {
            for cell in &conn.by_op {
                let acc = per_op.entry(cell.op.clone()).or_default();
                add_counts(&mut acc.counts, &cell.counts, &mut acc.saturated);
                add_counts(&mut total.counts, &cell.counts, &mut total.saturated);
            }
            for h in &conn.histograms {
                let acc = per_op.entry(h.op.clone()).or_default();
                for &(len, n) in &h.burst_lengths {
                    capped[0] |= bump(acc.bursts.entry(len).or_default(), n);
                    capped[0] |= bump(total.bursts.entry(len).or_default(), n);
                }
                for &(ns, n) in &h.latency_ns {
                    capped[1] |= bump(acc.latency_ns.entry(ns).or_default(), n);
                    capped[1] |= bump(total.latency_ns.entry(ns).or_default(), n);
                }
            }
        }
    }
    let mut by_step: BTreeMap<u64, StepCounts> = BTreeMap::new();
    for file in files {
        for step in &file.by_step {
            let acc = by_step.entry(step.step).or_insert(StepCounts {
                step: step.step,
                ..StepCounts::default()
            });
            capped[2] |= bump(&mut acc.packets, step.packets)
                | bump(&mut acc.lost_packets, step.lost_packets)
                | bump(&mut acc.packets_injection_off, step.packets_injection_off);
        }
    }
    let mut steps_beyond: Option<StepCounts> = None;
    for beyond in files.iter().filter_map(|f| f.steps_beyond.as_ref()) {
        let acc = steps_beyond.get_or_insert(StepCounts {
            step: beyond.step,
            ..StepCounts::default()
        });
        acc.step = acc.step.min(beyond.step);
        capped[3] |= bump(&mut acc.packets, beyond.packets)
            | bump(&mut acc.lost_packets, beyond.lost_packets)
            | bump(&mut acc.packets_injection_off, beyond.packets_injection_off);
    }
    let profile = files
        .first()
        .map_or(serde_json::Value::Null, |f| f.profile.clone());
    let (ranks, mut warnings) = mixed_runs(files);
    let total = total.finish("all");
    warnings.extend(saturated_warning(&total));
    let names = ["bursts", "latency_us", "by_step", "steps_beyond"];
    let capped: Vec<&str> = names
        .into_iter()
        .zip(capped)
        .filter(|c| c.1)
        .map(|c| c.0)
        .collect();
    if !capped.is_empty() {
        warnings.push(format!(
            "counts of {} passed {} and stopped at it (each such count is a lower bound): the \
             files hold more than 64 bits can count (edited by hand?)",
            capped.join(", "),
            u64::MAX
        ));
    }
    RunSummary {
        run: name.to_string(),
        ranks,
        files: files.len(),
        warnings,
        expected: expectation(&profile),
        by_rule: rule_summaries(files, &profile),
        profile,
        by_step: by_step.into_values().collect(),
        steps_beyond,
        total,
        by_op: per_op
            .into_iter()
            .map(|(op, acc)| acc.finish(&op))
            .collect(),
    }
}

/// The distinct ranks of `files`, and warnings when they look like more than one run: a
/// profile that differs between files (seed and overrides included), or a rank that several
/// processes wrote (two runs into one `NCCL_LOSSY_STATS` directory, say).
fn mixed_runs(files: &[StatsFile]) -> (usize, Vec<String>) {
    let mut warnings = Vec::new();
    let mut profiles: Vec<&serde_json::Value> = Vec::new();
    for file in files {
        if !profiles.contains(&&file.profile) {
            profiles.push(&file.profile);
        }
    }
    if profiles.len() > 1 {
        let described: Vec<String> = profiles
            .iter()
            .map(|p| {
                let origin = p.get("origin").and_then(|v| v.as_str()).unwrap_or("?");
                let overrides = p.get("overrides").and_then(|v| v.as_str()).unwrap_or("");
                let seed = p.get("seed").map_or("?".to_string(), |v| v.to_string());
                format!("{origin} (overrides `{overrides}`, seed {seed})")
            })
            .collect();
        warnings.push(format!(
            "these files come from {} different profiles and are summed as one run: {}; give \
             each run its own NCCL_LOSSY_STATS directory",
            profiles.len(),
            described.join("; ")
        ));
    }
    let mut by_rank: BTreeMap<u64, Vec<(String, u32)>> = BTreeMap::new();
    let mut unranked = 0;
    for file in files {
        match file.rank {
            Some(rank) => by_rank
                .entry(rank)
                .or_default()
                .push((file.host.clone(), file.pid)),
            None => unranked += 1,
        }
    }
    let repeated: Vec<(&u64, &Vec<(String, u32)>)> =
        by_rank.iter().filter(|(_, w)| w.len() > 1).collect();
    if let Some((first, writers)) = repeated.first() {
        let pids: Vec<String> = writers.iter().map(|(h, p)| format!("{h}:{p}")).collect();
        let all: Vec<String> = repeated.iter().map(|(r, _)| r.to_string()).collect();
        warnings.push(format!(
            "{} rank(s) are each in several files (rank {first} in {} files, from processes \
             {}; ranks {}): either several runs wrote into this directory and their counts are \
             summed, or the launcher gave several processes one rank number (one \
             SLURM_PROCID per node with a process per GPU: set RANK for each process); `ranks` \
             counts rank numbers, `files` the processes",
            repeated.len(),
            writers.len(),
            pids.join(", "),
            all.join(", ")
        ));
    }
    if let Some(missing) = missing_ranks(files, &by_rank) {
        warnings.push(missing);
    }
    (by_rank.len() + unranked, warnings)
}

/// A warning naming the ranks of the run that left no statistics file: below the number of
/// ranks the launcher started (`world_size`, the largest any file says), or, in files that do
/// not say it, below the highest rank found. A rank killed before its first write leaves none,
/// and the sums would pass for the whole run.
fn missing_ranks(
    files: &[StatsFile],
    by_rank: &BTreeMap<u64, Vec<(String, u32)>>,
) -> Option<String> {
    let world = files.iter().filter_map(|f| f.world_size).max();
    let (end, of) = match world {
        Some(world) => (world, format!("of the {world} ranks the launcher started")),
        None => {
            let highest = *by_rank.keys().next_back()?;
            (highest, format!("below the highest rank found, {highest}"))
        }
    };
    // Counted, not listed: a world of millions (a broken environment) is no list of millions.
    let shown: Vec<String> = (0..end)
        .filter(|rank| !by_rank.contains_key(rank))
        .take(16)
        .map(|r| r.to_string())
        .collect();
    if shown.is_empty() {
        return None;
    }
    let present = by_rank.keys().filter(|&&rank| rank < end).count() as u64;
    let more = (end - present).saturating_sub(shown.len() as u64);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    Some(format!(
        "no statistics file from rank {}{more} {of}: a rank stopped before it wrote its \
         statistics (they are written when its communicators close, and every \
         stats_interval) leaves none, and the sums leave its traffic out",
        shown.join(", ")
    ))
}

/// Reads and sums one run directory; a directory without statistics files is an error.
pub fn load_run(dir: &Path) -> Result<RunSummary> {
    load_run_files(dir).map(|(summary, _)| summary)
}

/// [`load_run`], with the statistics files it read.
pub fn load_run_files(dir: &Path) -> Result<(RunSummary, Vec<StatsFile>)> {
    let paths = stats_files(dir)?;
    if paths.is_empty() {
        return Err(Error::invalid_argument(format!(
            "{} holds no statistics files (lossy-stats-*.json); was NCCL_LOSSY_STATS set for the run?",
            shown(dir)
        )));
    }
    let files = paths
        .iter()
        .map(|p| StatsFile::read(p))
        .collect::<Result<Vec<_>>>()?;
    let name = dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok((summarize_run(&name, &files), files))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{ConnectionStats, MessageRecord};

    fn rank_file(lost: u64, bursts: &[u64]) -> StatsFile {
        let stats = ConnectionStats::new(1, 0);
        stats.record_message(&MessageRecord {
            op: 5,
            phase: 2,
            bytes: 4096 * 100,
            packets: 100,
            lost_packets: lost,
            loss_events: bursts.len() as u64,
            retransmit_delay_ns: 0,
            packets_injection_off: 0,
            rule: None,
        });
        stats.record_message(&MessageRecord {
            op: 4,
            phase: 0,
            bytes: 4096 * 50,
            packets: 50,
            ..Default::default()
        });
        for &b in bursts {
            stats.record_burst(5, b);
        }
        stats.record_latency_ns(5, 10_000);
        stats.record_latency_ns(5, 20_000);
        StatsFile::new(serde_json::json!({"seed": 3}), vec![stats.snapshot()])
    }

    #[test]
    fn ranks_sum_per_collective_and_in_total() {
        let run = summarize_run("r", &[rank_file(3, &[1, 2]), rank_file(4, &[4])]);
        assert_eq!(run.ranks, 2);
        assert_eq!(run.total.counts.packets, 300);
        assert_eq!(run.total.counts.lost_packets, 7);
        let allreduce = run
            .by_op
            .iter()
            .find(|o| o.op == "AllReduce")
            .expect("AllReduce row");
        assert_eq!(allreduce.counts.packets, 200);
        assert!((allreduce.loss_rate - 7.0 / 200.0).abs() < 1e-12);
        // Bursts 1, 2 and 4: mean 7/3.
        assert!((allreduce.mean_burst.expect("bursts") - 7.0 / 3.0).abs() < 1e-12);
        let reduce_scatter = run
            .by_op
            .iter()
            .find(|o| o.op == "ReduceScatter")
            .expect("row");
        assert_eq!(reduce_scatter.counts.lost_packets, 0);
        assert_eq!(reduce_scatter.mean_burst, None);
        let [p50, _, p99] = allreduce.latency_us.expect("latency");
        assert!((9.9..=10.1).contains(&p50), "{p50}");
        assert!((19.8..=20.2).contains(&p99), "{p99}");
    }

    #[test]
    fn ranks_missing_from_the_world_are_listed_up_to_16_and_counted_past_that() {
        let mut files = vec![rank_file(0, &[]), rank_file(0, &[])];
        files[0].rank = Some(0);
        files[1].rank = Some(2);
        let said = |files: &[StatsFile]| summarize_run("r", files).warnings.join("\n");
        assert!(
            said(&files).contains("no statistics file from rank 1 below the highest rank found, 2"),
            "{}",
            said(&files)
        );
        // A size no launcher gives (a broken environment): counted, not listed one by one.
        files[1].world_size = Some(u64::MAX);
        let text = said(&files);
        let more = u64::MAX - 2 - 16;
        assert!(
            text.contains(&format!(
                "rank 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17 and {more} more of the {} ranks",
                u64::MAX
            )),
            "{text}"
        );
    }

    #[test]
    fn steps_sum_over_ranks_and_the_expectation_comes_from_the_profile() {
        let mut a = rank_file(0, &[]);
        a.by_step = vec![
            StepCounts {
                step: 1,
                packets: 10,
                lost_packets: 1,
                packets_injection_off: 0,
            },
            StepCounts {
                step: 2,
                packets: 10,
                lost_packets: 0,
                packets_injection_off: 0,
            },
        ];
        a.profile = serde_json::json!({"expected": {"loss_rate": 0.01, "mean_burst": 8.0}});
        let mut b = rank_file(0, &[]);
        b.by_step = vec![StepCounts {
            step: 2,
            packets: 5,
            lost_packets: 5,
            packets_injection_off: 0,
        }];
        let run = summarize_run("r", &[a, b]);
        assert_eq!(
            run.by_step,
            vec![
                StepCounts {
                    step: 1,
                    packets: 10,
                    lost_packets: 1,
                    packets_injection_off: 0,
                },
                StepCounts {
                    step: 2,
                    packets: 15,
                    lost_packets: 5,
                    packets_injection_off: 0,
                },
            ]
        );
        assert_eq!(
            run.expected,
            Some(ModelExpectation {
                loss_rate: 0.01,
                mean_burst: 8.0
            })
        );
        assert_eq!(summarize_run("r", &[rank_file(0, &[])]).expected, None);
    }

    #[test]
    fn sums_saturate_instead_of_wrapping() {
        // Files edited by hand (or corrupted) can hold any u64: the report must not wrap.
        let huge = |mut f: StatsFile| {
            for cell in &mut f.connections[0].by_op {
                cell.counts.packets = u64::MAX - 1;
            }
            for h in &mut f.connections[0].histograms {
                h.burst_lengths = vec![(u64::MAX, 1)];
                h.latency_ns = vec![(5, u64::MAX)];
            }
            f
        };
        let run = summarize_run("r", &[huge(rank_file(1, &[1])), huge(rank_file(1, &[1]))]);
        assert_eq!(run.total.counts.packets, u64::MAX);
        let allreduce = run.by_op.iter().find(|o| o.op == "AllReduce").expect("row");
        assert_eq!(allreduce.counts.packets, u64::MAX);
        // Two bursts of 2^64 - 1 packets: the mean is that length, not a wrapped product.
        assert_eq!(allreduce.mean_burst, Some(u64::MAX as f64));
        assert_eq!(allreduce.latency_us.map(|p| p[0]), Some(0.005));
    }

    #[test]
    fn percentiles_follow_the_cumulative_counts() {
        let bins: BTreeMap<u64, u64> = [(1, 50), (2, 40), (10, 10)].into_iter().collect();
        assert_eq!(percentiles(&bins, [0.5, 0.9, 0.99]), Some([1, 2, 10]));
        assert_eq!(percentiles(&BTreeMap::new(), [0.5, 0.9, 0.99]), None);
    }
}
