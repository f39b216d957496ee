//! `lossy bench --runs N`: the whole measurement repeated with new worker processes and
//! connections each time, summarized as the median over runs, with each ratio's range, and
//! each ratio's geometric mean with its 95% confidence interval.

mod common;

use std::process::Command;

use common::lossy_exe;

/// Runs `lossy bench args` (lo, the uniform 1% profile); asserts it succeeded and returns its
/// stdout and stderr.
fn bench(args: &[&str]) -> (String, String) {
    let out = Command::new(lossy_exe())
        .arg("bench")
        .args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_LOSSY_PROFILE", "configs/uniform-1pct.toml")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_NSOCKS")
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run lossy bench");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "lossy bench {args:?} failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The numbers of a `|`-separated cell: `100.4% (95.1-106.2%)` gives 100.4, 95.1, 106.2.
fn numbers(cell: &str) -> Vec<f64> {
    cell.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().expect("a number"))
        .collect()
}

#[test]
fn runs_3_prints_each_links_median_p50_and_each_ratios_median_range_mean_and_interval() {
    // A copy at another path: the same path would be the plugin's own `dlopen` handle.
    let dir = common::fresh_dir("bench-runs");
    let peer = common::library_copy(&dir, "libnccl-net-peer.so");
    let (out, err) = bench(&[
        "--runs",
        "3",
        "--sizes",
        "8,4K",
        "--iters",
        "20",
        "--lossless",
        "--vs-library",
        &peer,
    ]);
    assert!(out.contains("# 3 runs"), "{out}");
    // Each run's p50 per size and link, as stderr reports it while the runs go:
    // `# run R of 3: SIZE B: plugin P us, raw Q us, peer S us`.
    let mut per_run: std::collections::BTreeMap<usize, Vec<[f64; 3]>> = Default::default();
    for line in err.lines().filter(|l| l.starts_with("# run ")) {
        let (_, rest) = line.split_once(": ").expect("run prefix");
        let (size, links) = rest.split_once(" B: ").expect("size");
        let v = numbers(links);
        assert_eq!(v.len(), 3, "{line}");
        per_run
            .entry(size.parse().expect("size"))
            .or_default()
            .push([v[0], v[1], v[2]]);
    }
    assert_eq!(
        per_run.keys().copied().collect::<Vec<_>>(),
        [8, 4096],
        "{err}"
    );
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    for row in rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // size count iters | plugin | raw | peer | raw/plugin | peer/plugin | raw mean |
        // peer mean | check
        assert_eq!(cells.len(), 9, "{row}");
        let size = numbers(cells[0])[0] as usize;
        let runs = &per_run[&size];
        assert_eq!(runs.len(), 3, "{size} B ran {} times: {err}", runs.len());
        // Printed with one decimal: a median within 0.05 us (or 0.05%) of the one computed.
        let close = |printed: f64, want: f64, what: &str| {
            assert!(
                (printed - want).abs() <= 0.051,
                "{size} B {what}: printed {printed}, the runs give {want:.3}\n{out}\n{err}"
            );
        };
        for (k, name) in ["plugin", "raw", "peer"].iter().enumerate() {
            let mut p50s: Vec<f64> = runs.iter().map(|r| r[k]).collect();
            close(numbers(cells[1 + k])[0], median(&mut p50s), name);
        }
        for (k, name) in [(1, "raw/plugin"), (2, "peer/plugin")] {
            // Each run's ratio from its printed p50s (rounded to 0.1 us), so allow for that.
            let mut ratios: Vec<f64> = runs.iter().map(|r| 100.0 * r[k] / r[0]).collect();
            let v = numbers(cells[3 + k]);
            assert_eq!(v.len(), 3, "{row}");
            let (lo, hi) = (
                ratios.iter().copied().fold(f64::MAX, f64::min),
                ratios.iter().copied().fold(f64::MIN, f64::max),
            );
            let slack =
                |want: f64| 0.051 + want * 0.1 / runs.iter().map(|r| r[0]).fold(f64::MAX, f64::min);
            let m = median(&mut ratios);
            for (printed, want, what) in [
                (v[0], m, "median"),
                (v[1], lo, "lowest"),
                (v[2], hi, "highest"),
            ] {
                assert!(
                    (printed - want).abs() <= slack(want),
                    "{size} B {name} {what}: printed {printed}%, the runs give {want:.3}%\n{out}\n{err}"
                );
            }
            assert!(v[1] <= v[0] && v[0] <= v[2], "{row}");
            // The geometric mean of the ratios and its 95% interval: Student's t with 2
            // degrees of freedom (4.3027) over the runs' log ratios. Each printed p50 is off
            // by up to 0.05 us, so each log ratio by up to d = 0.1 us / the least p50; the
            // mean moves by at most d, the standard deviation by at most d * sqrt(3/2), so a
            // bound by at most d * (1 + 4.3027 / sqrt(2)) < 4.05 d of its value. (With 1.96,
            // the normal quantile, in its place, the interval is less than half as wide.)
            let logs: Vec<f64> = runs.iter().map(|r| (r[k] / r[0]).ln()).collect();
            let mean = logs.iter().sum::<f64>() / 3.0;
            let sd = (logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
            let half = 4.3027 * sd / 3f64.sqrt();
            let d = 0.1
                / runs
                    .iter()
                    .flat_map(|r| [r[0], r[k]])
                    .fold(f64::MAX, f64::min);
            let v = numbers(cells[5 + k]);
            assert_eq!(v.len(), 3, "{row}");
            for (printed, want, what) in [
                (v[0], 100.0 * mean.exp(), "mean"),
                (v[1], 100.0 * (mean - half).exp(), "interval's low end"),
                (v[2], 100.0 * (mean + half).exp(), "interval's high end"),
            ] {
                assert!(
                    (printed - want).abs() <= 0.051 + want * 4.05 * d,
                    "{size} B {name} {what}: printed {printed}%, the runs give {want:.3}%\n{out}\n{err}"
                );
            }
        }
        assert_eq!(cells[8], "ok", "{row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
