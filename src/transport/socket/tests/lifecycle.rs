//! Connecting, closing and failing: connect before accept, device properties, leaks, the
//! environment, clean and unclean closes, timeouts.

use super::*;

/// A refused connect is tried again for as long as NCCL's Socket transport tries one (34
/// times, the k-th after a pause of k x 100 ms: about a minute, `socketConnectCheck` in
/// src/os/linux.cc), so a listener that answers a few seconds late still gets its
/// connection. Ours gave up after 20 tries 100 ms apart (2 s).
#[test]
fn a_refused_connect_is_tried_again_as_long_as_nccl_tries_it() {
    let t = loopback(1);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    drop(t.listen(0, None, &mut handle).expect("listen"));
    let addr = crate::transport::socket::wire::Handle::decode(&handle)
        .expect("handle")
        .addr;
    let mut connector = t.connect(0, None, &handle).expect("connect");
    let start = Instant::now();
    // Refused until the listener comes back, 3 s later (std's listener reuses the address).
    let mut late = None;
    let connected = loop {
        if late.is_none() && start.elapsed() > Duration::from_secs(3) {
            late = Some(std::net::TcpListener::bind(addr).expect("listen again"));
        }
        match connector.poll() {
            Ok(Some(conn)) => break Ok(conn),
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => break Err(e),
        }
        assert!(
            start.elapsed() < PATIENCE,
            "connect neither done nor failed"
        );
    };
    if let Err(e) = connected {
        panic!(
            "a connect refused for {:.1} s failed instead of trying again: {e}",
            start.elapsed().as_secs_f64()
        );
    }
    assert!(late.is_some(), "connected before anything listened again");
}

#[test]
fn connect_completes_before_accept_and_refused_connect_fails() {
    let t = loopback(2);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, None, &mut handle).expect("listen");
    let mut connector = t.connect(0, None, &handle).expect("connect");
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

    // Nobody listens any more: connecting fails after its retries, without blocking (three
    // here, NCCL's 34 take a minute).
    drop(listener);
    let few = loopback_with(SocketConfig {
        retries: crate::transport::socket::ConnectRetries {
            count: 3,
            pause: Duration::from_millis(10),
        },
        ..SocketConfig::default()
    });
    let mut connector = few.connect(0, None, &handle).expect("connect");
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
    assert!(t.connect(0, None, &garbage).is_err());
    assert!(t.connect(5, None, &handle).is_err());
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
            running: true,
        }],
    );
    assert_eq!(fast.properties(0).expect("props").speed_mbps, 123);
}

const LEAK_CHILD_ENV: &str = "LOSSY_SOCKET_LEAK_CHILD";

#[test]
fn opening_and_closing_200_connections_leaks_no_threads_or_fds() {
    // Counting threads and descriptors needs a process of its own: other tests run beside us.
    run_child(
        "transport::socket::tests::lifecycle::leak_check_child",
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
    assert_eq!(c.nsocks, DEFAULT_NSOCKS);
}

#[test]
fn timeout_variable_is_parsed_and_bad_values_name_it() {
    let c = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_TIMEOUT", " 2.5 ")])).expect("valid");
    assert_eq!(c.timeout, Some(Duration::from_millis(2500)));
    let c = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_TIMEOUT", "0")])).expect("off");
    assert_eq!(c.timeout, None);
    assert_eq!(SocketConfig::default().timeout, None, "off by default");
    let c = SocketConfig::from_lookup(env(&[("NCCL_LOSSY_TIMEOUT", "0.001")])).expect("1 ms");
    assert_eq!(c.timeout, Some(Duration::from_millis(1)));
    // Below a millisecond: a positive value that became a zero timeout (`1e-300`), or one
    // that fails every connection at once, and the error said `NCCL_LOSSY_TIMEOUT=0`.
    for bad in ["-1", "ten", "1e9", "inf", "NaN", "5s", "1e-300", "0.0009"] {
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
    let mut listener = t.listen(0, None, &mut handle).expect("listen");
    let mut connector = t.connect(0, None, &handle).expect("connect");
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
    let mut listener = t.listen(0, None, &mut handle).expect("listen");
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

const POOL_FDS_CHILD_ENV: &str = "LOSSY_SOCKET_POOL_FDS_CHILD";

#[test]
fn an_io_pool_that_does_not_fit_the_descriptor_limit_is_refused_naming_ulimit() {
    // Lowering the limit needs a process of its own: other tests run beside us.
    run_child(
        "transport::socket::tests::lifecycle::pool_fds_child",
        POOL_FDS_CHILD_ENV,
        &[("NCCL_LOSSY_IO_THREADS", "1")],
        "pool fd check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by an_io_pool_that_does_not_fit_the_descriptor_limit_is_refused_naming_ulimit"]
fn pool_fds_child() {
    if std::env::var_os(POOL_FDS_CHILD_ENV).is_none() {
        return;
    }
    // Descriptors are numbered densely from here on, so the limit (on numbers) and the budget
    // check (on counts) agree.
    close_inherited_fds();
    let t = loopback(1);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen_socket(0, &mut handle).expect("listen");
    // Room for the connector's socket: the sending side starts first (before the accept) and
    // makes the process's I/O pool, whose epoll instance and eventfd do not both fit.
    let first_free = fd_numbers().len() as i32;
    let limit = libc::rlimit {
        rlim_cur: first_free as u64 + 1,
        rlim_max: first_free as u64 + 64,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
    // The connect is refused before any of its sockets reaches the peer: a peer whose
    // accept completed a connection we then dropped would fail later, mid-run, at its `test`.
    let err = match t.connect(0, None, &handle) {
        Err(e) => e,
        Ok(mut connector) => wait("the refused connect", || {
            connector.poll().map(|c| c.map(drop))
        })
        .expect_err("connected with no room for the I/O pool"),
    };
    let text = err.to_string();
    assert_eq!(err.kind, ErrorKind::System, "{text}");
    assert!(text.contains("`ulimit -n`"), "{text}");
    assert!(text.contains("NCCL_LOSSY_IO_THREADS"), "{text}");
    let roomy = libc::rlimit {
        rlim_cur: first_free as u64 + 64,
        rlim_max: first_free as u64 + 64,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &roomy) }, 0);
    for _ in 0..20 {
        let accepted = listener.poll_accept_socket().expect("accept");
        assert!(
            accepted.is_none(),
            "the listener accepted a connection whose connect had failed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        listener.pending(),
        0,
        "sockets of the failed connect reached the peer"
    );
    println!("pool fd check passed: {text}");
}

/// The numbers of this process's open descriptors (the listing's own one, closed by then, left
/// out).
/// Closes every descriptor this (child) process inherited above stderr, so the ones it opens
/// are numbered densely.
pub(super) fn close_inherited_fds() {
    for n in fd_numbers().into_iter().filter(|&n| n > 2) {
        // SAFETY: called first in a child process that has opened nothing yet: every
        // descriptor above stderr was inherited (the test runner's), and nothing here uses it.
        unsafe { libc::close(n) };
    }
}

pub(super) fn fd_numbers() -> Vec<i32> {
    let listed: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    listed
        .into_iter()
        .filter(|n| std::fs::read_link(format!("/proc/self/fd/{n}")).is_ok())
        .collect()
}

fn iface(name: &str, ip: &str, running: bool) -> IfaceAddr {
    IfaceAddr {
        name: name.into(),
        ip: ip.parse().expect("ip"),
        scope_id: 0,
        is_loopback: name == "lo",
        running,
    }
}

#[test]
fn a_one_character_ifname_chooses_as_if_unset() {
    // NCCL reads NCCL_SOCKET_IFNAME only when it is longer than one character: `^` does not
    // let loopback in beside eth0, `=` does not ask for an interface named "".
    let host = [
        iface("lo", "127.0.0.1", true),
        iface("eth0", "10.0.0.2", true),
    ];
    for spec in ["^", "=", "e"] {
        let config = SocketConfig {
            ifname: Some(spec.into()),
            ..SocketConfig::default()
        };
        let t = SocketTransport::choosing_from(config, &host).expect(spec);
        assert_eq!(t.device_count(), 1, "NCCL_SOCKET_IFNAME={spec}");
        assert_eq!(t.properties(0).expect("dev 0").name, "eth0", "{spec}");
    }
}

#[test]
fn no_usable_interface_error_names_what_the_host_has() {
    let host = [iface("eth1", "10.0.0.1", false)];
    let config = SocketConfig {
        ifname: Some("eth".into()),
        ..SocketConfig::default()
    };
    let err = SocketTransport::choosing_from(config, &host)
        .err()
        .expect("no device");
    // NCCL's Socket plugin: ncclInternalError (`ncclNetSocketInit`).
    assert_eq!(err.kind, ErrorKind::Internal);
    let msg = err.to_string();
    assert!(msg.contains("NCCL_SOCKET_IFNAME=eth,"), "{msg}");
    assert!(msg.contains("NCCL_SOCKET_FAMILY=unset"), "{msg}");
    assert!(
        msg.contains("eth1 10.0.0.1 (interface not running)"),
        "{msg}"
    );
}

const POOL_SPAWN_CHILD_ENV: &str = "LOSSY_SOCKET_POOL_SPAWN_CHILD";

/// Threads of this process named `lossy-io*` (the I/O pool's).
fn pool_threads() -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").expect("list this process's threads");
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|name| name.starts_with("lossy-io"))
        })
        .count()
}

/// An I/O pool thread that cannot start (no memory for its stack here, as `pthread_create`
/// fails with `EAGAIN` at the process limit, `ulimit -u`) refuses the connect with an error
/// that says how to do without the pool, leaves no thread of a half-started pool behind, and
/// a later connect starts the pool and works.
#[test]
fn an_io_pool_thread_that_cannot_start_refuses_the_connect_and_a_later_one_works() {
    // Lowering the limit needs a process of its own: other tests run beside us.
    run_child(
        "transport::socket::tests::lifecycle::pool_spawn_child",
        POOL_SPAWN_CHILD_ENV,
        &[("NCCL_LOSSY_IO_THREADS", "2")],
        "pool spawn check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by an_io_pool_thread_that_cannot_start_refuses_the_connect_and_a_later_one_works"]
fn pool_spawn_child() {
    if std::env::var_os(POOL_SPAWN_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(1);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let _listener = t.listen_socket(0, &mut handle).expect("listen");
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmSize");
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut old) }, 0);
    // Room for small allocations, none for a thread's 256 KiB stack.
    let tight = libc::rlimit {
        rlim_cur: (vm_kib + 64) << 10,
        rlim_max: old.rlim_max,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &tight) }, 0);
    let outcome = t.connect(0, None, &handle).map(drop);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &old) }, 0);
    let err = outcome.expect_err("connected with no memory for the pool's threads");
    let text = err.to_string();
    assert_eq!(err.kind, ErrorKind::System, "{text}");
    assert!(
        text.contains("cannot start an I/O pool thread")
            && text.contains("NCCL_LOSSY_IO_THREADS=0"),
        "{text}"
    );
    assert_eq!(pool_threads(), 0, "a half-started pool left threads behind");
    let (send, recv) = connect_pair(&t);
    // A thread names itself once it runs.
    wait("the pool's 2 threads for a later connection", || {
        Ok((pool_threads() == 2).then_some(()))
    })
    .expect("pool threads");
    let mut data = pattern(10_000, 5);
    let mut into = vec![0u8; 10_000];
    let (s, r) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
    assert!(s.is_ok() && r.is_ok() && into == data);
    println!("pool spawn check passed");
}

#[test]
fn unset_settings_give_one_socket_and_no_pool_thread() {
    // Above 4 cores the defaults were 4 sockets and a quarter of the cores as pool threads,
    // argued for large messages on many cores; measured on a 16-core GPU host they took 3-66%
    // longer at every size from 8 B to 256 MiB, over 1 and over 8 channels, than one socket
    // moved inline (docs/gpu-host.md), NCCL's Socket transport's default. `io_threads` reads
    // this process's environment, which the tests leave without the variable.
    assert!(
        std::env::var_os("NCCL_LOSSY_IO_THREADS").is_none(),
        "run the tests without NCCL_LOSSY_IO_THREADS set"
    );
    let unset = SocketConfig::from_lookup(env(&[])).expect("no settings");
    assert_eq!(
        (
            unset.nsocks,
            SocketConfig::default().nsocks,
            conn::io_threads()
        ),
        (1, 1, 0)
    );
}
