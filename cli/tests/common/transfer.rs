//! One message at a time through a pair of comms: post, wait, check.

use std::time::{Duration, Instant};

use lossy_cli::harness::plugin_client::{Posted, RecvComm, RecvItem, Request, SendComm};
use nccl_net_lossy::Result;

/// Posts one receive of `size` bytes with `tag`.
pub fn post_recv(recv: &RecvComm, size: usize, tag: i32) -> Result<Request> {
    let mut buf = vec![0u8; size].into_boxed_slice();
    let mr = recv.reg_mr(&mut buf)?;
    match recv.irecv(vec![RecvItem { buf, size, tag, mr }])? {
        Posted::Started(r) => Ok(r),
        Posted::Busy(_) => panic!("no receive slot for a single request"),
    }
}

/// Posts one send of `data` with `tag`.
pub fn post_send(send: &SendComm, data: Vec<u8>, tag: i32) -> Result<Request> {
    let mut buf = data.into_boxed_slice();
    let size = buf.len();
    let mr = send.reg_mr(&mut buf)?;
    match send.isend(buf, size, tag, mr)? {
        Posted::Started(r) => Ok(r),
        Posted::Busy(_) => panic!("no send slot for a single request"),
    }
}

/// Opens a local connection of `client` and moves `messages` messages of `size` bytes over
/// it, each waited for at most `hang`; returns the connection, still open.
pub fn move_messages(
    client: &lossy_cli::harness::plugin_client::PluginClient,
    messages: u64,
    size: usize,
    hang: Duration,
) -> (SendComm, RecvComm) {
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(20))
        .expect("local pair");
    for i in 0..messages {
        let mut r = post_recv(&recv, size, 0).expect("irecv");
        let mut s = post_send(&send, vec![i as u8; size], 0).expect("isend");
        wait_request(&mut s, hang).expect("send");
        wait_request(&mut r, hang).expect("recv");
    }
    (send, recv)
}

/// Tests `req` until done or failed; a request still pending after `hang` is a hang, and
/// fails the test.
pub fn wait_request(req: &mut Request, hang: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        if req.test()?.is_some() {
            return Ok(());
        }
        assert!(
            start.elapsed() < hang,
            "request still pending after {hang:?}: a hang"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Sends `payload` with `tag` from `send` to `recv`, both buffers registered (the receive
/// 16 bytes larger than the message), and checks the size the receive reports and every byte
/// that arrived; `what` names the case in failures.
pub fn registered_round_trip(
    send: &SendComm,
    recv: &RecvComm,
    payload: &[u8],
    tag: i32,
    what: &str,
) {
    let len = payload.len();
    let mut out = vec![0u8; len + 16].into_boxed_slice();
    let rmr = recv.reg_mr(&mut out).expect("regMr");
    let mut data = payload.to_vec().into_boxed_slice();
    let smr = send.reg_mr(&mut data).expect("regMr");
    let item = RecvItem {
        buf: out,
        size: len + 16,
        tag,
        mr: rmr,
    };
    let Posted::Started(mut r) = recv.irecv(vec![item]).expect("irecv") else {
        panic!("{what}: no receive slot")
    };
    let Posted::Started(mut s) = send.isend(data, len, tag, smr).expect("isend") else {
        panic!("{what}: no send slot")
    };
    let hang = Duration::from_secs(10);
    wait_request(&mut s, hang).expect("send");
    let start = Instant::now();
    let sizes = loop {
        if let Some(sizes) = r.test().expect("test") {
            break sizes.to_vec();
        }
        assert!(
            start.elapsed() < hang,
            "{what}: receive still pending after {hang:?}"
        );
    };
    assert_eq!(sizes, [len], "{what}: the real size");
    let (bufs, _) = r.finish().expect("finish");
    assert!(bufs[0][..len] == payload[..], "{what}: {len} bytes differ");
    s.finish().expect("finish send");
    recv.dereg_mr(rmr).expect("deregMr");
    send.dereg_mr(smr).expect("deregMr");
}
