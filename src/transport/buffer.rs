//! Host memory lent to the transport by NCCL for the life of one request.

use std::ptr::NonNull;

/// A host buffer NCCL lent us: an address, a length and the registration NCCL gave with it.
///
/// A `HostBuf` is a raw loan, not a borrow: it is `Copy` (a request's slot, and each I/O
/// thread moving part of it, hold a copy), and the borrow checker cannot see when NCCL takes
/// the memory back. So making one is `unsafe` (the lender promises the memory stays valid and
/// untouched by others until the request completes), and so is every view of its bytes (the
/// viewer promises that no other view of the same bytes is in use at the same time). Looking
/// at its address, length and registration is safe.
///
/// Lending a Rust slice does not compile without `unsafe`, because the loan outlives the
/// borrow:
///
/// ```compile_fail,E0133
/// use nccl_net_lossy::transport::HostBuf;
/// let mut bytes = vec![0u8; 4];
/// let buf = HostBuf::from_slice(&mut bytes);
/// drop(bytes);
/// ```
///
/// and neither do two writable views of the same bytes from two copies of one loan:
///
/// ```compile_fail,E0133
/// use nccl_net_lossy::transport::HostBuf;
/// fn alias(buf: HostBuf) {
///     let copy = buf;
///     let a = buf.slice_mut(0, 1);
///     let b = copy.slice_mut(0, 1);
///     a[0] = b[0];
/// }
/// ```
///
/// With `unsafe`, the caller states why the loan is kept:
///
/// ```
/// use nccl_net_lossy::transport::HostBuf;
/// let mut bytes = vec![1u8, 2, 3];
/// // SAFETY: `bytes` outlives `buf`, and nothing else touches it while `buf` is in use.
/// let buf = unsafe { HostBuf::from_slice(&mut bytes) };
/// // SAFETY: the only view of these bytes while it lives.
/// assert_eq!(unsafe { buf.slice(1, 3) }, &[2, 3]);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
    mr: usize,
}

// SAFETY: a HostBuf is only an address and a length; its bytes are reached only through the
// `unsafe` views, whose callers guarantee exclusive use whichever thread they run on.
unsafe impl Send for HostBuf {}
// SAFETY: as above: a shared `&HostBuf` gives safe access to the address and length only.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// A zero-byte buffer (an unused request slot): no memory, nothing to keep alive.
    pub const EMPTY: HostBuf = HostBuf {
        ptr: NonNull::dangling(),
        len: 0,
        mr: 0,
    };

    /// Wraps `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes (or `len` be 0), and no one
    /// but the transport may access that memory from now until the request it is handed to
    /// has completed (`test` reported it done) or the connection it was posted on has been
    /// dropped, whichever comes first.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        HostBuf {
            ptr: NonNull::new(ptr).unwrap_or(NonNull::dangling()),
            len,
            mr: 0,
        }
    }

    /// Lends a Rust slice (tests, examples and the raw-TCP baseline).
    ///
    /// # Safety
    /// As for [`HostBuf::new`]: `slice` must stay alive, and be neither read nor written
    /// through any other path, until the request it is handed to has completed or the
    /// connection it was posted on has been dropped. The borrow checker cannot see that
    /// time, so it is the caller's to keep.
    pub unsafe fn from_slice(slice: &mut [u8]) -> Self {
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
    ///
    /// # Safety
    /// The loan must still hold (see [`HostBuf::new`]: its request has not completed and its
    /// connection is alive), and nothing may write these bytes while the returned slice is in
    /// use (no `slice_mut` view of them, from any copy of this buffer, on any thread).
    pub unsafe fn slice(&self, start: usize, end: usize) -> &[u8] {
        assert!(
            start <= end && end <= self.len,
            "range outside the lent buffer"
        );
        if start == end {
            return &[];
        }
        // SAFETY: the range is inside the lent region (checked above); the caller guarantees
        // the loan holds and that no one writes these bytes while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), end - start) }
    }

    /// The bytes in `start..end` for writing; panics if the range is outside the buffer.
    ///
    /// # Safety
    /// The loan must still hold (see [`HostBuf::new`]), and while the returned slice is in
    /// use no other view of these bytes may exist: callers that share one buffer between
    /// threads give each thread a disjoint range, and take one view of a range at a time.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, start: usize, end: usize) -> &mut [u8] {
        assert!(
            start <= end && end <= self.len,
            "range outside the lent buffer"
        );
        if start == end {
            return &mut [];
        }
        // SAFETY: in bounds (checked above); the caller guarantees the loan holds and that
        // this is the only view of these bytes while it lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), end - start) }
    }
}
