//! The v12 table driven raw, as a C driver would, with the pointers mixed up: a comm of one
//! kind where another is taken, NULL closes, a context finalized twice or never made, and no
//! context at all. NCCL's Socket plugin has one struct for every comm and ignores the
//! context, so these calls work or fail cleanly there; here they must fail cleanly (an error
//! code), never crash or hang, and the comms must go on working afterwards.

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use nccl_net_lossy::ffi::{ncclNet_v12_t, ncclResult_t, NCCL_PTR_HOST};

const OK: ncclResult_t = ncclResult_t::ncclSuccess;

/// Sends 64 KiB from `sc` to `rc` and checks they arrive intact.
fn transfer(t: &ncclNet_v12_t, sc: *mut c_void, rc: *mut c_void) {
    let mut data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + 3) as u8).collect();
    let got = common::raw_transfer(t, sc, rc, &mut data);
    assert!(got == data, "the message arrived changed");
}

#[test]
fn a_comm_of_the_wrong_kind_is_an_error_and_the_comms_still_work() {
    let t = common::table_v12();
    let ctx = common::raw_context(t, 0x5a1, None);
    let (sc, rc, lc) = common::raw_connected(t, ctx);
    let mut byte = [0u8; 8];
    let mut req = null_mut();
    let mut out = null_mut();
    let mut dev = null_mut();
    let mut done: c_int = 0;
    // SAFETY: every pointer is one of the plugin's live comms (of another kind than the entry
    // point takes) or a valid out-pointer: the situation under test.
    unsafe {
        let isend = t.isend.expect("isend");
        assert_ne!(
            isend(
                rc,
                byte.as_mut_ptr().cast(),
                8,
                1,
                null_mut(),
                null_mut(),
                &mut req
            ),
            OK,
            "isend(recvComm)"
        );
        assert_ne!(
            isend(
                lc,
                byte.as_mut_ptr().cast(),
                8,
                1,
                null_mut(),
                null_mut(),
                &mut req
            ),
            OK,
            "isend(listenComm)"
        );
        let mut ptr: *mut c_void = byte.as_mut_ptr().cast();
        let (mut size, mut tag, mut mr) = (8usize, 1 as c_int, null_mut());
        let irecv = t.irecv.expect("irecv");
        assert_ne!(
            irecv(
                sc,
                1,
                &mut ptr,
                &mut size,
                &mut tag,
                &mut mr,
                null_mut(),
                &mut req
            ),
            OK,
            "irecv(sendComm)"
        );
        assert_ne!(
            t.accept.expect("accept")(sc, &mut out, &mut dev),
            OK,
            "accept(sendComm)"
        );
        assert!(out.is_null(), "accept(sendComm) handed out a comm");
        assert_ne!(
            t.test.expect("test")(sc, &mut done, null_mut()),
            OK,
            "test(sendComm)"
        );
        let reg = t.regMr.expect("regMr");
        assert_ne!(
            reg(
                lc,
                byte.as_mut_ptr().cast(),
                8,
                NCCL_PTR_HOST as c_int,
                &mut out
            ),
            OK,
            "regMr(listenComm)"
        );
        assert_ne!(
            t.closeSend.expect("closeSend")(rc),
            OK,
            "closeSend(recvComm)"
        );
        assert_ne!(
            t.closeRecv.expect("closeRecv")(lc),
            OK,
            "closeRecv(listenComm)"
        );
        assert_ne!(
            t.closeListen.expect("closeListen")(sc),
            OK,
            "closeListen(sendComm)"
        );
    }
    // None of that touched the comms.
    transfer(t, sc, rc);
    // SAFETY: live comms and a live context the test made, none used again.
    unsafe { common::raw_close_all(t, sc, rc, lc, ctx) };
}

#[test]
fn closing_null_succeeds_as_with_nccls_plugins() {
    let t = common::table_v12();
    // SAFETY: NULL comms, which NCCL's Socket and IB plugins accept as "nothing to close".
    unsafe {
        assert_eq!(t.closeSend.expect("closeSend")(null_mut()), OK);
        assert_eq!(t.closeRecv.expect("closeRecv")(null_mut()), OK);
        assert_eq!(t.closeListen.expect("closeListen")(null_mut()), OK);
    }
}

#[test]
fn finalizing_null_is_nothing_to_finalize_and_leaves_live_contexts_working() {
    // NCCL 2.28-2.29.3 finalizes the context a failed init left NULL (the `fail:` path of
    // `ncclNetPluginInit` in src/plugin/net.cc); like a NULL close, that is nothing to do.
    let t = common::table_v12();
    let ctx = common::raw_context(t, 0x5a4, None);
    // SAFETY: NULL, the case under test.
    assert_eq!(unsafe { t.finalize.expect("finalize")(null_mut()) }, OK);
    // The live context kept its hold on the runtime: its comms still connect and carry data.
    let (sc, rc, lc) = common::raw_connected(t, ctx);
    transfer(t, sc, rc);
    // SAFETY: live comms and a live context the test made, none used again.
    unsafe { common::raw_close_all(t, sc, rc, lc, ctx) };
}

#[test]
fn a_context_finalized_twice_or_never_made_is_an_error() {
    let t = common::table_v12();
    let ctx = common::raw_context(t, 0x5a2, None);
    let mut foreign = [0u64; 4];
    let foreign: *mut c_void = foreign.as_mut_ptr().cast();
    let mut handle = [0u8; 128];
    let mut lc = null_mut();
    // SAFETY: a live context and a foreign pointer of 32 readable bytes; valid out-pointers.
    unsafe {
        let listen = t.listen.expect("listen");
        assert_ne!(
            listen(foreign, 0, handle.as_mut_ptr().cast(), &mut lc),
            OK,
            "listen(foreign ctx)"
        );
        assert!(lc.is_null());
        assert_ne!(
            t.finalize.expect("finalize")(foreign),
            OK,
            "finalize(foreign)"
        );
        assert_eq!(t.finalize.expect("finalize")(ctx), OK, "finalize");
        // The second finalize freed the context again: a crash, before it was an error.
        assert_ne!(t.finalize.expect("finalize")(ctx), OK, "finalize twice");
    }
}

#[test]
fn without_a_context_the_plugin_works_as_nccls_socket_plugin_does() {
    let t = common::table_v12();
    // Hold the runtime with a real context, as NCCL does (init before anything else)...
    let ctx = common::raw_context(t, 0x5a3, None);
    // ...and then pass none: NCCL's Socket plugin ignores the context altogether.
    let (sc, rc, lc) = common::raw_connected(t, null_mut());
    transfer(t, sc, rc);
    // SAFETY: a plain C struct of integers, for which all zeroes is a valid value.
    let mut attr: nccl_net_lossy::ffi::ncclNetAttr_v11_t = unsafe { std::mem::zeroed() };
    attr.op = 1 << 4;
    // SAFETY: a NULL context and a valid attribute.
    unsafe {
        assert_eq!(t.setNetAttr.expect("setNetAttr")(null_mut(), &mut attr), OK);
    }
    // SAFETY: live comms and a live context the test made, none used again.
    unsafe { common::raw_close_all(t, sc, rc, lc, ctx) };
}

#[test]
fn the_tables_leave_irecv_consumed_unset_as_nccls_host_plugins_do() {
    // NCCL calls `irecvConsumed` on every finished receive of a plugin that sets it
    // (src/transport/net.cc, recvProxyProgress); NCCL's Socket and IB plugins leave it NULL.
    // Ours set a call that did nothing: one more call into the plugin per receive for NCCL's
    // proxy, for nothing (wrap mode tells its inner plugin itself, when a receive completes).
    assert!(
        common::table_v12().irecvConsumed.is_none(),
        "v12 sets irecvConsumed"
    );
    // SAFETY: each symbol is the table of its version in our headers.
    let (v8, v9, v10, v11) = unsafe {
        (
            common::library_table::<nccl_net_lossy::ffi::ncclNet_v8_t>("ncclNetPlugin_v8"),
            common::library_table::<nccl_net_lossy::ffi::ncclNet_v9_t>("ncclNetPlugin_v9"),
            common::library_table::<nccl_net_lossy::ffi::ncclNet_v10_t>("ncclNetPlugin_v10"),
            common::library_table::<nccl_net_lossy::ffi::ncclNet_v11_t>("ncclNetPlugin_v11"),
        )
    };
    assert!(v8.irecvConsumed.is_none(), "v8 sets irecvConsumed");
    assert!(v9.irecvConsumed.is_none(), "v9 sets irecvConsumed");
    assert!(v10.irecvConsumed.is_none(), "v10 sets irecvConsumed");
    assert!(v11.irecvConsumed.is_none(), "v11 sets irecvConsumed");
}
