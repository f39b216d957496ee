//! Loading the wrapped ("inner") net plugin: resolves its name as NCCL resolves
//! `NCCL_NET_PLUGIN`, tells a copy of this library that it runs wrapped, and initialises it
//! through the one net-plugin client ([`crate::ffi::net`]), which adapts whichever table
//! version (v6 to v12) it exports.

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::ffi::net::{
    profiler, NetComm, NetContext, NetLibrary, NetPlugin, NEWEST_VERSION, OLDEST_VERSION,
};
use crate::ffi::{ncclDebugLogger_t, ncclNetAttr_v11_t, HANDLE_BYTES};
use crate::{log, Error, Result};

/// A loaded, initialised inner net plugin and its contexts, one per traffic class in use.
/// Its library is never `dlclose`d: NCCL may unload us while the inner plugin's own threads
/// wind down, and a second load reuses the same image.
pub struct InnerPlugin {
    /// The plugin, its table adapted into the current shape.
    pub net: NetPlugin,
    /// The contexts made so far, the first one (no traffic class) at load: a v11+ plugin
    /// gets a communicator's traffic class in its `init`, so each class has its own context
    /// (all with communicator id 0); older plugins are initialised once and take the class
    /// at `connect` (v10) or not at all. Finalized when this is dropped.
    contexts: Mutex<Vec<Arc<NetContext>>>,
    /// NCCL's logger, for the `init` of a context made later.
    logger: ncclDebugLogger_t,
    /// The file that was loaded.
    pub path: PathBuf,
    /// Whether it is a copy of this library (it exports `ncclLossyInnerMode`), whose handles
    /// are those of this library's own socket transport.
    pub lossy_copy: bool,
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

/// Loads the library `spec` names (see [`candidates`]) and reads its newest net table up to
/// `ncclNetPlugin_v{newest}`, without initialising it; `keep`: the library stays loaded for
/// good (see [`InnerPlugin`]). Returns the library, the plugin and the file that was loaded.
fn load(spec: &str, newest: u32, keep: bool) -> Result<(Arc<NetLibrary>, NetPlugin, String)> {
    let mut tried = Vec::new();
    let mut loaded = None;
    for name in candidates(spec) {
        refuse_special_file(Path::new(&name))?;
        // SAFETY: the user named this file as the NCCL net plugin to wrap, which NCCL
        // would load and trust the same way.
        match unsafe { NetLibrary::open(Path::new(&name)) } {
            Ok(lib) => {
                loaded = Some((if keep { lib.keep_loaded() } else { lib }, name));
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
    Ok((lib, net, file))
}

/// What [`check_loadable`] found of a plugin to wrap.
#[derive(Debug, PartialEq, Eq)]
pub enum InnerCheck {
    /// It loads and exports a net table: the file that was loaded.
    Loads(PathBuf),
    /// No such file here (the message says what was tried). It may still exist where the job
    /// runs (another node): a launcher warns instead of refusing.
    NotHere(String),
}

/// Checks, before a job starts, that the plugin `spec` names would load as the inner plugin
/// of wrap mode: a regular file the loader opens, exporting a net table of NCCL's v6 to v12.
/// Loads the library (its initialisers run) but does not initialise the plugin, and unloads
/// it again. An error: the file is there but is no net plugin this library can wrap.
pub fn check_loadable(spec: &str) -> Result<InnerCheck> {
    match load(spec, NEWEST_VERSION, false) {
        Ok((_lib, _net, file)) => Ok(InnerCheck::Loads(PathBuf::from(file))),
        Err(err) if absent(spec) => Ok(InnerCheck::NotHere(err.message)),
        Err(err) => Err(err),
    }
}

/// No file `spec` names exists here: a path that is not there, or a name no candidate of
/// which the loader finds (its error for each says "No such file").
fn absent(spec: &str) -> bool {
    candidates(spec).iter().all(|name| {
        if name.contains('/') {
            !Path::new(name).exists()
        } else {
            // SAFETY: as in `load`: the file the user named as the plugin to wrap.
            match unsafe { NetLibrary::open(Path::new(name)) } {
                Ok(_) => false,
                Err(err) => err.message.contains("No such file"),
            }
        }
    })
}

/// Refuses a path (one with a `/`, which the loader opens as given) that names something
/// other than a regular file: `dlopen` opens the file with a blocking `open`, so a FIFO would
/// hang the caller (NCCL's `init`) forever, and a device or directory is no library either.
/// A bare name is searched by the loader and left to it.
fn refuse_special_file(path: &Path) -> Result<()> {
    if !path.as_os_str().as_encoded_bytes().contains(&b'/') {
        return Ok(());
    }
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => Err(Error::invalid_argument(format!(
            "{}: not a regular file ({}); a net plugin library must be a regular file (a \
             shared object)",
            path.display(),
            crate::files::file_kind(&meta.file_type())
        ))),
        // A missing file and the like: dlopen says why in its own words.
        _ => Ok(()),
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
        let (lib, net, file) = load(spec, newest, true)?;
        // SAFETY: a copy of this library exports `ncclLossyInnerMode` as
        // `extern "C" fn() -> c_int`; the pointer is used while the library is loaded.
        let set = unsafe { lib.function::<extern "C" fn() -> c_int>("ncclLossyInnerMode") };
        if let Some(set) = set {
            set();
        }
        // NCCL hands a v10+ plugin's `init` its profiler callback, never NULL: the inner
        // plugin gets one that relays to NCCL's (crate::ffi::net::profiler).
        let ctx = net.init_profiled(0, logger, profiler::relay())?;
        Ok(InnerPlugin {
            net,
            contexts: Mutex::new(vec![Arc::new(ctx)]),
            logger,
            path: PathBuf::from(file),
            lossy_copy: set.is_some(),
        })
    }

    /// The plugin's own name (its `name` field, e.g. "IB", "AWS Libfabric").
    pub fn name(&self) -> &str {
        self.net.name()
    }

    /// The ABI version used (6 to 12).
    pub fn version(&self) -> u32 {
        self.net.version()
    }

    fn contexts(&self) -> MutexGuard<'_, Vec<Arc<NetContext>>> {
        // A poisoned lock only means a thread panicked while holding it; the list is whole.
        self.contexts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The context of communicators of traffic class `traffic_class`, made on first use.
    fn context(&self, traffic_class: Option<i32>) -> Result<Arc<NetContext>> {
        let mut contexts = self.contexts();
        if let Some(ctx) = contexts.iter().find(|c| c.traffic_class() == traffic_class) {
            return Ok(Arc::clone(ctx));
        }
        let ctx = match self.net.class_context(traffic_class) {
            Some(ctx) => ctx,
            None => self
                .net
                .init_for_class(0, traffic_class, self.logger, profiler::relay())?,
        };
        let ctx = Arc::new(ctx);
        contexts.push(Arc::clone(&ctx));
        Ok(ctx)
    }

    /// `setNetAttr` in the context of traffic class `traffic_class` (v11+; older plugins have
    /// no such call, and NCCL ignores its outcome, so a refusal is only logged).
    pub fn set_net_attr(&self, traffic_class: Option<i32>, attr: &ncclNetAttr_v11_t) {
        if self.net.version() < 11 {
            return;
        }
        let set = self
            .context(traffic_class)
            .and_then(|ctx| self.net.set_net_attributes(&ctx, attr));
        if let Err(err) = set {
            log::warn(&format!("wrap mode: {err}"));
        }
    }

    /// Starts listening on `dev` for a communicator of traffic class `traffic_class`; the
    /// plugin writes its connection handle into `handle`.
    pub fn listen(
        &self,
        dev: usize,
        traffic_class: Option<i32>,
        handle: &mut [u8; HANDLE_BYTES],
    ) -> Result<NetComm> {
        self.net.listen(&*self.context(traffic_class)?, dev, handle)
    }

    /// Advances a connect for a communicator of traffic class `traffic_class`: `Ok(None)`
    /// until the send comm is ready.
    ///
    /// # Safety
    /// As [`NetPlugin::connect`]: every call for one connection passes the same `handle`
    /// memory, unchanged in between.
    pub unsafe fn connect(
        &self,
        dev: usize,
        traffic_class: Option<i32>,
        handle: &mut [u8; HANDLE_BYTES],
    ) -> Result<Option<NetComm>> {
        let ctx = self.context(traffic_class)?;
        // SAFETY: per this function's contract.
        unsafe { self.net.connect(&ctx, dev, handle) }
    }
}

impl Drop for InnerPlugin {
    fn drop(&mut self) {
        // Every comm holds an Arc to this plugin, so all are closed by now, and only the list
        // holds the contexts (a listen or connect holds one for its call alone).
        let contexts = std::mem::take(&mut *self.contexts());
        for ctx in contexts {
            let Ok(ctx) = Arc::try_unwrap(ctx) else {
                log::warn("wrap mode: an inner net plugin context still in use at the end");
                continue;
            };
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
