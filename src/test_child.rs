//! Tests that need a process of their own (a descriptor or memory limit, a stderr on
//! `/dev/full`, thread counts): they run one ignored test of this binary again as a child.

use std::process::{Command, Output, Stdio};

/// Runs the ignored test `name` of this binary in a process of its own, with `flag` and `env`
/// set and its stderr sent to `stderr` (piped when `None`), and returns what it did.
pub fn output(name: &str, flag: &str, env: &[(&str, &str)], stderr: Option<Stdio>) -> Output {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        name,
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ])
    .env(flag, "1")
    .envs(env.iter().copied());
    if let Some(stderr) = stderr {
        cmd.stderr(stderr);
    }
    cmd.output().expect("run child")
}

/// As [`output`], and checks that the child succeeded and ran its check to the end (it
/// prints `passed`); returns what it printed.
pub fn run(name: &str, flag: &str, env: &[(&str, &str)], passed: &str) -> String {
    let out = output(name, flag, env, None);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(
        text.contains(passed),
        "child did not run the check:\n{text}"
    );
    text
}

/// Limits this process's address space to `bytes` (`RLIMIT_AS`): for a child that runs one
/// test under a memory limit.
pub fn limit_address_space(bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: a valid rlimit for this process, which runs the one test that asked for it.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
}
