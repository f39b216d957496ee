//! The protocol guard as NCCL drives it: the library's `ncclTunerPlugin_v6` table, opened
//! with `dlopen`, `init` for a communicator, `getCollInfo` on NCCL's cost table, `finalize`.
//! One test in this binary: it sets `NCCL_LOSSY_PROFILE` for the process, which the plugin's
//! runtime reads when the first `init` builds it.

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use nccl_net_lossy::ffi::{ncclResult_t, ncclTuner_v6_t};

const OK: ncclResult_t = ncclResult_t::ncclSuccess;
/// NCCL's protocol indices (LL, LL128, Simple) and the marker for a pair it must not use.
const LL: usize = 0;
const LL128: usize = 1;
const SIMPLE: usize = 2;
const IGNORE: f32 = -1.0;
const ALGOS: usize = 7;
const PROTOS: usize = 3;

fn table() -> &'static ncclTuner_v6_t {
    // SAFETY: ncclTunerPlugin_v6 is a ncclTuner_v6_t in our headers.
    unsafe { common::library_table::<ncclTuner_v6_t>("ncclTunerPlugin_v6") }
}

/// One all-reduce of 1 MiB's `getCollInfo` on `costs`, NCCL's algorithms x protocols table.
///
/// # Safety
/// `ctx` is what the misuse under test needs it to be: a live context, or readable memory.
unsafe fn coll_info(t: &ncclTuner_v6_t, ctx: *mut c_void, costs: &mut [f32]) -> ncclResult_t {
    let mut channels = 0;
    // SAFETY: the table cast to `float**` as NCCL passes it (src/enqueue.cc); `ctx` per this
    // function's contract; a valid out-pointer.
    unsafe {
        t.getCollInfo.expect("getCollInfo")(
            ctx,
            4, // ncclFuncAllReduce
            1 << 20,
            1,
            costs.as_mut_ptr().cast(),
            ALGOS as i32,
            PROTOS as i32,
            0,
            &mut channels,
        )
    }
}

/// One communicator's tuner: init, one all-reduce's cost table, finalize (twice: the second
/// must be refused). Returns the cost table as the tuner left it.
fn costs_after_one_collective(t: &ncclTuner_v6_t) -> Vec<f32> {
    let mut ctx: *mut c_void = null_mut();
    // SAFETY: valid out-pointer; NULL logger and NVLink/constants structs are allowed.
    let rc = unsafe { t.init.expect("init")(&mut ctx, 0x7e57, 8, 1, None, null_mut(), null_mut()) };
    assert_eq!(rc, OK, "tuner init");
    let mut costs = vec![1.0f32; ALGOS * PROTOS];
    // SAFETY: the live context init returned.
    let rc = unsafe { coll_info(t, ctx, &mut costs) };
    assert_eq!(rc, OK, "getCollInfo");
    // SAFETY: the context init returned, finalized once; the second call is the misuse under
    // test (a double free before).
    unsafe {
        assert_eq!(t.finalize.expect("finalize")(ctx), OK, "finalize");
        assert_ne!(t.finalize.expect("finalize")(ctx), OK, "finalize twice");
    }
    // A finalized context whose memory was handed out again (as a forgery of a live one
    // that rules LL out) is refused, not read: NCCL never does this, but a tuner that
    // trusted the context's first word would edit the cost table of a communicator it no
    // longer knows.
    const TUNER_WORD: u64 = 0x4c53_5455_4e43_5458;
    let forgeries = common::forged::refill(ctx, [TUNER_WORD, 1]);
    let mut after = vec![1.0f32; ALGOS * PROTOS];
    // SAFETY: `ctx` is the finalized context, now the forgery's memory (readable): the
    // misuse under test.
    let rc = unsafe { coll_info(t, ctx, &mut after) };
    assert_ne!(rc, OK, "getCollInfo on a finalized context");
    assert!(after.iter().all(|&c| c == 1.0), "{after:?}");
    drop(forgeries);
    costs
}

#[test]
fn the_guard_rules_out_ll_for_a_corrupting_profile_and_only_then() {
    let t = table();
    // A profile that zeroes lost packets: LL and LL128 would hang the receiving GPU.
    std::env::set_var(
        "NCCL_LOSSY_PROFILE",
        common::repo_file("configs/uniform-1pct.toml"),
    );
    let costs = costs_after_one_collective(t);
    for algo in 0..ALGOS {
        let row = &costs[algo * PROTOS..(algo + 1) * PROTOS];
        assert_eq!(
            (row[LL], row[LL128], row[SIMPLE]),
            (IGNORE, IGNORE, 1.0),
            "algorithm {algo}"
        );
    }
    // The runtime went with the last finalize; the next init builds it from this profile,
    // which only retransmits: NCCL's choice is left alone.
    std::env::set_var(
        "NCCL_LOSSY_PROFILE",
        common::repo_file("configs/retransmit-1pct.toml"),
    );
    let costs = costs_after_one_collective(t);
    assert!(costs.iter().all(|&c| c == 1.0), "{costs:?}");
}
