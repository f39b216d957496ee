//! The data path of one connection: a fixed table of request slots, a queue of posted
//! messages, and one I/O thread per socket that moves its share of every message.
//!
//! Every message is cut into `k` contiguous chunks (see [`chunk_count`]); chunk `j` of message
//! `seq` travels on socket `(seq + j) mod n`, right after its own header (size, tag, chunk
//! index, the loss plan's runs that touch the chunk). Each socket's chunks come in stream
//! order, and every chunk describes itself, so a receiving thread never waits for another
//! socket to learn where its bytes go: sockets run independently, which matters when one of
//! them is briefly slower (measured: waiting for another socket's header cost 10-25% of the
//! receive time when only one socket carried the message header).
//!
//! The owner's calls (`isend`/`irecv`/`test`) take the connection lock only briefly and never
//! do I/O; I/O threads take it to pick up work and to report a finished chunk, never while
//! they move bytes. `test` on a pending request reads one atomic.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::net::Shutdown;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::Socket;

use super::log_warn;
use super::wire::{self, Header, HEADER_SIZE, MAX_MESSAGE_BYTES, MAX_RETRANSMIT_TIMEOUT, RUN_SIZE};
use crate::loss::effect::{self, MIN_MTU};
use crate::loss::plan::{Effect, LossPlan, PacketRun};
use crate::transport::{
    Completion, HostBuf, RecvConn, RequestId, SendConn, MAX_RECVS, MAX_REQUESTS,
};
use crate::{Error, Result};

/// Smallest chunk a message is cut into, so small messages use few sockets.
pub const MIN_CHUNK: usize = 64 << 10;

/// Runs read from the wire per `recv`, so a long list costs a bounded buffer.
const RUN_BATCH: usize = 4096;

/// Stack of an I/O thread: its calls are shallow, and connections are many.
const IO_THREAD_STACK: usize = 256 << 10;

/// Most bytes one `send`/`recv` call moves, so a large chunk still marks progress often
/// enough for the no-progress timeout (a few more system calls per 64 MiB, no measurable cost).
const IO_PIECE: usize = 4 << 20;

const FREE: u8 = 0;
const PENDING: u8 = 1;
const DONE: u8 = 2;

/// Number of chunks a `size`-byte message is cut into over `sockets` sockets (at least 1).
pub fn chunk_count(size: usize, sockets: usize) -> usize {
    (size / MIN_CHUNK).clamp(1, sockets.max(1))
}

/// Byte range of chunk `j` of `chunks` in a `size`-byte message: near-equal contiguous parts.
pub fn chunk_span(size: usize, chunks: usize, j: usize) -> Range<usize> {
    let (base, extra) = (size / chunks, size % chunks);
    let start = j * base + j.min(extra);
    start..start + base + usize::from(j < extra)
}

/// The socket of chunk 0 of message `seq`, and the chunk index socket `s` carries for it.
fn roles(seq: u64, s: usize, n: usize) -> (usize, usize) {
    let h = (seq % n as u64) as usize;
    (h, (s + n - h) % n)
}

/// The sockets that carry chunks `0..chunks` of message `seq`, in chunk order.
fn chunk_sockets(seq: u64, chunks: usize, n: usize) -> impl Iterator<Item = usize> {
    let first = roles(seq, 0, n).0;
    (0..chunks).map(move |j| (first + j) % n)
}

/// When a connection last moved bytes, for the no-progress timeout (`NCCL_LOSSY_TIMEOUT`).
struct Progress {
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

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Records that bytes moved (or that the clock starts now).
    fn touch(&self) {
        self.last_ns.store(self.now_ns(), Ordering::Relaxed);
    }

    /// How long since bytes last moved.
    fn idle_for(&self) -> Duration {
        Duration::from_nanos(
            self.now_ns()
                .saturating_sub(self.last_ns.load(Ordering::Relaxed)),
        )
    }
}

fn send_all(sock: &Socket, mut bytes: &[u8], more: bool, progress: &Progress) -> io::Result<()> {
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
fn recv_until_eof(sock: &Socket, buf: &mut [u8], progress: &Progress) -> io::Result<usize> {
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

fn recv_all(sock: &Socket, buf: &mut [u8], progress: &Progress) -> io::Result<()> {
    if recv_until_eof(sock, buf, progress)? < buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "peer closed the connection",
        ));
    }
    Ok(())
}

/// Why an I/O thread stopped.
enum Exit {
    /// The connection is closing or already failed: nothing more to report.
    Stopped,
    /// This thread hit the failure that brings the connection down.
    Failed(Error),
}

/// Connection state guarded by the lock.
struct Locked<S> {
    side: S,
    failed: Option<Error>,
    stopping: bool,
}

/// What the owner and the I/O threads of one connection share.
struct Core<S> {
    sockets: Vec<Socket>,
    peer: String,
    locked: Mutex<Locked<S>>,
    wake: Condvar,
    slot_state: [AtomicU8; MAX_REQUESTS],
    failed: AtomicBool,
    progress: Progress,
    /// Fail the connection when a request is outstanding and no byte moved for this long.
    timeout: Option<Duration>,
}

type Guard<'a, S> = MutexGuard<'a, Locked<S>>;

impl<S> Core<S> {
    fn new(sockets: Vec<Socket>, peer: String, side: S, timeout: Option<Duration>) -> Self {
        Core {
            progress: Progress::new(),
            timeout,
            sockets,
            peer,
            locked: Mutex::new(Locked {
                side,
                failed: None,
                stopping: false,
            }),
            wake: Condvar::new(),
            slot_state: std::array::from_fn(|_| AtomicU8::new(FREE)),
            failed: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> Guard<'_, S> {
        // A poisoned lock only means an I/O thread panicked; its panic is reported as a failure.
        self.locked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `ready` holds; `Err(Stopped)` once the connection closes or fails.
    fn wait_until<'a>(
        &self,
        mut g: Guard<'a, S>,
        ready: impl Fn(&S) -> bool,
    ) -> std::result::Result<Guard<'a, S>, Exit> {
        loop {
            if g.stopping || g.failed.is_some() {
                return Err(Exit::Stopped);
            }
            if ready(&g.side) {
                return Ok(g);
            }
            g = self.wake.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits for one wake-up; `Err(Stopped)` once the connection closes or fails.
    fn wait_once<'a>(&self, g: Guard<'a, S>) -> std::result::Result<Guard<'a, S>, Exit> {
        let g = self.wake.wait(g).unwrap_or_else(|p| p.into_inner());
        if g.stopping || g.failed.is_some() {
            return Err(Exit::Stopped);
        }
        Ok(g)
    }

    /// Sleeps for `dur` unless the connection closes or fails first.
    fn sleep(&self, dur: Duration) -> std::result::Result<(), Exit> {
        let deadline = Instant::now() + dur;
        let mut g = self.lock();
        loop {
            if g.stopping || g.failed.is_some() {
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
    fn fail(&self, err: Error, warn: bool) {
        self.fail_locked(self.lock(), err, warn);
    }

    /// As [`Core::fail`], with the lock already held.
    fn fail_locked(&self, mut g: Guard<'_, S>, err: Error, warn: bool) {
        if g.stopping || g.failed.is_some() {
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
    fn io_exit(&self, err: io::Error, what: fmt::Arguments<'_>) -> Exit {
        let g = self.lock();
        if g.stopping || g.failed.is_some() {
            return Exit::Stopped;
        }
        drop(g);
        Exit::Failed(Error::from(err).context(format_args!("{what} with {}", self.peer)))
    }

    /// Fails unless new requests may be posted.
    fn usable(&self, g: &Guard<'_, S>) -> Result<()> {
        if let Some(err) = &g.failed {
            return Err(err.clone());
        }
        if g.stopping {
            return Err(Error::internal("connection is closing"));
        }
        Ok(())
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

    fn free_slot(&self) -> Option<usize> {
        (0..MAX_REQUESTS).find(|&i| self.slot_state[i].load(Ordering::Acquire) == FREE)
    }

    /// Common part of `test`: `Ok(None)` while pending, the slot's completion when done.
    fn test_with(
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
struct Running<S> {
    core: Arc<Core<S>>,
    threads: Vec<JoinHandle<()>>,
}

impl<S: Send + 'static> Running<S> {
    fn start(core: Core<S>, prefix: &str, body: fn(&Core<S>, usize) -> Exit) -> Result<Self> {
        let core = Arc::new(core);
        let mut running = Running {
            threads: Vec::with_capacity(core.sockets.len()),
            core,
        };
        for s in 0..running.core.sockets.len() {
            let core = Arc::clone(&running.core);
            let spawned = std::thread::Builder::new()
                .name(format!("{prefix}{s}"))
                .stack_size(IO_THREAD_STACK)
                .spawn(move || run_io(&core, s, body));
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
        self.core.stop();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                log_warn("an I/O thread ended with a panic");
            }
        }
        // The threads' references are gone: dropping ours closes the sockets now.
    }
}

fn run_io<S>(core: &Core<S>, s: usize, body: fn(&Core<S>, usize) -> Exit) {
    match catch_unwind(AssertUnwindSafe(|| body(core, s))) {
        Ok(Exit::Stopped) => {}
        Ok(Exit::Failed(err)) => core.fail(err, true),
        Err(_) => core.fail(
            Error::internal(format!("I/O thread of socket {s} panicked")),
            true,
        ),
    }
}

/// Puts a connected socket in the mode the I/O threads expect.
pub(crate) fn prepare(sock: &Socket) -> io::Result<()> {
    sock.set_nonblocking(false)?;
    sock.set_nodelay(true)
}

fn check_plan(plan: &LossPlan, size: usize) -> Result<()> {
    let bad = |why: String| Error::invalid_argument(format!("loss plan: {why}"));
    if plan.mtu < MIN_MTU {
        return Err(bad(format!("mtu {} below {MIN_MTU}", plan.mtu)));
    }
    if plan.retransmit_timeout > MAX_RETRANSMIT_TIMEOUT {
        return Err(bad(format!(
            "retransmit timeout {:?} too long",
            plan.retransmit_timeout
        )));
    }
    effect::check_runs(&plan.lost, effect::packet_count(size, plan.mtu), 0)
        .map(|_| ())
        .map_err(|e| bad(e.to_string()))
}

// ---------------------------------------------------------------------------------------
// Sending side.

struct SendSlot {
    buf: HostBuf,
    tag: i32,
    effect: Effect,
    mtu: u32,
    retransmit: Duration,
    flip_seed: u64,
    runs: Vec<PacketRun>,
    chunks_left: usize,
}

struct SendSide {
    slots: Vec<SendSlot>,
    /// (message seq, slot) of every message whose chunks are not all sent, oldest first.
    posted: VecDeque<(u64, usize)>,
    next_seq: u64,
}

/// One socket's share of one message.
struct SendJob {
    slot: usize,
    seq: u64,
    buf: HostBuf,
    tag: i32,
    effect: Effect,
    mtu: u32,
    retransmit: Duration,
    flip_seed: u64,
    events: usize,
    span: Range<usize>,
    chunk: u8,
}

/// The sending half of a socket connection.
pub struct SocketSendConn {
    running: Running<SendSide>,
}

impl SocketSendConn {
    /// Starts the I/O threads over connected `sockets` (index order = socket order); with
    /// `timeout`, requests fail when no byte moves for that long.
    pub(crate) fn start(
        sockets: Vec<Socket>,
        peer: String,
        timeout: Option<Duration>,
    ) -> Result<Self> {
        let side = SendSide {
            slots: (0..MAX_REQUESTS)
                .map(|_| SendSlot {
                    buf: HostBuf::from_slice(&mut []),
                    tag: 0,
                    effect: Effect::Zero,
                    mtu: 0,
                    retransmit: Duration::ZERO,
                    flip_seed: 0,
                    runs: Vec::new(),
                    chunks_left: 0,
                })
                .collect(),
            posted: VecDeque::with_capacity(MAX_REQUESTS),
            next_seq: 0,
        };
        let core = Core::new(sockets, peer, side, timeout);
        Ok(SocketSendConn {
            running: Running::start(core, "lossy-tx", send_loop)?,
        })
    }
}

impl SendConn for SocketSendConn {
    fn isend(&self, buf: HostBuf, tag: i32, plan: &LossPlan) -> Result<Option<RequestId>> {
        let size = buf.len();
        if size as u64 > MAX_MESSAGE_BYTES {
            return Err(Error::invalid_argument(format!(
                "message of {size} bytes is too large"
            )));
        }
        check_plan(plan, size)?;
        let core = &self.running.core;
        let mut g = core.lock();
        core.usable(&g)?;
        let Some(slot) = core.free_slot() else {
            return Ok(None);
        };
        let n = core.sockets.len();
        let side = &mut g.side;
        let seq = side.next_seq;
        if side.posted.is_empty() {
            // The connection was idle: the no-progress clock starts now.
            core.progress.touch();
        }
        let s = &mut side.slots[slot];
        s.buf = buf;
        s.tag = tag;
        s.effect = plan.effect;
        s.mtu = plan.mtu;
        s.retransmit = plan.retransmit_timeout;
        s.flip_seed = plan.flip_seed;
        s.runs.clear();
        s.runs.extend_from_slice(&plan.lost);
        s.chunks_left = chunk_count(size, n);
        side.posted.push_back((seq, slot));
        side.next_seq += 1;
        core.slot_state[slot].store(PENDING, Ordering::Release);
        core.wake.notify_all();
        Ok(Some(slot as RequestId))
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.running.core.test_with(id, |side, slot| {
            Completion::single(side.slots[slot].buf.len())
        })
    }
}

fn send_loop(core: &Core<SendSide>, s: usize) -> Exit {
    let n = core.sockets.len();
    let mut runs: Vec<PacketRun> = Vec::new();
    let mut wire_buf: Vec<u8> = Vec::new();
    let mut seq = 0u64;
    loop {
        let job = {
            let g = match core.wait_until(core.lock(), |side| side.next_seq > seq) {
                Ok(g) => g,
                Err(exit) => return exit,
            };
            let (_, j) = roles(seq, s, n);
            // Not queued any more: its chunks are all sent, so none of them was ours.
            let found = g.side.posted.iter().find(|p| p.0 == seq).map(|p| p.1);
            found.and_then(|slot| {
                let m = &g.side.slots[slot];
                let size = m.buf.len();
                let k = chunk_count(size, n);
                (j < k).then(|| {
                    let span = chunk_span(size, k, j);
                    runs.clear();
                    runs.extend_from_slice(effect::runs_in_span(&m.runs, m.mtu, span.clone()));
                    SendJob {
                        slot,
                        seq,
                        buf: m.buf,
                        tag: m.tag,
                        effect: m.effect,
                        mtu: m.mtu,
                        retransmit: m.retransmit,
                        flip_seed: m.flip_seed,
                        events: m.runs.len(),
                        span,
                        chunk: j as u8,
                    }
                })
            })
        };
        if let Some(job) = job {
            if let Err(exit) = send_chunk(core, s, &job, &runs, &mut wire_buf) {
                return exit;
            }
            let mut g = core.lock();
            let side = &mut g.side;
            side.slots[job.slot].chunks_left -= 1;
            if side.slots[job.slot].chunks_left == 0 {
                side.posted.retain(|p| p.1 != job.slot);
                core.slot_state[job.slot].store(DONE, Ordering::Release);
            }
        }
        seq += 1;
    }
}

fn send_chunk(
    core: &Core<SendSide>,
    s: usize,
    job: &SendJob,
    runs: &[PacketRun],
    wire_buf: &mut Vec<u8>,
) -> std::result::Result<(), Exit> {
    let sock = &core.sockets[s];
    let size = job.buf.len();
    let seq = job.seq;
    let io = |e| core.io_exit(e, format_args!("sending message {seq} on socket {s}"));
    {
        let header = Header {
            seq: job.seq,
            chunk: job.chunk,
            size: size as u64,
            tag: job.tag,
            effect: job.effect,
            mtu: job.mtu,
            runs: runs.len() as u32,
            retransmit_ns: job.retransmit.as_nanos() as u64,
            flip_seed: job.flip_seed,
        };
        wire_buf.clear();
        wire_buf.extend_from_slice(&header.encode());
        wire::encode_runs(runs, wire_buf);
        send_all(sock, wire_buf, !job.span.is_empty(), &core.progress).map_err(io)?;
    }
    // Sends the bytes of `r`, a range of the message.
    let send = |r: Range<usize>| {
        send_all(sock, job.buf.slice(r.start, r.end), false, &core.progress).map_err(io)
    };
    let span = job.span.clone();
    match job.effect {
        Effect::Zero | Effect::Stale => {
            for r in effect::kept_ranges(runs, job.mtu, size, span) {
                send(r)?;
            }
        }
        Effect::Retransmit => {
            send(span.clone())?;
            if effect::lost_ranges(runs, job.mtu, size, span.clone())
                .next()
                .is_some()
            {
                // One timeout per loss event of the message, as if each were recovered by
                // its own retransmission timer; only this socket's stream waits.
                let events = u32::try_from(job.events).unwrap_or(u32::MAX);
                core.sleep(job.retransmit.saturating_mul(events))?;
                core.progress.touch();
                for r in effect::lost_ranges(runs, job.mtu, size, span) {
                    send(r)?;
                }
            }
        }
        Effect::Bitflip => send(span)?,
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Receiving side.

/// A message of a grouped receive, as its chunk headers describe it.
#[derive(Clone, Copy)]
struct RecvMsg {
    /// A chunk header of this message has arrived: the fields below are set.
    known: bool,
    /// The buffer the message lands in, once matched by tag.
    buf_index: Option<usize>,
    size: usize,
    tag: i32,
    effect: Effect,
    mtu: u32,
    flip_seed: u64,
    chunks_left: usize,
    /// Sockets whose chunk header for this message has arrived (bit `s`).
    got: u16,
}

const UNKNOWN_MSG: RecvMsg = RecvMsg {
    known: false,
    buf_index: None,
    size: 0,
    tag: 0,
    effect: Effect::Zero,
    mtu: 0,
    flip_seed: 0,
    chunks_left: 0,
    got: 0,
};

struct RecvSlot {
    n: usize,
    first_seq: u64,
    bufs: [HostBuf; MAX_RECVS],
    tags: [i32; MAX_RECVS],
    taken: [bool; MAX_RECVS],
    sizes: [usize; MAX_RECVS],
    /// Messages in stream order (message `first_seq + i` is `msgs[i]`).
    msgs: [RecvMsg; MAX_RECVS],
    msgs_left: usize,
}

impl RecvSlot {
    /// Matches message `i` to the first buffer with its tag not taken by an earlier message
    /// of this receive. `Ok(None)`: that depends on earlier messages whose headers are still
    /// on their way (only when several buffers share the tag).
    fn match_buffer(&mut self, i: usize) -> Result<Option<usize>> {
        if let Some(b) = self.msgs[i].buf_index {
            return Ok(Some(b));
        }
        let tag = self.msgs[i].tag;
        let with_tag = |b: &usize| self.tags[*b] == tag;
        let rank = match (0..self.n).filter(with_tag).count() {
            0 => {
                return Err(Error::invalid_usage(format!(
                    "a message with tag {tag} arrived, but the posted receive has tags {:?}",
                    &self.tags[..self.n]
                )))
            }
            // One buffer with this tag: it is this message's, whatever came before.
            1 => 0,
            _ => {
                if self.msgs[..i].iter().any(|m| !m.known) {
                    return Ok(None);
                }
                self.msgs[..i].iter().filter(|m| m.tag == tag).count()
            }
        };
        let found = (0..self.n).filter(with_tag).nth(rank);
        match found {
            Some(b) if !self.taken[b] => {
                self.taken[b] = true;
                self.msgs[i].buf_index = Some(b);
                Ok(Some(b))
            }
            _ => Err(Error::invalid_usage(format!(
                "more messages with tag {tag} than buffers with that tag in the posted receive"
            ))),
        }
    }
}

struct RecvSide {
    slots: Vec<RecvSlot>,
    /// Slots with messages still arriving, oldest first.
    posted: VecDeque<usize>,
    next_seq: u64,
    /// Per socket: the message after the last one whose chunk header it delivered. A socket
    /// carries its chunks in stream order, so it will never carry one for an earlier message.
    passed: Vec<u64>,
    /// Sockets the peer closed cleanly (bit `s`): socket `s` carries nothing for message
    /// `passed[s]` or any later one.
    closed: u16,
}

impl RecvSide {
    /// Socket `s` was closed before it carried its chunk of message `seq`.
    fn closed_before(&self, s: usize, seq: u64) -> bool {
        self.closed & (1 << s) != 0 && self.passed[s] <= seq
    }

    /// A closed socket that still owes a chunk of a posted message, and that message: the
    /// receive can never complete. An unknown message owes at least its chunk 0, on socket
    /// `seq mod n`; a known one owes a chunk on each of the sockets its size spreads it over.
    fn owed_by_closed(&self, n: usize) -> Option<(usize, u64)> {
        if self.closed == 0 {
            return None;
        }
        for &slot in &self.posted {
            let r = &self.slots[slot];
            for (i, m) in r.msgs[..r.n].iter().enumerate() {
                let seq = r.first_seq + i as u64;
                let chunks = match (m.known, m.chunks_left) {
                    (false, _) => 1,
                    (true, 0) => 0,
                    (true, _) => chunk_count(m.size, n),
                };
                if let Some(s) = chunk_sockets(seq, chunks, n).find(|&s| self.closed_before(s, seq))
                {
                    return Some((s, seq));
                }
            }
        }
        None
    }

    fn find(&self, seq: u64) -> Option<(usize, usize)> {
        self.posted.iter().find_map(|&slot| {
            let r = &self.slots[slot];
            (r.first_seq <= seq && seq < r.first_seq + r.n as u64)
                .then(|| (slot, (seq - r.first_seq) as usize))
        })
    }
}

/// One socket's share of one message.
struct RecvJob {
    slot: usize,
    msg: usize,
    seq: u64,
    buf: HostBuf,
    size: usize,
    effect: Effect,
    mtu: u32,
    flip_seed: u64,
    span: Range<usize>,
    runs: u32,
}

/// The receiving half of a socket connection.
pub struct SocketRecvConn {
    running: Running<RecvSide>,
}

impl SocketRecvConn {
    /// Starts the I/O threads over accepted `sockets` (index order = socket order); with
    /// `timeout`, requests fail when no byte moves for that long.
    pub(crate) fn start(
        sockets: Vec<Socket>,
        peer: String,
        timeout: Option<Duration>,
    ) -> Result<Self> {
        let side = RecvSide {
            passed: vec![0; sockets.len()],
            closed: 0,
            slots: (0..MAX_REQUESTS)
                .map(|_| RecvSlot {
                    n: 0,
                    first_seq: 0,
                    bufs: [HostBuf::from_slice(&mut []); MAX_RECVS],
                    tags: [0; MAX_RECVS],
                    taken: [false; MAX_RECVS],
                    sizes: [0; MAX_RECVS],
                    msgs: [UNKNOWN_MSG; MAX_RECVS],
                    msgs_left: 0,
                })
                .collect(),
            posted: VecDeque::with_capacity(MAX_REQUESTS),
            next_seq: 0,
        };
        let core = Core::new(sockets, peer, side, timeout);
        Ok(SocketRecvConn {
            running: Running::start(core, "lossy-rx", recv_loop)?,
        })
    }
}

impl RecvConn for SocketRecvConn {
    fn irecv(&self, bufs: &[HostBuf], tags: &[i32]) -> Result<Option<RequestId>> {
        let n = bufs.len();
        if n == 0 || n > MAX_RECVS || tags.len() != n {
            return Err(Error::invalid_argument(format!(
                "grouped receive of {n} buffers and {} tags (at most {MAX_RECVS})",
                tags.len()
            )));
        }
        let core = &self.running.core;
        let mut g = core.lock();
        core.usable(&g)?;
        let Some(slot) = core.free_slot() else {
            return Ok(None);
        };
        let nsocks = core.sockets.len();
        let side = &mut g.side;
        if side.posted.is_empty() {
            // The connection was idle: the no-progress clock starts now.
            core.progress.touch();
        }
        let r = &mut side.slots[slot];
        r.n = n;
        r.first_seq = side.next_seq;
        r.bufs[..n].copy_from_slice(bufs);
        r.tags[..n].copy_from_slice(tags);
        r.taken = [false; MAX_RECVS];
        r.sizes = [0; MAX_RECVS];
        r.msgs = [UNKNOWN_MSG; MAX_RECVS];
        r.msgs_left = n;
        side.posted.push_back(slot);
        side.next_seq += n as u64;
        core.slot_state[slot].store(PENDING, Ordering::Release);
        if let Some((s, seq)) = side.owed_by_closed(nsocks) {
            // The peer already closed a socket this receive needs: it can never complete.
            let err = owed_error(core, s, seq);
            core.fail_locked(g, err.clone(), true);
            return Err(err);
        }
        core.wake.notify_all();
        Ok(Some(slot as RequestId))
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.running.core.test_with(id, |side, slot| {
            let r = &side.slots[slot];
            Completion {
                count: r.n,
                sizes: r.sizes,
            }
        })
    }
}

/// Reads a chunk header; `Ok(false)` when the peer closed the connection between messages.
fn recv_header(
    sock: &Socket,
    raw: &mut [u8; HEADER_SIZE],
    progress: &Progress,
) -> io::Result<bool> {
    match recv_until_eof(sock, raw, progress)? {
        0 => Ok(false),
        HEADER_SIZE => Ok(true),
        got => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("peer closed the connection after {got} bytes of a chunk header"),
        )),
    }
}

fn recv_loop(core: &Core<RecvSide>, s: usize) -> Exit {
    let sock = &core.sockets[s];
    let mut runs: Vec<PacketRun> = Vec::new();
    let mut run_bytes = vec![0u8; RUN_BATCH * RUN_SIZE];
    // Chunks on one socket come in stream order: the next one is for this message or later.
    let mut min_seq = 0u64;
    loop {
        let mut raw = [0u8; HEADER_SIZE];
        match recv_header(sock, &mut raw, &core.progress) {
            Ok(true) => {}
            Ok(false) => return peer_closed(core, s),
            Err(e) => return core.io_exit(e, format_args!("receiving a header on socket {s}")),
        }
        let job = match accept_header(core, s, &raw, min_seq) {
            Ok(job) => job,
            Err(exit) => return exit,
        };
        min_seq = job.seq + 1;
        if let Err(exit) = read_runs(core, s, &job, &mut runs, &mut run_bytes) {
            return exit;
        }
        if let Err(exit) = recv_chunk(core, s, &job, &runs) {
            return exit;
        }
        let mut g = core.lock();
        let side = &mut g.side;
        let r = &mut side.slots[job.slot];
        let m = &mut r.msgs[job.msg];
        m.chunks_left -= 1;
        if m.chunks_left == 0 {
            if let Some(b) = m.buf_index {
                r.sizes[b] = m.size;
            }
            r.msgs_left -= 1;
            if r.msgs_left == 0 {
                side.posted.retain(|&p| p != job.slot);
                core.slot_state[job.slot].store(DONE, Ordering::Release);
            }
        }
    }
}

/// The peer closed socket `s` cleanly after the chunks of the messages it went past. That
/// is how every connection ends, and it fails nothing by itself: only a posted receive that
/// needs a chunk this socket will now never carry fails (now, or when the receive is posted
/// or its message's size becomes known). The other sockets go on delivering their chunks.
fn peer_closed(core: &Core<RecvSide>, s: usize) -> Exit {
    let mut g = core.lock();
    if g.stopping || g.failed.is_some() {
        return Exit::Stopped;
    }
    g.side.closed |= 1 << s;
    match g.side.owed_by_closed(core.sockets.len()) {
        Some((owing, seq)) => Exit::Failed(owed_error(core, owing, seq)),
        None => Exit::Stopped,
    }
}

fn owed_error<S>(core: &Core<S>, s: usize, seq: u64) -> Error {
    Error::remote(format!(
        "{} closed socket {s} of the connection before sending its part of message {seq}",
        core.peer
    ))
}

/// A message before `seq` (and from `from` on) that socket `s` should have carried a chunk of,
/// but went past: known, incomplete, with a chunk on `s` that never arrived.
fn skipped_chunk(side: &RecvSide, s: usize, n: usize, from: u64, seq: u64) -> Option<u64> {
    (from..seq).find(|&q| {
        side.find(q).is_some_and(|(slot, i)| {
            let m = &side.slots[slot].msgs[i];
            m.known
                && m.chunks_left > 0
                && m.got & (1 << s) == 0
                && roles(q, s, n).1 < chunk_count(m.size, n)
        })
    })
}

/// Checks a chunk header against the connection's state, records what it says about its
/// message, and matches the message to a posted buffer; returns this socket's job.
fn accept_header(
    core: &Core<RecvSide>,
    s: usize,
    raw: &[u8; HEADER_SIZE],
    min_seq: u64,
) -> std::result::Result<RecvJob, Exit> {
    let n = core.sockets.len();
    let h = Header::decode(raw).map_err(Exit::Failed)?;
    let seq = h.seq;
    let bad = |why: String| {
        Exit::Failed(Error::remote(format!(
            "bad chunk header for message {seq} on socket {s}: {why}"
        )))
    };
    // Every message has a chunk 0, on socket `seq mod n`: this socket's next chunk belongs
    // to the next message whose chunk 0 is ours, or to one before it.
    let latest = min_seq + ((s as u64 + n as u64 - min_seq % n as u64) % n as u64);
    if seq < min_seq || seq > latest {
        return Err(bad(format!(
            "out of order (expected message {min_seq} to {latest})"
        )));
    }
    let size = h.size as usize; // at most 1 TiB (checked by `decode`)
    let chunks = chunk_count(size, n);
    let j = usize::from(h.chunk);
    if j >= chunks || roles(seq, s, n).1 != j {
        return Err(bad(format!(
            "chunk {j} of {chunks} does not travel on this socket"
        )));
    }
    let span = chunk_span(size, chunks, j);
    let mtu = h.mtu as usize;
    let touched = if span.is_empty() {
        0
    } else {
        (span.end - 1) / mtu - span.start / mtu + 1
    };
    if h.runs as usize > touched {
        return Err(bad(format!("{} lost runs for {touched} packets", h.runs)));
    }
    let mut g = core.wait_until(core.lock(), |side| side.next_seq > seq)?;
    let Some((slot, i)) = g.side.find(seq) else {
        return Err(bad("its message is already complete".into()));
    };
    // This socket went past the messages before `seq`: any of them that is known and
    // needs a chunk from it that never came can no longer complete (a peer that skips a
    // chunk would otherwise leave the receive pending forever).
    if let Some(q) = skipped_chunk(&g.side, s, n, min_seq, seq) {
        return Err(Exit::Failed(Error::remote(format!(
            "{} skipped the chunk of message {q} that socket {s} carries",
            core.peer
        ))));
    }
    g.side.passed[s] = seq + 1;
    let m = &mut g.side.slots[slot].msgs[i];
    let says = (size, h.tag, h.effect, h.mtu, h.flip_seed);
    if m.known {
        if (m.size, m.tag, m.effect, m.mtu, m.flip_seed) != says {
            return Err(bad("it disagrees with another chunk of the message".into()));
        }
        m.got |= 1 << s;
    } else {
        *m = RecvMsg {
            known: true,
            buf_index: None,
            size,
            tag: h.tag,
            effect: h.effect,
            mtu: h.mtu,
            flip_seed: h.flip_seed,
            chunks_left: chunks,
            got: 1 << s,
        };
        // Sockets waiting for this message's tag to match their own message can go on.
        core.wake.notify_all();
        // Now that its size is known: a socket that already went past it, or that the peer
        // closed before it, owes a chunk (every other message was checked before).
        if let Some(o) = chunk_sockets(seq, chunks, n)
            .find(|&o| o != s && (g.side.passed[o] > seq || g.side.closed_before(o, seq)))
        {
            return Err(Exit::Failed(if g.side.passed[o] > seq {
                Error::remote(format!(
                    "{} skipped the chunk of message {seq} that socket {o} carries",
                    core.peer
                ))
            } else {
                owed_error(core, o, seq)
            }));
        }
    }
    let b = loop {
        match g.side.slots[slot].match_buffer(i) {
            Err(e) => return Err(Exit::Failed(e.context(format_args!("message {seq}")))),
            Ok(Some(b)) => break b,
            // Our chunk is not in, so the message, and its slot, stay ours while we wait.
            Ok(None) => g = core.wait_once(g)?,
        }
    };
    let buf = g.side.slots[slot].bufs[b];
    if size > buf.len() {
        return Err(Exit::Failed(Error::invalid_usage(format!(
            "message {seq} of {size} bytes is larger than the posted receive of {} bytes",
            buf.len()
        ))));
    }
    Ok(RecvJob {
        slot,
        msg: i,
        seq,
        buf,
        size,
        effect: h.effect,
        mtu: h.mtu,
        flip_seed: h.flip_seed,
        span,
        runs: h.runs,
    })
}

/// Reads the job's lost-packet runs in bounded pieces, checking them as they come. Their
/// number was bounded by the packets of the chunk, which the posted buffer bounds.
fn read_runs(
    core: &Core<RecvSide>,
    s: usize,
    job: &RecvJob,
    runs: &mut Vec<PacketRun>,
    run_bytes: &mut [u8],
) -> std::result::Result<(), Exit> {
    let seq = job.seq;
    let packets = effect::packet_count(job.size, job.mtu);
    runs.clear();
    let mut left = job.runs as usize;
    let mut end = 0;
    while left > 0 {
        let take = left.min(RUN_BATCH);
        let bytes = &mut run_bytes[..take * RUN_SIZE];
        recv_all(&core.sockets[s], bytes, &core.progress)
            .map_err(|e| core.io_exit(e, format_args!("receiving message {seq} on socket {s}")))?;
        let before = runs.len();
        wire::decode_runs(bytes, runs);
        end = effect::check_runs(&runs[before..], packets, end).map_err(|e| {
            Exit::Failed(Error::remote(format!(
                "bad chunk header for message {seq}: {e}"
            )))
        })?;
        left -= take;
    }
    Ok(())
}

fn recv_chunk(
    core: &Core<RecvSide>,
    s: usize,
    job: &RecvJob,
    runs: &[PacketRun],
) -> std::result::Result<(), Exit> {
    let sock = &core.sockets[s];
    let seq = job.seq;
    let io = |e| core.io_exit(e, format_args!("receiving message {seq} on socket {s}"));
    let (size, mtu, span) = (job.size, job.mtu, job.span.clone());
    // This socket alone writes `span` of the buffer (chunks are disjoint).
    let whole = || job.buf.slice_mut(span.start, span.end);
    // Receives the bytes of `r`, a range of the message.
    let recv = |r: Range<usize>| {
        recv_all(sock, job.buf.slice_mut(r.start, r.end), &core.progress).map_err(io)
    };
    match job.effect {
        Effect::Zero | Effect::Stale => {
            for r in effect::kept_ranges(runs, mtu, size, span.clone()) {
                recv(r)?;
            }
            if job.effect == Effect::Zero {
                effect::zero_lost(whole(), span.start, runs, mtu, size);
            }
        }
        Effect::Retransmit => {
            recv_all(sock, whole(), &core.progress).map_err(io)?;
            // The lost packets come again after the sender's timeout: same bytes, same place.
            for r in effect::lost_ranges(runs, mtu, size, span) {
                recv(r)?;
            }
        }
        Effect::Bitflip => {
            recv_all(sock, whole(), &core.progress).map_err(io)?;
            effect::flip_lost(whole(), span.start, runs, mtu, size, job.flip_seed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_message_contiguously() {
        assert_eq!(chunk_count(0, 4), 1);
        assert_eq!(chunk_count(MIN_CHUNK - 1, 4), 1);
        assert_eq!(chunk_count(2 * MIN_CHUNK + 5, 4), 2);
        assert_eq!(chunk_count(1 << 30, 4), 4);
        assert_eq!(chunk_count(1 << 30, 1), 1);
        for (size, k) in [(0, 1), (7, 1), (1 << 20, 3), ((1 << 20) + 3, 4)] {
            let mut next = 0;
            for j in 0..k {
                let r = chunk_span(size, k, j);
                assert_eq!(r.start, next);
                assert!(r.len() + 1 >= size / k);
                next = r.end;
            }
            assert_eq!(next, size);
        }
    }

    #[test]
    fn roles_rotate_the_header_socket() {
        assert_eq!(roles(0, 0, 4), (0, 0));
        assert_eq!(roles(5, 1, 4), (1, 0));
        assert_eq!(roles(5, 0, 4), (1, 3));
        assert_eq!(roles(7, 2, 1), (0, 0));
    }
}
