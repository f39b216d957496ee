//! Hostile or mistaken files named by the environment and by profiles, through the real
//! library (`dlopen`, `init` in a process of its own) and the `lossy` binary: each must give
//! an error naming the file and what is allowed, at once, never a hang or a crash.

mod common;

use std::path::Path;
use std::process::Command;

use common::{lossy_exe, make_fifo, output_within_10s};

const CHILD: &str = "hostile_files_child";

/// Runs the plugin's `init` alone in a fresh process with `env` set: its stdout and stderr.
/// A child still running after 10 s fails the test (a hang).
fn init_only(env: &[(&str, &str)], what: &str) -> (String, String) {
    let mut cmd = common::init_child::command(CHILD);
    cmd.env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_STATS")
        .envs(env.iter().copied());
    let out = output_within_10s(&mut cmd, what);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

#[test]
fn an_inner_plugin_that_is_a_fifo_fails_init_at_once_naming_it() {
    // dlopen opens its file with a blocking open: a FIFO hung `init` (NCCL's thread) forever.
    let dir = common::fresh_dir("inner-fifo");
    let fifo = dir.join("libnccl-net-fifo.so");
    make_fifo(&fifo);
    let (stdout, stderr) = init_only(
        &[("NCCL_LOSSY_INNER", path_str(&fifo))],
        "init with NCCL_LOSSY_INNER naming a FIFO",
    );
    assert!(stdout.contains("INIT failed"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("{}: not a regular file (a FIFO)", fifo.display())),
        "{stderr}"
    );
    // The same file as the library `lossy demo` drives: refused naming what it is.
    let out = output_within_10s(
        Command::new(lossy_exe()).args(["demo", "--ranks", "2", "--library", path_str(&fifo)]),
        "lossy demo --library naming a FIFO",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is not a regular file (a FIFO)"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_output_directory_that_is_a_fifo_or_a_file_fails_init_saying_what_it_is() {
    // The error said only "cannot create stats directory PATH: File exists (os error 17)".
    let dir = common::fresh_dir("output-not-dir");
    let fifo = dir.join("fifo");
    make_fifo(&fifo);
    let file = dir.join("file");
    std::fs::write(&file, "in the way\n").expect("write");
    for (var, path, kind) in [
        ("NCCL_LOSSY_STATS", &fifo, "a FIFO"),
        ("NCCL_LOSSY_TRACE", &fifo, "a FIFO"),
        ("NCCL_LOSSY_STATS", &file, "a regular file"),
    ] {
        let (stdout, stderr) = init_only(&[(var, path_str(path))], var);
        assert!(stdout.contains("INIT failed"), "{var}: {stdout}\n{stderr}");
        assert!(
            stderr.contains(&format!("{var}={}", path.display()))
                && stderr.contains(&format!("{} is not a directory ({kind})", path.display())),
            "{var}: {stderr}"
        );
    }
    // `lossy run --stats` says the same before it starts the command.
    let out = output_within_10s(
        Command::new(lossy_exe()).args(["run", "--stats", path_str(&fifo), "--", "true"]),
        "lossy run --stats naming a FIFO",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains(&format!("{} is not a directory (a FIFO)", fifo.display())),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_socket_or_a_non_utf8_profile_is_refused_saying_what_and_where() {
    // A Unix socket as profile or trace failed to open with "No such device or address (os
    // error 6)", as if it were missing; a profile with one Latin-1 byte said "not UTF-8 text"
    // without saying where in the file.
    let dir = common::fresh_dir("socket-profile");
    let socket_path = dir.join("p.sock");
    let _socket = std::os::unix::net::UnixListener::bind(&socket_path).expect("bind socket");
    let socket = path_str(&socket_path);
    let (stdout, stderr) = init_only(&[("NCCL_LOSSY_PROFILE", socket)], "a socket as profile");
    assert!(stdout.contains("INIT failed"), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("{socket}: not a regular file (a socket)")),
        "{stderr}"
    );
    let trace = format!("model={{kind=\"trace\",file=\"{socket}\"}}");
    for args in [
        &["validate", socket][..],
        &["validate", "--set", &trace][..],
    ] {
        let out = output_within_10s(Command::new(lossy_exe()).args(args), "lossy validate");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() == Some(2)
                && err.contains(&format!("{socket}: not a regular file (a socket)")),
            "{args:?}: {err}"
        );
    }
    let latin1 = dir.join("latin1.toml");
    std::fs::write(
        &latin1,
        b"seed = 1\nmtu = 4096\ndescription = \"r\xe9seau\"\n",
    )
    .expect("write");
    let out = output_within_10s(
        Command::new(lossy_exe()).args(["validate", path_str(&latin1)]),
        "lossy validate on a Latin-1 profile",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(2)
            && err.contains(&format!("{}:3: ", latin1.display()))
            && err.contains("not UTF-8"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn traces_that_keep_more_than_the_limit_together_are_refused_by_validate_simulate_and_init() {
    // Each trace file was limited, not a profile's traces together, and a link to a loaded
    // file loaded it again: 12 links to one 16 MiB bitmap held 1.7 GB in `lossy simulate`,
    // and `validate` under a 1.2 GB `ulimit -v` aborted ("memory allocation of 67108864
    // bytes failed"). Here every bitmap alternates 1 and 0 over 16 MiB, so each keeps
    // 8388608 runs of 16 bytes: 128 MiB. The links to the first share its copy; the third
    // distinct file takes the total to 384 MiB, over the limit of 256 MiB.
    let dir = common::fresh_dir("trace-budget");
    let bitmap = "10".repeat(8 << 20);
    for name in ["a.bitmap", "b.bitmap", "c.bitmap"] {
        std::fs::write(dir.join(name), &bitmap).expect("write a trace");
    }
    std::os::unix::fs::symlink(dir.join("a.bitmap"), dir.join("link.bitmap")).expect("link");
    std::fs::hard_link(dir.join("a.bitmap"), dir.join("hard.bitmap")).expect("hard link");
    let mut text = String::new();
    for (peer, file) in ["a", "link", "hard", "b", "link", "c"].iter().enumerate() {
        text.push_str(&format!(
            "[[rules]]\npeer = {peer}\nmodel = {{ kind = \"trace\", file = \"{file}.bitmap\", \
             format = \"bitmap\" }}\n"
        ));
    }
    let profile = dir.join("p.toml");
    std::fs::write(&profile, text).expect("write the profile");
    let profile = path_str(&profile);
    let expected = [
        format!("{profile}:18: rules.5.model.file = \"c.bitmap\": "),
        format!("{}: ", dir.join("c.bitmap").display()),
        "would keep 384.0 MiB".to_string(),
        "over the limit of 256.0 MiB".to_string(),
    ];
    let check = |stderr: &str, what: &str| {
        for part in &expected {
            assert!(
                stderr.contains(part.as_str()),
                "{what}: no {part:?} in {stderr}"
            );
        }
    };
    for args in [
        &["validate", profile][..],
        &["simulate", "--packets", "100", profile][..],
    ] {
        let out = output_within_10s(Command::new(lossy_exe()).args(args), args[0]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        check(&stderr, args[0]);
    }
    let (stdout, stderr) = init_only(&[("NCCL_LOSSY_PROFILE", profile)], "init");
    assert!(stdout.contains("INIT failed"), "{stdout}\n{stderr}");
    check(&stderr, "init");
    // Without the last file the profile loads: two distinct traces, 256 MiB.
    let two = dir.join("two.toml");
    let text = std::fs::read_to_string(profile).expect("read the profile");
    let cut = text.rfind("[[rules]]").expect("a rule");
    std::fs::write(&two, &text[..cut]).expect("write");
    let out = output_within_10s(
        Command::new(lossy_exe()).args(["validate", path_str(&two)]),
        "validate",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The child side of the tests above: acts on [`ROLE_ENV`].
#[test]
#[ignore = "run by the other tests of this file in a process of its own"]
fn hostile_files_child() {
    common::init_child::serve();
}
