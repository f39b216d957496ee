//! The safe core behind every ABI version: the process-wide state, per-communicator
//! contexts, and the comms NCCL holds. The ABI adapters in [`crate::abi`] only translate
//! pointers and integer widths into calls on these types.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use crate::control;
use crate::loss::plan::{Effect, LossPlan};
use crate::stats::writer::{StatsFile, STATS_DIR_ENV};
use crate::stats::{self, BurstTracker, ConnectionStats, MessageRecord};
use crate::transport::socket::SocketTransport;
use crate::transport::{
    Completion, Connector, DeviceProps, HostBuf, Listener, RecvConn, RequestId, SendConn,
    Transport, WireHandle, MAX_REQUESTS,
};
use crate::{log, Error, Result};

/// The name NCCL matches against `NCCL_NET`.
pub const PLUGIN_NAME: &str = "lossy";

/// Process-wide state: the transport and what it reported about its devices.
pub struct Core {
    transport: Box<dyn Transport>,
    devices: Vec<DeviceProps>,
    profile_json: serde_json::Value,
    corrupts_data: bool,
}

static CORE: OnceLock<std::result::Result<Core, Error>> = OnceLock::new();

impl Core {
    /// Builds the core over `transport`, reading every device's properties once.
    pub fn new(transport: Box<dyn Transport>) -> Result<Core> {
        let devices = (0..transport.device_count())
            .map(|dev| transport.properties(dev))
            .collect::<Result<Vec<_>>>()?;
        if devices.is_empty() {
            return Err(Error::system("no usable network interface found"));
        }
        Ok(Core {
            transport,
            devices,
            profile_json: serde_json::Value::Null,
            corrupts_data: false,
        })
    }

    /// Builds the core from the environment (transport choice, interfaces, profile).
    pub fn from_env() -> Result<Core> {
        let transport = SocketTransport::from_env()?;
        Core::new(Box::new(transport))
    }

    /// The process-wide core, built on first use; a failure is remembered and returned on
    /// every later call so that each NCCL init attempt reports it.
    pub fn global() -> Result<&'static Core> {
        CORE.get_or_init(|| {
            let core = Core::from_env();
            match &core {
                Ok(core) => log::info(&format!(
                    "initialised with {} device(s): {}",
                    core.devices.len(),
                    core.devices
                        .iter()
                        .map(|d| d.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                Err(err) => log::loud(&format!("initialisation failed: {err}")),
            }
            core
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// Number of devices NCCL may use.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Properties of device `dev`.
    pub fn properties(&self, dev: usize) -> Result<&DeviceProps> {
        self.devices.get(dev).ok_or_else(|| {
            Error::invalid_argument(format!("no device {dev} (have {})", self.devices.len()))
        })
    }

    /// Starts listening on `dev` for `ctx`.
    pub fn listen(
        &self,
        ctx: &Arc<Context>,
        dev: usize,
        handle: &mut WireHandle,
    ) -> Result<ListenComm> {
        self.properties(dev)?;
        let listener = self.transport.listen(dev, handle)?;
        Ok(ListenComm {
            ctx: Arc::clone(ctx),
            listener,
        })
    }

    /// Starts connecting `ctx` to the listener described by `handle`.
    pub fn connect(
        &self,
        ctx: &Arc<Context>,
        dev: usize,
        handle: &WireHandle,
    ) -> Result<Connecting> {
        self.properties(dev)?;
        let connector = self.transport.connect(dev, handle)?;
        Ok(Connecting {
            ctx: Arc::clone(ctx),
            connector,
        })
    }
}

/// Collective operation being posted, as NCCL's `setNetAttr` reports it (0: not reported).
pub type OpCode = u32;

/// One NCCL communicator's view of the plugin (net v11+), or the single implicit context
/// older versions share.
#[derive(Debug)]
pub struct Context {
    /// NCCL's id of the communicator (0 for the implicit context).
    pub comm_id: u64,
    /// Traffic class from the communicator's config, when NCCL gave one.
    pub traffic_class: Option<i32>,
    op: AtomicU32,
    algo: AtomicU32,
    proto: AtomicU32,
    connections: AtomicU32,
}

static IMPLICIT_CONTEXT: OnceLock<Arc<Context>> = OnceLock::new();

impl Context {
    /// A context for communicator `comm_id`.
    pub fn new(comm_id: u64, traffic_class: Option<i32>) -> Arc<Context> {
        Arc::new(Context {
            comm_id,
            traffic_class,
            op: AtomicU32::new(0),
            algo: AtomicU32::new(0),
            proto: AtomicU32::new(0),
            connections: AtomicU32::new(0),
        })
    }

    /// The context shared by every communicator under net v8 to v10.
    pub fn implicit() -> Arc<Context> {
        Arc::clone(IMPLICIT_CONTEXT.get_or_init(|| Context::new(0, None)))
    }

    /// Records the collective, algorithm and protocol NCCL is about to post.
    pub fn set_attributes(&self, op: OpCode, algo: u32, proto: u32) {
        self.op.store(op, Ordering::Relaxed);
        self.algo.store(algo, Ordering::Relaxed);
        self.proto.store(proto, Ordering::Relaxed);
    }

    /// The collective NCCL last said it is posting (0 when never told).
    pub fn op(&self) -> OpCode {
        self.op.load(Ordering::Relaxed)
    }

    /// Numbers this context's connections in the order they were opened, which NCCL keeps
    /// the same from run to run, so each gets its own reproducible loss stream.
    fn next_connection_index(&self) -> u32 {
        self.connections.fetch_add(1, Ordering::Relaxed)
    }
}

/// A listening endpoint (NCCL's `listenComm`).
pub struct ListenComm {
    ctx: Arc<Context>,
    listener: Box<dyn Listener>,
}

impl ListenComm {
    /// Advances pending handshakes; `Ok(None)` until a peer has fully connected.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        Ok(self.listener.poll_accept()?.map(|conn| RecvComm {
            _ctx: Arc::clone(&self.ctx),
            conn,
        }))
    }
}

/// A connection being established (kept in the ABI handle between `connect` calls).
pub struct Connecting {
    ctx: Arc<Context>,
    connector: Box<dyn Connector>,
}

impl Connecting {
    /// Advances the connection; `Ok(None)` until it is ready.
    pub fn poll(&mut self) -> Result<Option<SendComm>> {
        let Some(conn) = self.connector.poll()? else {
            return Ok(None);
        };
        let index = self.ctx.next_connection_index();
        let stats = Arc::new(ConnectionStats::new(self.ctx.comm_id, index));
        stats::registry().register(Arc::clone(&stats));
        Ok(Some(SendComm {
            ctx: Arc::clone(&self.ctx),
            conn,
            stats,
            sender: Mutex::new(SenderState::default()),
        }))
    }
}

/// Loss decisions of one sending connection. Guarded by a mutex that only NCCL's progress
/// thread takes, so it is never contended.
struct SenderState {
    plan: LossPlan,
    bursts: BurstTracker,
    /// When each request slot was posted, for the latency histogram.
    posted_at: [Option<(Instant, usize)>; MAX_REQUESTS],
}

impl Default for SenderState {
    fn default() -> Self {
        SenderState {
            plan: LossPlan::lossless(),
            bursts: BurstTracker::default(),
            posted_at: [None; MAX_REQUESTS],
        }
    }
}

/// The sending half of a connection (NCCL's `sendComm`).
pub struct SendComm {
    ctx: Arc<Context>,
    conn: Box<dyn SendConn>,
    stats: Arc<ConnectionStats>,
    sender: Mutex<SenderState>,
}

impl SendComm {
    fn state(&self) -> Result<std::sync::MutexGuard<'_, SenderState>> {
        self.sender
            .lock()
            .map_err(|_| Error::internal("sender state poisoned by an earlier panic"))
    }

    /// Queues `buf` for sending; `Ok(None)` asks NCCL to retry later.
    pub fn isend(&self, buf: HostBuf, tag: i32) -> Result<Option<RequestId>> {
        let mut state = self.state()?;
        let op = stats::op_slot(self.ctx.op());
        let phase = control::phase() as usize;
        let Some(id) = self.conn.isend(buf, tag, &state.plan)? else {
            return Ok(None);
        };
        let SenderState { plan, bursts, .. } = &mut *state;
        let packets = plan.packets_in(buf.len());
        let retransmit_delay_ns = if plan.effect == Effect::Retransmit {
            plan.retransmit_timeout.as_nanos() as u64 * plan.loss_events()
        } else {
            0
        };
        self.stats.record_message(&MessageRecord {
            op,
            phase,
            bytes: buf.len() as u64,
            packets,
            lost_packets: plan.lost_packets(),
            loss_events: plan.loss_events(),
            retransmit_delay_ns,
        });
        bursts.observe(op, packets, &plan.lost, |op, len| {
            self.stats.record_burst(op, len)
        });
        if let Some(slot) = state.posted_at.get_mut(id as usize) {
            *slot = Some((Instant::now(), op));
        }
        Ok(Some(id))
    }

    /// Reports whether request `id` is done.
    pub fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        let done = self.conn.test(id)?;
        if done.is_some() {
            let mut state = self.state()?;
            if let Some(posted) = state.posted_at.get_mut(id as usize).and_then(Option::take) {
                let ns = posted.0.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
                self.stats.record_latency_ns(posted.1, ns);
            }
        }
        Ok(done)
    }
}

impl Drop for SendComm {
    fn drop(&mut self) {
        if let Ok(mut state) = self.sender.lock() {
            state
                .bursts
                .finish(|op, len| self.stats.record_burst(op, len));
        }
        // Each closed connection refreshes the file, so a run that ends without finalize
        // (NCCL v8-v10 have none) still leaves its statistics behind.
        if let Err(err) = write_stats() {
            log::warn(&format!("statistics not written: {err}"));
        }
    }
}

/// This process's statistics, with the profile that produced them.
pub fn stats_file() -> StatsFile {
    let profile = CORE
        .get()
        .and_then(|core| core.as_ref().ok())
        .map_or(serde_json::Value::Null, |core| core.profile_json.clone());
    StatsFile::new(profile, stats::registry().snapshot())
}

/// Writes the statistics file into `NCCL_LOSSY_STATS`; `Ok(None)` when it is not set.
pub fn write_stats() -> Result<Option<PathBuf>> {
    match std::env::var_os(STATS_DIR_ENV) {
        Some(dir) if !dir.is_empty() => stats_file().write_to(std::path::Path::new(&dir)).map(Some),
        _ => Ok(None),
    }
}

/// The receiving half of a connection (NCCL's `recvComm`).
pub struct RecvComm {
    _ctx: Arc<Context>,
    conn: Box<dyn RecvConn>,
}

impl RecvComm {
    /// Posts a (possibly grouped) receive; `Ok(None)` asks NCCL to retry later.
    pub fn irecv(&self, bufs: &[HostBuf], tags: &[i32]) -> Result<Option<RequestId>> {
        if bufs.len() != tags.len() || bufs.is_empty() {
            return Err(Error::invalid_argument(format!(
                "irecv with {} buffers and {} tags",
                bufs.len(),
                tags.len()
            )));
        }
        self.conn.irecv(bufs, tags)
    }

    /// Reports whether request `id` is done and the size each buffer got.
    pub fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        self.conn.test(id)
    }
}

/// True when the active profile has a data-corrupting effect, so LL/LL128 must be ruled out.
/// Fails (loudly, at init) when the user also forces LL or LL128 through `NCCL_PROTO`.
pub fn protocol_guard_needed() -> Result<bool> {
    let core = Core::global()?;
    Ok(core.corrupts_data)
}
