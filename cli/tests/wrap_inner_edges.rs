//! Wrap mode over inner plugins that do what NCCL allows a plugin to do, and what a plugin
//! may do wrong: a plugin that exports one older table only, an `init` that fails, `isend` /
//! `irecv` that answer "not yet" (a NULL request), a `test` that fails, closes that fail.
//! The inner plugins are small C fixtures (`tests/fixtures/forward_plugin.c`,
//! `forward_vn_plugin.c`) in front of the calibration plugin or a copy of this library.
//!
//! The library reads its environment (which plugin to wrap) once per runtime, and an inner
//! plugin reads its quirks once per process, so each case runs in a child process of its own:
//! this binary's ignored test `child`, with the case named in `WRAP_EDGE_CASE`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    assert_all_exact, every, fresh_dir, launch_env, library, post_recv, post_send, repo_file,
    wait_request,
};
use lossy_cli::harness::collectives::DataType;
use lossy_cli::harness::plugin_client::{
    establish, PluginClient, PluginLibrary, Posted, RecvComm, RecvItem, Request, SendComm,
};
use lossy_cli::harness::worker::{Job, LinkKind};
use nccl_net_lossy::ffi::net::NetLibrary;
use nccl_net_lossy::ErrorKind;

const CASE_ENV: &str = "WRAP_EDGE_CASE";
const VERSION_ENV: &str = "WRAP_EDGE_VERSION";
const HANG: Duration = Duration::from_secs(20);

/// Runs case `case` in a child process (our net API `version`) wrapping `inner`, with `env`;
/// returns whether it passed and everything it printed.
fn run_case(case: &str, version: u32, inner: &Path, env: &[(&str, &str)]) -> (bool, String) {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(exe)
        .args(["--exact", "child", "--ignored", "--nocapture"])
        .env(CASE_ENV, case)
        .env(VERSION_ENV, version.to_string())
        .env(
            "NCCL_LOSSY_PROFILE",
            repo_file("configs/lossless.toml").display().to_string(),
        )
        .env("NCCL_LOSSY_INNER", inner)
        .env_remove("NCCL_LOSSY_SET")
        .envs(env.iter().copied())
        .output()
        .expect("run the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success() && text.contains("CASE PASSED"), text)
}

/// The forwarding fixture in front of the calibration plugin, with `quirk` set.
fn forward_to_calibration(test: &str) -> (PathBuf, String) {
    let target = common::build_fixture(&format!("{test}-target"), "inline_tcp_plugin.c");
    let inner = common::build_fixture(test, "forward_plugin.c");
    (inner, target.display().to_string())
}

#[test]
fn an_inner_init_that_fails_fails_our_init_on_every_version() {
    let (inner, target) = forward_to_calibration("edge-init-fail");
    for version in [8, 10, 11, 12] {
        let (passed, text) = run_case(
            "init_fails",
            version,
            &inner,
            &[
                ("FORWARD_PLUGIN_TARGET", &target),
                ("FORWARD_PLUGIN_INIT_FAIL", "1"),
            ],
        );
        assert!(passed, "v{version}:\n{text}");
        assert!(
            text.contains("init returned ncclSystemError"),
            "v{version}:\n{text}"
        );
    }
}

#[test]
fn inner_closes_that_fail_fail_our_closes() {
    let (inner, target) = forward_to_calibration("edge-close-fail");
    for version in [8, 12] {
        let (passed, text) = run_case(
            "close_fails",
            version,
            &inner,
            &[
                ("FORWARD_PLUGIN_TARGET", &target),
                ("FORWARD_PLUGIN_CLOSE_FAIL", "1"),
            ],
        );
        assert!(passed, "v{version}:\n{text}");
    }
}

#[test]
fn an_inner_test_that_fails_fails_our_test_with_its_code() {
    let (inner, target) = forward_to_calibration("edge-test-fail");
    // A few tests go through (connection set-up needs none): the failure comes mid-stream.
    let (passed, text) = run_case(
        "test_fails",
        12,
        &inner,
        &[
            ("FORWARD_PLUGIN_TARGET", &target),
            ("FORWARD_PLUGIN_TEST_FAIL_AFTER", "9"),
        ],
    );
    assert!(passed, "{text}");
}

#[test]
fn after_an_inner_test_fails_later_tests_of_the_connection_fail_with_its_code() {
    // NCCL's Socket and IB plugins fail every later request of a failed connection with the
    // connection's code (a peer's failure stays ncclRemoteError); wrap mode answered the
    // requests queued behind the failed one with ncclInternalError.
    let (inner, target) = forward_to_calibration("edge-test-fail-later");
    let (passed, text) = run_case(
        "later_tests_fail",
        12,
        &inner,
        &[
            ("FORWARD_PLUGIN_TARGET", &target),
            ("FORWARD_PLUGIN_TEST_FAIL_AFTER", "9"),
        ],
    );
    assert!(passed, "{text}");
}

#[test]
fn a_request_done_before_a_later_one_failed_tests_done_as_with_nccls_plugins() {
    // The inner plugin answers two tests (both halves of the first send) and fails every
    // one after: the first send is done, and its test must say so, as NCCL's Socket and IB
    // plugins report a request's own outcome; the failure is the second send's. Wrap mode
    // tested the second send's halves within the first send's test and failed that.
    let (inner, target) = forward_to_calibration("edge-test-fail-next");
    let (passed, text) = run_case(
        "earlier_request_done",
        12,
        &inner,
        &[
            ("FORWARD_PLUGIN_TARGET", &target),
            ("FORWARD_PLUGIN_TEST_FAIL_AFTER", "2"),
        ],
    );
    assert!(passed, "{text}");
}

#[test]
fn an_inner_devices_rail_and_plane_reach_nccl_as_the_inner_plugin_reports_them() {
    // NCCL's topology search never pairs NICs of different planes, and without cross-NIC
    // rings only NICs of one rail (src/graph/search.cc): a wrapped device must keep them.
    let (inner, target) = forward_to_calibration("edge-rail-plane");
    for version in [8, 11, 12] {
        let (passed, text) = run_case(
            "rail_plane",
            version,
            &inner,
            &[
                ("FORWARD_PLUGIN_TARGET", &target),
                ("FORWARD_PLUGIN_RAIL_PLANE", "3,1"),
            ],
        );
        assert!(passed, "v{version}:\n{text}");
    }
}

#[test]
fn an_inner_test_that_fails_with_a_cuda_error_fails_ours_with_that_code() {
    // Every code NCCL's headers have named since net v8 reaches NCCL as the inner plugin
    // returned it: NCCL tells the user "unhandled cuda error" for this one, not "internal
    // error".
    let (inner, target) = forward_to_calibration("edge-test-fail-cuda");
    let (passed, text) = run_case(
        "test_fails",
        12,
        &inner,
        &[
            ("FORWARD_PLUGIN_TARGET", &target),
            ("FORWARD_PLUGIN_TEST_FAIL_AFTER", "9"),
            ("FORWARD_PLUGIN_TEST_FAIL_CODE", "1"),
        ],
    );
    assert!(passed, "{text}");
}

#[test]
fn inner_posts_answered_not_yet_are_retried_and_counted_once() {
    let (inner, target) = forward_to_calibration("edge-null-posts");
    let (passed, text) = run_case(
        "null_posts",
        12,
        &inner,
        &[
            ("FORWARD_PLUGIN_TARGET", &target),
            ("FORWARD_PLUGIN_NULL_POSTS", "1"),
        ],
    );
    assert!(passed, "{text}");
}

#[test]
fn a_grouped_receive_is_refused_as_nccls_plugins_refuse_one_beyond_max_recvs() {
    // Wrapped devices report maxRecvs = 1, so NCCL never groups receives; a receive of more
    // buffers than a device's maxRecvs is refused by NCCL's Socket and IB plugins with
    // ncclInternalError (src/transport/net_socket.cc, net_ib/p2p.cc), as by our own sockets.
    let (inner, target) = forward_to_calibration("edge-grouped-recv");
    let (passed, text) = run_case(
        "grouped_recv",
        12,
        &inner,
        &[("FORWARD_PLUGIN_TARGET", &target)],
    );
    assert!(passed, "{text}");
}

/// Every table version an inner plugin may export alone (v6 to v12, as NCCL 2.30 loads;
/// v6 and v7 over the copy's v8 table), under every version NCCL may speak to us: lossless
/// collectives on 2 ranks, bit-exact.
#[test]
fn an_inner_plugin_with_one_older_table_only_is_wrapped_under_every_outer_version() {
    let dir = fresh_dir("edge-one-table");
    let target = dir.join("libnccl-net-lossy-target.so");
    std::fs::copy(library(), &target).expect("copy the library");
    let target = target.display().to_string();
    for inner_version in 6..=12 {
        let inner = common::build_fixture_with(
            &format!("edge-one-table-v{inner_version}"),
            "forward_vn_plugin.c",
            &[&format!("FORWARD_VERSION={inner_version}")],
        );
        // SAFETY: the fixture's initialiser only reads its environment and, with no target
        // named, loads nothing.
        let only = unsafe { NetLibrary::open(&inner) }.expect("dlopen the fixture");
        assert_eq!(only.net_versions(), [inner_version], "the fixture's tables");
        drop(only);
        for version in 8..=12 {
            let runs = every(&[0, 4096, (1 << 20) + 3], &[DataType::F32]);
            let n = runs.len();
            let mut job = Job::collectives(library(), vec![LinkKind::Plugin], runs);
            job.version = version;
            job.timeout_s = 60.0;
            let env = vec![
                (
                    "NCCL_LOSSY_PROFILE".to_string(),
                    repo_file("configs/lossless.toml").display().to_string(),
                ),
                ("NCCL_LOSSY_INNER".to_string(), inner.display().to_string()),
                ("FORWARD_PLUGIN_TARGET".to_string(), target.clone()),
                ("NCCL_DEBUG".to_string(), "INFO".to_string()),
            ];
            let reports = launch_env(2, job, env)
                .unwrap_or_else(|e| panic!("inner v{inner_version} under our v{version}: {e}"));
            assert_all_exact(&reports, n);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- the child ------------------------------------------------------------------------------

fn client() -> (std::rc::Rc<PluginLibrary>, u32) {
    let version: u32 = std::env::var(VERSION_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .expect("version");
    (PluginLibrary::open(&library()).expect("dlopen"), version)
}

fn init_fails() {
    let (lib, version) = client();
    let err = PluginClient::init(&lib, version, 1)
        .err()
        .expect("our init succeeded over an inner init that failed");
    assert_eq!(err.kind, ErrorKind::System, "{err}");
    // Once more: a failed build is not remembered, and must fail again.
    let again = PluginClient::init(&lib, version, 2).err();
    assert!(again.is_some(), "the second init succeeded");
}

fn close_fails() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let (handle, mut listen) = client.listen(0).expect("listen");
    let (send, recv) = establish(client.connect(0, &handle), &mut listen, HANG).expect("connect");
    // A message goes through first: the comms are in use, as NCCL's are before it closes them.
    let mut r = post_recv(&recv, 4096, 1).expect("irecv");
    let mut s = post_send(&send, vec![7u8; 4096], 1).expect("isend");
    wait_request(&mut s, HANG).expect("send");
    wait_request(&mut r, HANG).expect("recv");
    for (what, outcome) in [
        ("closeSend", send.close()),
        ("closeRecv", recv.close()),
        ("closeListen", listen.close()),
    ] {
        let err = outcome
            .err()
            .unwrap_or_else(|| panic!("our {what} succeeded over an inner {what} that failed"));
        assert_eq!(err.kind, ErrorKind::System, "{what}: {err}");
    }
}

fn test_fails() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let (send, recv) = client.local_pair(0, HANG).expect("connect");
    let mut failed = None;
    for i in 0..20 {
        let mut r = post_recv(&recv, 4096, 1).expect("irecv");
        let mut s = post_send(&send, vec![i as u8; 4096], 1).expect("isend");
        if let Err(e) = wait_request(&mut s, HANG).and_then(|()| wait_request(&mut r, HANG)) {
            failed = Some(e);
            break;
        }
    }
    let err = failed.expect("no test failed");
    // The inner plugin's code, as our `test` returned it to the client.
    let (kind, name) = match std::env::var("FORWARD_PLUGIN_TEST_FAIL_CODE").as_deref() {
        Ok("1") => (ErrorKind::Cuda, "ncclUnhandledCudaError"),
        _ => (ErrorKind::System, "ncclSystemError"),
    };
    assert!(
        err.message.contains(&format!("test returned {name}")),
        "{err}"
    );
    assert_eq!(err.kind, kind, "{err}");
}

fn later_tests_fail() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let (send, recv) = client.local_pair(0, HANG).expect("connect");
    let mut failed = None;
    for i in 0..20 {
        let mut r = post_recv(&recv, 4096, 1).expect("irecv");
        let mut s = post_send(&send, vec![i as u8; 4096], 1).expect("isend");
        if let Err(e) = wait_request(&mut s, HANG).and_then(|()| wait_request(&mut r, HANG)) {
            failed = Some(e);
            break;
        }
    }
    let first = failed.expect("no test failed");
    assert_eq!(first.kind, ErrorKind::System, "{first}");
    // Every later message of both connections fails at test with the inner plugin's code,
    // whether its connection's failed request is ahead of it or not.
    for i in 0..3 {
        let mut r = post_recv(&recv, 4096, 1).expect("irecv after the failure");
        let mut s = post_send(&send, vec![i; 4096], 1).expect("isend after the failure");
        for (what, req) in [("send", &mut s), ("receive", &mut r)] {
            let err = wait_request(req, HANG)
                .err()
                .unwrap_or_else(|| panic!("{what} {i} after the failure completed"));
            assert_eq!(err.kind, ErrorKind::System, "{what} {i}: {err}");
        }
    }
}

fn earlier_request_done() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let (send, _recv) = client.local_pair(0, HANG).expect("connect");
    // Small sends, which the inner plugin moves into the kernel at their first test.
    let mut first = post_send(&send, vec![1u8; 4096], 1).expect("isend");
    let mut second = post_send(&send, vec![2u8; 4096], 1).expect("isend");
    wait_request(&mut first, HANG).expect("the first send, done before the failure");
    let err = wait_request(&mut second, HANG)
        .expect_err("the second send completed over an inner test that failed");
    assert_eq!(err.kind, ErrorKind::System, "{err}");
}

fn rail_plane() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let props = client.properties(0).expect("getProperties");
    // Only v12's struct has the fields (the client reads older ones as -1, unknown, as
    // NCCL's compat layers set them, src/plugin/net/net_v11.cc).
    let want = if version >= 12 { (3, 1) } else { (-1, -1) };
    assert_eq!((props.rail_id, props.plane_id), want, "v{version}");
}

/// Posts `data` as a send, again and again while the plugin answers "not yet", as NCCL's
/// proxy does; returns the request and how many posts were refused.
fn send_until_started(send: &SendComm, data: Vec<u8>, tag: i32) -> (Request, usize) {
    let mut buf = data.into_boxed_slice();
    let size = buf.len();
    let mr = send.reg_mr(&mut buf).expect("regMr");
    for refused in 0.. {
        match send.isend(buf, size, tag, mr).expect("isend") {
            Posted::Started(r) => return (r, refused),
            Posted::Busy(mut back) => buf = back.pop().expect("the buffer back"),
        }
    }
    unreachable!()
}

/// As [`send_until_started`], for a receive of `size` bytes.
fn recv_until_started(recv: &RecvComm, size: usize, tag: i32) -> (Request, usize) {
    let mut buf = vec![0u8; size].into_boxed_slice();
    let mr = recv.reg_mr(&mut buf).expect("regMr");
    for refused in 0.. {
        match recv
            .irecv(vec![RecvItem { buf, size, tag, mr }])
            .expect("irecv")
        {
            Posted::Started(r) => return (r, refused),
            Posted::Busy(mut back) => buf = back.pop().expect("the buffer back"),
        }
    }
    unreachable!()
}

fn null_posts() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let (send, recv) = client.local_pair(0, HANG).expect("connect");
    let mut refused = 0;
    for i in 0..16u8 {
        let data = common::message_bytes(1000 + usize::from(i), u64::from(i));
        let (mut r, a) = recv_until_started(&recv, 4096, 3);
        let (mut s, b) = send_until_started(&send, data.clone(), 3);
        refused += a + b;
        wait_request(&mut s, HANG).expect("send");
        wait_request(&mut r, HANG).expect("recv");
        let (bufs, sizes) = r.finish().expect("finish");
        assert_eq!(sizes, vec![data.len()], "message {i}");
        assert!(bufs[0][..data.len()] == data[..], "message {i} changed");
    }
    assert!(
        refused >= 32,
        "the inner plugin refused only {refused} posts"
    );
}

fn grouped_recv() {
    let (lib, version) = client();
    let client = PluginClient::init(&lib, version, 1).expect("init");
    let (send, recv) = client.local_pair(0, HANG).expect("connect");
    let items = (0..2).map(|_| {
        let mut buf = vec![0u8; 4096].into_boxed_slice();
        let mr = recv.reg_mr(&mut buf).expect("regMr");
        RecvItem {
            buf,
            size: 4096,
            tag: 1,
            mr,
        }
    });
    let err = recv
        .irecv(items.collect::<Vec<_>>())
        .err()
        .expect("a receive of 2 buffers was accepted with maxRecvs = 1");
    assert_eq!(err.kind, ErrorKind::Internal, "{err}");
    // The refusal left the connection as it was.
    let data = common::message_bytes(3000, 5);
    let mut r = post_recv(&recv, 4096, 1).expect("irecv");
    let mut s = post_send(&send, data.clone(), 1).expect("isend");
    wait_request(&mut s, HANG).expect("send");
    wait_request(&mut r, HANG).expect("recv");
    let (bufs, sizes) = r.finish().expect("finish");
    assert_eq!(sizes, vec![data.len()]);
    assert!(bufs[0][..data.len()] == data[..], "the message changed");
}

/// The child process of the tests above.
#[test]
#[ignore = "the child process of this binary's tests, started by them"]
fn child() {
    let Ok(case) = std::env::var(CASE_ENV) else {
        return;
    };
    match case.as_str() {
        "init_fails" => init_fails(),
        "close_fails" => close_fails(),
        "test_fails" => test_fails(),
        "later_tests_fail" => later_tests_fail(),
        "earlier_request_done" => earlier_request_done(),
        "null_posts" => null_posts(),
        "grouped_recv" => grouped_recv(),
        "rail_plane" => rail_plane(),
        other => panic!("unknown case {other}"),
    }
    println!("CASE PASSED");
}
