//! The side message: a sender's [`LossPlan`] for one message, serialized into a small
//! fixed-capacity buffer that travels on the inner plugin right before the data message.
//! Pure code: encoding, decoding and every check the receiver makes.
//!
//! Layout (little-endian, [`HEADER`] bytes, then the payload):
//! `0 magic "LsWp" | 4 version u8 | 5 effect u8 | 6 encoding u8 (0 runs, 1 bitmap) | 7 0 |
//! 8 tag i32 | 12 mtu u32 | 16 message size u64 | 24 sequence number u64 |
//! 32 retransmit timeout ns u64 | 40 flip seed u64 | 48 run count u32 | 52 payload bytes u32 |
//! 56 0 u64`, then either `run count × (first packet u32, packet count u32)` or a bitmap of
//! the message's packets (bit `i % 8` of byte `i / 8` set: packet `i` lost).

use std::time::Duration;

use crate::loss::effect::{check_runs, packet_count};
use crate::loss::plan::{Effect, LossPlan, PacketRun};
use crate::{Error, Result};

/// Bytes of the fixed header.
pub const HEADER: usize = 64;
/// Capacity of one side message (header + payload); receivers post buffers of this size.
pub const CAPACITY: usize = 16 * 1024;
/// Most payload bytes.
pub const MAX_PAYLOAD: usize = CAPACITY - HEADER;

const MAGIC: &[u8; 4] = b"LsWp";
const VERSION: u8 = 1;
const RUNS: u8 = 0;
const BITMAP: u8 = 1;
/// Longest retransmit timeout we accept from a peer.
const MAX_TIMEOUT_NS: u64 = 10_000_000_000;

/// What a side message says about the data message that follows it.
#[derive(Clone, Debug, PartialEq)]
pub struct SideInfo {
    /// The sender's plan.
    pub plan: LossPlan,
    /// Size of the data message in bytes.
    pub size: u64,
    /// Tag of the data message.
    pub tag: i32,
    /// The message's number on its connection (0, 1, 2, ...).
    pub seq: u64,
}

fn effect_code(effect: Effect) -> u8 {
    match effect {
        Effect::Zero => 0,
        Effect::Stale => 1,
        Effect::Retransmit => 2,
        Effect::Bitflip => 3,
    }
}

fn put(out: &mut [u8], at: usize, bytes: &[u8]) {
    out[at..at + bytes.len()].copy_from_slice(bytes);
}

/// Serializes `plan` for a message of `size` bytes into `out` (at least [`CAPACITY`] bytes);
/// returns the number of bytes to send. Runs or a bitmap, whichever is smaller; an error
/// when neither fits.
pub fn encode(plan: &LossPlan, size: u64, tag: i32, seq: u64, out: &mut [u8]) -> Result<usize> {
    if out.len() < CAPACITY {
        return Err(Error::internal("side buffer smaller than its capacity"));
    }
    let packets = packet_count(size as usize, plan.mtu);
    let runs_bytes = plan.lost.len() * 8;
    let bitmap_bytes = packets.div_ceil(8) as usize;
    let (encoding, payload) = if runs_bytes <= bitmap_bytes || plan.lost.is_empty() {
        (RUNS, runs_bytes)
    } else {
        (BITMAP, bitmap_bytes)
    };
    if payload > MAX_PAYLOAD {
        return Err(Error::invalid_usage(format!(
            "wrap mode: the loss plan of a {size}-byte message ({packets} packets of {} bytes, \
             {} loss runs) needs {payload} bytes, more than a side message carries \
             ({MAX_PAYLOAD}); use a larger mtu",
            plan.mtu,
            plan.lost.len()
        )));
    }
    out[..HEADER + payload].fill(0);
    put(out, 0, MAGIC);
    out[4] = VERSION;
    out[5] = effect_code(plan.effect);
    out[6] = encoding;
    put(out, 8, &tag.to_le_bytes());
    put(out, 12, &plan.mtu.to_le_bytes());
    put(out, 16, &size.to_le_bytes());
    put(out, 24, &seq.to_le_bytes());
    let timeout = plan.retransmit_timeout.as_nanos().min(u128::from(u64::MAX)) as u64;
    put(out, 32, &timeout.to_le_bytes());
    put(out, 40, &plan.flip_seed.to_le_bytes());
    put(out, 48, &(plan.lost.len() as u32).to_le_bytes());
    put(out, 52, &(payload as u32).to_le_bytes());
    let body = &mut out[HEADER..HEADER + payload];
    if encoding == RUNS {
        for (i, run) in plan.lost.iter().enumerate() {
            body[i * 8..i * 8 + 4].copy_from_slice(&run.start.to_le_bytes());
            body[i * 8 + 4..i * 8 + 8].copy_from_slice(&run.len.to_le_bytes());
        }
    } else {
        for run in &plan.lost {
            for packet in run.start..run.end() {
                body[packet as usize / 8] |= 1 << (packet % 8);
            }
        }
    }
    Ok(HEADER + payload)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// How many of `bytes` (a side receive's buffer) the side message in it says it takes: its
/// header and the payload its header declares, within `bytes`; for an inner plugin that does
/// not report a receive's size. [`decode`] checks the rest.
pub fn declared_len(bytes: &[u8]) -> usize {
    if bytes.len() < HEADER {
        return bytes.len();
    }
    HEADER
        .saturating_add(u32_at(bytes, 52) as usize)
        .min(bytes.len())
}

/// Parses and checks a side message of `bytes` (exactly what arrived), reusing `lost`'s
/// allocation for the runs.
pub fn decode(bytes: &[u8], mut lost: Vec<PacketRun>) -> Result<SideInfo> {
    let bad =
        |why: &str| Error::remote(format!("wrap mode: bad side message from the peer: {why}"));
    if bytes.len() < HEADER {
        return Err(bad(&format!(
            "{} bytes, shorter than its header",
            bytes.len()
        )));
    }
    if &bytes[0..4] != MAGIC || bytes[4] != VERSION {
        return Err(bad(
            "wrong magic or version (is the peer running wrap mode too?)",
        ));
    }
    if bytes[7] != 0 || u64_at(bytes, 56) != 0 {
        return Err(bad("reserved bytes are not zero"));
    }
    let effect = match bytes[5] {
        0 => Effect::Zero,
        1 => Effect::Stale,
        2 => Effect::Retransmit,
        3 => Effect::Bitflip,
        e => return Err(bad(&format!("unknown effect {e}"))),
    };
    let encoding = bytes[6];
    let tag = u32_at(bytes, 8) as i32;
    let mtu = u32_at(bytes, 12);
    let size = u64_at(bytes, 16);
    let seq = u64_at(bytes, 24);
    let timeout = u64_at(bytes, 32);
    let flip_seed = u64_at(bytes, 40);
    let runs = u32_at(bytes, 48) as usize;
    let payload = u32_at(bytes, 52) as usize;
    if mtu < 64 || size > 1 << 40 || timeout > MAX_TIMEOUT_NS {
        return Err(bad(&format!(
            "mtu {mtu}, size {size}, timeout {timeout} ns out of range"
        )));
    }
    if HEADER + payload != bytes.len() {
        return Err(bad(&format!(
            "payload of {payload} bytes in a {}-byte message",
            bytes.len()
        )));
    }
    let packets = packet_count(size as usize, mtu);
    let body = &bytes[HEADER..];
    lost.clear();
    match encoding {
        RUNS => {
            if payload != runs * 8 {
                return Err(bad("run count and payload disagree"));
            }
            lost.extend((0..runs).map(|i| PacketRun {
                start: u32_at(body, i * 8),
                len: u32_at(body, i * 8 + 4),
            }));
        }
        BITMAP => {
            if payload as u64 != packets.div_ceil(8) {
                return Err(bad("bitmap size does not match the message's packets"));
            }
            let mut packet = 0u64;
            while packet < packets {
                if body[packet as usize / 8] & (1 << (packet % 8)) == 0 {
                    packet += 1;
                    continue;
                }
                let start = packet;
                while packet < packets && body[packet as usize / 8] & (1 << (packet % 8)) != 0 {
                    packet += 1;
                }
                lost.push(PacketRun {
                    start: start as u32,
                    len: (packet - start) as u32,
                });
            }
            if lost.len() != runs || body.iter().skip(packets as usize / 8 + 1).any(|&b| b != 0) {
                return Err(bad("bitmap does not match its run count"));
            }
            if packets % 8 != 0 && body[packets as usize / 8] >> (packets % 8) != 0 {
                return Err(bad("bitmap marks packets past the end of the message"));
            }
        }
        e => return Err(bad(&format!("unknown encoding {e}"))),
    }
    check_runs(&lost, packets, 0).map_err(|e| {
        bad(&format!(
            "lost runs are not sorted, disjoint and inside: {e:?}"
        ))
    })?;
    Ok(SideInfo {
        plan: LossPlan {
            effect,
            mtu,
            lost,
            retransmit_timeout: Duration::from_nanos(timeout),
            flip_seed,
        },
        size,
        tag,
        seq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(effect: Effect, mtu: u32, runs: &[(u32, u32)]) -> LossPlan {
        LossPlan {
            effect,
            mtu,
            lost: runs
                .iter()
                .map(|&(start, len)| PacketRun { start, len })
                .collect(),
            retransmit_timeout: Duration::from_micros(150),
            flip_seed: 0xfeed,
        }
    }

    #[test]
    fn plans_survive_the_round_trip_in_both_encodings() {
        let mut buf = vec![0u8; CAPACITY];
        // Few runs: the run list is smaller.
        let p = plan(Effect::Bitflip, 4096, &[(0, 1), (7, 3)]);
        let n = encode(&p, 1 << 20, 9, 42, &mut buf).unwrap();
        assert_eq!(n, HEADER + 16);
        let info = decode(&buf[..n], Vec::new()).unwrap();
        assert_eq!(
            (info.plan, info.size, info.tag, info.seq),
            (p, 1 << 20, 9, 42)
        );
        // Many short runs: the bitmap (256 packets = 32 bytes) is smaller than 64 runs.
        let runs: Vec<(u32, u32)> = (0..64).map(|i| (i * 4, 1)).collect();
        let p = plan(Effect::Zero, 4096, &runs);
        let n = encode(&p, 1 << 20, -3, 0, &mut buf).unwrap();
        assert_eq!(n, HEADER + 32);
        assert_eq!(buf[6], BITMAP);
        let info = decode(&buf[..n], Vec::new()).unwrap();
        assert_eq!((info.plan, info.tag), (p, -3));
        // Lossless and empty messages.
        let p = plan(Effect::Retransmit, 4096, &[]);
        let n = encode(&p, 0, 1, 5, &mut buf).unwrap();
        assert_eq!(n, HEADER);
        assert_eq!(decode(&buf[..n], Vec::new()).unwrap().plan, p);
        // A bitmap ending mid-byte (10 packets).
        let p = plan(Effect::Stale, 64, &[(0, 1), (2, 1), (4, 1), (9, 1)]);
        let n = encode(&p, 640, 1, 1, &mut buf).unwrap();
        assert_eq!((n, buf[6]), (HEADER + 2, BITMAP));
        assert_eq!(decode(&buf[..n], Vec::new()).unwrap().plan, p);
    }

    #[test]
    fn damaged_or_impossible_side_messages_are_refused() {
        let mut buf = vec![0u8; CAPACITY];
        let p = plan(Effect::Zero, 4096, &[(1, 2)]);
        // 256 packets: one run (8 bytes) is smaller than the bitmap (32 bytes).
        let n = encode(&p, 1 << 20, 0, 0, &mut buf).unwrap();
        assert_eq!(buf[6], RUNS);
        let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
        let mut b = buf[..n].to_vec();
        b[0] = b'X';
        cases.push((b, "magic"));
        let mut b = buf[..n].to_vec();
        b[5] = 9;
        cases.push((b, "unknown effect"));
        let mut b = buf[..n].to_vec();
        b[HEADER] = 255; // run 255..257 of a 256-packet message
        cases.push((b, "inside"));
        cases.push((buf[..n - 1].to_vec(), "payload"));
        cases.push((buf[..10].to_vec(), "shorter"));
        for (bytes, want) in cases {
            let err = decode(&bytes, Vec::new()).unwrap_err();
            assert!(err.message.contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn plans_too_large_for_a_side_message_are_an_error() {
        let mut buf = vec![0u8; CAPACITY];
        // 1 GiB at mtu 64 = 16 Mi packets: the bitmap alone is 2 MiB.
        let runs: Vec<(u32, u32)> = (0..10_000).map(|i| (i * 2, 1)).collect();
        let p = plan(Effect::Zero, 64, &runs);
        let err = encode(&p, 1 << 30, 0, 0, &mut buf).unwrap_err();
        assert!(err.message.contains("use a larger mtu"), "{err}");
    }
}
