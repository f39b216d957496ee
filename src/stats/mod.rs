//! Loss statistics: what each connection sent and lost, broken down by collective and phase.
//!
//! The data path only bumps relaxed atomics in a fixed table per connection (no allocation,
//! no shared lock); histograms sit behind a per-connection mutex that only NCCL's progress
//! thread takes, once per message. Snapshots read everything into plain [`Snapshot`] values
//! that serialise to the JSON files `lossy report` reads.

pub mod writer;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Number of collective slots: "unknown" plus NCCL's function codes 0..=14.
pub const OP_SLOTS: usize = 16;

/// Number of training phases tracked: any (unset), forward, backward.
pub const PHASE_SLOTS: usize = 3;

/// NCCL's collective function names, indexed by `ncclFunc_t` (stable since NCCL 2.27).
const NCCL_FUNC_NAMES: [&str; OP_SLOTS - 1] = [
    "Broadcast",
    "Reduce",
    "AllGather",
    "ReduceScatter",
    "AllReduce",
    "SendRecv",
    "Send",
    "Recv",
    "AllToAll",
    "Scatter",
    "Gather",
    "AllGatherV",
    "PutSignal",
    "Signal",
    "WaitSignal",
];

/// Name of the collective in stats slot `slot` (0 is "Unknown").
pub fn op_name(slot: usize) -> &'static str {
    match slot {
        0 => "Unknown",
        s => NCCL_FUNC_NAMES.get(s - 1).copied().unwrap_or("Unknown"),
    }
}

/// Stats slot of the `op` bitmask NCCL passes to `setNetAttr` (one bit set: `1 << ncclFunc`).
pub fn op_slot(op_bits: u32) -> usize {
    if op_bits == 0 {
        return 0;
    }
    let func = op_bits.trailing_zeros() as usize;
    if func + 1 < OP_SLOTS {
        func + 1
    } else {
        0
    }
}

/// Name of phase slot `slot`.
pub fn phase_name(slot: usize) -> &'static str {
    match slot {
        1 => "forward",
        2 => "backward",
        _ => "any",
    }
}

#[derive(Default)]
struct Cell {
    messages: AtomicU64,
    bytes: AtomicU64,
    packets: AtomicU64,
    lost_packets: AtomicU64,
    loss_events: AtomicU64,
    retransmit_delay_ns: AtomicU64,
}

/// Counts of one (collective, phase) cell, or of a whole connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Messages sent.
    pub messages: u64,
    /// Payload bytes sent.
    pub bytes: u64,
    /// Packets (of the profile's `mtu`) the messages were cut into.
    pub packets: u64,
    /// Packets lost.
    pub lost_packets: u64,
    /// Runs of consecutive lost packets within a message.
    pub loss_events: u64,
    /// Delay added by retransmissions, in nanoseconds.
    pub retransmit_delay_ns: u64,
}

impl Counts {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &Counts) {
        self.messages += other.messages;
        self.bytes += other.bytes;
        self.packets += other.packets;
        self.lost_packets += other.lost_packets;
        self.loss_events += other.loss_events;
        self.retransmit_delay_ns += other.retransmit_delay_ns;
    }

    /// Lost packets over packets (0 when nothing was sent).
    pub fn loss_rate(&self) -> f64 {
        if self.packets == 0 {
            0.0
        } else {
            self.lost_packets as f64 / self.packets as f64
        }
    }
}

impl Cell {
    fn read(&self) -> Counts {
        Counts {
            messages: self.messages.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            packets: self.packets.load(Ordering::Relaxed),
            lost_packets: self.lost_packets.load(Ordering::Relaxed),
            loss_events: self.loss_events.load(Ordering::Relaxed),
            retransmit_delay_ns: self.retransmit_delay_ns.load(Ordering::Relaxed),
        }
    }
}

/// What one message cost, as the sender decided it.
#[derive(Clone, Copy, Debug, Default)]
pub struct MessageRecord {
    /// Collective slot (see [`op_slot`]).
    pub op: usize,
    /// Phase slot (see [`phase_name`]).
    pub phase: usize,
    /// Payload bytes.
    pub bytes: u64,
    /// Packets the message was cut into.
    pub packets: u64,
    /// Packets lost.
    pub lost_packets: u64,
    /// Runs of consecutive lost packets.
    pub loss_events: u64,
    /// Retransmission delay added, in nanoseconds.
    pub retransmit_delay_ns: u64,
}

/// Largest burst or latency value a histogram keeps exactly; larger ones are clamped.
const HISTOGRAM_MAX: u64 = 1 << 40;

fn new_histogram() -> Histogram<u64> {
    // Bounds are fixed up front so recording never allocates.
    Histogram::new_with_bounds(1, HISTOGRAM_MAX, 3).expect("constant histogram bounds are valid")
}

struct Histograms {
    bursts: Histogram<u64>,
    latency_ns: Histogram<u64>,
}

/// Statistics of one sending connection.
pub struct ConnectionStats {
    /// Communicator id of the owning context (0 for the implicit one).
    pub comm_id: u64,
    /// Position of the connection among its context's connections.
    pub index: u32,
    cells: Box<[Cell]>,
    histograms: Mutex<Histograms>,
}

impl ConnectionStats {
    /// Empty statistics for connection `index` of communicator `comm_id`.
    pub fn new(comm_id: u64, index: u32) -> Self {
        ConnectionStats {
            comm_id,
            index,
            cells: (0..OP_SLOTS * PHASE_SLOTS)
                .map(|_| Cell::default())
                .collect(),
            histograms: Mutex::new(Histograms {
                bursts: new_histogram(),
                latency_ns: new_histogram(),
            }),
        }
    }

    /// Counts one message.
    pub fn record_message(&self, record: &MessageRecord) {
        let slot = record.op.min(OP_SLOTS - 1) * PHASE_SLOTS + record.phase.min(PHASE_SLOTS - 1);
        let cell = &self.cells[slot];
        cell.messages.fetch_add(1, Ordering::Relaxed);
        cell.bytes.fetch_add(record.bytes, Ordering::Relaxed);
        cell.packets.fetch_add(record.packets, Ordering::Relaxed);
        cell.lost_packets
            .fetch_add(record.lost_packets, Ordering::Relaxed);
        cell.loss_events
            .fetch_add(record.loss_events, Ordering::Relaxed);
        cell.retransmit_delay_ns
            .fetch_add(record.retransmit_delay_ns, Ordering::Relaxed);
    }

    /// Records a finished burst of `len` consecutive lost packets.
    pub fn record_burst(&self, len: u64) {
        if let Ok(mut h) = self.histograms.lock() {
            h.bursts.saturating_record(len.clamp(1, HISTOGRAM_MAX));
        }
    }

    /// Records how long a message took from `isend` to completion.
    pub fn record_latency_ns(&self, ns: u64) {
        if let Ok(mut h) = self.histograms.lock() {
            h.latency_ns.saturating_record(ns.clamp(1, HISTOGRAM_MAX));
        }
    }

    /// Reads the connection's statistics.
    pub fn snapshot(&self) -> ConnectionSnapshot {
        let mut by_op = Vec::new();
        let mut total = Counts::default();
        for (slot, cell) in self.cells.iter().enumerate() {
            let counts = cell.read();
            if counts.messages == 0 {
                continue;
            }
            total.add(&counts);
            by_op.push(OpCounts {
                op: op_name(slot / PHASE_SLOTS).to_string(),
                phase: phase_name(slot % PHASE_SLOTS).to_string(),
                counts,
            });
        }
        let (bursts, latency) = match self.histograms.lock() {
            Ok(h) => (histogram_bins(&h.bursts), latency_summary(&h.latency_ns)),
            Err(_) => (Vec::new(), LatencySummary::default()),
        };
        ConnectionSnapshot {
            comm_id: self.comm_id,
            index: self.index,
            total,
            by_op,
            burst_lengths: bursts,
            latency_us: latency,
        }
    }
}

fn histogram_bins(h: &Histogram<u64>) -> Vec<(u64, u64)> {
    h.iter_recorded()
        .map(|v| {
            (
                h.highest_equivalent(v.value_iterated_to()),
                v.count_at_value(),
            )
        })
        .collect()
}

fn latency_summary(h: &Histogram<u64>) -> LatencySummary {
    if h.is_empty() {
        return LatencySummary::default();
    }
    let us = |ns: u64| ns as f64 / 1000.0;
    LatencySummary {
        count: h.len(),
        p50: us(h.value_at_quantile(0.50)),
        p90: us(h.value_at_quantile(0.90)),
        p99: us(h.value_at_quantile(0.99)),
        max: us(h.max()),
    }
}

/// Counts of one collective in one phase.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpCounts {
    /// Collective name (`AllReduce`, ..., `Unknown`).
    pub op: String,
    /// Phase name (`any`, `forward`, `backward`).
    pub phase: String,
    /// The counts.
    #[serde(flatten)]
    pub counts: Counts,
}

/// Message latency percentiles in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Messages measured.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// A connection's statistics at one moment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConnectionSnapshot {
    /// Communicator id.
    pub comm_id: u64,
    /// Connection index within the communicator's context.
    pub index: u32,
    /// Totals over all collectives and phases.
    pub total: Counts,
    /// Non-empty (collective, phase) cells.
    pub by_op: Vec<OpCounts>,
    /// Burst length histogram as (length, count) pairs.
    pub burst_lengths: Vec<(u64, u64)>,
    /// Message latency from isend to completion.
    pub latency_us: LatencySummary,
}

/// Every connection this process has opened, live or closed, so a snapshot covers the run.
#[derive(Default)]
pub struct Registry {
    connections: Mutex<Vec<Arc<ConnectionStats>>>,
}

impl Registry {
    /// Adds a connection (once, when it opens).
    pub fn register(&self, stats: Arc<ConnectionStats>) {
        if let Ok(mut list) = self.connections.lock() {
            list.push(stats);
        }
    }

    /// Reads every connection's statistics.
    pub fn snapshot(&self) -> Vec<ConnectionSnapshot> {
        match self.connections.lock() {
            Ok(list) => list.iter().map(|c| c.snapshot()).collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// The process-wide registry.
pub fn registry() -> &'static Registry {
    static REGISTRY: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    REGISTRY.get_or_init(Registry::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_bits_map_to_nccl_function_names() {
        assert_eq!(op_name(op_slot(0)), "Unknown");
        assert_eq!(op_name(op_slot(1 << 0)), "Broadcast");
        assert_eq!(op_name(op_slot(1 << 2)), "AllGather");
        assert_eq!(op_name(op_slot(1 << 3)), "ReduceScatter");
        assert_eq!(op_name(op_slot(1 << 4)), "AllReduce");
        assert_eq!(op_name(op_slot(1 << 5)), "SendRecv");
        assert_eq!(op_name(op_slot(1 << 31)), "Unknown");
    }

    #[test]
    fn messages_accumulate_per_op_and_phase() {
        let stats = ConnectionStats::new(7, 1);
        let rec = |op, phase, lost| MessageRecord {
            op,
            phase,
            bytes: 8192,
            packets: 2,
            lost_packets: lost,
            loss_events: lost.min(1),
            retransmit_delay_ns: 0,
        };
        stats.record_message(&rec(5, 2, 1));
        stats.record_message(&rec(5, 2, 0));
        stats.record_message(&rec(3, 0, 2));
        stats.record_burst(1);
        stats.record_burst(2);
        let snap = stats.snapshot();
        assert_eq!(snap.total.messages, 3);
        assert_eq!(snap.total.packets, 6);
        assert_eq!(snap.total.lost_packets, 3);
        assert_eq!(snap.by_op.len(), 2);
        let allreduce = snap
            .by_op
            .iter()
            .find(|c| c.op == "AllReduce")
            .expect("AllReduce cell");
        assert_eq!(allreduce.phase, "backward");
        assert_eq!(allreduce.counts.messages, 2);
        assert_eq!(allreduce.counts.lost_packets, 1);
        assert_eq!(snap.burst_lengths, vec![(1, 1), (2, 1)]);
    }
}
