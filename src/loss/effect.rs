//! What a loss plan does to bytes: pure functions shared by the sender (which bytes go on the
//! wire) and the receiver (which bytes to zero, keep or flip). No I/O, no allocation.
//!
//! A message of `len` bytes is cut into packets of `mtu` bytes (the last may be shorter);
//! a [`PacketRun`] names consecutive lost packets. Transports move a message in contiguous
//! chunks, so every function here works on one byte span of the message at a time.

use std::ops::Range;

pub use crate::loss::plan::packet_count;
use crate::loss::plan::PacketRun;

/// Smallest packet size a plan may use: keeps the number of packets, and so the number of
/// runs a peer may describe, within a small fraction of the message size.
pub const MIN_MTU: u32 = 64;

/// Why a list of runs is not a valid plan for a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunError {
    /// A run has no packet in it.
    Empty,
    /// A run starts before the end of the previous one.
    Unsorted,
    /// A run reaches past the message's last packet.
    OutOfRange,
    /// There are more runs than packets.
    TooMany,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunError::Empty => "a lost-packet run is empty",
            RunError::Unsorted => "lost-packet runs are not sorted and disjoint",
            RunError::OutOfRange => "a lost-packet run lies past the end of the message",
            RunError::TooMany => "more lost-packet runs than packets",
        })
    }
}

/// Checks that `runs` are non-empty, sorted, disjoint and inside `packets` packets.
/// `prev_end` is where the previous run ended (0 for the first), so a long list can be
/// checked piece by piece as it arrives; returns the new end.
pub fn check_runs(runs: &[PacketRun], packets: u64, prev_end: u64) -> Result<u64, RunError> {
    let mut end = prev_end;
    for run in runs {
        if run.len == 0 {
            return Err(RunError::Empty);
        }
        let start = u64::from(run.start);
        if start < end {
            return Err(RunError::Unsorted);
        }
        end = start + u64::from(run.len);
        if end > packets {
            return Err(RunError::OutOfRange);
        }
    }
    Ok(end)
}

/// Bytes of the message covered by `run`, clipped to the message length.
pub fn run_bytes(run: PacketRun, mtu: u32, len: usize) -> Range<usize> {
    let mtu = u64::from(mtu.max(1));
    let clip = |packet: u64| (packet.saturating_mul(mtu)).min(len as u64) as usize;
    clip(u64::from(run.start))..clip(u64::from(run.start) + u64::from(run.len))
}

/// The runs (of a sorted, disjoint list) that touch the byte span `span` of the message.
pub fn runs_in_span(runs: &[PacketRun], mtu: u32, span: Range<usize>) -> &[PacketRun] {
    if span.is_empty() {
        return &[];
    }
    let mtu = u64::from(mtu.max(1));
    let first_packet = span.start as u64 / mtu;
    let last_packet = (span.end as u64 - 1) / mtu;
    let lo = runs.partition_point(|r| u64::from(r.start) + u64::from(r.len) <= first_packet);
    let hi = runs.partition_point(|r| u64::from(r.start) <= last_packet);
    &runs[lo..hi.max(lo)]
}

/// Lost byte ranges (absolute offsets in the message) inside `span`, in order.
pub fn lost_ranges(
    runs: &[PacketRun],
    mtu: u32,
    len: usize,
    span: Range<usize>,
) -> impl Iterator<Item = Range<usize>> + '_ {
    let (lo, hi) = (span.start, span.end);
    runs_in_span(runs, mtu, span).iter().filter_map(move |run| {
        let bytes = run_bytes(*run, mtu, len);
        let r = bytes.start.max(lo)..bytes.end.min(hi);
        (!r.is_empty()).then_some(r)
    })
}

/// Byte ranges inside `span` that are not lost (the complement of [`lost_ranges`]), in order:
/// what the sender transmits when lost packets are left out.
pub fn kept_ranges(
    runs: &[PacketRun],
    mtu: u32,
    len: usize,
    span: Range<usize>,
) -> impl Iterator<Item = Range<usize>> + '_ {
    let end = span.end;
    let mut cursor = span.start;
    let mut lost = lost_ranges(runs, mtu, len, span);
    let mut done = false;
    std::iter::from_fn(move || {
        while !done {
            match lost.next() {
                Some(r) => {
                    let kept = cursor..r.start;
                    cursor = r.end;
                    if !kept.is_empty() {
                        return Some(kept);
                    }
                }
                None => {
                    done = true;
                    let kept = cursor..end;
                    if !kept.is_empty() {
                        return Some(kept);
                    }
                }
            }
        }
        None
    })
}

/// Number of lost bytes inside `span`.
pub fn lost_bytes(runs: &[PacketRun], mtu: u32, len: usize, span: Range<usize>) -> usize {
    lost_ranges(runs, mtu, len, span).map(|r| r.len()).sum()
}

/// Zeroes the lost bytes of `slice`, which holds message bytes starting at `offset`.
pub fn zero_lost(slice: &mut [u8], offset: usize, runs: &[PacketRun], mtu: u32, len: usize) {
    let span = offset..offset + slice.len();
    for r in lost_ranges(runs, mtu, len, span) {
        slice[r.start - offset..r.end - offset].fill(0);
    }
}

/// SplitMix64's output function: a cheap, well-mixed bijection on 64-bit values.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce5_e4b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Which bit a lost packet gets flipped: `h = splitmix64(seed ^ splitmix64(packet))`, bit
/// `h mod (8 × packet length)` of the packet, counted from its first byte, least significant
/// bit first. Returns (byte offset in the message, bit in that byte); `None` for a packet
/// outside the message.
pub fn flip_position(seed: u64, packet: u64, mtu: u32, len: usize) -> Option<(usize, u8)> {
    let mtu64 = u64::from(mtu.max(1));
    let start = packet.checked_mul(mtu64)?;
    if start >= len as u64 {
        return None;
    }
    let packet_len = mtu64.min(len as u64 - start);
    let bit = splitmix64(seed ^ splitmix64(packet)) % (packet_len * 8);
    Some(((start + bit / 8) as usize, (bit % 8) as u8))
}

/// Flips one bit in every lost packet whose chosen bit (see [`flip_position`]) lies in
/// `slice`, which holds message bytes starting at `offset`. Returns how many bits it flipped.
pub fn flip_lost(
    slice: &mut [u8],
    offset: usize,
    runs: &[PacketRun],
    mtu: u32,
    len: usize,
    seed: u64,
) -> usize {
    let span = offset..offset + slice.len();
    let mtu64 = u64::from(mtu.max(1));
    let mut flipped = 0;
    for run in runs_in_span(runs, mtu, span.clone()) {
        // Only packets that overlap the span can hold a chosen bit inside it.
        let first = u64::from(run.start).max(span.start as u64 / mtu64);
        let last =
            (u64::from(run.start) + u64::from(run.len)).min((span.end as u64).div_ceil(mtu64));
        for packet in first..last {
            if let Some((byte, bit)) = flip_position(seed, packet, mtu, len) {
                if span.contains(&byte) {
                    slice[byte - offset] ^= 1 << bit;
                    flipped += 1;
                }
            }
        }
    }
    flipped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: u32, len: u32) -> PacketRun {
        PacketRun { start, len }
    }

    #[test]
    fn packet_counts() {
        assert_eq!(packet_count(0, 100), 0);
        assert_eq!(packet_count(1, 100), 1);
        assert_eq!(packet_count(100, 100), 1);
        assert_eq!(packet_count(101, 100), 2);
        assert_eq!(packet_count(5, 0), 5);
    }

    #[test]
    fn check_runs_accepts_sorted_disjoint_and_rejects_the_rest() {
        assert_eq!(check_runs(&[], 0, 0), Ok(0));
        assert_eq!(
            check_runs(&[run(0, 2), run(2, 1), run(5, 5)], 10, 0),
            Ok(10)
        );
        assert_eq!(check_runs(&[run(0, 0)], 10, 0), Err(RunError::Empty));
        assert_eq!(
            check_runs(&[run(3, 2), run(4, 1)], 10, 0),
            Err(RunError::Unsorted)
        );
        assert_eq!(check_runs(&[run(9, 2)], 10, 0), Err(RunError::OutOfRange));
        assert_eq!(
            check_runs(&[run(u32::MAX, u32::MAX)], 10, 0),
            Err(RunError::OutOfRange)
        );
        // Piecewise checking carries the previous end.
        assert_eq!(check_runs(&[run(3, 1)], 10, 4), Err(RunError::Unsorted));
        assert_eq!(check_runs(&[run(4, 1)], 10, 4), Ok(5));
    }

    #[test]
    fn run_bytes_clip_to_message() {
        assert_eq!(run_bytes(run(1, 2), 10, 25), 10..25);
        assert_eq!(run_bytes(run(0, 1), 10, 25), 0..10);
        assert_eq!(run_bytes(run(5, 1), 10, 25), 25..25);
    }

    #[test]
    fn runs_in_span_picks_overlapping_runs() {
        let runs = [run(0, 1), run(3, 2), run(8, 1)];
        assert_eq!(runs_in_span(&runs, 10, 0..10), &runs[0..1]);
        assert_eq!(runs_in_span(&runs, 10, 10..30), &[] as &[PacketRun]);
        assert_eq!(runs_in_span(&runs, 10, 29..31), &runs[1..2]);
        assert_eq!(runs_in_span(&runs, 10, 45..85), &runs[1..3]);
        assert_eq!(runs_in_span(&runs, 10, 5..5), &[] as &[PacketRun]);
    }

    #[test]
    fn lost_and_kept_ranges_partition_a_span() {
        let runs = [run(1, 1), run(2, 1), run(4, 2)];
        let len = 55;
        let span = 5..52;
        let lost: Vec<_> = lost_ranges(&runs, 10, len, span.clone()).collect();
        assert_eq!(lost, vec![10..20, 20..30, 40..52]);
        let kept: Vec<_> = kept_ranges(&runs, 10, len, span.clone()).collect();
        assert_eq!(kept, vec![5..10, 30..40]);
        assert_eq!(lost_bytes(&runs, 10, len, span), 32);
        // No runs: the whole span is kept; an empty span yields nothing.
        assert_eq!(
            kept_ranges(&[], 10, len, 3..9).collect::<Vec<_>>(),
            vec![3..9]
        );
        assert_eq!(kept_ranges(&runs, 10, len, 7..7).count(), 0);
        // Everything lost.
        assert_eq!(kept_ranges(&[run(0, 6)], 10, len, 0..55).count(), 0);
    }

    #[test]
    fn zero_lost_only_touches_lost_bytes_of_the_slice() {
        let runs = [run(1, 1), run(3, 1)];
        let mut slice = [0xffu8; 20]; // message bytes 15..35 of a 40-byte message
        zero_lost(&mut slice, 15, &runs, 10, 40);
        let expect: Vec<u8> = (15..35)
            .map(|b| {
                if (10..20).contains(&b) || (30..40).contains(&b) {
                    0
                } else {
                    0xff
                }
            })
            .collect();
        assert_eq!(slice.to_vec(), expect);
    }

    #[test]
    fn flip_positions_are_deterministic_and_inside_their_packet() {
        for packet in 0..100 {
            let (byte, bit) = flip_position(42, packet, 64, 100 * 64 - 7).expect("inside");
            assert!(byte as u64 / 64 == packet && bit < 8);
            assert_eq!(
                flip_position(42, packet, 64, 100 * 64 - 7),
                Some((byte, bit))
            );
        }
        assert_eq!(flip_position(42, 100, 64, 100 * 64), None);
        // Different seeds pick different bits somewhere.
        let a: Vec<_> = (0..32)
            .map(|p| flip_position(1, p, 4096, 1 << 20))
            .collect();
        let b: Vec<_> = (0..32)
            .map(|p| flip_position(2, p, 4096, 1 << 20))
            .collect();
        assert_ne!(a, b);
    }

    #[test]
    fn flip_lost_flips_one_bit_per_packet_across_any_split() {
        let len = 1000;
        let mtu = 64;
        let runs = [run(0, 2), run(5, 3), run(15, 1)];
        let mut whole = vec![0u8; len];
        assert_eq!(flip_lost(&mut whole, 0, &runs, mtu, len, 7), 6);
        // The same flips, done chunk by chunk with odd boundaries.
        let mut pieces = vec![0u8; len];
        let mut total = 0;
        for bounds in [0, 33, 100, 101, 500, 999, 1000].windows(2) {
            let (lo, hi) = (bounds[0], bounds[1]);
            total += flip_lost(&mut pieces[lo..hi], lo, &runs, mtu, len, 7);
        }
        assert_eq!(total, 6);
        assert_eq!(whole, pieces);
        for packet in 0..packet_count(len, mtu) {
            let range = packet as usize * 64..((packet as usize + 1) * 64).min(len);
            let ones: u32 = whole[range].iter().map(|b| b.count_ones()).sum();
            let lost = runs
                .iter()
                .any(|r| (r.start..r.end()).contains(&(packet as u32)));
            assert_eq!(ones, u32::from(lost), "packet {packet}");
        }
    }
}
