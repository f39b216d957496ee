//! Finding and opening the built plugin library, and its control API (`ncclLossy*`), for
//! the harness and the `lossy` command. With [`super::plugin_client`], the only harness
//! code with `unsafe`.

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use nccl_net_lossy::ffi::net::NetLibrary;
use nccl_net_lossy::{Error, Result};

pub use nccl_net_lossy::{CARGO_LIBRARY_NAME, NCCL_LIBRARY_NAME};

/// The control API's switch for loss injection (`nccl_lossy_control.h`).
const LOSS_SWITCH: &str = "ncclLossySetEnabled";
/// Where the plugin library probably is: next to the running executable (Cargo's target
/// directory, or `bin/../lib` of an installation), or in the target directory above a test
/// binary in `deps/`.
pub fn default_library_path() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::system(format!("cannot find the running executable: {e}")))?;
    let dir = exe
        .parent()
        .ok_or_else(|| Error::system("the running executable has no directory"))?;
    library_near(dir)
}

/// The plugin library in or near `dir`: Cargo's target directory (the library itself, or
/// the copy in `deps/`), or `bin/../lib` of an installation. When several exist the newest
/// wins: `cargo test` rebuilds the copy in `deps/` without refreshing the one beside the
/// binaries, and loading that stale one would test old code.
pub fn library_near(dir: &Path) -> Result<PathBuf> {
    let candidates = [
        dir.join(CARGO_LIBRARY_NAME),
        dir.join("deps").join(CARGO_LIBRARY_NAME),
        dir.join(NCCL_LIBRARY_NAME),
        dir.join("..").join(CARGO_LIBRARY_NAME),
        dir.join("..").join("lib").join(NCCL_LIBRARY_NAME),
    ];
    candidates
        .iter()
        .filter_map(|p| {
            let modified = std::fs::metadata(p)
                .ok()
                .filter(|m| m.is_file())?
                .modified()
                .ok()?;
            Some((modified, p))
        })
        .max_by_key(|(modified, _)| *modified)
        .map(|(_, p)| p.canonicalize().unwrap_or_else(|_| p.clone()))
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "plugin library not found; looked for {} (build it with `cargo build --release`)",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// A `dlopen`ed plugin library. Closed (`dlclose`) when the last client, comm and request
/// made from it are gone, as NCCL does when its last communicator is destroyed.
pub struct PluginLibrary {
    pub(super) lib: Arc<NetLibrary>,
}

impl PluginLibrary {
    /// Opens the library at `path` with `RTLD_NOW | RTLD_LOCAL`.
    pub fn open(path: &Path) -> Result<Rc<PluginLibrary>> {
        Ok(Rc::new(PluginLibrary {
            // SAFETY: the harness drives the plugin library it is given and trusts it as NCCL
            // trusts `NCCL_NET_PLUGIN`: a net plugin built from this repository.
            lib: Arc::new(unsafe { NetLibrary::open(path)? }),
        }))
    }

    /// Opens the library [`default_library_path`] finds.
    pub fn open_default() -> Result<Rc<PluginLibrary>> {
        Self::open(&default_library_path()?)
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        self.lib.path()
    }

    /// True when the library exports `name`.
    pub fn exports(&self, name: &str) -> bool {
        self.lib.exports(name)
    }

    /// The `ncclNetPlugin_vN` versions the library exports, newest first.
    pub fn net_versions(&self) -> Vec<u32> {
        self.lib.net_versions()
    }

    /// True when the library has this project's switch for loss injection (another build of
    /// this plugin, not a third party's).
    pub fn switches_loss(&self) -> bool {
        self.exports(LOSS_SWITCH)
    }

    /// Turns loss injection on or off through the library's control API
    /// (`ncclLossySetEnabled`). The control API is this library's own: a plugin without it
    /// (a third party's, or a raw-TCP-only job's) is left as it is when loss is asked on,
    /// and only a job that needs loss off (a lossless baseline) fails, naming the symbol.
    pub fn set_loss_enabled(&self, enabled: bool) -> Result<()> {
        // SAFETY: the control header declares `int ncclLossySetEnabled(int)`; the library
        // stays loaded during the call.
        let f = unsafe {
            self.lib
                .function::<extern "C" fn(c_int) -> c_int>(LOSS_SWITCH)
        };
        let Some(f) = f else {
            return if enabled {
                Ok(())
            } else {
                Err(missing(LOSS_SWITCH).context(
                    "cannot switch loss injection off for a lossless run (a plugin without \
                     this project's control API)",
                ))
            };
        };
        match f(c_int::from(enabled)) {
            0 => Ok(()),
            code => Err(Error::internal(format!(
                "ncclLossySetEnabled returned {code}"
            ))),
        }
    }

    /// Asks the library to write its statistics file now (`ncclLossyWriteStats`); `Ok(false)`
    /// when `NCCL_LOSSY_STATS` is not set or the library has no control API (a third
    /// party's plugin keeps no statistics of ours).
    pub fn write_stats(&self) -> Result<bool> {
        // SAFETY: the control header declares `int ncclLossyWriteStats(void)`; the library
        // stays loaded during the call.
        let f = unsafe {
            self.lib
                .function::<extern "C" fn() -> c_int>("ncclLossyWriteStats")
        };
        let Some(f) = f else {
            return Ok(false);
        };
        match f() {
            0 => Ok(true),
            1 => Ok(false),
            code => Err(Error::system(format!(
                "ncclLossyWriteStats returned {code}"
            ))),
        }
    }
}

/// The error for a control-API function the library lacks.
fn missing(name: &str) -> Error {
    Error::invalid_argument(format!("the library does not export {name}"))
}
