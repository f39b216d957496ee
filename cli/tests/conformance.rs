//! Where NCCL relies on how its own net plugins behave, ours behaves the same, checked
//! through `dlopen`, real sockets and real processes: the `maxRecvs` it advertises and the
//! interleaved tags NCCL's proxy sends, teardown while the other side still posts, and an
//! accepting process that is out of file descriptors.

mod common;

use std::time::{Duration, Instant};

use common::{launch_job, library, message_bytes, park, post_recv, say, Peer, ROLE_ENV};
use lossy_cli::harness::plugin_client::{
    PluginClient, PluginLibrary, Posted, RequestFifo, SendComm,
};
use lossy_cli::harness::worker::{Job, Task};
use nccl_net_lossy::ErrorKind;

#[test]
fn max_recvs_is_one_at_every_abi_version() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    for version in 8..=12 {
        let client = PluginClient::init(&lib, version, 0x1300 + u64::from(version)).expect("init");
        let props = client.properties(0).expect("properties");
        assert_eq!(props.max_recvs, 1, "v{version}: {props:?}");
        client.finalize().expect("finalize");
    }
}

/// Sends interleaved by tag (`b1 b2 a1 a2` for groups `{a, b}, {a, b}`), as NCCL's proxy may
/// post them, driven as NCCL drives a plugin with the `maxRecvs` it advertises: 4 ranks, each
/// its own process and comms, mixed sizes (some cut into chunks over several sockets).
#[test]
fn interleaved_tags_land_in_their_buffers() {
    let rounds = 3;
    for count in [2, 4, 8] {
        for depth in [2, 3] {
            let mut job = Job::collectives(library(), vec![], vec![]);
            job.version = 12;
            job.task = Task::Grouped {
                count,
                depth,
                rounds,
            };
            let reports = launch_job(4, job);
            assert_eq!(reports.len(), 4);
            for r in &reports {
                assert_eq!(
                    r.groups_checked,
                    rounds * depth,
                    "{count} tags x {depth} groups: {r:?}"
                );
            }
        }
    }
}

/// Posts one send of `data` as NCCL's proxy would: a NULL request (no slot) means "test the
/// oldest outstanding send, then try again". Panics on any failed call.
fn post_send_patiently(send: &SendComm, sends: &mut RequestFifo, data: &[u8], what: &str) {
    loop {
        let mut buf = data.to_vec().into_boxed_slice();
        let mr = send.reg_mr(&mut buf).expect("regMr");
        match send.isend(buf, data.len(), 0, mr) {
            Ok(Posted::Started(r)) => {
                sends.push_back(r);
                return;
            }
            Ok(Posted::Busy(_)) => {
                let oldest = sends
                    .front_mut()
                    .expect("a NULL request with nothing in flight");
                match oldest.test() {
                    Ok(Some(_)) => drop(sends.pop_front()),
                    Ok(None) => std::thread::yield_now(),
                    Err(e) => panic!("{what}: test failed: {e}"),
                }
            }
            Err(e) => panic!("{what}: isend failed: {e}"),
        }
    }
}

/// The receiver closes its comm with 32 receives in flight while the sender still has sends
/// to make, as when one side of a job aborts. As with NCCL's Socket transport, whose send
/// then meets a closed connection ("Connection closed by remote peer", `ncclRemoteError`:
/// `socketProgress` in src/misc/socket.cc), the sends not yet made fail at `test`, never at
/// `isend`, within seconds, and so does every later one; the receiver's close and the
/// sender's close after it fail nothing. Closing both ends once the last message completed
/// is never an error: every other test closes so.
#[test]
fn a_receivers_close_fails_the_sends_it_cut_short_at_test_as_with_nccl() {
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 0x1320).expect("init");
    let (send, recv) = client.local_pair(0, Duration::from_secs(30)).expect("link");
    const SIZE: usize = 4 << 20;
    let receives: Vec<_> = (0..32)
        .map(|_| post_recv(&recv, SIZE, 0).expect("irecv"))
        .collect();
    let data = message_bytes(SIZE, 9);
    let mut sends = RequestFifo::new();
    for _ in 0..4 {
        post_send_patiently(&send, &mut sends, &data, "before the close");
    }
    // The receiver leaves with its 32 receives still in flight.
    recv.close().expect("closeRecv with receives in flight");
    drop(receives);
    let start = Instant::now();
    // Sends after the close: posting never fails, whatever `test` will say.
    while sends.len() < 8 {
        let mut buf = data.clone().into_boxed_slice();
        let mr = send.reg_mr(&mut buf).expect("regMr");
        match send.isend(buf, SIZE, 0, mr) {
            Ok(Posted::Started(r)) => sends.push_back(r),
            Ok(Posted::Busy(_)) => break,
            Err(e) => panic!("isend failed after the peer's close (errors belong to test): {e}"),
        }
    }
    let mut failed = 0;
    while let Some(mut r) = sends.pop_front() {
        let outcome = loop {
            match r.test() {
                Ok(None) => std::thread::yield_now(),
                other => break other,
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "a send cut short by the peer's close neither completes nor fails"
            );
        };
        match outcome {
            // Bytes the kernel took before the close are sent, as with NCCL's transport.
            Ok(_) if failed == 0 => {}
            Ok(_) => panic!("a send completed after an earlier one failed"),
            Err(e) => {
                // ncclRemoteError, as NCCL's transport returns (the message, naming the
                // orderly close, goes to NCCL's log).
                assert_eq!(e.kind, ErrorKind::Remote, "{e}");
                failed += 1;
            }
        }
    }
    assert!(
        failed > 0,
        "every send succeeded though the receiver had gone"
    );
    send.close().expect("closeSend after the peer's close");
    client.finalize().expect("finalize");
}

/// A receiver that dies (SIGKILL: no orderly close) while sends are posted: `isend` still
/// never fails, and the failure surfaces at `test` within the bound of docs/hardening.md.
#[test]
fn killed_receiver_errors_at_test_not_at_isend() {
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 0x1330).expect("init");
    let mut p = Peer::spawn(CHILD, "recv_then_park", &peer_env());
    let handle = p.read_handle();
    let send = client
        .connect(0, &handle)
        .wait(Duration::from_secs(30))
        .expect("connect");
    p.expect_line("READY");
    const SIZE: usize = 4 << 20;
    let data = message_bytes(SIZE, 3);
    let mut sends = RequestFifo::new();
    for _ in 0..4 {
        post_send_patiently(&send, &mut sends, &data, "before the kill");
    }
    let killed = p.kill();
    let err = loop {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "no error within 10 s of the receiver's death"
        );
        let mut buf = data.clone().into_boxed_slice();
        let mr = send.reg_mr(&mut buf).expect("regMr");
        match send.isend(buf, SIZE, 0, mr) {
            Ok(Posted::Started(r)) => sends.push_back(r),
            Ok(Posted::Busy(_)) => {}
            Err(e) => panic!("isend failed after the peer died (errors belong to test): {e}"),
        }
        let Some(oldest) = sends.front_mut() else {
            continue;
        };
        match oldest.test() {
            Ok(Some(_)) => drop(sends.pop_front()),
            Ok(None) => std::thread::yield_now(),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err.kind, ErrorKind::Remote | ErrorKind::System),
        "{err}"
    );
    println!(
        "killed receiver: error at test after {} ms: {err}",
        killed.elapsed().as_millis()
    );
}

const CHILD: &str = "conformance_peer";

fn peer_env() -> [(&'static str, &'static str); 1] {
    [("NCCL_SOCKET_IFNAME", "lo")]
}

/// Out of file descriptors in the accepting process: `accept` must fail (as NCCL's Socket
/// transport does), not return "no comm yet" forever while the connecting side believes it
/// is connected.
#[test]
fn accept_out_of_descriptors_fails() {
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 0x1310).expect("init");
    let mut p = Peer::spawn(CHILD, "accept_few_fds", &peer_env());
    let handle = p.read_handle();
    // The connect completes in the kernel's backlog, whatever the listener does.
    let send = client
        .connect(0, &handle)
        .wait(Duration::from_secs(30))
        .expect("connect");
    let outcome = p.expect_line("ACCEPT");
    assert!(
        outcome.starts_with("error") && outcome.contains("accept returned ncclSystemError"),
        "the accepting process got: {outcome}"
    );
    drop(send);
    client.finalize().expect("finalize");
}

/// Leaves no descriptor free below a lowered `RLIMIT_NOFILE`. (With one free, a one-socket
/// connection fits, and its accept completes.)
fn leave_no_descriptor() -> Vec<std::fs::File> {
    let max_fd = std::fs::read_dir("/proc/self/fd")
        .expect("fd list")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .expect("open descriptors");
    let limit = libc::rlimit {
        rlim_cur: max_fd + 2,
        rlim_max: max_fd + 2,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(rc, 0, "setrlimit");
    // Fill every hole and the last slots.
    let mut held = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        held.push(f);
    }
    held
}

/// The peer process of these tests: its role comes from [`ROLE_ENV`].
#[test]
#[ignore = "the peer process of the conformance tests, started by them"]
fn conformance_peer() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 0x1390).expect("init");
    match role.as_str() {
        "accept_few_fds" => {
            let (handle, mut listen) = client.listen(0).expect("listen");
            let _held = leave_no_descriptor();
            say(&format!("HANDLE {}", common::hex(&handle)));
            let start = Instant::now();
            let mut polls = 0u64;
            let outcome = loop {
                polls += 1;
                match listen.poll_accept() {
                    Ok(Some(_)) => break "ok: a comm".to_string(),
                    Err(e) => break format!("error: {e}"),
                    Ok(None) if start.elapsed() > Duration::from_secs(5) => {
                        break format!("none after {polls} polls in 5 s")
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(1)),
                }
            };
            say(&format!("ACCEPT {outcome}"));
            park();
        }
        "recv_then_park" => {
            let (handle, mut listen) = client.listen(0).expect("listen");
            say(&format!("HANDLE {}", common::hex(&handle)));
            let recv = listen.accept(Duration::from_secs(60)).expect("accept");
            let receives: Vec<_> = (0..32)
                .map(|_| post_recv(&recv, 4 << 20, 0).expect("irecv"))
                .collect();
            say("READY");
            let _keep = (recv, receives);
            park();
        }
        other => panic!("unknown role {other}"),
    }
}
