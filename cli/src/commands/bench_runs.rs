//! `lossy bench --runs N`: the whole measurement repeated with new worker processes and new
//! connections, the links' order rotated from run to run, and summarized in one table: each link's
//! p50 as the median over the runs, and each link's p50 over the plugin's as the median over
//! the runs with its range. One run's rows can sit a few percent apart for the life of its
//! connections (a TCP connection keeps the pace its congestion control found), where the
//! median of several runs does not; the range says how far a single run could have misled.

use std::path::{Path, PathBuf};

use crate::harness::cluster::run_ranks;
use crate::harness::launch::Launch;
use crate::harness::worker::{Job, LinkKind, RunSpec, Task, WorkerReport};
use nccl_net_lossy::{Error, Result};

use super::bench::{percentile, slowest_samples, Args, Check};
use super::sizes::fmt_bytes;

/// Most runs `--runs` takes.
pub const MAX_RUNS: usize = 1000;

/// What the repeated runs share.
pub(super) struct Plan<'a> {
    pub args: &'a Args,
    pub job: Job,
    /// The links, in the table's order (the plugin, raw TCP, then the compared ones).
    pub links: Vec<LinkKind>,
    /// Their names in the table.
    pub names: Vec<String>,
    pub specs: Vec<RunSpec>,
    pub library: &'a Path,
    pub peers: &'a [PathBuf],
    pub corrupts_data: bool,
    pub chunk: usize,
}

/// The median, lowest and highest of `values` (not empty).
pub fn median_and_range(values: &[f64]) -> (f64, f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

/// Where the result of link `kind` is among the `n` results of one size, from `first` on:
/// each result names its link (a worker runs a size's links in the run's order), so a
/// rotation never pairs one link's times with another's name. `usize::MAX` (no result) when
/// it is missing.
fn result_index(reports: &[WorkerReport], first: usize, n: usize, kind: LinkKind) -> usize {
    reports
        .first()
        .and_then(|r| r.results.get(first..first + n))
        .and_then(|size| size.iter().position(|x| x.link == kind))
        .map_or(usize::MAX, |j| first + j)
}

/// What one run gave.
struct Run {
    /// The p50 (seconds) of each link at each size, in the table's link order.
    p50: Vec<Vec<f64>>,
    /// How each size's data came through.
    checks: Vec<Check>,
    reports: Vec<WorkerReport>,
}

fn one_run(plan: &Plan<'_>, run: usize) -> Result<Run> {
    let n = plan.links.len();
    // Each run rotates the links' order (the order their turns take within an iteration).
    let turns: Vec<LinkKind> = (0..n).map(|k| plan.links[(k + run) % n]).collect();
    let mut job = plan.job.clone();
    job.task = Task::Collectives {
        links: turns.clone(),
        runs: plan.specs.clone(),
    };
    let launch = Launch::new(plan.args.ranks, job)?;
    let Some(ranks) = run_ranks(&plan.args.cluster, "bench", &launch)? else {
        return Err(Error::internal("--runs: the ranks reported nothing"));
    };
    let reports = ranks.reports;
    let mut p50s = Vec::with_capacity(plan.specs.len());
    let mut checks = Vec::with_capacity(plan.specs.len());
    for i in 0..plan.specs.len() {
        let index = |kind: LinkKind| result_index(&reports, n * i, n, kind);
        p50s.push(
            plan.links
                .iter()
                .map(|&kind| percentile(&slowest_samples(&reports, index(kind)), 50.0))
                .collect(),
        );
        let exact = |kind: LinkKind| {
            reports
                .iter()
                .all(|r| r.results.get(index(kind)).is_some_and(|x| x.ok))
        };
        // Damage is judged on the lossy plugin link only; the others must be bit-exact.
        checks.push(if plan.links[1..].iter().all(|&k| exact(k)) {
            Check::of(exact(LinkKind::Plugin), plan.corrupts_data)
        } else {
            Check::Wrong
        });
    }
    Ok(Run {
        p50: p50s,
        checks,
        reports,
    })
}

/// Runs the measurement `args.runs` times and prints the summary table.
pub(super) fn many(plan: &Plan<'_>) -> Result<()> {
    let runs = plan.args.runs;
    let (sizes, links) = (plan.specs.len(), plan.links.len());
    // p50[size][link][run], seconds.
    let mut p50 = vec![vec![Vec::with_capacity(runs); links]; sizes];
    let mut checks = vec![Check::Exact; sizes];
    let mut first: Option<Vec<WorkerReport>> = None;
    for run in 0..runs {
        let Run {
            p50: p,
            checks: c,
            reports,
        } = one_run(plan, run)?;
        for i in 0..sizes {
            let mut line = format!("# run {} of {runs}: {} B:", run + 1, plan.specs[i].bytes);
            for (k, name) in plan.names.iter().enumerate() {
                p50[i][k].push(p[i][k]);
                line += &format!(
                    "{} {name} {:.1} us",
                    if k == 0 { "" } else { "," },
                    p[i][k] * 1e6
                );
            }
            eprintln!("{line}");
            checks[i] = match (checks[i], c[i]) {
                (Check::Wrong, _) | (_, Check::Wrong) => Check::Wrong,
                (Check::Damaged, _) | (_, Check::Damaged) => Check::Damaged,
                _ => Check::Exact,
            };
        }
        first.get_or_insert(reports);
    }
    let reports = first.unwrap_or_default();
    let mut out = String::new();
    let mut say = |line: String| {
        out.push_str(&line);
        out.push('\n');
    };
    let dtype = plan.specs.first().map(|s| s.dtype);
    say(format!(
        "# all_reduce, {} ranks, {}, chunk {}, loss {}",
        reports.len(),
        dtype.map_or("?".to_string(), |d| d.to_string()),
        fmt_bytes(plan.chunk),
        if plan.args.lossless {
            "off"
        } else {
            "as profiled"
        }
    ));
    let peer_names = &plan.names[plan.names.len() - plan.peers.len()..];
    say(
        super::bench::library_lines(&reports, plan.library, plan.peers, peer_names)
            .trim_end()
            .to_string(),
    );
    say(format!(
        "# TCP congestion control on this host: {}",
        super::bench::congestion_control()
    ));
    say(format!(
        "# {runs} runs, each with new worker processes and connections, the links' order \
         rotated from run to run; per size: each link's p50 (us, slowest rank per iteration) as the \
         median over the runs, then each link's p50 over the plugin's, per run: the median \
         (lowest-highest) over the runs; above 100%: the plugin is faster"
    ));
    let mut head = format!("# {:>10} {:>10} {:>5}", "size", "count", "iters");
    for name in &plan.names {
        head += &format!(" | {:>10}", format!("{name} p50"));
    }
    for name in &plan.names[1..] {
        head += &format!(" | {:>22}", format!("{name}/plugin"));
    }
    say(head + &format!(" | {:>5}", "check"));
    let mut all_ok = true;
    for (i, spec) in plan.specs.iter().enumerate() {
        let mut row = format!(
            "  {:>10} {:>10} {:>5}",
            spec.bytes,
            spec.bytes / spec.dtype.size(),
            spec.iters
        );
        for link in &p50[i] {
            row += &format!(" | {:>10.1}", median_and_range(link).0 * 1e6);
        }
        for k in 1..links {
            let ratios: Vec<f64> = p50[i][0]
                .iter()
                .zip(&p50[i][k])
                .map(|(&plugin, &other)| 100.0 * other / plugin.max(1e-12))
                .collect();
            let (m, lo, hi) = median_and_range(&ratios);
            row += &format!(" | {:>22}", format!("{m:.1}% ({lo:.1}-{hi:.1}%)"));
        }
        all_ok &= checks[i].passed();
        row += &format!(
            " | {:>5}",
            match checks[i] {
                Check::Exact => "ok",
                Check::Damaged => "dmg",
                Check::Wrong => "WRONG",
            }
        );
        say(row);
    }
    if plan.corrupts_data {
        say("# dmg: the profile's effect changed data, as it is meant to".to_string());
    }
    super::write_stdout(&out).map_err(|e| Error::system(format!("cannot write the table: {e}")))?;
    if all_ok {
        Ok(())
    } else {
        Err(Error::remote("some results were not bit-exact"))
    }
}

#[cfg(test)]
mod tests {
    use super::{median_and_range, result_index};
    use crate::harness::worker::{LinkKind, WorkerReport};

    /// A rank's report of `sizes` sizes, each with the links in `order` (as a worker runs a
    /// rotated run), every result's time its link's position in `order` plus 10 x size.
    fn report(order: &[LinkKind], sizes: usize) -> WorkerReport {
        let results: Vec<serde_json::Value> = (0..sizes)
            .flat_map(|i| {
                order.iter().enumerate().map(move |(j, kind)| {
                    serde_json::json!({
                        "link": kind, "collective": "all_reduce", "dtype": "f32", "bytes": 8,
                        "iters": 1, "seconds": (10 * i + j) as f64, "ok": true, "mismatches": 0,
                    })
                })
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "rank": 0, "plugin": "p", "version": 12, "results": results, "groups_checked": 0,
        }))
        .expect("a worker report")
    }

    #[test]
    fn a_rotated_runs_results_are_found_by_their_link_not_their_place() {
        let order = [LinkKind::Peer(0), LinkKind::Plugin, LinkKind::RawTcp];
        let reports = [report(&order, 2)];
        let n = order.len();
        for i in 0..2 {
            for (j, &kind) in order.iter().enumerate() {
                let at = result_index(&reports, n * i, n, kind);
                assert_eq!(reports[0].results[at].link, kind);
                assert_eq!(reports[0].results[at].seconds, (10 * i + j) as f64);
            }
        }
        assert_eq!(
            result_index(&reports, 0, n, LinkKind::PluginLossless),
            usize::MAX
        );
    }

    #[test]
    fn the_median_of_an_odd_count_is_the_middle_one_and_of_an_even_count_the_mean_of_two() {
        assert_eq!(median_and_range(&[3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(median_and_range(&[4.0, 1.0, 3.0, 2.0]), (2.5, 1.0, 4.0));
        assert_eq!(median_and_range(&[7.0]), (7.0, 7.0, 7.0));
    }
}
