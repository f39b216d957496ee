//! The contexts this library handed out and that are not finalized yet, by address: a
//! pointer that is not one of them (a foreign one, one finalized already) is an error instead
//! of a crash or a double free. NCCL's Socket plugin ignores its context, so a driver that
//! passes a wrong one, or finalizes one twice, works there.

use std::sync::{Mutex, MutexGuard};

use crate::{Error, Result};

/// A set of live addresses of one kind of context.
pub(crate) struct Live {
    what: &'static str,
    addrs: Mutex<Vec<usize>>,
}

impl Live {
    pub(crate) const fn new(what: &'static str) -> Live {
        Live {
            what,
            addrs: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Vec<usize>>> {
        self.addrs.lock().map_err(|_| {
            Error::internal(format!("{} list poisoned by an earlier panic", self.what))
        })
    }

    /// Records `addr` as handed out.
    pub(crate) fn add(&self, addr: usize) -> Result<()> {
        self.lock()?.push(addr);
        Ok(())
    }

    /// Runs `f` while `addr` is known to be live (it cannot be taken meanwhile), or fails
    /// naming the kind of context.
    pub(crate) fn with<T>(&self, addr: usize, f: impl FnOnce() -> T) -> Result<T> {
        let live = self.lock()?;
        if !live.contains(&addr) {
            return Err(self.unknown());
        }
        let out = f();
        drop(live);
        Ok(out)
    }

    /// Takes `addr` out (its owner is about to free it), or fails if it is not live.
    pub(crate) fn take(&self, addr: usize) -> Result<()> {
        let mut live = self.lock()?;
        let at = live
            .iter()
            .position(|&a| a == addr)
            .ok_or_else(|| self.unknown())?;
        live.swap_remove(at);
        Ok(())
    }

    fn unknown(&self) -> Error {
        Error::invalid_argument(format!(
            "{} is not one this plugin's init returned, or it was finalized already",
            self.what
        ))
    }
}
