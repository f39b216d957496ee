//! One place for the plugin's log lines. Inside NCCL they go to NCCL's own logger (so they
//! obey `NCCL_DEBUG`); before NCCL hands us one, and for anything a user must not miss, they
//! also go to stderr.
//!
//! The sink is process-wide, not part of the runtime: any thread logs, with no context, and
//! lines about a runtime that failed to build must still reach NCCL's log.

use std::sync::RwLock;

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
        eprintln!("NET/lossy {}: {message}", level_name(level));
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
