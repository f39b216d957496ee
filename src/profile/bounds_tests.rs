//! What the profile's errors and warnings say stays short: a value, a key or a trace line of
//! megabytes is cut in the message, which says how long the whole was, and a profile of many
//! rules an earlier one covers gets a bounded number of warnings and a count of the rest
//! (every rank logs them at init).

use crate::profile::*;

/// The error of profile `text` read with `overrides`.
fn err(text: &str, overrides: &str) -> String {
    match Profile::parse(text, "configs/x.toml", overrides) {
        Ok(p) => panic!("expected an error, got {p:?}"),
        Err(e) => e.message,
    }
}

/// Asserts `message` is at most `max` bytes, begins with `start`, holds every one of `words`
/// and says the echo was cut from a whole of `whole` bytes.
fn assert_cut(message: &str, max: usize, start: &str, words: &[&str], whole: usize) {
    let head: String = message.chars().take(300).collect();
    assert!(
        message.len() <= max,
        "{} bytes, more than {max}: {head}",
        message.len()
    );
    assert!(message.starts_with(start), "want {start:?} first: {head}");
    for word in words {
        assert!(message.contains(word), "want {word:?}: {head}");
    }
    assert!(
        message.contains('…') && message.contains(&format!("{whole} bytes in all")),
        "want the cut and the whole's length ({whole} bytes): {head}"
    );
}

const BIG: usize = 3 << 20;

#[test]
fn a_huge_value_in_the_file_is_cut_in_the_error() {
    // `seed = "<3 MB>"` gave an error of 3 MB, and `model = { kind = "<3 MB>" }` one of 6 MB
    // (the value, then the message of the unknown kind naming it again).
    let big = "x".repeat(BIG);
    let cases = [
        (
            format!("seed = \"{big}\"\n"),
            "configs/x.toml:1: seed = \"xxx",
            "must be an integer",
        ),
        (
            format!("model = {{ kind = \"{big}\" }}\n"),
            "configs/x.toml:1: model.kind = \"xxx",
            "unknown model kind",
        ),
        (
            format!("model = \"{big}\"\n"),
            "configs/x.toml:1: model = \"xxx",
            "unknown model kind",
        ),
        (
            format!("[[rules]]\ncollective = \"{big}\"\n"),
            "configs/x.toml:2: rules.0.collective = \"xxx",
            "unknown collective",
        ),
        // A trace's file: named by the value, and not again by the error of reading it.
        (
            format!("model = {{ kind = \"trace\", file = \"{big}\" }}\n"),
            "configs/x.toml:1: model.file = \"xxx",
            "a path has at most 4095 bytes",
        ),
        (
            format!("[[rules]]\nname = \"a\"\npeer = \"{big}\"\n"),
            "configs/x.toml:3: rules.0.peer = \"xxx",
            "must be an integer",
        ),
    ];
    for (text, start, why) in cases {
        assert_cut(&err(&text, ""), 400, start, &[why], BIG);
    }
    // An integer literal of a megabyte: its digits are cut too.
    let digits = "9".repeat(1 << 20);
    assert_cut(
        &err(&format!("seed = {digits}\n"), ""),
        300,
        "configs/x.toml:1: seed = 999",
        &["out of range"],
        1 << 20,
    );
}

#[test]
fn a_huge_key_in_the_file_is_cut_in_the_error() {
    let big = "k".repeat(BIG);
    let cases = [
        (format!("\"{big}\" = 1\n"), "configs/x.toml:1: kkk", BIG),
        (
            format!("[[rules]]\n\"{big}\" = 1\n"),
            "configs/x.toml:2: rules.0.kkk",
            BIG,
        ),
        (
            format!("model = {{ kind = \"none\", \"{big}\" = 1 }}\n"),
            "configs/x.toml:1: model.kkk",
            BIG,
        ),
        // Quoted (a control character in it): cut all the same.
        (
            format!("\"\\u0000{big}\" = 1\n"),
            "configs/x.toml:1: \"\\0kkk",
            BIG + 1,
        ),
    ];
    for (text, start, whole) in cases {
        assert_cut(&err(&text, ""), 400, start, &["unknown key"], whole);
    }
    // A key set twice is named by the parser's error.
    let twice = format!("\"{big}\" = 1\n\"{big}\" = 2\n");
    assert_cut(
        &err(&twice, ""),
        400,
        "configs/x.toml:2: not valid TOML: duplicate key",
        &["a key or table is set once"],
        BIG,
    );
}

#[test]
fn a_huge_override_is_cut_wherever_its_error_echoes_it() {
    // Only some override errors cut what they echoed; the others gave 100 KB back.
    let big = "x".repeat(100_000);
    let nines = "9".repeat(100_000);
    let cases = [
        (
            format!("seed=\"{big}\""),
            "NCCL_LOSSY_SET: seed = \"xxx",
            "must be an integer",
            100_000,
        ),
        (
            format!("seed={big}"),
            "NCCL_LOSSY_SET: seed = \"xxx",
            "must be an integer",
            100_000,
        ),
        (
            format!("seed=1{nines}"),
            "NCCL_LOSSY_SET: seed = 199",
            "out of range",
            100_001,
        ),
        (
            format!("{big}.a=1"),
            "NCCL_LOSSY_SET: xxx",
            "unknown key",
            100_000,
        ),
        (
            format!("rules.0.{big}=1"),
            "NCCL_LOSSY_SET: rules.0.xxx",
            "not in the profile",
            100_008,
        ),
        (
            format!("{big}..a=1"),
            "NCCL_LOSSY_SET: `xxx",
            "not a dotted key",
            100_003,
        ),
        (
            format!("description=\"{big}"),
            "NCCL_LOSSY_SET: `description=\"xxx",
            "unterminated",
            100_013,
        ),
        (
            big.clone(),
            "NCCL_LOSSY_SET: `xxx",
            "expected key=value",
            100_000,
        ),
        (
            format!("description={big} seed=1"),
            "NCCL_LOSSY_SET: description = `xxx",
            "another override",
            100_007,
        ),
        (
            format!("model={{kind={big}"),
            "NCCL_LOSSY_SET: model = `{kind=xxx",
            "not valid TOML",
            100_006,
        ),
    ];
    for (set, start, why, whole) in cases {
        assert_cut(&err("", &set), 400, start, &[why], whole);
    }
}

#[test]
fn warnings_of_rules_covered_by_earlier_ones_are_capped_with_a_count() {
    // 1024 identical rules with names of 3.9 KB: one warning per rule after the first, each
    // naming both rules in full, 8 MB from `lossy validate` and 4 MB at every rank's init.
    let name = "n".repeat(3900);
    let rule = format!("[[rules]]\nname = \"{name}\"\ncollective = \"AllReduce\"\n");
    let p = Profile::parse(&rule.repeat(MAX_RULES), "configs/x.toml", "").unwrap();
    let warnings = p.warnings();
    let bytes: usize = warnings.iter().map(String::len).sum();
    let head: Vec<String> = warnings
        .iter()
        .take(3)
        .map(|w| w.chars().take(400).collect())
        .collect();
    assert!(
        bytes <= 8192,
        "{} warnings, {bytes} bytes: {head:?}",
        warnings.len()
    );
    let (last, listed) = warnings.split_last().expect("warnings");
    assert!(
        !listed.is_empty() && listed.iter().all(|w| w.contains("never decides a message")),
        "{head:?}"
    );
    // Each listed warning names both rules, their names cut.
    for w in listed {
        assert!(
            w.contains("rules.0 \"nnn")
                && w.contains('…')
                && w.contains("3900 bytes in all")
                && w.len() < 1000,
            "{w}"
        );
    }
    // The rest are counted: every covered rule is listed or counted.
    let left = MAX_RULES - 1 - listed.len();
    assert!(
        last.starts_with("configs/x.toml: ")
            && last.contains(&format!("{left} more rules never decide a message"))
            && last.contains(&format!("rules.{}", listed.len() + 1)),
        "{last}"
    );
    // A few covered rules are all listed, and nothing is counted.
    let p = Profile::parse(&rule.repeat(3), "configs/x.toml", "").unwrap();
    let warnings = p.warnings();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().all(|w| !w.contains("more rules")));
    // One warning longer than the cap by itself (a list of 2000 peers) is counted, and the
    // count names the rule.
    let peers: Vec<String> = (0..2000).map(|i| i.to_string()).collect();
    let rule = format!("[[rules]]\npeer = [{}]\n", peers.join(", "));
    let p = Profile::parse(&rule.repeat(2), "configs/x.toml", "").unwrap();
    assert_eq!(
        p.warnings(),
        [
            "configs/x.toml: … 1 more rule never decides a message, rules.1: it matches only \
          messages an earlier rule matches (the first rule that matches decides; put the \
          narrower rule first)"
        ]
    );
}

#[test]
fn a_retransmit_wait_of_a_second_or_more_per_message_is_warned_about() {
    // mtu 64, a 10 s timeout and half the packets lost: a 512 KiB message waits some 5.7
    // hours on average, which `lossy validate` printed as a number and accepted without a
    // word (a benchmark sat until its deadline).
    let p = |text: &str| Profile::parse(text, "configs/x.toml", "").expect("a valid profile");
    let slow = p("mtu = 64\nretransmit_timeout_us = 10000000\n\
                  model = { kind = \"uniform\", rate = 0.5 }\n");
    let warnings = slow.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = &warnings[0];
    assert!(
        w.starts_with("configs/x.toml: default")
            && w.contains("512 KiB message waits 20482.5 s on average")
            && w.contains("retransmit_timeout_us"),
        "{w}"
    );
    // A rule of its own, named; 200 us at 1% (the default timeout) is nothing to say.
    let rule = p(
        "model = { kind = \"uniform\", rate = 0.01 }\n[[rules]]\nname = \"slow\"\n\
                  collective = \"AllReduce\"\nretransmit_timeout_us = 1000000\n\
                  model = { kind = \"uniform\", rate = 0.2 }\n",
    );
    let warnings = rule.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("rules.0 \"slow\""), "{}", warnings[0]);
    // Data-loss effects wait for nothing.
    let zero = p("effect = \"zero\"\nmtu = 64\nmodel = { kind = \"uniform\", rate = 0.5 }\n");
    assert!(zero.warnings().is_empty(), "{:?}", zero.warnings());
}
