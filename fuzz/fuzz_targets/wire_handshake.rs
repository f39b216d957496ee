//! Connection handles (from NCCL's bootstrap) and hellos (from anyone who can reach a
//! listening port).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_lossy::transport::socket::wire::{Handle, Hello, HELLO_SIZE, NONCE_SIZE};
use nccl_net_lossy::transport::HANDLE_WIRE_SIZE;

fuzz_target!(|data: &[u8]| {
    if data.len() >= HANDLE_WIRE_SIZE {
        let raw: &[u8; HANDLE_WIRE_SIZE] = data[..HANDLE_WIRE_SIZE].try_into().expect("size");
        if let Ok(h) = Handle::decode(raw) {
            let mut again = [0u8; HANDLE_WIRE_SIZE];
            h.encode(&mut again);
            assert_eq!(&again, raw);
        }
    }
    if data.len() >= HELLO_SIZE + NONCE_SIZE {
        let raw: &[u8; HELLO_SIZE] = data[..HELLO_SIZE].try_into().expect("size");
        let nonce: &[u8; NONCE_SIZE] = data[HELLO_SIZE..HELLO_SIZE + NONCE_SIZE]
            .try_into()
            .expect("size");
        if let Ok(h) = Hello::decode(raw, nonce) {
            assert_eq!(&h.encode(), raw);
            assert_eq!(&h.nonce, nonce);
        }
    }
});
