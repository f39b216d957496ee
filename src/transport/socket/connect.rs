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

/// How a connect the peer's host turned away, or did not answer, is tried again: as NCCL's
/// Socket transport does (`socketConnectCheck`, src/os/linux.cc), up to `count` more times,
/// the k-th after a pause of k x `pause` (by default 34 times from 100 ms: about a minute in
/// all), and within the connect's deadline. A listener whose host is slow to come up, or a
/// network that drops a route for a moment, still gets its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectRetries {
    pub count: u32,
    pub pause: Duration,
}

impl Default for ConnectRetries {
    fn default() -> Self {
        ConnectRetries {
            count: 34,
            pause: Duration::from_millis(100),
        }
    }
}

/// Largest `NCCL_SOCKET_RETRY_CNT` and `NCCL_SOCKET_RETRY_SLEEP_MSEC` accepted (above, the
/// connect's own deadline ends the retries long before they would).
const MAX_RETRY_COUNT: u32 = 100_000;
const MAX_RETRY_SLEEP_MS: u64 = 3_600_000;

impl ConnectRetries {
    /// Reads NCCL's own variables for its socket retries, so one setting tunes both NCCL's
    /// bootstrap and this transport; a malformed value is an error naming the variable.
    pub(super) fn read(text: &dyn Fn(&str) -> Result<Option<String>>) -> Result<ConnectRetries> {
        // `name`'s value, an integer from 0 to `max`, or an error saying what it is.
        let bounded = |name: &str, max: u64, what: &str| -> Result<Option<u64>> {
            let Some(v) = text(name)? else {
                return Ok(None);
            };
            let n = v.trim().parse::<u64>().ok().filter(|n| *n <= max);
            n.map(Some).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "{name}={} is not a valid value: {what}, an integer from 0 to {max}",
                    crate::error::echo(&v, str::to_string)
                ))
            })
        };
        let mut r = ConnectRetries::default();
        let count = "how many times a refused connect is tried again";
        if let Some(n) = bounded("NCCL_SOCKET_RETRY_CNT", MAX_RETRY_COUNT.into(), count)? {
            r.count = u32::try_from(n).unwrap_or(MAX_RETRY_COUNT);
        }
        let pause = "the pause before the first retry of a refused connect (the k-th waits k \
                     times as long), in milliseconds";
        if let Some(ms) = bounded("NCCL_SOCKET_RETRY_SLEEP_MSEC", MAX_RETRY_SLEEP_MS, pause)? {
            r.pause = Duration::from_millis(ms);
        }
        Ok(r)
    }

    /// The pause before try number `attempts + 1`, or `None` when no try is left.
    fn pause_after(&self, attempts: u32) -> Option<Duration> {
        (attempts <= self.count).then(|| self.pause.saturating_mul(attempts))
    }
}

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
    retries: ConnectRetries,
    deadline: Instant,
    conns: Vec<Conn>,
    finished: bool,
    /// The process's I/O pool, taken before any socket opens, so a pool that cannot start
    /// refuses the connect before the peer's listener sees a socket (else its accept would
    /// complete a connection this side then drops, and the peer fail later, at `test`).
    pool: Option<Arc<Pool>>,
}

/// The peer (or its host) did not answer: refused, reset, unreachable or timed out. Tried
/// again ([`ConnectRetries`]), and once no try is left reported as `ncclRemoteError`, as
/// NCCL's `socketConnectCheck` does (src/os/linux.cc); any other errno is `ncclSystemError`.
fn is_peer_failure(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::ECONNREFUSED | libc::ECONNRESET | libc::EHOSTUNREACH | libc::ETIMEDOUT)
    )
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
        retries: ConnectRetries,
        pool: Option<Arc<Pool>>,
    ) -> Self {
        let now = Instant::now();
        SocketConnector {
            addr,
            sockbuf,
            timeout,
            retries,
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
            Err(e) if is_peer_failure(&e) => {
                let pause = self
                    .retries
                    .pause_after(c.attempts)
                    .ok_or_else(|| self.gave_up(c, e))?;
                c.stage = Stage::Retry(Instant::now() + pause);
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

    /// The peer failure `err` of the last of `c`'s tries.
    fn gave_up(&self, c: &Conn, err: io::Error) -> Error {
        self.failure(err).context(format_args!(
            "{} tries (NCCL_SOCKET_RETRY_CNT={}, NCCL_SOCKET_RETRY_SLEEP_MSEC={})",
            c.attempts,
            self.retries.count,
            self.retries.pause.as_millis()
        ))
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
                            if !is_peer_failure(&e) {
                                return Err(self.failure(e));
                            }
                            let pause = self
                                .retries
                                .pause_after(c.attempts)
                                .ok_or_else(|| self.gave_up(c, e))?;
                            c.stage = Stage::Retry(now + pause);
                            return Ok(false);
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
        let connector = SocketConnector::new(
            "127.0.0.1:9".parse().expect("addr"),
            &[],
            None,
            None,
            ConnectRetries::default(),
            None,
        );
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
        // Each of these is tried again (an unreachable host may answer a moment later), the
        // others are not; NCCL's schedule: the k-th retry after k pauses, 34 retries.
        for errno in [
            libc::ECONNREFUSED,
            libc::ECONNRESET,
            libc::ETIMEDOUT,
            libc::EHOSTUNREACH,
        ] {
            assert!(is_peer_failure(&io::Error::from_raw_os_error(errno)));
        }
        assert!(!is_peer_failure(&io::Error::from_raw_os_error(
            libc::ENETUNREACH
        )));
        let r = ConnectRetries::default();
        assert_eq!(r.pause_after(1), Some(Duration::from_millis(100)));
        assert_eq!(r.pause_after(34), Some(Duration::from_millis(3400)));
        assert_eq!(r.pause_after(35), None);
    }
}
