//! What the owner and the I/O threads of one connection share, the threads' lifetime, and
//! the blocking socket I/O they do.

use std::fmt;
use std::io;
use std::net::Shutdown;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::Socket;

use crate::transport::socket::log_warn;
use crate::transport::{Completion, RequestId, MAX_REQUESTS};
use crate::{Error, Result};

/// Stack of an I/O thread: its calls are shallow, and connections are many.
const IO_THREAD_STACK: usize = 256 << 10;

/// Most bytes one `send`/`recv` call moves, so a large chunk still marks progress often
/// enough for the no-progress timeout (a few more system calls per 64 MiB, no measurable cost).
const IO_PIECE: usize = 4 << 20;

pub(super) const FREE: u8 = 0;
pub(super) const PENDING: u8 = 1;
pub(super) const DONE: u8 = 2;

/// When a connection last moved bytes, for the no-progress timeout (`NCCL_LOSSY_TIMEOUT`).
pub(super) struct Progress {
    epoch: Instant,
    last_ns: AtomicU64,
}

impl Progress {
    fn new() -> Self {
        Progress {
            epoch: Instant::now(),
            last_ns: AtomicU64::new(0),
        }
    }

    #[inline]
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records that bytes moved (or that the clock starts now).
    #[inline]
    pub(super) fn touch(&self) {
        self.last_ns.store(self.now_ns(), Ordering::Relaxed);
    }

    /// How long since bytes last moved.
    #[inline]
    pub(super) fn idle_for(&self) -> Duration {
        Duration::from_nanos(
            self.now_ns()
                .saturating_sub(self.last_ns.load(Ordering::Relaxed)),
        )
    }
}

pub(super) fn send_all(
    sock: &Socket,
    mut bytes: &[u8],
    more: bool,
    progress: &Progress,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let piece = bytes.len().min(IO_PIECE);
        // MSG_NOSIGNAL: a dead peer must give EPIPE, not kill a host process that kept SIGPIPE.
        let more = more || piece < bytes.len();
        let flags = libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
        match sock.send_with_flags(&bytes[..piece], flags) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                bytes = &bytes[n..];
                progress.touch();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Fills `buf` unless the peer closes first; returns how many bytes arrived.
pub(super) fn recv_until_eof(
    sock: &Socket,
    buf: &mut [u8],
    progress: &Progress,
) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let end = buf.len().min(got + IO_PIECE);
        let rest = &mut buf[got..end];
        // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and `recv` only stores initialised
        // bytes into the slice, so viewing initialised bytes as possibly uninitialised is sound.
        let rest = unsafe { &mut *(rest as *mut [u8] as *mut [std::mem::MaybeUninit<u8>]) };
        // MSG_WAITALL: one call (one wake-up) per chunk instead of one per arriving segment.
        match sock.recv_with_flags(rest, libc::MSG_WAITALL) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                progress.touch();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

pub(super) fn recv_all(sock: &Socket, buf: &mut [u8], progress: &Progress) -> io::Result<()> {
    if recv_until_eof(sock, buf, progress)? < buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "peer closed the connection",
        ));
    }
    Ok(())
}

/// Peeks at up to `buf.len()` bytes that have already arrived on `sock`, without waiting and
/// without consuming them.
pub(super) fn peek_arrived(sock: &Socket, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: as in `recv_until_eof`: `recv` only stores initialised bytes into the slice.
    let view = unsafe { &mut *(buf as *mut [u8] as *mut [std::mem::MaybeUninit<u8>]) };
    sock.recv_with_flags(view, libc::MSG_PEEK | libc::MSG_DONTWAIT)
}

/// Why an I/O thread stopped.
pub(super) enum Exit {
    /// The connection is closing or already failed: nothing more to report.
    Stopped,
    /// This thread hit the failure that brings the connection down.
    Failed(Error),
}

/// Connection state guarded by the lock.
pub(super) struct Locked<S> {
    pub(super) side: S,
    pub(super) failed: Option<Error>,
    pub(super) stopping: bool,
    /// The peer closed its end in an orderly way (sending side: it said goodbye): nothing
    /// more will move, and that is no failure.
    pub(super) peer_left: bool,
}

impl<S> Locked<S> {
    /// The I/O threads have nothing more to do: closing, failed, or the peer left.
    pub(super) fn over(&self) -> bool {
        self.stopping || self.failed.is_some() || self.peer_left
    }
}

/// What the owner and the I/O threads of one connection share.
pub(super) struct Shared<S> {
    pub(super) sockets: Vec<Socket>,
    pub(super) peer: String,
    pub(super) locked: Mutex<Locked<S>>,
    pub(super) wake: Condvar,
    pub(super) slot_state: [AtomicU8; MAX_REQUESTS],
    pub(super) failed: AtomicBool,
    pub(super) progress: Progress,
    /// Fail the connection when a request is outstanding and no byte moved for this long.
    pub(super) timeout: Option<Duration>,
}

pub(super) type Guard<'a, S> = MutexGuard<'a, Locked<S>>;

impl<S> Shared<S> {
    pub(super) fn new(
        sockets: Vec<Socket>,
        peer: String,
        side: S,
        timeout: Option<Duration>,
    ) -> Self {
        Shared {
            progress: Progress::new(),
            timeout,
            sockets,
            peer,
            locked: Mutex::new(Locked {
                side,
                failed: None,
                stopping: false,
                peer_left: false,
            }),
            wake: Condvar::new(),
            slot_state: std::array::from_fn(|_| AtomicU8::new(FREE)),
            failed: AtomicBool::new(false),
        }
    }

    pub(super) fn lock(&self) -> Guard<'_, S> {
        // A poisoned lock only means an I/O thread panicked; its panic is reported as a failure.
        self.locked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `ready` holds; `Err(Stopped)` once the connection closes or fails.
    pub(super) fn wait_until<'a>(
        &self,
        mut g: Guard<'a, S>,
        ready: impl Fn(&S) -> bool,
    ) -> std::result::Result<Guard<'a, S>, Exit> {
        loop {
            if g.over() {
                return Err(Exit::Stopped);
            }
            if ready(&g.side) {
                return Ok(g);
            }
            g = self.wake.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits for one wake-up; `Err(Stopped)` once the connection closes or fails.
    pub(super) fn wait_once<'a>(&self, g: Guard<'a, S>) -> std::result::Result<Guard<'a, S>, Exit> {
        let g = self.wake.wait(g).unwrap_or_else(|p| p.into_inner());
        if g.over() {
            return Err(Exit::Stopped);
        }
        Ok(g)
    }

    /// Sleeps for `dur` unless the connection closes or fails first.
    pub(super) fn sleep(&self, dur: Duration) -> std::result::Result<(), Exit> {
        let deadline = Instant::now() + dur;
        let mut g = self.lock();
        loop {
            if g.over() {
                return Err(Exit::Stopped);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            g = self
                .wake
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn shutdown_sockets(&self) {
        for sock in &self.sockets {
            // Errors only mean the socket is already down, which is what we want.
            let _ = sock.shutdown(Shutdown::Both);
        }
    }

    /// Records the connection's first failure and wakes every thread so they exit.
    pub(super) fn fail(&self, err: Error, warn: bool) {
        self.fail_locked(self.lock(), err, warn);
    }

    /// As [`Shared::fail`], with the lock already held.
    pub(super) fn fail_locked(&self, mut g: Guard<'_, S>, err: Error, warn: bool) {
        if g.over() {
            return;
        }
        if warn {
            log_warn(format_args!("connection with {} failed: {err}", self.peer));
        }
        g.failed = Some(err);
        self.failed.store(true, Ordering::Release);
        self.wake.notify_all();
        drop(g);
        self.shutdown_sockets();
    }

    /// Starts closing: threads blocked on the lock or on a socket return.
    fn stop(&self) {
        let mut g = self.lock();
        g.stopping = true;
        self.wake.notify_all();
        drop(g);
        self.shutdown_sockets();
    }

    /// Turns an I/O error into a thread exit: quiet while closing, a failure otherwise.
    pub(super) fn io_exit(&self, err: io::Error, what: fmt::Arguments<'_>) -> Exit {
        let g = self.lock();
        if g.over() {
            return Exit::Stopped;
        }
        drop(g);
        Exit::Failed(Error::from(err).context(format_args!("{what} with {}", self.peer)))
    }

    /// Fails unless new requests may be posted: only while closing. A failed connection
    /// still takes requests, which fail at `test` (as with NCCL's own plugins, an `isend` or
    /// `irecv` never reports the peer's failure).
    pub(super) fn usable(&self, g: &Guard<'_, S>) -> Result<()> {
        if g.stopping {
            return Err(Error::internal("connection is closing"));
        }
        Ok(())
    }

    /// Shuts the sockets down once the peer left, so threads blocked on them return.
    pub(super) fn peer_left(&self, mut g: Guard<'_, S>) {
        if g.over() {
            return;
        }
        g.peer_left = true;
        self.wake.notify_all();
        drop(g);
        self.shutdown_sockets();
    }

    fn timeout_error(&self, limit: Duration) -> Error {
        Error::remote(format!(
            "no progress with {} for {:.1} s while a request was outstanding \
             (NCCL_LOSSY_TIMEOUT={}): the peer is stalled, unreachable or gone",
            self.peer,
            self.progress.idle_for().as_secs_f64(),
            limit.as_secs_f64()
        ))
    }

    pub(super) fn free_slot(&self) -> Option<usize> {
        (0..MAX_REQUESTS).find(|&i| self.slot_state[i].load(Ordering::Acquire) == FREE)
    }

    /// Common part of `test`: `Ok(None)` while pending, the slot's completion when done.
    pub(super) fn test_with(
        &self,
        id: RequestId,
        done: impl FnOnce(&S, usize) -> Completion,
    ) -> Result<Option<Completion>> {
        let slot = id as usize;
        if slot >= MAX_REQUESTS {
            return Err(Error::invalid_argument(format!(
                "request id {id} out of range"
            )));
        }
        let not_in_flight = || Error::invalid_argument(format!("request {id} is not in flight"));
        let state = self.slot_state[slot].load(Ordering::Acquire);
        if state == PENDING && !self.failed.load(Ordering::Acquire) {
            // The common case while polling: one atomic load (and a clock read when a
            // timeout is set), no lock.
            match self.timeout {
                Some(limit) if self.progress.idle_for() > limit => {
                    self.fail(self.timeout_error(limit), true)
                }
                _ => return Ok(None),
            }
        }
        match state {
            PENDING | DONE => {
                // Slot states change only under the lock: look again now that we hold it.
                let g = self.lock();
                match self.slot_state[slot].load(Ordering::Acquire) {
                    DONE => {
                        let c = done(&g.side, slot);
                        self.slot_state[slot].store(FREE, Ordering::Release);
                        Ok(Some(c))
                    }
                    PENDING => Err(g
                        .failed
                        .clone()
                        .unwrap_or_else(|| Error::internal("connection failed"))),
                    _ => Err(not_in_flight()),
                }
            }
            _ => Err(not_in_flight()),
        }
    }
}

/// A connection's threads; dropping it stops them, joins them and closes the sockets.
pub(super) struct Running<S> {
    pub(super) shared: Arc<Shared<S>>,
    threads: Vec<JoinHandle<()>>,
}

impl<S: Send + 'static> Running<S> {
    pub(super) fn start(
        shared: Shared<S>,
        prefix: &str,
        body: fn(&Shared<S>, usize) -> Exit,
    ) -> Result<Self> {
        let shared = Arc::new(shared);
        let mut running = Running {
            threads: Vec::with_capacity(shared.sockets.len()),
            shared,
        };
        for s in 0..running.shared.sockets.len() {
            let shared = Arc::clone(&running.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("{prefix}{s}"))
                .stack_size(IO_THREAD_STACK)
                .spawn(move || run_io(&shared, s, body));
            match spawned {
                Ok(t) => running.threads.push(t),
                // Dropping `running` stops and joins the threads started so far.
                Err(e) => return Err(Error::system(format!("cannot start an I/O thread: {e}"))),
            }
        }
        Ok(running)
    }
}

impl<S> Drop for Running<S> {
    fn drop(&mut self) {
        self.shared.stop();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                log_warn("an I/O thread ended with a panic");
            }
        }
        // The threads' references are gone: dropping ours closes the sockets now.
    }
}

fn run_io<S>(shared: &Shared<S>, s: usize, body: fn(&Shared<S>, usize) -> Exit) {
    match catch_unwind(AssertUnwindSafe(|| body(shared, s))) {
        Ok(Exit::Stopped) => {}
        Ok(Exit::Failed(err)) => shared.fail(err, true),
        Err(_) => shared.fail(
            Error::internal(format!("I/O thread of socket {s} panicked")),
            true,
        ),
    }
}
