//! One NCCL communicator's view of the plugin (net v11+), or the implicit context older
//! versions share, with the connects it has in progress.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Connecting, MessageProfiler};
use crate::transport::HANDLE_SIZE;
use crate::{Error, Result};

/// Collective operation being posted, as NCCL's `setNetAttr` reports it (0: not reported).
pub type OpCode = u32;

/// Which connect in progress a `connect` call continues: NCCL passes the same handle memory,
/// with the same content, to every call of one connect until a comm comes back. The content
/// is part of the key, so a connect whose handle sits where an abandoned one's did (freed
/// memory handed out again) does not resume the abandoned one.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PendingKey {
    address: usize,
    handle: [u8; HANDLE_SIZE],
}

impl PendingKey {
    /// The key of the handle `handle`, at its address.
    pub fn of(handle: &[u8; HANDLE_SIZE]) -> PendingKey {
        PendingKey {
            address: handle.as_ptr() as usize,
            handle: *handle,
        }
    }
}

/// One communicator's context.
pub struct Context {
    /// NCCL's id of the communicator (0 for the implicit context).
    pub comm_id: u64,
    /// The communicator's number in this process: the order of its `init` (1 for the first,
    /// 0 for the implicit context). Loss streams are seeded from it, not from `comm_id`: NCCL
    /// passes its commHash, a hash of the unique id, which is random in every run.
    pub number: u64,
    /// Traffic class from the communicator's config, when NCCL gave one.
    pub traffic_class: Option<i32>,
    /// `setNetAttr` goes on to the transport (it takes it: [`crate::transport::Transport::takes_net_attr`]).
    pub forwards_net_attr: bool,
    op: AtomicU32,
    algo: AtomicU32,
    proto: AtomicU32,
    connections: AtomicU32,
    /// Connects in progress, dropped at `finalize` (each holds this context: the table is
    /// emptied explicitly, by [`Context::abandon_pending`]).
    pending: Mutex<HashMap<PendingKey, Box<Connecting>>>,
    /// The profiler callback NCCL gave `init` (v10+), taken by each send comm as it connects.
    profiler: Mutex<Option<Arc<dyn MessageProfiler>>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("comm_id", &self.comm_id)
            .field("traffic_class", &self.traffic_class)
            .field("op", &self.op())
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context for communicator `comm_id`, this process's `number`th; `forwards_net_attr`:
    /// its runtime's transport takes `setNetAttr`.
    pub fn new(
        comm_id: u64,
        number: u64,
        traffic_class: Option<i32>,
        forwards_net_attr: bool,
    ) -> Arc<Context> {
        Arc::new(Context {
            comm_id,
            number,
            traffic_class,
            forwards_net_attr,
            op: AtomicU32::new(0),
            algo: AtomicU32::new(0),
            proto: AtomicU32::new(0),
            connections: AtomicU32::new(0),
            pending: Mutex::default(),
            profiler: Mutex::new(None),
        })
    }

    /// Keeps the profiler NCCL's `init` gave this context (`None`: none, or NULL); send
    /// comms connected afterwards report their messages to it.
    pub fn set_profiler(&self, profiler: Option<Arc<dyn MessageProfiler>>) {
        match self.profiler.lock() {
            Ok(mut slot) => *slot = profiler,
            Err(poisoned) => *poisoned.into_inner() = profiler,
        }
    }

    /// The profiler send comms of this context report to, if any.
    pub fn profiler(&self) -> Option<Arc<dyn MessageProfiler>> {
        match self.profiler.lock() {
            Ok(slot) => slot.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
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
    pub(super) fn next_connection_index(&self) -> u32 {
        self.connections.fetch_add(1, Ordering::Relaxed)
    }

    fn pending(&self) -> Result<MutexGuard<'_, HashMap<PendingKey, Box<Connecting>>>> {
        self.pending
            .lock()
            .map_err(|_| Error::internal("pending connects poisoned by an earlier panic"))
    }

    /// Takes out the connect in progress that `key` continues, if any.
    pub fn resume_connect(&self, key: &PendingKey) -> Result<Option<Box<Connecting>>> {
        Ok(self.pending()?.remove(key))
    }

    /// Keeps a connect in progress until the next `connect` call with the same handle.
    pub fn park_connect(&self, key: PendingKey, connecting: Box<Connecting>) -> Result<()> {
        self.pending()?.insert(key, connecting);
        Ok(())
    }

    /// Drops every connect still in progress (NCCL's `finalize`: it will never ask again).
    pub fn abandon_pending(&self) {
        let abandoned = match self.pending.lock() {
            Ok(mut pending) => std::mem::take(&mut *pending),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        // Dropped outside the lock: each holds this context.
        drop(abandoned);
    }
}
