//! The process-wide pool of I/O helper threads (`NCCL_LOSSY_IO_THREADS`): a few threads, each
//! with one epoll instance and an eventfd to wake it, serve the sockets of every connection.
//!
//! A connection's sockets are given to the threads round-robin, registered one-shot and
//! edge-triggered for both directions. On readiness, or at a deadline a socket asked for,
//! the thread runs the socket's state machine the same way an inline caller does
//! (`try_lock`, never waiting), so a caller and a pool thread never move one socket's bytes
//! at once, and a slow or delayed connection never holds a thread. While the owner polls the
//! connection (inline progress in the last [`OWNER_ACTIVE`]), the thread leaves the socket to
//! it, out of its epoll set, and looks again [`DEFER`] later (the owner does not re-arm the
//! socket meanwhile, so the messages it polls wake no thread and run no epoll callback): on a
//! 2-core host a second thread moving the same bytes costs more than it gains
//! (docs/transport.md). The pool exists while some connection uses
//! it: created by the first, stopped (threads joined) when the last one closes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::Socket;

use crate::transport::socket::log_warn;
use crate::{Error, Result};

/// Stack of a pool thread: its calls are shallow.
const IO_THREAD_STACK: usize = 256 << 10;

/// The epoll key of a thread's eventfd; sockets get keys from 1 up, never reused.
const WAKE_KEY: u64 = 0;

/// A connection whose owner progressed it this recently is left to the owner.
pub(super) const OWNER_ACTIVE: Duration = Duration::from_millis(5);

/// How long a pool thread leaves a socket to its polling owner before it looks again.
pub(super) const DEFER: Duration = Duration::from_millis(5);

/// Most pool threads `NCCL_LOSSY_IO_THREADS` may ask for.
pub const MAX_IO_THREADS: usize = 64;

/// Something whose socket `s` a pool thread progresses.
pub(super) trait Ready: Send + Sync {
    /// Socket `s` is ready (`fired`: epoll reported it, which disarmed it), or a deadline it
    /// asked for passed. `None`: handled (the socket re-arms itself for what it waits on);
    /// `Some(t)`: left to the owner, who is polling it, look again at `t`.
    fn ready(&self, s: usize, fired: bool) -> Option<Instant>;
}

struct Entry {
    target: Weak<dyn Ready>,
    s: usize,
    /// A deferral timer is outstanding (at most one per socket).
    deferred: bool,
}

/// A timer: when, the socket's key, and whether it is the socket's deferral (else a
/// deadline the socket asked for).
type Timer = Reverse<(Instant, u64, bool)>;

/// How a socket is watched: edge-triggered and one-shot, for only what its state machine
/// waits on ([`Registration::arm`]). A socket with nothing to wait on stays disarmed: an idle
/// connection's always-writable socket would otherwise wake its thread at once, forever.
const ARM_FLAGS: u32 = (libc::EPOLLET | libc::EPOLLONESHOT) as u32;

/// Readiness a socket's state machine may wait on.
pub(super) const WANT_READ: u32 = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
/// Readiness a socket's state machine may wait on.
pub(super) const WANT_WRITE: u32 = libc::EPOLLOUT as u32;

type Lock<T> = Mutex<T>;

fn lock<T>(m: &Lock<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Worker {
    epfd: OwnedFd,
    evfd: OwnedFd,
    entries: Lock<HashMap<u64, Entry>>,
    timers: Lock<BinaryHeap<Timer>>,
    stop: AtomicBool,
}

impl Worker {
    fn new() -> io::Result<Worker> {
        // SAFETY: plain system calls with no pointer arguments; each result is checked.
        let (ep, ev) = unsafe {
            (
                libc::epoll_create1(libc::EPOLL_CLOEXEC),
                libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK),
            )
        };
        let err = io::Error::last_os_error();
        // SAFETY: each descriptor, when valid, was just created and is owned by nobody else.
        let own = |fd: RawFd| (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) });
        let (Some(epfd), Some(evfd)) = (own(ep), own(ev)) else {
            return Err(err);
        };
        let w = Worker {
            epfd,
            evfd,
            entries: Mutex::new(HashMap::new()),
            timers: Mutex::new(BinaryHeap::new()),
            stop: AtomicBool::new(false),
        };
        w.ctl(
            libc::EPOLL_CTL_ADD,
            w.evfd.as_raw_fd(),
            libc::EPOLLIN as u32,
            WAKE_KEY,
        )?;
        Ok(w)
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, key: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: key };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call; the kernel copies it.
        if unsafe { libc::epoll_ctl(self.epfd.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local array to our own eventfd. A full counter
        // (EAGAIN) already means the thread will wake.
        let _ = unsafe { libc::write(self.evfd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    fn drain_wake(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local array from our own eventfd.
        let _ = unsafe { libc::read(self.evfd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }

    /// Milliseconds until the earliest deadline, rounded up (so it is never early); -1: none.
    fn timeout_ms(&self) -> i32 {
        lock(&self.timers).peek().map_or(-1, |Reverse((d, _, _))| {
            let ns = d.saturating_duration_since(Instant::now()).as_nanos();
            i32::try_from(ns.div_ceil(1_000_000)).unwrap_or(i32::MAX)
        })
    }

    fn run(&self) {
        const EMPTY: libc::epoll_event = libc::epoll_event { events: 0, u64: 0 };
        let mut events = [EMPTY; 64];
        // (socket key, deferral timer, reported by epoll)
        let mut due: Vec<(u64, bool, bool)> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            let timeout = self.timeout_ms();
            // SAFETY: `events` is a live array of `events.len()` epoll_event the kernel fills.
            let n = unsafe {
                libc::epoll_wait(
                    self.epfd.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    timeout,
                )
            };
            due.clear();
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    log_warn(format_args!("I/O pool thread: epoll_wait failed: {e}"));
                    return;
                }
            }
            for ev in &events[..usize::try_from(n).unwrap_or(0)] {
                let key = ev.u64;
                if key == WAKE_KEY {
                    self.drain_wake();
                } else {
                    due.push((key, false, true));
                }
            }
            {
                let now = Instant::now();
                let mut timers = lock(&self.timers);
                while let Some(&Reverse((d, key, deferral))) = timers.peek() {
                    if d > now {
                        break;
                    }
                    timers.pop();
                    due.push((key, deferral, false));
                }
            }
            for &(key, deferral, fired) in &due {
                let found = lock(&self.entries).get_mut(&key).map(|e| {
                    if deferral {
                        e.deferred = false;
                    }
                    (e.target.clone(), e.s)
                });
                let Some((target, s)) = found else {
                    continue;
                };
                let Some(target) = target.upgrade() else {
                    continue;
                };
                match target.ready(s, fired) {
                    None => {}
                    Some(t) => {
                        if let Some(e) = lock(&self.entries).get_mut(&key) {
                            if !e.deferred {
                                e.deferred = true;
                                lock(&self.timers).push(Reverse((t, key, true)));
                            }
                        }
                    }
                }
                // The connection may close here, on this thread: that takes it out.
                drop(target);
            }
        }
    }
}

/// A socket's place in the pool; dropping it takes the socket out (before it closes).
pub(super) struct Registration {
    worker: Arc<Worker>,
    key: u64,
    fd: RawFd,
}

impl Registration {
    /// Watches the socket, once, for `want` ([`WANT_READ`] and/or [`WANT_WRITE`]). Edge
    /// triggered: a socket already ready is reported at once. False when it could not be
    /// watched (the kernel's limit on watched descriptors): the caller arms it again later.
    pub(super) fn arm(&self, want: u32) -> bool {
        let events = want | ARM_FLAGS;
        let modify = || {
            self.worker
                .ctl(libc::EPOLL_CTL_MOD, self.fd, events, self.key)
        };
        let err = match modify() {
            Ok(()) => return true,
            // Out of the set while it was left to its owner ([`Registration::leave`]).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                match self
                    .worker
                    .ctl(libc::EPOLL_CTL_ADD, self.fd, events, self.key)
                {
                    Ok(()) => return true,
                    // Put back by another caller arming it at the same moment.
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => match modify() {
                        Ok(()) => return true,
                        Err(e) => e,
                    },
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        // Closing (EBADF: the socket is already out, nothing to watch) is no failure.
        if err.raw_os_error() == Some(libc::EBADF) {
            return true;
        }
        // Tried again at every arming while the limit holds: a few lines, not one per try.
        static UNWATCHED: crate::log::RateLimit = crate::log::RateLimit::new(5, 10);
        UNWATCHED.warn(
            "epoll",
            &format!(
                "I/O pool thread: cannot watch a socket: {err}; it moves only inside NCCL's calls \
                 until it can"
            ),
        );
        false
    }

    /// Takes the socket out of the thread's epoll set while its owner polls it: registered,
    /// even disarmed, it would run the kernel's epoll callback for every segment that
    /// arrives or is acknowledged (measured: 1-3% of 8-64 B all-reduces on 2 cores,
    /// docs/remaining-gap.md). [`Registration::arm`] puts it back.
    pub(super) fn leave(&self) {
        // An error only means the socket is already out.
        let _ = self.worker.ctl(libc::EPOLL_CTL_DEL, self.fd, 0, self.key);
    }

    /// Has the socket progressed at `deadline`, even if no readiness comes.
    pub(super) fn wake_at(&self, deadline: Instant) {
        lock(&self.worker.timers).push(Reverse((deadline, self.key, false)));
        self.worker.wake();
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // An error only means the socket is already out (closed).
        let _ = self.worker.ctl(libc::EPOLL_CTL_DEL, self.fd, 0, self.key);
        lock(&self.worker.entries).remove(&self.key);
    }
}

/// The I/O helper threads of this process.
pub struct Pool {
    workers: Vec<Arc<Worker>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
}

/// The pool in use, if any: connections hold it, the last one to close stops it.
static POOL: Mutex<Weak<Pool>> = Mutex::new(Weak::new());

static NEXT_KEY: AtomicU64 = AtomicU64::new(WAKE_KEY + 1);

/// Pool threads when `NCCL_LOSSY_IO_THREADS` is unset: none, on any host. Bytes move inside NCCL's calls, as NCCL's own Socket transport moves them with no
/// helper thread, and NCCL's proxy tests every request it posted. A thread woken by every
/// arriving message cost a small message a third of its time on 2 cores (docs/performance.md,
/// "Engine v2"); on a 16-core GPU host a quarter of the cores as pool threads (with four
/// sockets, the default there until then) took 3-66% longer at every size, over 1 and over 8
/// channels (docs/gpu-host.md). The pool serves those who set `NCCL_LOSSY_IO_THREADS`.
pub const DEFAULT_IO_THREADS: usize = 0;

/// `NCCL_LOSSY_IO_THREADS`, or the default. `SocketConfig` refuses a malformed value at `init`;
/// one set after `init` is reported and ignored.
pub fn io_threads() -> usize {
    let fallback = |why: std::fmt::Arguments<'_>| {
        let n = DEFAULT_IO_THREADS;
        log_warn(format_args!("{why}; using {n}"));
        n
    };
    match crate::env::var("NCCL_LOSSY_IO_THREADS") {
        Ok(Some(v)) if !v.trim().is_empty() => match v.trim().parse::<usize>() {
            Ok(n) if n <= MAX_IO_THREADS => n,
            _ => fallback(format_args!(
                "NCCL_LOSSY_IO_THREADS={} is not valid (an integer from 0 to {MAX_IO_THREADS})",
                crate::error::echo(&v, str::to_string)
            )),
        },
        Ok(_) => DEFAULT_IO_THREADS,
        Err(e) => fallback(format_args!("{e}")),
    }
}

impl Pool {
    /// The process's pool, started if no connection uses one yet; `None` with 0 threads.
    pub(crate) fn shared() -> Result<Option<Arc<Pool>>> {
        let n = io_threads();
        if n == 0 {
            return Ok(None);
        }
        let mut slot = lock(&POOL);
        if let Some(p) = slot.upgrade() {
            return Ok(Some(p));
        }
        let p = Arc::new(Pool::start(n)?);
        *slot = Arc::downgrade(&p);
        Ok(Some(p))
    }

    fn start(n: usize) -> Result<Pool> {
        let mut pool = Pool {
            workers: Vec::with_capacity(n),
            threads: Vec::with_capacity(n),
            next: AtomicUsize::new(0),
        };
        for i in 0..n {
            let w = Arc::new(Worker::new().map_err(|e| {
                if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                    Error::system(format!(
                        "creating an I/O pool thread: {e}; each of the NCCL_LOSSY_IO_THREADS={n} \
                         pool threads takes two file descriptors (descriptor limit {}: raise it \
                         with `ulimit -n`, or set NCCL_LOSSY_IO_THREADS=0)",
                        crate::transport::socket::fds::limit_text()
                    ))
                } else {
                    Error::from(e).context("creating an I/O pool thread")
                }
            })?);
            let run = Arc::clone(&w);
            let t = std::thread::Builder::new()
                .name(format!("lossy-io{i}"))
                .stack_size(IO_THREAD_STACK)
                .spawn(move || run.run())
                .map_err(|e| {
                    Error::system(format!(
                        "cannot start an I/O pool thread: {e} (the process limit, `ulimit -u`, \
                         or memory: raise it, or set NCCL_LOSSY_IO_THREADS=0 to move bytes \
                         on NCCL's own thread)"
                    ))
                })?;
            pool.workers.push(w);
            pool.threads.push(t);
        }
        Ok(pool)
    }

    /// Registers `sock` (socket `s` of `target`) with the next thread, round-robin.
    pub(super) fn register(
        &self,
        sock: &Socket,
        target: Weak<dyn Ready>,
        s: usize,
    ) -> Result<Registration> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        let worker = Arc::clone(&self.workers[i]);
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        let fd = sock.as_raw_fd();
        lock(&worker.entries).insert(
            key,
            Entry {
                target,
                s,
                deferred: false,
            },
        );
        // Disarmed until the socket's state machine waits on something.
        if let Err(e) = worker.ctl(libc::EPOLL_CTL_ADD, fd, ARM_FLAGS, key) {
            lock(&worker.entries).remove(&key);
            return Err(Error::from(e).context("registering a socket with the I/O pool"));
        }
        Ok(Registration { worker, key, fd })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for w in &self.workers {
            w.stop.store(true, Ordering::Release);
            w.wake();
        }
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                log_warn("an I/O pool thread ended with a panic");
            }
        }
    }
}
