//! A device's properties in the current (v12) shape, converted from each table version's own
//! properties struct with the values NCCL's adapters (`src/plugin/net/net_v6.cc` ..
//! `net_v12.cc`) give the fields an older version lacks.

use std::ffi::c_int;

use super::{Code, MISSING, OK, V8_MAX_BYTES, V8_MAX_COLL_BYTES};
use crate::ffi::{
    c_string, ncclNetProperties_v11_t, ncclNetProperties_v12_t, ncclNetProperties_v6_t,
    ncclNetProperties_v7_t, ncclNetProperties_v8_t, ncclNetProperties_v9_t,
};

// ---- properties ----------------------------------------------------------------------------

/// A device's properties in the current (v12) shape, whatever the table's version: fields
/// an older version lacks get the values NCCL's own adapters give them.
#[derive(Clone, Debug, PartialEq)]
pub struct NetProperties {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
    /// PCI path in /sys, when the plugin gave one.
    pub pci_path: Option<String>,
    /// Device GUID.
    pub guid: u64,
    /// `NCCL_PTR_*` bits the device accepts.
    pub ptr_support: i32,
    /// Whether registrations are global.
    pub reg_is_global: i32,
    /// Whether receives need a flush (v9+; 0 before).
    pub force_flush: i32,
    /// Link speed, Mbps.
    pub speed_mbps: i32,
    /// Port number.
    pub port: i32,
    /// Latency, microseconds.
    pub latency_us: f32,
    /// Most connections.
    pub max_comms: i32,
    /// Most buffers per grouped receive.
    pub max_recvs: i32,
    /// Device type (0: host).
    pub net_device_type: i32,
    /// Device-side API version.
    pub net_device_version: i32,
    /// Physical devices behind this one (before v9: the device itself).
    pub vdevs: Vec<i32>,
    /// Largest point-to-point message (before v9: 1 GiB, as NCCL assumes).
    pub max_p2p_bytes: usize,
    /// Largest collective message (before v9: 512 MiB, as NCCL assumes).
    pub max_coll_bytes: usize,
    /// Most requests NCCL may merge (before v11: 1).
    pub max_multi_request_size: i32,
    /// Rail id (before v12: -1, unknown).
    pub rail_id: i16,
    /// Plane id (before v12: -1, unknown).
    pub plane_id: i16,
}

/// One version's properties struct.
pub(super) trait PropsLayout: Default {
    /// The struct in the current shape.
    ///
    /// # Safety
    /// `self` was filled by the plugin's `getProperties`, so its string fields are NULL or
    /// NUL-terminated strings that live as long as the plugin.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties;
}

/// The fields every version has, from v6 on (the device offload type and version given, as
/// v6 has none), and the others as NCCL's `net_v6.cc` and `net_v7.cc` fill them (v6 and v7
/// have no `regIsGlobal`).
macro_rules! v6_props {
    ($p:expr, $dev:expr, $device_type:expr, $device_version:expr) => {{
        let p = $p;
        NetProperties {
            // SAFETY: the caller's contract: NULL or a NUL-terminated string of the plugin.
            name: unsafe { c_string(p.name) }.unwrap_or_default(),
            // SAFETY: as for `name`.
            pci_path: unsafe { c_string(p.pciPath) },
            guid: p.guid,
            ptr_support: p.ptrSupport,
            reg_is_global: 0,
            force_flush: 0,
            speed_mbps: p.speed,
            port: p.port,
            latency_us: p.latency,
            max_comms: p.maxComms,
            max_recvs: p.maxRecvs,
            net_device_type: $device_type,
            net_device_version: $device_version,
            vdevs: vec![$dev],
            max_p2p_bytes: V8_MAX_BYTES,
            max_coll_bytes: V8_MAX_COLL_BYTES,
            max_multi_request_size: 1,
            rail_id: -1,
            plane_id: -1,
        }
    }};
}

impl PropsLayout for ncclNetProperties_v6_t {
    /// # Safety: the [`PropsLayout::adapt`] contract.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties {
        // A host device of no device-side API version (NCCL's
        // `NCCL_NET_DEVICE_HOST` and `NCCL_NET_DEVICE_INVALID_VERSION`).
        v6_props!(self, dev, 0, 0)
    }
}

impl PropsLayout for ncclNetProperties_v7_t {
    /// # Safety: the [`PropsLayout::adapt`] contract.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties {
        v6_props!(
            self,
            dev,
            self.netDeviceType.0 as i32,
            self.netDeviceVersion
        )
    }
}

/// The fields every properties version from v8 on shares, with v8's defaults for the others.
macro_rules! base_props {
    ($p:expr, $dev:expr) => {{
        let p = $p;
        NetProperties {
            reg_is_global: p.regIsGlobal,
            ..v6_props!(p, $dev, p.netDeviceType.0 as i32, p.netDeviceVersion)
        }
    }};
}

/// Adds the fields v9 introduced.
macro_rules! v9_props {
    ($p:expr, $dev:expr) => {{
        let p = $p;
        let n = usize::try_from(p.vProps.ndevs).unwrap_or(0);
        NetProperties {
            force_flush: p.forceFlush,
            vdevs: p.vProps.devs[..n.min(p.vProps.devs.len())].to_vec(),
            max_p2p_bytes: p.maxP2pBytes,
            max_coll_bytes: p.maxCollBytes,
            ..base_props!(p, $dev)
        }
    }};
}

impl PropsLayout for ncclNetProperties_v8_t {
    /// # Safety: the [`PropsLayout::adapt`] contract.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties {
        base_props!(self, dev)
    }
}

impl PropsLayout for ncclNetProperties_v9_t {
    /// # Safety: the [`PropsLayout::adapt`] contract.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties {
        v9_props!(self, dev)
    }
}

impl PropsLayout for ncclNetProperties_v11_t {
    /// # Safety: the [`PropsLayout::adapt`] contract.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties {
        NetProperties {
            max_multi_request_size: self.maxMultiRequestSize,
            ..v9_props!(self, dev)
        }
    }
}

impl PropsLayout for ncclNetProperties_v12_t {
    /// # Safety: the [`PropsLayout::adapt`] contract.
    unsafe fn adapt(&self, dev: c_int) -> NetProperties {
        NetProperties {
            max_multi_request_size: self.maxMultiRequestSize,
            rail_id: self.railId,
            plane_id: self.planeId,
            ..v9_props!(self, dev)
        }
    }
}

/// Calls `getProperties` of any version with a struct of its own layout, then adapts it.
///
/// # Safety
/// `get` is a plugin's `getProperties` taking a `*mut P`.
pub(super) unsafe fn properties_of<P: PropsLayout>(
    get: Option<unsafe extern "C" fn(c_int, *mut P) -> Code>,
    dev: c_int,
) -> std::result::Result<NetProperties, Code> {
    let Some(get) = get else { return Err(MISSING) };
    let mut p = P::default();
    // SAFETY: a writable struct of the layout this entry takes, owned by this frame.
    match unsafe { get(dev, &mut p) } {
        // SAFETY: the plugin filled `p`.
        OK => Ok(unsafe { p.adapt(dev) }),
        code => Err(code),
    }
}
