//! `lossy bench` at the limits a shared machine sets: too few file descriptors
//! (`ulimit -n`) or too little address space (`ulimit -v`). Each run is a child process with
//! the real rlimit set before it starts; the error must say what ran out, how much was
//! needed, and what to change, on every rank that met it.

mod common;

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::lossy_exe;

/// `lossy bench args` over loopback as a child whose `resource` limit is `limit` (soft and
/// hard).
fn limited_bench(resource: libc::__rlimit_resource_t, limit: u64, args: &[&str]) -> Child {
    let mut cmd = Command::new(lossy_exe());
    cmd.arg("bench")
        .args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_NSOCKS")
        .env_remove("NCCL_LOSSY_RENDEZVOUS")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let rl = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: the closure runs in the forked child before exec and only calls setrlimit(2),
    // which is async-signal-safe, on a struct it owns; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(resource, &rl) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().expect("start lossy bench")
}

/// Waits for `child`, failing the test if it has not ended after `limit` (a hang).
fn finish(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("poll lossy bench").is_none() {
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!("lossy bench did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The raw TCP baseline of 8 channels wants far more than 32 descriptors per rank.
const FEW_FDS: u64 = 32;
const MANY_COMMS: [&str; 6] = ["--sizes", "64K", "--iters", "5", "--comms", "8"];

#[test]
fn too_few_descriptors_for_the_raw_tcp_baseline_name_the_link_the_need_and_the_limit() {
    let child = limited_bench(libc::RLIMIT_NOFILE, FEW_FDS, &MANY_COMMS);
    let out = finish(child, Duration::from_secs(120));
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "lossy bench succeeded under ulimit -n {FEW_FDS}"
    );
    assert!(
        err.contains("raw TCP baseline")
            && err.contains("sockets")
            && err.contains("ulimit -n")
            && err.contains("--comms"),
        "the error does not name the link, its sockets, `ulimit -n` and --comms:\n{err}"
    );
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn a_rank_of_a_multi_process_job_that_fails_on_its_own_prints_its_own_error() {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let rank = |r: &'static str, fds: u64| {
        let mut args = vec!["--rank", r, "--world", "2", "--rendezvous", &rendezvous];
        args.extend(["--rendezvous-timeout", "20"]);
        args.extend(MANY_COMMS);
        limited_bench(libc::RLIMIT_NOFILE, fds, &args)
    };
    // Rank 1 has descriptors enough; rank 0 runs out in the raw TCP baseline.
    let ranks = [rank("1", 4096), rank("0", FEW_FDS)];
    let [one, zero] = ranks.map(|c| finish(c, Duration::from_secs(120)));
    let err = text(&zero.stderr);
    assert!(
        !zero.status.success(),
        "rank 0 succeeded under ulimit -n {FEW_FDS}"
    );
    assert!(
        err.contains("ulimit -n") && err.contains("raw TCP baseline"),
        "rank 0 did not print its own error:\n{err}"
    );
    assert!(!one.status.success(), "rank 1 succeeded without rank 0");
}

/// 256 MiB in and out per rank cannot fit in 300 000 KiB of address space.
#[test]
fn buffers_larger_than_the_address_space_limit_fail_with_the_size_and_the_limit() {
    let child = limited_bench(
        libc::RLIMIT_AS,
        300_000 * 1024,
        &["--sizes", "256M", "--iters", "1"],
    );
    let out = finish(child, Duration::from_secs(120));
    let err = text(&out.stderr);
    assert!(
        !out.status.success(),
        "lossy bench succeeded under ulimit -v 300000"
    );
    assert!(
        !err.contains("memory allocation of"),
        "a rank aborted on a failed allocation:\n{err}"
    );
    assert!(
        err.contains("256 MiB") && err.contains("ulimit -v") && err.contains("--sizes"),
        "the error does not name the size, `ulimit -v` and --sizes:\n{err}"
    );
}

#[test]
fn init_reports_the_descriptors_each_connection_and_the_pool_need() {
    // Issue: "report fds needed per connection". A rank's init log (the harness shows INFO
    // lines with LOSSY_HARNESS_DEBUG, as NCCL does with NCCL_DEBUG=INFO) says the
    // budget before any connection exists, not only in a refusal once it is exceeded.
    let out = std::process::Command::new(common::lossy_exe())
        .args(["demo", "--ranks", "2", "--sizes", "4K"])
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("LOSSY_HARNESS_DEBUG", "INFO")
        .env("NCCL_LOSSY_NSOCKS", "3")
        .env("NCCL_LOSSY_IO_THREADS", "2")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_STATS")
        .output()
        .expect("run lossy demo");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.contains("file descriptors"))
        .unwrap_or_else(|| panic!("no descriptor budget in the init log:\n{stderr}"));
    for want in ["3 per connection", "4 for the I/O pool", "`ulimit -n`"] {
        assert!(line.contains(want), "{want:?} not in {line:?}");
    }
}
