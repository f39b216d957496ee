//! Stress: 64 communicators x 8 requests in flight per direction x 4 ranks (real processes),
//! grouped receives of 1 to 8 buffers (some sharing a tag), sizes from 0 to 256 KiB + 3 with
//! odd ones, under the embedded default profile (1% loss, repaired by retransmission), every
//! byte checked, within a time bound. The short run is part of `cargo test`; the long one is
//! ignored by default: `cargo test --release --test stress -- --ignored --nocapture`.

mod common;

use std::time::{Duration, Instant};

use common::{library, lossy_exe};
use lossy_cli::harness::launch::{self, Launch};
use lossy_cli::harness::worker::{Job, StressCounts, Task};

fn run(groups: usize, timeout_s: f64) -> StressCounts {
    let mut job = Job::collectives(library(), vec![], vec![]);
    job.timeout_s = timeout_s;
    job.task = Task::Stress {
        comms: 64,
        groups,
        in_flight: 8,
    };
    let launch = Launch {
        exe: lossy_exe(),
        nranks: 4,
        job,
        env: vec![("NCCL_SOCKET_IFNAME".into(), "lo".into())],
        timeout: Duration::from_secs_f64(timeout_s + 60.0),
    };
    let start = Instant::now();
    let reports = launch::run(&launch).unwrap_or_else(|e| panic!("stress run failed: {e}"));
    let wall = start.elapsed();
    assert_eq!(reports.len(), 4);
    let mut total = StressCounts::default();
    for r in &reports {
        let s = r.stress;
        assert_eq!(s.comms, 64, "rank {}", r.rank);
        assert_eq!(
            s.groups,
            64 * groups as u64,
            "rank {}: every group arrived",
            r.rank
        );
        // Groups hold at most the plugin's maxRecvs messages (1 for ours: one per receive).
        assert!(
            s.zero_byte > 0 && s.messages >= s.groups,
            "rank {}: {s:?}",
            r.rank
        );
        total.groups += s.groups;
        total.messages += s.messages;
        total.zero_byte += s.zero_byte;
        total.bytes += s.bytes;
        total.peak_in_flight = total.peak_in_flight.max(s.peak_in_flight);
        total.seconds = total.seconds.max(s.seconds);
    }
    println!(
        "STRESS 4 ranks x 64 comms x 8 in flight, {groups} groups per comm: {} grouped receives, \
         {} messages ({} of 0 bytes), {:.1} MiB, all bit-exact; peak {} requests in flight on \
         one rank; slowest rank {:.1} s, wall {:.1} s",
        total.groups,
        total.messages,
        total.zero_byte,
        total.bytes as f64 / (1 << 20) as f64,
        total.peak_in_flight,
        total.seconds,
        wall.as_secs_f64()
    );
    total
}

#[test]
fn stress_short() {
    let total = run(8, 120.0);
    // 64 comms each with 8 receives and 8 sends posted at once, on some rank at some time.
    assert!(total.peak_in_flight >= 64 * 8, "{total:?}");
}

#[test]
#[ignore = "long: cargo test --release --test stress -- --ignored --nocapture"]
fn stress_long() {
    let total = run(250, 900.0);
    assert!(total.messages > 250_000, "{total:?}");
}
