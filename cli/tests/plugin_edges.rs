//! The plugin library at its edges, through `dlopen` and real sockets: grouped receives,
//! garbage on a listening port, and a peer killed in the middle of a transfer.

mod common;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
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
