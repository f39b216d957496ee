//! Errors as values: every fallible path returns one, and the ABI edge maps it to an
//! `ncclResult_t` code (see [`ErrorKind`]).

use std::fmt;

/// The class of a failure, which decides the `ncclResult_t` NCCL sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// An operating-system call failed (socket, thread, file).
    System,
    /// A bug or broken invariant inside the plugin.
    Internal,
    /// The caller passed an argument we cannot use.
    InvalidArgument,
    /// The caller used the API in a way it does not allow (e.g. a send larger than the receive).
    InvalidUsage,
    /// The peer misbehaved or went away.
    Remote,
    /// A CUDA call failed (`ncclUnhandledCudaError`): this plugin makes none, but a wrapped
    /// plugin may, and NCCL then tells the user so.
    Cuda,
}

/// A failure with a message meant for a person reading NCCL's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// Which class of failure this is.
    pub kind: ErrorKind,
    /// What happened, in words.
    pub message: String,
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds an error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// An operating-system failure.
    pub fn system(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::System, message)
    }

    /// A broken invariant inside the plugin.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// A bad argument from the caller.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// A use of the API it does not allow.
    pub fn invalid_usage(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidUsage, message)
    }

    /// A failure caused by the peer.
    pub fn remote(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Remote, message)
    }

    /// Prefixes the message with what we were doing when it failed.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Self {
        use std::io::ErrorKind as Io;
        let kind = match err.kind() {
            Io::ConnectionReset
            | Io::ConnectionAborted
            | Io::BrokenPipe
            | Io::UnexpectedEof
            | Io::ConnectionRefused => ErrorKind::Remote,
            _ => ErrorKind::System,
        };
        Error::new(kind, err.to_string())
    }
}

/// Most characters of a value, a key or a line of input that an error message echoes: past
/// it the message shows the first ones and says how long the whole is. Every rank logs an
/// `init` error, and a value of megabytes echoed whole made an error of megabytes.
pub const ECHO_CHARS: usize = 60;

/// `text` as an error message echoes it, written by `show` (as it is, quoted, between
/// backticks): whole when it has at most [`ECHO_CHARS`] characters, else its first
/// [`ECHO_CHARS`] and "…", followed by how long the whole is:
/// "`a.a.a…` (80001 bytes in all)".
pub fn echo(text: &str, show: impl FnOnce(&str) -> String) -> String {
    echo_at_most(text, ECHO_CHARS, show)
}

/// Most characters of a valid value a summary or a log line shows (overrides, a plugin's
/// path): every rank logs the summary at `init`, and a value of megabytes made a line of
/// megabytes; past it, cut as [`echo`] cuts.
pub const SHOWN_CHARS: usize = 4096;

/// As [`echo`], cut past `chars` characters.
pub fn echo_at_most(text: &str, chars: usize, show: impl FnOnce(&str) -> String) -> String {
    match text.char_indices().nth(chars) {
        None => show(text),
        Some((end, _)) => format!(
            "{} ({} bytes in all)",
            show(&format!("{}…", &text[..end])),
            text.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_cuts_long_text_and_says_how_long_it_was() {
        assert_eq!(echo("seed", str::to_string), "seed");
        let exact = "é".repeat(ECHO_CHARS);
        assert_eq!(echo(&exact, |t| format!("`{t}`")), format!("`{exact}`"));
        let long = format!("{exact}x");
        assert_eq!(
            echo(&long, |t| format!("{t:?}")),
            format!("\"{exact}…\" ({} bytes in all)", long.len())
        );
    }
}
