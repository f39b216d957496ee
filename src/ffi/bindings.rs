//! Rust view of `nccl_headers/nccl_net.h`, `nccl_tuner.h` and `nccl_lossy_profiler.h`, generated
//! by bindgen in build.rs.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code
)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/nccl_net.rs"));
