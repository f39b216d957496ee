//! A connection whose every request slot is taken, and the send NCCL then posts again
//! (`isend` hands back a NULL request: the proxy keeps the message and posts it later).

use std::time::Duration;

use lossy_cli::harness::plugin_client::{
    HostBuffer, MrHandle, Posted, RecvComm, Request, SendComm,
};

use super::{message_bytes, post_recv, post_send, wait_request};

/// Sends holding every slot, and the message that found none (its buffer handed back).
pub struct Jammed {
    sends: Vec<Request>,
    back: Vec<HostBuffer>,
    mr: MrHandle,
    tag: i32,
    size: usize,
}

/// Takes every one of `slots` request slots of `send` with messages of `size` bytes (not
/// tested yet, as the proxy tests them later), then posts one more, which finds none.
pub fn jam(send: &SendComm, slots: usize, size: usize) -> Jammed {
    let sends = (0..slots)
        .map(|i| post_send(send, message_bytes(size, i as u64), i as i32).expect("isend"))
        .collect();
    let tag = slots as i32;
    let mut last = message_bytes(size, 99).into_boxed_slice();
    let mr = send.reg_mr(&mut last).expect("regMr");
    let Posted::Busy(back) = send.isend(last, size, tag, mr).expect("isend") else {
        panic!("a send with every slot taken got a request");
    };
    Jammed {
        sends,
        back,
        mr,
        tag,
        size,
    }
}

/// Completes the sends that held the slots, then posts the message that found none again
/// (it goes now) and completes it.
pub fn unjam(send: &SendComm, recv: &RecvComm, mut j: Jammed) {
    let hang = Duration::from_secs(30);
    for (i, s) in j.sends.iter_mut().enumerate() {
        let mut r = post_recv(recv, j.size, i as i32).expect("irecv");
        wait_request(s, hang).expect("send");
        wait_request(&mut r, hang).expect("recv");
    }
    let mut r = post_recv(recv, j.size, j.tag).expect("irecv");
    let buf = j.back.pop().expect("the message's buffer");
    let Posted::Started(mut again) = send.isend(buf, j.size, j.tag, j.mr).expect("isend") else {
        panic!("a send found no slot with every earlier send done");
    };
    wait_request(&mut again, hang).expect("send");
    wait_request(&mut r, hang).expect("recv");
}
