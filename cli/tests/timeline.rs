//! The loss timeline (`NCCL_LOSSY_TRACE`): worker processes load the built library, move
//! messages over real sockets, and the trace files they leave are checked against the
//! trace-event schema, against the statistics files of the same run, against the wall clock
//! read around a transfer, and after a SIGKILL.
//!
//! The in-process cases run in a fresh process each (this binary again, with the ignored test
//! `timeline_child`), because tracing is switched on once per process.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{
    fresh_dir, launch_env, library, lossy_stdout, post_recv, post_send, repo_file, say, Peer,
};
use lossy_cli::harness::plugin_client::{op, PluginClient, PluginLibrary, RecvComm, SendComm};
use lossy_cli::harness::worker::{Job, LinkKind, Task};
use nccl_net_lossy::stats::writer::StatsFile;
use serde_json::Value;

const CHILD: &str = "timeline_child";
const MIB: usize = 1 << 20;

/// The trace files in `dir`, parsed.
fn traces(dir: &Path) -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("list the trace directory") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .to_string();
        if name.starts_with("lossy-trace-rank") && name.ends_with(".json") {
            let text = std::fs::read(&path).expect("read a trace");
            let json: Value = serde_json::from_slice(&text)
                .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
            out.push((path, json));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Checks every event against the trace-event schema; returns the complete (`X`) events.
fn checked_events(trace: &Value) -> Vec<&Value> {
    assert_eq!(trace["displayTimeUnit"], "ns");
    let pid = trace["lossy_trace"]["pid"]
        .as_u64()
        .expect("lossy_trace.pid");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let mut complete = Vec::new();
    for e in events {
        let ph = e["ph"].as_str().expect("ph is a string");
        assert!(e["name"].is_string(), "name: {e}");
        assert_eq!(e["pid"].as_u64(), Some(pid), "pid: {e}");
        match ph {
            "M" => assert!(e["args"]["name"].is_string(), "{e}"),
            "X" => {
                assert!(e["tid"].is_u64(), "tid: {e}");
                let ts = e["ts"].as_f64().expect("ts is a number");
                let dur = e["dur"].as_f64().expect("dur is a number");
                assert!(ts > 0.0 && dur >= 0.0, "{e}");
                assert_eq!(e["cat"], "lossy");
                let args = &e["args"];
                for key in [
                    "comm_id",
                    "connection",
                    "step",
                    "bytes",
                    "packets",
                    "lost_packets",
                    "loss_events",
                    "retransmit_delay_ns",
                ] {
                    assert!(args[key].is_u64(), "args.{key}: {e}");
                }
                for key in ["collective", "direction", "phase", "effect"] {
                    assert!(args[key].is_string(), "args.{key}: {e}");
                }
                assert_eq!(args["collective"], e["name"]);
                complete.push(e);
            }
            "C" => {
                assert!(e["ts"].is_f64(), "{e}");
                assert!(e["args"]["lost_packets"].is_u64(), "{e}");
            }
            other => panic!("unexpected ph {other}: {e}"),
        }
    }
    let meta = &trace["lossy_trace"];
    assert_eq!(meta["format_version"], 1);
    assert_eq!(meta["clock"], "CLOCK_MONOTONIC");
    for key in ["ring_capacity", "recorded", "dropped", "written_at_unix_ms"] {
        assert!(meta[key].is_u64(), "lossy_trace.{key}: {meta}");
    }
    assert!(meta["monotonic_to_epoch_ns"].is_i64() || meta["monotonic_to_epoch_ns"].is_u64());
    // Complete events of one thread must not overlap: viewers draw only events that nest.
    let mut by_tid: BTreeMap<u64, Vec<(f64, f64)>> = BTreeMap::new();
    for e in &complete {
        let ts = e["ts"].as_f64().expect("ts");
        let end = ts + e["dur"].as_f64().expect("dur");
        by_tid
            .entry(e["tid"].as_u64().expect("tid"))
            .or_default()
            .push((ts, end));
    }
    for (tid, spans) in &mut by_tid {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for pair in spans.windows(2) {
            assert!(
                pair[1].0 >= pair[0].1,
                "messages overlap on track {tid}: {pair:?}"
            );
        }
    }
    complete
}

#[test]
fn each_rank_traces_its_messages_and_the_trace_agrees_with_the_statistics() {
    let stats = fresh_dir("timeline-stats");
    let trace_dir = fresh_dir("timeline-trace");
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], Vec::new());
    job.task = Task::Messages {
        bytes: MIB,
        count: 40,
        mtu: 4096,
        op_bits: op::ALL_REDUCE,
    };
    job.timeout_s = 60.0;
    let env = vec![
        (
            "NCCL_LOSSY_PROFILE".into(),
            repo_file("configs/uniform-1pct.toml").display().to_string(),
        ),
        ("NCCL_LOSSY_SET".into(), "seed=3".into()),
        ("NCCL_LOSSY_STATS".into(), stats.display().to_string()),
        ("NCCL_LOSSY_TRACE".into(), trace_dir.display().to_string()),
    ];
    launch_env(2, job, env).unwrap_or_else(|e| panic!("run failed: {e}"));
    let traces = traces(&trace_dir);
    assert_eq!(traces.len(), 2, "one trace file per rank");
    let mut lost_total = 0;
    for (path, trace) in &traces {
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .to_string();
        let meta = &trace["lossy_trace"];
        let rank = meta["rank"].as_u64().expect("rank");
        let pid = meta["pid"].as_u64().expect("pid");
        assert!(
            name.starts_with(&format!("lossy-trace-rank{rank}-"))
                && name.ends_with(&format!("-{pid}.json")),
            "{name}"
        );
        let events = checked_events(trace);
        // The statistics file of the same process.
        let stats_name = name.replacen("lossy-trace-", "lossy-stats-", 1);
        let file = StatsFile::read(&stats.join(&stats_name)).expect("the rank's statistics");
        let mut by_op: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for e in &events {
            let a = &e["args"];
            let cell = by_op
                .entry(a["collective"].as_str().expect("name").into())
                .or_default();
            cell.0 += 1;
            cell.1 += a["packets"].as_u64().expect("packets");
            cell.2 += a["lost_packets"].as_u64().expect("lost");
        }
        let mut from_stats: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for conn in &file.connections {
            for cell in &conn.by_op {
                let sum = from_stats.entry(cell.op.clone()).or_default();
                sum.0 += cell.counts.messages;
                sum.1 += cell.counts.packets;
                sum.2 += cell.counts.lost_packets;
            }
        }
        assert_eq!(
            by_op, from_stats,
            "{name}: trace vs statistics per collective"
        );
        assert_eq!(meta["recorded"].as_u64(), Some(events.len() as u64));
        assert_eq!(meta["dropped"], 0);
        lost_total += file.total.lost_packets;
    }
    assert!(
        lost_total > 0,
        "the profile lost nothing: the comparison proves little"
    );
    let _ = std::fs::remove_dir_all(&stats);
    let _ = std::fs::remove_dir_all(&trace_dir);
}

/// `lossy demo` pipelines messages (NCCL-style ring collectives, several in flight per
/// connection): every rank's trace still passes the schema, its tracks hold no overlapping
/// messages, and its events add up to the rank's statistics.
#[test]
fn the_demo_s_pipelined_messages_give_well_formed_tracks() {
    let stats = fresh_dir("timeline-demo-stats");
    let trace_dir = fresh_dir("timeline-demo-trace");
    let profile = repo_file("configs/bursty-ge-1pct.toml");
    lossy_stdout(
        &["demo", "--ranks", "4", "--sizes", "64K,1M"],
        &[
            ("NCCL_LOSSY_PROFILE", profile.to_str().expect("utf-8")),
            ("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8")),
            ("NCCL_LOSSY_TRACE", trace_dir.to_str().expect("utf-8")),
        ],
    );
    let traces = traces(&trace_dir);
    assert_eq!(traces.len(), 4, "one trace file per rank");
    for (path, trace) in &traces {
        let events = checked_events(trace);
        let name = path.file_name().expect("name").to_string_lossy();
        let stats_name = name.replacen("lossy-trace-", "lossy-stats-", 1);
        let file = StatsFile::read(&stats.join(&stats_name)).expect("the rank's statistics");
        let sum = |key: &str| -> u64 {
            events
                .iter()
                .map(|e| e["args"][key].as_u64().expect("a count"))
                .sum()
        };
        assert_eq!(events.len() as u64, file.total.messages, "{name}");
        assert_eq!(sum("packets"), file.total.packets, "{name}");
        assert_eq!(sum("lost_packets"), file.total.lost_packets, "{name}");
    }
    let _ = std::fs::remove_dir_all(&stats);
    let _ = std::fs::remove_dir_all(&trace_dir);
}

/// Runs `role` in a fresh process with `env`; returns what it said after `OK`.
fn run_child(role: &str, env: &[(&str, &str)]) -> (Peer, String) {
    let mut all = vec![("NCCL_SOCKET_IFNAME", "lo")];
    all.extend_from_slice(env);
    let mut peer = Peer::spawn(CHILD, role, &all);
    let said = peer.expect_line("OK");
    (peer, said)
}

#[test]
fn the_clock_offset_puts_a_transfer_at_its_wall_clock_time() {
    let dir = fresh_dir("timeline-clock");
    let (mut peer, said) = run_child(
        "clock",
        &[("NCCL_LOSSY_TRACE", dir.to_str().expect("utf-8"))],
    );
    assert!(peer.wait().success());
    let window: Vec<i64> = said
        .split_whitespace()
        .map(|w| w.parse().expect("epoch ns"))
        .collect();
    let (before, after) = (window[0], window[1]);
    let traces = traces(&dir);
    assert_eq!(traces.len(), 1);
    let trace = &traces[0].1;
    let offset = trace["lossy_trace"]["monotonic_to_epoch_ns"]
        .as_i64()
        .expect("offset");
    let events = checked_events(trace);
    assert_eq!(events.len(), 1, "one message sent");
    let ts = events[0]["ts"].as_f64().expect("ts");
    let dur = events[0]["dur"].as_f64().expect("dur");
    let start = (ts * 1000.0) as i64 + offset;
    let end = ((ts + dur) * 1000.0) as i64 + offset;
    let slack = 5_000_000; // 5 ms
    assert!(
        before - slack <= start && start <= end && end <= after + slack,
        "the transfer [{start}, {end}] lies outside the wall-clock window [{before}, {after}]"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_rank_leaves_the_trace_of_its_last_interval() {
    let dir = fresh_dir("timeline-killed");
    let (mut peer, _) = run_child(
        "killed",
        &[
            ("NCCL_LOSSY_TRACE", dir.to_str().expect("utf-8")),
            ("NCCL_LOSSY_SET", "stats_interval=0.1"),
        ],
    );
    // A few intervals pass with the comms open and nothing closing, then SIGKILL.
    std::thread::sleep(Duration::from_millis(800));
    peer.kill();
    let traces = traces(&dir);
    assert_eq!(traces.len(), 1, "the killed rank left no trace");
    let events = checked_events(&traces[0].1);
    assert_eq!(events.len(), 10);
    assert_eq!(traces[0].1["lossy_trace"]["recorded"], 10);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_periodic_write_with_no_new_message_rewrites_nothing() {
    // Writing a ring of a million messages takes seconds: rewriting an unchanged one every
    // interval kept a core busy for as long as the job sat idle.
    let dir = fresh_dir("timeline-idle");
    let (mut peer, _) = run_child(
        "killed",
        &[
            ("NCCL_LOSSY_TRACE", dir.to_str().expect("utf-8")),
            ("NCCL_LOSSY_SET", "stats_interval=0.1"),
        ],
    );
    // The file of the first interval after the messages (each write stamps its time).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let first = loop {
        let found = traces(&dir);
        if let Some((_, trace)) = found.first() {
            if trace["lossy_trace"]["recorded"] == 10 {
                break trace["lossy_trace"]["written_at_unix_ms"].clone();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no trace of the 10 messages"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Eight more intervals with nothing sent.
    std::thread::sleep(Duration::from_millis(800));
    let found = traces(&dir);
    assert_eq!(found.len(), 1);
    let now = found[0].1["lossy_trace"]["written_at_unix_ms"].clone();
    peer.kill();
    assert_eq!(now, first, "the unchanged trace was written again");
    let _ = std::fs::remove_dir_all(&dir);
}

fn epoch_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos() as i64
}

/// Sends `count` messages of `size` bytes to itself and waits for them.
fn send_to_self(client: &PluginClient, count: usize, size: usize) -> (SendComm, RecvComm) {
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(20))
        .expect("local pair");
    for i in 0..count {
        let mut r = post_recv(&recv, size, i as i32).expect("irecv");
        let mut s = post_send(&send, vec![7u8; size], i as i32).expect("isend");
        common::wait_request(&mut s, Duration::from_secs(20)).expect("send");
        common::wait_request(&mut r, Duration::from_secs(20)).expect("recv");
    }
    (send, recv)
}

/// The child side of the tests above: acts on [`common::ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn timeline_child() {
    let Ok(role) = std::env::var(common::ROLE_ENV) else {
        return;
    };
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 1).expect("init");
    match role.as_str() {
        "clock" => {
            let before = epoch_ns();
            let (send, recv) = send_to_self(&client, 1, MIB);
            let after = epoch_ns();
            send.close().expect("close send");
            recv.close().expect("close recv");
            client.finalize().expect("finalize");
            say(&format!("OK {before} {after}"));
        }
        "killed" => {
            let _pair = send_to_self(&client, 10, 64 * 1024);
            say("OK sent");
            common::park();
        }
        other => panic!("unknown role {other}"),
    }
}
