//! The comms NCCL holds: listening, connecting, sending and receiving. Each holds the runtime
//! it was made by, so the transport outlives every comm that uses it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Context, MessageProfiler, MessageReport, ProfilerEvent, ProfilerParent, Runtime};
use crate::ids::{self, CollectiveId};
use crate::loss::engine::ConnectionLoss;
use crate::loss::plan::{Effect, LossPlan};
use crate::loss::rules::{Direction, MatchContext};
use crate::stats::timeline::{self, Side, TimelineEvent};
use crate::stats::{self, BurstTracker, ConnectionStats, MessageRecord};
use crate::switches;
use crate::transport::{
    Completion, Connector, HostBuf, Listener, MrHandle, RecvConn, RequestId, SendConn, MAX_REQUESTS,
};
use crate::{Error, Result};

/// A listening endpoint (NCCL's `listenComm`).
pub struct ListenComm {
    ctx: Arc<Context>,
    listener: Box<dyn Listener>,
    runtime: Arc<Runtime>,
}

impl ListenComm {
    pub(super) fn new(
        runtime: Arc<Runtime>,
        ctx: Arc<Context>,
        listener: Box<dyn Listener>,
    ) -> ListenComm {
        ListenComm {
            ctx,
            listener,
            runtime,
        }
    }

    /// Advances pending handshakes; `Ok(None)` until a peer has fully connected.
    pub fn accept(&mut self) -> Result<Option<RecvComm>> {
        let Some(conn) = self.listener.poll_accept()? else {
            return Ok(None);
        };
        self.runtime.comm_opened();
        Ok(Some(RecvComm {
            _ctx: Arc::clone(&self.ctx),
            conn,
            runtime: Arc::clone(&self.runtime),
        }))
    }

    /// Closes the endpoint (NCCL's `closeListen`), reporting the transport's error.
    pub fn close(&mut self) -> Result<()> {
        self.listener.close()
    }
}

/// A connection being established (parked in its context between `connect` calls).
pub struct Connecting {
    ctx: Arc<Context>,
    connector: Box<dyn Connector>,
    loss: Option<ConnectionLoss>,
    peer: Option<u32>,
    index: u32,
    traffic_class: Option<i32>,
    runtime: Arc<Runtime>,
}

impl Connecting {
    pub(super) fn new(
        runtime: Arc<Runtime>,
        ctx: Arc<Context>,
        connector: Box<dyn Connector>,
        loss: ConnectionLoss,
        peer: Option<u32>,
        index: u32,
        traffic_class: Option<i32>,
    ) -> Connecting {
        Connecting {
            ctx,
            connector,
            loss: Some(loss),
            peer,
            index,
            traffic_class,
            runtime,
        }
    }

    /// Advances the connection; `Ok(None)` until it is ready.
    pub fn poll(&mut self) -> Result<Option<SendComm>> {
        let Some(conn) = self.connector.poll()? else {
            return Ok(None);
        };
        let loss = self
            .loss
            .take()
            .ok_or_else(|| Error::internal("connect polled again after it finished"))?;
        let stats = Arc::new(
            ConnectionStats::new(self.ctx.comm_id, self.index).with_rules(loss.rule_count()),
        );
        stats::registry().register(Arc::clone(&stats));
        self.runtime.comm_opened();
        Ok(Some(SendComm {
            profiler: self.ctx.profiler(),
            ctx: Arc::clone(&self.ctx),
            conn,
            stats,
            peer: self.peer,
            index: self.index,
            traffic_class: self.traffic_class,
            local_rank: self.runtime.rank(),
            comm_size: self.runtime.comm_size(self.ctx.comm_id),
            sender: Mutex::new(SenderState::new(loss)),
            runtime: Arc::clone(&self.runtime),
        }))
    }
}

/// Loss decisions of one sending connection. Guarded by a mutex that only NCCL's progress
/// thread takes, so it is never contended.
struct SenderState {
    loss: ConnectionLoss,
    plan: LossPlan,
    /// The rule `plan` was made by (`None`: the profile's defaults).
    rule: Option<usize>,
    /// The message `plan` was made for, while the transport had no free slot for it: NCCL
    /// posts the same message again, and it must get the same plan rather than advance the
    /// loss chain twice, and be counted where that plan was decided.
    pending: Option<Attribution>,
    /// Whether injection was on when `plan` was made (statistics count the packets of
    /// messages sent with it off apart).
    injecting: bool,
    bursts: BurstTracker,
    /// When each request slot was posted, for the latency histogram and the timeline.
    posted_at: [Option<Posted>; MAX_REQUESTS],
}

/// What a message's loss plan was made under: its length (which tells a message NCCL posts
/// again from a new one) and the collective, phase and step it is counted in.
#[derive(Clone, Copy)]
struct Attribution {
    len: usize,
    op_bits: u32,
    phase: switches::Phase,
    step: u64,
    /// Whether the script had set a step by the first post (a message decided before the
    /// first step set belongs to none, whenever the proxy posts it again).
    step_set: bool,
}

/// A message in flight: when it was posted, its collective slot, its timeline event (when
/// tracing is on) waiting for its end time, and its profiler event (when NCCL profiles it).
#[derive(Clone, Copy)]
struct Posted {
    at: Instant,
    op: usize,
    event: Option<TimelineEvent>,
    profiled: Option<ProfilerEvent>,
}

/// The code of `effect` in timeline events, and back to its name: the order of [`EFFECTS`].
const EFFECTS: [Effect; 4] = [
    Effect::Zero,
    Effect::Stale,
    Effect::Retransmit,
    Effect::Bitflip,
];

fn effect_code(effect: Effect) -> u8 {
    EFFECTS.iter().position(|e| *e == effect).unwrap_or(0) as u8
}

/// The name of an effect code of a timeline event.
pub(super) fn effect_name(code: u8) -> &'static str {
    EFFECTS
        .get(usize::from(code))
        .map_or("unknown", |e| e.name())
}

impl SenderState {
    fn new(loss: ConnectionLoss) -> Self {
        SenderState {
            loss,
            plan: LossPlan::lossless(),
            rule: None,
            pending: None,
            injecting: true,
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
    index: u32,
    /// The communicator's traffic class, for rules (v11+: from the context; v10: connect's).
    traffic_class: Option<i32>,
    local_rank: Option<u32>,
    comm_size: Option<u32>,
    sender: Mutex<SenderState>,
    /// The profiler NCCL gave the context's `init` (v10+), when it gave one.
    profiler: Option<Arc<dyn MessageProfiler>>,
    /// Last: the connection above closes before the transport can go.
    runtime: Arc<Runtime>,
}

impl SendComm {
    fn state(&self) -> Result<std::sync::MutexGuard<'_, SenderState>> {
        self.sender
            .lock()
            .map_err(|_| Error::internal("sender state poisoned by an earlier panic"))
    }

    /// Queues `buf` for sending; `Ok(None)` asks NCCL to retry later. With `parent` (NCCL's
    /// profiler handle for the message) and a profiler in the context, the message is
    /// reported to it, from here to the `test` that sees it done.
    pub fn isend(
        &self,
        buf: HostBuf,
        tag: i32,
        parent: Option<ProfilerParent>,
    ) -> Result<Option<RequestId>> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        // One read of the op, phase and step serves rule matching, the statistics and the
        // profiler. A message posted again keeps those its plan was made under: the training
        // thread may have moved to another phase or step, and the proxy announced another
        // collective, since NCCL first posted it (src/transport/net.cc, sendProxyProgress).
        // The phase and the injection switch are read together: a message never takes one
        // from before a script's switch and the other from after it.
        let retried = state.pending.filter(|p| p.len == buf.len());
        let now = switches::current();
        let Attribution {
            op_bits,
            phase,
            step,
            step_set,
            ..
        } = retried.unwrap_or_else(|| {
            // Whether a step was set, then the step: a step read after the flag is the one
            // set with it, or a later one.
            let step_set = switches::step_set();
            Attribution {
                len: buf.len(),
                op_bits: self.ctx.op(),
                phase: now.phase,
                step: switches::step(),
                step_set,
            }
        });
        let op = ids::op_slot(op_bits);
        if retried.is_none() {
            let matching = MatchContext {
                collective: CollectiveId::from_op_slot(op),
                traffic_class: self.traffic_class,
                comm_size: self.comm_size,
                direction: Direction::Send,
                peer: self.peer,
                local_rank: self.local_rank,
                phase,
                step,
            };
            state.injecting = now.enabled;
            state.rule = if state.injecting {
                state.loss.plan(&matching, buf.len(), &mut state.plan)
            } else {
                // Nothing lost, but the message is still cut into the profile's packets.
                state.loss.lossless_plan(&matching, &mut state.plan)
            };
        }
        let Some(id) = self.conn.isend_profiled(buf, tag, &state.plan, parent)? else {
            state.pending = Some(Attribution {
                len: buf.len(),
                op_bits,
                phase,
                step,
                step_set,
            });
            return Ok(None);
        };
        state.pending = None;
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
            packets_injection_off: if state.injecting { 0 } else { packets },
            rule: state.rule,
        });
        // Before the script sets a step, its traffic is not broken down by step; once it has,
        // step 0 is a step like the others (a loop counting from 0). Whether it had is read
        // at the message's first post, as its step is.
        if step_set || step > 0 {
            stats::record_step(step, packets, lost_packets, !state.injecting);
        }
        let runs = plan.lost.iter().map(|r| (r.start, r.len));
        state.bursts.observe(op, packets, runs, |op, len| {
            self.stats.record_burst(op, len)
        });
        if let Some((op, len)) = state.bursts.open() {
            self.stats.set_open_burst(op, len);
        }
        let at = Instant::now();
        let event = timeline::ring().map(|ring| TimelineEvent {
            start_ns: ring.monotonic_of(at),
            end_ns: 0,
            comm_id: self.ctx.comm_id,
            connection: self.index,
            peer: self.peer,
            side: Side::Send,
            op,
            phase: phase as usize,
            step,
            bytes: buf.len() as u64,
            packets,
            lost_packets,
            loss_events: plan.loss_events(),
            effect: effect_code(plan.effect),
            retransmit_delay_ns,
        });
        // An event START left empty (NCCL's callback with no profiler recording net events
        // leaves the handle NULL) has nothing to stop.
        let profiled = match (&self.profiler, parent) {
            (Some(profiler), Some(parent)) => Some(profiler.start(
                parent,
                &MessageReport {
                    comm_id: self.ctx.comm_id,
                    connection: self.index,
                    peer: self.peer,
                    op_bits,
                    phase: phase as u32,
                    step,
                    bytes: buf.len() as u64,
                    packets,
                    lost_packets,
                    loss_events: plan.loss_events(),
                    effect: effect_code(plan.effect),
                    retransmit_delay_ns,
                },
            ))
            .filter(|event| event.0 != 0),
            _ => None,
        };
        if let Some(slot) = state.posted_at.get_mut(id as usize) {
            *slot = Some(Posted {
                at,
                op,
                event,
                profiled,
            });
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

    /// Closes the connection (NCCL's `closeSend`), reporting the transport's error; the drop
    /// that follows finishes the bookkeeping.
    pub fn close(&self) -> Result<()> {
        self.conn.close()
    }

    /// Reports whether request `id` is done.
    pub fn test(&self, id: RequestId) -> Result<Option<Completion>> {
        let done = self.conn.test(id)?;
        if done.is_some() {
            let mut state = self.state()?;
            if let Some(posted) = state.posted_at.get_mut(id as usize).and_then(Option::take) {
                let now = Instant::now();
                let ns = now.saturating_duration_since(posted.at).as_nanos();
                self.stats
                    .record_latency_ns(posted.op, ns.min(u128::from(u64::MAX)) as u64);
                if let (Some(mut event), Some(ring)) = (posted.event, timeline::ring()) {
                    event.end_ns = ring.monotonic_of(now);
                    ring.record(&event);
                }
                if let (Some(event), Some(profiler)) = (posted.profiled, &self.profiler) {
                    profiler.stop(event);
                }
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
        // The connection's numbers are frozen in the registry; the file is written later,
        // off NCCL's thread (see `output`), not rewritten here at every close.
        stats::registry().close(&self.stats);
        self.runtime.comm_closed();
    }
}

/// The receiving half of a connection (NCCL's `recvComm`).
pub struct RecvComm {
    _ctx: Arc<Context>,
    conn: Box<dyn RecvConn>,
    /// Last: the connection above closes before the transport can go.
    runtime: Arc<Runtime>,
}

impl RecvComm {
    /// Posts a (possibly grouped) receive; `Ok(None)` asks NCCL to retry later. `parents`:
    /// NCCL's profiler handle of each buffer (v10+), handed on to a wrapped plugin.
    pub fn irecv(
        &self,
        bufs: &[HostBuf],
        tags: &[i32],
        parents: &[Option<ProfilerParent>],
    ) -> Result<Option<RequestId>> {
        if bufs.len() != tags.len() || bufs.len() != parents.len() || bufs.is_empty() {
            return Err(Error::invalid_argument(format!(
                "irecv with {} buffers and {} tags",
                bufs.len(),
                tags.len()
            )));
        }
        self.conn.irecv_profiled(bufs, tags, parents)
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

    /// Closes the connection (NCCL's `closeRecv`), as [`SendComm::close`].
    pub fn close(&self) -> Result<()> {
        self.conn.close()
    }
}

impl Drop for RecvComm {
    fn drop(&mut self) {
        self.runtime.comm_closed();
    }
}
