//! Acknowledgements: a receiving socket that carries messages under one loopback segment
//! asks TCP to delay its acknowledgements (`TCP_QUICKACK` off), and bulk ones put TCP's usual
//! mode back (docs/transport.md, "Small messages").

use super::{one_socket_pair, pattern, send_recv};
use crate::loss::plan::LossPlan;
use crate::transport::socket::SocketRecvConn;
use crate::transport::SendConn;

/// Sends `count` messages of `size` bytes one at a time (each received before the next is
/// sent).
fn one_at_a_time(send: &dyn SendConn, recv: &SocketRecvConn, size: usize, count: u64) {
    for i in 0..count {
        let mut data = pattern(size, i + 1);
        let mut into = vec![0u8; size];
        let (s, r) = send_recv(send, recv, &mut data, &mut into, &LossPlan::lossless());
        assert!(s.is_ok() && r.is_ok() && into == data);
    }
}

/// Segments the receiving side sends while `count` messages of 8 bytes arrive one at a time,
/// with delayed acknowledgements on or off.
fn acks_for_small_messages(delayed_acks: bool, count: u64) -> u64 {
    let (send, recv) = one_socket_pair(delayed_acks);
    let before = recv.segments_sent();
    one_at_a_time(&*send, &recv, 8, count);
    recv.segments_sent() - before
}

#[test]
fn bulk_messages_put_acknowledgements_back_to_the_usual_and_small_ones_delay_them_again() {
    let (send, recv) = one_socket_pair(true);
    one_at_a_time(&*send, &recv, 8, 3);
    assert_eq!(recv.acks_delayed(), [true], "after small messages");
    one_at_a_time(&*send, &recv, 1 << 20, 1);
    assert_eq!(recv.acks_delayed(), [false], "after a bulk message");
    one_at_a_time(&*send, &recv, 100, 1);
    assert_eq!(recv.acks_delayed(), [true], "small messages again");
    let (send, recv) = one_socket_pair(false);
    one_at_a_time(&*send, &recv, 8, 3);
    assert_eq!(recv.acks_delayed(), [false], "switched off");
}

#[test]
fn messages_under_one_loopback_segment_delay_acknowledgements_from_a_fresh_socket() {
    // A connection whose first messages are 4-32 KiB (NCCL's channels carry such slices of a
    // mid-sized collective) is one segment a message on loopback, acknowledged one by one as
    // read, exactly as the small messages are; it kept TCP's prompt mode when it never saw a
    // message under 4 KiB (8 channels at 64-256 KiB ran 14-16% slower, docs/transport.md).
    for size in [4 << 10, 16 << 10, 32 << 10, (64 << 10) - 1] {
        let (send, recv) = one_socket_pair(true);
        one_at_a_time(&*send, &recv, size, 2);
        assert_eq!(recv.acks_delayed(), [true], "after {size}-byte messages");
        one_at_a_time(&*send, &recv, 64 << 10, 1);
        assert_eq!(recv.acks_delayed(), [false], "after a 64 KiB message");
    }
}

#[test]
fn small_messages_are_acknowledged_every_second_segment_with_delayed_acks() {
    // Linux acknowledges each small segment when it is read, one pure ACK per message: with
    // acknowledgements delayed, every second one. 200 messages: about 100 against about 200;
    // the bounds leave 20 % either way for acknowledgements the kernel sends on its own
    // (a delayed-ACK timer firing in a slow run, window updates).
    let count = 200;
    let delayed = acks_for_small_messages(true, count);
    let prompt = acks_for_small_messages(false, count);
    assert!(
        delayed <= count * 6 / 10,
        "{delayed} ACKs for {count} messages"
    );
    assert!(
        prompt >= count * 8 / 10,
        "{prompt} ACKs for {count} messages"
    );
}

#[test]
fn delayed_acks_variable_is_parsed_and_bad_values_name_it() {
    use crate::transport::socket::SocketConfig;
    let with = |v: &'static str| {
        SocketConfig::from_lookup(move |name| {
            (name == "NCCL_LOSSY_DELAYED_ACKS").then(|| v.to_string())
        })
    };
    assert!(
        SocketConfig::from_lookup(|_| None)
            .expect("unset")
            .delayed_acks
    );
    assert!(with("1").expect("1").delayed_acks);
    assert!(!with(" 0 ").expect("0").delayed_acks);
    for bad in ["yes", "2", "off"] {
        let err = with(bad).expect_err(bad).to_string();
        assert!(
            err.contains("NCCL_LOSSY_DELAYED_ACKS") && err.contains(bad) && err.contains("0"),
            "{err}"
        );
    }
}
