//! Rules on `traffic_class` match the class NCCL gives: v11+ pass it to `init` with the
//! communicator's config, v10 (NCCL 2.26-2.27) to every `connect`. Driven raw, as NCCL calls
//! the tables (the data path through v12's, the same functions as v10's), under a profile
//! that loses every packet of class 5 (as zeros) and nothing else. One test in this binary:
//! the profile is read from the environment when the plugin's runtime starts, once per
//! process.

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use nccl_net_lossy::ffi::{ncclNetCommConfig_v10_t, ncclNet_v10_t, ncclNet_v12_t, ncclResult_t};

const OK: ncclResult_t = ncclResult_t::ncclSuccess;

const PROFILE: &str = r#"
seed = 1
mtu = 4096
model = { kind = "none" }

[[rules]]
name = "class 5"
traffic_class = 5
effect = "zero"
model = { kind = "uniform", rate = 1.0 }
"#;

/// Sends 64 KiB of non-zero bytes from `sc` to `rc`: what arrived.
fn transfer(t: &ncclNet_v12_t, sc: *mut c_void, rc: *mut c_void) -> Vec<u8> {
    let mut data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 + 1).collect();
    common::raw_transfer(t, sc, rc, &mut data)
}

/// What a connection of traffic class `class` delivers: intact, or all zeros (lost).
fn delivered(got: &[u8]) -> &'static str {
    if got.iter().all(|&b| b == 0) {
        "zeros"
    } else if got
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i % 251) as u8 + 1)
    {
        "intact"
    } else {
        "damaged"
    }
}

#[test]
fn traffic_class_rules_match_the_class_init_v11_and_connect_v10_are_given() {
    let dir = common::fresh_dir("traffic-class");
    let profile = dir.join("profile.toml");
    std::fs::write(&profile, PROFILE).expect("write the profile");
    // Before the library's runtime starts (this binary's only test).
    std::env::set_var("NCCL_LOSSY_PROFILE", &profile);
    std::env::remove_var("NCCL_LOSSY_SET");

    // SAFETY: the tables are the C types of our headers.
    let v10 = unsafe { common::library_table::<ncclNet_v10_t>("ncclNetPlugin_v10") };
    // SAFETY: as above.
    let v12 = unsafe { common::library_table::<ncclNet_v12_t>("ncclNetPlugin_v12") };

    // v10: one implicit context; the class comes with each connect (NULL: none).
    // SAFETY: NULL logger and profiler are allowed.
    assert_eq!(unsafe { v10.init.expect("init")(None, None) }, OK);
    for (class, expect) in [(Some(5), "zeros"), (Some(3), "intact"), (None, "intact")] {
        let mut handle = [0u8; 128];
        let mut lc = null_mut();
        // SAFETY: a 128-byte handle buffer and a valid out-pointer.
        let rc = unsafe { v10.listen.expect("listen")(0, handle.as_mut_ptr().cast(), &mut lc) };
        assert_eq!(rc, OK, "listen");
        let mut config = class.map(|c| ncclNetCommConfig_v10_t { trafficClass: c });
        let config_ptr = config.as_mut().map_or(null_mut(), |c| c as *mut _);
        let (sc, rc) = common::raw_connect_pair(v12, lc, |sc| {
            let mut dev = null_mut();
            // SAFETY: the same handle memory every call, as NCCL does; valid out-pointers.
            unsafe {
                v10.connect.expect("connect")(
                    0,
                    config_ptr,
                    handle.as_mut_ptr().cast(),
                    sc,
                    &mut dev,
                )
            }
        });
        let got = transfer(v12, sc, rc);
        assert_eq!(
            delivered(&got),
            expect,
            "v10, connect's traffic class {class:?}"
        );
        // SAFETY: comms this test made, closed once.
        unsafe {
            assert_eq!(v10.closeSend.expect("closeSend")(sc), OK);
            assert_eq!(v10.closeRecv.expect("closeRecv")(rc), OK);
            assert_eq!(v10.closeListen.expect("closeListen")(lc), OK);
        }
    }

    // v12: the class comes with init, for every connection of the context.
    for (class, expect) in [(5, "zeros"), (3, "intact")] {
        let ctx = common::raw_context(v12, 0x7c + class as u64, Some(class));
        let (sc, rc, lc) = common::raw_connected(v12, ctx);
        let got = transfer(v12, sc, rc);
        assert_eq!(delivered(&got), expect, "v12, init's traffic class {class}");
        // SAFETY: comms and context this test made, closed once.
        unsafe {
            assert_eq!(v12.closeSend.expect("closeSend")(sc), OK);
            assert_eq!(v12.closeRecv.expect("closeRecv")(rc), OK);
            assert_eq!(v12.closeListen.expect("closeListen")(lc), OK);
            assert_eq!(v12.finalize.expect("finalize")(ctx), OK);
        }
    }
}
