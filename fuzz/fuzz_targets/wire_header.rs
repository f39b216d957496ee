//! Chunk headers and the lost-packet runs behind them, as a receiving socket reads them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_lossy::loss::effect::packet_count;
use nccl_net_lossy::transport::socket::wire::{self, Header, HEADER_SIZE, MAX_MESSAGE_BYTES};

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_SIZE {
        return;
    }
    let (head, rest) = data.split_at(HEADER_SIZE);
    let raw: &[u8; HEADER_SIZE] = head.try_into().expect("HEADER_SIZE bytes");
    if let Ok(h) = Header::decode(raw) {
        // Whatever decodes re-encodes to the same bytes and respects the limits.
        assert_eq!(&h.encode(), raw);
        assert!(h.size <= MAX_MESSAGE_BYTES);
        assert!(u64::from(h.runs) <= packet_count(h.size as usize, h.mtu));
        let take = rest.len().min(h.runs as usize * wire::RUN_SIZE);
        let whole = take - take % wire::RUN_SIZE;
        let mut runs = Vec::new();
        wire::decode_runs(&rest[..whole], &mut runs);
        assert_eq!(runs.len(), whole / wire::RUN_SIZE);
    }
});
