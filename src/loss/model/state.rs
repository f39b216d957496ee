//! The generator: one stream's chain state, sampling run lengths (not one draw per packet).

use std::sync::Arc;

use rand::Rng;

use crate::loss::model::ModelSpec;
use crate::loss::plan::PacketRun;
use crate::loss::rng::{Geometric, StreamRng, NEVER};
use crate::loss::trace::{TraceCursor, TraceData, TraceEnd, TraceStart};

/// One state of a compiled chain.
#[derive(Clone, Copy, Debug)]
struct State {
    /// Loss probability of a packet in this state.
    loss: f64,
    /// Packets kept before the next loss, for 0 < loss < 1.
    gap: Geometric,
    /// Extra packets spent in the state after the first (exit probability per packet).
    stay: Geometric,
    /// Where the chain goes on leaving: `to[0]` with probability `p_first`, else `to[1]`.
    to: [u8; 2],
    p_first: f64,
}

impl State {
    fn new(loss: f64, exit: f64, to: [u8; 2], p_first: f64) -> State {
        State {
            loss,
            gap: Geometric::new(loss),
            stay: Geometric::new(exit),
            to,
            p_first,
        }
    }
}

/// What produces the segments. The chain is kept inline (not boxed) on purpose: it is read
/// on every segment, and one model state per rule per connection is a few hundred bytes.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
enum Source {
    /// Nothing is ever lost.
    Lossless,
    /// A Markov chain of up to four states.
    Chain {
        states: [State; 4],
        cur: u8,
        /// Packets left in the current state's sojourn.
        left: u64,
        /// The next packet is lost (a sampled gap has just been emitted).
        pending_loss: bool,
    },
    /// A trace replay.
    Trace {
        data: Arc<TraceData>,
        end: TraceEnd,
        cursor: TraceCursor,
    },
}

/// One stream's model: the chain state and generator, kept for the life of a connection.
#[derive(Clone, Debug)]
pub struct ModelState {
    rng: StreamRng,
    source: Source,
    /// Packets left in the current segment, and whether they are lost.
    seg_left: u64,
    seg_lost: bool,
}

impl ModelState {
    /// A fresh stream of `spec` driven by `rng` (an unloaded trace loses nothing).
    pub fn new(spec: &ModelSpec, mut rng: StreamRng) -> ModelState {
        let idle = State::new(0.0, 0.0, [0, 0], 1.0);
        let source = match *spec {
            ModelSpec::None => Source::Lossless,
            ModelSpec::Uniform { rate } if rate <= 0.0 => Source::Lossless,
            ModelSpec::Uniform { rate } => Source::Chain {
                states: [State::new(rate, 0.0, [0, 0], 1.0), idle, idle, idle],
                cur: 0,
                left: NEVER,
                pending_loss: false,
            },
            ModelSpec::GilbertElliott {
                p,
                r,
                h_loss,
                k_loss,
            } => {
                let good = State::new(k_loss, p, [1, 1], 1.0);
                let bad = State::new(h_loss, r, [0, 0], 1.0);
                // The first packet is in Good; it and each later Good packet leave with p.
                let left = 1 + good.stay.sample(&mut rng);
                Source::Chain {
                    states: [good, bad, idle, idle],
                    cur: 0,
                    left,
                    pending_loss: false,
                }
            }
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => {
                let exit1 = p13 + p14;
                let exit3 = p31 + p32;
                let s1 = State::new(
                    0.0,
                    exit1,
                    [2, 3],
                    if exit1 > 0.0 { p13 / exit1 } else { 1.0 },
                );
                let s2 = State::new(0.0, p23, [2, 2], 1.0);
                let s3 = State::new(
                    1.0,
                    exit3,
                    [0, 1],
                    if exit3 > 0.0 { p31 / exit3 } else { 1.0 },
                );
                let s4 = State::new(1.0, 1.0, [0, 0], 1.0);
                // The chain starts in 1 and the first packet already takes a transition, so
                // the first sojourn in 1 may be empty.
                let left = s1.stay.sample(&mut rng);
                Source::Chain {
                    states: [s1, s2, s3, s4],
                    cur: 0,
                    left,
                    pending_loss: false,
                }
            }
            ModelSpec::Trace(ref t) => match &t.data {
                Some(data) if !data.runs.is_empty() => {
                    let pos = match t.start {
                        TraceStart::Beginning => 0,
                        TraceStart::Random => rng.gen_range(0..data.length.max(1)),
                    };
                    Source::Trace {
                        data: Arc::clone(data),
                        end: t.at_end,
                        cursor: TraceCursor::at(data, pos),
                    }
                }
                _ => Source::Lossless,
            },
        };
        ModelState {
            rng,
            source,
            seg_left: 0,
            seg_lost: false,
        }
    }

    /// The next segment of the packet stream: (packets, lost?).
    #[inline]
    fn next_segment(&mut self) -> (u64, bool) {
        match &mut self.source {
            Source::Lossless => (NEVER, false),
            Source::Trace { data, end, cursor } => cursor.next_segment(data, *end),
            Source::Chain {
                states,
                cur,
                left,
                pending_loss,
            } => {
                if *left == 0 {
                    let s = &states[usize::from(*cur)];
                    let next = if s.p_first >= 1.0 || self.rng.gen::<f64>() < s.p_first {
                        s.to[0]
                    } else {
                        s.to[1]
                    };
                    *cur = next;
                    *left = 1 + states[usize::from(next)].stay.sample(&mut self.rng);
                }
                let s = &states[usize::from(*cur)];
                if s.loss <= 0.0 || s.loss >= 1.0 {
                    let n = *left;
                    *left = 0;
                    return (n, s.loss >= 1.0);
                }
                if *pending_loss {
                    *pending_loss = false;
                    *left -= 1;
                    return (1, true);
                }
                let gap = s.gap.sample(&mut self.rng);
                if gap >= *left {
                    let n = *left;
                    *left = 0;
                    (n, false)
                } else if gap == 0 {
                    *left -= 1;
                    (1, true)
                } else {
                    *left -= gap;
                    *pending_loss = true;
                    (gap, false)
                }
            }
        }
    }

    /// Decides the next `packets` packets of the stream and appends their lost runs (packet
    /// indices from 0) to `out`, merging adjacent losses. `packets` must fit in `u32`.
    pub fn fill(&mut self, packets: u64, out: &mut Vec<PacketRun>) {
        let packets = packets.min(u64::from(u32::MAX));
        let mut pos = 0u64;
        while pos < packets {
            if self.seg_left == 0 {
                let (n, lost) = self.next_segment();
                self.seg_left = n;
                self.seg_lost = lost;
                continue;
            }
            let take = self.seg_left.min(packets - pos);
            if self.seg_lost {
                // pos and take are below 2^32 by the clamp above.
                let start = pos as u32;
                match out.last_mut() {
                    Some(last) if last.end() == start => last.len += take as u32,
                    _ => out.push(PacketRun {
                        start,
                        len: take as u32,
                    }),
                }
            }
            pos += take;
            self.seg_left -= take;
        }
    }
}
