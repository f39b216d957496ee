//! Ring collectives over a [`RingLink`], pipelined the way NCCL's ring kernels and proxy
//! pipeline them, with results checked bit-exact against a locally computed expectation.
//!
//! The buffer of `count` elements is cut into `n` segments (rank order, sizes differing by
//! at most one element) and every segment into chunks. At step `k` rank `r` sends segment
//! `(r - k + shift) mod n` and receives segment `(r - k - 1 + shift) mod n`, so what arrives
//! at step `k` is what leaves at step `k + 1`: each received chunk is reduced (or copied) and
//! forwarded in place, in the receive buffer, with no extra copy, as soon as it arrives.
//! Only step 0 reads the rank's own input. The first `reduce_steps` steps add the local
//! contribution (`acc + local`); the rest only copy into the output.
//!
//! | collective | shift | steps | reduce steps | input | output |
//! |---|---|---|---|---|---|
//! | all-reduce | 0 | 2(n-1) | n-1 | all | all |
//! | reduce-scatter | -1 | n-1 | n-1 | all | segment r |
//! | all-gather | 0 | n-1 | 0 | segment r | all |

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::net::{RingLink, MAX_IN_FLIGHT};
use super::plugin_client::{op, HostBuffer};
use nccl_net_lossy::{Error, Result};

/// Default chunk size: NCCL's Simple protocol moves 512 KiB per step (4 MiB buffer, 8 steps).
pub const DEFAULT_CHUNK: usize = 512 << 10;

/// The ring collectives the harness runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Every rank ends with the sum of every rank's buffer.
    AllReduce,
    /// Every rank ends with every rank's segment.
    AllGather,
    /// Rank r ends with the sum of every rank's segment r.
    ReduceScatter,
}

impl Collective {
    /// All three, in the order tables list them.
    pub const ALL: [Collective; 3] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ];

    /// The `setNetAttr` op bit NCCL sends for this collective.
    pub fn op_bits(self) -> u32 {
        match self {
            Collective::AllReduce => op::ALL_REDUCE,
            Collective::AllGather => op::ALL_GATHER,
            Collective::ReduceScatter => op::REDUCE_SCATTER,
        }
    }

    /// nccl-tests' bus bandwidth factor: busbw = algbw * factor.
    pub fn bus_factor(self, nranks: usize) -> f64 {
        let n = nranks as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
        }
    }

    /// The name NCCL's statistics use.
    pub fn nccl_name(self) -> &'static str {
        match self {
            Collective::AllReduce => "AllReduce",
            Collective::AllGather => "AllGather",
            Collective::ReduceScatter => "ReduceScatter",
        }
    }

    fn shape(self, n: usize) -> (isize, usize, usize) {
        match self {
            Collective::AllReduce => (0, 2 * (n - 1), n - 1),
            Collective::ReduceScatter => (-1, n - 1, n - 1),
            Collective::AllGather => (0, n - 1, 0),
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
        })
    }
}

/// Element type and reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataType {
    /// Bytes, summed with wrap-around.
    U8,
    /// IEEE single precision, summed.
    F32,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::U8 => 1,
            DataType::F32 => 4,
        }
    }

    /// `acc[i] = acc[i] + x[i]` element-wise.
    pub fn reduce_into(self, acc: &mut [u8], x: &[u8]) {
        match self {
            DataType::U8 => {
                for (a, b) in acc.iter_mut().zip(x) {
                    *a = a.wrapping_add(*b);
                }
            }
            DataType::F32 => {
                for (a, b) in acc.chunks_exact_mut(4).zip(x.chunks_exact(4)) {
                    let sum = f32::from_ne_bytes([a[0], a[1], a[2], a[3]])
                        + f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                    a.copy_from_slice(&sum.to_ne_bytes());
                }
            }
        }
    }

    /// Writes rank `rank`'s deterministic input for elements `first..` into `out`.
    pub fn fill(self, rank: usize, first: usize, out: &mut [u8]) {
        match self {
            DataType::U8 => {
                for (i, b) in out.iter_mut().enumerate() {
                    *b = u8_value(rank, first + i);
                }
            }
            DataType::F32 => {
                for (i, b) in out.chunks_exact_mut(4).enumerate() {
                    b.copy_from_slice(&f32_value(rank, first + i).to_ne_bytes());
                }
            }
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataType::U8 => "u8",
            DataType::F32 => "f32",
        })
    }
}

fn u8_value(rank: usize, i: usize) -> u8 {
    (rank.wrapping_mul(151) ^ i.wrapping_mul(31) ^ (i >> 8)) as u8
}

/// Values with fractional bits, so a different summation order gives different bits.
fn f32_value(rank: usize, i: usize) -> f32 {
    let k = (rank.wrapping_mul(7919) + i.wrapping_mul(131)) % 2003;
    k as f32 / 7.0 - 100.0 + rank as f32 * 0.1
}

/// Segment bounds in elements: segment `s` of `count` elements over `n` ranks.
fn segment(count: usize, n: usize, s: usize) -> (usize, usize) {
    let at = |s: usize| (count as u128 * s as u128 / n as u128) as usize;
    (at(s), at(s + 1))
}

/// The chunks (offset, length in bytes) of a segment of `bytes` bytes; an empty segment is
/// one zero-byte message, so every step still exchanges something.
fn chunks(bytes: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = bytes.div_ceil(chunk).max(1);
    (0..count).map(move |c| {
        let off = c * chunk;
        (off, chunk.min(bytes - off.min(bytes)))
    })
}

/// One collective call: its shape and the rank's buffers.
pub struct CollectiveSpec {
    /// Which collective.
    pub collective: Collective,
    /// Element type.
    pub dtype: DataType,
    /// Elements in the full buffer (all-reduce buffer, all-gather output, reduce-scatter input).
    pub count: usize,
    /// Largest message in bytes (rounded down to whole elements).
    pub chunk: usize,
    /// Requests in flight per direction, at most [`MAX_IN_FLIGHT`].
    pub in_flight: usize,
    /// Give up (with an error) after this long.
    pub timeout: Duration,
}

/// Byte range of segment `s` in the full buffer.
fn seg_bytes(spec: &CollectiveSpec, n: usize, s: usize) -> (usize, usize) {
    let (a, b) = segment(spec.count, n, s);
    let es = spec.dtype.size();
    (a * es, b * es)
}

/// The elements the rank contributes, as (first, count): its own segment for all-gather,
/// the whole buffer otherwise.
fn input_elems(spec: &CollectiveSpec, rank: usize, n: usize) -> (usize, usize) {
    match spec.collective {
        Collective::AllGather => {
            let (a, b) = segment(spec.count, n, rank);
            (a, b - a)
        }
        _ => (0, spec.count),
    }
}

/// `len` zero bytes, or `None` when the memory cannot be had (an address-space limit, a
/// machine short of memory): the caller says what it was for, where `vec!` would abort.
pub fn try_zeroed(len: usize) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(len).ok()?;
    buf.resize(len, 0);
    Some(buf)
}

/// Bytes of the rank's input for `spec`.
pub fn input_len(spec: &CollectiveSpec, rank: usize, n: usize) -> usize {
    input_elems(spec, rank, n).1 * spec.dtype.size()
}

/// The rank's input for `spec` (deterministic from rank and element index); `None` when
/// its memory cannot be had (see [`try_zeroed`]).
pub fn make_input(spec: &CollectiveSpec, rank: usize, n: usize) -> Option<Vec<u8>> {
    let (first, _) = input_elems(spec, rank, n);
    let mut input = try_zeroed(input_len(spec, rank, n))?;
    spec.dtype.fill(rank, first, &mut input);
    Some(input)
}

/// Bytes of the rank's output for `spec`.
pub fn output_len(spec: &CollectiveSpec, rank: usize, n: usize) -> usize {
    match spec.collective {
        Collective::ReduceScatter => {
            let (a, b) = seg_bytes(spec, n, rank);
            b - a
        }
        _ => spec.count * spec.dtype.size(),
    }
}

/// Recycles chunk buffers (NCCL's staging slots), allocating more only when all are lent.
struct Pool {
    free: Vec<HostBuffer>,
    chunk: usize,
    allocated: usize,
}

impl Pool {
    fn get(&mut self) -> HostBuffer {
        self.free.pop().unwrap_or_else(|| {
            self.allocated += 1;
            vec![0u8; self.chunk.max(1)].into_boxed_slice()
        })
    }

    fn put(&mut self, buf: HostBuffer) {
        self.free.push(buf);
    }
}

/// Buffers kept between calls, like NCCL's per-connection staging buffers.
pub struct Staging {
    pool: Pool,
}

impl Staging {
    /// Staging for chunks of up to `chunk` bytes.
    pub fn new(chunk: usize) -> Staging {
        Staging {
            pool: Pool {
                free: Vec::new(),
                chunk,
                allocated: 0,
            },
        }
    }

    /// Buffers allocated so far.
    pub fn allocated(&self) -> usize {
        self.pool.allocated
    }
}

/// What the message at position `m` of the rank's receive sequence is: step and chunk.
struct MsgPos {
    step: usize,
    seg: usize,
    off: usize,
    len: usize,
}

/// Runs one collective on `link` as rank `rank` of `n`: `input` is the rank's input (see
/// [`make_input`]), `output` receives the result (see [`output_len`]).
pub fn run(
    link: &mut dyn RingLink,
    staging: &mut Staging,
    spec: &CollectiveSpec,
    rank: usize,
    n: usize,
    input: &[u8],
    output: &mut [u8],
) -> Result<()> {
    run_channels(&mut [link], staging, spec, rank, n, input, output)
}

/// The element range channel `c` of `channels` carries: contiguous slices of the buffer,
/// sizes differing by at most one element (NCCL's channels split a buffer the same way).
pub fn channel_slice(count: usize, channels: usize, c: usize) -> (usize, usize) {
    segment(count, channels.max(1), c)
}

/// Runs one collective spread over `links`, one ring channel each: channel `c` carries the
/// contiguous slice [`channel_slice`] of the buffer as a collective of its own, and every
/// channel progresses in this one loop on this thread, as NCCL's proxy drives its channels'
/// connections. More than one channel is an all-reduce only.
pub fn run_channels(
    links: &mut [&mut dyn RingLink],
    staging: &mut Staging,
    spec: &CollectiveSpec,
    rank: usize,
    n: usize,
    input: &[u8],
    output: &mut [u8],
) -> Result<()> {
    if n < 2 {
        return Err(Error::invalid_argument("a ring needs at least 2 ranks"));
    }
    if links.is_empty() {
        return Err(Error::invalid_argument("a collective needs a ring channel"));
    }
    if links.len() > 1 && spec.collective != Collective::AllReduce {
        return Err(Error::invalid_argument(format!(
            "{} over {} channels (more than one channel is all-reduce only)",
            spec.collective,
            links.len()
        )));
    }
    let es = spec.dtype.size();
    let chunk = (spec.chunk / es).max(1) * es;
    if staging.pool.chunk < chunk {
        return Err(Error::invalid_argument(format!(
            "staging buffers of {} bytes for {chunk}-byte chunks",
            staging.pool.chunk
        )));
    }
    if input.len() != input_elems(spec, rank, n).1 * es || output.len() != output_len(spec, rank, n)
    {
        return Err(Error::invalid_argument(format!(
            "{} buffers of {} and {} bytes do not match {} elements",
            spec.collective,
            input.len(),
            output.len(),
            spec.count
        )));
    }
    let nch = links.len();
    let mut channels: Vec<Channel> = (0..nch)
        .map(|c| {
            let (a, b) = channel_slice(spec.count, nch, c);
            Channel::new(spec, rank, n, b - a, a * es, chunk)
        })
        .collect();
    if spec.collective == Collective::AllGather {
        let my_a = channels[0].my_a;
        output[my_a..my_a + input.len()].copy_from_slice(input);
    }
    for link in links.iter_mut() {
        link.set_op(spec.collective.op_bits())?;
    }
    let deadline = Instant::now() + spec.timeout;
    loop {
        let mut progressed = false;
        for (ch, link) in channels.iter_mut().zip(links.iter_mut()) {
            progressed |= ch.poll(&mut **link, &mut staging.pool, input, output)?;
        }
        if channels.iter().all(Channel::done) {
            return Ok(());
        }
        if !progressed {
            // Nothing moved: yield the core and poll again, as NCCL's proxy progress thread
            // does (`src/proxy.cc`, `ncclProxyProgress`, never sleeps). A transport that moves
            // bytes inline in `test`, as NCCL's Socket transport does, is only as fast as the
            // loop that calls it, so a sleep here would slow exactly those transports.
            if Instant::now() > deadline {
                let (done, total, left) = channels.iter().fold((0, 0, 0), |acc, ch| {
                    (
                        acc.0 + ch.sends_done,
                        acc.1 + ch.total_sends,
                        acc.2 + ch.recv_plan.len() + ch.posted_recvs.len(),
                    )
                });
                return Err(Error::remote(format!(
                    "{} of {} elements did not finish within {:?} ({done} of {total} sends \
                     done, {left} receives left)",
                    spec.collective, spec.count, spec.timeout,
                )));
            }
            std::thread::yield_now();
        }
    }
}

/// One channel's part of a collective: the ring algorithm over its slice of the buffer,
/// `base` bytes into the input and output (0 for a single channel).
struct Channel {
    collective: Collective,
    dtype: DataType,
    count: usize,
    n: usize,
    base: usize,
    chunk: usize,
    depth: usize,
    steps: usize,
    reduce_steps: usize,
    my_a: usize,
    s0a: usize,
    recv_plan: VecDeque<MsgPos>,
    posted_recvs: VecDeque<MsgPos>,
    local: VecDeque<(usize, usize)>,
    forward: VecDeque<(HostBuffer, usize)>,
    total_sends: usize,
    sends_done: usize,
}

impl Channel {
    fn new(
        spec: &CollectiveSpec,
        rank: usize,
        n: usize,
        count: usize,
        base: usize,
        chunk: usize,
    ) -> Channel {
        let (shift, steps, reduce_steps) = spec.collective.shape(n);
        let es = spec.dtype.size();
        let seg = |s: usize| {
            let (a, b) = segment(count, n, s);
            (a * es, b * es)
        };
        let seg_at = |k: usize, extra: isize| -> usize {
            (rank as isize - k as isize + shift + extra).rem_euclid(n as isize) as usize
        };
        // The receive sequence, in posting order.
        let mut recv_plan = VecDeque::new();
        for k in 0..steps {
            let s = seg_at(k, -1);
            let (a, b) = seg(s);
            for (off, len) in chunks(b - a, chunk) {
                recv_plan.push_back(MsgPos {
                    step: k,
                    seg: s,
                    off,
                    len,
                });
            }
        }
        // Step 0 sends, from the rank's own input.
        let (s0a, s0b) = seg(seg_at(0, 0));
        let local: VecDeque<(usize, usize)> = chunks(s0b - s0a, chunk).collect();
        let total_sends = local.len() + recv_plan.iter().filter(|m| m.step + 1 < steps).count();
        Channel {
            collective: spec.collective,
            dtype: spec.dtype,
            count,
            n,
            base,
            chunk,
            depth: spec.in_flight.clamp(1, MAX_IN_FLIGHT),
            steps,
            reduce_steps,
            my_a: seg(rank).0,
            s0a,
            recv_plan,
            posted_recvs: VecDeque::new(),
            local,
            forward: VecDeque::new(),
            total_sends,
            sends_done: 0,
        }
    }

    fn seg_start(&self, s: usize) -> usize {
        segment(self.count, self.n, s).0 * self.dtype.size()
    }

    fn input_at(&self, seg_start: usize) -> usize {
        self.base
            + match self.collective {
                Collective::AllGather => seg_start - self.my_a,
                _ => seg_start,
            }
    }

    fn out_at(&self, seg_start: usize) -> usize {
        self.base
            + match self.collective {
                Collective::ReduceScatter => seg_start - self.my_a,
                _ => seg_start,
            }
    }

    fn done(&self) -> bool {
        self.recv_plan.is_empty()
            && self.posted_recvs.is_empty()
            && self.sends_done == self.total_sends
            && self.forward.is_empty()
    }

    /// Posts what the window allows and takes what completed; true when anything moved.
    fn poll(
        &mut self,
        link: &mut dyn RingLink,
        pool: &mut Pool,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<bool> {
        debug_assert!(pool.chunk >= self.chunk);
        let mut progressed = false;
        // Sends, strictly in message order: step 0 from the input, then forwards.
        while link.sends_in_flight() < self.depth {
            let from_local = !self.local.is_empty();
            let (buf, len) = if let Some(&(off, len)) = self.local.front() {
                let mut buf = pool.get();
                let from = self.input_at(self.s0a) + off;
                buf[..len].copy_from_slice(&input[from..from + len]);
                (buf, len)
            } else if let Some(next) = self.forward.pop_front() {
                next
            } else {
                break;
            };
            match link.post_send(buf, len)? {
                None => {
                    if from_local {
                        self.local.pop_front();
                    }
                    progressed = true;
                }
                Some(back) if from_local => {
                    pool.put(back);
                    break;
                }
                Some(back) => {
                    self.forward.push_front((back, len));
                    break;
                }
            }
        }
        // Receives, as many as the window allows.
        while link.recvs_in_flight() < self.depth {
            let Some(pos) = self.recv_plan.pop_front() else {
                break;
            };
            let buf = pool.get();
            match link.post_recv(buf)? {
                None => {
                    self.posted_recvs.push_back(pos);
                    progressed = true;
                }
                Some(back) => {
                    pool.put(back);
                    self.recv_plan.push_front(pos);
                    break;
                }
            }
        }
        while let Some(buf) = link.test_send()? {
            pool.put(buf);
            self.sends_done += 1;
            progressed = true;
        }
        while let Some((mut buf, got)) = link.test_recv()? {
            let pos = self
                .posted_recvs
                .pop_front()
                .ok_or_else(|| Error::internal("a receive completed that was never posted"))?;
            // The size the plugin reports is read as NCCL reads it: not at all (its kernels
            // know each step's size; `recvProxyProgress` passes it only to its profiler and
            // GPU flushes). Only one that the receive could not hold is an error.
            if got > buf.len() {
                return Err(Error::remote(format!(
                    "{}: step {} chunk at {} reported {got} bytes for a receive of {}",
                    self.collective,
                    pos.step,
                    pos.off,
                    buf.len()
                )));
            }
            let sa = self.seg_start(pos.seg);
            let data = &mut buf[..pos.len];
            if pos.step < self.reduce_steps {
                let from = self.input_at(sa) + pos.off;
                self.dtype.reduce_into(data, &input[from..from + pos.len]);
            }
            if pos.step + 1 >= self.reduce_steps {
                let to = self.out_at(sa) + pos.off;
                output[to..to + pos.len].copy_from_slice(data);
            }
            if pos.step + 1 < self.steps {
                self.forward.push_back((buf, pos.len));
            } else {
                pool.put(buf);
            }
            progressed = true;
        }
        Ok(progressed)
    }
}

/// Result of comparing an output with the expectation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Elements that differ in any bit.
    pub mismatches: usize,
    /// First differing element index (in the output), if any.
    pub first_mismatch: Option<usize>,
}

impl Verdict {
    /// True when every bit matched.
    pub fn ok(&self) -> bool {
        self.mismatches == 0
    }
}

/// Checks `output` bit by bit against what rank `rank` of `n` must hold: sums are folded in
/// ring order (`acc + x`), starting at the rank that sent the segment at step 0, so the
/// float result is reproduced exactly.
pub fn verify(spec: &CollectiveSpec, rank: usize, n: usize, output: &[u8]) -> Verdict {
    verify_slice(spec, spec.count, 0, rank, n, output)
}

/// [`verify`] for a collective spread over `channels` ([`run_channels`]): each channel's
/// slice is a ring of its own, with its own segments and so its own summation order.
pub fn verify_channels(
    spec: &CollectiveSpec,
    channels: usize,
    rank: usize,
    n: usize,
    output: &[u8],
) -> Verdict {
    if channels <= 1 {
        return verify(spec, rank, n, output);
    }
    let es = spec.dtype.size();
    let mut verdict = Verdict::default();
    for c in 0..channels {
        let (a, b) = channel_slice(spec.count, channels, c);
        let part = output.get(a * es..b * es).unwrap_or(&[]);
        let v = verify_slice(spec, b - a, a, rank, n, part);
        verdict.mismatches += v.mismatches;
        if verdict.first_mismatch.is_none() {
            verdict.first_mismatch = v.first_mismatch;
        }
    }
    verdict
}

/// Checks the `count` elements of a ring whose element 0 is element `first` of the buffer.
fn verify_slice(
    spec: &CollectiveSpec,
    count: usize,
    first: usize,
    rank: usize,
    n: usize,
    output: &[u8],
) -> Verdict {
    let es = spec.dtype.size();
    let (shift, _, _) = spec.collective.shape(n);
    let mut verdict = Verdict::default();
    let mut expected = vec![0u8; es];
    let mut term = vec![0u8; es];
    let first_seg = match spec.collective {
        Collective::ReduceScatter => rank,
        _ => 0,
    };
    let last_seg = match spec.collective {
        Collective::ReduceScatter => rank + 1,
        _ => n,
    };
    let base = segment(count, n, first_seg).0;
    for s in first_seg..last_seg {
        let (a, b) = segment(count, n, s);
        // Segment s leaves rank (s - shift) at step 0 and collects ranks in ring order.
        let start = (s as isize - shift).rem_euclid(n as isize) as usize;
        for i in a..b {
            match spec.collective {
                Collective::AllGather => spec.dtype.fill(s, first + i, &mut expected),
                _ => {
                    spec.dtype.fill(start, first + i, &mut expected);
                    for j in 1..n {
                        spec.dtype.fill((start + j) % n, first + i, &mut term);
                        spec.dtype.reduce_into(&mut expected, &term);
                    }
                }
            }
            let at = (i - base) * es;
            if output.get(at..at + es) != Some(&expected[..]) {
                verdict.mismatches += 1;
                verdict.first_mismatch.get_or_insert(first + i - base);
            }
        }
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_buffer_without_gaps() {
        for (count, n) in [(0, 2), (1, 4), (7, 4), (1000, 8), (5, 3)] {
            let mut next = 0;
            for s in 0..n {
                let (a, b) = segment(count, n, s);
                assert_eq!(a, next);
                assert!(b >= a);
                next = b;
            }
            assert_eq!(next, count);
        }
    }

    #[test]
    fn chunks_cover_a_segment_and_empty_is_one_message() {
        assert_eq!(chunks(0, 4).collect::<Vec<_>>(), vec![(0, 0)]);
        assert_eq!(
            chunks(10, 4).collect::<Vec<_>>(),
            vec![(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
    }

    #[test]
    fn float_sums_depend_on_order_so_verification_is_meaningful() {
        // Some element must sum differently in another order, or bit-exactness proves little.
        let differs = (0..1000).any(|i| {
            let v: Vec<f32> = (0..4).map(|r| f32_value(r, i)).collect();
            ((v[0] + v[1]) + v[2]) + v[3] != ((v[3] + v[2]) + v[1]) + v[0]
        });
        assert!(differs);
    }
}
