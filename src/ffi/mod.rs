//! The NCCL net-plugin ABI as data, in one leaf module (it imports nothing from the ABI
//! edge, the runtime or the transports):
//! - the bindgen view of `nccl_headers/` (every `ncclNet_vN_t`, properties and result type),
//!   re-exported here;
//! - the mapping between `ncclResult_t` and [`ErrorKind`] ([`result_code`], [`error_kind`]);
//! - C-string copying ([`c_string`]) and `dlerror` text ([`dl_error`]);
//! - [`net`]: the one client of a loaded net plugin, which adapts whichever table
//!   (`ncclNetPlugin_v12` .. `v6`) it finds into one current-shaped set of calls at load, as
//!   NCCL's own loader does. Wrap mode and the CPU harness both use it.

mod bindings;
pub mod net;

pub use bindings::*;

use std::ffi::{c_char, CStr};

use crate::ErrorKind;

/// Bytes in a connection handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_BYTES: usize = NCCL_NET_HANDLE_MAXSIZE as usize;

/// Maps an error class to the code NCCL understands.
pub fn result_code(kind: ErrorKind) -> ncclResult_t {
    match kind {
        ErrorKind::System => ncclResult_t::ncclSystemError,
        ErrorKind::Internal => ncclResult_t::ncclInternalError,
        ErrorKind::InvalidArgument => ncclResult_t::ncclInvalidArgument,
        ErrorKind::InvalidUsage => ncclResult_t::ncclInvalidUsage,
        ErrorKind::Remote => ncclResult_t::ncclRemoteError,
        ErrorKind::Cuda => ncclResult_t::ncclUnhandledCudaError,
    }
}

/// The error class of a code a net plugin returned (`None`: success); the inverse of
/// [`result_code`]. `ncclInProgress` is no error either: NCCL's `NCCLCHECK` lets it through
/// and goes on with what the call returned. Every code NCCL has named since net v8 keeps its
/// class, so a wrapped plugin's error reaches NCCL with its own code. Any other code, one NCCL
/// added later (`ncclTimeout`, 8, in 2.30, which an older NCCL driving us would not know) or a
/// stray value, is an internal error: the code is a plain integer here, so no value a plugin
/// returns is undefined behaviour.
pub fn error_kind(code: ncclResult_t) -> Option<ErrorKind> {
    Some(match code {
        ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => return None,
        ncclResult_t::ncclSystemError => ErrorKind::System,
        ncclResult_t::ncclInvalidArgument => ErrorKind::InvalidArgument,
        ncclResult_t::ncclInvalidUsage => ErrorKind::InvalidUsage,
        ncclResult_t::ncclRemoteError => ErrorKind::Remote,
        ncclResult_t::ncclUnhandledCudaError => ErrorKind::Cuda,
        _ => ErrorKind::Internal,
    })
}

/// NCCL's name of a result code, for messages.
pub fn result_name(code: ncclResult_t) -> &'static str {
    match code {
        ncclResult_t::ncclSuccess => "ncclSuccess",
        ncclResult_t::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclResult_t::ncclSystemError => "ncclSystemError",
        ncclResult_t::ncclInternalError => "ncclInternalError",
        ncclResult_t::ncclInvalidArgument => "ncclInvalidArgument",
        ncclResult_t::ncclInvalidUsage => "ncclInvalidUsage",
        ncclResult_t::ncclRemoteError => "ncclRemoteError",
        ncclResult_t::ncclInProgress => "ncclInProgress",
        ncclResult_t(8) => "ncclTimeout",
        _ => "an unknown result code",
    }
}

/// Copies a C string a plugin owns (NULL: none).
///
/// # Safety
/// `ptr` is NULL or points at a NUL-terminated string that stays valid during the call.
pub unsafe fn c_string(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: the caller promises a NUL-terminated string valid for the call; we copy at once.
    Some(
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The text of the last `dlerror` on this thread.
pub fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; we copy it at once.
    let msg = unsafe { libc::dlerror() };
    // SAFETY: NULL or NUL-terminated (see above).
    unsafe { c_string(msg) }.unwrap_or_else(|| "unknown dlopen error".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_kind_survives_the_round_trip_through_a_code() {
        for kind in [
            ErrorKind::System,
            ErrorKind::Internal,
            ErrorKind::InvalidArgument,
            ErrorKind::InvalidUsage,
            ErrorKind::Remote,
            ErrorKind::Cuda,
        ] {
            assert_eq!(error_kind(result_code(kind)), Some(kind));
        }
        assert_eq!(error_kind(ncclResult_t::ncclSuccess), None);
        assert_eq!(
            error_kind(ncclResult_t(8)), // ncclTimeout, NCCL 2.30+
            Some(ErrorKind::Internal)
        );
    }
}
