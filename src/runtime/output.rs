//! The statistics file, written off NCCL's threads. A closing connection only freezes its
//! numbers in the registry (in memory) and asks the writer thread for a write; the writer
//! coalesces requests (at most one write per [`MIN_GAP`], plus one every `stats_interval`
//! when the profile sets one), and writes what is left when the last comm closes and when the
//! runtime is released. The writer thread exists only while comms are open: NCCL may
//! `dlclose` the library after its last comm, and a thread still running our code then
//! would crash the process.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use super::Runtime;
use crate::profile::{Profile, MAX_TRACE_EVENTS};
use crate::stats::periodic::PeriodicWriter;
use crate::stats::timeline::{self, DEFAULT_CAPACITY, TRACE_DIR_ENV, TRACE_EVENTS_ENV};
use crate::stats::writer::{
    check_output_dir, dir_setting, output_dir_writable_in_place, StatsFile, STATS_DIR_ENV,
};
use crate::switches;
use crate::{log, stats, Result};

/// Shortest time between two writes that closing connections asked for: a communicator
/// closing thousands of connections costs a handful of writes, not one per connection.
pub const MIN_GAP: Duration = Duration::from_millis(200);

/// Open send and receive comms of one runtime, and the statistics writer that runs while any
/// is open.
#[derive(Default)]
pub(super) struct LiveComms {
    open: usize,
    writer: Option<PeriodicWriter>,
    /// The runtime was released while comms were still open: no writer is started again,
    /// and each late close writes the file itself.
    retired: bool,
}

impl Runtime {
    /// Counts a comm opening; starts the statistics writer with the first one.
    pub(super) fn comm_opened(&self) {
        let Ok(mut live) = self.live.lock() else {
            return;
        };
        live.open += 1;
        if live.writer.is_some() || live.retired || (stats_dir().is_none() && trace_dir().is_none())
        {
            return;
        }
        match PeriodicWriter::start(self.stats_interval, MIN_GAP, write_logged) {
            Ok(writer) => live.writer = Some(writer),
            Err(err) => log::warn(&format!("no statistics writer thread: {err}")),
        }
    }

    /// Counts a comm closing and asks for a write; the last one stops (joins) the writer,
    /// which writes the file one last time, because NCCL may unload the library next.
    pub(super) fn comm_closed(&self) {
        let (writer, write_now) = match self.live.lock() {
            Ok(mut live) => {
                live.open = live.open.saturating_sub(1);
                if let Some(writer) = &live.writer {
                    writer.request();
                }
                let writer = if live.open == 0 {
                    live.writer.take()
                } else {
                    None
                };
                (writer, live.retired)
            }
            Err(_) => (None, false),
        };
        if let Some(writer) = writer {
            writer.stop();
        }
        if write_now {
            write_logged();
        }
    }

    /// Stops the writer whatever comms remain (the runtime is being released; the caller
    /// writes the file).
    pub(super) fn retire_output(&self) {
        let writer = self.live.lock().ok().and_then(|mut live| {
            live.retired = true;
            live.writer.take()
        });
        if let Some(writer) = writer {
            writer.stop();
        }
    }
}

/// This process's statistics, with the profile that produced them.
pub fn stats_file() -> StatsFile {
    StatsFile::new(super::last_profile(), stats::registry().snapshot())
}

/// The statistics directory: the one the latest runtime's `init` found, else (no runtime
/// built yet: a control call before NCCL's init) `NCCL_LOSSY_STATS` as it is now.
fn stats_dir() -> Option<PathBuf> {
    if switches::inner_mode() {
        // The outer copy writes this rank's statistics; a second file would clobber them.
        return None;
    }
    match STATS_DIR
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
    {
        Some(at_init) => at_init,
        None => stats_dir_now(),
    }
}

/// `NCCL_LOSSY_STATS` as it is now, made absolute against the working directory now.
fn stats_dir_now() -> Option<PathBuf> {
    dir_setting(std::env::var_os(STATS_DIR_ENV)).map(|dir| absolute(Path::new(&dir)))
}

/// `NCCL_LOSSY_STATS` as the latest runtime's `init` found it, made absolute against the
/// working directory of that moment (inner `None`: not set); outer `None` until a runtime is
/// built. A relative directory read again at each write followed the process's working
/// directory: a script that changes it after NCCL's init (a configuration framework's run
/// directory) had its statistics written, and the directory created, somewhere else than
/// where `init` checked and created it.
static STATS_DIR: Mutex<Option<Option<PathBuf>>> = Mutex::new(None);

/// Forgets the directory [`settle_stats_dir`] fixed: the library is being unloaded, its last
/// statistics file written (the heap memory of a static would outlive the image).
pub(super) fn forget_stats_dir() {
    *STATS_DIR.lock().unwrap_or_else(PoisonError::into_inner) = None;
}

/// `dir` made absolute against the working directory now (as given when that cannot be had).
fn absolute(dir: &Path) -> PathBuf {
    std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// [`check_stats_dir`] at a runtime's `init`, which then fixes the directory every write of
/// the process uses (see [`STATS_DIR`]).
pub(super) fn settle_stats_dir() -> Result<()> {
    check_stats_dir()?;
    let at_init = if switches::inner_mode() {
        None
    } else {
        stats_dir_now()
    };
    *STATS_DIR.lock().unwrap_or_else(PoisonError::into_inner) = Some(at_init);
    Ok(())
}

/// Whole writes of the statistics file, snapshot included, one at a time (the trace has its
/// own). Each write's own temporary already keeps concurrent writes (the writer thread,
/// `ncclLossyWriteStats`, a closing comm) from breaking the file; the lock also keeps an older
/// snapshot from replacing a newer one, which a write that took its numbers first but renamed
/// last would do. A writer waits for at most the one write in progress.
static STATS_WRITES: Mutex<()> = Mutex::new(());
/// The same for the trace file: snapshot and write one at a time. It holds the file last
/// written and the messages the ring had recorded for it: a write with no message recorded
/// since, while that file is still there, writes nothing (a ring of millions takes seconds
/// to write, and the periodic writer would rewrite it every interval of an idle job).
static TRACE_WRITES: Mutex<Option<(u64, PathBuf)>> = Mutex::new(None);

/// Writes the statistics file into `NCCL_LOSSY_STATS`; `Ok(None)` when it is not set.
pub fn write_stats() -> Result<Option<PathBuf>> {
    match stats_dir() {
        Some(dir) => {
            // A panic while held (not expected) leaves nothing half done to guard: go on.
            let _one_at_a_time = STATS_WRITES.lock().unwrap_or_else(PoisonError::into_inner);
            stats_file().write_to(Path::new(&dir)).map(Some)
        }
        None => Ok(None),
    }
}

/// Checks at `init` that `NCCL_LOSSY_STATS`, when set, is a directory statistics can be
/// written to: a run that cannot keep its statistics is refused up front, with the variable
/// and the path named, rather than warned about at every write.
pub fn check_stats_dir() -> Result<()> {
    if switches::inner_mode() {
        return Ok(());
    }
    match dir_setting(std::env::var_os(STATS_DIR_ENV)) {
        Some(dir) => {
            check_output_dir(Path::new(&dir), "stats").map_err(|err| stats_dir_context(err, &dir))
        }
        None => Ok(()),
    }
}

/// An error about the statistics directory `dir`, under the variable that named it.
fn stats_dir_context(err: crate::Error, dir: &std::ffi::OsStr) -> crate::Error {
    err.context(format!(
        "{STATS_DIR_ENV}={}: statistics cannot be written there (set it to a writable \
         directory, or unset it)",
        crate::error::echo(&Path::new(dir).display().to_string(), str::to_string)
    ))
}

/// An error about the trace directory `dir`, under the setting that named it (`source`).
fn trace_dir_context(err: crate::Error, source: &str, dir: &Path) -> crate::Error {
    err.context(format!(
        "{source}={}: the trace cannot be written there (set it to a writable directory, or \
         unset it)",
        crate::error::echo(&dir.display().to_string(), str::to_string)
    ))
}

/// The trace directory and what named it: `NCCL_LOSSY_TRACE` (`env_dir`, blank is unset),
/// else the profile's `trace`; `None`: no trace.
fn trace_dir_setting(profile: &Profile, env_dir: Option<String>) -> Option<(String, String)> {
    match env_dir.filter(|d| !d.trim().is_empty()) {
        Some(dir) => Some((dir, TRACE_DIR_ENV.to_string())),
        None => profile
            .trace
            .as_ref()
            .map(|dir| (dir.clone(), format!("trace (profile {})", profile.origin))),
    }
}

/// A warning when the profile sets `stats_interval` but nothing is ever written: the
/// statistics file goes only into `NCCL_LOSSY_STATS` (`stats_env`), the trace only into its
/// directory (`trace_env`, `NCCL_LOSSY_TRACE`, else the profile's `trace`), and with neither
/// the key does nothing.
pub fn unused_stats_interval_warning(
    profile: &Profile,
    stats_env: Option<std::ffi::OsString>,
    trace_env: Option<String>,
) -> Option<String> {
    let interval = profile.stats_interval?;
    if dir_setting(stats_env).is_some() || trace_dir_setting(profile, trace_env).is_some() {
        return None;
    }
    Some(format!(
        "stats_interval = {} s (profile {}): {STATS_DIR_ENV} is not set (nor a trace \
         directory), so nothing is ever written; set {STATS_DIR_ENV} to a directory for \
         the statistics files",
        interval.as_secs_f64(),
        profile.origin
    ))
}

/// What `init` refuses of the statistics directory (`stats_env`, `NCCL_LOSSY_STATS`) and the
/// trace directory (`trace_env`, `NCCL_LOSSY_TRACE`, else the profile's `trace`) that shows
/// without creating a directory (a file where a directory goes, a place that takes no new
/// file; a probe file is created and removed), in `init`'s words: `lossy validate` and `lossy
/// simulate` check with it what `init` will create.
pub fn check_output_dirs_in_place(
    profile: &Profile,
    stats_env: Option<std::ffi::OsString>,
    trace_env: Option<String>,
) -> Result<()> {
    if let Some(dir) = dir_setting(stats_env) {
        output_dir_writable_in_place(Path::new(&dir), "stats")
            .map_err(|err| stats_dir_context(err, &dir))?;
    }
    if let Some((dir, source)) = trace_dir_setting(profile, trace_env) {
        let dir = PathBuf::from(dir);
        output_dir_writable_in_place(&dir, "trace")
            .map_err(|err| trace_dir_context(err, &source, &dir))?;
    }
    Ok(())
}

/// Writes the statistics file and the trace; a failure is a warning (statistics never fail
/// NCCL's calls). A directory that stays unwritable (replaced by a file, a full disk) fails
/// every periodic write, up to 10 a second, for the rest of a run that may last days: the
/// warnings of one kind are limited to [`FAILED_WRITES`]'s share, the rest counted.
pub(super) fn write_logged() {
    write_outputs(|what, err| {
        FAILED_WRITES.warn(
            &format!("{what} {}", err.message),
            &format!("{what} not written: {err}"),
        )
    });
}

/// Writes the statistics file and the trace one last time (the runtime is being released);
/// a failure is warned about whatever [`FAILED_WRITES`] let through before: the run's final
/// numbers being lost must not go unsaid behind a limit the periodic writes reached.
pub(super) fn write_final() {
    write_outputs(|what, err| {
        log::warn(&format!("{what} not written at the end of the run: {err}"))
    });
}

/// Writes the statistics file, then the trace, handing `failed` what could not be written
/// ("statistics" or "trace") and why.
fn write_outputs(failed: impl Fn(&str, &crate::Error)) {
    if let Err(err) = write_stats() {
        failed("statistics", &err);
    }
    if let Err(err) = write_trace() {
        failed("trace", &err);
    }
}

/// At most 5 warnings of failed statistics or trace writes per kind (the error, digits aside)
/// in 10 minutes; the next one after that says how many were left out.
static FAILED_WRITES: log::RateLimit = log::RateLimit::new(5, 600);

/// The trace directory the first `init` that turned tracing on chose.
static TRACE_DIR: OnceLock<PathBuf> = OnceLock::new();

fn trace_dir() -> Option<&'static PathBuf> {
    TRACE_DIR.get()
}

/// The trace ring's capacity in messages, and what set it: `NCCL_LOSSY_TRACE_EVENTS`
/// (`env_events`, blank is unset) over the profile's `trace_events` over the default. Checked at
/// every `init`, tracing or not, and by `lossy validate` and `lossy simulate` as at `init`.
pub fn trace_capacity(profile: &Profile, env_events: Option<String>) -> Result<(usize, String)> {
    match env_events.filter(|v| !v.trim().is_empty()) {
        Some(text) => match text.trim().parse::<i64>() {
            Ok(n) if (1..=MAX_TRACE_EVENTS).contains(&n) => {
                Ok((n as usize, TRACE_EVENTS_ENV.to_string()))
            }
            _ => Err(crate::Error::invalid_argument(format!(
                "{TRACE_EVENTS_ENV}={}: must be an integer in [1, {MAX_TRACE_EVENTS}] \
                 (messages the trace ring holds)",
                crate::error::echo(&text, str::to_string)
            ))),
        },
        None => Ok(match profile.trace_events {
            Some(n) => (n, format!("trace_events (profile {})", profile.origin)),
            None => (DEFAULT_CAPACITY, "the default trace ring size".to_string()),
        }),
    }
}

/// Where the loss timeline goes and how large its ring is, as `init` decides it (see
/// [`trace_setting`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceSetting {
    /// Messages the ring holds.
    pub capacity: usize,
    /// What chose `capacity` (`NCCL_LOSSY_TRACE_EVENTS`, the profile's `trace_events`, ...).
    pub sized_by: String,
    /// The trace directory, when tracing is on.
    pub dir: Option<PathBuf>,
    /// What named `dir` (`NCCL_LOSSY_TRACE`, or the profile's `trace`).
    pub source: String,
}

/// The trace settings of `profile` with `NCCL_LOSSY_TRACE` (`env_dir`, which wins) and
/// `NCCL_LOSSY_TRACE_EVENTS` (`env_events`, which wins over the profile's `trace_events`),
/// and the trace directory checked as for statistics (created, a file can be written in it):
/// what `init` refuses, found without starting anything (`lossy run` asks it before the
/// launch). The ring's size is checked whether or not tracing is on, so a mistake shows on
/// every run, not only on the one that turns tracing on.
pub fn trace_setting(
    profile: &Profile,
    env_dir: Option<String>,
    env_events: Option<String>,
) -> Result<TraceSetting> {
    let (capacity, sized_by) = trace_capacity(profile, env_events)?;
    let (dir, source) = match trace_dir_setting(profile, env_dir) {
        Some((dir, source)) => (Some(PathBuf::from(dir)), source),
        None => (None, String::new()),
    };
    if let Some(path) = &dir {
        check_output_dir(path, "trace").map_err(|err| trace_dir_context(err, &source, path))?;
    }
    Ok(TraceSetting {
        capacity,
        sized_by,
        dir,
        source,
    })
}

/// Turns the loss timeline on at `init` when [`trace_setting`] names a directory, and
/// allocates its ring. The first `init` that turns it on decides for the process.
pub(super) fn start_trace(
    profile: &Profile,
    env_dir: Option<String>,
    env_events: Option<String>,
) -> Result<()> {
    let TraceSetting {
        capacity,
        sized_by,
        dir,
        source,
    } = trace_setting(profile, env_dir, env_events)?;
    let Some(path) = dir else {
        return Ok(());
    };
    if timeline::enable(capacity).is_none() {
        return Err(crate::Error::system(format!(
            "{sized_by}={capacity}: a trace ring of {capacity} messages needs {} MiB, which \
             this process cannot allocate (a memory limit, `ulimit -v`?); ask for fewer \
             messages, or unset {source} to trace nothing",
            timeline::Timeline::bytes_for(capacity).div_ceil(1 << 20)
        )));
    }
    // Fixed here, as the statistics directory is (see [`STATS_DIR`]): a relative one is the
    // working directory's at init, wherever the process goes after.
    let _ = TRACE_DIR.set(absolute(&path));
    Ok(())
}

/// Writes the trace file into the trace directory; `Ok(None)` when tracing is off.
pub fn write_trace() -> Result<Option<PathBuf>> {
    let (Some(dir), Some(ring)) = (trace_dir(), timeline::ring()) else {
        return Ok(None);
    };
    let mut last = TRACE_WRITES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((recorded, path)) = last.as_ref() {
        if *recorded == ring.recorded() && path.exists() {
            return Ok(Some(path.clone()));
        }
    }
    let snapshot = ring.snapshot()?;
    let path = timeline::write_trace(dir, &snapshot, &super::comms::effect_name)?;
    // A record still being written is in the next file: the next write must not be skipped.
    *last = (snapshot.unsettled == 0).then(|| (snapshot.recorded, path.clone()));
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blank_statistics_directory_is_no_directory() {
        for blank in ["", " ", " \t "] {
            assert_eq!(dir_setting(Some(blank.into())), None, "{blank:?}");
        }
        assert_eq!(dir_setting(Some(" d ".into())), Some(" d ".into()));
        assert_eq!(dir_setting(None), None);
    }

    #[test]
    fn a_bad_trace_ring_size_is_refused_even_without_a_trace_directory() {
        // Otherwise the mistake shows only on the run that turns tracing on.
        let profile = Profile::parse("", "p.toml", "").expect("profile");
        for bad in ["garbage", "-5", "0", "16777217"] {
            let err = start_trace(&profile, None, Some(bad.to_string())).expect_err(bad);
            assert!(
                err.message
                    .contains(&format!("{TRACE_EVENTS_ENV}={bad}: must be an integer")),
                "{err}"
            );
        }
        assert!(start_trace(&profile, None, Some(" 64 ".to_string())).is_ok());
    }

    const SMALL_MEMORY_CHILD: &str = "LOSSY_TRACE_SMALL_MEMORY_CHILD";

    #[test]
    fn a_trace_ring_that_does_not_fit_in_memory_fails_init_naming_the_variable() {
        // 16,777,216 events (the largest allowed) take about 1.7 GB, allocated at init; under a
        // memory limit that is an error to report, not an abort of NCCL's process.
        let said = crate::test_child::run(
            "runtime::output::tests::small_memory_child",
            SMALL_MEMORY_CHILD,
            &[],
            "refused:",
        );
        assert!(
            said.contains(&format!("{TRACE_EVENTS_ENV}={MAX_TRACE_EVENTS}"))
                && said.contains("MiB"),
            "{said}"
        );
    }

    #[test]
    #[ignore = "run under a memory limit of its own by the test above"]
    fn small_memory_child() {
        if std::env::var_os(SMALL_MEMORY_CHILD).is_none() {
            return;
        }
        crate::test_child::limit_address_space(512 << 20);
        let profile = Profile::parse("", "p.toml", "").expect("profile");
        let dir = std::env::temp_dir().join(format!("lossy-trace-small-{}", std::process::id()));
        let result = start_trace(
            &profile,
            Some(dir.display().to_string()),
            Some(MAX_TRACE_EVENTS.to_string()),
        );
        std::fs::remove_dir_all(&dir).ok();
        match result {
            Err(err) => println!("refused: {err}"),
            Ok(()) => println!("accepted"),
        }
    }

    #[test]
    fn a_trace_directory_that_cannot_be_created_is_named_as_the_trace_directory() {
        let profile = Profile::parse("", "p.toml", "").expect("profile");
        let blocker =
            std::env::temp_dir().join(format!("lossy-trace-in-way-{}", std::process::id()));
        std::fs::write(&blocker, "a file in the way\n").expect("write");
        let below = blocker.join("trace").display().to_string();
        let err = start_trace(&profile, Some(below.clone()), None).expect_err("unwritable");
        std::fs::remove_file(&blocker).ok();
        assert!(
            err.message.contains(&format!("NCCL_LOSSY_TRACE={below}"))
                && err
                    .message
                    .contains(&format!("cannot create trace directory {below}")),
            "{err}"
        );
        assert!(!err.message.contains("stats"), "{err}");
    }

    #[test]
    fn a_bad_trace_setting_fails_init_naming_the_variable_or_key() {
        let profile = Profile::parse("trace = \"t\"\n", "p.toml", "").expect("profile");
        let err = start_trace(&profile, None, Some("lots".into())).expect_err("bad capacity");
        assert!(
            err.message
                .contains("NCCL_LOSSY_TRACE_EVENTS=lots: must be an integer"),
            "{err}"
        );
        let dir = std::env::temp_dir().join(format!("lossy-trace-blocked-{}", std::process::id()));
        std::fs::write(&dir, "a file in the way\n").expect("write");
        let below = dir.join("trace").display().to_string();
        let err = start_trace(&profile, Some(below.clone()), None).expect_err("unwritable");
        assert!(
            err.message.contains(&format!(
                "NCCL_LOSSY_TRACE={below}: the trace cannot be written"
            )),
            "{err}"
        );
        let bare = Profile::parse("", "p.toml", "").expect("profile");
        let err = start_trace(&bare, Some(below), None).expect_err("unwritable");
        assert!(err.message.contains("NCCL_LOSSY_TRACE="), "{err}");
        let mut from_profile = profile.clone();
        from_profile.trace = Some(dir.join("t").display().to_string());
        let err = start_trace(&from_profile, None, None).expect_err("unwritable");
        assert!(err.message.contains("trace (profile p.toml)="), "{err}");
        std::fs::remove_file(&dir).ok();
        assert!(
            timeline::ring().is_none(),
            "a refused trace allocates nothing"
        );
    }
}
