//! The launcher when it cannot start the threads that read its ranks' output (a user at its
//! process limit, `ulimit -u`): it says so and stops every rank it started, rather than run
//! ranks whose stderr is a broken pipe. Thread creation fails here through the launcher's
//! spawn seam, on the third reader (rank 1's stdout), as `pthread_create` fails with EAGAIN.
//! This file holds one test, so every child of this process is a rank of that test.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lossy_cli::harness::collectives::{Collective, DataType};
use lossy_cli::harness::launch::{self, Launch, PipeReader};
use lossy_cli::harness::worker::{Job, LinkKind, RunSpec};

/// The children of this process still present (running or unreaped), by pid.
fn children() -> Vec<String> {
    let tasks = std::fs::read_dir("/proc/self/task").expect("list this process's threads");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn a_reader_thread_that_cannot_start_stops_the_run_naming_the_process_limit() {
    let runs = vec![RunSpec {
        collective: Collective::AllReduce,
        dtype: DataType::F32,
        bytes: 4096,
        iters: 2,
        warmup: 0,
    }];
    let mut job = Job::collectives(common::library(), vec![LinkKind::Plugin], runs);
    job.timeout_s = 60.0;
    let started = AtomicUsize::new(0);
    let spawn = |read: PipeReader| {
        if started.fetch_add(1, Ordering::SeqCst) == 2 {
            return Err(std::io::Error::from_raw_os_error(libc::EAGAIN));
        }
        launch::reader_thread(read)
    };
    let outcome = launch::run_with(
        &Launch {
            exe: common::lossy_exe(),
            nranks: 3,
            job,
            env: vec![("NCCL_SOCKET_IFNAME".into(), "lo".into())],
            timeout: Duration::from_secs(60),
        },
        &spawn,
    );
    let err = match outcome {
        Ok(_) => panic!("the run succeeded without a reader for rank 1's stdout"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("thread") && err.contains("rank 1") && err.contains("ulimit -u"),
        "the error does not say which thread could not start and which limit to raise: {err}"
    );
    assert_eq!(
        started.load(Ordering::SeqCst),
        3,
        "readers were started after the one that failed: {err}"
    );
    assert!(
        children().is_empty(),
        "ranks left behind after the failed launch: {:?}",
        children()
    );
}
