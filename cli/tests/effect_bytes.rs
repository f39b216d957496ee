//! The data effects through the real plugin, byte by byte: worker processes exchange messages
//! whose sizes are not a multiple of the packet size (a short last packet) or smaller than one
//! packet, and every packet the receiver got is compared with what was sent. A `zero` or
//! `stale` loss must touch exactly the lost packets' bytes (the short last one included),
//! `bitflip` exactly one bit of each lost packet, and nothing else.

mod common;

use std::path::Path;

use common::{fresh_dir, launch_env, library, total_census};
use lossy_cli::harness::plugin_client::op;
use lossy_cli::harness::worker::{Job, LinkKind, Task, WorkerReport};
use nccl_net_lossy::stats::report::load_run;

fn exchange(
    task: Task,
    profile: &Path,
    overrides: &str,
    stats: &Path,
    extra: &[(&str, &str)],
) -> Vec<WorkerReport> {
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], Vec::new());
    job.task = task;
    job.timeout_s = 60.0;
    let mut env = vec![
        ("NCCL_LOSSY_PROFILE".into(), profile.display().to_string()),
        ("NCCL_LOSSY_SET".into(), overrides.into()),
        ("NCCL_LOSSY_STATS".into(), stats.display().to_string()),
    ];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    launch_env(2, job, env).unwrap_or_else(|e| panic!("run failed: {e}"))
}

/// Exchanges `count` messages of each `(bytes, mtu)` under uniform 30% loss with each data
/// effect, and checks packet by packet what the receivers got against the senders' counts.
fn effects_touch_only_lost_packets(
    name: &str,
    shapes: &[(usize, usize, usize)],
    extra: &[(&str, &str)],
) {
    let dir = fresh_dir(name);
    let profile = dir.join("p.toml");
    std::fs::write(
        &profile,
        "seed = 3\nmodel = { kind = \"uniform\", rate = 0.3 }\n",
    )
    .expect("profile written");
    for &(bytes, mtu, count) in shapes {
        let packets_per_message = bytes.div_ceil(mtu);
        for effect in ["zero", "stale", "bitflip"] {
            let what = format!("{effect}, {bytes} bytes at mtu {mtu}");
            let stats = dir.join(format!("{effect}-{bytes}"));
            std::fs::create_dir_all(&stats).expect("stats dir");
            let reports = exchange(
                Task::Messages {
                    bytes,
                    count,
                    mtu,
                    op_bits: op::SEND_RECV,
                },
                &profile,
                &format!("effect={effect};mtu={mtu}"),
                &stats,
                extra,
            );
            let census = total_census(&reports);
            let run = load_run(&stats).expect("statistics written");
            let lost = run.total.counts.lost_packets;
            assert_eq!(
                census.packets,
                (2 * count * packets_per_message) as u64,
                "{what}"
            );
            assert_eq!(run.total.counts.packets, census.packets, "{what}");
            let damaged = match effect {
                "zero" => census.zeroed,
                "stale" => census.stale,
                // A one-byte packet with one bit flipped may read as zeroed or stale (a byte
                // of 1 or 0x7f): under bitflip every damaged packet counts.
                _ => census.packets - census.intact - census.other,
            };
            // Every lost packet arrived damaged in the effect's way, every other one intact.
            common::census::assert_exact_damage(&census, damaged, lost, &what);
            // Binomial at 0.3 over at least 400 packets: sd <= sqrt(0.21/400) = 0.023; 5 sd.
            let rate = lost as f64 / census.packets as f64;
            assert!((rate - 0.3).abs() < 0.115, "{what}: loss rate {rate}");
        }
    }
}

#[test]
fn data_effects_touch_exactly_the_lost_packets_short_last_packet_included() {
    // (bytes, mtu, messages): 66 packets of 1500 and a last one of 1000; one packet of 1
    // byte; one of 100 bytes under 4096; a packet of 64 bytes and one of 1 at the smallest mtu.
    effects_touch_only_lost_packets(
        "effect-bytes",
        &[
            (100_000, 1500, 30),
            (1, 4096, 200),
            (100, 4096, 200),
            (65, 64, 200),
        ],
        &[],
    );
}

#[test]
fn data_effects_stay_on_the_lost_packets_when_a_message_is_split_over_sockets() {
    // 1,000,003 bytes over 4 sockets: chunks of about 250,000 bytes, whose edges fall inside
    // packets of 1500 (and the last packet is 1003 bytes); I/O threads move the bytes.
    effects_touch_only_lost_packets(
        "effect-bytes-split",
        &[(1_000_003, 1500, 6)],
        &[("NCCL_LOSSY_NSOCKS", "4"), ("NCCL_LOSSY_IO_THREADS", "2")],
    );
}
