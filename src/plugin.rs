//! The safe core behind every ABI version: the process-wide state, per-communicator
//! contexts, and the comms NCCL holds. The ABI adapters in [`crate::abi`] only translate
//! pointers and integer widths into calls on these types.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::control;
use crate::ids::{self, CollectiveId};
use crate::loss::engine::{ConnectionLoss, LossEngine, StreamKey};
use crate::loss::plan::{Effect, LossPlan};
use crate::loss::rules::{Direction, MatchContext};
use crate::profile::{Profile, TransportKind};
use crate::stats::periodic::PeriodicWriter;
use crate::stats::writer::{launcher_rank, StatsFile, STATS_DIR_ENV};
use crate::stats::{self, BurstTracker, ConnectionStats, MessageRecord};
use crate::transport::socket::SocketTransport;
use crate::transport::wrap::{WrapOptions, WrapTransport};
use crate::transport::{
    Completion, Connector, DeviceProps, HostBuf, Listener, MrHandle, RecvConn, RequestId, SendConn,
    Transport, WireHandle, MAX_REQUESTS,
};
use crate::{log, Error, Result};

/// The name NCCL matches against `NCCL_NET`.
pub const PLUGIN_NAME: &str = "lossy";

/// Process-wide state: the transport, what it reported about its devices, and the loss
/// engine built from the profile.
pub struct Core {
    transport: Box<dyn Transport>,
    devices: Vec<DeviceProps>,
    profile: Arc<Profile>,
    engine: LossEngine,
    profile_json: serde_json::Value,
    corrupts_data: bool,
    stats_interval: Option<Duration>,
    rank: Option<u32>,
}

static CORE: OnceLock<std::result::Result<Core, Error>> = OnceLock::new();

impl Core {
    /// Builds the core over `transport` with `profile`, reading every device's properties once.
    pub fn new(transport: Box<dyn Transport>, profile: Profile) -> Result<Core> {
        let devices = (0..transport.device_count())
            .map(|dev| transport.properties(dev))
            .collect::<Result<Vec<_>>>()?;
        if devices.is_empty() {
            return Err(Error::system("no usable network interface found"));
        }
        let profile = Arc::new(profile);
        Ok(Core {
            transport,
            devices,
            profile_json: profile_with_expectation(&profile),
            corrupts_data: profile.corrupts_data(),
            stats_interval: profile.stats_interval,
            engine: profile.loss_engine(),
            profile,
            rank: launcher_rank().and_then(|rank| u32::try_from(rank).ok()),
        })
    }

    /// Builds the core from the environment: the profile (`NCCL_LOSSY_PROFILE`,
    /// `NCCL_LOSSY_SET`), the protocol the user forces, the transport's interfaces.
    pub fn from_env() -> Result<Core> {
        if control::inner_mode() {
            // Wrapped inside another copy of this library: carry bytes, nothing else. The
            // environment's profile and NCCL_LOSSY_INNER belong to the outer copy.
            let profile =
                Profile::parse(INNER_PROFILE, "inner mode (wrapped by another copy)", "")?;
            let mut core = Core::new(Box::new(SocketTransport::from_env()?), profile)?;
            core.rank = None;
            return Ok(core);
        }
        let mut profile = Profile::from_env()?;
        check_forced_protocol(&profile, std::env::var("NCCL_PROTO").ok().as_deref())?;
        let inner_env = std::env::var(INNER_ENV)
            .ok()
            .filter(|v| !v.trim().is_empty());
        let transport: Box<dyn Transport> = match wrap_target(&profile, inner_env)? {
            None => Box::new(SocketTransport::from_env()?),
            Some(inner) => {
                // Statistics files and the init log say which transport really ran.
                profile.transport = Some(TransportKind::Wrap);
                profile.inner = Some(inner.clone());
                let options = WrapOptions {
                    keep_stale_copy: profile.uses_effect(Effect::Stale),
                    ..WrapOptions::default()
                };
                Box::new(
                    WrapTransport::open(&inner, crate::abi::nccl_logger(), options)
                        .map_err(|e| e.context(format!("wrap mode (inner {inner:?})")))?,
                )
            }
        };
        Core::new(transport, profile)
    }

    /// The process-wide core, built on first use; a failure is remembered and returned on
    /// every later call so that each NCCL init attempt reports it.
    pub fn global() -> Result<&'static Core> {
        CORE.get_or_init(|| {
            let core = Core::from_env();
            match &core {
                Ok(core) => log::info(&format!(
                    "initialised with {} device(s): {}; profile: {}",
                    core.devices.len(),
                    core.devices
                        .iter()
                        .map(|d| d.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    core.profile().summary()
                )),
                Err(err) => log::loud(&format!("initialisation failed: {err}")),
            }
            core
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// The active loss profile.
    pub fn profile(&self) -> &Profile {
        &self.profile
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

    /// This process's rank as the launcher numbered it, when it did.
    pub fn rank(&self) -> Option<u32> {
        self.rank
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
            stats_interval: self.stats_interval,
        })
    }

    /// Starts connecting `ctx` to the listener described by `handle`, which belongs to the
    /// process of rank `peer` when the handle said so.
    pub fn connect(
        &self,
        ctx: &Arc<Context>,
        dev: usize,
        handle: &WireHandle,
        peer: Option<u32>,
    ) -> Result<Connecting> {
        self.properties(dev)?;
        let connector = self.transport.connect(dev, handle)?;
        // Numbered when NCCL asks, which happens in the same order in every run, so each
        // connection keeps its own reproducible loss stream.
        let index = ctx.next_connection_index();
        let loss = self.engine.stream(StreamKey {
            rank: self.rank.unwrap_or(0),
            comm_id: ctx.comm_id,
            peer: peer.unwrap_or(u32::MAX),
            direction: Direction::Send,
            conn: index,
        });
        Ok(Connecting {
            ctx: Arc::clone(ctx),
            connector,
            loss: Some(loss),
            peer,
            local_rank: self.rank,
            index,
            stats_interval: self.stats_interval,
        })
    }
}

/// Environment variable naming the net plugin to wrap; overrides the profile's `inner`.
pub const INNER_ENV: &str = "NCCL_LOSSY_INNER";

/// The profile of a copy running as another copy's inner plugin: nothing is ever lost.
const INNER_PROFILE: &str = "model = { kind = \"none\" }\n";

/// The plugin to wrap, if any: `NCCL_LOSSY_INNER` (`inner_env`) wins over the profile's
/// `inner`; `transport = "wrap"` without either, or `transport = "socket"` with
/// `NCCL_LOSSY_INNER`, is an error.
pub fn wrap_target(profile: &Profile, inner_env: Option<String>) -> Result<Option<String>> {
    match (profile.transport, inner_env) {
        (Some(TransportKind::Socket), Some(inner)) => Err(Error::invalid_argument(format!(
            "{INNER_ENV}={inner} asks to wrap a net plugin, but the profile ({}) says \
             transport = \"socket\"; unset one of them",
            profile.origin
        ))),
        (_, Some(inner)) => Ok(Some(inner)),
        (Some(TransportKind::Wrap), None) => match &profile.inner {
            Some(inner) => Ok(Some(inner.clone())),
            None => Err(Error::invalid_argument(format!(
                "the profile ({}) says transport = \"wrap\" but names no plugin to wrap: set \
                 `inner` in the profile or {INNER_ENV} (a path, or a name like \"ib\")",
                profile.origin
            ))),
        },
        _ => Ok(None),
    }
}

/// The resolved profile as JSON, with the closed-form loss rate and mean burst length of its
/// first lossy model (the defaults', else the first rule's) under `expected`, which
/// `lossy report` draws the measured bursts against.
fn profile_with_expectation(profile: &Profile) -> serde_json::Value {
    let mut json = profile.to_json();
    let lossy = profile
        .actions()
        .map(|action| &action.model)
        .find(|model| model.expected_loss_rate() > 0.0);
    if let (Some(model), Some(object)) = (lossy, json.as_object_mut()) {
        object.insert(
            "expected".into(),
            serde_json::json!({
                "loss_rate": model.expected_loss_rate(),
                "mean_burst": model.expected_mean_burst(),
            }),
        );
    }
    json
}

/// Fails when the user forces LL or LL128 through `NCCL_PROTO` while the profile corrupts
/// data: those protocols carry flags in the payload, and a lost flag hangs the receiving GPU.
pub fn check_forced_protocol(profile: &Profile, nccl_proto: Option<&str>) -> Result<()> {
    let Some(forced) = nccl_proto.and_then(forced_ll_protocol) else {
        return Ok(());
    };
    if !profile.corrupts_data() {
        return Ok(());
    }
    Err(Error::invalid_usage(format!(
        "NCCL_PROTO={} allows {forced}, but the loss profile ({}) has a data-loss effect \
         (zero, stale or bitflip): LL and LL128 carry flags inside the payload and a lost \
         packet would hang the receiving GPU. Use NCCL_PROTO=Simple (or unset it: this \
         library's tuner then rules LL/LL128 out), or the `retransmit` effect",
        nccl_proto.unwrap_or_default(),
        profile.origin
    )))
}

/// The LL-family protocol an `NCCL_PROTO` value explicitly allows, if any. A value starting
/// with `^` lists protocols to exclude, which forces nothing.
pub fn forced_ll_protocol(nccl_proto: &str) -> Option<&'static str> {
    let value = nccl_proto.trim();
    if value.is_empty() || value.starts_with('^') {
        return None;
    }
    let names: Vec<String> = value
        .split(',')
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    if names.iter().any(|n| n == "ll128") {
        Some("LL128")
    } else if names.iter().any(|n| n == "ll") {
        Some("LL")
    } else {
        None
    }
}

/// Communicator sizes reported by this library's tuner (which NCCL initialises per
/// communicator with its rank count), so rules can match on `comm_size`.
fn comm_sizes() -> &'static Mutex<HashMap<u64, u32>> {
    static SIZES: OnceLock<Mutex<HashMap<u64, u32>>> = OnceLock::new();
    SIZES.get_or_init(Mutex::default)
}

/// Records the size of communicator `comm_id` (called by the tuner's init).
pub fn record_comm_size(comm_id: u64, ranks: usize) {
    if let (Ok(mut sizes), Ok(ranks)) = (comm_sizes().lock(), u32::try_from(ranks)) {
        sizes.insert(comm_id, ranks);
    }
}

/// The size of communicator `comm_id`, when the tuner reported it.
pub fn comm_size(comm_id: u64) -> Option<u32> {
    comm_sizes().lock().ok()?.get(&comm_id).copied()
}

/// Warns once, for NCCL with net API v8 to v10 (no per-communicator context, no
/// `setNetAttr`), that rules matching on a collective will only ever see `Unknown`.
pub fn note_legacy_api() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let Ok(core) = Core::global() else {
        return;
    };
    if core.profile().matches_on_collective() {
        WARNED.call_once(|| {
            log::warn(
                "this NCCL speaks net API v8 to v10, which does not say which collective is \
                 posted: rules that match on `collective` see `Unknown` and will not match \
                 (net API v11, NCCL 2.28 or newer, is needed)",
            )
        });
    }
}

/// Open send and receive comms, and the statistics writer that runs while any is open.
struct LiveComms {
    open: usize,
    writer: Option<PeriodicWriter>,
}

static LIVE: Mutex<LiveComms> = Mutex::new(LiveComms {
    open: 0,
    writer: None,
});

/// Counts a comm opening; starts the periodic statistics writer with the first one.
fn comm_opened(stats_interval: Option<Duration>) {
    let Ok(mut live) = LIVE.lock() else {
        return;
    };
    live.open += 1;
    if live.writer.is_some() || stats_dir().is_none() {
        return;
    }
    if let Some(interval) = stats_interval {
        match PeriodicWriter::start(interval, || {
            if let Err(err) = write_stats() {
                log::warn(&format!("statistics not written: {err}"));
            }
        }) {
            Ok(writer) => live.writer = Some(writer),
            Err(err) => log::warn(&format!("no periodic statistics writer: {err}")),
        }
    }
}

/// Counts a comm closing; the last one stops (joins) the periodic writer, because NCCL may
/// unload the library next.
fn comm_closed() {
    let writer = match LIVE.lock() {
        Ok(mut live) => {
            live.open = live.open.saturating_sub(1);
            if live.open == 0 {
                live.writer.take()
            } else {
                None
            }
        }
        Err(_) => None,
    };
    if let Some(writer) = writer {
        writer.stop();
    }
}

/// Stops the periodic writer whatever comms remain (NCCL's `finalize`).
pub fn stop_periodic_writer() {
    let writer = LIVE.lock().ok().and_then(|mut live| live.writer.take());
    if let Some(writer) = writer {
        writer.stop();
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
    stats_interval: Option<Duration>,
}

impl ListenComm {
    /// Advances pending handshakes; `Ok(None)` until a peer has fully connected.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        let Some(conn) = self.listener.poll_accept()? else {
            return Ok(None);
        };
        comm_opened(self.stats_interval);
        Ok(Some(RecvComm {
            _ctx: Arc::clone(&self.ctx),
            conn,
        }))
    }
}

/// A connection being established (kept in the ABI handle between `connect` calls).
pub struct Connecting {
    ctx: Arc<Context>,
    connector: Box<dyn Connector>,
    loss: Option<ConnectionLoss>,
    peer: Option<u32>,
    local_rank: Option<u32>,
    index: u32,
    stats_interval: Option<Duration>,
}

impl Connecting {
    /// Advances the connection; `Ok(None)` until it is ready.
    pub fn poll(&mut self) -> Result<Option<SendComm>> {
        let Some(conn) = self.connector.poll()? else {
            return Ok(None);
        };
        let loss = self
            .loss
            .take()
            .ok_or_else(|| Error::internal("connect polled again after it finished"))?;
        let stats = Arc::new(ConnectionStats::new(self.ctx.comm_id, self.index));
        stats::registry().register(Arc::clone(&stats));
        comm_opened(self.stats_interval);
        Ok(Some(SendComm {
            ctx: Arc::clone(&self.ctx),
            conn,
            stats,
            peer: self.peer,
            local_rank: self.local_rank,
            comm_size: comm_size(self.ctx.comm_id),
            sender: Mutex::new(SenderState::new(loss)),
        }))
    }
}

/// Loss decisions of one sending connection. Guarded by a mutex that only NCCL's progress
/// thread takes, so it is never contended.
struct SenderState {
    loss: ConnectionLoss,
    plan: LossPlan,
    /// Length of the message `plan` was made for, while the transport had no free slot for
    /// it: NCCL posts the same message again, and it must get the same plan rather than
    /// advance the loss chain twice.
    pending_len: Option<usize>,
    bursts: BurstTracker,
    /// When each request slot was posted, for the latency histogram.
    posted_at: [Option<(Instant, usize)>; MAX_REQUESTS],
}

impl SenderState {
    fn new(loss: ConnectionLoss) -> Self {
        SenderState {
            loss,
            plan: LossPlan::lossless(),
            pending_len: None,
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
    peer: Option<u32>,
    local_rank: Option<u32>,
    comm_size: Option<u32>,
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
        let mut guard = self.state()?;
        let state = &mut *guard;
        // One read of the op serves both the statistics slot and rule matching.
        let op = ids::op_slot(self.ctx.op());
        let phase = control::phase();
        let step = control::step();
        if state.pending_len != Some(buf.len()) {
            if control::enabled() {
                let matching = MatchContext {
                    collective: CollectiveId::from_op_slot(op),
                    traffic_class: self.ctx.traffic_class,
                    comm_size: self.comm_size,
                    direction: Direction::Send,
                    peer: self.peer,
                    local_rank: self.local_rank,
                    phase,
                    step,
                };
                state.loss.plan(&matching, buf.len(), &mut state.plan);
            } else {
                state.plan.lost.clear();
            }
        }
        let Some(id) = self.conn.isend(buf, tag, &state.plan)? else {
            state.pending_len = Some(buf.len());
            return Ok(None);
        };
        state.pending_len = None;
        let plan = &state.plan;
        let packets = plan.packets_in(buf.len());
        let lost_packets = plan.lost_packets();
        let retransmit_delay_ns = if plan.effect == Effect::Retransmit {
            plan.retransmit_timeout.as_nanos() as u64 * plan.loss_events()
        } else {
            0
        };
        self.stats.record_message(&MessageRecord {
            op,
            phase: phase as usize,
            bytes: buf.len() as u64,
            packets,
            lost_packets,
            loss_events: plan.loss_events(),
            retransmit_delay_ns,
        });
        stats::record_step(step, packets, lost_packets);
        let runs = plan.lost.iter().map(|r| (r.start, r.len));
        state.bursts.observe(op, packets, runs, |op, len| {
            self.stats.record_burst(op, len)
        });
        if let Some(slot) = state.posted_at.get_mut(id as usize) {
            *slot = Some((Instant::now(), op));
        }
        Ok(Some(id))
    }

    /// Registers host memory for later sends (NCCL's `regMr`).
    pub fn register(&self, buf: HostBuf) -> Result<MrHandle> {
        self.conn.register(buf)
    }

    /// Releases a registration made by [`SendComm::register`].
    pub fn deregister(&self, mr: MrHandle) -> Result<()> {
        self.conn.deregister(mr)
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
        stats::registry().close(&self.stats);
        comm_closed();
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

fn stats_dir() -> Option<std::ffi::OsString> {
    if control::inner_mode() {
        // The outer copy writes this rank's statistics; a second file would clobber them.
        return None;
    }
    std::env::var_os(STATS_DIR_ENV).filter(|dir| !dir.is_empty())
}

/// Writes the statistics file into `NCCL_LOSSY_STATS`; `Ok(None)` when it is not set.
pub fn write_stats() -> Result<Option<PathBuf>> {
    match stats_dir() {
        Some(dir) => stats_file().write_to(std::path::Path::new(&dir)).map(Some),
        None => Ok(None),
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

    /// Registers host memory for later receives (NCCL's `regMr`).
    pub fn register(&self, buf: HostBuf) -> Result<MrHandle> {
        self.conn.register(buf)
    }

    /// Releases a registration made by [`RecvComm::register`].
    pub fn deregister(&self, mr: MrHandle) -> Result<()> {
        self.conn.deregister(mr)
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        comm_closed();
    }
}

/// True when the active profile has a data-corrupting effect, so LL/LL128 must be ruled out.
pub fn protocol_guard_needed() -> Result<bool> {
    let core = Core::global()?;
    Ok(core.corrupts_data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_proto_values_that_force_an_ll_protocol() {
        assert_eq!(forced_ll_protocol("LL"), Some("LL"));
        assert_eq!(forced_ll_protocol("simple,ll128"), Some("LL128"));
        assert_eq!(forced_ll_protocol(" LL , Simple"), Some("LL"));
        assert_eq!(forced_ll_protocol("Simple"), None);
        assert_eq!(forced_ll_protocol("^LL,LL128"), None);
        assert_eq!(forced_ll_protocol("^LL128"), None);
        assert_eq!(forced_ll_protocol(""), None);
    }

    #[test]
    fn the_plugin_to_wrap_comes_from_the_environment_or_the_profile() {
        let p = |text: &str| Profile::parse(text, "p.toml", "").unwrap();
        let none = p("");
        assert_eq!(wrap_target(&none, None), Ok(None));
        assert_eq!(wrap_target(&none, Some("ib".into())), Ok(Some("ib".into())));
        let wrap = p("transport = \"wrap\"\ninner = \"ib\"\n");
        assert_eq!(wrap_target(&wrap, None), Ok(Some("ib".into())));
        assert_eq!(
            wrap_target(&wrap, Some("/x/ofi.so".into())),
            Ok(Some("/x/ofi.so".into()))
        );
        let bare = p("transport = \"wrap\"\n");
        let err = wrap_target(&bare, None).unwrap_err();
        assert!(err.message.contains("names no plugin to wrap") && err.message.contains("p.toml"));
        let socket = p("transport = \"socket\"\n");
        assert_eq!(wrap_target(&socket, None), Ok(None));
        let err = wrap_target(&socket, Some("ib".into())).unwrap_err();
        assert!(err.message.contains("NCCL_LOSSY_INNER=ib"), "{err}");
    }
}
