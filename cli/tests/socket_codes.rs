//! The codes the v12 table returns on the conditions where NCCL's Socket plugin
//! (`src/transport/net_socket.cc`) returns a specific one, driven raw as NCCL's proxy calls
//! the table: a device out of range at `listen`/`connect`, a memory type other than
//! `NCCL_PTR_HOST` at `regMr`, `test` of a NULL request and an `irecv` of a number of
//! buffers the plugin cannot group. NCCL's Socket plugin answers each with
//! `ncclInternalError` (IB too, for a count above its most receives), and the comms go on
//! working.

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use nccl_net_lossy::ffi::{ncclResult_t, NCCL_PTR_CUDA, NCCL_PTR_HOST};

const OK: ncclResult_t = ncclResult_t::ncclSuccess;
const INTERNAL: ncclResult_t = ncclResult_t::ncclInternalError;

#[test]
fn conditions_nccls_socket_plugin_fails_with_an_internal_error_give_the_same_code() {
    let t = common::table_v12();
    let ctx = common::raw_context(t, 0x50c, None);
    let mut ndev: c_int = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { t.devices.expect("devices")(&mut ndev) }, OK);
    assert!(ndev >= 1, "no device");
    let (sc, rc, lc) = common::raw_connected(t, ctx);
    let mut handle = [0u8; 128];
    let mut byte = [0u8; 8];
    // SAFETY: a live context and comms of the plugin, a 128-byte handle, valid buffers and
    // out-pointers: only the device, memory type, request or count is out of range.
    unsafe {
        let listen = t.listen.expect("listen");
        for dev in [ndev, -1] {
            let mut out = null_mut();
            let code = listen(ctx, dev, handle.as_mut_ptr().cast(), &mut out);
            assert_eq!(code, INTERNAL, "listen on device {dev} of {ndev}");
            assert!(out.is_null(), "listen on device {dev} handed out a comm");
        }
        // A valid handle (of device 0), connected from a device that does not exist.
        let mut lc0 = null_mut();
        assert_eq!(listen(ctx, 0, handle.as_mut_ptr().cast(), &mut lc0), OK);
        let connect = t.connect.expect("connect");
        for dev in [ndev, -1] {
            let (mut out, mut dev_comm) = (null_mut(), null_mut());
            let code = connect(
                ctx,
                dev,
                handle.as_mut_ptr().cast(),
                &mut out,
                &mut dev_comm,
            );
            assert_eq!(code, INTERNAL, "connect from device {dev} of {ndev}");
            assert!(out.is_null(), "connect from device {dev} handed out a comm");
        }
        assert_eq!(t.closeListen.expect("closeListen")(lc0), OK);

        let reg = t.regMr.expect("regMr");
        let (cuda, host) = (NCCL_PTR_CUDA as c_int, NCCL_PTR_HOST as c_int);
        for (comm, kind, want) in [(sc, cuda, INTERNAL), (rc, cuda, INTERNAL), (sc, host, OK)] {
            let mut mh = null_mut();
            let code = reg(comm, byte.as_mut_ptr().cast(), 8, kind, &mut mh);
            assert_eq!(code, want, "regMr of memory type {kind}");
            if code == OK {
                assert_eq!(t.deregMr.expect("deregMr")(comm, mh), OK);
            }
        }

        let mut done: c_int = 1;
        let mut size: c_int = 0;
        assert_eq!(
            t.test.expect("test")(null_mut(), &mut done, &mut size),
            INTERNAL,
            "test(NULL request)"
        );
        assert_eq!(done, 0, "test(NULL request) reported it done");

        let irecv = t.irecv.expect("irecv");
        let mut ptrs: [*mut c_void; 9] = [byte.as_mut_ptr().cast(); 9];
        let mut sizes = [8usize; 9];
        let mut tags = [1 as c_int; 9];
        let mut mrs: [*mut c_void; 9] = [null_mut(); 9];
        for n in [0, 9, -1] {
            let mut req = null_mut();
            let code = irecv(
                rc,
                n,
                ptrs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                tags.as_mut_ptr(),
                mrs.as_mut_ptr(),
                null_mut(),
                &mut req,
            );
            assert_eq!(code, INTERNAL, "irecv of {n} buffers");
            assert!(req.is_null(), "irecv of {n} buffers posted a request");
        }
    }
    // None of that touched the comms.
    let mut data: Vec<u8> = (0..65536u32).map(|i| (i * 5 + 1) as u8).collect();
    let got = common::raw_transfer(t, sc, rc, &mut data);
    assert!(got == data, "the message arrived changed");
    // SAFETY: live comms and context, each closed or finalized once.
    unsafe {
        assert_eq!(t.closeSend.expect("closeSend")(sc), OK);
        assert_eq!(t.closeRecv.expect("closeRecv")(rc), OK);
        assert_eq!(t.closeListen.expect("closeListen")(lc), OK);
        assert_eq!(t.finalize.expect("finalize")(ctx), OK);
    }
}
