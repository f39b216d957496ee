//! One place for the plugin's log lines. Inside NCCL they go to NCCL's own logger (so they
//! obey `NCCL_DEBUG`); before NCCL hands us one, and for anything a user must not miss, they
//! also go to stderr.
//!
//! The sink is process-wide, not part of the runtime: any thread logs, with no context, and
//! lines about a runtime that failed to build must still reach NCCL's log.

use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

/// How serious a log line is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Something went wrong or looks wrong.
    Warn,
    /// Progress worth knowing with `NCCL_DEBUG=INFO`.
    Info,
}

/// Receives log lines; the ABI layer installs one that forwards to NCCL's logger.
pub type Sink = Box<dyn Fn(Level, &str) + Send + Sync>;

static SINK: RwLock<Option<Sink>> = RwLock::new(None);

/// Routes log lines to `sink` from now on (replacing any earlier one).
pub fn set_sink(sink: Sink) {
    if let Ok(mut slot) = SINK.write() {
        *slot = Some(sink);
    }
}

/// Drops the sink (log lines go to stderr again): when the library is unloaded, since a
/// static's heap memory outlives an unloaded image.
pub fn clear_sink() {
    if let Ok(mut slot) = SINK.write() {
        *slot = None;
    }
}

fn emit(level: Level, message: &str, also_stderr: bool) {
    let delivered = match SINK.read() {
        Ok(slot) => match slot.as_ref() {
            Some(sink) => {
                sink(level, message);
                true
            }
            None => false,
        },
        Err(_) => false,
    };
    if also_stderr || (!delivered && level == Level::Warn) {
        // Not `eprintln!`: it panics when stderr cannot be written (a full disk, a closed
        // pipe), and a line nobody can read is no reason to stop NCCL.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "NET/lossy {}: {message}",
            level_name(level)
        );
    }
}

fn level_name(level: Level) -> &'static str {
    match level {
        Level::Warn => "WARN",
        Level::Info => "INFO",
    }
}

/// Logs a warning (to stderr too when NCCL has not given us a logger yet).
pub fn warn(message: &str) {
    emit(Level::Warn, message, false);
}

/// Logs an informational line (dropped when NCCL has not given us a logger yet).
pub fn info(message: &str) {
    emit(Level::Info, message, false);
}

/// Logs a failure the user must see even when NCCL silently falls back to another network:
/// always written to stderr as well as to NCCL's log.
pub fn loud(message: &str) {
    emit(Level::Warn, message, true);
}

/// Warnings of one kind that may come in floods (a port scan sends thousands of garbage
/// connections): per kind of warning, the first [`RateLimit::new`]`(per_interval, ..)` lines
/// of each interval are logged, the rest are counted, and the count is logged, with an
/// example, with the first warning of that kind after the interval ends. A kind is the
/// message's reason with its digits removed ("closed after 3 of 32 hello bytes" and "closed
/// after 0 of 32 hello bytes" are one kind), so different problems stay visible. At most
/// [`MAX_KINDS`] kinds are tracked; the rest share one.
pub struct RateLimit {
    per_interval: u32,
    interval: Duration,
    kinds: Mutex<Vec<Kind>>,
}

/// Kinds of warning one [`RateLimit`] tells apart.
pub const MAX_KINDS: usize = 16;

struct Kind {
    key: String,
    since: Instant,
    logged: u32,
    suppressed: u64,
    example: String,
}

impl RateLimit {
    /// At most `per_interval` lines per kind in each `interval_secs` seconds.
    pub const fn new(per_interval: u32, interval_secs: u64) -> RateLimit {
        RateLimit {
            per_interval,
            interval: Duration::from_secs(interval_secs),
            kinds: Mutex::new(Vec::new()),
        }
    }

    /// Logs `message` (a warning whose reason is `reason`) unless this interval already had
    /// its share of that kind.
    pub fn warn(&self, reason: &str, message: &str) {
        for line in self.admit(reason, message, Instant::now()) {
            warn(&line);
        }
    }

    /// The lines to log for one warning at `now`: none, the message, or a summary of the
    /// last interval's suppressed warnings and the message.
    fn admit(&self, reason: &str, message: &str, now: Instant) -> Vec<String> {
        let Ok(mut kinds) = self.kinds.lock() else {
            return vec![message.to_string()];
        };
        let key: String = reason.chars().filter(|c| !c.is_ascii_digit()).collect();
        let at = match kinds.iter().position(|k| k.key == key) {
            Some(at) => at,
            None if kinds.len() < MAX_KINDS => {
                kinds.push(Kind {
                    key,
                    since: now,
                    logged: 0,
                    suppressed: 0,
                    example: String::new(),
                });
                kinds.len() - 1
            }
            // Full: the last kind takes every other reason too.
            None => MAX_KINDS - 1,
        };
        let kind = &mut kinds[at];
        let mut lines = Vec::new();
        if now.duration_since(kind.since) >= self.interval {
            if kind.suppressed > 0 {
                lines.push(format!(
                    "{} more warnings like this one were not logged in the last {} s: {}",
                    kind.suppressed,
                    now.duration_since(kind.since).as_secs(),
                    kind.example
                ));
            }
            kind.since = now;
            kind.logged = 0;
            kind.suppressed = 0;
        }
        if kind.logged < self.per_interval {
            kind.logged += 1;
            if kind.logged == self.per_interval {
                kind.example = message.to_string();
                lines.push(format!(
                    "{message} (more like this are counted, not logged, for {} s)",
                    self.interval.as_secs()
                ));
            } else {
                lines.push(message.to_string());
            }
        } else {
            kind.suppressed += 1;
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL_STDERR_CHILD: &str = "LOSSY_LOG_FULL_STDERR_CHILD";

    #[test]
    fn a_log_line_to_a_stderr_that_cannot_be_written_is_dropped_not_a_panic() {
        // A job whose stderr is a full disk or a closed pipe: `eprintln!` panics there, and a
        // panic while reporting a panic (the ABI guard logs what it caught) aborts NCCL's
        // process. The child writes every kind of line into /dev/full and must live.
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full");
        let out = crate::test_child::output(
            "log::tests::full_stderr_child",
            FULL_STDERR_CHILD,
            &[],
            Some(full.into()),
        );
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the child died: {:?}\n{said}",
            out.status
        );
        assert!(said.contains("every line dropped quietly"), "{said}");
    }

    #[test]
    #[ignore = "run with its stderr on /dev/full by the test above"]
    fn full_stderr_child() {
        if std::env::var_os(FULL_STDERR_CHILD).is_none() {
            return;
        }
        clear_sink();
        warn("a warning nobody can read");
        loud("an init failure nobody can read");
        info("dropped anyway");
        println!("every line dropped quietly");
    }

    #[test]
    fn a_flood_of_one_kind_logs_the_first_few_then_a_count() {
        let limit = RateLimit::new(3, 10);
        let t0 = Instant::now();
        let mut lines = Vec::new();
        for i in 0..2000 {
            let why = format!("closed after {} of 32 hello bytes", i % 7);
            lines.extend(limit.admit(&why, &format!("drop {i}: {why}"), t0));
        }
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[2].contains("counted, not logged, for 10 s"),
            "{}",
            lines[2]
        );
        // Another reason is another kind: still logged.
        let other = limit.admit("wrong magic", "drop: wrong magic", t0);
        assert_eq!(other, vec!["drop: wrong magic".to_string()]);
        // After the interval, the count comes with the next warning of that kind.
        let later = limit.admit(
            "closed after 1 of 32 hello bytes",
            "drop x",
            t0 + Duration::from_secs(11),
        );
        assert_eq!(later.len(), 2, "{later:?}");
        assert!(
            later[0].starts_with(
                "1997 more warnings like this one were not logged in the last 11 s: drop 2:"
            ),
            "{}",
            later[0]
        );
        assert_eq!(later[1], "drop x");
        // More kinds than tracked share the last slot, and nothing grows without bound.
        for i in 0..100 {
            limit.admit(&format!("reason {}", "x".repeat(i)), "m", t0);
        }
        assert_eq!(limit.kinds.lock().unwrap().len(), MAX_KINDS);
    }
}
