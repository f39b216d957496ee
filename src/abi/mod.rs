//! The C ABI NCCL calls: versioned function tables over the safe core in [`crate::plugin`].

pub mod ffi;
