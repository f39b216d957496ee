//! Faults, through the loaded library and real processes: a peer killed at each stage of a
//! connection's life, a peer stopped with SIGSTOP (a stall), and a peer that closes cleanly
//! after its last message. Every survivor must get an error (mapped to `ncclRemoteError` or
//! `ncclSystemError` at the ABI) within `NCCL_LOSSY_TIMEOUT` plus a margin, never hang, and a
//! clean close must lose nothing.
//!
//! Each test prints one `FAULT <name>: ...` line; `cargo test --test faults -- --nocapture`
//! shows them (docs/hardening.md lists the figures).

mod common;

use std::net::TcpStream;
use std::rc::Rc;
use std::sync::Once;
use std::time::{Duration, Instant};

use common::{
    handle_from_stdin, library, message_bytes, park, post_recv, post_send, say, wait_request, Peer,
    ROLE_ENV,
};
use lossy_cli::harness::plugin_client::{ConnHandle, PluginClient, PluginLibrary};
use nccl_net_lossy::transport::socket::wire::{Handle, Hello};
use nccl_net_lossy::transport::HANDLE_WIRE_SIZE;
use nccl_net_lossy::{Error, ErrorKind};

/// `NCCL_LOSSY_TIMEOUT` of these tests, in seconds, for this process and its peers.
const TIMEOUT_S: &str = "2";
const TIMEOUT: Duration = Duration::from_secs(2);
/// Allowance on top of the timeout for a loaded 2-core machine.
const MARGIN: Duration = Duration::from_secs(8);
/// A request pending this long is a hang (the plugin never gave an answer).
const HANG: Duration = Duration::from_secs(60);
const BIG: usize = 64 << 20;
const CHILD: &str = "fault_peer";

fn env() -> [(&'static str, &'static str); 2] {
    [
        ("NCCL_LOSSY_TIMEOUT", TIMEOUT_S),
        ("NCCL_SOCKET_IFNAME", "lo"),
    ]
}

/// The library, with this process's plugin configured like its peers' (the plugin reads its
/// environment once, at the first init in the process).
fn lib() -> Rc<PluginLibrary> {
    static ENV: Once = Once::new();
    ENV.call_once(|| {
        for (k, v) in env() {
            std::env::set_var(k, v);
        }
    });
    PluginLibrary::open(&library()).expect("dlopen")
}

fn peer(role: &str) -> Peer {
    Peer::spawn(CHILD, role, &env())
}

/// The error an ABI call returned: a remote or system failure, never a success or a hang.
fn check_error(name: &str, err: &Error, since: Instant) {
    let took = since.elapsed();
    assert!(
        matches!(err.kind, ErrorKind::Remote | ErrorKind::System),
        "{name}: {err}"
    );
    assert!(took < TIMEOUT + MARGIN, "{name}: error only after {took:?}");
    println!(
        "FAULT {name}: survived, error after {} ms: {err}",
        took.as_millis()
    );
}

/// Receives `BIG` messages until one fails.
fn receive_until_error(recv: &lossy_cli::harness::plugin_client::RecvComm) -> Error {
    loop {
        let outcome = post_recv(recv, BIG, 0).and_then(|mut r| wait_request(&mut r, HANG));
        if let Err(e) = outcome {
            return e;
        }
    }
}

fn send_until_error(send: &lossy_cli::harness::plugin_client::SendComm) -> Error {
    let data = message_bytes(BIG, 1);
    loop {
        let outcome = post_send(send, data.clone(), 0).and_then(|mut r| wait_request(&mut r, HANG));
        if let Err(e) = outcome {
            return e;
        }
    }
}

/// Polls a connect or an accept until it fails; `success` is the panic message should it
/// complete, `hang` the one should it still be pending after [`HANG`].
fn poll_until_error<T>(
    mut poll: impl FnMut() -> Result<Option<T>, Error>,
    since: Instant,
    success: &str,
    hang: &str,
) -> Error {
    loop {
        match poll() {
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Ok(Some(_)) => panic!("{success}"),
            Err(e) => return e,
        }
        assert!(since.elapsed() < HANG, "{hang}");
    }
}

#[test]
fn killed_listener_before_connect() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 101).expect("init");
    let mut p = peer("listen");
    let handle = p.read_handle();
    let killed = p.kill();
    let mut connecting = client.connect(0, &handle);
    let err = poll_until_error(
        || connecting.poll(),
        killed,
        "connected to a dead listener",
        "connect hangs",
    );
    check_error("peer killed before our connect", &err, killed);
}

#[test]
fn killed_after_connect_before_accept() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 102).expect("init");
    let mut p = peer("listen");
    let handle = p.read_handle();
    let send = client
        .connect(0, &handle)
        .wait(Duration::from_secs(30))
        .expect("connect completes before the peer accepts");
    let killed = p.kill();
    let err = send_until_error(&send);
    check_error(
        "peer killed after our connect, before its accept",
        &err,
        killed,
    );
}

#[test]
fn killed_before_connecting_while_we_accept() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 103).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let mut p = peer("hang");
    p.send_handle(&handle);
    p.expect_line("READY");
    let killed = p.kill();
    let err = poll_until_error(
        || listen.poll_accept(),
        killed,
        "accepted a dead peer",
        "accept hangs",
    );
    check_error(
        "peer killed before connecting to our listener",
        &err,
        killed,
    );
}

#[test]
fn killed_mid_handshake_while_we_accept() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 104).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let mut p = peer("one_socket");
    p.send_handle(&handle);
    p.expect_line("READY");
    // Its first socket is greeted and waits for its 3 siblings.
    for _ in 0..50 {
        assert!(listen.poll_accept().expect("accept").is_none());
        std::thread::sleep(Duration::from_millis(2));
    }
    let killed = p.kill();
    let err = poll_until_error(
        || listen.poll_accept(),
        killed,
        "accepted half a connection",
        "accept hangs",
    );
    check_error(
        "peer killed after 1 of 4 sockets of its handshake",
        &err,
        killed,
    );
}

#[test]
fn killed_sender_mid_message() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 105).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let mut p = peer("send_stream");
    p.send_handle(&handle);
    let recv = listen.accept(Duration::from_secs(30)).expect("accept");
    p.expect_line("READY");
    // Receive a few messages, then kill the peer while the next one is on the wire.
    for _ in 0..2 {
        let mut r = post_recv(&recv, BIG, 0).expect("irecv");
        wait_request(&mut r, HANG).expect("message");
    }
    let mut r = post_recv(&recv, BIG, 0).expect("irecv");
    std::thread::sleep(Duration::from_millis(5));
    let killed = p.kill();
    let err = wait_request(&mut r, HANG)
        .err()
        .unwrap_or_else(|| receive_until_error(&recv));
    check_error("sending peer killed mid-message", &err, killed);
}

#[test]
fn killed_receiver_mid_message() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 106).expect("init");
    let mut p = peer("recv_stream");
    let handle = p.read_handle();
    let send = client
        .connect(0, &handle)
        .wait(Duration::from_secs(30))
        .expect("connect");
    p.expect_line("READY");
    let mut s = post_send(&send, message_bytes(BIG, 1), 0).expect("isend");
    wait_request(&mut s, HANG).expect("first message");
    let mut s = post_send(&send, message_bytes(BIG, 2), 0).expect("isend");
    std::thread::sleep(Duration::from_millis(5));
    let killed = p.kill();
    let err = wait_request(&mut s, HANG)
        .err()
        .unwrap_or_else(|| send_until_error(&send));
    check_error("receiving peer killed mid-message", &err, killed);
}

#[test]
fn killed_between_messages() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 107).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let mut p = peer("send_three");
    p.send_handle(&handle);
    let recv = listen.accept(Duration::from_secs(30)).expect("accept");
    p.expect_line("SENT");
    let killed = p.kill();
    // What it sent before dying still arrives, bit-exact; the next receive fails.
    for (i, &size) in THREE.iter().enumerate() {
        let mut r = post_recv(&recv, size + 3, 0).expect("irecv");
        wait_request(&mut r, HANG).expect("a message sent before the kill");
        let (bufs, sizes) = r.finish().expect("finish");
        assert_eq!(sizes, vec![size]);
        assert!(bufs[0][..size] == message_bytes(size, i as u64)[..]);
    }
    let err = post_recv(&recv, 100, 0)
        .and_then(|mut r| wait_request(&mut r, HANG))
        .expect_err("nothing more can come");
    check_error("peer killed between messages", &err, killed);
}

#[test]
fn clean_close_after_the_last_message_loses_nothing() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 108).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let mut p = peer("send_three_and_exit");
    p.send_handle(&handle);
    let recv = listen.accept(Duration::from_secs(30)).expect("accept");
    assert!(p.wait().success(), "the peer closes and exits cleanly");
    for (i, &size) in THREE.iter().enumerate() {
        let mut r = post_recv(&recv, size, 0).expect("irecv after the peer closed");
        wait_request(&mut r, HANG).expect("delivered");
        let (bufs, sizes) = r.finish().expect("finish");
        assert_eq!(sizes, vec![size]);
        assert!(bufs[0][..size] == message_bytes(size, i as u64)[..]);
    }
    println!("FAULT clean close after the last message: 3 messages delivered bit-exact");
}

#[test]
fn stopped_sender_times_out() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 109).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let mut p = peer("send_stream");
    p.send_handle(&handle);
    let recv = listen.accept(Duration::from_secs(30)).expect("accept");
    p.expect_line("READY");
    let mut r = post_recv(&recv, BIG, 0).expect("irecv");
    wait_request(&mut r, HANG).expect("message");
    p.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let err = receive_until_error(&recv);
    assert!(
        stopped.elapsed() >= TIMEOUT,
        "failed before the timeout: {err}"
    );
    check_error("sending peer stopped (SIGSTOP)", &err, stopped);
    drop(p); // SIGCONT, SIGKILL, reap
}

#[test]
fn stopped_receiver_times_out() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 110).expect("init");
    let mut p = peer("recv_stream");
    let handle = p.read_handle();
    let send = client
        .connect(0, &handle)
        .wait(Duration::from_secs(30))
        .expect("connect");
    p.expect_line("READY");
    let mut s = post_send(&send, message_bytes(BIG, 1), 0).expect("isend");
    wait_request(&mut s, HANG).expect("message");
    p.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let err = send_until_error(&send);
    check_error(
        "receiving peer stopped (SIGSTOP, stops reading)",
        &err,
        stopped,
    );
    drop(p);
}

#[test]
fn a_malformed_timeout_fails_init_loudly_naming_the_variable() {
    let (stdout, stderr) = init_only_with("NCCL_LOSSY_TIMEOUT", "ten".as_ref());
    assert!(
        stdout.contains("INIT failed"),
        "init succeeded:\n{stdout}\n{stderr}"
    );
    // On stderr whatever NCCL does with its log: a silent fallback cannot hide it.
    assert!(
        stderr.contains("NCCL_LOSSY_TIMEOUT=ten is not valid")
            && stderr.contains("0 or unset: off"),
        "{stderr}"
    );
}

/// Runs the plugin's `init` alone in a child process with `name=value` set: its stdout and
/// stderr.
fn init_only_with(name: &str, value: &std::ffi::OsStr) -> (String, String) {
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            CHILD,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, "init_only")
        .env(name, value)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .output()
        .expect("run the peer");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_value_that_is_not_utf8_fails_init_naming_the_variable() {
    use std::os::unix::ffi::OsStrExt;
    for name in [
        "NCCL_LOSSY_TIMEOUT",
        "NCCL_LOSSY_NSOCKS",
        "NCCL_LOSSY_TRACE",
        "NCCL_LOSSY_TRACE_EVENTS",
        "NCCL_LOSSY_INNER",
        "NCCL_LOSSY_SOCKBUF",
    ] {
        let (stdout, stderr) = init_only_with(name, std::ffi::OsStr::from_bytes(b"\xff10"));
        // Treated as unset, init would succeed: a run that asked to wrap a plugin would
        // silently run over the plugin's own sockets.
        assert!(
            stdout.contains("INIT failed"),
            "{name}: init succeeded:\n{stdout}\n{stderr}"
        );
        assert!(
            stderr.contains(&format!("{name} is not valid UTF-8")),
            "{name}: {stderr}"
        );
    }
}

/// Sizes the `send_three` peers send: odd, zero and multi-socket.
const THREE: [usize; 3] = [1001, 0, 300_001];

/// The peer process of these tests: its role comes from [`ROLE_ENV`].
#[test]
#[ignore = "the peer process of the fault tests, started by them"]
fn fault_peer() {
    if common::init_child::serve() {
        return;
    }
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 900).expect("init");
    let wait = Duration::from_secs(60);
    match role.as_str() {
        "listen" => {
            let (handle, _listen) = client.listen(0).expect("listen");
            say(&format!("HANDLE {}", common::hex(&handle)));
            park();
        }
        "recv_stream" => {
            let (handle, mut listen) = client.listen(0).expect("listen");
            say(&format!("HANDLE {}", common::hex(&handle)));
            let recv = listen.accept(wait).expect("accept");
            say("READY");
            loop {
                let mut r = post_recv(&recv, BIG, 0).expect("irecv");
                wait_request(&mut r, Duration::from_secs(3600)).expect("receive");
            }
        }
        "send_stream" => {
            let send = client
                .connect(0, &handle_from_stdin())
                .wait(wait)
                .expect("connect");
            say("READY");
            let data = message_bytes(BIG, 1);
            loop {
                let mut s = post_send(&send, data.clone(), 0).expect("isend");
                wait_request(&mut s, Duration::from_secs(3600)).expect("send");
            }
        }
        "send_three" | "send_three_and_exit" => {
            let send = client
                .connect(0, &handle_from_stdin())
                .wait(wait)
                .expect("connect");
            for (i, &size) in THREE.iter().enumerate() {
                let mut s = post_send(&send, message_bytes(size, i as u64), 0).expect("isend");
                wait_request(&mut s, wait).expect("send");
            }
            if role == "send_three" {
                say("SENT");
                park();
            }
            send.close().expect("closeSend");
            client.finalize().expect("finalize");
        }
        "hang" => {
            let _handle = handle_from_stdin();
            say("READY");
            park();
        }
        "one_socket" => {
            let handle: ConnHandle = handle_from_stdin();
            let wire: [u8; HANDLE_WIRE_SIZE] =
                handle[..HANDLE_WIRE_SIZE].try_into().expect("wire part");
            let h = Handle::decode(&wire).expect("our handle");
            let hello = Hello {
                nonce: h.nonce,
                conn_id: 77,
                index: 0,
                count: 4,
            };
            let mut s = TcpStream::connect(h.addr).expect("connect");
            std::io::Write::write_all(&mut s, &hello.encode()).expect("hello");
            say("READY");
            park();
        }
        other => panic!("unknown role {other}"),
    }
}
