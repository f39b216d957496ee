//! The sending half of a socket connection: request slots of posted messages, and the I/O
//! threads that send each socket's chunk of every message.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Duration;

use socket2::Socket;

use super::shared::{peek_arrived, send_all, Exit, Running, Shared, DONE, PENDING};
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
                    buf: HostBuf::EMPTY,
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
        let shared = Shared::new(sockets, peer, side, timeout);
        Ok(SocketSendConn {
            running: Running::start(shared, "lossy-tx", send_loop)?,
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
        let shared = &self.running.shared;
        let mut g = shared.lock();
        shared.usable(&g)?;
        let Some(slot) = shared.free_slot() else {
            return Ok(None);
        };
        if g.failed.is_some() || g.peer_left {
            // Nothing will be sent: the request fails at `test` when the connection failed,
            // and is done at once when the receiver closed its end in an orderly way.
            g.side.slots[slot].buf = buf;
            g.side.slots[slot].chunks_left = 0;
            let state = if g.peer_left { DONE } else { PENDING };
            shared.slot_state[slot].store(state, Ordering::Release);
            return Ok(Some(slot as RequestId));
        }
        let n = shared.sockets.len();
        let side = &mut g.side;
        let seq = side.next_seq;
        if side.posted.is_empty() {
            // The connection was idle: the no-progress clock starts now.
            shared.progress.touch();
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
        shared.slot_state[slot].store(PENDING, Ordering::Release);
        shared.wake.notify_all();
        Ok(Some(slot as RequestId))
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.running.shared.test_with(id, |side, slot| {
            Completion::single(side.slots[slot].buf.len())
        })
    }
}

fn send_loop(shared: &Shared<SendSide>, s: usize) -> Exit {
    let n = shared.sockets.len();
    let mut runs: Vec<PacketRun> = Vec::new();
    let mut wire_buf: Vec<u8> = Vec::new();
    let mut seq = 0u64;
    loop {
        let job = {
            let g = match shared.wait_until(shared.lock(), |side| side.next_seq > seq) {
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
            if let Err(exit) = send_chunk(shared, s, &job, &runs, &mut wire_buf) {
                return match exit {
                    Exit::Failed(_) if said_goodbye(&shared.sockets[s]) => receiver_left(shared),
                    exit => exit,
                };
            }
            let mut g = shared.lock();
            if g.peer_left {
                // Every queued message is already done, and its slot may be reused.
                return Exit::Stopped;
            }
            let side = &mut g.side;
            side.slots[job.slot].chunks_left -= 1;
            if side.slots[job.slot].chunks_left == 0 {
                side.posted.retain(|p| p.1 != job.slot);
                shared.slot_state[job.slot].store(DONE, Ordering::Release);
            }
        }
        seq += 1;
    }
}

/// Whether the receiver wrote [`wire::GOODBYE`] on `sock` before closing it.
fn said_goodbye(sock: &Socket) -> bool {
    let mut b = [0u8; 1];
    matches!(peek_arrived(sock, &mut b), Ok(1)) && b[0] == wire::GOODBYE
}

/// The receiver closed its comm in an orderly way: every message still queued, and every one
/// posted from now on, is done (its bytes are discarded; nobody will receive them), as when a
/// peer closes while NCCL's own plugins still send. Not a failure.
fn receiver_left(shared: &Shared<SendSide>) -> Exit {
    let mut g = shared.lock();
    if g.over() {
        return Exit::Stopped;
    }
    let side = &mut g.side;
    for (_, slot) in side.posted.drain(..) {
        shared.slot_state[slot].store(DONE, Ordering::Release);
    }
    shared.peer_left(g);
    Exit::Stopped
}

fn send_chunk(
    shared: &Shared<SendSide>,
    s: usize,
    job: &SendJob,
    runs: &[PacketRun],
    wire_buf: &mut Vec<u8>,
) -> std::result::Result<(), Exit> {
    let sock = &shared.sockets[s];
    let size = job.buf.len();
    let seq = job.seq;
    let io = |e| shared.io_exit(e, format_args!("sending message {seq} on socket {s}"));
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
        send_all(sock, wire_buf, !job.span.is_empty(), &shared.progress).map_err(io)?;
    }
    // Sends the bytes of `r`, a range of the message.
    let send = |r: Range<usize>| {
        // SAFETY: NCCL lent the buffer until the send completes, which is only after this
        // chunk is reported sent, and does not write it meanwhile; the transport only reads it.
        let bytes = unsafe { job.buf.slice(r.start, r.end) };
        send_all(sock, bytes, false, &shared.progress).map_err(io)
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
                shared.sleep(job.retransmit.saturating_mul(events))?;
                shared.progress.touch();
                for r in effect::lost_ranges(runs, job.mtu, size, span) {
                    send(r)?;
                }
            }
        }
        Effect::Bitflip => send(span)?,
    }
    Ok(())
}
