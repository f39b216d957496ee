//! The receiving half of a socket connection: grouped receives matched to messages by tag,
//! and the I/O threads that receive each socket's chunk and apply the loss plan to it.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Duration;

use socket2::Socket;

use super::shared::{recv_all, recv_until_eof, Exit, Progress, Running, Shared, DONE, PENDING};
use super::{chunk_count, chunk_sockets, chunk_span, roles};
use crate::loss::effect;
use crate::loss::plan::{Effect, PacketRun};
use crate::transport::socket::wire::{self, Header, GOODBYE, HEADER_SIZE, RUN_SIZE};
use crate::transport::{Completion, HostBuf, RecvConn, RequestId, MAX_RECVS, MAX_REQUESTS};
use crate::{Error, Result};

/// Runs read from the wire per `recv`, so a long list costs a bounded buffer.
const RUN_BATCH: usize = 4096;

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
        let shared = Shared::new(sockets, peer, side, timeout);
        Ok(SocketRecvConn {
            running: Running::start(shared, "lossy-rx", recv_loop)?,
        })
    }

    /// Sockets whose clean close by the peer a receive thread has read (bit `s`: socket `s`).
    #[cfg(test)]
    pub(crate) fn closed_by_peer(&self) -> u16 {
        self.running.shared.lock().side.closed
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
        let shared = &self.running.shared;
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
        r.msgs = [UNKNOWN_MSG; MAX_RECVS];
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
        shared.wake.notify_all();
        Ok(Some(slot as RequestId))
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.running.shared.test_with(id, |side, slot| {
            let r = &side.slots[slot];
            Completion {
                count: r.n,
                sizes: r.sizes,
            }
        })
    }
}

impl Drop for SocketRecvConn {
    /// An orderly close: says [`GOODBYE`] on every socket before the threads stop and the
    /// sockets shut down, so a sender still sending completes its messages instead of failing.
    fn drop(&mut self) {
        let shared = &self.running.shared;
        if shared.lock().over() {
            return;
        }
        for sock in &shared.sockets {
            // Never blocks (nothing else flows this way); a socket already down just fails.
            let _ = sock.send_with_flags(&[GOODBYE], libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
        }
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

fn recv_loop(shared: &Shared<RecvSide>, s: usize) -> Exit {
    let sock = &shared.sockets[s];
    let mut runs: Vec<PacketRun> = Vec::new();
    let mut run_bytes = vec![0u8; RUN_BATCH * RUN_SIZE];
    // Chunks on one socket come in stream order: the next one is for this message or later.
    let mut min_seq = 0u64;
    loop {
        let mut raw = [0u8; HEADER_SIZE];
        match recv_header(sock, &mut raw, &shared.progress) {
            Ok(true) => {}
            Ok(false) => return peer_closed(shared, s),
            Err(e) => return shared.io_exit(e, format_args!("receiving a header on socket {s}")),
        }
        let job = match accept_header(shared, s, &raw, min_seq) {
            Ok(job) => job,
            Err(exit) => return exit,
        };
        min_seq = job.seq + 1;
        if let Err(exit) = read_runs(shared, s, &job, &mut runs, &mut run_bytes) {
            return exit;
        }
        if let Err(exit) = recv_chunk(shared, s, &job, &runs) {
            return exit;
        }
        let mut g = shared.lock();
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
                shared.slot_state[job.slot].store(DONE, Ordering::Release);
            }
        }
    }
}

/// The peer closed socket `s` cleanly after the chunks of the messages it went past. That
/// is how every connection ends, and it fails nothing by itself: only a posted receive that
/// needs a chunk this socket will now never carry fails (now, or when the receive is posted
/// or its message's size becomes known). The other sockets go on delivering their chunks.
fn peer_closed(shared: &Shared<RecvSide>, s: usize) -> Exit {
    let mut g = shared.lock();
    if g.stopping || g.failed.is_some() {
        return Exit::Stopped;
    }
    g.side.closed |= 1 << s;
    match g.side.owed_by_closed(shared.sockets.len()) {
        Some((owing, seq)) => Exit::Failed(owed_error(shared, owing, seq)),
        None => Exit::Stopped,
    }
}

fn owed_error<S>(shared: &Shared<S>, s: usize, seq: u64) -> Error {
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

/// Checks a chunk header against the connection's state, records what it says about its
/// message, and matches the message to a posted buffer; returns this socket's job.
fn accept_header(
    shared: &Shared<RecvSide>,
    s: usize,
    raw: &[u8; HEADER_SIZE],
    min_seq: u64,
) -> std::result::Result<RecvJob, Exit> {
    let n = shared.sockets.len();
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
    let mut g = shared.wait_until(shared.lock(), |side| side.next_seq > seq)?;
    let Some((slot, i)) = g.side.find(seq) else {
        return Err(bad("its message is already complete".into()));
    };
    // This socket went past the messages before `seq`: any of them that is known and
    // needs a chunk from it that never came can no longer complete (a peer that skips a
    // chunk would otherwise leave the receive pending forever).
    if let Some(q) = skipped_chunk(&g.side, s, n, min_seq, seq) {
        return Err(Exit::Failed(Error::remote(format!(
            "{} skipped the chunk of message {q} that socket {s} carries",
            shared.peer
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
        shared.wake.notify_all();
        // Now that its size is known: a socket that already went past it, or that the peer
        // closed before it, owes a chunk (every other message was checked before).
        if let Some(o) = chunk_sockets(seq, chunks, n)
            .find(|&o| o != s && (g.side.passed[o] > seq || g.side.closed_before(o, seq)))
        {
            return Err(Exit::Failed(if g.side.passed[o] > seq {
                Error::remote(format!(
                    "{} skipped the chunk of message {seq} that socket {o} carries",
                    shared.peer
                ))
            } else {
                owed_error(shared, o, seq)
            }));
        }
    }
    let b = loop {
        match g.side.slots[slot].match_buffer(i) {
            Err(e) => return Err(Exit::Failed(e.context(format_args!("message {seq}")))),
            Ok(Some(b)) => break b,
            // Our chunk is not in, so the message, and its slot, stay ours while we wait.
            Ok(None) => g = shared.wait_once(g)?,
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
    shared: &Shared<RecvSide>,
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
        recv_all(&shared.sockets[s], bytes, &shared.progress).map_err(|e| {
            shared.io_exit(e, format_args!("receiving message {seq} on socket {s}"))
        })?;
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
    shared: &Shared<RecvSide>,
    s: usize,
    job: &RecvJob,
    runs: &[PacketRun],
) -> std::result::Result<(), Exit> {
    let sock = &shared.sockets[s];
    let seq = job.seq;
    let io = |e| shared.io_exit(e, format_args!("receiving message {seq} on socket {s}"));
    let (size, mtu, span) = (job.size, job.mtu, job.span.clone());
    // This socket alone writes `span` of the buffer (chunks are disjoint).
    let whole = || {
        // SAFETY: NCCL lent the buffer until the receive completes, which is only after this
        // chunk is reported in; chunks of a message are disjoint, so this thread alone touches
        // `span`, and each view taken here is dropped before the next one is taken.
        unsafe { job.buf.slice_mut(span.start, span.end) }
    };
    // Receives the bytes of `r`, a range of the message inside `span`.
    let recv = |r: Range<usize>| {
        // SAFETY: as for `whole`: `r` lies in this thread's `span`, and the view lives only
        // for this call.
        let bytes = unsafe { job.buf.slice_mut(r.start, r.end) };
        recv_all(sock, bytes, &shared.progress).map_err(io)
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
            recv_all(sock, whole(), &shared.progress).map_err(io)?;
            // The lost packets come again after the sender's timeout: same bytes, same place.
            for r in effect::lost_ranges(runs, mtu, size, span) {
                recv(r)?;
            }
        }
        Effect::Bitflip => {
            recv_all(sock, whole(), &shared.progress).map_err(io)?;
            effect::flip_lost(whole(), span.start, runs, mtu, size, job.flip_seed);
        }
    }
    Ok(())
}
