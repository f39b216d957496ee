//! What NCCL holds of ours: every comm, request slot and context we hand out starts with a
//! word naming its kind, and each entry point checks that word before it trusts the rest. A
//! pointer of another kind (`isend` on a recvComm, `test` on a comm, a foreign context) is an
//! error instead of undefined behaviour: NCCL's Socket plugin has one struct for every comm
//! and ignores its context, so such a mix-up does no harm there either. The check is one
//! read of a word the call reads anyway, with no lock, so it costs the data path nothing.
//!
//! A word cannot tell a context that was finalized already (its memory is freed, and may
//! hold anything by now), so contexts are also kept in a [`Live`] list from `init` to
//! `finalize`, and a context is only read while the list, under its lock, says it is live:
//! a second `finalize`, or a `listen` on a finalized context, is refused instead of reading
//! or freeing memory that is no longer ours.

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use crate::{Error, Result};

/// First word of everything we hand to NCCL.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u64)]
pub(crate) enum Kind {
    Send = 0x4c53_5345_4e44_434d,    // "LSSENDCM"
    Recv = 0x4c53_5245_4356_434d,    // "LSRECVCM"
    Listen = 0x4c53_4c49_5354_434d,  // "LSLISTCM"
    Request = 0x4c53_5245_5155_5354, // "LSREQUST"
    Context = 0x4c53_4e45_5443_5458, // "LSNETCTX"
    Tuner = 0x4c53_5455_4e43_5458,   // "LSTUNCTX"
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Send,
        Kind::Recv,
        Kind::Listen,
        Kind::Request,
        Kind::Context,
        Kind::Tuner,
    ];

    fn of_word(word: u64) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| *k as u64 == word)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Send => "sendComm",
            Kind::Recv => "recvComm",
            Kind::Listen => "listenComm",
            Kind::Request => "request",
            Kind::Context => "ctx",
            Kind::Tuner => "tuner context",
        }
    }
}

/// The kind word of `ptr`, which `what` (an entry point) was given as a `expected`: `None`
/// for a foreign object, an error for NULL.
///
/// # Safety
/// `ptr` must be NULL or point to at least 8 readable bytes.
pub(crate) unsafe fn kind_of(ptr: *mut c_void, expected: Kind) -> Result<Option<Kind>> {
    let ptr = super::non_null(ptr, expected.name())?;
    // SAFETY: per this function's contract; read as a plain integer so a foreign object gives
    // `None`, not an invalid enum value.
    Ok(Kind::of_word(unsafe { *(ptr as *const u64) }))
}

/// `ptr` as the `T` of kind `kind` it must be: NULL or anything else is an error naming what
/// `what` was given.
///
/// # Safety
/// `ptr` must be NULL or point to at least 8 readable bytes; a `T` of `kind` must be a
/// `#[repr(C)]` struct whose first field is that [`Kind`]. The pointer is only checked, not
/// dereferenced: the caller decides how to borrow it.
#[inline]
pub(crate) unsafe fn checked<T>(ptr: *mut c_void, kind: Kind, what: &str) -> Result<*mut T> {
    // SAFETY: per this function's contract (a non-NULL `ptr` has 8 readable bytes). The
    // expected word first: the common case costs a compare, and only a mismatch looks up
    // what else it is, for the error, out of line.
    if !ptr.is_null() && unsafe { *(ptr as *const u64) } == kind as u64 {
        return Ok(ptr.cast());
    }
    // SAFETY: per this function's contract.
    unsafe { mismatched(ptr, kind, what) }
}

/// [`checked`] of a pointer that is NULL or whose first word is not `kind`'s.
///
/// # Safety
/// As [`checked`].
#[cold]
#[inline(never)]
unsafe fn mismatched<T>(ptr: *mut c_void, kind: Kind, what: &str) -> Result<*mut T> {
    let ptr = super::non_null(ptr, kind.name())?;
    // SAFETY: per this function's contract.
    match unsafe { kind_of(ptr, kind)? } {
        Some(k) if k == kind => Ok(ptr.cast()),
        Some(other) => Err(Error::invalid_argument(format!(
            "{what} was given a {} where it takes a {}",
            other.name(),
            kind.name()
        ))),
        None => Err(Error::invalid_argument(format!(
            "{what} was given a {} that is none of this plugin's",
            kind.name()
        ))),
    }
}

/// What `finalize` (or a tuner's `destroy`) does with a context (see
/// `contexts::finalize_context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterFinalize {
    /// Out of the list: its owner frees it now.
    Free,
    /// Kept in the list, readable and never finalized again, until [`Live::drain_finalized`]
    /// (v11 net contexts: NCCL 2.28.3 passes a split parent's finalized context on).
    KeepWhilePluginHeld,
}

/// The addresses of one kind of context handed out, each with what its `finalize` does and
/// whether it came: a kept one stays readable until [`Live::drain_finalized`] takes it out.
pub(crate) struct Live {
    kind: Kind,
    addrs: Mutex<Vec<Entry>>,
}

#[derive(Clone, Copy)]
struct Entry {
    addr: usize,
    after_finalize: AfterFinalize,
    finalized: bool,
}

impl Live {
    pub(crate) const fn new(kind: Kind) -> Live {
        Live {
            kind,
            addrs: Mutex::new(Vec::new()),
        }
    }

    /// The list. A poisoned lock only means a thread panicked while holding it; no step of
    /// the methods below can leave the list half-changed, so it is used as it is. (Failing
    /// instead would leak the context `add` was about to record, and its hold on the
    /// runtime.)
    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.addrs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets every address (the library is being unloaded: its statics' heap memory would
    /// outlive the image).
    pub(crate) fn forget_all(&self) {
        *self.lock() = Vec::new();
    }

    /// Records `ptr` as handed out, with what its `finalize` will do.
    pub(crate) fn add<T>(&self, ptr: *mut T, after_finalize: AfterFinalize) {
        self.lock().push(Entry {
            addr: ptr as usize,
            after_finalize,
            finalized: false,
        });
    }

    fn not_live(&self, what: &str) -> Error {
        Error::invalid_argument(format!(
            "{what} was given a {} that is not one this plugin's init returned, or that was \
             finalized already",
            self.kind.name()
        ))
    }

    /// `read(ptr)` while `ptr` is in the list (live, or finalized and kept), under the list's
    /// lock (so nothing frees it meanwhile), or an error naming `what` (the entry point) if it
    /// is not: never handed out, or gone. `ptr` is not read when it is not in the list.
    pub(crate) fn read<R>(
        &self,
        ptr: *mut c_void,
        what: &str,
        read: impl FnOnce() -> R,
    ) -> Result<R> {
        let live = self.lock();
        if !live.iter().any(|e| e.addr == ptr as usize) {
            return Err(self.not_live(what));
        }
        Ok(read())
    }

    /// Finalizes `ptr` as it was added to be finalized: taken out of the list (`Free`: its
    /// owner frees it now) or marked and kept (`KeepWhilePluginHeld`); fails if it is not
    /// live: never handed out, or finalized already.
    pub(crate) fn finalize(&self, ptr: *mut c_void) -> Result<AfterFinalize> {
        let mut live = self.lock();
        let at = live
            .iter()
            .position(|e| e.addr == ptr as usize && !e.finalized)
            .ok_or_else(|| self.not_live("finalize"))?;
        let after = live[at].after_finalize;
        match after {
            AfterFinalize::Free => {
                live.swap_remove(at);
            }
            AfterFinalize::KeepWhilePluginHeld => live[at].finalized = true,
        }
        Ok(after)
    }

    /// Takes every finalized address out of the list (their owner frees them): none is read
    /// through the list afterwards.
    pub(crate) fn drain_finalized(&self) -> Vec<usize> {
        let mut live = self.lock();
        let gone = live
            .iter()
            .filter(|e| e.finalized)
            .map(|e| e.addr)
            .collect();
        live.retain(|e| !e.finalized);
        gone
    }
}
