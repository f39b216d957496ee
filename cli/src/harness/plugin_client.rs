//! The FFI edge of the harness: loads the built plugin library with `dlopen`, picks one
//! `ncclNetPlugin_vN` table and wraps it in a safe API shaped like NCCL's proxy uses it.
//!
//! Safety model: every object that holds a plugin pointer also holds a reference-counted
//! owner of what the pointer lives in (the library, the context, the comm), so nothing can be
//! used after it was closed or unloaded. Buffers lent to the plugin by `isend`/`irecv` move
//! into the [`Request`] and come back only when `test` reports it done; a request dropped
//! before that leaks its buffers rather than free memory the plugin may still write.
//! This file is the only place in the harness with `unsafe`.

use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_ulong, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use nccl_net_lossy::abi::ffi::{
    ncclDebugLogLevel, ncclDebugLogger_t, ncclNetAttr_v11_t, ncclNetCommConfig_v10_t,
    ncclNetDeviceHandle_v8_t, ncclNetProperties_v11_t, ncclNetProperties_v12_t,
    ncclNetProperties_v8_t, ncclNetProperties_v9_t, ncclNet_v10_t, ncclNet_v11_t, ncclNet_v12_t,
    ncclNet_v8_t, ncclNet_v9_t, ncclResult_t, NCCL_NET_HANDLE_MAXSIZE,
    NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_PTR_HOST,
};
use nccl_net_lossy::transport::wrap::inner::{c_string, dl_error};
use nccl_net_lossy::{Error, Result};

/// Bytes in a connection handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_BYTES: usize = NCCL_NET_HANDLE_MAXSIZE as usize;

/// A connection handle as `listen` fills it and the peer's `connect` reads it.
pub type ConnHandle = [u8; HANDLE_BYTES];

/// Oldest net-plugin ABI version the harness drives.
pub const MIN_VERSION: u32 = 8;

/// Newest net-plugin ABI version the harness drives (and the default).
pub const MAX_VERSION: u32 = 12;

/// Most buffers one grouped receive may carry in this harness (NCCL's `NCCL_NET_MAX_RECVS`).
pub const MAX_GROUPED_RECVS: usize = 8;

/// Environment variable that makes the harness print the plugin's log lines: `WARN` (the
/// default without it) prints warnings only, anything else prints every line.
pub const DEBUG_ENV: &str = "LOSSY_HARNESS_DEBUG";

/// Cargo's file name for the library.
pub const CARGO_LIBRARY_NAME: &str = "libnccl_net_lossy.so";

/// The file name NCCL opens for `NCCL_NET_PLUGIN=lossy`.
pub const NCCL_LIBRARY_NAME: &str = "libnccl-net-lossy.so";

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

/// Algorithm bit for the ring (`1 << NCCL_ALGO_RING`) sent with [`PluginClient::set_net_attr`].
pub const ALGO_RING_BIT: u32 = 1 << 1;

/// Protocol bit for Simple (`1 << NCCL_PROTO_SIMPLE`): the only protocol a host ring uses.
pub const PROTO_SIMPLE_BIT: u32 = 1 << 2;

/// Where the plugin library probably is: next to the running executable (Cargo's target
/// directory, or `bin/../lib` of an installation), or in the target directory above a test
/// binary in `deps/`.
pub fn default_library_path() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::system(format!("cannot find the running executable: {e}")))?;
    let dir = exe
        .parent()
        .ok_or_else(|| Error::system("the running executable has no directory"))?;
    library_near(dir)
}

/// The plugin library in or near `dir`: Cargo's target directory (the library itself, or
/// the copy in `deps/`), or `bin/../lib` of an installation. When several exist the newest
/// wins: `cargo test` rebuilds the copy in `deps/` without refreshing the one beside the
/// binaries, and loading that stale one would test old code.
pub fn library_near(dir: &Path) -> Result<PathBuf> {
    let candidates = [
        dir.join(CARGO_LIBRARY_NAME),
        dir.join("deps").join(CARGO_LIBRARY_NAME),
        dir.join(NCCL_LIBRARY_NAME),
        dir.join("..").join(CARGO_LIBRARY_NAME),
        dir.join("..").join("lib").join(NCCL_LIBRARY_NAME),
    ];
    candidates
        .iter()
        .filter_map(|p| {
            let modified = std::fs::metadata(p)
                .ok()
                .filter(|m| m.is_file())?
                .modified()
                .ok()?;
            Some((modified, p))
        })
        .max_by_key(|(modified, _)| *modified)
        .map(|(_, p)| p.canonicalize().unwrap_or_else(|_| p.clone()))
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "plugin library not found; looked for {} (build it with `cargo build --release`)",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// Turns a plugin return code into a result naming the call.
fn check(code: ncclResult_t, what: &str) -> Result<()> {
    let Some(kind) = nccl_net_lossy::abi::error_kind(code) else {
        return Ok(());
    };
    Err(Error::new(
        kind,
        format!("plugin {what} returned {code:?} ({})", code as i32),
    ))
}

/// A function pointer from the table, or an error naming the missing entry.
fn entry<F>(f: Option<F>, name: &str) -> Result<F> {
    f.ok_or_else(|| Error::internal(format!("the plugin's table has no `{name}`")))
}

// ---- logging --------------------------------------------------------------------------------

/// Receives the plugin's log lines. NCCL's logger is printf-like and variadic, which stable
/// Rust cannot define; this plugin always logs with a single `%s` argument, so the harness
/// takes exactly one pointer after the format (the calling convention passes the first
/// variadic pointer where a sixth fixed pointer argument goes on x86-64 and AArch64 Linux).
///
/// # Safety
/// `fmt` is NULL or a NUL-terminated string; when it holds exactly one `%s`, `arg` is NULL or
/// a NUL-terminated string (NCCL's logger contract, which the plugin follows).
unsafe extern "C" fn log_line(
    level: ncclDebugLogLevel,
    _flags: c_ulong,
    _file: *const c_char,
    _line: c_int,
    fmt: *const c_char,
    arg: *const c_char,
) {
    let verbose = std::env::var_os(DEBUG_ENV).is_some_and(|v| v != "WARN" && v != "0");
    let warn = matches!(level, ncclDebugLogLevel::NCCL_LOG_WARN);
    if fmt.is_null() || !(warn || verbose) {
        return;
    }
    // SAFETY: NCCL's contract (which the plugin follows) gives a NUL-terminated format.
    let fmt = unsafe { CStr::from_ptr(fmt) }.to_string_lossy();
    let text = if fmt.matches('%').count() == 1 && fmt.contains("%s") && !arg.is_null() {
        // SAFETY: the format has exactly one `%s`, so the one argument is a C string.
        let arg = unsafe { CStr::from_ptr(arg) }.to_string_lossy();
        fmt.replacen("%s", &arg, 1)
    } else {
        fmt.into_owned()
    };
    let tag = if warn { "WARN" } else { "INFO" };
    eprintln!("[pid {}] {tag} {text}", std::process::id());
}

/// The logger handed to the plugin's `init`.
fn logger() -> ncclDebugLogger_t {
    type Fixed = unsafe extern "C" fn(
        ncclDebugLogLevel,
        c_ulong,
        *const c_char,
        c_int,
        *const c_char,
        *const c_char,
    );
    type Variadic =
        unsafe extern "C" fn(ncclDebugLogLevel, c_ulong, *const c_char, c_int, *const c_char, ...);
    let fixed: Fixed = log_line;
    // SAFETY: both are `extern "C"` function pointers of the same size; see `log_line` for
    // why a call through the variadic type reaches it with the right arguments.
    Some(unsafe { std::mem::transmute::<Fixed, Variadic>(fixed) })
}

// ---- the library -----------------------------------------------------------------------------

/// A `dlopen`ed plugin library. Closed (`dlclose`) when the last client, comm and request
/// made from it are gone, as NCCL does when its last communicator is destroyed.
pub struct PluginLibrary {
    handle: *mut c_void,
    path: PathBuf,
}

impl PluginLibrary {
    /// Opens the library at `path` with `RTLD_NOW | RTLD_LOCAL`.
    pub fn open(path: &Path) -> Result<Rc<PluginLibrary>> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::invalid_argument("library path contains a NUL byte"))?;
        // SAFETY: a valid NUL-terminated path; the flags are plain dlopen flags.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(Error::system(format!(
                "dlopen {}: {}",
                path.display(),
                dl_error()
            )));
        }
        Ok(Rc::new(PluginLibrary {
            handle,
            path: path.to_path_buf(),
        }))
    }

    /// Opens the library [`default_library_path`] finds.
    pub fn open_default() -> Result<Rc<PluginLibrary>> {
        Self::open(&default_library_path()?)
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Address of the exported symbol `name`, if there is one.
    fn symbol(&self, name: &str) -> Option<*mut c_void> {
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
        (MIN_VERSION..=MAX_VERSION)
            .rev()
            .filter(|v| self.exports(&format!("ncclNetPlugin_v{v}")))
            .collect()
    }

    /// The control-API function `name`, or an error saying the library lacks it.
    fn control_symbol(&self, name: &str) -> Result<*mut c_void> {
        self.symbol(name)
            .ok_or_else(|| Error::invalid_argument(format!("the library does not export {name}")))
    }

    /// Turns loss injection on or off through the library's control API
    /// (`ncclLossySetEnabled`).
    pub fn set_loss_enabled(&self, enabled: bool) -> Result<()> {
        let sym = self.control_symbol("ncclLossySetEnabled")?;
        // SAFETY: the control header declares `int ncclLossySetEnabled(int)`.
        let f: extern "C" fn(c_int) -> c_int = unsafe { std::mem::transmute(sym) };
        match f(c_int::from(enabled)) {
            0 => Ok(()),
            code => Err(Error::internal(format!(
                "ncclLossySetEnabled returned {code}"
            ))),
        }
    }

    /// Asks the library to write its statistics file now (`ncclLossyWriteStats`); `Ok(false)`
    /// when `NCCL_LOSSY_STATS` is not set.
    pub fn write_stats(&self) -> Result<bool> {
        let sym = self.control_symbol("ncclLossyWriteStats")?;
        // SAFETY: the control header declares `int ncclLossyWriteStats(void)`.
        let f: extern "C" fn() -> c_int = unsafe { std::mem::transmute(sym) };
        match f() {
            0 => Ok(true),
            1 => Ok(false),
            code => Err(Error::system(format!(
                "ncclLossyWriteStats returned {code}"
            ))),
        }
    }
}

impl Drop for PluginLibrary {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and nothing made from it is alive any more
        // (every client, comm and request holds an Rc to this library).
        unsafe { libc::dlclose(self.handle) };
    }
}

/// One version's function table inside the library.
#[derive(Clone, Copy)]
enum Table {
    V8(*const ncclNet_v8_t),
    V9(*const ncclNet_v9_t),
    V10(*const ncclNet_v10_t),
    V11(*const ncclNet_v11_t),
    V12(*const ncclNet_v12_t),
}

/// Runs `$body` with `$t` bound to the table of whichever version is loaded, for the entry
/// points whose signature is the same in every version.
macro_rules! with_table {
    ($client:expr, $t:ident => $body:expr) => {{
        let client: &ClientInner = $client;
        // SAFETY: the table lives in the library, which `client` keeps loaded.
        unsafe {
            match client.table {
                Table::V8(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V9(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V10(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V11(p) => {
                    let $t = &*p;
                    $body
                }
                Table::V12(p) => {
                    let $t = &*p;
                    $body
                }
            }
        }
    }};
}

/// Device properties, whatever the version's struct looked like.
#[derive(Clone, Debug, PartialEq)]
pub struct NetProperties {
    /// Device name.
    pub name: String,
    /// PCI path, when the plugin gave one.
    pub pci_path: Option<String>,
    /// Device id.
    pub guid: u64,
    /// Memory types supported (`NCCL_PTR_*` bits).
    pub ptr_support: i32,
    /// Whether registrations are global.
    pub reg_is_global: i32,
    /// Link speed in Mbps.
    pub speed_mbps: i32,
    /// Port number.
    pub port: i32,
    /// Latency in microseconds.
    pub latency_us: f32,
    /// Maximum comms.
    pub max_comms: i32,
    /// Maximum buffers in one grouped receive.
    pub max_recvs: i32,
    /// Device type (0: host).
    pub net_device_type: i32,
    /// Largest point-to-point message (v9+).
    pub max_p2p_bytes: Option<usize>,
    /// Largest collective message (v9+).
    pub max_coll_bytes: Option<usize>,
    /// Physical devices behind this one (v9+).
    pub vdevs: Vec<i32>,
    /// Most requests NCCL may merge (v11+).
    pub max_multi_request_size: Option<i32>,
    /// Rail and plane ids (v12).
    pub rail_plane: Option<(i16, i16)>,
}

/// Copies a C string the plugin owns, or None for NULL.
/// Fills the fields every version shares.
macro_rules! common_props {
    ($p:expr) => {
        NetProperties {
            // SAFETY: getProperties points `name`/`pciPath` at NUL-terminated strings (or
            // NULL) that outlive this copy.
            #[allow(unused_unsafe)]
            name: unsafe { c_string($p.name) }.unwrap_or_default(),
            // SAFETY: as for `name`.
            #[allow(unused_unsafe)]
            pci_path: unsafe { c_string($p.pciPath) },
            guid: $p.guid,
            ptr_support: $p.ptrSupport,
            reg_is_global: $p.regIsGlobal,
            speed_mbps: $p.speed,
            port: $p.port,
            latency_us: $p.latency,
            max_comms: $p.maxComms,
            max_recvs: $p.maxRecvs,
            net_device_type: $p.netDeviceType as i32,
            max_p2p_bytes: None,
            max_coll_bytes: None,
            vdevs: Vec::new(),
            max_multi_request_size: None,
            rail_plane: None,
        }
    };
}

// ---- the client ------------------------------------------------------------------------------

/// What every object made by a client shares: the library, the table, the context.
struct ClientInner {
    lib: Rc<PluginLibrary>,
    table: Table,
    version: u32,
    /// v11+ context from `init`; NULL for older versions and after `finalize`.
    ctx: Cell<*mut c_void>,
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let _ = finalize_inner(self);
    }
}

/// Calls `finalize(ctx)` once (v11+); older versions have nothing to finalize.
fn finalize_inner(inner: &ClientInner) -> Result<()> {
    let ctx = inner.ctx.replace(ptr::null_mut());
    if ctx.is_null() {
        return Ok(());
    }
    // SAFETY: `ctx` came from this table's init and is finalized once (swapped out above);
    // the table lives in the library `inner` keeps loaded.
    unsafe {
        match inner.table {
            Table::V11(t) => check(entry((*t).finalize, "finalize")?(ctx), "finalize"),
            Table::V12(t) => check(entry((*t).finalize, "finalize")?(ctx), "finalize"),
            _ => Ok(()),
        }
    }
}

/// One communicator's use of the plugin: under v11+ its own context from `init(ctx, commId,
/// ...)`, under v8-v10 the library-wide state `init(logger)` sets up.
#[derive(Clone)]
pub struct PluginClient {
    inner: Rc<ClientInner>,
}

impl PluginClient {
    /// Looks up `ncclNetPlugin_v{version}` in `lib` and calls its `init`; `comm_id` is the
    /// communicator id v11+ receives.
    pub fn init(lib: &Rc<PluginLibrary>, version: u32, comm_id: u64) -> Result<PluginClient> {
        if !(MIN_VERSION..=MAX_VERSION).contains(&version) {
            return Err(Error::invalid_argument(format!(
                "net plugin version {version} (the harness drives {MIN_VERSION} to {MAX_VERSION})"
            )));
        }
        let symbol = format!("ncclNetPlugin_v{version}");
        let sym = lib.symbol(&symbol).ok_or_else(|| {
            Error::invalid_argument(format!("{} does not export {symbol}", lib.path.display()))
        })?;
        let table = match version {
            8 => Table::V8(sym as *const ncclNet_v8_t),
            9 => Table::V9(sym as *const ncclNet_v9_t),
            10 => Table::V10(sym as *const ncclNet_v10_t),
            11 => Table::V11(sym as *const ncclNet_v11_t),
            _ => Table::V12(sym as *const ncclNet_v12_t),
        };
        let inner = ClientInner {
            lib: Rc::clone(lib),
            table,
            version,
            ctx: Cell::new(ptr::null_mut()),
        };
        let mut ctx: *mut c_void = ptr::null_mut();
        let mut config = ncclNetCommConfig_v10_t {
            trafficClass: NCCL_NET_TRAFFIC_CLASS_UNDEF,
        };
        // SAFETY: the table lives in `lib`, kept loaded by `inner`; every pointer passed is
        // to a live local.
        let code = unsafe {
            match table {
                Table::V8(t) => entry((*t).init, "init")?(logger()),
                Table::V9(t) => entry((*t).init, "init")?(logger()),
                Table::V10(t) => entry((*t).init, "init")?(logger(), None),
                Table::V11(t) => {
                    entry((*t).init, "init")?(&mut ctx, comm_id, &mut config, logger(), None)
                }
                Table::V12(t) => {
                    entry((*t).init, "init")?(&mut ctx, comm_id, &mut config, logger(), None)
                }
            }
        };
        check(code, "init")?;
        if version >= 11 && ctx.is_null() {
            return Err(Error::internal(
                "init succeeded but returned a NULL context",
            ));
        }
        inner.ctx.set(ctx);
        Ok(PluginClient {
            inner: Rc::new(inner),
        })
    }

    /// The ABI version in use.
    pub fn version(&self) -> u32 {
        self.inner.version
    }

    /// The library this client uses.
    pub fn library(&self) -> &Rc<PluginLibrary> {
        &self.inner.lib
    }

    /// The plugin's `name` field.
    pub fn name(&self) -> String {
        with_table!(&self.inner, t => c_string(t.name)).unwrap_or_default()
    }

    /// Number of devices.
    pub fn devices(&self) -> Result<i32> {
        let mut n: c_int = 0;
        let code = with_table!(&self.inner, t => entry(t.devices, "devices")?(&mut n));
        check(code, "devices")?;
        Ok(n)
    }

    /// Properties of device `dev`.
    pub fn properties(&self, dev: i32) -> Result<NetProperties> {
        // SAFETY: each arm passes a properties struct of its own version's layout, owned
        // by this frame; the table lives in the library `inner` keeps loaded.
        unsafe {
            match self.inner.table {
                Table::V8(t) => {
                    let mut p = ncclNetProperties_v8_t::default();
                    check(
                        entry((*t).getProperties, "getProperties")?(dev, &mut p),
                        "getProperties",
                    )?;
                    Ok(common_props!(p))
                }
                Table::V9(t) => {
                    let mut p = ncclNetProperties_v9_t::default();
                    check(
                        entry((*t).getProperties, "getProperties")?(dev, &mut p),
                        "getProperties",
                    )?;
                    Ok(v9_props(&p))
                }
                Table::V10(t) => {
                    let mut p = ncclNetProperties_v9_t::default();
                    check(
                        entry((*t).getProperties, "getProperties")?(dev, &mut p),
                        "getProperties",
                    )?;
                    Ok(v9_props(&p))
                }
                Table::V11(t) => {
                    let mut p = ncclNetProperties_v11_t::default();
                    check(
                        entry((*t).getProperties, "getProperties")?(dev, &mut p),
                        "getProperties",
                    )?;
                    let mut props = common_props!(p);
                    props.max_p2p_bytes = Some(p.maxP2pBytes);
                    props.max_coll_bytes = Some(p.maxCollBytes);
                    props.vdevs = vdevs(p.vProps.ndevs, &p.vProps.devs);
                    props.max_multi_request_size = Some(p.maxMultiRequestSize);
                    Ok(props)
                }
                Table::V12(t) => {
                    let mut p = ncclNetProperties_v12_t::default();
                    check(
                        entry((*t).getProperties, "getProperties")?(dev, &mut p),
                        "getProperties",
                    )?;
                    let mut props = common_props!(p);
                    props.max_p2p_bytes = Some(p.maxP2pBytes);
                    props.max_coll_bytes = Some(p.maxCollBytes);
                    props.vdevs = vdevs(p.vProps.ndevs, &p.vProps.devs);
                    props.max_multi_request_size = Some(p.maxMultiRequestSize);
                    props.rail_plane = Some((p.railId, p.planeId));
                    Ok(props)
                }
            }
        }
    }

    /// Starts listening on `dev`: the handle to ship to the peer, and the listening comm.
    pub fn listen(&self, dev: i32) -> Result<(ConnHandle, ListenComm)> {
        let mut handle: ConnHandle = [0; HANDLE_BYTES];
        let mut comm: *mut c_void = ptr::null_mut();
        let h = handle.as_mut_ptr().cast::<c_void>();
        // SAFETY: the handle buffer holds NCCL_NET_HANDLE_MAXSIZE bytes and the out-pointer
        // is a live local; the table lives in the library `inner` keeps loaded.
        let code = unsafe {
            match self.inner.table {
                Table::V8(t) => entry((*t).listen, "listen")?(dev, h, &mut comm),
                Table::V9(t) => entry((*t).listen, "listen")?(dev, h, &mut comm),
                Table::V10(t) => entry((*t).listen, "listen")?(dev, h, &mut comm),
                Table::V11(t) => entry((*t).listen, "listen")?(self.live_ctx()?, dev, h, &mut comm),
                Table::V12(t) => entry((*t).listen, "listen")?(self.live_ctx()?, dev, h, &mut comm),
            }
        };
        check(code, "listen")?;
        if comm.is_null() {
            return Err(Error::internal("listen succeeded but returned a NULL comm"));
        }
        Ok((
            handle,
            ListenComm {
                raw: comm,
                client: Rc::clone(&self.inner),
            },
        ))
    }

    /// The v11+ context, or an error after `finalize`.
    fn live_ctx(&self) -> Result<*mut c_void> {
        ctx_or(self.inner.ctx.get())
    }

    /// Starts connecting to the listener that produced `handle` on device `dev`.
    pub fn connect(&self, dev: i32, handle: &ConnHandle) -> Connecting {
        Connecting {
            handle: Box::new(*handle),
            dev,
            client: Rc::clone(&self.inner),
        }
    }

    /// Tells the plugin which collective is being posted next (v11+ `setNetAttr`, with the
    /// ring algorithm and Simple protocol); `Ok(false)` on older versions, which have no such
    /// call.
    pub fn set_net_attr(&self, op_bits: u32) -> Result<bool> {
        let mut attr = ncclNetAttr_v11_t {
            op: op_bits,
            algo: ALGO_RING_BIT,
            proto: PROTO_SIMPLE_BIT,
            ..Default::default()
        };
        // SAFETY: the attribute struct is a live local of the v11 layout both versions use;
        // the table lives in the library `inner` keeps loaded.
        let code = unsafe {
            match self.inner.table {
                Table::V11(t) => match (*t).setNetAttr {
                    Some(f) => f(self.live_ctx()?, &mut attr),
                    None => return Ok(false),
                },
                Table::V12(t) => match (*t).setNetAttr {
                    Some(f) => f(self.live_ctx()?, &mut attr),
                    None => return Ok(false),
                },
                _ => return Ok(false),
            }
        };
        check(code, "setNetAttr")?;
        Ok(true)
    }

    /// Calls `finalize(ctx)` (v11+) now instead of when the last object made by this client
    /// is dropped.
    pub fn finalize(&self) -> Result<()> {
        finalize_inner(&self.inner)
    }
}

fn ctx_or(ctx: *mut c_void) -> Result<*mut c_void> {
    if ctx.is_null() {
        Err(Error::invalid_usage(
            "the plugin context was already finalized",
        ))
    } else {
        Ok(ctx)
    }
}

fn vdevs(n: c_int, devs: &[c_int]) -> Vec<i32> {
    devs[..usize::try_from(n).unwrap_or(0).min(devs.len())].to_vec()
}

fn v9_props(p: &ncclNetProperties_v9_t) -> NetProperties {
    let mut props = common_props!(p);
    props.max_p2p_bytes = Some(p.maxP2pBytes);
    props.max_coll_bytes = Some(p.maxCollBytes);
    props.vdevs = vdevs(p.vProps.ndevs, &p.vProps.devs);
    props
}

// ---- listen, connect, accept --------------------------------------------------------------------

/// How long polling loops wait between calls that made no progress.
const POLL_PAUSE: Duration = Duration::from_micros(200);

/// A listening comm (`listenComm`), closed with `closeListen` on [`ListenComm::close`] or drop.
pub struct ListenComm {
    raw: *mut c_void,
    client: Rc<ClientInner>,
}

impl ListenComm {
    /// Calls `accept` once: `Ok(None)` while no peer has fully connected.
    pub fn poll_accept(&mut self) -> Result<Option<RecvComm>> {
        if self.raw.is_null() {
            return Err(Error::invalid_usage("accept on a closed listen comm"));
        }
        let mut comm: *mut c_void = ptr::null_mut();
        let mut dev_comm: *mut ncclNetDeviceHandle_v8_t = ptr::null_mut();
        let code = with_table!(&self.client, t => {
            entry(t.accept, "accept")?(self.raw, &mut comm, &mut dev_comm)
        });
        check(code, "accept")?;
        Ok((!comm.is_null()).then(|| RecvComm {
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
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        if raw.is_null() {
            return Ok(());
        }
        let code = with_table!(&self.client, t => entry(t.closeListen, "closeListen")?(raw));
        check(code, "closeListen")
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
}

impl Connecting {
    /// Calls `connect` once: `Ok(None)` while the connection is not ready.
    pub fn poll(&mut self) -> Result<Option<SendComm>> {
        let mut comm: *mut c_void = ptr::null_mut();
        let mut dev_comm: *mut ncclNetDeviceHandle_v8_t = ptr::null_mut();
        let h = self.handle.as_mut_ptr().cast::<c_void>();
        let dev = self.dev;
        let mut config = ncclNetCommConfig_v10_t {
            trafficClass: NCCL_NET_TRAFFIC_CLASS_UNDEF,
        };
        let ctx = self.client.ctx.get();
        // SAFETY: the handle is HANDLE_BYTES of memory this object owns, the same on every
        // call; the out-pointers and config are live locals; the table lives in the library
        // the client keeps loaded.
        let code = unsafe {
            match self.client.table {
                Table::V8(t) => entry((*t).connect, "connect")?(dev, h, &mut comm, &mut dev_comm),
                Table::V9(t) => entry((*t).connect, "connect")?(dev, h, &mut comm, &mut dev_comm),
                Table::V10(t) => {
                    entry((*t).connect, "connect")?(dev, &mut config, h, &mut comm, &mut dev_comm)
                }
                Table::V11(t) => {
                    entry((*t).connect, "connect")?(ctx_or(ctx)?, dev, h, &mut comm, &mut dev_comm)
                }
                Table::V12(t) => {
                    entry((*t).connect, "connect")?(ctx_or(ctx)?, dev, h, &mut comm, &mut dev_comm)
                }
            }
        };
        check(code, "connect")?;
        Ok((!comm.is_null()).then(|| SendComm {
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
    raw: Cell<*mut c_void>,
    kind: CommKind,
    client: Rc<ClientInner>,
}

impl CommInner {
    fn new(raw: *mut c_void, kind: CommKind, client: &Rc<ClientInner>) -> Rc<CommInner> {
        Rc::new(CommInner {
            raw: Cell::new(raw),
            kind,
            client: Rc::clone(client),
        })
    }

    fn live(&self) -> Result<*mut c_void> {
        let raw = self.raw.get();
        if raw.is_null() {
            Err(Error::invalid_usage("use of a closed comm"))
        } else {
            Ok(raw)
        }
    }

    fn close(&self) -> Result<()> {
        let raw = self.raw.replace(ptr::null_mut());
        if raw.is_null() {
            return Ok(());
        }
        let code = match self.kind {
            CommKind::Send => {
                with_table!(&self.client, t => entry(t.closeSend, "closeSend")?(raw))
            }
            CommKind::Recv => {
                with_table!(&self.client, t => entry(t.closeRecv, "closeRecv")?(raw))
            }
        };
        check(code, "close")
    }

    fn reg_mr(&self, buf: &mut [u8]) -> Result<MrHandle> {
        let raw = self.live()?;
        let mut mhandle: *mut c_void = ptr::null_mut();
        let data = buf.as_mut_ptr().cast::<c_void>();
        let code = with_table!(&self.client, t => {
            entry(t.regMr, "regMr")?(raw, data, buf.len(), NCCL_PTR_HOST as c_int, &mut mhandle)
        });
        check(code, "regMr")?;
        Ok(MrHandle {
            raw: mhandle,
            comm: raw as usize,
        })
    }

    fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        let raw = self.live()?;
        if mr.comm != raw as usize {
            return Err(Error::invalid_usage("deregMr with another comm's handle"));
        }
        let code = with_table!(&self.client, t => entry(t.deregMr, "deregMr")?(raw, mr.raw));
        check(code, "deregMr")
    }

    fn check_mr(&self, raw: *mut c_void, mr: &MrHandle) -> Result<()> {
        if mr.comm == raw as usize {
            Ok(())
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
    raw: *mut c_void,
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

/// What `isend`/`irecv` did: started a request, or (NULL request) asked to retry later, in
/// which case the buffers come back.
pub enum Posted {
    /// The request, to `test` until done.
    Started(Request),
    /// The plugin had no free slot: try again later with the same buffers.
    Busy(Vec<HostBuffer>),
}

/// An outstanding `isend`/`irecv`. Owns the lent buffers until `test` says done.
pub struct Request {
    raw: *mut c_void,
    comm: Rc<CommInner>,
    /// The lent buffers, as raw allocations the plugin may use until done.
    bufs: Vec<*mut [u8]>,
    sizes: Option<Vec<usize>>,
}

impl Request {
    fn new(raw: *mut c_void, comm: &Rc<CommInner>, bufs: Vec<*mut [u8]>) -> Request {
        Request {
            raw,
            comm: Rc::clone(comm),
            bufs,
            sizes: None,
        }
    }

    /// Calls `test` once: `Ok(Some(sizes))` when done (bytes per buffer), `Ok(None)` while
    /// pending. After an error the request is dead and its buffers are never returned.
    pub fn test(&mut self) -> Result<Option<&[usize]>> {
        if self.sizes.is_none() {
            self.comm.live()?;
            let mut done: c_int = 0;
            let mut sizes: [c_int; MAX_GROUPED_RECVS] = [-1; MAX_GROUPED_RECVS];
            let code = with_table!(&self.comm.client, t => {
                entry(t.test, "test")?(self.raw, &mut done, sizes.as_mut_ptr())
            });
            check(code, "test")?;
            if done == 0 {
                return Ok(None);
            }
            let n = self.bufs.len().max(1);
            let sizes = sizes[..n]
                .iter()
                .map(|&s| {
                    usize::try_from(s)
                        .map_err(|_| Error::internal(format!("test reported a negative size {s}")))
                })
                .collect::<Result<Vec<_>>>()?;
            self.sizes = Some(sizes);
        }
        Ok(self.sizes.as_deref())
    }

    /// True once `test` has reported the request done.
    pub fn is_done(&self) -> bool {
        self.sizes.is_some()
    }

    /// The buffers back, with the size each got, once `test` reported the request done.
    pub fn finish(mut self) -> Result<(Vec<HostBuffer>, Vec<usize>)> {
        let sizes = self
            .sizes
            .take()
            .ok_or_else(|| Error::invalid_usage("finish before test reported the request done"))?;
        let bufs = std::mem::take(&mut self.bufs)
            .into_iter()
            // SAFETY: each pointer came from Box::into_raw in isend/irecv, and the plugin
            // no longer uses it now that test reported the request done.
            .map(|p| unsafe { Box::from_raw(p) })
            .collect();
        Ok((bufs, sizes))
    }
}

// Dropping an unfinished Request leaks its buffers on purpose: the plugin may still write
// into them until its comm is closed.

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
        let raw = self.inner.live()?;
        self.inner.check_mr(raw, &mr)?;
        if size > buf.len() {
            return Err(Error::invalid_argument(format!(
                "isend of {size} bytes from a {}-byte buffer",
                buf.len()
            )));
        }
        let version = self.inner.client.version;
        if version == 8 && size > i32::MAX as usize {
            return Err(Error::invalid_argument("net v8 sends at most 2 GiB - 1"));
        }
        let lent = Box::into_raw(buf);
        let data = lent.cast::<u8>().cast::<c_void>();
        let mut request: *mut c_void = ptr::null_mut();
        let null = ptr::null_mut::<c_void>();
        // SAFETY: `data` points to at least `size` bytes we own (leaked into `lent`) and keep
        // untouched until test reports the request done; the out-pointer is a live local; the
        // table lives in the library the client keeps loaded.
        let code = unsafe {
            match self.inner.client.table {
                Table::V8(t) => {
                    entry((*t).isend, "isend")?(raw, data, size as c_int, tag, mr.raw, &mut request)
                }
                Table::V9(t) => {
                    entry((*t).isend, "isend")?(raw, data, size, tag, mr.raw, &mut request)
                }
                Table::V10(t) => {
                    entry((*t).isend, "isend")?(raw, data, size, tag, mr.raw, null, &mut request)
                }
                Table::V11(t) => {
                    entry((*t).isend, "isend")?(raw, data, size, tag, mr.raw, null, &mut request)
                }
                Table::V12(t) => {
                    entry((*t).isend, "isend")?(raw, data, size, tag, mr.raw, null, &mut request)
                }
            }
        };
        let lent_back = || {
            // SAFETY: the plugin did not take the buffer (no request), so it is ours again.
            vec![unsafe { Box::from_raw(lent) }]
        };
        if let Err(err) = check(code, "isend") {
            drop(lent_back());
            return Err(err);
        }
        if request.is_null() {
            return Ok(Posted::Busy(lent_back()));
        }
        Ok(Posted::Started(Request::new(
            request,
            &self.inner,
            vec![lent],
        )))
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

    /// Posts a receive of `items.len()` messages (`irecv`; grouped when more than one).
    pub fn irecv(&self, items: Vec<RecvItem>) -> Result<Posted> {
        let raw = self.inner.live()?;
        let n = items.len();
        if n == 0 || n > MAX_GROUPED_RECVS {
            return Err(Error::invalid_argument(format!(
                "irecv of {n} buffers (1 to {MAX_GROUPED_RECVS})"
            )));
        }
        let version = self.inner.client.version;
        for item in &items {
            self.inner.check_mr(raw, &item.mr)?;
            if item.size > item.buf.len() || (version == 8 && item.size > i32::MAX as usize) {
                return Err(Error::invalid_argument(format!(
                    "irecv of {} bytes into a {}-byte buffer (net v{version})",
                    item.size,
                    item.buf.len()
                )));
            }
        }
        let mut tags: Vec<c_int> = items.iter().map(|i| i.tag).collect();
        let mut sizes: Vec<usize> = items.iter().map(|i| i.size).collect();
        let mut int_sizes: Vec<c_int> = sizes.iter().map(|&s| s as c_int).collect();
        let mut mhandles: Vec<*mut c_void> = items.iter().map(|i| i.mr.raw).collect();
        let mut phandles: Vec<*mut c_void> = vec![ptr::null_mut(); n];
        let lent: Vec<*mut [u8]> = items.into_iter().map(|i| Box::into_raw(i.buf)).collect();
        let mut data: Vec<*mut c_void> = lent.iter().map(|p| p.cast::<c_void>()).collect();
        let mut request: *mut c_void = ptr::null_mut();
        let count = n as c_int;
        // SAFETY: every array has `n` entries and lives across the call; each data pointer
        // has at least its posted size of bytes we own (leaked into `lent`) and keep
        // untouched until test reports the request done; the table lives in the library the
        // client keeps loaded.
        let code = unsafe {
            let (d, t, m) = (data.as_mut_ptr(), tags.as_mut_ptr(), mhandles.as_mut_ptr());
            let ph = phandles.as_mut_ptr();
            match self.inner.client.table {
                Table::V8(tb) => entry((*tb).irecv, "irecv")?(
                    raw,
                    count,
                    d,
                    int_sizes.as_mut_ptr(),
                    t,
                    m,
                    &mut request,
                ),
                Table::V9(tb) => entry((*tb).irecv, "irecv")?(
                    raw,
                    count,
                    d,
                    sizes.as_mut_ptr(),
                    t,
                    m,
                    &mut request,
                ),
                Table::V10(tb) => entry((*tb).irecv, "irecv")?(
                    raw,
                    count,
                    d,
                    sizes.as_mut_ptr(),
                    t,
                    m,
                    ph,
                    &mut request,
                ),
                Table::V11(tb) => entry((*tb).irecv, "irecv")?(
                    raw,
                    count,
                    d,
                    sizes.as_mut_ptr(),
                    t,
                    m,
                    ph,
                    &mut request,
                ),
                Table::V12(tb) => entry((*tb).irecv, "irecv")?(
                    raw,
                    count,
                    d,
                    sizes.as_mut_ptr(),
                    t,
                    m,
                    ph,
                    &mut request,
                ),
            }
        };
        let lent_back = |lent: Vec<*mut [u8]>| -> Vec<HostBuffer> {
            lent.into_iter()
                // SAFETY: the plugin did not take the buffers (no request): ours again.
                .map(|p| unsafe { Box::from_raw(p) })
                .collect()
        };
        if let Err(err) = check(code, "irecv") {
            drop(lent_back(lent));
            return Err(err);
        }
        if request.is_null() {
            return Ok(Posted::Busy(lent_back(lent)));
        }
        Ok(Posted::Started(Request::new(request, &self.inner, lent)))
    }

    /// Calls `closeRecv`.
    pub fn close(self) -> Result<()> {
        self.inner.close()
    }
}

/// Requests of one comm, tested oldest first as NCCL's proxy does.
pub type RequestFifo = VecDeque<Request>;
