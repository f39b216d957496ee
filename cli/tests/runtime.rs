//! The plugin's runtime over its whole life, driven through `dlopen` the way NCCL does: built at
//! the first `init`, released at the last `finalize`, and built again by the next `init`.
//!
//! Each test runs in a fresh process of its own (this binary run again with the ignored test
//! `runtime_child`, as in `common::Peer`), because what it checks is process-wide: whether an
//! earlier failure is remembered, and the threads, descriptors and heap of the whole process.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    heap_in_use, library, message_bytes, post_recv, post_send, say, wait_request, Peer, ROLE_ENV,
};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};

const CHILD: &str = "runtime_child";

/// Runs `role` in a fresh process with `env` and expects it to say `OK` and exit cleanly.
fn run_child(role: &str, env: &[(&str, &str)]) -> String {
    let mut all = vec![("NCCL_SOCKET_IFNAME", "lo")];
    all.extend_from_slice(env);
    let mut peer = Peer::spawn(CHILD, role, &all);
    let said = peer.expect_line("OK");
    let status = peer.wait();
    assert!(status.success(), "{role}: the child failed: {status}");
    said
}

#[test]
fn an_init_that_failed_on_a_bad_profile_succeeds_once_the_profile_is_fixed() {
    let dir = common::fresh_dir("runtime-profile");
    let profile = dir.join("profile.toml");
    let path = profile.to_str().expect("utf-8 path");
    run_child("bad-profile", &[("NCCL_LOSSY_PROFILE", path)]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_thousand_init_finalize_cycles_leave_threads_fds_and_heap_at_baseline() {
    let dir = common::fresh_dir("runtime-cycles");
    let profile = dir.join("profile.toml");
    // A short statistics interval, so every connection starts (and its close joins) the
    // periodic writer, and statistics files are written at each release.
    std::fs::write(&profile, "stats_interval = 0.1\n").expect("write the profile");
    let stats = dir.join("stats");
    let said = run_child(
        "cycles",
        &[
            ("NCCL_LOSSY_PROFILE", profile.to_str().expect("utf-8")),
            ("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8")),
            // Exact heap accounting: one arena, no per-thread cache of freed chunks.
            common::EXACT_HEAP_ENV,
        ],
    );
    println!("{said}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_connect_abandoned_at_finalize_does_not_answer_a_later_connect_at_the_same_address() {
    run_child("abandoned", &[]);
}

/// The peer side of every test above: acts on [`ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn runtime_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    match role.as_str() {
        "bad-profile" => bad_profile(),
        "cycles" => cycles(),
        "abandoned" => abandoned(),
        other => panic!("unknown role {other}"),
    }
}

// ---- (a) a failed init is not remembered -------------------------------------------------------

fn bad_profile() {
    let path = std::env::var("NCCL_LOSSY_PROFILE").expect("NCCL_LOSSY_PROFILE");
    std::fs::write(&path, "effect = \"drop\"\n").expect("write the broken profile");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    for version in [12, 9] {
        let err = PluginClient::init(&lib, version, 1)
            .err()
            .unwrap_or_else(|| panic!("v{version}: init accepted a broken profile"));
        println!("v{version}: init refused the broken profile: {err}");
    }
    // The user fixes the file; NCCL initialises again in the same process.
    std::fs::write(&path, "effect = \"zero\"\n").expect("write the fixed profile");
    for version in [12, 9] {
        let client = PluginClient::init(&lib, version, 2)
            .unwrap_or_else(|e| panic!("v{version}: init after the fix: {e}"));
        one_message(&client, 1000, version.into());
        client.finalize().expect("finalize");
    }
    say("OK bad profile, then fixed: init succeeds");
}

/// Connects to a new listener of `client`, moves one message of `size` bytes, closes all.
fn one_message(client: &PluginClient, size: usize, seed: u64) {
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(10))
        .expect("connect and accept");
    let mut r = post_recv(&recv, size, 7).expect("irecv");
    let mut s = post_send(&send, message_bytes(size, seed), 7).expect("isend");
    wait_request(&mut s, Duration::from_secs(30)).expect("send");
    wait_request(&mut r, Duration::from_secs(30)).expect("recv");
    s.finish().expect("send done");
    let (bufs, _) = r.finish().expect("recv done");
    assert_eq!(bufs[0].len(), size);
    send.close().expect("closeSend");
    recv.close().expect("closeRecv");
}

// ---- (b) init/finalize cycles leave nothing behind ---------------------------------------------

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.count())
        .expect("read /proc")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Counts {
    threads: usize,
    fds: usize,
}

fn counts() -> Counts {
    Counts {
        threads: entries("/proc/self/task"),
        fds: entries("/proc/self/fd"),
    }
}

/// The counts once they equal `want` (a joined thread may linger in /proc for a moment).
fn settled(want: Counts) -> Counts {
    let start = Instant::now();
    loop {
        let now = counts();
        if now == want || start.elapsed() > Duration::from_secs(3) {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One communicator's life: init, a connection opened and closed (one cycle in four),
/// finalize. No message is sent, so no statistics are kept for its connection.
fn cycle(lib: &std::rc::Rc<PluginLibrary>, i: usize) {
    let client = PluginClient::init(lib, 12, i as u64 + 1).expect("init");
    if i % 4 == 0 {
        let (send, recv) = client
            .local_pair(0, Duration::from_secs(10))
            .expect("connect and accept");
        if i % 8 == 0 {
            send.close().expect("closeSend");
            recv.close().expect("closeRecv");
        } else {
            recv.close().expect("closeRecv");
            send.close().expect("closeSend");
        }
    }
    client.finalize().expect("finalize");
}

fn cycles() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    // Warm-up: the allocator reaches its working set and the few things that are
    // process-wide by design are made once (the log sink, the statistics registry and the
    // profile it reports, the library's thread-local blocks, the thread stack cache).
    for i in 0..50 {
        cycle(&lib, i);
    }
    let before = counts();
    let heap_before = heap_in_use();
    // One communicator watched closely: its init builds the runtime (the previous finalize
    // released it), its finalize frees all of it.
    let client = PluginClient::init(&lib, 12, 1 << 40).expect("init");
    let heap_alive = heap_in_use();
    client.finalize().expect("finalize");
    drop(client);
    let heap_released = heap_in_use();
    let start = Instant::now();
    const CYCLES: usize = 1000;
    for i in 50..50 + CYCLES {
        cycle(&lib, i);
    }
    let took = start.elapsed();
    let after = settled(before);
    let heap_after = heap_in_use();
    assert_eq!(after, before, "threads or fds held after the last finalize");
    // Heap bytes in use are exact here: the parent runs this process with one malloc arena
    // and no per-thread cache (GLIBC_TUNABLES), so mallinfo2 counts every live chunk and
    // nothing else (observed jitter between two calls: under 100 bytes). Bounds:
    // - a runtime is real memory: the resolved profile, its JSON form, the device list, the
    //   loss engine (about 1.6 KiB with this small profile); a context alone is about 160
    //   bytes. So
    //   an init that builds one grows the heap by well over 1 KiB, and an init that finds the
    //   runtime still alive (nothing released at the last finalize) does not.
    // - released is released: after that finalize the heap is back where it was, within
    //   256 bytes (jitter), not one runtime's worth.
    // - cycles leak nothing: a leak of anything per cycle is at least one malloc chunk (32
    //   bytes on 64-bit glibc), 32,000 bytes over the 1,000 cycles; 1 KiB is only jitter
    //   (a leak of one chunk every 32 cycles would still fail).
    let built = heap_alive.saturating_sub(heap_before);
    assert!(
        built > 1024,
        "init grew the heap by only {built} bytes: no runtime was built, so the previous \
         finalize released nothing"
    );
    assert!(
        heap_released.abs_diff(heap_before) < 256,
        "finalize left {heap_released} bytes in use, {heap_before} before its init"
    );
    assert!(
        heap_after.abs_diff(heap_before) < 1024,
        "heap went from {heap_before} to {heap_after} bytes over {CYCLES} init/finalize cycles"
    );
    let stats_dir = std::env::var("NCCL_LOSSY_STATS").expect("NCCL_LOSSY_STATS");
    let files = std::fs::read_dir(Path::new(&stats_dir))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(
        files, 1,
        "one statistics file per process, written at each release"
    );
    say(&format!(
        "OK {CYCLES} init/finalize cycles in {:.1} s: threads {} -> {}, fds {} -> {}, heap \
         {heap_before} -> {heap_after} bytes (a runtime: {built} bytes)",
        took.as_secs_f64(),
        before.threads,
        after.threads,
        before.fds,
        after.fds
    ));
}

// ---- (c) a connect abandoned at finalize is gone -----------------------------------------------

/// Abandons `n` connects in progress on `client`: each to a listener that was closed, so its
/// first `connect` call is refused and the plugin keeps it to try again.
fn abandon_connects(client: &PluginClient, n: usize) {
    let (dead, listen) = client.listen(0).expect("listen");
    listen.close().expect("closeListen");
    let mut pending = Vec::new();
    for _ in 0..n {
        let mut connecting = client.connect(0, &dead);
        assert!(
            connecting
                .poll()
                .expect("a refused connect is retried")
                .is_none(),
            "a connect to a closed listener finished"
        );
        pending.push(connecting);
    }
    // NCCL gives up on them: their handle memory is freed, and `finalize` comes next.
    drop(pending);
}

/// `n` connects of `client`, each to a live listener: the handle memory of each is likely the
/// memory an abandoned connect used (the allocator hands freed blocks of one size back first).
fn fresh_connects(client: &PluginClient, n: usize) {
    for i in 0..n {
        let (send, recv) = client
            .local_pair(0, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("connect {i} after the abandoned ones: {e}"));
        let mut r = post_recv(&recv, 64, 3).expect("irecv");
        let mut s = post_send(&send, message_bytes(64, i as u64), 3).expect("isend");
        wait_request(&mut s, Duration::from_secs(10)).expect("send");
        wait_request(&mut r, Duration::from_secs(10)).expect("recv");
        s.finish().expect("send done");
        let (bufs, _) = r.finish().expect("recv done");
        assert!(
            bufs[0][..] == message_bytes(64, i as u64)[..],
            "connect {i}"
        );
        send.close().expect("closeSend");
        recv.close().expect("closeRecv");
    }
}

fn abandoned() {
    const N: usize = 32;
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    // Another communicator keeps the runtime alive: only the abandoning context ends.
    let keeper = PluginClient::init(&lib, 12, 100).expect("init");
    let first = PluginClient::init(&lib, 12, 1).expect("init");
    abandon_connects(&first, N);
    first.finalize().expect("finalize");
    drop(first);
    let second = PluginClient::init(&lib, 12, 2).expect("init");
    fresh_connects(&second, N);
    second.finalize().expect("finalize");
    keeper.finalize().expect("finalize");
    drop((second, keeper));
    // The last finalize releases the runtime; the next init builds a new one.
    let third = PluginClient::init(&lib, 12, 3).expect("init");
    abandon_connects(&third, N);
    third.finalize().expect("finalize");
    drop(third);
    let fourth = PluginClient::init(&lib, 12, 4).expect("init");
    fresh_connects(&fourth, N);
    fourth.finalize().expect("finalize");
    say("OK abandoned connects do not answer later ones");
}
