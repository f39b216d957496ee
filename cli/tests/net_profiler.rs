//! The net profiler callback (net v10+ `init`): the harness hands the built plugin a
//! recording callback and a profiler handle with every `isend`, as NCCL's proxy does, moves
//! lossy messages over real sockets, and checks what the callback saw against the plugin's
//! own statistics. Each case runs in a fresh process (this binary again, with the ignored
//! test `net_profiler_child`): the runtime and a v10 `init` are process-wide.

mod common;

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use common::{library, post_recv, post_send, say, wait_request};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use nccl_net_lossy::ffi::{
    ncclLossyProfilerNetDescr_v1_t, ncclLossyProfilerNetMessage_v1_t, ncclResult_t,
    NCCL_LOSSY_EFFECT_RETRANSMIT, NCCL_LOSSY_EFFECT_ZERO, NCCL_LOSSY_NET_EVENT_START,
    NCCL_LOSSY_NET_EVENT_STOP, NCCL_LOSSY_PROFILER_NET_ID, NCCL_LOSSY_PROFILE_MESSAGE,
};

const CHILD: &str = "net_profiler_child";
const MESSAGES: usize = 24;
const SIZE: usize = 64 * 1024;
const COMM_ID: u64 = 0x7e57;
/// The plugin id of the events the forwarding fixture reports (`FORWARD_PROFILER_ID`).
const FORWARD_PROFILER_ID: u32 = 0x4657;

/// One call of the callback.
#[derive(Clone, Copy, Debug)]
struct Call {
    kind: c_int,
    /// `*eHandle` after the call (START) or as the plugin passed it (STOP).
    event: usize,
    parent: usize,
    plugin_id: i64,
    descr_type: Option<u8>,
    message: Option<ncclLossyProfilerNetMessage_v1_t>,
}

static CALLS: Mutex<Vec<Call>> = Mutex::new(Vec::new());
static NEXT_EVENT: AtomicUsize = AtomicUsize::new(0x1000);
static FAIL: AtomicBool = AtomicBool::new(false);
/// START leaves the event handle as it was (NULL), as NCCL's callback does when no profiler
/// is loaded or the loaded one does not record net plugin events (src/plugin/profiler.cc).
static NO_EVENT: AtomicBool = AtomicBool::new(false);

/// The test's profiler callback: records each call; at START it copies the descriptor (it
/// lives only during the call) and gives the event a handle of its own.
///
/// # Safety
/// NCCL's contract for the callback: `e_handle` points to the plugin's event handle, and at
/// START `ext` is NULL or a descriptor valid during the call.
unsafe extern "C" fn record(
    e_handle: *mut *mut c_void,
    kind: c_int,
    parent: *mut c_void,
    plugin_id: i64,
    ext: *mut c_void,
) -> ncclResult_t {
    let mut call = Call {
        kind,
        event: 0,
        parent: parent as usize,
        plugin_id,
        descr_type: None,
        message: None,
    };
    if kind == NCCL_LOSSY_NET_EVENT_START as c_int {
        if !ext.is_null() {
            // SAFETY: at START the plugin passes its descriptor, valid during the call.
            let descr = unsafe { *(ext as *const ncclLossyProfilerNetDescr_v1_t) };
            call.descr_type = Some(descr.type_);
            // SAFETY: the union's only member.
            call.message = Some(unsafe { descr.__bindgen_anon_1.message });
        }
        let event = if NO_EVENT.load(Ordering::Relaxed) {
            0
        } else {
            NEXT_EVENT.fetch_add(1, Ordering::Relaxed)
        };
        if !e_handle.is_null() && event != 0 {
            // SAFETY: the plugin's event handle slot.
            unsafe { *e_handle = event as *mut c_void };
        }
        call.event = event;
    } else if !e_handle.is_null() {
        // SAFETY: the plugin's event handle slot.
        call.event = unsafe { *e_handle } as usize;
    }
    CALLS.lock().expect("calls").push(call);
    if FAIL.load(Ordering::Relaxed) {
        ncclResult_t::ncclInternalError
    } else {
        ncclResult_t::ncclSuccess
    }
}

/// The loss the children run under (`effect=zero`).
const LOSSY: &str = "mtu=1024;model.rate=0.05;effect=zero;seed=11";

/// Runs `role` in a fresh process under [`LOSSY`]; returns its stderr (the plugin's warnings).
fn run_child(role: &str) -> String {
    run_child_with(role, LOSSY)
}

/// Runs `role` in a fresh process with `NCCL_LOSSY_SET=set`; returns its stderr.
fn run_child_with(role: &str, set: &str) -> String {
    run_child_env(role, set, &[])
}

/// As [`run_child_with`], with `env` set too.
fn run_child_env(role: &str, set: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(exe)
        .args([
            "--exact",
            CHILD,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(common::ROLE_ENV, role)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_LOSSY_SET", set)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success() && stdout.contains("OK"),
        "child {role} failed:\n{stdout}\n{stderr}"
    );
    stderr
}

#[test]
fn v10_to_v12_report_every_sent_message_with_its_losses() {
    for v in [10, 11, 12] {
        run_child(&format!("report-{v}"));
    }
}

#[test]
fn the_payload_carries_the_retransmit_effect_and_its_delay() {
    run_child_with(
        "retransmit-11",
        "mtu=1024;model.rate=0.05;effect=retransmit;retransmit_timeout_us=50;seed=11",
    );
}

#[test]
fn v8_v9_and_a_null_callback_call_nothing_and_break_nothing() {
    for role in ["quiet-8", "quiet-9", "null-10", "null-12"] {
        run_child(role);
    }
}

#[test]
fn an_event_the_profiler_did_not_start_is_not_stopped() {
    // Under NCCL 2.26+ with no profiler recording net events, START leaves the event handle
    // NULL: there is no event, and a STOP of NULL per message is a call for nothing.
    run_child("idle-12");
}

#[test]
fn a_failing_callback_is_warned_about_once_and_ignored() {
    let stderr = run_child("failing-12");
    let warnings = stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("profiler"))
        .count();
    assert_eq!(
        warnings, 1,
        "one warning for the failing callback:\n{stderr}"
    );
}

#[test]
fn a_wrapped_plugin_gets_the_profiler_callback_and_each_messages_handle_as_under_nccl() {
    // NCCL hands a v10+ plugin's `init` its profiler callback and every post a handle of the
    // proxy's (src/plugin/net.cc, src/transport/net.cc); its IB and Socket plugins call the
    // callback with that handle for each of their own events, unchecked
    // (src/transport/net_ib/p2p.cc, src/transport/net_socket.cc), and NCCL's callback reads
    // the handle as its own (src/plugin/profiler.cc). Wrapped, the inner plugin (the
    // forwarding fixture, which logs what it gets, in front of a copy of this library, which
    // reports an event per post, in front of the calibration plugin) must get the same, its
    // events must reach NCCL's callback under NCCL's handles, and nothing else may reach it
    // (a side message has no NCCL handle).
    let fixture = common::build_fixture("profiler-wrap", "forward_plugin.c");
    let target = common::build_fixture("profiler-wrap-target", "inline_tcp_plugin.c");
    let dir = fixture
        .parent()
        .expect("the fixture's folder")
        .to_path_buf();
    for version in [10, 12] {
        let log = dir.join(format!("inner-profiler-v{version}.txt"));
        let _ = std::fs::remove_file(&log);
        run_child_env(
            &format!("wrap-{version}"),
            LOSSY,
            &[
                ("NCCL_LOSSY_INNER", fixture.to_str().expect("UTF-8")),
                ("FORWARD_PLUGIN_TARGET", target.to_str().expect("UTF-8")),
                ("FORWARD_PLUGIN_PROFILER_LOG", log.to_str().expect("UTF-8")),
            ],
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(target.parent().expect("the target's folder"));
}

/// Checks a wrapped run: the inner plugin's log of its profiler arguments and the calls
/// that reached the callback.
fn check_wrapped(version: u32, sends: &[Option<usize>], recvs: &[Option<usize>], calls: &[Call]) {
    let log = std::env::var("FORWARD_PLUGIN_PROFILER_LOG").expect("the fixture's log");
    let text = std::fs::read_to_string(&log).expect("the fixture's log of profiler arguments");
    let sends: Vec<usize> = sends.iter().map(|h| h.expect("a send handle")).collect();
    let recvs: Vec<usize> = recvs.iter().map(|h| h.expect("a receive handle")).collect();
    let mut given: HashMap<(&str, usize), usize> = HashMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f.len(), 4, "{line}");
        assert_eq!(
            f[1], "1",
            "v{version}: the inner plugin got a NULL: {line}\n{text}"
        );
        *given
            .entry((f[0], f[3].parse().expect("an address")))
            .or_default() += 1;
    }
    assert!(given.keys().any(|(what, _)| *what == "init"), "{text}");
    // Each message's own handle reached the inner plugin with its data, once (a handle's
    // memory may serve several messages, one after the other).
    let mut expected: HashMap<(&str, usize), usize> = HashMap::new();
    for (what, handles) in [("send", &sends), ("recv", &recvs)] {
        for h in handles.iter() {
            *expected.entry((what, *h)).or_default() += 1;
        }
    }
    for (key, n) in &expected {
        assert_eq!(
            given.get(key),
            Some(n),
            "v{version}: {key:?} not passed on once per message:\n{text}"
        );
    }
    // Every event the callback saw is under a handle it gave: the inner plugin's events for
    // the side messages never reach it.
    let ours: std::collections::HashSet<usize> = sends.iter().chain(&recvs).copied().collect();
    let starts: Vec<&Call> = calls
        .iter()
        .filter(|c| c.kind == NCCL_LOSSY_NET_EVENT_START as c_int)
        .collect();
    for start in &starts {
        assert!(
            ours.contains(&start.parent),
            "v{version}: an event under a handle NCCL never gave: {start:?}"
        );
    }
    // The inner plugin's event for each message NCCL posted, and ours for each sent one, each
    // under that message's handle.
    let mut uses: HashMap<usize, (usize, usize)> = HashMap::new();
    for ((what, h), n) in &expected {
        let (all, sent) = uses.entry(*h).or_default();
        *all += n;
        if *what == "send" {
            *sent += n;
        }
    }
    for (h, (all, sent)) in &uses {
        let count = |id: u32| {
            starts
                .iter()
                .filter(|c| c.parent == *h && c.plugin_id == i64::from(id))
                .count()
        };
        assert_eq!(
            count(FORWARD_PROFILER_ID),
            *all,
            "v{version}: inner events under {h:#x}"
        );
        assert_eq!(
            count(NCCL_LOSSY_PROFILER_NET_ID),
            *sent,
            "v{version}: ours under {h:#x}"
        );
    }
    let stops = calls
        .iter()
        .filter(|c| c.kind == NCCL_LOSSY_NET_EVENT_STOP as c_int)
        .count();
    assert_eq!(
        stops,
        starts.len(),
        "v{version}: every event stopped: {calls:?}"
    );
    // Ours still add up to this rank's statistics.
    let stats = connection_stats();
    let lost: u64 = starts
        .iter()
        .filter_map(|c| c.message)
        .map(|m| m.lostPackets)
        .sum();
    assert!(
        stats[2] > 0,
        "the profile lost nothing: the check proves little"
    );
    assert_eq!(
        lost, stats[2],
        "v{version}: lost packets of the events vs statistics"
    );
}

/// The plugin's statistics of this process: (messages, packets, lost packets, loss events,
/// bytes, retransmit delay) of its only sending connection.
fn connection_stats() -> [u64; 6] {
    let path = CString::new(library().to_str().expect("utf-8").to_string()).expect("no NUL");
    // SAFETY: a valid C string; RTLD_NOLOAD only hands back the copy already loaded.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null(), "the plugin is not loaded");
    // SAFETY: a live handle and a valid C string.
    let sym = unsafe { libc::dlsym(handle, c"ncclLossyStatsJson".as_ptr()) };
    assert!(!sym.is_null(), "no ncclLossyStatsJson");
    // SAFETY: the control header declares `int64_t ncclLossyStatsJson(char*, size_t)`.
    let stats_json = unsafe {
        std::mem::transmute::<*mut c_void, extern "C" fn(*mut c_char, usize) -> i64>(sym)
    };
    let mut buf = vec![0u8; 1 << 20];
    let n = stats_json(buf.as_mut_ptr().cast(), buf.len());
    assert!(n > 0 && (n as usize) < buf.len(), "ncclLossyStatsJson: {n}");
    // SAFETY: the handle from dlopen above (one reference of our own).
    unsafe { libc::dlclose(handle) };
    let doc: serde_json::Value = serde_json::from_slice(&buf[..n as usize]).expect("JSON");
    let conns = doc["connections"].as_array().expect("connections");
    assert_eq!(conns.len(), 1, "one sending connection: {doc}");
    let t = &conns[0]["total"];
    [
        "messages",
        "packets",
        "lost_packets",
        "loss_events",
        "bytes",
        "retransmit_delay_ns",
    ]
    .map(|k| t[k].as_u64().unwrap_or_else(|| panic!("total.{k}: {doc}")))
}

/// Sends [`MESSAGES`] messages to itself; returns each send's and each receive's profiler
/// handle.
fn send_to_self(client: &PluginClient) -> (Vec<Option<usize>>, Vec<Option<usize>>) {
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(20))
        .expect("local pair");
    let mut handles = Vec::new();
    let mut recv_handles = Vec::new();
    for i in 0..MESSAGES {
        let mut r = post_recv(&recv, SIZE, i as i32).expect("irecv");
        let mut s = post_send(&send, vec![3u8; SIZE], i as i32).expect("isend");
        handles.push(s.profiler_handle());
        recv_handles.push(r.profiler_handle());
        wait_request(&mut s, Duration::from_secs(20)).expect("send");
        wait_request(&mut r, Duration::from_secs(20)).expect("recv");
    }
    send.close().expect("close send");
    recv.close().expect("close recv");
    (handles, recv_handles)
}

/// Checks the calls of a run that reported: a START with the documented payload under the
/// message's own handle, then its STOP, for every message; the payloads add up to the
/// connection's statistics.
fn check_reports(version: u32, handles: &[Option<usize>], calls: &[Call], retransmit: bool) {
    let stats = connection_stats();
    assert_eq!(stats[0], MESSAGES as u64);
    assert!(
        stats[2] > 0,
        "the profile lost nothing: the check proves little"
    );
    let starts: Vec<&Call> = calls
        .iter()
        .filter(|c| c.kind == NCCL_LOSSY_NET_EVENT_START as c_int)
        .collect();
    let stops: Vec<&Call> = calls
        .iter()
        .filter(|c| c.kind == NCCL_LOSSY_NET_EVENT_STOP as c_int)
        .collect();
    assert_eq!(starts.len(), MESSAGES, "v{version}: {calls:?}");
    assert_eq!(stops.len(), MESSAGES, "v{version}: {calls:?}");
    assert_eq!(calls.len(), 2 * MESSAGES, "only starts and stops");
    // Each message's start came under its own isend's handle, in order; its stop follows.
    let mut started_at: HashMap<usize, usize> = HashMap::new();
    for (i, (start, handle)) in starts.iter().zip(handles).enumerate() {
        let handle = handle.expect("v10+ sends carry a profiler handle");
        assert_eq!(
            start.parent, handle,
            "v{version} message {i}: parent handle"
        );
        assert_eq!(start.plugin_id, i64::from(NCCL_LOSSY_PROFILER_NET_ID));
        assert_eq!(start.descr_type, Some(NCCL_LOSSY_PROFILE_MESSAGE as u8));
        let at = calls
            .iter()
            .position(|c| std::ptr::eq(c, *start))
            .expect("start");
        started_at.insert(start.event, at);
    }
    for (at, stop) in calls.iter().enumerate().filter(|(_, c)| c.kind == 1) {
        let started = started_at
            .remove(&stop.event)
            .unwrap_or_else(|| panic!("v{version}: stop of an event never started: {stop:?}"));
        assert!(started < at, "v{version}: stop before start");
    }
    assert!(started_at.is_empty(), "v{version}: events never stopped");
    let mut sums = [0u64; 5];
    let mut delay = 0;
    for start in &starts {
        let m = start.message.expect("a descriptor at START");
        assert_eq!(m.commId, if version >= 11 { COMM_ID } else { 0 });
        assert_eq!(m.connection, 0);
        assert_eq!(m.bytes, SIZE as u64);
        if retransmit {
            assert_eq!(m.effect, NCCL_LOSSY_EFFECT_RETRANSMIT);
            assert_eq!(m.retransmitDelayNs, m.lossEvents * 50_000, "{m:?}");
            delay += m.retransmitDelayNs;
        } else {
            assert_eq!(m.effect, NCCL_LOSSY_EFFECT_ZERO);
            assert_eq!(m.retransmitDelayNs, 0);
        }
        assert!(m.lostPackets <= m.packets && m.lossEvents <= m.lostPackets);
        for (sum, v) in sums
            .iter_mut()
            .zip([1, m.packets, m.lostPackets, m.lossEvents, m.bytes])
        {
            *sum += v;
        }
    }
    assert_eq!(
        sums,
        stats[..5],
        "v{version}: payloads (messages, packets, lost, loss events, bytes) vs statistics"
    );
    assert_eq!(
        delay, stats[5],
        "v{version}: retransmit delay vs statistics"
    );
}

/// The child side of the tests above: acts on [`common::ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn net_profiler_child() {
    let Ok(role) = std::env::var(common::ROLE_ENV) else {
        return;
    };
    let (kind, version) = role.split_once('-').expect("KIND-VERSION");
    let version: u32 = version.parse().expect("version");
    FAIL.store(kind == "failing", Ordering::Relaxed);
    NO_EVENT.store(kind == "idle", Ordering::Relaxed);
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let callback = (kind != "null").then_some(record as _);
    let client = PluginClient::init_profiled(&lib, version, COMM_ID, callback).expect("init");
    let (handles, recv_handles) = send_to_self(&client);
    let calls = CALLS.lock().expect("calls").clone();
    match kind {
        "report" | "failing" | "retransmit" => {
            check_reports(version, &handles, &calls, kind == "retransmit")
        }
        "idle" => {
            let starts = calls
                .iter()
                .filter(|c| c.kind == NCCL_LOSSY_NET_EVENT_START as c_int);
            assert_eq!(starts.count(), MESSAGES, "v{version}: {calls:?}");
            assert_eq!(calls.len(), MESSAGES, "v{version}: no STOP: {calls:?}");
        }
        "wrap" => check_wrapped(version, &handles, &recv_handles, &calls),
        "quiet" | "null" => {
            assert!(calls.is_empty(), "v{version} {kind}: {calls:?}");
            assert_eq!(handles.iter().all(Option::is_some), version >= 10);
            assert_eq!(connection_stats()[0], MESSAGES as u64);
        }
        other => panic!("unknown role {other}"),
    }
    client.finalize().expect("finalize");
    say("OK");
}
