//! The plugin crate's one net-plugin client (`nccl_net_lossy::ffi::net`) against the built
//! library at every table version: it picks the table asked for, adapts its properties into
//! the current shape the way NCCL does, and carries messages both ways through the harness
//! that is built on it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::library;
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use nccl_net_lossy::ffi::net::{
    NetLibrary, NetPlugin, NetProperties, V8_MAX_BYTES, V8_MAX_COLL_BYTES,
};

fn open() -> Arc<NetLibrary> {
    // SAFETY: the plugin library built from this repository.
    Arc::new(unsafe { NetLibrary::open(&library()) }.expect("dlopen"))
}

#[test]
fn the_newest_table_in_the_range_is_the_one_adapted() {
    let lib = open();
    for (range, want) in [(8..=12, 12), (8..=10, 10), (9..=9, 9), (8..=8, 8)] {
        let plugin = NetPlugin::load(Arc::clone(&lib), range.clone()).expect("load");
        assert_eq!(plugin.version(), want, "{range:?}");
        assert_eq!(plugin.name(), "lossy");
    }
    let err = NetPlugin::load(Arc::clone(&lib), 13..=20)
        .err()
        .expect("no such table");
    assert!(err.message.contains("no ncclNetPlugin_v13..v20"), "{err}");
}

/// Properties of device 0 through the client's table of `version`.
fn properties(lib: &Arc<NetLibrary>, version: u32) -> NetProperties {
    let plugin = NetPlugin::load(Arc::clone(lib), version..=version).expect("load");
    let ctx = plugin.init(version.into(), None).expect("init");
    assert!(plugin.devices().expect("devices") >= 1);
    let props = plugin.properties(0).expect("properties");
    plugin.finalize(ctx).expect("finalize");
    props
}

#[test]
fn every_version_s_properties_come_back_in_the_current_shape() {
    let lib = open();
    let current = properties(&lib, 12);
    assert_eq!((current.rail_id, current.plane_id), (-1, -1));
    assert_eq!(current.vdevs, [0]);
    assert_eq!(current.max_multi_request_size, 1);
    assert!(current.max_p2p_bytes > V8_MAX_BYTES, "{current:?}");
    for version in 8..=11 {
        let p = properties(&lib, version);
        // What every version reports is the same device.
        let same = NetProperties {
            max_p2p_bytes: current.max_p2p_bytes,
            max_coll_bytes: current.max_coll_bytes,
            ..p.clone()
        };
        assert_eq!(same, current, "v{version}");
        // What v8 cannot say gets NCCL's own assumptions for a v8 table.
        if version == 8 {
            assert_eq!(
                (p.max_p2p_bytes, p.max_coll_bytes),
                (V8_MAX_BYTES, V8_MAX_COLL_BYTES)
            );
        } else {
            assert_eq!(
                (p.max_p2p_bytes, p.max_coll_bytes),
                (current.max_p2p_bytes, current.max_coll_bytes),
                "v{version}"
            );
        }
    }
}

#[test]
fn every_version_carries_messages_both_ways() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    for version in 8..=12 {
        let client = PluginClient::init(&lib, version, 100 + u64::from(version)).expect("init");
        assert_eq!(client.version(), version);
        let (send, recv) = client
            .local_pair(0, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("v{version}: {e}"));
        for len in [0usize, 1, 70_001] {
            let payload: Vec<u8> = (0..len)
                .map(|i| (i * 31 + version as usize) as u8)
                .collect();
            common::registered_round_trip(&send, &recv, &payload, 3, &format!("v{version}"));
        }
        send.close().expect("closeSend");
        recv.close().expect("closeRecv");
        client.finalize().expect("finalize");
    }
}
