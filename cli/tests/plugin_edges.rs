//! The plugin library at its edges, through `dlopen` and real sockets: grouped receives,
//! garbage on a listening port, a connector whose hello comes late, and a peer killed in the
//! middle of a transfer.

mod common;

use std::ffi::c_void;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{launch_job, library, lossy_exe};
use lossy_cli::harness::bootstrap::{Bootstrap, BootstrapServer};
use lossy_cli::harness::collectives::{self, Collective, CollectiveSpec, DataType, Staging};
use lossy_cli::harness::net::{PluginLink, RingLink};
use lossy_cli::harness::plugin_client::{
    establish, ConnHandle, PluginClient, PluginLibrary, Posted, RecvItem,
};
use lossy_cli::harness::worker::{Job, LinkKind, RunSpec, Task};
use nccl_net_lossy::ffi::{ncclNet_v12_t, ncclResult_t};

fn grouped_job(version: u32) -> Job {
    let mut job = Job::collectives(library(), vec![], vec![]);
    job.version = version;
    job.task = Task::Grouped {
        count: 8,
        depth: 1,
        rounds: 20,
    };
    job
}

#[test]
fn grouped_receives_match_buffers_by_tag() {
    for (nranks, version) in [(2, 12), (3, 12), (2, 8), (2, 10)] {
        let reports = launch_job(nranks, grouped_job(version));
        assert!(
            reports.iter().all(|r| r.groups_checked == 20),
            "{reports:?}"
        );
    }
}

/// The listener's address, read from the handle's documented wire layout.
fn handle_addr(h: &ConnHandle) -> SocketAddr {
    let port = u16::from_le_bytes([h[12], h[13]]);
    let ip = match h[10] {
        4 => IpAddr::V4(Ipv4Addr::new(h[16], h[17], h[18], h[19])),
        _ => {
            let mut b = [0u8; 16];
            b.copy_from_slice(&h[16..32]);
            IpAddr::V6(Ipv6Addr::from(b))
        }
    };
    SocketAddr::new(ip, port)
}

#[test]
fn garbage_on_the_listening_port_is_rejected_and_the_real_peer_still_connects() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 77).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let addr = handle_addr(&handle);
    let mut junk = Vec::new();
    for pattern in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0xffu8; 64][..],
        &[0u8; 40][..],
    ] {
        let mut s = TcpStream::connect(addr).expect("raw connect");
        s.write_all(pattern).expect("write garbage");
        junk.push(s);
    }
    // The listener sees the garbage first and must drop it without failing.
    for _ in 0..20 {
        assert!(listen
            .poll_accept()
            .expect("accept survives garbage")
            .is_none());
        std::thread::sleep(Duration::from_millis(5));
    }
    let (send, recv) = establish(
        client.connect(0, &handle),
        &mut listen,
        Duration::from_secs(10),
    )
    .expect("the real peer connects");
    let mut out = vec![0u8; 1000].into_boxed_slice();
    let rmr = recv.reg_mr(&mut out).expect("regMr");
    let mut data: Vec<u8> = (0..1000).map(|i| i as u8).collect();
    let smr = send.reg_mr(&mut data).expect("regMr");
    let Posted::Started(mut r) = recv
        .irecv(vec![RecvItem {
            buf: out,
            size: 1000,
            tag: 1,
            mr: rmr,
        }])
        .expect("irecv")
    else {
        panic!("no receive slot")
    };
    let Posted::Started(mut s) = send
        .isend(data.into_boxed_slice(), 1000, 1, smr)
        .expect("isend")
    else {
        panic!("no send slot")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(r.is_done() && s.is_done()) {
        r.test().expect("test recv");
        s.test().expect("test send");
        assert!(Instant::now() < deadline, "message did not arrive");
    }
    let (bufs, sizes) = r.finish().expect("finish");
    assert_eq!(sizes, vec![1000]);
    assert!(bufs[0].iter().enumerate().all(|(i, &b)| b == i as u8));
    s.finish().expect("finish send");
    drop(junk);
    send.close().expect("closeSend");
    recv.close().expect("closeRecv");
    listen.close().expect("closeListen");
}

/// A relay on 127.0.0.1 that connects each socket it accepts to `target` at once (the
/// listener accepts it then), and carries bytes both ways only after `delay`: to the
/// listener, a connector that sent nothing for that long after its TCP connection was
/// accepted. Its address.
fn late_relay(target: SocketAddr, delay: Duration) -> SocketAddr {
    let relay = TcpListener::bind("127.0.0.1:0").expect("relay bind");
    let addr = relay.local_addr().expect("relay addr");
    std::thread::spawn(move || {
        for client in relay.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(target) else {
                return;
            };
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    })
                };
                let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
                    return;
                };
                pipe(client, server);
                pipe(s2, c2);
            });
        }
    });
    addr
}

/// NCCL's proxy calls `connect` again when it gets to it: its first call may return with the
/// TCP connection made in the kernel (the listener accepts it) and the hello not yet sent,
/// the next one may come seconds later (the proxy thread setting up other connections, a
/// busy host). NCCL's Socket plugin waits for the connector's bytes as long as it takes
/// (`socketFinalizeAccept`, src/misc/socket.cc); a silent socket must not be dropped for
/// its silence alone, or `accept` never completes while the connector believes it is
/// connected. (Silent sockets still go when room or a descriptor is needed.)
#[test]
fn a_connector_whose_hello_comes_late_is_still_accepted() {
    use nccl_net_lossy::transport::socket::HELLO_TIMEOUT;
    // SAFETY: ncclNetPlugin_v12 is a ncclNet_v12_t in our headers.
    let t: &ncclNet_v12_t = unsafe { common::library_table("ncclNetPlugin_v12") };
    let ctx = common::raw_context(t, 0x1a7e, None);
    let mut handle: ConnHandle = [0; 128];
    let mut lc = std::ptr::null_mut();
    // SAFETY: a 128-byte handle and a valid out-pointer, as NCCL passes them.
    let code = unsafe { t.listen.expect("listen")(ctx, 0, handle.as_mut_ptr().cast(), &mut lc) };
    assert_eq!(code, ncclResult_t::ncclSuccess, "listen");
    let relay = late_relay(handle_addr(&handle), HELLO_TIMEOUT + Duration::from_secs(2));
    let SocketAddr::V4(relay) = relay else {
        panic!("an IPv4 relay")
    };
    handle[10] = 4;
    handle[12..14].copy_from_slice(&relay.port().to_le_bytes());
    handle[16..32].fill(0);
    handle[16..20].copy_from_slice(&relay.ip().octets());
    let (mut sc, mut rc): (*mut c_void, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
    let start = Instant::now();
    while sc.is_null() || rc.is_null() {
        assert!(
            start.elapsed() < HELLO_TIMEOUT * 4,
            "no connection (connect {}, accept {})",
            if sc.is_null() { "pending" } else { "done" },
            if rc.is_null() { "pending" } else { "done" }
        );
        std::thread::sleep(Duration::from_millis(1));
        let mut dev = std::ptr::null_mut();
        // SAFETY: the same handle memory every call, as NCCL does; valid out-pointers; the
        // listenComm listen returned.
        unsafe {
            if sc.is_null() {
                let code = t.connect.expect("connect")(
                    ctx,
                    0,
                    handle.as_mut_ptr().cast(),
                    &mut sc,
                    &mut dev,
                );
                assert_eq!(code, ncclResult_t::ncclSuccess, "connect");
            }
            if rc.is_null() {
                let code = t.accept.expect("accept")(lc, &mut rc, &mut dev);
                assert_eq!(code, ncclResult_t::ncclSuccess, "accept");
            }
        }
    }
    let mut data: Vec<u8> = (0..65536u32).map(|i| (i * 13 + 1) as u8).collect();
    assert!(
        common::raw_transfer(t, sc, rc, &mut data) == data,
        "the message arrived changed"
    );
    // SAFETY: live comms and context, none used again.
    unsafe { common::raw_close_all(t, sc, rc, lc, ctx) };
}

#[test]
fn a_peer_killed_mid_transfer_fails_test_within_10_s() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let server = BootstrapServer::start(2, Duration::from_secs(30)).expect("bootstrap");
    let run = RunSpec {
        collective: Collective::AllReduce,
        dtype: DataType::F32,
        bytes: 64 << 20,
        iters: 100_000,
        warmup: 0,
    };
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], vec![run.clone()]);
    job.timeout_s = 120.0;
    let json = serde_json::to_string(&job).expect("job");
    let mut child = Command::new(lossy_exe())
        .args(["worker", "--rank", "1", "--nranks", "2", "--bootstrap"])
        .arg(server.addr().to_string())
        .arg("--job")
        .arg(json)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the peer");
    let mut boot = Bootstrap::connect(server.addr(), 0, 2, Duration::from_secs(30)).expect("boot");
    let mut link =
        PluginLink::connect_ring(&lib, 12, 1, &mut boot, Duration::from_secs(30)).expect("ring");
    boot.barrier().expect("barrier");
    let spec = CollectiveSpec {
        collective: run.collective,
        dtype: run.dtype,
        count: run.bytes / 4,
        chunk: job.chunk,
        in_flight: job.in_flight,
        timeout: Duration::from_secs(120),
    };
    let input = collectives::make_input(&spec, 0, 2).expect("input buffer");
    let mut output = vec![0u8; collectives::output_len(&spec, 0, 2)];
    let mut staging = Staging::new(job.chunk);
    collectives::run(&mut link, &mut staging, &spec, 0, 2, &input, &mut output)
        .expect("first all-reduce");
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        child.kill().expect("kill the peer");
        let at = Instant::now();
        child.wait().expect("reap");
        at
    });
    let failure = loop {
        if let Err(e) = collectives::run(&mut link, &mut staging, &spec, 0, 2, &input, &mut output)
        {
            break e;
        }
    };
    let killed_at = killer.join().expect("killer");
    let waited = killed_at.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "took {waited:?}: {failure}"
    );
    assert!(
        !failure.message.contains("did not finish within"),
        "the harness deadline fired, not the plugin: {failure}"
    );
    drop(Box::new(link).close());
    drop(boot);
    let _ = server.join();
}
