//! A send NCCL posts again (every request slot taken: `isend` hands back a NULL request, see
//! `busy_retry.rs`) whose first post came before the training script set any step: the
//! per-step series starts at the first step the script sets, and that message, decided
//! before it, belongs to no step, even though the script set one before the proxy posted it
//! again. One test in this binary: the plugin's switches are process-wide.

mod common;

use std::time::Duration;

use common::{library, LoadedControl};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};

/// Bytes per message.
const SIZE: usize = 64 << 10;
/// Request slots of one connection (`NCCL_NET_MAX_REQUESTS`, per comm).
const SLOTS: usize = 32;

#[test]
fn a_send_decided_before_the_first_step_is_in_no_step() {
    std::env::set_var("NCCL_SOCKET_IFNAME", "lo");
    let lib = PluginLibrary::open(&library()).expect("load the plugin");
    let control = LoadedControl::of_loaded_library();
    let client = PluginClient::init(&lib, 12, 0xf125).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(30))
        .expect("connect");

    // No step set yet (warm-up traffic): every slot taken, one more message finds none.
    let jammed = common::busy::jam(&send, SLOTS, SIZE);
    // The training loop starts (step 0) before the proxy posts the message again.
    assert_eq!((control.set_step)(0), 0);
    common::busy::unjam(&send, &recv, jammed);
    let doc = control.stats();
    send.close().expect("closeSend");
    recv.close().expect("closeRecv");
    client.finalize().expect("finalize");

    assert_eq!(
        doc["total"]["messages"].as_u64(),
        Some(SLOTS as u64 + 1),
        "every message counted"
    );
    assert_eq!(
        doc["by_step"],
        serde_json::json!([]),
        "a message decided before the first step set counted in a step"
    );
}
