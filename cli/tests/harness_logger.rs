//! The logger the harness gives plugins formats printf varargs as NCCL's does: a third-party
//! plugin logging `"%s: %d of %zu (%5.1f%%)"` must read the same under the harness as under
//! NCCL. The logger is called through its C variadic type, as a plugin calls it, in a child
//! process whose stderr (the harness log) the test reads.

mod common;

use std::ffi::{c_char, c_int, c_long, c_uint, c_ulong, c_ulonglong, c_void};
use std::process::Stdio;

use common::{say, Peer, ROLE_ENV};
use lossy_cli::harness::plugin_client::logger;
use nccl_net_lossy::ffi::ncclDebugLogLevel;

const CHILD: &str = "logger_child";

/// Each case: what the C format renders to (the child calls the logger with the arguments).
const WANT: &[&str] = &[
    "plain line, no conversion",
    "s=[hello] d=-42 i=7 u=4000000000",
    "ld=-1234567890123 lu=18446744073709551615 zu=4096 lld=-9 llu=12345678901234",
    "x=ff X=BEEF #x=0x1f p=0x1234",
    "f=3.142 g=0.0001 e=2.500000e+00 c=Z pct=100%",
    "w=[   42] l=[42   ] z=[00042] p=[ab] s=[  abc] +d=+5",
    "null s=[(null)]",
];

#[test]
fn the_harness_logger_formats_printf_varargs() {
    let dir = common::fresh_dir("harness-logger");
    let log_path = dir.join("log");
    let log = std::fs::File::create(&log_path).expect("log");
    let mut p = Peer::spawn_with_stderr(CHILD, "log", &[], Stdio::from(log));
    p.expect_line("OK");
    assert!(p.wait().success(), "the child failed");
    let text = std::fs::read_to_string(&log_path).expect("read log");
    for want in WANT {
        assert!(
            text.lines().any(|l| l.ends_with(&format!("WARN {want}"))),
            "no line ending in {want:?}:\n{text}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A worker whose stderr cannot be written (a full disk, a launcher whose reader is gone)
/// keeps running when the plugin logs: the logger is called from C and must not panic there.
#[test]
fn the_harness_logger_survives_an_unwritable_stderr() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let mut p = Peer::spawn_with_stderr(CHILD, "log_unwritable", &[], Stdio::from(full));
    p.expect_line("OK");
    let status = p.wait();
    assert!(
        status.success(),
        "the child logging to an unwritable stderr ended with {status}"
    );
}

#[test]
#[ignore = "run by the other tests of this file in a process of their own"]
fn logger_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let log = logger().expect("a logger");
    if role == "log_unwritable" {
        let warn = ncclDebugLogLevel::NCCL_LOG_WARN;
        // SAFETY: a NUL-terminated format with one %d and one c_int for it.
        unsafe {
            log(
                warn,
                0,
                c"plugin.c".as_ptr(),
                1,
                c"lost line %d".as_ptr(),
                1 as c_int,
            )
        };
        say("OK survived");
        return;
    }
    assert_eq!(role, "log");
    let warn = ncclDebugLogLevel::NCCL_LOG_WARN;
    let file = c"plugin.c".as_ptr();
    // SAFETY: each call passes a NUL-terminated format and, for every conversion in it, one
    // argument of the C type that conversion reads (printf's contract), as a plugin would.
    unsafe {
        log(warn, 0, file, 1, c"plain line, no conversion".as_ptr());
        log(
            warn,
            0,
            file,
            2,
            c"s=[%s] d=%d i=%i u=%u".as_ptr(),
            c"hello".as_ptr(),
            -42 as c_int,
            7 as c_int,
            4_000_000_000u32 as c_uint,
        );
        log(
            warn,
            0,
            file,
            3,
            c"ld=%ld lu=%lu zu=%zu lld=%lld llu=%llu".as_ptr(),
            -1_234_567_890_123 as c_long,
            u64::MAX as c_ulong,
            4096usize,
            -9i64 as std::ffi::c_longlong,
            12_345_678_901_234 as c_ulonglong,
        );
        log(
            warn,
            0,
            file,
            4,
            c"x=%x X=%X #x=%#x p=%p".as_ptr(),
            255 as c_uint,
            0xbeef as c_uint,
            31 as c_uint,
            0x1234usize as *const c_void,
        );
        log(
            warn,
            0,
            file,
            5,
            c"f=%.3f g=%g e=%e c=%c pct=%d%%".as_ptr(),
            std::f64::consts::PI,
            0.0001f64,
            2.5f64,
            b'Z' as c_int,
            100 as c_int,
        );
        log(
            warn,
            0,
            file,
            6,
            c"w=[%5d] l=[%-5d] z=[%05d] p=[%.2s] s=[%*s] +d=%+d".as_ptr(),
            42 as c_int,
            42 as c_int,
            42 as c_int,
            c"abc".as_ptr(),
            5 as c_int,
            c"abc".as_ptr(),
            5 as c_int,
        );
        log(
            warn,
            0,
            file,
            7,
            c"null s=[%s]".as_ptr(),
            std::ptr::null::<c_char>(),
        );
    }
    say("OK logged");
}
