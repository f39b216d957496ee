//! The harness's plugin client allocates nothing per message, as NCCL's proxy allocates
//! nothing per request: its posts pass pointers into structures set up once (the profiler
//! handles are `&sub->pHandles[..]`, src/transport/net.cc). An allocation per post would be
//! the harness's cost, timed as the plugin's in `lossy bench` next to raw TCP, which makes
//! none. The test binary counts its own allocations (the plugin library has its own
//! allocator, which is not counted: the plugin's work is not the client's).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::library;
use lossy_cli::harness::plugin_client::{op, PluginClient, PluginLibrary, Posted, RecvItem};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call goes to the system allocator with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counting {
    /// # Safety
    /// `GlobalAlloc::alloc`'s contract, passed on unchanged.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded as given (the caller keeps `alloc`'s contract).
        unsafe { System.alloc(layout) }
    }

    /// # Safety
    /// `GlobalAlloc::dealloc`'s contract, passed on unchanged.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) }
    }

    /// # Safety
    /// `GlobalAlloc::realloc`'s contract, passed on unchanged.
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded as given.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn posting_testing_and_finishing_messages_allocates_nothing_in_the_client() {
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("load the plugin");
    // v12: every post gets profiler handles, and setNetAttr is called per collective.
    let client = PluginClient::init(&lib, 12, 0xa110c).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(30))
        .expect("connect");
    let (mut sbuf, mut rbuf) = (
        vec![7u8; 64].into_boxed_slice(),
        vec![0u8; 64].into_boxed_slice(),
    );
    let smr = send.reg_mr(&mut sbuf).expect("regMr send");
    let rmr = recv.reg_mr(&mut rbuf).expect("regMr recv");
    let (mut sbuf, mut rbuf) = (Some(sbuf), Some(rbuf));
    let mut message = || {
        // As run_channels: the collective is announced before its transfers.
        client.set_net_attr(op::ALL_REDUCE).expect("setNetAttr");
        let item = RecvItem {
            buf: rbuf.take().expect("receive buffer"),
            size: 64,
            tag: 3,
            mr: rmr,
        };
        let Posted::Started(mut r) = recv.irecv([item]).expect("irecv") else {
            panic!("irecv found no free request");
        };
        let buf = sbuf.take().expect("send buffer");
        let Posted::Started(mut s) = send.isend(buf, 64, 3, smr).expect("isend") else {
            panic!("isend found no free request");
        };
        let (mut received, mut sent) = (false, false);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !(received && sent) {
            received = received || r.test().expect("test receive").is_some();
            sent = sent || s.test().expect("test send").is_some();
            assert!(
                std::time::Instant::now() < deadline,
                "the message never came"
            );
        }
        let (back, got) = r.finish_one().expect("receive");
        assert_eq!((got, back[0]), (64, 7));
        rbuf = Some(back);
        sbuf = Some(s.finish_one().expect("send").0);
    };
    // The first messages may size what the client keeps for the next ones.
    for _ in 0..8 {
        message();
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..200 {
        message();
    }
    let made = ALLOCATIONS.load(Ordering::Relaxed) - before;
    assert_eq!(
        made, 0,
        "the client allocated {made} times over 200 messages"
    );
}
