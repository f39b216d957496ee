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

/// One communicator's tuner: init, one all-reduce's cost table, finalize (twice: the second
/// must be refused). Returns the cost table as the tuner left it.
fn costs_after_one_collective(t: &ncclTuner_v6_t) -> Vec<f32> {
    let mut ctx: *mut c_void = null_mut();
    // SAFETY: valid out-pointer; NULL logger and NVLink/constants structs are allowed.
    let rc = unsafe { t.init.expect("init")(&mut ctx, 0x7e57, 8, 1, None, null_mut(), null_mut()) };
    assert_eq!(rc, OK, "tuner init");
    let mut costs = vec![1.0f32; ALGOS * PROTOS];
    let mut channels = 0;
    // SAFETY: NCCL's algorithms x protocols table of floats, the array itself cast to
    // `float**` as NCCL passes it (src/enqueue.cc); a live context; a valid out-pointer.
    let rc = unsafe {
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
    };
    assert_eq!(rc, OK, "getCollInfo");
    // SAFETY: the context init returned, finalized once; the second call is the misuse under
    // test (a double free before).
    unsafe {
        assert_eq!(t.finalize.expect("finalize")(ctx), OK, "finalize");
        assert_ne!(t.finalize.expect("finalize")(ctx), OK, "finalize twice");
    }
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
