//! What the profile's errors echo stays short: a value, a key or a trace line of megabytes
//! is cut in the message, which says how long the whole was (every rank logs the message at
//! init).

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
