//! The runtime behind every ABI version: the transport, its devices and the loss engine built
//! from the profile, owned by NCCL's `init`/`finalize` calls. The ABI adapters in
//! [`crate::abi`] only translate pointers and integer widths into calls on these types.
//!
//! Lifetime, as aws-ofi-nccl counts it: the first `init` builds the [`Runtime`]; every v11+
//! `init` (one per communicator, and each tuner `init`) holds it until its `finalize`; the last
//! `finalize` releases it: the periodic statistics writer stops, the statistics file is
//! written, and once the last comm that still uses it is closed its transport goes (sockets
//! closed, I/O threads joined, a wrapped plugin unloaded). Net v8 to v10 have no `finalize`:
//! their `init` holds the runtime until the library is unloaded (a `.fini_array` destructor).
//! A failed build is not remembered: the next `init` tries again, so a user can fix the
//! profile and initialise again in the same process. A child forked after `init` releases
//! nothing when it exits: the runtime, its threads and its numbers are the parent's.
//!
//! What stays process-wide, and why:
//! - the slot below that holds the runtime: `devices` and `getProperties` carry no context,
//!   and net v8 to v10 carry none anywhere, so the ABI must find the runtime without one;
//! - the run-time switches ([`crate::switches`]): the Python API and the training script set
//!   them through the control API with no context, before or between inits;
//! - the log sink ([`crate::log`]): any thread logs, with no context;
//! - the statistics registry and per-step series ([`crate::stats`]) and the profile they were
//!   produced under: the statistics file is per process (its name carries the pid), so a
//!   runtime rebuilt in the same process adds to the same numbers, and the control API can
//!   read them after the last `finalize`;
//! - the device names handed to NCCL ([`crate::abi`]): NCCL keeps the `char*` of
//!   `getProperties` with no call telling when it lets go; they are interned, one per name;
//! - the socket transport's I/O thread pool: its thread budget is per process, whatever the
//!   number of runtimes and comms; the comms hold it, and the last to close stops it.

mod comms;
mod context;
mod environment;
mod net_profiler;
mod output;

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use comms::{Connecting, ListenComm, RecvComm, SendComm};
pub use context::{Context, PendingKey};
pub use environment::{
    check_forced_protocol, check_p2p_ll, unguarded_ll_warning, unknown_comm_size_warning,
    unknown_rank_warning, wrap_target, P2pLlSettings, INNER_ENV, INTRA_NODE_THROUGH_NET,
};
pub use net_profiler::{MessageProfiler, MessageReport, ProfilerEvent, ProfilerParent};
pub use output::{
    check_output_dirs_in_place, check_stats_dir, stats_file, trace_capacity, trace_setting,
    unused_stats_interval_warning, write_stats, write_trace, TraceSetting,
};

use crate::ffi::{ncclDebugLogger_t, ncclNetAttr_v11_t};
use crate::loss::engine::{LossEngine, StreamKey};
use crate::loss::plan::Effect;
use crate::loss::rules::Direction;
use crate::profile::{Profile, TransportKind};
use crate::stats::writer::launcher_rank;
use crate::switches;
use crate::transport::socket::SocketTransport;
use crate::transport::wrap::{WrapOptions, WrapTransport};
use crate::transport::{DeviceProps, Transport, WireHandle};
use crate::{env, log, Error, Result};

/// The name NCCL matches against `NCCL_NET`.
pub const PLUGIN_NAME: &str = "lossy";

/// The file name NCCL opens for `NCCL_NET_PLUGIN=lossy`.
pub const NCCL_LIBRARY_NAME: &str = "libnccl-net-lossy.so";

/// Cargo's file name for the library.
pub const CARGO_LIBRARY_NAME: &str = "libnccl_net_lossy.so";

/// The profile of a copy running as another copy's inner plugin: nothing is ever lost.
const INNER_PROFILE: &str = "model = { kind = \"none\" }\n";

/// What one build of the plugin owns: the transport, what it reported about its devices, the
/// loss engine built from the profile, and the comms' shared state.
pub struct Runtime {
    devices: Vec<DeviceProps>,
    engine: LossEngine,
    profile: Arc<Profile>,
    profile_json: Arc<serde_json::Value>,
    corrupts_data: bool,
    stats_interval: Option<Duration>,
    rank: Option<u32>,
    /// Communicator sizes this library's tuner reported (NCCL initialises it per
    /// communicator with its rank count), so rules can match on `comm_size`.
    comm_sizes: Mutex<HashMap<u64, u32>>,
    /// Open comms and the statistics writer that runs while any is open.
    live: Mutex<output::LiveComms>,
    legacy_warned: AtomicBool,
    /// Contexts numbered so far (see [`Runtime::number_context`]).
    contexts: AtomicU64,
    /// Last, so that everything above (and every comm, which holds the runtime) is gone
    /// before the transport.
    transport: Box<dyn Transport>,
}

impl Runtime {
    /// Builds a runtime over `transport` with `profile`, reading every device's properties
    /// once.
    pub fn new(transport: Box<dyn Transport>, profile: Profile) -> Result<Runtime> {
        let devices = (0..transport.device_count())
            .map(|dev| transport.properties(dev))
            .collect::<Result<Vec<_>>>()?;
        if devices.is_empty() {
            // As NCCL's Socket plugin answers it (`ncclNetSocketInit`, ncclInternalError).
            return Err(Error::internal("no usable network interface found"));
        }
        let profile = Arc::new(profile);
        Ok(Runtime {
            devices,
            profile_json: Arc::new(environment::profile_with_expectation(&profile)),
            corrupts_data: profile.corrupts_data(),
            stats_interval: profile.stats_interval,
            engine: profile.loss_engine(),
            profile,
            rank: launcher_rank().and_then(|rank| u32::try_from(rank).ok()),
            comm_sizes: Mutex::default(),
            live: Mutex::default(),
            legacy_warned: AtomicBool::new(false),
            contexts: AtomicU64::new(0),
            transport,
        })
    }

    /// Builds a runtime from the environment: the profile (`NCCL_LOSSY_PROFILE`,
    /// `NCCL_LOSSY_SET`), the protocol the user forces, the transport's interfaces; a wrapped
    /// plugin gets NCCL's `logger`.
    pub fn from_env(logger: ncclDebugLogger_t) -> Result<Runtime> {
        if switches::inner_mode() {
            // Wrapped inside another copy of this library: carry bytes, nothing else. The
            // environment's profile and NCCL_LOSSY_INNER belong to the outer copy.
            let profile =
                Profile::parse(INNER_PROFILE, "inner mode (wrapped by another copy)", "")?;
            let mut runtime = Runtime::new(Box::new(SocketTransport::from_env()?), profile)?;
            runtime.rank = None;
            return Ok(runtime);
        }
        for warning in env::unknown_var_warnings() {
            log::loud(&warning);
        }
        let mut profile = Profile::from_env()?;
        output::settle_stats_dir()?;
        let trace_dir = env::var(crate::stats::timeline::TRACE_DIR_ENV)?;
        output::start_trace(
            &profile,
            trace_dir.clone(),
            env::var(crate::stats::timeline::TRACE_EVENTS_ENV)?,
        )?;
        let stats_dir = std::env::var_os(crate::stats::writer::STATS_DIR_ENV);
        if let Some(warning) = unused_stats_interval_warning(&profile, stats_dir, trace_dir) {
            log::loud(&warning);
        }
        let nccl_proto = env::var("NCCL_PROTO")?;
        check_forced_protocol(&profile, nccl_proto.as_deref())?;
        check_p2p_ll(&profile, &P2pLlSettings::from_env())?;
        let tuner = env::var("NCCL_TUNER_PLUGIN")?;
        let warnings = [
            unguarded_ll_warning(&profile, nccl_proto.as_deref(), tuner.as_deref()),
            unknown_comm_size_warning(&profile, tuner.as_deref()),
            unknown_rank_warning(&profile, launcher_rank(), &environment::rank_values()),
        ];
        for warning in warnings.iter().flatten() {
            log::loud(warning);
        }
        let inner_env = env::var(INNER_ENV)?.filter(|v| !v.trim().is_empty());
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
                    WrapTransport::open(&inner, logger, options)
                        .map_err(|e| e.context(format!("wrap mode (inner {inner:?})")))?,
                )
            }
        };
        Runtime::new(transport, profile)
    }

    /// Takes a hold on the process's runtime, building it from the environment first when
    /// there is none. A build that fails leaves nothing behind: the next call tries again.
    pub fn acquire(hold: Hold, logger: ncclDebugLogger_t) -> Result<Arc<Runtime>> {
        if BUILDING.with(Cell::get) {
            // This thread holds the slot's lock while it builds: waiting for it would never end.
            return Err(Error::invalid_usage(
                "the inner net plugin's init leads back into this library (a plugin that \
                 forwards to it, or to a copy of it): wrap mode needs another network's plugin \
                 (NCCL_LOSSY_INNER, or the profile's `inner`)",
            ));
        }
        let mut slot = slot()?;
        let runtime = match &slot.runtime {
            Some(runtime) => Arc::clone(runtime),
            None => {
                let runtime = Arc::new(building(|| build_logged(logger))?);
                OWNER_PID.store(std::process::id(), Ordering::Relaxed);
                if slot
                    .last_profile
                    .as_ref()
                    .is_some_and(|last| **last != *runtime.profile_json)
                {
                    // Built again under another profile: the statistics file goes on adding
                    // to the same totals, but the earlier connections' rule numbers belong to
                    // the old profile's rules.
                    crate::stats::registry().forget_rules();
                    log::warn(
                        "the profile changed since this process's last runtime: its \
                         statistics file adds the runs of both (the per-rule counts only this \
                         one's)",
                    );
                }
                slot.last_profile = Some(Arc::clone(&runtime.profile_json));
                slot.implicit = Some(Context::new(0, 0, None, runtime.takes_net_attr()));
                slot.runtime = Some(Arc::clone(&runtime));
                runtime
            }
        };
        match hold {
            Hold::Counted => slot.holds += 1,
            Hold::UntilUnload => slot.until_unload = true,
        }
        Ok(runtime)
    }

    /// Gives back one [`Hold::Counted`] hold; the last one releases the runtime, and then
    /// `on_last` runs, under the slot's lock, before any other `acquire` can build the next
    /// runtime: what it takes belongs to the runtime released, never to the next one. (Asked
    /// after the release instead, "is there a runtime?" could see one that an `init` on
    /// another thread built meanwhile, while the released one was being retired.)
    pub fn release<T>(on_last: impl FnOnce() -> T) -> Result<Option<T>> {
        let (retired, taken) = {
            let mut slot = slot()?;
            slot.holds = slot.holds.saturating_sub(1);
            if slot.holds == 0 && !slot.until_unload {
                let retired = slot.take();
                let taken = retired.as_ref().map(|_| on_last());
                (retired, taken)
            } else {
                (None, None)
            }
        };
        match retired {
            Some((runtime, implicit)) => {
                retire(runtime, implicit);
                Ok(taken)
            }
            // Not the last communicator: its numbers still go to the file now. A write that
            // fails is warned about, never NCCL's error: statistics are not the run.
            None => {
                output::write_logged();
                Ok(None)
            }
        }
    }

    /// Releases the runtime whatever holds remain (the library is being unloaded).
    fn release_all() {
        let retired = match SLOT.lock() {
            Ok(mut slot) => {
                slot.holds = 0;
                slot.until_unload = false;
                slot.take()
            }
            Err(_) => None,
        };
        if let Some((runtime, implicit)) = retired {
            retire(runtime, implicit);
        }
    }

    /// The runtime an earlier `init` built, or an error saying there is none.
    pub fn current() -> Result<Arc<Runtime>> {
        slot()?.runtime.clone().ok_or_else(|| {
            Error::invalid_usage("the plugin is not initialised (no init, or after its finalize)")
        })
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

    /// True when the profile has a data-corrupting effect, so LL/LL128 must be ruled out.
    pub fn protocol_guard_needed(&self) -> bool {
        self.corrupts_data
    }

    /// The next communicator's number (1, 2, ...: the order of the `init`s), which seeds its
    /// loss streams. A program opens its communicators in the same order in every run, while
    /// NCCL's commHash changes with every run's unique id.
    pub fn number_context(&self) -> u64 {
        self.contexts.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Records the size of communicator `comm_id` (called by the tuner's init).
    pub fn record_comm_size(&self, comm_id: u64, ranks: usize) {
        if let (Ok(mut sizes), Ok(ranks)) = (self.comm_sizes.lock(), u32::try_from(ranks)) {
            sizes.insert(comm_id, ranks);
        }
    }

    /// The size of communicator `comm_id`, when the tuner reported it.
    pub fn comm_size(&self, comm_id: u64) -> Option<u32> {
        self.comm_sizes.lock().ok()?.get(&comm_id).copied()
    }

    /// Warns once per runtime, for NCCL with net API v8 to v10 (no per-communicator context,
    /// no `setNetAttr`), that rules matching on a collective will only ever see `Unknown`.
    pub fn note_legacy_api(&self) {
        if self.profile.matches_on_collective() && !self.legacy_warned.swap(true, Ordering::Relaxed)
        {
            log::warn(
                "this NCCL speaks net API v8 to v10, which does not say which collective is \
                 posted: rules that match on `collective` see `Unknown` and will not match \
                 (net API v11, NCCL 2.28 or newer, is needed)",
            );
        }
    }

    /// Starts listening on `dev` for `ctx`.
    pub fn listen(
        self: &Arc<Self>,
        ctx: &Arc<Context>,
        dev: usize,
        handle: &mut WireHandle,
    ) -> Result<ListenComm> {
        self.properties(dev)?;
        let listener = self.transport.listen(dev, ctx.traffic_class, handle)?;
        Ok(ListenComm::new(Arc::clone(self), Arc::clone(ctx), listener))
    }

    /// Whether the transport takes NCCL's `setNetAttr` (a wrapped plugin may; our sockets
    /// do not), decided once per context so the call costs nothing otherwise.
    pub fn takes_net_attr(&self) -> bool {
        self.transport.takes_net_attr()
    }

    /// Hands NCCL's `setNetAttr` for `ctx` to the transport (a wrapped plugin gets it in the
    /// context of `ctx`'s traffic class).
    pub fn forward_net_attr(&self, ctx: &Context, attr: &ncclNetAttr_v11_t) {
        self.transport.set_net_attr(ctx.traffic_class, attr);
    }

    /// Starts connecting `ctx` to the listener described by `handle`, which belongs to the
    /// process of rank `peer` when the handle said so.
    pub fn connect(
        self: &Arc<Self>,
        ctx: &Arc<Context>,
        dev: usize,
        handle: &WireHandle,
        peer: Option<u32>,
        traffic_class: Option<i32>,
    ) -> Result<Connecting> {
        self.properties(dev)?;
        // v10 gives it per connection; v11+ in the context.
        let traffic_class = traffic_class.or(ctx.traffic_class);
        let connector = self.transport.connect(dev, traffic_class, handle)?;
        // Numbered when NCCL asks, which happens in the same order in every run, so each
        // connection keeps its own reproducible loss stream.
        let index = ctx.next_connection_index();
        let loss = self.engine.stream(stream_key(self.rank, ctx, peer, index));
        Ok(Connecting::new(
            Arc::clone(self),
            Arc::clone(ctx),
            connector,
            loss,
            peer,
            index,
            traffic_class,
        ))
    }
}

/// The identity a send connection's loss stream is seeded from: this rank, its communicator's
/// number in this process (not NCCL's commHash, which changes every run), the peer and the
/// connection's number in that communicator.
fn stream_key(rank: Option<u32>, ctx: &Context, peer: Option<u32>, conn: u32) -> StreamKey {
    StreamKey {
        rank: rank.unwrap_or(0),
        comm: ctx.number,
        peer: peer.unwrap_or(u32::MAX),
        direction: Direction::Send,
        conn,
    }
}

/// How an `init` holds the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Until the matching `finalize` (net v11+, and the tuner's init/finalize).
    Counted,
    /// Until the library is unloaded (net v8 to v10, which have no `finalize`).
    UntilUnload,
}

/// The process's runtime, the implicit context of net v8 to v10, and the holds on them.
struct Slot {
    runtime: Option<Arc<Runtime>>,
    implicit: Option<Arc<Context>>,
    holds: usize,
    until_unload: bool,
    /// The profile of the latest runtime, as statistics files show it: the statistics
    /// outlive the runtime (see the module documentation).
    last_profile: Option<Arc<serde_json::Value>>,
}

impl Slot {
    fn take(&mut self) -> Option<(Arc<Runtime>, Option<Arc<Context>>)> {
        let runtime = self.runtime.take()?;
        Some((runtime, self.implicit.take()))
    }
}

/// The one process-wide slot (why: see the module documentation).
static SLOT: Mutex<Slot> = Mutex::new(Slot {
    runtime: None,
    implicit: None,
    holds: 0,
    until_unload: false,
    last_profile: None,
});

thread_local! {
    /// Set while this thread builds the runtime (under the slot's lock): an `acquire` then can
    /// only come from a wrapped plugin's `init` leading back into this library.
    static BUILDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `build` with [`BUILDING`] set on this thread, cleared again however it ends.
fn building<T>(build: impl FnOnce() -> T) -> T {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            BUILDING.with(|b| b.set(false));
        }
    }
    BUILDING.with(|b| b.set(true));
    let _clear = Clear;
    build()
}

fn slot() -> Result<MutexGuard<'static, Slot>> {
    SLOT.lock()
        .map_err(|_| Error::internal("the runtime slot was poisoned by an earlier panic"))
}

/// The profile statistics files carry: the latest runtime's.
fn last_profile() -> serde_json::Value {
    SLOT.lock()
        .ok()
        .and_then(|slot| slot.last_profile.as_deref().cloned())
        .unwrap_or(serde_json::Value::Null)
}

/// Builds a runtime from the environment and says so in the log.
fn build_logged(logger: ncclDebugLogger_t) -> Result<Runtime> {
    let runtime = Runtime::from_env(logger);
    match &runtime {
        Ok(runtime) => {
            log::info(&format!(
                "initialised with {} device(s): {}; profile: {}",
                runtime.devices.len(),
                runtime
                    .devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                runtime.profile.summary()
            ));
            for warning in runtime.profile.warnings() {
                log::warn(&format!("profile {warning}"));
            }
        }
        Err(err) => log::loud(&format!("initialisation failed: {err}")),
    }
    runtime
}

/// Releases a runtime the slot let go of: connects still pending are dropped, the periodic
/// writer stops, the statistics file is written. The transport goes with the last comm.
fn retire(runtime: Arc<Runtime>, implicit: Option<Arc<Context>>) {
    if let Some(implicit) = implicit {
        implicit.abandon_pending();
    }
    runtime.retire_output();
    output::write_final();
    drop(runtime);
}

impl Context {
    /// The context shared by every communicator under net v8 to v10: the runtime's, or a
    /// detached one when no runtime is built (its listens and connects then fail).
    pub fn implicit() -> Arc<Context> {
        SLOT.lock()
            .ok()
            .and_then(|slot| slot.implicit.clone())
            .unwrap_or_else(|| Context::new(0, 0, None, false))
    }
}

/// The process that built the latest runtime. A child forked after `init` inherits a copy of
/// the slot, the statistics and the trace, but none of the threads (the statistics writer, the
/// transport's I/O threads): they are the parent's.
static OWNER_PID: AtomicU32 = AtomicU32::new(0);

/// Whether this process is a child forked after the runtime was built (see [`OWNER_PID`]).
fn forked_child() -> bool {
    let owner = OWNER_PID.load(Ordering::Relaxed);
    owner != 0 && owner != std::process::id()
}

/// Releases the runtime when the library is unloaded (`dlclose`, or the process exits):
/// the end of net v8 to v10, which have no `finalize`. A child forked after `init` leaves
/// everything as it is: joining the writer thread, which exists only in the parent, would
/// never return, and a statistics file or trace under the child's pid would hold the
/// parent's messages a second time.
extern "C" fn release_at_unload() {
    if forked_child() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        Runtime::release_all();
        // The last statistics file is written: what it was made of can go (the heap memory
        // of a static would outlive the image).
        if let Ok(mut slot) = SLOT.lock() {
            slot.last_profile = None;
        }
        crate::stats::registry().forget_all();
        output::forget_stats_dir();
    });
}

#[used]
#[link_section = ".fini_array"]
static RELEASE_AT_UNLOAD: extern "C" fn() = release_at_unload;

#[cfg(test)]
mod stream_key_tests {
    use super::*;

    #[test]
    fn loss_streams_do_not_depend_on_nccls_per_run_communicator_hash() {
        // NCCL hands `init` its commHash, a hash of the unique id, whose magic is random in
        // every run: the same job, seed and communicator get another hash each time. Seeding
        // from it made no two runs lose the same packets. The communicator's number in this
        // process (the order of its init) is what repeats.
        let run_a = Context::new(0x9c1e_22f0_4a7b_d001, 2, None, false);
        let run_b = Context::new(0x51d3_8e0a_07c4_9f12, 2, None, false);
        assert_eq!(
            stream_key(Some(1), &run_a, Some(0), 3),
            stream_key(Some(1), &run_b, Some(0), 3)
        );
        // Two communicators of one run still get streams of their own.
        let other = Context::new(0x9c1e_22f0_4a7b_d001, 3, None, false);
        assert_ne!(
            stream_key(Some(1), &run_a, Some(0), 3),
            stream_key(Some(1), &other, Some(0), 3)
        );
    }
}
