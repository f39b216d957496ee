//! The run-time control API declared in `nccl_headers/nccl_lossy_control.h`.

use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::profile::Profile;
use crate::switches::{self, Phase};
use crate::{log, runtime};

/// Version of the control API (`NCCL_LOSSY_CONTROL_VERSION`).
pub const CONTROL_VERSION: c_int = 3;

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
    switches::set_inner_mode();
    0
}

/// Turns loss injection on or off.
#[no_mangle]
pub extern "C" fn ncclLossySetEnabled(enabled: c_int) -> c_int {
    switches::set_enabled(enabled != 0);
    0
}

/// Sets the training phase; -1 for an unknown code.
#[no_mangle]
pub extern "C" fn ncclLossySetPhase(phase: c_int) -> c_int {
    match Phase::from_code(phase) {
        Some(phase) => {
            switches::set_phase(phase);
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
    switches::set_step(step);
    0
}

/// Copies the statistics JSON into `buf`; returns its full length, or -1 on error.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn ncclLossyStatsJson(buf: *mut c_char, cap: usize) -> i64 {
    shielded("ncclLossyStatsJson", -1, || {
        let json = match serde_json::to_string(&runtime::stats_file()) {
            Ok(json) => json,
            Err(err) => {
                log::warn(&format!("ncclLossyStatsJson: {err}"));
                return -1;
            }
        };
        // SAFETY: the caller's contract is ours (NULL or `cap` writable bytes).
        unsafe { copy_out(json.as_bytes(), buf, cap) }
    })
}

/// Copies `text` NUL-terminated into `buf` (truncated to `cap - 1` bytes); returns its length.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
unsafe fn copy_out(text: &[u8], buf: *mut c_char, cap: usize) -> i64 {
    if !buf.is_null() && cap > 0 {
        let n = text.len().min(cap - 1);
        // SAFETY: the caller gives `cap` writable bytes at `buf`; we write n + 1 <= cap.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    i64::try_from(text.len()).unwrap_or(i64::MAX)
}

/// Reads an optional C string argument; `what` names it in the error.
///
/// # Safety
/// `text` must be NULL or a NUL-terminated string.
unsafe fn optional_str<'a>(text: *const c_char, what: &str) -> Result<Option<&'a str>, String> {
    if text.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    text.to_str()
        .map(Some)
        .map_err(|_| format!("{what} is not valid UTF-8"))
}

/// The answer of [`ncclLossyCheckProfile`] for a profile file (None: the embedded default)
/// and `NCCL_LOSSY_SET`-style overrides.
pub fn check_profile_json(path: Option<&str>, overrides: &str) -> serde_json::Value {
    match Profile::load(path.map(Path::new), overrides) {
        Ok(profile) => serde_json::json!({
            "ok": true,
            "origin": profile.origin,
            "summary": profile.summary(),
            "corrupts_data": profile.corrupts_data(),
            "lossless": profile.is_lossless(),
            "profile": profile.to_json(),
            // What init checks besides the profile's loss (launchers refuse them before the
            // launch, as `lossy run` does): the trace directory and the trace ring's size.
            "trace": profile.trace,
            "trace_events": profile.trace_events,
            "max_trace_events": crate::profile::MAX_TRACE_EVENTS,
            "intra_node_through_net": runtime::INTRA_NODE_THROUGH_NET
                .iter()
                .map(|&(key, value, _)| (key.to_string(), serde_json::Value::from(value)))
                .collect::<serde_json::Map<_, _>>(),
            "intra_node_transports": runtime::INTRA_NODE_THROUGH_NET
                .iter()
                .map(|&(key, _, kept_on)| (key.to_string(), serde_json::Value::from(kept_on)))
                .collect::<serde_json::Map<_, _>>(),
        }),
        Err(err) => serde_json::json!({ "ok": false, "error": err.to_string() }),
    }
}

/// Loads a profile the way the plugin would and describes it as JSON (see the header).
///
/// # Safety
/// `path` and `overrides` must be NULL or NUL-terminated strings; `buf` NULL or `cap`
/// writable bytes.
#[no_mangle]
pub unsafe extern "C" fn ncclLossyCheckProfile(
    path: *const c_char,
    overrides: *const c_char,
    buf: *mut c_char,
    cap: usize,
) -> i64 {
    shielded("ncclLossyCheckProfile", -1, || {
        // SAFETY: the caller passes NULL or NUL-terminated strings.
        let args = unsafe {
            optional_str(path, "path").and_then(|p| Ok((p, optional_str(overrides, "overrides")?)))
        };
        let answer = match args {
            Ok((path, overrides)) => check_profile_json(path, overrides.unwrap_or("")),
            Err(err) => serde_json::json!({ "ok": false, "error": err }),
        };
        // SAFETY: the caller's contract is ours (NULL or `cap` writable bytes).
        unsafe { copy_out(answer.to_string().as_bytes(), buf, cap) }
    })
}

/// Writes the statistics file now; 0 on success, 1 without `NCCL_LOSSY_STATS`, -1 on error.
#[no_mangle]
pub extern "C" fn ncclLossyWriteStats() -> c_int {
    shielded("ncclLossyWriteStats", -1, || match runtime::write_stats() {
        Ok(Some(_)) => 0,
        Ok(None) => 1,
        Err(err) => {
            log::warn(&format!("ncclLossyWriteStats: {err}"));
            -1
        }
    })
}

/// Writes the trace file now (the messages recorded so far) and copies its path, NUL-terminated,
/// into `buf`; returns the path's length (0: this process traces nothing), or -1 on error.
///
/// # Safety
/// `buf` must be NULL or point to `cap` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn ncclLossyWriteTrace(buf: *mut c_char, cap: usize) -> i64 {
    shielded("ncclLossyWriteTrace", -1, || match runtime::write_trace() {
        Ok(path) => {
            let path = path.unwrap_or_default();
            // SAFETY: the caller's contract is ours (NULL or `cap` writable bytes).
            unsafe { copy_out(path.as_os_str().as_encoded_bytes(), buf, cap) }
        }
        Err(err) => {
            log::warn(&format!("ncclLossyWriteTrace: {err}"));
            -1
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(path: Option<&str>, overrides: &str) -> serde_json::Value {
        let path = path.map(|p| std::ffi::CString::new(p).expect("no NUL"));
        let overrides = std::ffi::CString::new(overrides).expect("no NUL");
        let path_ptr = path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        // SAFETY: NULL for a length query; the strings are NUL-terminated.
        let len =
            unsafe { ncclLossyCheckProfile(path_ptr, overrides.as_ptr(), std::ptr::null_mut(), 0) };
        let mut buf = vec![0 as c_char; usize::try_from(len).expect("length") + 1];
        // SAFETY: `buf` holds `buf.len()` writable bytes.
        let again = unsafe {
            ncclLossyCheckProfile(path_ptr, overrides.as_ptr(), buf.as_mut_ptr(), buf.len())
        };
        assert_eq!(len, again);
        // SAFETY: the call NUL-terminated `buf`.
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
        serde_json::from_str(text.to_str().expect("utf-8")).expect("JSON")
    }

    #[test]
    fn check_profile_reads_the_embedded_default_and_overrides() {
        let answer = check(None, "");
        assert_eq!(answer["ok"], true);
        assert_eq!(answer["corrupts_data"], false);
        assert_eq!(answer["origin"], crate::profile::EMBEDDED_ORIGIN);
        let answer = check(None, "effect=zero");
        assert_eq!(
            (&answer["ok"], &answer["corrupts_data"]),
            (&true.into(), &true.into())
        );
    }

    #[test]
    fn check_profile_reports_the_file_and_key_of_an_error() {
        let dir = std::env::temp_dir().join(format!("lossy-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("bad.toml");
        std::fs::write(&file, "effect = \"drop\"\n").expect("write");
        let answer = check(file.to_str(), "");
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(answer["ok"], false);
        let error = answer["error"].as_str().expect("error text");
        assert!(
            error.contains("bad.toml:1: effect = \"drop\": unknown effect; allowed:"),
            "{error}"
        );
        let answer = check(Some("/nonexistent/x.toml"), "");
        assert!(answer["error"].as_str().expect("error").contains("x.toml"));
    }

    #[test]
    fn a_short_buffer_gets_a_terminated_prefix_and_the_full_length() {
        let mut buf = [1 as c_char; 8];
        // SAFETY: `buf` holds 8 writable bytes.
        let n = unsafe { copy_out(b"0123456789", buf.as_mut_ptr(), buf.len()) };
        assert_eq!(n, 10);
        assert_eq!(buf[7], 0);
        // SAFETY: NUL-terminated just above.
        assert_eq!(
            unsafe { CStr::from_ptr(buf.as_ptr()) }.to_bytes(),
            b"0123456"
        );
    }
}
