//! Property-based tests of the two parsers that read bytes or text from outside: the wire
//! decoders (handle, hello, chunk header, lost-packet runs) and the profile parser.
//!
//! - Decoders: arbitrary bytes never panic, and whatever decodes re-encodes to the very same
//!   bytes (nothing is silently ignored) and respects the documented limits.
//! - Profiles: arbitrary text and arbitrary overrides never panic; generated valid profiles
//!   parse back to the values they were written with; generated keys and values are accepted
//!   exactly when the schema allows them, and a rejection names the line, the key and what is
//!   allowed.
//!
//! `PROPTEST_CASES=100000 cargo test --release --test properties` runs longer; cargo-fuzz
//! targets over the same functions are in `fuzz/` (docs/hardening.md).

use nccl_net_lossy::loss::effect::{packet_count, MIN_MTU};
use nccl_net_lossy::loss::model::ModelSpec;
use nccl_net_lossy::loss::plan::{Effect, PacketRun};
use nccl_net_lossy::profile::{Profile, DEFAULT_PROFILE};
use nccl_net_lossy::transport::socket::wire::{
    self, Handle, Header, Hello, HEADER_SIZE, HELLO_SIZE, MAX_MESSAGE_BYTES,
    MAX_RETRANSMIT_TIMEOUT, MAX_SOCKETS, NONCE_SIZE,
};
use nccl_net_lossy::transport::HANDLE_WIRE_SIZE;
use proptest::prelude::*;

/// `default` cases, or `PROPTEST_CASES` when set (longer runs).
fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig::with_cases(cases)
}

fn array<const N: usize>() -> impl Strategy<Value = [u8; N]> {
    proptest::collection::vec(any::<u8>(), N).prop_map(|v| v.try_into().expect("length N"))
}

fn effect() -> impl Strategy<Value = Effect> {
    prop_oneof![
        Just(Effect::Zero),
        Just(Effect::Stale),
        Just(Effect::Retransmit),
        Just(Effect::Bitflip),
    ]
}

/// Headers inside every limit the decoder enforces.
fn valid_header() -> impl Strategy<Value = Header> {
    (
        any::<u64>(),
        0..MAX_SOCKETS as u8,
        prop_oneof![0..1u64 << 24, 0..=MAX_MESSAGE_BYTES],
        any::<i32>(),
        effect(),
        MIN_MTU..1 << 20,
        0..=MAX_RETRANSMIT_TIMEOUT.as_nanos() as u64,
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(seq, chunk, size, tag, effect, mtu, rt, seed, runs)| {
            let packets = packet_count(size as usize, mtu);
            Header {
                seq,
                chunk,
                size,
                tag,
                effect,
                mtu,
                runs: (u64::from(runs) % (packets + 1)) as u32,
                retransmit_ns: rt,
                flip_seed: seed,
            }
        })
}

/// Bytes near a valid header: a few bytes overwritten, so the decoder's checks are reached
/// (uniformly random bytes almost never get past the magic).
fn mutated_header() -> impl Strategy<Value = [u8; HEADER_SIZE]> {
    (
        valid_header(),
        proptest::collection::vec((0..HEADER_SIZE, any::<u8>()), 0..4),
    )
        .prop_map(|(h, edits)| {
            let mut b = h.encode();
            for (at, v) in edits {
                b[at] = v;
            }
            b
        })
}

fn check_header_bytes(b: &[u8; HEADER_SIZE]) {
    if let Ok(h) = Header::decode(b) {
        assert_eq!(&h.encode(), b, "decoded header re-encodes differently");
        assert!(h.size <= MAX_MESSAGE_BYTES);
        assert!(h.mtu >= MIN_MTU);
        assert!(usize::from(h.chunk) < MAX_SOCKETS);
        assert!(u64::from(h.runs) <= packet_count(h.size as usize, h.mtu));
        assert!(h.retransmit_ns <= MAX_RETRANSMIT_TIMEOUT.as_nanos() as u64);
    }
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn header_decoder_accepts_only_what_it_can_reproduce(b in array::<HEADER_SIZE>()) {
        check_header_bytes(&b);
    }

    #[test]
    fn mutated_headers_never_panic_and_reencode_exactly(b in mutated_header()) {
        check_header_bytes(&b);
    }

    #[test]
    fn valid_headers_round_trip(h in valid_header()) {
        prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn hello_decoder_never_panics_and_checks_the_nonce(
        b in array::<HELLO_SIZE>(),
        nonce in array::<NONCE_SIZE>(),
        conn_id in any::<u64>(),
        count in 1..=MAX_SOCKETS as u16,
        index in any::<u16>(),
    ) {
        if let Ok(h) = Hello::decode(&b, &nonce) {
            prop_assert_eq!(h.encode(), b);
            prop_assert_eq!(h.nonce, nonce);
        }
        let hello = Hello { nonce, conn_id, index: index % count, count };
        prop_assert_eq!(Hello::decode(&hello.encode(), &nonce), Ok(hello));
        let mut other = nonce;
        other[0] ^= 1;
        prop_assert!(Hello::decode(&hello.encode(), &other).is_err());
    }

    #[test]
    fn handle_decoder_never_panics_and_reencodes_exactly(b in array::<HANDLE_WIRE_SIZE>()) {
        if let Ok(h) = Handle::decode(&b) {
            let mut again = [0u8; HANDLE_WIRE_SIZE];
            h.encode(&mut again);
            prop_assert_eq!(again, b);
        }
    }

    #[test]
    fn runs_round_trip(runs in proptest::collection::vec((any::<u32>(), any::<u32>()), 0..64)) {
        let runs: Vec<PacketRun> = runs.into_iter().map(|(start, len)| PacketRun { start, len }).collect();
        let mut bytes = Vec::new();
        wire::encode_runs(&runs, &mut bytes);
        prop_assert_eq!(bytes.len(), runs.len() * wire::RUN_SIZE);
        let mut back = Vec::new();
        wire::decode_runs(&bytes, &mut back);
        prop_assert_eq!(back, runs);
    }
}

/// Text made of profile-like pieces, so the parser gets past TOML syntax and into the schema.
fn profile_like() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("seed = ".to_string()),
        Just("mtu = ".to_string()),
        Just("effect = ".to_string()),
        Just("model = { kind = \"uniform\", rate = ".to_string()),
        Just("model = { kind = \"gilbert_elliott\", p = ".to_string()),
        Just("[[rules]]\n".to_string()),
        Just("collective = [\"AllReduce\"]\n".to_string()),
        Just("steps = { from = ".to_string()),
        Just("retransmit_timeout_us = ".to_string()),
        Just("stats_interval = ".to_string()),
        Just("\"zero\"".to_string()),
        Just(" }\n".to_string()),
        Just("\n".to_string()),
        any::<i64>().prop_map(|x| x.to_string()),
        any::<f64>().prop_map(|x| x.to_string()),
        "[a-z_\\.=\"{}\\[\\], 0-9-]{0,12}",
    ];
    proptest::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn arbitrary_text_never_panics_the_profile_parser(text in any::<String>()) {
        let _ = Profile::parse(&text, "proptest", "");
    }

    #[test]
    fn profile_like_text_never_panics(text in profile_like()) {
        let _ = Profile::parse(&text, "proptest", "");
    }

    #[test]
    fn arbitrary_overrides_never_panic(overrides in "[a-z_\\.=;0-9\"\\[\\]{}, -]{0,60}") {
        let _ = Profile::parse(DEFAULT_PROFILE, "proptest", &overrides);
    }

    #[test]
    fn generated_profiles_round_trip_their_values(
        seed in 0..i64::MAX,
        mtu in MIN_MTU..=65536u32,
        effect in effect(),
        rate in 0.0..=1.0f64,
        timeout_us in 0..100_000u32,
        with_rule in any::<bool>(),
        rule_rate in 0.0..=1.0f64,
    ) {
        let name = |e: Effect| match e {
            Effect::Zero => "zero",
            Effect::Stale => "stale",
            Effect::Retransmit => "retransmit",
            Effect::Bitflip => "bitflip",
        };
        let mut text = format!(
            "seed = {seed}\nmtu = {mtu}\neffect = \"{}\"\nretransmit_timeout_us = {timeout_us}\n\
             model = {{ kind = \"uniform\", rate = {rate:?} }}\n",
            name(effect)
        );
        if with_rule {
            text.push_str(&format!(
                "[[rules]]\nname = \"r\"\ncollective = [\"AllReduce\"]\n\
                 model = {{ kind = \"uniform\", rate = {rule_rate:?} }}\n"
            ));
        }
        let p = Profile::parse(&text, "proptest", "").map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(p.seed, seed as u64);
        prop_assert_eq!(p.mtu, mtu);
        prop_assert_eq!(p.defaults.effect, effect);
        prop_assert_eq!(p.defaults.retransmit_timeout.as_micros(), u128::from(timeout_us));
        prop_assert_eq!(&p.defaults.model, &ModelSpec::Uniform { rate });
        prop_assert_eq!(p.rules.len(), usize::from(with_rule));
        if with_rule {
            prop_assert_eq!(&p.rules[0].action.model, &ModelSpec::Uniform { rate: rule_rate });
        }
        // The same value through an override wins over the file.
        let p = Profile::parse(&text, "proptest", &format!("seed={}", seed / 2))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(p.seed, (seed / 2) as u64);
    }
}

/// The top-level keys, model kinds, model keys and collective names, as messages list them.
const TOP_KEYS: &str = "description, seed, mtu, stats_interval, effect, model, \
                        retransmit_timeout_us, rules, transport, inner, trace, trace_events";
const KINDS: [&str; 5] = ["none", "uniform", "gilbert_elliott", "markov4", "trace"];
const MODEL_KEYS: &str = "kind, rate, mean_burst, p, r, h_loss, k_loss, p13, p31, p32, p23, p14, \
                          file, format, length, at_end, start";
const COLLECTIVES: [&str; 16] = [
    "Unknown",
    "Broadcast",
    "Reduce",
    "AllGather",
    "ReduceScatter",
    "AllReduce",
    "SendRecv",
    "Send",
    "Recv",
    "AllToAll",
    "Scatter",
    "Gather",
    "AllGatherV",
    "PutSignal",
    "Signal",
    "WaitSignal",
];

/// The keys each kind takes (gilbert_elliott: both forms).
fn kind_keys(kind: &str) -> &'static [&'static str] {
    match kind {
        "uniform" => &["rate"],
        "gilbert_elliott" => &["rate", "mean_burst", "p", "r", "h_loss", "k_loss"],
        "markov4" => &["p13", "p31", "p32", "p23", "p14"],
        "trace" => &["file", "format", "length", "at_end", "start"],
        _ => &[],
    }
}

fn parse_err(text: &str) -> Result<String, TestCaseError> {
    match Profile::parse(text, "proptest", "") {
        Ok(p) => Err(TestCaseError::fail(format!("accepted {text:?}: {p:?}"))),
        Err(e) => Ok(e.message),
    }
}

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn uniform_rate_is_accepted_exactly_in_0_1(rate in prop_oneof![-2.0..3.0f64, 0.0..=1.0f64]) {
        let text = format!("seed = 1\nmodel = {{ kind = \"uniform\", rate = {rate:?} }}\n");
        if (0.0..=1.0).contains(&rate) {
            let p = Profile::parse(&text, "proptest", "").map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&p.defaults.model, &ModelSpec::Uniform { rate });
        } else {
            prop_assert_eq!(
                parse_err(&text)?,
                format!("proptest:2: model.rate = {rate}: must be a probability in [0, 1]")
            );
        }
    }

    #[test]
    fn unknown_top_level_keys_are_rejected_naming_the_allowed_ones(key in "[a-z_]{1,12}") {
        let text = format!("seed = 1\n{key} = 1\n");
        if TOP_KEYS.split(", ").any(|k| k.trim() == key) {
            // A known key with a value that may or may not suit it: never "unknown key".
            if let Err(e) = Profile::parse(&text, "proptest", "") {
                prop_assert!(!e.message.contains("unknown key"), "{}", e.message);
            }
        } else {
            let allowed = TOP_KEYS.split_whitespace().collect::<Vec<_>>().join(" ");
            prop_assert_eq!(
                parse_err(&text)?,
                format!("proptest:2: {key}: unknown key; allowed: {allowed}")
            );
        }
    }

    #[test]
    fn model_keys_are_checked_against_the_kind(
        kind in proptest::sample::select(KINDS.to_vec()),
        key in proptest::sample::select(
            MODEL_KEYS.split(", ").map(str::trim).skip(1).chain(["wobble"]).collect::<Vec<_>>()
        ),
    ) {
        let value = match key {
            "file" | "format" | "at_end" | "start" => "\"x\"",
            "length" => "3",
            _ => "0.5",
        };
        let text = format!("model = {{ kind = \"{kind}\", {key} = {value} }}\n");
        let model_keys = MODEL_KEYS.split_whitespace().collect::<Vec<_>>().join(" ");
        if key == "wobble" {
            prop_assert_eq!(
                parse_err(&text)?,
                format!("proptest:1: model.wobble: unknown key; allowed: {model_keys}")
            );
        } else if !kind_keys(kind).contains(&key) {
            let got = parse_err(&text)?;
            let want = format!("proptest:1: model.{key} = {value}: not a parameter of kind {kind}");
            prop_assert!(got.starts_with(&want), "got {}\nwant {}", got, want);
        } else {
            // A key of the kind: accepted, or rejected for what it needs with it, never as
            // a stranger.
            match Profile::parse(&text, "proptest", "") {
                Ok(p) => prop_assert_eq!(p.defaults.model.kind(), kind),
                Err(e) => prop_assert!(
                    !e.message.contains("unknown key") && !e.message.contains("not a parameter"),
                    "{}", e.message
                ),
            }
            if matches!((kind, key), ("uniform", "rate") | ("gilbert_elliott", "p") | ("markov4", "p13")) {
                prop_assert!(Profile::parse(&text, "proptest", "").is_ok(), "{}", text);
            }
        }
    }

    #[test]
    fn unknown_model_kinds_are_rejected_naming_the_kinds(kind in "[a-z_0-9]{1,16}") {
        let text = format!("\nmodel = {{ kind = \"{kind}\" }}\n");
        if KINDS.contains(&kind.as_str()) {
            // Only `none` takes no parameters; the others say which one they miss.
            let r = Profile::parse(&text, "proptest", "");
            prop_assert_eq!(r.is_ok(), kind == "none");
        } else {
            prop_assert_eq!(
                parse_err(&text)?,
                format!(
                    "proptest:2: model.kind = \"{kind}\": unknown model kind \"{kind}\"; \
                     allowed: {}",
                    KINDS.join(", ")
                )
            );
        }
    }

    #[test]
    fn collective_names_are_accepted_in_any_case_and_others_rejected(name in "[A-Za-z]{1,14}") {
        let text = format!("[[rules]]\ncollective = \"{name}\"\n");
        match COLLECTIVES.iter().find(|c| c.eq_ignore_ascii_case(&name)) {
            Some(canonical) => {
                let p = Profile::parse(&text, "proptest", "").map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(
                    &p.to_json()["rules"][0]["match"]["collective"][0],
                    &serde_json::json!(canonical)
                );
            }
            None => prop_assert_eq!(
                parse_err(&text)?,
                format!(
                    "proptest:2: rules.0.collective = \"{name}\": unknown collective; allowed: {}",
                    COLLECTIVES.join(", ")
                )
            ),
        }
    }
}
