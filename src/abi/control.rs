//! The run-time control API declared in `nccl_headers/nccl_lossy_control.h`.

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::control::{self, Phase};
use crate::{log, plugin};

/// Version of the control API (`NCCL_LOSSY_CONTROL_VERSION`).
pub const CONTROL_VERSION: c_int = 1;

/// Runs a control call, turning a panic into `on_panic` instead of unwinding into the caller.
fn shielded<T>(what: &str, on_panic: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        log::loud(&format!("{what}: internal error (panic caught)"));
        on_panic
    })
}

/// Returns the control API version.
#[no_mangle]
pub extern "C" fn ncclLossyControlVersion() -> c_int {
    CONTROL_VERSION
}

/// Called by another copy of this library that loads this one as its inner plugin (wrap
/// mode), before `init`: this copy then only carries bytes (sockets, no loss, no statistics
/// files, never wraps). Returns 0.
#[no_mangle]
pub extern "C" fn ncclLossyInnerMode() -> c_int {
    control::set_inner_mode();
    0
}

/// Turns loss injection on or off.
#[no_mangle]
pub extern "C" fn ncclLossySetEnabled(enabled: c_int) -> c_int {
    control::set_enabled(enabled != 0);
    0
}

/// Sets the training phase; -1 for an unknown code.
#[no_mangle]
pub extern "C" fn ncclLossySetPhase(phase: c_int) -> c_int {
    match Phase::from_code(phase) {
        Some(phase) => {
            control::set_phase(phase);
            0
        }
        None => {
            log::warn(&format!(
                "ncclLossySetPhase({phase}): allowed phases are 0 (any), 1 (forward), 2 (backward)"
            ));
            -1
        }
    }
}

/// Sets the training step.
#[no_mangle]
pub extern "C" fn ncclLossySetStep(step: u64) -> c_int {
    control::set_step(step);
    0
}

/// Copies the statistics JSON into `buf`; returns its full length, or -1 on error.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn ncclLossyStatsJson(buf: *mut c_char, cap: usize) -> i64 {
    shielded("ncclLossyStatsJson", -1, || {
        let json = match serde_json::to_string(&plugin::stats_file()) {
            Ok(json) => json,
            Err(err) => {
                log::warn(&format!("ncclLossyStatsJson: {err}"));
                return -1;
            }
        };
        if !buf.is_null() && cap > 0 {
            let n = json.len().min(cap - 1);
            // SAFETY: the caller gives `cap` writable bytes at `buf`; we write n + 1 <= cap.
            unsafe {
                std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        i64::try_from(json.len()).unwrap_or(i64::MAX)
    })
}

/// Writes the statistics file now; 0 on success, 1 without `NCCL_LOSSY_STATS`, -1 on error.
#[no_mangle]
pub extern "C" fn ncclLossyWriteStats() -> c_int {
    shielded("ncclLossyWriteStats", -1, || match plugin::write_stats() {
        Ok(Some(_)) => 0,
        Ok(None) => 1,
        Err(err) => {
            log::warn(&format!("ncclLossyWriteStats: {err}"));
            -1
        }
    })
}
