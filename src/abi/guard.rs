//! The guard every entry point runs in: no error or panic crosses into NCCL.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::ffi::{ncclResult_t, result_code};
use crate::log;
use crate::{Error, Result};

/// Runs one entry point: errors become codes (and a warning naming `what`), and a panic is
/// caught here, logged and reported as an internal error instead of unwinding into NCCL.
#[inline]
pub(crate) fn guard(what: &str, body: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ncclResult_t::ncclSuccess,
        Ok(Err(err)) => failed(what, err),
        Err(panic) => panicked(what, panic),
    }
}

/// The code of an entry point that failed with `err`, warned about (out of the calls' way).
#[cold]
#[inline(never)]
fn failed(what: &str, err: Error) -> ncclResult_t {
    log::warn(&format!("{what}: {err}"));
    result_code(err.kind)
}

/// The code of an entry point that panicked, logged loudly.
#[cold]
#[inline(never)]
fn panicked(what: &str, panic: Box<dyn std::any::Any + Send>) -> ncclResult_t {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    log::loud(&format!("{what}: internal error (panic caught): {detail}"));
    ncclResult_t::ncclInternalError
}
