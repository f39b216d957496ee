//! How often the harness calls a plugin's `init`, against NCCL. NCCL 2.28+ calls a v11/v12
//! `init` once per communicator; for a v6-v10 table its compat layer
//! (`src/plugin/net/net_v6.cc` .. `net_v10.cc`) calls the plugin's `init` only when
//! no communicator holds the plugin (a count that each `init` raises and each `finalize`
//! lowers), because those plugins are initialised once per process. A plugin of that era may
//! reset its state, or fail, in a second `init`; the harness must not call it more than NCCL.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{build_fixture_with, fresh_dir, library, move_messages};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};

/// The `init` calls the fixture logged.
fn inits(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .map(|text| text.lines().count())
        .unwrap_or(0)
}

#[test]
fn a_v6_to_v10_plugin_is_initialised_once_while_communicators_hold_it_as_under_nccl() {
    let dir = fresh_dir("legacy-init");
    // The only test of this binary: the fixture reads these when it is loaded.
    std::env::set_var("FORWARD_PLUGIN_TARGET", library());
    for version in 6..=12u32 {
        // The harness speaks v8 at the oldest; a v6 or v7 table is loaded under it.
        let speak = version.max(8);
        let fixture = build_fixture_with(
            &format!("legacy-init-v{version}"),
            "forward_vn_plugin.c",
            &[&format!("FORWARD_VERSION={version}")],
        );
        let log = dir.join(format!("inits-v{version}"));
        std::env::set_var("FORWARD_PLUGIN_INIT_LOG", &log);
        let lib = PluginLibrary::open(&fixture).expect("open the fixture");
        let a = PluginClient::init(&lib, speak, 0x1e6a).expect("init of the first comm");
        let b = PluginClient::init(&lib, speak, 0x1e6b).expect("init of the second comm");
        let per_comm = version >= 11;
        assert_eq!(
            inits(&log),
            if per_comm { 2 } else { 1 },
            "v{version}: init calls for two communicators"
        );
        // Both communicators carry messages.
        for client in [&a, &b] {
            let (send, recv) = move_messages(client, 4, 4096, Duration::from_secs(20));
            send.close().expect("closeSend");
            recv.close().expect("closeRecv");
        }
        a.finalize().expect("finalize of the first comm");
        drop(a);
        let c = PluginClient::init(&lib, speak, 0x1e6c).expect("init of a third comm");
        assert_eq!(
            inits(&log),
            if per_comm { 3 } else { 1 },
            "v{version}: a communicator made while another holds the plugin"
        );
        drop(b);
        drop(c);
        // No communicator holds it any more, the library still loaded (as with
        // NCCL_NET_PLUGIN_REF_COUNT): NCCL's compat layer initialises it again.
        let d = PluginClient::init(&lib, speak, 0x1e6d).expect("init after the last finalize");
        assert_eq!(
            inits(&log),
            if per_comm { 4 } else { 2 },
            "v{version}: a communicator made after the last one was finalized"
        );
        let (send, recv) = move_messages(&d, 4, 4096, Duration::from_secs(20));
        drop((send, recv, d, lib));
    }
}
