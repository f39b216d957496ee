//! `lossy validate` checks exactly what the plugin will load: the profile with the
//! `NCCL_LOSSY_SET` of the environment and each `--set` on top, printing the overrides it
//! applied; with no file, the profile `NCCL_LOSSY_PROFILE` names. A FIFO or device given as a
//! profile is refused at once.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe, make_fifo};

fn lossy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args)
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_INNER");
    for (k, v) in env {
        cmd.env(k, v);
    }
    common::output_within_10s(&mut cmd, &format!("lossy {args:?}"))
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, body).expect("write profile");
    path.display().to_string()
}

#[test]
fn validate_applies_nccl_lossy_set_like_the_plugin() {
    let dir = fresh_dir("validate-set");
    let good = write(
        &dir,
        "good.toml",
        "model = { kind = \"uniform\", rate = 0.01 }\n",
    );
    // The environment breaks the profile: validate must say so, as init would.
    let out = lossy(
        &["validate", &good],
        &[("NCCL_LOSSY_SET", "model.rate=1.5")],
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("NCCL_LOSSY_SET: model.rate = 1.5: must be a probability"),
        "{stderr}"
    );
    // The environment's overrides and --set apply in that order, and both are printed.
    let out = lossy(
        &["validate", &good, "--set", "model.rate=0.05"],
        &[("NCCL_LOSSY_SET", "seed=42;model.rate=0.5")],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("seed 42"), "{stdout}");
    assert!(stdout.contains("expected loss 5%"), "{stdout}");
    assert!(
        stdout.contains("override from NCCL_LOSSY_SET: seed=42;model.rate=0.5")
            && stdout.contains("override from --set: model.rate=0.05"),
        "{stdout}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_without_a_file_checks_the_profile_nccl_lossy_profile_names() {
    let dir = fresh_dir("validate-env-profile");
    let bad = write(&dir, "bad.toml", "effect = \"drop\"\n");
    let out = lossy(&["validate"], &[("NCCL_LOSSY_PROFILE", &bad)]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("bad.toml") && stderr.contains("unknown effect"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_refuses_a_fifo_at_once() {
    let dir = fresh_dir("validate-fifo");
    let fifo = dir.join("profile.toml");
    make_fifo(&fifo);
    let fifo = fifo.display().to_string();
    for env in [vec![], vec![("NCCL_LOSSY_PROFILE", fifo.as_str())]] {
        let args: &[&str] = if env.is_empty() {
            &["validate", &fifo]
        } else {
            &["validate"]
        };
        let out = lossy(args, &env);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("not a regular file (a FIFO)"), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_names_the_command_line_for_a_bad_set_and_survives_a_deep_key() {
    let deep = format!("{}b=1", "a.".repeat(40_000));
    for (env, set, want) in [
        (
            vec![],
            "model.rate=1e400".to_string(),
            "--set: model.rate = 1e400: float out of range",
        ),
        (vec![], deep.clone(), "--set: `a.a.a."),
        (
            vec![("NCCL_LOSSY_SET", deep.as_str())],
            "seed=2".to_string(),
            "NCCL_LOSSY_SET: `a.a.a.",
        ),
    ] {
        let out = lossy(&["validate", "--set", &set], &env);
        let (stdout, stderr) = text(&out);
        // A stack overflow aborts (134); an error is exit 2 with the message.
        assert_eq!(
            out.status.code(),
            Some(2),
            "{stdout}{}",
            &stderr[..stderr.len().min(500)]
        );
        assert!(
            stderr.contains(want) && stderr.len() < 1000,
            "{}",
            &stderr[..stderr.len().min(500)]
        );
    }
    // The deep key's error says what is allowed.
    let out = lossy(&["validate", "--set", &deep], &[]);
    assert!(text(&out).1.contains("at most 16 segments"));
}

#[test]
fn the_summary_names_each_override_where_it_came_from() {
    // The one-line summary said "(NCCL_LOSSY_SET: seed=5)" for an override given only with
    // --set: a reader checking the environment would find no such variable.
    let out = lossy(&["validate", "--set", "seed=5"], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let summary = stdout.lines().next().unwrap_or_default();
    assert!(
        summary.ends_with("(--set: seed=5)") && !summary.contains("NCCL_LOSSY_SET"),
        "{summary}"
    );
    let out = lossy(
        &["validate", "--set", "seed=5"],
        &[("NCCL_LOSSY_SET", "mtu=1024")],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let summary = stdout.lines().next().unwrap_or_default();
    assert!(
        summary.ends_with("(NCCL_LOSSY_SET: mtu=1024; --set: seed=5)"),
        "{summary}"
    );
}

#[test]
fn a_malformed_number_is_named_as_malformed_with_its_text_not_as_out_of_range() {
    // `seed = 0x` (a base prefix with no digit) and `rate = 1e` (an exponent with none) were
    // reported as "seed = : integer out of range", the value shown empty and the reason wrong.
    let dir = fresh_dir("validate-malformed-number");
    for (body, want) in [
        ("seed = 0x\n", "x.toml:1: seed = 0x: not a valid integer"),
        ("seed = 0b2\n", "x.toml:1: seed = 0b2: not a valid integer"),
        // Too large: out of the key's range, shown with its prefix (it read "seed = ffff...").
        (
            "seed = 0xffffffffffffffffff\n",
            "x.toml:1: seed = 0xffffffffffffffffff: must be an integer in [0, 9223372036854775807]: out of range",
        ),
        (
            "\nmodel = { kind = \"uniform\", rate = 1e }\n",
            "x.toml:2: model.rate = 1e: not a valid number",
        ),
    ] {
        let file = write(&dir, "x.toml", body);
        let out = lossy(&["validate", &file], &[]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{body}: {stdout}{stderr}");
        assert!(
            stderr.contains(want) && (want.contains("range") || !stderr.contains("range")),
            "{body}: {stderr}"
        );
    }
    for (set, want) in [
        ("seed=0x", "--set: seed = 0x: not a valid integer"),
        ("mtu=0o", "--set: mtu = 0o: not a valid integer"),
    ] {
        let out = lossy(&["validate", "--set", set], &[]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{set}: {stdout}{stderr}");
        assert!(
            stderr.contains(want) && !stderr.contains("out of range"),
            "{set}: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_override_value_that_opens_a_list_or_table_but_is_not_toml_says_so() {
    // A value starting with `[` or `{` is meant as TOML; taken as a string instead, a missing
    // brace read "unknown model kind \"{kind=...\"" and unquoted names in a list read
    // "unknown collective", and a deep one was echoed whole (120 KB on one line).
    for (set, want) in [
        (
            "model={kind=\"uniform\", rate=0.1",
            "--set: model = `{kind=\"uniform\", rate=0.1`: not valid TOML",
        ),
        (
            "rules=[{effect=\"zero\"}",
            "--set: rules = `[{effect=\"zero\"}`: not valid TOML",
        ),
        (
            "rules=[{collective=[AllReduce, Broadcast]}]",
            "--set: rules = `[{collective=[AllReduce, Broadcast]}]`: not valid TOML: string \
             values must be quoted, expected literal string (strings inside a list or table \
             need quotes",
        ),
    ] {
        let out = lossy(&["validate", "--set", set], &[]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{set}: {stdout}{stderr}");
        assert!(
            stderr.contains(want)
                && !stderr.contains("unknown model kind")
                && !stderr.contains("unknown collective"),
            "{set}: {stderr}"
        );
    }
    let deep = format!("model={}{}", "[".repeat(60_000), "]".repeat(60_000));
    let out = lossy(&["validate", "--set", &deep], &[]);
    let (_, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        &stderr[..stderr.len().min(500)]
    );
    assert!(
        stderr.contains("not valid TOML") && stderr.len() < 1000,
        "{}",
        &stderr[..stderr.len().min(500)]
    );
}

#[test]
fn a_rule_an_earlier_rule_always_takes_first_is_warned_about() {
    // The first matching rule decides: a backward-pass AllReduce rule after a rule for every
    // AllReduce never decides a message. The profile stays valid (a sweep may produce such
    // an order on purpose), but nothing said that the condition written is not the one that
    // will run.
    let dir = fresh_dir("validate-shadowed");
    let profile = write(
        &dir,
        "shadowed.toml",
        "[[rules]]\nname = \"all gradients\"\ncollective = \"AllReduce\"\n\
         model = { kind = \"uniform\", rate = 0.01 }\n\n\
         [[rules]]\ncollective = \"AllReduce\"\nphase = \"backward\"\n\
         model = { kind = \"uniform\", rate = 0.05 }\n\n\
         [[rules]]\ncollective = \"AllGather\"\nmodel = { kind = \"uniform\", rate = 0.05 }\n",
    );
    let out = lossy(&["validate", &profile], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "one rule is shadowed:\n{stderr}");
    assert!(
        warnings[0].contains(&format!(
            "{profile}: rules.1 (collective=AllReduce phase=backward)"
        )) && warnings[0].contains("never decides a message")
            && warnings[0].contains("rules.0 \"all gradients\" (collective=AllReduce)"),
        "{stderr}"
    );
    // The same warning where it matters most: before a run starts, and in the plugin's log.
    let out = lossy(&["run", "--profile", &profile, "--print-env"], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("lossy run: warning: ") && stderr.contains("never decides a message"),
        "{stderr}"
    );
    let out = lossy(
        &["demo", "--ranks", "2", "--sizes", "4096"],
        &[("NCCL_LOSSY_PROFILE", &profile)],
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.contains("WARN NET/lossy profile") && l.contains("never decides"))
            .count(),
        2,
        "each rank's plugin says so at init:\n{stderr}"
    );
    // Reordered (the narrower rule first), nothing to say.
    let reordered = write(
        &dir,
        "reordered.toml",
        "[[rules]]\ncollective = \"AllReduce\"\nphase = \"backward\"\n\
         model = { kind = \"uniform\", rate = 0.05 }\n\n\
         [[rules]]\ncollective = \"AllReduce\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
    );
    let out = lossy(&["validate", &reordered], &[]);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success() && !stderr.contains("warning"),
        "{stdout}{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_refuses_the_wrap_settings_the_plugin_and_lossy_run_refuse() {
    // `transport = "wrap"` without `inner` and without NCCL_LOSSY_INNER: the plugin fails at
    // init and `lossy run` refuses it, but validate printed the summary and exited 0; so did
    // `transport = "socket"` under NCCL_LOSSY_INNER, which the plugin refuses too.
    let dir = fresh_dir("validate-wrap");
    let wrap = write(
        &dir,
        "wrap.toml",
        "transport = \"wrap\"\nmodel = \"none\"\n",
    );
    let socket = write(
        &dir,
        "socket.toml",
        "transport = \"socket\"\nmodel = \"none\"\n",
    );
    let out = lossy(&["validate", &wrap], &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains(&wrap)
            && stderr.contains("transport = \"wrap\" but names no plugin to wrap")
            && stderr.contains("NCCL_LOSSY_INNER"),
        "{stderr}"
    );
    // the same words as `lossy run`'s refusal
    let run = lossy(&["run", "--profile", &wrap, "--", "true"], &[]);
    let (_, run_err) = text(&run);
    assert_eq!(run.status.code(), Some(2), "{run_err}");
    let reason = |s: &str| s.split_once(": ").map(|(_, r)| r.trim().to_string());
    assert_eq!(reason(&stderr), reason(&run_err), "{stderr}\n{run_err}");
    // with the plugin to wrap named in the environment the profile is fine
    let out = lossy(&["validate", &wrap], &[("NCCL_LOSSY_INNER", "ofi")]);
    assert!(out.status.success(), "{:?}", text(&out));
    let out = lossy(&["validate", &socket], &[("NCCL_LOSSY_INNER", "ofi")]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(
        stderr.contains("NCCL_LOSSY_INNER=ofi") && stderr.contains("transport = \"socket\""),
        "{stderr}"
    );
    assert!(lossy(&["validate", &socket], &[]).status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn validate_names_the_plugin_to_wrap_that_nccl_lossy_inner_names() {
    // NCCL_LOSSY_INNER puts any profile in wrap mode over that plugin, but the summary of a
    // profile without `transport` said nothing of it: the run wraps `ofi`, validate showed sockets.
    let dir = fresh_dir("validate-inner-env");
    let plain = write(&dir, "plain.toml", "model = \"none\"\n");
    let out = lossy(&["validate", &plain], &[("NCCL_LOSSY_INNER", "ofi")]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout
            .lines()
            .any(|l| l.trim() == "wrap mode: inner ofi (from NCCL_LOSSY_INNER)"),
        "{stdout}"
    );
    // the profile's own `inner` loses to the environment's, as at init
    let wrap = write(
        &dir,
        "wrap.toml",
        "transport = \"wrap\"\ninner = \"ib\"\nmodel = \"none\"\n",
    );
    let out = lossy(&["validate", &wrap], &[("NCCL_LOSSY_INNER", "ofi")]);
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("wrap mode: inner ofi (from NCCL_LOSSY_INNER)"),
        "{stdout}"
    );
    // without it, nothing is added
    let out = lossy(&["validate", &wrap], &[]);
    assert!(!text(&out).0.contains("wrap mode:"), "{:?}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_refuses_the_wrap_settings_validate_and_the_plugin_refuse() {
    // `lossy simulate` measured and exited 0 on a profile that the plugin refuses at init
    // (and `lossy validate` with exit 2): `transport = "wrap"` with nothing to wrap, or
    // `transport = "socket"` under NCCL_LOSSY_INNER. Both must give one verdict.
    let dir = fresh_dir("simulate-wrap");
    let wrap = write(
        &dir,
        "wrap.toml",
        "transport = \"wrap\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
    );
    let socket = write(
        &dir,
        "socket.toml",
        "transport = \"socket\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
    );
    for (file, env) in [
        (&wrap, &[][..]),
        (&socket, &[("NCCL_LOSSY_INNER", "ofi")][..]),
    ] {
        let check = lossy(&["validate", file], env);
        let sim = lossy(&["simulate", "--packets", "1000", file], env);
        let (_, check_err) = text(&check);
        let (sim_out, sim_err) = text(&sim);
        assert_eq!(check.status.code(), Some(2), "{check_err}");
        assert_eq!(sim.status.code(), Some(2), "{env:?}: {sim_out}{sim_err}");
        let reason = |s: &str| s.split_once(": ").map(|(_, r)| r.trim().to_string());
        assert_eq!(
            reason(&check_err),
            reason(&sim_err),
            "{check_err}\n{sim_err}"
        );
    }
    // what both accept, simulate measures
    let sim = lossy(
        &["simulate", "--packets", "1000", &wrap],
        &[("NCCL_LOSSY_INNER", "ofi")],
    );
    assert!(sim.status.success(), "{:?}", text(&sim));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_key_set_twice_is_named_with_its_dotted_path() {
    // The error said only "FILE:5: not valid TOML: duplicate key": which key, in which table,
    // was left to guess (a profile's rules repeat the same key names).
    let dir = fresh_dir("validate-duplicate");
    let cases = [
        (
            "model.toml",
            "seed = 1\n[model]\nkind = \"uniform\"\nrate = 0.01\nrate = 0.02\n",
            ":5:",
            "model.rate",
        ),
        (
            "rule.toml",
            "[[rules]]\nname = \"a\"\n[[rules]]\nname = \"b\"\neffect = \"zero\"\neffect = \"stale\"\n",
            ":6:",
            "rules.1.effect",
        ),
        (
            "inline.toml",
            "model = { kind = \"uniform\", rate = 0.01, rate = 0.5 }\n",
            ":1:",
            "model.rate",
        ),
    ];
    for (name, body, line, key) in cases {
        let file = write(&dir, name, body);
        let out = lossy(&["validate", &file], &[]);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&format!("{file}{line}")) && stderr.contains(&format!("`{key}`")),
            "{name}: {key} not named in {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_traffic_class_criterion_of_nccls_undefined_class_is_refused() {
    // NCCL hands the plugin -1 (NCCL_NET_TRAFFIC_CLASS_UNDEF) for a communicator without a
    // traffic class, which the plugin takes for "none": a rule with `traffic_class = -1` was
    // accepted and never matched a message, whatever the communicators said.
    let dir = fresh_dir("validate-traffic-class");
    for (name, criterion) in [("one.toml", "-1"), ("list.toml", "[3, -1]")] {
        let file = write(
            &dir,
            name,
            &format!(
                "[[rules]]\ntraffic_class = {criterion}\nmodel = {{ kind = \"uniform\", rate = 0.1 }}\n"
            ),
        );
        let out = lossy(&["validate", &file], &[]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{name}: {stdout}{stderr}");
        assert!(
            stderr.contains(&format!("{file}:2: rules.0.traffic_class"))
                && stderr.contains("= -1")
                && stderr.contains("NCCL_NET_TRAFFIC_CLASS_UNDEF"),
            "{stderr}"
        );
    }
    // A real class is fine.
    let file = write(&dir, "ok.toml", "[[rules]]\ntraffic_class = [0, 3]\n");
    let out = lossy(&["validate", &file], &[]);
    assert!(out.status.success(), "{:?}", text(&out));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bare_value_holding_another_override_is_refused() {
    // Overrides forgotten a `;` between (`description=sweep model.rate=0.5`) read as one bare
    // string: the description became "sweep model.rate=0.5" and the rate was never set, with
    // exit 0 and the old rate in the summary.
    let dir = fresh_dir("validate-bare-equals");
    let file = write(
        &dir,
        "p.toml",
        "model = { kind = \"uniform\", rate = 0.01 }\n",
    );
    for (set, env) in [
        ("description=sweep model.rate=0.5", None),
        ("trace=runs/t,model.rate=0.5", None),
        ("", Some("inner=ib model.rate=0.5")),
    ] {
        let mut args = vec!["validate", file.as_str()];
        if !set.is_empty() {
            args.extend(["--set", set]);
        }
        let env: Vec<(&str, &str)> = env.map(|e| ("NCCL_LOSSY_SET", e)).into_iter().collect();
        let out = lossy(&args, &env);
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{set} {env:?}: {stdout}{stderr}"
        );
        assert!(
            stderr.contains("model.rate=0.5") && stderr.contains(';') && stderr.contains("quote"),
            "{stderr}"
        );
    }
    // Quoted, a string may hold `=`.
    let out = lossy(&["validate", &file, "--set", "description=\"a=b\""], &[]);
    assert!(out.status.success(), "{:?}", text(&out));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bursty_model_says_how_much_traffic_its_mean_needs() {
    // A Gilbert-Elliott stream starts in its good state, and its bursts come far apart: at 1%
    // loss in bursts of 8, one every 800 packets (3.1 MiB of 4 KiB packets). A connection that
    // carries a few MiB shows 0% or several times the mean, and validate's "expected loss 1%"
    // alone let a user take a short run's rate for the model's. Uniform loss has no such
    // scale worth a word: its losses are 100 packets apart on average.
    let dir = fresh_dir("validate-burst-scale");
    let ge = write(
        &dir,
        "ge.toml",
        "mtu = 4096\nmodel = { kind = \"gilbert_elliott\", rate = 0.01, mean_burst = 8 }\n",
    );
    let (stdout, stderr) = text(&lossy(&["validate", &ge], &[]));
    assert!(
        stdout.contains("a burst begins every 800 packets (3.1 MiB at mtu 4096) on average"),
        "{stdout}{stderr}"
    );
    let uniform = write(
        &dir,
        "u.toml",
        "model = { kind = \"uniform\", rate = 0.01 }\n",
    );
    let (stdout, stderr) = text(&lossy(&["validate", &uniform], &[]));
    assert!(
        stdout.contains("expected loss 1%") && !stdout.contains("a burst begins every"),
        "{stdout}{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn long_overrides_and_an_inner_plugin_path_are_shown_cut() {
    // Valid values a summary shows are cut past 4096 characters (a 100 KB override was
    // printed whole twice, and every rank logs the summary at init); a plugin to wrap whose
    // path is longer than the system opens is refused with the path cut, where init passed
    // it to the loader, whose error named it whole.
    let lossless = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/lossless.toml");
    let long = "x".repeat(100_000);
    let set = format!("description={long}");
    let out = lossy(&["validate", "--set", &set, lossless], &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.len() < 10_000 && stdout.contains("…") && stdout.contains("bytes in all"),
        "{} bytes: {}",
        stdout.len(),
        &stdout[..stdout.len().min(300)]
    );
    let inner = format!("/tmp/{long}");
    let out = lossy(&["validate", lossless], &[("NCCL_LOSSY_INNER", &inner)]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "a 100 KB plugin path was accepted");
    let all = format!("{stdout}{stderr}");
    assert!(
        all.len() < 1_000 && all.contains("a path has at most 4095 bytes"),
        "{} bytes: {}",
        all.len(),
        &all[..all.len().min(300)]
    );
}

#[test]
fn environment_values_of_kilobytes_are_echoed_cut() {
    // A variable's value is echoed in init's errors and warnings (logged by every rank, on
    // stderr too) and by validate: cut past 60 characters with its length said, as the
    // profile's values are. `NCCL_PROTO`, `NCCL_LOSSY_TRACE_EVENTS` and a misspelt
    // `NCCL_LOSSY_*` of 100 KB were echoed whole.
    let dir = fresh_dir("validate-long-env");
    let zero = write(
        &dir,
        "zero.toml",
        "effect = \"zero\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
    );
    let long = "9".repeat(100_000);
    let forced = format!("LL,{long}");
    for (name, value, refused) in [
        ("NCCL_LOSSY_TRACE_EVENTS", long.as_str(), true),
        ("NCCL_LOSSY_NSOCKS", long.as_str(), true),
        ("NCCL_PROTO", forced.as_str(), true),
        ("NCCL_LOSSY_PROFIL", long.as_str(), false),
    ] {
        let out = lossy(&["validate", &zero], &[(name, value)]);
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.success(),
            !refused,
            "{name}: {}",
            &stderr[..stderr.len().min(300)]
        );
        assert!(
            stderr.len() < 2_000 && stderr.contains(name) && stderr.contains("bytes in all"),
            "{name}: {} bytes: {}{}",
            stderr.len(),
            &stdout[..stdout.len().min(300)],
            &stderr[..stderr.len().min(300)]
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_and_simulate_refuse_a_plugin_to_wrap_that_lossy_run_and_init_refuse() {
    // `lossy run` and the plugin's init refuse a plugin to wrap that is here but is no net
    // plugin (a device, a directory, a library without a ncclNetPlugin_v8..v12 table), but
    // validate and simulate printed the summary and exited 0: the profile they approved
    // failed every rank at init.
    let dir = fresh_dir("validate-bad-inner");
    let missing = dir.join("libnccl-net-nothing.so");
    for (inner, why) in [
        ("/dev/null", "not a regular file"),
        ("libc.so.6", "ncclNetPlugin_v"),
    ] {
        let wrap = write(
            &dir,
            "wrap.toml",
            &format!("transport = \"wrap\"\ninner = \"{inner}\"\nmodel = \"none\"\n"),
        );
        for command in ["validate", "simulate"] {
            let out = lossy(&[command, &wrap], &[]);
            let (stdout, stderr) = text(&out);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{command} {inner}: {stdout}{stderr}"
            );
            assert!(
                stderr.contains(inner) && stderr.contains(why),
                "{command} {inner}: {stderr}"
            );
        }
        let lossless = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/lossless.toml");
        let out = lossy(&["validate", lossless], &[("NCCL_LOSSY_INNER", inner)]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{inner}: {stdout}{stderr}");
        assert!(stderr.contains(why), "{inner}: {stderr}");
    }
    // A plugin that is not on this machine may be where the job runs: still valid.
    let out = lossy(
        &[
            "validate",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/lossless.toml"),
        ],
        &[("NCCL_LOSSY_INNER", missing.to_str().expect("utf-8"))],
    );
    assert!(out.status.success(), "{:?}", text(&out));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_blank_profile_variable_of_kilobytes_is_echoed_cut() {
    // `NCCL_LOSSY_PROFILE` of blanks names no file and is refused, but the refusal quoted the
    // value whole: 100,000 spaces made an error of 100 KB, from validate, run and every rank's
    // init.
    let blanks = " ".repeat(100_000);
    for args in [&["validate"][..], &["run", "--print-env"][..]] {
        let out = lossy(args, &[("NCCL_LOSSY_PROFILE", blanks.as_str())]);
        let (_, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {} bytes",
            stderr.len()
        );
        assert!(
            stderr.len() < 2_000
                && stderr.contains("NCCL_LOSSY_PROFILE")
                && stderr.contains("bytes in all"),
            "{args:?}: {} bytes: {}",
            stderr.len(),
            &stderr[..stderr.len().min(300)]
        );
    }
}

#[test]
fn an_output_directory_path_of_kilobytes_is_refused_cut() {
    // A statistics or trace directory longer than the system opens: validate approved it
    // (its nearest existing ancestor is writable) while init fails on it, and run and init
    // echoed the 100 KB path whole, twice (the variable's value, then the system's error).
    let dir = fresh_dir("validate-long-output-dir");
    let profile = write(&dir, "ok.toml", "seed = 1\n");
    let long = "a".repeat(100_000);
    for name in ["NCCL_LOSSY_STATS", "NCCL_LOSSY_TRACE"] {
        for args in [&["validate", &profile][..], &["run", "--", "true"][..]] {
            let out = lossy(args, &[(name, long.as_str())]);
            let (_, stderr) = text(&out);
            assert_eq!(
                out.status.code(),
                Some(2),
                "{name} {args:?}: {}",
                &stderr[..stderr.len().min(300)]
            );
            assert!(
                stderr.len() < 2_000
                    && stderr.contains(name)
                    && stderr.contains("bytes in all")
                    && stderr.contains("4095"),
                "{name} {args:?}: {} bytes: {}",
                stderr.len(),
                &stderr[..stderr.len().min(300)]
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
