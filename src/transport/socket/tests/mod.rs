//! Real sockets over loopback, both ends in this process: the helpers every socket test
//! shares, and the tests by theme.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::wire::{self, Header, HELLO_MAGIC, HELLO_SIZE, PROTOCOL_VERSION};
use super::*;
use crate::loss::effect;
use crate::loss::plan::{Effect, LossPlan, PacketRun};
use crate::transport::{
    Completion, HostBuf, Listener, RecvConn, SendConn, Transport, HANDLE_WIRE_SIZE, MAX_REQUESTS,
};
use crate::ErrorKind;

mod acks;
mod descriptors;
mod effects;
mod handshake;
mod lifecycle;
mod peer_errors;
mod pool;
mod reads;
mod roundtrip;
mod small;
mod streams;

pub(super) const PATIENCE: Duration = Duration::from_secs(30);

pub(super) fn loopback(nsocks: usize) -> SocketTransport {
    loopback_with(SocketConfig {
        nsocks,
        ..SocketConfig::default()
    })
}

/// The transport on IPv4 loopback only, with `config`.
pub(super) fn loopback_with(config: SocketConfig) -> SocketTransport {
    let lo = IfaceAddr {
        name: "lo".into(),
        ip: "127.0.0.1".parse().expect("ip"),
        scope_id: 0,
        is_loopback: true,
        running: true,
    };
    SocketTransport::with_interfaces(config, vec![lo])
}

/// Runs the ignored test `name` of this binary in a process of its own (counting threads,
/// descriptors or CPU time needs one: other tests run beside us), with `flag` and `env` set,
/// and checks that it ran its check to the end (it prints `passed`).
pub(super) fn run_child(name: &str, flag: &str, env: &[(&str, &str)], passed: &str) {
    crate::test_child::run(name, flag, env, passed);
}

/// Polls `f` until it yields, failing the test after `PATIENCE`.
pub(super) fn wait<T>(
    what: &str,
    mut f: impl FnMut() -> crate::Result<Option<T>>,
) -> crate::Result<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

pub(super) fn connect_pair(t: &SocketTransport) -> (Box<dyn SendConn>, Box<dyn RecvConn>) {
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, None, &mut handle).expect("listen");
    let mut connector = t.connect(0, None, &handle).expect("connect");
    let (mut send, mut recv) = (None, None);
    let start = Instant::now();
    while send.is_none() || recv.is_none() {
        if send.is_none() {
            send = connector.poll().expect("connector poll");
        }
        if recv.is_none() {
            recv = listener.poll_accept().expect("listener poll");
        }
        assert!(start.elapsed() < PATIENCE, "connection never completed");
        std::thread::sleep(Duration::from_micros(200));
    }
    (send.expect("send"), recv.expect("recv"))
}

/// Waits until the receive threads of `recv` have read the peer's clean close on every
/// socket in `mask` (bit `s`: socket `s`).
pub(super) fn wait_for_closed(recv: &SocketRecvConn, mask: u16) {
    wait("the peer's close", || {
        Ok((recv.closed_by_peer() & mask == mask).then_some(()))
    })
    .expect("closed");
}

/// Waits until at least `want` bytes have arrived unread on `recv`'s sockets, failing the
/// test after `PATIENCE`.
pub(super) fn wait_for_bytes(recv: &SocketRecvConn, want: usize) {
    let deadline = Instant::now() + PATIENCE;
    while recv.bytes_waiting() < want {
        assert!(
            Instant::now() < deadline,
            "{want} bytes never arrived ({} did)",
            recv.bytes_waiting()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Deterministic bytes, different for each seed.
pub(super) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub(super) fn send_recv(
    send: &dyn SendConn,
    recv: &dyn RecvConn,
    data: &mut [u8],
    into: &mut [u8],
    plan: &LossPlan,
) -> (crate::Result<Completion>, crate::Result<Completion>) {
    let r = wait("irecv slot", || {
        // SAFETY: the caller lends `into` and `data` until this function returns, after both
        // requests ended.
        recv.irecv(&[unsafe { HostBuf::from_slice(into) }], &[7])
    });
    let s = wait("isend slot", || {
        // SAFETY: as above.
        send.isend(unsafe { HostBuf::from_slice(data) }, 7, plan)
    });
    let (Ok(r), Ok(s)) = (r, s) else {
        panic!("posting failed");
    };
    // Both requests are tested in turn until both end, as NCCL's proxy tests every request it
    // has in flight: with no pool thread, bytes move only inside these calls.
    let (mut sent, mut got) = (None, None);
    wait("send and recv completion", || {
        if sent.is_none() {
            sent = send.test(s).transpose();
        }
        if got.is_none() {
            got = recv.test(r).transpose();
        }
        Ok((sent.is_some() && got.is_some()).then_some(()))
    })
    .expect("polling only collects results");
    match (sent, got) {
        (Some(sent), Some(got)) => (sent, got),
        _ => unreachable!("the wait ends only when both requests ended"),
    }
}

/// Sends `data` losslessly with `tag` and waits until the send completes.
pub(super) fn send_and_wait(send: &dyn SendConn, data: &mut [u8], tag: i32) {
    send_outcome(send, data, tag).expect("send completes");
}

/// Posts `data` losslessly with `tag` and tests it until it ends: what `test` then said, the
/// completion or the error.
pub(super) fn send_outcome(
    send: &dyn SendConn,
    data: &mut [u8],
    tag: i32,
) -> Result<Option<Completion>> {
    let id = send
        // SAFETY: the caller lends `data` until this function returns, after the request ended.
        .isend(
            unsafe { HostBuf::from_slice(data) },
            tag,
            &LossPlan::lossless(),
        )
        .expect("isend never reports the peer's failure")
        .expect("slot");
    wait("send outcome", || match send.test(id) {
        Ok(None) => Ok(None),
        other => Ok(Some(other)),
    })
    .expect("the send ends")
}

pub(super) fn plan(effect: Effect, mtu: u32, lost: &[(u32, u32)]) -> LossPlan {
    LossPlan {
        effect,
        mtu,
        lost: lost
            .iter()
            .map(|&(start, len)| PacketRun { start, len })
            .collect(),
        retransmit_timeout: Duration::from_millis(20),
        flip_seed: 0xdead_beef,
    }
}

/// A message cut so lost packets straddle chunk boundaries with 3 sockets.
pub(super) const LOSSY_SIZE: usize = (1 << 20) + 3;

pub(super) const LOSSY_RUNS: [(u32, u32); 4] = [(0, 2), (85, 1), (100, 70), (256, 1)];

pub(super) fn in_lost_packet(byte: usize, mtu: usize) -> bool {
    let p = (byte / mtu) as u32;
    LOSSY_RUNS.iter().any(|&(s, l)| (s..s + l).contains(&p))
}

pub(super) fn run_lossy(effect: Effect, nsocks: usize) -> (Vec<u8>, Vec<u8>, Duration) {
    let t = loopback(nsocks);
    let (send, recv) = connect_pair(&t);
    let mut data = pattern(LOSSY_SIZE, 77);
    let mut into = vec![0x3cu8; LOSSY_SIZE];
    let start = Instant::now();
    let (s, r) = send_recv(
        &*send,
        &*recv,
        &mut data,
        &mut into,
        &plan(effect, 4096, &LOSSY_RUNS),
    );
    let elapsed = start.elapsed();
    assert_eq!(s.expect("send").sizes(), &[LOSSY_SIZE]);
    assert_eq!(r.expect("recv").sizes(), &[LOSSY_SIZE]);
    // The connection stays usable after a lossy message.
    let mut d2 = pattern(100_000, 1);
    let mut i2 = vec![0; 100_000];
    let (s2, r2) = send_recv(&*send, &*recv, &mut d2, &mut i2, &LossPlan::lossless());
    assert!(s2.is_ok() && r2.is_ok() && i2 == d2);
    (data, into, elapsed)
}

/// Raw connection to a listener of `t`, for crafting bytes by hand.
pub(super) fn raw_listener(t: &SocketTransport) -> (SocketListener, Handle) {
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let listener = t.listen_socket(0, &mut handle).expect("listen");
    (listener, Handle::decode(&handle).expect("handle"))
}

pub(super) fn hello_bytes(h: &Handle, conn_id: u64, index: u16, count: u16) -> [u8; HELLO_SIZE] {
    Hello {
        nonce: h.nonce,
        conn_id,
        index,
        count,
    }
    .encode()
}

/// A raw one-socket peer that says hello and then sends `bytes` as its data stream.
pub(super) fn raw_sender(t: &SocketTransport, bytes: &[u8]) -> (Box<dyn RecvConn>, TcpStream) {
    let (mut listener, h) = raw_listener(t);
    let mut c = TcpStream::connect(h.addr).expect("connect");
    c.write_all(&hello_bytes(&h, 1, 0, 1)).expect("hello");
    c.write_all(bytes).expect("data");
    let recv = wait("accept", || listener.poll_accept()).expect("accept");
    (recv, c)
}

pub(super) fn header(size: u64, runs: u32) -> Header {
    Header {
        seq: 0,
        chunk: 0,
        size,
        tag: 0,
        effect: Effect::Zero,
        mtu: 4096,
        runs,
        retransmit_ns: 0,
        flip_seed: 0,
    }
}

pub(super) fn count_entries(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// A lookup over fixed variable values, standing in for the environment.
pub(super) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let owned: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| {
        owned
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
}

/// What the receiver should hold after `data` went through `plan` into a buffer that held
/// `before`.
pub(super) fn expected_after(data: &[u8], before: &[u8], plan: &LossPlan) -> Vec<u8> {
    let len = data.len();
    let mut want = data.to_vec();
    match plan.effect {
        Effect::Zero => effect::zero_lost(&mut want, 0, &plan.lost, plan.mtu, len),
        Effect::Stale => {
            for r in effect::lost_ranges(&plan.lost, plan.mtu, len, 0..len) {
                want[r.clone()].copy_from_slice(&before[r]);
            }
        }
        Effect::Retransmit => {}
        Effect::Bitflip => {
            effect::flip_lost(&mut want, 0, &plan.lost, plan.mtu, len, plan.flip_seed);
        }
    }
    want
}

pub(super) fn random_plan(rng: &mut impl rand::Rng, len: usize) -> LossPlan {
    let mtu = [64u32, 1500, 4096, 9000][rng.gen_range(0..4)];
    let packets = effect::packet_count(len, mtu) as u32;
    let mut lost = Vec::new();
    let mut p = 0u32;
    while packets > 0 && p < packets && rng.gen_bool(0.7) {
        p += rng.gen_range(0..(packets / 4).max(2));
        if p >= packets {
            break;
        }
        let run = rng.gen_range(1..=(packets - p).min(5));
        lost.push(PacketRun { start: p, len: run });
        p += run;
    }
    LossPlan {
        effect: [
            Effect::Zero,
            Effect::Stale,
            Effect::Retransmit,
            Effect::Bitflip,
        ][rng.gen_range(0..4)],
        mtu,
        lost,
        retransmit_timeout: Duration::from_micros(rng.gen_range(0..50)),
        flip_seed: rng.gen(),
    }
}

/// A raw peer with `count` sockets that said hello; the test writes the data streams.
pub(super) fn raw_peer(t: &SocketTransport, count: u16) -> (SocketRecvConn, Vec<TcpStream>) {
    let (mut listener, h) = raw_listener(t);
    let socks: Vec<TcpStream> = (0..count)
        .map(|i| {
            let mut c = TcpStream::connect(h.addr).expect("connect");
            c.write_all(&hello_bytes(&h, 5, i, count)).expect("hello");
            c
        })
        .collect();
    let recv = wait("accept", || listener.poll_accept_socket()).expect("accept");
    (recv, socks)
}

pub(super) fn chunk_header(seq: u64, chunk: u8, size: u64) -> [u8; wire::HEADER_SIZE] {
    Header {
        seq,
        chunk,
        ..header(size, 0)
    }
    .encode()
}

pub(super) fn with_timeout(nsocks: usize, timeout: Duration) -> SocketTransport {
    loopback_with(SocketConfig {
        nsocks,
        timeout: Some(timeout),
        ..SocketConfig::default()
    })
}

/// A connection over loopback with one socket, delayed acknowledgements on or off; the
/// receiving half as its concrete type.
pub(super) fn one_socket_pair(delayed_acks: bool) -> (Box<dyn SendConn>, SocketRecvConn) {
    let t = loopback_with(SocketConfig {
        nsocks: 1,
        delayed_acks,
        ..super::SocketConfig::default()
    });
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen_socket(0, &mut handle).expect("listen");
    let mut connector = t.connect(0, None, &handle).expect("connect");
    let (mut send, mut recv) = (None, None);
    wait("connection", || {
        if send.is_none() {
            send = connector.poll()?;
        }
        if recv.is_none() {
            recv = listener.poll_accept_socket()?;
        }
        Ok((send.is_some() && recv.is_some()).then_some(()))
    })
    .expect("connect");
    (send.expect("send"), recv.expect("recv"))
}
