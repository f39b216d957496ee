//! A training run longer than the plugin's per-step series (steps 65,536 and later are not
//! kept one by one): `lossy report --per-step` says how much traffic it does not break down
//! by step, instead of ending the table at step 65,535 without a word.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{
    fresh_dir, library, lossy_exe, message_bytes, output_within_10s, post_recv, post_send,
    wait_request, LoadedControl,
};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};

const SIZE: usize = 64 << 10;

/// Sends `count` messages at training step `step` through the plugin loaded in this process.
fn send_at_step(dir: &Path, plan: &[(u64, usize)]) {
    std::env::set_var("NCCL_LOSSY_STATS", dir);
    // 512-byte packets: 128 to a message; half of them lost.
    std::env::set_var("NCCL_LOSSY_SET", "mtu=512;model.rate=0.5;effect=zero");
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("load the plugin");
    let control = LoadedControl::of_loaded_library();
    let client = PluginClient::init(&lib, 12, 0x5eed).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(30))
        .expect("connect");
    let mut tag = 0;
    for &(step, count) in plan {
        assert_eq!((control.set_step)(step), 0);
        for _ in 0..count {
            tag += 1;
            let mut r = post_recv(&recv, SIZE, tag).expect("irecv");
            let mut s = post_send(&send, message_bytes(SIZE, tag as u64), tag).expect("isend");
            wait_request(&mut s, Duration::from_secs(30)).expect("send");
            wait_request(&mut r, Duration::from_secs(30)).expect("recv");
        }
    }
    send.close().expect("close send");
    recv.close().expect("close recv");
    assert!(lib.write_stats().expect("write statistics"));
}

#[test]
fn traffic_at_steps_the_series_does_not_keep_is_named_by_the_per_step_report() {
    let dir = fresh_dir("report-steps-beyond");
    // Step 3, then two messages at step 70,000: past the series' last step, 65,535.
    send_at_step(&dir, &[(3, 1), (70_000, 2)]);
    let out = output_within_10s(
        Command::new(lossy_exe()).args(["report", "--per-step", dir.to_str().expect("utf-8")]),
        "lossy report --per-step",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    // The table has step 3 alone: 128 packets.
    let steps: Vec<&str> = stdout.lines().skip(1).collect();
    assert_eq!(steps.len(), 1, "{stdout}");
    assert!(
        steps[0].contains(" 3 ") && steps[0].contains(" 128 "),
        "{stdout}"
    );
    // The two messages at step 70,000 (256 packets) are named, with where they went.
    assert!(
        stderr.contains("256 packets") && stderr.contains("steps from 65536 on"),
        "{stderr}"
    );
}
