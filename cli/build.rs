//! Compiles the harness's C logger (src/harness/logger.c): NCCL's logger type is C-variadic,
//! which stable Rust can call but not define.

fn main() {
    println!("cargo:rerun-if-changed=src/harness/logger.c");
    cc::Build::new()
        .file("src/harness/logger.c")
        .warnings(true)
        .compile("lossy_harness_logger");
}
