//! A send NCCL must post again: when every request slot of a connection is taken, `isend`
//! hands back a NULL request and NCCL's proxy posts the same message again on a later pass
//! (`sendProxyProgress`, src/transport/net.cc). Its loss is decided at the first post, so the
//! statistics must count it under the collective, phase and step of that first post, even
//! when, before the proxy posts it again, the training thread has moved on to another phase
//! and step (`ncclLossySetPhase`/`ncclLossySetStep`) and the proxy has announced another
//! collective on the context (`setNetAttr` for another operation sharing the connection).
//! One test in this binary: the plugin reads its profile from the environment once per
//! process.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{fresh_dir, library, LoadedControl};
use lossy_cli::harness::plugin_client::{op, PluginClient, PluginLibrary};

/// Bytes per message: 16 packets of the profile's 4096-byte MTU.
const SIZE: usize = 64 << 10;
/// Request slots of one connection (`NCCL_NET_MAX_REQUESTS`, per comm).
const SLOTS: usize = 32;

/// Backward-pass AllReduce loses everything (as zeros); nothing else loses anything.
const PROFILE: &str = "mtu = 4096\nmodel = { kind = \"none\" }\n\n[[rules]]\n\
    name = \"backward all-reduce\"\nphase = \"backward\"\ncollective = \"AllReduce\"\n\
    effect = \"zero\"\nmodel = { kind = \"uniform\", rate = 1.0 }\n";

/// "collective/phase" -> (messages, lost packets), and step -> (packets, lost packets).
type Cells = (BTreeMap<String, (u64, u64)>, BTreeMap<u64, (u64, u64)>);

fn cells(doc: &serde_json::Value) -> Cells {
    let mut by_op = BTreeMap::new();
    for conn in doc["connections"].as_array().expect("connections") {
        for cell in conn["by_op"].as_array().expect("by_op") {
            let key = format!(
                "{}/{}",
                cell["op"].as_str().expect("op"),
                cell["phase"].as_str().expect("phase")
            );
            let entry: &mut (u64, u64) = by_op.entry(key).or_default();
            entry.0 += cell["messages"].as_u64().expect("messages");
            entry.1 += cell["lost_packets"].as_u64().expect("lost_packets");
        }
    }
    let by_step = doc["by_step"]
        .as_array()
        .expect("by_step")
        .iter()
        .map(|s| {
            let n = |k: &str| s[k].as_u64().expect(k);
            (n("step"), (n("packets"), n("lost_packets")))
        })
        .collect();
    (by_op, by_step)
}

#[test]
fn a_send_posted_again_is_counted_where_its_loss_was_decided() {
    let dir = fresh_dir("busy-retry");
    let profile = dir.join("profile.toml");
    std::fs::write(&profile, PROFILE).expect("write the profile");
    std::env::set_var("NCCL_LOSSY_PROFILE", &profile);
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("load the plugin");
    let control = LoadedControl::of_loaded_library();
    let client = PluginClient::init(&lib, 12, 0xb05e).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(30))
        .expect("connect");

    // Step 5, backward pass, an AllReduce: every slot of the connection taken (sends not
    // tested yet, as the proxy tests them later), and one more message finds none: NCCL
    // will post it again.
    assert_eq!((control.set_step)(5), 0);
    assert_eq!((control.set_phase)(2), 0);
    assert!(client.set_net_attr(op::ALL_REDUCE).expect("setNetAttr"));
    let jammed = common::busy::jam(&send, SLOTS, SIZE);
    // Meanwhile the training thread moves on, and the proxy announces another collective.
    assert_eq!((control.set_step)(6), 0);
    assert_eq!((control.set_phase)(1), 0);
    assert!(client.set_net_attr(op::ALL_GATHER).expect("setNetAttr"));

    // Slots are free again: the same message, posted again, goes.
    common::busy::unjam(&send, &recv, jammed);
    let (by_op, by_step) = cells(&control.stats());
    send.close().expect("closeSend");
    recv.close().expect("closeRecv");
    client.finalize().expect("finalize");
    std::fs::remove_dir_all(&dir).ok();

    let all = (SLOTS + 1) as u64;
    let packets = (SIZE / 4096) as u64;
    assert_eq!(
        by_op,
        BTreeMap::from([("AllReduce/backward".to_string(), (all, all * packets))]),
        "every message counted under the collective and phase its loss was decided in"
    );
    assert_eq!(
        by_step,
        BTreeMap::from([(5, (all * packets, all * packets))]),
        "every message counted in the step its loss was decided in"
    );
}
