//! What every caller and I/O pool thread touching one connection shares: the connection lock,
//! the request slot states, the progress clock, one state machine per socket, and the
//! non-blocking socket I/O the state machines do.
//!
//! Progress on a socket is driven by whoever comes first: the owner's `isend`/`irecv`/`test`
//! (inline), or the pool thread the socket is registered with, on readiness or at a
//! retransmit deadline. Each socket's state is behind its own lock taken with `try_lock`: a
//! busy lock means someone else is moving that socket's bytes, so the caller skips it after
//! raising the socket's `pending` flag, which the lock holder checks before it lets go (no
//! readiness is lost, and nobody waits).

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::Shutdown;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use socket2::Socket;

use super::pool::{Pool, Ready, Registration, DEFER, OWNER_ACTIVE};
use crate::transport::socket::log_warn;
use crate::transport::{Completion, RequestId, MAX_REQUESTS};
use crate::{Error, Result};

/// Most bytes one `send`/`recv` call moves, so a large chunk still marks progress often
/// enough for the no-progress timeout (a few more system calls per 64 MiB, no measurable cost).
pub(super) const IO_PIECE: usize = 4 << 20;

pub(super) const FREE: u8 = 0;
pub(super) const PENDING: u8 = 1;
pub(super) const DONE: u8 = 2;

/// When a connection last moved bytes, for the no-progress timeout (`NCCL_LOSSY_TIMEOUT`).
/// Without a timeout nothing reads it, and recording costs nothing (no clock read per
/// transfer on the hot path).
pub(super) struct Progress {
    epoch: Instant,
    last_ns: AtomicU64,
    recorded: bool,
}

impl Progress {
    fn new(recorded: bool) -> Self {
        Progress {
            epoch: Instant::now(),
            last_ns: AtomicU64::new(0),
            recorded,
        }
    }

    #[inline]
    pub(super) fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records that bytes moved (or that the clock starts now).
    #[inline]
    pub(super) fn touch(&self) {
        if self.recorded {
            self.last_ns.store(self.now_ns(), Ordering::Relaxed);
        }
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

/// The kernel's coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`), in nanoseconds that move
/// in its ticks of 1-4 ms: cheap enough to read on every call (no time-stamp counter read,
/// which costs some 25 ns in a virtual machine), fine enough to tell a pause from a stream
/// of messages, or an owner that polls from one that went away. 0 if it cannot be read.
pub(super) fn coarse_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the duration of the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) } != 0 {
        return 0;
    }
    (now.tv_sec as u64).wrapping_mul(1_000_000_000) + now.tv_nsec as u64
}

/// Sends a prefix of the bytes of `parts`, in order, in one system call without waiting:
/// `Ok(None)` when the socket buffer is full. `more`: the caller has more bytes to send
/// right after these (the kernel may hold a short segment back for them).
pub(super) fn send_gathered(
    sock: &Socket,
    parts: &[IoSlice<'_>],
    more: bool,
) -> io::Result<Option<usize>> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    // MSG_NOSIGNAL: a dead peer must give EPIPE, not kill a host process that kept SIGPIPE.
    let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT | if more { libc::MSG_MORE } else { 0 };
    loop {
        let sent = match parts {
            [one] => sock.send_with_flags(one, flags),
            _ => sock.send_vectored_with_flags(parts, flags),
        };
        match sent {
            Ok(0) if total > 0 => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// Receives what has arrived into `buf`, and once `buf` is full into `tail` (a vectored read
/// only when `tail` is not empty), in one system call without waiting: `Ok(None)` when
/// nothing has arrived, `Ok(Some(0))` when the peer closed its end, else the bytes stored
/// (`buf` first). The socket is non-blocking.
pub(super) fn recv_some(
    sock: &Socket,
    buf: &mut [u8],
    tail: &mut [u8],
) -> io::Result<Option<usize>> {
    let end = buf.len().min(IO_PIECE);
    // A read cut short of `buf` must not run on into `tail`.
    let tail = if end < buf.len() { &mut [][..] } else { tail };
    let mut reader = sock;
    loop {
        #[cfg(test)]
        reads::count(1, 0);
        let got = if tail.is_empty() {
            reader.read(&mut buf[..end])
        } else {
            reader.read_vectored(&mut [IoSliceMut::new(&mut buf[..end]), IoSliceMut::new(tail)])
        };
        match got {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                #[cfg(test)]
                reads::count(0, 1);
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Peeks at up to `buf.len()` bytes that have already arrived on `sock`, without waiting and
/// without consuming them.
pub(super) fn peek_arrived(sock: &Socket, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`, and `recv` only stores initialised
    // bytes into the slice, so viewing initialised bytes as possibly uninitialised is sound.
    let view = unsafe { &mut *(buf as *mut [u8] as *mut [std::mem::MaybeUninit<u8>]) };
    sock.recv_with_flags(view, libc::MSG_PEEK | libc::MSG_DONTWAIT)
}

/// Takes the first entry of `queue` that `is_it`, looking at the front first: messages and
/// receives mostly finish in the order they were posted, so the usual case is one comparison
/// and a `pop_front`, not a pass over the queue.
pub(super) fn remove_first<T>(queue: &mut VecDeque<T>, is_it: impl Fn(&T) -> bool) {
    match queue.front() {
        Some(front) if is_it(front) => {
            queue.pop_front();
        }
        _ => {
            if let Some(i) = queue.iter().position(is_it) {
                queue.remove(i);
            }
        }
    }
}

/// A failed `send`/`recv` on an established connection: the peer's failure (`Remote`),
/// whatever the errno, as NCCL's Socket transport reports every such error but the transient
/// ones (`ncclOsSocketProgressOpt` in src/os/linux.cc: `ncclRemoteError`). A peer whose host
/// stopped answering ends in `ETIMEDOUT` (or `EHOSTUNREACH`), which `Error::from` would call
/// a `System` error, as if this process had run out of something.
pub(super) fn peer_io_error(e: &io::Error) -> Error {
    Error::remote(e.to_string())
}

/// Connection state guarded by the lock.
pub(super) struct Locked<S> {
    pub(super) side: S,
    pub(super) failed: Option<Error>,
    pub(super) stopping: bool,
}

impl<S> Locked<S> {
    /// Nothing more moves: closing or failed.
    pub(super) fn over(&self) -> bool {
        self.stopping || self.failed.is_some()
    }
}

/// One half of a connection: its shared state and the state machine of each socket.
pub(super) trait Side: Send + Sized + 'static {
    /// The state machine of one socket.
    type Sock: Send;
    /// Moves the bytes socket `s` can move now, until it would block or has no work; records
    /// a failure in `shared`. Never blocks, never sleeps.
    fn advance(shared: &Shared<Self>, s: usize, st: &mut Self::Sock);
    /// What socket `s`, as `advance` left it, waits on before it can move more bytes
    /// ([`WANT_READ`], [`WANT_WRITE`]); 0 when only its owner or a timer can make it move
    /// (nothing queued, a receive not posted yet, a retransmit deadline ahead).
    fn waits_on(st: &Self::Sock) -> u32;
}

/// A socket's state machine and the flag that asks its lock holder for another pass.
struct SockCell<T> {
    state: Mutex<T>,
    pending: AtomicBool,
    /// What the socket is armed for with its pool thread (0: disarmed).
    armed: AtomicU32,
    /// Its pool thread left the socket to the polling owner and looks again after
    /// [`DEFER`]: until then the owner does not arm it (see [`Shared::arm`]).
    deferred: AtomicBool,
}

/// What the owner and the pool threads of one connection share.
pub(super) struct Shared<S: Side> {
    /// Registrations with the pool, dropped (unregistered) before the sockets close.
    regs: OnceLock<Vec<Registration>>,
    pub(super) sockets: Vec<Socket>,
    cells: Vec<SockCell<S::Sock>>,
    pub(super) peer: String,
    pub(super) locked: Mutex<Locked<S>>,
    pub(super) slot_state: [AtomicU8; MAX_REQUESTS],
    pub(super) failed: AtomicBool,
    /// The owner is closing the connection: no state machine runs any more (it could write
    /// into a receive buffer the caller frees once the close returns).
    closing: AtomicBool,
    pub(super) progress: Progress,
    /// Fail the connection when a request is outstanding and no byte moved for this long.
    pub(super) timeout: Option<Duration>,
    /// When the owner last ran inline progress ([`coarse_ns`]: marked at every call, so it costs
    /// no precise clock read).
    owner_ns: AtomicU64,
}

pub(super) type Guard<'a, S> = MutexGuard<'a, Locked<S>>;

impl<S: Side> Shared<S> {
    /// Puts `sockets` in non-blocking mode and registers them with `pool` (if any).
    pub(super) fn start(
        sockets: Vec<Socket>,
        states: Vec<S::Sock>,
        peer: String,
        side: S,
        timeout: Option<Duration>,
        pool: Option<&Pool>,
    ) -> Result<Arc<Self>> {
        for sock in &sockets {
            sock.set_nonblocking(true)
                .map_err(|e| Error::from(e).context("configuring a connection's socket"))?;
        }
        let shared = Arc::new(Shared {
            regs: OnceLock::new(),
            progress: Progress::new(timeout.is_some()),
            timeout,
            sockets,
            cells: states
                .into_iter()
                .map(|st| SockCell {
                    state: Mutex::new(st),
                    pending: AtomicBool::new(false),
                    armed: AtomicU32::new(0),
                    deferred: AtomicBool::new(false),
                })
                .collect(),
            peer,
            locked: Mutex::new(Locked {
                side,
                failed: None,
                stopping: false,
            }),
            slot_state: std::array::from_fn(|_| AtomicU8::new(FREE)),
            failed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            owner_ns: AtomicU64::new(0),
        });
        if let Some(pool) = pool {
            let weak = Arc::downgrade(&shared);
            let mut regs = Vec::with_capacity(shared.sockets.len());
            for (s, sock) in shared.sockets.iter().enumerate() {
                let target: std::sync::Weak<dyn Ready> = weak.clone();
                regs.push(pool.register(sock, target, s)?);
            }
            let _ = shared.regs.set(regs);
        }
        Ok(shared)
    }

    pub(super) fn lock(&self) -> Guard<'_, S> {
        // A poisoned lock only means a caller panicked while holding it; the state stays valid.
        self.locked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves what every socket can move now (the owner's inline progress, from a call that
    /// marked the owner active: [`Shared::test_with`], or a post). Never blocks.
    pub(super) fn progress_all(&self) {
        for s in 0..self.cells.len() {
            self.progress_socket(s);
        }
    }

    /// Whether a pool thread serves this connection's sockets (else only the owner's calls
    /// move them).
    pub(super) fn has_pool(&self) -> bool {
        self.regs.get().is_some()
    }

    /// Notes that the owner progresses the connection now, for its pool thread (if any) to
    /// leave the sockets to it.
    pub(super) fn owner_active(&self) {
        if self.has_pool() {
            self.owner_ns.store(coarse_ns(), Ordering::Relaxed);
        }
    }

    /// Moves what the sockets of `mask` (bit `s`: socket `s`) can move now, as the owner.
    pub(super) fn progress_sockets(&self, mask: u16) {
        self.owner_active();
        if mask == 0 {
            return;
        }
        for s in (0..self.cells.len()).filter(|s| mask & (1 << s) != 0) {
            self.progress_socket(s);
        }
    }

    /// Moves what socket `s` can move now, unless someone else is already doing it (then
    /// that one makes another pass). Never blocks.
    pub(super) fn progress_socket(&self, s: usize) {
        let cell = &self.cells[s];
        if !self.has_pool() {
            // Only the owner's calls move the sockets: one pass, and nothing to arm. A caller
            // that finds the socket busy (the owner's calls made from two threads at once)
            // leaves it to the pass under way and to the next `test`, which NCCL's proxy
            // makes for every request it has in flight.
            let mut st = match cell.state.try_lock() {
                Ok(st) => st,
                Err(TryLockError::WouldBlock) => return,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
            };
            if !self.halted() {
                self.pass(s, &mut st);
            }
            return;
        }
        cell.pending.store(true, Ordering::Release);
        loop {
            let mut st = match cell.state.try_lock() {
                Ok(st) => st,
                Err(TryLockError::WouldBlock) => return,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
            };
            while cell.pending.swap(false, Ordering::AcqRel) {
                if self.halted() {
                    break;
                }
                self.pass(s, &mut st);
            }
            // A failed connection's sockets are shut down and always ready: arming one again
            // would wake its pool thread at once, for ever.
            let want = if self.halted() { 0 } else { S::waits_on(&st) };
            self.arm(s, want);
            drop(st);
            // Raised after our last pass and before we let go: its raiser skipped, so go on.
            if !cell.pending.load(Ordering::Acquire) {
                return;
            }
        }
    }

    /// One run of socket `s`'s state machine; a panic in it fails the connection.
    fn pass(&self, s: usize, st: &mut S::Sock) {
        let run = catch_unwind(AssertUnwindSafe(|| S::advance(self, s, st)));
        if run.is_err() {
            self.fail(
                Error::internal(format!("progress on socket {s} panicked")),
                true,
            );
        }
    }

    /// Failed or closing: no state machine runs, and no socket is armed.
    fn halted(&self) -> bool {
        self.failed.load(Ordering::Acquire) || self.closing.load(Ordering::Acquire)
    }

    /// Has the pool thread of socket `s` progress it when `want` is ready, unless it is
    /// armed for that already (a syscall only when the wait changes, not per `test`), or the
    /// thread left the socket to its polling owner and looks again soon anyway: re-armed
    /// then, every message that arrives while the owner polls would wake the thread only to
    /// hear that (a wake-up and an `epoll_ctl` per message; the thread arms the socket
    /// itself once the owner stops).
    fn arm(&self, s: usize, want: u32) {
        let Some(reg) = self.regs.get().and_then(|r| r.get(s)) else {
            return;
        };
        let cell = &self.cells[s];
        if want != 0
            && !cell.deferred.load(Ordering::Acquire)
            && cell.armed.swap(want, Ordering::AcqRel) != want
            && !reg.arm(want)
        {
            // Not watched: the next arming tries again.
            cell.armed.store(0, Ordering::Release);
        }
    }

    /// New work waits on the owner's next call: has the pool thread look at every socket it
    /// watches (arming it for `want`), so work nobody tests still moves. A socket the thread
    /// left to its polling owner is not armed: that owner's next `test` moves it, or the
    /// thread, which looks again within [`DEFER`], once the owner has stopped.
    pub(super) fn offer(&self, want: u32) {
        if !self.has_pool() || self.halted() {
            return;
        }
        // The owner posting is the owner polling.
        self.owner_active();
        for s in 0..self.cells.len() {
            self.arm(s, want);
        }
    }

    /// Asks the pool thread of socket `s` to progress it at `deadline` (a delayed retransmit).
    pub(super) fn wake_at(&self, s: usize, deadline: Instant) {
        if let Some(reg) = self.regs.get().and_then(|r| r.get(s)) {
            reg.wake_at(deadline);
        }
    }

    fn shutdown_sockets(&self) {
        for sock in &self.sockets {
            // Errors only mean the socket is already down, which is what we want.
            let _ = sock.shutdown(Shutdown::Both);
        }
    }

    /// Records the connection's first failure; the sockets shut down.
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
        drop(g);
        self.shutdown_sockets();
    }

    /// Closes: nothing moves any more, and the sockets shut down. Returns only when no pool
    /// thread is inside a socket's state machine, so none writes into (or reads from) a
    /// buffer of NCCL's after its `close` returned and NCCL freed it.
    pub(super) fn stop(&self) {
        let mut g = self.lock();
        g.stopping = true;
        drop(g);
        self.closing.store(true, Ordering::Release);
        self.shutdown_sockets();
        for cell in &self.cells {
            // A state machine never blocks while it holds its lock, so this wait is short; and
            // a later pass sees `closing` before it touches anything.
            drop(cell.state.lock());
        }
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

    fn timeout_error(&self, limit: Duration) -> Error {
        Error::remote(format!(
            "no progress with {} for {:.3} s while a request was outstanding \
             (NCCL_LOSSY_TIMEOUT={}): the peer is stalled, unreachable or gone",
            self.peer,
            self.progress.idle_for().as_secs_f64(),
            limit.as_secs_f64()
        ))
    }

    pub(super) fn free_slot(&self) -> Option<usize> {
        (0..MAX_REQUESTS).find(|&i| self.slot_state[i].load(Ordering::Acquire) == FREE)
    }

    /// Common part of `test`: `Ok(None)` while pending, the slot's completion when done. A
    /// pending request first gets inline progress; a finished one costs one atomic read.
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
        // Every `test` says the owner polls (as every post does), one that finds its request
        // done at once too: only those that ran progress said it, so once the pool thread had
        // sent a message for an owner that looked away, the owner's next tests found theirs
        // done, the owner looked gone for good, and the thread sent every later message.
        self.owner_active();
        let mut state = self.slot_state[slot].load(Ordering::Acquire);
        if state == PENDING && !self.failed.load(Ordering::Acquire) {
            self.progress_all();
            state = self.slot_state[slot].load(Ordering::Acquire);
        }
        if state == PENDING && !self.failed.load(Ordering::Acquire) {
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

impl<S: Side> Ready for Shared<S> {
    fn ready(&self, s: usize, fired: bool) -> Option<Instant> {
        let cell = self.cells.get(s)?;
        if fired {
            // One-shot: reporting the socket disarmed it.
            cell.armed.store(0, Ordering::Release);
        }
        let since_owner = coarse_ns().saturating_sub(self.owner_ns.load(Ordering::Relaxed));
        if since_owner < OWNER_ACTIVE.as_nanos() as u64 && !self.failed.load(Ordering::Acquire) {
            // The pool keeps a timer for this look (one per socket), so the socket is never
            // left unwatched: the owner polls it, or this thread looks again. Out of the
            // thread's epoll set meanwhile (once per stretch the owner polls, and again if
            // an owner's arming raced with that and it fired).
            if !cell.deferred.swap(true, Ordering::AcqRel) || fired {
                if let Some(reg) = self.regs.get().and_then(|r| r.get(s)) {
                    reg.leave();
                }
            }
            return Some(Instant::now() + DEFER);
        }
        // From here the thread moves the socket, and arms it for what it waits on next (out
        // of the set, it is armed for nothing, whatever `armed` last said).
        cell.deferred.store(false, Ordering::Release);
        cell.armed.store(0, Ordering::Release);
        self.progress_socket(s);
        None
    }
}

/// The kernel's TCP state of `sock` (`TCP_INFO`), for tests that count segments.
#[cfg(test)]
pub(crate) fn tcp_info(sock: &impl std::os::fd::AsRawFd) -> libc::tcp_info {
    // SAFETY: `tcp_info` is plain data (all-zero is a valid value).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a live socket descriptor, and `info`/`len` describe a buffer of `len` bytes
    // that outlives the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_INFO");
    info
}

/// The socket reads this thread made, and how many of them found nothing, for tests of
/// when a receive stops reading.
#[cfg(test)]
pub(crate) mod reads {
    use std::cell::Cell;

    thread_local! {
        static COUNTS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }

    pub(super) fn count(reads: u64, empty: u64) {
        COUNTS.with(|c| {
            let (r, e) = c.get();
            c.set((r + reads, e + empty));
        });
    }

    /// (reads, reads that found nothing) made by this thread so far.
    pub(crate) fn so_far() -> (u64, u64) {
        COUNTS.with(Cell::get)
    }
}
