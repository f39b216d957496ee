//! The FFI edge of wrap mode: loads another NCCL net plugin with `dlopen(RTLD_LOCAL)`, picks
//! its newest `ncclNetPlugin_vN` table (v8 to v12) and offers one safe, version-independent
//! API over it. Every call into the foreign table is here, with its reason to be sound.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;

use crate::abi::ffi::{
    ncclDebugLogger_t, ncclNetCommConfig_v10_t, ncclNetDeviceHandle_v8_t, ncclNetDeviceType,
    ncclNetProperties_v11_t, ncclNetProperties_v12_t, ncclNetProperties_v8_t,
    ncclNetProperties_v9_t, ncclNet_v10_t, ncclNet_v11_t, ncclNet_v12_t, ncclNet_v8_t,
    ncclNet_v9_t, ncclResult_t, NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_PTR_HOST,
};
use crate::transport::HANDLE_SIZE;
use crate::{Error, Result};

/// Largest message NCCL's v9+ API allows a plugin to advertise (1 TiB).
const MAX_BYTES: usize = 1 << 40;

/// An opaque pointer the inner plugin handed us (comm, request or memory handle). We only
/// give it back to the plugin that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opaque(*mut c_void);

// SAFETY: an Opaque is never dereferenced by us; NCCL plugins accept their comms, requests
// and memory handles from any thread (NCCL itself uses them from its service and progress
// threads).
unsafe impl Send for Opaque {}
// SAFETY: as above.
unsafe impl Sync for Opaque {}

impl Opaque {
    /// The address, as NCCL would hold it (our `mhandle`).
    pub fn addr(self) -> usize {
        self.0 as usize
    }

    /// Rebuilds a handle from an address we handed out.
    pub fn from_addr(addr: usize) -> Opaque {
        Opaque(addr as *mut c_void)
    }
}

/// What the inner plugin says about one of its devices, whatever its API version.
#[derive(Clone, Debug)]
pub struct InnerProps {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
    /// PCI path in /sys, when the plugin gives one.
    pub pci_path: Option<String>,
    /// Device GUID.
    pub guid: u64,
    /// `NCCL_PTR_*` bits the device accepts.
    pub ptr_support: c_int,
    /// Link speed, Mbps.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Latency, microseconds.
    pub latency: f32,
    /// Most connections.
    pub max_comms: c_int,
    /// Most buffers per grouped receive.
    pub max_recvs: c_int,
    /// Largest point-to-point message.
    pub max_p2p_bytes: usize,
    /// Largest collective message.
    pub max_coll_bytes: usize,
}

#[derive(Clone, Copy)]
enum Table {
    V8(&'static ncclNet_v8_t),
    V9(&'static ncclNet_v9_t),
    V10(&'static ncclNet_v10_t),
    V11(&'static ncclNet_v11_t),
    V12(&'static ncclNet_v12_t),
}

/// A loaded, initialised inner net plugin. Never `dlclose`d: NCCL may unload us while the
/// inner plugin's own threads wind down, and a second load reuses the same image.
pub struct InnerPlugin {
    table: Table,
    ctx: Opaque,
    /// The file that was loaded.
    pub path: PathBuf,
    /// The plugin's own name (its `name` field, e.g. "IB", "AWS Libfabric").
    pub name: String,
    /// The ABI version used (8 to 12).
    pub version: u32,
}

// SAFETY: the table is an immutable static of the inner library (never unloaded) holding
// a name pointer and function pointers; NCCL calls plugins from several threads, so their
// functions are thread-safe by contract. The context is only passed back to the plugin.
unsafe impl Send for InnerPlugin {}
// SAFETY: as above.
unsafe impl Sync for InnerPlugin {}

/// Takes a function from the table, or says which one the plugin lacks.
fn entry<T>(f: Option<T>, what: &str) -> Result<T> {
    f.ok_or_else(|| Error::internal(format!("the inner plugin has no `{what}` function")))
}

/// Evaluates `$call` with `$t` bound to the loaded table, whatever its version: for the
/// entries whose signature is the same in v8 to v12.
macro_rules! any_table {
    ($table:expr, $t:ident => $call:expr) => {
        match $table {
            Table::V8($t) => $call,
            Table::V9($t) => $call,
            Table::V10($t) => $call,
            Table::V11($t) => $call,
            Table::V12($t) => $call,
        }
    };
}

/// The file names tried for `spec`, as NCCL resolves `NCCL_NET_PLUGIN`: a path as given;
/// a name as given, then as `libnccl-net-<name>.so`.
pub fn candidates(spec: &str) -> Vec<String> {
    let spec = spec.trim();
    if spec.contains('/') || (spec.starts_with("lib") && spec.contains(".so")) {
        vec![spec.to_string()]
    } else {
        vec![spec.to_string(), format!("libnccl-net-{spec}.so")]
    }
}

/// The text of the last `dlerror` (also the harness's, which loads plugins the same way).
pub fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; we copy it at once.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (see above).
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Looks up `symbol` in the library behind `handle`.
fn symbol(handle: *mut c_void, symbol: &CStr) -> *mut c_void {
    // SAFETY: `handle` is a live dlopen handle (never closed) and `symbol` is NUL-terminated.
    unsafe { libc::dlsym(handle, symbol.as_ptr()) }
}

/// Our own exported net tables: finding one of them in the "inner" library means it is
/// this very image, which would recurse into itself.
fn own_tables() -> [usize; 5] {
    use crate::abi::tables as t;
    [
        &t::ncclNetPlugin_v8 as *const _ as usize,
        &t::ncclNetPlugin_v9 as *const _ as usize,
        &t::ncclNetPlugin_v10 as *const _ as usize,
        &t::ncclNetPlugin_v11 as *const _ as usize,
        &t::ncclNetPlugin_v12 as *const _ as usize,
    ]
}

impl InnerPlugin {
    /// Loads the plugin named by `spec` (a path, or a name like "ib"), tells it that it runs
    /// wrapped when it is a copy of this library (`ncclLossyInnerMode`), and initialises it.
    pub fn open(spec: &str, logger: ncclDebugLogger_t) -> Result<InnerPlugin> {
        Self::open_up_to(spec, logger, 12)
    }

    /// As [`InnerPlugin::open`], using no table newer than `ncclNetPlugin_v{newest}` (tests
    /// drive the older version adapters with it).
    pub fn open_up_to(spec: &str, logger: ncclDebugLogger_t, newest: u32) -> Result<InnerPlugin> {
        let mut tried = Vec::new();
        let mut loaded = None;
        for name in candidates(spec) {
            let c_name = CString::new(name.as_str())
                .map_err(|_| Error::invalid_argument(format!("inner {spec:?} contains NUL")))?;
            // SAFETY: a valid NUL-terminated file name and plain dlopen flags; RTLD_LOCAL keeps
            // the plugin's symbols out of the global namespace (ours and NCCL's).
            let handle =
                unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                tried.push(format!("{name}: {}", dl_error()));
            } else {
                loaded = Some((handle, name));
                break;
            }
        }
        let Some((handle, file)) = loaded else {
            return Err(Error::invalid_argument(format!(
                "cannot load the inner net plugin {spec:?} (tried {})",
                tried.join("; ")
            )));
        };
        let mut found = None;
        for version in (8..=newest.min(12)).rev() {
            let name = CString::new(format!("ncclNetPlugin_v{version}")).unwrap_or_default();
            let ptr = symbol(handle, &name);
            if !ptr.is_null() {
                found = Some((version, ptr));
                break;
            }
        }
        let Some((version, ptr)) = found else {
            return Err(Error::invalid_argument(format!(
                "inner net plugin {file}: no ncclNetPlugin_v8 .. ncclNetPlugin_v12 symbol \
                 (not an NCCL net plugin, or one too old for wrap mode)"
            )));
        };
        if own_tables().contains(&(ptr as usize)) {
            return Err(Error::invalid_argument(format!(
                "inner net plugin {file} is this library itself; to wrap a copy of it, copy \
                 the file to another name and point `inner` at the copy"
            )));
        }
        // SAFETY: `ptr` is the address of the plugin's exported ncclNetPlugin_v{version}
        // table, which has that version's layout and lives as long as the library, which
        // we never unload.
        let table = unsafe {
            match version {
                8 => Table::V8(&*(ptr as *const ncclNet_v8_t)),
                9 => Table::V9(&*(ptr as *const ncclNet_v9_t)),
                10 => Table::V10(&*(ptr as *const ncclNet_v10_t)),
                11 => Table::V11(&*(ptr as *const ncclNet_v11_t)),
                _ => Table::V12(&*(ptr as *const ncclNet_v12_t)),
            }
        };
        let inner_mode = symbol(handle, c"ncclLossyInnerMode");
        if !inner_mode.is_null() {
            // SAFETY: a copy of this library exports `ncclLossyInnerMode` as
            // `extern "C" fn() -> c_int`; it only sets a flag in that image.
            let set: extern "C" fn() -> c_int = unsafe { std::mem::transmute(inner_mode) };
            set();
        }
        // SAFETY: a plugin's `name` is a static NUL-terminated string (or NULL).
        let name =
            unsafe { c_string(any_table!(table, t => t.name)) }.unwrap_or_else(|| "unnamed".into());
        let mut plugin = InnerPlugin {
            table,
            ctx: Opaque(std::ptr::null_mut()),
            path: PathBuf::from(file),
            name,
            version,
        };
        plugin.init(logger)?;
        Ok(plugin)
    }

    /// Turns an inner return code into a result whose message names the plugin and call.
    fn check(&self, code: ncclResult_t, what: &str) -> Result<()> {
        let Some(kind) = crate::abi::error_kind(code) else {
            return Ok(());
        };
        Err(Error::new(
            kind,
            format!(
                "inner net plugin {} ({}): {what} failed with {code:?}",
                self.name,
                self.path.display()
            ),
        ))
    }

    fn init(&mut self, logger: ncclDebugLogger_t) -> Result<()> {
        let code = match self.table {
            // SAFETY: init is the first call into the table, made once, with NCCL's logger
            // (a function that lives as long as NCCL) or NULL.
            Table::V8(t) => unsafe { entry(t.init, "init")?(logger) },
            // SAFETY: as above.
            Table::V9(t) => unsafe { entry(t.init, "init")?(logger) },
            // SAFETY: as above; no profiler callback.
            Table::V10(t) => unsafe { entry(t.init, "init")?(logger, None) },
            Table::V11(_) | Table::V12(_) => {
                let mut config = ncclNetCommConfig_v10_t {
                    trafficClass: NCCL_NET_TRAFFIC_CLASS_UNDEF,
                };
                let mut ctx: *mut c_void = std::ptr::null_mut();
                let init = match self.table {
                    Table::V11(t) => entry(t.init, "init")?,
                    Table::V12(t) => entry(t.init, "init")?,
                    _ => return Err(Error::internal("unreachable table version")),
                };
                // SAFETY: one process-wide context (commId 0), a valid config struct and
                // context out-pointer that outlive the call, NCCL's logger or NULL.
                let code = unsafe { init(&mut ctx, 0, &mut config, logger, None) };
                self.ctx = Opaque(ctx);
                code
            }
        };
        self.check(code, "init")
    }

    /// Number of devices.
    pub fn devices(&self) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: a valid int out-pointer.
        let code = any_table!(self.table, t => unsafe { entry(t.devices, "devices")?(&mut n) });
        self.check(code, "devices")?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Properties of device `dev`.
    pub fn properties(&self, dev: usize) -> Result<InnerProps> {
        let d = c_int::try_from(dev).map_err(|_| Error::invalid_argument("device index"))?;
        macro_rules! common {
            ($p:expr, $p2p:expr, $coll:expr) => {{
                let p = $p;
                if p.netDeviceType != ncclNetDeviceType::NCCL_NET_DEVICE_HOST {
                    return Err(Error::invalid_argument(format!(
                        "inner net plugin {}: device {dev} is a device-side (GPU-initiated) \
                         network, which wrap mode cannot carry",
                        self.name
                    )));
                }
                InnerProps {
                    // SAFETY: getProperties points `name`/`pciPath` at NUL-terminated
                    // strings (or NULL) that outlive this copy.
                    name: unsafe { c_string(p.name) }.unwrap_or_else(|| format!("dev{dev}")),
                    // SAFETY: as for `name`.
                    pci_path: unsafe { c_string(p.pciPath) },
                    guid: p.guid,
                    ptr_support: p.ptrSupport,
                    speed: p.speed,
                    port: p.port,
                    latency: p.latency,
                    max_comms: p.maxComms,
                    max_recvs: p.maxRecvs,
                    max_p2p_bytes: $p2p,
                    max_coll_bytes: $coll,
                }
            }};
        }
        let props = match self.table {
            Table::V8(t) => {
                let mut p = ncclNetProperties_v8_t::default();
                // SAFETY: a valid, writable v8 properties struct.
                let code = unsafe { entry(t.getProperties, "getProperties")?(d, &mut p) };
                self.check(code, "getProperties")?;
                // v8 sizes are `int`.
                common!(&p, i32::MAX as usize, i32::MAX as usize)
            }
            Table::V9(t) => {
                let mut p = ncclNetProperties_v9_t::default();
                // SAFETY: a valid, writable v9 properties struct.
                let code = unsafe { entry(t.getProperties, "getProperties")?(d, &mut p) };
                self.check(code, "getProperties")?;
                common!(&p, p.maxP2pBytes, p.maxCollBytes)
            }
            Table::V10(t) => {
                let mut p = ncclNetProperties_v9_t::default();
                // SAFETY: v10 uses the v9 properties struct; valid and writable.
                let code = unsafe { entry(t.getProperties, "getProperties")?(d, &mut p) };
                self.check(code, "getProperties")?;
                common!(&p, p.maxP2pBytes, p.maxCollBytes)
            }
            Table::V11(t) => {
                let mut p = ncclNetProperties_v11_t::default();
                // SAFETY: a valid, writable v11 properties struct.
                let code = unsafe { entry(t.getProperties, "getProperties")?(d, &mut p) };
                self.check(code, "getProperties")?;
                common!(&p, p.maxP2pBytes, p.maxCollBytes)
            }
            Table::V12(t) => {
                let mut p = ncclNetProperties_v12_t::default();
                // SAFETY: a valid, writable v12 properties struct.
                let code = unsafe { entry(t.getProperties, "getProperties")?(d, &mut p) };
                self.check(code, "getProperties")?;
                common!(&p, p.maxP2pBytes, p.maxCollBytes)
            }
        };
        let clamp = |x: usize| {
            if x == 0 || x > MAX_BYTES {
                MAX_BYTES
            } else {
                x
            }
        };
        Ok(InnerProps {
            max_p2p_bytes: clamp(props.max_p2p_bytes),
            max_coll_bytes: clamp(props.max_coll_bytes),
            ..props
        })
    }

    /// Starts listening on `dev`; the plugin writes its connection handle into `handle`.
    pub fn listen(&self, dev: usize, handle: &mut [u8; HANDLE_SIZE]) -> Result<Opaque> {
        let d = c_int::try_from(dev).map_err(|_| Error::invalid_argument("device index"))?;
        let h = handle.as_mut_ptr().cast::<c_void>();
        let mut comm: *mut c_void = std::ptr::null_mut();
        let ctx = self.ctx.0;
        let code = match self.table {
            // SAFETY: a writable NCCL_NET_HANDLE_MAXSIZE-byte handle and a comm out-pointer.
            Table::V8(t) => unsafe { entry(t.listen, "listen")?(d, h, &mut comm) },
            // SAFETY: as above.
            Table::V9(t) => unsafe { entry(t.listen, "listen")?(d, h, &mut comm) },
            // SAFETY: as above.
            Table::V10(t) => unsafe { entry(t.listen, "listen")?(d, h, &mut comm) },
            // SAFETY: as above, with the context the plugin's init returned.
            Table::V11(t) => unsafe { entry(t.listen, "listen")?(ctx, d, h, &mut comm) },
            // SAFETY: as above, with the context the plugin's init returned.
            Table::V12(t) => unsafe { entry(t.listen, "listen")?(ctx, d, h, &mut comm) },
        };
        self.check(code, "listen")?;
        if comm.is_null() {
            return Err(Error::internal(format!(
                "inner net plugin {}: listen returned no comm",
                self.name
            )));
        }
        Ok(Opaque(comm))
    }

    /// Advances a connect; `handle` must stay at one address until a comm comes back (the
    /// plugin may keep its progress in it).
    pub fn connect(&self, dev: usize, handle: &mut [u8; HANDLE_SIZE]) -> Result<Option<Opaque>> {
        let d = c_int::try_from(dev).map_err(|_| Error::invalid_argument("device index"))?;
        let h = handle.as_mut_ptr().cast::<c_void>();
        let mut comm: *mut c_void = std::ptr::null_mut();
        let mut dev_comm: *mut ncclNetDeviceHandle_v8_t = std::ptr::null_mut();
        let mut config = ncclNetCommConfig_v10_t {
            trafficClass: NCCL_NET_TRAFFIC_CLASS_UNDEF,
        };
        let ctx = self.ctx.0;
        let code = match self.table {
            // SAFETY: the handle from the peer's listen, writable and stable between calls
            // (it lives in our boxed connector); valid out-pointers.
            Table::V8(t) => unsafe { entry(t.connect, "connect")?(d, h, &mut comm, &mut dev_comm) },
            // SAFETY: as above.
            Table::V9(t) => unsafe { entry(t.connect, "connect")?(d, h, &mut comm, &mut dev_comm) },
            // SAFETY: as above, with a config struct that outlives the call.
            Table::V10(t) => unsafe {
                entry(t.connect, "connect")?(d, &mut config, h, &mut comm, &mut dev_comm)
            },
            // SAFETY: as above, with the context the plugin's init returned.
            Table::V11(t) => unsafe {
                entry(t.connect, "connect")?(ctx, d, h, &mut comm, &mut dev_comm)
            },
            // SAFETY: as above, with the context the plugin's init returned.
            Table::V12(t) => unsafe {
                entry(t.connect, "connect")?(ctx, d, h, &mut comm, &mut dev_comm)
            },
        };
        self.check(code, "connect")?;
        Ok((!comm.is_null()).then_some(Opaque(comm)))
    }

    /// Advances an accept on `listen`.
    pub fn accept(&self, listen: Opaque) -> Result<Option<Opaque>> {
        let mut comm: *mut c_void = std::ptr::null_mut();
        let mut dev_comm: *mut ncclNetDeviceHandle_v8_t = std::ptr::null_mut();
        let l = listen.0;
        // SAFETY: `listen` came from this plugin's listen and is not closed; valid
        // out-pointers.
        let code = any_table!(self.table, t => unsafe {
            entry(t.accept, "accept")?(l, &mut comm, &mut dev_comm)
        });
        self.check(code, "accept")?;
        Ok((!comm.is_null()).then_some(Opaque(comm)))
    }

    /// Registers `len` bytes of host memory at `data` with `comm`.
    pub fn reg_mr(&self, comm: Opaque, data: *mut u8, len: usize) -> Result<Opaque> {
        let mut mh: *mut c_void = std::ptr::null_mut();
        let (c, p, k) = (comm.0, data.cast::<c_void>(), NCCL_PTR_HOST as c_int);
        // SAFETY: `comm` is a live comm of this plugin; `data..data+len` is host memory
        // that stays allocated until the matching deregistration.
        let code =
            any_table!(self.table, t => unsafe { entry(t.regMr, "regMr")?(c, p, len, k, &mut mh) });
        self.check(code, "regMr")?;
        Ok(Opaque(mh))
    }

    /// Releases a registration of `comm`.
    pub fn dereg_mr(&self, comm: Opaque, mh: Opaque) -> Result<()> {
        let (c, m) = (comm.0, mh.0);
        // SAFETY: `mh` came from this comm's regMr and is released once.
        let code = any_table!(self.table, t => unsafe { entry(t.deregMr, "deregMr")?(c, m) });
        self.check(code, "deregMr")
    }

    /// Posts a send; `Ok(None)` when the plugin has no free request (retry later).
    pub fn isend(
        &self,
        comm: Opaque,
        data: *mut u8,
        len: usize,
        tag: i32,
        mh: Opaque,
    ) -> Result<Option<Opaque>> {
        let mut req: *mut c_void = std::ptr::null_mut();
        let (c, p, m) = (comm.0, data.cast::<c_void>(), mh.0);
        let null = std::ptr::null_mut();
        let code = match self.table {
            Table::V8(t) => {
                let n = c_int::try_from(len).map_err(|_| {
                    Error::invalid_argument(format!(
                        "a {len}-byte message does not fit the inner plugin's v8 API (int sizes)"
                    ))
                })?;
                // SAFETY: `data..data+len` is registered host memory (by `mh`) that stays
                // untouched until this request tests done; valid request out-pointer.
                unsafe { entry(t.isend, "isend")?(c, p, n, tag, m, &mut req) }
            }
            // SAFETY: as above.
            Table::V9(t) => unsafe { entry(t.isend, "isend")?(c, p, len, tag, m, &mut req) },
            // SAFETY: as above; no profiler handle.
            Table::V10(t) => unsafe { entry(t.isend, "isend")?(c, p, len, tag, m, null, &mut req) },
            // SAFETY: as above.
            Table::V11(t) => unsafe { entry(t.isend, "isend")?(c, p, len, tag, m, null, &mut req) },
            // SAFETY: as above.
            Table::V12(t) => unsafe { entry(t.isend, "isend")?(c, p, len, tag, m, null, &mut req) },
        };
        self.check(code, "isend")?;
        Ok((!req.is_null()).then_some(Opaque(req)))
    }

    /// Posts a receive of one buffer; `Ok(None)` when the plugin has no free request.
    pub fn irecv(
        &self,
        comm: Opaque,
        data: *mut u8,
        len: usize,
        tag: i32,
        mh: Opaque,
    ) -> Result<Option<Opaque>> {
        let mut req: *mut c_void = std::ptr::null_mut();
        let mut datas = [data.cast::<c_void>()];
        let mut tags = [tag];
        let mut mhs = [mh.0];
        let mut phandles = [std::ptr::null_mut::<c_void>()];
        let mut sizes = [len];
        let c = comm.0;
        let (d, t_, m, ph, sz) = (
            datas.as_mut_ptr(),
            tags.as_mut_ptr(),
            mhs.as_mut_ptr(),
            phandles.as_mut_ptr(),
            sizes.as_mut_ptr(),
        );
        let code = match self.table {
            Table::V8(t) => {
                let mut int_sizes = [c_int::try_from(len).map_err(|_| {
                    Error::invalid_argument(format!(
                        "a {len}-byte receive does not fit the inner plugin's v8 API (int sizes)"
                    ))
                })?];
                // SAFETY: one-entry arrays that outlive the call; the buffer is registered
                // host memory untouched by us until the request tests done.
                unsafe {
                    entry(t.irecv, "irecv")?(c, 1, d, int_sizes.as_mut_ptr(), t_, m, &mut req)
                }
            }
            // SAFETY: as above.
            Table::V9(t) => unsafe { entry(t.irecv, "irecv")?(c, 1, d, sz, t_, m, &mut req) },
            // SAFETY: as above; no profiler handles.
            Table::V10(t) => unsafe { entry(t.irecv, "irecv")?(c, 1, d, sz, t_, m, ph, &mut req) },
            // SAFETY: as above.
            Table::V11(t) => unsafe { entry(t.irecv, "irecv")?(c, 1, d, sz, t_, m, ph, &mut req) },
            // SAFETY: as above.
            Table::V12(t) => unsafe { entry(t.irecv, "irecv")?(c, 1, d, sz, t_, m, ph, &mut req) },
        };
        self.check(code, "irecv")?;
        Ok((!req.is_null()).then_some(Opaque(req)))
    }

    /// Tests a request; `Some(bytes)` once done (the request is then gone).
    pub fn test(&self, req: Opaque) -> Result<Option<usize>> {
        let mut done: c_int = 0;
        let mut size: c_int = 0;
        let r = req.0;
        // SAFETY: `req` is a live request of this plugin with one buffer, so `sizes`
        // needs one entry; valid out-pointers.
        let code =
            any_table!(self.table, t => unsafe { entry(t.test, "test")?(r, &mut done, &mut size) });
        self.check(code, "test")?;
        Ok((done != 0).then(|| usize::try_from(size).unwrap_or(0)))
    }

    /// Closes a send comm.
    pub fn close_send(&self, comm: Opaque) -> Result<()> {
        let c = comm.0;
        // SAFETY: a live send comm of this plugin, closed once, no request outstanding.
        let code = any_table!(self.table, t => unsafe { entry(t.closeSend, "closeSend")?(c) });
        self.check(code, "closeSend")
    }

    /// Closes a receive comm.
    pub fn close_recv(&self, comm: Opaque) -> Result<()> {
        let c = comm.0;
        // SAFETY: a live receive comm of this plugin, closed once.
        let code = any_table!(self.table, t => unsafe { entry(t.closeRecv, "closeRecv")?(c) });
        self.check(code, "closeRecv")
    }

    /// Closes a listen comm.
    pub fn close_listen(&self, comm: Opaque) -> Result<()> {
        let c = comm.0;
        // SAFETY: a live listen comm of this plugin, closed once.
        let code = any_table!(self.table, t => unsafe { entry(t.closeListen, "closeListen")?(c) });
        self.check(code, "closeListen")
    }
}

/// Copies a C string the plugin owns (NULL: none).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_like_nccl_net_plugin() {
        assert_eq!(candidates("ib"), ["ib", "libnccl-net-ib.so"]);
        assert_eq!(candidates("/opt/x/libfoo.so"), ["/opt/x/libfoo.so"]);
        assert_eq!(candidates("libnccl-net-ofi.so"), ["libnccl-net-ofi.so"]);
        assert_eq!(
            candidates(" aws-ofi "),
            ["aws-ofi", "libnccl-net-aws-ofi.so"]
        );
    }

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let err = InnerPlugin::open("/nonexistent/libnccl-net-nothing.so", None)
            .err()
            .expect("must fail");
        assert!(
            err.message.contains("cannot load the inner net plugin")
                && err.message.contains("/nonexistent/libnccl-net-nothing.so"),
            "{err}"
        );
    }
}
