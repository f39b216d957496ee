//! Requests of a plugin client: the buffers an `isend`/`irecv` lends the plugin, and the
//! `test` that gives them back.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::rc::Rc;

use nccl_net_lossy::ffi::net::{NetRequest, MAX_GROUPED_RECVS};
use nccl_net_lossy::{Error, Result};

use super::{CommInner, HostBuffer};

/// What a request was posted with, for the sizes `test` may leave unwritten: NCCL never
/// reads the size of a finished send (`sendProxyProgress`), and reads a receive's only for its
/// profiler and GPU flushes (`recvProxyProgress`, sizes zeroed before the call), so a plugin
/// that writes none works there, and must here.
#[derive(Clone, Copy, Debug)]
pub(super) enum PostedSizes {
    /// A send of this many bytes: the plugin's report is not read.
    Send(usize),
    /// A receive into buffers of these posted sizes: a size the plugin did not write counts
    /// as the posted one (the bytes themselves are still checked by the caller).
    Recv([usize; MAX_GROUPED_RECVS]),
}

/// What `isend`/`irecv` did: started a request, or (NULL request) asked to retry later, in
/// which case the buffers come back.
// A request keeps its buffers and sizes inline (no allocation per message); it is moved once,
// into the caller's queue, so its size costs less than the allocation boxing it would.
#[allow(clippy::large_enum_variant)]
pub enum Posted {
    /// The request, to `test` until done.
    Started(Request),
    /// The plugin had no free slot: try again later with the same buffers.
    Busy(Vec<HostBuffer>),
}

/// The buffers of one request, lent to the plugin as raw allocations, kept inline: posting
/// and completing a request allocates nothing, as NCCL's proxy allocates nothing per request
/// (an allocation per message would be harness cost charged to the plugin in `lossy bench`).
pub(super) struct Lent {
    ptrs: [*mut [u8]; MAX_GROUPED_RECVS],
    pub(super) n: usize,
}

impl Lent {
    pub(super) fn new() -> Lent {
        Lent {
            ptrs: [std::ptr::slice_from_raw_parts_mut(std::ptr::null_mut(), 0); MAX_GROUPED_RECVS],
            n: 0,
        }
    }

    /// Lends `buf`; `None` when the request already has the most buffers one may have.
    pub(super) fn lend(&mut self, buf: HostBuffer) -> Option<*mut [u8]> {
        let slot = self.ptrs.get_mut(self.n)?;
        *slot = Box::into_raw(buf);
        self.n += 1;
        Some(*slot)
    }

    /// The buffers back, ours again.
    ///
    /// # Safety
    /// The plugin holds no request using them (it reported the request done, or none started).
    pub(super) unsafe fn take_back(self) -> impl Iterator<Item = HostBuffer> {
        self.ptrs
            .into_iter()
            .take(self.n)
            // SAFETY: each pointer came from `Box::into_raw` in `lend`, and per this
            // function's contract the plugin no longer uses it.
            .map(|p| unsafe { Box::from_raw(p) })
    }
}

/// Turns a post's outcome into [`Posted`], taking the buffers back when no request started.
pub(super) fn posted(
    outcome: Result<Option<NetRequest>>,
    comm: &Rc<CommInner>,
    lent: Lent,
    phandles: Option<ProfilerHandles>,
    sizes: PostedSizes,
) -> Result<Posted> {
    match outcome {
        Ok(Some(raw)) => Ok(Posted::Started(Request {
            raw,
            comm: Rc::clone(comm),
            bufs: lent,
            posted: sizes,
            sizes: None,
            failed: false,
            phandles,
        })),
        // SAFETY: no request was started, so the plugin did not take the buffers.
        Ok(None) => Ok(Posted::Busy(unsafe { lent.take_back() }.collect())),
        Err(err) => {
            // SAFETY: as above: a failed post started no request.
            drop(unsafe { lent.take_back() }.collect::<Vec<_>>());
            Err(err)
        }
    }
}

/// An outstanding `isend`/`irecv`. Owns the lent buffers until `test` says done.
pub struct Request {
    raw: NetRequest,
    comm: Rc<CommInner>,
    /// The lent buffers, as raw allocations the plugin may use until done.
    bufs: Lent,
    /// What it was posted with.
    posted: PostedSizes,
    /// Bytes per buffer, once `test` reported the request done.
    sizes: Option<[usize; MAX_GROUPED_RECVS]>,
    /// `test` failed: the plugin may have released the request.
    failed: bool,
    /// The profiler handles the post passed, one per buffer (see
    /// [`PluginClient::init_profiled`]).
    phandles: Option<ProfilerHandles>,
}

/// What a post hands the plugin as profiler handles (v10+), one per buffer; a send uses the
/// first. Only their addresses matter: the plugin gives them back to the profiler callback.
pub(super) type ProfilerHandles = Box<[u64; MAX_GROUPED_RECVS]>;

/// The address of handle `i` of `handles` (NULL without handles).
pub(super) fn handle_address(handles: &mut Option<ProfilerHandles>, i: usize) -> *mut c_void {
    handles
        .as_deref_mut()
        .map_or(std::ptr::null_mut(), |h| (&mut h[i] as *mut u64).cast())
}

impl Request {
    /// Calls `test` once: `Ok(Some(sizes))` when done (bytes per buffer), `Ok(None)` while
    /// pending. After an error the request is dead and its buffers are never returned.
    pub fn test(&mut self) -> Result<Option<&[usize]>> {
        let n = self.bufs.n.max(1);
        if self.sizes.is_none() {
            let _comm = self.comm.live()?;
            if self.failed {
                return Err(Error::invalid_usage(
                    "test of a request that already failed",
                ));
            }
            // SAFETY: a request of the live comm (checked) that has not tested done or failed.
            let outcome = unsafe { self.comm.plugin().test(self.raw) };
            self.failed = outcome.is_err();
            let Some(reported) = outcome? else {
                return Ok(None);
            };
            let mut sizes = [0; MAX_GROUPED_RECVS];
            match self.posted {
                PostedSizes::Send(len) => sizes[0] = len,
                PostedSizes::Recv(posted) => {
                    for (i, (to, &s)) in sizes.iter_mut().zip(&reported[..n]).enumerate() {
                        // The client fills the array with -1 before the call: left so, the
                        // plugin did not write it.
                        *to = if s == -1 {
                            posted[i]
                        } else {
                            usize::try_from(s).map_err(|_| {
                                Error::internal(format!("test reported a negative size {s}"))
                            })?
                        };
                    }
                }
            }
            self.sizes = Some(sizes);
        }
        Ok(self.sizes.as_ref().map(|s| &s[..n]))
    }

    /// The address passed to `isend` as its profiler handle (of an `irecv`: its first
    /// buffer's), if any: what the plugin hands back to the profiler callback as the parent
    /// of the message's event.
    pub fn profiler_handle(&self) -> Option<usize> {
        self.phandles
            .as_deref()
            .map(|h| &h[0] as *const u64 as usize)
    }

    /// True once `test` has reported the request done.
    pub fn is_done(&self) -> bool {
        self.sizes.is_some()
    }

    /// The buffers back, with the size each got, once `test` reported the request done.
    pub fn finish(self) -> Result<(Vec<HostBuffer>, Vec<usize>)> {
        let n = self.bufs.n.max(1);
        let (bufs, sizes) = self.finish_with()?;
        Ok((bufs.collect(), sizes[..n].to_vec()))
    }

    /// As [`Request::finish`] for a request of one buffer, without allocating: the buffer and
    /// the bytes it got.
    pub fn finish_one(self) -> Result<(HostBuffer, usize)> {
        let (mut bufs, sizes) = self.finish_with()?;
        match bufs.next() {
            Some(buf) => Ok((buf, sizes[0])),
            None => Err(Error::internal("a finished request without its buffer")),
        }
    }

    fn finish_with(
        mut self,
    ) -> Result<(impl Iterator<Item = HostBuffer>, [usize; MAX_GROUPED_RECVS])> {
        let sizes = self
            .sizes
            .take()
            .ok_or_else(|| Error::invalid_usage("finish before test reported the request done"))?;
        let bufs = std::mem::replace(&mut self.bufs, Lent::new());
        // A receive's data is consumed here, before its buffers can be posted again: NCCL
        // calls `irecvConsumed` (when the plugin has one) for every receive at that point
        // (`recvProxyProgress`, once the GPU has read the step), and a plugin may hold the
        // request's resources until then.
        let consumed = match self.posted {
            PostedSizes::Recv(_) => self.comm.live().and_then(|comm| {
                // SAFETY: the live receive comm this request was posted on; the request
                // tested done with `bufs.n` buffers, and `sizes` was taken above, so this
                // is its only `irecvConsumed`.
                unsafe { self.comm.plugin().irecv_consumed(comm, bufs.n, self.raw) }
            }),
            PostedSizes::Send(_) => Ok(()),
        };
        // SAFETY: the plugin no longer uses the buffers now that test reported the request
        // done.
        let bufs = unsafe { bufs.take_back() };
        consumed.map(|()| (bufs, sizes))
    }
}

// Dropping an unfinished Request leaks its buffers on purpose: the plugin may still write
// into them until its comm is closed.

/// Requests of one comm, tested oldest first as NCCL's proxy does.
pub type RequestFifo = VecDeque<Request>;
