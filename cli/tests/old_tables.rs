//! Plugins that export only a v6 or v7 table, as plugins built for NCCL before 2.19 do. NCCL
//! 2.30 still loads them (src/plugin/net/net_v6.cc, net_v7.cc): so must the one net-plugin
//! client, and with it the harness and wrap mode. The fixture (`forward_vn_plugin.c` with
//! `FORWARD_VERSION` 6 or 7) puts this project's v8 table behind v6's or v7's signatures.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{build_fixture_with, library};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use nccl_net_lossy::ffi::net::{
    NetLibrary, NetPlugin, NetProperties, OLDEST_VERSION, V8_MAX_BYTES, V8_MAX_COLL_BYTES,
};

/// The fixture exporting `ncclNetPlugin_v{version}` only, over this project's library.
/// Built once per process: the tests of this binary run in parallel, and a second build into
/// the same folder replaced the library while another test opened it ("file too short").
fn fixture(version: u32) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<(u32, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, path)) = built.iter().find(|(v, _)| *v == version) {
        return path.clone();
    }
    // Every test of this binary sets the same value: the fixture reads it when it is loaded.
    std::env::set_var("FORWARD_PLUGIN_TARGET", library());
    let path = build_fixture_with(
        &format!("old-table-v{version}"),
        "forward_vn_plugin.c",
        &[&format!("FORWARD_VERSION={version}")],
    );
    built.push((version, path.clone()));
    path
}

fn open(path: &std::path::Path) -> Arc<NetLibrary> {
    // SAFETY: this project's library, or the fixture over it (whose initialiser only copies
    // the library's table).
    Arc::new(unsafe { NetLibrary::open(path) }.expect("dlopen"))
}

/// Device 0's properties through the newest table of `lib` from `versions`, and its version.
fn properties(
    lib: &Arc<NetLibrary>,
    versions: std::ops::RangeInclusive<u32>,
) -> (u32, NetProperties) {
    let plugin = NetPlugin::load(Arc::clone(lib), versions).expect("load");
    let ctx = plugin.init(7, None).expect("init");
    let props = plugin.properties(0).expect("properties");
    plugin.finalize(ctx).expect("finalize");
    (plugin.version(), props)
}

#[test]
fn a_v6_or_v7_table_is_loaded_and_its_properties_read_as_nccls_adapters_fill_them() {
    assert_eq!(OLDEST_VERSION, 6);
    let (_, v8) = properties(&open(&library()), 8..=8);
    for version in [6, 7] {
        let lib = open(&fixture(version));
        assert_eq!(lib.net_versions(), [version], "the fixture's tables");
        let (found, props) = properties(&lib, OLDEST_VERSION..=12);
        assert_eq!(found, version);
        // The same device, read through the older struct: no `regIsGlobal` (0, as NCCL
        // fills it), and for v6 no device offload fields (a host device, version 0:
        // NCCL_NET_DEVICE_HOST, NCCL_NET_DEVICE_INVALID_VERSION).
        let want = NetProperties {
            reg_is_global: 0,
            net_device_type: if version == 6 { 0 } else { v8.net_device_type },
            net_device_version: if version == 6 {
                0
            } else {
                v8.net_device_version
            },
            ..v8.clone()
        };
        assert_eq!(props, want, "v{version}");
        assert_eq!(
            (
                props.max_p2p_bytes,
                props.max_coll_bytes,
                props.vdevs.clone()
            ),
            (V8_MAX_BYTES, V8_MAX_COLL_BYTES, vec![0]),
            "v{version}: NCCL's assumptions for a table that cannot say"
        );
    }
}

#[test]
fn v6_and_v7_tables_carry_messages_both_ways_under_every_version_the_harness_speaks() {
    for (version, speak) in [(6, 8), (6, 12), (7, 10), (7, 12)] {
        let lib = PluginLibrary::open(&fixture(version)).expect("dlopen");
        let client = PluginClient::init(&lib, speak, 0x01d0 + u64::from(version)).expect("init");
        assert_eq!(client.version(), version, "the table used");
        let (send, recv) = client
            .local_pair(0, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("v{version}: {e}"));
        // Registered through v6's and v7's `int`-sized `regMr`.
        for len in [0usize, 1, 70_001, 3 << 20] {
            let payload = common::message_bytes(len, u64::from(version));
            common::registered_round_trip(&send, &recv, &payload, 5, &format!("v{version}"));
        }
        send.close().expect("closeSend");
        recv.close().expect("closeRecv");
        client.finalize().expect("finalize");
    }
}
