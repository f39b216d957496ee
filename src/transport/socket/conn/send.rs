//! The sending half of a socket connection: request slots of posted messages, and the I/O
//! state machines that send each socket's chunk of every message.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::Socket;

use super::pool::{Pool, WANT_WRITE};
use super::shared::{
    coarse_ns, peek_arrived, remove_first, send_gathered, Guard, Shared, Side, DONE, IO_PIECE,
    PENDING,
};
use super::{chunk_count, chunk_span, roles};
use crate::loss::effect::{self, MIN_MTU};
use crate::loss::plan::{Effect, LossPlan, PacketRun};
use crate::transport::socket::wire::{self, Header, MAX_MESSAGE_BYTES, MAX_RETRANSMIT_TIMEOUT};
use crate::transport::{Completion, HostBuf, RequestId, SendConn, MAX_REQUESTS};
use crate::{Error, Result};

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
    if plan.lost.is_empty() {
        return Ok(());
    }
    effect::check_runs(&plan.lost, effect::packet_count(size, plan.mtu), 0)
        .map(|_| ())
        .map_err(|e| bad(e.to_string()))
}

struct SendSlot {
    buf: HostBuf,
    tag: i32,
    effect: Effect,
    mtu: u32,
    retransmit: Duration,
    flip_seed: u64,
    runs: Vec<PacketRun>,
    chunks_left: usize,
    /// Posted on an idle connection after a pause: each socket looks for the receiver's
    /// goodbye before it sends its part (see [`receiver_left_on`]).
    after_pause: bool,
}

impl SendSlot {
    /// The header of chunk `j` of this message (message `seq`), with `runs` lost runs after it.
    fn header(&self, seq: u64, j: usize, runs: usize) -> Header {
        Header {
            seq,
            chunk: j as u8,
            size: self.buf.len() as u64,
            tag: self.tag,
            effect: self.effect,
            mtu: self.mtu,
            runs: runs as u32,
            retransmit_ns: self.retransmit.as_nanos() as u64,
            flip_seed: self.flip_seed,
        }
    }
}

/// A socket sent its chunk of the message in `slot`: the last chunk completes it.
fn chunk_sent(shared: &Shared<SendSide>, side: &mut SendSide, slot: usize) {
    side.slots[slot].chunks_left -= 1;
    if side.slots[slot].chunks_left == 0 {
        remove_first(&mut side.posted, |p| p.1 == slot);
        shared.slot_state[slot].store(DONE, Ordering::Release);
    }
}

struct SendSide {
    slots: Vec<SendSlot>,
    /// (message seq, slot) of every message whose chunks are not all sent, oldest first.
    posted: VecDeque<(u64, usize)>,
    next_seq: u64,
    /// The coarse clock's reading at the last `isend` on an idle connection (see
    /// [`coarse_ns`]).
    last_post: u64,
}

/// One socket's share of one message, and how far it got.
struct TxJob {
    slot: usize,
    seq: u64,
    buf: HostBuf,
    /// Header bytes (and lost runs) already sent from the socket's `wire` buffer.
    head: usize,
    /// Ranges of the message to send, in order, and the cursor in them.
    segs: Vec<Range<usize>>,
    seg: usize,
    off: usize,
    /// Retransmit: the ranges from `resend_from` on go only after `delay` (`deadline` once
    /// the first part is sent).
    resend_from: usize,
    delay: Duration,
    deadline: Option<Instant>,
    /// Look for the receiver's goodbye before sending this part.
    after_pause: bool,
}

/// The state machine of one sending socket.
pub(super) struct TxSock {
    /// The next message this socket looks at.
    next: u64,
    job: Option<TxJob>,
    wire: Vec<u8>,
    runs: Vec<PacketRun>,
    /// The ranges vector of the last finished job, reused so steady state allocates nothing.
    spare: Vec<Range<usize>>,
}

/// The sending half of a socket connection.
pub struct SocketSendConn {
    shared: Arc<Shared<SendSide>>,
    _pool: Option<Arc<Pool>>,
}

impl SocketSendConn {
    /// Takes over connected `sockets` (index order = socket order), served by `pool` (the
    /// process's I/O pool, taken before the sockets were opened: see `SocketConnector`); with
    /// `timeout`, requests fail when no byte moves for that long.
    pub(crate) fn start(
        sockets: Vec<Socket>,
        peer: String,
        timeout: Option<Duration>,
        pool: Option<Arc<Pool>>,
    ) -> Result<Self> {
        let side = SendSide {
            slots: (0..MAX_REQUESTS)
                .map(|_| SendSlot {
                    buf: HostBuf::EMPTY,
                    tag: 0,
                    effect: Effect::Zero,
                    mtu: 0,
                    retransmit: Duration::ZERO,
                    flip_seed: 0,
                    runs: Vec::new(),
                    chunks_left: 0,
                    after_pause: false,
                })
                .collect(),
            posted: VecDeque::with_capacity(MAX_REQUESTS),
            next_seq: 0,
            last_post: 0,
        };
        let states = (0..sockets.len())
            .map(|_| TxSock {
                next: 0,
                job: None,
                wire: Vec::new(),
                runs: Vec::new(),
                spare: Vec::new(),
            })
            .collect();
        let shared = Shared::start(sockets, states, peer, side, timeout, pool.as_deref())?;
        Ok(SocketSendConn {
            shared,
            _pool: pool,
        })
    }
}

impl Drop for SocketSendConn {
    fn drop(&mut self) {
        self.shared.stop();
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
        let shared = &self.shared;
        let mut g = shared.lock();
        shared.usable(&g)?;
        let Some(slot) = shared.free_slot() else {
            return Ok(None);
        };
        if g.failed.is_some() {
            // Nothing will be sent: the request fails at `test` (as with NCCL's own plugins,
            // a post never reports the peer's failure).
            g.side.slots[slot].buf = buf;
            g.side.slots[slot].chunks_left = 0;
            shared.slot_state[slot].store(PENDING, Ordering::Release);
            return Ok(Some(slot as RequestId));
        }
        let n = shared.sockets.len();
        let side = &mut g.side;
        let seq = side.next_seq;
        // No earlier message still waits for room in the sockets.
        let idle = side.posted.is_empty();
        if idle {
            // The connection was idle: the no-progress clock starts now.
            shared.progress.touch();
        }
        // A message posted behind others is no pause; the clock is read only on an idle post.
        let after_pause = idle && {
            let tick = coarse_ns();
            std::mem::replace(&mut side.last_post, tick) != tick
        };
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
        s.after_pause = after_pause;
        side.posted.push_back((seq, slot));
        side.next_seq += 1;
        shared.slot_state[slot].store(PENDING, Ordering::Release);
        drop(g);
        // When the bytes go out (docs/transport.md, "When a send starts"): a message posted
        // behind others still under way joins them now, keeping the sockets' buffers full; one
        // on an idle connection leaves at the `test` NCCL's proxy calls right after `isend`,
        // as NCCL's Socket transport sends only from `test` (measured: docs/calibration.md).
        // A pool thread serves connections nobody tests: it is told of the message, and sends
        // it unless the owner is polling (then the owner's `test` does).
        if idle {
            shared.offer(WANT_WRITE);
        } else {
            shared.owner_active();
            shared.progress_all();
        }
        Ok(Some(slot as RequestId))
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.shared.test_with(id, |side, slot| {
            Completion::single(side.slots[slot].buf.len())
        })
    }
}

impl Side for SendSide {
    type Sock = TxSock;

    /// A message part under way waits for room in the socket, unless its retransmit deadline
    /// is still ahead (a timer wakes it then); with nothing under way, only `isend` brings work.
    fn waits_on(st: &TxSock) -> u32 {
        match &st.job {
            Some(job) if job.deadline.map_or(true, |d| Instant::now() >= d) => WANT_WRITE,
            _ => 0,
        }
    }

    fn advance(shared: &Shared<SendSide>, s: usize, st: &mut TxSock) {
        if shared.sockets.len() == 1 {
            while st.job.is_none() {
                match send_small(shared, s, st) {
                    Small::Sent => {}
                    Small::Stopped => return,
                    Small::Other => break,
                }
            }
        }
        if st.job.is_none() && !next_job(shared, s, st, &shared.lock()) {
            return;
        }
        loop {
            let Some(job) = st.job.as_mut() else {
                return;
            };
            if std::mem::take(&mut job.after_pause) && receiver_left_on(shared, s) {
                st.job = None;
                return;
            }
            match drive(shared, s, job, &st.wire) {
                Ok(false) => return,
                Ok(true) => {
                    let slot = job.slot;
                    st.spare = std::mem::take(&mut job.segs);
                    st.job = None;
                    st.next += 1;
                    let mut g = shared.lock();
                    if g.over() {
                        // Failed or closing: the queued messages' requests answer that.
                        return;
                    }
                    chunk_sent(shared, &mut g.side, slot);
                    // The next job, under the same lock.
                    if !next_job(shared, s, st, &g) {
                        return;
                    }
                }
                Err(e) => {
                    let seq = job.seq;
                    st.job = None;
                    if said_goodbye(&shared.sockets[s]) {
                        receiver_left(shared);
                    } else {
                        let what = format_args!("sending message {seq} on socket {s}");
                        let err = super::shared::peer_io_error(&e)
                            .context(format_args!("{what} with {}", shared.peer));
                        shared.fail(err, true);
                    }
                    return;
                }
            }
        }
    }
}

/// What [`send_small`] did.
enum Small {
    /// Sent the next message whole, and completed it.
    Sent,
    /// Nothing more moves now: nothing queued, the socket full (the rest is the job's), or the
    /// connection over.
    Stopped,
    /// The next message is not a small one sent whole: [`next_job`] takes it.
    Other,
}

/// The usual small message on a one-socket connection, sent and completed without a job: no
/// lost runs, at most [`INLINE_BYTES`] of payload, not the first after a pause (which looks
/// for the receiver's goodbye first). The same bytes as [`next_job`] and [`drive`] send
/// (header and payload in one plain `send`) and the same completion, with fewer steps; what
/// the socket does not take at once is left as the socket's job, which [`drive`] finishes.
fn send_small(shared: &Shared<SendSide>, s: usize, st: &mut TxSock) -> Small {
    let g = shared.lock();
    if g.over() || g.side.next_seq <= st.next {
        return Small::Stopped;
    }
    let seq = st.next;
    let Some(&(front, slot)) = g.side.posted.front() else {
        return Small::Stopped;
    };
    let m = &g.side.slots[slot];
    let size = m.buf.len();
    if front != seq || !m.runs.is_empty() || size > INLINE_BYTES || m.after_pause {
        return Small::Other;
    }
    let header = m.header(seq, 0, 0);
    let buf = m.buf;
    drop(g);
    st.wire.clear();
    st.wire.extend_from_slice(&header.encode());
    // SAFETY: NCCL lent the buffer until the send completes, which is only after these bytes
    // are sent, and does not write it meanwhile; the view lives only for this copy.
    st.wire.extend_from_slice(unsafe { buf.slice(0, size) });
    // The socket full, or failed: the job's [`drive`] goes on from here (and reports a
    // failure as it does for every message).
    let (sent, failed) = match send_gathered(&shared.sockets[s], &[IoSlice::new(&st.wire)], false) {
        Ok(Some(n)) => (n, false),
        Ok(None) => (0, false),
        Err(_) => (0, true),
    };
    if sent > 0 {
        shared.progress.touch();
    }
    if sent < st.wire.len() {
        let mut segs = std::mem::take(&mut st.spare);
        segs.clear();
        st.job = Some(TxJob {
            slot,
            seq,
            buf,
            head: sent,
            segs,
            seg: 0,
            off: 0,
            resend_from: 0,
            delay: Duration::ZERO,
            deadline: None,
            after_pause: false,
        });
        return if failed { Small::Other } else { Small::Stopped };
    }
    st.next += 1;
    let mut g = shared.lock();
    if g.over() {
        return Small::Stopped;
    }
    chunk_sent(shared, &mut g.side, slot);
    Small::Sent
}

/// Picks up socket `s`'s share of the next message, skipping messages it carries no chunk
/// of; `false` when there is nothing (more) to send now.
fn next_job(shared: &Shared<SendSide>, s: usize, st: &mut TxSock, g: &Guard<'_, SendSide>) -> bool {
    let n = shared.sockets.len();
    loop {
        if g.over() || g.side.next_seq <= st.next {
            return false;
        }
        let seq = st.next;
        let (_, j) = roles(seq, s, n);
        // Not queued any more: its chunks are all sent, so none of them was ours.
        let found = g.side.posted.iter().find(|p| p.0 == seq).map(|p| p.1);
        let Some(slot) = found else {
            st.next += 1;
            continue;
        };
        let m = &g.side.slots[slot];
        let size = m.buf.len();
        let k = chunk_count(size, n);
        if j >= k {
            st.next += 1;
            continue;
        }
        let span = chunk_span(size, k, j);
        st.runs.clear();
        if !m.runs.is_empty() {
            st.runs
                .extend_from_slice(effect::runs_in_span(&m.runs, m.mtu, span.clone()));
        }
        let runs = &st.runs[..];
        let header = m.header(seq, j, runs.len());
        st.wire.clear();
        st.wire.extend_from_slice(&header.encode());
        wire::encode_runs(runs, &mut st.wire);
        let mut segs = std::mem::take(&mut st.spare);
        segs.clear();
        let mut resend_from = usize::MAX;
        let mut delay = Duration::ZERO;
        match m.effect {
            // Nothing lost (every message of a lossless run): the chunk as it is.
            _ if runs.is_empty() => segs.push(span),
            Effect::Zero | Effect::Stale => {
                segs.extend(effect::kept_ranges(runs, m.mtu, size, span));
            }
            Effect::Retransmit => {
                segs.push(span.clone());
                let lost: Vec<_> = effect::lost_ranges(runs, m.mtu, size, span).collect();
                if !lost.is_empty() {
                    // One timeout per loss event of the message, as if each were recovered
                    // by its own retransmission timer; only this socket's stream waits.
                    let events = u32::try_from(m.runs.len()).unwrap_or(u32::MAX);
                    delay = m.retransmit.saturating_mul(events);
                    resend_from = segs.len();
                    segs.extend(lost);
                }
            }
            Effect::Bitflip => segs.push(span),
        }
        segs.retain(|r| !r.is_empty());
        resend_from = resend_from.min(segs.len());
        // A few bytes to send now ride in the header's buffer: one plain `send`, which costs
        // the kernel less than a gathered one.
        let inline: usize = segs[..resend_from].iter().map(|r| r.len()).sum();
        if inline <= INLINE_BYTES {
            for r in segs.drain(..resend_from) {
                // SAFETY: NCCL lent the buffer until the send completes, which is only after
                // this chunk is reported sent, and does not write it meanwhile; the
                // transport only reads it, and the view lives only for this copy.
                st.wire
                    .extend_from_slice(unsafe { m.buf.slice(r.start, r.end) });
            }
            resend_from = 0;
        }
        st.job = Some(TxJob {
            slot,
            seq,
            buf: m.buf,
            head: 0,
            segs,
            seg: 0,
            off: 0,
            resend_from,
            delay,
            deadline: None,
            after_pause: m.after_pause,
        });
        return true;
    }
}

/// Most message bytes copied behind the header so the two go out in one plain `send`.
const INLINE_BYTES: usize = 1024;

/// Most pieces one gathered send hands the kernel: the header (with its runs) and the
/// message ranges after it, so a small message, or a lossy one cut into many kept ranges,
/// goes out in one system call.
const MAX_GATHER: usize = 16;

/// Sends what socket `s` takes of `job` now: `Ok(true)` once all of it is sent, `Ok(false)`
/// when the socket is full or the job waits for its retransmit deadline.
fn drive(
    shared: &Shared<SendSide>,
    s: usize,
    job: &mut TxJob,
    wire_bytes: &[u8],
) -> std::io::Result<bool> {
    let sock = &shared.sockets[s];
    loop {
        let head_left = wire_bytes.len() - job.head;
        if head_left == 0 && job.seg == job.resend_from {
            // A retransmission waits for its deadline; with no delay (every effect but a
            // retransmit with losses) it goes on without reading the clock.
            if !job.delay.is_zero() {
                let now = Instant::now();
                match job.deadline {
                    None => {
                        let d = now + job.delay;
                        job.deadline = Some(d);
                        shared.wake_at(s, d);
                        return Ok(false);
                    }
                    Some(d) if now < d => return Ok(false),
                    Some(_) => {}
                }
            }
            job.resend_from = usize::MAX;
            shared.progress.touch();
        }
        if head_left == 0 && job.seg == job.segs.len() {
            return Ok(true);
        }
        // Gather what may go now: the rest of the header, then ranges up to a delayed
        // retransmission, within one system call's share.
        let mut parts = [IoSlice::new(&[]); MAX_GATHER];
        let mut n = 0;
        let mut total = 0;
        if head_left > 0 {
            parts[0] = IoSlice::new(&wire_bytes[job.head..]);
            n = 1;
            total = head_left;
        }
        let stop = job.resend_from.min(job.segs.len());
        let (mut seg, mut off) = (job.seg, job.off);
        while seg < stop && n < MAX_GATHER && total < IO_PIECE {
            let r = &job.segs[seg];
            let end = r.end.min(r.start + off + (IO_PIECE - total));
            // SAFETY: NCCL lent the buffer until the send completes, which is only after this
            // chunk is reported sent, and does not write it meanwhile; the transport only
            // reads it, and the view lives only for this call.
            let bytes = unsafe { job.buf.slice(r.start + off, end) };
            parts[n] = IoSlice::new(bytes);
            n += 1;
            total += bytes.len();
            if end == r.end {
                seg += 1;
                off = 0;
            } else {
                off = end - r.start;
            }
        }
        // More of this job follows at once when the gather stopped short of the stop point.
        let more = seg < stop;
        let Some(mut sent) = send_gathered(sock, &parts[..n], more)? else {
            return Ok(false);
        };
        shared.progress.touch();
        let from_head = sent.min(head_left);
        job.head += from_head;
        sent -= from_head;
        while sent > 0 {
            let r = &job.segs[job.seg];
            let left = r.end - r.start - job.off;
            if sent >= left {
                sent -= left;
                job.seg += 1;
                job.off = 0;
            } else {
                job.off += sent;
                sent = 0;
            }
        }
    }
}

/// Whether the receiver wrote [`wire::GOODBYE`] on `sock` before closing it.
fn said_goodbye(sock: &Socket) -> bool {
    let mut b = [0u8; 1];
    matches!(peek_arrived(sock, &mut b), Ok(1)) && b[0] == wire::GOODBYE
}

/// Before sending a message posted on an idle connection after a pause: whether the receiver
/// left meanwhile, which fails the connection (true) so the message fails at `test` instead
/// of completing with its bytes lost. An idle sender reads nothing, so a receiver's goodbye
/// or end of stream waits unseen on its socket, and on loopback a message of up to a few
/// segments is taken whole before the peer's reset comes back. Looked for before the send,
/// never after: a receiver that takes the message and then closes is an orderly close of
/// both sides. One `MSG_PEEK` per pause: a stream of messages (each posted within the clock
/// tick of the one before) pays nothing, and a message posted within the tick of the close
/// may still complete; the next one fails, as with NCCL's Socket transport for messages
/// within its inline size (docs/hardening.md, "Errors surface at `test`").
fn receiver_left_on(shared: &Shared<SendSide>, s: usize) -> bool {
    let mut b = [0u8; 1];
    match peek_arrived(&shared.sockets[s], &mut b) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ) =>
        {
            false
        }
        Ok(1) if b[0] == wire::GOODBYE => {
            receiver_left(shared);
            true
        }
        Ok(0) => {
            let err = Error::remote(format!(
                "{} closed the connection without an orderly close (socket {s})",
                shared.peer
            ));
            shared.fail(err, true);
            true
        }
        // Any other byte: the peer is alive and talking, which a receiving end of ours never
        // does. Saying it closed would send the reader looking for a crash that did not happen.
        Ok(_) => {
            let err = Error::remote(format!(
                "{} sent byte {:#04x} on socket {s}, which a receiving end of this plugin never \
                 sends: the peer is not this plugin's socket transport (a stale handle whose \
                 port another program now uses?) or speaks another protocol version",
                shared.peer, b[0]
            ));
            shared.fail(err, true);
            true
        }
        Err(e) => {
            let err = Error::remote(format!(
                "{} closed the connection without an orderly close (socket {s}): {e}",
                shared.peer
            ));
            shared.fail(err, true);
            true
        }
    }
}

/// The receiver closed its comm (an orderly close: it said goodbye) while this side still
/// had bytes to send: as with NCCL's Socket transport, whose send then meets a closed
/// connection ("Connection closed by remote peer", `socketProgress` in src/misc/socket.cc),
/// every message not yet sent, and every later one, fails at `test` with a remote error.
/// Closing both ends after the last message completed never gets here: an idle sender
/// sends nothing.
fn receiver_left(shared: &Shared<SendSide>) {
    let queued = shared.lock().side.posted.len();
    shared.fail(
        Error::remote(format!(
            "{} closed its receiving end (an orderly close) with {queued} message(s) still \
             to send: the connection is closed",
            shared.peer
        )),
        true,
    );
}
