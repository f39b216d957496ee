//! A process that exits without closing its comms or calling `finalize`, as NCCL jobs often do
//! (NCCL never calls `finalize` on many paths, and a training script may just return): the
//! statistics file and the trace must still hold every message the process moved, and the
//! exit must not hang, also while another thread is still testing a request of a comm.
//!
//! Each case runs in a fresh process (this binary again, with the ignored test `exit_child`),
//! which moves its messages and then calls `exit` with everything open.

mod common;

use std::ffi::c_int;
use std::path::Path;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use common::{fresh_dir, library, say, Peer};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use nccl_net_lossy::ffi::{ncclNet_v12_t, ncclResult_t};
use nccl_net_lossy::stats::writer::StatsFile;

const CHILD: &str = "exit_child";
/// Messages each child moves before it exits.
const MESSAGES: u64 = 12;
const SIZE: usize = 200_000;
/// An exit still going on after this long is a hang.
const HANG: Duration = Duration::from_secs(60);

/// Runs `role` in a fresh process writing statistics and a trace under `dir`; checks that it
/// exits successfully and in time, and returns its statistics file and its trace.
fn run(role: &str, dir: &Path, set: &str) -> (StatsFile, serde_json::Value) {
    let stats = dir.join("stats");
    let trace = dir.join("trace");
    let env = [
        ("NCCL_SOCKET_IFNAME", "lo"),
        ("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8")),
        ("NCCL_LOSSY_TRACE", trace.to_str().expect("utf-8")),
        ("NCCL_LOSSY_SET", set),
    ];
    let mut peer = Peer::spawn(CHILD, role, &env);
    peer.expect_line("OK");
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child, without blocking, with a valid status pointer.
        let rc = unsafe { libc::waitpid(peer.pid(), &mut status, libc::WNOHANG) };
        if rc == peer.pid() {
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "{role}: the child did not exit cleanly: status {status:#x}"
            );
            break;
        }
        assert!(
            start.elapsed() < HANG,
            "{role}: the child is still exiting after {HANG:?}: a hang at exit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let only = |d: &Path, prefix: &str| {
        let files: Vec<_> = std::fs::read_dir(d)
            .unwrap_or_else(|e| panic!("{role}: {}: {e}", d.display()))
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
            })
            .collect();
        assert_eq!(files.len(), 1, "{role}: {prefix} files: {files:?}");
        files[0].clone()
    };
    let file = StatsFile::read(&only(&stats, "lossy-stats-")).expect("statistics file");
    let text = std::fs::read_to_string(only(&trace, "lossy-trace-")).expect("trace file");
    (file, serde_json::from_str(&text).expect("trace JSON"))
}

fn check(role: &str) {
    let dir = fresh_dir(&format!("exit-{role}"));
    let (file, trace) = run(role, &dir, "");
    assert_eq!(
        file.total.messages, MESSAGES,
        "{role}: the statistics written at exit miss messages"
    );
    assert_eq!(
        trace["lossy_trace"]["recorded"].as_u64(),
        Some(MESSAGES),
        "{role}: the trace written at exit misses messages"
    );
    println!(
        "EXIT {role}: {} messages, {} packets, {} lost in the statistics written at exit",
        file.total.messages, file.total.packets, file.total.lost_packets
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn exiting_with_comms_open_and_no_finalize_keeps_the_statistics_v12() {
    check("open_v12");
}

#[test]
fn exiting_with_comms_open_under_net_v9_keeps_the_statistics() {
    check("open_v9");
}

#[test]
fn exiting_while_another_thread_tests_a_request_keeps_the_statistics() {
    check("testing");
}

#[test]
fn a_burst_still_going_at_exit_is_in_the_burst_histogram() {
    // Every packet lost: the connection's messages make one burst that is still going when
    // the process exits (a burst that reaches a message's end goes on into the next
    // message). The file written at exit counted every packet lost but held no burst at all,
    // so the report showed 100% loss and no burst length; the live statistics
    // (`ncclLossyStatsJson`, a periodic write) left out the burst in progress the same way.
    let dir = fresh_dir("exit-burst-open");
    let (file, _) = run("open_v12", &dir, "model.kind=uniform;model.rate=1");
    assert_eq!(file.total.messages, MESSAGES);
    assert_eq!(file.total.lost_packets, file.total.packets);
    let bins: Vec<(u64, u64)> = file
        .connections
        .iter()
        .flat_map(|c| &c.histograms)
        .flat_map(|h| h.burst_lengths.iter().copied())
        .collect();
    // One burst of every packet; its bin (two significant digits) lies less than 1/128
    // above its length.
    assert_eq!(
        bins.iter().map(|&(_, n)| n).sum::<u64>(),
        1,
        "bursts in the file written at exit: {bins:?}"
    );
    let (len, _) = bins[0];
    let lost = file.total.lost_packets;
    assert!(
        len >= lost && len * 128 <= lost * 129,
        "a burst of {len} for {lost} lost packets"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Moves [`MESSAGES`] messages over one connection of `client` and leaves it open.
fn move_messages(client: &PluginClient) -> impl Sized {
    common::move_messages(client, MESSAGES, SIZE, HANG)
}

/// On a connection of its own, posts a receive nobody sends to and tests it for ever, through
/// the raw v12 table as NCCL's proxy thread does.
fn poll_a_receive_forever() {
    // SAFETY: ncclNetPlugin_v12 is a ncclNet_v12_t in our headers.
    let t = unsafe { common::library_table::<ncclNet_v12_t>("ncclNetPlugin_v12") };
    let ctx = common::raw_context(t, 2, None);
    let (_sc, rc, _lc) = common::raw_connected(t, ctx);
    let buf: &'static mut [u8] = Box::leak(vec![0u8; 1 << 20].into_boxed_slice());
    // SAFETY: a live receive comm of `t`, and a buffer leaked for ever.
    let request = unsafe { common::raw_irecv(t, rc, buf, 0, null_mut()) };
    assert!(!request.is_null(), "irecv handed out no request");
    loop {
        let mut done: c_int = 0;
        // SAFETY: the request irecv handed out, on a comm never closed; a valid out-pointer.
        let rc_ = unsafe { t.test.expect("test")(request, &mut done, null_mut()) };
        assert_eq!(rc_, ncclResult_t::ncclSuccess, "test");
        assert_eq!(done, 0, "a receive nobody sent to completed");
        std::thread::yield_now();
    }
}

/// The child side of the tests above: acts on [`common::ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn exit_child() {
    let Ok(role) = std::env::var(common::ROLE_ENV) else {
        return;
    };
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    match role.as_str() {
        "open_v12" | "open_v9" => {
            let version = if role == "open_v12" { 12 } else { 9 };
            let client = PluginClient::init(&lib, version, 1).expect("init");
            let _open = move_messages(&client);
            say("OK moved");
            std::process::exit(0);
        }
        "testing" => {
            let client = PluginClient::init(&lib, 12, 1).expect("init");
            let _open = move_messages(&client);
            // A receive nobody sends to, tested in a loop by another thread (NCCL's proxy
            // thread goes on polling while the main thread returns from the script).
            std::thread::spawn(poll_a_receive_forever);
            std::thread::sleep(Duration::from_millis(200));
            say("OK moved");
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}
