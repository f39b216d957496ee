//! The error class of a peer that stops answering: every failed `send`/`recv` on an
//! established connection is the peer's (`Remote`), as NCCL's Socket transport reports it
//! (`ncclOsSocketProgressOpt`: any error but the transient ones is `ncclRemoteError`).

use std::net::{SocketAddr, TcpListener};

use super::*;

/// The descriptor of this process's connected socket whose local address is `local`.
fn connected_fd_at(local: SocketAddr) -> Option<i32> {
    for entry in std::fs::read_dir("/proc/self/fd").ok()? {
        let Some(fd) = entry
            .ok()?
            .file_name()
            .to_str()
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        // SAFETY: a borrowed view of a descriptor this process holds (the listing's own
        // descriptor at worst, which is no socket), used only for two address queries while
        // the socket it names stays open (the connection below outlives this call).
        let fd_ref = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let sock = socket2::SockRef::from(&fd_ref);
        let mine = sock.local_addr().ok().and_then(|a| a.as_socket()) == Some(local);
        if mine && sock.peer_addr().is_ok() {
            return Some(fd);
        }
    }
    None
}

/// A peer whose host stops answering while a message is in flight: its kernel gives up on
/// the connection (`ETIMEDOUT`, after `tcp_retries2` on a real network; here the receiver
/// never reads, and `TCP_USER_TIMEOUT` of 1 s on the sending socket makes the kernel abort
/// the zero-window probing that follows). The send fails at `test` with a `Remote` error, as
/// NCCL's Socket transport fails it; before, the timed-out `send` was a `System` error.
#[test]
fn a_send_the_kernel_gives_up_on_is_the_peers_failure() {
    let t = loopback(1);
    let (_listener, handle) = raw_listener(&t);
    let plain = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut wire = [0u8; HANDLE_WIRE_SIZE];
    Handle {
        addr: plain.local_addr().expect("address"),
        ..handle
    }
    .encode(&mut wire);
    let mut connector = t.connect(0, None, &wire).expect("connect");
    let send = wait("connect", || connector.poll()).expect("connect");
    let (peer, ours) = plain.accept().expect("accept");
    socket2::SockRef::from(&peer)
        .set_recv_buffer_size(4096)
        .expect("SO_RCVBUF");
    let fd = connected_fd_at(ours).expect("the plugin's sending socket");
    let ms: libc::c_uint = 1000;
    // SAFETY: a live socket descriptor, and a `c_uint` that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "TCP_USER_TIMEOUT");
    let mut data = vec![1u8; 64 << 20];
    let err = send_outcome(&*send, &mut data, 0).expect_err("the peer never reads");
    assert!(
        err.message.contains("timed out"),
        "the kernel's time-out was expected: {err}"
    );
    assert_eq!(err.kind, ErrorKind::Remote, "{err}");
    drop(peer);
}
