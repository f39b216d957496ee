//! Wrap mode end to end: worker processes load the built library, which loads a second copy
//! of itself (the same file copied under another name, `dlopen`ed privately) as its inner
//! net plugin. The outer copy injects loss and sends side messages; the inner copy carries
//! the bytes on its sockets.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{assert_all_exact, every, fresh_dir, launch_env, library, repo_file, total_census};
use lossy_cli::harness::collectives::DataType;
use lossy_cli::harness::plugin_client::op;
use lossy_cli::harness::worker::{Job, LinkKind, Task, WorkerReport};
use nccl_net_lossy::stats::report::load_run;

/// A copy of the built library under another file name, as a wrapped plugin would be.
fn inner_copy(dir: &Path) -> PathBuf {
    let copy = dir.join("libnccl-net-innercopy.so");
    std::fs::copy(library(), &copy).expect("copy the plugin library");
    copy
}

/// Lossless collectives (several sizes, f32 and u8) on `nranks` ranks wrapping `inner`,
/// driven through net API `version`: every result bit-exact, and NCCL sees our name.
fn exact_over(inner: &Path, nranks: usize, version: u32) {
    let runs = every(&[0, 7, 4096, (1 << 20) + 3], &[DataType::F32, DataType::U8]);
    let n = runs.len();
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], runs);
    job.version = version;
    job.timeout_s = 60.0;
    let env = vec![
        (
            "NCCL_LOSSY_PROFILE".into(),
            repo_file("configs/lossless.toml").display().to_string(),
        ),
        ("NCCL_LOSSY_INNER".into(), inner.display().to_string()),
    ];
    let reports = launch_env(nranks, job, env)
        .unwrap_or_else(|e| panic!("v{version} over {}: run failed: {e}", inner.display()));
    assert_all_exact(&reports, n);
    assert!(
        reports.iter().all(|r| r.plugin == "lossy"),
        "our name stays"
    );
}

#[test]
fn wrapped_collectives_are_bit_exact_at_zero_loss_on_every_abi_version() {
    let dir = fresh_dir("exact");
    let inner = inner_copy(&dir);
    for version in [8, 10, 12] {
        exact_over(&inner, 3, version);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// 2 ranks x 40 messages of 1 MiB (256 packets each), under a loss profile, with statistics.
fn lossy_messages(effect: &str, inner: Option<&Path>, stats: &Path) -> Vec<WorkerReport> {
    lossy_messages_env(effect, inner, stats, &[])
}

/// As [`lossy_messages`], with more variables set on every rank.
fn lossy_messages_env(
    effect: &str,
    inner: Option<&Path>,
    stats: &Path,
    more: &[(&str, &str)],
) -> Vec<WorkerReport> {
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], Vec::new());
    job.task = Task::Messages {
        bytes: 1 << 20,
        count: 40,
        mtu: 4096,
        op_bits: op::SEND_RECV,
    };
    job.timeout_s = 60.0;
    let mut env = vec![
        (
            "NCCL_LOSSY_PROFILE".into(),
            repo_file("configs/uniform-1pct.toml").display().to_string(),
        ),
        ("NCCL_LOSSY_SET".into(), format!("effect={effect};seed=11")),
        ("NCCL_LOSSY_STATS".into(), stats.display().to_string()),
    ];
    if let Some(inner) = inner {
        env.push(("NCCL_LOSSY_INNER".into(), inner.display().to_string()));
    }
    env.extend(more.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    launch_env(2, job, env).unwrap_or_else(|e| panic!("run failed: {e}"))
}

#[test]
fn wrapped_loss_matches_the_direct_transport_packet_for_packet() {
    let dir = fresh_dir("stats");
    let inner = inner_copy(&dir);
    for effect in ["zero", "stale", "bitflip", "retransmit"] {
        let direct_stats = dir.join(format!("direct-{effect}"));
        let wrapped_stats = dir.join(format!("wrapped-{effect}"));
        let direct = total_census(&lossy_messages(effect, None, &direct_stats));
        let wrapped = total_census(&lossy_messages(effect, Some(&inner), &wrapped_stats));
        // Same seed, same messages: the same packets are lost and damaged the same way.
        assert_eq!(wrapped, direct, "{effect}");
        let d = load_run(&direct_stats).expect("direct statistics");
        let w = load_run(&wrapped_stats).expect("wrapped statistics");
        // One file per rank: the inner copy writes none.
        assert_eq!((d.ranks, w.ranks), (2, 2), "{effect}");
        assert_eq!(w.total.counts, d.total.counts, "{effect}");
        assert_eq!(w.total.bursts, d.total.bursts, "{effect}");
        assert!(
            d.total.counts.lost_packets > 0,
            "{effect}: the profile loses packets"
        );
        let damaged = match effect {
            "zero" => wrapped.zeroed,
            "stale" => wrapped.stale,
            "bitflip" => wrapped.flipped,
            _ => 0,
        };
        let expected = if effect == "retransmit" {
            0
        } else {
            w.total.counts.lost_packets
        };
        assert_eq!(damaged, expected, "{effect}: {wrapped:?}");
        assert_eq!(
            wrapped.intact + damaged,
            wrapped.packets,
            "{effect}: {wrapped:?}"
        );
        assert_eq!(w.profile["transport"], "wrap", "{effect}");
        assert_eq!(w.profile["inner"], inner.display().to_string(), "{effect}");
        assert_eq!(d.profile["transport"], "socket", "{effect}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs 2 lossless ranks with `inner`, expecting the workers to fail; returns the error text.
fn failing_run(inner: &str) -> String {
    failing_run_env(inner, &[])
}

/// As [`failing_run`], with more variables for the workers.
fn failing_run_env(inner: &str, env: &[(&str, &str)]) -> String {
    let runs = every(&[4096], &[DataType::F32]);
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], runs);
    job.timeout_s = 20.0;
    let mut all = vec![("NCCL_LOSSY_INNER".to_string(), inner.to_string())];
    all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    match launch_env(2, job, all) {
        Ok(_) => panic!("a run wrapping {inner:?} succeeded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_missing_or_broken_inner_library_fails_init_clearly() {
    let dir = fresh_dir("broken");
    let missing = dir.join("libnccl-net-missing.so");
    let err = failing_run(&missing.display().to_string());
    assert!(
        err.contains("cannot load the inner net plugin") && err.contains("libnccl-net-missing.so"),
        "{err}"
    );
    let garbage = dir.join("libnccl-net-garbage.so");
    std::fs::write(&garbage, b"this is not an ELF file").expect("write");
    let err = failing_run(&garbage.display().to_string());
    assert!(err.contains("cannot load the inner net plugin"), "{err}");
    // Wrapping the very file that is loaded would recurse into itself.
    let err = failing_run(&library().display().to_string());
    assert!(err.contains("is this library itself"), "{err}");
    // So would a plugin in front of it, or of a copy of it, whose init leads back here: a
    // clear error, not an init that never returns (it deadlocked on the runtime's lock).
    let shim = common::build_fixture("wrap-shim", "forward_plugin.c");
    let copy = dir.join("libnccl-net-lossy-copy.so");
    std::fs::copy(library(), &copy).expect("copy the library");
    for target in [library(), copy] {
        let target = target.display().to_string();
        let err = failing_run_env(
            &shim.display().to_string(),
            &[("FORWARD_PLUGIN_TARGET", target.as_str())],
        );
        assert!(
            err.contains("leads back into this library"),
            "{target}: {err}"
        );
    }
    // An inner plugin with no device (its hardware is missing) is named in the error.
    let target = common::build_fixture_with("wrap-no-devices-target", "inline_tcp_plugin.c", &[]);
    let target = target.display().to_string();
    let shim = shim.display().to_string();
    let err = failing_run_env(
        &shim,
        &[
            ("FORWARD_PLUGIN_TARGET", target.as_str()),
            ("FORWARD_PLUGIN_NO_DEVICES", "1"),
        ],
    );
    assert!(
        err.contains(&format!("wrap mode (inner {shim:?})")) && err.contains("reports no devices"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Drives `WrapTransport` in this process over a private copy of the library, using the
/// inner table of API `version`: regMr, side + data messages, every effect.
fn in_process_round_trip(version: u32, dir: &Path) {
    use nccl_net_lossy::loss::plan::{Effect, LossPlan, PacketRun};
    use nccl_net_lossy::transport::wrap::{WrapOptions, WrapTransport};
    use nccl_net_lossy::transport::{HostBuf, Transport, HANDLE_WIRE_SIZE};

    // A copy per version: each file is its own image with its own (inner-mode) state.
    let inner = dir.join(format!("libnccl-net-inner-v{version}.so"));
    std::fs::copy(library(), &inner).expect("copy");
    let options = WrapOptions {
        keep_stale_copy: true,
        ..WrapOptions::default()
    };
    let t = WrapTransport::open_up_to(&inner.display().to_string(), None, options, version)
        .unwrap_or_else(|e| panic!("v{version}: {e}"));
    assert_eq!(t.inner_version(), version);
    let props = t.properties(0).expect("device 0");
    assert!(props.name.starts_with("lossy:"), "{}", props.name);
    assert_eq!(props.max_recvs, 1);
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, None, &mut handle).expect("listen");
    let mut connector = t.connect(0, None, &handle).expect("connect");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (mut send, mut recv) = (None, None);
    while send.is_none() || recv.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "v{version}: connect timed out"
        );
        if send.is_none() {
            send = connector.poll().expect("connect poll");
        }
        if recv.is_none() {
            recv = listener.poll_accept().expect("accept");
        }
    }
    let (send, recv) = (send.unwrap(), recv.unwrap());
    const LEN: usize = 64 * 1024; // 16 packets of 4096
    let payload: Vec<u8> = (0..LEN).map(|i| (i * 7 + 1) as u8).collect();
    let mut src = payload.clone();
    let mut dst = vec![0xeeu8; LEN];
    let src_mr = send
        // SAFETY: registering lends only the address and length, which the inner plugin pins;
        // requests below lend the bytes, each waited for before the test touches them.
        .register(unsafe { HostBuf::from_slice(&mut src) })
        .expect("regMr send");
    let dst_mr = recv
        // SAFETY: registering lends only the address and length, which the inner plugin pins;
        // requests below lend the bytes, each waited for before the test touches them.
        .register(unsafe { HostBuf::from_slice(&mut dst) })
        .expect("regMr recv");
    for (effect, lost) in [
        (Effect::Zero, vec![PacketRun { start: 1, len: 2 }]),
        (Effect::Stale, vec![PacketRun { start: 15, len: 1 }]),
        (
            Effect::Bitflip,
            vec![
                PacketRun { start: 0, len: 1 },
                PacketRun { start: 4, len: 1 },
            ],
        ),
        (Effect::Retransmit, vec![PacketRun { start: 3, len: 1 }]),
        (Effect::Zero, Vec::new()),
    ] {
        dst.fill(0xee);
        let plan = LossPlan {
            effect,
            lost: lost.clone(),
            flip_seed: 99,
            ..LossPlan::lossless()
        };
        // SAFETY: the buffer outlives the request and is touched again only after it completed.
        let rbuf = unsafe { HostBuf::from_slice(&mut dst) }.with_mr(dst_mr);
        let rid = recv
            .irecv(&[rbuf], &[5])
            .expect("irecv")
            .expect("a free slot");
        // SAFETY: the buffer outlives the request and is touched again only after it completed.
        let sbuf = unsafe { HostBuf::from_slice(&mut src) }.with_mr(src_mr);
        let sid = send
            .isend(sbuf, 5, &plan)
            .expect("isend")
            .expect("a free slot");
        let (mut sent, mut got) = (None, None);
        while sent.is_none() || got.is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "v{version}: transfer timed out"
            );
            if sent.is_none() {
                sent = send.test(sid).expect("test send");
            }
            if got.is_none() {
                got = recv.test(rid).expect("test recv");
            }
        }
        assert_eq!(got.unwrap().sizes(), [LEN]);
        for (i, (&got, &want)) in dst.iter().zip(&payload).enumerate() {
            let in_lost = lost
                .iter()
                .any(|r| (r.start..r.end()).contains(&((i / 4096) as u32)));
            match effect {
                Effect::Zero if in_lost => assert_eq!(got, 0, "v{version} {effect:?} @{i}"),
                Effect::Stale if in_lost => assert_eq!(got, 0xee, "v{version} {effect:?} @{i}"),
                Effect::Bitflip if in_lost => {}
                _ => assert_eq!(got, want, "v{version} {effect:?} @{i}"),
            }
        }
        if effect == Effect::Bitflip {
            let flipped: u32 = dst
                .iter()
                .zip(&payload)
                .map(|(a, b)| (a ^ b).count_ones())
                .sum();
            assert_eq!(flipped, 2, "v{version}: one bit per lost packet");
        }
    }
    // Several messages in flight, tested newest first: each receive still gets its own
    // message (they match in posting order, whatever order they are tested in).
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; LEN]).collect();
    let mrs: Vec<usize> = bufs
        .iter_mut()
        .map(|b| {
            // SAFETY: registering lends only the address and length, which the inner plugin
            // pins; requests below lend the bytes, each waited for before the test touches them.
            recv.register(unsafe { HostBuf::from_slice(b) })
                .expect("regMr")
        })
        .collect();
    let mut srcs: Vec<Vec<u8>> = (0..3u8).map(|k| vec![k + 1; LEN - k as usize]).collect();
    let smrs: Vec<usize> = srcs
        .iter_mut()
        .map(|b| {
            // SAFETY: registering lends only the address and length, which the inner plugin
            // pins; requests below lend the bytes, each waited for before the test touches them.
            send.register(unsafe { HostBuf::from_slice(b) })
                .expect("regMr")
        })
        .collect();
    let rids: Vec<u32> = (0..3)
        .map(|k| {
            // SAFETY: the buffer outlives the request and is touched again only after it completed.
            let b = unsafe { HostBuf::from_slice(&mut bufs[k]) }.with_mr(mrs[k]);
            recv.irecv(&[b], &[7]).expect("irecv").expect("slot")
        })
        .collect();
    let sids: Vec<u32> = (0..3)
        .map(|k| {
            // SAFETY: the buffer outlives the request and is touched again only after it completed.
            let b = unsafe { HostBuf::from_slice(&mut srcs[k]) }.with_mr(smrs[k]);
            send.isend(b, 7, &LossPlan::lossless())
                .expect("isend")
                .expect("slot")
        })
        .collect();
    let mut pending: Vec<(bool, u32, usize)> = sids
        .iter()
        .map(|&id| (true, id, 0))
        .chain(
            rids.iter()
                .rev()
                .enumerate()
                .map(|(i, &id)| (false, id, 2 - i)),
        )
        .collect();
    while !pending.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "v{version}: in-flight timed out"
        );
        pending.retain(|&(is_send, id, k)| {
            if is_send {
                send.test(id).expect("test").is_none()
            } else {
                match recv.test(id).expect("test") {
                    Some(done) => {
                        assert_eq!(done.sizes(), [LEN - k], "v{version} message {k}");
                        false
                    }
                    None => true,
                }
            }
        });
    }
    for (k, b) in bufs.iter().enumerate() {
        assert!(
            b[..LEN - k].iter().all(|&x| x == k as u8 + 1),
            "v{version} message {k}"
        );
    }
    send.deregister(src_mr).expect("deregMr");
    recv.deregister(dst_mr).expect("deregMr");
}

#[test]
fn every_inner_api_version_carries_side_and_data_messages() {
    let dir = fresh_dir("versions");
    for version in 8..=12 {
        in_process_round_trip(version, &dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// With more wrap slots than the inner plugin has requests (32 per connection), the inner
/// plugin refuses requests: a message whose side message went out but whose data was
/// refused is finished by NCCL's retry of the same message, and every byte arrives in order.
#[test]
fn an_inner_plugin_out_of_requests_gets_the_data_on_the_retry() {
    use nccl_net_lossy::loss::plan::LossPlan;
    use nccl_net_lossy::transport::wrap::{WrapOptions, WrapTransport};
    use nccl_net_lossy::transport::{HostBuf, Transport, HANDLE_WIRE_SIZE};

    let dir = fresh_dir("retry");
    let inner = dir.join("libnccl-net-inner-retry.so");
    std::fs::copy(library(), &inner).expect("copy");
    let options = WrapOptions {
        slots: 20,
        ..WrapOptions::default()
    };
    let t = WrapTransport::open(&inner.display().to_string(), None, options).expect("open");
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, None, &mut handle).expect("listen");
    let mut connector = t.connect(0, None, &handle).expect("connect");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (mut send, mut recv) = (None, None);
    while send.is_none() || recv.is_none() {
        assert!(std::time::Instant::now() < deadline, "connect timed out");
        if send.is_none() {
            send = connector.poll().expect("connect poll");
        }
        if recv.is_none() {
            recv = listener.poll_accept().expect("accept");
        }
    }
    let (send, recv) = (send.unwrap(), recv.unwrap());
    // Message 0 is large and has no receive yet: its data stays in flight while its side
    // message completes, so the inner plugin holds an odd number of send requests.
    const BIG: usize = 64 << 20;
    const SMALL: usize = 4096;
    let mut srcs: Vec<Vec<u8>> = std::iter::once(vec![1u8; BIG])
        .chain((1..=16u8).map(|k| vec![k + 1; SMALL]))
        .collect();
    let smrs: Vec<usize> = srcs
        .iter_mut()
        .map(|b| {
            // SAFETY: registering lends only the address and length, which the inner plugin
            // pins; requests below lend the bytes, each waited for before the test touches them.
            send.register(unsafe { HostBuf::from_slice(b) })
                .expect("regMr")
        })
        .collect();
    let plan = LossPlan::lossless();
    let post = |k: usize, srcs: &mut Vec<Vec<u8>>| {
        // SAFETY: the buffer outlives the request and is touched again only after it completed.
        let b = unsafe { HostBuf::from_slice(&mut srcs[k]) }.with_mr(smrs[k]);
        send.isend(b, 3, &plan).expect("isend")
    };
    let big = post(0, &mut srcs).expect("slot for the big message");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        send.test(big).expect("test").is_none(),
        "no receive posted yet"
    );
    // 1 inner request (big data) + 15 messages x 2 = 31; message 16's side message takes
    // the 32nd and its data is refused.
    let mut sids = vec![big];
    for k in 1..=15 {
        sids.push(post(k, &mut srcs).unwrap_or_else(|| panic!("message {k} refused")));
    }
    assert_eq!(
        post(16, &mut srcs),
        None,
        "the inner plugin must run out of requests"
    );
    // Receive everything, in order, at most 15 messages (30 inner requests) at a time.
    let mut dsts: Vec<Vec<u8>> = std::iter::once(vec![0u8; BIG])
        .chain((1..=16).map(|_| vec![0u8; SMALL]))
        .collect();
    let dmrs: Vec<usize> = dsts
        .iter_mut()
        .map(|b| {
            // SAFETY: registering lends only the address and length, which the inner plugin
            // pins; requests below lend the bytes, each waited for before the test touches them.
            recv.register(unsafe { HostBuf::from_slice(b) })
                .expect("regMr")
        })
        .collect();
    let mut next_recv = 0;
    let mut rids: Vec<(usize, u32)> = Vec::new();
    let mut last_sent = false;
    let mut received = 0;
    while received < 17 {
        assert!(
            std::time::Instant::now() < deadline,
            "transfer timed out ({received} received)"
        );
        while next_recv < 17 && rids.len() < 15 {
            // SAFETY: the buffer outlives the request and is touched again only after it completed.
            let b = unsafe { HostBuf::from_slice(&mut dsts[next_recv]) }.with_mr(dmrs[next_recv]);
            let id = recv.irecv(&[b], &[3]).expect("irecv").expect("slot");
            rids.push((next_recv, id));
            next_recv += 1;
        }
        sids.retain(|&id| send.test(id).expect("test send").is_none());
        if !last_sent {
            if let Some(id) = post(16, &mut srcs) {
                sids.push(id);
                last_sent = true;
            }
        }
        rids.retain(|&(k, id)| match recv.test(id).expect("test recv") {
            Some(done) => {
                assert_eq!(done.sizes(), [if k == 0 { BIG } else { SMALL }]);
                received += 1;
                false
            }
            None => true,
        });
    }
    assert!(last_sent);
    for (k, d) in dsts.iter().enumerate() {
        assert!(d.iter().all(|&x| x == k as u8 + 1), "message {k}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_inner_device_that_does_not_list_host_memory_is_wrapped_as_nccl_uses_it() {
    // NCCL never checks NCCL_PTR_HOST in a device's ptrSupport: it registers host buffers with
    // any plugin (its bootstrap over the net, its host-staged proxy buffers), and only an
    // inner regMr that refuses one fails. Wrap mode refused such a device at init, stricter
    // than NCCL; the calibration plugin built to list NCCL_PTR_CUDA only must wrap cleanly.
    let inner =
        common::build_fixture_with("wrap-no-host-ptr", "inline_tcp_plugin.c", &["NO_HOST_PTR"]);
    exact_over(&inner, 2, 12);
}

#[test]
fn an_inner_plugin_that_reports_no_sizes_is_wrapped_as_nccl_uses_it() {
    // NCCL reads no send's size and a receive's only for its profiler and GPU flushes, so a
    // plugin may leave them unwritten; wrap mode needed them (its side message was checked
    // against the reported data size) and failed such a plugin with "bad side message".
    // The inner plugin here is the forwarding fixture with its sizes switched off, in front
    // of the calibration plugin: the same packets must be lost and damaged as on our own
    // sockets with the same seed.
    loses_behind_the_forwarder_as_on_our_sockets(
        "no-sizes",
        ("FORWARD_PLUGIN_NO_SIZES", "1"),
        &["zero", "bitflip", "retransmit"],
    );
}

#[test]
fn inner_posts_answered_not_yet_lose_and_count_as_on_our_sockets() {
    // A plugin may answer isend/irecv with a NULL request ("not yet"); NCCL posts the same
    // message again later. The inner plugin here refuses every other post (the forwarding
    // fixture with FORWARD_PLUGIN_NULL_POSTS=1, in front of the calibration plugin), so side
    // messages, data messages and their retries all meet a refusal: every message must still
    // be lost and damaged exactly as on our own sockets with the same seed, and counted once.
    loses_behind_the_forwarder_as_on_our_sockets(
        "null-posts",
        ("FORWARD_PLUGIN_NULL_POSTS", "1"),
        &["zero", "stale", "retransmit"],
    );
}

#[test]
fn an_inner_plugin_that_frees_receives_at_irecv_consumed_is_told_as_nccl_tells_it() {
    // NCCL calls `irecvConsumed` on every finished receive of a plugin that has it
    // (src/transport/net.cc, recvProxyProgress). Wrap mode never passed it on, so an inner
    // plugin that frees a receive's resources there (the forwarding fixture with
    // FORWARD_PLUGIN_CONSUMED_SLOTS=1: 8 receive slots a comm) ran out of them after 8
    // receives and the job timed out.
    loses_behind_the_forwarder_as_on_our_sockets(
        "consumed-slots",
        ("FORWARD_PLUGIN_CONSUMED_SLOTS", "1"),
        &["zero"],
    );
}

/// Runs each of `effects` on our own sockets and wrapped around the forwarding fixture with
/// `quirk`, in front of the calibration plugin, with the same seed: the same packets must be
/// lost and damaged, and the statistics count the same (each message once).
fn loses_behind_the_forwarder_as_on_our_sockets(name: &str, quirk: (&str, &str), effects: &[&str]) {
    let dir = fresh_dir(name);
    let target =
        common::build_fixture_with(&format!("wrap-{name}-target"), "inline_tcp_plugin.c", &[]);
    let inner = common::build_fixture(&format!("wrap-{name}"), "forward_plugin.c");
    let target = target.display().to_string();
    let quirks = [("FORWARD_PLUGIN_TARGET", target.as_str()), quirk];
    for &effect in effects {
        let direct_stats = dir.join(format!("direct-{effect}"));
        let wrapped_stats = dir.join(format!("wrapped-{effect}"));
        let direct = total_census(&lossy_messages(effect, None, &direct_stats));
        let wrapped = total_census(&lossy_messages_env(
            effect,
            Some(&inner),
            &wrapped_stats,
            &quirks,
        ));
        assert_eq!(wrapped, direct, "{effect}");
        let d = load_run(&direct_stats).expect("direct statistics");
        let w = load_run(&wrapped_stats).expect("wrapped statistics");
        assert_eq!(w.total.counts, d.total.counts, "{effect}");
        assert!(w.total.counts.lost_packets > 0, "{effect}: nothing lost");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
