//! What both halves of a wrapped connection share: the inner comm with its side-message
//! buffers, and the queue that tests the inner requests strictly in posting order.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::inner::InnerPlugin;
use super::side;
use std::ffi::c_void;

use crate::ffi::net::profiler::ProfilerParent;
use crate::ffi::net::{profiler, NetComm, NetMr, NetRecvBuf, NetRequest};
use crate::transport::{HostBuf, MrHandle};
use crate::{log, Error, Result};

/// The side-message buffers of one connection (one per slot), registered once with its
/// inner comm.
pub(super) struct SideArea {
    pub(super) _memory: Vec<u8>,
    pub(super) buf: HostBuf,
    pub(super) mr: NetMr,
}

impl SideArea {
    /// Allocates and registers the side buffers of the live comm `comm`.
    pub(super) fn new(plugin: &InnerPlugin, comm: NetComm, slots: usize) -> Result<SideArea> {
        let mut memory = vec![0u8; slots * side::CAPACITY];
        // SAFETY: the SideArea owns `memory` next to `buf`, so the heap block (which does not
        // move with the Vec) lives as long as `buf`; it is reached only through `slot`.
        let buf = unsafe { HostBuf::from_slice(&mut memory) };
        // SAFETY: `comm` is live (the caller's contract); the memory is owned by this area,
        // which deregisters it (InnerConn's drop) before freeing it.
        let mr = unsafe { plugin.net.reg_mr(comm, buf.as_ptr(), buf.len())? };
        Ok(SideArea {
            _memory: memory,
            buf,
            mr,
        })
    }

    /// The side buffer of slot `i`: its address, and its bytes.
    ///
    /// # Safety
    /// While the bytes are in use, nothing else may access slot `i`'s buffer: the caller holds
    /// the connection's state lock and the inner plugin has no request on that buffer.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slot(&self, i: usize) -> (*mut u8, &mut [u8]) {
        let range = i * side::CAPACITY..(i + 1) * side::CAPACITY;
        // SAFETY: `buf` is `_memory`, alive as long as `self`; the caller guarantees that
        // nothing else uses this slot's bytes meanwhile.
        let bytes = unsafe { self.buf.slice_mut(range.start, range.end) };
        (bytes.as_mut_ptr(), bytes)
    }
}

/// Which half of a connection an inner comm is.
#[derive(Clone, Copy)]
pub(super) enum Direction {
    Send,
    Recv,
}

/// Closes the live inner comm `comm` of `direction`.
///
/// # Safety
/// `comm` is a live comm of `plugin` of that direction, not used afterwards.
pub(super) unsafe fn close(
    plugin: &InnerPlugin,
    comm: NetComm,
    direction: Direction,
) -> Result<()> {
    match direction {
        // SAFETY: per this function's contract.
        Direction::Send => unsafe { plugin.net.close_send(comm) },
        // SAFETY: per this function's contract.
        Direction::Recv => unsafe { plugin.net.close_recv(comm) },
    }
}

/// What both halves of a wrapped connection hold: the inner comm (live until
/// [`InnerConn::close`] or the drop) and its side buffers. Closing (or dropping) it releases
/// the side buffers and closes the comm.
pub(super) struct InnerConn {
    pub(super) plugin: Arc<InnerPlugin>,
    pub(super) comm: NetComm,
    pub(super) side: SideArea,
    pub(super) direction: Direction,
    /// Set once the comm is closed: it is never used again, nor closed twice.
    closed: AtomicBool,
}

impl InnerConn {
    /// Takes over the live comm `comm`, registering its side buffers; closes it when that
    /// fails.
    pub(super) fn new(
        plugin: &Arc<InnerPlugin>,
        comm: NetComm,
        slots: usize,
        direction: Direction,
    ) -> Result<InnerConn> {
        let side = SideArea::new(plugin, comm, slots).inspect_err(|_| {
            // SAFETY: the comm the plugin just returned, given up here.
            let _ = unsafe { close(plugin, comm, direction) };
        })?;
        Ok(InnerConn {
            plugin: Arc::clone(plugin),
            comm,
            side,
            direction,
            closed: AtomicBool::new(false),
        })
    }

    /// Releases the side buffers and closes the inner comm (NCCL's `closeSend` or
    /// `closeRecv` of ours), once: the inner plugin's error, if either call failed, is ours,
    /// as it would be NCCL's with that plugin alone. Both calls are made whatever the first
    /// one returned.
    pub(super) fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // SAFETY: the side registration of our live comm, released once (the flag above);
        // then the comm is closed once and never used again: NCCL closes a comm with no
        // request in flight and uses it no more.
        let dereg = unsafe { self.plugin.net.dereg_mr(self.comm, self.side.mr) };
        // SAFETY: as above.
        let closed = unsafe { close(&self.plugin, self.comm, self.direction) };
        closed.and(dereg)
    }

    pub(super) fn register(&self, buf: HostBuf) -> Result<MrHandle> {
        // SAFETY: our live comm; NCCL registers memory it keeps allocated until deregMr.
        let mr = unsafe { self.plugin.net.reg_mr(self.comm, buf.as_ptr(), buf.len())? };
        Ok(mr.addr())
    }

    pub(super) fn deregister(&self, mr: MrHandle) -> Result<()> {
        // SAFETY: our live comm; NCCL passes back an mhandle our `register` returned for this
        // connection, once, with no request using it (its deregMr contract).
        unsafe { self.plugin.net.dereg_mr(self.comm, NetMr::from_addr(mr)) }
    }

    /// Posts a send of `len` bytes at `data` registered by `mr`, with the profiler handle
    /// `parent` (NCCL's for the message; `None`: [`profiler::unprofiled`]).
    ///
    /// # Safety
    /// As [`crate::ffi::net::NetPlugin::isend`]: the memory stays as it is until the request
    /// tests done, and so does NCCL's profiler handle.
    pub(super) unsafe fn isend(
        &self,
        data: *mut u8,
        len: usize,
        tag: i32,
        mr: NetMr,
        parent: Option<ProfilerParent>,
    ) -> Result<Option<NetRequest>> {
        // SAFETY: our live send comm; the handle is NCCL's for this message (valid until it
        // tests done, which the inner request precedes) or the relay's own; the rest per
        // this function's contract.
        unsafe {
            self.plugin
                .net
                .isend_profiled(self.comm, data, len, tag, mr, phandle(parent))
        }
    }

    /// Posts a receive of one buffer, with the profiler handle `parent` (as for
    /// [`InnerConn::isend`]).
    ///
    /// # Safety
    /// As [`crate::ffi::net::NetPlugin::irecv`]: the memory is left to the plugin until the
    /// request tests done.
    pub(super) unsafe fn irecv(
        &self,
        data: *mut u8,
        size: usize,
        tag: i32,
        mr: NetMr,
        parent: Option<ProfilerParent>,
    ) -> Result<Option<NetRequest>> {
        let buf = NetRecvBuf {
            data,
            size,
            tag,
            mr,
            phandle: phandle(parent),
        };
        // SAFETY: our live receive comm; the rest per this function's contract.
        unsafe { self.plugin.net.irecv(self.comm, &[buf]) }
    }
}

/// The profiler handle an inner post gets: NCCL's for the message, or, for a message NCCL
/// posted none for (a side message), one whose events the relay keeps from NCCL's callback.
/// Never NULL, as NCCL gives none (`crate::ffi::net::profiler`).
fn phandle(parent: Option<ProfilerParent>) -> *mut c_void {
    parent.map_or_else(profiler::unprofiled, |p| p.address() as *mut c_void)
}

impl Drop for InnerConn {
    fn drop(&mut self) {
        // Nothing to do when NCCL's close already closed it; a comm dropped without one (a
        // connection given up half-way) can only log what went wrong.
        if let Err(err) = self.close() {
            log::warn(&err.to_string());
        }
    }
}

/// Where one half (side or data) of a message is.
#[derive(Clone, Copy, Debug, Default)]
pub(super) enum Half {
    /// Not handed to the inner plugin yet.
    #[default]
    Unposted,
    /// Posted; the inner request.
    Pending(NetRequest),
    /// Done, with the size the inner plugin reported; `None` when it wrote none (NCCL reads
    /// no send's size and a receive's only for its profiler and GPU flushes, so a plugin may
    /// leave them unwritten). The request stays known for a receive's `irecvConsumed`.
    Done(Option<usize>, NetRequest),
    /// Its test failed: the inner plugin may have released the request.
    Failed,
}

impl Half {
    pub(super) fn is_done(&self) -> bool {
        matches!(self, Half::Done(..))
    }
}

/// Which half of a slot an inner request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    Side,
    Data,
}

/// A slot with a side half and a data half.
pub(super) trait Halves {
    fn half(&mut self, part: Part) -> &mut Half;
}

/// The inner requests of one connection and direction in posting order (side, data, side,
/// data, ...), oldest first, as (slot, part).
///
/// Inner plugins only guarantee what NCCL's proxy needs: it tests the requests of a
/// connection one at a time, oldest first, and tests a request only once every earlier one
/// has completed. Some match a request to a message when it is first tested rather than
/// when it is posted (NCCL's own Socket transport reads the next message's size then), so
/// testing a later request early would hand it an earlier message. So wrap mode tests inner
/// requests only through this queue, from its head, and stops at the first one not done.
#[derive(Default)]
pub(super) struct InFlight {
    queue: VecDeque<(usize, Part)>,
    /// The error of the request whose test failed (it stays at the head of `queue`), given
    /// again to every later test of this connection, as NCCL's Socket and IB plugins fail
    /// the later requests of a failed connection with its code.
    failure: Option<Error>,
}

impl InFlight {
    /// Records a request just posted for `part` of `slot`.
    pub(super) fn posted(&mut self, slot: usize, part: Part) {
        self.queue.push_back((slot, part));
    }

    /// Tests the oldest inner requests in posting order, marking each done one in its slot,
    /// until one is still in progress (or none is left).
    ///
    /// A request whose test fails is marked `Failed` and never tested again (the inner plugin
    /// may have released it); a later test of that connection reports the failure again,
    /// with its code.
    pub(super) fn advance<S: Halves>(&mut self, conn: &InnerConn, slots: &mut [S]) -> Result<()> {
        while let Some(&(slot, part)) = self.queue.front() {
            let half = slots
                .get_mut(slot)
                .map(|s| s.half(part))
                .ok_or_else(|| Error::internal(format!("wrap mode: no slot {slot}")))?;
            let req = match *half {
                Half::Pending(req) => req,
                Half::Failed => {
                    return Err(match &self.failure {
                        Some(err) => err
                            .clone()
                            .context("wrap mode: an earlier request of this connection failed"),
                        None => Error::internal(
                            "wrap mode: test of a message whose inner request already failed",
                        ),
                    })
                }
                other => {
                    return Err(Error::internal(format!(
                        "wrap mode: slot {slot} {part:?} queued but {other:?}"
                    )))
                }
            };
            // SAFETY: a request of this connection's live comm that has neither tested done
            // nor failed (either takes it out of `Pending`, so it is never tested again).
            match unsafe { conn.plugin.net.test(req) } {
                // The client fills the sizes with -1 before the call: still negative, the
                // plugin did not write it.
                Ok(Some(sizes)) => *half = Half::Done(usize::try_from(sizes[0]).ok(), req),
                Ok(None) => return Ok(()),
                Err(err) => {
                    *half = Half::Failed;
                    self.failure = Some(err.clone());
                    return Err(err);
                }
            }
            self.queue.pop_front();
        }
        Ok(())
    }
}
