//! The protocol guard: a tuner NCCL finds in this same library (`ncclTunerPlugin_v2`..`v6`)
//! that rules out LL and LL128 while the profile has a data-corrupting effect. Those
//! protocols put flags inside the payload; a zeroed, stale or flipped packet leaves the
//! receiving GPU waiting for a flag that never comes. Simple carries no flags in the data.

use std::ffi::{c_int, c_void};

use super::ffi::{
    ncclDebugLogger_t, ncclResult_t, ncclTuner_v2_t, ncclTuner_v3_t, ncclTuner_v4_t,
    ncclTuner_v5_t, ncclTuner_v6_t, NCCL_LOSSY_ALGO_RING, NCCL_LOSSY_PROTO_LL,
    NCCL_LOSSY_PROTO_LL128, NCCL_LOSSY_PROTO_SIMPLE,
};
use super::handles::{AfterFinalize, Kind, Live};
use super::tables::Exported;
use super::{guard, non_null};
use crate::log;
use crate::runtime::{Hold, Runtime};

/// NCCL's cost-table marker for an algorithm/protocol pair it must not use.
const ALGO_PROTO_IGNORE: f32 = -1.0;

/// Per-communicator tuner state: whether this communicator's traffic must avoid LL/LL128.
#[repr(C)]
struct TunerContext {
    kind: Kind,
    force_simple: bool,
}

impl TunerContext {
    fn new(force_simple: bool) -> TunerContext {
        TunerContext {
            kind: Kind::Tuner,
            force_simple,
        }
    }
}

/// Tuner contexts handed out and not yet destroyed.
static LIVE_TUNERS: Live = Live::new(Kind::Tuner);

/// The library is being unloaded: forgets the tuner contexts (see `abi::forget_at_unload`).
pub(super) fn forget_at_unload() {
    LIVE_TUNERS.forget_all();
}

/// The tuner's `init`: holds the runtime (building it if need be) until the tuner's
/// `finalize`/`destroy`, like a net context does; records the communicator's size
/// (`comm_id`, v5+) for rules that match on it.
fn tuner_init(
    context: *mut *mut c_void,
    comm_id: Option<u64>,
    n_ranks: usize,
    logger: ncclDebugLogger_t,
) -> crate::Result<()> {
    let context = non_null(context, "context")?;
    super::install_logger(logger);
    let runtime = Runtime::acquire(Hold::Counted, logger)?;
    if let Some(comm_id) = comm_id {
        runtime.record_comm_size(comm_id, n_ranks);
    }
    let force_simple = runtime.protocol_guard_needed();
    if force_simple {
        log::info(&format!(
            "tuner: a data-corrupting loss effect is active: LL and LL128 are ruled out for this communicator ({n_ranks} ranks)"
        ));
    }
    let ctx = Box::into_raw(Box::new(TunerContext::new(force_simple)));
    LIVE_TUNERS.add(ctx, AfterFinalize::Free);
    // SAFETY: NCCL passes a valid pointer to where it keeps the tuner context.
    unsafe { *context = ctx.cast() };
    Ok(())
}

/// Whether the tuner context `context` rules out LL and LL128: an error for a pointer that
/// is not a live tuner context of ours (never made, or destroyed already: its memory may
/// hold anything by now, so it is not read). NCCL calls this for every collective; the
/// live list's lock, uncontended, is a few tens of nanoseconds of a collective's launch.
fn forces_simple(context: *mut c_void) -> crate::Result<bool> {
    let context = non_null(context, "tuner context")?;
    LIVE_TUNERS.read(context, "tuner getCollInfo", || {
        // SAFETY: in the live list, so a TunerContext our init made and not yet freed
        // (destroy takes it out of the list, under the lock held here, before freeing it).
        unsafe { (*context.cast::<TunerContext>()).force_simple }
    })
}

/// Destroys a tuner context once: another pointer, or a second destroy, is an error and
/// gives back no hold on the runtime.
fn tuner_destroy(context: *mut c_void) -> crate::Result<()> {
    let context = non_null(context, "tuner context")?;
    LIVE_TUNERS.finalize(context)?;
    // SAFETY: the Box our init created, now out of the live list, so freed only here.
    drop(unsafe { Box::from_raw(context as *mut TunerContext) });
    super::contexts::release_hold()
}

/// Marks LL and LL128 as not allowed in NCCL's cost table (a flat numAlgo x numProto array).
fn rule_out_ll(table: *mut *mut f32, num_algo: c_int, num_proto: c_int) -> crate::Result<()> {
    let table = non_null(table, "collCostTable")? as *mut f32;
    let (rows, cols) = (num_algo.max(0) as usize, num_proto.max(0) as usize);
    for algo in 0..rows {
        for proto in [NCCL_LOSSY_PROTO_LL, NCCL_LOSSY_PROTO_LL128] {
            let proto = proto as usize;
            if proto < cols {
                // SAFETY: NCCL's table holds num_algo * num_proto floats; indices are in range.
                unsafe { *table.add(algo * cols + proto) = ALGO_PROTO_IGNORE };
            }
        }
    }
    Ok(())
}

fn cost_table_info(
    context: *mut c_void,
    table: *mut *mut f32,
    num_algo: c_int,
    num_proto: c_int,
) -> crate::Result<()> {
    if forces_simple(context)? {
        rule_out_ll(table, num_algo, num_proto)?;
    }
    Ok(())
}

extern "C" fn init_v2(
    n_ranks: usize,
    _n_nodes: usize,
    logger: ncclDebugLogger_t,
    context: *mut *mut c_void,
) -> ncclResult_t {
    guard("tuner init", || tuner_init(context, None, n_ranks, logger))
}

extern "C" fn init_v5(
    context: *mut *mut c_void,
    comm_id: u64,
    n_ranks: usize,
    _n_nodes: usize,
    logger: ncclDebugLogger_t,
    _nvl: *mut super::ffi::ncclNvlDomainInfo_v5_t,
    _constants: *mut super::ffi::ncclTunerConstants_v5_t,
) -> ncclResult_t {
    guard("tuner init", || {
        tuner_init(context, Some(comm_id), n_ranks, logger)
    })
}

#[allow(clippy::too_many_arguments)]
extern "C" fn get_coll_info_v2(
    context: *mut c_void,
    _coll: c_int,
    _bytes: usize,
    _coll_net: c_int,
    _nvls: c_int,
    _pipe_ops: c_int,
    algorithm: *mut c_int,
    protocol: *mut c_int,
    _channels: *mut c_int,
) -> ncclResult_t {
    // v2 can only name a preferred pair, not forbid one: prefer ring over Simple.
    guard("tuner getCollInfo", || {
        if forces_simple(context)? {
            let (algorithm, protocol) = (
                non_null(algorithm, "algorithm")?,
                non_null(protocol, "protocol")?,
            );
            // SAFETY: NCCL passes valid out-pointers for the chosen algorithm and protocol.
            unsafe {
                *algorithm = NCCL_LOSSY_ALGO_RING as c_int;
                *protocol = NCCL_LOSSY_PROTO_SIMPLE as c_int;
            }
        }
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
extern "C" fn get_coll_info_v3(
    context: *mut c_void,
    _coll: c_int,
    _bytes: usize,
    _pipe_ops: c_int,
    table: *mut *mut f32,
    num_algo: c_int,
    num_proto: c_int,
    _channels: *mut c_int,
) -> ncclResult_t {
    guard("tuner getCollInfo", || {
        cost_table_info(context, table, num_algo, num_proto)
    })
}

#[allow(clippy::too_many_arguments)]
extern "C" fn get_coll_info_v4(
    context: *mut c_void,
    _coll: c_int,
    _bytes: usize,
    _pipe_ops: c_int,
    table: *mut *mut f32,
    num_algo: c_int,
    num_proto: c_int,
    _reg_buff: c_int,
    _channels: *mut c_int,
) -> ncclResult_t {
    guard("tuner getCollInfo", || {
        cost_table_info(context, table, num_algo, num_proto)
    })
}

extern "C" fn destroy(context: *mut c_void) -> ncclResult_t {
    guard("tuner finalize", || tuner_destroy(context))
}

#[allow(clippy::too_many_arguments)]
extern "C" fn get_chunk_size(
    _context: *mut c_void,
    _coll: c_int,
    _bytes: usize,
    _algo: c_int,
    _proto: c_int,
    _channels: c_int,
    _chunk: *mut usize,
) -> ncclResult_t {
    // Leave NCCL's chunk size as it is.
    ncclResult_t::ncclSuccess
}

const NAME: *const std::ffi::c_char = c"lossy".as_ptr();

/// Tuner API v6 (NCCL 2.30+).
#[no_mangle]
pub static ncclTunerPlugin_v6: Exported<ncclTuner_v6_t> = Exported(ncclTuner_v6_t {
    name: NAME,
    init: Some(init_v5),
    getCollInfo: Some(get_coll_info_v4),
    finalize: Some(destroy),
    getChunkSize: Some(get_chunk_size),
});

/// Tuner API v5 (NCCL 2.28-2.29).
#[no_mangle]
pub static ncclTunerPlugin_v5: Exported<ncclTuner_v5_t> = Exported(ncclTuner_v5_t {
    name: NAME,
    init: Some(init_v5),
    getCollInfo: Some(get_coll_info_v4),
    finalize: Some(destroy),
});

/// Tuner API v4.
#[no_mangle]
pub static ncclTunerPlugin_v4: Exported<ncclTuner_v4_t> = Exported(ncclTuner_v4_t {
    name: NAME,
    init: Some(init_v2),
    getCollInfo: Some(get_coll_info_v4),
    destroy: Some(destroy),
});

/// Tuner API v3.
#[no_mangle]
pub static ncclTunerPlugin_v3: Exported<ncclTuner_v3_t> = Exported(ncclTuner_v3_t {
    name: NAME,
    init: Some(init_v2),
    getCollInfo: Some(get_coll_info_v3),
    destroy: Some(destroy),
});

/// Tuner API v2.
#[no_mangle]
pub static ncclTunerPlugin_v2: Exported<ncclTuner_v2_t> = Exported(ncclTuner_v2_t {
    name: NAME,
    init: Some(init_v2),
    getCollInfo: Some(get_coll_info_v2),
    destroy: Some(destroy),
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_rules_out_exactly_the_ll_columns() {
        // 7 algorithms x 3 protocols, as NCCL 2.28 passes it.
        let mut table = vec![1.0f32; 7 * 3];
        rule_out_ll(table.as_mut_ptr().cast(), 7, 3).expect("table");
        for algo in 0..7 {
            assert_eq!(table[algo * 3], ALGO_PROTO_IGNORE);
            assert_eq!(table[algo * 3 + 1], ALGO_PROTO_IGNORE);
            assert_eq!(table[algo * 3 + 2], 1.0);
        }
    }

    #[test]
    fn context_without_guard_leaves_the_table_alone() {
        // A live context, as init makes one (only those are read).
        let ctx = Box::into_raw(Box::new(TunerContext::new(false)));
        LIVE_TUNERS.add(ctx, AfterFinalize::Free);
        let mut table = vec![2.0f32; 7 * 3];
        let rc = coll_info(ctx.cast(), &mut table);
        LIVE_TUNERS.finalize(ctx.cast()).expect("live");
        // SAFETY: the box made above, out of the live list: freed once, here.
        drop(unsafe { Box::from_raw(ctx) });
        assert_eq!(rc, ncclResult_t::ncclSuccess);
        assert!(table.iter().all(|&c| c == 2.0));
    }

    fn coll_info(context: *mut c_void, table: &mut [f32]) -> ncclResult_t {
        get_coll_info_v4(
            context,
            4,
            1 << 20,
            1,
            table.as_mut_ptr().cast(),
            7,
            3,
            0,
            std::ptr::null_mut(),
        )
    }

    #[test]
    fn a_context_that_is_not_ours_or_destroyed_is_an_error_not_a_crash() {
        // Never handed out (no tuner kind word): refused, the table untouched.
        let mut foreign = [0u64; 4];
        let mut table = vec![2.0f32; 7 * 3];
        let rc = coll_info(foreign.as_mut_ptr().cast(), &mut table);
        assert_eq!(rc, ncclResult_t::ncclInvalidArgument);
        assert!(table.iter().all(|&c| c == 2.0));
        assert!(tuner_destroy(foreign.as_mut_ptr().cast()).is_err());
        // Destroyed: a second destroy freed the box twice before (and gave back a hold on
        // the runtime it did not have); now it is refused.
        let ctx = Box::into_raw(Box::new(TunerContext::new(false)));
        LIVE_TUNERS.add(ctx, AfterFinalize::Free);
        LIVE_TUNERS.finalize(ctx.cast()).expect("live");
        // SAFETY: the box made above, out of the live list: freed once, here.
        drop(unsafe { Box::from_raw(ctx) });
        assert!(tuner_destroy(ctx.cast()).is_err());
    }
}
