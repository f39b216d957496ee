//! The `lossy` command and the CPU harness of nccl-net-lossy.
//!
//! This crate sits beside the plugin library (the root package) and depends on it; the library
//! NCCL loads never depends on this one.
//!
//! - [`harness`] drives a built NCCL net plugin exactly as NCCL's proxy does (through one
//!   loaded-plugin client), for the tests, the demo and the benchmark;
//! - [`commands`] is the `lossy` command line, one module per subcommand.

pub mod commands;
pub mod harness;
