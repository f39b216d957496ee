//! The sender's decision for one message: which packets are lost and what that does.
//! This is the contract between the loss engine (which fills a plan) and the transports
//! (which carry it on the wire and apply it at the receiver).

use std::time::Duration;

/// What a lost packet does to the data the receiver sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// The bytes arrive as zeros (the sender does not transmit them).
    #[default]
    Zero,
    /// The receive buffer keeps what it held before (the sender does not transmit them).
    Stale,
    /// The data arrives intact but late: each loss event costs a timeout and a resend.
    Retransmit,
    /// The packet arrives with one bit flipped.
    Bitflip,
}

impl Effect {
    /// The name as profiles write it (and as it serialises).
    pub fn name(self) -> &'static str {
        match self {
            Effect::Zero => "zero",
            Effect::Stale => "stale",
            Effect::Retransmit => "retransmit",
            Effect::Bitflip => "bitflip",
        }
    }

    /// True when the receiver's data differs from what was sent (all but `Retransmit`).
    pub fn corrupts_data(self) -> bool {
        !matches!(self, Effect::Retransmit)
    }

    /// True when the sender leaves lost packets' bytes out of the stream.
    pub fn skips_bytes(self) -> bool {
        matches!(self, Effect::Zero | Effect::Stale)
    }
}

/// A run of consecutive lost packets: packets `start .. start + len` of the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketRun {
    /// Index of the first lost packet in the run.
    pub start: u32,
    /// Number of lost packets in the run (at least 1).
    pub len: u32,
}

impl PacketRun {
    /// One past the last lost packet.
    pub fn end(&self) -> u32 {
        self.start + self.len
    }
}

/// Default packet size in bytes.
pub const DEFAULT_MTU: u32 = 4096;

/// Default retransmission timeout per loss event.
pub const DEFAULT_RETRANSMIT_TIMEOUT: Duration = Duration::from_micros(200);

/// Longest retransmission timeout per loss event: the most a chunk header carries, and so the
/// most a profile may ask for.
pub const MAX_RETRANSMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// The fate of one message, decided by the sender. `lost` is sorted, runs are disjoint,
/// and every run lies inside the message's packets.
#[derive(Clone, Debug, PartialEq)]
pub struct LossPlan {
    /// What lost packets do.
    pub effect: Effect,
    /// Packet size in bytes; the last packet of a message may be shorter.
    pub mtu: u32,
    /// The lost packets, as sorted disjoint runs.
    pub lost: Vec<PacketRun>,
    /// Delay per loss event under [`Effect::Retransmit`].
    pub retransmit_timeout: Duration,
    /// Seed that picks the flipped bit of each packet under [`Effect::Bitflip`].
    pub flip_seed: u64,
}

impl Default for LossPlan {
    fn default() -> Self {
        Self::lossless()
    }
}

impl LossPlan {
    /// A plan that loses nothing.
    pub fn lossless() -> Self {
        LossPlan {
            effect: Effect::Zero,
            mtu: DEFAULT_MTU,
            lost: Vec::new(),
            retransmit_timeout: DEFAULT_RETRANSMIT_TIMEOUT,
            flip_seed: 0,
        }
    }

    /// True when no packet is lost.
    pub fn is_lossless(&self) -> bool {
        self.lost.is_empty()
    }

    /// Number of lost packets.
    pub fn lost_packets(&self) -> u64 {
        self.lost.iter().map(|run| u64::from(run.len)).sum()
    }

    /// Number of loss events (runs of consecutive lost packets).
    pub fn loss_events(&self) -> u64 {
        self.lost.len() as u64
    }

    /// Number of packets a message of `len` bytes is cut into (0 for an empty message).
    pub fn packets_in(&self, len: usize) -> u64 {
        packet_count(len, self.mtu)
    }
}

/// Number of `mtu`-byte packets in `len` bytes (0 for an empty message).
pub fn packet_count(len: usize, mtu: u32) -> u64 {
    let (len, mtu) = (len as u64, u64::from(mtu.max(1)));
    if len <= mtu {
        // Every message of up to one packet: no division (tens of cycles) per message.
        u64::from(len > 0)
    } else {
        len.div_ceil(mtu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effect_names_are_the_serialised_names() {
        for effect in [
            Effect::Zero,
            Effect::Stale,
            Effect::Retransmit,
            Effect::Bitflip,
        ] {
            assert_eq!(
                serde_json::to_value(effect).unwrap(),
                serde_json::json!(effect.name())
            );
        }
    }
}
