//! `lossy bench` as a user runs it: the small-size sweep, the latency percentiles, channels
//! (`--comms`) and the raw-TCP baseline's stream count, each in real worker processes.

mod common;

use std::path::Path;
use std::process::Command;

use common::lossy_exe;

/// Runs `lossy args` with `env` added; asserts it succeeded and returns its stdout.
fn bench(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(lossy_exe())
        .arg("bench")
        .args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_NSOCKS")
        .envs(env.iter().copied())
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run lossy bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "lossy bench {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// One table row: `size count iters | avg p50 p99 algbw busbw | (raw, same) | ratio | check`.
struct Row {
    size: usize,
    iters: usize,
    /// avg, p50, p99 in microseconds, then algbw and busbw.
    plugin: [f64; 5],
    raw: [f64; 5],
    check: String,
}

fn numbers(group: &str) -> Vec<f64> {
    group
        .split_whitespace()
        .map(|w| {
            w.trim_end_matches('%')
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("`{w}` in `{group}` is not a number"))
        })
        .collect()
}

fn rows(out: &str) -> Vec<Row> {
    out.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let groups: Vec<&str> = l.split('|').collect();
            assert!(groups.len() >= 5, "row `{l}`");
            let head = numbers(groups[0]);
            let five = |g: &str| -> [f64; 5] {
                numbers(g)
                    .try_into()
                    .unwrap_or_else(|v| panic!("five numbers in `{g}`: {v:?}"))
            };
            Row {
                size: head[0] as usize,
                iters: head[2] as usize,
                plugin: five(groups[1]),
                raw: five(groups[2]),
                check: groups[groups.len() - 1].trim().to_string(),
            }
        })
        .collect()
}

#[test]
fn small_sweep_is_8_bytes_to_1_mib_doubling_and_every_size_is_bit_exact() {
    let out = bench(&["--sizes", "small", "--iters", "2", "--lossless"], &[]);
    let rows = rows(&out);
    let sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    let want: Vec<usize> = (3..=20).map(|k| 1usize << k).collect();
    assert_eq!(sizes, want, "{out}");
    assert!(rows.iter().all(|r| r.check == "ok"), "{out}");
    assert!(rows.iter().all(|r| r.iters == 2), "{out}");
}

#[test]
fn small_sizes_get_more_iterations_and_complete_bit_exact() {
    let out = bench(&["--sizes", "8,4K,4M", "--lossless"], &[]);
    let rows = rows(&out);
    assert_eq!(
        rows.iter().map(|r| r.size).collect::<Vec<_>>(),
        [8, 4096, 4 << 20],
        "{out}"
    );
    assert!(rows.iter().all(|r| r.check == "ok"), "{out}");
    assert!(rows[0].iters >= rows[2].iters * 10, "{out}");
    assert!(rows[1].iters >= rows[2].iters * 10, "{out}");
}

#[test]
fn sizes_below_one_element_round_up_to_one_element() {
    let out = bench(&["--sizes", "1,6", "--iters", "2", "--lossless"], &[]);
    let rows = rows(&out);
    assert_eq!(
        rows.iter().map(|r| r.size).collect::<Vec<_>>(),
        [4, 4],
        "{out}"
    );
    assert!(rows.iter().all(|r| r.check == "ok"), "{out}");
}

#[test]
fn every_row_has_p50_at_most_p99_for_plugin_and_raw() {
    let out = bench(&["--sizes", "8,64K", "--iters", "20", "--lossless"], &[]);
    assert!(out.contains("p50") && out.contains("p99"), "{out}");
    let rows = rows(&out);
    assert_eq!(rows.len(), 2, "{out}");
    for r in &rows {
        for side in [r.plugin, r.raw] {
            let [avg, p50, p99, _, _] = side;
            assert!(p50 > 0.0 && p50 <= p99, "{out}");
            assert!(
                avg <= p99 * 1.0001,
                "the mean is at most the maximum: {out}"
            );
        }
    }
}

/// Send connections of the bench's plugin link with messages, per rank file in `dir`.
fn busy_send_connections(dir: &Path) -> Vec<usize> {
    let mut per_rank = Vec::new();
    for entry in std::fs::read_dir(dir).expect("statistics directory") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read statistics"))
                .expect("statistics are JSON");
        let conns = doc["connections"].as_array().expect("connections");
        per_rank.push(
            conns
                .iter()
                .filter(|c| c["total"]["messages"].as_u64().unwrap_or(0) > 0)
                .count(),
        );
    }
    per_rank.sort_unstable();
    per_rank
}

#[test]
fn comms_4_spreads_the_collective_over_4_send_comms_per_rank_bit_exact() {
    let stats = common::fresh_dir("bench-comms");
    let stats_s = stats.display().to_string();
    let out = bench(
        // Three ranks: float sums then depend on each channel's own ring order, which the
        // check reproduces.
        &[
            "--ranks",
            "3",
            "--sizes",
            "8,4K,1M",
            "--iters",
            "3",
            "--comms",
            "4",
            "--lossless",
        ],
        &[("NCCL_LOSSY_STATS", &stats_s)],
    );
    let rows = rows(&out);
    assert_eq!(rows.len(), 3, "{out}");
    assert!(rows.iter().all(|r| r.check == "ok"), "{out}");
    assert!(out.contains("# plugin: 4 send comms per rank"), "{out}");
    // The plugin's own statistics: one connection per send comm, every one carried data.
    assert_eq!(busy_send_connections(&stats), [4, 4, 4], "{out}");
    let _ = std::fs::remove_dir_all(&stats);
}

#[test]
fn raw_baseline_opens_as_many_streams_as_the_plugin_per_comm() {
    let out = bench(
        &[
            "--sizes",
            "64K",
            "--iters",
            "2",
            "--comms",
            "2",
            "--lossless",
        ],
        &[("NCCL_LOSSY_NSOCKS", "3")],
    );
    assert!(
        out.contains("# raw TCP: 2 comms x 3 streams per rank, inline non-blocking"),
        "{out}"
    );
    assert!(rows(&out).iter().all(|r| r.check == "ok"), "{out}");
}

/// TCP's congestion control decides how the kernel paces every connection the table times
/// (BBR paces each one at its own estimate, docs/calibration.md), so the header names the one
/// this host runs, as the kernel reports it.
#[test]
fn the_header_names_the_hosts_tcp_congestion_control() {
    let out = bench(&["--sizes", "8", "--iters", "2", "--lossless"], &[]);
    let line = match std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control") {
        Ok(cc) => format!("# TCP congestion control on this host: {}", cc.trim()),
        Err(_) => "# TCP congestion control on this host: unknown".to_string(),
    };
    assert!(
        out.lines().any(|l| l.starts_with(&line)),
        "no line starting {line:?} in:\n{out}"
    );
}

/// The numbers of the `n`-th `|`-separated group of a table row.
fn group(line: &str, n: usize) -> Vec<f64> {
    numbers(
        line.split('|')
            .nth(n)
            .unwrap_or_else(|| panic!("group {n} of `{line}`")),
    )
}

/// Group `n` of a table row is a peer's: five columns and its time over the plugin's (group
/// 1), in percent; the row is bit-exact.
fn assert_peer_columns(line: &str, n: usize) {
    let plugin = group(line, 1);
    let peer = group(line, n);
    assert_eq!(peer.len(), 6, "{line}");
    assert!(peer[1] > 0.0 && peer[1] <= peer[2], "{line}");
    let want = 100.0 * peer[0] / plugin[0];
    // Both means are printed to 0.1 us and the ratio to 1%: at 10 us and more the
    // rounding moves the ratio by well under 2 points.
    assert!((peer[5] - want).abs() < 2.0, "{line}: want {want:.1}%");
    assert!(line.trim_end().ends_with("ok"), "{line}");
}

/// `lossy bench` over 8 B and 64 KiB with each of `peers` as a `--vs-library`, loss switched
/// off under a profile that zeroes lost packets (so a peer left lossy would deliver damaged
/// data and the table would say WRONG): the output and its two table rows.
fn bench_with_peers(peers: &[String]) -> (String, Vec<String>) {
    let mut args = vec!["--sizes", "8,64K", "--iters", "20", "--lossless"];
    for peer in peers {
        args.extend(["--vs-library", peer.as_str()]);
    }
    let out = bench(
        &args,
        &[("NCCL_LOSSY_PROFILE", "configs/uniform-1pct.toml")],
    );
    let lines: Vec<String> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    (out, lines)
}

#[test]
fn vs_library_given_twice_times_both_libraries_in_the_same_run() {
    // Two copies of our library at two paths: two independent `dlopen`s besides the plugin's
    // (the build before a change and NCCL's transport, in real use).
    let dir = common::fresh_dir("bench-peers");
    let copies: Vec<String> = ["a", "b"]
        .iter()
        .map(|c| common::library_copy(&dir, &format!("libnccl-net-peer{c}.so")))
        .collect();
    let (out, lines) = bench_with_peers(&copies);
    // Each name comes from its own link's `init`: both copies were driven, in order.
    for (i, copy) in copies.iter().enumerate() {
        let name = format!("peer{}", i + 1);
        assert!(
            out.contains(&format!("# {name} lossy from {copy}")),
            "{out}"
        );
        assert!(out.contains(&format!("{name} us")), "{out}");
    }
    for line in &lines {
        assert_peer_columns(line, 4);
        assert_peer_columns(line, 5);
    }
}

#[test]
fn vs_library_times_a_second_library_in_the_same_processes_with_its_ratio() {
    // A copy of our library at another path: a second, independent `dlopen` (a library opened
    // twice from one path would be one instance).
    let dir = common::fresh_dir("bench-peer");
    let copy_s = common::library_copy(&dir, "libnccl-net-peercopy.so");
    // `--lossless` must switch the other build off too.
    let (out, lines) = bench_with_peers(std::slice::from_ref(&copy_s));
    // The name comes from the peer link's own `init`, so the copy really was driven.
    assert!(
        out.contains(&format!("# peer lossy from {copy_s}")),
        "{out}"
    );
    assert!(out.contains("peer us"), "{out}");
    for line in &lines {
        assert_peer_columns(line, 4);
    }
    let missing = dir.join("libnccl-net-missing.so").display().to_string();
    let err = Command::new(lossy_exe())
        .args(["bench", "--sizes", "8", "--vs-library", &missing])
        .output()
        .expect("run lossy bench");
    assert!(!err.status.success());
    let stderr = String::from_utf8_lossy(&err.stderr);
    assert!(
        stderr.contains(&missing) && stderr.contains("does not exist"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `lossy bench args`, which must fail at once with an error on stderr (no rank started).
fn bench_refused(args: &[&str]) -> String {
    // Bounded: a limit that stopped working would start ranks (and hang or exhaust memory).
    let out = common::output_within_10s(
        Command::new(lossy_exe())
            .arg("bench")
            .args(args)
            .env("NCCL_SOCKET_IFNAME", "lo")
            .env_remove("NCCL_LOSSY_STATS"),
        "lossy bench",
    );
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "lossy bench {args:?}: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("rank"),
        "lossy bench {args:?} started ranks or panicked: {stderr}"
    );
    // No table either: the ranks never ran.
    assert!(
        out.stdout.is_empty(),
        "lossy bench {args:?} printed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

#[test]
fn sizes_chunks_and_iterations_beyond_the_limits_are_refused_before_any_rank_starts() {
    for sizes in ["18446744073709551615", "4G", "64K,2G"] {
        let e = bench_refused(&["--sizes", sizes, "--iters", "1"]);
        assert!(e.contains("bad size") && e.contains("at most 1 GiB"), "{e}");
    }
    let e = bench_refused(&["--sizes", "64K", "--chunk", "1099511627776"]);
    assert!(e.contains("bad size") && e.contains("at most 1 GiB"), "{e}");
    let e = bench_refused(&["--sizes", "64K", "--iters", "18446744073709551615"]);
    assert!(
        e.contains("--iters") && e.contains("at most 1000000"),
        "{e}"
    );
    for runs in ["0", "1001"] {
        let e = bench_refused(&["--sizes", "64K", "--runs", runs]);
        assert!(
            e.contains(&format!("--runs {runs}")) && e.contains("at least 1 and at most 1000"),
            "{e}"
        );
    }
    // One samples file per run would overwrite itself; the runs' medians are the table.
    let e = bench_refused(&["--sizes", "64K", "--runs", "2", "--samples", "/tmp/x.csv"]);
    assert!(e.contains("--samples") && e.contains("--runs"), "{e}");
}

/// One line of a `--samples` file: size, link, iteration, slowest rank's time, each rank's.
struct Sample {
    size: usize,
    link: String,
    iter: usize,
    slowest: f64,
    ranks: Vec<f64>,
}

fn samples(path: &Path) -> (String, Vec<Sample>) {
    let text = std::fs::read_to_string(path).expect("read the samples file");
    let mut lines = text.lines();
    let header = lines.next().expect("a header line").to_string();
    let rows = lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert!(f.len() >= 5, "line `{l}`");
            let num = |s: &str| -> f64 { s.parse().unwrap_or_else(|_| panic!("`{s}` in `{l}`")) };
            Sample {
                size: f[0].parse().expect("size"),
                link: f[1].to_string(),
                iter: f[2].parse().expect("iteration"),
                slowest: num(f[3]),
                ranks: f[4..].iter().map(|s| num(s)).collect(),
            }
        })
        .collect();
    (header, rows)
}

#[test]
fn samples_file_holds_every_iteration_of_every_link_in_order_and_its_p50_is_the_tables() {
    let dir = common::fresh_dir("bench-samples");
    let file = dir.join("samples.csv");
    let arg = file.to_str().expect("utf-8 path");
    let out = bench(
        &[
            "--sizes",
            "4K,64K",
            "--iters",
            "9",
            "--vs-lossless",
            "--samples",
            arg,
        ],
        &[],
    );
    let table = rows(&out);
    assert_eq!(table.len(), 2, "{out}");
    let (header, got) = samples(&file);
    assert_eq!(
        header,
        "size_bytes,link,iteration,slowest_us,rank0_us,rank1_us"
    );
    // Two sizes, three links (the plugin, raw TCP, the plugin with loss off), nine
    // iterations each: grouped by size, then link in the table's order.
    assert_eq!(got.len(), 2 * 3 * 9);
    let groups: Vec<(usize, &str)> = got
        .chunks(9)
        .map(|c| (c[0].size, c[0].link.as_str()))
        .collect();
    let want: Vec<(usize, &str)> = [4096, 65536]
        .into_iter()
        .flat_map(|size| ["plugin", "raw", "lossless"].map(|l| (size, l)))
        .collect();
    assert_eq!(groups, want);
    for row in &table {
        for (link, cols) in [("plugin", row.plugin), ("raw", row.raw)] {
            let mine: Vec<&Sample> = got
                .iter()
                .filter(|s| s.size == row.size && s.link == link)
                .collect();
            let iters: Vec<usize> = mine.iter().map(|s| s.iter).collect();
            assert_eq!(iters, (0..9).collect::<Vec<_>>(), "{link} at {}", row.size);
            for s in &mine {
                assert_eq!(s.ranks.len(), 2);
                assert!(s.ranks.iter().all(|&t| t > 0.0), "{link}: {:?}", s.ranks);
                let max = s.ranks.iter().copied().fold(0.0, f64::max);
                // Both printed with 3 decimals: equal to the last digit.
                assert!((s.slowest - max).abs() < 0.0015, "{} vs {max}", s.slowest);
            }
            // The table's p50 is the nearest-rank median of the slowest rank per iteration,
            // printed with one decimal: the file's must round to it.
            let mut sorted: Vec<f64> = mine.iter().map(|s| s.slowest).collect();
            sorted.sort_by(f64::total_cmp);
            let p50 = sorted[sorted.len().div_ceil(2) - 1];
            assert!(
                (p50 - cols[1]).abs() <= 0.051,
                "{link} at {}: file p50 {p50}, table {}",
                row.size,
                cols[1]
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_samples_path_that_cannot_be_a_regular_file_is_refused_before_any_rank_starts() {
    let dir = common::fresh_dir("bench-samples-bad");
    let fifo = dir.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let missing = dir.join("no-such-dir").join("samples.csv");
    // A name ending in `/` can only be a directory, even one that does not exist yet.
    let slash = format!("{}/", dir.join("new").display());
    let (fifo, dir, missing) = (
        fifo.display().to_string(),
        dir.display().to_string(),
        missing.display().to_string(),
    );
    for (arg, why) in [
        (fifo.as_str(), "a FIFO"),
        (dir.as_str(), "a directory"),
        (missing.as_str(), "No such file or directory"),
        (slash.as_str(), "names a directory"),
    ] {
        let e = bench_refused(&["--sizes", "4K", "--iters", "1", "--samples", arg]);
        assert!(
            e.contains("--samples") && e.contains(arg) && e.contains(why),
            "{arg}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    // An empty path is refused by the argument parser itself, as a usage error.
    let out = common::output_within_10s(
        Command::new(lossy_exe()).args(["bench", "--sizes", "4K", "--samples", ""]),
        "lossy bench",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--samples") && out.stdout.is_empty(),
        "{stderr}"
    );
}
