//! Run-time switches a training script flips while NCCL runs: injection on or off, the
//! training phase and step that profile rules match on, and whether this copy runs wrapped
//! inside another. Plain atomics, read once per message.
//!
//! They are process-wide on purpose, not part of the runtime: the control API
//! (`ncclLossySet*`, used by the Python package) sets them with no context, before the first
//! `init` and after the last `finalize`, and a setting must survive the runtime being built
//! again.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

pub use crate::ids::Phase;

static ENABLED: AtomicBool = AtomicBool::new(true);
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
static PHASE: AtomicU8 = AtomicU8::new(Phase::Any as u8);
static STEP: AtomicU64 = AtomicU64::new(0);

/// Turns loss injection on or off for every connection of this process.
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// True when loss injection is on (the default).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Sets the current training phase.
pub fn set_phase(phase: Phase) {
    PHASE.store(phase as u8, Ordering::Relaxed);
}

/// The current training phase.
pub fn phase() -> Phase {
    Phase::from_code(i32::from(PHASE.load(Ordering::Relaxed))).unwrap_or(Phase::Any)
}

/// Sets the current training step.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// The current training step.
pub fn step() -> u64 {
    STEP.load(Ordering::Relaxed)
}
