//! How long a v11/v12 context stays usable after its `finalize`. NCCL 2.28.3 splits a
//! communicator with `splitShare` by giving the child the parent's proxy thread, which keeps
//! the parent's context (`ncclProxyCreate`, src/proxy.cc: `proxyState->netContext =
//! comm->netContext`), and finalizes each communicator's own context when it is destroyed
//! (`commFree`, src/init.cc: `ncclNetFinalize(comm)`, whatever the shared proxy still
//! holds). A parent destroyed before its child leaves the child's later connections
//! (made lazily, at first use) going through `listen`/`connect` with the parent's finalized
//! context (src/transport/net.cc). NCCL's Socket and IB plugins ignore the context, so that
//! works there; it must work here (2.28.3 drives the v11 table). Once the last context is
//! finalized, no shared proxy is left (it goes before the last `finalize`), and a finalized
//! context is an error. NCCL 2.30 (v12) shares a parent's context with its children and
//! finalizes it once: a v12 context is freed at its `finalize`.
//!
//! Each case runs in a process of its own, so that no other test's context holds the plugin.

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use common::{say, Peer};
use nccl_net_lossy::ffi::{ncclNetProperties_v12_t, ncclNet_v12_t, ncclResult_t};

const OK: ncclResult_t = ncclResult_t::ncclSuccess;
const CHILD: &str = "context_lifetime_child";

/// `listen` on `ctx`: its code, closing the listen comm it made (if any).
fn listen_code(t: &ncclNet_v12_t, ctx: *mut c_void) -> ncclResult_t {
    let mut handle = [0u8; 128];
    let mut lc = null_mut();
    // SAFETY: a 128-byte handle buffer and a valid out-pointer; `ctx` is the situation under
    // test (a context the plugin made, finalized or not).
    let rc = unsafe { t.listen.expect("listen")(ctx, 0, handle.as_mut_ptr().cast(), &mut lc) };
    if !lc.is_null() {
        // SAFETY: the listen comm just made, closed once.
        assert_eq!(unsafe { t.closeListen.expect("closeListen")(lc) }, OK);
    }
    rc
}

/// Runs `role` in a process of its own and checks that it got to the end.
fn run(role: &str) {
    let lossless = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/lossless.toml");
    let mut peer = Peer::spawn(
        CHILD,
        role,
        &[
            ("NCCL_SOCKET_IFNAME", "lo"),
            ("NCCL_LOSSY_PROFILE", lossless),
            ("RANK", "0"),
        ],
    );
    peer.expect_line("OK");
    assert!(peer.wait().success(), "the {role} child failed");
}

#[test]
fn a_parents_finalized_context_still_connects_its_split_childs_comms() {
    run("split");
}

#[test]
fn after_the_last_finalize_a_context_is_an_error_even_when_its_memory_is_reused() {
    run("reuse");
}

#[test]
fn a_v12_context_is_freed_at_its_finalize_while_another_holds_the_plugin() {
    run("v12");
}

#[test]
fn a_v11_context_finalized_last_while_another_init_runs_is_an_error_afterwards() {
    run("race");
}

/// The link speed the plugin reports for device 0: read from `NCCL_LOSSY_SPEED_MBPS` when
/// its runtime is built, so it tells which build answers.
fn speed(t: &ncclNet_v12_t) -> i32 {
    let mut props = ncclNetProperties_v12_t::default();
    // SAFETY: a valid, writable properties struct of the table's version.
    let rc = unsafe { t.getProperties.expect("getProperties")(0, &mut props) };
    assert_eq!(rc, OK, "getProperties");
    props.speed
}

/// The v11 table (NCCL 2.28-2.29), seen through the v12 type the helpers take.
fn table_v11() -> &'static ncclNet_v12_t {
    // SAFETY: ncclNetPlugin_v11 has the v12 table's layout (the same entry points in the same
    // order; only getProperties' properties type differs, which these tests never call).
    unsafe { common::library_table::<ncclNet_v12_t>("ncclNetPlugin_v11") }
}

/// The cases above, each in its own process.
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn context_lifetime_child() {
    let Ok(role) = std::env::var(common::ROLE_ENV) else {
        return;
    };
    let t = common::table_v12();
    match role.as_str() {
        "split" => {
            let t = table_v11();
            // NCCL 2.28.3's order: the parent's init, the child's (splitShare: the child's
            // own context, which the shared proxy never uses), the parent destroyed first.
            let parent = common::raw_context(t, 0x2283, None);
            let child = common::raw_context(t, 0x2284, None);
            // A connect of the child's under way through the shared proxy when the parent is
            // destroyed (its peer has not accepted yet): it goes on after the finalize, with
            // the same handle, as NCCL's plugins (which keep a connect's state in the handle)
            // let it.
            let mut handle = [0u8; 128];
            let mut early_lc = null_mut();
            // SAFETY: a 128-byte handle buffer and a valid out-pointer, as NCCL passes them.
            let rc = unsafe {
                t.listen.expect("listen")(parent, 0, handle.as_mut_ptr().cast(), &mut early_lc)
            };
            assert_eq!(rc, OK, "listen");
            let mut connect = |sc: &mut *mut c_void| {
                let mut dev = null_mut();
                // SAFETY: the same handle memory every call, as NCCL does; valid out-pointers.
                unsafe {
                    t.connect.expect("connect")(parent, 0, handle.as_mut_ptr().cast(), sc, &mut dev)
                }
            };
            let mut early_sc = null_mut();
            assert_eq!(connect(&mut early_sc), OK, "connect");
            // SAFETY: the parent's live context, finalized once here.
            assert_eq!(unsafe { t.finalize.expect("finalize")(parent) }, OK);
            let (early_sc, early_rc) = if early_sc.is_null() {
                common::raw_connect_pair(t, early_lc, &mut connect)
            } else {
                common::raw_connect_pair(t, early_lc, |sc: &mut *mut c_void| {
                    *sc = early_sc;
                    OK
                })
            };
            let mut data: Vec<u8> = (0..4096u32).map(|i| (i * 3 + 1) as u8).collect();
            assert!(
                common::raw_transfer(t, early_sc, early_rc, &mut data) == data,
                "the message arrived changed"
            );
            // SAFETY: live comms, each closed once.
            unsafe {
                assert_eq!(t.closeSend.expect("closeSend")(early_sc), OK);
                assert_eq!(t.closeRecv.expect("closeRecv")(early_rc), OK);
                assert_eq!(t.closeListen.expect("closeListen")(early_lc), OK);
            }
            // The child's next connection, through the shared proxy: the parent's context.
            let (sc, rc, lc) = common::raw_connected(t, parent);
            let mut data: Vec<u8> = (0..65536u32).map(|i| (i * 13 + 5) as u8).collect();
            assert!(
                common::raw_transfer(t, sc, rc, &mut data) == data,
                "the message arrived changed"
            );
            // SAFETY: live comms, each closed once; `parent` is the finalized context, a
            // second finalize of which is the misuse under test.
            unsafe {
                assert_eq!(t.closeSend.expect("closeSend")(sc), OK);
                assert_eq!(t.closeRecv.expect("closeRecv")(rc), OK);
                assert_eq!(t.closeListen.expect("closeListen")(lc), OK);
                assert_ne!(
                    t.finalize.expect("finalize")(parent),
                    OK,
                    "a context finalized twice"
                );
                // The child destroyed: the last context, the plugin released.
                assert_eq!(t.finalize.expect("finalize")(child), OK);
            }
            assert_ne!(
                listen_code(t, parent),
                OK,
                "listen on a finalized context after the last finalize"
            );
            say("OK split");
        }
        "reuse" => {
            // A driver that passes a context after the last finalize must get an error, not
            // have the plugin read freed memory: the word at the start of a freed context
            // says nothing once the allocator has handed the memory out again. Here it is
            // handed out again as a forgery of a live context (our kind word, then a pointer
            // to nothing), which a plugin that trusted the word would follow.
            const CONTEXT_WORD: u64 = 0x4c53_4e45_5443_5458;
            let ctx = common::raw_context(t, 0x5a5, None);
            // SAFETY: the only live context, finalized once: the plugin is released.
            assert_eq!(unsafe { t.finalize.expect("finalize")(ctx) }, OK);
            let forgeries = common::forged::refill(ctx, [CONTEXT_WORD, 0x10]);
            assert_ne!(listen_code(t, ctx), OK, "listen on a finalized context");
            drop(forgeries);
            say("OK reuse");
        }
        "v12" => {
            let first = common::raw_context(t, 0x2300, None);
            let second = common::raw_context(t, 0x2301, None);
            // SAFETY: a live context, finalized once here.
            assert_eq!(unsafe { t.finalize.expect("finalize")(first) }, OK);
            assert_ne!(
                listen_code(t, first),
                OK,
                "listen on a finalized v12 context"
            );
            assert_eq!(listen_code(t, second), OK, "listen on the live one");
            // SAFETY: the other live context, finalized once.
            assert_eq!(unsafe { t.finalize.expect("finalize")(second) }, OK);
            say("OK v12");
        }
        "race" => {
            // The last context's finalize races another communicator's init. When the init
            // builds a new runtime, the finalize was the last (the plugin was released): the
            // finalized context must be an error from then on, whatever the new init does
            // meanwhile. It stayed usable, with the connects it left in progress holding the
            // old runtime, when the init came while the old runtime was being retired.
            let v11 = table_v11();
            // A statistics file is written as the last finalize releases the runtime.
            let stats = common::fresh_dir("context-race-stats");
            std::env::set_var("NCCL_LOSSY_STATS", &stats);
            let (mut rebuilt, mut kept) = (0, 0);
            for i in 0..300u64 {
                // Set with no other thread running; read by each runtime build.
                std::env::set_var("NCCL_LOSSY_SPEED_MBPS", "1000");
                let last = common::raw_context(v11, 0x7000 + i, None);
                std::env::set_var("NCCL_LOSSY_SPEED_MBPS", "2000");
                let start = std::sync::Arc::new(std::sync::Barrier::new(2));
                let go = std::sync::Arc::clone(&start);
                let other = std::thread::spawn(move || {
                    go.wait();
                    let until =
                        std::time::Instant::now() + std::time::Duration::from_micros(i % 60);
                    while std::time::Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    common::raw_context(table_v11(), 0x8000 + i, None) as usize
                });
                start.wait();
                // SAFETY: the live context made above, finalized once.
                assert_eq!(unsafe { v11.finalize.expect("finalize")(last) }, OK);
                let other = other.join().expect("the init thread") as *mut c_void;
                if speed(t) == 2000 {
                    // A new runtime: `last` was the last context when it was finalized.
                    rebuilt += 1;
                    assert_ne!(
                        listen_code(v11, last),
                        OK,
                        "round {i}: a context finalized last stayed usable under the runtime \
                         an init built after it"
                    );
                } else {
                    // The init held the plugin first: `last` was not the last.
                    kept += 1;
                }
                // SAFETY: the other live context, finalized once: the plugin is released.
                assert_eq!(unsafe { v11.finalize.expect("finalize")(other) }, OK);
            }
            eprintln!("RACE {rebuilt} rebuilt, {kept} kept");
            say("OK race");
        }
        other => panic!("unknown role {other}"),
    }
}
