//! Message latencies of one connection, counted without a lock: one relaxed load and store
//! per message into buckets laid out as the statistics' histograms are (two significant
//! figures), turned into a histogram only when a snapshot is taken. A lock and a histogram
//! update per completed send cost 0.3-0.9% of a 64 KiB-1 MiB all-reduce on a 2-core host
//! (docs/remaining-gap.md, "What the runtime's bookkeeping is worth").

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use hdrhistogram::Histogram;

use crate::ids::OP_SLOTS;

/// Longest message latency told apart, in nanoseconds (about 68 s); longer ones count here.
pub(super) const LATENCY_MAX_NS: u64 = 1 << 36;

/// Values below this are counted one by one (2^8: the histogram's unit-resolution range).
const EXACT: u64 = 256;
/// Buckets per power of two above [`EXACT`]: the histogram's half sub-bucket count.
const PER_OCTAVE: usize = 128;
/// Buckets of one collective: the exact range, then 128 per power of two from 2^8 to 2^36.
const BUCKETS: usize = EXACT as usize + (36 - 8) * PER_OCTAVE + 1;

/// Latency counts per collective, each allocated the first time the collective completes a
/// message (15 KiB).
pub(super) struct LatencyCounts {
    ops: [OnceLock<Box<[AtomicU32]>>; OP_SLOTS],
}

impl LatencyCounts {
    pub(super) fn new() -> Self {
        LatencyCounts {
            ops: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// Counts one message of collective `op` (clamped to the last slot) that took `ns`.
    /// Counts saturate. Meant for one writer per connection (NCCL's progress thread, under
    /// the sender's lock): concurrent calls stay sound but may lose counts.
    pub(super) fn record(&self, op: usize, ns: u64) {
        let buckets = self.ops[op.min(OP_SLOTS - 1)]
            .get_or_init(|| (0..BUCKETS).map(|_| AtomicU32::new(0)).collect());
        let cell = &buckets[bucket(ns)];
        let n = cell.load(Ordering::Relaxed);
        cell.store(n.saturating_add(1), Ordering::Relaxed);
    }

    /// The latencies of collective `op` as a histogram of two significant figures, or `None`
    /// when it never completed a message.
    pub(super) fn histogram(&self, op: usize) -> Option<Histogram<u32>> {
        let buckets = self.ops.get(op)?.get()?;
        let mut h = new_histogram();
        for (i, cell) in buckets.iter().enumerate() {
            let n = cell.load(Ordering::Relaxed);
            if n > 0 {
                // Each bucket lies within one of the histogram's: its lowest value stands
                // for all of it.
                h.saturating_record_n(lowest(i), n);
            }
        }
        Some(h)
    }
}

/// The histogram latencies are read into.
fn new_histogram() -> Histogram<u32> {
    Histogram::new_with_bounds(1, LATENCY_MAX_NS, 2).expect("constant bounds are valid")
}

/// The bucket of a latency of `ns` (clamped to 1..=[`LATENCY_MAX_NS`]).
fn bucket(ns: u64) -> usize {
    let v = ns.clamp(1, LATENCY_MAX_NS);
    if v < EXACT {
        return v as usize;
    }
    let octave = 63 - v.leading_zeros() as usize; // 8..=36
    let sub = (v >> (octave - 7)) as usize; // 128..=255
    EXACT as usize + (octave - 8) * PER_OCTAVE + (sub - PER_OCTAVE)
}

/// The lowest latency of bucket `i`.
fn lowest(i: usize) -> u64 {
    if i < EXACT as usize {
        return i as u64;
    }
    let k = i - EXACT as usize;
    let octave = 8 + k / PER_OCTAVE;
    ((PER_OCTAVE + k % PER_OCTAVE) as u64) << (octave - 7)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Latencies to check: every value up to 70,000 ns, each power of two and its
    /// neighbours up to the top, and a fixed pseudo-random spread over the whole range.
    fn values() -> Vec<u64> {
        let mut v: Vec<u64> = (1..=70_000).collect();
        for p in 0..=36 {
            let x = 1u64 << p;
            v.extend([x - 1, x, x + 1]);
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            v.push((state >> 28) % LATENCY_MAX_NS + 1);
        }
        v.retain(|&x| (1..=LATENCY_MAX_NS).contains(&x));
        v
    }

    #[test]
    fn every_bucket_lies_inside_one_histogram_bucket() {
        // Counting a latency in its bucket and reading the bucket back as its lowest value
        // must land where recording the latency itself would: the same histogram bucket.
        let h = new_histogram();
        for ns in values() {
            let i = bucket(ns);
            assert!(i < BUCKETS, "{ns} ns: bucket {i} of {BUCKETS}");
            assert!(
                lowest(i) <= ns,
                "{ns} ns: bucket {i} starts at {}",
                lowest(i)
            );
            assert_eq!(
                h.highest_equivalent(lowest(i)),
                h.highest_equivalent(ns),
                "{ns} ns read back as {}",
                lowest(i)
            );
        }
        assert_eq!(bucket(LATENCY_MAX_NS), BUCKETS - 1);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket(0), 1);
    }

    #[test]
    fn read_back_gives_the_bins_of_recording_each_latency() {
        let counts = LatencyCounts::new();
        let mut direct = new_histogram();
        for ns in values().into_iter().step_by(7) {
            counts.record(3, ns);
            direct.saturating_record(ns);
        }
        let read = counts.histogram(3).expect("recorded");
        let bins = crate::stats::histogram_bins;
        assert_eq!(bins(&read), bins(&direct));
        assert!(counts.histogram(2).is_none(), "op 2 never recorded");
        assert!(counts.histogram(OP_SLOTS).is_none());
    }

    #[test]
    fn ops_past_the_table_count_in_its_last_slot() {
        let counts = LatencyCounts::new();
        counts.record(OP_SLOTS + 5, 1000);
        assert_eq!(
            counts.histogram(OP_SLOTS - 1).map(|h| h.len()),
            Some(1),
            "an op past the table"
        );
    }
}
