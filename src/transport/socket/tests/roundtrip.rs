//! Round trips: sizes, socket counts, requests in flight, grouped receives, bad arguments.

use super::*;

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
        running: true,
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
        // The send is tested too, as NCCL's proxy tests what it posted: on an idle
        // connection its bytes leave at its test (docs/transport.md, "When a send starts").
        let mut sent = false;
        let err = wait("recv error", || {
            if let (Some(s), false) = (s, sent) {
                sent = !matches!(send.test(s), Ok(None));
            }
            recv.test(r)
        })
        .expect_err("must fail");
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
    let s = send
        .isend(
            unsafe { HostBuf::from_slice(&mut m) },
            5,
            &LossPlan::lossless(),
        )
        .expect("isend")
        .expect("slot");
    // Its test sends it (an idle connection's bytes leave at the send's test).
    assert!(
        send.test(s).expect("test").is_some(),
        "64 bytes did not go at once"
    );
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
