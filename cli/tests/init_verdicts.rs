//! What the plugin's `init` refuses of the environment around a valid profile, `lossy validate`,
//! `lossy simulate` and `lossy run` refuse too, for the same reason: they are the checks a user
//! runs before a job, and NCCL, when the plugin's `init` fails, silently moves on to another
//! network unless `NCCL_NET` names ours. What `init` only warns of, they warn of too. Each case
//! runs the real library's `init` in a process of its own.

mod common;

use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe, output_within_10s};

const CHILD: &str = "init_verdicts_child";

/// The variables these tests set or that change a verdict, cleared before each run.
const CLEARED: [&str; 11] = [
    "NCCL_LOSSY_PROFILE",
    "NCCL_LOSSY_SET",
    "NCCL_LOSSY_STATS",
    "NCCL_LOSSY_INNER",
    "NCCL_LOSSY_TRACE",
    "NCCL_LOSSY_TRACE_EVENTS",
    "NCCL_PROTO",
    "NCCL_TUNER_PLUGIN",
    "NCCL_NET_SHARED_BUFFERS",
    "NCCL_ALLOC_P2P_NET_LL_BUFFERS",
    "NCCL_P2P_LL_THRESHOLD",
];

fn cleared(cmd: &mut Command, env: &[(&str, &str)]) {
    for var in CLEARED {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
}

/// The plugin's `init` alone in a fresh process with `env` set: "INIT ok" or "INIT failed:
/// ...", then what the plugin logged.
fn init_outcome(env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = common::init_child::command(CHILD);
    cleared(&mut cmd, env);
    let out = output_within_10s(&mut cmd, &format!("init with {env:?}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.find("INIT ").map(|at| l[at..].to_string()))
        .unwrap_or_else(|| panic!("no INIT line: {stdout}"));
    (line, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn lossy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args);
    cleared(&mut cmd, env);
    output_within_10s(&mut cmd, &format!("lossy {args:?} with {env:?}"))
}

/// A profile that loses nothing, written as `name` in `dir`; its path.
fn lossless_profile(dir: &std::path::Path, name: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, "model = \"none\"\n").expect("write profile");
    path.to_str().expect("utf-8 path").to_string()
}

/// Asserts that `init`, `lossy validate`, `lossy simulate` and `lossy run` all refuse
/// `profile` under `env`, each naming every one of `words`.
fn all_refuse(profile: &str, env: &[(&str, &str)], words: &[&str]) {
    let mut init_env = env.to_vec();
    init_env.push(("NCCL_LOSSY_PROFILE", profile));
    let (init, log) = init_outcome(&init_env);
    assert!(init.starts_with("INIT failed"), "{env:?}: {init}\n{log}");
    for word in words {
        assert!(log.contains(word), "{env:?}: {word:?} not in {log}");
    }
    // `lossy run` checks before any rank starts what every rank's init would refuse.
    for args in [
        &["validate", profile][..],
        &["simulate", "--packets", "1000", profile][..],
        &["run", "--print-env", "--profile", profile][..],
    ] {
        let out = lossy(args, env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?} under {env:?} accepted what init refuses ({init}):\n{}{stderr}",
            String::from_utf8_lossy(&out.stdout)
        );
        for word in words {
            assert!(stderr.contains(word), "{args:?}: {word:?} not in {stderr}");
        }
    }
}

#[test]
fn a_forced_ll_protocol_or_a_bad_trace_ring_size_is_refused_before_the_run_as_at_init() {
    let dir = fresh_dir("init-verdicts");
    let zero = dir.join("zero.toml");
    std::fs::write(
        &zero,
        "effect = \"zero\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
    )
    .expect("write profile");
    let zero = zero.to_str().expect("utf-8 path");
    // A data-loss effect under a forced LL protocol would hang the receiving GPU: init
    // refuses it, and validate said the profile was fine.
    all_refuse(zero, &[("NCCL_PROTO", "LL")], &["NCCL_PROTO=LL", zero]);
    // So would a point-to-point LL transfer, which dedicated network buffers let NCCL pick
    // whatever NCCL_PROTO and the tuner say.
    all_refuse(
        zero,
        &[("NCCL_NET_SHARED_BUFFERS", "0")],
        &["NCCL_NET_SHARED_BUFFERS=0", "NCCL_P2P_LL_THRESHOLD=0", zero],
    );
    // The trace ring's size is checked at every init, tracing or not.
    all_refuse(
        zero,
        &[("NCCL_LOSSY_TRACE_EVENTS", "0")],
        &["NCCL_LOSSY_TRACE_EVENTS=0", "[1, 16777216]"],
    );
    // What init accepts, both accept.
    for env in [
        &[("NCCL_PROTO", "Simple")][..],
        &[("NCCL_LOSSY_TRACE_EVENTS", "64")][..],
        &[
            ("NCCL_NET_SHARED_BUFFERS", "0"),
            ("NCCL_P2P_LL_THRESHOLD", "0"),
        ][..],
    ] {
        let mut init_env = env.to_vec();
        init_env.push(("NCCL_LOSSY_PROFILE", zero));
        let (init, log) = init_outcome(&init_env);
        assert_eq!(init, "INIT ok", "{env:?}: {log}");
        for args in [
            &["validate", zero][..],
            &["simulate", "--packets", "1000", zero][..],
        ] {
            let out = lossy(args, env);
            assert!(
                out.status.success(),
                "{args:?} under {env:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_socket_setting_init_refuses_is_refused_by_validate_and_simulate_too() {
    // The socket transport reads NCCL_LOSSY_NSOCKS, NCCL_LOSSY_TIMEOUT, ... at init and fails
    // on a malformed one; `lossy validate` and `lossy simulate` said the run was fine.
    let dir = fresh_dir("init-verdicts-socket");
    let plain = lossless_profile(&dir, "plain.toml");
    let plain = plain.as_str();
    for (key, value, allowed) in [
        ("NCCL_LOSSY_NSOCKS", "0", "from 1 to"),
        ("NCCL_LOSSY_NSOCKS", "4.5", "from 1 to"),
        ("NCCL_LOSSY_SOCKBUF", "-1", "from"),
        ("NCCL_LOSSY_DELAYED_ACKS", "yes", "1 (delay"),
        ("NCCL_SOCKET_FAMILY", "AF_UNIX", "AF_INET"),
    ] {
        let said = format!("{key}={value}");
        all_refuse(plain, &[(key, value)], &[&said, allowed]);
    }
    // What init accepts, both accept.
    let env = [("NCCL_LOSSY_NSOCKS", "2")];
    let (init, log) = init_outcome(&[env[0], ("NCCL_LOSSY_PROFILE", plain)]);
    assert_eq!(init, "INIT ok", "{log}");
    for args in [
        &["validate", plain][..],
        &["simulate", "--packets", "1000", plain][..],
    ] {
        let out = lossy(args, &env);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_output_directory_that_is_a_file_is_refused_before_the_run_as_at_init() {
    // The profile's `trace`, NCCL_LOSSY_TRACE and NCCL_LOSSY_STATS name directories that init
    // creates and probes; one that is a file fails init, and validate said the profile was fine.
    let dir = fresh_dir("init-verdicts-dirs");
    let file = dir.join("a-file");
    std::fs::write(&file, "not a directory\n").expect("write file");
    let file = file.to_str().expect("utf-8 path");
    let traced = dir.join("traced.toml");
    std::fs::write(&traced, format!("trace = \"{file}\"\nmodel = \"none\"\n"))
        .expect("write profile");
    let traced = traced.to_str().expect("utf-8 path");
    let plain = lossless_profile(&dir, "plain.toml");
    let plain = plain.as_str();
    let below = format!("{file}/sub");
    all_refuse(traced, &[], &["trace (profile", file, "not a directory"]);
    all_refuse(
        plain,
        &[("NCCL_LOSSY_TRACE", file)],
        &["NCCL_LOSSY_TRACE=", file, "not a directory"],
    );
    all_refuse(
        plain,
        &[("NCCL_LOSSY_STATS", file)],
        &["NCCL_LOSSY_STATS=", file, "not a directory"],
    );
    all_refuse(
        plain,
        &[("NCCL_LOSSY_STATS", &below)],
        &["NCCL_LOSSY_STATS=", file, "not a directory"],
    );
    // A directory that does not exist yet is created at init: fine, and validate creates
    // nothing.
    let fresh = dir.join("stats-to-be");
    let fresh = fresh.to_str().expect("utf-8 path");
    for args in [
        &["validate", plain][..],
        &["simulate", "--packets", "1000", plain][..],
    ] {
        let out = lossy(args, &[("NCCL_LOSSY_STATS", fresh)]);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        !std::path::Path::new(fresh).exists(),
        "validate created {fresh}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_output_directory_where_nothing_can_be_written_is_refused_before_the_run_as_at_init() {
    // init creates the statistics and trace directories and writes a probe file in them;
    // validate only looked for a file in the way, and passed a directory (or the parent of
    // one to create) where nothing can be written. /proc takes no new file, even from root.
    let dir = fresh_dir("init-verdicts-unwritable");
    let plain = lossless_profile(&dir, "plain.toml");
    let plain = plain.as_str();
    for place in ["/proc", "/proc/lossy-no-such-dir/stats"] {
        all_refuse(
            plain,
            &[("NCCL_LOSSY_STATS", place)],
            &[&format!("NCCL_LOSSY_STATS={place}"), "cannot"],
        );
        all_refuse(
            plain,
            &[("NCCL_LOSSY_TRACE", place)],
            &[&format!("NCCL_LOSSY_TRACE={place}"), "cannot"],
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_comm_size_rule_under_another_tuner_is_warned_about_at_init_and_by_validate() {
    // `comm_size` is learnt from this library's tuner; NCCL loads the tuner NCCL_TUNER_PLUGIN
    // names instead (or none for "none", src/plugin/tuner.cc), and the rule then never matched
    // a message without a word from init or validate.
    let dir = fresh_dir("init-verdicts-comm-size");
    let profile = dir.join("sized.toml");
    std::fs::write(
        &profile,
        "[[rules]]\ncomm_size = 8\nmodel = { kind = \"uniform\", rate = 0.1 }\n",
    )
    .expect("write profile");
    let profile = profile.to_str().expect("utf-8 path");
    for tuner in ["/opt/tuners/libnccl-tuner-other.so", "none"] {
        let env = [("NCCL_TUNER_PLUGIN", tuner)];
        let (init, log) = init_outcome(&[env[0], ("NCCL_LOSSY_PROFILE", profile)]);
        assert_eq!(init, "INIT ok", "{log}");
        let out = lossy(&["validate", profile], &env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        for (who, text) in [("init", &log), ("validate", &stderr.to_string())] {
            assert!(
                text.contains(&format!("NCCL_TUNER_PLUGIN={tuner}"))
                    && text.contains("rules.0")
                    && text.contains("comm_size"),
                "{who} under NCCL_TUNER_PLUGIN={tuner} said nothing: {text}"
            );
        }
    }
    // This library as the tuner, or none named: no warning.
    for env in [&[][..], &[("NCCL_TUNER_PLUGIN", "lossy")][..]] {
        let out = lossy(&["validate", profile], env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !stderr.contains("comm_size"),
            "{env:?}: {stderr}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_peer_rule_without_a_launcher_rank_is_warned_about_at_init() {
    // `peer` names launcher ranks (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID), carried
    // in the connection handle. With none set, or one that is not a number, no message has a
    // peer and the rule never matched, without a word.
    let dir = fresh_dir("init-verdicts-peer");
    let profile = dir.join("peer.toml");
    std::fs::write(
        &profile,
        "[[rules]]\npeer = 1\nmodel = { kind = \"uniform\", rate = 0.1 }\n",
    )
    .expect("write profile");
    let profile = profile.to_str().expect("utf-8 path");
    let unset = [
        ("RANK", ""),
        ("OMPI_COMM_WORLD_RANK", ""),
        ("PMI_RANK", ""),
        ("SLURM_PROCID", ""),
    ];
    for (rank, said) in [(None, "RANK"), (Some("rank-one"), "RANK=rank-one")] {
        let mut env = unset.to_vec();
        env.push(("NCCL_LOSSY_PROFILE", profile));
        if let Some(rank) = rank {
            env[0] = ("RANK", rank);
        }
        let (init, log) = init_outcome(&env);
        assert_eq!(init, "INIT ok", "{log}");
        assert!(
            log.contains("rules.0") && log.contains("peer") && log.contains(said),
            "{rank:?}: init said nothing of the peer rule: {log}"
        );
    }
    // With a rank, nothing to say.
    let mut env = unset.to_vec();
    env[0] = ("RANK", "0");
    env.push(("NCCL_LOSSY_PROFILE", profile));
    let (init, log) = init_outcome(&env);
    assert_eq!(init, "INIT ok", "{log}");
    assert!(!log.contains("peer"), "{log}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_lossy_profile_without_a_launcher_rank_is_warned_about_at_init() {
    // Loss streams are seeded from the launcher's rank: without one every process seeded as
    // rank 0 toward an unknown peer, so all ranks lost the same packets, without a word.
    let unset = [
        ("RANK", ""),
        ("OMPI_COMM_WORLD_RANK", ""),
        ("PMI_RANK", ""),
        ("SLURM_PROCID", ""),
    ];
    // The embedded default (uniform 1%, retransmit) loses too.
    let (init, log) = init_outcome(&unset);
    assert_eq!(init, "INIT ok", "{log}");
    assert!(
        log.contains("same packets") && log.contains("RANK"),
        "init said nothing of the seeding: {log}"
    );
    let mut env = unset.to_vec();
    env[0] = ("RANK", "1");
    let (init, log) = init_outcome(&env);
    assert_eq!(init, "INIT ok", "{log}");
    assert!(!log.contains("same packets"), "{log}");
}

#[test]
fn a_stats_interval_with_nowhere_to_write_is_warned_about_at_init_and_by_validate() {
    // `stats_interval` sets how often the statistics file is written, but the file is written
    // only into NCCL_LOSSY_STATS: without it (and without a trace directory) the key did
    // nothing, without a word.
    let dir = fresh_dir("init-verdicts-interval");
    let profile = dir.join("periodic.toml");
    std::fs::write(&profile, "stats_interval = 5\nmodel = \"none\"\n").expect("write profile");
    let profile = profile.to_str().expect("utf-8 path");
    let (init, log) = init_outcome(&[("NCCL_LOSSY_PROFILE", profile)]);
    assert_eq!(init, "INIT ok", "{log}");
    let out = lossy(&["validate", profile], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let run = lossy(&["run", "--print-env", "--profile", profile], &[]);
    let run_err = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{run_err}");
    for (who, text) in [("init", &log), ("validate", &stderr), ("run", &run_err)] {
        assert!(
            text.contains("stats_interval") && text.contains("NCCL_LOSSY_STATS"),
            "{who} said nothing of the unused stats_interval: {text}"
        );
    }
    // With a statistics directory, nothing to say.
    let stats = dir.join("stats");
    let stats = stats.to_str().expect("utf-8 path");
    let (init, log) = init_outcome(&[("NCCL_LOSSY_PROFILE", profile), ("NCCL_LOSSY_STATS", stats)]);
    assert_eq!(init, "INIT ok", "{log}");
    assert!(!log.contains("stats_interval"), "{log}");
    let out = lossy(&["validate", profile], &[("NCCL_LOSSY_STATS", stats)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("stats_interval"),
        "{stderr}"
    );
    let run = lossy(
        &["run", "--print-env", "--stats", stats, "--profile", profile],
        &[],
    );
    let run_err = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && !run_err.contains("stats_interval"),
        "{run_err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_misspelt_variable_of_ours_is_named_with_the_one_meant_at_init_and_by_validate_and_run() {
    // NCCL_LOSSY_PROFIL=p.toml (a letter short) was ignored without a word: the run used the
    // embedded default, 1% loss, instead of the profile meant.
    let dir = fresh_dir("init-verdicts-misspelt");
    let profile = lossless_profile(&dir, "p.toml");
    let profile = profile.as_str();
    for (typo, meant) in [
        ("NCCL_LOSSY_PROFIL", "NCCL_LOSSY_PROFILE"),
        ("NCCL_LOSSY_NSOCK", "NCCL_LOSSY_NSOCKS"),
        ("NCCL_LOSSY_STAT", "NCCL_LOSSY_STATS"),
    ] {
        let env = [(typo, profile)];
        let (init, log) = init_outcome(&env);
        assert_eq!(init, "INIT ok", "{log}");
        let validate = lossy(&["validate"], &env);
        let run = lossy(&["run", "--print-env"], &env);
        assert!(validate.status.success() && run.status.success());
        let validate = String::from_utf8_lossy(&validate.stderr).into_owned();
        let run = String::from_utf8_lossy(&run.stderr).into_owned();
        for (who, text) in [("init", &log), ("validate", &validate), ("run", &run)] {
            assert!(
                text.contains(&format!("{typo}=")) && text.contains(&format!("{meant}?")),
                "{who} said nothing of {typo}: {text}"
            );
        }
    }
    // Our own variables are not warned about.
    let (init, log) = init_outcome(&[("NCCL_LOSSY_PROFILE", profile)]);
    assert_eq!(init, "INIT ok", "{log}");
    assert!(!log.contains("not a variable"), "{log}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn no_interface_to_use_fails_init_with_nccls_code() {
    // NCCL's Socket plugin answers it with ncclInternalError ("NET/Socket : no interface
    // found", `ncclNetSocketInit` in src/transport/net_socket.cc); ours said ncclSystemError.
    let (init, log) = init_outcome(&[("NCCL_SOCKET_IFNAME", "=no-such-interface")]);
    assert!(init.starts_with("INIT failed"), "{init}\n{log}");
    assert!(init.contains("ncclInternalError"), "{init}\n{log}");
    assert!(log.contains("no usable network interface"), "{init}\n{log}");
}

/// The child side of the tests above: acts on [`ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn init_verdicts_child() {
    common::init_child::serve();
}
