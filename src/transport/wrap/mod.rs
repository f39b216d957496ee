//! Wrap mode: another NCCL net plugin (InfiniBand, EFA, any vendor's) carries the bytes, and
//! loss is injected on top. Each data message is preceded, on the same inner connection, by
//! a small side message with the sender's [`LossPlan`]; the receiver posts a side receive
//! and the data receive together, and applies the plan's effect to the data once both have
//! arrived. Design and costs: `docs/wrap.md`.

pub mod inner;
mod inner_conn;
pub mod side;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::ffi::net::profiler::ProfilerParent;
use crate::ffi::net::{NetComm, NetMr};
use crate::ffi::{ncclDebugLogger_t, ncclNetAttr_v11_t, NCCL_PTR_HOST};
use crate::loss::effect::{flip_lost, lost_ranges, zero_lost};
use crate::loss::plan::{Effect, LossPlan, PacketRun};
use crate::transport::socket::wire::HANDLE_MAGIC;
use crate::transport::{
    Completion, Connector, DeviceProps, HostBuf, Listener, MrHandle, RecvConn, RequestId, SendConn,
    Transport, WireHandle, HANDLE_SIZE, HANDLE_WIRE_SIZE, MAX_RECVS, MAX_REQUESTS,
};
use crate::{log, Error, Result};

use inner::InnerPlugin;
use inner_conn::{Direction, Half, Halves, InFlight, InnerConn, Part};

/// Requests one wrapped connection keeps in flight per direction by default: NCCL's proxy
/// posts at most 8 (`NCCL_STEPS`); each costs two inner requests (side + data).
pub const SLOTS: usize = 8;

/// Largest message NCCL's v9+ API allows a plugin to advertise (1 TiB).
const MAX_BYTES: usize = 1 << 40;

/// A message size limit as the inner plugin advertised it, within what NCCL accepts.
fn clamp_bytes(x: usize) -> usize {
    if x == 0 || x > MAX_BYTES {
        MAX_BYTES
    } else {
        x
    }
}

/// Options of wrap mode.
#[derive(Clone, Copy, Debug)]
pub struct WrapOptions {
    /// Keep a copy of each receive buffer before the inner plugin writes it, so the `stale`
    /// effect can put the old bytes back (costs one memcpy per received message).
    pub keep_stale_copy: bool,
    /// Requests in flight per connection and direction, 1 to [`MAX_REQUESTS`] (default
    /// [`SLOTS`]); more only make sense to test an inner plugin running out of requests.
    pub slots: usize,
}

impl Default for WrapOptions {
    fn default() -> Self {
        WrapOptions {
            keep_stale_copy: false,
            slots: SLOTS,
        }
    }
}

/// Another net plugin, presented through the [`Transport`] trait with loss on top.
pub struct WrapTransport {
    plugin: Arc<InnerPlugin>,
    devices: Vec<DeviceProps>,
    options: WrapOptions,
}

impl WrapTransport {
    /// Loads and initialises the plugin named by `spec` (a path, or a name like "ib"),
    /// passing it NCCL's `logger`, and reads its devices.
    pub fn open(spec: &str, logger: ncclDebugLogger_t, options: WrapOptions) -> Result<Self> {
        Self::open_up_to(spec, logger, options, 12)
    }

    /// As [`WrapTransport::open`], using no inner table newer than `ncclNetPlugin_v{newest}`.
    pub fn open_up_to(
        spec: &str,
        logger: ncclDebugLogger_t,
        options: WrapOptions,
        newest: u32,
    ) -> Result<Self> {
        if !(1..=MAX_REQUESTS).contains(&options.slots) {
            return Err(Error::invalid_argument(format!(
                "wrap mode: {} request slots per connection (allowed 1..={MAX_REQUESTS})",
                options.slots
            )));
        }
        let plugin = InnerPlugin::open_up_to(spec, logger, newest)?;
        let count = plugin.net.devices()?;
        if count == 0 {
            // NCCL would fall back to another network; asked for this one, say whose it is.
            return Err(Error::system(format!(
                "inner net plugin {} reports no devices (is its network present on this \
                 host?)",
                plugin.name()
            )));
        }
        let mut devices = Vec::with_capacity(count);
        for dev in 0..count {
            let p = plugin.net.properties(dev)?;
            if p.net_device_type != 0 {
                return Err(Error::invalid_argument(format!(
                    "inner net plugin {}: device {dev} is a device-side (GPU-initiated) \
                     network, which wrap mode cannot carry",
                    plugin.name()
                )));
            }
            if p.ptr_support & NCCL_PTR_HOST as i32 == 0 {
                // NCCL registers host buffers with any plugin whatever its ptrSupport says
                // (src/bootstrap.cc, src/transport/net.cc): only an inner regMr that refuses
                // host memory fails, with the inner plugin's own error.
                log::warn(&format!(
                    "wrap mode: inner net plugin {} device {dev} ({}) does not list host \
                     memory (NCCL_PTR_HOST) in its ptrSupport; wrap mode registers host \
                     buffers with it all the same, as NCCL does",
                    plugin.name(),
                    p.name
                ));
            }
            devices.push(DeviceProps {
                name: format!("{}:{}", plugin.name(), p.name),
                pci_path: p.pci_path,
                guid: p.guid,
                speed_mbps: p.speed_mbps,
                port: p.port,
                latency_us: p.latency_us,
                max_comms: p.max_comms,
                // Side and data messages interleave on the inner connection, so receives are
                // never grouped (see docs/wrap.md).
                max_recvs: 1,
                max_p2p_bytes: clamp_bytes(p.max_p2p_bytes),
                max_coll_bytes: clamp_bytes(p.max_coll_bytes),
                // NCCL's topology search never pairs NICs of different planes, nor (without
                // cross-NIC rings) of different rails (src/graph/search.cc).
                rail_id: p.rail_id,
                plane_id: p.plane_id,
            });
        }
        log::info(&format!(
            "wrap mode: inner net plugin {} (API v{}) from {}, {} device(s): {}",
            plugin.name(),
            plugin.version(),
            plugin.path.display(),
            devices.len(),
            devices
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
        Ok(WrapTransport {
            plugin: Arc::new(plugin),
            devices,
            options,
        })
    }
}

impl WrapTransport {
    /// The inner plugin's API version in use (6 to 12).
    pub fn inner_version(&self) -> u32 {
        self.plugin.version()
    }
}

impl Transport for WrapTransport {
    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn properties(&self, dev: usize) -> Result<DeviceProps> {
        self.devices
            .get(dev)
            .cloned()
            .ok_or_else(|| Error::invalid_argument(format!("no device {dev}")))
    }

    /// The inner plugin gets the traffic class as NCCL would give it (v11+: in the `init`
    /// of the context the comm is made in; v10: at `connect`).
    fn listen(
        &self,
        dev: usize,
        traffic_class: Option<i32>,
        handle: &mut WireHandle,
    ) -> Result<Box<dyn Listener>> {
        let mut full = [0u8; HANDLE_SIZE];
        let comm = self.plugin.listen(dev, traffic_class, &mut full)?;
        if full[HANDLE_WIRE_SIZE..].iter().any(|&b| b != 0) {
            // SAFETY: the listen comm just returned, closed once and not used again.
            let _ = unsafe { self.plugin.net.close_listen(comm) };
            return Err(Error::invalid_argument(format!(
                "inner net plugin {}: its connection handle uses more than the {} bytes \
                 wrap mode can forward",
                self.plugin.name(),
                HANDLE_WIRE_SIZE
            )));
        }
        handle.copy_from_slice(&full[..HANDLE_WIRE_SIZE]);
        Ok(Box::new(WrapListener {
            plugin: Arc::clone(&self.plugin),
            comm,
            options: self.options,
            closed: false,
        }))
    }

    fn takes_net_attr(&self) -> bool {
        true
    }

    /// Forwarded to the inner plugin's context of that traffic class, as NCCL would call it.
    fn set_net_attr(&self, traffic_class: Option<i32>, attr: &ncclNetAttr_v11_t) {
        self.plugin.set_net_attr(traffic_class, attr);
    }

    fn connect(
        &self,
        dev: usize,
        traffic_class: Option<i32>,
        handle: &WireHandle,
    ) -> Result<Box<dyn Connector>> {
        if !self.plugin.lossy_copy && handle[..8] == HANDLE_MAGIC.to_le_bytes() {
            // The inner plugin would read our socket handle as its own: NCCL's Socket and IB
            // transports take its first bytes as an address (an unknown family fails) and
            // the later ones as their socket count and connect progress (random bytes there
            // made NCCL's Socket transport hand out a comm with no connection behind it).
            return Err(Error::invalid_usage(format!(
                "wrap mode: the peer's connection handle comes from this plugin's own socket \
                 transport, so the peer does not run wrap mode over {} (set NCCL_LOSSY_INNER, \
                 or transport = \"wrap\" with inner, alike on every rank)",
                self.plugin.name()
            )));
        }
        let mut full = Box::new([0u8; HANDLE_SIZE]);
        full[..HANDLE_WIRE_SIZE].copy_from_slice(handle);
        Ok(Box::new(WrapConnector {
            plugin: Arc::clone(&self.plugin),
            dev,
            traffic_class,
            handle: full,
            slots: self.options.slots,
        }))
    }
}

/// A connect in progress; the inner plugin's handle lives in a box at a fixed address.
struct WrapConnector {
    plugin: Arc<InnerPlugin>,
    dev: usize,
    traffic_class: Option<i32>,
    handle: Box<[u8; HANDLE_SIZE]>,
    slots: usize,
}

impl Connector for WrapConnector {
    fn poll(&mut self) -> Result<Option<Box<dyn SendConn>>> {
        // SAFETY: the handle lives in this connector's box, the same memory on every call of
        // this connection, and only the inner plugin writes it.
        let connected = unsafe {
            self.plugin
                .connect(self.dev, self.traffic_class, &mut self.handle)?
        };
        let Some(comm) = connected else {
            return Ok(None);
        };
        let conn = InnerConn::new(&self.plugin, comm, self.slots, Direction::Send)?;
        Ok(Some(Box::new(WrapSendConn {
            conn,
            state: Mutex::new(SendState {
                slots: (0..self.slots).map(|_| SendSlot::default()).collect(),
                half_posted: None,
                seq: 0,
                in_flight: InFlight::default(),
            }),
        })))
    }
}

/// A listening inner comm.
struct WrapListener {
    plugin: Arc<InnerPlugin>,
    comm: NetComm,
    options: WrapOptions,
    /// Set once the inner listen comm is closed (never used again, nor closed twice).
    closed: bool,
}

impl Listener for WrapListener {
    fn poll_accept(&mut self) -> Result<Option<Box<dyn RecvConn>>> {
        if self.closed {
            return Err(Error::invalid_usage("accept on a closed listen comm"));
        }
        // SAFETY: our listen comm, open until `close` (checked above) or the drop.
        let Some(comm) = (unsafe { self.plugin.net.accept(self.comm)? }) else {
            return Ok(None);
        };
        let conn = InnerConn::new(&self.plugin, comm, self.options.slots, Direction::Recv)?;
        Ok(Some(Box::new(WrapRecvConn {
            conn,
            options: self.options,
            state: Mutex::new(RecvState {
                slots: (0..self.options.slots)
                    .map(|_| RecvSlot::default())
                    .collect(),
                half_posted: None,
                seq: 0,
                warned_stale: false,
                in_flight: InFlight::default(),
            }),
        })))
    }

    /// The inner `closeListen`, once; its error is ours.
    fn close(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.closed, true) {
            return Ok(());
        }
        // SAFETY: our listen comm, closed once (the flag above) and never used again;
        // accepted comms are independent of it.
        unsafe { self.plugin.net.close_listen(self.comm) }
    }
}

impl Drop for WrapListener {
    fn drop(&mut self) {
        if let Err(err) = self.close() {
            log::warn(&err.to_string());
        }
    }
}

#[derive(Default)]
struct SendSlot {
    busy: bool,
    side: Half,
    data: Half,
    size: usize,
    delay: Duration,
    ready_at: Option<Instant>,
}

impl Halves for SendSlot {
    fn half(&mut self, part: Part) -> &mut Half {
        match part {
            Part::Side => &mut self.side,
            Part::Data => &mut self.data,
        }
    }
}

struct SendState {
    slots: Vec<SendSlot>,
    /// A message whose side message is posted but whose data the inner plugin refused for
    /// now: NCCL posts the same message again and only the data goes out then.
    half_posted: Option<usize>,
    seq: u64,
    /// The inner requests in flight, in posting order.
    in_flight: InFlight,
}

/// The sending half of a wrapped connection.
struct WrapSendConn {
    conn: InnerConn,
    state: Mutex<SendState>,
}

fn locked<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| Error::internal("wrap connection state poisoned by an earlier panic"))
}

impl SendConn for WrapSendConn {
    fn isend(&self, buf: HostBuf, tag: i32, plan: &LossPlan) -> Result<Option<RequestId>> {
        self.isend_profiled(buf, tag, plan, None)
    }

    /// The data message goes to the inner plugin with NCCL's profiler handle, the side
    /// message with none of NCCL's (see `crate::ffi::net::profiler`).
    fn isend_profiled(
        &self,
        buf: HostBuf,
        tag: i32,
        plan: &LossPlan,
        parent: Option<ProfilerParent>,
    ) -> Result<Option<RequestId>> {
        let mut state = locked(&self.state)?;
        let state = &mut *state;
        let id = match state.half_posted {
            Some(id) => {
                if state.slots[id].size != buf.len() {
                    return Err(Error::internal(format!(
                        "wrap mode: a {}-byte message was half posted, then NCCL posted {} bytes",
                        state.slots[id].size,
                        buf.len()
                    )));
                }
                id
            }
            None => {
                let Some(id) = state.slots.iter().position(|s| !s.busy) else {
                    return Ok(None);
                };
                // SAFETY: under the state lock; slot `id` is not busy, so the inner plugin has
                // no request on its side buffer.
                let (ptr, bytes) = unsafe { self.conn.side.slot(id) };
                let len = side::encode(plan, buf.len() as u64, tag, state.seq, bytes)?;
                // SAFETY: the slot's side buffer is registered by `side.mr` and untouched until
                // the slot is free again, which waits for this request to test done.
                let Some(req) =
                    (unsafe { self.conn.isend(ptr, len, tag, self.conn.side.mr, None)? })
                else {
                    return Ok(None);
                };
                state.seq += 1;
                state.in_flight.posted(id, Part::Side);
                let delay = if plan.effect == Effect::Retransmit {
                    plan.retransmit_timeout * plan.loss_events() as u32
                } else {
                    Duration::ZERO
                };
                state.slots[id] = SendSlot {
                    busy: true,
                    side: Half::Pending(req),
                    data: Half::Unposted,
                    size: buf.len(),
                    delay,
                    ready_at: None,
                };
                id
            }
        };
        let mr = NetMr::from_addr(buf.mr());
        // SAFETY: NCCL lends the registered buffer until this request tests done.
        match unsafe { self.conn.isend(buf.as_ptr(), buf.len(), tag, mr, parent)? } {
            Some(req) => {
                state.slots[id].data = Half::Pending(req);
                state.in_flight.posted(id, Part::Data);
                state.half_posted = None;
                Ok(Some(id as RequestId))
            }
            None => {
                state.half_posted = Some(id);
                Ok(None)
            }
        }
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        let mut guard = locked(&self.state)?;
        let state = &mut *guard;
        if !state.slots.get(id as usize).is_some_and(|s| s.busy) {
            return Err(Error::invalid_argument(format!(
                "test of unknown request {id}"
            )));
        }
        let advanced = state.in_flight.advance(&self.conn, &mut state.slots);
        let slot = &mut state.slots[id as usize];
        if !(slot.side.is_done() && slot.data.is_done()) {
            advanced?;
            return Ok(None);
        }
        // Done: a later request's failure met on the way is that request's (kept at the
        // head of the queue for its own test), as NCCL's plugins report each its own.
        // Retransmit: the sender's request ends after the resends, as on our own sockets.
        let ready_at = *slot
            .ready_at
            .get_or_insert_with(|| Instant::now() + slot.delay);
        if Instant::now() < ready_at {
            return Ok(None);
        }
        let size = slot.size;
        *slot = SendSlot::default();
        Ok(Some(Completion::single(size)))
    }

    fn register(&self, buf: HostBuf) -> Result<MrHandle> {
        self.conn.register(buf)
    }

    fn deregister(&self, mr: MrHandle) -> Result<()> {
        self.conn.deregister(mr)
    }

    fn close(&self) -> Result<()> {
        self.conn.close()
    }
}

#[derive(Default)]
struct RecvSlot {
    busy: bool,
    side: Half,
    data: Half,
    buf: Option<HostBuf>,
    tag: i32,
    /// The buffer's bytes before the inner plugin wrote it (stale effect only).
    old: Vec<u8>,
    ready_at: Option<Instant>,
    runs: Vec<PacketRun>,
    /// Number of the message this slot receives (receives match in posting order).
    seq: u64,
    /// Bytes the message brought, once its side message is read.
    size: usize,
}

impl Halves for RecvSlot {
    fn half(&mut self, part: Part) -> &mut Half {
        match part {
            Part::Side => &mut self.side,
            Part::Data => &mut self.data,
        }
    }
}

struct RecvState {
    slots: Vec<RecvSlot>,
    half_posted: Option<usize>,
    /// Number of the next message a side receive is posted for.
    seq: u64,
    warned_stale: bool,
    /// The inner requests in flight, in posting order.
    in_flight: InFlight,
}

/// The receiving half of a wrapped connection.
struct WrapRecvConn {
    conn: InnerConn,
    options: WrapOptions,
    state: Mutex<RecvState>,
}

impl RecvConn for WrapRecvConn {
    fn irecv(&self, bufs: &[HostBuf], tags: &[i32]) -> Result<Option<RequestId>> {
        // No profiler handles (no allocation: the slice is as long as `bufs`, up to the most
        // a receive may group; more is refused by `irecv_profiled` as any count but 1 is).
        let none = [None; MAX_RECVS];
        self.irecv_profiled(bufs, tags, &none[..bufs.len().min(MAX_RECVS)])
    }

    /// The data receive goes to the inner plugin with NCCL's profiler handle, the side
    /// receive with none of NCCL's (see `crate::ffi::net::profiler`).
    fn irecv_profiled(
        &self,
        bufs: &[HostBuf],
        tags: &[i32],
        parents: &[Option<ProfilerParent>],
    ) -> Result<Option<RequestId>> {
        let (&[buf], &[tag], &[parent]) = (bufs, tags, parents) else {
            // As NCCL's Socket and IB plugins refuse more buffers than their maxRecvs
            // (src/transport/net_socket.cc, net_ib/p2p.cc).
            return Err(Error::internal(format!(
                "wrap mode receives one buffer at a time (maxRecvs = 1), got {}",
                bufs.len()
            )));
        };
        let mut state = locked(&self.state)?;
        let state = &mut *state;
        let id = match state.half_posted {
            Some(id) => id,
            None => {
                let Some(id) = state.slots.iter().position(|s| !s.busy) else {
                    return Ok(None);
                };
                // SAFETY: under the state lock; slot `id` is not busy, so the inner plugin has
                // no request on its side buffer (only its address is used here).
                let (ptr, _) = unsafe { self.conn.side.slot(id) };
                // SAFETY: the slot's side buffer is registered by `side.mr` and read only once
                // this request tested done.
                let Some(req) = (unsafe {
                    self.conn
                        .irecv(ptr, side::CAPACITY, tag, self.conn.side.mr, None)?
                }) else {
                    return Ok(None);
                };
                state.in_flight.posted(id, Part::Side);
                let slot = &mut state.slots[id];
                slot.seq = state.seq;
                state.seq += 1;
                slot.busy = true;
                slot.side = Half::Pending(req);
                slot.data = Half::Unposted;
                slot.ready_at = None;
                id
            }
        };
        let slot = &mut state.slots[id];
        slot.buf = Some(buf);
        slot.tag = tag;
        slot.old.clear();
        if self.options.keep_stale_copy {
            // SAFETY: NCCL lent `buf` to this receive and does not touch it until the receive
            // completes; the inner plugin gets it only below, after this copy.
            slot.old
                .extend_from_slice(unsafe { buf.slice(0, buf.len()) });
        }
        let mr = NetMr::from_addr(buf.mr());
        // SAFETY: NCCL lends the registered buffer until this request tests done.
        match unsafe { self.conn.irecv(buf.as_ptr(), buf.len(), tag, mr, parent)? } {
            Some(req) => {
                slot.data = Half::Pending(req);
                state.in_flight.posted(id, Part::Data);
                state.half_posted = None;
                Ok(Some(id as RequestId))
            }
            None => {
                state.half_posted = Some(id);
                Ok(None)
            }
        }
    }

    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        let mut guard = locked(&self.state)?;
        let state = &mut *guard;
        if !state.slots.get(id as usize).is_some_and(|s| s.busy) {
            return Err(Error::invalid_argument(format!(
                "test of unknown request {id}"
            )));
        }
        let advanced = state.in_flight.advance(&self.conn, &mut state.slots);
        let slot = &mut state.slots[id as usize];
        if !(slot.side.is_done() && slot.data.is_done()) {
            advanced?;
            return Ok(None);
        }
        // Done: a later request's failure met on the way is that request's (kept at the
        // head of the queue for its own test), as NCCL's plugins report each its own.
        let (Half::Done(side_len, side_req), Half::Done(reported, data_req), Some(buf)) =
            (slot.side, slot.data, slot.buf)
        else {
            return Err(Error::internal(
                "wrap receive slot finished without a buffer",
            ));
        };
        let too_long = |size: usize| {
            Error::remote(format!(
                "inner net plugin {}: a receive of {} bytes got {size} bytes",
                self.conn.plugin.name(),
                buf.len()
            ))
        };
        if let Some(size) = reported.filter(|&s| s > buf.len()) {
            return Err(too_long(size));
        }
        if slot.ready_at.is_none() {
            // SAFETY: under the state lock; the side receive of this slot is done, so the
            // inner plugin no longer writes its buffer.
            let (_, bytes) = unsafe { self.conn.side.slot(id as usize) };
            let bytes = &bytes[..bytes.len().min(side::CAPACITY)];
            // An inner plugin that reports no sizes: the side message says its own length,
            // and the data message's (checked against the posted receive).
            let side_len = side_len.unwrap_or_else(|| side::declared_len(bytes));
            let info = side::decode(
                &bytes[..side_len.min(bytes.len())],
                std::mem::take(&mut slot.runs),
            )?;
            let size = match reported {
                Some(size) => size,
                None => usize::try_from(info.size)
                    .ok()
                    .filter(|&s| s <= buf.len())
                    .ok_or_else(|| too_long(info.size as usize))?,
            };
            if info.seq != slot.seq || info.tag != slot.tag || info.size != size as u64 {
                return Err(Error::remote(format!(
                    "wrap mode: side message says message {} (tag {}, {} bytes) but the data \
                     is message {} (tag {}, {size} bytes): the peer is out of step",
                    info.seq, info.tag, info.size, slot.seq, slot.tag
                )));
            }
            slot.size = size;
            let plan = info.plan;
            // SAFETY: the inner plugin finished writing `buf` (its data request is done), and
            // NCCL does not touch it until this receive completes; only this view exists.
            let data = unsafe { buf.slice_mut(0, size) };
            let delay = apply(
                &plan,
                data,
                &slot.old,
                self.options.keep_stale_copy,
                &mut state.warned_stale,
            );
            slot.runs = plan.lost;
            slot.ready_at = Some(Instant::now() + delay);
        }
        if slot.ready_at.is_some_and(|at| Instant::now() < at) {
            return Ok(None);
        }
        // Both inner receives are finished with (their bytes read, the loss applied): the
        // inner plugin is told so, as NCCL tells a plugin that has `irecvConsumed` of every
        // finished receive (src/transport/net.cc, recvProxyProgress). Told now rather than
        // when NCCL tells us, since this slot is free for NCCL's next receive after this
        // `test`.
        for req in [side_req, data_req] {
            // SAFETY: a receive of this connection's live comm that tested done with one
            // buffer; it is forgotten below, so this is its only `irecvConsumed`.
            unsafe { self.conn.plugin.net.irecv_consumed(self.conn.comm, 1, req) }?;
        }
        slot.busy = false;
        slot.buf = None;
        slot.side = Half::Unposted;
        slot.data = Half::Unposted;
        Ok(Some(Completion::single(slot.size)))
    }

    fn register(&self, buf: HostBuf) -> Result<MrHandle> {
        self.conn.register(buf)
    }

    fn deregister(&self, mr: MrHandle) -> Result<()> {
        self.conn.deregister(mr)
    }

    fn close(&self) -> Result<()> {
        self.conn.close()
    }
}

/// Applies `plan` to `data`, the bytes that arrived; returns how long the request
/// must still wait (retransmit).
fn apply(
    plan: &LossPlan,
    data: &mut [u8],
    old: &[u8],
    have_old: bool,
    warned_stale: &mut bool,
) -> Duration {
    if plan.lost.is_empty() {
        return Duration::ZERO;
    }
    let size = data.len();
    match plan.effect {
        Effect::Zero => zero_lost(data, 0, &plan.lost, plan.mtu, size),
        Effect::Stale if have_old && old.len() >= size => {
            for range in lost_ranges(&plan.lost, plan.mtu, size, 0..size) {
                data[range.clone()].copy_from_slice(&old[range]);
            }
        }
        Effect::Stale => {
            if !*warned_stale {
                *warned_stale = true;
                log::warn(
                    "wrap mode: the peer sent a `stale` loss but this rank's profile has no \
                     stale effect, so it kept no copy of the old bytes: lost bytes are zeroed",
                );
            }
            zero_lost(data, 0, &plan.lost, plan.mtu, size);
        }
        Effect::Bitflip => {
            flip_lost(data, 0, &plan.lost, plan.mtu, size, plan.flip_seed);
        }
        Effect::Retransmit => {
            return plan.retransmit_timeout * plan.loss_events() as u32;
        }
    }
    Duration::ZERO
}
