//! Each sent message reported to NCCL's profiler: since net v10, NCCL hands `init` a profiler
//! callback and every `isend` a profiler handle. The runtime keeps the callback, behind
//! [`MessageProfiler`], in the context `init` made (the implicit one for v10), and each send
//! comm takes it when it connects; when a message comes with a handle, the comm starts an
//! event at `isend` and stops it when `test` sees the message done. The ABI edge implements
//! [`MessageProfiler`] over the C callback (payload layout: `nccl_headers/nccl_lossy_profiler.h`).

pub use crate::ffi::net::profiler::ProfilerParent;

/// The profiler's handle of one message's event (what it wrote at the start), given back when
/// the event stops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProfilerEvent(pub usize);

/// One sent message as the profiler sees it (the fields of the header's message descriptor).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessageReport {
    /// The communicator id `init` got (v11+; 0 for the implicit context).
    pub comm_id: u64,
    /// The connection's index in its context.
    pub connection: u32,
    /// The receiver's rank, when known.
    pub peer: Option<u32>,
    /// The collective as `setNetAttr` reported it (`1 << ncclFunc_t`; 0: never told).
    pub op_bits: u32,
    /// The control API's phase at `isend`.
    pub phase: u32,
    /// The control API's step at `isend`.
    pub step: u64,
    /// Message size.
    pub bytes: u64,
    /// Packets of the profile's mtu.
    pub packets: u64,
    /// Packets lost.
    pub lost_packets: u64,
    /// Runs of consecutive lost packets.
    pub loss_events: u64,
    /// The effect's code (the order of the header's `NCCL_LOSSY_EFFECT_*`).
    pub effect: u8,
    /// Delay `retransmit` added (0 for the other effects).
    pub retransmit_delay_ns: u64,
}

/// Where a send comm reports its messages. Implementations never fail and never panic: a
/// profiler that reports an error is the implementation's to log, and is otherwise ignored.
pub trait MessageProfiler: Send + Sync {
    /// Starts the event of one message under NCCL's handle `parent`.
    fn start(&self, parent: ProfilerParent, message: &MessageReport) -> ProfilerEvent;

    /// Stops an event [`MessageProfiler::start`] returned (never one it left empty: 0, no
    /// event, as NCCL's callback leaves it when no profiler records net plugin events).
    fn stop(&self, event: ProfilerEvent);
}
