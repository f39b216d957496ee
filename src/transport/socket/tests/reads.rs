//! When a `test` stops reading: once a socket gave less than the receive still needs, it has
//! given what had arrived, and the call returns, so the caller's other requests (its own
//! sends, in NCCL's proxy loop) move while the peer's next bytes are on their way.

use std::io::{ErrorKind as IoErrorKind, Write};

use super::super::conn::{reads, AFTER_DONE_READ};
use super::*;

const SHORT_READ_CHILD_ENV: &str = "LOSSY_SOCKET_SHORT_READ_CHILD";

#[test]
fn a_receive_test_stops_at_the_first_short_read() {
    // Without a pool thread: only this thread reads the socket, so its reads are all there is.
    run_child(
        "transport::socket::tests::reads::short_read_child",
        SHORT_READ_CHILD_ENV,
        &[("NCCL_LOSSY_IO_THREADS", "0")],
        "short read check passed",
    );
}

/// Writes to `sock` (non-blocking) what it takes of `bytes` now: how many it took.
fn write_what_fits(sock: &mut TcpStream, bytes: &[u8]) -> usize {
    let mut done = 0;
    while done < bytes.len() {
        match sock.write(&bytes[done..]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == IoErrorKind::WouldBlock => break,
            Err(e) if e.kind() == IoErrorKind::Interrupted => {}
            Err(e) => panic!("writing the message: {e}"),
        }
    }
    done
}

#[test]
#[ignore = "run in a process of its own by a_receive_test_stops_at_the_first_short_read"]
fn short_read_child() {
    if std::env::var_os(SHORT_READ_CHILD_ENV).is_none() {
        return;
    }
    const SIZE: usize = 4 << 20;
    let t = loopback(1);
    let mut into = vec![0u8; SIZE];
    let (recv, mut socks) = raw_peer(&t, 1);
    let sock = &mut socks[0];
    let r = recv
        // SAFETY: `into` is declared before the connection, so it outlives the receive.
        .irecv(&[unsafe { HostBuf::from_slice(&mut into) }], &[0])
        .expect("irecv")
        .expect("slot");
    let data = pattern(SIZE, 3);
    let mut stream = chunk_header(0, 0, SIZE as u64).to_vec();
    stream.extend_from_slice(&data);
    // The peer fills the receiver's socket and its own: more waits behind what arrived, and
    // each read makes room for it (loopback delivers it while the reader is still in the
    // kernel), so a receive that read until a read found nothing would go on reading.
    sock.set_nonblocking(true).expect("non-blocking");
    // A fixed send buffer: autotuned, it may grow to the host's `tcp_wmem` maximum (4 MiB on
    // many) while the loop below writes, and the whole message would then fit.
    socket2::SockRef::from(&*sock)
        .set_send_buffer_size(256 << 10)
        .expect("SO_SNDBUF");
    let mut written = write_what_fits(sock, &stream);
    assert!(
        written < stream.len(),
        "the whole message fit in the sockets"
    );
    wait_for_bytes(&recv, 1);
    let before = reads::so_far();
    let first = recv.test(r).expect("test");
    let (count, empty) = (reads::so_far().0 - before.0, reads::so_far().1 - before.1);
    assert!(
        first.is_none(),
        "the message completed before it was all written"
    );
    // The header (with the first bytes behind it, read ahead), then the payload up to what had
    // arrived: that read came back short, so nothing more had arrived.
    assert_eq!(
        (count, empty),
        (2, 0),
        "reads in one test (and how many found nothing)"
    );
    // The rest arrives as the receiver takes it.
    let done = wait("the rest of the message", || {
        written += write_what_fits(sock, &stream[written..]);
        recv.test(r)
    })
    .expect("receive");
    assert_eq!(done.sizes[0], SIZE);
    assert!(into == data, "the message arrived damaged");
    println!("short read check passed");
}

const AFTER_DONE_CHILD_ENV: &str = "LOSSY_SOCKET_AFTER_DONE_CHILD";

#[test]
fn a_receive_test_returns_soon_after_its_message_is_done() {
    run_child(
        "transport::socket::tests::reads::after_done_child",
        AFTER_DONE_CHILD_ENV,
        &[("NCCL_LOSSY_IO_THREADS", "0")],
        "after-done check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by a_receive_test_returns_soon_after_its_message_is_done"]
fn after_done_child() {
    if std::env::var_os(AFTER_DONE_CHILD_ENV).is_none() {
        return;
    }
    // Two messages that the socket buffers hold whole, so the second has all arrived when
    // the first is tested, yet each at least twice `AFTER_DONE_READ`, so a test that read
    // all of the second one shows. The buffers asked for are Linux's stock limit
    // (`net.core.rmem_max`, `wmem_max`: 212992, which the kernel doubles), and what they hold
    // must not depend on a host's own limits: beyond them the stream below (both messages,
    // written before anything reads) cannot all be in flight at once, and its `write_all`
    // would block for ever. Doubled, they hold about 400 KiB each.
    const SIZE: usize = 128 << 10;
    const SOCKBUF: usize = 212_992;
    const _: () = assert!(
        SIZE >= 2 * AFTER_DONE_READ,
        "the check below would not tell"
    );
    let t = loopback_with(SocketConfig {
        nsocks: 1,
        sockbuf: Some(SOCKBUF),
        ..SocketConfig::default()
    });
    let (mut warm, mut first, mut second) = (vec![0u8; SIZE], vec![0u8; SIZE], vec![0u8; SIZE]);
    let (recv, mut socks) = raw_peer(&t, 1);
    let sock = &mut socks[0];
    let post = |into: &mut Vec<u8>| {
        recv
            // SAFETY: both buffers are declared before the connection, so they outlive the
            // receives.
            .irecv(&[unsafe { HostBuf::from_slice(into) }], &[0])
            .expect("irecv")
            .expect("slot")
    };
    socket2::SockRef::from(&*sock)
        .set_send_buffer_size(SOCKBUF)
        .expect("SO_SNDBUF");
    // A first bulk message puts the socket in bulk mode (no read-ahead into its stage).
    let r0 = post(&mut warm);
    sock.write_all(&chunk_header(0, 0, SIZE as u64))
        .and_then(|()| sock.write_all(&pattern(SIZE, 4)))
        .expect("the first message");
    wait("the first message", || recv.test(r0)).expect("receive");
    let (r1, r2) = (post(&mut first), post(&mut second));
    let (a, b) = (pattern(SIZE, 5), pattern(SIZE, 6));
    let mut stream = chunk_header(1, 0, SIZE as u64).to_vec();
    stream.extend_from_slice(&a);
    stream.extend_from_slice(&chunk_header(2, 0, SIZE as u64));
    stream.extend_from_slice(&b);
    sock.write_all(&stream).expect("both messages");
    wait_for_bytes(&recv, stream.len());
    // One test finds the first message whole and reports it done. It reads the next header
    // and at most one bounded read of the next payload before it returns: the caller acts on
    // the finished message (NCCL's proxy hands it to the GPU) without first waiting for the
    // next message to be copied, which the next `test` does.
    let done = recv
        .test(r1)
        .expect("test")
        .expect("the first message is in");
    assert_eq!(done.sizes[0], SIZE);
    assert!(first == a, "the first message arrived damaged");
    let left = recv.bytes_waiting();
    assert!(
        left >= SIZE - AFTER_DONE_READ,
        "the test that finished the first message went on to read {} bytes of the second",
        SIZE - left
    );
    let done = wait("the second message", || recv.test(r2)).expect("receive");
    assert_eq!(done.sizes[0], SIZE);
    assert!(second == b, "the second message arrived damaged");
    println!("after-done check passed");
}
