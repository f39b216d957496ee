//! The per-step series: packets and lost packets per training step, process-wide (steps set
//! through the control API), and what was sent at steps past its last one.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::loss_rate_injecting;

/// Steps the per-step series keeps exactly; later steps are not broken down by step, but
/// summed in one count (see [`steps_beyond`]).
pub const STEP_SLOTS: usize = 1 << 16;

/// Packets and lost packets per training step, process-wide (steps set through the control
/// API). Three atomics per step, allocated on the first message of a step set, so the data
/// path neither locks nor allocates per message after that. The last slot, [`STEP_SLOTS`],
/// sums every later step.
pub struct StepSeries {
    packets: Box<[AtomicU64]>,
    lost: Box<[AtomicU64]>,
    off: Box<[AtomicU64]>,
}

/// Packets and lost packets of one training step, summed over this process's connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCounts {
    /// The training step (for the steps past the series, [`STEP_SLOTS`]: the first of them).
    pub step: u64,
    /// Packets sent during the step.
    pub packets: u64,
    /// Packets lost during the step.
    pub lost_packets: u64,
    /// Of `packets`, those sent with injection switched off (see
    /// [`super::Counts::packets_injection_off`]); 0 in files written before it was counted.
    #[serde(default)]
    pub packets_injection_off: u64,
}

impl StepCounts {
    /// Lost packets over the step's packets sent with injection on (None when none was).
    pub fn loss_rate_injecting(&self) -> Option<f64> {
        loss_rate_injecting(self.packets, self.lost_packets, self.packets_injection_off)
    }
}

impl StepSeries {
    pub(super) fn new() -> Self {
        let slots = || (0..=STEP_SLOTS).map(|_| AtomicU64::new(0)).collect();
        StepSeries {
            packets: slots(),
            lost: slots(),
            off: slots(),
        }
    }

    /// Adds a message's packets to `step` (steps from [`STEP_SLOTS`] on all to one count),
    /// all of them also as sent with injection off when `injection_off`.
    ///
    /// The packets go up first, then the parts of them, with release; [`Self::snapshot`]
    /// reads the parts first, with acquire, so it never reads one above the packets (as
    /// the connections' cells do).
    pub fn record(&self, step: u64, packets: u64, lost: u64, injection_off: bool) {
        let i = usize::try_from(step).map_or(STEP_SLOTS, |i| i.min(STEP_SLOTS));
        self.packets[i].fetch_add(packets, Ordering::Release);
        self.lost[i].fetch_add(lost, Ordering::Release);
        if injection_off {
            self.off[i].fetch_add(packets, Ordering::Release);
        }
    }

    /// Slot `i`, when it saw traffic.
    fn read(&self, i: usize) -> Option<StepCounts> {
        if self.packets[i].load(Ordering::Relaxed) == 0 {
            return None;
        }
        let packets_injection_off = self.off[i].load(Ordering::Acquire);
        let lost_packets = self.lost[i].load(Ordering::Acquire);
        Some(StepCounts {
            step: i as u64,
            packets: self.packets[i].load(Ordering::Acquire),
            lost_packets,
            packets_injection_off,
        })
    }

    /// The steps below [`STEP_SLOTS`] that saw traffic, in order.
    pub fn snapshot(&self) -> Vec<StepCounts> {
        (0..STEP_SLOTS).filter_map(|i| self.read(i)).collect()
    }

    /// What was sent at steps from [`STEP_SLOTS`] on, summed (`step` = [`STEP_SLOTS`]).
    pub fn beyond(&self) -> Option<StepCounts> {
        self.read(STEP_SLOTS)
    }
}

static STEPS: std::sync::OnceLock<StepSeries> = std::sync::OnceLock::new();

/// Counts a message towards training step `step` (the runtime calls it only once the script
/// has set a step: before, traffic is not broken down; after, step 0 is a step like the
/// others, a training loop counting from 0, the Python integration's first step).
pub fn record_step(step: u64, packets: u64, lost: u64, injection_off: bool) {
    STEPS
        .get_or_init(StepSeries::new)
        .record(step, packets, lost, injection_off);
}

/// Per-step packet counts of this process (empty when no step was ever set).
pub fn step_snapshot() -> Vec<StepCounts> {
    STEPS.get().map(StepSeries::snapshot).unwrap_or_default()
}

/// This process's packets at steps from [`STEP_SLOTS`] on, which [`step_snapshot`] leaves
/// out (None when there were none).
pub fn steps_beyond() -> Option<StepCounts> {
    STEPS.get().and_then(StepSeries::beyond)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_series_keeps_steps_apart_and_sums_those_past_its_end() {
        let series = StepSeries::new();
        series.record(3, 10, 1, false);
        series.record(3, 5, 0, true);
        series.record(9, 4, 4, false);
        assert_eq!(series.beyond(), None);
        series.record(STEP_SLOTS as u64, 100, 100, false);
        series.record(u64::MAX, 20, 0, true);
        let step = |step, packets, lost_packets, packets_injection_off| StepCounts {
            step,
            packets,
            lost_packets,
            packets_injection_off,
        };
        assert_eq!(series.snapshot(), vec![step(3, 15, 1, 5), step(9, 4, 4, 0)]);
        assert_eq!(series.beyond(), Some(step(STEP_SLOTS as u64, 120, 100, 20)));
        // The rate to hold against the model leaves the 5 packets sent with injection off out.
        assert_eq!(series.snapshot()[0].loss_rate_injecting(), Some(0.1));
        assert_eq!(step(4, 7, 0, 7).loss_rate_injecting(), None);
    }
}
