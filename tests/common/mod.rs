//! Shared helpers of the integration tests: the built `lossy` binary and plugin library.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use nccl_net_lossy::harness::collectives::{Collective, DataType};
use nccl_net_lossy::harness::launch::{self, Launch};
use nccl_net_lossy::harness::plugin_client::library_near;
use nccl_net_lossy::harness::worker::{Job, LinkKind, RunSpec, WorkerReport};

/// The `lossy` binary Cargo built for these tests.
pub fn lossy_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_lossy"))
}

/// The plugin library next to it.
pub fn library() -> PathBuf {
    let exe = lossy_exe();
    let dir = exe.parent().expect("binary directory");
    library_near(dir).expect("the plugin library is built next to the lossy binary")
}

/// Runs `runs` on `nranks` worker processes through the plugin (version `version`).
pub fn run_ranks(nranks: usize, version: u32, runs: Vec<RunSpec>) -> Vec<WorkerReport> {
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], runs);
    job.version = version;
    job.timeout_s = 60.0;
    launch_job(nranks, job)
}

/// Launches `job` on `nranks` worker processes and returns the reports.
pub fn launch_job(nranks: usize, job: Job) -> Vec<WorkerReport> {
    let launch = Launch {
        exe: lossy_exe(),
        nranks,
        job,
        env: vec![("NCCL_SOCKET_IFNAME".into(), "lo".into())],
        timeout: Duration::from_secs(120),
    };
    launch::run(&launch).unwrap_or_else(|e| panic!("run failed: {e}"))
}

/// One run of each collective at each size, in both element types.
pub fn every(sizes: &[usize], dtypes: &[DataType]) -> Vec<RunSpec> {
    let mut runs = Vec::new();
    for &bytes in sizes {
        for collective in Collective::ALL {
            for &dtype in dtypes {
                runs.push(RunSpec {
                    collective,
                    dtype,
                    bytes,
                    iters: 1,
                    warmup: 0,
                });
            }
        }
    }
    runs
}

/// Asserts every result of every rank was bit-exact and every rank reported each run.
pub fn assert_all_exact(reports: &[WorkerReport], runs: usize) {
    for report in reports {
        assert_eq!(report.results.len(), runs, "rank {}", report.rank);
        for r in &report.results {
            assert!(
                r.ok,
                "rank {}: {} {} of {} bytes: {} mismatches, first at {:?}",
                report.rank, r.collective, r.dtype, r.bytes, r.mismatches, r.first_mismatch
            );
        }
    }
}
