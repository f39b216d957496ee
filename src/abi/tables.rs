//! The exported `ncclNetPlugin_v8` .. `ncclNetPlugin_v12` tables. Each function here only
//! converts one version's argument types and calls the shared entry point in [`super`];
//! functions whose signature did not change are shared by all tables.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use super::ffi::{
    ncclDebugLogger_t, ncclNetAttr_v11_t, ncclNetCommConfig_v10_t, ncclNetDeviceHandle_v8_t,
    ncclNetDeviceType, ncclNetProperties_v11_t, ncclNetProperties_v12_t, ncclNetProperties_v8_t,
    ncclNetProperties_v9_t, ncclNetVDeviceProps_v12_t, ncclNetVDeviceProps_v9_t, ncclNet_v10_t,
    ncclNet_v11_t, ncclNet_v12_t, ncclNet_v8_t, ncclNet_v9_t, ncclProfilerCallback_t, ncclResult_t,
    NCCL_NET_TRAFFIC_CLASS_UNDEF, NCCL_PTR_HOST,
};
use super::{guard, non_null, CommonProps};
use crate::runtime::Context;

/// Makes a function table exportable as a `static`: the tables hold only a pointer to a
/// string literal and function pointers, all immutable for the life of the library.
#[repr(transparent)]
pub struct Exported<T>(pub T);

// SAFETY: the wrapped tables are never mutated and point only at 'static data and functions.
unsafe impl<T> Sync for Exported<T> {}

const NAME: *const std::ffi::c_char = c"lossy".as_ptr();

// ---- entry points shared by every version -------------------------------------------------

extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || super::devices(ndev))
}

extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    guard("accept", || super::accept(listen_comm, recv_comm))
}

extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    guard("regMr", || super::reg_mr(comm, data, size, kind, mhandle))
}

extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    guard("deregMr", || super::dereg_mr(comm, mhandle))
}

extern "C" fn iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("iflush", || super::iflush(request))
}

extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> ncclResult_t {
    guard("test", || super::test(request, done, sizes))
}

extern "C" fn close_send(send_comm: *mut c_void) -> ncclResult_t {
    guard("closeSend", || super::close_send(send_comm))
}

extern "C" fn close_recv(recv_comm: *mut c_void) -> ncclResult_t {
    guard("closeRecv", || super::close_recv(recv_comm))
}

extern "C" fn close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    guard("closeListen", || super::close_listen(listen_comm))
}

extern "C" fn get_device_mr(
    _comm: *mut c_void,
    _mhandle: *mut c_void,
    dptr_mhandle: *mut *mut c_void,
) -> ncclResult_t {
    guard("getDeviceMr", || super::get_device_mr(dptr_mhandle))
}

/// Converts NCCL's per-version size arrays into byte counts (negative sizes become 0 and
/// are then refused by the transport as too small for any message).
fn int_size(sizes: *mut c_int, i: usize) -> usize {
    // SAFETY: NCCL's sizes array has `n` entries and callers only ask for i < n.
    usize::try_from(unsafe { *sizes.add(i) }).unwrap_or(0)
}

fn size_t_size(sizes: *mut usize, i: usize) -> usize {
    // SAFETY: NCCL's sizes array has `n` entries and callers only ask for i < n.
    unsafe { *sizes.add(i) }
}

// ---- properties ---------------------------------------------------------------------------

/// Fills the fields every properties version shares, then the version's own extras.
macro_rules! fill_props {
    ($props:expr, $common:expr) => {{
        let p = $props;
        let c: CommonProps = $common;
        p.name = c.name;
        p.pciPath = c.pci_path;
        p.guid = c.guid;
        p.ptrSupport = NCCL_PTR_HOST as c_int;
        p.regIsGlobal = 0;
        p.speed = c.speed;
        p.port = c.port;
        p.latency = c.latency;
        p.maxComms = c.max_comms;
        p.maxRecvs = c.max_recvs;
        p.netDeviceType = ncclNetDeviceType::NCCL_NET_DEVICE_HOST;
        p.netDeviceVersion = 0;
        (p, c)
    }};
}

extern "C" fn get_properties_v8(dev: c_int, props: *mut ncclNetProperties_v8_t) -> ncclResult_t {
    guard("getProperties", || {
        let props = non_null(props, "props")?;
        let common = super::common_props(dev)?;
        // SAFETY: NCCL passes a valid, writable v8 properties struct.
        let props = unsafe { &mut *props };
        *props = Default::default();
        fill_props!(props, common);
        Ok(())
    })
}

/// Fills a v9/v10 properties struct (and is reused by v11 for its shared prefix).
fn fill_v9(props: &mut ncclNetProperties_v9_t, dev: c_int) -> crate::Result<()> {
    *props = Default::default();
    let (p, c) = fill_props!(props, super::common_props(dev)?);
    p.forceFlush = 0;
    p.vProps = ncclNetVDeviceProps_v9_t::default();
    p.vProps.ndevs = 1;
    p.vProps.devs[0] = dev;
    p.maxP2pBytes = c.max_p2p_bytes;
    p.maxCollBytes = c.max_coll_bytes;
    Ok(())
}

extern "C" fn get_properties_v9(dev: c_int, props: *mut ncclNetProperties_v9_t) -> ncclResult_t {
    guard("getProperties", || {
        let props = non_null(props, "props")?;
        // SAFETY: NCCL passes a valid, writable v9 properties struct.
        fill_v9(unsafe { &mut *props }, dev)
    })
}

extern "C" fn get_properties_v11(dev: c_int, props: *mut ncclNetProperties_v11_t) -> ncclResult_t {
    guard("getProperties", || {
        let props = non_null(props, "props")?;
        // SAFETY: NCCL passes a valid, writable v11 properties struct.
        let props = unsafe { &mut *props };
        *props = Default::default();
        let (p, c) = fill_props!(props, super::common_props(dev)?);
        p.vProps.ndevs = 1;
        p.vProps.devs[0] = dev;
        p.maxP2pBytes = c.max_p2p_bytes;
        p.maxCollBytes = c.max_coll_bytes;
        p.maxMultiRequestSize = 1;
        Ok(())
    })
}

extern "C" fn get_properties_v12(dev: c_int, props: *mut ncclNetProperties_v12_t) -> ncclResult_t {
    guard("getProperties", || {
        let props = non_null(props, "props")?;
        // SAFETY: NCCL passes a valid, writable v12 properties struct.
        let props = unsafe { &mut *props };
        *props = Default::default();
        let (p, c) = fill_props!(props, super::common_props(dev)?);
        p.vProps = ncclNetVDeviceProps_v12_t::default();
        p.vProps.ndevs = 1;
        p.vProps.devs[0] = dev;
        p.maxP2pBytes = c.max_p2p_bytes;
        p.maxCollBytes = c.max_coll_bytes;
        p.maxMultiRequestSize = 1;
        p.railId = c.rail_id;
        p.planeId = c.plane_id;
        Ok(())
    })
}

// ---- v8 to v10: one implicit context -------------------------------------------------------

extern "C" fn init_v8(logger: ncclDebugLogger_t) -> ncclResult_t {
    guard("init", || super::init_legacy(logger, None))
}

extern "C" fn init_v10(
    logger: ncclDebugLogger_t,
    profiler: ncclProfilerCallback_t,
) -> ncclResult_t {
    guard("init", || super::init_legacy(logger, Some(profiler)))
}

extern "C" fn listen_implicit(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    guard("listen", || {
        super::listen(&Context::implicit(), dev, handle, listen_comm)
    })
}

extern "C" fn connect_v8(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    guard("connect", || {
        super::connect(&Context::implicit(), dev, handle, send_comm, None)
    })
}

/// v10 gives the communicator's traffic class to each `connect` (v11+ to `init`).
extern "C" fn connect_v10(
    dev: c_int,
    config: *mut ncclNetCommConfig_v10_t,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    guard("connect", || {
        let traffic_class = traffic_class_of(config);
        super::connect(&Context::implicit(), dev, handle, send_comm, traffic_class)
    })
}

/// The traffic class of NCCL's comm config, if it sets one (NULL or
/// `NCCL_NET_TRAFFIC_CLASS_UNDEF`: none).
fn traffic_class_of(config: *const ncclNetCommConfig_v10_t) -> Option<i32> {
    if config.is_null() {
        return None;
    }
    // SAFETY: NCCL passes a valid config struct or NULL (checked).
    Some(unsafe { (*config).trafficClass }).filter(|&tc| tc != NCCL_NET_TRAFFIC_CLASS_UNDEF)
}

extern "C" fn isend_v8(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("isend", || {
        let size = usize::try_from(size).map_err(|_| {
            crate::Error::invalid_argument(format!("isend of negative size {size}"))
        })?;
        super::isend(send_comm, data, size, tag, mhandle, null_mut(), request)
    })
}

extern "C" fn isend_v9(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("isend", || {
        super::isend(send_comm, data, size, tag, mhandle, null_mut(), request)
    })
}

extern "C" fn isend_v10(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    phandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // v10 adds NCCL's profiler handle for the message (see `net_profiler`).
    guard("isend", || {
        super::isend(send_comm, data, size, tag, mhandle, phandle, request)
    })
}

extern "C" fn irecv_v8(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("irecv", || {
        let sizes = non_null(sizes, "sizes")?;
        super::irecv(
            recv_comm,
            n,
            data,
            |i| int_size(sizes, i),
            tags,
            mhandles,
            std::ptr::null_mut(),
            request,
        )
    })
}

extern "C" fn irecv_v9(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // v9 is v10 without profiler handles.
    irecv_v10(
        recv_comm,
        n,
        data,
        sizes,
        tags,
        mhandles,
        std::ptr::null_mut(),
        request,
    )
}

#[allow(clippy::too_many_arguments)]
extern "C" fn irecv_v10(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    phandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // v10 adds profiler handles: our receives report no events, but a wrapped plugin gets
    // them (see `crate::ffi::net::profiler`).
    guard("irecv", || {
        let sizes = non_null(sizes, "sizes")?;
        super::irecv(
            recv_comm,
            n,
            data,
            |i| size_t_size(sizes, i),
            tags,
            mhandles,
            phandles,
            request,
        )
    })
}

// ---- v11 and v12: one context per communicator ---------------------------------------------

extern "C" fn init_v11(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v10_t,
    logger: ncclDebugLogger_t,
    profiler: ncclProfilerCallback_t,
) -> ncclResult_t {
    // NCCL 2.28.3 may pass a finalized context on (docs/abi.md, "Contexts").
    let keep = super::contexts::AfterFinalize::KeepWhilePluginHeld;
    init_context(ctx, comm_id, config, logger, profiler, keep)
}

extern "C" fn init_v12(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v10_t,
    logger: ncclDebugLogger_t,
    profiler: ncclProfilerCallback_t,
) -> ncclResult_t {
    init_context(
        ctx,
        comm_id,
        config,
        logger,
        profiler,
        super::contexts::AfterFinalize::Free,
    )
}

/// `init` of v11 and v12, which differ in what `finalize` does with the context.
fn init_context(
    ctx: *mut *mut c_void,
    comm_id: u64,
    config: *mut ncclNetCommConfig_v10_t,
    logger: ncclDebugLogger_t,
    profiler: ncclProfilerCallback_t,
    after_finalize: super::contexts::AfterFinalize,
) -> ncclResult_t {
    guard("init", || {
        let class = traffic_class_of(config);
        super::contexts::init_context(ctx, comm_id, class, logger, profiler, after_finalize)
    })
}

extern "C" fn listen_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    guard("listen", || {
        let ctx = super::contexts::context_of(ctx, "listen")?;
        super::listen(&ctx, dev, handle, listen_comm)
    })
}

extern "C" fn connect_v11(
    ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    guard("connect", || {
        let ctx = super::contexts::context_of(ctx, "connect")?;
        super::connect(&ctx, dev, handle, send_comm, None)
    })
}

extern "C" fn finalize(ctx: *mut c_void) -> ncclResult_t {
    guard("finalize", || super::contexts::finalize_context(ctx))
}

extern "C" fn set_net_attr(ctx: *mut c_void, attr: *mut ncclNetAttr_v11_t) -> ncclResult_t {
    // SAFETY: NCCL passes a valid attribute struct (or NULL).
    guard("setNetAttr", || unsafe { super::set_net_attr(ctx, attr) })
}

// ---- the exported tables --------------------------------------------------------------------

/// Defines one exported `ncclNetPlugin_vN` table: the version-specific entries are named,
/// every other entry is the shared one (or NULL for the optional ones we do not offer);
/// `extra` lists the fields a version added after `irecvConsumed`.
macro_rules! export_table {
    (
        $(#[$doc:meta])*
        $symbol:ident: $table:ident {
            init: $init:expr,
            getProperties: $get_properties:expr,
            listen: $listen:expr,
            connect: $connect:expr,
            isend: $isend:expr,
            irecv: $irecv:expr
            $(, $extra:ident: $value:expr)* $(,)?
        }
    ) => {
        $(#[$doc])*
        #[no_mangle]
        pub static $symbol: Exported<$table> = Exported($table {
            name: NAME,
            init: Some($init),
            devices: Some(devices),
            getProperties: Some($get_properties),
            listen: Some($listen),
            connect: Some($connect),
            accept: Some(accept),
            regMr: Some(reg_mr),
            regMrDmaBuf: None,
            deregMr: Some(dereg_mr),
            isend: Some($isend),
            irecv: Some($irecv),
            iflush: Some(iflush),
            test: Some(test),
            closeSend: Some(close_send),
            closeRecv: Some(close_recv),
            closeListen: Some(close_listen),
            getDeviceMr: Some(get_device_mr),
            // NULL, as NCCL's Socket and IB plugins: NCCL then makes no call per receive
            // (src/transport/net.cc, recvProxyProgress); wrap mode tells its inner plugin
            // itself when a receive completes.
            irecvConsumed: None,
            $($extra: $value,)*
        });
    };
}

export_table! {
    /// Net plugin API v12 (NCCL 2.30+).
    ncclNetPlugin_v12: ncclNet_v12_t {
        init: init_v12,
        getProperties: get_properties_v12,
        listen: listen_v11,
        connect: connect_v11,
        isend: isend_v10,
        irecv: irecv_v10,
        makeVDevice: None,
        finalize: Some(finalize),
        setNetAttr: Some(set_net_attr),
    }
}

export_table! {
    /// Net plugin API v11 (NCCL 2.28-2.29).
    ncclNetPlugin_v11: ncclNet_v11_t {
        init: init_v11,
        getProperties: get_properties_v11,
        listen: listen_v11,
        connect: connect_v11,
        isend: isend_v10,
        irecv: irecv_v10,
        makeVDevice: None,
        finalize: Some(finalize),
        setNetAttr: Some(set_net_attr),
    }
}

export_table! {
    /// Net plugin API v10 (NCCL 2.26-2.27).
    ncclNetPlugin_v10: ncclNet_v10_t {
        init: init_v10,
        getProperties: get_properties_v9,
        listen: listen_implicit,
        connect: connect_v10,
        isend: isend_v10,
        irecv: irecv_v10,
        makeVDevice: None,
    }
}

export_table! {
    /// Net plugin API v9 (NCCL 2.24-2.25).
    ncclNetPlugin_v9: ncclNet_v9_t {
        init: init_v8,
        getProperties: get_properties_v9,
        listen: listen_implicit,
        connect: connect_v8,
        isend: isend_v9,
        irecv: irecv_v9,
        makeVDevice: None,
    }
}

export_table! {
    /// Net plugin API v8 (NCCL 2.20-2.23).
    ncclNetPlugin_v8: ncclNet_v8_t {
        init: init_v8,
        getProperties: get_properties_v8,
        listen: listen_implicit,
        connect: connect_v8,
        isend: isend_v8,
        irecv: irecv_v8,
    }
}
