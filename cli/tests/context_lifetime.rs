//! How long a v11/v12 context stays usable after its `finalize`. NCCL 2.28.3 splits a
//! communicator with `splitShare` by giving the child the parent's proxy thread, which keeps
//! the parent's context (`ncclProxyCreate`, src/proxy.cc: `proxyState->netContext =
//! comm->netContext`), and finalizes each communicator's own context when it is destroyed
//! (`commFree`, src/init.cc: `ncclNetFinalize(comm)`, whatever the shared proxy still
//! holds). A parent destroyed before its child leaves the child's later connections
//! (made lazily, at first use) going through `listen`/`connect` with the parent's finalized
//! context (src/transport/net.cc). NCCL's Socket and IB plugins ignore the context, so that
//! works there; it must work here. Once the last context is finalized, no shared proxy is
//! left (it goes before the last `finalize`), and a finalized context is an error.
//!
//! Each case runs in a process of its own, so that no other test's context holds the plugin.

mod common;

use std::ffi::c_void;
use std::ptr::null_mut;

use common::{say, Peer};
use nccl_net_lossy::ffi::{ncclNet_v12_t, ncclResult_t};

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
            // NCCL 2.28.3's order: the parent's init, the child's (splitShare: the child's
            // own context, which the shared proxy never uses), the parent destroyed first.
            let parent = common::raw_context(t, 0x2283, None);
            let child = common::raw_context(t, 0x2284, None);
            // SAFETY: the parent's live context, finalized once here.
            assert_eq!(unsafe { t.finalize.expect("finalize")(parent) }, OK);
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
        other => panic!("unknown role {other}"),
    }
}
