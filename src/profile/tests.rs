//! Unit tests of the profile parser: resolution, defaults, overrides and error messages.

use std::time::Duration;

use crate::ids::{CollectiveId, Phase};
use crate::loss::model::ModelSpec;
use crate::loss::plan::{Effect, DEFAULT_MTU, DEFAULT_RETRANSMIT_TIMEOUT};
use crate::loss::rules::Direction;
use crate::profile::*;
use crate::Result;

fn parse(text: &str) -> Result<Profile> {
    Profile::parse(text, "configs/x.toml", "")
}

fn err(text: &str, overrides: &str) -> String {
    match Profile::parse(text, "configs/x.toml", overrides) {
        Ok(p) => panic!("expected an error, got {p:?}"),
        Err(e) => e.message,
    }
}

const FULL: &str = r#"
seed = 7
mtu = 2048
stats_interval = 2.5
effect = "zero"
retransmit_timeout_us = 150
model = { kind = "uniform", rate = 0.01 }

[[rules]]
name = "grads"
collective = ["AllReduce", "reducescatter"]
phase = "backward"
steps = { from = 100, until = 200 }
model = { kind = "gilbert_elliott", rate = 0.01, mean_burst = 8 }

[[rules]]
peer = [1, 2]
direction = "recv"
traffic_class = 3
comm_size = 8
effect = "bitflip"
mtu = 512

[[rules]]
collective = "Broadcast"
[rules.model]
kind = "none"
"#;

#[test]
fn full_profile_resolves_defaults_and_inheritance() {
    let p = parse(FULL).unwrap();
    assert_eq!((p.seed, p.mtu), (7, 2048));
    assert_eq!(p.stats_interval, Some(Duration::from_millis(2500)));
    assert_eq!(p.defaults.effect, Effect::Zero);
    assert_eq!(p.defaults.retransmit_timeout, Duration::from_micros(150));
    assert_eq!(p.rules.len(), 3);
    let r0 = &p.rules[0];
    assert_eq!(r0.name.as_deref(), Some("grads"));
    assert_eq!(
        r0.when.collectives,
        Some(vec![CollectiveId::AllReduce, CollectiveId::ReduceScatter])
    );
    assert_eq!(r0.when.phase, Phase::Backward);
    assert_eq!(r0.when.steps, Some((100, Some(200))));
    // Rules inherit what they leave out from the defaults.
    assert_eq!((r0.action.effect, r0.action.mtu), (Effect::Zero, 2048));
    assert_eq!(
        r0.action.model,
        ModelSpec::gilbert_elliott_from_rate(0.01, 8.0).unwrap()
    );
    let r1 = &p.rules[1];
    assert_eq!(r1.action.model, ModelSpec::Uniform { rate: 0.01 });
    assert_eq!((r1.action.effect, r1.action.mtu), (Effect::Bitflip, 512));
    assert_eq!(r1.when.peers, Some(vec![1, 2]));
    assert_eq!(r1.when.direction, Some(Direction::Recv));
    assert_eq!(r1.when.traffic_classes, Some(vec![3]));
    assert_eq!(r1.when.comm_sizes, Some(vec![8]));
    assert_eq!(p.rules[2].action.model, ModelSpec::None);
    assert!(p.corrupts_data() && p.matches_on_collective() && !p.is_lossless());
    let json = p.to_json();
    assert_eq!(json["seed"], 7);
    assert_eq!(json["origin"], "configs/x.toml");
    assert_eq!(json["rules"][0]["match"]["collective"][1], "ReduceScatter");
    assert_eq!(
        json["rules"][0]["action"]["model"]["kind"],
        "gilbert_elliott"
    );
    assert_eq!(json["defaults"]["expected_loss_rate"], 0.01);
    let s = p.summary();
    assert!(s.starts_with("configs/x.toml: seed 7, mtu 2048; default: uniform(rate=0.01), effect zero, expected loss 1% (mean burst 1.0101); 3 rules [collective=AllReduce|ReduceScatter phase=backward steps=[100,200) -> gilbert_elliott("), "{s}");
    assert!(
        s.contains("[collective=Broadcast -> none, effect zero, expected loss 0%]"),
        "{s}"
    );
}

#[test]
fn transport_and_inner_are_read_and_shown() {
    let p = parse("transport = \"wrap\"\ninner = \"ib\"\n").unwrap();
    assert_eq!(p.transport, Some(TransportKind::Wrap));
    assert_eq!(p.inner.as_deref(), Some("ib"));
    assert!(
        p.summary().contains("; transport wrap (inner ib)"),
        "{}",
        p.summary()
    );
    assert_eq!(p.to_json()["transport"], "wrap");
    assert_eq!(p.to_json()["inner"], "ib");
    let p = parse("transport = \"socket\"\n").unwrap();
    assert_eq!((p.transport, p.inner), (Some(TransportKind::Socket), None));
    // As every other name of the profile (effect, model kind, phase), in any case.
    let p = parse("transport = \"Wrap\"\ninner = \"ib\"\n").unwrap();
    assert_eq!(p.transport, Some(TransportKind::Wrap));
    let p = parse("transport = \"SOCKET\"\n").unwrap();
    assert_eq!(p.transport, Some(TransportKind::Socket));
    let p = parse("").unwrap();
    assert_eq!((p.transport, p.inner.clone()), (None, None));
    assert_eq!(p.to_json()["transport"], "socket");
    let p = Profile::parse("", "configs/x.toml", "transport=\"wrap\"").unwrap();
    assert!(p.summary().contains("inner from NCCL_LOSSY_INNER"));
}

#[test]
fn omitted_keys_take_the_documented_defaults() {
    let p = parse("").unwrap();
    assert_eq!(
        (p.seed, p.mtu, p.stats_interval),
        (DEFAULT_SEED, DEFAULT_MTU, None)
    );
    assert_eq!(p.defaults.effect, Effect::Retransmit);
    assert_eq!(p.defaults.model, ModelSpec::None);
    assert_eq!(p.defaults.retransmit_timeout, DEFAULT_RETRANSMIT_TIMEOUT);
    assert!(p.is_lossless() && !p.corrupts_data() && !p.matches_on_collective());
    // Retransmit loses packets but never corrupts data.
    let p = parse("model = { kind = \"uniform\", rate = 0.5 }").unwrap();
    assert!(!p.is_lossless() && !p.corrupts_data());
    assert!(parse("model = \"none\"").unwrap().is_lossless());
}

#[test]
fn embedded_default_is_uniform_one_percent_retransmit() {
    let p = Profile::load(None, "").unwrap();
    assert_eq!(p.origin, EMBEDDED_ORIGIN);
    assert_eq!(p.defaults.model, ModelSpec::Uniform { rate: 0.01 });
    assert_eq!(p.defaults.effect, Effect::Retransmit);
    assert!(!p.corrupts_data());
}

#[test]
fn errors_name_file_line_key_and_what_is_allowed() {
    let cases: &[(&str, &str)] = &[
        ("seed = 1\nmodel = { kind = \"uniform\", rate = 1.5 }\n", "configs/x.toml:2: model.rate = 1.5: must be a probability in [0, 1]"),
        ("seed = 1\n\n[[rules]]\nphase = \"backward\"\nmodel = { kind = \"uniform\", rate = -0.1 }\n", "configs/x.toml:5: rules.0.model.rate = -0.1: must be a probability in [0, 1]"),
        ("sed = 1\n", "configs/x.toml:1: sed: unknown key; allowed: description, seed"),
        // A key that is empty, or that a dotted path would misread, is shown quoted.
        ("\"\" = 1\n", "configs/x.toml:1: \"\": unknown key; allowed: description, seed"),
        ("model = { kind = \"none\", \"a.b\" = 1 }\n", "configs/x.toml:1: model.\"a.b\": unknown key"),
        ("[[rules]]\ncolective = \"AllReduce\"\n", "configs/x.toml:2: rules.0.colective: unknown key; allowed: name, collective"),
        ("mtu = \"big\"\n", "configs/x.toml:1: mtu = \"big\": must be an integer"),
        ("mtu = 32\n", "configs/x.toml:1: mtu = 32: must be an integer in [64, 4294967295]"),
        ("\n\nmodel = { kind = \"gilbert_elliott\", rate = 0.01, mean_burst = 0.5 }\n", "configs/x.toml:3: model.mean_burst = 0.5: must be a number >= 1"),
        ("model = { kind = \"gilbert_elliott\", rate = 1, mean_burst = 4 }\n", "configs/x.toml:1: model.rate = 1: must be < 1 with bursts"),
        ("model = { kind = \"gilbert_elliott\", p = 0.1, rate = 0.01 }\n", "configs/x.toml:1: model.rate = 0.01: gilbert_elliott takes either netem's p, r, h_loss, k_loss or rate and mean_burst, not both"),
        ("model = { kind = \"bursty\" }\n", "configs/x.toml:1: model.kind = \"bursty\": unknown model kind \"bursty\"; allowed: none, uniform, gilbert_elliott, markov4, trace"),
        ("model = { rate = 0.1 }\n", "configs/x.toml:1: model.kind: missing; allowed kinds"),
        ("model = { kind = \"uniform\", rate = \"high\" }\n", "configs/x.toml:1: model.rate = \"high\": must be a number"),
        ("model = { kind = \"uniform\", rate = 0.1, wobble = 2 }\n", "configs/x.toml:1: model.wobble: unknown key; allowed: kind, rate"),
        ("[[rules]]\nsteps = { from = 300, until = 200 }\n", "configs/x.toml:2: rules.0.steps = {…}: from = 300 is after until = 200"),
        ("[[rules]]\nsteps = { from = 7, until = 7 }\n", "configs/x.toml:2: rules.0.steps.until = 7: [7, 7) holds no step"),
        ("[[rules]]\nsteps = { from = 7, until = 7 }\n", "configs/x.toml:2: rules.0.steps.until = 7: [7, 7) holds no step, so the rule would never match; the window is [from, until): until = 8 takes step 7"),
        // until = 2^63 would be out of its range: the way to take the last steps is named.
        ("[[rules]]\nsteps = { from = 9223372036854775807, until = 9223372036854775807 }\n", "configs/x.toml:2: rules.0.steps.until = 9223372036854775807: [9223372036854775807, 9223372036854775807) holds no step, so the rule would never match; the window is [from, until): leave until out to take step 9223372036854775807 and those after"),
        ("[[rules]]\ncollective = [\"AllReduce\", \"AllReduse\"]\n", "configs/x.toml:2: rules.0.collective.1 = \"AllReduse\": unknown collective; allowed: Unknown, Broadcast, Reduce"),
        ("[[rules]]\ncollective = []\n", "configs/x.toml:2: rules.0.collective = […]: must list at least one value"),
        ("effect = \"drop\"\n", "configs/x.toml:1: effect = \"drop\": unknown effect; allowed: \"zero\", \"stale\", \"retransmit\", \"bitflip\""),
        ("[[rules]]\nphase = \"sideways\"\n", "configs/x.toml:2: rules.0.phase = \"sideways\": allowed: \"forward\", \"backward\", \"any\""),
        ("[[rules]]\ndirection = \"up\"\n", "configs/x.toml:2: rules.0.direction = \"up\": allowed: \"send\", \"recv\""),
        ("[[rules]]\npeer = -1\n", "configs/x.toml:2: rules.0.peer = -1: must be an integer in [0, 4294967295]"),
        ("stats_interval = 0\n", "configs/x.toml:1: stats_interval = 0: must be a number at least 0.1 s"),
        ("trace_events = 0\n", "configs/x.toml:1: trace_events = 0: must be an integer in [1, 16777216]"),
        ("trace = \"\"\n", "configs/x.toml:1: trace = \"\": must name a directory"),
        ("trace = 3\n", "configs/x.toml:1: trace = 3: must be a string"),
        ("transport = \"ib\"\n", "configs/x.toml:1: transport = \"ib\": allowed: \"socket\", \"wrap\""),
        ("inner = \"ib\"\n", "configs/x.toml:1: inner = \"ib\": only used with transport = \"wrap\""),
        ("transport = \"wrap\"\ninner = \" \"\n", "configs/x.toml:2: inner = \" \": must name a net plugin library"),
        ("retransmit_timeout_us = -5\n", "configs/x.toml:1: retransmit_timeout_us = -5: must be a number >= 0"),
        ("rules = 3\n", "configs/x.toml:1: rules = 3: must be a list of tables"),
        ("model = { kind = \"markov4\", p13 = 0.6, p14 = 0.6 }\n", "configs/x.toml:1: model.p14 = 0.6: p13 + p14 = 1.2 must be at most 1"),
        ("model = { kind = \"gilbert_elliott\", p = 0.01, r = 0 }\n", "configs/x.toml:1: model.r = 0: r must be > 0 when p > 0, or the first burst would never end"),
        ("model = { kind = \"trace\", file = \"missing-trace.txt\" }\n", "configs/x.toml:1: model.file = \"missing-trace.txt\": configs/missing-trace.txt: cannot read trace"),
        ("model = { kind = \"trace\", file = \" \" }\n", "configs/x.toml:1: model.file = \" \": must name a trace file"),
        // The parser places an unclosed array where its line ends.
        ("seed = 1\nmtu = [\n", "configs/x.toml:2: not valid TOML: unclosed array"),
        ("seed = 1\nmtu = [1,\n\n", "configs/x.toml:2: not valid TOML: unclosed array"),
        ("seed = 1\nmtu = 2\nmtu = 3\n", "configs/x.toml:3: not valid TOML: duplicate key"),
        // An integer too large for 64 bits gets the key's own range, as any other out of it.
        (
            "mtu = 100\n\nseed = 99999999999999999999\n",
            "configs/x.toml:3: seed = 99999999999999999999: must be an integer in [0, 9223372036854775807]: out of range",
        ),
        (
            "mtu = 0x1_0000_0000_0000_0000\n",
            "configs/x.toml:1: mtu = 0x1_0000_0000_0000_0000: must be an integer in [64, 4294967295]: out of range",
        ),
        (
            "mtu = -99999999999999999999\n",
            "configs/x.toml:1: mtu = -99999999999999999999: must be an integer in [64, 4294967295]: out of range",
        ),
        (
            "[[rules]]\nmodel = { kind = \"uniform\", rate = 99999999999999999999 }\n",
            "configs/x.toml:2: rules.0.model.rate = 99999999999999999999: must be a probability in [0, 1]",
        ),
        (
            "[[rules]]\nmodel = { kind = \"uniform\", rate = 1e400 }\n",
            "configs/x.toml:2: rules.0.model.rate = 1e400: float out of range",
        ),
        (
            "[[rules]]\npeer = [1, 99999999999999999999]\n",
            "configs/x.toml:2: rules.0.peer.1 = 99999999999999999999: must be an integer in [0, 4294967295]: out of range",
        ),
        (
            "seed = 1\nrate = 1e400\n",
            "configs/x.toml:2: rate = 1e400: float out of range: at most about 1.8e308",
        ),
        (
            "seed = 1\nrate = 1e-400\n",
            "configs/x.toml:2: rate = 1e-400: float underflows to 0",
        ),
    ];
    for (text, want) in cases {
        let got = err(text, "");
        assert!(
            got.starts_with(want),
            "for {text:?}\n got: {got}\nwant: {want}"
        );
    }
}

#[test]
fn an_override_too_large_for_64_bits_names_the_keys_range() {
    let e = err("", "mtu=99999999999999999999");
    assert!(
        e.contains("mtu = 99999999999999999999: must be an integer in [64, 4294967295]"),
        "{e}"
    );
}

#[test]
fn overrides_apply_on_top_and_name_the_variable() {
    let p = Profile::parse(
        FULL,
        "x.toml",
        "model.rate=0.02; seed=9 ;effect=retransmit;rules.0.model.mean_burst=4;rules.1.peer=[5]",
    )
    .unwrap();
    assert_eq!(p.seed, 9);
    assert_eq!(p.defaults.model, ModelSpec::Uniform { rate: 0.02 });
    assert_eq!(p.defaults.effect, Effect::Retransmit);
    assert_eq!(
        p.rules[0].action.model,
        ModelSpec::gilbert_elliott_from_rate(0.01, 4.0).unwrap()
    );
    assert_eq!(p.rules[1].when.peers, Some(vec![5]));
    assert_eq!(
        p.overrides,
        "model.rate=0.02; seed=9 ;effect=retransmit;rules.0.model.mean_burst=4;rules.1.peer=[5]"
    );
    assert!(p.summary().contains("(NCCL_LOSSY_SET: model.rate=0.02"));
    // A whole model at once, and keys the file did not have.
    let p = Profile::parse(
        "",
        "x.toml",
        "model={kind=\"gilbert_elliott\",rate=0.05,mean_burst=2};stats_interval=1",
    )
    .unwrap();
    assert!((p.defaults.model.expected_loss_rate() - 0.05).abs() < 1e-12);
    assert_eq!(p.stats_interval, Some(Duration::from_secs(1)));
    let p = Profile::parse("trace = \"runs/t\"\n", "x.toml", "trace_events=16").unwrap();
    assert_eq!(
        (p.trace.as_deref(), p.trace_events),
        (Some("runs/t"), Some(16))
    );
    let p = Profile::parse("", "x.toml", "model.kind=uniform;model.rate=0.1").unwrap();
    assert_eq!(p.defaults.model, ModelSpec::Uniform { rate: 0.1 });
    let cases: &[(&str, &str)] = &[
        (
            "model.rate=1.5",
            "NCCL_LOSSY_SET: model.rate = 1.5: must be a probability in [0, 1]",
        ),
        (
            "rules.5.effect=zero",
            "NCCL_LOSSY_SET: rules.5.effect: rules has no entry 5 (it has 3)",
        ),
        (
            "rules.x.effect=zero",
            "NCCL_LOSSY_SET: rules.x.effect: rules is a list",
        ),
        ("seed", "NCCL_LOSSY_SET: `seed`: expected key=value"),
        (
            "model..rate=1",
            "NCCL_LOSSY_SET: `model..rate`: not a dotted key",
        ),
        (
            "mtu.x=1",
            "NCCL_LOSSY_SET: mtu.x: mtu is a value, not a table",
        ),
        ("modle.rate=0.1", "NCCL_LOSSY_SET: modle: unknown key"),
        (
            "model.rate=1e400",
            "NCCL_LOSSY_SET: model.rate = 1e400: float out of range",
        ),
        (
            "model.rate=2.5e-400",
            "NCCL_LOSSY_SET: model.rate = 2.5e-400: float underflows to 0",
        ),
        (
            "rules.1.peer=[1,1e400]",
            "NCCL_LOSSY_SET: rules.1.peer.1 = 1e400: float out of range",
        ),
        (
            "effect=drop",
            "NCCL_LOSSY_SET: effect = \"drop\": unknown effect",
        ),
    ];
    for (set, want) in cases {
        let got = err(FULL, set);
        assert!(
            got.starts_with(want),
            "for {set:?}\n got: {got}\nwant: {want}"
        );
    }
    let got = err("", "rules.0.effect=zero");
    assert!(got.contains("rules is not in the profile"), "{got}");
}

#[test]
fn trace_files_resolve_next_to_the_profile() {
    let dir = std::env::temp_dir().join(format!("lossy-profile-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("drops.txt"), "# lost packets\n1\n2\n7\n").unwrap();
    let path = dir.join("p.toml");
    std::fs::write(
        &path,
        "model = { kind = \"trace\", file = \"drops.txt\", length = 10 }\n",
    )
    .unwrap();
    let p = Profile::load(Some(&path), "").unwrap();
    assert!((p.defaults.model.expected_loss_rate() - 0.3).abs() < 1e-12);
    assert!(
        p.summary().contains("trace(drops.txt, 10 packets, 3 lost)"),
        "{}",
        p.summary()
    );
    std::fs::write(dir.join("bad.txt"), "1\nseven\n").unwrap();
    let e = Profile::load(Some(&path), "model.file=bad.txt")
        .unwrap_err()
        .message;
    assert!(
        e.starts_with("NCCL_LOSSY_SET: model.file = \"bad.txt\": ") && e.contains("bad.txt:2:"),
        "{e}"
    );
    let e = Profile::load(Some(&dir.join("nope.toml")), "")
        .unwrap_err()
        .message;
    assert!(e.contains("nope.toml: cannot read profile"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `f` on a thread and gives up after a few seconds: a hang is a failure, not a stuck test.
fn within_seconds<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("loading did not finish within 5 s (it blocks or reads forever)")
}

fn make_fifo(path: &std::path::Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
}

#[test]
fn profiles_and_traces_must_be_regular_files_of_bounded_size() {
    let dir = std::env::temp_dir().join(format!("lossy-profile-kinds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A FIFO with no writer: opening it for reading would block forever.
    let fifo = dir.join("fifo.toml");
    make_fifo(&fifo);
    let path = fifo.clone();
    let e = within_seconds(move || Profile::load(Some(&path), ""))
        .unwrap_err()
        .message;
    assert!(
        e.contains("fifo.toml") && e.contains("not a regular file") && e.contains("4 MiB"),
        "{e}"
    );
    // A character device that never ends.
    let e = within_seconds(|| Profile::load(Some(std::path::Path::new("/dev/zero")), ""))
        .unwrap_err()
        .message;
    assert!(
        e.contains("/dev/zero") && e.contains("not a regular file"),
        "{e}"
    );
    // A directory.
    let e = Profile::load(Some(&dir), "").unwrap_err().message;
    assert!(e.contains("not a regular file"), "{e}");
    // A regular file over the cap (sparse: no disk used).
    let big = dir.join("big.toml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(MAX_PROFILE_BYTES + 1)
        .unwrap();
    let e = Profile::load(Some(&big), "").unwrap_err().message;
    assert!(
        e.contains("big.toml") && e.contains("larger than") && e.contains("4 MiB"),
        "{e}"
    );
    // Traces: the same rules, with their own cap.
    let trace_fifo = dir.join("drops.fifo");
    make_fifo(&trace_fifo);
    let profile = dir.join("p.toml");
    std::fs::write(
        &profile,
        "model = { kind = \"trace\", file = \"drops.fifo\" }\n",
    )
    .unwrap();
    let path = profile.clone();
    let e = within_seconds(move || Profile::load(Some(&path), ""))
        .unwrap_err()
        .message;
    assert!(
        e.contains("drops.fifo") && e.contains("not a regular file"),
        "{e}"
    );
    let big_trace = dir.join("big.txt");
    std::fs::File::create(&big_trace)
        .unwrap()
        .set_len(crate::loss::trace::MAX_TRACE_BYTES + 1)
        .unwrap();
    let e = Profile::load(Some(&profile), "model.file=big.txt")
        .unwrap_err()
        .message;
    assert!(e.contains("big.txt") && e.contains("larger than"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn out_of_range_numbers_say_so_with_the_range() {
    for set in ["mtu=1e10", "mtu=10000000000", "mtu=0"] {
        let got = err("", set);
        assert!(
            got.contains("out of range") && got.contains("64"),
            "for {set:?}: {got}"
        );
    }
}

#[test]
fn a_float_where_an_integer_belongs_is_shown_as_a_float() {
    // `mtu = 64.0` said "mtu = 64: must be an integer in [64, ...]", contradicting itself.
    for (text, shown) in [
        (
            "mtu = 64.0",
            "mtu = 64.0: must be an integer in [64, 4294967295]",
        ),
        ("seed = 7.0", "seed = 7.0: must be an integer"),
        ("mtu = 1e10", "mtu = 10000000000.0: must be an integer"),
    ] {
        let got = err(text, "");
        assert!(got.contains(shown), "for {text:?}: {got}");
    }
    let got = err("", "mtu=128.0");
    assert!(got.contains("mtu = 128.0: must be an integer"), "{got}");
}

#[test]
fn a_quoted_semicolon_does_not_split_an_override() {
    let p = Profile::parse(
        "",
        "x.toml",
        "description=\"a; b\"; seed=3; model.rate='c;d'",
    );
    // model.rate='c;d' is not a number: the error must quote the whole string.
    let e = p.unwrap_err().message;
    assert!(e.contains("c;d"), "{e}");
    let p = Profile::parse("", "x.toml", "description=\"a; b\"; seed=3").unwrap();
    assert_eq!(p.description.as_deref(), Some("a; b"));
    assert_eq!(p.seed, 3);
    // An unterminated quote is an error, not a silent split.
    let e = err("", "description=\"a; seed=3");
    assert!(e.contains("NCCL_LOSSY_SET") && e.contains("quote"), "{e}");
}

#[test]
fn a_deep_override_key_is_refused_naming_the_variable_and_the_limit() {
    // 40,000 segments: one stack frame each would overflow the stack (it crashed init).
    let deep = format!("{}b=1", "a.".repeat(40_000));
    let e = within_seconds(move || err("", &deep));
    assert!(
        e.starts_with("NCCL_LOSSY_SET: `a.a.a.")
            && e.contains(&format!("at most {MAX_KEY_SEGMENTS} segments"))
            && e.contains("40001"),
        "{}",
        &e[..e.len().min(300)]
    );
    assert!(
        e.len() < 400,
        "the key is cut in the error: {} bytes",
        e.len()
    );
    // The deepest key the schema has is far below the limit.
    let ok = Profile::parse(FULL, "x.toml", "rules.0.model.mean_burst=4");
    assert!(ok.is_ok(), "{ok:?}");
    let at_limit = format!("{}b=1", "a.".repeat(MAX_KEY_SEGMENTS - 1));
    assert!(err("", &at_limit).contains("a: unknown key"));
}

#[test]
fn overrides_from_the_command_line_are_named_as_such() {
    let layers = [(SET_ENV, "seed=3"), ("--set", "model.rate=1.5")];
    let e = Profile::load_layers(None, &layers).unwrap_err().message;
    assert!(
        e.starts_with("--set: model.rate = 1.5: must be a probability"),
        "{e}"
    );
    let layers = [(SET_ENV, "seed=-3"), ("--set", "model.rate=0.5")];
    let e = Profile::load_layers(None, &layers).unwrap_err().message;
    assert!(e.starts_with("NCCL_LOSSY_SET: seed = -3"), "{e}");
    let deep = format!("{}b=1", "a.".repeat(100));
    let e = Profile::load_layers(None, &[("--set", &deep)])
        .unwrap_err()
        .message;
    assert!(
        e.starts_with("--set: `a.a.") && e.contains("segments"),
        "{e}"
    );
    let p = Profile::load_layers(None, &[(SET_ENV, "seed=3"), ("--set", "seed=4")]).unwrap();
    assert_eq!((p.seed, p.overrides.as_str()), (4, "seed=3;seed=4"));
}

#[test]
fn a_retransmit_timeout_beyond_the_transports_limit_is_refused() {
    for (text, shown) in [
        ("retransmit_timeout_us = 20000000\n", "20000000"),
        ("retransmit_timeout_us = 1e12\n", "1000000000000"),
        ("[[rules]]\nretransmit_timeout_us = 10000001\n", "10000001"),
    ] {
        let e = err(text, "");
        assert!(
            e.contains(&format!("retransmit_timeout_us = {shown}"))
                && e.contains("at most 10 s (10000000 us)"),
            "for {text:?}: {e}"
        );
    }
    let p = parse("retransmit_timeout_us = 10000000\n").unwrap();
    assert_eq!(p.defaults.retransmit_timeout, Duration::from_secs(10));
}

#[test]
fn a_stats_interval_below_the_minimum_is_refused_with_the_range() {
    for (bad, shown) in [
        ("1e-9", "0.000000001"),
        ("0.01", "0.01"),
        ("0", "0"),
        ("-1", "-1"),
    ] {
        let e = err(&format!("stats_interval = {bad}\n"), "");
        assert!(
            e.starts_with(&format!("configs/x.toml:1: stats_interval = {shown}: "))
                && e.contains("at least 0.1 s")
                && e.contains("at most 1000000 s"),
            "for {bad}: {e}"
        );
    }
    let p = parse("stats_interval = 0.1\n").unwrap();
    assert_eq!(p.stats_interval, Some(Duration::from_millis(100)));
}

#[test]
fn the_number_of_rules_is_limited_and_the_summary_stays_short() {
    let many = "[[rules]]\n".repeat(MAX_RULES + 1);
    let e = err(&many, "");
    assert!(
        e.starts_with("configs/x.toml:")
            && e.contains(&format!("{} rules", MAX_RULES + 1))
            && e.contains(&format!("at most {MAX_RULES}")),
        "{e}"
    );
    let text = "[[rules]]\npeer = [1, 2, 3]\nmodel = { kind = \"uniform\", rate = 0.1 }\n"
        .repeat(MAX_RULES);
    let p = parse(&text).unwrap();
    assert_eq!(p.rules.len(), MAX_RULES);
    let s = p.summary();
    assert!(
        s.len() <= MAX_SUMMARY_BYTES + 100 && s.contains(&format!("{MAX_RULES} rules")),
        "{} bytes: {}",
        s.len(),
        &s[..s.len().min(300)]
    );
    assert!(s.contains("more rules"), "{s}");
    // One rule with a long list is cut too.
    let peers: Vec<String> = (0..100_000).map(|i| i.to_string()).collect();
    let p = parse(&format!("[[rules]]\npeer = [{}]\n", peers.join(","))).unwrap();
    assert!(p.summary().len() <= MAX_SUMMARY_BYTES + 100);
}

#[test]
fn rules_naming_one_trace_share_one_loaded_copy() {
    // Each rule naming the trace loaded it again: 16 rules over an 8 MiB bitmap held 1.1 GB,
    // and 1024 rules (the limit) over a 16 MiB one would have asked for 128 GiB at `init`.
    let dir = std::env::temp_dir().join(format!("lossy-profile-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("drops.txt"), "0110\n").unwrap();
    std::fs::write(dir.join("other.txt"), "1\n").unwrap();
    let trace =
        |file: &str| format!("{{ kind = \"trace\", file = \"{file}\", format = \"bitmap\" }}");
    let mut text = format!("model = {}\n", trace("drops.txt"));
    for peer in 0..4 {
        text.push_str(&format!(
            "[[rules]]\npeer = {peer}\nmodel = {}\n",
            trace("drops.txt")
        ));
    }
    text.push_str(&format!("[[rules]]\nmodel = {}\n", trace("other.txt")));
    let path = dir.join("p.toml");
    std::fs::write(&path, text).unwrap();
    let p = Profile::load(Some(&path), "").unwrap();
    let data = |model: &ModelSpec| match model {
        ModelSpec::Trace(t) => std::sync::Arc::clone(t.data.as_ref().expect("loaded")),
        other => panic!("not a trace: {other:?}"),
    };
    let first = data(&p.defaults.model);
    for rule in &p.rules[..4] {
        assert!(
            std::sync::Arc::ptr_eq(&first, &data(&rule.action.model)),
            "a rule loaded its own copy of the trace"
        );
    }
    // Another file is another trace.
    let other = data(&p.rules[4].action.model);
    assert!(!std::sync::Arc::ptr_eq(&first, &other));
    assert_eq!(other.length, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unknown_key_with_invisible_characters_is_shown_escaped() {
    // A key holding a control character (a NUL, a terminal escape) was printed raw: the
    // message read "seed: unknown key" for a key that is not `seed`, or drove the terminal.
    let got = err("\"seed\\u0000\" = 1\n", "");
    assert!(got.contains(r#""seed\0": unknown key"#), "{got}");
    let got = err(
        "[model]\nkind = \"uniform\"\n\"rate\\u001b[2J\" = 0.1\n",
        "",
    );
    assert!(
        got.contains(r#"model."rate\u{1b}[2J": unknown key"#),
        "{got}"
    );
    let got = err("", "se\u{7}ed=1");
    assert!(got.contains(r#""se\u{7}ed": unknown key"#), "{got}");
}

#[test]
fn a_retransmit_summary_says_how_long_a_message_waits() {
    // A retransmit profile's cost is time, and the summary gave only the loss rate: a user who
    // set retransmit_timeout_us = 10000000 with a bursty model learned what that means per
    // message only from a run that seemed to hang. Uniform 1% over 4096-byte packets: a
    // 512 KiB message is 128 packets; each run of losses within it is one event (one
    // timeout). Its first packet is lost with probability rate = 0.01, and a run starts at
    // each later one with probability rate / mean burst = 0.01 / (1 / 0.99) = 0.0099:
    // 0.01 + 127 x 0.0099 = 1.2673 events, x 200 us = 253.46 us.
    let p = Profile::parse(
        "effect = \"retransmit\"\nretransmit_timeout_us = 200\nmtu = 4096\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
        "configs/x.toml",
        "",
    )
    .expect("valid profile");
    let s = p.summary();
    assert!(
        s.contains(
            "effect retransmit, expected loss 1% (mean burst 1.0101), a 512 KiB message waits 253.46 us on average (1.2673 loss events x 200 us)"
        ),
        "{s}"
    );
    let wait = p.to_json()["defaults"]["expected_wait_us_per_512kib"]
        .as_f64()
        .expect("a number");
    assert!((wait - 253.46).abs() < 1e-9, "{wait}");
    // Effects that cost no time say nothing of it.
    let zero = Profile::parse(
        "effect = \"zero\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
        "configs/x.toml",
        "",
    )
    .expect("valid profile");
    assert!(!zero.summary().contains("waits"), "{}", zero.summary());
    assert!(zero.to_json()["defaults"]
        .get("expected_wait_us_per_512kib")
        .is_none());
}

#[test]
fn the_expected_wait_matches_the_loss_events_the_engine_plans() {
    // The summary's figure against what the transport will wait: one timeout per run of
    // losses in each message's plan. Gilbert-Elliott, 2% loss in bursts of 4 on average,
    // 512 KiB messages of 128 packets: 0.02 + 127 x 0.02 / 4 = 0.655 events a message.
    // Counting 0.02 x 128 = 2.56 (a timeout per lost packet) or 128 x 0.02 / 4 = 0.64 (no
    // run carried in from the message before) would be wrong. Over 200,000 messages of a
    // fixed seed the mean has a standard error of about sqrt(0.655 x 1.5) / sqrt(200,000) =
    // 0.0022 (the 1.5: runs cluster); 4 standard errors, 0.009, tell 0.655 from 0.64.
    let p = Profile::parse(
        "seed = 3\neffect = \"retransmit\"\nmtu = 4096\nmodel = { kind = \"gilbert_elliott\", rate = 0.02, mean_burst = 4 }\n",
        "configs/x.toml",
        "",
    )
    .expect("valid profile");
    let (events, wait_us) = super::expected_wait(&p.defaults).expect("a retransmit profile");
    assert!((events - 0.655).abs() < 1e-9, "{events}");
    assert!((wait_us - 0.655 * 200.0).abs() < 1e-6, "{wait_us}");
    let mut stream = p.loss_engine().stream(crate::loss::engine::StreamKey {
        rank: 0,
        comm: 0,
        peer: 1,
        direction: Direction::Send,
        conn: 0,
    });
    let mut plan = crate::loss::plan::LossPlan::default();
    let ctx = crate::loss::rules::MatchContext::default();
    let n = 200_000;
    let total: u64 = (0..n)
        .map(|_| {
            stream.plan(&ctx, 512 << 10, &mut plan);
            plan.loss_events()
        })
        .sum();
    let mean = total as f64 / n as f64;
    assert!(
        (mean - events).abs() < 0.009,
        "engine {mean}, summary {events}"
    );
}

#[test]
fn a_refusal_caused_by_a_default_names_the_key_written_and_the_default() {
    // p = 1 alone leaves r at netem's default 1 - p = 0; the error named `model.r`, a key the
    // profile does not have, as if the user had written r = 0.
    let e = err("model = { kind = \"gilbert_elliott\", p = 1 }", "");
    assert!(
        e.starts_with("configs/x.toml:1: model.p = 1:") && e.contains("r defaults to 1 - p = 0"),
        "{e}"
    );
    let e = err("model = { kind = \"markov4\", p13 = 1 }", "");
    assert!(
        e.starts_with("configs/x.toml:1: model.p13 = 1:")
            && e.contains("p31 defaults to 1 - p13 = 0"),
        "{e}"
    );
    // Written out, the key at fault is still the one named.
    let e = err("model = { kind = \"gilbert_elliott\", p = 0.5, r = 0 }", "");
    assert!(e.starts_with("configs/x.toml:1: model.r = 0:"), "{e}");
    let e = err("model = { kind = \"markov4\", p13 = 0.5, p31 = 0 }", "");
    assert!(e.starts_with("configs/x.toml:1: model.p31 = 0:"), "{e}");
}

#[test]
fn the_summary_shows_a_rules_own_packet_size() {
    // A rule's mtu decides which bytes a loss takes (and how many packets a message has); the
    // summary said only the profile's "mtu 4096", so a rule at 512 read as 4096.
    let p = Profile::parse(
        "effect = \"zero\"\n[[rules]]\nmtu = 512\nmodel = { kind = \"uniform\", rate = 0.1 }\n",
        "configs/x.toml",
        "",
    )
    .unwrap();
    let s = p.summary();
    assert!(
        s.contains("[all -> uniform(rate=0.1), effect zero, mtu 512, expected loss 10%"),
        "{s}"
    );
    // The same packet size as the profile's is not repeated.
    assert!(!s.contains("default: none, effect zero, mtu"), "{s}");
    let p = Profile::parse("[[rules]]\n", "configs/x.toml", "rules.0.mtu=1024").unwrap();
    assert!(
        p.summary().contains("effect retransmit, mtu 1024,"),
        "{}",
        p.summary()
    );
}

#[test]
fn an_error_the_overrides_caused_in_the_file_names_them() {
    // `--set model.kind=gilbert_elliott` on a uniform profile left a table that needs
    // `mean_burst`: the error pointed at the file's line only, as if the file were wrong.
    let err = Profile::parse(
        "model = { kind = \"uniform\", rate = 0.01 }\n",
        "configs/x.toml",
        "model.kind=gilbert_elliott",
    )
    .expect_err("a rate-form table without mean_burst");
    let msg = err.to_string();
    assert!(
        msg.starts_with("configs/x.toml:1: model.mean_burst: missing")
            && msg.contains("with the overrides of NCCL_LOSSY_SET: model.kind=gilbert_elliott"),
        "{msg}"
    );
    // An error at an override's own value names the override already: nothing added.
    let err = Profile::parse("", "configs/x.toml", "mtu=1").expect_err("mtu 1");
    assert!(!err.to_string().contains("with the overrides"), "{err}");
    // Without overrides, nothing added either.
    let err = Profile::parse("mtu = 1\n", "configs/x.toml", "").expect_err("mtu 1");
    assert!(!err.to_string().contains("with the overrides"), "{err}");
}
