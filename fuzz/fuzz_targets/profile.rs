//! Profile text and `NCCL_LOSSY_SET` overrides: any input gives a profile or an error,
//! never a panic. Input: the profile text, then optionally a NUL byte and the overrides.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nccl_net_lossy::profile::Profile;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (profile, overrides) = text.split_once('\0').unwrap_or((text, ""));
    // A trace model reads the file it names: keep the fuzzer away from the file system.
    if profile.contains("file") || overrides.contains("file") {
        return;
    }
    let _ = Profile::parse(profile, "fuzz", overrides);
});
