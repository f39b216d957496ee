//! `lossy report --per-step` on the statistics of a real run: this test process loads the built
//! plugin, moves 1 MiB messages over loopback through it under three training steps (set with
//! the control API, as the Python integration does) and two collectives, and keeps the growth
//! of the plugin's live counters per step x collective x phase in a per-step file, as the
//! Python integration's recorder does. The report must print exactly those numbers, and they
//! must add up to the plugin's own per-step series in its statistics file.

mod common;

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{
    fresh_dir, library, lossy_exe, make_fifo, message_bytes, post_recv, post_send, wait_request,
};
use lossy_cli::harness::plugin_client::{op, PluginClient, PluginLibrary};
use nccl_net_lossy::stats::report::load_run;

const MIB: usize = 1 << 20;
/// (step, collective bits, messages) of the run.
const PLAN: [(u64, u32, usize); 4] = [
    (1, op::ALL_REDUCE, 2),
    (2, op::ALL_GATHER, 1),
    (2, op::ALL_REDUCE, 1),
    (3, op::ALL_GATHER, 2),
];

/// The control API of the copy of the library this process loaded.
struct Control {
    handle: *mut c_void,
    set_step: extern "C" fn(u64) -> c_int,
    stats_json: extern "C" fn(*mut c_char, usize) -> i64,
}

impl Control {
    fn of(path: &Path) -> Control {
        let c_path = CString::new(path.to_str().expect("utf-8 path")).expect("no NUL");
        // SAFETY: a valid C string; RTLD_NOLOAD only hands back the copy already loaded.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(!handle.is_null(), "the plugin is not loaded");
        let sym = |name: &str| {
            let c_name = CString::new(name).expect("no NUL");
            // SAFETY: a live handle and a valid C string.
            let sym = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
            assert!(!sym.is_null(), "no {name}");
            sym
        };
        let (set_step, stats_json) = (sym("ncclLossySetStep"), sym("ncclLossyStatsJson"));
        // SAFETY: the control header declares `int ncclLossySetStep(uint64_t)` and
        // `int64_t ncclLossyStatsJson(char*, size_t)`.
        unsafe {
            Control {
                handle,
                set_step: std::mem::transmute::<*mut c_void, extern "C" fn(u64) -> c_int>(set_step),
                stats_json: std::mem::transmute::<
                    *mut c_void,
                    extern "C" fn(*mut c_char, usize) -> i64,
                >(stats_json),
            }
        }
    }

    /// (collective, phase) -> (messages, packets, lost packets, bytes), over every connection.
    fn cells(&self) -> BTreeMap<(String, String), [u64; 4]> {
        let mut buf = vec![0u8; 1 << 20];
        let n = (self.stats_json)(buf.as_mut_ptr().cast(), buf.len());
        assert!(
            n > 0 && (n as usize) < buf.len(),
            "ncclLossyStatsJson returned {n}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&buf[..n as usize]).expect("JSON");
        let mut out = BTreeMap::new();
        for conn in doc["connections"].as_array().expect("connections") {
            for cell in conn["by_op"].as_array().expect("by_op") {
                let key = (
                    cell["op"].as_str().unwrap().to_string(),
                    cell["phase"].as_str().unwrap().to_string(),
                );
                let acc: &mut [u64; 4] = out.entry(key).or_default();
                for (slot, name) in
                    acc.iter_mut()
                        .zip(["messages", "packets", "lost_packets", "bytes"])
                {
                    *slot += cell[name].as_u64().unwrap();
                }
            }
        }
        out
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen above (one reference of our own).
        unsafe { libc::dlclose(self.handle) };
    }
}

/// Runs the plan through the plugin with statistics into `stats`; writes the per-step file
/// there and returns its rows as (step, collective) -> (packets, lost).
fn real_run(stats: &Path) -> BTreeMap<(u64, String), (u64, u64)> {
    std::env::set_var("NCCL_LOSSY_STATS", stats);
    std::env::set_var("NCCL_LOSSY_SET", "mtu=512;model.rate=0.5;effect=zero");
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let path = library();
    let lib = PluginLibrary::open(&path).expect("load the plugin");
    let control = Control::of(&path);
    let client = PluginClient::init(&lib, 12, 0x5eed).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(30))
        .expect("connect");
    let mut rows = Vec::new();
    let mut expected = BTreeMap::new();
    let mut last = control.cells();
    let mut tag = 0;
    for step in 1..=3u64 {
        (control.set_step)(step);
        for &(_, bits, count) in PLAN.iter().filter(|p| p.0 == step) {
            assert!(client.set_net_attr(bits).expect("setNetAttr"));
            for _ in 0..count {
                tag += 1;
                let mut r = post_recv(&recv, MIB, tag).expect("irecv");
                let mut s = post_send(&send, message_bytes(MIB, tag as u64), tag).expect("isend");
                wait_request(&mut s, Duration::from_secs(30)).expect("send");
                wait_request(&mut r, Duration::from_secs(30)).expect("recv");
            }
        }
        let now = control.cells();
        for (key, counts) in &now {
            let before = last.get(key).copied().unwrap_or_default();
            let grown: Vec<u64> = counts.iter().zip(before).map(|(a, b)| a - b).collect();
            if grown[0] > 0 {
                rows.push(
                    serde_json::json!({"step": step, "op": key.0, "phase": key.1,
                    "messages": grown[0], "bytes": grown[3], "packets": grown[1],
                    "lost_packets": grown[2], "loss_events": 0}),
                );
                let cell: &mut (u64, u64) = expected.entry((step, key.0.clone())).or_default();
                cell.0 += grown[1];
                cell.1 += grown[2];
            }
        }
        last = now;
    }
    send.close().expect("close send");
    recv.close().expect("close recv");
    assert!(lib.write_stats().expect("write statistics"));
    let doc = serde_json::json!({"format_version": 1, "rank": 0, "host": "test", "pid": std::process::id(),
        "written_at_unix_ms": 0, "steps": rows});
    std::fs::write(stats.join("lossy-steps-rank0-test-1.json"), doc.to_string()).expect("write");
    expected
}

fn lossy(args: &[&str]) -> Output {
    Command::new(lossy_exe())
        .args(args)
        .output()
        .expect("run lossy")
}

fn stdout_of(args: &[&str]) -> String {
    let out = lossy(args);
    assert!(
        out.status.success(),
        "lossy {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A CSV row's key: (run, step, collective).
type RowKey = (String, u64, String);

/// The CSV rows as (run, step, collective) -> (packets, lost, metric).
fn parse_csv(text: &str) -> BTreeMap<RowKey, (u64, u64, Option<f64>)> {
    text.lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let metric = f.get(6).and_then(|v| v.parse().ok());
            (
                (f[0].to_string(), f[1].parse().unwrap(), f[2].to_string()),
                (f[3].parse().unwrap(), f[4].parse().unwrap(), metric),
            )
        })
        .collect()
}

#[test]
fn per_step_report_prints_the_plugins_counts_by_collective_beside_the_training_loss() {
    let dir = fresh_dir("report-steps");
    let (run_a, run_b) = (dir.join("a"), dir.join("b"));
    std::fs::create_dir_all(&run_a).expect("dir");
    std::fs::create_dir_all(&run_b).expect("dir");
    let expected = real_run(&run_a);
    let s = |p: &Path| p.to_str().expect("utf-8").to_string();

    // by collective: exactly the plugin's counters per step; 2,048 packets a message
    let rows = parse_csv(&stdout_of(&["report", &s(&run_a), "--per-step", "--csv"]));
    let got: BTreeMap<(u64, String), (u64, u64)> = rows
        .iter()
        .map(|((_, step, op), v)| ((*step, op.clone()), (v.0, v.1)))
        .collect();
    assert_eq!(got, expected);
    let keys: Vec<(u64, &str, u64)> = got
        .iter()
        .map(|((s, o), v)| (*s, o.as_str(), v.0))
        .collect();
    assert_eq!(
        keys,
        [
            (1, "AllReduce", 4096),
            (2, "AllGather", 2048),
            (2, "AllReduce", 2048),
            (3, "AllGather", 4096)
        ]
    );
    assert!(
        got.values()
            .all(|&(p, lost)| lost > p / 4 && lost < 3 * p / 4),
        "{got:?}"
    );
    // ... which add up to the plugin's own per-step series in its statistics file
    let by_step = load_run(&run_a).expect("statistics").by_step;
    assert_eq!(by_step.len(), 3);
    for s in &by_step {
        let (p, l) = got
            .iter()
            .filter(|((st, _), _)| *st == s.step)
            .fold((0, 0), |a, (_, v)| (a.0 + v.0, a.1 + v.1));
        assert_eq!((s.step, p, l), (s.step, s.packets, s.lost_packets));
    }

    // without the per-step file: the plugin's series, as `all`
    for entry in std::fs::read_dir(&run_a).expect("dir") {
        let path = entry.expect("entry").path();
        if path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("lossy-stats-")
        {
            std::fs::copy(&path, run_b.join(path.file_name().unwrap())).expect("copy");
        }
    }
    let table = stdout_of(&["report", &s(&run_b), "--per-step"]);
    let lines: Vec<&str> = table.lines().skip(1).collect();
    assert_eq!(lines.len(), 3, "{table}");
    for (line, s) in lines.iter().zip(&by_step) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            (f[1], f[2], f[3], f[4]),
            (
                s.step.to_string().as_str(),
                "all",
                s.packets.to_string().as_str(),
                s.lost_packets.to_string().as_str()
            ),
            "{table}"
        );
    }

    // the training loss on the same step axis: a JSONL log (as the decorator writes) and a CSV
    let jsonl = dir.join("a.jsonl");
    std::fs::write(&jsonl, "{\"step\": 1, \"loss\": 2.5, \"wall_s\": 0.1}\n{\"step\": 2, \"loss\": 2.25}\n{\"step\": 3, \"loss\": null}\n").expect("write");
    let csv = dir.join("b.csv");
    std::fs::write(&csv, "step,loss,lr\n1,3.0,0.1\n2,2.0,0.1\n3,1.5,0.1\n").expect("write");
    let plot = dir.join("loss.svg");
    let out = stdout_of(&[
        "report",
        &s(&run_a),
        &s(&run_b),
        "--per-step",
        "--metric",
        "loss",
        "--train-log",
        &s(&jsonl),
        "--train-log",
        &s(&csv),
        "--csv",
        "--plot",
        &s(&plot),
    ]);
    let rows = parse_csv(&out);
    assert_eq!(rows[&("a".into(), 1, "AllReduce".into())].2, Some(2.5));
    assert_eq!(rows[&("a".into(), 2, "AllGather".into())].2, Some(2.25));
    assert_eq!(rows[&("a".into(), 3, "AllGather".into())].2, None);
    assert_eq!(rows[&("b".into(), 3, "all".into())].2, Some(1.5));
    let svg = std::fs::read_to_string(&plot).expect("the plot");
    for text in [
        "a: lost packets",
        "a: loss",
        "b: loss",
        "Packet loss and loss per training step",
    ] {
        assert!(svg.contains(text), "no {text:?} in the plot");
    }

    // a sweep: each run's directory holds its training log, found by the metric's name
    std::fs::copy(&jsonl, run_a.join("perf.jsonl")).expect("copy");
    std::fs::copy(&csv, run_b.join("train.csv")).expect("copy");
    let found = stdout_of(&[
        "report",
        &s(&run_a),
        &s(&run_b),
        "--per-step",
        "--metric",
        "loss",
        "--csv",
    ]);
    assert_eq!(parse_csv(&found), rows);
    let out = lossy(&["report", &s(&run_a), "--per-step", "--metric", "lr"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no training log"));

    // the totals' plot draws too (its text is measured with a font for SVG as for PNG)
    let totals = dir.join("totals.svg");
    stdout_of(&["report", &s(&run_a), "--plot", &s(&totals)]);
    assert!(std::fs::read_to_string(&totals)
        .expect("the plot")
        .contains("Loss per training step"));

    // one training log per run, or the command says so
    let out = lossy(&[
        "report",
        &s(&run_a),
        &s(&run_b),
        "--per-step",
        "--train-log",
        &s(&csv),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("one per run"));
    let out = lossy(&[
        "report",
        &s(&run_a),
        "--per-step",
        "--metric",
        "accuracy",
        "--train-log",
        &s(&csv),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no column \"accuracy\""));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `lossy args` and gives up after 10 s: a hang is a failure, not a stuck test.
fn lossy_within_10s(args: &[&str]) -> Output {
    common::output_within_10s(
        Command::new(lossy_exe()).args(args),
        &format!("lossy {args:?}"),
    )
}

/// `lossy report` failed with an error naming `file` and saying `why`.
fn assert_refused_naming(out: &Output, file: &str, why: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains(file) && stderr.contains(why),
        "{stderr}"
    );
}

#[test]
fn report_refuses_fifos_and_endless_files_naming_them() {
    use nccl_net_lossy::stats::writer::StatsFile;
    let dir = fresh_dir("report-hostile");
    let good = StatsFile::new(serde_json::json!({"seed": 1}), vec![]);
    std::fs::write(
        dir.join("lossy-stats-rank0-x-1.json"),
        serde_json::to_string(&good).expect("JSON"),
    )
    .expect("write");
    let run = dir.to_str().expect("utf-8").to_string();
    // A training log that is a FIFO with no writer: opening it would block forever.
    let log = dir.join("train.jsonl");
    make_fifo(&log);
    let out = lossy_within_10s(&[
        "report",
        &run,
        "--per-step",
        "--train-log",
        log.to_str().expect("utf-8"),
    ]);
    assert_refused_naming(&out, "train.jsonl", "not a regular file");
    // A statistics file that is a FIFO, then one that never ends.
    let fifo = dir.join("lossy-stats-rank9-x-1.json");
    make_fifo(&fifo);
    let out = lossy_within_10s(&["report", &run]);
    assert_refused_naming(&out, "lossy-stats-rank9-x-1.json", "not a regular file");
    std::fs::remove_file(&fifo).expect("remove");
    std::os::unix::fs::symlink("/dev/zero", dir.join("lossy-stats-rank9-x-2.json"))
        .expect("symlink");
    let out = lossy_within_10s(&["report", &run]);
    assert_refused_naming(
        &out,
        "lossy-stats-rank9-x-2.json",
        "not a regular file (a character device)",
    );
    std::fs::remove_dir_all(&dir).ok();
}
