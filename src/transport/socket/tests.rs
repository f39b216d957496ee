//! Real sockets over loopback, both ends in this process.

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

pub(super) const PATIENCE: Duration = Duration::from_secs(30);

pub(super) fn loopback(nsocks: usize) -> SocketTransport {
    let lo = IfaceAddr {
        name: "lo".into(),
        ip: "127.0.0.1".parse().expect("ip"),
        scope_id: 0,
        is_loopback: true,
    };
    let config = SocketConfig {
        nsocks,
        ..SocketConfig::default()
    };
    SocketTransport::with_interfaces(config, vec![lo])
}

/// Runs the ignored test `name` of this binary in a process of its own (counting threads,
/// descriptors or CPU time needs one: other tests run beside us), with `flag` and `env` set,
/// and checks that it ran its check to the end (it prints `passed`).
pub(super) fn run_child(name: &str, flag: &str, env: &[(&str, &str)], passed: &str) {
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            name,
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(flag, "1")
        .envs(env.iter().copied())
        .output()
        .expect("run child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(
        text.contains(passed),
        "child did not run the check:\n{text}"
    );
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
    let mut listener = t.listen(0, &mut handle).expect("listen");
    let mut connector = t.connect(0, &handle).expect("connect");
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
fn wait_for_closed(recv: &SocketRecvConn, mask: u16) {
    wait("the peer's close", || {
        Ok((recv.closed_by_peer() & mask == mask).then_some(()))
    })
    .expect("closed");
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
fn send_and_wait(send: &dyn SendConn, data: &mut [u8], tag: i32) {
    let id = send
        // SAFETY: the caller lends `data` until this function returns, after the send completed.
        .isend(
            unsafe { HostBuf::from_slice(data) },
            tag,
            &LossPlan::lossless(),
        )
        .expect("isend")
        .expect("slot");
    wait("send", || send.test(id)).expect("send completes");
}

#[test]
fn round_trips_are_bit_exact_for_every_size_and_socket_count() {
    for nsocks in [1, 2, 4] {
        let t = loopback(nsocks);
        let (send, recv) = connect_pair(&t);
        for (i, size) in [0usize, 1, 7, 4096, (1 << 20) + 3, 16 << 20]
            .into_iter()
            .enumerate()
        {
            let mut data = pattern(size, i as u64 + 1);
            let mut into = vec![0xa5u8; size];
            let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
            assert_eq!(s.expect("send").sizes(), &[size]);
            assert_eq!(r.expect("recv").sizes(), &[size]);
            assert!(into == data, "{nsocks} sockets, {size} bytes: data differs");
        }
    }
}

#[test]
fn ipv6_loopback_round_trip() {
    // Hosts without IPv6 on loopback skip this test.
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        return;
    }
    let lo = IfaceAddr {
        name: "lo".into(),
        ip: "::1".parse().expect("ip"),
        scope_id: 0,
        is_loopback: true,
    };
    let config = SocketConfig {
        nsocks: 2,
        ..SocketConfig::default()
    };
    let t = SocketTransport::with_interfaces(config, vec![lo]);
    let (send, recv) = connect_pair(&t);
    let mut data = pattern(300_000, 9);
    let mut into = vec![0; data.len()];
    let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
    assert!(s.is_ok() && r.is_ok());
    assert!(into == data);
}

#[test]
fn eight_requests_in_flight_complete_with_their_own_data() {
    let t = loopback(2);
    let (send, recv) = connect_pair(&t);
    let sizes = [0usize, 100, 70_000, 1 << 20, 5, 3 << 20, 65_536, 200_000];
    let mut data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i as u64 + 10))
        .collect();
    let mut into: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let rids: Vec<_> = into
        .iter_mut()
        .map(|b| {
            // SAFETY: the buffer outlives the request and is touched again only after it ended.
            recv.irecv(&[unsafe { HostBuf::from_slice(b) }], &[1])
                .expect("irecv")
                .expect("slot")
        })
        .collect();
    let sids: Vec<_> = data
        .iter_mut()
        .map(|b| {
            // SAFETY: the buffer outlives the request and is touched again only after it ended.
            send.isend(unsafe { HostBuf::from_slice(b) }, 1, &LossPlan::lossless())
                .expect("isend")
                .expect("slot")
        })
        .collect();
    for (i, (&s, &r)) in sids.iter().zip(&rids).enumerate().rev() {
        assert_eq!(
            wait("send", || send.test(s)).expect("send").sizes(),
            &[sizes[i]]
        );
        assert_eq!(
            wait("recv", || recv.test(r)).expect("recv").sizes(),
            &[sizes[i]]
        );
    }
    assert!(into == data);
}

#[test]
fn request_slots_run_out_and_come_back() {
    let t = loopback(1);
    let mut bufs: Vec<Vec<u8>> = (0..MAX_REQUESTS).map(|_| vec![0u8; 16]).collect();
    let mut extra = [0u8; 16];
    let (send, recv) = connect_pair(&t);
    let ids: Vec<_> = bufs
        .iter_mut()
        .map(|b| {
            // SAFETY: `bufs` outlives the receives: it is declared before the connection, which is
            // dropped first.
            recv.irecv(&[unsafe { HostBuf::from_slice(b) }], &[0])
                .expect("irecv")
                .expect("slot")
        })
        .collect();
    assert_eq!(
        // SAFETY: the call is refused (error, or no free slot), so the transport keeps no loan.
        recv.irecv(&[unsafe { HostBuf::from_slice(&mut extra) }], &[0])
            .expect("irecv"),
        None
    );
    assert_eq!(recv.test(ids[0]).expect("pending"), None);
    assert!(recv.test(MAX_REQUESTS as u32).is_err());
    send_and_wait(&*send, &mut [1u8; 16], 0);
    wait("recv", || recv.test(ids[0])).expect("recv");
    // Testing a finished request again is an error: its slot is free.
    assert!(recv.test(ids[0]).is_err());
    assert!(recv
        // SAFETY: `extra` outlives the receive: it is declared before the connection.
        .irecv(&[unsafe { HostBuf::from_slice(&mut extra) }], &[0])
        .expect("irecv")
        .is_some());
}

#[test]
fn larger_receive_reports_the_real_size() {
    let t = loopback(2);
    let (send, recv) = connect_pair(&t);
    let mut data = pattern(300_001, 3);
    let mut into = vec![0xeeu8; 1 << 20];
    let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
    assert_eq!(s.expect("send").sizes(), &[300_001]);
    assert_eq!(r.expect("recv").sizes(), &[300_001]);
    assert!(into[..300_001] == data[..]);
    assert!(into[300_001..].iter().all(|&b| b == 0xee));
}

#[test]
fn send_larger_than_receive_fails_without_overrun() {
    const GUARD: usize = 4096;
    for nsocks in [1, 3] {
        let t = loopback(nsocks);
        let posted = 200_000;
        let mut region = vec![0x5au8; posted + 2 * GUARD];
        let mut data = pattern(posted + 1, 4);
        let mut more = [0u8; 8];
        let (send, recv) = connect_pair(&t);
        let r = recv
            .irecv(
                // SAFETY: `region` is declared before the connection, so it outlives the
                // receive; the test reads only the guard bytes around the lent range.
                &[unsafe { HostBuf::from_slice(&mut region[GUARD..GUARD + posted]) }],
                &[2],
            )
            .expect("irecv")
            .expect("slot");
        let s = send
            // SAFETY: `data` is declared before the connection, so it outlives the send.
            .isend(
                unsafe { HostBuf::from_slice(&mut data) },
                2,
                &LossPlan::lossless(),
            )
            .expect("isend");
        let err = wait("recv error", || recv.test(r)).expect_err("must fail");
        assert_eq!(err.kind, ErrorKind::InvalidUsage, "{err}");
        assert!(region[..GUARD].iter().all(|&b| b == 0x5a));
        assert!(region[GUARD + posted..].iter().all(|&b| b == 0x5a));
        // The connection is dead for later calls: they fail at `test`, never at `irecv`.
        // SAFETY: nothing is ever written into `more` on a failed connection, and the loan
        // ends with the connection, dropped before `more`.
        let late = recv
            .irecv(&[unsafe { HostBuf::from_slice(&mut more) }], &[2])
            .expect("irecv on a failed connection is no error")
            .expect("slot");
        assert!(recv.test(late).is_err());
        // Once the failed side closes, the sender learns it too, at the latest on a later send.
        drop(recv);
        let start = Instant::now();
        if let Some(s) = s {
            let _ = wait("send outcome", || {
                send.test(s).or(Ok(Some(Completion::default())))
            });
        }
        let failed = loop {
            // SAFETY: `more` is declared before the connection, so it outlives every send.
            match send.isend(
                unsafe { HostBuf::from_slice(&mut more) },
                2,
                &LossPlan::lossless(),
            ) {
                Err(_) => break true,
                Ok(Some(id)) => {
                    if wait("send", || send.test(id)).is_err() {
                        break true;
                    }
                }
                Ok(None) => {}
            }
            if start.elapsed() > Duration::from_secs(10) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(failed, "sender never noticed the failed connection");
    }
}

#[test]
fn grouped_receive_matches_buffers_by_tag() {
    for nsocks in [1, 2, 4] {
        grouped_receive(nsocks);
    }
}

fn grouped_receive(nsocks: usize) {
    let t = loopback(nsocks);
    let (send, recv) = connect_pair(&t);
    let tags = [3, 1, 2, 1];
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 300_000]).collect();
    // SAFETY: the buffer outlives the request and is touched again only after it ended.
    let hb: Vec<HostBuf> = bufs
        .iter_mut()
        .map(|b| unsafe { HostBuf::from_slice(b) })
        .collect();
    let r = recv.irecv(&hb, &tags).expect("irecv").expect("slot");
    // Messages in stream order with tags 1, 2, 3, 1: they land in buffers 1, 2, 0, 3.
    let sent_tags = [1, 2, 3, 1];
    let sizes = [10usize, 200_000, 0, 299_999];
    let mut msgs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, 50 + i as u64))
        .collect();
    let ids: Vec<_> = msgs
        .iter_mut()
        .zip(sent_tags)
        .map(|(m, tag)| {
            // SAFETY: the buffer outlives the request and is touched again only after it ended.
            send.isend(
                unsafe { HostBuf::from_slice(m) },
                tag,
                &LossPlan::lossless(),
            )
            .expect("isend")
            .expect("slot")
        })
        .collect();
    for id in ids {
        wait("send", || send.test(id)).expect("send");
    }
    let c = wait("recv", || recv.test(r)).expect("recv");
    assert_eq!(c.sizes(), &[0, 10, 200_000, 299_999]);
    assert!(bufs[1][..10] == msgs[0][..]);
    assert!(bufs[2][..200_000] == msgs[1][..]);
    assert!(bufs[3][..299_999] == msgs[3][..]);
}

#[test]
fn unknown_tag_fails_the_receive() {
    let t = loopback(1);
    let mut a = [0u8; 64];
    let mut b = [0u8; 64];
    let mut m = [9u8; 64];
    let (send, recv) = connect_pair(&t);
    let r = recv
        .irecv(
            // SAFETY: `a` and `b` are declared before the connection, so they outlive the receive.
            &[unsafe { HostBuf::from_slice(&mut a) }, unsafe {
                HostBuf::from_slice(&mut b)
            }],
            &[1, 2],
        )
        .expect("irecv")
        .expect("slot");
    // SAFETY: `m` is declared before the connection, so it outlives the send.
    send.isend(
        unsafe { HostBuf::from_slice(&mut m) },
        5,
        &LossPlan::lossless(),
    )
    .expect("isend");
    let err = wait("recv", || recv.test(r)).expect_err("tag 5 was never posted");
    assert_eq!(err.kind, ErrorKind::InvalidUsage);
}

#[test]
fn bad_arguments_are_refused() {
    let t = loopback(1);
    let (send, recv) = connect_pair(&t);
    let mut m = [0u8; 4096];
    let mut plan = LossPlan::lossless();
    plan.mtu = 8;
    assert_eq!(
        // SAFETY: the call is refused (error, or no free slot), so the transport keeps no loan.
        send.isend(unsafe { HostBuf::from_slice(&mut m) }, 0, &plan)
            .expect_err("mtu")
            .kind,
        ErrorKind::InvalidArgument
    );
    plan.mtu = 1024;
    plan.lost = vec![
        PacketRun { start: 2, len: 1 },
        PacketRun { start: 1, len: 1 },
    ];
    // SAFETY: the call is refused (error, or no free slot), so the transport keeps no loan.
    assert!(send
        .isend(unsafe { HostBuf::from_slice(&mut m) }, 0, &plan)
        .is_err());
    plan.lost = vec![PacketRun { start: 3, len: 2 }];
    // SAFETY: the call is refused (error, or no free slot), so the transport keeps no loan.
    assert!(send
        .isend(unsafe { HostBuf::from_slice(&mut m) }, 0, &plan)
        .is_err());
    assert!(recv.irecv(&[], &[]).is_err());
    // SAFETY: the call is refused (error, or no free slot), so the transport keeps no loan.
    assert!(recv
        .irecv(&[unsafe { HostBuf::from_slice(&mut m) }], &[1, 2])
        .is_err());
    // SAFETY: the call is refused (error, or no free slot), so the transport keeps no loan.
    let nine: Vec<HostBuf> = (0..9)
        .map(|_| unsafe { HostBuf::from_slice(&mut []) })
        .collect();
    assert!(recv.irecv(&nine, &[0; 9]).is_err());
    // The connection still works.
    let mut data = pattern(5000, 1);
    let mut into = vec![0; 5000];
    let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
    assert!(s.is_ok() && r.is_ok() && into == data);
}

fn plan(effect: Effect, mtu: u32, lost: &[(u32, u32)]) -> LossPlan {
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
const LOSSY_SIZE: usize = (1 << 20) + 3;
const LOSSY_RUNS: [(u32, u32); 4] = [(0, 2), (85, 1), (100, 70), (256, 1)];

fn in_lost_packet(byte: usize, mtu: usize) -> bool {
    let p = (byte / mtu) as u32;
    LOSSY_RUNS.iter().any(|&(s, l)| (s..s + l).contains(&p))
}

fn run_lossy(effect: Effect, nsocks: usize) -> (Vec<u8>, Vec<u8>, Duration) {
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

#[test]
fn zero_effect_zeroes_exactly_the_lost_packets() {
    for nsocks in [1, 3] {
        let (data, into, _) = run_lossy(Effect::Zero, nsocks);
        for (i, (&d, &g)) in data.iter().zip(&into).enumerate() {
            let want = if in_lost_packet(i, 4096) { 0 } else { d };
            assert_eq!(g, want, "byte {i} with {nsocks} sockets");
        }
    }
}

#[test]
fn stale_effect_keeps_old_contents_in_lost_packets() {
    for nsocks in [1, 3] {
        let (data, into, _) = run_lossy(Effect::Stale, nsocks);
        for (i, (&d, &g)) in data.iter().zip(&into).enumerate() {
            let want = if in_lost_packet(i, 4096) { 0x3c } else { d };
            assert_eq!(g, want, "byte {i} with {nsocks} sockets");
        }
    }
}

#[test]
fn retransmit_effect_is_bit_exact_and_slower() {
    for nsocks in [1, 3] {
        let (data, into, elapsed) = run_lossy(Effect::Retransmit, nsocks);
        assert!(into == data, "{nsocks} sockets");
        // Four loss events at 20 ms each.
        assert!(
            elapsed >= Duration::from_millis(80),
            "took only {elapsed:?}"
        );
    }
}

#[test]
fn bitflip_effect_flips_one_bit_in_each_lost_packet() {
    for nsocks in [1, 3] {
        let (data, into, _) = run_lossy(Effect::Bitflip, nsocks);
        let packets = effect::packet_count(LOSSY_SIZE, 4096) as usize;
        for p in 0..packets {
            let r = p * 4096..((p + 1) * 4096).min(LOSSY_SIZE);
            let diff: u32 = data[r.clone()]
                .iter()
                .zip(&into[r.clone()])
                .map(|(a, b)| (a ^ b).count_ones())
                .sum();
            let want = u32::from(in_lost_packet(r.start, 4096));
            assert_eq!(diff, want, "packet {p} with {nsocks} sockets");
        }
    }
}

/// Raw connection to a listener of `t`, for crafting bytes by hand.
fn raw_listener(t: &SocketTransport) -> (SocketListener, Handle) {
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let listener = t.listen_socket(0, &mut handle).expect("listen");
    (listener, Handle::decode(&handle).expect("handle"))
}

fn hello_bytes(h: &Handle, conn_id: u64, index: u16, count: u16) -> [u8; HELLO_SIZE] {
    Hello {
        nonce: h.nonce,
        conn_id,
        index,
        count,
    }
    .encode()
}

#[test]
fn handshake_rejects_bad_peers_and_keeps_serving() {
    let t = loopback(2);
    let (mut listener, h) = raw_listener(&t);
    listener.set_hello_timeout(Duration::from_millis(300));
    let good = hello_bytes(&h, 42, 0, 1);
    let mut wrong_magic = good;
    wrong_magic[0] ^= 0xff;
    let mut wrong_version = good;
    wrong_version[8..10].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    let wrong_nonce = Hello {
        nonce: [0; 16],
        conn_id: 43,
        index: 0,
        count: 1,
    }
    .encode();
    let garbage = [0x41u8; HELLO_SIZE];
    let mut bad_count = good;
    bad_count[12..14].copy_from_slice(&100u16.to_le_bytes());
    let mut peers = Vec::new();
    for bytes in [
        &wrong_magic[..],
        &wrong_version,
        &wrong_nonce,
        &garbage,
        &bad_count,
    ] {
        let mut s = TcpStream::connect(h.addr).expect("raw connect");
        s.write_all(bytes).expect("write");
        peers.push(s);
    }
    // Truncated and closed at once.
    let mut closed = TcpStream::connect(h.addr).expect("raw connect");
    closed.write_all(&good[..10]).expect("write");
    drop(closed);
    // Truncated and left hanging: dropped at the deadline.
    let mut slow = TcpStream::connect(h.addr).expect("raw connect");
    slow.write_all(&HELLO_MAGIC.to_le_bytes()).expect("write");
    // A real peer after all that.
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    h.encode(&mut handle);
    let mut connector = t.connect(0, &handle).expect("connect");
    let send = wait("connector", || connector.poll()).expect("connect");
    let recv = wait("accept", || listener.poll_accept()).expect("accept");
    let start = Instant::now();
    while listener.rejected() < 7 {
        assert!(listener.poll_accept().expect("poll").is_none());
        assert!(
            start.elapsed() < PATIENCE,
            "only {} rejected",
            listener.rejected()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // Every bad peer sees its connection closed.
    for mut p in peers.into_iter().chain([slow]) {
        p.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut b = [0u8; 1];
        assert!(matches!(p.read(&mut b), Ok(0) | Err(_)));
    }
    let mut data = pattern(1 << 20, 5);
    let mut into = vec![0; 1 << 20];
    let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
    assert!(s.is_ok() && r.is_ok() && into == data);
}

#[test]
fn sockets_of_a_connection_are_grouped_by_id_in_any_order() {
    let t = loopback(1);
    let (mut listener, h) = raw_listener(&t);
    // Two interleaved raw connections of 2 sockets each, arriving out of order.
    let mut s = Vec::new();
    for (id, index) in [(7u64, 1u16), (8, 0), (7, 0), (8, 1)] {
        let mut c = TcpStream::connect(h.addr).expect("connect");
        c.write_all(&hello_bytes(&h, id, index, 2)).expect("hello");
        s.push(c);
    }
    let first = wait("first", || listener.poll_accept()).expect("accept");
    let second = wait("second", || listener.poll_accept()).expect("accept");
    // A duplicate socket index is dropped.
    let mut dup = TcpStream::connect(h.addr).expect("connect");
    dup.write_all(&hello_bytes(&h, 9, 0, 2)).expect("hello");
    let mut dup2 = TcpStream::connect(h.addr).expect("connect");
    dup2.write_all(&hello_bytes(&h, 9, 0, 2)).expect("hello");
    let start = Instant::now();
    while listener.rejected() < 1 {
        assert!(listener.poll_accept().expect("poll").is_none());
        assert!(start.elapsed() < PATIENCE);
        std::thread::sleep(Duration::from_millis(5));
    }
    drop((first, second, s, dup, dup2));
}

#[test]
fn a_flood_of_silent_peers_cannot_crowd_out_a_real_one() {
    let t = loopback(2);
    let (mut listener, h) = raw_listener(&t);
    let mut silent = Vec::new();
    for _ in 0..MAX_PENDING + 20 {
        silent.push(TcpStream::connect(h.addr).expect("connect"));
        // Keep the kernel's backlog short by accepting as we go.
        assert!(listener.poll_accept().expect("poll").is_none());
    }
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    h.encode(&mut handle);
    let mut connector = t.connect(0, &handle).expect("connect");
    let send = wait("connect", || connector.poll()).expect("connect");
    let recv = wait("accept", || listener.poll_accept()).expect("accept");
    assert!(
        listener.rejected() >= 20,
        "the oldest silent peers make room"
    );
    let mut data = pattern(100_000, 6);
    let mut into = vec![0; 100_000];
    let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
    assert!(s.is_ok() && r.is_ok() && into == data);
}

/// A raw one-socket peer that says hello and then sends `bytes` as its data stream.
fn raw_sender(t: &SocketTransport, bytes: &[u8]) -> (Box<dyn RecvConn>, TcpStream) {
    let (mut listener, h) = raw_listener(t);
    let mut c = TcpStream::connect(h.addr).expect("connect");
    c.write_all(&hello_bytes(&h, 1, 0, 1)).expect("hello");
    c.write_all(bytes).expect("data");
    let recv = wait("accept", || listener.poll_accept()).expect("accept");
    (recv, c)
}

fn header(size: u64, runs: u32) -> Header {
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

#[test]
fn bad_headers_fail_the_connection() {
    let t = loopback(1);
    let unsorted = {
        let mut b = header(1 << 20, 2).encode().to_vec();
        wire::encode_runs(
            &[
                PacketRun { start: 5, len: 2 },
                PacketRun { start: 6, len: 1 },
            ],
            &mut b,
        );
        b
    };
    let past_end = {
        let mut b = header(8192, 1).encode().to_vec();
        wire::encode_runs(&[PacketRun { start: 1, len: 2 }], &mut b);
        b
    };
    let mut wrong_seq = header(10, 0);
    wrong_seq.seq = 1;
    let mut tiny_mtu = header(10, 0).encode();
    tiny_mtu[12..16].copy_from_slice(&1u32.to_le_bytes());
    let cases: Vec<(Vec<u8>, ErrorKind)> = vec![
        (vec![0xff; 100], ErrorKind::Remote),
        (
            header(1 << 20, 0).encode()[..20].to_vec(),
            ErrorKind::Remote,
        ), // truncated, then EOF
        (unsorted, ErrorKind::Remote),
        (past_end, ErrorKind::Remote),
        (wrong_seq.encode().to_vec(), ErrorKind::Remote),
        (tiny_mtu.to_vec(), ErrorKind::Remote),
        (
            header(1 << 21, 0).encode().to_vec(),
            ErrorKind::InvalidUsage,
        ), // larger than posted
    ];
    for (i, (bytes, kind)) in cases.into_iter().enumerate() {
        let mut buf = vec![0u8; 1 << 20];
        let (recv, peer) = raw_sender(&t, &bytes);
        let start = Instant::now();
        // Headers are read as they arrive: the failure may come before the receive is posted.
        // SAFETY: `buf` is declared before the connection, so it outlives the receive.
        let err = match recv.irecv(&[unsafe { HostBuf::from_slice(&mut buf) }], &[0]) {
            Err(err) => err,
            Ok(r) => {
                let r = r.expect("slot");
                drop(peer);
                wait("failure", || recv.test(r)).expect_err("bad header must fail")
            }
        };
        assert_eq!(err.kind, kind, "case {i}: {err}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn peer_leaving_mid_transfer_ends_the_other_side_quickly() {
    let size = 64 << 20;
    // The receiver closes in an orderly way while a large send is in progress: the send
    // completes (nobody will receive it), as with NCCL's own plugins. A receiver that dies
    // instead fails the send at `test`: cli/tests/conformance.rs and faults.rs kill one.
    let t = loopback(2);
    let mut data = pattern(size, 8);
    let mut into = vec![0u8; size];
    let mut big = vec![0u8; size];
    let (send, recv) = connect_pair(&t);
    let r = recv
        // SAFETY: `into`, `data` and `big` are declared before the connections, so they outlive
        // every request made with them.
        .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0])
        .expect("irecv")
        .expect("slot");
    let s = send
        // SAFETY: as above.
        .isend(
            unsafe { HostBuf::from_slice(&mut data) },
            0,
            &LossPlan::lossless(),
        )
        .expect("isend")
        .expect("slot");
    let s2 = send
        // SAFETY: as above.
        .isend(
            unsafe { HostBuf::from_slice(&mut big) },
            0,
            &LossPlan::lossless(),
        )
        .expect("isend")
        .expect("slot");
    std::thread::sleep(Duration::from_millis(20));
    let _ = recv.test(r);
    drop(recv);
    let start = Instant::now();
    let outcome = wait("send outcome", || match send.test(s2) {
        Ok(None) => Ok(None),
        other => Ok(Some(other)),
    })
    .expect("wait");
    assert!(
        outcome.is_ok(),
        "the receiver closed in an orderly way: {outcome:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    let _ = send.test(s);
    drop(send);

    // The sender goes away while the receiver waits for a large message.
    let mut more = [0u8; 8];
    let (send, recv) = connect_pair(&t);
    let r = recv
        // SAFETY: as above.
        .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0])
        .expect("irecv")
        .expect("slot");
    // SAFETY: as above.
    send.isend(
        unsafe { HostBuf::from_slice(&mut data) },
        0,
        &LossPlan::lossless(),
    )
    .expect("isend");
    std::thread::sleep(Duration::from_millis(5));
    drop(send);
    let start = Instant::now();
    let err = wait("recv failure", || recv.test(r)).expect_err("partial message must fail");
    assert_eq!(err.kind, ErrorKind::Remote, "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
    // Later receives fail at `test`, never at `irecv`.
    // SAFETY: `more` is declared before the connection, so it outlives the receive.
    let late = recv
        .irecv(&[unsafe { HostBuf::from_slice(&mut more) }], &[0])
        .expect("irecv on a failed connection is no error")
        .expect("slot");
    assert!(recv.test(late).is_err());
}

#[test]
fn connect_completes_before_accept_and_refused_connect_fails() {
    let t = loopback(2);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, &mut handle).expect("listen");
    let mut connector = t.connect(0, &handle).expect("connect");
    let send = wait("connect", || connector.poll()).expect("connect");
    assert!(
        connector.poll().is_err(),
        "a finished connector does not connect twice"
    );
    let mut data = pattern(70_000, 2);
    let s = send
        // SAFETY: the buffer outlives the request and is touched again only after it ended.
        .isend(
            unsafe { HostBuf::from_slice(&mut data) },
            0,
            &LossPlan::lossless(),
        )
        .expect("isend")
        .expect("slot");
    let recv = wait("accept", || listener.poll_accept()).expect("accept");
    let mut into = vec![0u8; 70_000];
    let r = recv
        // SAFETY: the buffer outlives the request and is touched again only after it ended.
        .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0])
        .expect("irecv")
        .expect("slot");
    wait("send", || send.test(s)).expect("send");
    wait("recv", || recv.test(r)).expect("recv");
    assert!(into == data);

    // Nobody listens any more: connecting fails after a few retries, without blocking.
    drop(listener);
    let mut connector = t.connect(0, &handle).expect("connect");
    let start = Instant::now();
    loop {
        let poll_start = Instant::now();
        let res = connector.poll();
        assert!(
            poll_start.elapsed() < Duration::from_millis(100),
            "poll blocked"
        );
        match res {
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Ok(Some(_)) => panic!("connected to a closed port"),
            Err(_) => break,
        }
        assert!(start.elapsed() < Duration::from_secs(10));
    }
    let garbage = [0x11u8; HANDLE_WIRE_SIZE];
    assert!(t.connect(0, &garbage).is_err());
    assert!(t.connect(5, &handle).is_err());
}

#[test]
fn properties_describe_the_device() {
    let t = loopback(1);
    assert_eq!(t.device_count(), 1);
    let p = t.properties(0).expect("props");
    assert_eq!(p.name, "lo");
    assert_eq!(p.max_recvs, 1);
    assert_eq!(p.max_comms, 65_536);
    assert!(p.speed_mbps > 0);
    assert!(p.max_p2p_bytes > 0 && p.max_p2p_bytes <= 1 << 40);
    assert!(t.properties(1).is_err());
    let fast = SocketTransport::with_interfaces(
        SocketConfig {
            speed_mbps: Some(123),
            ..SocketConfig::default()
        },
        vec![IfaceAddr {
            name: "lo".into(),
            ip: "127.0.0.1".parse().expect("ip"),
            scope_id: 0,
            is_loopback: true,
        }],
    );
    assert_eq!(fast.properties(0).expect("props").speed_mbps, 123);
}

pub(super) fn count_entries(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

const LEAK_CHILD_ENV: &str = "LOSSY_SOCKET_LEAK_CHILD";

#[test]
fn opening_and_closing_200_connections_leaks_no_threads_or_fds() {
    // Counting threads and descriptors needs a process of its own: other tests run beside us.
    run_child(
        "transport::socket::tests::leak_check_child",
        LEAK_CHILD_ENV,
        &[],
        "leak check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by opening_and_closing_200_connections_leaks_no_threads_or_fds"]
fn leak_check_child() {
    if std::env::var_os(LEAK_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(4);
    let cycle = |i: usize| {
        let (send, recv) = connect_pair(&t);
        if i % 10 == 0 {
            let mut d = pattern(200_000, i as u64);
            let mut r = vec![0; 200_000];
            let (a, b) = send_recv(&*send, &*recv, &mut d, &mut r, &LossPlan::lossless());
            assert!(a.is_ok() && b.is_ok() && r == d);
        }
        if i % 2 == 0 {
            drop(recv);
            drop(send);
        } else {
            drop(send);
            drop(recv);
        }
    };
    cycle(0); // first use may open lasting descriptors (randomness, thread names)
    let counts = || {
        (
            count_entries("/proc/self/task"),
            count_entries("/proc/self/fd"),
        )
    };
    // A joined thread may linger in /proc for a moment after join returns: the kernel wakes
    // the joiner before it finishes reaping the thread. Let the counts settle first.
    let mut before = counts();
    let mut stable = 0;
    while stable < 3 {
        std::thread::sleep(Duration::from_millis(20));
        let now = counts();
        stable = if now == before { stable + 1 } else { 0 };
        before = now;
    }
    for i in 1..=200 {
        cycle(i);
    }
    let start = Instant::now();
    let after = loop {
        let now = counts();
        if now == before || start.elapsed() > Duration::from_secs(2) {
            break now;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        before, after,
        "(threads, fds) before and after 200 connections"
    );
    println!("leak check passed: {before:?} (threads, fds)");
}

/// A lookup over fixed variable values, standing in for the environment.
fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
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

#[test]
fn config_reads_the_environment_and_refuses_bad_values() {
    assert_eq!(
        SocketConfig::from_lookup(env(&[])).expect("empty"),
        SocketConfig::default()
    );
    let c = SocketConfig::from_lookup(env(&[
        ("NCCL_SOCKET_IFNAME", "^docker,lo"),
        ("NCCL_SOCKET_FAMILY", "AF_INET6"),
        ("NCCL_LOSSY_NSOCKS", " 3 "),
        ("NCCL_LOSSY_SPEED_MBPS", "100000"),
        ("NCCL_LOSSY_SOCKBUF", "1048576"),
    ]))
    .expect("valid");
    assert_eq!(c.ifname.as_deref(), Some("^docker,lo"));
    assert_eq!(c.family, Some(Family::V6));
    assert_eq!(
        (c.nsocks, c.speed_mbps, c.sockbuf),
        (3, Some(100_000), Some(1 << 20))
    );
    for bad in [
        ("NCCL_LOSSY_NSOCKS", "0"),
        ("NCCL_LOSSY_NSOCKS", "17"),
        ("NCCL_LOSSY_NSOCKS", "two"),
        ("NCCL_LOSSY_SPEED_MBPS", "-5"),
        ("NCCL_LOSSY_SOCKBUF", "12"),
        ("NCCL_SOCKET_FAMILY", "AF_UNIX"),
    ] {
        let err = SocketConfig::from_lookup(env(&[bad])).expect_err(bad.0);
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
    }
    // Blank values count as unset.
    let c = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_NSOCKS", " ")])).expect("blank");
    assert_eq!(c.nsocks, default_nsocks());
}

/// What the receiver should hold after `data` went through `plan` into a buffer that held
/// `before`.
fn expected_after(data: &[u8], before: &[u8], plan: &LossPlan) -> Vec<u8> {
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

fn random_plan(rng: &mut impl rand::Rng, len: usize) -> LossPlan {
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

#[test]
fn random_traffic_with_grouped_receives_and_every_effect() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for nsocks in [1, 2, 3, 4] {
        let t = loopback(nsocks);
        let (send, recv) = connect_pair(&t);
        for round in 0..25 {
            let n = rng.gen_range(1..=4);
            let buf_tags: Vec<i32> = (0..n).map(|_| rng.gen_range(0..3)).collect();
            // Messages carry the same tags in a shuffled order.
            let mut msg_tags = buf_tags.clone();
            for i in (1..n).rev() {
                msg_tags.swap(i, rng.gen_range(0..=i));
            }
            // Message i goes to the rank-th buffer with its tag, rank = earlier messages with it.
            let target: Vec<usize> = (0..n)
                .map(|i| {
                    let rank = msg_tags[..i].iter().filter(|&&t| t == msg_tags[i]).count();
                    (0..n)
                        .filter(|&b| buf_tags[b] == msg_tags[i])
                        .nth(rank)
                        .expect("buffer")
                })
                .collect();
            let sizes: Vec<usize> = (0..n)
                .map(|_| match rng.gen_range(0..4) {
                    0 => rng.gen_range(0..100),
                    1 => rng.gen_range(60_000..140_000),
                    _ => rng.gen_range(0..(1 << 20)),
                })
                .collect();
            let mut data: Vec<Vec<u8>> = sizes.iter().map(|&len| pattern(len, rng.gen())).collect();
            let plans: Vec<LossPlan> = sizes
                .iter()
                .map(|&len| random_plan(&mut rng, len))
                .collect();
            let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); n];
            for i in 0..n {
                bufs[target[i]] = pattern(sizes[i] + rng.gen_range(0..100), rng.gen());
            }
            let before = bufs.clone();
            // SAFETY: the buffer outlives the request and is touched again only after it ended.
            let hb: Vec<HostBuf> = bufs
                .iter_mut()
                .map(|b| unsafe { HostBuf::from_slice(b) })
                .collect();
            let r = recv.irecv(&hb, &buf_tags).expect("irecv").expect("slot");
            let ids: Vec<_> = (0..n)
                .map(|i| {
                    // SAFETY: the buffer outlives the request and is touched again only after it
                    // ended.
                    send.isend(
                        unsafe { HostBuf::from_slice(&mut data[i]) },
                        msg_tags[i],
                        &plans[i],
                    )
                    .expect("isend")
                    .expect("slot")
                })
                .collect();
            for (i, id) in ids.into_iter().enumerate() {
                let c = wait("send", || send.test(id)).expect("send");
                assert_eq!(c.sizes(), &[sizes[i]]);
            }
            let c = wait("recv", || recv.test(r)).expect("recv");
            for i in 0..n {
                let b = target[i];
                assert_eq!(c.sizes[b], sizes[i], "{nsocks} sockets, round {round}");
                let want = expected_after(&data[i], &before[b], &plans[i]);
                assert!(
                    bufs[b][..sizes[i]] == want[..],
                    "{nsocks} sockets, round {round}, message {i}: {:?}",
                    plans[i].effect
                );
                assert!(
                    bufs[b][sizes[i]..] == before[b][sizes[i]..],
                    "past the message"
                );
            }
        }
    }
}

#[test]
fn timeout_variable_is_parsed_and_bad_values_name_it() {
    let c = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_TIMEOUT", " 2.5 ")])).expect("valid");
    assert_eq!(c.timeout, Some(Duration::from_millis(2500)));
    let c = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_TIMEOUT", "0")])).expect("off");
    assert_eq!(c.timeout, None);
    assert_eq!(SocketConfig::default().timeout, None, "off by default");
    for bad in ["-1", "ten", "1e9", "inf", "NaN", "5s"] {
        let err = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_TIMEOUT", bad)]))
            .expect_err("bad timeout");
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(
            err.message.contains("NCCL_LOSSY_TIMEOUT") && err.message.contains("0 or unset: off"),
            "{err}"
        );
    }
}

/// Messages of mixed sizes (some spread over several sockets) with the receives posted only
/// after the sender closed: every socket saw EOF first, and none of them owed anything.
#[test]
fn a_sender_that_closes_after_its_last_message_does_not_fail_the_receiver() {
    // 0 and odd sizes; 150_001 bytes is 2 chunks, 200_000 is 3 (of at most 70 KB each, so
    // they fit the sockets' buffers before the receiver reads).
    let sizes = [0usize, 7, 150_001, 1, 200_000, 65_535, 3];
    for nsocks in [1, 2, 4] {
        let t = loopback(nsocks);
        let mut more = [0u8; 8];
        let (send, recv) = connect_pair(&t);
        let mut data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(n, 100 + i as u64))
            .collect();
        for d in data.iter_mut() {
            send_and_wait(&*send, d, 3);
        }
        drop(send);
        // Let every receive thread read its socket's EOF before anything is posted.
        std::thread::sleep(Duration::from_millis(200));
        for (i, d) in data.iter().enumerate() {
            let mut into = vec![0xeeu8; d.len() + 5];
            let id = recv
                // SAFETY: the buffer outlives the request and is touched again only after it ended.
                .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[3])
                .expect("irecv after a clean close")
                .expect("slot");
            let done = wait("recv", || recv.test(id)).expect("message delivered");
            assert_eq!(done.sizes(), &[d.len()], "{nsocks} sockets, message {i}");
            assert!(into[..d.len()] == d[..], "{nsocks} sockets, message {i}");
        }
        // The peer is gone: a receive for a message it never sent fails at once, at `test`.
        let late = recv
            // SAFETY: the peer closed every socket, so nothing is ever written into `more`, and the
            // failed receive's loan ends with the connection, dropped before `more`.
            .irecv(&[unsafe { HostBuf::from_slice(&mut more) }], &[3])
            .expect("irecv reports nothing")
            .expect("slot");
        let err = recv.test(late).expect_err("nothing more can come");
        assert_eq!(err.kind, ErrorKind::Remote, "{err}");
        assert!(err.message.contains("closed socket"), "{err}");
    }
}

/// The same with receives posted first, and the last message big enough to keep the other
/// sockets busy while the socket of a small message already reads EOF.
#[test]
fn posted_receives_survive_a_clean_close_on_sockets_that_owe_nothing() {
    for round in 0..20u64 {
        let t = loopback(4);
        let (send, recv) = connect_pair(&t);
        let sizes = [3usize << 20, 5, 0, 1 << 20];
        let mut data: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(n, round * 10 + i as u64))
            .collect();
        let mut into: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let rids: Vec<_> = into
            .iter_mut()
            .map(|b| {
                // SAFETY: the buffer outlives the request and is touched again only after it ended.
                recv.irecv(&[unsafe { HostBuf::from_slice(b) }], &[0])
                    .expect("irecv")
                    .expect("slot")
            })
            .collect();
        for d in data.iter_mut() {
            send_and_wait(&*send, d, 0);
        }
        drop(send);
        for (i, &r) in rids.iter().enumerate() {
            let done = wait("recv", || recv.test(r)).expect("delivered despite the close");
            assert_eq!(done.sizes(), &[sizes[i]]);
        }
        assert!(into == data, "round {round}");
    }
}

/// A raw peer with `count` sockets that said hello; the test writes the data streams.
fn raw_peer(t: &SocketTransport, count: u16) -> (SocketRecvConn, Vec<TcpStream>) {
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

fn chunk_header(seq: u64, chunk: u8, size: u64) -> [u8; wire::HEADER_SIZE] {
    Header {
        seq,
        chunk,
        ..header(size, 0)
    }
    .encode()
}

#[test]
fn a_clean_close_on_a_socket_that_still_owes_a_chunk_is_an_error() {
    let t = loopback(2);
    // Message 0 of 200_000 bytes has chunk 0 on socket 0 and chunk 1 on socket 1. Socket 0
    // delivers its chunk; socket 1 closes cleanly without sending its chunk.
    for post_first in [true, false] {
        let mut into = vec![0u8; 200_000];
        let (recv, mut socks) = raw_peer(&t, 2);
        let mut posted = None;
        if post_first {
            posted = Some(
                // SAFETY: `into` is declared before the connection, so it outlives the receive.
                recv.irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0])
                    .expect("irecv")
                    .expect("slot"),
            );
        }
        let s1 = socks.pop().expect("socket 1");
        s1.shutdown(std::net::Shutdown::Write).expect("half-close");
        wait_for_closed(&recv, 1 << 1);
        let mut s0 = socks.pop().expect("socket 0");
        s0.write_all(&chunk_header(0, 0, 200_000)).expect("header");
        s0.write_all(&pattern(100_000, 1)).expect("chunk");
        let outcome = match posted {
            Some(id) => wait("failure", || recv.test(id)).map(|_| ()),
            // SAFETY: as above.
            None => match recv.irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0]) {
                Err(e) => Err(e),
                Ok(id) => wait("failure", || recv.test(id.expect("slot"))).map(|_| ()),
            },
        };
        let err = outcome.expect_err("chunk 1 never comes");
        assert_eq!(err.kind, ErrorKind::Remote, "{err}");
        assert!(
            err.message.contains("closed socket 1") && err.message.contains("message 0"),
            "{err}"
        );
        drop((s0, s1));
    }
    // An unknown message owes its chunk 0: message 1's is on socket 1, which closed.
    let (mut a, mut b) = (vec![0u8; 10], vec![0u8; 10]);
    let (recv, mut socks) = raw_peer(&t, 2);
    socks[1]
        .shutdown(std::net::Shutdown::Write)
        .expect("half-close");
    socks[0].write_all(&chunk_header(0, 0, 10)).expect("header");
    socks[0].write_all(&[9; 10]).expect("data");
    let ra = recv
        // SAFETY: the buffer outlives the request and is touched again only after it ended.
        .irecv(&[unsafe { HostBuf::from_slice(&mut a) }], &[0])
        .expect("irecv")
        .expect("slot");
    assert_eq!(
        wait("a", || recv.test(ra)).expect("message 0").sizes(),
        &[10]
    );
    assert_eq!(a, vec![9; 10]);
    wait_for_closed(&recv, 1 << 1);
    // SAFETY: `b` is declared before the connection, so it outlives the receive.
    let err = match recv.irecv(&[unsafe { HostBuf::from_slice(&mut b) }], &[0]) {
        Err(e) => e,
        Ok(id) => wait("b", || recv.test(id.expect("slot"))).expect_err("message 1 never comes"),
    };
    assert!(err.message.contains("closed socket 1"), "{err}");
    // EOF in the middle of a chunk is an error too.
    let mut c = vec![0u8; 1000];
    let (recv, mut socks) = raw_peer(&t, 1);
    let rc = recv
        // SAFETY: `c` is declared before the connection, so it outlives the receive.
        .irecv(&[unsafe { HostBuf::from_slice(&mut c) }], &[0])
        .expect("irecv")
        .expect("slot");
    socks[0]
        .write_all(&chunk_header(0, 0, 1000))
        .expect("header");
    socks[0].write_all(&[1; 400]).expect("part");
    drop(socks);
    let err = wait("c", || recv.test(rc)).expect_err("truncated chunk");
    assert_eq!(err.kind, ErrorKind::Remote, "{err}");
}

fn with_timeout(nsocks: usize, timeout: Duration) -> SocketTransport {
    let lo = IfaceAddr {
        name: "lo".into(),
        ip: "127.0.0.1".parse().expect("ip"),
        scope_id: 0,
        is_loopback: true,
    };
    let config = SocketConfig {
        nsocks,
        timeout: Some(timeout),
        ..SocketConfig::default()
    };
    SocketTransport::with_interfaces(config, vec![lo])
}

#[test]
fn a_silent_peer_fails_outstanding_requests_after_the_timeout() {
    let limit = Duration::from_millis(500);
    let t = with_timeout(2, limit);
    // Receiver: the peer connected, sent half a message, and went silent (socket open).
    let mut into = vec![0u8; 1 << 20];
    let (recv, mut socks) = raw_peer(&t, 1);
    // An idle connection does not time out: wait past the limit before posting.
    std::thread::sleep(limit * 2);
    let r = recv
        // SAFETY: `into` is declared before the connection, so it outlives the receive.
        .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0])
        .expect("irecv on an idle connection")
        .expect("slot");
    socks[0]
        .write_all(&chunk_header(0, 0, 1 << 20))
        .expect("header");
    socks[0].write_all(&[1; 1000]).expect("part");
    let start = Instant::now();
    let err = wait("timeout", || recv.test(r)).expect_err("stalled peer");
    let took = start.elapsed();
    assert_eq!(err.kind, ErrorKind::Remote, "{err}");
    assert!(err.message.contains("NCCL_LOSSY_TIMEOUT"), "{err}");
    assert!(
        took >= limit && took < limit + Duration::from_secs(3),
        "{took:?}"
    );
    drop(socks);

    // Sender: the receiving side accepted but never reads; the send blocks in the kernel.
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, &mut handle).expect("listen");
    let mut connector = t.connect(0, &handle).expect("connect");
    let send = wait("connect", || connector.poll()).expect("connected");
    let _recv = wait("accept", || listener.poll_accept()).expect("accepted");
    let mut big = vec![7u8; 256 << 20];
    let s = send
        // SAFETY: `big` outlives the send: the connection is dropped below, before it.
        .isend(
            unsafe { HostBuf::from_slice(&mut big) },
            0,
            &LossPlan::lossless(),
        )
        .expect("isend")
        .expect("slot");
    let start = Instant::now();
    let err = wait("send timeout", || send.test(s)).expect_err("nobody reads");
    assert!(err.message.contains("NCCL_LOSSY_TIMEOUT"), "{err}");
    assert!(start.elapsed() < limit + Duration::from_secs(5));
    drop(send);

    // Accepting: no peer ever connects.
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, &mut handle).expect("listen");
    let start = Instant::now();
    let err = loop {
        match listener.poll_accept() {
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Ok(Some(_)) => panic!("nobody connected"),
            Err(e) => break e,
        }
        assert!(
            start.elapsed() < limit + Duration::from_secs(5),
            "accept never gave up"
        );
    };
    assert!(err.message.contains("NCCL_LOSSY_TIMEOUT"), "{err}");
}

#[test]
fn a_peer_that_skips_a_chunk_fails_the_receive_instead_of_hanging() {
    // Message 0 (200_000 bytes) has chunk 0 on socket 0 and chunk 1 on socket 1; message 1
    // (10 bytes) has its only chunk on socket 1. Socket 1 sends message 1 and never its chunk
    // of message 0. Both orders: message 0 known before or after socket 1 went past it.
    let t = loopback(2);
    for known_first in [true, false] {
        let (mut a, mut b) = (vec![0u8; 200_000], vec![0u8; 10]);
        let (recv, mut socks) = raw_peer(&t, 2);
        let ra = recv
            // SAFETY: `a` and `b` are declared before the connection, so they outlive the receives.
            .irecv(&[unsafe { HostBuf::from_slice(&mut a) }], &[0])
            .expect("irecv")
            .expect("slot");
        let _rb = recv
            // SAFETY: as above.
            .irecv(&[unsafe { HostBuf::from_slice(&mut b) }], &[0])
            .expect("irecv")
            .expect("slot");
        let (first, second) = socks.split_at_mut(1);
        let mut chunk0 = chunk_header(0, 0, 200_000).to_vec();
        chunk0.extend_from_slice(&pattern(100_000, 3));
        let mut msg1 = chunk_header(1, 0, 10).to_vec();
        msg1.extend_from_slice(&[5; 10]);
        if known_first {
            first[0].write_all(&chunk0).expect("chunk 0");
            std::thread::sleep(Duration::from_millis(50));
            second[0].write_all(&msg1).expect("message 1");
        } else {
            second[0].write_all(&msg1).expect("message 1");
            std::thread::sleep(Duration::from_millis(50));
            first[0].write_all(&chunk0).expect("chunk 0");
        }
        let err = wait("failure", || recv.test(ra)).expect_err("chunk 1 was skipped");
        assert_eq!(err.kind, ErrorKind::Remote, "{err}");
        assert!(
            err.message
                .contains("skipped the chunk of message 0 that socket 1"),
            "{err}"
        );
        drop(socks);
    }
}
