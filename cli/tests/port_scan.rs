//! A port scan against a real listener of the loaded library: 2,000 connections that open and
//! close without a byte. Each is dropped, but the log gets a handful of lines per reason and
//! interval, not one per connection, and the listener goes on serving a real peer.

mod common;

use std::fs::File;
use std::io::Read;
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

use common::{library, message_bytes, post_recv, post_send, say, wait_request, Peer, ROLE_ENV};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use nccl_net_lossy::transport::socket::wire::Handle;
use nccl_net_lossy::transport::HANDLE_WIRE_SIZE;

const CHILD: &str = "scanned_listener";
const SCANS: usize = 2000;
/// Lines allowed for the whole scan: a few per reason per 10 s interval (the scan takes a
/// few seconds: at most two intervals), far below one per connection.
const MAX_LINES: usize = 40;

#[test]
fn a_port_scan_logs_a_few_lines_not_one_per_connection() {
    let log_path = common::fresh_dir("port-scan").join("listener.log");
    let log = File::create(&log_path).expect("log file");
    let mut p = Peer::spawn_with_stderr(
        CHILD,
        "listener",
        &[("NCCL_SOCKET_IFNAME", "lo")],
        Stdio::from(log),
    );
    let handle = p.read_handle();
    let wire: [u8; HANDLE_WIRE_SIZE] = handle[..HANDLE_WIRE_SIZE].try_into().expect("wire");
    let addr = Handle::decode(&wire).expect("a handle of ours").addr;
    for _ in 0..SCANS {
        drop(TcpStream::connect(addr).expect("scan connect"));
    }
    // A real peer after the scan.
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 1).expect("init");
    let send = client
        .connect(0, &handle)
        .wait(Duration::from_secs(30))
        .expect("the real peer connects");
    let mut s = post_send(&send, message_bytes(4096, 5), 0).expect("isend");
    wait_request(&mut s, Duration::from_secs(30)).expect("sent");
    assert_eq!(p.expect_line("RECV"), "ok 4096");
    drop(p);
    let mut text = String::new();
    File::open(&log_path)
        .expect("log")
        .read_to_string(&mut text)
        .expect("read log");
    let lines = text
        .lines()
        .filter(|l| l.contains("dropping connection"))
        .count();
    assert!(lines > 0, "the scan was not logged at all:\n{text}");
    assert!(
        lines <= MAX_LINES,
        "{lines} log lines for {SCANS} scanned connections (at most {MAX_LINES})"
    );
    println!("PORT SCAN {SCANS} connections: {lines} log lines; listener served on");
    std::fs::remove_dir_all(log_path.parent().expect("dir")).ok();
}

/// The listening peer: accepts until a real connection arrives, receives one message on it.
#[test]
#[ignore = "run by the other test of this file in a process of its own"]
fn scanned_listener() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    assert_eq!(role, "listener");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 2).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    say(&format!("HANDLE {}", common::hex(&handle)));
    let recv = loop {
        match listen.poll_accept().expect("accept") {
            Some(recv) => break recv,
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    let mut r = post_recv(&recv, 4096, 0).expect("irecv");
    wait_request(&mut r, Duration::from_secs(30)).expect("recv");
    let (bufs, sizes) = r.finish().expect("recv done");
    assert!(bufs[0][..sizes[0]] == message_bytes(4096, 5)[..]);
    say(&format!("RECV ok {}", sizes[0]));
    common::park();
}
