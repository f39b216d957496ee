//! The file descriptor budget: a connection needs one descriptor per socket on each side, a
//! listen one more, and the I/O pool two per thread. A new connection that would not fit
//! under `RLIMIT_NOFILE` is refused before it opens anything, with an error that names the
//! need, the limit and `ulimit -n`, instead of failing halfway through a run.

use crate::{Error, Result};

/// The soft `RLIMIT_NOFILE`, if it is finite and readable.
fn fd_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct we pass, which lives across the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// Descriptors this process has open (the directory listing's own one not counted); all of
/// `limit` when the listing itself finds no descriptor free (`EMFILE`).
fn fds_in_use(limit: u64) -> Option<u64> {
    match std::fs::read_dir("/proc/self/fd") {
        Ok(listing) => Some((listing.count() as u64).saturating_sub(1)),
        Err(e) if e.raw_os_error() == Some(libc::EMFILE) => Some(limit),
        Err(_) => None,
    }
}

/// Refuses `what` when its `need` descriptors do not fit under the limit.
pub fn check(need: usize, what: &str) -> Result<()> {
    let Some(limit) = fd_limit() else {
        return Ok(());
    };
    let Some(used) = fds_in_use(limit) else {
        return Ok(());
    };
    if used + need as u64 <= limit {
        return Ok(());
    }
    Err(Error::system(format!(
        "{what} needs {need} file descriptors, but {used} of the limit of {limit} are in use \
         (a connection takes one per socket, NCCL_LOSSY_NSOCKS, on each side, a listen one \
         more): raise the limit (`ulimit -n`) or lower NCCL_LOSSY_NSOCKS"
    )))
}

/// What to do when the system's table of open files is full (`ENFILE`): it is shared by
/// every process, so this process's limit (`ulimit -n`) is not the one to raise.
pub const SYSTEM_TABLE_FULL: &str = "the system's table of open files, shared by all \
    processes, is full (see /proc/sys/fs/file-nr): close files elsewhere or raise the system's \
    limit, fs.file-max; this process's own limit is not the one reached";

/// `err`, met while opening a descriptor for `what`; when it is the process's descriptor
/// limit (`EMFILE`), the error names the limit and `ulimit -n`, as [`check`]'s does (the
/// check cannot see a descriptor another thread takes after it); the system's (`ENFILE`),
/// [`SYSTEM_TABLE_FULL`].
pub fn opening(err: std::io::Error, what: impl std::fmt::Display) -> Error {
    let errno = err.raw_os_error();
    let err = Error::from(err).context(what);
    if errno == Some(libc::ENFILE) {
        return Error::system(format!("{}: {SYSTEM_TABLE_FULL}", err.message));
    }
    if errno != Some(libc::EMFILE) {
        return err;
    }
    Error::system(format!(
        "{}: this process has no file descriptor left (limit {}; a connection takes \
         NCCL_LOSSY_NSOCKS on each side, a listen one more): raise the limit (`ulimit -n`) or \
         lower NCCL_LOSSY_NSOCKS",
        err.message,
        limit_text()
    ))
}

/// The limit, for messages: a number, or "unlimited".
pub fn limit_text() -> String {
    fd_limit().map_or_else(|| "unlimited".into(), |l| l.to_string())
}

/// The budget for `init`'s log: descriptors per connection (`nsocks` on each side), per
/// listen and for the I/O pool (`io_threads`, two each, while a connection is open), with the
/// limit and how many are free now.
pub fn budget(nsocks: usize, io_threads: usize) -> String {
    let free = fd_limit()
        .and_then(|limit| Some((limit, fds_in_use(limit)?)))
        .map_or_else(String::new, |(limit, used)| {
            let free = limit.saturating_sub(used);
            format!(
                ", {free} free now: room for about {} connection ends",
                free / nsocks.max(1) as u64
            )
        });
    format!(
        "file descriptors: {nsocks} per connection on each side (NCCL_LOSSY_NSOCKS), 1 per \
         listen, {} for the I/O pool ({io_threads} thread(s), NCCL_LOSSY_IO_THREADS); limit {} \
         (`ulimit -n`){free}",
        2 * io_threads,
        limit_text()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opening a socket with the system's file table full (`ENFILE`) says which limit that
    /// is, not `ulimit -n`; with this process's limit reached (`EMFILE`), `ulimit -n`.
    #[test]
    fn each_descriptor_limit_is_named_as_the_one_reached() {
        let enfile = opening(
            std::io::Error::from_raw_os_error(libc::ENFILE),
            "creating a socket",
        );
        assert!(enfile.message.contains("fs.file-max"), "{enfile}");
        assert!(!enfile.message.contains("ulimit"), "{enfile}");
        let emfile = opening(
            std::io::Error::from_raw_os_error(libc::EMFILE),
            "creating a socket",
        );
        assert!(emfile.message.contains("`ulimit -n`"), "{emfile}");
    }
}
