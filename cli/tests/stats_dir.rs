//! `NCCL_LOSSY_STATS` that cannot take statistics: `init` refuses it with an error that names
//! the variable and the path, and once a run is under way, a statistics write that fails is a
//! warning: `finalize` never fails for statistics.
//!
//! Each case runs in a fresh process (this binary again, with the ignored test `stats_child`),
//! because the runtime and the environment it reads are process-wide.

mod common;

use std::path::Path;
use std::process::Stdio;

use common::{library, say, Peer, ROLE_ENV};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};

const CHILD: &str = "stats_child";

/// Runs `role` in a fresh process with `env`; returns what it said and what it logged.
fn run_child(role: &str, env: &[(&str, &str)], log: &Path) -> (String, String) {
    let mut all = vec![("NCCL_SOCKET_IFNAME", "lo")];
    all.extend_from_slice(env);
    let file = std::fs::File::create(log).expect("log file");
    let mut peer = Peer::spawn_with_stderr(CHILD, role, &all, Stdio::from(file));
    let said = peer.expect_line("OK");
    let status = peer.wait();
    let logged = std::fs::read_to_string(log).expect("read the log");
    assert!(
        status.success(),
        "{role}: the child failed: {status}\n{logged}"
    );
    (said, logged)
}

#[test]
fn init_refuses_a_stats_directory_that_cannot_be_created() {
    let dir = common::fresh_dir("stats-unwritable");
    // A regular file where a directory would have to be: no one, root included, can create
    // the directory below it.
    let blocker = dir.join("a-file");
    std::fs::write(&blocker, "not a directory\n").expect("write");
    let stats = blocker.join("stats");
    let stats = stats.to_str().expect("utf-8");
    let (said, logged) = run_child("refused", &[("NCCL_LOSSY_STATS", stats)], &dir.join("log"));
    println!("{said}");
    assert!(
        logged.contains(&format!(
            "NCCL_LOSSY_STATS={stats}: statistics cannot be written"
        )),
        "the error names neither the variable nor the path:\n{logged}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn finalize_never_fails_because_statistics_cannot_be_written() {
    let dir = common::fresh_dir("stats-vanishing");
    let stats = dir.join("stats");
    let (said, logged) = run_child(
        "vanishing",
        &[("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8"))],
        &dir.join("log"),
    );
    println!("{said}");
    assert!(
        logged.contains("statistics not written"),
        "a failed write is not warned about:\n{logged}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs child `role` with statistics and a trace written every 0.1 s into directories the
/// child replaces by files: its folder (removed by the caller) and what it logged.
fn flood(role: &str) -> (std::path::PathBuf, String) {
    let dir = common::fresh_dir(&format!("stats-{role}"));
    let stats = dir.join("stats");
    let trace = dir.join("trace");
    let (said, logged) = run_child(
        role,
        &[
            ("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8")),
            ("NCCL_LOSSY_TRACE", trace.to_str().expect("utf-8")),
            ("NCCL_LOSSY_SET", "stats_interval=0.1"),
        ],
        &dir.join("log"),
    );
    println!("{said}");
    (dir, logged)
}

#[test]
fn a_statistics_directory_that_stays_unwritable_does_not_flood_the_log() {
    // The directory goes away under a run with a statistics interval of 0.1 s and a file takes
    // its place, so every periodic write fails (as on a full disk) for 3 s: about 30 failed
    // writes of the statistics and as many of the trace. Each warns, but the log of a job that
    // runs for days must not get a line per write for ever: a few per kind and interval (5),
    // then a count; the write when the process ends says so once more (the next test).
    let (dir, logged) = flood("flood");
    let count = |what: &str| logged.lines().filter(|l| l.contains(what)).count();
    let (stats_lines, trace_lines) = (count("statistics not written"), count("trace not written"));
    println!("{stats_lines} statistics and {trace_lines} trace warnings");
    assert!(
        (1..=6).contains(&stats_lines) && (1..=6).contains(&trace_lines),
        "{stats_lines} statistics and {trace_lines} trace warnings for 3 s of failed writes:\n{logged}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_last_write_of_a_run_is_reported_even_after_a_flood_of_failed_ones() {
    // Once the warnings of failed periodic writes reached their limit, the write at the last
    // finalize failed as quietly as the others: the user was never told the run's final
    // numbers were lost. Whatever the limit, the last write says so.
    let (dir, logged) = flood("flood_then_finalize");
    let finals: Vec<&str> = logged
        .lines()
        .filter(|l| l.contains("at the end of the run"))
        .collect();
    assert!(
        finals.iter().any(|l| l.contains("statistics not written"))
            && finals.iter().any(|l| l.contains("trace not written")),
        "no word of the final writes failing:\n{logged}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Where the child of `relative_directories_stay_where_init_found_them` starts, and where
/// it moves to after `init`.
const START_DIR_ENV: &str = "LOSSY_TEST_START_DIR";
const MOVED_DIR_ENV: &str = "LOSSY_TEST_MOVED_DIR";

#[test]
fn relative_directories_stay_where_init_found_them() {
    // NCCL_LOSSY_STATS=stats and NCCL_LOSSY_TRACE=trace, relative, and a script that changes
    // its working directory after NCCL's init (a config framework's run directory, a
    // library's chdir): init checked and created `start/stats`, but each write read the
    // variable again against the directory of the moment, so the final statistics and the
    // trace went to `moved/stats` and `moved/trace` (created there), and the directory the
    // run was checked against held nothing for `lossy report`.
    let dir = common::fresh_dir("stats-relative");
    let (start, moved) = (dir.join("start"), dir.join("moved"));
    for d in [&start, &moved] {
        std::fs::create_dir_all(d).expect("create");
    }
    let (said, logged) = run_child(
        "relative",
        &[
            ("NCCL_LOSSY_STATS", "stats"),
            ("NCCL_LOSSY_TRACE", "trace"),
            (START_DIR_ENV, start.to_str().expect("utf-8")),
            (MOVED_DIR_ENV, moved.to_str().expect("utf-8")),
        ],
        &dir.join("log"),
    );
    println!("{said}");
    for (sub, prefix) in [("stats", "lossy-stats-"), ("trace", "lossy-trace-")] {
        assert!(
            !moved.join(sub).exists(),
            "{sub} written into the directory the process moved to:\n{logged}"
        );
        let files: Vec<_> = std::fs::read_dir(start.join(sub))
            .expect("the directory init created")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .collect();
        assert_eq!(files.len(), 1, "{sub}: {files:?}\n{logged}");
    }
    let file = nccl_net_lossy::stats::writer::StatsFile::read(
        &std::fs::read_dir(start.join("stats"))
            .expect("stats")
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(".json"))
            .expect("a statistics file"),
    )
    .expect("statistics file");
    assert_eq!(file.total.messages, 3, "the final write's numbers");
    // The path the control API hands the Python profiler names the same file wherever the
    // process is now.
    let path = said.trim().rsplit(' ').next().expect("a path");
    assert!(
        Path::new(path).is_absolute() && Path::new(path).starts_with(&start),
        "ncclLossyWriteTrace said {path}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `ncclLossyWriteTrace` of the copy of the plugin this process loaded: the path it wrote.
fn write_trace_now() -> String {
    let path = std::ffi::CString::new(library().to_str().expect("utf-8")).expect("no NUL");
    // SAFETY: a valid C string; RTLD_NOLOAD only hands back the copy already loaded.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null(), "the plugin is not loaded");
    // SAFETY: a live handle and a NUL-terminated name.
    let sym = unsafe { libc::dlsym(handle, c"ncclLossyWriteTrace".as_ptr()) };
    assert!(!sym.is_null(), "no ncclLossyWriteTrace");
    // SAFETY: the control header's signature of ncclLossyWriteTrace.
    let write: extern "C" fn(*mut std::ffi::c_char, usize) -> i64 =
        unsafe { std::mem::transmute(sym) };
    let mut buf = vec![0u8; 4096];
    let n = write(buf.as_mut_ptr().cast(), buf.len());
    assert!(
        n > 0 && (n as usize) < buf.len(),
        "ncclLossyWriteTrace: {n}"
    );
    String::from_utf8_lossy(&buf[..n as usize]).into_owned()
}

/// The child side of the tests above: acts on [`ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn stats_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let stats = std::env::var("NCCL_LOSSY_STATS").expect("NCCL_LOSSY_STATS");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    match role.as_str() {
        "refused" => {
            for version in [12, 9] {
                let err = PluginClient::init(&lib, version, 1)
                    .err()
                    .unwrap_or_else(|| {
                        panic!("v{version}: init accepted NCCL_LOSSY_STATS={stats}")
                    });
                println!("v{version}: init refused NCCL_LOSSY_STATS={stats}: {err}");
            }
            say("OK init refuses an unwritable NCCL_LOSSY_STATS");
        }
        "vanishing" => {
            let keeper = PluginClient::init(&lib, 12, 1).expect("init");
            let client = PluginClient::init(&lib, 12, 2).expect("init");
            // The directory goes away under the run, and a file takes its place.
            std::fs::remove_dir_all(&stats).expect("remove the stats directory");
            std::fs::write(&stats, "in the way\n").expect("write");
            client
                .finalize()
                .expect("finalize (not the last) failed for statistics");
            keeper
                .finalize()
                .expect("finalize (the last) failed for statistics");
            say("OK finalize succeeds when statistics cannot be written");
        }
        "flood" | "flood_then_finalize" => {
            let client = PluginClient::init(&lib, 12, 1).expect("init");
            // An open connection keeps the periodic writer running.
            let pair = client
                .local_pair(0, std::time::Duration::from_secs(20))
                .expect("local pair");
            let trace = std::env::var("NCCL_LOSSY_TRACE").expect("NCCL_LOSSY_TRACE");
            for dir in [&stats, &trace] {
                std::fs::remove_dir_all(dir).expect("remove the directory");
                std::fs::write(dir, "in the way\n").expect("write");
            }
            // Well past the limit of warnings (5 a kind): 30 failed writes of each.
            std::thread::sleep(std::time::Duration::from_secs(3));
            if role == "flood" {
                say("OK ran 3 s with unwritable statistics");
                return;
            }
            drop(pair);
            client.finalize().expect("finalize");
            say("OK finalized after a flood of failed writes");
        }
        "relative" => {
            let var = |name: &str| std::env::var(name).expect(name);
            std::env::set_current_dir(var(START_DIR_ENV)).expect("chdir to start");
            let client = PluginClient::init(&lib, 12, 1).expect("init");
            let pair = common::move_messages(&client, 3, 1000, std::time::Duration::from_secs(60));
            std::env::set_current_dir(var(MOVED_DIR_ENV)).expect("chdir after init");
            let trace = write_trace_now();
            drop(pair);
            client.finalize().expect("finalize");
            say(&format!("OK wrote the trace into {trace}"));
        }
        other => panic!("unknown role {other}"),
    }
}
