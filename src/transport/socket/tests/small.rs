//! Small messages on a one-socket connection, which take the shortest way through both state
//! machines (`send_small`, `deliver_staged`): the same bytes, sizes, completions and errors as
//! every other message, whether the receive comes first or last, several messages arrive in
//! one read, or the socket fills in the middle of one.

use std::net::TcpListener;

use super::*;

/// Posts one receive of `into` with `tag` (a free slot assumed).
fn post_recv(recv: &dyn RecvConn, into: &mut [u8], tag: i32) -> crate::transport::RequestId {
    // SAFETY: every caller keeps `into` alive and untouched until the receive has ended.
    recv.irecv(&[unsafe { HostBuf::from_slice(into) }], &[tag])
        .expect("irecv")
        .expect("slot")
}

/// Posts one lossless send of `data` with `tag` (a free slot assumed).
fn post_send(send: &dyn SendConn, data: &mut [u8], tag: i32) -> crate::transport::RequestId {
    // SAFETY: every caller keeps `data` alive and untouched until the send has ended.
    send.isend(
        unsafe { HostBuf::from_slice(data) },
        tag,
        &LossPlan::lossless(),
    )
    .expect("isend")
    .expect("slot")
}

/// Sizes around every boundary of the short ways: empty, a few bytes, the most copied behind
/// the header (1 KiB), the most a stage holds behind a header (4 KiB less 56), and past it.
const SIZES: [usize; 12] = [0, 1, 7, 8, 100, 1000, 1024, 1025, 2000, 4040, 4041, 4096];

#[test]
fn small_messages_arrive_exact_whether_the_receive_comes_first_or_last() {
    let (send, recv) = one_socket_pair(true);
    for (round, &size) in SIZES.iter().chain(SIZES.iter().rev()).enumerate() {
        let receive_first = round % 2 == 0;
        let mut data = pattern(size, round as u64);
        let mut into = vec![0xeeu8; size + 16];
        let (r, s) = if receive_first {
            let r = post_recv(&recv, &mut into, 3);
            (r, post_send(&*send, &mut data, 3))
        } else {
            let s = post_send(&*send, &mut data, 3);
            // The message leaves at its test and waits in the socket for a receive.
            wait("the send", || send.test(s)).expect("send");
            (post_recv(&recv, &mut into, 3), s)
        };
        let got = wait("the receive", || {
            // Tested in turn, as NCCL's proxy does (the send may still be under way).
            let _ = send.test(s);
            recv.test(r)
        })
        .expect("receive");
        assert_eq!(got.sizes(), &[size], "round {round}: size {size}");
        assert!(
            into[..size] == data[..],
            "round {round}: {size} bytes differ"
        );
        assert!(
            into[size..].iter().all(|&b| b == 0xee),
            "round {round}: bytes written past the message of {size}"
        );
    }
}

#[test]
fn several_small_messages_read_together_land_in_their_own_receives() {
    let (send, recv) = one_socket_pair(true);
    let sizes = [8usize, 0, 300, 1024, 17, 4000, 64, 2];
    let mut datas: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, 100 + i as u64))
        .collect();
    // All sent before any receive is posted: they wait in the socket, and the first read
    // brings several of them into the stage at once.
    let ids: Vec<_> = datas.iter_mut().map(|d| post_send(&*send, d, 9)).collect();
    for &id in &ids {
        wait("a send", || send.test(id)).expect("send");
    }
    wait_for_bytes(&recv, sizes.iter().map(|n| n + wire::HEADER_SIZE).sum());
    let mut intos: Vec<Vec<u8>> = sizes.iter().map(|_| vec![0u8; 4096]).collect();
    let rids: Vec<_> = intos
        .iter_mut()
        .map(|into| post_recv(&recv, into, 9))
        .collect();
    for (i, &r) in rids.iter().enumerate() {
        let got = wait("a receive", || recv.test(r)).expect("receive");
        assert_eq!(got.sizes(), &[sizes[i]], "message {i}");
    }
    for (i, n) in sizes.iter().enumerate() {
        assert!(intos[i][..*n] == datas[i][..], "message {i} differs");
    }
}

#[test]
fn a_small_message_with_another_tag_or_too_large_still_fails_its_receive() {
    for (tag, room, kind, says) in [
        (4, 64, ErrorKind::InvalidUsage, "tag 5"),
        (
            5,
            10,
            ErrorKind::InvalidUsage,
            "larger than the posted receive",
        ),
    ] {
        let (send, recv) = one_socket_pair(true);
        let mut data = pattern(64, 1);
        let mut into = vec![0u8; room];
        let r = post_recv(&recv, &mut into, tag);
        let s = post_send(&*send, &mut data, 5);
        wait("the send", || send.test(s)).expect("64 bytes go at once");
        let err = wait("the receive's failure", || recv.test(r)).expect_err("must fail");
        assert_eq!(err.kind, kind, "{err}");
        assert!(err.to_string().contains(says), "{err}");
        assert!(
            into.iter().all(|&b| b == 0),
            "bytes landed in a receive that failed"
        );
    }
}

/// A sender whose socket fills while small messages go one at a time (each posted on an idle
/// connection, so each is sent whole or cut where the socket is full): the peer, which reads
/// nothing for a while and then everything, gets every header and payload once and in order.
#[test]
fn small_messages_cut_by_a_full_socket_go_on_where_they_stopped() {
    const COUNT: usize = 64;
    const SIZE: usize = 1000;
    let t = loopback_with(SocketConfig {
        nsocks: 1,
        sockbuf: Some(4096),
        ..SocketConfig::default()
    });
    let (_listener, handle) = raw_listener(&t);
    let plain = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut wire_handle = [0u8; HANDLE_WIRE_SIZE];
    wire::Handle {
        addr: plain.local_addr().expect("address"),
        ..handle
    }
    .encode(&mut wire_handle);
    let mut connector = t.connect(0, None, &wire_handle).expect("connect");
    let send = wait("connect", || connector.poll()).expect("connect");
    let (mut peer, _) = plain.accept().expect("accept");
    socket2::SockRef::from(&peer)
        .set_recv_buffer_size(4096)
        .expect("SO_RCVBUF");
    let reader = std::thread::spawn(move || {
        // Reads nothing until the sender's socket is full, then the whole stream.
        std::thread::sleep(Duration::from_millis(300));
        let mut hello = [0u8; HELLO_SIZE];
        peer.read_exact(&mut hello).expect("hello");
        let mut stream = vec![0u8; COUNT * (wire::HEADER_SIZE + SIZE)];
        peer.read_exact(&mut stream).expect("every message");
        stream
    });
    let mut datas: Vec<Vec<u8>> = (0..COUNT).map(|i| pattern(SIZE, i as u64)).collect();
    let mut outstanding = std::collections::VecDeque::new();
    let mut stalled = 0;
    for data in datas.iter_mut() {
        outstanding.push_back(post_send(&*send, data, 2));
        // The message gets a few tests of its own, so that the next one is posted on an
        // idle connection while there is room, and the socket fills in the middle of one.
        let start = Instant::now();
        while let Some(&id) = outstanding.front() {
            if send.test(id).expect("test").is_some() {
                outstanding.pop_front();
            } else if start.elapsed() > Duration::from_millis(5) {
                stalled += 1;
                break;
            } else {
                std::thread::yield_now();
            }
        }
        while outstanding.len() == MAX_REQUESTS {
            let id = outstanding[0];
            if wait("room for a send", || send.test(id)).is_ok() {
                outstanding.pop_front();
            }
        }
    }
    for id in outstanding {
        wait("the last sends", || send.test(id)).expect("send");
    }
    assert!(
        stalled > 0,
        "the socket never filled: the test proves nothing"
    );
    let stream = reader.join().expect("reader");
    for (i, data) in datas.iter().enumerate() {
        let at = i * (wire::HEADER_SIZE + SIZE);
        let raw: &[u8; wire::HEADER_SIZE] = stream[at..at + wire::HEADER_SIZE]
            .try_into()
            .expect("header bytes");
        let h = Header::decode(raw).expect("a header where one belongs");
        assert_eq!(
            (h.seq, h.size, h.tag, h.runs),
            (i as u64, SIZE as u64, 2, 0)
        );
        let payload = &stream[at + wire::HEADER_SIZE..at + wire::HEADER_SIZE + SIZE];
        assert!(payload == &data[..], "message {i}'s payload differs");
    }
}
