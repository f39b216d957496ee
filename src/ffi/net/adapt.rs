//! Each table version in the current (v12) shape: an [`Adapter`] for the entries whose C
//! signature changed (its properties struct is converted by `props`), as NCCL's
//! `src/plugin/net/net_v6.cc` and friends adapt an old table once, at load.

use std::ffi::{c_char, c_int, c_void};

use super::props::{properties_of, NetProperties};
use super::{Code, MAX_GROUPED_RECVS, MISSING, OK, V8_MAX_BYTES};
use crate::ffi::{
    ncclDebugLogger_t, ncclNetAttr_v11_t, ncclNetCommConfig_v10_t, ncclNetDeviceHandle_v8_t,
    ncclNet_v10_t, ncclNet_v11_t, ncclNet_v12_t, ncclNet_v6_t, ncclNet_v7_t, ncclNet_v8_t,
    ncclNet_v9_t, ncclProfilerCallback_t, ncclResult_t,
};
use crate::{Error, Result};

// ---- adapters: each table version in the current shape ------------------------------------

type DevicesFn = unsafe extern "C" fn(*mut c_int) -> Code;
type AcceptFn =
    unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut ncclNetDeviceHandle_v8_t) -> Code;
/// v6's `accept`: no device handle.
type AcceptV6Fn = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> Code;
type RegMrFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, *mut *mut c_void) -> Code;
/// v6's and v7's `regMr`: an `int` size.
type RegMrIntFn =
    unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, c_int, *mut *mut c_void) -> Code;
type DeregMrFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> Code;
type TestFn = unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> Code;
type CloseFn = unsafe extern "C" fn(*mut c_void) -> Code;
type IrecvConsumedFn = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> Code;

/// `accept`: with a device handle out-pointer from v7 on, without in v6.
#[derive(Clone, Copy)]
pub(super) enum AcceptEntry {
    DevComm(AcceptFn),
    Plain(AcceptV6Fn),
}

/// `regMr`: a `size_t` size from v8 on, an `int` in v6 and v7.
#[derive(Clone, Copy)]
pub(super) enum RegMrEntry {
    SizeT(RegMrFn),
    Int(RegMrIntFn),
}

/// The entries whose C signature is the same in v6 to v12 (or nearly: `accept` and `regMr`
/// say which they are), copied out of the table at load.
#[derive(Clone, Copy)]
pub(super) struct Shared {
    pub(super) devices: DevicesFn,
    pub(super) accept: AcceptEntry,
    pub(super) reg_mr: RegMrEntry,
    pub(super) dereg_mr: DeregMrFn,
    pub(super) test: TestFn,
    pub(super) close_send: CloseFn,
    pub(super) close_recv: CloseFn,
    pub(super) close_listen: CloseFn,
    /// Optional: NCCL calls it, when present, once a completed receive's data was consumed.
    pub(super) irecv_consumed: Option<IrecvConsumedFn>,
}

/// The entries whose signature changed across versions, in the current (v12) shape. Each
/// method has the contract of the v12 entry it stands for (pointers as NCCL passes them).
pub(super) trait Adapter {
    /// `init`; v11+ writes its context to `ctx`, older versions leave it NULL; v11+ get the
    /// communicator's `traffic_class` (older versions take it at `connect`); v10+ get
    /// `profiler` (v8 and v9 have no such argument: it is dropped).
    ///
    /// # Safety
    /// `logger` is NULL or a printf-like logger that outlives the plugin; `profiler` is NULL
    /// or a function with the contract of NCCL's profiler callback that outlives the plugin.
    unsafe fn init(
        &self,
        ctx: &mut *mut c_void,
        comm_id: u64,
        traffic_class: c_int,
        logger: ncclDebugLogger_t,
        profiler: ncclProfilerCallback_t,
    ) -> Code;

    /// `getProperties`, adapted.
    ///
    /// # Safety
    /// None beyond the plugin's own contract: all pointers are made here.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code>;

    /// `listen(ctx, dev, handle, listenComm)`.
    ///
    /// # Safety
    /// `ctx` comes from this table's init; `handle` points to `HANDLE_BYTES` writable bytes.
    unsafe fn listen(
        &self,
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
    ) -> (Code, *mut c_void);

    /// `connect(ctx, dev, handle, sendComm, sendDevComm)`; v10 gets the communicator's
    /// `traffic_class` here (v11+ took it at `init`, v8 and v9 have none).
    ///
    /// # Safety
    /// As `listen`, and `handle` is the same memory on every call for one connection.
    unsafe fn connect(
        &self,
        ctx: *mut c_void,
        dev: c_int,
        handle: *mut c_void,
        traffic_class: c_int,
    ) -> (Code, *mut c_void);

    /// `isend(comm, data, size, tag, mhandle, phandle, request)` (v8 and v9 have no
    /// `phandle`: it is dropped).
    ///
    /// # Safety
    /// v12's `isend` contract; `size` at most the version's limit (v8: [`V8_MAX_BYTES`]).
    #[allow(clippy::too_many_arguments)]
    unsafe fn isend(
        &self,
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        tag: c_int,
        mh: *mut c_void,
        phandle: *mut c_void,
        req: &mut *mut c_void,
    ) -> Code;

    /// `irecv(comm, n, data, sizes, tags, mhandles, phandles, request)` (v8 and v9 have no
    /// `phandles`: they are dropped).
    ///
    /// # Safety
    /// v12's `irecv` contract, with 1 to [`MAX_GROUPED_RECVS`] buffers of at most the
    /// version's size limit; `phandles` holds `n` profiler handles (each NULL or the caller's).
    #[allow(clippy::too_many_arguments)]
    unsafe fn irecv(
        &self,
        comm: *mut c_void,
        n: c_int,
        data: *mut *mut c_void,
        sizes: *mut usize,
        tags: *mut c_int,
        mhs: *mut *mut c_void,
        phandles: *mut *mut c_void,
        req: &mut *mut c_void,
    ) -> Code;

    /// `finalize(ctx)` (v11+; nothing to do before).
    ///
    /// # Safety
    /// `ctx` comes from this table's init and is not used again.
    unsafe fn finalize(&self, _ctx: *mut c_void) -> Code {
        OK
    }

    /// `setNetAttr(ctx, attr)`; `None` when the version (or the plugin) has none.
    ///
    /// # Safety
    /// `ctx` comes from this table's init.
    unsafe fn set_net_attr(
        &self,
        _ctx: *mut c_void,
        _attr: &mut ncclNetAttr_v11_t,
    ) -> Option<Code> {
        None
    }
}

/// Calls an entry the load-time check found present (`MISSING` if it were not).
macro_rules! call {
    ($f:expr, $($arg:expr),* $(,)?) => {
        match $f {
            Some(f) => f($($arg),*),
            None => MISSING,
        }
    };
}

/// A comm out-pointer call: returns the code and the comm (NULL: none yet).
macro_rules! comm_out {
    ($f:expr, $($arg:expr),* ; dev_comm) => {{
        let mut comm: *mut c_void = std::ptr::null_mut();
        let mut dev_comm: *mut ncclNetDeviceHandle_v8_t = std::ptr::null_mut();
        let code = call!($f, $($arg,)* &mut comm, &mut dev_comm);
        (code, comm)
    }};
    ($f:expr, $($arg:expr),*) => {{
        let mut comm: *mut c_void = std::ptr::null_mut();
        let code = call!($f, $($arg,)* &mut comm);
        (code, comm)
    }};
}

/// v6-v8 `int` sizes of a receive (callers checked each against [`V8_MAX_BYTES`]).
///
/// # Safety
/// `sizes` has `n` entries, 1 <= n <= MAX_GROUPED_RECVS.
unsafe fn int_sizes(n: c_int, sizes: *mut usize) -> [c_int; MAX_GROUPED_RECVS] {
    let mut out = [0 as c_int; MAX_GROUPED_RECVS];
    let n = usize::try_from(n).unwrap_or(0).min(MAX_GROUPED_RECVS);
    for (i, slot) in out.iter_mut().enumerate().take(n) {
        // SAFETY: per this function's contract, `sizes` has `n` entries.
        *slot = c_int::try_from(unsafe { *sizes.add(i) }).unwrap_or(c_int::MAX);
    }
    out
}

/// `listen` of v6 to v10: no context.
macro_rules! listen_without_context {
    () => {
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn listen(
            &self,
            _ctx: *mut c_void,
            dev: c_int,
            h: *mut c_void,
        ) -> (Code, *mut c_void) {
            // SAFETY: the trait's contract; versions before v11 have no context.
            unsafe { comm_out!(self.listen, dev, h) }
        }
    };
}

/// `connect` of v7 to v9: no context, no traffic class.
macro_rules! connect_v8_v9 {
    () => {
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn connect(
            &self,
            _ctx: *mut c_void,
            dev: c_int,
            h: *mut c_void,
            _class: c_int,
        ) -> (Code, *mut c_void) {
            // SAFETY: the trait's contract; v7 to v9 have no context and no traffic class.
            unsafe { comm_out!(self.connect, dev, h; dev_comm) }
        }
    };
}

/// `init`, `isend` and `irecv` of v6 to v8: a logger only, `int` sizes, no profiler handles.
macro_rules! int_sized_v6_to_v8 {
    () => {
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn init(
            &self,
            _ctx: &mut *mut c_void,
            _id: u64,
            _class: c_int,
            logger: ncclDebugLogger_t,
            _profiler: ncclProfilerCallback_t,
        ) -> Code {
            // SAFETY: the trait's contract; no profiler callback before v10.
            unsafe { call!(self.init, logger) }
        }
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn isend(
            &self,
            comm: *mut c_void,
            data: *mut c_void,
            size: usize,
            tag: c_int,
            mh: *mut c_void,
            _phandle: *mut c_void,
            req: &mut *mut c_void,
        ) -> Code {
            let Ok(size) = c_int::try_from(size) else {
                return ncclResult_t::ncclInvalidArgument;
            };
            // SAFETY: the trait's contract; the size fits the version's int.
            unsafe { call!(self.isend, comm, data, size, tag, mh, req) }
        }
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn irecv(
            &self,
            comm: *mut c_void,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut usize,
            tags: *mut c_int,
            mhs: *mut *mut c_void,
            _phandles: *mut *mut c_void,
            req: &mut *mut c_void,
        ) -> Code {
            // SAFETY: the trait's contract: `sizes` has `n` entries, n <= MAX_GROUPED_RECVS.
            let mut ints = unsafe { int_sizes(n, sizes) };
            // SAFETY: the trait's contract, with the sizes as the version's ints (alive for
            // the call).
            unsafe { call!(self.irecv, comm, n, data, ints.as_mut_ptr(), tags, mhs, req) }
        }
    };
}

impl Adapter for ncclNet_v6_t {
    int_sized_v6_to_v8!();
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v6's getProperties takes a v6 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    listen_without_context!();
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn connect(
        &self,
        _ctx: *mut c_void,
        dev: c_int,
        h: *mut c_void,
        _class: c_int,
    ) -> (Code, *mut c_void) {
        // SAFETY: the trait's contract; v6 has no context, traffic class or device handle.
        unsafe { comm_out!(self.connect, dev, h) }
    }
}

impl Adapter for ncclNet_v7_t {
    int_sized_v6_to_v8!();
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v7's getProperties takes a v7 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    listen_without_context!();
    connect_v8_v9!();
}

impl Adapter for ncclNet_v8_t {
    int_sized_v6_to_v8!();
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v8's getProperties takes a v8 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    listen_without_context!();
    connect_v8_v9!();
}

impl Adapter for ncclNet_v9_t {
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn init(
        &self,
        _ctx: &mut *mut c_void,
        _id: u64,
        _class: c_int,
        logger: ncclDebugLogger_t,
        _profiler: ncclProfilerCallback_t,
    ) -> Code {
        // SAFETY: the trait's contract; no profiler callback before v10.
        unsafe { call!(self.init, logger) }
    }
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v9's getProperties takes a v9 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    listen_without_context!();
    connect_v8_v9!();
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn isend(
        &self,
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        tag: c_int,
        mh: *mut c_void,
        _phandle: *mut c_void,
        req: &mut *mut c_void,
    ) -> Code {
        // SAFETY: the trait's contract; v9 has no profiler handle.
        unsafe { call!(self.isend, comm, data, size, tag, mh, req) }
    }
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn irecv(
        &self,
        comm: *mut c_void,
        n: c_int,
        data: *mut *mut c_void,
        sizes: *mut usize,
        tags: *mut c_int,
        mhs: *mut *mut c_void,
        _phandles: *mut *mut c_void,
        req: &mut *mut c_void,
    ) -> Code {
        // SAFETY: the trait's contract; v9 has no profiler handles.
        unsafe { call!(self.irecv, comm, n, data, sizes, tags, mhs, req) }
    }
}

/// `isend`/`irecv` of v10 to v12, which only added profiler handles (the caller's).
macro_rules! transfer_v10 {
    () => {
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn isend(
            &self,
            comm: *mut c_void,
            data: *mut c_void,
            size: usize,
            tag: c_int,
            mh: *mut c_void,
            phandle: *mut c_void,
            req: &mut *mut c_void,
        ) -> Code {
            // SAFETY: the trait's contract; the profiler handle is the caller's (or NULL).
            unsafe { call!(self.isend, comm, data, size, tag, mh, phandle, req) }
        }
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn irecv(
            &self,
            comm: *mut c_void,
            n: c_int,
            data: *mut *mut c_void,
            sizes: *mut usize,
            tags: *mut c_int,
            mhs: *mut *mut c_void,
            phandles: *mut *mut c_void,
            req: &mut *mut c_void,
        ) -> Code {
            // SAFETY: the trait's contract; the profiler handles are the caller's.
            unsafe { call!(self.irecv, comm, n, data, sizes, tags, mhs, phandles, req) }
        }
    };
}

impl Adapter for ncclNet_v10_t {
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn init(
        &self,
        _ctx: &mut *mut c_void,
        _id: u64,
        _class: c_int,
        logger: ncclDebugLogger_t,
        profiler: ncclProfilerCallback_t,
    ) -> Code {
        // SAFETY: the trait's contract.
        unsafe { call!(self.init, logger, profiler) }
    }
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v10's getProperties takes the v9 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    listen_without_context!();
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn connect(
        &self,
        _ctx: *mut c_void,
        dev: c_int,
        h: *mut c_void,
        class: c_int,
    ) -> (Code, *mut c_void) {
        let mut config = ncclNetCommConfig_v10_t {
            trafficClass: class,
        };
        // SAFETY: the trait's contract, with a config struct that outlives the call.
        unsafe { comm_out!(self.connect, dev, &mut config, h; dev_comm) }
    }
    transfer_v10!();
}

/// Everything of v11 and v12 but their properties: the tables are the same otherwise.
macro_rules! context_api {
    () => {
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn init(
            &self,
            ctx: &mut *mut c_void,
            id: u64,
            class: c_int,
            logger: ncclDebugLogger_t,
            profiler: ncclProfilerCallback_t,
        ) -> Code {
            let mut config = ncclNetCommConfig_v10_t {
                trafficClass: class,
            };
            // SAFETY: the trait's contract; a config struct and a context out-pointer that
            // outlive the call.
            unsafe { call!(self.init, ctx, id, &mut config, logger, profiler) }
        }
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn listen(&self, ctx: *mut c_void, dev: c_int, h: *mut c_void) -> (Code, *mut c_void) {
            // SAFETY: the trait's contract.
            unsafe { comm_out!(self.listen, ctx, dev, h) }
        }
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn connect(
            &self,
            ctx: *mut c_void,
            dev: c_int,
            h: *mut c_void,
            _class: c_int,
        ) -> (Code, *mut c_void) {
            // SAFETY: the trait's contract; the traffic class went to `init`.
            unsafe { comm_out!(self.connect, ctx, dev, h; dev_comm) }
        }
        transfer_v10!();
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn finalize(&self, ctx: *mut c_void) -> Code {
            // SAFETY: the trait's contract.
            unsafe { call!(self.finalize, ctx) }
        }
        /// # Safety: the [`Adapter`] method's contract.
        unsafe fn set_net_attr(&self, ctx: *mut c_void, attr: &mut ncclNetAttr_v11_t) -> Option<Code> {
            // SAFETY: the trait's contract; the attribute struct outlives the call.
            self.setNetAttr.map(|f| unsafe { f(ctx, attr) })
        }
    };
}

impl Adapter for ncclNet_v11_t {
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v11's getProperties takes a v11 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    context_api!();
}

impl Adapter for ncclNet_v12_t {
    /// # Safety: the [`Adapter`] method's contract.
    unsafe fn properties(&self, dev: c_int) -> std::result::Result<NetProperties, Code> {
        // SAFETY: v12's getProperties takes a v12 struct.
        unsafe { properties_of(self.getProperties, dev) }
    }
    context_api!();
}

/// An entry the adapter relies on, or an error naming it.
fn need<F>(f: Option<F>, what: &str) -> Result<F> {
    f.ok_or_else(|| Error::invalid_argument(format!("its table has no `{what}` function")))
}

/// What the loader needs of every table version besides its [`Adapter`].
pub(super) trait Table: Adapter + Copy + 'static {
    /// The `N` of `ncclNetPlugin_vN`.
    const VERSION: u32;
    /// Largest message one buffer may carry (v8's `int` sizes: NCCL's `MAX_NET_SIZE`).
    const MAX_BYTES: usize;
    /// The plugin's `name` field.
    fn name(&self) -> *const c_char;
    /// Checks the entries the adapter calls, and copies out the shared ones.
    fn shared(&self) -> Result<Shared>;
}

macro_rules! table {
    ($t:ty, $version:expr, $max_bytes:expr, $accept:path, $reg_mr:path,
     |$table:ident| $consumed:expr $(, $extra:ident)*) => {
        impl Table for $t {
            const VERSION: u32 = $version;
            const MAX_BYTES: usize = $max_bytes;
            fn name(&self) -> *const c_char {
                self.name
            }
            fn shared(&self) -> Result<Shared> {
                need(self.init, "init")?;
                need(self.getProperties, "getProperties")?;
                need(self.listen, "listen")?;
                need(self.connect, "connect")?;
                need(self.isend, "isend")?;
                need(self.irecv, "irecv")?;
                $(need(self.$extra, stringify!($extra))?;)*
                let $table = self;
                Ok(Shared {
                    devices: need(self.devices, "devices")?,
                    accept: $accept(need(self.accept, "accept")?),
                    reg_mr: $reg_mr(need(self.regMr, "regMr")?),
                    dereg_mr: need(self.deregMr, "deregMr")?,
                    test: need(self.test, "test")?,
                    close_send: need(self.closeSend, "closeSend")?,
                    close_recv: need(self.closeRecv, "closeRecv")?,
                    close_listen: need(self.closeListen, "closeListen")?,
                    irecv_consumed: $consumed,
                })
            }
        }
    };
}

use AcceptEntry::{DevComm, Plain};
use RegMrEntry::{Int, SizeT};
table!(ncclNet_v6_t, 6, V8_MAX_BYTES, Plain, Int, |_t| None);
table!(ncclNet_v7_t, 7, V8_MAX_BYTES, DevComm, Int, |t| t
    .irecvConsumed);
table!(ncclNet_v8_t, 8, V8_MAX_BYTES, DevComm, SizeT, |t| t
    .irecvConsumed);
table!(ncclNet_v9_t, 9, usize::MAX, DevComm, SizeT, |t| t
    .irecvConsumed);
table!(ncclNet_v10_t, 10, usize::MAX, DevComm, SizeT, |t| t
    .irecvConsumed);
table!(
    ncclNet_v11_t,
    11,
    usize::MAX,
    DevComm,
    SizeT,
    |t| t.irecvConsumed,
    finalize
);
table!(
    ncclNet_v12_t,
    12,
    usize::MAX,
    DevComm,
    SizeT,
    |t| t.irecvConsumed,
    finalize
);

/// A table adapted into the current shape.
pub(super) struct Adapted {
    pub(super) api: Box<dyn Adapter>,
    pub(super) shared: Shared,
    pub(super) name: *const c_char,
    /// Largest message one buffer may carry through this version's sizes.
    pub(super) max_bytes: usize,
}

/// Copies the table at `sym` (of version `T`) and adapts it.
///
/// # Safety
/// `sym` is the address of an exported `ncclNetPlugin_v{T::VERSION}`.
pub(super) unsafe fn adapt<T: Table>(sym: *mut c_void) -> Result<Adapted> {
    // SAFETY: per this function's contract the symbol is a table of T's layout; tables are
    // immutable, so a copy taken now stays what the plugin exports.
    let table: T = unsafe { *(sym as *const T) };
    Ok(Adapted {
        shared: table.shared()?,
        name: table.name(),
        max_bytes: T::MAX_BYTES,
        api: Box::new(table),
    })
}

/// Each version's adapter constructor, newest first.
/// Adapts the table at a symbol's address (see [`adapt`]).
type AdaptFn = unsafe fn(*mut c_void) -> Result<Adapted>;

pub(super) const VERSIONS: [(u32, AdaptFn); 7] = [
    (ncclNet_v12_t::VERSION, adapt::<ncclNet_v12_t>),
    (ncclNet_v11_t::VERSION, adapt::<ncclNet_v11_t>),
    (ncclNet_v10_t::VERSION, adapt::<ncclNet_v10_t>),
    (ncclNet_v9_t::VERSION, adapt::<ncclNet_v9_t>),
    (ncclNet_v8_t::VERSION, adapt::<ncclNet_v8_t>),
    (ncclNet_v7_t::VERSION, adapt::<ncclNet_v7_t>),
    (ncclNet_v6_t::VERSION, adapt::<ncclNet_v6_t>),
];
