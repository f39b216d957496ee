//! The connecting side: non-blocking connects of every socket of a connection, each followed
//! by its hello. No answer is awaited, so connecting completes even before the peer accepts;
//! a peer that turns the connection down is noticed at the first send.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::conn::{prepare, Pool, SocketSendConn};
use super::wire::{Hello, HELLO_SIZE};
use crate::transport::{Connector, SendConn};
use crate::{Error, Result};

/// How many times a refused connect is tried again (the listener's backlog may be full, or
/// its host not reachable yet).
/// A timed-out connect already waited minutes in the kernel and is not tried again.
const CONNECT_RETRIES: u32 = 20;

/// Pause before trying a refused connect again.
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// How long connecting may take when `NCCL_LOSSY_TIMEOUT` is off: about as long as the
/// kernel retries an unanswered SYN, so a vanished host fails the connect instead of hanging.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(120);

enum Stage {
    /// Waiting to try (again) at this time.
    Retry(Instant),
    /// The kernel is completing the TCP handshake.
    Connecting,
    /// Connected; this many hello bytes sent.
    Greeting(usize),
    /// Hello sent.
    Ready,
}

struct Conn {
    sock: Option<Socket>,
    stage: Stage,
    hello: [u8; HELLO_SIZE],
    attempts: u32,
}

/// Where the hello is cut into sends of its own: after the magic (8 bytes) and after the
/// version and socket index (4 more); the rest goes in a third. NCCL's connect sends its
/// magic, its socket type and its socket index the same way, in three sends
/// (`socketFinalizeConnect` in src/misc/socket.cc, `ncclNetSocketConnect` in
/// src/transport/net_socket.cc). Measured on a loopback with BBR: with the hello in one send,
/// 84 of 100 of our links settled at BBR's slow pacing level for their run; in three, 16 of
/// 100 (NCCL's transport: 41). The bytes are the same either way (docs/calibration.md, "What
/// puts a connection at the fast level").
const HELLO_CUTS: [usize; 2] = [8, 12];

/// Connects the sockets of one connection to a listener, one poll at a time.
pub struct SocketConnector {
    addr: SocketAddr,
    sockbuf: Option<usize>,
    timeout: Option<Duration>,
    deadline: Instant,
    conns: Vec<Conn>,
    finished: bool,
    /// The process's I/O pool, taken before any socket opens, so a pool that cannot start
    /// refuses the connect before the peer's listener sees a socket (else its accept would
    /// complete a connection this side then drops, and the peer fail later, at `test`).
    pool: Option<Arc<Pool>>,
}

/// A connect the listener's host turned away, or could not be reached yet: tried again (as
/// NCCL's `socketConnectCheck` does, src/os/linux.cc).
fn is_refusal(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::ECONNREFUSED | libc::ECONNRESET | libc::EHOSTUNREACH)
    )
}

/// The peer (or its host) did not answer: refused, reset, unreachable or timed out. NCCL
/// reports these as `ncclRemoteError`, any other errno as `ncclSystemError`.
fn is_peer_failure(err: &io::Error) -> bool {
    is_refusal(err) || err.raw_os_error() == Some(libc::ETIMEDOUT)
}

impl SocketConnector {
    /// Prepares `hellos.len()` sockets to `addr`; nothing blocks until `poll`. Connecting
    /// fails after `timeout` (else [`DEFAULT_CONNECT_TIMEOUT`]); the connection it makes
    /// fails requests that make no progress for `timeout`.
    pub(crate) fn new(
        addr: SocketAddr,
        hellos: &[Hello],
        sockbuf: Option<usize>,
        timeout: Option<Duration>,
        pool: Option<Arc<Pool>>,
    ) -> Self {
        let now = Instant::now();
        SocketConnector {
            addr,
            sockbuf,
            timeout,
            deadline: now + timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
            conns: hellos
                .iter()
                .map(|h| Conn {
                    sock: None,
                    stage: Stage::Retry(now),
                    hello: h.encode(),
                    attempts: 0,
                })
                .collect(),
            finished: false,
            pool,
        }
    }

    fn start_connect(&self, c: &mut Conn) -> Result<()> {
        let setup = || -> io::Result<Socket> {
            let sock = Socket::new(
                Domain::for_address(self.addr),
                Type::STREAM,
                Some(Protocol::TCP),
            )?;
            sock.set_nonblocking(true)?;
            sock.set_nodelay(true)?;
            if let Some(bytes) = self.sockbuf {
                // Before connecting, so the window scale offered in the SYN fits the buffer.
                sock.set_send_buffer_size(bytes)?;
                sock.set_recv_buffer_size(bytes)?;
            }
            Ok(sock)
        };
        let sock = setup().map_err(|e| super::fds::opening(e, "creating a socket"))?;
        c.attempts += 1;
        match sock.connect(&SockAddr::from(self.addr)) {
            Ok(()) => c.stage = Stage::Greeting(0),
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => c.stage = Stage::Connecting,
            Err(e) if is_refusal(&e) && c.attempts <= CONNECT_RETRIES => {
                c.stage = Stage::Retry(Instant::now() + RETRY_DELAY);
                return Ok(());
            }
            Err(e) => return Err(self.failure(e)),
        }
        c.sock = Some(sock);
        Ok(())
    }

    fn failure(&self, err: io::Error) -> Error {
        let err = if is_peer_failure(&err) {
            Error::remote(err.to_string())
        } else {
            Error::from(err)
        };
        err.context(format_args!("connecting to {}", self.addr))
    }

    /// Advances one socket; true once its hello is sent.
    fn advance(&self, c: &mut Conn, now: Instant) -> Result<bool> {
        loop {
            match c.stage {
                Stage::Ready => return Ok(true),
                Stage::Retry(at) if now < at => return Ok(false),
                Stage::Retry(_) => {
                    c.sock = None;
                    self.start_connect(c)?;
                    if matches!(c.stage, Stage::Retry(_)) {
                        return Ok(false);
                    }
                }
                Stage::Connecting => {
                    let Some(sock) = &c.sock else {
                        return Err(Error::internal("connecting without a socket"));
                    };
                    // A failed connect leaves its error in SO_ERROR; a pending one has no peer yet.
                    match sock.take_error() {
                        Ok(None) => {}
                        Ok(Some(e)) | Err(e) => {
                            if is_refusal(&e) && c.attempts <= CONNECT_RETRIES {
                                c.stage = Stage::Retry(now + RETRY_DELAY);
                                return Ok(false);
                            }
                            return Err(self.failure(e));
                        }
                    }
                    match sock.peer_addr() {
                        Ok(_) => c.stage = Stage::Greeting(0),
                        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => return Ok(false),
                        Err(e) => return Err(self.failure(e)),
                    }
                }
                Stage::Greeting(sent) => {
                    let Some(sock) = &c.sock else {
                        return Err(Error::internal("greeting without a socket"));
                    };
                    let end = HELLO_CUTS
                        .into_iter()
                        .find(|&cut| cut > sent)
                        .unwrap_or(HELLO_SIZE);
                    match sock.send_with_flags(&c.hello[sent..end], libc::MSG_NOSIGNAL) {
                        Ok(n) if sent + n == HELLO_SIZE => c.stage = Stage::Ready,
                        Ok(n) => c.stage = Stage::Greeting(sent + n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(self.failure(e)),
                    }
                }
            }
        }
    }
}

impl Connector for SocketConnector {
    fn poll(&mut self) -> Result<Option<Box<dyn SendConn>>> {
        if self.finished {
            return Err(Error::invalid_usage(
                "this connection attempt already finished",
            ));
        }
        let now = Instant::now();
        let mut conns = std::mem::take(&mut self.conns);
        let mut ready = true;
        let mut outcome = Ok(());
        for c in &mut conns {
            match self.advance(c, now) {
                Ok(done) => ready &= done,
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        self.conns = conns;
        if outcome.is_ok() && !ready && now > self.deadline {
            outcome = Err(Error::remote(format!(
                "connecting to {}: not connected after {:.3} s (NCCL_LOSSY_TIMEOUT)",
                self.addr,
                self.timeout
                    .unwrap_or(DEFAULT_CONNECT_TIMEOUT)
                    .as_secs_f64()
            )));
        }
        if let Err(e) = outcome {
            self.finished = true;
            self.conns.clear();
            return Err(e);
        }
        if !ready {
            return Ok(None);
        }
        self.finished = true;
        let socks: Vec<Socket> = self.conns.drain(..).filter_map(|c| c.sock).collect();
        for s in &socks {
            prepare(s).map_err(|e| Error::from(e).context("configuring a connected socket"))?;
        }
        Ok(Some(Box::new(SocketSendConn::start(
            socks,
            self.addr.to_string(),
            self.timeout,
            self.pool.take(),
        )?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's connect (`socketConnectCheck`, src/os/linux.cc) takes a refused, unreachable or
    /// timed-out connect for the peer's failure (`ncclRemoteError` once its retries are
    /// spent), any other errno for a system error. The unreachable and timed-out cases cannot
    /// be made on a loopback, so the classification is checked directly.
    #[test]
    fn a_connect_the_peer_never_answers_is_the_peers_failure() {
        let connector =
            SocketConnector::new("127.0.0.1:9".parse().expect("addr"), &[], None, None, None);
        for (errno, kind) in [
            (libc::ECONNREFUSED, crate::ErrorKind::Remote),
            (libc::ECONNRESET, crate::ErrorKind::Remote),
            (libc::ETIMEDOUT, crate::ErrorKind::Remote),
            (libc::EHOSTUNREACH, crate::ErrorKind::Remote),
            (libc::ENETUNREACH, crate::ErrorKind::System),
            (libc::EMFILE, crate::ErrorKind::System),
        ] {
            let err = connector.failure(io::Error::from_raw_os_error(errno));
            assert_eq!(err.kind, kind, "errno {errno}: {err}");
            assert!(err.message.contains("127.0.0.1:9"), "{err}");
        }
        // An unreachable host may answer a moment later (NCCL retries it as a refusal).
        assert!(is_refusal(&io::Error::from_raw_os_error(
            libc::EHOSTUNREACH
        )));
    }
}
