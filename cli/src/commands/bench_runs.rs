//! `lossy bench --runs N`: the whole measurement repeated with new worker processes and new
//! connections, the links' order rotated from run to run, and summarized in one table: each link's
//! p50 as the median over the runs, and each link's p50 over the plugin's as the median over
//! the runs with its range, and as the geometric mean with its 95% confidence interval. One
//! run's rows can sit a few percent apart for the life of its connections (a TCP connection
//! keeps the pace its congestion control found), where the median of several runs does not;
//! the range says how far a single run could have misled, and the interval whether the runs
//! tell the two links apart at all.

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

/// Student's t two-sided 95% quantiles for 1 to 30 degrees of freedom.
const T95: [f64; 30] = [
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010,
    2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687,
    2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
];

/// The two-sided 95% quantile of Student's t with `df` (at least 1) degrees of freedom: the
/// table up to 30, beyond it the normal quantile with the first two terms of its
/// Cornish-Fisher correction (within 0.0002 of the exact value from 31 on).
fn t95(df: usize) -> f64 {
    if let Some(&t) = T95.get(df.max(1) - 1) {
        return t;
    }
    let (z, n): (f64, f64) = (1.959_964, df as f64);
    let g1 = (z.powi(3) + z) / 4.0;
    let g2 = (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / 96.0;
    z + g1 / n + g2 / (n * n)
}

/// The geometric mean of `ratios` and its 95% confidence interval: Student's t over their
/// logarithms, as the runs are independent (new processes and connections each) and a
/// ratio's two links ran side by side in each. `None` under two ratios, or with one not
/// finite and above 0.
pub fn mean_and_interval(ratios: &[f64]) -> Option<(f64, f64, f64)> {
    let n = ratios.len();
    if n < 2 || ratios.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
        return None;
    }
    let logs: Vec<f64> = ratios.iter().map(|r| r.ln()).collect();
    let mean = logs.iter().sum::<f64>() / n as f64;
    let var = logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half = t95(n - 1) * (var / n as f64).sqrt();
    Some((mean.exp(), (mean - half).exp(), (mean + half).exp()))
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
         (lowest-highest) over the runs, and their geometric mean (95% confidence interval, \
         Student's t over the runs' log ratios: an interval that leaves out 100% is a \
         difference the runs resolve); above 100%: the plugin is faster"
    ));
    let mut head = format!("# {:>10} {:>10} {:>5}", "size", "count", "iters");
    for name in &plan.names {
        head += &format!(" | {:>10}", format!("{name} p50"));
    }
    for name in &plan.names[1..] {
        head += &format!(" | {:>22}", format!("{name}/plugin"));
    }
    for name in &plan.names[1..] {
        head += &format!(" | {:>22}", format!("{name} mean (95%)"));
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
        let ratios: Vec<Vec<f64>> = (1..links)
            .map(|k| {
                p50[i][0]
                    .iter()
                    .zip(&p50[i][k])
                    .map(|(&plugin, &other)| 100.0 * other / plugin.max(1e-12))
                    .collect()
            })
            .collect();
        for r in &ratios {
            let (m, lo, hi) = median_and_range(r);
            row += &format!(" | {:>22}", format!("{m:.1}% ({lo:.1}-{hi:.1}%)"));
        }
        for r in &ratios {
            let cell = mean_and_interval(r).map_or("-".to_string(), |(m, lo, hi)| {
                format!("{m:.1}% ({lo:.1}-{hi:.1}%)")
            });
            row += &format!(" | {cell:>22}");
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
    use super::{mean_and_interval, median_and_range, result_index, t95};
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

    #[test]
    fn the_interval_is_students_t_over_the_log_ratios_around_their_geometric_mean() {
        // Logs 0, ln 1.1, 2 ln 1.1: mean ln 1.1 (110%), standard deviation ln 1.1, and with
        // t(2) = 4.3027 the interval 110% / 1.1^2.4842 to 110% x 1.1^2.4842 (by hand:
        // 86.810% to 139.386%).
        let (m, lo, hi) = mean_and_interval(&[100.0, 110.0, 121.0]).expect("three ratios");
        for (got, want) in [(m, 110.0), (lo, 86.810), (hi, 139.386)] {
            assert!((got - want).abs() < 0.002, "{got} against {want}");
        }
        // Equal ratios: no spread, no width.
        assert_eq!(mean_and_interval(&[95.0; 4]), Some((95.0, 95.0, 95.0)));
        assert_eq!(mean_and_interval(&[100.0]), None);
        assert_eq!(mean_and_interval(&[100.0, 0.0]), None);
        assert_eq!(mean_and_interval(&[100.0, f64::INFINITY]), None);
    }

    #[test]
    fn t_quantiles_follow_the_table_and_then_the_expansion() {
        assert_eq!(t95(1), 12.7062);
        assert_eq!(t95(30), 2.0423);
        // Exact values: 2.0395 (31), 2.0211 (40), 1.9799 (120), 1.9623 (1000).
        for (df, exact) in [(31, 2.0395), (40, 2.0211), (120, 1.9799), (1000, 1.9623)] {
            assert!((t95(df) - exact).abs() < 2e-4, "t95({df}) = {}", t95(df));
        }
    }
}
