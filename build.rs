//! Generates the Rust view of the NCCL net-plugin ABI from our own headers in `nccl_headers/`.

use std::env;
use std::path::PathBuf;

fn main() {
    let header = "nccl_headers/nccl_net.h";
    let tuner_header = "nccl_headers/nccl_tuner.h";
    let profiler_header = "nccl_headers/nccl_lossy_profiler.h";
    println!("cargo:rerun-if-changed=nccl_headers");

    let bindings = bindgen::Builder::default()
        .header(header)
        .header(tuner_header)
        .header(profiler_header)
        .allowlist_type("ncclNet_v.*")
        .allowlist_type("ncclTuner_v.*")
        .allowlist_type("ncclNetProperties_v.*")
        .allowlist_type("ncclNetVDeviceProps_v.*")
        .allowlist_type("ncclNetCommConfig_v.*")
        .allowlist_type("ncclNetAttr_v.*")
        .allowlist_type("ncclLossyProfilerNet.*")
        .allowlist_type("ncclResult_t")
        .allowlist_type("ncclDebugLogLevel")
        .allowlist_var("NCCL_.*")
        .newtype_enum("ncclResult_t")
        .rustified_enum("ncclDebugLogLevel")
        .newtype_enum("ncclNetDeviceType")
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate_comments(false)
        .generate()
        .unwrap_or_else(|err| panic!("bindgen failed on {header}: {err}"));

    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("nccl_net.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|err| panic!("cannot write {}: {err}", out.display()));
}
