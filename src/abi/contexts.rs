//! The v11/v12 net contexts: made by `init`, looked up by every call that takes one, and
//! freed at `finalize` (v12) or at the last `finalize` (v11, for NCCL 2.28.3; docs/abi.md,
//! "Contexts").

use std::ffi::c_void;
use std::sync::Arc;

pub(crate) use super::handles::AfterFinalize;
use super::handles::{Kind, Live};
use super::{install_logger, net_profiler, non_null};
use crate::ffi::{ncclDebugLogger_t, ncclProfilerCallback_t};
use crate::runtime::{Context, Hold, Runtime};
use crate::Result;

/// Net contexts handed out by [`init_context`]: live, or finalized while another context
/// still holds the plugin (see [`finalize_context`]).
static LIVE_CONTEXTS: Live = Live::new(Kind::Context);

/// Frees the finalized contexts and forgets the rest (the library is being unloaded).
pub(super) fn forget_at_unload() {
    free_finalized_contexts();
    LIVE_CONTEXTS.forget_all();
}

/// A v11/v12 context as NCCL holds it: the kind word, then the context.
#[repr(C)]
struct AbiContext {
    kind: Kind,
    ctx: Arc<Context>,
}

/// `init` of v11/v12: one context per communicator.
pub(super) fn init_context(
    ctx_out: *mut *mut c_void,
    comm_id: u64,
    traffic_class: Option<i32>,
    logger: ncclDebugLogger_t,
    profiler: ncclProfilerCallback_t,
    after_finalize: AfterFinalize,
) -> Result<()> {
    let ctx_out = non_null(ctx_out, "ctx")?;
    install_logger(logger);
    // Held until this context's finalize.
    let runtime = Runtime::acquire(Hold::Counted, logger)?;
    let number = runtime.number_context();
    let ctx = Context::new(comm_id, number, traffic_class, runtime.takes_net_attr());
    crate::ffi::net::profiler::set_nccl_callback(profiler);
    ctx.set_profiler(net_profiler::from_callback(profiler));
    let ptr = Box::into_raw(Box::new(AbiContext {
        kind: Kind::Context,
        ctx,
    }));
    LIVE_CONTEXTS.add(ptr, after_finalize);
    // SAFETY: NCCL passes a valid pointer to where it keeps the context (checked non-NULL).
    unsafe { *ctx_out = ptr.cast() };
    Ok(())
}

/// The context behind the v11/v12 `ctx` pointer `what` was given: one [`init_context`]
/// made and the plugin still holds (finalized or not: see [`finalize_context`]; anything
/// else is an error, and is not read), or, for NULL, the process's implicit context (the one
/// v8-v10 use: NCCL's Socket plugin ignores the context, so a driver may pass none).
pub(super) fn context_of(ctx: *mut c_void, what: &str) -> Result<Arc<Context>> {
    if ctx.is_null() {
        return Ok(Context::implicit());
    }
    LIVE_CONTEXTS.read(ctx, what, || {
        // SAFETY: `ctx` is in the list, so it is an AbiContext made at init and not freed:
        // only [`free_finalized_contexts`] frees one, after taking it out of the list under
        // the lock held here.
        Arc::clone(unsafe { &(*ctx.cast::<AbiContext>()).ctx })
    })
}

/// `finalize` of v11/v12: gives back the context's hold on the runtime (the last one releases
/// it, and frees every finalized context with the connects it left in progress; its comms
/// hold their own references).
///
/// A v11 context (NCCL 2.28-2.29) stays usable until the last context is finalized, its
/// connects in progress included, as with NCCL's own plugins, which ignore the context (and
/// keep a connect's state in its handle): NCCL 2.28.3 gives a communicator split off with
/// `splitShare` its parent's proxy thread, which keeps the parent's context
/// (`ncclProxyCreate`, src/proxy.cc), and finalizes each communicator's context when that
/// communicator is destroyed (`commFree`, src/init.cc), so a parent destroyed first leaves
/// the child's later connections calling `listen`/`connect`/`setNetAttr` with the parent's
/// finalized context (src/transport/net.cc). By the last `finalize` the shared proxy is
/// gone (`commFree` destroys it first), and every finalized context is freed. A v12 context
/// (NCCL 2.30+, which shares a parent's context with its children and finalizes it once,
/// `ncclNetInitFromParent`) is freed at its `finalize`, with its connects in progress: a
/// process that makes and destroys many communicators keeps none of them. A context
/// finalized twice is an error.
///
/// NULL is nothing to finalize, as a NULL close is nothing to close: NCCL 2.28-2.29.3
/// finalizes the context a failed `init` left NULL (`ncclNetPluginInit`'s `fail:` path in
/// src/plugin/net.cc). Any other pointer that is not a live context (foreign, finalized
/// already) is an error.
pub(super) fn finalize_context(ctx: *mut c_void) -> Result<()> {
    if ctx.is_null() {
        return Ok(());
    }
    if LIVE_CONTEXTS.finalize(ctx)? == AfterFinalize::Free {
        // SAFETY: an AbiContext made at init, now out of the list, so nothing reads it
        // through the list and nothing else frees it.
        let context = unsafe { Box::from_raw(ctx.cast::<AbiContext>()) };
        context.ctx.abandon_pending();
    }
    release_hold()
}

/// Gives back one hold on the runtime (a net context's or a tuner's); when it was the last,
/// frees the finalized net contexts: nothing passes them once the plugin is released. They
/// are taken out of the list as the runtime is released, under its lock: an `init` on another
/// thread that builds the next runtime meanwhile neither keeps them alive with it nor has its
/// own finalized contexts taken (`cli/tests/context_lifetime.rs`).
pub(super) fn release_hold() -> Result<()> {
    let finalized = Runtime::release(|| LIVE_CONTEXTS.drain_finalized())?;
    free_contexts(finalized.unwrap_or_default());
    Ok(())
}

/// Frees the finalized contexts and drops the connects they left in progress (each holds its
/// context: dropped with it, they would keep it, and its sockets, for the process's life).
/// The runtime is gone, or the library is being unloaded: nothing passes them any more.
fn free_finalized_contexts() {
    free_contexts(LIVE_CONTEXTS.drain_finalized());
}

/// Frees contexts [`Live::drain_finalized`] took out of the list.
fn free_contexts(finalized: Vec<usize>) {
    for addr in finalized {
        // SAFETY: each was an AbiContext made by `init_context` (Box::into_raw), finalized,
        // and is now out of the list, so nothing reads it through the list, and nothing else
        // frees it.
        let context = unsafe { Box::from_raw(addr as *mut AbiContext) };
        context.ctx.abandon_pending();
    }
}
