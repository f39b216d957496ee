//! Moving bytes between ranks. The ABI layer talks to one [`Transport`] and never knows
//! which: our own TCP sockets ([`socket`]) or another NCCL net plugin wrapped ([`wrap`]).
//!
//! Everything here is non-blocking from the caller's point of view: `listen` returns at once,
//! `connect`/`accept` are polled state machines, and `isend`/`irecv`/`test` only queue work or
//! read completion flags; the network I/O happens on the transport's own threads.

pub mod buffer;
pub mod socket;
pub mod wrap;

use crate::ffi::ncclNetAttr_v11_t;
use crate::ffi::net::profiler::ProfilerParent;
use crate::loss::plan::LossPlan;
use crate::Result;

pub use buffer::HostBuf;

/// Size of the opaque connection handle NCCL ships to the peer (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_SIZE: usize = 128;

/// Leading bytes of the handle a transport may fill for its peer. The ABI layer keeps the
/// last 8 for the listener's rank (see `docs/abi.md`).
pub const HANDLE_WIRE_SIZE: usize = 120;

/// The part of the connection handle a transport writes in `listen` and reads in `connect`.
pub type WireHandle = [u8; HANDLE_WIRE_SIZE];

/// Most requests one connection may have outstanding (NCCL posts at most 32 per comm).
pub const MAX_REQUESTS: usize = 32;

/// Most buffers one grouped receive may carry (NCCL's `NCCL_NET_MAX_RECVS`): the size of the
/// per-request arrays. What a transport advertises as `maxRecvs` may be lower (the socket
/// transport advertises 1).
pub const MAX_RECVS: usize = 8;

/// A transport's memory registration, opaque to everyone else (NCCL keeps it as `mhandle`).
/// Never 0 for a registration that succeeded.
pub type MrHandle = usize;

/// What transports that need no registration hand out: any non-zero value will do.
pub const NO_REGISTRATION: MrHandle = 1;

/// Index of an outstanding request within its connection, below [`MAX_REQUESTS`].
pub type RequestId = u32;

/// What a transport tells NCCL about one of its devices.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceProps {
    /// Interface or device name, for logs.
    pub name: String,
    /// Path of the device in /sys, when there is one.
    pub pci_path: Option<String>,
    /// Unique id of the device.
    pub guid: u64,
    /// Link speed in Mbps.
    pub speed_mbps: i32,
    /// Port number on the device.
    pub port: i32,
    /// One-way latency in microseconds.
    pub latency_us: f32,
    /// How many connections the device supports.
    pub max_comms: i32,
    /// Most buffers in one grouped receive.
    pub max_recvs: i32,
    /// Largest point-to-point message in bytes.
    pub max_p2p_bytes: usize,
    /// Largest collective message in bytes.
    pub max_coll_bytes: usize,
    /// Rail of the device (net v12's `railId`; -1: unknown).
    pub rail_id: i16,
    /// Network plane of the device (net v12's `planeId`; -1: unknown).
    pub plane_id: i16,
}

/// A finished request: how many bytes each of its buffers got (sends: one entry).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// Number of meaningful entries in `sizes`.
    pub count: usize,
    /// Bytes received (or sent) per buffer.
    pub sizes: [usize; MAX_RECVS],
}

impl Completion {
    /// A finished request of one buffer that got (or sent) `size` bytes.
    pub fn single(size: usize) -> Completion {
        let mut done = Completion {
            count: 1,
            ..Completion::default()
        };
        done.sizes[0] = size;
        done
    }

    /// The sizes that are meaningful.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes[..self.count]
    }
}

/// A network backend: devices, and the start of every connection.
pub trait Transport: Send + Sync {
    /// Number of devices NCCL may use.
    fn device_count(&self) -> usize;

    /// Properties of device `dev`.
    fn properties(&self, dev: usize) -> Result<DeviceProps>;

    /// Starts listening on `dev` for a communicator of traffic class `traffic_class` (NCCL's
    /// `ncclNetCommConfig_t`; `None`: none), filling `handle` with what a peer needs to
    /// connect. Never blocks.
    fn listen(
        &self,
        dev: usize,
        traffic_class: Option<i32>,
        handle: &mut WireHandle,
    ) -> Result<Box<dyn Listener>>;

    /// Starts connecting, for a communicator of traffic class `traffic_class`, to the
    /// listener described by `handle`. Never blocks.
    fn connect(
        &self,
        dev: usize,
        traffic_class: Option<i32>,
        handle: &WireHandle,
    ) -> Result<Box<dyn Connector>>;

    /// Whether [`Transport::set_net_attr`] does anything: only then does `setNetAttr`, which
    /// NCCL's proxy calls before every transfer, reach the transport (our sockets need none).
    fn takes_net_attr(&self) -> bool {
        false
    }

    /// NCCL's `setNetAttr` for the communicators of traffic class `traffic_class` (what the
    /// next operations are, and the communicators' flow hints); NCCL ignores its outcome.
    fn set_net_attr(&self, _traffic_class: Option<i32>, _attr: &ncclNetAttr_v11_t) {}
}

/// A connection being established from the sending side.
pub trait Connector: Send {
    /// Advances the connection; `Ok(None)` means "not yet, call again".
    fn poll(&mut self) -> Result<Option<Box<dyn SendConn>>>;
}

/// A listening endpoint that turns incoming peers into receiving connections.
pub trait Listener: Send {
    /// Advances pending handshakes; `Ok(None)` means "no complete peer yet, call again".
    /// A peer that fails the handshake is dropped (and logged) without failing the listener.
    fn poll_accept(&mut self) -> Result<Option<Box<dyn RecvConn>>>;

    /// Closes the endpoint now and says whether that went well (NCCL's `closeListen`); the
    /// drop that follows has nothing left to do. The default closes at drop, which cannot
    /// fail.
    fn close(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The sending half of a connection. Closing is dropping: all threads are joined and all
/// sockets closed before `drop` returns.
pub trait SendConn: Send + Sync {
    /// Queues `buf` for sending with `tag`, losing packets as `plan` says.
    /// `Ok(None)` means every request slot is busy: the caller retries later.
    fn isend(&self, buf: HostBuf, tag: i32, plan: &LossPlan) -> Result<Option<RequestId>>;

    /// As [`SendConn::isend`], with NCCL's profiler handle for the message (v10+ `phandle`),
    /// which a transport that hands the message to another net plugin passes on; the default
    /// has no use for it.
    fn isend_profiled(
        &self,
        buf: HostBuf,
        tag: i32,
        plan: &LossPlan,
        _parent: Option<ProfilerParent>,
    ) -> Result<Option<RequestId>> {
        self.isend(buf, tag, plan)
    }

    /// Registers host memory that later sends use (NCCL's `regMr`); the default needs none.
    fn register(&self, _buf: HostBuf) -> Result<MrHandle> {
        Ok(NO_REGISTRATION)
    }

    /// Releases a registration made by [`SendConn::register`].
    fn deregister(&self, _mr: MrHandle) -> Result<()> {
        Ok(())
    }

    /// Reports whether request `id` is done; a finished request's slot is freed.
    fn test(&self, id: RequestId) -> Result<Option<Completion>>;

    /// Closes the connection now and says whether that went well (NCCL's `closeSend`); the
    /// drop that follows has nothing left to do. The default closes at drop, which cannot
    /// fail.
    fn close(&self) -> Result<()> {
        Ok(())
    }
}

/// The receiving half of a connection. Closing is dropping, as for [`SendConn`].
pub trait RecvConn: Send + Sync {
    /// Posts a (possibly grouped) receive: message `i` with tag `tags[i]` lands in `bufs[i]`.
    /// `Ok(None)` means every request slot is busy: the caller retries later.
    fn irecv(&self, bufs: &[HostBuf], tags: &[i32]) -> Result<Option<RequestId>>;

    /// As [`RecvConn::irecv`], with NCCL's profiler handle for each buffer (v10+
    /// `phandles`), which a transport that hands the receive to another net plugin passes
    /// on; the default has no use for them.
    fn irecv_profiled(
        &self,
        bufs: &[HostBuf],
        tags: &[i32],
        _parents: &[Option<ProfilerParent>],
    ) -> Result<Option<RequestId>> {
        self.irecv(bufs, tags)
    }

    /// Registers host memory that later receives use (NCCL's `regMr`); the default needs none.
    fn register(&self, _buf: HostBuf) -> Result<MrHandle> {
        Ok(NO_REGISTRATION)
    }

    /// Releases a registration made by [`RecvConn::register`].
    fn deregister(&self, _mr: MrHandle) -> Result<()> {
        Ok(())
    }

    /// Reports whether request `id` is done and how many bytes each buffer got.
    fn test(&self, id: RequestId) -> Result<Option<Completion>>;

    /// Closes the connection now and says whether that went well (NCCL's `closeRecv`), as
    /// [`SendConn::close`].
    fn close(&self) -> Result<()> {
        Ok(())
    }
}
