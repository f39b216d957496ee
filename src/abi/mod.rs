//! The C ABI NCCL calls. Each `ncclNetPlugin_vN` table in [`tables`] is a set of thin
//! adapters that convert C pointers and integer widths, then call the shared entry points
//! here, which call the runtime in [`crate::runtime`]. This is the only module where raw
//! pointers from NCCL are dereferenced, and every such place says why it is sound.
//!
//! No panic may unwind into NCCL (it would abort the training job): every entry point runs
//! inside [`guard`], which turns errors and panics into `ncclResult_t` codes and log lines.

mod contexts;
pub mod control;
mod guard;
mod handles;
mod net_profiler;
pub mod tables;
pub mod tuner;

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Arc, Mutex};

use ffi::{ncclDebugLogLevel, ncclDebugLogger_t, ncclProfilerCallback_t};

use crate::ffi;
use crate::log;
use crate::runtime::{
    Context, Hold, ListenComm, PendingKey, ProfilerParent, RecvComm, Runtime, SendComm,
};
use crate::transport::{
    Completion, HostBuf, RequestId, WireHandle, HANDLE_SIZE, HANDLE_WIRE_SIZE, MAX_RECVS,
    MAX_REQUESTS,
};
use crate::{Error, Result};
use guard::guard;
use handles::{checked, Kind};

/// Turns a NULL check into an error that names the argument.
#[inline]
fn non_null<T>(ptr: *mut T, what: &str) -> Result<*mut T> {
    if ptr.is_null() {
        Err(null_argument(what))
    } else {
        Ok(ptr)
    }
}

#[cold]
#[inline(never)]
fn null_argument(what: &str) -> Error {
    Error::invalid_argument(format!("{what} is NULL"))
}

/// Checks a device index from NCCL.
fn device_index(dev: c_int) -> Result<usize> {
    usize::try_from(dev)
        .map_err(|_| Error::invalid_argument(format!("negative device index {dev}")))
}

/// The device `listen`/`connect` were given, checked against the runtime's devices: one out
/// of range is `ncclInternalError`, as NCCL's Socket plugin answers it (`dev < 0 || dev >=
/// ncclNetIfs` in `ncclNetSocketListen`/`ncclNetSocketConnect`, src/transport/net_socket.cc).
fn comm_device(runtime: &Runtime, dev: c_int) -> Result<usize> {
    usize::try_from(dev)
        .ok()
        .filter(|&d| d < runtime.device_count())
        .ok_or_else(|| {
            Error::internal(format!(
                "device {dev} does not exist ({} devices)",
                runtime.device_count()
            ))
        })
}

// ---- logging -------------------------------------------------------------------------------

/// Routes our log lines to NCCL's logger (kept until the next init replaces it; the log sink
/// is process-wide, see [`crate::log`]). A wrapped plugin gets the logger when the runtime
/// is built.
pub(crate) fn install_logger(logger: ncclDebugLogger_t) {
    let Some(logger) = logger else { return };
    log::set_sink(Box::new(move |level, message| {
        let level = match level {
            log::Level::Warn => ncclDebugLogLevel::NCCL_LOG_WARN,
            log::Level::Info => ncclDebugLogLevel::NCCL_LOG_INFO,
        };
        let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
        // SAFETY: NCCL's logger is a printf-like function that lives as long as NCCL; we pass
        // a "%s" format with exactly one NUL-terminated string argument that outlives the call.
        unsafe {
            logger(
                level,
                u64::from(ffi::NCCL_LOSSY_LOG_NET) as std::ffi::c_ulong,
                c"net_lossy".as_ptr(),
                0,
                c"NET/lossy %s".as_ptr(),
                text.as_ptr(),
            )
        }
    }));
}

// ---- init, devices, properties ------------------------------------------------------------

/// `init` of v8 to v10: holds the runtime (building it if need be) until the library is
/// unloaded; one implicit context, and no word on which collective is posted. v10 passes
/// its profiler callback (`Some`, NULL or not), which the implicit context keeps.
fn init_legacy(logger: ncclDebugLogger_t, profiler: Option<ncclProfilerCallback_t>) -> Result<()> {
    install_logger(logger);
    Runtime::acquire(Hold::UntilUnload, logger)?.note_legacy_api();
    if let Some(profiler) = profiler {
        crate::ffi::net::profiler::set_nccl_callback(profiler);
        Context::implicit().set_profiler(net_profiler::from_callback(profiler));
    }
    Ok(())
}

/// The device names and PCI paths handed to NCCL ([`interned`]).
static STRINGS: Mutex<Vec<CString>> = Mutex::new(Vec::new());

/// Frees what the ABI layer's statics hold when the library is unloaded (`dlclose`, which
/// NCCL does when its last communicator lets the plugin go): static memory goes with the
/// image, the heap memory it points to would not, a few KiB per load. NCCL holds none of it
/// by then (no context, no comm, no property string is used after the unload).
extern "C" fn forget_at_unload() {
    let _ = std::panic::catch_unwind(|| {
        contexts::forget_at_unload();
        tuner::forget_at_unload();
        if let Ok(mut strings) = STRINGS.lock() {
            *strings = Vec::new();
        }
        log::clear_sink();
    });
}

#[used]
#[link_section = ".fini_array"]
static FORGET_AT_UNLOAD: extern "C" fn() = forget_at_unload;

fn devices(ndev: *mut c_int) -> Result<()> {
    let ndev = non_null(ndev, "ndev")?;
    let count = Runtime::current()?.device_count();
    // SAFETY: NCCL passes a valid int pointer (checked non-NULL).
    unsafe { *ndev = c_int::try_from(count).unwrap_or(c_int::MAX) };
    Ok(())
}

/// A NUL-terminated copy of `text` that lives as long as the process. NCCL keeps the `char*`
/// of device names and PCI paths we put in the properties, with no call telling us when it
/// lets go, so they cannot belong to the runtime (released at the last finalize): they stay
/// process-wide, one per distinct string (a handful: this host's interfaces), so building
/// the runtime again adds nothing.
fn interned(text: &str) -> Result<*mut c_char> {
    let text = CString::new(text.replace('\0', "")).unwrap_or_default();
    let mut strings = STRINGS
        .lock()
        .map_err(|_| Error::internal("device names poisoned by an earlier panic"))?;
    if let Some(known) = strings.iter().find(|s| **s == text) {
        return Ok(known.as_ptr().cast_mut());
    }
    // The bytes of a CString stay where they are when the Vec moves it.
    let ptr = text.as_ptr().cast_mut();
    strings.push(text);
    Ok(ptr)
}

/// The version-independent content of a properties struct.
pub(crate) struct CommonProps {
    name: *mut c_char,
    pci_path: *mut c_char,
    guid: u64,
    speed: c_int,
    port: c_int,
    latency: f32,
    max_comms: c_int,
    max_recvs: c_int,
    max_p2p_bytes: usize,
    max_coll_bytes: usize,
    rail_id: i16,
    plane_id: i16,
}

/// Properties of `dev`, in the form every version's struct is filled from.
pub(crate) fn common_props(dev: c_int) -> Result<CommonProps> {
    let runtime = Runtime::current()?;
    let props = runtime.properties(device_index(dev)?)?;
    Ok(CommonProps {
        name: interned(&props.name)?,
        pci_path: match &props.pci_path {
            Some(path) => interned(path)?,
            None => std::ptr::null_mut(),
        },
        guid: props.guid,
        speed: props.speed_mbps,
        port: props.port,
        latency: props.latency_us,
        max_comms: props.max_comms,
        max_recvs: props.max_recvs,
        max_p2p_bytes: props.max_p2p_bytes,
        max_coll_bytes: props.max_coll_bytes,
        rail_id: props.rail_id,
        plane_id: props.plane_id,
    })
}

// ---- listen, connect, accept --------------------------------------------------------------

/// Splits NCCL's 128-byte handle: the transport's wire part, then the listener's rank.
///
/// # Safety
/// `handle` must point to `HANDLE_SIZE` writable bytes, unaliased during the call.
unsafe fn handle_bytes<'a>(handle: *mut c_void) -> Result<&'a mut [u8; HANDLE_SIZE]> {
    let handle = non_null(handle, "handle")?;
    // SAFETY: per this function's contract; [u8; N] has alignment 1.
    Ok(unsafe { &mut *(handle as *mut [u8; HANDLE_SIZE]) })
}

fn wire_part(bytes: &mut [u8; HANDLE_SIZE]) -> &mut WireHandle {
    let (wire, _) = bytes.split_at_mut(HANDLE_WIRE_SIZE);
    wire.try_into().expect("HANDLE_WIRE_SIZE bytes")
}

fn read_u64(bytes: &[u8; HANDLE_SIZE], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_ne_bytes(word)
}

fn write_u64(bytes: &mut [u8; HANDLE_SIZE], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_ne_bytes());
}

/// Where the listener writes its launcher rank + 1 (0: unknown), so the connecting side
/// knows its peer for rules that match on `peer`. NCCL ships all 128 bytes to the peer.
const PEER_RANK_AT: usize = HANDLE_WIRE_SIZE;

fn listen(
    ctx: &Arc<Context>,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> Result<()> {
    let listen_comm = non_null(listen_comm, "listenComm")?;
    // SAFETY: NCCL hands us its NCCL_NET_HANDLE_MAXSIZE-byte handle buffer.
    let bytes = unsafe { handle_bytes(handle)? };
    let runtime = Runtime::current()?;
    let dev = comm_device(&runtime, dev)?;
    bytes.fill(0);
    let comm = runtime.listen(ctx, dev, wire_part(bytes))?;
    write_u64(
        bytes,
        PEER_RANK_AT,
        runtime.rank().map_or(0, |rank| u64::from(rank) + 1),
    );
    let comm = Box::new(AbiListenComm {
        kind: Kind::Listen,
        comm,
    });
    // SAFETY: valid out-pointer from NCCL (checked non-NULL).
    unsafe { *listen_comm = Box::into_raw(comm).cast() };
    Ok(())
}

/// `traffic_class`: the one v10 gives each `connect` (v11+ give it to `init`, in `ctx`).
fn connect(
    ctx: &Arc<Context>,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    traffic_class: Option<i32>,
) -> Result<()> {
    let send_comm = non_null(send_comm, "sendComm")?;
    // SAFETY: NCCL writes NULL here until we return a comm; the pointer is valid.
    unsafe { *send_comm = std::ptr::null_mut() };
    // SAFETY: NCCL hands us the handle it received from the peer, HANDLE_SIZE bytes.
    let bytes = unsafe { handle_bytes(handle)? };
    let runtime = Runtime::current()?;
    let dev = comm_device(&runtime, dev)?;
    // Connects in progress are parked in their context (dropped at its finalize), keyed by
    // the handle's address and content, rather than inside the handle, so that a transport
    // may use the handle's first `HANDLE_WIRE_SIZE` bytes in full.
    let key = PendingKey::of(bytes);
    let mut connecting = match ctx.resume_connect(&key)? {
        Some(connecting) => connecting,
        None => {
            let peer = u32::try_from(read_u64(bytes, PEER_RANK_AT))
                .ok()
                .and_then(|rank| rank.checked_sub(1));
            Box::new(runtime.connect(ctx, dev, wire_part(bytes), peer, traffic_class)?)
        }
    };
    let outcome = connecting.poll();
    if matches!(outcome, Ok(None)) {
        ctx.park_connect(key, connecting)?;
    }
    if let Some(comm) = outcome? {
        let comm = AbiSendComm::new(comm);
        // SAFETY: valid out-pointer (checked non-NULL above).
        unsafe { *send_comm = Box::into_raw(comm).cast() };
    }
    Ok(())
}

fn accept(listen_comm: *mut c_void, recv_comm: *mut *mut c_void) -> Result<()> {
    let recv_comm = non_null(recv_comm, "recvComm")?;
    // SAFETY: valid out-pointer from NCCL.
    unsafe { *recv_comm = std::ptr::null_mut() };
    // SAFETY: NCCL passes back the listenComm our listen returned (kind checked), and uses it
    // from one thread at a time.
    let listener = unsafe { &mut *checked::<AbiListenComm>(listen_comm, Kind::Listen, "accept")? };
    if let Some(comm) = listener.comm.accept()? {
        // SAFETY: valid out-pointer (checked above).
        unsafe { *recv_comm = Box::into_raw(AbiRecvComm::new(comm)).cast() };
    }
    Ok(())
}

/// Closes and frees the handle of `kind` (a `T` our listen, connect or accept made) that NCCL
/// hands back to `call` (`closeListen`, `closeSend`, `closeRecv`): `close` closes it first and
/// its error (a wrapped plugin's own close that failed) is NCCL's, after the handle is freed
/// all the same, as NCCL never uses a closed comm again. Closing NULL does nothing, as with
/// NCCL's own plugins.
fn close_handle<T>(
    handle: *mut c_void,
    kind: Kind,
    call: &str,
    close: impl FnOnce(&mut T) -> Result<()>,
) -> Result<()> {
    if handle.is_null() {
        return Ok(());
    }
    // SAFETY: NCCL gives back a handle our listen/connect/accept made, once; its kind word is
    // checked to be `kind`, which only a `T` carries.
    unsafe { checked::<T>(handle, kind, call)? };
    // SAFETY: as above: the Box our call made, no longer used by NCCL (no request of a comm
    // is in use when NCCL closes it).
    let mut comm = unsafe { Box::from_raw(handle as *mut T) };
    let outcome = close(&mut comm);
    drop(comm);
    outcome
}

// ---- comms and requests -------------------------------------------------------------------

/// What NCCL's `request` pointer points to: one of the fixed slots of a comm, so posting a
/// message allocates nothing.
#[repr(C)]
pub(crate) struct RequestSlot {
    kind: Kind,
    owner: *const dyn TestRequest,
    id: RequestId,
}

/// A comm that can report on its requests.
trait TestRequest {
    fn test(&self, id: RequestId) -> Result<Option<Completion>>;
}

/// A listenComm as NCCL holds it: the kind word, then the listener.
#[repr(C)]
pub(crate) struct AbiListenComm {
    kind: Kind,
    comm: ListenComm,
}

/// A sendComm as NCCL holds it: the safe comm plus its request slots.
#[repr(C)]
pub(crate) struct AbiSendComm {
    kind: Kind,
    comm: SendComm,
    slots: Box<[RequestSlot]>,
}

/// A recvComm as NCCL holds it.
#[repr(C)]
pub(crate) struct AbiRecvComm {
    kind: Kind,
    comm: RecvComm,
    slots: Box<[RequestSlot]>,
}

impl TestRequest for AbiSendComm {
    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.comm.test(id)
    }
}

impl TestRequest for AbiRecvComm {
    fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.comm.test(id)
    }
}

/// Boxes a comm and points each of its request slots back at it.
fn with_slots<T: TestRequest + 'static>(
    make: impl FnOnce(Box<[RequestSlot]>) -> T,
    slots_of: fn(&mut T) -> &mut [RequestSlot],
) -> Box<T> {
    let empty: Box<[RequestSlot]> = (0..MAX_REQUESTS as RequestId)
        .map(|id| RequestSlot {
            kind: Kind::Request,
            owner: std::ptr::null::<AbiSendComm>() as *const dyn TestRequest,
            id,
        })
        .collect();
    let mut comm = Box::new(make(empty));
    let owner: *const dyn TestRequest = &*comm as &dyn TestRequest;
    for slot in slots_of(&mut comm) {
        slot.owner = owner;
    }
    comm
}

impl AbiSendComm {
    fn new(comm: SendComm) -> Box<Self> {
        with_slots(
            |slots| AbiSendComm {
                kind: Kind::Send,
                comm,
                slots,
            },
            |c| &mut c.slots,
        )
    }
}

impl AbiRecvComm {
    fn new(comm: RecvComm) -> Box<Self> {
        with_slots(
            |slots| AbiRecvComm {
                kind: Kind::Recv,
                comm,
                slots,
            },
            |c| &mut c.slots,
        )
    }
}

/// Gives NCCL the slot of request `id`, or NULL ("retry later") when none was posted.
fn hand_out(slots: &[RequestSlot], id: Option<RequestId>, request: *mut *mut c_void) -> Result<()> {
    let ptr = match id {
        Some(id) => {
            let slot = slots
                .get(id as usize)
                .ok_or_else(|| Error::internal(format!("transport returned request id {id}")))?;
            slot as *const RequestSlot as *mut c_void
        }
        None => std::ptr::null_mut(),
    };
    // SAFETY: NCCL's out-pointer (checked non-NULL by callers).
    unsafe { *request = ptr };
    Ok(())
}

fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> Result<()> {
    let request = non_null(request, "request")?;
    // SAFETY: NCCL passes back the sendComm our connect returned; it is alive until closeSend.
    let comm = unsafe { &*checked::<AbiSendComm>(send_comm, Kind::Send, "isend")? };
    if size > 0 {
        non_null(data, "data")?;
    }
    // SAFETY: NCCL lends `size` bytes at `data` (registered host memory) until `test`
    // reports this request done, and does not touch them meanwhile.
    let buf = unsafe { HostBuf::new(data.cast(), size) }.with_mr(mhandle as usize);
    // NCCL's profiler handle is only handed back to its profiler callback, never read here.
    let id = comm
        .comm
        .isend(buf, tag, ProfilerParent::new(phandle as usize))?;
    hand_out(&comm.slots, id, request)
}

/// Posts a receive of `n` buffers; `size_of(i)` reads the i-th posted size from NCCL's array
/// (whose integer width depends on the version); `phandles`: NCCL's profiler handles (v10+,
/// `n` of them), or NULL.
#[allow(clippy::too_many_arguments)]
fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    size_of: impl Fn(usize) -> usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> Result<()> {
    let request = non_null(request, "request")?;
    // SAFETY: NCCL passes back the recvComm our accept returned; alive until closeRecv.
    let comm = unsafe { &*checked::<AbiRecvComm>(recv_comm, Kind::Recv, "irecv")? };
    let count = usize::try_from(n)
        .ok()
        .filter(|&n| (1..=MAX_RECVS).contains(&n))
        // NCCL's Socket plugin refuses `n != 1`, its IB plugin `n` above its most receives,
        // both with ncclInternalError (src/transport/net_socket.cc, net_ib/p2p.cc).
        .ok_or_else(|| {
            Error::internal(format!("irecv of {n} buffers (allowed 1..={MAX_RECVS})"))
        })?;
    let data = non_null(data, "data")?;
    let tags = non_null(tags, "tags")?;
    // Buffer `i < count` of NCCL's arrays: its memory, tag and profiler handle.
    let entry = |i: usize| -> Result<(HostBuf, i32, Option<ProfilerParent>)> {
        // SAFETY: NCCL passes arrays of `n` entries for data, sizes and tags.
        let (ptr, tag) = unsafe { (*data.add(i), *tags.add(i)) };
        let mr = if mhandles.is_null() {
            0
        } else {
            // SAFETY: a non-NULL mhandles array has `n` entries, like data.
            unsafe { *mhandles.add(i) as usize }
        };
        let size = size_of(i);
        if size > 0 {
            non_null(ptr, "receive buffer")?;
        }
        let parent = if phandles.is_null() {
            None
        } else {
            // SAFETY: a non-NULL phandles array (v10+) has `n` entries, like data; NCCL's
            // profiler handles are only handed on, never read here.
            ProfilerParent::new(unsafe { *phandles.add(i) } as usize)
        };
        // SAFETY: NCCL lends `size` bytes at `ptr` until `test` reports the request done.
        let buf = unsafe { HostBuf::new(ptr.cast(), size) }.with_mr(mr);
        Ok((buf, tag, parent))
    };
    let id = if count == 1 {
        // Every receive NCCL posts on our comms (we advertise one buffer per receive): no
        // arrays of eight to fill.
        let (buf, tag, parent) = entry(0)?;
        comm.comm.irecv(&[buf], &[tag], &[parent])?
    } else {
        let mut bufs = [HostBuf::EMPTY; MAX_RECVS];
        let mut tag_values = [0i32; MAX_RECVS];
        let mut parents = [None; MAX_RECVS];
        for i in 0..count {
            (bufs[i], tag_values[i], parents[i]) = entry(i)?;
        }
        comm.comm
            .irecv(&bufs[..count], &tag_values[..count], &parents[..count])?
    };
    hand_out(&comm.slots, id, request)
}

/// Reports on a request; `sizes` (may be NULL) gets the size of each of its buffers.
fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> Result<()> {
    let done = non_null(done, "done")?;
    if request.is_null() {
        // SAFETY: valid out-pointer (checked non-NULL).
        unsafe { *done = 0 };
        // As NCCL's Socket plugin answers it ("test called with NULL request",
        // src/transport/net_socket.cc).
        return Err(Error::internal("test called with a NULL request"));
    }
    // SAFETY: `request` is a slot we handed out from a comm that NCCL has not closed yet (its
    // kind word checked), or another object of at least 8 readable bytes.
    let slot = unsafe { &*checked::<RequestSlot>(request, Kind::Request, "test")? };
    // SAFETY: slots point at the comm that owns them, alive as long as the slot is.
    let owner = unsafe { &*slot.owner };
    let completion = owner.test(slot.id);
    // SAFETY: valid out-pointer (checked non-NULL).
    unsafe { *done = c_int::from(matches!(completion, Ok(Some(_)))) };
    if let Some(completion) = completion? {
        if !sizes.is_null() {
            for (i, &size) in completion.sizes().iter().enumerate() {
                let size = c_int::try_from(size).unwrap_or(c_int::MAX);
                // SAFETY: NCCL's sizes array has one entry per buffer of the request.
                unsafe { *sizes.add(i) = size };
            }
        }
    }
    Ok(())
}

fn close_send(send_comm: *mut c_void) -> Result<()> {
    close_handle(send_comm, Kind::Send, "closeSend", |c: &mut AbiSendComm| {
        c.comm.close()
    })
}

fn close_recv(recv_comm: *mut c_void) -> Result<()> {
    close_handle(recv_comm, Kind::Recv, "closeRecv", |c: &mut AbiRecvComm| {
        c.comm.close()
    })
}

fn close_listen(listen_comm: *mut c_void) -> Result<()> {
    close_handle(
        listen_comm,
        Kind::Listen,
        "closeListen",
        |c: &mut AbiListenComm| c.comm.close(),
    )
}

// ---- memory registration ------------------------------------------------------------------

/// Which comm `regMr`/`deregMr` (which take either kind as `void*`) were given.
///
/// # Safety
/// `comm` must be NULL, a comm our listen/connect/accept returned and not yet closed, or
/// another object of at least 8 readable bytes.
unsafe fn comm_kind(comm: *mut c_void) -> Result<Kind> {
    // SAFETY: per this function's contract.
    match unsafe { handles::kind_of(comm, Kind::Send)? } {
        Some(kind @ (Kind::Send | Kind::Recv)) => Ok(kind),
        Some(Kind::Listen) => Err(Error::invalid_argument(
            "regMr/deregMr on a listenComm (memory registers with a sendComm or recvComm)",
        )),
        _ => Err(Error::invalid_argument(
            "regMr/deregMr on something that is not one of our comms",
        )),
    }
}

/// `regMr`: registers host memory with the comm's transport (sockets need nothing; a
/// wrapped plugin registers it with its own comm).
fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    mhandle: *mut *mut c_void,
) -> Result<()> {
    let mhandle = non_null(mhandle, "mhandle")?;
    if kind != ffi::NCCL_PTR_HOST as c_int {
        // ncclInternalError, as NCCL's Socket plugin answers it (`ncclNetSocketRegMr`,
        // src/transport/net_socket.cc).
        return Err(Error::internal(format!(
            "regMr of memory type {kind}: this plugin handles host memory only (NCCL_PTR_HOST)"
        )));
    }
    if size > 0 {
        non_null(data, "data")?;
    }
    // SAFETY: NCCL registers memory it owns for as long as the registration lives; the
    // transport only records (or forwards) the address.
    let buf = unsafe { HostBuf::new(data.cast(), size) };
    // SAFETY: NCCL passes one of the comms our connect/accept returned.
    let mr = match unsafe { comm_kind(comm)? } {
        // SAFETY: the kind word says this is an AbiSendComm, alive until closeSend.
        Kind::Send => unsafe { &*(comm as *const AbiSendComm) }
            .comm
            .register(buf)?,
        // SAFETY: the kind word says this is an AbiRecvComm, alive until closeRecv.
        Kind::Recv => unsafe { &*(comm as *const AbiRecvComm) }
            .comm
            .register(buf)?,
        _ => return Err(Error::internal("comm_kind returned another kind")),
    };
    // SAFETY: valid out-pointer (checked non-NULL).
    unsafe { *mhandle = mr as *mut c_void };
    Ok(())
}

/// `deregMr`: releases what [`reg_mr`] made.
fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> Result<()> {
    let mr = mhandle as usize;
    // SAFETY: NCCL passes one of the comms our connect/accept returned.
    match unsafe { comm_kind(comm)? } {
        // SAFETY: the kind word says this is an AbiSendComm, alive until closeSend.
        Kind::Send => unsafe { &*(comm as *const AbiSendComm) }
            .comm
            .deregister(mr),
        // SAFETY: the kind word says this is an AbiRecvComm, alive until closeRecv.
        Kind::Recv => unsafe { &*(comm as *const AbiRecvComm) }
            .comm
            .deregister(mr),
        _ => Err(Error::internal("comm_kind returned another kind")),
    }
}

/// Host plugins are never asked to flush; answer "nothing to wait for".
fn iflush(request: *mut *mut c_void) -> Result<()> {
    let request = non_null(request, "request")?;
    // SAFETY: valid out-pointer (checked non-NULL).
    unsafe { *request = std::ptr::null_mut() };
    Ok(())
}

/// No device-side memory handle: this plugin's data never lives on the GPU.
fn get_device_mr(dptr_mhandle: *mut *mut c_void) -> Result<()> {
    if !dptr_mhandle.is_null() {
        // SAFETY: valid out-pointer (checked non-NULL).
        unsafe { *dptr_mhandle = std::ptr::null_mut() };
    }
    Ok(())
}

/// Records `setNetAttr` in the context so rules can match the collective being posted.
///
/// # Safety
/// `attr` is NCCL's attribute struct or NULL.
unsafe fn set_net_attr(ctx: *mut c_void, attr: *mut ffi::ncclNetAttr_v11_t) -> Result<()> {
    let ctx = contexts::context_of(ctx, "setNetAttr")?;
    let attr = non_null(attr, "netAttr")?;
    // SAFETY: NCCL passes a valid attribute struct for the duration of the call.
    let attr = unsafe { &*attr };
    ctx.set_attributes(attr.op, attr.algo, attr.proto);
    // NCCL's proxy calls this before every transfer: the runtime (a process-wide lock) is
    // looked up only when its transport takes the call.
    if ctx.forwards_net_attr {
        Runtime::current()?.forward_net_attr(&ctx, attr);
    }
    Ok(())
}
