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

// Public: what the `lossy` command, the harness, the benches and the examples build on.
pub mod env;
pub mod error;
pub mod ffi;
pub mod files;
pub mod loss;
pub mod profile;
pub mod stats;
pub mod transport;

// Internal: NCCL reaches these only through the exported C symbols (`#[no_mangle]`, exported
// from the cdylib whatever the module's visibility).
pub(crate) mod abi;
pub(crate) mod ids;
pub(crate) mod log;
pub(crate) mod runtime;
pub(crate) mod switches;
#[cfg(test)]
pub(crate) mod test_child;

pub use error::{Error, ErrorKind, Result};
pub use runtime::{
    check_forced_protocol, check_output_dirs_in_place, check_p2p_ll, check_stats_dir,
    trace_capacity, trace_setting, unguarded_ll_warning, unknown_comm_size_warning,
    unused_stats_interval_warning, wrap_target, P2pLlSettings, TraceSetting, CARGO_LIBRARY_NAME,
    INNER_ENV, INTRA_NODE_THROUGH_NET, NCCL_LIBRARY_NAME, PLUGIN_NAME,
};
