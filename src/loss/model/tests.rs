//! Unit tests of the models: closed forms against the generator and a per-packet reference.

use std::sync::Arc;

use rand::Rng;

use crate::loss::model::*;
use crate::loss::plan::PacketRun;
use crate::loss::rng::stream_rng;
use crate::loss::trace::{TraceData, TraceEnd, TraceFormat, TraceStart};

/// Loss statistics of `packets` packets of a stream, cut into messages of `chunk` packets
/// so bursts that cross message boundaries are joined: (loss rate, mean burst, bursts).
pub(crate) fn measure(spec: &ModelSpec, seed: u64, packets: u64, chunk: u64) -> (f64, f64, u64) {
    let mut state = ModelState::new(spec, stream_rng(seed));
    let mut runs = Vec::new();
    let (mut lost, mut bursts, mut done) = (0u64, 0u64, 0u64);
    let mut prev_lost_last = false;
    while done < packets {
        let n = chunk.min(packets - done);
        runs.clear();
        state.fill(n, &mut runs);
        for (i, run) in runs.iter().enumerate() {
            lost += u64::from(run.len);
            if !(i == 0 && run.start == 0 && prev_lost_last) {
                bursts += 1;
            }
        }
        prev_lost_last = runs.last().is_some_and(|r| u64::from(r.end()) == n);
        done += n;
    }
    let burst = if bursts == 0 {
        0.0
    } else {
        lost as f64 / bursts as f64
    };
    (lost as f64 / packets as f64, burst, bursts)
}

/// Per-packet reference of netem's processes, one draw per decision: Gilbert-Elliott
/// draws the transition, then the loss from the state the packet started in; markov4
/// moves first and loses when it lands in 3 or 4. Returns (loss rate, mean burst).
fn reference(spec: &ModelSpec, seed: u64, packets: u64) -> (f64, f64) {
    let mut rng = stream_rng(seed);
    let mut state = 0usize;
    let (mut lost, mut bursts, mut prev) = (0u64, 0u64, false);
    for _ in 0..packets {
        let is_lost = match *spec {
            ModelSpec::GilbertElliott {
                p,
                r,
                h_loss,
                k_loss,
            } => {
                let start = state;
                let u: f64 = rng.gen();
                state = match state {
                    0 if u < p => 1,
                    1 if u < r => 0,
                    s => s,
                };
                rng.gen::<f64>() < if start == 0 { k_loss } else { h_loss }
            }
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => {
                let u: f64 = rng.gen();
                state = match state {
                    0 if u < p13 => 2,
                    0 if u < p13 + p14 => 3,
                    1 if u < p23 => 2,
                    2 if u < p31 => 0,
                    2 if u < p31 + p32 => 1,
                    3 => 0,
                    s => s,
                };
                state >= 2
            }
            _ => unreachable!("reference covers the Markov models only"),
        };
        if is_lost {
            lost += 1;
            if !prev {
                bursts += 1;
            }
        }
        prev = is_lost;
    }
    (
        lost as f64 / packets as f64,
        lost as f64 / bursts.max(1) as f64,
    )
}

/// Tolerances, 5 standard deviations of the estimators over n packets.
/// Loss rate: a Markov-modulated process is a renewal process of (kept, lost) cycles;
/// by the ratio (delta) method the rate's variance is about
/// ((1-ρ)²·Var(B) + ρ²·Var(G)) / (m·E[cycle]²) with m cycles (= bursts). Sojourns are
/// geometric (CV ≤ 1), which bounds that by 2ρ²/m; Bernoulli losses inside a state add at
/// most the binomial term ρ(1-ρ)/n. So σ_rate ≤ sqrt(2ρ²/m + ρ(1-ρ)/n), m = n·ρ/burst.
/// Mean burst: a mean of m burst lengths, each with CV ≤ 1 (geometric, or for markov4 a
/// mixture of 1 and a geometric, CV² ≤ 2): σ_burst ≤ burst·sqrt(2/m).
pub(crate) fn tolerances(rate: f64, burst: f64, n: u64) -> (f64, f64) {
    let n = n as f64;
    let m = (n * rate / burst).max(1.0);
    let rate_tol = 5.0 * (2.0 * rate * rate / m + rate * (1.0 - rate) / n).sqrt();
    let burst_tol = 5.0 * burst * (2.0 / m).sqrt();
    (rate_tol, burst_tol)
}

fn check(spec: &ModelSpec, seed: u64, n: u64) {
    let (rate, burst) = (spec.expected_loss_rate(), spec.expected_mean_burst());
    let (rate_tol, burst_tol) = tolerances(rate, burst, n);
    let (got_rate, got_burst, _) = measure(spec, seed, n, 1000);
    assert!(
        (got_rate - rate).abs() < rate_tol,
        "{}: loss {got_rate} vs {rate} ± {rate_tol}",
        spec.describe()
    );
    assert!(
        (got_burst - burst).abs() < burst_tol,
        "{}: burst {got_burst} vs {burst} ± {burst_tol}",
        spec.describe()
    );
}

/// The per-packet reference over `n` packets meets the closed forms within the same
/// tolerances as the generator: the closed forms describe netem's process, not ours.
fn check_reference(spec: &ModelSpec, seed: u64, n: u64) {
    let (rate, burst) = (spec.expected_loss_rate(), spec.expected_mean_burst());
    let (rate_tol, burst_tol) = tolerances(rate, burst, n);
    let (ref_rate, ref_burst) = reference(spec, seed, n);
    assert!(
        (ref_rate - rate).abs() < rate_tol,
        "{}: reference loss {ref_rate} vs {rate} ± {rate_tol}",
        spec.describe()
    );
    assert!(
        (ref_burst - burst).abs() < burst_tol,
        "{}: reference burst {ref_burst} vs {burst} ± {burst_tol}",
        spec.describe()
    );
}

fn raw(kind: &str) -> RawModel {
    RawModel {
        kind: kind.into(),
        ..RawModel::default()
    }
}

#[test]
fn uniform_matches_closed_form() {
    // Binomial: σ = sqrt(p(1-p)/n); the delta-method bound above is looser and also holds.
    for (i, &rate) in [0.001, 0.01, 0.1, 0.5].iter().enumerate() {
        let spec = ModelSpec::Uniform { rate };
        assert!((spec.expected_mean_burst() - 1.0 / (1.0 - rate)).abs() < 1e-12);
        check(&spec, 11 + i as u64, 4_000_000);
    }
    assert_eq!(
        measure(&ModelSpec::Uniform { rate: 1.0 }, 1, 5000, 100).0,
        1.0
    );
    assert_eq!(
        measure(&ModelSpec::Uniform { rate: 0.0 }, 1, 5000, 100).0,
        0.0
    );
    assert_eq!(measure(&ModelSpec::None, 1, 5000, 100).0, 0.0);
}

#[test]
fn gilbert_elliott_matches_closed_form_and_reference() {
    let cases = [
        ModelSpec::GilbertElliott {
            p: 0.00126,
            r: 0.125,
            h_loss: 1.0,
            k_loss: 0.0,
        },
        ModelSpec::GilbertElliott {
            p: 0.01,
            r: 0.3,
            h_loss: 0.6,
            k_loss: 0.0,
        },
        ModelSpec::GilbertElliott {
            p: 0.02,
            r: 0.2,
            h_loss: 0.5,
            k_loss: 0.01,
        },
        ModelSpec::GilbertElliott {
            p: 0.1,
            r: 0.9,
            h_loss: 1.0,
            k_loss: 0.0,
        },
    ];
    for (i, spec) in cases.iter().enumerate() {
        check(spec, 100 + i as u64, 4_000_000);
        check_reference(spec, 200 + i as u64, 2_000_000);
    }
    // Simple Gilbert: loss p/(p+r), burst 1/r; with 1-k = 0, burst 1/(1-(1-r)·h_loss).
    let simple = &cases[0];
    assert!((simple.expected_loss_rate() - 0.00126 / 0.12626).abs() < 1e-12);
    assert!((simple.expected_mean_burst() - 8.0).abs() < 1e-9);
    assert!((cases[1].expected_mean_burst() - 1.0 / (1.0 - 0.7 * 0.6)).abs() < 1e-9);
}

#[test]
fn markov4_matches_closed_form_and_reference() {
    let cases = [
        ModelSpec::Markov4 {
            p13: 0.001,
            p31: 0.2,
            p32: 0.3,
            p23: 0.4,
            p14: 0.005,
        },
        ModelSpec::Markov4 {
            p13: 0.01,
            p31: 0.99,
            p32: 0.0,
            p23: 1.0,
            p14: 0.0,
        },
        ModelSpec::Markov4 {
            p13: 0.05,
            p31: 0.5,
            p32: 0.1,
            p23: 0.2,
            p14: 0.02,
        },
    ];
    for (i, spec) in cases.iter().enumerate() {
        let ModelSpec::Markov4 {
            p13,
            p31,
            p32,
            p23,
            p14,
        } = *spec
        else {
            unreachable!()
        };
        // DESIGN §2's closed form for the loss.
        let design =
            (p13 * p23 + p14 * p31 * p23) / (p31 * p23 + p14 * p31 * p23 + p13 * p23 + p13 * p32);
        assert!((spec.expected_loss_rate() - design).abs() < 1e-12);
        check(spec, 300 + i as u64, 4_000_000);
        check_reference(spec, 400 + i as u64, 2_000_000);
    }
}

#[test]
fn netem_defaults() {
    let mut m = raw("gilbert_elliott");
    m.p = Some(0.05);
    let spec = ModelSpec::from_raw(&m).unwrap();
    assert_eq!(
        spec,
        ModelSpec::GilbertElliott {
            p: 0.05,
            r: 0.95,
            h_loss: 1.0,
            k_loss: 0.0
        }
    );
    // With the defaults the chain is Bernoulli(p): same rate and bursts as uniform p.
    assert!((spec.expected_loss_rate() - 0.05).abs() < 1e-12);
    assert!((spec.expected_mean_burst() - 1.0 / 0.95).abs() < 1e-12);
    let mut m = raw("markov4");
    m.p13 = Some(0.1);
    let spec = ModelSpec::from_raw(&m).unwrap();
    assert_eq!(
        spec,
        ModelSpec::Markov4 {
            p13: 0.1,
            p31: 0.9,
            p32: 0.0,
            p23: 1.0,
            p14: 0.0
        }
    );
    // p31 = 1 - p13 makes state 3 a Bernoulli(p13) loss too.
    assert!((spec.expected_loss_rate() - 0.1).abs() < 1e-12);
}

#[test]
fn intuitive_gilbert_elliott_converts() {
    let spec = ModelSpec::gilbert_elliott_from_rate(0.01, 8.0).unwrap();
    let ModelSpec::GilbertElliott {
        p,
        r,
        h_loss,
        k_loss,
    } = spec
    else {
        panic!("{spec:?}")
    };
    assert_eq!((h_loss, k_loss), (1.0, 0.0));
    assert!((r - 0.125).abs() < 1e-15);
    assert!((p - 0.01 * 0.125 / 0.99).abs() < 1e-15);
    assert!((spec.expected_loss_rate() - 0.01).abs() < 1e-12);
    assert!((spec.expected_mean_burst() - 8.0).abs() < 1e-9);
    check(&spec, 7, 8_000_000);
    // The same through a model table.
    let mut m = raw("gilbert_elliott");
    m.rate = Some(0.01);
    m.mean_burst = Some(8.0);
    assert_eq!(ModelSpec::from_raw(&m).unwrap(), spec);
    // mean_burst = 1: r = 1, p = rate/(1-rate) (isolated losses, not Bernoulli: see below).
    let b = ModelSpec::gilbert_elliott_from_rate(0.2, 1.0).unwrap();
    assert!((b.expected_loss_rate() - 0.2).abs() < 1e-12);
}

#[test]
fn invalid_models_name_the_key() {
    let e = ModelSpec::gilbert_elliott_from_rate(0.01, 0.5).unwrap_err();
    assert_eq!(e.key, "mean_burst");
    let e = ModelSpec::gilbert_elliott_from_rate(1.0, 4.0).unwrap_err();
    assert_eq!(e.key, "rate");
    let e = ModelSpec::gilbert_elliott_from_rate(0.6, 1.0).unwrap_err();
    assert!(e.message.contains("B/(B+1)"), "{e}");
    let mut m = raw("gilbert_elliott");
    m.p = Some(0.1);
    m.rate = Some(0.1);
    assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "rate");
    let mut m = raw("uniform");
    m.rate = Some(1.5);
    assert_eq!(
        ModelSpec::from_raw(&m).unwrap_err().message,
        "must be a probability in [0, 1]"
    );
    m.rate = Some(f64::NAN);
    assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "rate");
    let mut m = raw("uniform");
    m.p13 = Some(0.1);
    assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "p13");
    assert_eq!(
        ModelSpec::from_raw(&raw("uniform")).unwrap_err().key,
        "rate"
    );
    let e = ModelSpec::from_raw(&raw("bursty")).unwrap_err();
    assert!(e.key == "kind" && e.message.contains("markov4"), "{e}");
    let mut m = raw("markov4");
    m.p13 = Some(0.7);
    m.p14 = Some(0.5);
    assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "p14");
    let mut m = raw("markov4");
    m.p13 = Some(0.1);
    m.p31 = Some(0.0);
    assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "p31");
    assert!(ModelSpec::from_raw(&raw("NONE")).is_ok());
}

#[test]
fn serde_round_trip_uses_the_same_checks() {
    let spec: ModelSpec =
        serde_json::from_str(r#"{"kind":"gilbert_elliott","rate":0.01,"mean_burst":8}"#).unwrap();
    assert_eq!(
        spec,
        ModelSpec::gilbert_elliott_from_rate(0.01, 8.0).unwrap()
    );
    let json = serde_json::to_value(&spec).unwrap();
    assert_eq!(json["kind"], "gilbert_elliott");
    let back: ModelSpec = serde_json::from_value(json).unwrap();
    assert_eq!(back, spec);
    assert!(serde_json::from_str::<ModelSpec>(r#"{"kind":"uniform","rate":2}"#).is_err());
}

#[test]
fn trace_replay_follows_the_file() {
    let data = TraceData::parse("0011000001", TraceFormat::Bitmap, None, "t").unwrap();
    let spec = |at_end, start| {
        ModelSpec::Trace(TraceSpec {
            file: "t".into(),
            format: TraceFormat::Bitmap,
            length: None,
            at_end,
            start,
            data: Some(Arc::new(data.clone())),
        })
    };
    let wrap = spec(TraceEnd::Wrap, TraceStart::Beginning);
    let mut s = ModelState::new(&wrap, stream_rng(1));
    let mut out = Vec::new();
    s.fill(7, &mut out);
    assert_eq!(out, vec![PacketRun { start: 2, len: 2 }]);
    out.clear();
    // Packets 7..20 of the stream are trace packets 7, 8, 9, then (wrapped) 0..=9: losses
    // at trace 9, 2-3 and 9 again, i.e. message packets 2, 5-6 and 12.
    s.fill(13, &mut out);
    let runs = [(2, 1), (5, 2), (12, 1)].map(|(start, len)| PacketRun { start, len });
    assert_eq!(out, runs.to_vec());
    // Wrapping, one pass is 3 of 10 lost; the run at 9 does not touch 0, so 2 bursts.
    assert!((wrap.expected_loss_rate() - 0.3).abs() < 1e-12);
    assert!((wrap.expected_mean_burst() - 1.5).abs() < 1e-12);
    let stop = spec(TraceEnd::Stop, TraceStart::Beginning);
    let mut s = ModelState::new(&stop, stream_rng(1));
    out.clear();
    s.fill(100, &mut out);
    assert_eq!(
        out,
        vec![
            PacketRun { start: 2, len: 2 },
            PacketRun { start: 9, len: 1 }
        ]
    );
    // Random starts: different streams start at different places, same long-run rate.
    let random = spec(TraceEnd::Wrap, TraceStart::Random);
    let firsts: std::collections::HashSet<Vec<(u32, u32)>> = (0..20)
        .map(|seed| {
            let mut s = ModelState::new(&random, stream_rng(seed));
            let mut out = Vec::new();
            s.fill(10, &mut out);
            out.iter().map(|r| (r.start, r.len)).collect()
        })
        .collect();
    assert!(firsts.len() > 3, "random starts should differ: {firsts:?}");
    let (rate, _, _) = measure(&random, 5, 10_000, 7);
    assert!((rate - 0.3).abs() < 1e-3 + 3.0 / 10_000.0);
}

#[test]
fn bursts_span_message_boundaries() {
    // Mean burst 500 packets, messages of 10: inside a burst a message boundary must not
    // end it, so P(first packet lost | previous message's last lost) ≈ 1 - r = 0.998.
    let spec = ModelSpec::gilbert_elliott_from_rate(0.2, 500.0).unwrap();
    let mut s = ModelState::new(&spec, stream_rng(9));
    let mut out = Vec::new();
    let (mut both, mut prev_last) = (0u32, 0u32);
    let mut prev = false;
    for _ in 0..100_000 {
        out.clear();
        s.fill(10, &mut out);
        let first = out.first().is_some_and(|r| r.start == 0);
        if prev {
            prev_last += 1;
            both += u32::from(first);
        }
        prev = out.last().is_some_and(|r| r.end() == 10);
    }
    assert!(prev_last > 1000);
    assert!(
        f64::from(both) / f64::from(prev_last) > 0.98,
        "{both}/{prev_last}"
    );
}

#[test]
fn runs_are_sorted_disjoint_and_inside() {
    let spec = ModelSpec::Uniform { rate: 0.3 };
    let mut s = ModelState::new(&spec, stream_rng(2));
    let mut out = Vec::new();
    for len in [1u64, 2, 3, 64, 1000] {
        out.clear();
        s.fill(len, &mut out);
        assert!(crate::loss::effect::check_runs(&out, len, 0).is_ok());
        // Adjacent losses merge into one run.
        assert!(out.windows(2).all(|w| w[0].end() < w[1].start));
    }
}

#[test]
fn short_formats() {
    assert_eq!(short(0.01), "0.01");
    assert_eq!(short(8.0), "8");
    assert_eq!(short(0.0012626262), "0.00126263");
    assert_eq!(short(f64::INFINITY), "inf");
    // Tiny and huge values keep their digits in exponent form, not 0 or 300 digits.
    assert_eq!(short(1e-13), "1e-13");
    assert_eq!(short(1.234567e-9), "1.23457e-9");
    assert_eq!(short(1e300), "1e300");
    assert_eq!(short(123456.0), "123456");
    assert_eq!(short(-0.0), "0");
}

#[test]
fn the_model_table_lists_each_key_once() {
    let keys = model_keys();
    assert_eq!(keys[0], "kind");
    for (i, key) in keys.iter().enumerate() {
        assert!(!keys[i + 1..].contains(key), "{key} listed twice");
    }
    // Every key of every form is a parameter, and every parameter belongs to some form.
    let in_forms: Vec<&str> = MODEL_KINDS
        .iter()
        .flat_map(|k| k.forms.iter().flat_map(|f| f.iter().copied()))
        .collect();
    for key in &in_forms {
        assert!(params::param_type(key).is_some(), "{key}");
    }
    for (key, _) in MODEL_PARAMS {
        assert!(in_forms.contains(key), "{key} belongs to no kind");
    }
    assert_eq!(
        kind_names(),
        "none, uniform, gilbert_elliott, markov4, trace"
    );
    // A parameter takes values of its type only, and unknown keys nothing.
    let mut m = raw("uniform");
    assert!(m.set("rate", params::ParamValue::Number(0.5)));
    assert!(!m.set("rate", params::ParamValue::Text("high".into())));
    assert!(m.set("length", params::ParamValue::Count(7)));
    assert!(!m.set("wobble", params::ParamValue::Number(1.0)));
    assert_eq!((m.rate, m.length), (Some(0.5), Some(7)));
}

#[test]
fn each_kind_names_the_keys_it_takes_from_the_table() {
    // A key of another kind is rejected with the kind's own keys from the table.
    for kind in MODEL_KINDS {
        let foreign = MODEL_PARAMS
            .iter()
            .map(|(key, _)| *key)
            .find(|key| kind.forms.iter().all(|f| !f.contains(key)))
            .expect("some key belongs to another kind");
        let mut m = raw(kind.name);
        match params::param_type(foreign) {
            Some(params::ParamType::Number) => m.set(foreign, params::ParamValue::Number(0.5)),
            Some(params::ParamType::Text) => m.set(foreign, params::ParamValue::Text("x".into())),
            Some(params::ParamType::Count) => m.set(foreign, params::ParamValue::Count(1)),
            None => unreachable!(),
        };
        let e = ModelSpec::from_raw(&m).unwrap_err();
        assert_eq!(e.key, foreign, "{}: {e}", kind.name);
        let takes = match kind.forms.last().copied().unwrap_or(&[]) {
            [] => "no parameters".to_string(),
            keys => keys.join(", "),
        };
        assert!(
            e.message
                .starts_with(&format!("not a parameter of kind {}", kind.name))
                && e.message.ends_with(&format!("it takes {takes}")),
            "{}: {e}",
            kind.name
        );
    }
}

#[test]
fn the_docs_describe_every_kind_and_key_of_the_table() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/loss-models.md");
    let docs = std::fs::read_to_string(path).expect("docs/loss-models.md");
    for kind in MODEL_KINDS {
        assert!(
            docs.contains(&format!("### `{}", kind.name)),
            "docs/loss-models.md has no section for model kind {}",
            kind.name
        );
    }
    for (key, _) in MODEL_PARAMS {
        assert!(
            docs.contains(&format!("`{key}`"))
                || docs.contains(&format!(" {key},"))
                || docs.contains(&format!(" {key} }}")),
            "docs/loss-models.md does not name model key {key}"
        );
    }
}

/// The longest run of consecutive losses in `packets` packets of a stream (joined across
/// messages of `chunk` packets).
fn longest_burst(spec: &ModelSpec, seed: u64, packets: u64, chunk: u64) -> u64 {
    let mut state = ModelState::new(spec, stream_rng(seed));
    let mut runs = Vec::new();
    let (mut longest, mut open, mut done) = (0u64, 0u64, 0u64);
    while done < packets {
        let n = chunk.min(packets - done);
        runs.clear();
        state.fill(n, &mut runs);
        for run in &runs {
            let len = u64::from(run.len);
            open = if run.start == 0 { open + len } else { len };
            longest = longest.max(open);
            if u64::from(run.end()) != n {
                open = 0;
            }
        }
        if runs.last().map_or(true, |r| u64::from(r.end()) != n) {
            open = 0;
        }
        done += n;
    }
    longest
}

#[test]
fn gilbert_elliott_edge_values() {
    // p = 0: the chain never leaves Good, so only Good's loss (netem's 1-k) is ever seen.
    let never_bad = ModelSpec::GilbertElliott {
        p: 0.0,
        r: 0.5,
        h_loss: 1.0,
        k_loss: 0.0,
    };
    assert!(!never_bad.can_lose());
    assert_eq!(measure(&never_bad, 1, 100_000, 1000).0, 0.0);
    let good_only = ModelSpec::GilbertElliott {
        p: 0.0,
        r: 0.0,
        h_loss: 1.0,
        k_loss: 0.1,
    };
    assert!((good_only.expected_loss_rate() - 0.1).abs() < 1e-12);
    assert!((good_only.expected_mean_burst() - 1.0 / 0.9).abs() < 1e-12);
    check(&good_only, 21, 2_000_000);
    // r = 1 with netem's h = 0, k = 1 (h_loss = 1, k_loss = 0): a Bad sojourn is one packet
    // and Good loses nothing, so every loss is isolated: mean burst exactly 1, loss p/(p+1).
    let isolated = ModelSpec::GilbertElliott {
        p: 0.3,
        r: 1.0,
        h_loss: 1.0,
        k_loss: 0.0,
    };
    assert!((isolated.expected_loss_rate() - 0.3 / 1.3).abs() < 1e-12);
    assert!((isolated.expected_mean_burst() - 1.0).abs() < 1e-12);
    assert_eq!(longest_burst(&isolated, 22, 1_000_000, 777), 1);
    check(&isolated, 23, 2_000_000);
    check_reference(&isolated, 24, 1_000_000);
    // h_loss = 0 (netem h = 1): Bad loses nothing, Good loses k_loss: loss k·r/(p+r).
    let bad_is_clean = ModelSpec::GilbertElliott {
        p: 0.1,
        r: 0.2,
        h_loss: 0.0,
        k_loss: 0.05,
    };
    assert!((bad_is_clean.expected_loss_rate() - 0.05 * 0.2 / 0.3).abs() < 1e-12);
    check(&bad_is_clean, 25, 4_000_000);
    check_reference(&bad_is_clean, 26, 2_000_000);
    // r = 1, k_loss = 1, h_loss = 0: Good always loses, Bad never; p = 1 alternates them.
    let alternate = ModelSpec::GilbertElliott {
        p: 1.0,
        r: 1.0,
        h_loss: 0.0,
        k_loss: 1.0,
    };
    let mut s = ModelState::new(&alternate, stream_rng(1));
    let mut out = Vec::new();
    s.fill(6, &mut out);
    let every_other = [0, 2, 4].map(|start| PacketRun { start, len: 1 });
    assert_eq!(out, every_other.to_vec());
}

#[test]
fn rate_form_with_mean_burst_one_isolates_losses_rather_than_bernoulli() {
    // r = 1/mean_burst = 1: every lost packet is followed by a kept one. The loss rate is the
    // one asked for, but the bursts are not Bernoulli's (whose mean burst is 1/(1-rate)).
    let spec = ModelSpec::gilbert_elliott_from_rate(0.2, 1.0).unwrap();
    assert!((spec.expected_loss_rate() - 0.2).abs() < 1e-12);
    assert!((spec.expected_mean_burst() - 1.0).abs() < 1e-12);
    let bernoulli = ModelSpec::Uniform { rate: 0.2 };
    assert!((bernoulli.expected_mean_burst() - 1.25).abs() < 1e-12);
    assert_eq!(longest_burst(&spec, 31, 1_000_000, 1000), 1);
    check(&spec, 32, 2_000_000);
    // The form netem calls Bernoulli is p alone: r = 1 - p.
    let mut m = raw("gilbert_elliott");
    m.p = Some(0.2);
    let netem = ModelSpec::from_raw(&m).unwrap();
    assert!((netem.expected_mean_burst() - 1.25).abs() < 1e-12);
    check(&netem, 33, 2_000_000);
}

#[test]
fn markov4_edge_values() {
    // p13 = 0, p14 > 0: only isolated losses (state 4, then back to 1): loss p14/(1+p14),
    // every burst one packet.
    let isolated = ModelSpec::Markov4 {
        p13: 0.0,
        p31: 1.0,
        p32: 0.0,
        p23: 1.0,
        p14: 0.1,
    };
    assert!((isolated.expected_loss_rate() - 0.1 / 1.1).abs() < 1e-12);
    assert!((isolated.expected_mean_burst() - 1.0).abs() < 1e-12);
    assert_eq!(longest_burst(&isolated, 41, 1_000_000, 1000), 1);
    check(&isolated, 42, 2_000_000);
    check_reference(&isolated, 43, 1_000_000);
    // p31 = 0 with p32 > 0: once in a burst, the chain alternates between 3 and 2 for good;
    // the closed form is that of the 2-3 chain: loss p23/(p23+p32).
    let trapped = ModelSpec::Markov4 {
        p13: 0.01,
        p31: 0.0,
        p32: 0.4,
        p23: 0.6,
        p14: 0.0,
    };
    assert!((trapped.expected_loss_rate() - 0.6).abs() < 1e-12);
    assert!((trapped.expected_mean_burst() - 1.0 / 0.4).abs() < 1e-9);
    check(&trapped, 44, 2_000_000);
    check_reference(&trapped, 45, 2_000_000);
    // State meanings: with p32 = 0 every burst is one sojourn in 3, of mean 1/p31 packets,
    // plus isolated losses from 4.
    let bursts = ModelSpec::Markov4 {
        p13: 0.01,
        p31: 0.25,
        p32: 0.0,
        p23: 1.0,
        p14: 0.0,
    };
    assert!((bursts.expected_mean_burst() - 4.0).abs() < 1e-9);
    check(&bursts, 46, 4_000_000);
}

#[test]
fn rate_form_accepts_its_documented_bound_rate_equal_to_b_over_b_plus_1() {
    // rate = B/(B+1) needs p = 1 exactly; rounding made p = 1.0000000000000002 for B = 4, 9,
    // 12, ... and the profile was refused with "needs p = 1 > 1". The bound is allowed.
    for (rate, burst) in [(0.8, 4.0), (0.9, 9.0), (0.95, 19.0), (0.99, 99.0)] {
        let spec = ModelSpec::gilbert_elliott_from_rate(rate, burst)
            .unwrap_or_else(|e| panic!("rate {rate}, mean_burst {burst}: {e}"));
        let ModelSpec::GilbertElliott { p, .. } = spec else {
            panic!("{spec:?}")
        };
        assert!(
            p <= 1.0 && 1.0 - p < 1e-12,
            "rate {rate}, mean_burst {burst}: p = {p}"
        );
        assert!((spec.expected_loss_rate() - rate).abs() < 1e-12);
    }
    for b in 1..=200u32 {
        let burst = f64::from(b);
        let rate = burst / (burst + 1.0);
        assert!(
            ModelSpec::gilbert_elliott_from_rate(rate, burst).is_ok(),
            "mean_burst {b}"
        );
    }
    // Past the bound is still refused, by as little as 1e-9.
    let e = ModelSpec::gilbert_elliott_from_rate(0.9 + 1e-9, 9.0).unwrap_err();
    assert_eq!(e.key, "rate");
    assert!(e.message.contains("B/(B+1) = 0.9"), "{e}");
}
