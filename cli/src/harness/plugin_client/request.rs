//! Requests of a plugin client: the buffers an `isend`/`irecv` lends the plugin, and the
//! `test` that gives them back.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::rc::Rc;

use nccl_net_lossy::ffi::net::{NetRequest, MAX_GROUPED_RECVS};
use nccl_net_lossy::{Error, Result};

use super::{CommInner, HostBuffer};

/// What `isend`/`irecv` did: started a request, or (NULL request) asked to retry later, in
/// which case the buffers come back.
pub enum Posted {
    /// The request, to `test` until done.
    Started(Request),
    /// The plugin had no free slot: try again later with the same buffers.
    Busy(Vec<HostBuffer>),
}

/// What one request lends the plugin and gets back: its buffers (as raw allocations), the
/// sizes they were posted with, the sizes `test` reported, and the profiler handles the post
/// passed (v10+, one per buffer; a send uses the first; only their addresses matter: the
/// plugin gives them back to the profiler callback). Kept in a box the comm recycles
/// ([`CommInner::parts`]): posting and completing a request allocates nothing once a few
/// requests have finished, and a request moves as a few words into its caller's queue, as
/// NCCL's proxy allocates and copies nothing per request (it passes `&sub->pHandles[..]`).
/// Either would be harness cost charged to the plugin in `lossy bench`.
pub(super) struct Parts {
    ptrs: [*mut [u8]; MAX_GROUPED_RECVS],
    pub(super) n: usize,
    posted: [usize; MAX_GROUPED_RECVS],
    sizes: [usize; MAX_GROUPED_RECVS],
    handles: [u64; MAX_GROUPED_RECVS],
}

impl Parts {
    pub(super) fn new() -> Box<Parts> {
        Box::new(Parts {
            ptrs: [std::ptr::slice_from_raw_parts_mut(std::ptr::null_mut(), 0); MAX_GROUPED_RECVS],
            n: 0,
            posted: [0; MAX_GROUPED_RECVS],
            sizes: [0; MAX_GROUPED_RECVS],
            handles: [0; MAX_GROUPED_RECVS],
        })
    }

    /// Lends `buf`, posted at `size` bytes; `None` when the request already has the most
    /// buffers one may have.
    pub(super) fn lend(&mut self, buf: HostBuffer, size: usize) -> Option<*mut [u8]> {
        let i = self.n;
        let slot = self.ptrs.get_mut(i)?;
        *slot = Box::into_raw(buf);
        self.posted[i] = size;
        self.n += 1;
        Some(*slot)
    }

    /// The address of profiler handle `i` (NULL when the post passes none).
    pub(super) fn handle(&mut self, i: usize, profiled: bool) -> *mut c_void {
        match self.handles.get_mut(i) {
            Some(h) if profiled => (h as *mut u64).cast(),
            _ => std::ptr::null_mut(),
        }
    }

    /// The buffers back, ours again; the parts are empty after.
    ///
    /// # Safety
    /// The plugin holds no request using them (it reported the request done, or none started).
    pub(super) unsafe fn take_back(&mut self) -> impl Iterator<Item = HostBuffer> + '_ {
        let n = std::mem::take(&mut self.n);
        self.ptrs
            .iter()
            .take(n)
            // SAFETY: each pointer came from `Box::into_raw` in `lend`, is taken back once
            // (`n` is reset first), and per this function's contract the plugin no longer
            // uses it.
            .map(|&p| unsafe { Box::from_raw(p) })
    }
}

/// Turns a post's outcome into [`Posted`], taking the buffers back when no request started.
pub(super) fn posted(
    outcome: Result<Option<NetRequest>>,
    comm: &Rc<CommInner>,
    mut parts: Box<Parts>,
    send: bool,
    profiled: bool,
) -> Result<Posted> {
    match outcome {
        Ok(Some(raw)) => Ok(Posted::Started(Request {
            raw,
            comm: Rc::clone(comm),
            parts: Some(parts),
            send,
            done: false,
            failed: false,
            profiled,
        })),
        Ok(None) => {
            // SAFETY: no request was started, so the plugin did not take the buffers.
            let back = unsafe { parts.take_back() }.collect();
            comm.recycle(parts);
            Ok(Posted::Busy(back))
        }
        Err(err) => {
            // SAFETY: as above: a failed post started no request.
            drop(unsafe { parts.take_back() }.collect::<Vec<_>>());
            comm.recycle(parts);
            Err(err)
        }
    }
}

/// An outstanding `isend`/`irecv`. Owns the lent buffers until `test` says done.
pub struct Request {
    raw: NetRequest,
    comm: Rc<CommInner>,
    /// The buffers, sizes and profiler handles; `None` once finished.
    parts: Option<Box<Parts>>,
    /// An `isend` (else an `irecv`).
    send: bool,
    /// `test` reported the request done (the sizes are in `parts`).
    done: bool,
    /// `test` failed: the plugin may have released the request.
    failed: bool,
    /// The post passed profiler handles (v10+).
    profiled: bool,
}

impl Request {
    /// Calls `test` once: `Ok(Some(sizes))` when done (bytes per buffer), `Ok(None)` while
    /// pending. After an error the request is dead and its buffers are never returned.
    pub fn test(&mut self) -> Result<Option<&[usize]>> {
        let parts = self
            .parts
            .as_deref_mut()
            .ok_or_else(|| Error::invalid_usage("test of a finished request"))?;
        let n = parts.n.max(1);
        if !self.done {
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
            if self.send {
                // NCCL never reads the size of a finished send (`sendProxyProgress`): the
                // plugin's report is not read.
                parts.sizes[0] = parts.posted[0];
            } else {
                // NCCL reads a receive's sizes only for its profiler and GPU flushes
                // (`recvProxyProgress`, sizes filled with -1 before the call), so a plugin
                // that writes none works there, and must here: a size left at -1 counts as
                // the posted one (the bytes themselves are still checked by the caller).
                let (posted, reported) = (&parts.posted[..n], &reported[..n]);
                for ((to, &s), &p) in parts.sizes.iter_mut().zip(reported).zip(posted) {
                    *to = if s == -1 {
                        p
                    } else {
                        usize::try_from(s).map_err(|_| {
                            Error::internal(format!("test reported a negative size {s}"))
                        })?
                    };
                }
            }
            self.done = true;
        }
        Ok(Some(&parts.sizes[..n]))
    }

    /// The address passed to `isend` as its profiler handle (of an `irecv`: its first
    /// buffer's), if any: what the plugin hands back to the profiler callback as the parent
    /// of the message's event.
    pub fn profiler_handle(&self) -> Option<usize> {
        let parts = self.parts.as_deref().filter(|_| self.profiled)?;
        Some(&parts.handles[0] as *const u64 as usize)
    }

    /// True once `test` has reported the request done.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The buffers back, with the size each got, once `test` reported the request done.
    pub fn finish(self) -> Result<(Vec<HostBuffer>, Vec<usize>)> {
        let comm = Rc::clone(&self.comm);
        let mut parts = self.release()?;
        let sizes = parts.sizes[..parts.n.max(1)].to_vec();
        // SAFETY: `release` checked that the plugin reported the request done.
        let bufs = unsafe { parts.take_back() }.collect();
        comm.recycle(parts);
        Ok((bufs, sizes))
    }

    /// As [`Request::finish`] for a request of one buffer, without allocating: the buffer and
    /// the bytes it got.
    pub fn finish_one(self) -> Result<(HostBuffer, usize)> {
        let comm = Rc::clone(&self.comm);
        let mut parts = self.release()?;
        let got = parts.sizes[0];
        // SAFETY: `release` checked that the plugin reported the request done.
        let buf = unsafe { parts.take_back() }.next();
        comm.recycle(parts);
        buf.map(|b| (b, got))
            .ok_or_else(|| Error::internal("a finished request without its buffer"))
    }

    /// The parts of a request `test` reported done, its data consumed: the plugin uses its
    /// buffers no more.
    fn release(mut self) -> Result<Box<Parts>> {
        if !self.done {
            return Err(Error::invalid_usage(
                "finish before test reported the request done",
            ));
        }
        let mut parts = self
            .parts
            .take()
            .ok_or_else(|| Error::invalid_usage("finish of a finished request"))?;
        // A receive's data is consumed here, before its buffers can be posted again: NCCL
        // calls `irecvConsumed` (when the plugin has one) for every receive at that point
        // (`recvProxyProgress`, once the GPU has read the step), and a plugin may hold the
        // request's resources until then.
        if !self.send {
            let consumed = self.comm.live().and_then(|comm| {
                // SAFETY: the live receive comm this request was posted on; the request
                // tested done with `parts.n` buffers, and the parts were taken above, so
                // this is its only `irecvConsumed`.
                unsafe { self.comm.plugin().irecv_consumed(comm, parts.n, self.raw) }
            });
            if let Err(e) = consumed {
                // SAFETY: the plugin reported the request done: the buffers are ours.
                drop(unsafe { parts.take_back() }.collect::<Vec<_>>());
                self.comm.recycle(parts);
                return Err(e);
            }
        }
        Ok(parts)
    }
}

// Dropping an unfinished Request leaks its buffers on purpose: the plugin may still write
// into them until its comm is closed.

/// Requests of one comm, tested oldest first as NCCL's proxy does.
pub type RequestFifo = VecDeque<Request>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_moves_as_a_few_words() {
        // Every post moves its request into the caller's queue and every finish out of it;
        // with its buffers, sizes and handles inline it was some 300 bytes, copied several
        // times per message on the plugin's side of `lossy bench` and never on raw TCP's.
        let words = std::mem::size_of::<Request>() / std::mem::size_of::<usize>();
        assert!(words <= 4, "a request is {words} words");
        let posted = std::mem::size_of::<Posted>() / std::mem::size_of::<usize>();
        assert!(posted <= 4, "a post's outcome is {posted} words");
    }
}
