//! A process with no descriptor left at all (every one up to `ulimit -n` taken, as a job that
//! leaks descriptors ends up): listing the interfaces at `init`, `listen` and `connect` must
//! each fail with an error that names `ulimit -n`, as they do when a few are left.

use super::lifecycle::{close_inherited_fds, fd_numbers};
use super::*;
use crate::transport::socket::SocketConfig;

const NO_FD_LEFT_CHILD_ENV: &str = "LOSSY_SOCKET_NO_FD_LEFT_CHILD";

#[test]
fn with_no_descriptor_left_init_listen_and_connect_fail_naming_ulimit() {
    // Lowering the limit needs a process of its own: other tests run beside us.
    run_child(
        "transport::socket::tests::descriptors::no_fd_left_child",
        NO_FD_LEFT_CHILD_ENV,
        &[],
        "no descriptor left check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by with_no_descriptor_left_init_listen_and_connect_fail_naming_ulimit"]
fn no_fd_left_child() {
    if std::env::var_os(NO_FD_LEFT_CHILD_ENV).is_none() {
        return;
    }
    // Descriptors are numbered densely from here on, so the limit (on numbers) and the count
    // of open descriptors agree.
    close_inherited_fds();
    let t = loopback(1);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let _listener = t.listen(0, None, &mut handle).expect("listen");
    // Not one descriptor free: the limit is the number of those open.
    let open = fd_numbers().len() as u64;
    let limit = libc::rlimit {
        rlim_cur: open,
        rlim_max: open,
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
    let check = |what: &str, err: crate::Error| {
        let text = err.to_string();
        assert_eq!(err.kind, crate::ErrorKind::System, "{what}: {text}");
        assert!(text.contains("`ulimit -n`"), "{what}: {text}");
        assert!(text.contains(&open.to_string()), "{what}: {text}");
        println!("{what}: {text}");
    };
    // A connector opens its sockets when polled: either step may be the one that refuses.
    let connect = t
        .connect(0, None, &handle)
        .and_then(|mut c| wait("connect", || c.poll()).map(|_| ()));
    check(
        "connect",
        connect.expect_err("connected with no descriptor left"),
    );
    let mut other = [0u8; HANDLE_WIRE_SIZE];
    check(
        "listen",
        t.listen(0, None, &mut other)
            .map(|_| ())
            .expect_err("listened with no descriptor left"),
    );
    check(
        "init",
        SocketTransport::new(SocketConfig::default())
            .map(|_| ())
            .expect_err("listed the interfaces with no descriptor left"),
    );
    println!("no descriptor left check passed");
}
