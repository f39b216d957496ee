//! Memory a freed plugin object lived in, handed out again with chosen contents: what a
//! plugin that trusted a stale pointer would then read.

use std::ffi::c_void;

/// Allocates 16-byte blocks holding `words` until the allocator hands out the block at
/// `freed` (a 16-byte object of the plugin's that this thread just freed: glibc gives a
/// freed block to a later request of its size on the same thread, at once or after the few
/// freed after it). Keep the blocks until the stale pointer has been used. Panics if the
/// block never comes back, which would leave the test without its situation.
// Each block must be its own heap allocation of 16 bytes: boxes, not a vector's one buffer.
#[allow(clippy::vec_box)]
pub fn refill(freed: *mut c_void, words: [u64; 2]) -> Vec<Box<[u64; 2]>> {
    let mut blocks = Vec::new();
    let reused = (0..4096).any(|_| {
        let b = Box::new(words);
        let at = &*b as *const [u64; 2] as *mut c_void;
        blocks.push(b);
        at == freed
    });
    assert!(reused, "the freed block was not handed out again");
    blocks
}
