//! The `lossy` command and the CPU harness of nccl-net-lossy.
//!
//! This crate sits beside the plugin library (the root package) and depends on it; the library
//! NCCL loads never depends on this one.
//!
//! - [`harness`] drives a built NCCL net plugin exactly as NCCL's proxy does (through one
//!   loaded-plugin client), for the tests, the demo and the benchmark;
//! - [`commands`] is the `lossy` command line, one module per subcommand.

/// `eprintln!` for every module of this crate, without the standard one's panic when standard
/// error cannot be written (`lossy validate P 2>&1 | head -1`: the reader has gone, and Rust
/// ignores SIGPIPE): a message that cannot be shown is dropped, and the command ends with its
/// own exit code instead of a panic's 101. Defined before the modules, so their calls use it.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stderr(), $($arg)*);
    }};
}

pub mod commands;
pub mod harness;
