//! `lossy run` and the guards at the plugin's init: the environment a launch gets, and the
//! loud failures (broken profile, LL/LL128 forced with a data-loss effect).

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use common::{fresh_dir, launch_env, library, lossy_exe, repo_file};
use lossy_cli::harness::worker::{Job, LinkKind};

fn lossy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let env: Vec<(&str, &OsStr)> = env.iter().map(|(k, v)| (*k, OsStr::new(v))).collect();
    lossy_os(args, &env)
}

/// As [`lossy`], with values that need not be UTF-8.
fn lossy_os(args: &[&str], env: &[(&str, &OsStr)]) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_PROTO")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_STATS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run lossy")
}

/// The environment `env` printed when run under `lossy run`, as (key, value) pairs.
fn env_under_run(args: &[&str]) -> Vec<(String, String)> {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "env"]);
    let out = lossy(&all, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn get<'a>(env: &'a [(String, String)], key: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

#[test]
fn run_sets_the_plugin_the_network_the_profile_and_the_guard() {
    let stats = std::env::temp_dir().join(format!("lossy-run-env-{}", std::process::id()));
    let profile = repo_file("configs/uniform-1pct.toml");
    let env = env_under_run(&[
        "--profile",
        profile.to_str().expect("utf-8 path"),
        "--set",
        "seed=3",
        "--set",
        "model.rate=0.02",
        "--stats",
        stats.to_str().expect("utf-8 path"),
    ]);
    let plugin = PathBuf::from(get(&env, "NCCL_NET_PLUGIN").expect("NCCL_NET_PLUGIN"));
    assert!(plugin.is_absolute() && plugin.is_file(), "{plugin:?}");
    assert_eq!(get(&env, "NCCL_NET"), Some("lossy"));
    assert_eq!(
        get(&env, "NCCL_LOSSY_PROFILE").map(PathBuf::from),
        Some(profile)
    );
    assert_eq!(get(&env, "NCCL_LOSSY_SET"), Some("seed=3;model.rate=0.02"));
    assert_eq!(
        get(&env, "NCCL_LOSSY_STATS").map(PathBuf::from),
        Some(stats.clone())
    );
    assert!(stats.is_dir(), "the stats directory is created");
    // `zero` corrupts data: NCCL must stay on Simple.
    assert_eq!(get(&env, "NCCL_PROTO"), Some("Simple"));
    let _ = std::fs::remove_dir_all(&stats);
}

#[test]
fn run_sends_the_traffic_between_gpus_of_one_node_through_the_plugin_unless_told_not_to() {
    // NCCL moves the traffic between GPUs of one node over P2P (NVLink, PCIe), shared memory
    // or NVLS, never through a net plugin: `lossy run -- torchrun --nproc-per-node 8 ...` on
    // one node injected no loss at all, without a word.
    let intra = ["NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"];
    let env = env_under_run(&[]);
    let got: Vec<Option<&str>> = intra.iter().map(|k| get(&env, k)).collect();
    assert_eq!(got, [Some("1"), Some("1"), Some("0")], "{env:?}");
    // Multi-node jobs may keep it on the GPUs' own links (only the network drops packets).
    let env = env_under_run(&["--intra-node", "native"]);
    assert!(intra.iter().all(|k| get(&env, k).is_none()), "{env:?}");
    // A value the user chose is kept.
    let out = lossy(&["run", "--print-env"], &[("NCCL_P2P_DISABLE", "0")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        !stdout.contains("NCCL_P2P_DISABLE") && stdout.contains("export NCCL_SHM_DISABLE=1"),
        "{stdout}"
    );
}

#[test]
fn run_says_when_a_kept_setting_leaves_traffic_of_one_node_outside_the_loss() {
    // NCCL_SHM_DISABLE=0 inherited from a cluster's defaults: `lossy run` (intra-node `net`,
    // the default) kept it without a word, and a one-node job's traffic went over shared
    // memory, which the loss never touches, while the user believed it crossed the plugin.
    let out = lossy(
        &["run", "--", "true"],
        &[("NCCL_SHM_DISABLE", "0"), ("NCCL_P2P_DISABLE", "1")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let notes: Vec<&str> = stderr.lines().filter(|l| l.contains(" is kept")).collect();
    assert_eq!(notes.len(), 1, "{stderr}");
    assert!(
        notes[0].contains("NCCL_SHM_DISABLE=0")
            && notes[0].contains("shared memory")
            && notes[0].contains("--intra-node net sets 1"),
        "{stderr}"
    );
    // A value that agrees with ours, or `--intra-node native`, says nothing.
    let out = lossy(
        &["run", "--intra-node", "native", "--", "true"],
        &[("NCCL_SHM_DISABLE", "0")],
    );
    assert!(!String::from_utf8_lossy(&out.stderr).contains(" is kept"));
}

#[test]
fn retransmit_profiles_leave_the_protocol_alone() {
    let profile = repo_file("configs/retransmit-1pct.toml");
    let env = env_under_run(&["--profile", profile.to_str().expect("utf-8 path")]);
    assert_eq!(get(&env, "NCCL_PROTO"), None);
    assert_eq!(get(&env, "NCCL_NET"), Some("lossy"));
}

/// `lossy run --profile PROFILE -- touch MARKER` with `env` set.
fn run_touch(profile: &std::path::Path, marker: &std::path::Path, env: &[(&str, &str)]) -> Output {
    lossy(
        &[
            "run",
            "--profile",
            profile.to_str().expect("utf-8"),
            "--",
            "touch",
            marker.to_str().expect("utf-8"),
        ],
        env,
    )
}

#[test]
fn run_refuses_a_broken_profile_before_starting_anything() {
    let dir = fresh_dir("run-bad");
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "seed = 1\nmodel = { kind = \"uniform\", rate = 1.5 }\n",
    )
    .expect("write");
    let marker = dir.join("ran");
    let out = run_touch(&bad, &marker, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("bad.toml"), "{stderr}");
    assert!(stderr.contains("model.rate"), "{stderr}");
    assert!(!marker.exists(), "the command must not run");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_refuses_output_settings_the_plugin_refuses_at_init_before_starting_anything() {
    // The plugin's init refuses a statistics or trace directory it cannot write and a trace
    // ring size out of range; `lossy run` checked only its own --stats, so with the shell's
    // NCCL_LOSSY_STATS, NCCL_LOSSY_TRACE or a profile's `trace` it started the job, and NCCL
    // failed every rank at init.
    let dir = fresh_dir("run-bad-outputs");
    let file = dir.join("a-file");
    std::fs::write(&file, "not a directory").expect("write");
    let under_file = file.join("out");
    let under_file = under_file.to_str().expect("utf-8");
    let marker = dir.join("ran");
    let lossless = repo_file("configs/lossless.toml");
    for (key, value) in [
        ("NCCL_LOSSY_STATS", under_file),
        ("NCCL_LOSSY_TRACE", under_file),
        ("NCCL_LOSSY_TRACE_EVENTS", "0"),
    ] {
        assert_refused_naming(&lossless, &marker, key, value);
    }
    let traced = dir.join("traced.toml");
    std::fs::write(
        &traced,
        format!("trace = \"{under_file}\"\nmodel = {{ kind = \"none\" }}\n"),
    )
    .expect("write");
    assert_run_refused(&traced, &marker, &[], &["traced.toml", under_file], "trace");
    // Settings the plugin takes still run the command.
    let stats = dir.join("stats");
    let trace = dir.join("trace");
    let out = run_touch(
        &lossless,
        &marker,
        &[
            ("NCCL_LOSSY_STATS", stats.to_str().expect("utf-8")),
            ("NCCL_LOSSY_TRACE", trace.to_str().expect("utf-8")),
            ("NCCL_LOSSY_TRACE_EVENTS", "1000"),
        ],
    );
    assert_ran(&out, &marker);
}

#[test]
fn run_refuses_socket_settings_the_plugin_refuses_at_init_before_starting_anything() {
    // The socket transport's settings are read at init, which refuses a malformed one; `lossy
    // run` started the job with it, and NCCL failed every rank at init.
    let dir = fresh_dir("run-bad-socket");
    let marker = dir.join("ran");
    let lossless = repo_file("configs/lossless.toml");
    for (key, value) in [
        ("NCCL_LOSSY_NSOCKS", "0"),
        ("NCCL_LOSSY_TIMEOUT", "soon"),
        ("NCCL_SOCKET_FAMILY", "AF_UNIX"),
        ("NCCL_LOSSY_DELAYED_ACKS", "yes"),
    ] {
        assert_refused_naming(&lossless, &marker, key, value);
    }
    let out = run_touch(&lossless, &marker, &[("NCCL_LOSSY_NSOCKS", "2")]);
    assert_ran(&out, &marker);
}

#[test]
fn run_says_when_the_statistics_directory_already_holds_a_runs_files() {
    // A second run into the directory of a first adds its files beside the first run's, and
    // `lossy report` sums both: it said so only after the run, when the first run's files can
    // no longer be told from the second's.
    let dir = fresh_dir("run-stats-reused");
    let stats = dir.join("stats");
    let marker = dir.join("ran");
    let lossless = repo_file("configs/lossless.toml");
    let stats_arg = stats.to_str().expect("utf-8");
    let touch = |env: &[(&str, &str)], with_flag: bool| {
        let mut args = vec!["run", "--profile", lossless.to_str().expect("utf-8")];
        if with_flag {
            args.extend_from_slice(&["--stats", stats_arg]);
        }
        args.extend_from_slice(&["--", "touch", marker.to_str().expect("utf-8")]);
        lossy(&args, env)
    };
    let out = touch(&[], true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.contains("already holds"),
        "an empty directory: {stderr}"
    );
    std::fs::write(stats.join("lossy-stats-rank0-h-1.json"), "{}").expect("write");
    for (env, with_flag) in [
        (vec![], true),
        (vec![("NCCL_LOSSY_STATS", stats_arg)], false),
    ] {
        let out = touch(&env, with_flag);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains(&format!("{stats_arg} already holds 1 statistics file")),
            "{stderr}"
        );
    }
}

#[test]
fn run_refuses_a_plugin_to_wrap_that_cannot_be_loaded_before_starting_anything() {
    // The plugin's init refuses an inner plugin it cannot load, but `lossy run` started the
    // job anyway: NCCL then failed each rank at init, after the launch, instead of one clear
    // refusal before it.
    let dir = fresh_dir("run-bad-inner");
    let marker = dir.join("ran");
    let missing = dir.join("libnccl-net-nothing.so");
    let cases = [
        ("/dev/null", "not a regular file"),
        // A library, but no net plugin: it exports no ncclNetPlugin_v6..v12 table.
        ("libc.so.6", "ncclNetPlugin_v"),
    ];
    for (inner, why) in cases {
        let profile = dir.join("wrap.toml");
        std::fs::write(
            &profile,
            format!("transport = \"wrap\"\ninner = \"{inner}\"\nmodel = {{ kind = \"none\" }}\n"),
        )
        .expect("write");
        assert_run_refused(&profile, &marker, &[], &[inner, why], inner);
        // The same plugin named by NCCL_LOSSY_INNER, over a profile without a transport.
        let plain = repo_file("configs/lossless.toml");
        let env = [("NCCL_LOSSY_INNER", inner)];
        assert_run_refused(
            &plain,
            &marker,
            &env,
            &[why],
            &format!("NCCL_LOSSY_INNER={inner}"),
        );
    }
    // A plugin that is not on this machine may be on the nodes the job runs on (a launcher
    // started from another host): a warning, and the command runs.
    let out = run_touch(
        &repo_file("configs/lossless.toml"),
        &marker,
        &[("NCCL_LOSSY_INNER", missing.to_str().expect("utf-8"))],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: wrap mode: the plugin to wrap is not on this machine")
            && stderr.contains("libnccl-net-nothing.so"),
        "{stderr}"
    );
    assert!(marker.exists(), "the command runs");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lossy run --profile PROFILE -- true` with `NCCL_PROTO` set to `proto`.
fn run_true_with_proto(profile: &std::path::Path, proto: &str) -> std::process::Output {
    let profile = profile.to_str().expect("utf-8");
    lossy(
        &["run", "--profile", profile, "--", "true"],
        &[("NCCL_PROTO", proto)],
    )
}

#[test]
fn run_refuses_non_utf8_settings_instead_of_dropping_them() {
    // The plugin's init refuses these in every rank; `lossy run` must say so before any starts,
    // not take the variable for unset (and, with --set, replace it).
    let bad = OsStr::from_bytes(b"model.rate=0.5;description=\"\xff\"");
    for var in ["NCCL_LOSSY_SET", "NCCL_PROTO"] {
        for extra in [&[][..], &["--set", "seed=3"][..]] {
            let mut args = vec!["run", "--print-env"];
            args.extend_from_slice(extra);
            let out = lossy_os(&args, &[(var, bad)]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{var} {extra:?}: {stderr}");
            assert!(
                stderr.contains(&format!("{var} is not valid UTF-8")),
                "{stderr}"
            );
        }
    }
}

#[test]
fn run_refuses_ll_forced_with_a_data_loss_effect() {
    let profile = repo_file("configs/uniform-1pct.toml");
    // The second is NCCL 2.24's per-collective form, forcing LL for all-reduce alone.
    for proto in ["LL128,Simple", "Simple;allreduce:LL"] {
        let out = run_true_with_proto(&profile, proto);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{proto}: {stderr}");
        assert!(stderr.contains(&format!("NCCL_PROTO={proto}")), "{stderr}");
    }
    // Excluding LL is not forcing it.
    let out = run_true_with_proto(&profile, "^LL,LL128");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_demo_under_run_writes_its_statistics_where_run_said() {
    let stats = std::env::temp_dir().join(format!("lossy-run-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&stats);
    let out = lossy(
        &[
            "run",
            "--stats",
            stats.to_str().expect("utf-8"),
            "--",
            lossy_exe().to_str().expect("utf-8"),
            "demo",
            "--ranks",
            "2",
            "--sizes",
            "1M",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files = std::fs::read_dir(&stats).expect("stats dir").count();
    assert_eq!(files, 2, "one file per rank");
    let _ = std::fs::remove_dir_all(&stats);
}

/// Launches two plugin workers with `env` and returns the launch error.
fn plugin_init_error(env: Vec<(String, String)>) -> String {
    let job = Job::collectives(library(), vec![LinkKind::Plugin], Vec::new());
    match launch_env(2, job, env.clone()) {
        Ok(_) => panic!("the plugin initialised with {env:?}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn the_plugin_fails_init_loudly_on_a_broken_profile() {
    let dir = fresh_dir("init-bad");
    let bad = dir.join("typo.toml");
    std::fs::write(&bad, "seed = 1\neffect = \"zeros\"\n").expect("write");
    let err = plugin_init_error(vec![(
        "NCCL_LOSSY_PROFILE".into(),
        bad.display().to_string(),
    )]);
    assert!(err.contains("typo.toml") && err.contains("effect"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_plugin_fails_init_when_ll_is_forced_with_a_data_loss_effect() {
    let err = plugin_init_error(vec![
        (
            "NCCL_LOSSY_PROFILE".into(),
            repo_file("configs/uniform-1pct.toml").display().to_string(),
        ),
        ("NCCL_PROTO".into(), "LL".into()),
    ]);
    assert!(err.contains("NCCL_PROTO=LL"), "{err}");
}

#[test]
fn a_command_that_cannot_be_run_exits_as_a_shell_would() {
    // A shell answers 127 for a program it cannot find and 126 for one it found but cannot
    // execute; scripts tell "not installed" from "not executable" by it.
    let dir = common::fresh_dir("run-not-executable");
    let script = dir.join("train.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").expect("write the script");
    let out = lossy(&["run", "--", script.to_str().expect("utf-8")], &[]);
    assert_eq!(out.status.code(), Some(126), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("train.sh"),
        "{out:?}"
    );
    let missing = dir.join("no-such-program");
    let out = lossy(&["run", "--", missing.to_str().expect("utf-8")], &[]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_command_that_cannot_be_run_says_why_not_beyond_the_errno() {
    // The bare errno misled: a directory was "Permission denied", a script whose `#!`
    // interpreter is missing "No such file or directory" (the script is right there), and an
    // empty command word "cannot run : No such file or directory", a FIFO "Permission denied".
    let dir = common::fresh_dir("run-cannot-run");
    let folder = dir.join("train dir");
    std::fs::create_dir(&folder).expect("make the directory");
    let fifo = dir.join("train.fifo");
    common::make_fifo(&fifo);
    let fifo = fifo.to_str().expect("utf-8");
    let script = dir.join("train.sh");
    std::fs::write(&script, "#!/no/such/interpreter -u\nexit 0\n").expect("write the script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("make it executable");
    let folder = folder.to_str().expect("utf-8");
    let script = script.to_str().expect("utf-8");
    for (program, code, words) in [
        (folder, 126, &[folder, "is a directory"][..]),
        (fifo, 126, &[fifo, "not a regular file (a FIFO)"][..]),
        (
            script,
            127,
            &[script, "/no/such/interpreter", "interpreter"][..],
        ),
        ("", 127, &["empty"][..]),
    ] {
        let out = lossy(&["run", "--", program], &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{program:?}: {stderr}");
        for word in words {
            assert!(
                stderr.contains(word),
                "{program:?}: no `{word}` in {stderr}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn run_refuses_a_library_path_nccl_cannot_take_from_nccl_net_plugin() {
    // NCCL cuts NCCL_NET_PLUGIN at commas (a list of plugins) and skips a name of 255
    // characters or more (src/plugin/net.cc): `lossy run` set such a path, and every rank
    // failed with "Failed to initialize any NET plugin" after the launch.
    let dir = fresh_dir("run-library-path");
    let comma = dir.join("build,old");
    let long = dir.join("l".repeat(250));
    for place in [&comma, &long] {
        std::fs::create_dir_all(place).expect("make the directory");
        let copy = place.join("libnccl-net-lossy.so");
        std::fs::copy(library(), &copy).expect("copy the library");
        let copy = copy.to_str().expect("utf-8");
        let out = lossy(&["run", "--print-env", "--library", copy], &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{copy}: {stderr}");
        for word in [copy, "NCCL_NET_PLUGIN"] {
            assert!(stderr.contains(word), "no `{word}` in {stderr}");
        }
    }
    // A plain path of the same directory is fine.
    let plain = dir.join("libnccl-net-lossy.so");
    std::fs::copy(library(), &plain).expect("copy the library");
    let out = lossy(
        &[
            "run",
            "--print-env",
            "--library",
            plain.to_str().expect("utf-8"),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn run_warns_when_another_tuner_leaves_ll_allowed_under_a_data_loss_effect() {
    // This library's tuner rules LL/LL128 out under a data-loss effect; NCCL loads it from
    // the net plugin only when NCCL_TUNER_PLUGIN names nothing it can open. With another
    // tuner, an NCCL_PROTO that excludes only LL leaves LL128 to hang the GPU.
    let profile = common::repo_file("configs/uniform-1pct.toml");
    let out = lossy(
        &[
            "run",
            "--profile",
            profile.to_str().expect("utf-8"),
            "--",
            "true",
        ],
        &[
            ("NCCL_PROTO", "^LL"),
            ("NCCL_TUNER_PLUGIN", "/opt/tuners/libnccl-tuner-other.so"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("NCCL_TUNER_PLUGIN=/opt/tuners/libnccl-tuner-other.so")
            && stderr.contains("NCCL_PROTO=Simple"),
        "{stderr}"
    );
}

#[test]
fn run_says_which_of_the_users_settings_it_replaces() {
    // A user's NCCL_NET=IB (or another plugin, profile, statistics directory) was replaced
    // without a word: the job then ran on a network or profile other than the one the shell
    // showed. Each replaced value is named on stderr; a value already equal is not.
    let profile = repo_file("configs/uniform-1pct.toml");
    let stats = fresh_dir("run-replaces");
    let out = lossy(
        &[
            "run",
            "--profile",
            profile.to_str().expect("utf-8 path"),
            "--stats",
            stats.to_str().expect("utf-8 path"),
            "--",
            "true",
        ],
        &[
            ("NCCL_NET", "IB"),
            ("NCCL_NET_PLUGIN", "aws-ofi"),
            ("NCCL_LOSSY_PROFILE", "/nowhere/else.toml"),
            ("NCCL_LOSSY_STATS", "/nowhere/stats"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    for (key, old) in [
        ("NCCL_NET", "IB"),
        ("NCCL_NET_PLUGIN", "aws-ofi"),
        ("NCCL_LOSSY_STATS", "/nowhere/stats"),
    ] {
        let line = stderr
            .lines()
            .find(|l| l.contains(&format!("{key}={old}")))
            .unwrap_or_else(|| panic!("no word of replacing {key}={old}: {stderr}"));
        assert!(line.starts_with("lossy run: note:"), "{line}");
        assert!(line.contains("replaced"), "{line}");
    }
    // The profile given on the command line wins over the environment's, and says so.
    assert!(
        stderr.contains("NCCL_LOSSY_PROFILE=/nowhere/else.toml"),
        "{stderr}"
    );
    // A setting the user already had as run sets it draws no note.
    let same = lossy(&["run", "--", "true"], &[("NCCL_NET", "lossy")]);
    let same_err = String::from_utf8_lossy(&same.stderr);
    assert!(same.status.success(), "{same_err}");
    assert!(!same_err.contains("NCCL_NET="), "{same_err}");
}

#[test]
fn run_says_nothing_of_a_relative_path_naming_the_same_place() {
    // `NCCL_LOSSY_STATS=out` in the environment and `--stats out` on the command line name
    // one directory; run makes it absolute, and a note "replaced by /abs/out" would claim a
    // change that is none.
    let top = fresh_dir("run-same-relative");
    let run_in = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(lossy_exe());
        cmd.current_dir(&top)
            .args(["run", "--stats", "out", "--", "true"])
            .env_remove("NCCL_LOSSY_PROFILE")
            .env_remove("NCCL_LOSSY_SET");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("run lossy")
    };
    let out = run_in(&[("NCCL_LOSSY_STATS", "out")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("NCCL_LOSSY_STATS="), "{stderr}");
    // Another directory is still named.
    let other = run_in(&[("NCCL_LOSSY_STATS", "elsewhere")]);
    let other_err = String::from_utf8_lossy(&other.stderr);
    assert!(other.status.success(), "{other_err}");
    assert!(
        other_err.contains("NCCL_LOSSY_STATS=elsewhere replaced by"),
        "{other_err}"
    );
}

/// `out` is that of a `lossy run` that ran its command, which leaves `marker`.
fn assert_ran(out: &std::process::Output, marker: &std::path::Path) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(marker.exists(), "the command runs");
}

/// `lossy run` under `key=value` refuses (exit 2) naming the setting, and runs nothing.
fn assert_refused_naming(
    profile: &std::path::Path,
    marker: &std::path::Path,
    key: &str,
    value: &str,
) {
    let setting = format!("{key}={value}");
    assert_run_refused(profile, marker, &[(key, value)], &[&setting], &setting);
}

/// `lossy run` of `profile` under `env` refuses (exit 2) with each of `words` in its message,
/// and runs nothing; `what` names the case in a failure.
fn assert_run_refused(
    profile: &std::path::Path,
    marker: &std::path::Path,
    env: &[(&str, &str)],
    words: &[&str],
    what: &str,
) {
    let out = run_touch(profile, marker, env);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
    assert!(words.iter().all(|w| stderr.contains(w)), "{what}: {stderr}");
    assert!(!marker.exists(), "{what}: the command must not run");
}

/// `--stats` naming something that is not a directory: the refusal names the option, so the
/// reader knows which of the settings to fix (the shell's `NCCL_LOSSY_STATS` is not it).
#[test]
fn a_stats_option_that_is_not_a_directory_is_refused_by_its_name() {
    let out = lossy(&["run", "--stats", "/dev/null", "--", "true"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--stats /dev/null") && err.contains("not a directory"),
        "{err}"
    );
}
