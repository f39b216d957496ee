//! The accepting side: a non-blocking listener that reads each new socket's hello without
//! ever waiting, groups sockets by connection id and hands out a receiving connection once
//! all sockets of one connection are in.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use socket2::Socket;

use super::conn::{prepare, SocketRecvConn};
use super::log_warn;
use super::wire::{Hello, HELLO_SIZE, NONCE_SIZE};
use crate::transport::{Listener, RecvConn};
use crate::{Error, Result};

/// Most accepted sockets waiting for their hello or their siblings; past it the oldest that
/// has not presented a hello goes (the oldest of all only when every one has).
pub const MAX_PENDING: usize = 256;

/// How long an accepted socket may take to finish a hello it began. One that has sent
/// nothing is not timed: our connector sends its hello at NCCL's next `connect` call, which
/// may come seconds after the kernel completed the TCP handshake (NCCL's proxy sets up other
/// connections meanwhile), and NCCL's Socket transport waits for the connector's magic as
/// long as it takes (`socketFinalizeAccept`, src/misc/socket.cc). A silent socket goes when
/// it closes, or when room ([`MAX_PENDING`]) or a descriptor is needed.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an accepted socket may go without its whole hello before it is given up when
/// the process runs out of descriptors (a connector of ours sends its hello as its connect
/// completes).
const SHED_AFTER: Duration = Duration::from_secs(1);

/// How long a greeted socket waits for the other sockets of its connection.
pub const GROUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Most new sockets taken from the kernel per poll, so one poll stays short under a flood.
const ACCEPTS_PER_POLL: usize = 64;

/// An `accept` error that belongs to the queued connection it was about, not to the
/// listener: the peer gave up before we got to it, a firewall refused it, or the connection
/// carries a network error the kernel reports at accept time, which accept(2) says to treat
/// like `EAGAIN` for TCP and NCCL's Socket transport retries (`ncclOsSocketTryAccept`,
/// src/os/linux.cc). A poll makes at most [`ACCEPTS_PER_POLL`] calls, so going on to the
/// next connection cannot spin.
fn is_one_connections_error(errno: i32) -> bool {
    matches!(
        errno,
        libc::ECONNABORTED
            | libc::EINTR
            | libc::EPERM
            | libc::ENETDOWN
            | libc::EPROTO
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
    )
}

struct Pending {
    sock: Socket,
    peer: String,
    since: Instant,
    /// When the first hello byte was read (the hello deadline counts from there).
    began: Option<Instant>,
    buf: [u8; HELLO_SIZE],
    got: usize,
    hello: Option<Hello>,
}

/// A listening socket and the peers it is still greeting.
pub struct SocketListener {
    sock: Socket,
    nonce: [u8; NONCE_SIZE],
    pending: Vec<Pending>,
    hello_timeout: Duration,
    group_timeout: Duration,
    rejected: u64,
    /// `NCCL_LOSSY_TIMEOUT`: how long `poll_accept` may go without a complete connection,
    /// and the no-progress limit of the connections it makes.
    timeout: Option<Duration>,
    /// The connections' receiving sockets delay TCP acknowledgements of messages under 64 KiB.
    delayed_acks: bool,
    /// First `poll_accept` since the last connection was handed out.
    waiting_since: Option<Instant>,
}

impl SocketListener {
    /// Wraps a bound, listening, non-blocking socket whose peers must present `nonce`.
    /// With `timeout`, accepting fails when no peer completes a connection for that long.
    pub(crate) fn new(
        sock: Socket,
        nonce: [u8; NONCE_SIZE],
        timeout: Option<Duration>,
        delayed_acks: bool,
    ) -> Self {
        SocketListener {
            sock,
            nonce,
            pending: Vec::new(),
            hello_timeout: HELLO_TIMEOUT,
            group_timeout: GROUP_TIMEOUT,
            rejected: 0,
            timeout,
            delayed_acks,
            waiting_since: None,
        }
    }

    /// Shortens the hello deadline (tests of slow peers).
    #[cfg(test)]
    pub(crate) fn set_hello_timeout(&mut self, timeout: Duration) {
        self.hello_timeout = timeout;
    }

    /// Shortens how long a greeted socket waits for its siblings (tests of slow peers).
    #[cfg(test)]
    pub(crate) fn set_group_timeout(&mut self, timeout: Duration) {
        self.group_timeout = timeout;
    }

    /// Number of peers dropped so far for a bad or late hello.
    pub fn rejected(&self) -> u64 {
        self.rejected
    }

    /// Sockets accepted and not yet handed out or dropped.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Sockets that presented a good hello and wait for the other sockets of their connection.
    #[cfg(test)]
    pub(crate) fn greeted(&self) -> usize {
        self.pending.iter().filter(|p| p.hello.is_some()).count()
    }

    /// The socket accepted first among those that have not presented a hello: the one to
    /// give up when room or a descriptor is needed.
    fn oldest_without_hello(&self) -> Option<usize> {
        self.pending.iter().position(|p| p.hello.is_none())
    }

    /// Whether a connection waits in the kernel's queue (the listening socket is readable);
    /// true when that cannot be told.
    fn connection_queued(&self) -> bool {
        let mut fd = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid `pollfd` that outlives the call; a zero timeout never blocks.
        let rc = unsafe { libc::poll(&mut fd, 1, 0) };
        rc != 0
    }

    fn reject(&mut self, index: usize, why: &str) {
        let p = self.pending.remove(index);
        self.rejected += 1;
        // A port scan must not write a line per connection: rate-limited per reason.
        static DROPS: crate::log::RateLimit = crate::log::RateLimit::new(5, 10);
        DROPS.warn(
            why,
            &format!("socket: dropping connection from {}: {why}", p.peer),
        );
    }

    fn accept_new(&mut self) -> Result<()> {
        for _ in 0..ACCEPTS_PER_POLL {
            match self.sock.accept() {
                Ok((sock, addr)) => {
                    let peer = addr
                        .as_socket()
                        .map_or_else(|| "unknown peer".to_string(), |a| a.to_string());
                    if let Err(e) = sock.set_nonblocking(true) {
                        log_warn(format_args!("dropping connection from {peer}: {e}"));
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING {
                        // Room is made among the sockets still owing their hello: one that
                        // presented the nonce belongs to a peer holding the handle, whose
                        // connector believes it is connected; dropping it would leave that
                        // connection unable to complete, at a stranger's word.
                        self.make_room();
                    }
                    self.pending.push(Pending {
                        sock,
                        peer,
                        since: Instant::now(),
                        began: None,
                        buf: [0; HELLO_SIZE],
                        got: 0,
                        hello: None,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => match e.raw_os_error() {
                    // That connection's trouble, not the listener's: the next one goes on.
                    Some(errno) if is_one_connections_error(errno) => {}
                    // Out of descriptors: strangers' descriptors must not fail a real peer's
                    // accept. First the hellos that arrived are read (a real peer's socket,
                    // accepted moments ago, must not pass for a stranger's, and peers that
                    // closed free theirs); then a socket that said nothing for
                    // `SHED_AFTER` goes; either way the accept is tried again, within the
                    // poll's count; one silent for less goes at a later poll, and the
                    // connection waits in the kernel's queue until then. With nothing to
                    // give up: an error, as in NCCL's Socket transport. Retrying would spin
                    // while the peer, whose connect completed in the kernel, believes it is
                    // connected.
                    Some(libc::EMFILE | libc::ENFILE) => {
                        // Linux takes the descriptor before it looks at the queue: after an
                        // accept took the last one, the next fails even with nothing queued.
                        // Nobody waits then, and the sockets taken in may complete.
                        if !self.connection_queued() {
                            return Ok(());
                        }
                        let before = self.pending.len();
                        let now = Instant::now();
                        self.read_hellos(now);
                        if self.pending.len() < before {
                            continue;
                        }
                        if let Some(oldest) = self.oldest_without_hello() {
                            if now.duration_since(self.pending[oldest].since) >= SHED_AFTER {
                                let why = "out of descriptors, this is the oldest without a hello";
                                self.reject(oldest, why);
                                continue;
                            }
                            // Silent, but not for long enough to pass for a stranger: it
                            // can be given up at a later poll, so the connection waits in
                            // the kernel's queue until then. Failing now would abort the
                            // communicator over a flood that arrived a moment ago.
                            return Ok(());
                        }
                        // A connection whose sockets are all in needs no more descriptor:
                        // it is handed out now; whoever is queued waits for a later poll.
                        if self.complete().is_some() {
                            return Ok(());
                        }
                        return Err(super::fds::opening(e, "accepting a connection"));
                    }
                    Some(libc::ENOBUFS | libc::ENOMEM) => {
                        return Err(Error::from(e).context("out of memory accepting a connection"))
                    }
                    _ => return Err(Error::from(e).context("accepting a connection")),
                },
            }
        }
        Ok(())
    }

    /// Reads what has arrived of each hello; drops peers that fail or time out.
    fn read_hellos(&mut self, now: Instant) {
        // The hellos first: the siblings a greeted socket waits for may be among them (taken
        // in by this very poll, after a while nobody polled), and must be counted before
        // that socket is given up as one whose siblings never came.
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].hello.is_some() || self.read_hello(i, now) {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].hello.is_none() || self.read_hello(i, now) {
                i += 1;
            }
        }
    }

    /// Whether every socket of the connection `hello` belongs to has presented its hello.
    fn all_in(&self, hello: &Hello) -> bool {
        let siblings = self.pending.iter().filter_map(|p| p.hello);
        siblings.filter(|q| q.conn_id == hello.conn_id).count() == usize::from(hello.count)
    }

    /// Reads what has arrived of pending socket `i`'s hello (of a greeted one, checks how long
    /// it has waited for its siblings); drops it when it fails or is late. Whether it is
    /// still pending, at `i`.
    fn read_hello(&mut self, i: usize, now: Instant) -> bool {
        if let Some(hello) = self.pending[i].hello {
            let late = now.duration_since(self.pending[i].since) > self.group_timeout;
            if late && !self.all_in(&hello) {
                self.reject(i, "the other sockets of its connection never arrived");
                return false;
            }
            return true;
        }
        let p = &mut self.pending[i];
        // Only the hello's bytes: data may follow at once, and belongs to the connection.
        let outcome = loop {
            if p.got == HELLO_SIZE {
                break Ok(true);
            }
            match (&p.sock).read(&mut p.buf[p.got..]) {
                Ok(0) => {
                    break Err(format!(
                        "closed after {} of {HELLO_SIZE} hello bytes",
                        p.got
                    ))
                }
                Ok(n) => {
                    p.began.get_or_insert(now);
                    p.got += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(false),
                Err(e) => break Err(format!("reading its hello: {e}")),
            }
        };
        let late = p
            .began
            .is_some_and(|began| now.duration_since(began) > self.hello_deadline(i));
        let p = &self.pending[i];
        match outcome {
            Err(why) => self.reject(i, &why),
            Ok(false) if late => {
                let why = format!("only {} of {HELLO_SIZE} hello bytes in time", p.got);
                self.reject(i, &why);
            }
            Ok(false) => return true,
            Ok(true) => match Hello::decode(&p.buf, &self.nonce) {
                Err(e) => self.reject(i, &e.message),
                Ok(hello) => {
                    let clash = self.pending.iter().filter_map(|q| q.hello).find(|q| {
                        q.conn_id == hello.conn_id
                            && (q.index == hello.index || q.count != hello.count)
                    });
                    if clash.is_none() {
                        self.pending[i].hello = Some(hello);
                        return true;
                    }
                    self.reject(i, "its hello clashes with another socket of its connection");
                }
            },
        }
        false
    }

    /// How long pending socket `i` may take to present its whole hello: the hello deadline,
    /// or, once its first parts are what a connector of this plugin sends, as long as a
    /// greeted socket waits for its siblings. The connector sends the rest right after, so
    /// only a network that loses it again and again delays it (TCP's retransmissions back off
    /// from 200 ms, past 5 s at the fifth loss), and its connector believes it is connected;
    /// NCCL's Socket transport waits for its peer's magic without a deadline
    /// (`socketFinalizeAccept`, src/misc/socket.cc). Such a socket is still the first given up
    /// to make room or free a descriptor, as it has not presented its hello.
    fn hello_deadline(&self, i: usize) -> Duration {
        let p = &self.pending[i];
        if Hello::starts_as_ours(&p.buf[..p.got]) {
            self.group_timeout.max(self.hello_timeout)
        } else {
            self.hello_timeout
        }
    }

    /// Gives up one pending socket to make room for a new one: the oldest that has not
    /// presented a hello, once what has arrived of its hello is read (a real peer's may wait
    /// there unread; reading may also drop a stranger that closed or lied, which makes the
    /// room); the oldest of all when every one has presented a hello.
    fn make_room(&mut self) {
        let now = Instant::now();
        while let Some(oldest) = self.oldest_without_hello() {
            if !self.read_hello(oldest, now) {
                return;
            }
            if self.pending[oldest].hello.is_none() {
                let why = "too many connections pending, this is the oldest without a hello";
                self.reject(oldest, why);
                return;
            }
        }
        self.reject(0, "too many connections pending, this is the oldest");
    }

    /// A hello of the first connection whose sockets have all arrived.
    fn complete(&self) -> Option<Hello> {
        let mut hellos = self.pending.iter().filter_map(|p| p.hello);
        hellos.find(|h| self.all_in(h))
    }

    /// Takes out the sockets of the first connection whose sockets have all arrived.
    fn take_complete(&mut self) -> Option<(Vec<Socket>, String)> {
        let complete = self.complete()?;
        let mut socks: Vec<Option<Socket>> = (0..complete.count).map(|_| None).collect();
        let mut peer = String::new();
        let mut i = 0;
        while i < self.pending.len() {
            match self.pending[i].hello {
                Some(h) if h.conn_id == complete.conn_id => {
                    let p = self.pending.remove(i);
                    peer = p.peer;
                    socks[usize::from(h.index)] = Some(p.sock);
                }
                _ => i += 1,
            }
        }
        // Indices are distinct and below the count (checked as each hello came in).
        let socks: Vec<Socket> = socks.into_iter().flatten().collect();
        (socks.len() == usize::from(complete.count)).then_some((socks, peer))
    }
}

impl SocketListener {
    /// [`Listener::poll_accept`], with the connection as its concrete type.
    pub(crate) fn poll_accept_socket(&mut self) -> Result<Option<SocketRecvConn>> {
        let now = Instant::now();
        let since = *self.waiting_since.get_or_insert(now);
        self.accept_new()?;
        self.read_hellos(now);
        let Some((socks, peer)) = self.take_complete() else {
            return match self.timeout {
                Some(limit) if now.duration_since(since) > limit => Err(Error::remote(format!(
                    "no peer completed a connection within {:.3} s (NCCL_LOSSY_TIMEOUT); \
                     {} rejected so far",
                    limit.as_secs_f64(),
                    self.rejected
                ))),
                _ => Ok(None),
            };
        };
        self.waiting_since = None;
        for s in &socks {
            prepare(s).map_err(|e| Error::from(e).context("configuring an accepted socket"))?;
        }
        SocketRecvConn::start(socks, peer, self.timeout, self.delayed_acks).map(Some)
    }
}

impl Listener for SocketListener {
    fn poll_accept(&mut self) -> Result<Option<Box<dyn RecvConn>>> {
        let conn = self.poll_accept_socket()?;
        Ok(conn.map(|c| Box::new(c) as Box<dyn RecvConn>))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// accept(2): Linux passes a queued connection's pending network errors to `accept`, and
    /// for TCP they are to be treated like `EAGAIN`; NCCL's Socket transport retries them
    /// (`ncclOsSocketTryAccept`, src/os/linux.cc). They cannot be made on a loopback, so the
    /// classification is checked directly; before, each failed the accept (and so NCCL's
    /// communicator) over one stranger's connection.
    #[test]
    fn network_errors_of_a_queued_connection_do_not_fail_the_listener() {
        for errno in [
            libc::ENETDOWN,
            libc::EPROTO,
            libc::ENOPROTOOPT,
            libc::EHOSTDOWN,
            libc::ENONET,
            libc::EHOSTUNREACH,
            libc::EOPNOTSUPP,
            libc::ENETUNREACH,
            libc::EINTR,
            libc::ECONNABORTED,
            libc::EPERM,
        ] {
            assert!(is_one_connections_error(errno), "errno {errno}");
        }
        // The listener's own trouble fails the accept, as in NCCL's Socket transport.
        for errno in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::ENOMEM,
            libc::EBADF,
        ] {
            assert!(!is_one_connections_error(errno), "errno {errno}");
        }
    }
}
