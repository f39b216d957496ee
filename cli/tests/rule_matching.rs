//! Rule matching on real traffic: worker processes load the built plugin under a profile,
//! exchange messages over loopback sockets announced as one collective, and the receivers'
//! census and the senders' statistics files say which rule decided each message. Rules lose
//! every packet (`rate = 1`, effect `zero`) or none, so the checks are exact counts.

mod common;

use std::path::{Path, PathBuf};

use common::{fresh_dir, launch_env, library, total_census};
use lossy_cli::harness::worker::{Job, LinkKind, Task, WorkerReport};
use nccl_net_lossy::stats::report::{load_run, RunSummary};

/// `1 << ncclFunc` of NCCL 2.28's functions past `Recv` (src/include/device.h, `ncclFunc_t`).
const ALL_TO_ALL: u32 = 1 << 8;
const GATHER: u32 = 1 << 10;

fn write_profile(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("profile.toml");
    std::fs::write(&path, text).expect("write profile");
    path
}

/// 2 ranks x 4 messages of 64 KiB announced as `op_bits`, 16 packets of 4096 bytes each:
/// 128 packets in all; `Err` when the run fails (a profile the plugin refuses).
fn exchange(
    profile: &Path,
    overrides: &str,
    stats: &Path,
    op_bits: u32,
) -> Result<Vec<WorkerReport>, String> {
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], Vec::new());
    job.task = Task::Messages {
        bytes: 64 << 10,
        count: 4,
        mtu: 4096,
        op_bits,
    };
    job.timeout_s = 60.0;
    let env = vec![
        ("NCCL_LOSSY_PROFILE".into(), profile.display().to_string()),
        ("NCCL_LOSSY_SET".into(), overrides.into()),
        ("NCCL_LOSSY_STATS".into(), stats.display().to_string()),
    ];
    launch_env(2, job, env).map_err(|e| e.to_string())
}

fn op_counts(run: &RunSummary, name: &str) -> Option<(u64, u64)> {
    run.by_op
        .iter()
        .find(|o| o.op == name)
        .map(|o| (o.counts.packets, o.counts.lost_packets))
}

#[test]
fn a_rule_can_name_every_collective_the_statistics_name_and_unknown_is_only_unknown() {
    // NCCL 2.28 announces AllToAll, Scatter, Gather, ... per transfer, and the statistics
    // count them under those names: a rule must be able to pick them, and a rule on
    // "Unknown" (what old NCCL reports) must not take them.
    let dir = fresh_dir("rule-names");
    let profile = write_profile(
        &dir,
        "seed = 2\nmodel = \"none\"\n[[rules]]\ncollective = \"AllToAll\"\neffect = \"zero\"\n\
         model = { kind = \"uniform\", rate = 1.0 }\n",
    );
    for (op_bits, overrides, name, all_lost) in [
        (ALL_TO_ALL, "", "AllToAll", true),
        (GATHER, "", "Gather", false),
        (
            GATHER,
            "rules.0.collective=[\"alltoall\", \"gather\"]",
            "Gather",
            true,
        ),
        (ALL_TO_ALL, "rules.0.collective=Unknown", "AllToAll", false),
        (0, "rules.0.collective=Unknown", "Unknown", true),
    ] {
        let stats = dir.join(format!("stats-{name}-{}", overrides.len()));
        let reports = exchange(&profile, overrides, &stats, op_bits)
            .unwrap_or_else(|e| panic!("{name} with {overrides:?}: run failed: {e}"));
        let census = total_census(&reports);
        assert_eq!(census.packets, 128, "{name} {overrides:?}: {census:?}");
        let want_zeroed = if all_lost { census.packets } else { 0 };
        assert_eq!(
            (census.zeroed, census.intact + census.zeroed),
            (want_zeroed, census.packets),
            "{name} with {overrides:?}: {census:?}"
        );
        let run = load_run(&stats).expect("statistics written");
        assert_eq!(
            op_counts(&run, name),
            Some((128, want_zeroed)),
            "{name} with {overrides:?}: counted as {:?}",
            run.by_op.iter().map(|o| &o.op).collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_step_window_that_holds_no_step_is_refused_naming_the_key() {
    // `steps = { from = 5, until = 5 }` is the empty window [5, 5): the rule could never
    // match, and the run would go without the condition its profile names. The plugin's init
    // and `lossy validate` refuse it, from the file or from an override, naming the key.
    let dir = fresh_dir("empty-window");
    let profile = write_profile(
        &dir,
        "model = \"none\"\n[[rules]]\nsteps = { from = 5, until = 5 }\neffect = \"zero\"\n\
         model = { kind = \"uniform\", rate = 1.0 }\n",
    );
    let err = exchange(&profile, "", &dir.join("s1"), ALL_TO_ALL)
        .expect_err("the plugin refused the profile");
    assert!(
        err.contains("profile.toml:3: rules.0.steps") && err.contains("no step"),
        "{err}"
    );
    let fine = dir.join("fine.toml");
    std::fs::write(
        &fine,
        "model = \"none\"\n[[rules]]\nsteps = { from = 0, until = 1 }\n",
    )
    .expect("write profile");
    let err = exchange(&fine, "rules.0.steps.until=0", &dir.join("s2"), ALL_TO_ALL)
        .expect_err("the plugin refused the override");
    assert!(
        err.contains("NCCL_LOSSY_SET: rules.0.steps") && err.contains("no step"),
        "{err}"
    );
    let out = std::process::Command::new(common::lossy_exe())
        .args(["validate", &profile.display().to_string()])
        .env_remove("NCCL_LOSSY_SET")
        .output()
        .expect("run lossy validate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("rules.0.steps") && stderr.contains("no step"),
        "{stderr}"
    );
}
