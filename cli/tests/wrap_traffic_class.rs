//! Wrap mode hands the inner plugin the traffic class NCCL gave us, as NCCL would hand it to
//! that plugin directly: a v11+ inner plugin gets it in the `init` config of the context its
//! comms are made in, one context per class, and `setNetAttr` in that context. Driven raw through our v12 table, as NCCL calls
//! it, over the calibration plugin (tests/fixtures/inline_tcp_plugin.c), which logs the class
//! each `init` gets and the attributes each `setNetAttr` gets. One test in this binary: the plugin reads its environment once per
//! process.

mod common;

use std::ffi::c_void;

use nccl_net_lossy::ffi::{ncclNetAttr_v11_t, ncclNetCommAttr_v11_t, ncclNet_v12_t, ncclResult_t};

const OK: ncclResult_t = ncclResult_t::ncclSuccess;

/// One connection in context `ctx`, 64 KiB across it, which must arrive intact.
fn transfer_in(t: &ncclNet_v12_t, ctx: *mut c_void) {
    let (sc, rc, lc) = common::raw_connected(t, ctx);
    let mut data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 + 1).collect();
    let got = common::raw_transfer(t, sc, rc, &mut data);
    assert!(got == data, "the bytes arrived changed");
    // SAFETY: comms this function made, closed once.
    unsafe {
        assert_eq!(t.closeSend.expect("closeSend")(sc), OK);
        assert_eq!(t.closeRecv.expect("closeRecv")(rc), OK);
        assert_eq!(t.closeListen.expect("closeListen")(lc), OK);
    }
}

#[test]
fn a_v12_inner_plugin_gets_each_communicators_traffic_class_and_net_attributes() {
    let inner = common::build_fixture("wrap-traffic-class", "inline_tcp_plugin.c");
    let log = inner.with_file_name("classes.txt");
    // Before the library's runtime starts (this binary's only test).
    std::env::set_var(
        "NCCL_LOSSY_PROFILE",
        common::repo_file("configs/lossless.toml"),
    );
    std::env::set_var("NCCL_LOSSY_INNER", &inner);
    std::env::set_var("INLINE_TCP_LOG", &log);
    std::env::remove_var("NCCL_LOSSY_SET");
    // SAFETY: the table is the C type of our headers.
    let v12 = unsafe { common::library_table::<ncclNet_v12_t>("ncclNetPlugin_v12") };
    // Four communicators alive together (NCCL keeps the runtime while any is): classes 5,
    // 3, 5 again, and none.
    let classes = [Some(5), Some(3), Some(5), None];
    let contexts: Vec<_> = (0u64..)
        .zip(classes)
        .map(|(i, class)| common::raw_context(v12, 0x50 + i, class))
        .collect();
    for &ctx in &contexts {
        transfer_in(v12, ctx);
    }
    // setNetAttr, as NCCL's proxy calls it before posting a collective, with the flow hints
    // it fills: the inner plugin gets all of it, in the context of the communicator's class.
    for (&ctx, (op, flows)) in contexts.iter().zip([(4u32, 3), (8, 5)]) {
        let mut attr = ncclNetAttr_v11_t {
            sendCommAttr: ncclNetCommAttr_v11_t {
                maxFlowsPerPeer: flows,
                ..Default::default()
            },
            op,
            ..Default::default()
        };
        // SAFETY: a live context and an attribute struct that outlives the call.
        assert_eq!(
            unsafe { v12.setNetAttr.expect("setNetAttr")(ctx, &mut attr) },
            OK
        );
    }
    let (last, others) = contexts.split_last().expect("contexts");
    for &ctx in others {
        // SAFETY: a context made above, finalized once.
        assert_eq!(unsafe { v12.finalize.expect("finalize")(ctx) }, OK);
    }
    // While one communicator lives, the inner contexts all live (they are shared by class).
    let text = std::fs::read_to_string(&log).expect("the inner plugin's class log");
    assert!(!text.contains("finalize"), "{text}");
    // SAFETY: the last context made above, finalized once.
    assert_eq!(unsafe { v12.finalize.expect("finalize")(*last) }, OK);
    let text = std::fs::read_to_string(&log).expect("the inner plugin's class log");
    // Our last finalize finalizes every inner context, each once.
    let mut ends: Vec<&str> = text.lines().filter(|l| l.starts_with("finalize")).collect();
    ends.sort_unstable();
    assert_eq!(ends, ["finalize -1", "finalize 3", "finalize 5"], "{text}");
    let mut inits: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with("finalize"))
        .collect();
    // The context made when the inner plugin loads has no class (-1); then one per class
    // in use, each made once while the wrapped plugin lives.
    inits.sort_unstable();
    assert_eq!(
        inits,
        [
            "attr class 3 op 8 flows 5",
            "attr class 5 op 4 flows 3",
            "init -1",
            "init 3",
            "init 5"
        ],
        "{text}"
    );
}
