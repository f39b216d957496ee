//! NCCL's net profiler callback (net v10+ `init`) behind the runtime's [`MessageProfiler`]:
//! each sent message becomes one event, started at `isend` with the descriptor declared in
//! `nccl_headers/nccl_lossy_profiler.h` and stopped when `test` sees the message done, the
//! way NCCL's Socket transport reports its requests (`src/transport/net_socket.cc`).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use crate::ffi::{
    ncclLossyProfilerNetDescr_v1_t, ncclLossyProfilerNetDescr_v1_t__bindgen_ty_1,
    ncclLossyProfilerNetMessage_v1_t, ncclProfilerCallback_t, ncclResult_t,
    NCCL_LOSSY_NET_EVENT_START, NCCL_LOSSY_NET_EVENT_STOP, NCCL_LOSSY_PROFILER_NET_ID,
    NCCL_LOSSY_PROFILE_MESSAGE,
};
use crate::log::RateLimit;
use crate::runtime::{MessageProfiler, MessageReport, ProfilerEvent, ProfilerParent};

/// The callback NCCL handed `init` (never NULL: [`from_callback`] makes none for NULL).
struct NcclProfiler {
    callback: ncclProfilerCallback_t,
}

/// The profiler for `init`'s callback argument (`None` for NULL).
pub(super) fn from_callback(callback: ncclProfilerCallback_t) -> Option<Arc<dyn MessageProfiler>> {
    callback.map(|callback| {
        Arc::new(NcclProfiler {
            callback: Some(callback),
        }) as Arc<dyn MessageProfiler>
    })
}

/// A callback that reports an error is logged (once a minute at most) and otherwise ignored:
/// the profiler never decides whether a message goes.
fn checked(code: ncclResult_t, what: &str) {
    static ERRORS: RateLimit = RateLimit::new(1, 60);
    if code != ncclResult_t::ncclSuccess {
        ERRORS.warn(
            "profiler callback error",
            &format!(
                "NCCL's net profiler callback returned {} ({}) at {what} (ignored; the message \
                 goes on)",
                crate::ffi::result_name(code),
                code.0
            ),
        );
    }
}

/// The header's descriptor of one message.
fn descriptor(m: &MessageReport) -> ncclLossyProfilerNetDescr_v1_t {
    ncclLossyProfilerNetDescr_v1_t {
        type_: NCCL_LOSSY_PROFILE_MESSAGE as u8,
        __bindgen_anon_1: ncclLossyProfilerNetDescr_v1_t__bindgen_ty_1 {
            message: ncclLossyProfilerNetMessage_v1_t {
                commId: m.comm_id,
                connection: m.connection,
                peer: m.peer.and_then(|p| i32::try_from(p).ok()).unwrap_or(-1),
                op: m.op_bits,
                phase: m.phase,
                step: m.step,
                bytes: m.bytes,
                packets: m.packets,
                lostPackets: m.lost_packets,
                lossEvents: m.loss_events,
                effect: u32::from(m.effect),
                reserved: 0,
                retransmitDelayNs: m.retransmit_delay_ns,
            },
        },
    }
}

impl MessageProfiler for NcclProfiler {
    fn start(&self, parent: ProfilerParent, message: &MessageReport) -> ProfilerEvent {
        let Some(callback) = self.callback else {
            return ProfilerEvent::default();
        };
        let mut descr = descriptor(message);
        let mut event: *mut c_void = std::ptr::null_mut();
        // SAFETY: NCCL's callback contract for a START: an event-handle slot it may write
        // (ours, on this frame), the parent handle NCCL passed with this message's isend
        // (its profiling state for the message lives until the message is done, which the
        // stop below precedes), our plugin id and a descriptor valid during the call.
        let code = unsafe {
            callback(
                &mut event,
                NCCL_LOSSY_NET_EVENT_START as c_int,
                parent.address() as *mut c_void,
                i64::from(NCCL_LOSSY_PROFILER_NET_ID),
                (&mut descr as *mut ncclLossyProfilerNetDescr_v1_t).cast(),
            )
        };
        checked(code, "start");
        ProfilerEvent(event as usize)
    }

    fn stop(&self, event: ProfilerEvent) {
        let Some(callback) = self.callback else {
            return;
        };
        let mut event = event.0 as *mut c_void;
        // SAFETY: NCCL's callback contract for a STOP: the event handle its START wrote (in a
        // slot on this frame), no parent, no plugin id, no data (as NCCL's Socket transport
        // stops its events).
        let code = unsafe {
            callback(
                &mut event,
                NCCL_LOSSY_NET_EVENT_STOP as c_int,
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        };
        checked(code, "stop");
    }
}
