//! Listen/connect/accept/send/close cycles through the loaded library leave no thread, no
//! file descriptor, no socket and no memory behind, counted from /proc and from the
//! allocator. Each test runs its cycles in a process of its own (this binary again, with the
//! ignored test `leaks_child`), started with exact heap accounting (`common::EXACT_HEAP_ENV`),
//! so that the heap in use is known to the byte and no other test's threads are counted.
//!
//! The 1,000-cycle run is part of `cargo test`; the 10,000-cycle one is ignored by default:
//! `cargo test --release --test leaks -- --ignored --nocapture`.

mod common;

use std::time::{Duration, Instant};

use common::{
    heap_in_use, library, message_bytes, post_recv, post_send, say, wait_request, Peer,
    EXACT_HEAP_ENV, ROLE_ENV,
};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary, RecvComm, SendComm};

const CHILD: &str = "leaks_child";
/// Tells the child how many cycles to run.
const CYCLES_ENV: &str = "LOSSY_TEST_LEAK_CYCLES";

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.count())
        .expect("read /proc")
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
        sockets: common::sockets(),
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

/// One connection's life; it moves a message when `message` is set (17 or 300,001 bytes,
/// multi-socket every other time, so the data path's buffers are part of what must come back).
fn cycle(client: &PluginClient, i: usize, message: bool) {
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(10))
        .expect("connect and accept");
    if message {
        one_message(&send, &recv, i);
    }
    // Both close orders.
    if i % 2 == 0 {
        send.close().expect("closeSend");
        recv.close().expect("closeRecv");
    } else {
        recv.close().expect("closeRecv");
        send.close().expect("closeSend");
    }
}

fn one_message(send: &SendComm, recv: &RecvComm, i: usize) {
    let size = if i % 2 == 0 { 300_001 } else { 17 };
    let mut r = post_recv(recv, size, 1).expect("irecv");
    let mut s = post_send(send, message_bytes(size, i as u64), 1).expect("isend");
    wait_request(&mut s, Duration::from_secs(30)).expect("send");
    wait_request(&mut r, Duration::from_secs(30)).expect("recv");
    s.finish().expect("send done");
    let (bufs, _) = r.finish().expect("recv done");
    assert!(bufs[0][..] == message_bytes(size, i as u64)[..]);
}

/// `cycles` connections in rounds of 100, each round with a fresh context, as a new
/// communicator would get (v11+), and the older, context-free ABI on some rounds; one cycle
/// in 10 moves a message when `messages` is set.
fn rounds(lib: &std::rc::Rc<PluginLibrary>, cycles: usize, messages: bool, first_id: u64) {
    let per_client = 100;
    for round in 0..cycles.div_ceil(per_client) {
        let version = if round % 3 == 2 { 9 } else { 12 };
        let client = PluginClient::init(lib, version, first_id + round as u64).expect("init");
        for i in 0..per_client.min(cycles - round * per_client) {
            cycle(&client, i, messages && i % 10 == 0);
        }
        client.finalize().expect("finalize");
    }
}

/// The heap may differ by this much between two readings with nothing leaked: the
/// allocator's jitter is under 100 bytes (common::EXACT_HEAP_ENV), and a few process-wide
/// vectors may have to grow once more. A leak is at least one malloc chunk (32 bytes on
/// 64-bit glibc, whatever the allocation's size), so one small allocation per cycle is 32,000
/// bytes over 1,000 cycles, 31 times this bound: it fails, and so does one every 32 cycles.
const HEAP_JITTER: usize = 1024;

fn open_close(cycles: usize) -> String {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    // First use builds the plugin's process-wide state; count after it, and after a round of
    // warm-up cycles so the allocator has reached its working set.
    rounds(&lib, 300, true, 1);
    let before = settled(None);
    let rss_before = rss_kib();
    let start = Instant::now();

    // (a) Connections without a message: nothing is kept for them, so the heap comes back
    // to the byte (within HEAP_JITTER).
    let heap_before = heap_in_use();
    rounds(&lib, cycles, false, 1000);
    let heap_after_conns = heap_in_use();

    // (b) Messages: `cycles` of them on one connection pair (statistics of one connection
    // have a fixed size once each size was seen), so the data path must give back all it
    // took, per message.
    let client = PluginClient::init(&lib, 12, 1 << 20).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(10))
        .expect("connect and accept");
    for i in 0..20 {
        one_message(&send, &recv, i);
    }
    let heap_before_msgs = heap_in_use();
    for i in 0..cycles {
        one_message(&send, &recv, i);
    }
    let heap_after_msgs = heap_in_use();
    send.close().expect("closeSend");
    recv.close().expect("closeRecv");
    client.finalize().expect("finalize");
    drop(client);

    // (c) The mix, as before: one connection in 10 moves a message and keeps its statistics
    // snapshot for the statistics file (about 1 KiB; RSS bound below).
    rounds(&lib, cycles, true, 1 << 30);
    let took = start.elapsed();
    let after = settled(Some(before));
    let rss_after = rss_kib();
    assert_eq!(after, before, "threads, fds or sockets leaked");
    let conns = heap_after_conns.abs_diff(heap_before);
    assert!(
        conns < HEAP_JITTER,
        "heap went from {heap_before} to {heap_after_conns} bytes over {cycles} \
         listen/connect/accept/close cycles"
    );
    let msgs = heap_after_msgs.abs_diff(heap_before_msgs);
    assert!(
        msgs < HEAP_JITTER,
        "heap went from {heap_before_msgs} to {heap_after_msgs} bytes over {cycles} messages"
    );
    let growth = rss_after.saturating_sub(rss_before);
    // What may stay: the statistics of each closed connection that sent something (about
    // 1 KiB, one cycle in 10 of (c)), for the statistics file.
    assert!(
        growth < 1024 + cycles as u64 / 2,
        "RSS grew by {growth} KiB over {cycles} cycles"
    );
    format!(
        "{cycles} open/close cycles, {cycles} messages and {cycles} mixed cycles in {:.1} s: \
         threads {} -> {}, fds {} -> {}, sockets {} -> {}, heap {conns} bytes apart after the \
         cycles, {msgs} after the messages, RSS {rss_before} -> {rss_after} KiB",
        took.as_secs_f64(),
        before.threads,
        after.threads,
        before.fds,
        after.fds,
        before.sockets,
        after.sockets
    )
}

/// `cycles` loads of the library, as NCCL loads it for its first communicator and unloads
/// it (`dlclose`) when the last one goes: init, a connection with a message, finalize,
/// unload. The heap must come back each time: a static's heap memory (the logger, the
/// statistics registry, the live lists) outlives an unloaded image unless freed at unload.
fn load_unload(cycles: usize) -> String {
    let once = |i: usize| {
        let lib = PluginLibrary::open(&library()).expect("dlopen");
        let client = PluginClient::init(&lib, 12, 7 + i as u64).expect("init");
        cycle(&client, i, true);
        client.finalize().expect("finalize");
        drop(client);
        drop(lib);
    };
    // The allocator's working set, and the harness's own first-use state.
    for i in 0..5 {
        once(i);
    }
    let before = heap_in_use();
    for i in 0..cycles {
        once(i);
    }
    let after = heap_in_use();
    // Before the unload freed them, each load left about 2-4 KiB behind (the statistics
    // registry's entry, the profile, the logger, the live lists): 200 KiB over 100 loads,
    // 200 times this bound.
    assert!(
        after.abs_diff(before) < HEAP_JITTER,
        "heap went from {before} to {after} bytes over {cycles} loads and unloads"
    );
    format!("{cycles} loads and unloads: heap {before} -> {after} bytes")
}

/// `cycles` connections closed abruptly, with requests outstanding, as an abort closes them:
/// sends queued beyond what one `test` moves, a receive posted, both closes in either order.
/// Threads, descriptors and sockets must come back (the abandoned requests' buffers are the
/// harness's, leaked on purpose, so the heap is not compared).
fn abrupt(cycles: usize) -> String {
    // As on a big node: pool threads and several sockets per connection (read at the first
    // init of this fresh process).
    std::env::set_var("NCCL_LOSSY_IO_THREADS", "2");
    std::env::set_var("NCCL_LOSSY_NSOCKS", "4");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    rounds(&lib, 20, true, 1);
    let before = settled(None);
    let size = 64 << 10;
    for round in 0..cycles.div_ceil(50) {
        let client = PluginClient::init(&lib, 12, 100 + round as u64).expect("init");
        for i in 0..50.min(cycles - round * 50) {
            let (send, recv) = client
                .local_pair(0, Duration::from_secs(10))
                .expect("connect and accept");
            let mut r = post_recv(&recv, size, 1).expect("irecv");
            let mut sends: Vec<_> = (0..3)
                .map(|k| post_send(&send, message_bytes(size, k), 1).expect("isend"))
                .collect();
            for s in &mut sends {
                let _ = s.test();
            }
            let _ = r.test();
            if i % 2 == 0 {
                send.close().expect("closeSend with sends outstanding");
                recv.close().expect("closeRecv with a receive outstanding");
            } else {
                recv.close().expect("closeRecv with a receive outstanding");
                send.close().expect("closeSend with sends outstanding");
            }
        }
        client.finalize().expect("finalize");
    }
    let after = settled(Some(before));
    assert_eq!(after, before, "threads, fds or sockets leaked");
    format!(
        "{cycles} abrupt closes: threads {} -> {}, fds {} -> {}, sockets {} -> {}",
        before.threads, after.threads, before.fds, after.fds, before.sockets, after.sockets
    )
}

/// Runs `cycles` in a fresh process with exact heap accounting.
fn run(cycles: usize) {
    run_role("cycles", cycles);
}

/// Runs `role` with `cycles` in a fresh process with exact heap accounting.
fn run_role(role: &str, cycles: usize) {
    let cycles = cycles.to_string();
    let mut peer = Peer::spawn(
        CHILD,
        role,
        &[
            ("NCCL_SOCKET_IFNAME", "lo"),
            (CYCLES_ENV, &cycles),
            EXACT_HEAP_ENV,
        ],
    );
    let said = peer.expect_line("LEAKS");
    let status = peer.wait();
    assert!(status.success(), "the child failed: {status}");
    println!("LEAKS {said}");
}

#[test]
fn a_thousand_open_close_cycles_leak_nothing() {
    run(1_000);
}

#[test]
fn closing_with_requests_outstanding_leaks_no_thread_or_descriptor() {
    run_role("abrupt", 200);
}

#[test]
fn loading_and_unloading_the_library_leaks_nothing() {
    run_role("unload", 100);
}

#[test]
#[ignore = "long: cargo test --release --test leaks -- --ignored --nocapture"]
fn ten_thousand_open_close_cycles_leak_nothing() {
    run(10_000);
}

/// The process the tests above start: acts on [`ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn leaks_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let cycles: usize = std::env::var(CYCLES_ENV)
        .expect("cycles")
        .parse()
        .expect("a number");
    let said = match role.as_str() {
        "cycles" => open_close(cycles),
        "unload" => load_unload(cycles),
        "abrupt" => abrupt(cycles),
        other => panic!("unknown role {other}"),
    };
    say(&format!("LEAKS {said}"));
}
