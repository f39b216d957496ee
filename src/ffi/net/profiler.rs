//! The profiler callback a wrapped (inner) net plugin gets at `init`, in NCCL's place.
//!
//! NCCL hands every v10+ plugin's `init` its profiler callback, never NULL, and every post a
//! profiler handle of its proxy's, never NULL (`src/plugin/net.cc`, `src/transport/net.cc`).
//! Its IB and Socket plugins call the callback with that handle for each of their own events
//! without checking either (`src/transport/net_ib/p2p.cc`, `src/transport/net_socket.cc`),
//! and NCCL's callback reads the handle as its proxy's (`ncclProfilerCallback`,
//! `src/plugin/profiler.cc`). A wrapped plugin also carries messages NCCL never posted (wrap
//! mode's side messages), which have no NCCL handle. So the inner plugin gets [`relay`]: it
//! passes every call on to NCCL's callback unchanged, except the events of a message posted
//! with [`unprofiled`] (a side message, or a message NCCL gave no handle), which it answers
//! itself, as NCCL's callback answers when no profiler records net events. The inner plugin
//! thus sees a callback and a handle wherever NCCL would give it one, its events for NCCL's
//! messages reach NCCL's profiler under NCCL's handles, and nothing else reaches it.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use super::super::{ncclProfilerCallback_t, ncclResult_t};

/// NCCL's profiler handle for one message (the `phandle` of a v10+ `isend`). Opaque here:
/// only its address is kept, and handed back to the profiler as the parent of the message's
/// event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProfilerParent(usize);

impl ProfilerParent {
    /// The handle at `address`; `None` for NULL (no profiling of this message).
    pub fn new(address: usize) -> Option<ProfilerParent> {
        (address != 0).then_some(ProfilerParent(address))
    }

    /// The handle's address.
    pub fn address(self) -> usize {
        self.0
    }
}

/// The callback's `type` for the start of an event (NCCL's `ncclProfilerNetEventStart`).
const EVENT_START: c_int = 0;

type Callback =
    unsafe extern "C" fn(*mut *mut c_void, c_int, *mut c_void, i64, *mut c_void) -> ncclResult_t;

/// NCCL's callback (one function for the whole process), once an `init` of ours got it.
static NCCL_CALLBACK: OnceLock<Callback> = OnceLock::new();

/// What [`unprofiled`] points to: only its address matters.
static UNPROFILED_MESSAGE: u8 = 0;
/// The event handle [`relay`] writes at the start of an unprofiled message's event.
static UNPROFILED_EVENT: u8 = 0;

/// Keeps NCCL's profiler callback (from a v10+ `init` of ours) for [`relay`]; NULL keeps
/// whatever an earlier `init` gave.
pub fn set_nccl_callback(callback: ncclProfilerCallback_t) {
    if let Some(callback) = callback {
        let _ = NCCL_CALLBACK.set(callback);
    }
}

/// The profiler handle for a post NCCL gave no handle for (a side message): its events stay
/// with [`relay`].
pub fn unprofiled() -> *mut c_void {
    std::ptr::addr_of!(UNPROFILED_MESSAGE).cast_mut().cast()
}

/// The profiler callback for a wrapped plugin's `init` (see the module's text).
pub fn relay() -> ncclProfilerCallback_t {
    Some(relay_call)
}

/// # Safety
/// The callback contract of NCCL's `ncclProfilerCallback_t`: `event` points to the caller's
/// event handle, the rest is what the caller's post and NCCL's callback agree on.
unsafe extern "C" fn relay_call(
    event: *mut *mut c_void,
    kind: c_int,
    parent: *mut c_void,
    plugin_id: i64,
    data: *mut c_void,
) -> ncclResult_t {
    let unprofiled_event: *mut c_void = std::ptr::addr_of!(UNPROFILED_EVENT).cast_mut().cast();
    if kind == EVENT_START {
        // NCCL never gives a NULL handle: one can only be the plugin's own, never NCCL's.
        if parent == unprofiled() || parent.is_null() {
            if !event.is_null() {
                // SAFETY: the caller's event handle slot (the callback contract).
                unsafe { *event = unprofiled_event };
            }
            return ncclResult_t::ncclSuccess;
        }
    } else if !event.is_null() {
        // SAFETY: the caller's event handle slot (the callback contract).
        if unsafe { *event } == unprofiled_event {
            return ncclResult_t::ncclSuccess;
        }
    }
    match NCCL_CALLBACK.get() {
        // SAFETY: NCCL's callback, with the caller's arguments unchanged: the caller's event
        // slot and data, and a handle NCCL gave with the post.
        Some(nccl) => unsafe { nccl(event, kind, parent, plugin_id, data) },
        // No profiler callback from NCCL (an older NCCL, or none): nothing records events.
        None => ncclResult_t::ncclSuccess,
    }
}
