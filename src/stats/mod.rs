//! Loss statistics: what each connection sent and lost, broken down by collective and phase.
//!
//! The data path only bumps relaxed atomics in a fixed table per connection (no allocation,
//! no shared lock), latencies included (`latency`); burst lengths sit behind a per-connection
//! mutex that only NCCL's progress thread takes, when a burst of lost packets ends.
//! Snapshots read everything into plain [`Snapshot`] values that serialise to the JSON files
//! `lossy report` reads.

mod latency;
pub mod periodic;
pub mod report;
mod steps;
pub mod timeline;
pub mod writer;

pub use self::steps::{
    record_step, step_snapshot, steps_beyond, StepCounts, StepSeries, STEP_SLOTS,
};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;

use self::latency::LatencyCounts;

use crate::ids::{op_name, phase_name, OP_SLOTS, PHASE_SLOTS};
use serde::{Deserialize, Serialize};

#[derive(Default)]
struct Cell {
    messages: AtomicU64,
    bytes: AtomicU64,
    packets: AtomicU64,
    lost_packets: AtomicU64,
    loss_events: AtomicU64,
    retransmit_delay_ns: AtomicU64,
    packets_injection_off: AtomicU64,
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
    /// Of `packets`, those sent while injection was switched off (`ncclLossySetEnabled(0)`:
    /// `lossy bench --lossless`, a training phase the Python helper keeps lossless): never
    /// exposed to the loss model. 0 in files written before it was counted.
    #[serde(default)]
    pub packets_injection_off: u64,
}

impl Counts {
    /// Adds `other` into `self`, each count stopping at `u64::MAX` (counts read from a file
    /// can hold any value).
    pub fn add(&mut self, other: &Counts) {
        self.messages = self.messages.saturating_add(other.messages);
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.packets = self.packets.saturating_add(other.packets);
        self.lost_packets = self.lost_packets.saturating_add(other.lost_packets);
        self.loss_events = self.loss_events.saturating_add(other.loss_events);
        self.retransmit_delay_ns = self
            .retransmit_delay_ns
            .saturating_add(other.retransmit_delay_ns);
        self.packets_injection_off = self
            .packets_injection_off
            .saturating_add(other.packets_injection_off);
    }

    /// Lost packets over packets (0 when nothing was sent).
    pub fn loss_rate(&self) -> f64 {
        if self.packets == 0 {
            0.0
        } else {
            self.lost_packets as f64 / self.packets as f64
        }
    }

    /// Lost packets over the packets sent while injection was on: the rate to hold against
    /// the model. None when no packet was sent with injection on.
    pub fn loss_rate_injecting(&self) -> Option<f64> {
        loss_rate_injecting(self.packets, self.lost_packets, self.packets_injection_off)
    }
}

/// `lost` over the packets of `packets` that were sent with injection on (`off` were not):
/// the loss rate to hold against the model. None when no packet was sent with it on.
pub fn loss_rate_injecting(packets: u64, lost: u64, off: u64) -> Option<f64> {
    let injecting = packets.saturating_sub(off);
    (injecting > 0).then(|| lost as f64 / injecting as f64)
}

impl Cell {
    /// Adds a message. The counts go up in the order `read` reads them backwards, each with
    /// release: a snapshot taken while messages flow never reads a part above its whole
    /// (lost packets above packets, loss events above lost packets, packets sent with
    /// injection off above packets), which `lossy report` would refuse the file for.
    fn add(&self, record: &MessageRecord) {
        self.messages.fetch_add(1, Ordering::Release);
        self.bytes.fetch_add(record.bytes, Ordering::Release);
        self.packets.fetch_add(record.packets, Ordering::Release);
        self.lost_packets
            .fetch_add(record.lost_packets, Ordering::Release);
        self.loss_events
            .fetch_add(record.loss_events, Ordering::Release);
        self.retransmit_delay_ns
            .fetch_add(record.retransmit_delay_ns, Ordering::Release);
        if record.packets_injection_off > 0 {
            self.packets_injection_off
                .fetch_add(record.packets_injection_off, Ordering::Release);
        }
    }

    /// Reads the counts, the last one [`Cell::add`] adds first, each with acquire: what a
    /// count read includes, every count read after it includes too (the whole of its part).
    fn read(&self) -> Counts {
        let packets_injection_off = self.packets_injection_off.load(Ordering::Acquire);
        let retransmit_delay_ns = self.retransmit_delay_ns.load(Ordering::Acquire);
        let loss_events = self.loss_events.load(Ordering::Acquire);
        let lost_packets = self.lost_packets.load(Ordering::Acquire);
        let packets = self.packets.load(Ordering::Acquire);
        let bytes = self.bytes.load(Ordering::Acquire);
        let messages = self.messages.load(Ordering::Acquire);
        Counts {
            messages,
            bytes,
            packets,
            lost_packets,
            loss_events,
            retransmit_delay_ns,
            packets_injection_off,
        }
    }
}

/// What one message cost, as the sender decided it.
#[derive(Clone, Copy, Debug, Default)]
pub struct MessageRecord {
    /// Collective slot (see [`crate::ids::op_slot`]).
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
    /// The message's packets when it was sent with injection switched off, else 0.
    pub packets_injection_off: u64,
    /// The profile's rule that decided the message (its index in `rules`), or `None` for
    /// the profile's defaults.
    pub rule: Option<usize>,
}

/// Longest burst the histogram tells apart (longer ones are counted at this length).
const BURST_MAX: u64 = 1 << 24;

/// A burst-length histogram of one collective on one connection. Two significant figures
/// keep it at a few KiB, allocated once, the first time the collective loses a packet.
fn new_burst_histogram() -> Box<Histogram<u32>> {
    Box::new(Histogram::new_with_bounds(1, BURST_MAX, 2).expect("constant bounds are valid"))
}

/// Statistics of one sending connection.
pub struct ConnectionStats {
    /// Communicator id of the owning context (0 for the implicit one).
    pub comm_id: u64,
    /// Position of the connection among its context's connections.
    pub index: u32,
    cells: Box<[Cell]>,
    /// Per rule of the profile, then one for its defaults.
    by_rule: Box<[Cell]>,
    bursts: Mutex<Vec<Option<Box<Histogram<u32>>>>>,
    /// The burst still going at the end of the connection's last message (see
    /// [`ConnectionStats::set_open_burst`]), packed by [`pack_open_burst`]; 0: none.
    open_burst: AtomicU64,
    latencies: LatencyCounts,
}

/// Bits of [`ConnectionStats::open_burst`] that hold the burst's length (the collective's slot
/// is above them).
const OPEN_LEN_BITS: u32 = 48;

/// A burst in progress as one word: its collective's slot above [`OPEN_LEN_BITS`], its length
/// (at least 1, at most what the bits hold; the histogram stops at [`BURST_MAX`] anyway) below.
fn pack_open_burst(op: usize, len: u64) -> u64 {
    let op = op.min(OP_SLOTS - 1) as u64;
    (op << OPEN_LEN_BITS) | len.clamp(1, (1 << OPEN_LEN_BITS) - 1)
}

/// The (collective slot, length) of a word [`pack_open_burst`] made; None for 0.
fn unpack_open_burst(word: u64) -> Option<(usize, u64)> {
    let (op, len) = (
        (word >> OPEN_LEN_BITS) as usize,
        word & ((1 << OPEN_LEN_BITS) - 1),
    );
    (word != 0).then_some((op, len))
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
            by_rule: Box::new([Cell::default()]),
            bursts: Mutex::new((0..OP_SLOTS).map(|_| None).collect()),
            open_burst: AtomicU64::new(0),
            latencies: LatencyCounts::new(),
        }
    }

    /// Counts messages by which of the profile's `rules` rules (or its defaults) decided
    /// them, as [`MessageRecord::rule`] says.
    pub fn with_rules(mut self, rules: usize) -> Self {
        self.by_rule = (0..=rules).map(|_| Cell::default()).collect();
        self
    }

    /// Counts one message.
    pub fn record_message(&self, record: &MessageRecord) {
        let slot = record.op.min(OP_SLOTS - 1) * PHASE_SLOTS + record.phase.min(PHASE_SLOTS - 1);
        self.cells[slot].add(record);
        // Without rules every message is the defaults': the snapshot takes the totals, and
        // the data path saves a second cell. Rules past the profile's (none, unless a caller
        // is wrong) are not counted by rule.
        if self.by_rule.len() > 1 {
            let rule = record.rule.unwrap_or(self.by_rule.len() - 1);
            if let Some(cell) = self.by_rule.get(rule) {
                cell.add(record);
            }
        }
    }

    /// Records a finished burst of `len` consecutive lost packets, attributed to collective `op`.
    /// A burst in progress ([`ConnectionStats::set_open_burst`]) ends with the first burst
    /// recorded after it (itself, or one after a message that ended it): it is forgotten here,
    /// under the lock a snapshot reads the histograms under, so that no snapshot counts it
    /// both as in progress and as finished.
    pub fn record_burst(&self, op: usize, len: u64) {
        if let Ok(mut all) = self.bursts.lock() {
            self.open_burst.store(0, Ordering::Relaxed);
            if let Some(slot) = all.get_mut(op.min(OP_SLOTS - 1)) {
                slot.get_or_insert_with(new_burst_histogram)
                    .saturating_record(len.clamp(1, BURST_MAX));
            }
        }
    }

    /// Says which burst is in progress at the end of the message just counted: `len` lost
    /// packets so far, of collective `op` (the message's), which the next message may go on.
    /// Snapshots count it as a burst of its length so far, so that the statistics read while
    /// the connection is open (`ncclLossyStatsJson`, a periodic write, the write at an exit
    /// that closes nothing) hold it; the histogram gets it when it ends. Called after
    /// [`ConnectionStats::record_message`] and after recording the bursts the message ended
    /// (which forgot the earlier one), by the connection's one sending thread.
    pub fn set_open_burst(&self, op: usize, len: u64) {
        self.open_burst
            .store(pack_open_burst(op, len), Ordering::Release);
    }

    /// Records how long a message of collective `op` took from `isend` to completion. One
    /// writer per connection (NCCL's progress thread) is assumed: concurrent calls may lose
    /// counts.
    pub fn record_latency_ns(&self, op: usize, ns: u64) {
        self.latencies.record(op, ns);
    }

    /// Reads the connection's statistics.
    pub fn snapshot(&self) -> ConnectionSnapshot {
        // The bursts first: NCCL's progress thread counts a message before it records the
        // bursts that end in it, and taking the bursts' lock after it released it makes
        // those counts visible to the reads below. Read the other way round, a snapshot
        // taken while messages flow could hold a burst whose lost packets it does not count
        // (bursts on a collective that lost nothing), which the reader refuses.
        // The burst in progress is read under the same lock, after the histograms: the one
        // that ended it cleared it under that lock before recording itself (no burst is
        // read twice), and it was set after its message was counted (the counts read below
        // hold its lost packets).
        let bursts: Vec<Option<Vec<(u64, u64)>>> = match self.bursts.lock() {
            Ok(all) => {
                let open = unpack_open_burst(self.open_burst.load(Ordering::Acquire));
                all.iter()
                    .enumerate()
                    .map(|(op, h)| match open {
                        Some((open_op, len)) if open_op == op => {
                            let mut with_open = h.clone().unwrap_or_else(new_burst_histogram);
                            with_open.saturating_record(len.clamp(1, BURST_MAX));
                            Some(histogram_bins(&with_open))
                        }
                        _ => h.as_deref().map(histogram_bins),
                    })
                    .collect()
            }
            Err(_) => Vec::new(),
        };
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
        let mut histograms = Vec::new();
        for op in 0..OP_SLOTS {
            let burst_lengths = bursts.get(op).cloned().flatten();
            let latency_ns = self.latencies.histogram(op).map(|h| histogram_bins(&h));
            if burst_lengths.is_none() && latency_ns.is_none() {
                continue;
            }
            histograms.push(OpHistogramBins {
                op: op_name(op).to_string(),
                burst_lengths: burst_lengths.unwrap_or_default(),
                latency_ns: latency_ns.unwrap_or_default(),
            });
        }
        let defaults = self.by_rule.len() - 1;
        let by_rule = self
            .by_rule
            .iter()
            .enumerate()
            .map(|(i, cell)| RuleCounts {
                rule: (i < defaults).then_some(i),
                counts: if defaults == 0 { total } else { cell.read() },
            })
            .filter(|r| r.counts.messages > 0)
            .collect();
        ConnectionSnapshot {
            comm_id: self.comm_id,
            index: self.index,
            total,
            by_op,
            by_rule,
            histograms,
        }
    }
}

/// A histogram as (value, count) pairs, one per recorded bucket, so files can be merged.
fn histogram_bins(h: &Histogram<u32>) -> Vec<(u64, u64)> {
    h.iter_recorded()
        .map(|v| {
            (
                h.highest_equivalent(v.value_iterated_to()),
                u64::from(v.count_at_value()),
            )
        })
        .collect()
}

/// Histograms of one collective on one connection, as mergeable bins.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpHistogramBins {
    /// Collective name.
    pub op: String,
    /// Burst lengths in packets, as (length, count).
    pub burst_lengths: Vec<(u64, u64)>,
    /// Message latency from isend to completion in nanoseconds, as (value, count).
    pub latency_ns: Vec<(u64, u64)>,
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

/// Counts of the messages one rule of the profile decided.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuleCounts {
    /// The rule's index in the profile's `rules` (as in its keys, `rules.0`), or `None` for
    /// the profile's defaults.
    pub rule: Option<usize>,
    /// The counts.
    #[serde(flatten)]
    pub counts: Counts,
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
    /// Messages by the rule that decided them (files written before this was counted have
    /// none).
    #[serde(default)]
    pub by_rule: Vec<RuleCounts>,
    /// Burst-length and latency histograms per collective.
    pub histograms: Vec<OpHistogramBins>,
}

/// Every connection this process has opened, live or closed, so a snapshot covers the run.
/// A closed connection keeps only its compact snapshot (non-empty cells and recorded bins,
/// typically a few hundred bytes instead of tens of KiB of live histograms), and one that
/// never sent anything keeps nothing: opening and closing connections does not grow memory
/// beyond what the statistics file must report.
#[derive(Default)]
pub struct Registry {
    connections: Mutex<Vec<Entry>>,
}

enum Entry {
    Live(Arc<ConnectionStats>),
    Closed(ConnectionSnapshot),
}

impl Registry {
    /// Adds a connection (once, when it opens).
    pub fn register(&self, stats: Arc<ConnectionStats>) {
        if let Ok(mut list) = self.connections.lock() {
            list.push(Entry::Live(stats));
        }
    }

    /// Freezes a connection that closed: its snapshot replaces it, in place, or it goes
    /// when it recorded nothing.
    pub fn close(&self, stats: &Arc<ConnectionStats>) {
        let snap = stats.snapshot();
        let keep = snap.total.messages > 0 || !snap.histograms.is_empty();
        if let Ok(mut list) = self.connections.lock() {
            if let Some(i) = list
                .iter()
                .position(|e| matches!(e, Entry::Live(c) if Arc::ptr_eq(c, stats)))
            {
                if keep {
                    list[i] = Entry::Closed(snap);
                } else {
                    list.remove(i);
                }
            }
        }
    }

    /// Forgets every connection: the library is being unloaded, its last statistics file
    /// written (the heap memory of a static would outlive the image).
    pub fn forget_all(&self) {
        if let Ok(mut list) = self.connections.lock() {
            *list = Vec::new();
        }
    }

    /// Drops the per-rule counts of the connections that closed so far: the profile they were
    /// decided under is gone (a runtime built again under another profile), and its rule
    /// numbers would be read against the new profile's rules.
    pub fn forget_rules(&self) {
        if let Ok(mut list) = self.connections.lock() {
            for entry in list.iter_mut() {
                if let Entry::Closed(snap) = entry {
                    snap.by_rule.clear();
                }
            }
        }
    }

    /// Reads every connection's statistics.
    pub fn snapshot(&self) -> Vec<ConnectionSnapshot> {
        match self.connections.lock() {
            Ok(list) => list
                .iter()
                .map(|e| match e {
                    Entry::Live(c) => c.snapshot(),
                    Entry::Closed(s) => s.clone(),
                })
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// The process-wide registry.
pub fn registry() -> &'static Registry {
    static REGISTRY: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    REGISTRY.get_or_init(Registry::default)
}

/// Joins lost-packet runs into bursts across message boundaries: a run that reaches the last
/// packet of a message continues into a run that starts at packet 0 of the next message on the
/// same connection, as it would on a wire.
#[derive(Debug, Default)]
pub struct BurstTracker {
    open_len: u64,
    open_op: usize,
}

impl BurstTracker {
    /// Feeds one message of `packets` packets of collective `op` with its lost `runs`
    /// (`(start, len)` in packets, sorted and disjoint), calling `finished(op, length)` for
    /// every burst that ended.
    pub fn observe(
        &mut self,
        op: usize,
        packets: u64,
        runs: impl IntoIterator<Item = (u32, u32)>,
        mut finished: impl FnMut(usize, u64),
    ) {
        if packets == 0 {
            return;
        }
        let mut any = false;
        for (start, run_len) in runs {
            any = true;
            let mut len = u64::from(run_len);
            if self.open_len > 0 {
                if start == 0 {
                    len += self.open_len;
                } else {
                    finished(self.open_op, self.open_len);
                }
                self.open_len = 0;
            }
            if u64::from(start) + u64::from(run_len) >= packets {
                self.open_len = len;
                self.open_op = op;
            } else {
                finished(op, len);
            }
        }
        if !any && self.open_len > 0 {
            finished(self.open_op, self.open_len);
            self.open_len = 0;
        }
    }

    /// The burst still going at the end of the last message: (collective slot, length so
    /// far).
    pub fn open(&self) -> Option<(usize, u64)> {
        (self.open_len > 0).then_some((self.open_op, self.open_len))
    }

    /// Ends a burst still open when the connection closes.
    pub fn finish(&mut self, mut finished: impl FnMut(usize, u64)) {
        if self.open_len > 0 {
            finished(self.open_op, self.open_len);
            self.open_len = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            packets_injection_off: 0,
            rule: None,
        };
        stats.record_message(&rec(5, 2, 1));
        stats.record_message(&rec(5, 2, 0));
        stats.record_message(&rec(3, 0, 2));
        stats.record_burst(5, 1);
        stats.record_burst(5, 2);
        stats.record_latency_ns(5, 1500);
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
        assert_eq!(snap.histograms.len(), 1);
        assert_eq!(snap.histograms[0].op, "AllReduce");
        assert_eq!(snap.histograms[0].burst_lengths, vec![(1, 1), (2, 1)]);
        let (latency, count) = snap.histograms[0].latency_ns[0];
        assert_eq!(count, 1);
        // Two significant figures: 1500 ns lands in a bucket within 1% of it.
        assert!((1485..=1515).contains(&latency), "{latency}");
    }

    #[test]
    fn messages_are_counted_by_the_rule_that_decided_them() {
        let stats = ConnectionStats::new(7, 1).with_rules(2);
        let rec = |rule, lost| MessageRecord {
            packets: 4,
            lost_packets: lost,
            rule,
            ..MessageRecord::default()
        };
        stats.record_message(&rec(Some(1), 2));
        stats.record_message(&rec(Some(1), 1));
        stats.record_message(&rec(None, 0));
        // A rule the profile does not have is counted by collective only.
        stats.record_message(&rec(Some(9), 4));
        let snap = stats.snapshot();
        assert_eq!(snap.total.messages, 4);
        let by_rule: Vec<_> = snap
            .by_rule
            .iter()
            .map(|r| (r.rule, r.counts.messages, r.counts.lost_packets))
            .collect();
        // Rule 0 decided nothing: not listed; the defaults come last.
        assert_eq!(by_rule, vec![(Some(1), 2, 3), (None, 1, 0)]);
        // Without the profile's rules, everything is the defaults'.
        let plain = ConnectionStats::new(7, 2);
        plain.record_message(&rec(None, 1));
        let snap = plain.snapshot();
        assert_eq!(snap.by_rule.len(), 1);
        assert_eq!(snap.by_rule[0].rule, None);
    }

    #[test]
    fn per_rule_counts_of_closed_connections_can_be_dropped_and_the_rest_stays() {
        let registry = Registry::default();
        let (closed, live) = (
            Arc::new(ConnectionStats::new(1, 0).with_rules(1)),
            Arc::new(ConnectionStats::new(2, 0).with_rules(1)),
        );
        for stats in [&closed, &live] {
            registry.register(Arc::clone(stats));
            stats.record_message(&MessageRecord {
                packets: 2,
                rule: Some(0),
                ..MessageRecord::default()
            });
        }
        registry.close(&closed);
        registry.forget_rules();
        let snaps = registry.snapshot();
        let by_rule: Vec<usize> = snaps.iter().map(|s| s.by_rule.len()).collect();
        // The closed connection keeps its totals, not its rule numbers; the live one (of the
        // runtime now running) keeps both.
        assert_eq!(by_rule, vec![0, 1]);
        assert!(snaps.iter().all(|s| s.total.messages == 1));
    }

    #[test]
    fn a_burst_bin_is_less_than_1_in_128_above_the_lengths_recorded_in_it() {
        // The reader of statistics files allows burst bins 1/128 above the lost packets
        // (`writer::check_bursts`): two significant digits keep lengths below 256 exact and
        // put a length v >= 256 in a bucket of width 2^k with 128·2^k <= v, whose top is
        // less than 2^k <= v/128 above v. Checked at every length to 2^17 and around every
        // power of two (where the bucket width doubles) to the clamp.
        let mut lengths: Vec<u64> = (1..=1 << 17).collect();
        for shift in 17..=24 {
            let p = 1u64 << shift;
            lengths.extend((p - 300..=p + 300).filter(|&v| v <= BURST_MAX));
        }
        for v in lengths {
            let mut h = new_burst_histogram();
            h.saturating_record(v);
            let bins = histogram_bins(&h);
            assert_eq!(bins.len(), 1);
            let top = bins[0].0;
            assert!(
                top >= v && u128::from(top) * 128 < u128::from(v) * 129,
                "{v}: {top}"
            );
        }
    }

    #[test]
    fn bursts_continue_across_message_boundaries() {
        let run = |start: u32, len: u32| (start, len);
        let mut tracker = BurstTracker::default();
        let mut seen = Vec::new();
        // Message 1 (10 packets): a burst of 2 inside, one of 3 reaching the end.
        tracker.observe(5, 10, [run(2, 2), run(7, 3)], |op, len| {
            seen.push((op, len))
        });
        assert_eq!(seen, vec![(5, 2)]);
        // Message 2 starts with 4 lost packets: one burst of 7 across the boundary.
        tracker.observe(3, 10, [run(0, 4)], |op, len| seen.push((op, len)));
        assert_eq!(seen, vec![(5, 2), (3, 7)]);
        // A zero-byte message does not break a burst; a lossless one ends it.
        tracker.observe(3, 10, [run(9, 1)], |op, len| seen.push((op, len)));
        tracker.observe(3, 0, [], |op, len| seen.push((op, len)));
        tracker.observe(4, 10, [], |op, len| seen.push((op, len)));
        assert_eq!(seen, vec![(5, 2), (3, 7), (3, 1)]);
        tracker.observe(4, 4, [run(3, 1)], |op, len| seen.push((op, len)));
        tracker.finish(|op, len| seen.push((op, len)));
        assert_eq!(seen.last(), Some(&(4, 1)));
    }

    #[test]
    fn a_snapshot_counts_the_burst_in_progress_once() {
        // Feeds messages as the sender does (counts, bursts that ended, the burst in
        // progress) and reads the burst histogram of collective 2 after each.
        let stats = ConnectionStats::new(1, 0);
        let mut tracker = BurstTracker::default();
        let mut send = |packets: u64, runs: &[(u32, u32)]| {
            let lost: u64 = runs.iter().map(|r| u64::from(r.1)).sum();
            stats.record_message(&MessageRecord {
                op: 2,
                packets,
                lost_packets: lost,
                loss_events: runs.len() as u64,
                ..MessageRecord::default()
            });
            tracker.observe(2, packets, runs.iter().copied(), |op, len| {
                stats.record_burst(op, len)
            });
            if let Some((op, len)) = tracker.open() {
                stats.set_open_burst(op, len);
            }
            let snap = stats.snapshot();
            snap.histograms
                .iter()
                .flat_map(|h| h.burst_lengths.clone())
                .collect::<Vec<_>>()
        };
        // A burst of 3 reaching the end: in progress, shown at its length so far.
        assert_eq!(send(10, &[(7, 3)]), vec![(3, 1)]);
        // Carried on through a whole message, then ended inside the next one.
        assert_eq!(send(4, &[(0, 4)]), vec![(7, 1)]);
        assert_eq!(send(10, &[(0, 1), (9, 1)]), vec![(1, 1), (8, 1)]);
        // A lossless message ends the one in progress: counted once, as finished.
        assert_eq!(send(10, &[]), vec![(1, 1), (8, 1)]);
    }
}
