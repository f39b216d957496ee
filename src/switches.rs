//! Run-time switches a training script flips while NCCL runs: injection on or off, the
//! training phase and step that profile rules match on, and whether this copy runs wrapped
//! inside another. Plain atomics, read once per message (the phase and the switch as one).
//!
//! They are process-wide on purpose, not part of the runtime: the control API
//! (`ncclLossySet*`, used by the Python package) sets them with no context, before the first
//! `init` and after the last `finalize`, and a setting must survive the runtime being built
//! again.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

pub use crate::ids::Phase;

static INNER: AtomicBool = AtomicBool::new(false);

/// Marks this copy of the library as the inner plugin of another copy running in wrap mode:
/// it then carries bytes on its sockets only (no loss, no statistics files, no wrapping).
pub fn set_inner_mode() {
    INNER.store(true, Ordering::Relaxed);
}

/// True when this copy of the library runs wrapped inside another (see [`set_inner_mode`]).
pub fn inner_mode() -> bool {
    INNER.load(Ordering::Relaxed)
}
static MODE: Mode = Mode::new();
static STEP: AtomicU64 = AtomicU64::new(0);
/// Whether a step was ever set: step 0 set by the script (a training loop counting from 0)
/// is a step like any other, where 0 before any setting is none.
static STEP_SET: AtomicBool = AtomicBool::new(false);

/// The training phase and the injection switch, in one word so that a message reads both
/// from the same moment: the phase's code, and [`Mode::OFF`] while injection is off. Read as
/// two words, a message could take the phase from one setting and the switch from a later
/// one (a forward-phase message injected while the script switches injection off for the
/// forward pass and on again for the backward one).
struct Mode(AtomicU8);

impl Mode {
    /// The bit that says injection is off (phase codes are 0-2).
    const OFF: u8 = 0x80;

    const fn new() -> Mode {
        Mode(AtomicU8::new(Phase::Any as u8))
    }

    fn set_enabled(&self, enabled: bool) {
        if enabled {
            self.0.fetch_and(!Self::OFF, Ordering::Release);
        } else {
            self.0.fetch_or(Self::OFF, Ordering::Release);
        }
    }

    fn set_phase(&self, phase: Phase) {
        // Keeps the switch: only the phase's bits change.
        let _ = self
            .0
            .fetch_update(Ordering::Release, Ordering::Relaxed, |m| {
                Some(m & Self::OFF | phase as u8)
            });
    }

    fn current(&self) -> Current {
        let m = self.0.load(Ordering::Acquire);
        Current {
            phase: Phase::from_code(i32::from(m & !Self::OFF)).unwrap_or(Phase::Any),
            enabled: m & Self::OFF == 0,
        }
    }
}

/// The phase and the injection switch, as one message sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Current {
    /// The training phase.
    pub phase: Phase,
    /// Whether loss injection is on.
    pub enabled: bool,
}

/// The phase and the injection switch now.
pub fn current() -> Current {
    MODE.current()
}

/// Turns loss injection on or off for every connection of this process.
pub fn set_enabled(enabled: bool) {
    MODE.set_enabled(enabled);
}

/// Sets the current training phase.
pub fn set_phase(phase: Phase) {
    MODE.set_phase(phase);
}

/// Sets the current training step.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
    // Release: a reader that sees the flag ([`step_set`]) then reads this step or a later one.
    STEP_SET.store(true, Ordering::Release);
}

/// Whether [`set_step`] was ever called in this process (read it before [`step`]: the step
/// read after it is one set no earlier than the flag).
pub fn step_set() -> bool {
    STEP_SET.load(Ordering::Acquire)
}

/// The current training step.
pub fn step() -> u64 {
    STEP.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::{Mode, Phase};

    #[test]
    fn a_message_never_sees_a_phase_with_another_phases_switch() {
        // Backward injects, forward does not. The writer moves between them in the Python
        // helper's order (off, then forward; backward, then on); the reader takes what an
        // `isend` takes. Two separate words let a reader see "forward" from one state and
        // "on" from a later one: a forward message injected. On 2 cores about one read in
        // 15 million saw that (1-6 in each of 8 runs of 20 million, none in one); 200 million
        // reads (1-2 s) miss it with a chance of about e^-13.
        let mode = Mode::new();
        mode.set_phase(Phase::Backward);
        let stop = AtomicBool::new(false);
        let (transitions, seen) = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                let mut transitions = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    mode.set_enabled(false);
                    mode.set_phase(Phase::Forward);
                    mode.set_phase(Phase::Backward);
                    mode.set_enabled(true);
                    transitions += 1;
                }
                transitions
            });
            let mut seen = [0u64; 2];
            let mut bad = 0u64;
            for _ in 0..200_000_000u64 {
                let now = mode.current();
                bad += u64::from(now.phase == Phase::Forward && now.enabled);
                seen[usize::from(now.enabled)] += 1;
            }
            stop.store(true, Ordering::Relaxed);
            assert_eq!(bad, 0, "reads that saw the forward phase with injection on");
            (writer.join().expect("writer"), seen)
        });
        // The reader must have raced the writer for the check to mean anything.
        assert!(transitions > 1000, "{transitions} transitions");
        assert!(seen[0] > 0 && seen[1] > 0, "reads off/on: {seen:?}");
    }

    #[test]
    fn setting_the_phase_keeps_the_switch_and_the_switch_keeps_the_phase() {
        let mode = Mode::new();
        assert_eq!(
            (mode.current().phase, mode.current().enabled),
            (Phase::Any, true)
        );
        for phase in [Phase::Any, Phase::Forward, Phase::Backward] {
            for enabled in [false, true] {
                mode.set_enabled(enabled);
                mode.set_phase(phase);
                let now = mode.current();
                assert_eq!((now.phase, now.enabled), (phase, enabled));
                mode.set_enabled(!enabled);
                let now = mode.current();
                assert_eq!((now.phase, now.enabled), (phase, !enabled));
            }
        }
    }
}
