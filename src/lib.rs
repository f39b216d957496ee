//! nccl-net-lossy: an NCCL network plugin that injects simulated packet loss.
//!
//! Layers, in the direction data flows:
//! - [`ffi`]: the NCCL net-plugin ABI as data (bindgen types, result codes) and the one
//!   client of a loaded net plugin, a leaf that wrap mode and the harness build on;
//! - [`abi`]: the C entry points NCCL calls (`ncclNetPlugin_v8`..`v12`), thin adapters over
//!   [`runtime`], built at the first `init` and released at the last `finalize`, which owns
//!   the transport, the loss engine, contexts and connections;
//! - [`transport`]: moves bytes (our TCP sockets, or another plugin wrapped) behind one trait;
//! - [`loss`]: pure loss models and effects that decide and apply what a lost packet does;
//! - [`stats`]: counters and histograms of what was lost;
//! - [`ids`]: the collective and phase names loss rules and statistics share (a leaf).
//!
//! The `lossy` command and the CPU harness that drives this library the way NCCL's proxy
//! does live in the workspace member crate `cli/` (package `lossy-cli`), which depends on
//! this one; nothing here depends on them.

pub mod abi;
pub mod error;
pub mod ffi;
pub mod ids;
pub mod log;
pub mod loss;
pub mod profile;
pub mod runtime;
pub mod stats;
pub mod switches;
pub mod transport;

pub use error::{Error, ErrorKind, Result};
