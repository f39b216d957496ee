//! The I/O engine's bounds: threads and descriptors with many connections, a retransmit delay
//! that holds no other connection, calls that never block on a peer that receives nothing;
//! and its system-call economy: reads that carry several messages, gathered sends (delayed
//! acknowledgements: `tests/acks.rs`; the pool threads: `tests/pool.rs`).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::tests::{
    connect_pair, count_entries, loopback, pattern, run_child, send_recv, wait, PATIENCE,
};
use crate::loss::plan::{Effect, LossPlan, PacketRun};
use crate::transport::HostBuf;

const SCALE_CHILD_ENV: &str = "LOSSY_SOCKET_SCALE_CHILD";

fn counts() -> (usize, usize) {
    (
        count_entries("/proc/self/task"),
        count_entries("/proc/self/fd"),
    )
}

/// Waits until the thread and descriptor counts stop changing (a joined thread may linger in
/// /proc for a moment), or until they equal `target`.
fn settled(target: Option<(usize, usize)>) -> (usize, usize) {
    let start = Instant::now();
    let mut last = counts();
    let mut stable = 0;
    while stable < 3 && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(20));
        let now = counts();
        if Some(now) == target {
            return now;
        }
        stable = if now == last { stable + 1 } else { 0 };
        last = now;
    }
    last
}

fn status_kib(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn many_connections_share_a_few_io_threads_and_one_descriptor_per_socket() {
    // Counting threads and descriptors needs a process of its own: other tests run beside us.
    // With pool threads (`NCCL_LOSSY_IO_THREADS`), so the bound is theirs.
    run_child(
        "transport::socket::engine_tests::scale_child",
        SCALE_CHILD_ENV,
        &[("NCCL_LOSSY_IO_THREADS", "4")],
        "scale check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by many_connections_share_a_few_io_threads_and_one_descriptor_per_socket"]
fn scale_child() {
    if std::env::var_os(SCALE_CHILD_ENV).is_none() {
        return;
    }
    const PAIRS: usize = 256;
    const NSOCKS: usize = 4;
    let t = loopback(NSOCKS);
    {
        // First use may open lasting descriptors (randomness, thread names).
        let (send, recv) = connect_pair(&t);
        let mut d = pattern(1000, 1);
        let mut r = vec![0; 1000];
        let (a, b) = send_recv(&*send, &*recv, &mut d, &mut r, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok() && r == d);
    }
    let before = settled(None);
    let mut pairs = Vec::with_capacity(PAIRS);
    for i in 0..PAIRS {
        let (send, recv) = connect_pair(&t);
        let mut d = pattern(300_000, i as u64);
        let mut r = vec![0; 300_000];
        let (a, b) = send_recv(&*send, &*recv, &mut d, &mut r, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok() && r == d, "pair {i}");
        pairs.push((send, recv));
    }
    let during = settled(None);
    let threads = during.0 - before.0;
    let sockets = 2 * PAIRS * NSOCKS;
    let fds_extra = during.1 - before.1 - sockets;
    println!(
        "{PAIRS} send + {PAIRS} receive comms, {NSOCKS} sockets each: {} threads ({threads} \
         more), {} fds ({sockets} sockets + {fds_extra}), VmRSS {} KiB, VmSize {} KiB",
        during.0,
        during.1,
        status_kib("VmRSS:"),
        status_kib("VmSize:")
    );
    assert!(threads <= 32, "{threads} I/O threads for {PAIRS} pairs");
    assert!(
        fds_extra <= 40,
        "{fds_extra} descriptors beyond the sockets"
    );
    drop(pairs);
    assert_eq!(settled(Some(before)), before, "after closing {PAIRS} pairs");
    for i in 0..1000 {
        let (send, recv) = connect_pair(&t);
        if i % 2 == 0 {
            drop(recv);
            drop(send);
        } else {
            drop(send);
            drop(recv);
        }
    }
    assert_eq!(settled(Some(before)), before, "after 1,000 connections");
    println!("scale check passed: {before:?} (threads, fds)");
}

#[test]
fn a_retransmit_delay_holds_no_other_connection() {
    let t = loopback(2);
    let (slow_send, slow_recv) = connect_pair(&t);
    let (send, recv) = connect_pair(&t);
    let size = 1 << 20;
    let mut slow_data = pattern(size, 5);
    let mut slow_into = vec![0u8; size];
    let delayed = LossPlan {
        effect: Effect::Retransmit,
        mtu: 4096,
        lost: vec![PacketRun { start: 3, len: 1 }],
        retransmit_timeout: Duration::from_secs(3),
        flip_seed: 0,
    };
    // SAFETY: the buffers outlive both requests, which end before this test returns.
    let r = slow_recv
        .irecv(&[unsafe { HostBuf::from_slice(&mut slow_into) }], &[1])
        .expect("irecv")
        .expect("slot");
    // SAFETY: as above.
    let s = slow_send
        .isend(unsafe { HostBuf::from_slice(&mut slow_data) }, 1, &delayed)
        .expect("isend")
        .expect("slot");
    // The other connection moves 20 messages while the delayed one stays pending.
    for i in 0..20u64 {
        let mut d = pattern(size, 100 + i);
        let mut into = vec![0u8; size];
        let (a, b) = send_recv(&*send, &*recv, &mut d, &mut into, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok() && into == d, "message {i}");
        assert!(
            slow_recv.test(r).expect("pending").is_none(),
            "the delayed message arrived before message {i} of the other connection"
        );
    }
    wait("delayed send", || slow_send.test(s)).expect("delayed send");
    wait("delayed receive", || slow_recv.test(r)).expect("delayed receive");
    assert!(slow_into == slow_data);
}

#[test]
fn isend_and_test_return_while_the_receiver_posts_nothing() {
    let t = loopback(2);
    let (send, recv) = connect_pair(&t);
    let size = 64 << 20; // far more than the sockets' buffers hold
    let mut data = pattern(size, 9);
    let mut into = vec![0u8; size];
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|scope| {
        let send = &*send;
        let data = &mut data;
        scope.spawn(move || {
            // SAFETY: `data` outlives the request, which ends before the scope does.
            let id = send
                .isend(
                    unsafe { HostBuf::from_slice(data) },
                    4,
                    &LossPlan::lossless(),
                )
                .expect("isend")
                .expect("slot");
            tx.send(None).expect("report");
            for _ in 0..1000 {
                assert!(send.test(id).expect("test").is_none());
            }
            tx.send(None).expect("report");
            let done = wait("send", || send.test(id)).expect("send completes");
            tx.send(Some(done.sizes()[0])).expect("report");
        });
        // Both reports come while nothing is posted: the calls neither block nor wait.
        for what in ["isend", "1,000 tests"] {
            let got = rx.recv_timeout(PATIENCE);
            assert!(matches!(got, Ok(None)), "{what} did not return: {got:?}");
        }
        // SAFETY: `into` outlives the request, which ends before the scope does.
        let r = recv
            .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[4])
            .expect("irecv")
            .expect("slot");
        let got = wait("receive", || recv.test(r)).expect("receive");
        assert_eq!(got.sizes(), &[size]);
        assert_eq!(rx.recv_timeout(PATIENCE), Ok(Some(size)));
    });
    assert!(into == data);
}

const FDS_CHILD_ENV: &str = "LOSSY_SOCKET_FDS_CHILD";

#[test]
fn a_connection_that_does_not_fit_the_descriptor_limit_is_refused_naming_ulimit() {
    // Lowering the limit needs a process of its own: other tests run beside us.
    run_child(
        "transport::socket::engine_tests::fds_child",
        FDS_CHILD_ENV,
        &[],
        "fd budget check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by a_connection_that_does_not_fit_the_descriptor_limit_is_refused_naming_ulimit"]
fn fds_child() {
    use crate::transport::{Transport, HANDLE_WIRE_SIZE};
    use crate::ErrorKind;
    if std::env::var_os(FDS_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(4);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let _listener = t.listen(0, None, &mut handle).expect("listen");
    // Two descriptors left: fewer than the 4 sockets of a connection.
    let used = count_entries("/proc/self/fd") as u64;
    let limit = libc::rlimit {
        rlim_cur: used + 2,
        rlim_max: used + 2,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(rc, 0, "setrlimit");
    let err = match t.connect(0, None, &handle) {
        Ok(_) => panic!("a connection of 4 sockets was started with 2 descriptors left"),
        Err(e) => e,
    };
    assert_eq!(err.kind, ErrorKind::System, "{err}");
    let text = err.to_string();
    assert!(text.contains("`ulimit -n`"), "{text}");
    assert!(text.contains("needs 4 file descriptors"), "{text}");
    assert!(text.contains(&format!("limit of {}", used + 2)), "{text}");
    println!("fd budget check passed: {text}");
}

/// A zero-loss plan over `mtu`-byte packets that loses every other packet from packet 1 on,
/// `runs` times: `runs + 1` kept ranges, more than one gathered send takes.
fn every_other_packet(effect: Effect, mtu: u32, runs: u32) -> LossPlan {
    LossPlan {
        effect,
        mtu,
        lost: (0..runs)
            .map(|i| PacketRun {
                start: 1 + 2 * i,
                len: 1,
            })
            .collect(),
        retransmit_timeout: Duration::from_micros(50),
        flip_seed: 0,
    }
}

#[test]
fn messages_queued_before_their_receives_arrive_intact_one_read_at_a_time_or_many() {
    // Sizes around the header (56 bytes) and the receive stage (16 KiB): a read may carry
    // several whole messages, end inside a header, inside the lost-run list or inside a
    // payload, and a large read may spill the next header into the stage.
    let stage = 16 << 10;
    let sizes = [
        0,
        1,
        55,
        56,
        57,
        4000,
        stage - 57,
        stage - 56,
        stage,
        stage + 1,
        40_000,
        3,
        200_000,
        9,
    ];
    for nsocks in [1, 2] {
        let t = loopback(nsocks);
        let (send, recv) = connect_pair(&t);
        for (batch, group) in sizes.chunks(7).enumerate() {
            let plans: Vec<LossPlan> = group
                .iter()
                .enumerate()
                .map(|(i, &size)| {
                    if i % 3 == 1 && size >= 64 * 8 {
                        every_other_packet(Effect::Zero, 64, (size as u32 / 64 / 2).min(200))
                    } else {
                        LossPlan::lossless()
                    }
                })
                .collect();
            let mut data: Vec<Vec<u8>> = group
                .iter()
                .enumerate()
                .map(|(i, &n)| pattern(n, (batch * 10 + i) as u64 + 1))
                .collect();
            // Every message is sent (in the socket buffers) before any receive is posted.
            let ids: Vec<_> = data
                .iter_mut()
                .zip(&plans)
                .map(|(d, plan)| {
                    // SAFETY: the buffer outlives the request and is touched again only after
                    // it ended.
                    let buf = unsafe { HostBuf::from_slice(d) };
                    wait("isend slot", || send.isend(buf, 5, plan)).expect("isend")
                })
                .collect();
            for id in ids {
                wait("send", || send.test(id)).expect("send");
            }
            for (i, d) in data.iter().enumerate() {
                let mut into = vec![0xeeu8; d.len() + 100];
                // SAFETY: as above.
                let r = recv
                    .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[5])
                    .expect("irecv")
                    .expect("slot");
                let got = wait("receive", || recv.test(r)).expect("receive");
                assert_eq!(got.sizes(), &[d.len()], "{nsocks} sockets, message {i}");
                let mut want = d.clone();
                crate::loss::effect::zero_lost(
                    &mut want,
                    0,
                    &plans[i].lost,
                    plans[i].mtu.max(1),
                    d.len(),
                );
                assert!(
                    into[..d.len()] == want[..],
                    "{nsocks} sockets, batch {batch}, message {i} of {} bytes differs",
                    d.len()
                );
                assert!(
                    into[d.len()..].iter().all(|&b| b == 0xee),
                    "past the message"
                );
            }
        }
    }
}

#[test]
fn a_message_cut_into_more_ranges_than_one_send_gathers_arrives_intact() {
    // 100 runs: more ranges than one gathered send takes; 3 runs of a 9-packet message: few
    // enough bytes to travel in the header's buffer, its retransmission after it.
    for (mtu, runs) in [(64u32, 100u32), (64, 3)] {
        a_message_cut_into_ranges_arrives_intact(mtu, runs);
    }
}

fn a_message_cut_into_ranges_arrives_intact(mtu: u32, runs: u32) {
    let size = (mtu * (2 * runs + 3)) as usize;
    for effect in [Effect::Zero, Effect::Retransmit] {
        for nsocks in [1, 3] {
            let t = loopback(nsocks);
            let (send, recv) = connect_pair(&t);
            let mut plan = every_other_packet(effect, mtu, runs);
            plan.retransmit_timeout = Duration::from_millis(5);
            let mut data = pattern(size, 3);
            let mut into = vec![0x11u8; size];
            let start = Instant::now();
            let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &plan);
            let took = start.elapsed();
            assert!(s.is_ok() && r.is_ok());
            if effect == Effect::Retransmit {
                // The lost packets go again only after one timeout per loss event (a lower
                // bound: a slow machine only adds to it).
                let wait = plan.retransmit_timeout * runs;
                assert!(
                    took >= wait,
                    "{runs} runs: retransmitted after {took:?} < {wait:?}"
                );
            }
            let mut want = data.clone();
            if effect == Effect::Zero {
                crate::loss::effect::zero_lost(&mut want, 0, &plan.lost, mtu, size);
            }
            for (i, (&g, &w)) in into.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{effect:?}, {nsocks} sockets, {runs} runs: byte {i}");
            }
        }
    }
}
