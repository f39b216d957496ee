//! The FFI edge of the harness: a safe API over the one net-plugin client of the plugin
//! crate ([`nccl_net_lossy::ffi::net`]), shaped like NCCL's proxy uses a plugin. The client
//! loads the built library, finds the `ncclNetPlugin_vN` table asked for and adapts it into
//! the current shape; this file only adds ownership.
//!
//! Safety model: every object that holds a plugin pointer also holds a reference-counted
//! owner of what the pointer lives in (the library, the context, the comm), so nothing can be
//! used after it was closed or unloaded. Buffers lent to the plugin by `isend`/`irecv` move
//! into the [`Request`] and come back only when `test` reports it done; a request dropped
//! before that leaks its buffers rather than free memory the plugin may still write.
//! This file and [`super::library`] are the only places in the harness with `unsafe`.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};
use std::io::Write;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_net_lossy::ffi::net::{
    NetComm, NetContext, NetMr, NetPlugin, NetRecvBuf, NEWEST_VERSION, OLDEST_VERSION,
};
pub use nccl_net_lossy::ffi::net::{NetProperties, MAX_GROUPED_RECVS};
pub use nccl_net_lossy::ffi::HANDLE_BYTES;
use nccl_net_lossy::ffi::{
    ncclDebugLogLevel, ncclDebugLogger_t, ncclNetAttr_v11_t, ncclProfilerCallback_t, ncclResult_t,
};
use nccl_net_lossy::{Error, Result};

mod net_attr;
mod request;

pub use net_attr::CommShape;
use request::{posted, Parts};
pub use request::{Posted, Request, RequestFifo};

pub use super::library::{
    default_library_path, library_near, PluginLibrary, CARGO_LIBRARY_NAME, NCCL_LIBRARY_NAME,
};

/// A connection handle as `listen` fills it and the peer's `connect` reads it.
pub type ConnHandle = [u8; HANDLE_BYTES];

/// Oldest net-plugin ABI version the harness speaks as NCCL (the oldest this project's plugin
/// exports); under any of them it loads a library's newest table from that version down to
/// v6, as NCCL 2.30 does.
pub const MIN_VERSION: u32 = 8;

/// Newest net-plugin ABI version the harness drives (and the default: the newest table a
/// library exports up to it is used).
pub const MAX_VERSION: u32 = NEWEST_VERSION;

/// Environment variable that makes the harness print the plugin's log lines: `WARN` (the
/// default without it) prints warnings only, anything else prints every line.
pub const DEBUG_ENV: &str = "LOSSY_HARNESS_DEBUG";

/// Bit of NCCL's collective API (`1 << ncclFunc_t`) for the collectives the harness posts.
pub mod op {
    /// `ncclBroadcast`.
    pub const BROADCAST: u32 = 1 << 0;
    /// `ncclAllGather`.
    pub const ALL_GATHER: u32 = 1 << 2;
    /// `ncclReduceScatter`.
    pub const REDUCE_SCATTER: u32 = 1 << 3;
    /// `ncclAllReduce`.
    pub const ALL_REDUCE: u32 = 1 << 4;
    /// Point-to-point send/receive.
    pub const SEND_RECV: u32 = 1 << 5;
}

/// `NCCL_NET_DEVICE_HOST`.
const NET_DEVICE_HOST: i32 = 0;
/// `NCCL_NET_DEVICE_UNPACK`.
const NET_DEVICE_UNPACK: i32 = 1;
/// `NCCL_NET_DEVICE_UNPACK_VERSION` of NCCL 2.28-2.30 (`src/include/nccl_device/net_device.h`).
const UNPACK_VERSION: i32 = 0x7;

/// Algorithm bit for the ring (`1 << NCCL_ALGO_RING`) sent with [`PluginClient::set_net_attr`].
pub const ALGO_RING_BIT: u32 = 1 << 1;

/// Protocol bit for Simple (`1 << NCCL_PROTO_SIMPLE`): the only protocol a host ring uses.
pub const PROTO_SIMPLE_BIT: u32 = 1 << 2;

// ---- logging --------------------------------------------------------------------------------

extern "C" {
    /// The C logger (src/harness/logger.c, built by build.rs): formats NCCL's printf-style
    /// varargs with `vsnprintf`, as NCCL's own logger does, and hands the line to the sink.
    fn lossy_harness_logger(
        level: ncclDebugLogLevel,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    );
    /// Installs the function the C logger passes finished lines to.
    fn lossy_harness_set_log_sink(sink: LogSink);
}

/// Whether `LOSSY_HARNESS_DEBUG` asks for every log line, not only warnings.
pub fn log_verbose() -> bool {
    std::env::var_os(DEBUG_ENV).is_some_and(|v| v != "WARN" && v != "0")
}

/// What the C logger calls with each finished line: level, file, line, text.
type LogSink = unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char);

/// Receives each formatted line from the C logger and prints it (warnings always, the rest
/// with `NCCL_DEBUG` set to more than WARN).
///
/// # Safety
/// `text` is NULL or a NUL-terminated string (the C logger's buffer).
unsafe extern "C" fn log_line(
    level: c_int,
    _file: *const c_char,
    _line: c_int,
    text: *const c_char,
) {
    let verbose = log_verbose();
    let warn = level == ncclDebugLogLevel::NCCL_LOG_WARN as c_int;
    if text.is_null() || !(warn || verbose) {
        return;
    }
    // SAFETY: the C logger passes its NUL-terminated line buffer, alive during this call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let tag = if warn { "WARN" } else { "INFO" };
    // Not `eprintln!`: it panics when stderr cannot be written (a closed pipe, a full disk),
    // and a panic here, called from C, aborts the process. A lost log line is the lesser harm.
    let _ = writeln!(
        std::io::stderr(),
        "[pid {}] {tag} {text}",
        std::process::id()
    );
}

/// The logger handed to a plugin's `init`: printf-like, as NCCL's.
pub fn logger() -> ncclDebugLogger_t {
    static SINK: std::sync::Once = std::sync::Once::new();
    SINK.call_once(|| {
        // SAFETY: stores a function pointer in the C logger's static; the Once makes this
        // happen once, before any logger is handed out (so before any plugin logs).
        unsafe { lossy_harness_set_log_sink(log_line) }
    });
    Some(lossy_harness_logger)
}

// ---- the client ------------------------------------------------------------------------------

/// The profiler callback NCCL hands a v10+ `init` when no profiler plugin is loaded
/// (`ncclProfilerCallback`, src/plugin/profiler.cc): it does nothing, leaves the event handle
/// as it was, and succeeds. It reads none of its arguments, so it is safe to call with any.
extern "C" fn idle_profiler(
    _event: *mut *mut c_void,
    _kind: c_int,
    _parent: *mut c_void,
    _plugin_id: i64,
    _data: *mut c_void,
) -> ncclResult_t {
    ncclResult_t::ncclSuccess
}

/// What every object made by a client shares: the adapted plugin and its context.
struct ClientInner {
    plugin: NetPlugin,
    /// The context from `init`; `None` after `finalize`.
    ctx: RefCell<Option<NetContext>>,
    lib: Rc<PluginLibrary>,
    /// What the `setNetAttr` hints describe ([`PluginClient::set_shape`]).
    shape: Cell<CommShape>,
    /// The hints last given to `setNetAttr` (NCCL's `proxyState->netAttr`), and whether the
    /// plugin has the call.
    given: Cell<Option<(ncclNetAttr_v11_t, bool)>>,
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let _ = finalize_inner(self);
    }
}

/// Calls `finalize(ctx)` once (v11+; older versions have nothing to finalize).
fn finalize_inner(inner: &ClientInner) -> Result<()> {
    match inner.ctx.borrow_mut().take() {
        Some(ctx) => inner.plugin.finalize(ctx),
        None => Ok(()),
    }
}

/// NCCL's most bytes per point-to-point message (`NCCL_MAX_NET_SIZE_BYTES`, 1 TiB).
const MAX_NET_SIZE_BYTES: usize = 1 << 40;

/// What NCCL's proxy checks of device `dev` before it listens or connects on it
/// (`recvProxySetup`/`sendProxySetup`, src/transport/net.cc): `maxP2pBytes` in (0, 1 TiB],
/// else `ncclInternalError` and no connection.
fn check_setup(inner: &ClientInner, dev: i32) -> Result<()> {
    let max = inner.plugin.properties(device(dev)?)?.max_p2p_bytes;
    if max == 0 || max > MAX_NET_SIZE_BYTES {
        return Err(Error::internal(format!(
            "net plugin {}: device {dev} reports maxP2pBytes {max}, outside the (0, \
             {MAX_NET_SIZE_BYTES}] NCCL sets up connections with",
            inner.plugin.name()
        )));
    }
    Ok(())
}

/// Runs `f` with the live context, or fails after `finalize`.
fn with_ctx<T>(inner: &ClientInner, f: impl FnOnce(&NetContext) -> Result<T>) -> Result<T> {
    match inner.ctx.borrow().as_ref() {
        Some(ctx) => f(ctx),
        None => Err(Error::invalid_usage(
            "the plugin context was already finalized",
        )),
    }
}

/// A device index as the plugin takes it.
fn device(dev: i32) -> Result<usize> {
    usize::try_from(dev).map_err(|_| Error::invalid_argument(format!("device {dev}")))
}

/// One communicator's use of the plugin: under v11+ its own context from `init(ctx, commId,
/// ...)`, under v8-v10 the library-wide state `init(logger)` sets up.
#[derive(Clone)]
pub struct PluginClient {
    inner: Rc<ClientInner>,
}

impl PluginClient {
    /// Adapts `ncclNetPlugin_v{version}` of `lib` and calls its `init`; `comm_id` is the
    /// communicator id v11+ receives. As NCCL 2.26+ with no profiler loaded: a v10+ `init`
    /// gets a profiler callback that does nothing ([`idle_profiler`]) and every v10+ post
    /// profiler handles of its own (see [`PluginClient::init_profiled`]).
    pub fn init(lib: &Rc<PluginLibrary>, version: u32, comm_id: u64) -> Result<PluginClient> {
        Self::init_profiled(lib, version, comm_id, Some(idle_profiler))
    }

    /// As [`PluginClient::init`], with `profiler` as the callback (NULL allowed), as NCCL's
    /// proxy does: every v10+ `isend` and each buffer of a v10+ `irecv` get a non-NULL profiler
    /// handle of their own ([`Request::profiler_handle`]), valid until the request tests done
    /// (src/transport/net.cc passes `&sub->pHandles[..]`).
    pub fn init_profiled(
        lib: &Rc<PluginLibrary>,
        version: u32,
        comm_id: u64,
        profiler: ncclProfilerCallback_t,
    ) -> Result<PluginClient> {
        if !(MIN_VERSION..=MAX_VERSION).contains(&version) {
            return Err(Error::invalid_argument(format!(
                "net plugin version {version} (the harness drives {MIN_VERSION} to {MAX_VERSION})"
            )));
        }
        // As NCCL does: the newest table the library exports, from `version` down (NCCL
        // 2.30 asks for v12, then v11, ...; src/plugin/net.cc), so a plugin built for an
        // older NCCL runs under the default, down to v6 (src/plugin/net/net_v6.cc).
        let plugin = NetPlugin::load(Arc::clone(&lib.lib), OLDEST_VERSION..=version)?;
        let ctx = plugin.init_profiled(comm_id, logger(), profiler)?;
        let client = PluginClient {
            inner: Rc::new(ClientInner {
                plugin,
                ctx: RefCell::new(Some(ctx)),
                lib: Rc::clone(lib),
                shape: Cell::new(CommShape::default()),
                given: Cell::new(None),
            }),
        };
        // Dropped on failure, the client finalizes the context, as NCCL does.
        client.check_device_type()?;
        Ok(client)
    }

    /// NCCL assigns a plugin to a communicator only when its device 0 is a host device, or
    /// an unpack device of the version NCCL was built with; otherwise it finalizes the
    /// plugin unused (`ncclNetCheckDeviceVersion`, src/plugin/net.cc).
    fn check_device_type(&self) -> Result<()> {
        let props = self.inner.plugin.properties(0)?;
        let (kind, version) = (props.net_device_type, props.net_device_version);
        if kind == NET_DEVICE_HOST || (kind == NET_DEVICE_UNPACK && version == UNPACK_VERSION) {
            return Ok(());
        }
        Err(Error::invalid_argument(format!(
            "net plugin {}: device 0 has netDeviceType {kind} (version {version}); NCCL uses \
             only host devices (0) and unpack devices (1) of version {UNPACK_VERSION}",
            self.name()
        )))
    }

    /// The ABI version in use.
    pub fn version(&self) -> u32 {
        self.inner.plugin.version()
    }

    /// The library this client uses.
    pub fn library(&self) -> &Rc<PluginLibrary> {
        &self.inner.lib
    }

    /// The plugin's `name` field.
    pub fn name(&self) -> String {
        self.inner.plugin.name().to_string()
    }

    /// Number of devices.
    pub fn devices(&self) -> Result<i32> {
        Ok(i32::try_from(self.inner.plugin.devices()?).unwrap_or(i32::MAX))
    }

    /// Properties of device `dev`, in the current (v12) shape whatever the version.
    pub fn properties(&self, dev: i32) -> Result<NetProperties> {
        self.inner.plugin.properties(device(dev)?)
    }

    /// Starts listening on `dev`: the handle to ship to the peer, and the listening comm.
    pub fn listen(&self, dev: i32) -> Result<(ConnHandle, ListenComm)> {
        let mut handle: ConnHandle = [0; HANDLE_BYTES];
        check_setup(&self.inner, dev)?;
        let comm = with_ctx(&self.inner, |ctx| {
            self.inner.plugin.listen(ctx, device(dev)?, &mut handle)
        })?;
        Ok((
            handle,
            ListenComm {
                raw: Some(comm),
                client: Rc::clone(&self.inner),
            },
        ))
    }

    /// A connection from this client to itself on device `dev`: listens, connects to that
    /// listener and accepts it (as [`establish`] does), then closes the listen comm. What the
    /// tests use to move messages through one process.
    pub fn local_pair(&self, dev: i32, timeout: Duration) -> Result<(SendComm, RecvComm)> {
        let (handle, mut listen) = self.listen(dev)?;
        let pair = establish(self.connect(dev, &handle), &mut listen, timeout)?;
        listen.close()?;
        Ok(pair)
    }

    /// Starts connecting to the listener that produced `handle` on device `dev`.
    pub fn connect(&self, dev: i32, handle: &ConnHandle) -> Connecting {
        Connecting {
            handle: Box::new(*handle),
            dev,
            client: Rc::clone(&self.inner),
            set_up: false,
        }
    }

    /// Tells the plugin which collective is being posted next (v11+ `setNetAttr`, with the
    /// ring algorithm, Simple protocol, one peer each way and the shape's channels, as
    /// NCCL's `setXferNetAttrs` gives them), unless those are the hints it was last given,
    /// as NCCL's proxy skips the call then; `Ok(false)` on older versions, which have no
    /// such call.
    pub fn set_net_attr(&self, op_bits: u32) -> Result<bool> {
        net_attr::hint_transfer(&self.inner, op_bits)
    }

    /// Says what the communicator this client stands for looks like (its ranks, its
    /// channels), for the `setNetAttr` hints; a pair of ranks over one channel until told.
    pub fn set_shape(&self, shape: CommShape) {
        self.inner.shape.set(shape);
    }

    /// Calls `finalize(ctx)` (v11+) now instead of when the last object made by this client
    /// is dropped.
    pub fn finalize(&self) -> Result<()> {
        finalize_inner(&self.inner)
    }
}

// ---- listen, connect, accept --------------------------------------------------------------------

/// How long polling loops wait between calls that made no progress.
const POLL_PAUSE: Duration = Duration::from_micros(200);

/// A listening comm (`listenComm`), closed with `closeListen` on [`ListenComm::close`] or drop.
pub struct ListenComm {
    /// The comm; `None` once closed.
    raw: Option<NetComm>,
    client: Rc<ClientInner>,
}

impl ListenComm {
    /// Calls `accept` once: `Ok(None)` while no peer has fully connected.
    pub fn poll_accept(&mut self) -> Result<Option<RecvComm>> {
        let raw = self
            .raw
            .ok_or_else(|| Error::invalid_usage("accept on a closed listen comm"))?;
        net_attr::hint_connection(&self.client)?;
        // SAFETY: this plugin's listen comm, live until `close_now` takes it, in a context not
        // finalized (checked).
        let comm = unsafe { self.client.plugin.accept(raw)? };
        Ok(comm.map(|comm| RecvComm {
            inner: CommInner::new(comm, CommKind::Recv, &self.client),
        }))
    }

    /// Polls `accept` until a peer connects or `timeout` passes.
    pub fn accept(&mut self, timeout: Duration) -> Result<RecvComm> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(comm) = self.poll_accept()? {
                return Ok(comm);
            }
            if Instant::now() > deadline {
                return Err(Error::remote(format!(
                    "no peer connected within {timeout:?}"
                )));
            }
            std::thread::sleep(POLL_PAUSE);
        }
    }

    /// Calls `closeListen`.
    pub fn close(mut self) -> Result<()> {
        self.close_now()
    }

    fn close_now(&mut self) -> Result<()> {
        match self.raw.take() {
            // SAFETY: the live listen comm, taken out so it is closed once and never used again.
            Some(raw) => unsafe { self.client.plugin.close_listen(raw) },
            None => Ok(()),
        }
    }
}

impl Drop for ListenComm {
    fn drop(&mut self) {
        let _ = self.close_now();
    }
}

/// A connect in progress. The plugin may keep its state in the handle between calls, so the
/// handle lives here, at a fixed address, and every `connect` call gets the same memory.
pub struct Connecting {
    handle: Box<ConnHandle>,
    dev: i32,
    client: Rc<ClientInner>,
    /// Whether [`check_setup`] passed (NCCL checks once, before its first `connect`).
    set_up: bool,
}

impl Connecting {
    /// Calls `connect` once: `Ok(None)` while the connection is not ready.
    pub fn poll(&mut self) -> Result<Option<SendComm>> {
        let dev = device(self.dev)?;
        if !self.set_up {
            check_setup(&self.client, self.dev)?;
            self.set_up = true;
        }
        let handle = &mut self.handle;
        net_attr::hint_connection(&self.client)?;
        let comm = with_ctx(&self.client, |ctx| {
            // SAFETY: the handle is boxed memory this object owns, the same on every call of
            // this connection, changed only by the plugin.
            unsafe { self.client.plugin.connect(ctx, dev, handle) }
        })?;
        Ok(comm.map(|comm| SendComm {
            inner: CommInner::new(comm, CommKind::Send, &self.client),
        }))
    }

    /// Polls `connect` until the connection is ready or `timeout` passes.
    pub fn wait(mut self, timeout: Duration) -> Result<SendComm> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(comm) = self.poll()? {
                return Ok(comm);
            }
            if Instant::now() > deadline {
                return Err(Error::remote(format!(
                    "connect not done within {timeout:?}"
                )));
            }
            std::thread::sleep(POLL_PAUSE);
        }
    }
}

/// Drives a connect and an accept together, as NCCL's service thread does while a ring
/// forms (each rank connects to its successor and accepts its predecessor).
pub fn establish(
    mut connecting: Connecting,
    listen: &mut ListenComm,
    timeout: Duration,
) -> Result<(SendComm, RecvComm)> {
    let deadline = Instant::now() + timeout;
    let (mut send, mut recv) = (None, None);
    loop {
        if send.is_none() {
            send = connecting.poll()?;
        }
        if recv.is_none() {
            recv = listen.poll_accept()?;
        }
        if let (Some(_), Some(_)) = (&send, &recv) {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::remote(format!(
                "connection not established within {timeout:?} (connect {}, accept {})",
                if send.is_some() { "done" } else { "pending" },
                if recv.is_some() { "done" } else { "pending" },
            )));
        }
        std::thread::sleep(POLL_PAUSE);
    }
    match (send, recv) {
        (Some(s), Some(r)) => Ok((s, r)),
        _ => Err(Error::internal("establish finished without both comms")),
    }
}

// ---- comms, registration, requests -------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CommKind {
    Send,
    Recv,
}

/// A send or receive comm, shared with its requests so a request never outlives it.
struct CommInner {
    /// The comm; `None` once closed.
    raw: Cell<Option<NetComm>>,
    kind: CommKind,
    client: Rc<ClientInner>,
    /// The parts of finished requests, for the next posts: after the first few requests no
    /// post allocates (see [`Parts`]). Boxed in the list too: a request's parts must not
    /// move while the plugin holds their addresses, so they leave the list as the boxes they
    /// will be.
    #[allow(clippy::vec_box)]
    spare: RefCell<Vec<Box<Parts>>>,
}

impl CommInner {
    fn new(raw: NetComm, kind: CommKind, client: &Rc<ClientInner>) -> Rc<CommInner> {
        Rc::new(CommInner {
            raw: Cell::new(Some(raw)),
            kind,
            client: Rc::clone(client),
            spare: RefCell::new(Vec::new()),
        })
    }

    fn plugin(&self) -> &NetPlugin {
        &self.client.plugin
    }

    /// Whether posts pass profiler handles: v10+ takes them, as NCCL's proxy passes them to
    /// every post (v8 and v9 have none).
    fn profiled(&self) -> bool {
        self.plugin().version() >= 10
    }

    /// Empty parts for one post, a finished request's when there is one.
    fn parts(&self) -> Box<Parts> {
        self.spare.borrow_mut().pop().unwrap_or_else(Parts::new)
    }

    /// Takes back the parts of a finished request (its buffers taken back: the plugin uses
    /// them, and its profiler handles, no more).
    fn recycle(&self, parts: Box<Parts>) {
        debug_assert_eq!(parts.n, 0, "recycled parts still hold buffers");
        self.spare.borrow_mut().push(parts);
    }

    /// The comm while it and its context are open (every use below but `close` relies on
    /// this check).
    fn live(&self) -> Result<NetComm> {
        let raw = self
            .raw
            .get()
            .ok_or_else(|| Error::invalid_usage("use of a closed comm"))?;
        with_ctx(&self.client, |_| Ok(raw))
    }

    fn close(&self) -> Result<()> {
        let Some(raw) = self.raw.take() else {
            return Ok(());
        };
        // SAFETY: the live comm of this kind, taken out so it is closed once and never used
        // again; its requests check `live` first.
        unsafe {
            match self.kind {
                CommKind::Send => self.plugin().close_send(raw),
                CommKind::Recv => self.plugin().close_recv(raw),
            }
        }
    }

    fn reg_mr(&self, buf: &mut [u8]) -> Result<MrHandle> {
        let raw = self.live()?;
        // SAFETY: a live comm; the plugin only records the range here (it touches registered
        // memory through the requests that post it, whose buffers are lent below).
        let mr = unsafe { self.plugin().reg_mr(raw, buf.as_mut_ptr(), buf.len())? };
        Ok(MrHandle {
            raw: mr,
            comm: raw.addr(),
        })
    }

    fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        let raw = self.check_mr(&mr)?;
        // SAFETY: a live comm and one of its registrations (checked); the plugin reports a
        // registration released twice or still in use as an error.
        unsafe { self.plugin().dereg_mr(raw, mr.raw) }
    }

    /// The live comm, when `mr` is one of its registrations.
    fn check_mr(&self, mr: &MrHandle) -> Result<NetComm> {
        let raw = self.live()?;
        if mr.comm == raw.addr() {
            Ok(raw)
        } else {
            Err(Error::invalid_usage(
                "buffer registered with another comm (regMr is per comm)",
            ))
        }
    }
}

impl Drop for CommInner {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// A memory registration (`mhandle`) of one comm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrHandle {
    raw: NetMr,
    comm: usize,
}

/// Host memory lent to the plugin by `isend`/`irecv`.
pub type HostBuffer = Box<[u8]>;

/// One buffer of a (possibly grouped) receive.
pub struct RecvItem {
    /// Where the message lands.
    pub buf: HostBuffer,
    /// Bytes posted (at most `buf.len()`; the message may be shorter).
    pub size: usize,
    /// Tag the message must carry.
    pub tag: i32,
    /// The buffer's registration with this comm.
    pub mr: MrHandle,
}

/// A send comm (`sendComm`), closed with `closeSend` on [`SendComm::close`] or drop.
pub struct SendComm {
    inner: Rc<CommInner>,
}

impl SendComm {
    /// Registers host memory with this comm (`regMr`, `NCCL_PTR_HOST`).
    pub fn reg_mr(&self, buf: &mut [u8]) -> Result<MrHandle> {
        self.inner.reg_mr(buf)
    }

    /// Releases a registration (`deregMr`).
    pub fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        self.inner.dereg_mr(mr)
    }

    /// Posts a send of `buf[..size]` with `tag` (`isend`).
    pub fn isend(&self, buf: HostBuffer, size: usize, tag: i32, mr: MrHandle) -> Result<Posted> {
        let raw = self.inner.check_mr(&mr)?;
        if size > buf.len() {
            return Err(Error::invalid_argument(format!(
                "isend of {size} bytes from a {}-byte buffer",
                buf.len()
            )));
        }
        let profiled = self.inner.profiled();
        let mut parts = self.inner.parts();
        let Some(data) = parts.lend(buf, size) else {
            self.inner.recycle(parts);
            return Err(Error::internal("a send lends one buffer"));
        };
        let ph = parts.handle(0, profiled);
        // SAFETY: a live send comm and its registration (checked); `parts` holds at least
        // `size` bytes we own and keep untouched until test reports the request done; the
        // profiler handle is NULL or memory the request owns until it is finished (only its
        // address is used: the plugin hands it back to the callback this client's init was
        // given).
        let outcome = unsafe {
            self.inner
                .plugin()
                .isend_profiled(raw, data.cast(), size, tag, mr.raw, ph)
        };
        posted(outcome, &self.inner, parts, true, profiled)
    }

    /// Calls `closeSend`.
    pub fn close(self) -> Result<()> {
        self.inner.close()
    }
}

/// A receive comm (`recvComm`), closed with `closeRecv` on [`RecvComm::close`] or drop.
pub struct RecvComm {
    inner: Rc<CommInner>,
}

impl RecvComm {
    /// Registers host memory with this comm (`regMr`, `NCCL_PTR_HOST`).
    pub fn reg_mr(&self, buf: &mut [u8]) -> Result<MrHandle> {
        self.inner.reg_mr(buf)
    }

    /// Releases a registration (`deregMr`).
    pub fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        self.inner.dereg_mr(mr)
    }

    /// Posts a receive of `items` (`irecv`; grouped when more than one, at most
    /// [`MAX_GROUPED_RECVS`]).
    pub fn irecv(&self, items: impl IntoIterator<Item = RecvItem>) -> Result<Posted> {
        let raw = self.inner.live()?;
        let empty = NetRecvBuf {
            data: std::ptr::null_mut(),
            size: 0,
            tag: 0,
            mr: NetMr::from_addr(0),
            phandle: std::ptr::null_mut(),
        };
        let profiled = self.inner.profiled();
        let mut parts = self.inner.parts();
        let mut bufs = [empty; MAX_GROUPED_RECVS];
        for item in items {
            let bad = if parts.n == MAX_GROUPED_RECVS {
                Err(Error::invalid_argument(format!(
                    "irecv of more than {MAX_GROUPED_RECVS} buffers"
                )))
            } else if item.size > item.buf.len() {
                Err(Error::invalid_argument(format!(
                    "irecv of {} bytes into a {}-byte buffer",
                    item.size,
                    item.buf.len()
                )))
            } else {
                self.inner.check_mr(&item.mr)
            };
            let i = parts.n;
            let lent = match bad {
                Ok(_) => parts.lend(item.buf, item.size),
                Err(_) => None,
            };
            let Some(p) = lent else {
                // SAFETY: nothing was posted, so the plugin holds none of them.
                drop(unsafe { parts.take_back() }.collect::<Vec<_>>());
                self.inner.recycle(parts);
                return Err(bad
                    .err()
                    .unwrap_or_else(|| Error::internal("room checked above")));
            };
            bufs[i] = NetRecvBuf {
                data: p.cast(),
                size: item.size,
                tag: item.tag,
                mr: item.mr.raw,
                phandle: parts.handle(i, profiled),
            };
        }
        if parts.n == 0 {
            self.inner.recycle(parts);
            return Err(Error::invalid_argument(format!(
                "irecv of 0 buffers (1 to {MAX_GROUPED_RECVS})"
            )));
        }
        // SAFETY: a live receive comm and its registrations (checked); each buffer holds at
        // least its posted size of bytes we own (leaked into `parts`) and keep untouched
        // until test reports the request done.
        let outcome = unsafe { self.inner.plugin().irecv(raw, &bufs[..parts.n]) };
        posted(outcome, &self.inner, parts, false, profiled)
    }

    /// Calls `closeRecv`.
    pub fn close(self) -> Result<()> {
        self.inner.close()
    }
}
