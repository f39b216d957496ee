//! Our own TCP transport: several non-blocking sockets per connection, moved inline by the
//! caller and by a small process-wide pool of I/O threads.
//!
//! - [`iface`]: which interfaces become devices (NCCL's `NCCL_SOCKET_IFNAME` rules);
//! - [`wire`]: the handle, hello and chunk header byte layouts;
//! - `listen` / `connect`: non-blocking handshakes;
//! - `conn`: the data path (request slots, per-socket state machines, the I/O pool, loss
//!   effects at the receiver).
//!
//! Environment (read by [`SocketConfig::from_env`]):
//! `NCCL_SOCKET_IFNAME`, `NCCL_SOCKET_FAMILY` as in NCCL; `NCCL_LOSSY_NSOCKS` sockets per
//! connection (1 to 16, default [`DEFAULT_NSOCKS`]); `NCCL_LOSSY_IO_THREADS` I/O pool threads
//! (default: see `conn`); `NCCL_LOSSY_SPEED_MBPS` overrides the
//! reported link speed; `NCCL_LOSSY_SOCKBUF` sets SO_SNDBUF/SO_RCVBUF in bytes (default: the
//! kernel's autotuning); `NCCL_LOSSY_TIMEOUT` fails requests of a connection that moves no
//! byte for that many seconds, and bounds accept and connect (default 0: off).

mod conn;
mod connect;
mod fds;
pub mod iface;
mod listen;
pub mod wire;

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod tests;

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use rand::rngs::OsRng;
use rand::RngCore;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

pub use conn::{
    chunk_count, chunk_span, SocketRecvConn, SocketSendConn, DEFAULT_IO_THREADS, MAX_IO_THREADS,
    MIN_CHUNK,
};
pub use connect::{ConnectRetries, SocketConnector, DEFAULT_CONNECT_TIMEOUT};
pub use fds::limit_text as fd_limit_text;
pub use iface::{Family, IfaceAddr, IfaceFilter, MAX_DEVICES};
pub use listen::{SocketListener, HELLO_TIMEOUT, MAX_PENDING};
pub use wire::{Handle, Hello, MAX_SOCKETS};

use crate::transport::{Connector, DeviceProps, Listener, Transport, WireHandle};
use crate::{Error, Result};

/// Sockets per connection when `NCCL_LOSSY_NSOCKS` is unset: one, moved inline on the caller's
/// thread, as NCCL's Socket transport does by default, on any host. One stream beat four at every size from 8 B to 256 MiB on 2 cores (docs/performance.md,
/// "Engine v2"), and on a 16-core GPU host, where four streams (with a quarter of the cores as
/// pool threads) were the default above 4 cores, argued to win at large sizes: there they took
/// 3-66% longer at every size, over 1 and over 8 channels (docs/gpu-host.md). A fast NIC may
/// still want more: `NCCL_LOSSY_NSOCKS`.
pub const DEFAULT_NSOCKS: usize = 1;

/// Link speed reported when the interface does not tell one (10 Gb/s, NCCL's default).
pub const DEFAULT_SPEED_MBPS: i32 = 10_000;

/// Connections per device we advertise (the value NCCL's own socket transport uses).
pub const MAX_COMMS: i32 = 65_536;

/// The `maxRecvs` the socket transport advertises: 1, as NCCL's own Socket transport does, so
/// NCCL never groups receives on our comms; see docs/transport.md, "Grouped receives".
pub const ADVERTISED_MAX_RECVS: i32 = 1;

/// Logs a warning about the transport. The one place transport messages leave the library,
/// so routing them to NCCL's logger later is a one-line change.
pub fn log_warn(msg: impl fmt::Display) {
    crate::log::warn(&format!("socket: {msg}"));
}

/// Settings of the socket transport, usually from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketConfig {
    /// Interfaces to use (`NCCL_SOCKET_IFNAME` syntax); `None` picks like NCCL does.
    pub ifname: Option<String>,
    /// Address family restriction (`NCCL_SOCKET_FAMILY`).
    pub family: Option<Family>,
    /// Sockets per connection.
    pub nsocks: usize,
    /// Link speed to report instead of the interface's, in Mbps.
    pub speed_mbps: Option<i32>,
    /// Socket buffer sizes in bytes; `None` leaves the kernel's autotuning on.
    pub sockbuf: Option<usize>,
    /// `NCCL_LOSSY_TIMEOUT`: a connection whose outstanding requests move no byte for this
    /// long fails them, and accepting/connecting give up after it; `None`: off.
    pub timeout: Option<Duration>,
    /// `NCCL_LOSSY_DELAYED_ACKS` (default on): receiving sockets that carry messages under
    /// 64 KiB ask TCP to delay its acknowledgements (`TCP_QUICKACK` off) instead of sending
    /// one for every such segment (docs/transport.md, "Small messages").
    pub delayed_acks: bool,
    /// How a refused connect is tried again (`NCCL_SOCKET_RETRY_CNT`,
    /// `NCCL_SOCKET_RETRY_SLEEP_MSEC`, as NCCL's Socket transport reads them).
    pub retries: ConnectRetries,
}

impl Default for SocketConfig {
    fn default() -> Self {
        SocketConfig {
            ifname: None,
            family: None,
            nsocks: DEFAULT_NSOCKS,
            speed_mbps: None,
            sockbuf: None,
            timeout: None,
            delayed_acks: true,
            retries: ConnectRetries::default(),
        }
    }
}

/// Smallest and largest `NCCL_LOSSY_SOCKBUF` accepted, in bytes.
pub const MIN_SOCKBUF: usize = 4096;
pub const MAX_SOCKBUF: usize = 1 << 30;

/// Longest `NCCL_LOSSY_TIMEOUT` accepted, in seconds (a week; longer is a typo).
pub const MAX_TIMEOUT_SECS: f64 = 7.0 * 24.0 * 3600.0;

/// Shortest `NCCL_LOSSY_TIMEOUT` accepted, in seconds (below, a positive value would round
/// towards a zero timeout).
pub const MIN_TIMEOUT_SECS: f64 = 0.001;

/// Reads an `NCCL_LOSSY_TIMEOUT` value: seconds, 0 (off) or a decimal number from
/// [`MIN_TIMEOUT_SECS`] to [`MAX_TIMEOUT_SECS`]. The error names the variable and what it
/// accepts.
pub fn parse_timeout(value: &str) -> Result<Option<Duration>> {
    let text = value.trim();
    let secs = text.parse::<f64>().ok().filter(|s| s.is_finite());
    // A positive number below the smallest float (`1e-400`) parses as 0.0: only a value
    // whose digits before any exponent are all zeros is 0 (off).
    let mantissa = text.split(['e', 'E']).next().unwrap_or_default();
    let written_zero = !mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b));
    let value = crate::error::echo(value, str::to_string);
    match secs {
        Some(0.0) if written_zero => Ok(None),
        Some(s) if (MIN_TIMEOUT_SECS..=MAX_TIMEOUT_SECS).contains(&s) => {
            Ok(Some(Duration::from_secs_f64(s)))
        }
        _ => Err(Error::invalid_argument(format!(
            "NCCL_LOSSY_TIMEOUT={value} is not valid: expected 0 or a number of seconds from \
             {MIN_TIMEOUT_SECS} to {MAX_TIMEOUT_SECS} (0 or unset: off; e.g. 600 or 2.5)"
        ))),
    }
}

impl SocketConfig {
    /// Reads the settings from the environment; a malformed value is an error, not ignored.
    /// A value that is not UTF-8 is an error naming the variable.
    pub fn from_env() -> Result<SocketConfig> {
        SocketConfig::read(crate::env::var)
    }

    /// Reads the settings from `lookup` (a variable name to its value), as `from_env` does.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<SocketConfig> {
        SocketConfig::read(|name| Ok(lookup(name)))
    }

    fn read(lookup: impl Fn(&str) -> Result<Option<String>>) -> Result<SocketConfig> {
        let text = |name: &str| -> Result<Option<String>> {
            Ok(lookup(name)?.filter(|v| !v.trim().is_empty()))
        };
        // A value as the errors echo it: cut, with its length, past a few dozen characters
        // (every rank logs an init failure, and a variable may hold 128 KiB).
        let shown = |v: &str| crate::error::echo(v, str::to_string);
        // The value, or the refused value as the errors echo it.
        fn number<T: std::str::FromStr>(
            v: Option<String>,
            ok: impl Fn(&T) -> bool,
        ) -> std::result::Result<Option<T>, String> {
            match v {
                None => Ok(None),
                Some(v) => match v.trim().parse::<T>() {
                    Ok(x) if ok(&x) => Ok(Some(x)),
                    _ => Err(crate::error::echo(&v, str::to_string)),
                },
            }
        }
        let family = match text("NCCL_SOCKET_FAMILY")? {
            None => None,
            Some(v) => Some(Family::parse(&v).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "NCCL_SOCKET_FAMILY={}: expected AF_INET or AF_INET6",
                    shown(&v)
                ))
            })?),
        };
        let nsocks = number(text("NCCL_LOSSY_NSOCKS")?, |n: &usize| {
            (1..=MAX_SOCKETS).contains(n)
        })
        .map_err(|v| {
            Error::invalid_argument(format!(
                "NCCL_LOSSY_NSOCKS={v} is not a valid value: sockets per connection, an integer \
                 from 1 to {MAX_SOCKETS}"
            ))
        })?;
        let speed_mbps = number(text("NCCL_LOSSY_SPEED_MBPS")?, |s: &i32| *s > 0).map_err(|v| {
            Error::invalid_argument(format!(
                "NCCL_LOSSY_SPEED_MBPS={v} is not a valid value: the link speed reported to \
                 NCCL in Mbps, an integer from 1 to {}",
                i32::MAX
            ))
        })?;
        let sockbuf = number(text("NCCL_LOSSY_SOCKBUF")?, |b: &usize| {
            (MIN_SOCKBUF..=MAX_SOCKBUF).contains(b)
        })
        .map_err(|v| {
            Error::invalid_argument(format!(
                "NCCL_LOSSY_SOCKBUF={v} is not a valid value: socket buffer size in bytes, an \
                 integer from {MIN_SOCKBUF} to {MAX_SOCKBUF}"
            ))
        })?;
        // Read by the I/O pool when it starts; checked here so a bad value fails `init`.
        number(text("NCCL_LOSSY_IO_THREADS")?, |n: &usize| {
            *n <= MAX_IO_THREADS
        })
        .map_err(|v| {
            Error::invalid_argument(format!(
                "NCCL_LOSSY_IO_THREADS={v} is not a valid value: I/O helper threads per \
                 process, an integer from 0 to {MAX_IO_THREADS}"
            ))
        })?;
        let timeout = match text("NCCL_LOSSY_TIMEOUT")? {
            Some(v) => parse_timeout(&v)?,
            None => None,
        };
        let delayed_acks = match text("NCCL_LOSSY_DELAYED_ACKS")?.as_deref().map(str::trim) {
            None | Some("1") => true,
            Some("0") => false,
            Some(v) => {
                return Err(Error::invalid_argument(format!(
                    "NCCL_LOSSY_DELAYED_ACKS={} is not a valid value: 1 (delay TCP \
                     acknowledgements of messages under 64 KiB, the default) or 0 \
                     (acknowledge every segment at once)",
                    shown(v)
                )))
            }
        };
        let retries = ConnectRetries::read(&text)?;
        Ok(SocketConfig {
            timeout,
            delayed_acks,
            retries,
            ifname: text("NCCL_SOCKET_IFNAME")?,
            family,
            nsocks: nsocks.unwrap_or(DEFAULT_NSOCKS),
            speed_mbps,
            sockbuf,
        })
    }
}

struct Device {
    iface: IfaceAddr,
    props: DeviceProps,
}

/// The TCP transport: one device per chosen interface.
pub struct SocketTransport {
    devices: Vec<Device>,
    config: SocketConfig,
}

impl SocketTransport {
    /// Builds the transport from the environment (see the module documentation).
    pub fn from_env() -> Result<SocketTransport> {
        let transport = SocketTransport::new(SocketConfig::from_env()?)?;
        crate::log::info(&format!(
            "socket transport: {}",
            fds::budget(transport.config.nsocks, conn::io_threads())
        ));
        Ok(transport)
    }

    /// Builds the transport over this host's interfaces chosen by `config`.
    pub fn new(config: SocketConfig) -> Result<SocketTransport> {
        let addrs =
            iface::host_addrs().map_err(|e| fds::opening(e, "listing network interfaces"))?;
        SocketTransport::choosing_from(config, &addrs)
    }

    /// Builds the transport over the interfaces `config` chooses among `addrs` (as `new` does
    /// among the host's); an error, naming the settings and every address, when none qualifies.
    pub fn choosing_from(config: SocketConfig, addrs: &[IfaceAddr]) -> Result<SocketTransport> {
        let filter = config.ifname.as_deref().and_then(IfaceFilter::parse);
        let chosen = iface::select(addrs, filter.as_ref(), config.family, MAX_DEVICES);
        if chosen.is_empty() {
            // ncclInternalError, as NCCL's Socket plugin answers it ("no interface found",
            // `ncclNetSocketInit` in src/transport/net_socket.cc).
            return Err(Error::internal(iface::none_usable(
                addrs,
                config.ifname.as_deref(),
                config.family,
            )));
        }
        Ok(SocketTransport::with_interfaces(config, chosen))
    }

    /// Builds the transport over exactly these interface addresses, one device each.
    pub fn with_interfaces(config: SocketConfig, ifaces: Vec<IfaceAddr>) -> SocketTransport {
        let devices = ifaces
            .into_iter()
            .enumerate()
            .map(|(i, iface)| {
                let props = DeviceProps {
                    name: iface.name.clone(),
                    pci_path: iface::sysfs_device_path(&iface.name),
                    guid: i as u64,
                    speed_mbps: config
                        .speed_mbps
                        .or_else(|| iface::sysfs_speed_mbps(&iface.name))
                        .unwrap_or(DEFAULT_SPEED_MBPS),
                    port: 0,
                    latency_us: 0.0,
                    max_comms: MAX_COMMS,
                    max_recvs: ADVERTISED_MAX_RECVS,
                    max_p2p_bytes: wire::MAX_MESSAGE_BYTES as usize,
                    max_coll_bytes: wire::MAX_MESSAGE_BYTES as usize,
                    rail_id: -1,
                    plane_id: -1,
                };
                Device { iface, props }
            })
            .collect();
        SocketTransport { devices, config }
    }

    /// The settings in force.
    pub fn config(&self) -> &SocketConfig {
        &self.config
    }

    /// The address device `dev` listens on (port 0).
    pub fn device_addr(&self, dev: usize) -> Result<SocketAddr> {
        Ok(self.device(dev)?.iface.bind_addr())
    }

    fn device(&self, dev: usize) -> Result<&Device> {
        self.devices.get(dev).ok_or_else(|| {
            Error::invalid_argument(format!(
                "device {dev} does not exist ({} devices)",
                self.devices.len()
            ))
        })
    }

    /// Starts listening on `dev`; the concrete type, for callers that need its extras.
    pub fn listen_socket(&self, dev: usize, handle: &mut WireHandle) -> Result<SocketListener> {
        let bind = self.device(dev)?.iface.bind_addr();
        // The listen socket, and the sockets of a connection it accepts.
        fds::check(1 + self.config.nsocks, "listening")?;
        let setup = || -> std::io::Result<(Socket, SocketAddr)> {
            let sock = Socket::new(Domain::for_address(bind), Type::STREAM, Some(Protocol::TCP))?;
            if bind.is_ipv6() {
                sock.set_only_v6(true)?;
            }
            sock.set_nonblocking(true)?;
            if let Some(bytes) = self.config.sockbuf {
                // Accepted sockets inherit these, in time for the window scale in the SYN-ACK.
                sock.set_send_buffer_size(bytes)?;
                sock.set_recv_buffer_size(bytes)?;
            }
            sock.bind(&SockAddr::from(bind))?;
            sock.listen(libc::SOMAXCONN)?;
            let local = sock
                .local_addr()?
                .as_socket()
                .ok_or_else(|| std::io::Error::other("listener has no IP address"))?;
            Ok((sock, local))
        };
        let (sock, local) =
            setup().map_err(|e| fds::opening(e, format_args!("listening on {bind}")))?;
        let nonce = random_bytes::<16>()?;
        Handle { addr: local, nonce }.encode(handle);
        Ok(SocketListener::new(
            sock,
            nonce,
            self.config.timeout,
            self.config.delayed_acks,
        ))
    }

    /// Starts connecting to the listener of `handle`; the concrete type.
    pub fn connect_socket(&self, dev: usize, handle: &WireHandle) -> Result<SocketConnector> {
        self.device(dev)?;
        let h = Handle::decode(handle)?;
        let conn_id = u64::from_le_bytes(random_bytes::<8>()?);
        let count = self.config.nsocks.clamp(1, MAX_SOCKETS) as u16;
        // The I/O pool first (the first connection starts it): refused, nothing was opened,
        // and its descriptors count as in use in the check that follows.
        let pool = conn::Pool::shared()?;
        fds::check(usize::from(count), "connecting")?;
        let hellos: Vec<Hello> = (0..count)
            .map(|index| Hello {
                nonce: h.nonce,
                conn_id,
                index,
                count,
            })
            .collect();
        Ok(SocketConnector::new(
            h.addr,
            &hellos,
            self.config.sockbuf,
            self.config.timeout,
            self.config.retries,
            pool,
        ))
    }
}

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    OsRng
        .try_fill_bytes(&mut out)
        .map_err(|e| Error::system(format!("no randomness from the OS: {e}")))?;
    Ok(out)
}

impl Transport for SocketTransport {
    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn properties(&self, dev: usize) -> Result<DeviceProps> {
        Ok(self.device(dev)?.props.clone())
    }

    /// Our sockets carry no traffic class (NCCL's Socket transport ignores it too); loss
    /// rules still see it (docs/abi.md).
    fn listen(
        &self,
        dev: usize,
        _traffic_class: Option<i32>,
        handle: &mut WireHandle,
    ) -> Result<Box<dyn Listener>> {
        Ok(Box::new(self.listen_socket(dev, handle)?))
    }

    fn connect(
        &self,
        dev: usize,
        _traffic_class: Option<i32>,
        handle: &WireHandle,
    ) -> Result<Box<dyn Connector>> {
        Ok(Box::new(self.connect_socket(dev, handle)?))
    }
}
