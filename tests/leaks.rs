//! 1000 listen/connect/accept/close cycles through the loaded library leave no thread and no
//! file descriptor behind. Alone in its test binary, so no other test's threads are counted.

mod common;

use std::time::Duration;

use common::library;
use nccl_net_lossy::harness::plugin_client::{establish, PluginClient, PluginLibrary};

fn entries(dir: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.count())
        .expect("read /proc")
}

fn cycle(client: &PluginClient) {
    let (handle, mut listen) = client.listen(0).expect("listen");
    let (send, recv) = establish(
        client.connect(0, &handle),
        &mut listen,
        Duration::from_secs(10),
    )
    .expect("connect and accept");
    send.close().expect("closeSend");
    recv.close().expect("closeRecv");
    listen.close().expect("closeListen");
}

#[test]
fn a_thousand_open_close_cycles_leak_no_threads_or_fds() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    // First use builds the plugin's process-wide state; count after it.
    let warm = PluginClient::init(&lib, 12, 1).expect("init");
    cycle(&warm);
    warm.finalize().expect("finalize");
    drop(warm);
    let (threads, fds) = (entries("/proc/self/task"), entries("/proc/self/fd"));
    for round in 0..10u64 {
        // A fresh context every 100 cycles, as a new communicator would get (v11+), and the
        // older, context-free ABI on some rounds.
        let version = if round % 3 == 2 { 9 } else { 12 };
        let client = PluginClient::init(&lib, version, round + 2).expect("init");
        for _ in 0..100 {
            cycle(&client);
        }
        client.finalize().expect("finalize");
    }
    assert_eq!(entries("/proc/self/task"), threads, "threads leaked");
    assert_eq!(entries("/proc/self/fd"), fds, "file descriptors leaked");
}
