//! Host memory lent to the transport by NCCL for the life of one request.

use std::ptr::NonNull;

/// A host buffer NCCL lent us: valid, and not touched by anyone else, from the `isend` or
/// `irecv` that handed it over until `test` reports the request done.
#[derive(Clone, Copy, Debug)]
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
    mr: usize,
}

// SAFETY: a HostBuf is only an address and a length; the lending contract of `HostBuf::new`
// makes the memory exclusively ours until the request completes, whichever thread touches it.
unsafe impl Send for HostBuf {}
// SAFETY: as above; concurrent users touch disjoint byte ranges (see `slice_mut`).
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// Wraps `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, and no one else may access
    /// that memory until the request it is handed to has completed.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        HostBuf {
            ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
            len,
            mr: 0,
        }
    }

    /// Lends a Rust slice (for tests and the raw-TCP baseline); the caller keeps it alive
    /// and untouched until the request completes, which the borrow checker cannot see.
    pub fn from_slice(slice: &mut [u8]) -> Self {
        HostBuf {
            ptr: NonNull::new(slice.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: slice.len(),
            mr: 0,
        }
    }

    /// The same buffer, carrying the transport registration (`mhandle`) NCCL gave with it.
    pub fn with_mr(self, mr: usize) -> Self {
        HostBuf { mr, ..self }
    }

    /// The registration NCCL gave with the buffer (0: none).
    pub fn mr(&self) -> usize {
        self.mr
    }

    /// Address of the first byte (dangling for an empty buffer).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes in `start..end` for reading; panics if the range is outside the buffer.
    pub fn slice(&self, start: usize, end: usize) -> &[u8] {
        assert!(
            start <= end && end <= self.len,
            "range outside the lent buffer"
        );
        if start == end {
            return &[];
        }
        // SAFETY: the range is inside the lent region (checked above), and the lending
        // contract of `new` keeps that memory valid and ours until the request completes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), end - start) }
    }

    /// The bytes in `start..end` for writing; panics if the range is outside the buffer.
    /// Callers that share one buffer between threads give each thread a disjoint range.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, start: usize, end: usize) -> &mut [u8] {
        assert!(
            start <= end && end <= self.len,
            "range outside the lent buffer"
        );
        if start == end {
            return &mut [];
        }
        // SAFETY: in bounds (checked above); the lending contract of `new` makes the memory
        // ours, and every caller writes a byte range no other thread touches at that time.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), end - start) }
    }
}
