//! The one client of a loaded NCCL net plugin. [`NetPlugin::load`] looks up
//! `ncclNetPlugin_v12` down to `_v6` in a [`NetLibrary`] (newest first, as NCCL's
//! `src/plugin/net.cc` does) and adapts the table it finds, once, into one current-shaped
//! set of calls (as NCCL's `src/plugin/net/net_v6.cc` and friends do): an adapter per
//! table version ([`adapt`]) converts argument widths, contexts and properties, and the entries whose C
//! signature never changed are copied out of the table. Nothing matches on the version
//! afterwards.
//!
//! Safety model: opening a library is `unsafe` (it runs the library's code and trusts its
//! tables); after that, the calls that take only Rust values (devices, properties, listen, init,
//! finalize, setNetAttr) are safe. Comms, requests and memory handles are opaque pointers
//! only the plugin can check, so every call taking one is an `unsafe fn` whose contract says
//! what the caller (wrap mode's connections, the harness's owning types) must guarantee.
//! A comm is *live* from the call that returned it until it is closed, as long as the
//! context it was made in is not finalized (NCCL closes a context's comms before finalizing
//! it; closing a comm after that is still allowed).

use std::ffi::{c_int, c_void, CString};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

mod adapt;
pub mod profiler;
mod props;

pub use props::NetProperties;

use super::{
    c_string, dl_error, error_kind, ncclDebugLogger_t, ncclNetAttr_v11_t, ncclNetDeviceHandle_v8_t,
    ncclProfilerCallback_t, ncclResult_t, HANDLE_BYTES, NCCL_NET_TRAFFIC_CLASS_UNDEF,
    NCCL_PTR_HOST,
};
use crate::{Error, Result};
use adapt::{AcceptEntry, Adapter, RegMrEntry, Shared, VERSIONS};

/// Oldest net-plugin table version the client adapts.
pub const OLDEST_VERSION: u32 = 6;
/// Newest net-plugin table version (the current shape).
pub const NEWEST_VERSION: u32 = 12;
/// Most buffers one grouped receive may carry (NCCL's `NCCL_NET_MAX_RECVS`).
pub const MAX_GROUPED_RECVS: usize = 8;
/// Largest message NCCL lets through a v8 table, whose sizes are `int` (`MAX_NET_SIZE`).
pub const V8_MAX_BYTES: usize = 1 << 30;
/// The collective size NCCL assumes for a v8 table (`MAX_COLLNET_SIZE`).
pub const V8_MAX_COLL_BYTES: usize = 512 << 20;

type Code = ncclResult_t;
const OK: Code = ncclResult_t::ncclSuccess;
/// What an adapter answers for an entry the load-time check found present but that is not.
const MISSING: Code = ncclResult_t::ncclInternalError;

// ---- the library ---------------------------------------------------------------------------

/// A `dlopen`ed shared library (`RTLD_NOW | RTLD_LOCAL`), closed when dropped unless
/// [`NetLibrary::keep_loaded`] said otherwise.
pub struct NetLibrary {
    handle: *mut c_void,
    path: PathBuf,
    unload: bool,
    /// Contexts of a v8-v10 table made by [`NetPlugin::init`] and not yet finalized: the
    /// compat layer's count of NCCL (`src/plugin/net/net_v8.cc` .. `net_v10.cc`), which calls
    /// the plugin's own `init` only when it is 0.
    legacy_holds: Mutex<usize>,
}

// SAFETY: the handle is only passed to dlsym and dlclose, which are thread-safe; the path is
// plain data.
unsafe impl Send for NetLibrary {}
// SAFETY: as above; no method mutates the library.
unsafe impl Sync for NetLibrary {}

impl NetLibrary {
    /// Opens the library at `path` (a file name without `/` is searched like `dlopen` does).
    ///
    /// # Safety
    /// Loading runs the library's initialisers, and [`NetPlugin::load`] reads its
    /// `ncclNetPlugin_vN` symbols as tables of that version: the file must be a library whose
    /// initialisers are sound and whose such symbols, if any, are net-plugin tables (what NCCL
    /// trusts of the file `NCCL_NET_PLUGIN` names).
    pub unsafe fn open(path: &Path) -> Result<NetLibrary> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::invalid_argument("library path contains a NUL byte"))?;
        // SAFETY: a valid NUL-terminated path and plain dlopen flags; RTLD_LOCAL keeps the
        // library's symbols out of the global namespace.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(Error::system(format!(
                "dlopen {}: {}",
                path.display(),
                dl_error()
            )));
        }
        Ok(NetLibrary {
            handle,
            path: path.to_path_buf(),
            unload: true,
            legacy_holds: Mutex::new(0),
        })
    }

    /// Never `dlclose` this library (a plugin's own threads may outlive its last use).
    pub fn keep_loaded(mut self) -> NetLibrary {
        self.unload = false;
        self
    }

    /// The count of live v8-v10 contexts (a poisoned lock still holds a whole count).
    fn legacy_holds(&self) -> MutexGuard<'_, usize> {
        self.legacy_holds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Address of the exported symbol `name`, if there is one.
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c_name = CString::new(name).ok()?;
        // SAFETY: `handle` is a live dlopen handle (closed only in Drop) and the name is a
        // valid C string.
        let sym = unsafe { libc::dlsym(self.handle, c_name.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    }

    /// True when the library exports `name`.
    pub fn exports(&self, name: &str) -> bool {
        self.symbol(name).is_some()
    }

    /// The `ncclNetPlugin_vN` versions the library exports, newest first.
    pub fn net_versions(&self) -> Vec<u32> {
        (OLDEST_VERSION..=NEWEST_VERSION)
            .rev()
            .filter(|v| self.exports(&format!("ncclNetPlugin_v{v}")))
            .collect()
    }

    /// The exported function `name` as the function pointer type `F`.
    ///
    /// # Safety
    /// `F` must be an `extern "C"` function pointer type matching the symbol's definition,
    /// and the pointer must not be called after the library is closed.
    pub unsafe fn function<F: Copy>(&self, name: &str) -> Option<F> {
        let sym = self.symbol(name)?;
        if std::mem::size_of::<F>() != std::mem::size_of::<*mut c_void>() {
            return None;
        }
        // SAFETY: per this function's contract `F` is a function pointer type (same size as
        // a data pointer, checked) of the symbol's real signature.
        Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&sym) })
    }
}

impl Drop for NetLibrary {
    fn drop(&mut self) {
        if self.unload {
            // SAFETY: the handle came from dlopen; everything made from this library holds an
            // Arc to it, so nothing uses the library any more.
            unsafe { libc::dlclose(self.handle) };
        }
    }
}

/// The loaded image (its base address) that holds `addr`.
fn image_of(addr: *const c_void) -> Option<usize> {
    // SAFETY: Dl_info is plain data (pointers and NULLs), valid when zeroed.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the address and fills `info`.
    let found = unsafe { libc::dladdr(addr, &mut info) } != 0;
    found.then_some(info.dli_fbase as usize)
}

// ---- the plugin -----------------------------------------------------------------------------

/// What a plugin's `init` returned: a v11+ context (NULL for older versions, or for a v11+
/// plugin that keeps none). Valid for the plugin that made it until [`NetPlugin::finalize`]
/// consumes it; it keeps the library loaded.
pub struct NetContext {
    raw: *mut c_void,
    lib: Arc<NetLibrary>,
    version: u32,
    /// The communicator's traffic class (`NCCL_NET_TRAFFIC_CLASS_UNDEF`: none): v11+ took it
    /// at `init`, v10 gets it at every `connect` in this context.
    traffic_class: c_int,
    /// A v8-v10 context [`NetPlugin::init`] counted in its library's `legacy_holds`.
    holds_legacy: bool,
}

impl NetContext {
    /// The traffic class the context was made for; `None` when it has none.
    pub fn traffic_class(&self) -> Option<i32> {
        (self.traffic_class != NCCL_NET_TRAFFIC_CLASS_UNDEF).then_some(self.traffic_class)
    }
}

// SAFETY: the context is only passed back to its plugin, which NCCL calls from several
// threads (plugins are thread-safe by contract).
unsafe impl Send for NetContext {}
// SAFETY: as above.
unsafe impl Sync for NetContext {}

/// An opaque pointer the plugin handed out: a comm, a request or a memory handle. Only the
/// plugin can tell whether one is valid, so the calls taking one are `unsafe fn`.
macro_rules! opaque {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name(*mut c_void);

        // SAFETY: never dereferenced here; NCCL plugins accept their comms, requests and
        // memory handles from any thread (NCCL uses them from its service and progress
        // threads).
        unsafe impl Send for $name {}
        // SAFETY: as above.
        unsafe impl Sync for $name {}

        impl $name {
            /// The address, as NCCL would hold it.
            pub fn addr(self) -> usize {
                self.0 as usize
            }

            /// Rebuilds one from an address handed out earlier (only the plugin can use it).
            pub fn from_addr(addr: usize) -> $name {
                $name(addr as *mut c_void)
            }
        }
    };
}

opaque!(
    /// A listen, send or receive comm of a plugin.
    NetComm
);
opaque!(
    /// An outstanding `isend`/`irecv` of a plugin.
    NetRequest
);
opaque!(
    /// A memory registration (`mhandle`) of a plugin's comm.
    NetMr
);

/// One buffer of a (possibly grouped) receive.
#[derive(Clone, Copy, Debug)]
pub struct NetRecvBuf {
    /// Where the message lands.
    pub data: *mut u8,
    /// Bytes posted (the message may be shorter).
    pub size: usize,
    /// Tag the message must carry.
    pub tag: i32,
    /// The buffer's registration with the comm.
    pub mr: NetMr,
    /// NCCL's profiler handle for this buffer (v10+; NULL: none), which the plugin hands back
    /// to the profiler callback its `init` got.
    pub phandle: *mut c_void,
}

/// A net plugin loaded from a library, its table adapted into the current shape.
pub struct NetPlugin {
    api: Box<dyn Adapter>,
    shared: Shared,
    version: u32,
    name: String,
    max_bytes: usize,
    lib: Arc<NetLibrary>,
}

// SAFETY: the adapter holds a copy of the plugin's table (a name pointer to static data and
// function pointers), never mutated; NCCL calls plugins from several threads, so their
// functions are thread-safe by contract. The library stays loaded while `lib` lives.
unsafe impl Send for NetPlugin {}
// SAFETY: as above.
unsafe impl Sync for NetPlugin {}

impl NetPlugin {
    /// Finds the newest `ncclNetPlugin_vN` of `lib` with N in `versions` (within 6..=12) and
    /// adapts it. Refuses a table that lies in the image this code runs in (loading our own
    /// library into itself would recurse).
    pub fn load(lib: Arc<NetLibrary>, versions: RangeInclusive<u32>) -> Result<NetPlugin> {
        let path = lib.path().display().to_string();
        let found = VERSIONS
            .iter()
            .filter(|(v, _)| versions.contains(v))
            .find_map(|&(v, adapt)| Some((v, adapt, lib.symbol(&format!("ncclNetPlugin_v{v}"))?)));
        let Some((version, adapt, sym)) = found else {
            return Err(Error::invalid_argument(format!(
                "{path}: no ncclNetPlugin_v{}..v{} symbol (not an NCCL net plugin, or not one \
                 of these versions)",
                versions.start(),
                versions.end()
            )));
        };
        let own = image_of(image_of as *const c_void);
        if own.is_some() && image_of(sym) == own {
            return Err(Error::invalid_argument(format!(
                "{path} is this library itself (load a copy of the file under another name)"
            )));
        }
        // SAFETY: `sym` is the library's exported ncclNetPlugin_v{version}, a table of that
        // version (the contract under which the library was opened).
        let adapted = unsafe { adapt(sym) }
            .map_err(|e| Error::invalid_argument(format!("{path}: {}", e.message)))?;
        // SAFETY: a plugin's `name` is NULL or a static NUL-terminated string.
        let name = unsafe { c_string(adapted.name) }.unwrap_or_else(|| "unnamed".into());
        Ok(NetPlugin {
            api: adapted.api,
            shared: adapted.shared,
            version,
            name,
            max_bytes: adapted.max_bytes,
            lib,
        })
    }

    /// The table version in use (6 to 12).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The plugin's `name` field.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The library the plugin lives in.
    pub fn library(&self) -> &Arc<NetLibrary> {
        &self.lib
    }

    /// Largest message one `isend`/`irecv` buffer may carry (v8: [`V8_MAX_BYTES`]).
    pub fn max_message_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Turns a return code into a result whose message names the plugin and the call.
    fn check(&self, code: Code, what: &str) -> Result<()> {
        match error_kind(code) {
            None => Ok(()),
            Some(kind) => Err(Error::new(
                kind,
                format!(
                    "net plugin {} ({}): {what} returned {} ({})",
                    self.name,
                    self.lib.path().display(),
                    super::result_name(code),
                    code.0
                ),
            )),
        }
    }

    fn check_ctx(&self, ctx: &NetContext) -> Result<*mut c_void> {
        if Arc::ptr_eq(&ctx.lib, &self.lib) && ctx.version == self.version {
            Ok(ctx.raw)
        } else {
            Err(Error::invalid_usage(
                "a net plugin context used with another plugin",
            ))
        }
    }

    fn check_size(&self, size: usize, what: &str) -> Result<()> {
        if size <= self.max_bytes {
            Ok(())
        } else {
            Err(Error::invalid_argument(format!(
                "{what} of {size} bytes: net v{} carries at most {} bytes per message",
                self.version, self.max_bytes
            )))
        }
    }

    /// Calls `init` (v11+: for the communicator `comm_id`, with no traffic class; v10+: with
    /// no profiler callback).
    pub fn init(&self, comm_id: u64, logger: ncclDebugLogger_t) -> Result<NetContext> {
        self.init_profiled(comm_id, logger, None)
    }

    /// Calls `init` as [`NetPlugin::init`] does, handing v10+ the profiler callback
    /// `profiler` (v8 and v9 take none: it is not passed).
    pub fn init_profiled(
        &self,
        comm_id: u64,
        logger: ncclDebugLogger_t,
        profiler: ncclProfilerCallback_t,
    ) -> Result<NetContext> {
        self.init_for_class(comm_id, None, logger, profiler)
    }

    /// Calls `init` for a communicator of traffic class `traffic_class` (`None`: none), as
    /// NCCL 2.28+ does: v11+ get it in their `init` config; v10 gets it at every `connect`
    /// made in the returned context (NCCL 2.26-2.27 pass it there); v8 and v9 have none.
    /// A v8-v10 plugin's `init` runs only when no context of its library made here is live,
    /// as NCCL's compat layer calls it; [`NetPlugin::finalize`] counts such a context down.
    pub fn init_for_class(
        &self,
        comm_id: u64,
        traffic_class: Option<i32>,
        logger: ncclDebugLogger_t,
        profiler: ncclProfilerCallback_t,
    ) -> Result<NetContext> {
        let class = traffic_class.unwrap_or(NCCL_NET_TRAFFIC_CLASS_UNDEF);
        let mut raw: *mut c_void = std::ptr::null_mut();
        if self.version < 11 {
            // A v8-v10 plugin is initialised once per process: NCCL's compat layer calls its
            // `init` only while no communicator holds it (`refCount` in
            // src/plugin/net/net_v8.cc .. net_v10.cc), and its `finalize` only counts down.
            let mut holds = self.lib.legacy_holds();
            if *holds == 0 {
                // SAFETY: as below.
                let code = unsafe { self.api.init(&mut raw, comm_id, class, logger, profiler) };
                self.check(code, "init")?;
            }
            *holds += 1;
            return Ok(NetContext {
                raw,
                lib: Arc::clone(&self.lib),
                version: self.version,
                traffic_class: class,
                holds_legacy: true,
            });
        }
        // SAFETY: a context out-pointer that outlives the call; `logger` and `profiler` are
        // NCCL's contract for a logger and a profiler callback (function pointers the caller
        // vouches for, or NULL).
        let code = unsafe { self.api.init(&mut raw, comm_id, class, logger, profiler) };
        self.check(code, "init")?;
        Ok(NetContext {
            raw,
            lib: Arc::clone(&self.lib),
            version: self.version,
            traffic_class: class,
            holds_legacy: false,
        })
    }

    /// For a plugin older than v11 (one process-wide `init`, no context): a context that
    /// connects with traffic class `traffic_class` (v10 takes it at `connect`; v8 and v9
    /// ignore it), made without calling `init` again. `None` for v11+, whose contexts only
    /// `init` makes.
    pub fn class_context(&self, traffic_class: Option<i32>) -> Option<NetContext> {
        (self.version < 11).then(|| NetContext {
            raw: std::ptr::null_mut(),
            lib: Arc::clone(&self.lib),
            version: self.version,
            traffic_class: traffic_class.unwrap_or(NCCL_NET_TRAFFIC_CLASS_UNDEF),
            holds_legacy: false,
        })
    }

    /// Calls `finalize(ctx)` (v11+; v8-v10 have none: the context stops holding the plugin). The comms made in `ctx` are no longer
    /// live afterwards, except to be closed.
    pub fn finalize(&self, ctx: NetContext) -> Result<()> {
        let raw = self.check_ctx(&ctx)?;
        if ctx.holds_legacy {
            let mut holds = self.lib.legacy_holds();
            *holds = holds.saturating_sub(1);
        }
        // SAFETY: the context came from this plugin's init and is consumed here.
        let code = unsafe { self.api.finalize(raw) };
        self.check(code, "finalize")
    }

    /// Number of devices.
    pub fn devices(&self) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: a valid int out-pointer.
        let code = unsafe { (self.shared.devices)(&mut n) };
        self.check(code, "devices")?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Properties of device `dev`, in the current shape.
    pub fn properties(&self, dev: usize) -> Result<NetProperties> {
        let d = c_int::try_from(dev).map_err(|_| Error::invalid_argument("device index"))?;
        // SAFETY: the adapter passes a struct of the version's layout, owned by its frame.
        match unsafe { self.api.properties(d) } {
            Ok(props) => Ok(props),
            Err(code) => Err(self
                .check(code, "getProperties")
                .err()
                .unwrap_or_else(|| Error::internal("getProperties failed without a code"))),
        }
    }

    /// Starts listening on `dev` in `ctx`; the plugin writes its connection handle into
    /// `handle`.
    pub fn listen(
        &self,
        ctx: &NetContext,
        dev: usize,
        handle: &mut [u8; HANDLE_BYTES],
    ) -> Result<NetComm> {
        let ctx = self.check_ctx(ctx)?;
        let d = c_int::try_from(dev).map_err(|_| Error::invalid_argument("device index"))?;
        // SAFETY: a live context of this plugin and a writable handle of HANDLE_BYTES.
        let (code, comm) = unsafe { self.api.listen(ctx, d, handle.as_mut_ptr().cast()) };
        self.check(code, "listen")?;
        if comm.is_null() {
            return Err(Error::internal(format!(
                "net plugin {}: listen returned no comm",
                self.name
            )));
        }
        Ok(NetComm(comm))
    }

    /// Advances a connect to the listener whose handle is in `handle`: `Ok(None)` until the
    /// send comm is ready.
    ///
    /// # Safety
    /// Every call for one connection passes the same `handle` memory, not changed by the
    /// caller in between (the plugin may keep its progress there), and no other connection's.
    pub unsafe fn connect(
        &self,
        ctx: &NetContext,
        dev: usize,
        handle: &mut [u8; HANDLE_BYTES],
    ) -> Result<Option<NetComm>> {
        let class = ctx.traffic_class;
        let ctx = self.check_ctx(ctx)?;
        let d = c_int::try_from(dev).map_err(|_| Error::invalid_argument("device index"))?;
        // SAFETY: a live context, and the handle per this function's contract.
        let (code, comm) = unsafe { self.api.connect(ctx, d, handle.as_mut_ptr().cast(), class) };
        if let Err(err) = self.check(code, "connect") {
            if !comm.is_null() {
                // A comm the failed call handed out all the same is closed, as NCCL's proxy
                // closes it (`sendProxyConnect`, src/transport/net.cc); the error is the
                // connect's.
                // SAFETY: the sendComm the plugin just wrote, used nowhere else.
                let _ = unsafe { (self.shared.close_send)(comm) };
            }
            return Err(err);
        }
        Ok((!comm.is_null()).then_some(NetComm(comm)))
    }

    /// Advances an accept on `listen`: `Ok(None)` until a peer has connected.
    ///
    /// # Safety
    /// `listen` came from this plugin's [`NetPlugin::listen`] and is not closed.
    pub unsafe fn accept(&self, listen: NetComm) -> Result<Option<NetComm>> {
        let mut comm: *mut c_void = std::ptr::null_mut();
        let mut dev_comm: *mut ncclNetDeviceHandle_v8_t = std::ptr::null_mut();
        let code = match self.shared.accept {
            // SAFETY: a live listen comm per this function's contract; valid out-pointers.
            AcceptEntry::DevComm(accept) => unsafe { accept(listen.0, &mut comm, &mut dev_comm) },
            // SAFETY: as above (v6 has no device handle).
            AcceptEntry::Plain(accept) => unsafe { accept(listen.0, &mut comm) },
        };
        self.check(code, "accept")?;
        Ok((!comm.is_null()).then_some(NetComm(comm)))
    }

    /// Registers `len` bytes of host memory at `data` with `comm` (`NCCL_PTR_HOST`).
    ///
    /// # Safety
    /// `comm` is a live send or receive comm of this plugin; `data..data + len` is host
    /// memory that stays allocated until [`NetPlugin::dereg_mr`] releases the registration.
    pub unsafe fn reg_mr(&self, comm: NetComm, data: *mut u8, len: usize) -> Result<NetMr> {
        let mut mh: *mut c_void = std::ptr::null_mut();
        let kind = NCCL_PTR_HOST as c_int;
        let code = match self.shared.reg_mr {
            // SAFETY: per this function's contract; a valid out-pointer.
            RegMrEntry::SizeT(reg) => unsafe { reg(comm.0, data.cast(), len, kind, &mut mh) },
            RegMrEntry::Int(reg) => match c_int::try_from(len) {
                // SAFETY: as above, the size in v6's and v7's `int`.
                Ok(len) => unsafe { reg(comm.0, data.cast(), len, kind, &mut mh) },
                // What NCCL's `net_v6.cc` and `net_v7.cc` answer for 2 GiB and more.
                Err(_) => {
                    return Err(Error::internal(format!(
                        "regMr of {len} bytes: a v{} table takes at most {} bytes at once",
                        self.version,
                        c_int::MAX
                    )))
                }
            },
        };
        self.check(code, "regMr")?;
        Ok(NetMr(mh))
    }

    /// Releases a registration.
    ///
    /// # Safety
    /// `mr` came from [`NetPlugin::reg_mr`] on the live `comm`, is released once, and no
    /// outstanding request uses it.
    pub unsafe fn dereg_mr(&self, comm: NetComm, mr: NetMr) -> Result<()> {
        // SAFETY: per this function's contract.
        let code = unsafe { (self.shared.dereg_mr)(comm.0, mr.0) };
        self.check(code, "deregMr")
    }

    /// Posts a send of `len` bytes at `data`; `Ok(None)` when the plugin has no free request
    /// (retry later).
    ///
    /// # Safety
    /// `comm` is a live send comm of this plugin and `mr` a registration on it covering
    /// `data..data + len`, which stays allocated and unchanged until the request tests done
    /// (or the comm is closed).
    pub unsafe fn isend(
        &self,
        comm: NetComm,
        data: *mut u8,
        len: usize,
        tag: i32,
        mr: NetMr,
    ) -> Result<Option<NetRequest>> {
        // SAFETY: per this function's contract; no profiler handle.
        unsafe { self.isend_profiled(comm, data, len, tag, mr, std::ptr::null_mut()) }
    }

    /// Posts a send as [`NetPlugin::isend`] does, with the profiler handle `phandle` for
    /// v10+ (v8 and v9 take none: it is not passed).
    ///
    /// # Safety
    /// As [`NetPlugin::isend`]; `phandle` is NULL or what the profiler callback handed to
    /// this plugin's `init` accepts as a parent handle until the request tests done.
    pub unsafe fn isend_profiled(
        &self,
        comm: NetComm,
        data: *mut u8,
        len: usize,
        tag: i32,
        mr: NetMr,
        phandle: *mut c_void,
    ) -> Result<Option<NetRequest>> {
        self.check_size(len, "isend")?;
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: per this function's contract; the size fits the version (checked).
        let code = unsafe {
            self.api
                .isend(comm.0, data.cast(), len, tag, mr.0, phandle, &mut req)
        };
        self.check(code, "isend")?;
        Ok((!req.is_null()).then_some(NetRequest(req)))
    }

    /// Posts a receive of 1 to [`MAX_GROUPED_RECVS`] buffers (grouped when more than one);
    /// `Ok(None)` when the plugin has no free request.
    ///
    /// # Safety
    /// `comm` is a live receive comm of this plugin; each buffer's `data..data + size` is
    /// covered by its registration `mr` on `comm`, stays allocated and is not accessed by
    /// the caller until the request tests done (or the comm is closed); each `phandle` is NULL
    /// or what the profiler callback handed to this plugin's `init` accepts as a parent handle
    /// until the request tests done.
    pub unsafe fn irecv(&self, comm: NetComm, bufs: &[NetRecvBuf]) -> Result<Option<NetRequest>> {
        let n = bufs.len();
        if !(1..=MAX_GROUPED_RECVS).contains(&n) {
            return Err(Error::invalid_argument(format!(
                "irecv of {n} buffers (1 to {MAX_GROUPED_RECVS})"
            )));
        }
        let mut data = [std::ptr::null_mut::<c_void>(); MAX_GROUPED_RECVS];
        let mut sizes = [0usize; MAX_GROUPED_RECVS];
        let mut tags = [0 as c_int; MAX_GROUPED_RECVS];
        let mut mhs = [std::ptr::null_mut::<c_void>(); MAX_GROUPED_RECVS];
        let mut phandles = [std::ptr::null_mut::<c_void>(); MAX_GROUPED_RECVS];
        for (i, b) in bufs.iter().enumerate() {
            self.check_size(b.size, "irecv")?;
            (data[i], sizes[i], tags[i], mhs[i]) = (b.data.cast(), b.size, b.tag, b.mr.0);
            phandles[i] = b.phandle;
        }
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: per this function's contract; arrays of `n` entries that outlive the call,
        // sizes within the version's limit (checked).
        let code = unsafe {
            self.api.irecv(
                comm.0,
                n as c_int,
                data.as_mut_ptr(),
                sizes.as_mut_ptr(),
                tags.as_mut_ptr(),
                mhs.as_mut_ptr(),
                phandles.as_mut_ptr(),
                &mut req,
            )
        };
        self.check(code, "irecv")?;
        Ok((!req.is_null()).then_some(NetRequest(req)))
    }

    /// Tests a request: `Some(sizes)` once done (bytes received per buffer; a send reports
    /// its size in the first), after which the request is gone.
    ///
    /// # Safety
    /// `req` is an outstanding request of this plugin (not yet reported done) whose comm is
    /// not closed.
    pub unsafe fn test(&self, req: NetRequest) -> Result<Option<[i32; MAX_GROUPED_RECVS]>> {
        let mut done: c_int = 0;
        let mut sizes = [-1 as c_int; MAX_GROUPED_RECVS];
        // SAFETY: per this function's contract; `sizes` has room for the most buffers a
        // request can have.
        let code = unsafe { (self.shared.test)(req.0, &mut done, sizes.as_mut_ptr()) };
        self.check(code, "test")?;
        Ok((done != 0).then_some(sizes))
    }

    /// Tells the plugin that the data of a receive request of `n` buffers, which `test`
    /// already reported done, was consumed and its buffers may be posted again
    /// (`irecvConsumed`, as NCCL's `recvProxyProgress` calls it for every receive once the
    /// GPU read it). Nothing happens when the plugin has no such call.
    ///
    /// # Safety
    /// `comm` is the live receive comm `req` was posted on, `req` tested done with `n`
    /// buffers, and this is the only `irecvConsumed` for it.
    pub unsafe fn irecv_consumed(&self, comm: NetComm, n: usize, req: NetRequest) -> Result<()> {
        let Some(consumed) = self.shared.irecv_consumed else {
            return Ok(());
        };
        let n = c_int::try_from(n).map_err(|_| Error::invalid_argument("irecvConsumed count"))?;
        // SAFETY: per this function's contract.
        let code = unsafe { consumed(comm.0, n, req.0) };
        self.check(code, "irecvConsumed")
    }

    /// Closes a send comm.
    ///
    /// # Safety
    /// `comm` is a live send comm of this plugin, closed once; it is not used afterwards.
    pub unsafe fn close_send(&self, comm: NetComm) -> Result<()> {
        // SAFETY: per this function's contract.
        let code = unsafe { (self.shared.close_send)(comm.0) };
        self.check(code, "closeSend")
    }

    /// Closes a receive comm.
    ///
    /// # Safety
    /// `comm` is a live receive comm of this plugin, closed once; it is not used afterwards.
    pub unsafe fn close_recv(&self, comm: NetComm) -> Result<()> {
        // SAFETY: per this function's contract.
        let code = unsafe { (self.shared.close_recv)(comm.0) };
        self.check(code, "closeRecv")
    }

    /// Closes a listen comm.
    ///
    /// # Safety
    /// `comm` is a live listen comm of this plugin, closed once; it is not used afterwards.
    pub unsafe fn close_listen(&self, comm: NetComm) -> Result<()> {
        // SAFETY: per this function's contract.
        let code = unsafe { (self.shared.close_listen)(comm.0) };
        self.check(code, "closeListen")
    }

    /// Calls `setNetAttr(ctx, attr)` with the whole of `attr` (the communicators' send and
    /// receive attributes too, as NCCL fills them); `Ok(false)` when the plugin has no such
    /// call.
    pub fn set_net_attributes(&self, ctx: &NetContext, attr: &ncclNetAttr_v11_t) -> Result<bool> {
        let raw = self.check_ctx(ctx)?;
        // The plugin takes a mutable pointer: it gets a copy.
        let mut attr = *attr;
        // SAFETY: a live context of this plugin and an attribute struct owned by this frame.
        match unsafe { self.api.set_net_attr(raw, &mut attr) } {
            None => Ok(false),
            Some(code) => self.check(code, "setNetAttr").map(|()| true),
        }
    }
}
