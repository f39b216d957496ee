//! The harness drives a plugin that has none of this library's control API (`ncclLossy*`),
//! as it must for a third party's plugin: a plugin without those symbols runs on the plugin
//! and raw TCP links, and a job that needs the control API (switching loss off) says which
//! symbol is missing. The plugin is a small C library (tests/fixtures/forward_plugin.c, built
//! here with the system C compiler) that exports only `ncclNetPlugin_v12`, copied from this
//! project's library.

mod common;

use std::path::PathBuf;

use common::{every, launch_env, library};
use lossy_cli::harness::collectives::{Collective, DataType};
use lossy_cli::harness::worker::{Job, LinkKind, RunSpec};

/// Builds the forwarding plugin into a fresh folder of its own for test `test` (tests of this
/// file run in parallel: a shared folder would be wiped under another test's ranks).
fn forward_plugin(test: &str) -> PathBuf {
    common::build_fixture(test, "forward_plugin.c")
}

fn env() -> Vec<(String, String)> {
    vec![(
        "FORWARD_PLUGIN_TARGET".to_string(),
        library().display().to_string(),
    )]
}

/// Runs lossless collectives (4 KiB and 1 MiB, f32) through `plugin` on 2 ranks with the
/// forwarding plugin's `quirk` variables set, checks every result bit-exact, and returns the
/// reports.
fn exact_through(
    plugin: PathBuf,
    quirk: &[(&str, &str)],
) -> Vec<lossy_cli::harness::worker::WorkerReport> {
    let runs = every(&[4096, 1 << 20], &[DataType::F32]);
    let n = runs.len();
    let job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
    let mut env = env();
    env.extend(quirk.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env.push(("NCCL_LOSSY_SET".to_string(), "model.rate=0".to_string()));
    let reports = launch_env(2, job, env).unwrap_or_else(|e| panic!("the job failed: {e}"));
    for report in &reports {
        assert_eq!(report.results.len(), n, "{report:?}");
        assert!(report.results.iter().all(|r| r.ok), "{report:?}");
    }
    reports
}

#[test]
fn data_that_comes_out_wrong_in_an_early_iteration_fails_the_check() {
    // The first message a rank sends is damaged, in the first of three timed iterations;
    // the later iterations come out right. The run must not say bit-exact.
    corrupt_first_send(0, "corrupt-once");
}

#[test]
fn data_that_comes_out_wrong_in_a_warm_up_iteration_fails_the_check() {
    // The same damage in the one warm-up iteration: it is the plugin's result too.
    corrupt_first_send(1, "corrupt-warm-up");
}

/// Runs 3 timed iterations after `warmup` warm-up ones through a plugin that damages the first
/// message each rank sends, and asserts that the run is not said to be bit-exact.
fn corrupt_first_send(warmup: usize, test: &str) {
    let runs = vec![RunSpec {
        collective: Collective::AllReduce,
        dtype: DataType::F32,
        bytes: 4096,
        iters: 3,
        warmup,
    }];
    let job = Job::collectives(forward_plugin(test), vec![LinkKind::Plugin], runs);
    let mut env = env();
    env.push(("FORWARD_PLUGIN_CORRUPT_SEND".to_string(), "1".to_string()));
    env.push(("NCCL_LOSSY_SET".to_string(), "model.rate=0".to_string()));
    let reports = launch_env(2, job, env).unwrap_or_else(|e| panic!("the job failed: {e}"));
    assert!(
        reports.iter().any(|r| r.results.iter().any(|x| !x.ok)),
        "a wrong first iteration ({warmup} warm-up) passed the check: {reports:?}"
    );
}

#[test]
fn a_plugin_without_the_control_api_runs_on_the_plugin_and_raw_links() {
    let plugin = forward_plugin("links");
    let runs = every(&[4096, 1 << 20], &[DataType::F32]);
    let n = runs.len();
    let job = Job::collectives(plugin, vec![LinkKind::Plugin, LinkKind::RawTcp], runs);
    // Lossless profile: every result must be bit-exact on both links.
    let mut env = env();
    env.push(("NCCL_LOSSY_SET".to_string(), "model.rate=0".to_string()));
    let reports = launch_env(2, job, env).unwrap_or_else(|e| panic!("the job failed: {e}"));
    for report in &reports {
        assert_eq!(report.results.len(), 2 * n, "{report:?}");
        assert!(report.results.iter().all(|r| r.ok), "{report:?}");
    }
}

#[test]
fn a_job_that_needs_the_control_api_names_the_missing_symbol() {
    let plugin = forward_plugin("control");
    let runs = every(&[4096], &[DataType::F32]);
    let mut job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
    job.lossless = true;
    let err = launch_env(2, job, env()).expect_err("loss cannot be switched off");
    let text = err.to_string();
    assert!(text.contains("ncclLossySetEnabled"), "{text}");
}

#[test]
fn a_v12_init_that_leaves_the_context_null_is_accepted() {
    // NCCL accepts a v11+ `init` that leaves the context NULL (its own Socket transport does)
    // and then passes NULL back to listen, connect and finalize; the harness must too.
    exact_through(
        forward_plugin("null-context"),
        &[("FORWARD_PLUGIN_NULL_CONTEXT", "1")],
    );
}

#[test]
fn a_test_that_answers_in_progress_goes_on_as_with_nccl() {
    // NCCL's NCCLCHECK lets ncclInProgress through: the request is simply not done yet.
    exact_through(
        forward_plugin("in-progress"),
        &[("FORWARD_PLUGIN_PENDING_CODE", "7")],
    );
}

#[test]
fn a_result_code_newer_than_our_headers_is_an_error_naming_it() {
    // ncclTimeout (8) came with NCCL 2.30; a code the harness's bindings did not list was
    // undefined behaviour (a panic, "capacity overflow", in the rank). Now it is an error.
    let plugin = forward_plugin("timeout-code");
    let runs = every(&[1 << 20], &[DataType::F32]);
    let job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
    let mut env = env();
    env.push(("FORWARD_PLUGIN_PENDING_CODE".to_string(), "8".to_string()));
    let err = launch_env(2, job, env).expect_err("a timeout code fails the job");
    let text = err.to_string();
    assert!(text.contains("ncclTimeout (8)"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn a_plugin_built_for_an_older_nccl_runs_under_the_default_version() {
    // NCCL 2.30 takes the newest table a library exports, v12 down (src/plugin/net.cc); the
    // harness asked for v12 exactly and refused a v10-only plugin.
    // (Job::collectives asks for the newest version the harness drives, v12.)
    let plugin = common::build_fixture("v10-only", "forward_v10_plugin.c");
    for report in exact_through(plugin, &[]) {
        assert_eq!(report.version, 10, "{report:?}");
    }
}

#[test]
fn a_plugin_that_reports_no_sizes_runs_as_under_nccl() {
    // NCCL never reads a finished send's size and reads a receive's only for its profiler
    // and GPU flushes: a plugin that writes none works there. The bytes are still checked.
    exact_through(
        forward_plugin("no-sizes"),
        &[("FORWARD_PLUGIN_NO_SIZES", "1")],
    );
}

#[test]
fn receives_are_posted_at_the_whole_step_as_nccl_posts_them() {
    // NCCL posts every receive at its whole step (`stepSize * sliceSteps`, 512 KiB with the
    // default buffer), whatever the sender puts in it, and learns the size from `test`: a
    // plugin must deliver a shorter message into a larger receive. The 4 KiB all-reduce on
    // 2 ranks sends 2 KiB messages, so a driver that posts each receive at its message's
    // exact size never asks that of the plugin.
    let plugin = forward_plugin("recv-log");
    let log = plugin.with_file_name("posted-sizes.txt");
    let _ = std::fs::remove_file(&log);
    exact_through(
        plugin,
        &[("FORWARD_PLUGIN_RECV_LOG", log.to_str().expect("UTF-8 path"))],
    );
    let text = std::fs::read_to_string(&log).expect("the plugin's log of posted receives");
    let posted: Vec<usize> = text
        .lines()
        .map(|l| l.parse().expect("a size per line"))
        .collect();
    // 2 ranks x (2 steps of the 4 KiB run + 2 of the 1 MiB run), and warm-up iterations.
    assert!(posted.len() >= 8, "{posted:?}");
    assert!(
        posted.iter().all(|&s| s == 512 << 10),
        "receives posted at other sizes than the 512 KiB step: {posted:?}"
    );
}

#[test]
fn the_inline_calibration_plugin_runs_exact_collectives_in_both_wires() {
    // The benchmarks time tests/fixtures/inline_tcp_plugin.c (one inline socket, nothing
    // else) next to ours to tell the harness's own cost from the plugin's; it must run
    // through the harness as any plugin does, in its plain wire and in ours, and with the
    // knobs docs/remaining-gap.md measures (a longer header, one read per test).
    for (name, defines) in [
        ("inline", &[][..]),
        ("inline-lossy-wire", &["LOSSY_WIRE"][..]),
        ("inline-one-read", &["ONE_READ", "HEADER=56"][..]),
    ] {
        let plugin = common::build_fixture_with(name, "inline_tcp_plugin.c", defines);
        let runs = every(&[8, 4096, 1 << 20], &[DataType::F32, DataType::U8]);
        let n = runs.len();
        let job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
        let reports = launch_env(2, job, vec![])
            .unwrap_or_else(|e| panic!("the job over the {name} plugin failed: {e}"));
        for report in &reports {
            assert_eq!(report.plugin, "inline-tcp", "{report:?}");
            assert_eq!(report.results.len(), n, "{report:?}");
            assert!(report.results.iter().all(|r| r.ok), "{report:?}");
        }
    }
}

#[test]
fn a_plugins_warning_in_a_run_that_succeeds_reaches_the_user() {
    // A plugin's warnings (ours: "statistics not written: ...") go to each rank's stderr; a
    // run whose ranks all succeed printed none of them, so a lost statistics file went
    // unnoticed.
    let plugin = common::build_fixture("inline-warn", "inline_tcp_plugin.c");
    let said = "statistics not written: a test of the warning path";
    let out = std::process::Command::new(common::lossy_exe())
        .args(["demo", "--sizes", "4K", "--library"])
        .arg(&plugin)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("INLINE_TCP_WARN", said)
        .env_remove("NCCL_DEBUG")
        .output()
        .expect("run lossy demo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for rank in 0..4 {
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&format!("rank {rank}: ")) && l.contains(said)),
            "rank {rank}'s warning is not shown:\n{stderr}"
        );
    }
    // Without the warning, nothing of the ranks' stderr is shown.
    let out = std::process::Command::new(common::lossy_exe())
        .args(["demo", "--sizes", "4K", "--library"])
        .arg(&plugin)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_DEBUG")
        .output()
        .expect("run lossy demo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("rank 0: "), "{stderr}");
}

#[test]
fn a_plugin_that_frees_receive_slots_at_irecv_consumed_runs_as_under_nccl() {
    // NCCL calls `irecvConsumed` (when the plugin has one) for every receive once its data
    // was read, before the step is posted again (`recvProxyProgress`, src/transport/net.cc),
    // so a plugin may keep a receive's resources until then. This one holds one of 8 slots
    // per receive comm from `irecv` to `irecvConsumed` and refuses that call for a request
    // `test` has not reported done: a driver that never calls it runs out of slots after 8
    // receives and waits forever for a post the plugin keeps refusing.
    let plugin = forward_plugin("consumed-slots");
    let runs = every(&[4096, 1 << 20, 5 << 20], &[DataType::F32]);
    let n = runs.len();
    let mut job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
    job.timeout_s = 10.0;
    let mut env = env();
    env.push(("FORWARD_PLUGIN_CONSUMED_SLOTS".into(), "1".into()));
    env.push(("NCCL_LOSSY_SET".into(), "model.rate=0".into()));
    let reports = launch_env(2, job, env).unwrap_or_else(|e| panic!("the job failed: {e}"));
    for report in &reports {
        assert_eq!(report.results.len(), n, "{report:?}");
        assert!(report.results.iter().all(|r| r.ok), "{report:?}");
    }
}

/// Runs a 4 KiB all-reduce through the forwarding plugin with its device 0 reporting
/// `type_version` (`T,V`) as netDeviceType and netDeviceVersion.
fn run_with_device_type(test: &str, type_version: &str) -> nccl_net_lossy::Result<()> {
    let job = Job::collectives(
        forward_plugin(test),
        vec![LinkKind::Plugin],
        every(&[4096], &[DataType::F32]),
    );
    let mut env = env();
    env.push(("FORWARD_PLUGIN_DEVICE_TYPE".into(), type_version.into()));
    env.push(("NCCL_LOSSY_SET".into(), "model.rate=0".into()));
    launch_env(2, job, env).map(|_| ())
}

#[test]
fn a_plugin_whose_device_nccl_would_not_use_is_refused_at_init() {
    // NCCL assigns a net plugin to a communicator only when device 0's netDeviceType is
    // NCCL_NET_DEVICE_HOST, or NCCL_NET_DEVICE_UNPACK of the version it was built with (0x7);
    // any other type is "Unknown device code index" and the plugin is finalized unused
    // (`ncclNetCheckDeviceVersion`, src/plugin/net.cc).
    for (test, tv) in [("device-type-2", "2,0"), ("device-unpack-v6", "1,6")] {
        let err = run_with_device_type(test, tv).expect_err(tv);
        assert!(err.message.contains("netDeviceType"), "{tv}: {err}");
    }
    // A host device of any version is used.
    run_with_device_type("device-host", "0,3").expect("a host device");
}

#[test]
fn init_gets_a_profiler_callback_and_every_post_a_profiler_handle_as_nccl_passes_them() {
    // NCCL 2.26+ hands a v10+ `init` its profiler callback whether or not a profiler is
    // loaded (src/plugin/net.cc; the callback then does nothing), and every isend and each
    // buffer of an irecv a handle of the proxy's (src/transport/net.cc: `&sub->pHandles[..]`).
    // The harness passed NULL for all three, so a plugin's profiler path, which runs for every
    // message under NCCL, never ran under it, and a plugin that calls the callback
    // unconditionally would have crashed only under the harness.
    let plugin = forward_plugin("profiler-log");
    let log = plugin.with_file_name("profiler.txt");
    let _ = std::fs::remove_file(&log);
    exact_through(
        plugin,
        &[(
            "FORWARD_PLUGIN_PROFILER_LOG",
            log.to_str().expect("UTF-8 path"),
        )],
    );
    let text = std::fs::read_to_string(&log).expect("the plugin's log of profiler arguments");
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f.len(), 4, "{line}");
        assert_eq!(f[1], "1", "a NULL profiler argument: {line}");
        *seen.entry(f[0]).or_default() += 1;
    }
    // Both ranks initialise, and both send and receive.
    assert!(seen.get("init").is_some_and(|&n| n >= 2), "{text}");
    assert!(seen.get("send").is_some_and(|&n| n >= 2), "{text}");
    assert!(seen.get("recv").is_some_and(|&n| n >= 2), "{text}");
}

#[test]
fn messages_carry_the_ranks_as_tags_as_nccl_posts_them() {
    // NCCL's proxy tags every send with the sender's rank and posts every receive with the
    // peer's (src/transport/net.cc: isend(..., tpRank, ...), irecv tags = tpRemoteRank). The
    // harness tagged everything 0x52, so a plugin that sorts messages by tag, as it may under
    // NCCL, saw tags no NCCL run gives it.
    let plugin = forward_plugin("tag-log");
    let log = plugin.with_file_name("tags.txt");
    let _ = std::fs::remove_file(&log);
    exact_through(
        plugin,
        &[("FORWARD_PLUGIN_TAG_LOG", log.to_str().expect("UTF-8 path"))],
    );
    let text = std::fs::read_to_string(&log).expect("the plugin's log of tags");
    // Per process (a rank): the tags of its sends and of its receives.
    let mut by_pid: std::collections::BTreeMap<u32, (Vec<i32>, Vec<i32>)> = Default::default();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let (tag, pid): (i32, u32) = (f[1].parse().expect("tag"), f[2].parse().expect("pid"));
        let entry = by_pid.entry(pid).or_default();
        match f[0] {
            "send" => entry.0.push(tag),
            _ => entry.1.push(tag),
        }
    }
    assert_eq!(by_pid.len(), 2, "{text}");
    let mut senders = Vec::new();
    for (pid, (sends, recvs)) in &by_pid {
        assert!(!sends.is_empty() && !recvs.is_empty(), "{pid}: {text}");
        let rank = sends[0];
        assert!(sends.iter().all(|&t| t == rank), "{pid} sends {sends:?}");
        // A ring of 2: each rank receives from the other.
        assert!(
            recvs.iter().all(|&t| t == 1 - rank),
            "{pid} receives {recvs:?}"
        );
        senders.push(rank);
    }
    senders.sort_unstable();
    assert_eq!(senders, vec![0, 1], "{text}");
}

/// Runs `runs` on two ranks through the inline TCP fixture (built as `name`), which logs
/// every `setNetAttr` it gets; every result must check out. The log's text.
fn attributes_logged(name: &str, runs: Vec<RunSpec>) -> String {
    let plugin = common::build_fixture(name, "inline_tcp_plugin.c");
    let log = plugin.with_file_name("attrs.txt");
    let job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
    let env = vec![("INLINE_TCP_LOG".to_string(), log.display().to_string())];
    let reports = launch_env(2, job, env).unwrap_or_else(|e| panic!("the job failed: {e}"));
    assert!(
        reports.iter().all(|r| r.results.iter().all(|x| x.ok)),
        "{reports:?}"
    );
    std::fs::read_to_string(&log).expect("the plugin's log of attributes")
}

#[test]
fn set_net_attr_comes_as_nccls_proxy_sends_it_at_connect_and_per_collective_with_flows() {
    // NCCL's proxy calls setNetAttr before each connect and accept call with the
    // connection's hints (`populateCommNetAttrs`: op NCCL_NET_ATTR_UNDEF for a collective
    // connection, at least one peer and one flow per peer), and before a collective's
    // transfers with its op and the op's peers and channels (`setXferNetAttrs`,
    // src/transport/net.cc): never zero flows. The harness sent only the per-collective
    // call, with zero peers and flows, so a plugin that sizes its flows from them got what
    // no NCCL run gives.
    let text = attributes_logged("inline-net-attr", every(&[4096], &[DataType::F32]));
    let attrs: Vec<&str> = text.lines().filter(|l| l.starts_with("attr ")).collect();
    let undef = format!("op {} ", u32::MAX);
    assert!(
        attrs.first().is_some_and(|l| l.contains(&undef)),
        "no connection hints before the first collective's:\n{text}"
    );
    for line in &attrs {
        let flows: i32 = line
            .rsplit(' ')
            .next()
            .and_then(|f| f.parse().ok())
            .expect("flows");
        assert!(flows >= 1, "setNetAttr with {flows} flows: {line}\n{text}");
    }
    for op in [1u32 << 2, 1 << 3, 1 << 4] {
        assert!(
            attrs.iter().any(|l| l.contains(&format!("op {op} "))),
            "no setNetAttr for op {op}:\n{text}"
        );
    }
}

#[test]
fn set_net_attr_per_collective_comes_only_when_the_hints_change_as_from_nccls_proxy() {
    // NCCL's proxy keeps the hints it last gave (`proxyState->netAttr`) and calls
    // setNetAttr before a transfer only when the operation's differ (`setXferNetAttrs`
    // compares them with memcmp, src/transport/net.cc): the same collective run again and
    // again gives one call, another collective a new one. The harness called it before
    // every collective, a call per iteration that NCCL's proxy never makes (and that
    // `lossy bench` timed against raw TCP, which makes none).
    let run = |collective, iters| RunSpec {
        collective,
        dtype: DataType::F32,
        bytes: 4096,
        iters,
        warmup: 1,
    };
    let runs = vec![
        run(Collective::AllReduce, 5),
        run(Collective::AllReduce, 3),
        run(Collective::AllGather, 4),
        run(Collective::AllReduce, 2),
    ];
    let text = attributes_logged("inline-net-attr-once", runs);
    // Both ranks log to the one file; each gives its hints in the same order.
    let ops: Vec<u32> = text
        .lines()
        .filter(|l| l.starts_with("attr "))
        .filter_map(|l| {
            let op: u32 = l.split(' ').nth(4)?.parse().ok()?;
            (op != u32::MAX).then_some(op)
        })
        .collect();
    let (reduce, gather) = (
        Collective::AllReduce.op_bits(),
        Collective::AllGather.op_bits(),
    );
    let count = |op| ops.iter().filter(|&&o| o == op).count();
    assert_eq!(
        count(reduce),
        4,
        "two all-reduce stretches per rank:\n{text}"
    );
    assert_eq!(count(gather), 2, "one all-gather stretch per rank:\n{text}");
}

#[test]
fn a_plugin_whose_set_net_attr_fails_runs_as_under_nccl() {
    // NCCL's proxy discards what setNetAttr returns (`setNetAttrs`, src/transport/net.cc):
    // a plugin that fails it still runs. The harness failed the job at the first call.
    let plugin = common::build_fixture("inline-attr-fails", "inline_tcp_plugin.c");
    let log = plugin.with_file_name("attrs.txt");
    let runs = every(&[4096], &[DataType::F32]);
    let n = runs.len();
    let job = Job::collectives(plugin, vec![LinkKind::Plugin], runs);
    let env = vec![
        ("INLINE_TCP_LOG".to_string(), log.display().to_string()),
        ("INLINE_TCP_ATTR_FAILS".to_string(), "1".to_string()),
    ];
    let reports = launch_env(2, job, env).unwrap_or_else(|e| panic!("the job failed: {e}"));
    for report in &reports {
        assert_eq!(report.results.len(), n, "{report:?}");
        assert!(report.results.iter().all(|r| r.ok), "{report:?}");
    }
    let text = std::fs::read_to_string(&log).expect("the plugin's log of attributes");
    assert!(
        text.lines().any(|l| l.starts_with("attr ")),
        "setNetAttr never called:\n{text}"
    );
}

#[test]
fn a_comm_a_failed_connect_handed_out_is_closed_as_nccl_closes_it() {
    // NCCL's proxy closes the sendComm a failed `connect` left in its out-pointer
    // (`sendProxyConnect`, src/transport/net.cc) before it reports the error; the harness
    // dropped it, so the plugin's connection stayed open.
    let plugin = forward_plugin("connect-fails-with-comm");
    let log = plugin.with_file_name("connects.txt");
    let job = Job::collectives(
        plugin,
        vec![LinkKind::Plugin],
        every(&[4096], &[DataType::F32]),
    );
    let mut env = env();
    env.push((
        "FORWARD_PLUGIN_CONNECT_FAIL_LOG".to_string(),
        log.display().to_string(),
    ));
    let err = launch_env(2, job, env).expect_err("a job whose connects fail");
    assert!(err.message.contains("connect"), "{err}");
    let text = std::fs::read_to_string(&log).expect("the plugin's log of connects");
    let handed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("handed "))
        .collect();
    assert!(!handed.is_empty(), "no connect handed out a comm:\n{text}");
    for comm in handed {
        assert!(
            text.lines()
                .any(|l| l.strip_prefix("closed ") == Some(comm)),
            "comm {comm} was never closed:\n{text}"
        );
    }
}

#[test]
fn a_plugin_whose_max_p2p_bytes_nccl_refuses_gets_no_connection() {
    // NCCL sets up no connection of a plugin whose device reports maxP2pBytes outside
    // (0, 1 TiB]: sendProxySetup and recvProxySetup fail with ncclInternalError ("net plugin
    // returned invalid value for maxP2pBytes", src/transport/net.cc). The harness ran it.
    let run = |test: &str, bytes: &str| {
        let job = Job::collectives(
            forward_plugin(test),
            vec![LinkKind::Plugin],
            every(&[4096], &[DataType::F32]),
        );
        let mut env = env();
        env.push(("FORWARD_PLUGIN_MAX_P2P_BYTES".into(), bytes.into()));
        env.push(("NCCL_LOSSY_SET".into(), "model.rate=0".into()));
        launch_env(2, job, env).map(|_| ())
    };
    for (test, bytes) in [("max-p2p-zero", "0"), ("max-p2p-over-1t", "0x10000000001")] {
        let err = run(test, bytes).expect_err(bytes);
        assert!(err.message.contains("maxP2pBytes"), "{bytes}: {err}");
    }
    run("max-p2p-1t", "0x10000000000").expect("1 TiB, NCCL's largest");
}
