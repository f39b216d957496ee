//! Listen/connect/accept/send/close cycles through the loaded library leave no thread, no
//! file descriptor, no socket and no memory behind, counted from /proc. Alone in its test
//! binary, and its tests run one at a time, so no other test's threads are counted.
//!
//! The 1,000-cycle run is part of `cargo test`; the 10,000-cycle one is ignored by default:
//! `cargo test --release --test leaks -- --ignored --nocapture`.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{library, message_bytes, post_recv, post_send, wait_request};
use lossy_cli::harness::plugin_client::{establish, PluginClient, PluginLibrary};

/// The tests of this file count the whole process: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.count())
        .expect("read /proc")
}

fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("socket:"))
        .count()
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Counts {
    threads: usize,
    fds: usize,
    sockets: usize,
}

fn counts() -> Counts {
    Counts {
        threads: entries("/proc/self/task"),
        fds: entries("/proc/self/fd"),
        sockets: sockets(),
    }
}

/// The counts once they stop changing: a joined thread may linger in /proc for a moment.
fn settled(want: Option<Counts>) -> Counts {
    let start = Instant::now();
    let mut last = counts();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = counts();
        if (now == last && want.is_none()) || Some(now) == want {
            return now;
        }
        if start.elapsed() > Duration::from_secs(3) {
            return now;
        }
        last = now;
    }
}

fn cycle(client: &PluginClient, i: usize) {
    let (handle, mut listen) = client.listen(0).expect("listen");
    let (send, recv) = establish(
        client.connect(0, &handle),
        &mut listen,
        Duration::from_secs(10),
    )
    .expect("connect and accept");
    if i % 10 == 0 {
        // Some cycles move a message, multi-socket every other time, so the data path's
        // buffers are part of what must come back.
        let size = if i % 20 == 0 { 300_001 } else { 17 };
        let mut r = post_recv(&recv, size, 1).expect("irecv");
        let mut s = post_send(&send, message_bytes(size, i as u64), 1).expect("isend");
        wait_request(&mut s, Duration::from_secs(30)).expect("send");
        wait_request(&mut r, Duration::from_secs(30)).expect("recv");
        s.finish().expect("send done");
        let (bufs, _) = r.finish().expect("recv done");
        assert!(bufs[0][..] == message_bytes(size, i as u64)[..]);
    }
    // Both close orders.
    if i % 2 == 0 {
        send.close().expect("closeSend");
        recv.close().expect("closeRecv");
    } else {
        recv.close().expect("closeRecv");
        send.close().expect("closeSend");
    }
    listen.close().expect("closeListen");
}

fn open_close(cycles: usize) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    // First use builds the plugin's process-wide state; count after it, and after a round of
    // warm-up cycles so the allocator has reached its working set.
    let warm = PluginClient::init(&lib, 12, 1).expect("init");
    for i in 0..100 {
        cycle(&warm, i);
    }
    warm.finalize().expect("finalize");
    drop(warm);
    let before = settled(None);
    let rss_before = rss_kib();
    let start = Instant::now();
    let per_client = 100;
    for round in 0..cycles / per_client {
        // A fresh context every 100 cycles, as a new communicator would get (v11+), and the
        // older, context-free ABI on some rounds.
        let version = if round % 3 == 2 { 9 } else { 12 };
        let client = PluginClient::init(&lib, version, round as u64 + 2).expect("init");
        for i in 0..per_client {
            cycle(&client, i);
        }
        client.finalize().expect("finalize");
    }
    let took = start.elapsed();
    let after = settled(Some(before));
    let rss_after = rss_kib();
    assert_eq!(after, before, "threads, fds or sockets leaked");
    let growth = rss_after.saturating_sub(rss_before);
    // What may stay: the statistics of each closed connection that sent something (about
    // 1 KiB, one cycle in 10), for the statistics file. A leak of 1 KiB per cycle would
    // exceed the bound over the 10,000 cycles.
    assert!(
        growth < 1024 + cycles as u64 / 2,
        "RSS grew by {growth} KiB over {cycles} cycles"
    );
    println!(
        "LEAKS {cycles} open/close cycles in {:.1} s: threads {} -> {}, fds {} -> {}, sockets \
         {} -> {}, RSS {rss_before} -> {rss_after} KiB",
        took.as_secs_f64(),
        before.threads,
        after.threads,
        before.fds,
        after.fds,
        before.sockets,
        after.sockets
    );
}

#[test]
fn a_thousand_open_close_cycles_leak_nothing() {
    open_close(1_000);
}

#[test]
#[ignore = "long: cargo test --release --test leaks -- --ignored --nocapture"]
fn ten_thousand_open_close_cycles_leak_nothing() {
    open_close(10_000);
}
