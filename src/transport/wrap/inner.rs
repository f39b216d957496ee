//! Loading the wrapped ("inner") net plugin: resolves its name as NCCL resolves
//! `NCCL_NET_PLUGIN`, tells a copy of this library that it runs wrapped, and initialises it
//! through the one net-plugin client ([`crate::ffi::net`]), which adapts whichever table
//! version (v8 to v12) it exports.

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::ffi::net::{NetComm, NetContext, NetLibrary, NetPlugin, NEWEST_VERSION, OLDEST_VERSION};
use crate::ffi::{ncclDebugLogger_t, HANDLE_BYTES};
use crate::{log, Error, Result};

/// A loaded, initialised inner net plugin with its one process-wide context. Its library is
/// never `dlclose`d: NCCL may unload us while the inner plugin's own threads wind down, and
/// a second load reuses the same image.
pub struct InnerPlugin {
    /// The plugin, its table adapted into the current shape.
    pub net: NetPlugin,
    /// The context its `init` returned (taken by `finalize` when this is dropped).
    ctx: Option<NetContext>,
    /// The file that was loaded.
    pub path: PathBuf,
}

/// The file names tried for `spec`, as NCCL resolves `NCCL_NET_PLUGIN`: a path as given;
/// a name as given, then as `libnccl-net-<name>.so`.
pub fn candidates(spec: &str) -> Vec<String> {
    let spec = spec.trim();
    if spec.contains('/') || (spec.starts_with("lib") && spec.contains(".so")) {
        vec![spec.to_string()]
    } else {
        vec![spec.to_string(), format!("libnccl-net-{spec}.so")]
    }
}

impl InnerPlugin {
    /// Loads the plugin named by `spec` (a path, or a name like "ib"), tells it that it runs
    /// wrapped when it is a copy of this library (`ncclLossyInnerMode`), and initialises it.
    pub fn open(spec: &str, logger: ncclDebugLogger_t) -> Result<InnerPlugin> {
        Self::open_up_to(spec, logger, NEWEST_VERSION)
    }

    /// As [`InnerPlugin::open`], using no table newer than `ncclNetPlugin_v{newest}` (tests
    /// drive the older version adapters with it).
    pub fn open_up_to(spec: &str, logger: ncclDebugLogger_t, newest: u32) -> Result<InnerPlugin> {
        let mut tried = Vec::new();
        let mut loaded = None;
        for name in candidates(spec) {
            // SAFETY: the user named this file as the NCCL net plugin to wrap, which NCCL
            // would load and trust the same way.
            match unsafe { NetLibrary::open(Path::new(&name)) } {
                Ok(lib) => {
                    loaded = Some((lib.keep_loaded(), name));
                    break;
                }
                Err(err) => tried.push(err.message),
            }
        }
        let Some((lib, file)) = loaded else {
            return Err(Error::invalid_argument(format!(
                "cannot load the inner net plugin {spec:?} (tried {})",
                tried.join("; ")
            )));
        };
        let lib = Arc::new(lib);
        let net = NetPlugin::load(Arc::clone(&lib), OLDEST_VERSION..=newest)
            .map_err(|e| Error::new(e.kind, format!("inner net plugin {}", e.message)))?;
        // SAFETY: a copy of this library exports `ncclLossyInnerMode` as
        // `extern "C" fn() -> c_int`; the pointer is used while the library is loaded.
        if let Some(set) = unsafe { lib.function::<extern "C" fn() -> c_int>("ncclLossyInnerMode") }
        {
            set();
        }
        let ctx = net.init(0, logger)?;
        Ok(InnerPlugin {
            net,
            ctx: Some(ctx),
            path: PathBuf::from(file),
        })
    }

    /// The plugin's own name (its `name` field, e.g. "IB", "AWS Libfabric").
    pub fn name(&self) -> &str {
        self.net.name()
    }

    /// The ABI version used (8 to 12).
    pub fn version(&self) -> u32 {
        self.net.version()
    }

    fn ctx(&self) -> Result<&NetContext> {
        self.ctx
            .as_ref()
            .ok_or_else(|| Error::internal("inner net plugin already finalized"))
    }

    /// Starts listening on `dev`; the plugin writes its connection handle into `handle`.
    pub fn listen(&self, dev: usize, handle: &mut [u8; HANDLE_BYTES]) -> Result<NetComm> {
        self.net.listen(self.ctx()?, dev, handle)
    }

    /// Advances a connect: `Ok(None)` until the send comm is ready.
    ///
    /// # Safety
    /// As [`NetPlugin::connect`]: every call for one connection passes the same `handle`
    /// memory, unchanged in between.
    pub unsafe fn connect(
        &self,
        dev: usize,
        handle: &mut [u8; HANDLE_BYTES],
    ) -> Result<Option<NetComm>> {
        // SAFETY: per this function's contract.
        unsafe { self.net.connect(self.ctx()?, dev, handle) }
    }
}

impl Drop for InnerPlugin {
    fn drop(&mut self) {
        // Every comm holds an Arc to this plugin, so all are closed by now.
        if let Some(ctx) = self.ctx.take() {
            if let Err(err) = self.net.finalize(ctx) {
                log::warn(&err.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_like_nccl_net_plugin() {
        assert_eq!(candidates("ib"), ["ib", "libnccl-net-ib.so"]);
        assert_eq!(candidates("/opt/x/libfoo.so"), ["/opt/x/libfoo.so"]);
        assert_eq!(candidates("libnccl-net-ofi.so"), ["libnccl-net-ofi.so"]);
        assert_eq!(
            candidates(" aws-ofi "),
            ["aws-ofi", "libnccl-net-aws-ofi.so"]
        );
    }

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let err = InnerPlugin::open("/nonexistent/libnccl-net-nothing.so", None)
            .err()
            .expect("must fail");
        assert!(
            err.message.contains("cannot load the inner net plugin")
                && err.message.contains("/nonexistent/libnccl-net-nothing.so"),
            "{err}"
        );
    }
}
