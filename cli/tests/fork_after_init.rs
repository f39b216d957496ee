//! A process that forks after the plugin's `init` (a data-loader worker, a helper spawned
//! with `os.fork()`), whose child then exits normally: the child's copy of the plugin's state
//! (runtime, statistics, writer thread, trace) belongs to the parent. The child must exit
//! without waiting for the parent's threads, which it does not have, and must write no
//! statistics or trace file of its own: one under the child's pid would hold the parent's
//! messages a second time, and `lossy report` would count them twice.
//!
//! Each case runs in a fresh process (this binary again, with the ignored test `fork_child`):
//! it moves its messages, forks, waits for its child to exit, then exits itself.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{fresh_dir, library, say, Peer};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use nccl_net_lossy::stats::writer::StatsFile;

const CHILD: &str = "fork_child";
/// Messages the parent moves before it forks.
const MESSAGES: u64 = 6;
const SIZE: usize = 100_000;
/// A forked child still exiting after this long is hung.
const HANG: Duration = Duration::from_secs(20);

/// Files in `dir` whose names start with `prefix`.
fn files(dir: &Path, prefix: &str) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn check(role: &str) {
    let dir = fresh_dir(&format!("fork-{role}"));
    let stats = dir.join("stats");
    let trace = dir.join("trace");
    let env = [
        ("NCCL_SOCKET_IFNAME", "lo"),
        ("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8")),
        ("NCCL_LOSSY_TRACE", trace.to_str().expect("utf-8")),
    ];
    let log = dir.join("stderr.log");
    let stderr = std::fs::File::create(&log).expect("stderr log");
    let mut peer = Peer::spawn_with_stderr(CHILD, role, &env, stderr.into());
    let said = peer.expect_line("CHILD");
    let status = peer.wait();
    let logged = std::fs::read_to_string(&log).expect("stderr log");
    // A panic the library catches at exit still prints, into the job's log, and stops what
    // was to follow it.
    assert!(
        !logged.contains("panicked"),
        "{role}: a panic at the forked child's exit:\n{logged}"
    );
    assert!(
        said.trim() == "exited 0",
        "{role}: the forked child did not exit cleanly in {HANG:?}: {said}"
    );
    assert!(status.success(), "{role}: the parent failed: {status:?}");
    let parent = peer.pid().to_string();
    for (what, d, prefix) in [
        ("statistics", &stats, "lossy-stats-"),
        ("trace", &trace, "lossy-trace-"),
    ] {
        let found = files(d, prefix);
        assert_eq!(
            found.len(),
            1,
            "{role}: {what} files (only the parent, pid {parent}, may write one): {found:?}"
        );
        assert!(
            found[0]
                .to_string_lossy()
                .ends_with(&format!("-{parent}.json")),
            "{role}: {found:?}"
        );
    }
    let file = StatsFile::read(&files(&stats, "lossy-stats-")[0]).expect("statistics file");
    assert_eq!(
        file.total.messages, MESSAGES,
        "{role}: the parent's statistics"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_child_forked_with_comms_open_exits_and_writes_nothing_v12() {
    check("open_v12");
}

#[test]
fn a_child_forked_under_net_v9_exits_and_writes_nothing() {
    check("closed_v9");
}

/// Forks; the child exits through `exit` (atexit handlers, the library's destructors); waits
/// for it at most [`HANG`] and says how it ended.
fn fork_and_report() {
    // SAFETY: fork in a test process; the child only calls exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        std::process::exit(0);
    }
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child, without blocking, with a valid status pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == pid {
            if libc::WIFEXITED(status) {
                say(&format!("CHILD exited {}", libc::WEXITSTATUS(status)));
            } else {
                say(&format!("CHILD ended with status {status:#x}"));
            }
            return;
        }
        if start.elapsed() > HANG {
            // SAFETY: our own child, which is hung.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            say("CHILD hung at exit (killed)");
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The forking side of the tests above: acts on [`common::ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn fork_child() {
    let Ok(role) = std::env::var(common::ROLE_ENV) else {
        return;
    };
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let version = match role.as_str() {
        "open_v12" => 12,
        "closed_v9" => 9,
        other => panic!("unknown role {other}"),
    };
    let client = PluginClient::init(&lib, version, 1).expect("init");
    {
        let _open = common::move_messages(&client, MESSAGES, SIZE, HANG);
        if role == "open_v12" {
            // The comms stay open: the statistics writer thread runs while the process forks.
            fork_and_report();
            std::process::exit(0);
        }
    }
    // Under v9 the comms are closed, the runtime held until unload.
    fork_and_report();
    std::process::exit(0);
}
