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
