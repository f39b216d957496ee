//! The receiving half of a socket connection: grouped receives matched to messages by tag,
//! and the state machines that receive each socket's chunk and apply the loss plan to it.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use socket2::Socket;

use super::grouped::{RecvMsg, RecvSlot, UNKNOWN_MSG};
use super::pool::{Pool, WANT_READ};
use super::shared::{remove_first, Shared, Side, DONE, PENDING};
use super::stage::{Read, Stage};
use super::{chunk_count, chunk_sockets, chunk_span, roles};
use crate::loss::effect;
use crate::loss::plan::{Effect, PacketRun};
use crate::transport::socket::wire::{self, Header, GOODBYE, HEADER_SIZE, RUN_SIZE};
use crate::transport::{Completion, HostBuf, RecvConn, RequestId, MAX_RECVS, MAX_REQUESTS};
use crate::{Error, Result};

/// Runs read from the wire per `recv`, so a long list costs a bounded buffer.
const RUN_BATCH: usize = 4096;

pub(super) struct RecvSide {
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
    /// Sockets holding a whole header whose message has no matched buffer yet (bit `s`):
    /// only a new receive moves them on, so `irecv` progresses these and no others.
    parked: u16,
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

/// One socket's share of one message, and how far it got.
struct RxJob {
    slot: usize,
    msg: usize,
    seq: u64,
    buf: HostBuf,
    size: usize,
    effect: Effect,
    mtu: u32,
    flip_seed: u64,
    span: Range<usize>,
    /// Lost runs still to read, and the bytes of the current batch of them already read.
    runs_left: usize,
    batch_got: usize,
    /// The end of the last run checked (runs come in order).
    run_end: u64,
    /// Ranges of the message to receive, in order (set once the runs are in), and the cursor.
    segs: Vec<Range<usize>>,
    planned: bool,
    seg: usize,
    off: usize,
}

/// The state machine of one receiving socket.
pub(super) struct RxSock {
    /// Chunks on one socket come in stream order: the next one is for this message or later.
    min_seq: u64,
    hdr: [u8; HEADER_SIZE],
    hdr_got: usize,
    /// A whole, checked header whose message is not posted or matched yet.
    head: Option<Header>,
    job: Option<RxJob>,
    /// The peer closed this socket cleanly: nothing more to read.
    closed: bool,
    runs: Vec<PacketRun>,
    run_bytes: Vec<u8>,
    /// The ranges vector of the last finished job, reused so steady state allocates nothing.
    spare: Vec<Range<usize>>,
    stage: Stage,
}

/// The receiving half of a socket connection.
pub struct SocketRecvConn {
    pub(super) shared: Arc<Shared<RecvSide>>,
    _pool: Option<Arc<Pool>>,
}

impl SocketRecvConn {
    /// Takes over accepted `sockets` (index order = socket order); with `timeout`, requests
    /// fail when no byte moves for that long.
    pub(crate) fn start(
        sockets: Vec<Socket>,
        peer: String,
        timeout: Option<Duration>,
        delayed_acks: bool,
    ) -> Result<Self> {
        let side = RecvSide {
            passed: vec![0; sockets.len()],
            closed: 0,
            // Nothing is read before a receive is posted: the first `irecv` moves every
            // socket (and so arms it with its pool thread, which then keeps it moving even
            // if nobody tests that receive).
            parked: u16::MAX >> (16 - sockets.len().clamp(1, 16)),
            slots: (0..MAX_REQUESTS)
                .map(|_| RecvSlot {
                    n: 0,
                    first_seq: 0,
                    bufs: [HostBuf::EMPTY; MAX_RECVS],
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
        let states = (0..sockets.len())
            .map(|_| RxSock {
                min_seq: 0,
                hdr: [0; HEADER_SIZE],
                hdr_got: 0,
                head: None,
                job: None,
                closed: false,
                runs: Vec::new(),
                run_bytes: vec![0; RUN_BATCH * RUN_SIZE],
                spare: Vec::new(),
                stage: Stage::new(delayed_acks),
            })
            .collect();
        let pool = Pool::shared()?;
        let shared = Shared::start(sockets, states, peer, side, timeout, pool.as_deref())?;
        Ok(SocketRecvConn {
            shared,
            _pool: pool,
        })
    }

    /// Sockets whose clean close by the peer has been read (bit `s`: socket `s`).
    #[cfg(test)]
    pub(crate) fn closed_by_peer(&self) -> u16 {
        self.shared.progress_all();
        self.shared.lock().side.closed
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
        let shared = &self.shared;
        let mut g = shared.lock();
        shared.usable(&g)?;
        let Some(slot) = shared.free_slot() else {
            return Ok(None);
        };
        let nsocks = shared.sockets.len();
        let side = &mut g.side;
        if side.posted.is_empty() {
            // The connection was idle: the no-progress clock starts now.
            shared.progress.touch();
        }
        let r = &mut side.slots[slot];
        r.n = n;
        r.first_seq = side.next_seq;
        r.bufs[..n].copy_from_slice(bufs);
        r.tags[..n].copy_from_slice(tags);
        r.taken = [false; MAX_RECVS];
        r.sizes = [0; MAX_RECVS];
        // Only the messages of this receive's buffers are read (`..n`): all eight would be
        // some 450 bytes written per message.
        for m in &mut r.msgs[..n] {
            *m = UNKNOWN_MSG;
        }
        r.msgs_left = n;
        side.posted.push_back(slot);
        side.next_seq += n as u64;
        shared.slot_state[slot].store(PENDING, Ordering::Release);
        if let Some((s, seq)) = side.owed_by_closed(nsocks) {
            // The peer already closed a socket this receive needs: it can never complete,
            // which its `test` reports.
            let err = owed_error(shared, s, seq);
            shared.fail_locked(g, err, true);
            return Ok(Some(slot as RequestId));
        }
        // Sockets that wait for bytes are armed with their pool thread or progressed by
        // `test`; those that hold a header for a receive not posted until now move here, and
        // the others that went quiet for want of a receive are armed again. Without a pool
        // thread the next `test` moves every socket anyway, which NCCL calls next (its proxy
        // tests what it posted), so a read here would be one more system call per message,
        // mostly finding nothing.
        if shared.has_pool() {
            let parked = std::mem::take(&mut g.side.parked);
            drop(g);
            shared.progress_sockets(parked);
        }
        Ok(Some(slot as RequestId))
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.shared.test_with(id, |side, slot| {
            let r = &side.slots[slot];
            Completion {
                count: r.n,
                sizes: r.sizes,
            }
        })
    }
}

impl Drop for SocketRecvConn {
    /// An orderly close: says [`GOODBYE`] on every socket before the sockets shut down, so a
    /// sender still sending completes its messages instead of failing.
    fn drop(&mut self) {
        let shared = &self.shared;
        if !shared.lock().over() {
            for sock in &shared.sockets {
                // Never blocks (nothing else flows this way); a socket already down just fails.
                let _ = sock.send_with_flags(&[GOODBYE], libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
            }
        }
        shared.stop();
    }
}

type Step<T> = std::result::Result<T, Error>;

fn io_error(shared: &Shared<RecvSide>, e: io::Error, what: std::fmt::Arguments<'_>) -> Error {
    super::shared::peer_io_error(&e).context(format_args!("{what} with {}", shared.peer))
}

/// Reads what socket `s` has for `buf`, staged bytes first: `Ok(None)` when it would block,
/// `Ok(Some(0))` when the peer closed, else how many bytes of `buf` came (noted as
/// progress). `what` names the read in errors.
fn read_some(
    shared: &Shared<RecvSide>,
    s: usize,
    stage: &mut Stage,
    buf: &mut [u8],
    what: impl Fn() -> String,
) -> Step<Option<usize>> {
    match stage.read(&shared.sockets[s], buf) {
        Ok(Read::Staged(k)) => Ok(Some(k)),
        Ok(Read::Arrived(k)) => {
            shared.progress.touch();
            Ok(Some(k))
        }
        Ok(Read::Closed) => Ok(Some(0)),
        Ok(Read::Nothing) => Ok(None),
        Err(e) => Err(io_error(shared, e, format_args!("{}", what()))),
    }
}

/// The error of a peer that closed in the middle of message `seq` on socket `s`.
fn closed_mid_message(shared: &Shared<RecvSide>, s: usize, seq: u64) -> Error {
    io_error(
        shared,
        io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection"),
        format_args!("receiving message {seq} on socket {s}"),
    )
}

impl Side for RecvSide {
    type Sock = RxSock;

    /// Reading a header or a chunk waits for bytes; a header whose receive is not posted yet
    /// waits for `irecv` (which progresses the socket), not for the socket.
    fn waits_on(st: &RxSock) -> u32 {
        if st.closed || st.head.is_some() {
            0
        } else {
            WANT_READ
        }
    }

    fn advance(shared: &Shared<RecvSide>, s: usize, st: &mut RxSock) {
        if let Err(err) = advance(shared, s, st) {
            shared.fail(err, true);
        }
    }
}

fn advance(shared: &Shared<RecvSide>, s: usize, st: &mut RxSock) -> Step<()> {
    // A chunk was finished in this call: the next one gets one bounded read, then the caller
    // goes and acts on what finished (see [`AFTER_DONE_READ`]).
    let mut finished = false;
    loop {
        if st.closed || shared.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        if st.job.is_none() && st.head.is_none() {
            while st.hdr_got < HEADER_SIZE {
                let what = || format!("receiving a header on socket {s}");
                match read_some(shared, s, &mut st.stage, &mut st.hdr[st.hdr_got..], what)? {
                    None => return Ok(()),
                    Some(0) if st.hdr_got == 0 => {
                        st.closed = true;
                        return peer_closed(shared, s);
                    }
                    Some(0) => {
                        let got = st.hdr_got;
                        return Err(io_error(
                            shared,
                            io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                format!(
                                    "peer closed the connection after {got} bytes of a chunk header"
                                ),
                            ),
                            format_args!("{}", what()),
                        ));
                    }
                    Some(n) => st.hdr_got += n,
                }
            }
            st.hdr_got = 0;
            st.head = Some(check_header(shared, s, &st.hdr, st.min_seq)?);
        }
        if let Some(h) = st.head {
            match deliver_staged(shared, s, st, &h) {
                None => {}
                Some(Parked::Yes) => return Ok(()),
                Some(Parked::No) => {
                    finished = true;
                    continue;
                }
            }
        }
        if let Some(h) = st.head.as_ref() {
            let Some(job) = match_header(shared, s, h, st.min_seq)? else {
                // Its receive is not posted yet, or its buffer depends on earlier messages'
                // headers still on their way: this socket waits (posting or those headers
                // progress it again).
                return Ok(());
            };
            st.head = None;
            st.min_seq = job.seq + 1;
            st.runs.clear();
            let mut job = job;
            job.segs = std::mem::take(&mut st.spare);
            st.job = Some(job);
        }
        let Some(job) = st.job.as_mut() else {
            continue;
        };
        if !read_runs(
            shared,
            s,
            &mut st.stage,
            job,
            &mut st.runs,
            &mut st.run_bytes,
        )? {
            return Ok(());
        }
        if !recv_chunk(shared, s, &mut st.stage, job, &st.runs, finished)? {
            return Ok(());
        }
        st.stage
            .chunk_received(&shared.sockets[s], job.span.end - job.span.start);
        let (slot, msg) = (job.slot, job.msg);
        st.spare = std::mem::take(&mut job.segs);
        st.job = None;
        let mut g = shared.lock();
        if complete_chunk(shared, &mut g.side, slot, msg, s, st) == Parked::Yes {
            return Ok(());
        }
        finished = true;
    }
}

/// Whether a socket that delivered a chunk has nothing more to do until a receive is posted.
#[derive(PartialEq)]
enum Parked {
    Yes,
    No,
}

/// Socket `s` received its chunk of message `msg` of the receive in `slot` (its state `st`
/// already past it): the last chunk of the last message completes the receive. Then, when no
/// receive is posted for what the socket carries next, it parks: a read now would mostly find
/// nothing (the peer's next message usually answers this one); the next `irecv` moves the
/// socket on, or its pool thread when bytes come.
fn complete_chunk(
    shared: &Shared<RecvSide>,
    side: &mut RecvSide,
    slot: usize,
    msg: usize,
    s: usize,
    st: &RxSock,
) -> Parked {
    let r = &mut side.slots[slot];
    let m = &mut r.msgs[msg];
    m.chunks_left -= 1;
    if m.chunks_left == 0 {
        if let Some(b) = m.buf_index {
            r.sizes[b] = m.size;
        }
        r.msgs_left -= 1;
        if r.msgs_left == 0 {
            remove_first(&mut side.posted, |&p| p == slot);
            shared.slot_state[slot].store(DONE, Ordering::Release);
        }
    }
    if side.next_seq <= st.min_seq && st.stage.is_empty() {
        side.parked |= 1 << s;
        return Parked::Yes;
    }
    Parked::No
}

/// The usual small message, delivered at once: on a one-socket connection, a header with no
/// lost runs whose whole payload is already in the stage, for the oldest posted receive when
/// that is a receive of one buffer with the message's tag, large enough. The same outcome as
/// [`match_header`] and [`recv_chunk`] (no effect applies without lost runs), under one lock
/// and without a job; `None` when the message is not of that kind (the general path takes it).
fn deliver_staged(
    shared: &Shared<RecvSide>,
    s: usize,
    st: &mut RxSock,
    h: &Header,
) -> Option<Parked> {
    let size = h.size as usize;
    if shared.sockets.len() != 1 || h.runs != 0 || st.stage.staged() < size {
        return None;
    }
    let mut g = shared.lock();
    if g.over() {
        return None;
    }
    let side = &mut g.side;
    let slot = *side.posted.front()?;
    let r = &mut side.slots[slot];
    if r.n != 1 || r.first_seq != h.seq || r.msgs[0].known || r.tags[0] != h.tag {
        return None;
    }
    let buf = r.bufs[0];
    if size > buf.len() {
        return None;
    }
    // SAFETY: NCCL lent the buffer until the receive completes, which is below, under the
    // lock; no other state machine writes it (one socket), and the view lives only for this
    // copy.
    let dst = unsafe { buf.slice_mut(0, size) };
    st.stage.take_staged(dst);
    // What `match_header` records of a message whose only chunk came, matched to buffer 0.
    r.msgs[0] = RecvMsg {
        known: true,
        buf_index: Some(0),
        size,
        tag: h.tag,
        effect: h.effect,
        mtu: h.mtu,
        flip_seed: h.flip_seed,
        chunks_left: 1,
        got: 1 << s,
    };
    r.taken[0] = true;
    side.passed[s] = h.seq + 1;
    st.head = None;
    st.min_seq = h.seq + 1;
    st.stage.chunk_received(&shared.sockets[s], size);
    Some(complete_chunk(shared, side, slot, 0, s, st))
}

/// The peer closed socket `s` cleanly after the chunks of the messages it went past. That
/// is how every connection ends, and it fails nothing by itself: only a posted receive that
/// needs a chunk this socket will now never carry fails (now, or when the receive is posted
/// or its message's size becomes known). The other sockets go on delivering their chunks.
fn peer_closed(shared: &Shared<RecvSide>, s: usize) -> Step<()> {
    let mut g = shared.lock();
    if g.stopping || g.failed.is_some() {
        return Ok(());
    }
    g.side.closed |= 1 << s;
    match g.side.owed_by_closed(shared.sockets.len()) {
        Some((owing, seq)) => Err(owed_error(shared, owing, seq)),
        None => Ok(()),
    }
}

fn owed_error<S: Side>(shared: &Shared<S>, s: usize, seq: u64) -> Error {
    Error::remote(format!(
        "{} closed socket {s} of the connection before sending its part of message {seq}",
        shared.peer
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

/// Checks what a chunk header says on its own (its place in the socket's stream, its chunk,
/// its number of runs).
/// The error of a chunk header of message `seq` on socket `s` that breaks the rules.
fn bad_header(shared: &Shared<RecvSide>, s: usize, seq: u64, why: impl std::fmt::Display) -> Error {
    Error::remote(format!(
        "bad chunk header for message {seq} on socket {s} from {}: {why}",
        shared.peer
    ))
}

fn check_header(
    shared: &Shared<RecvSide>,
    s: usize,
    raw: &[u8; HEADER_SIZE],
    min_seq: u64,
) -> Step<Header> {
    let n = shared.sockets.len();
    let h = Header::decode(raw)
        .map_err(|e| e.context(format_args!("socket {s} from {}", shared.peer)))?;
    let seq = h.seq;
    let bad = |why: String| bad_header(shared, s, seq, why);
    // Every message has a chunk 0, on socket `seq mod n`: this socket's next chunk belongs
    // to the next message whose chunk 0 is ours, or to one before it.
    let latest = if n == 1 {
        min_seq
    } else {
        min_seq + ((s as u64 + n as u64 - min_seq % n as u64) % n as u64)
    };
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
    if h.runs > 0 {
        // Lost runs are bounded by the packets the chunk touches (divisions a message that
        // lost nothing does without).
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
    }
    Ok(h)
}

/// Records what a checked chunk header says about its message, and matches the message to a
/// posted buffer; `Ok(None)` while that cannot be done yet (nothing changes then, so it can
/// be tried again).
fn match_header(
    shared: &Shared<RecvSide>,
    s: usize,
    h: &Header,
    min_seq: u64,
) -> Step<Option<RxJob>> {
    let n = shared.sockets.len();
    let seq = h.seq;
    let size = h.size as usize;
    let chunks = chunk_count(size, n);
    let span = chunk_span(size, chunks, usize::from(h.chunk));
    let bad = |why: String| bad_header(shared, s, seq, why);
    let mut g = shared.lock();
    if g.over() {
        return Ok(None);
    }
    if g.side.next_seq <= seq {
        g.side.parked |= 1 << s;
        return Ok(None);
    }
    let Some((slot, i)) = g.side.find(seq) else {
        return Err(bad("its message is already complete".into()));
    };
    // This socket went past the messages before `seq`: any of them that is known and
    // needs a chunk from it that never came can no longer complete (a peer that skips a
    // chunk would otherwise leave the receive pending forever).
    if let Some(q) = skipped_chunk(&g.side, s, n, min_seq, seq) {
        return Err(Error::remote(format!(
            "{} skipped the chunk of message {q} that socket {s} carries",
            shared.peer
        )));
    }
    g.side.passed[s] = seq + 1;
    let m = &mut g.side.slots[slot].msgs[i];
    let newly_known = !m.known;
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
        // Now that its size is known: a socket that already went past it, or that the peer
        // closed before it, owes a chunk (every other message was checked before).
        if let Some(o) = chunk_sockets(seq, chunks, n)
            .find(|&o| o != s && (g.side.passed[o] > seq || g.side.closed_before(o, seq)))
        {
            return Err(if g.side.passed[o] > seq {
                Error::remote(format!(
                    "{} skipped the chunk of message {seq} that socket {o} carries",
                    shared.peer
                ))
            } else {
                owed_error(shared, o, seq)
            });
        }
    }
    let b = match g.side.slots[slot].match_buffer(i) {
        Err(e) => return Err(e.context(format_args!("message {seq}"))),
        Ok(Some(b)) => b,
        // Our chunk is not in, so the message, and its slot, stay ours while we wait.
        Ok(None) => {
            g.side.parked |= 1 << s;
            return Ok(None);
        }
    };
    let buf = g.side.slots[slot].bufs[b];
    if size > buf.len() {
        return Err(Error::invalid_usage(format!(
            "message {seq} of {size} bytes from {} (socket {s}) is larger than the posted \
             receive of {} bytes",
            shared.peer,
            buf.len()
        )));
    }
    drop(g);
    if newly_known && n > 1 {
        // Sockets whose messages share a tag with this one may wait for it to be known.
        for o in (0..n).filter(|&o| o != s) {
            shared.progress_socket(o);
        }
    }
    Ok(Some(RxJob {
        slot,
        msg: i,
        seq,
        buf,
        size,
        effect: h.effect,
        mtu: h.mtu,
        flip_seed: h.flip_seed,
        span,
        runs_left: h.runs as usize,
        batch_got: 0,
        run_end: 0,
        segs: Vec::new(),
        planned: false,
        seg: 0,
        off: 0,
    }))
}

/// Reads the job's lost-packet runs in bounded batches, checking them as they come; their
/// number was bounded by the packets of the chunk, which the posted buffer bounds. `Ok(false)`
/// while some are still on their way.
fn read_runs(
    shared: &Shared<RecvSide>,
    s: usize,
    stage: &mut Stage,
    job: &mut RxJob,
    runs: &mut Vec<PacketRun>,
    run_bytes: &mut Vec<u8>,
) -> Step<bool> {
    let seq = job.seq;
    let packets = effect::packet_count(job.size, job.mtu);
    while job.runs_left > 0 {
        let want = job.runs_left.min(RUN_BATCH) * RUN_SIZE;
        if run_bytes.len() < want {
            run_bytes.resize(want, 0);
        }
        while job.batch_got < want {
            let what = || format!("receiving message {seq} on socket {s}");
            match read_some(shared, s, stage, &mut run_bytes[job.batch_got..want], what)? {
                None => return Ok(false),
                Some(0) => return Err(closed_mid_message(shared, s, seq)),
                Some(k) => job.batch_got += k,
            }
        }
        let before = runs.len();
        wire::decode_runs(&run_bytes[..want], runs);
        job.run_end = effect::check_runs(&runs[before..], packets, job.run_end)
            .map_err(|e| bad_header(shared, s, seq, e))?;
        job.runs_left -= want / RUN_SIZE;
        job.batch_got = 0;
    }
    Ok(true)
}

/// Most bytes a `test` reads of the next chunk after it finished one: one read of at most
/// this much, and the call returns unless that read finished the chunk too (small messages
/// that arrived together are still taken in one call). The caller learns that its message is
/// done without first waiting for the next message to be copied (up to a whole chunk), while
/// the socket is still drained a little for the sender. Measured against reading on as
/// usual, and against stopping right after the next header (docs/transport.md, "When a
/// receive stops reading").
pub(crate) const AFTER_DONE_READ: usize = 64 << 10;

/// Receives what socket `s` has of the job's chunk now and applies the loss plan once it is
/// all in: `Ok(true)` then, `Ok(false)` while bytes are still on their way. `after_done`:
/// this call already finished a chunk, so the socket is read once, for at most
/// [`AFTER_DONE_READ`] bytes.
fn recv_chunk(
    shared: &Shared<RecvSide>,
    s: usize,
    stage: &mut Stage,
    job: &mut RxJob,
    runs: &[PacketRun],
    after_done: bool,
) -> Step<bool> {
    let seq = job.seq;
    let (size, mtu, span) = (job.size, job.mtu, job.span.clone());
    if !job.planned {
        let segs = &mut job.segs;
        segs.clear();
        match job.effect {
            // Nothing lost (every message of a lossless run): the chunk as it is.
            _ if runs.is_empty() => segs.push(span.clone()),
            Effect::Zero | Effect::Stale => {
                segs.extend(effect::kept_ranges(runs, mtu, size, span.clone()))
            }
            Effect::Retransmit => {
                segs.push(span.clone());
                // The lost packets come again after the sender's timeout: same bytes, same place.
                segs.extend(effect::lost_ranges(runs, mtu, size, span.clone()));
            }
            Effect::Bitflip => segs.push(span.clone()),
        }
        segs.retain(|r| !r.is_empty());
        job.planned = true;
    }
    let segs = &job.segs;
    let mut socket_reads = 0;
    while job.seg < segs.len() {
        if after_done && socket_reads > 0 {
            return Ok(false);
        }
        let r = segs[job.seg].clone();
        let end = if after_done {
            r.end.min(r.start + job.off + AFTER_DONE_READ)
        } else {
            r.end
        };
        // SAFETY: NCCL lent the buffer until the receive completes, which is only after this
        // chunk is reported in; chunks of a message are disjoint and only this socket's state
        // machine (under its lock) writes `span`, which holds `r` and so this view (`end` is
        // at most `r.end`); the view lives only for this call.
        let bytes = unsafe { job.buf.slice_mut(r.start + job.off, end) };
        let asked = bytes.len();
        let from_socket = stage.is_empty();
        socket_reads += usize::from(from_socket);
        let what = || format!("receiving message {seq} on socket {s}");
        match read_some(shared, s, stage, bytes, what)? {
            None => return Ok(false),
            Some(0) => return Err(closed_mid_message(shared, s, seq)),
            Some(k) => {
                job.off += k;
                if r.start + job.off == r.end {
                    job.seg += 1;
                    job.off = 0;
                } else if from_socket && k < asked {
                    // The socket gave what had arrived: another read now would mostly find
                    // nothing, or keep this caller reading while its own sends wait. Return,
                    // as NCCL's Socket transport does after its one `recv` per `test`
                    // (docs/transport.md, "When a receive stops reading").
                    return Ok(false);
                }
            }
        }
    }
    let whole = || {
        // SAFETY: as above: `span` is this socket's part of the lent buffer, and the view is
        // the only one alive while the effect is applied.
        unsafe { job.buf.slice_mut(span.start, span.end) }
    };
    match job.effect {
        Effect::Zero => effect::zero_lost(whole(), span.start, runs, mtu, size),
        Effect::Bitflip => {
            effect::flip_lost(whole(), span.start, runs, mtu, size, job.flip_seed);
        }
        Effect::Stale | Effect::Retransmit => {}
    }
    Ok(true)
}
