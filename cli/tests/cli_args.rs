//! Options of `lossy bench`, `demo` and `run` that were taken and then did something else
//! than asked: a number quietly clamped or panicking, a table counting an earlier run's
//! files, a size printed that did not run, a command ignored, a path printed as another.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Output};

use common::{fresh_dir, lossy_exe, lossy_stdout};
use lossy_cli::harness::plugin_client::NCCL_LIBRARY_NAME;

/// Runs `lossy args` (none of our variables from the developer's shell), within 10 s.
fn lossy(args: &[&OsStr]) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("RUST_BACKTRACE", "0")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_PROTO");
    common::output_within_10s(&mut cmd, &format!("lossy {args:?}"))
}

fn lossy_str(args: &[&str]) -> Output {
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    lossy(&args)
}

/// Asserts `out` is a refusal (exit `code`, no panic, no table) whose stderr holds every one
/// of `words`.
fn assert_refused(out: &Output, code: i32, words: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    for word in words {
        assert!(stderr.contains(word), "no `{word}` in: {stderr}");
    }
}

#[test]
fn a_rendezvous_timeout_out_of_range_is_refused_not_clamped_or_panicking() {
    // `nan` panicked converting to a Duration (exit 101, a backtrace); `-5` and `0` became
    // 0.1 s and `1e9` an hour without a word.
    for command in ["bench", "demo"] {
        for value in ["nan", "inf", "-5", "0", "1e9", "soon"] {
            let out = lossy_str(&[
                command,
                "--rank",
                "1",
                "--world",
                "2",
                "--rendezvous",
                "127.0.0.1:9",
                &format!("--rendezvous-timeout={value}"),
            ]);
            // A usage error, as clap reports one: exit 2.
            assert_refused(&out, 2, &["--rendezvous-timeout", value, "0.1", "3600"]);
        }
    }
}

#[test]
fn bench_counts_that_would_run_something_else_are_refused() {
    // --iters 0 ran one iteration, --raw-streams 0 one stream, --chunk 0 4-byte messages,
    // and a --warmup of 10^11 iterations ran on for days (--iters had its limit, not it).
    for (option, value, allowed) in [
        ("--iters", "0", "at least 1 and at most 1000000"),
        ("--warmup", "100000000000", "at most 1000000"),
        ("--raw-streams", "0", "at least 1"),
        ("--chunk", "0", "at least one element (4 bytes for f32)"),
        ("--chunk", "2", "at least one element (4 bytes for f32)"),
    ] {
        // As bench refuses its other bad values before any rank starts: exit 1.
        let out = lossy_str(&["bench", "--sizes", "4K", option, value]);
        assert_refused(&out, 1, &[option, value, allowed]);
    }
}

#[test]
fn bench_counts_beyond_what_nccl_opens_are_refused_before_any_rank_starts() {
    // --comms had no upper bound: 100000 channels spent many minutes opening connections
    // before running out of descriptors; --raw-streams 100000 failed a minute later as
    // "connection timed out", naming neither the option nor the value.
    for (option, value, allowed) in [
        ("--comms", "100000", "at most 64"),
        ("--comms", "65", "at most 64"),
        ("--raw-streams", "100000", "at most 64"),
        ("--raw-streams", "65", "at most 64"),
    ] {
        let out = lossy_str(&["bench", "--sizes", "4K", option, value]);
        assert_refused(&out, 1, &[option, value, allowed]);
    }
}

#[test]
fn a_bad_size_names_the_option_it_was_given_to() {
    // `lossy bench --sizes 64K --chunk 1.5M` said "bad size `1.5M`", naming no option: with
    // two size options (and a list of sizes) the user had to guess which one was meant.
    for (command, option, value, bad, allowed) in [
        ("bench", "--chunk", "1.5M", "`1.5M`", "e.g. 4096"),
        ("bench", "--chunk", "64Q", "`64Q`", "e.g. 4096"),
        ("bench", "--sizes", "4K,1.5M", "`1.5M`", "e.g. 4096"),
        ("bench", "--sizes", "4K,,1M", "``", "e.g. 4096"),
        (
            "bench",
            "--sizes",
            "99999999999999999999",
            "`9999",
            "at most 1 GiB",
        ),
        ("demo", "--sizes", "1.5M", "`1.5M`", "e.g. 4096"),
        ("demo", "--sizes", "", "``", "e.g. 4096"),
    ] {
        let out = lossy_str(&[command, option, value]);
        assert_refused(&out, 1, &[&format!("{option} {value}"), bad, allowed]);
    }
}

#[test]
fn a_net_version_the_harness_does_not_drive_is_refused_before_any_rank_starts() {
    // --net-version 7 started every rank, each failing with "net plugin version 7 (the
    // harness drives 8 to 12)", naming no option.
    for value in ["0", "7", "13", "4294967295"] {
        let out = lossy_str(&["bench", "--sizes", "4K", "--net-version", value]);
        assert_refused(&out, 1, &["--net-version", value, "8 to 12"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("rank"), "ranks were started: {stderr}");
    }
}

#[test]
fn demo_table_gives_the_size_that_ran() {
    // The demo runs f32 elements: `5` moved 4 bytes and `3` none, yet the table said 5 B and
    // 3 B ("bit-exact", with a bandwidth computed from them). It now runs whole elements, at
    // least one, and says so, as bench does.
    let out = lossy_stdout(&["demo", "--ranks", "2", "--sizes", "5,3"], &[]);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("all_reduce"))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    for row in rows {
        assert!(row.contains(" 4 B "), "{out}");
    }
}

/// The `all` line of the demo's loss table: messages, packets, lost.
fn demo_total(stdout: &str) -> Vec<u64> {
    let line = stdout
        .lines()
        .rfind(|l| l.starts_with("all "))
        .unwrap_or_else(|| panic!("no `all` line: {stdout}"));
    line.split_whitespace()
        .skip(1)
        .take(3)
        .map(|n| n.parse().expect("a count"))
        .collect()
}

#[test]
fn demo_counts_only_its_own_statistics_in_a_reused_directory() {
    // A second `lossy demo --stats-dir D` summed the first run's files with its own: the
    // loss table doubled its messages, without a word.
    let dir = fresh_dir("demo-reused-stats");
    let dir_arg = dir.to_str().expect("utf-8 path");
    let args = [
        "demo",
        "--ranks",
        "2",
        "--sizes",
        "64K",
        "--stats-dir",
        dir_arg,
    ];
    let first = demo_total(&lossy_stdout(&args, &[]));
    let second_out = lossy_stdout(&args, &[]);
    let second = demo_total(&second_out);
    // The same collectives at the same size: the same messages and packets each time.
    assert_eq!(first[..2], second[..2], "{second_out}");
    assert!(second_out.contains("left out"), "{second_out}");
    // Both runs' files stay for `lossy report`.
    let files = std::fs::read_dir(&dir).expect("dir").count();
    assert_eq!(files, 4, "two runs of two ranks");
}

#[test]
fn demo_takes_a_blank_stats_variable_as_unset() {
    // The plugin reads a blank NCCL_LOSSY_STATS as unset; the demo took it as a directory
    // named by the spaces: it made that folder where it ran, the plugin wrote no file there,
    // and the loss table said "no statistics files were written".
    let cwd = fresh_dir("demo-blank-stats");
    let mut cmd = Command::new(lossy_exe());
    cmd.args(["demo", "--ranks", "2", "--sizes", "4K"])
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_LOSSY_STATS", "  ")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .current_dir(&cwd);
    let out = common::output_within_10s(&mut cmd, "lossy demo with a blank NCCL_LOSSY_STATS");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert_eq!(demo_total(&stdout).len(), 3, "{stdout}");
    let made: Vec<_> = std::fs::read_dir(&cwd).expect("dir").collect();
    assert!(made.is_empty(), "the demo made {made:?}");
}

#[test]
fn demo_names_the_option_and_what_is_in_the_way_of_its_statistics_directory() {
    // A file where the statistics directory goes said "cannot create PATH: File exists (os
    // error 17)", naming neither the option nor what is in the way; `validate`, `run --stats`
    // and the plugin's init say what it is.
    let dir = fresh_dir("demo-stats-in-the-way");
    let file = dir.join("regular");
    std::fs::write(&file, "x").expect("write");
    let fifo = dir.join("fifo");
    common::make_fifo(&fifo);
    let file_arg = file.to_str().expect("utf-8 path");
    let out = lossy_str(&[
        "demo",
        "--ranks",
        "2",
        "--sizes",
        "4K",
        "--stats-dir",
        file_arg,
    ]);
    assert_refused(
        &out,
        1,
        &[
            &format!("--stats-dir {file_arg}"),
            &format!("{file_arg} is not a directory (a regular file)"),
        ],
    );
    let fifo_arg = fifo.to_str().expect("utf-8 path");
    let mut cmd = Command::new(lossy_exe());
    cmd.args(["demo", "--ranks", "2", "--sizes", "4K"])
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_LOSSY_STATS", &fifo)
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE");
    let out = common::output_within_10s(&mut cmd, "lossy demo with NCCL_LOSSY_STATS a FIFO");
    assert_refused(
        &out,
        1,
        &[
            &format!("NCCL_LOSSY_STATS={fifo_arg}"),
            &format!("{fifo_arg} is not a directory (a FIFO)"),
        ],
    );
}

#[test]
fn run_print_env_with_a_command_is_refused() {
    // `--print-env -- train.py` printed the exports and exited 0 without running anything.
    let out = lossy_str(&["run", "--print-env", "--", "true"]);
    assert_refused(&out, 2, &["--print-env", "true"]);
}

#[test]
fn run_print_env_prints_a_path_that_is_not_utf8_as_it_is() {
    // `--stats st\xffx` was printed as 'st\u{fffd}x': `eval` of it named another directory.
    let top = fresh_dir("run-print-env-bytes");
    let stats = top.join(OsStr::from_bytes(b"st\xffx"));
    let out = lossy(&[
        OsStr::new("run"),
        OsStr::new("--print-env"),
        OsStr::new("--stats"),
        stats.as_os_str(),
    ]);
    assert!(out.status.success(), "{:?}", out);
    let line = out
        .stdout
        .split(|&b| b == b'\n')
        .find(|l| l.starts_with(b"export NCCL_LOSSY_STATS="))
        .expect("a statistics line");
    let mut want = b"export NCCL_LOSSY_STATS='".to_vec();
    want.extend_from_slice(stats.as_os_str().as_bytes());
    want.push(b'\'');
    assert_eq!(
        line,
        &want[..],
        "{}",
        String::from_utf8_lossy(line).into_owned()
    );
    // A shell reads it back as the same bytes.
    let script = [b"eval \"$(cat)\"; printf %s \"$NCCL_LOSSY_STATS\"".as_slice()].concat();
    let mut sh = Command::new("sh")
        .arg("-c")
        .arg(OsStr::from_bytes(&script))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sh");
    {
        use std::io::Write;
        let mut stdin = sh.stdin.take().expect("stdin");
        stdin.write_all(&out.stdout).expect("write");
    }
    let read = sh.wait_with_output().expect("sh");
    assert_eq!(
        Path::new(OsStr::from_bytes(&read.stdout)),
        stats.as_path(),
        "the shell read another path"
    );
}

/// What `sh` holds in `$VAR` after running `line`, as bytes.
fn shell_reads(line: &[u8], var: &str) -> Vec<u8> {
    let mut script = line.to_vec();
    script.extend_from_slice(format!("; printf %s \"${var}\"").as_bytes());
    let out = Command::new("sh")
        .arg("-c")
        .arg(OsStr::from_bytes(&script))
        .output()
        .expect("sh");
    out.stdout
}

#[test]
fn install_prints_a_prefix_that_is_not_utf8_as_it_is() {
    // The export lines to paste named `p\u{fffd}q` for a prefix `p\xffq`: another directory,
    // where no library was installed.
    let top = fresh_dir("install-bytes");
    let prefix = top.join(OsStr::from_bytes(b"p\xffq"));
    let mut cmd = Command::new(lossy_exe());
    cmd.arg("install").arg("--prefix").arg(&prefix);
    let out = common::output_within_10s(&mut cmd, "lossy install");
    assert!(out.status.success(), "{out:?}");
    let line = out
        .stdout
        .split(|&b| b == b'\n')
        .find(|l| {
            let l = l.trim_ascii_start();
            l.starts_with(b"export NCCL_NET_PLUGIN=")
                && !l.starts_with(b"export NCCL_NET_PLUGIN=lossy")
        })
        .expect("the full-path export line");
    let library = prefix.join("lib").join(NCCL_LIBRARY_NAME);
    assert!(library.is_file(), "not installed at {}", library.display());
    assert_eq!(
        shell_reads(line, "NCCL_NET_PLUGIN"),
        library.as_os_str().as_bytes(),
        "{}",
        String::from_utf8_lossy(line)
    );
    let line = out
        .stdout
        .split(|&b| b == b'\n')
        .find(|l| l.trim_ascii_start().starts_with(b"export LD_LIBRARY_PATH="))
        .expect("the loader path line");
    let mut with_empty = b"LD_LIBRARY_PATH=; ".to_vec();
    with_empty.extend_from_slice(line);
    assert_eq!(
        shell_reads(&with_empty, "LD_LIBRARY_PATH"),
        prefix.join("lib").as_os_str().as_bytes(),
        "{}",
        String::from_utf8_lossy(line)
    );
}

#[test]
fn run_checks_each_set_as_validate_does_and_names_it() {
    // A bad `--set` was reported as `NCCL_LOSSY_SET: model.rate = 2`, a variable the user
    // never set; and two `--set`s each refused alone (an unterminated quote) were joined into
    // one valid override, `description="a;b"`, that neither asked for.
    let out = lossy_str(&["run", "--set", "model.rate=2", "--", "true"]);
    assert_refused(&out, 2, &["--set", "model.rate = 2", "[0, 1]"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("NCCL_LOSSY_SET"), "{stderr}");
    let out = lossy_str(&[
        "run",
        "--set",
        "description=\"a",
        "--set",
        "b\"",
        "--print-env",
    ]);
    assert_refused(&out, 2, &["--set", "quote"]);
    // The environment's own overrides are still named as its.
    let mut cmd = Command::new(lossy_exe());
    cmd.args(["run", "--", "true"])
        .env("NCCL_LOSSY_SET", "model.rate=3")
        .env_remove("NCCL_LOSSY_PROFILE");
    let out = common::output_within_10s(&mut cmd, "lossy run");
    assert_refused(&out, 2, &["NCCL_LOSSY_SET", "model.rate = 3"]);
}

#[test]
fn demo_says_why_a_statistics_file_of_its_run_cannot_be_read() {
    // A statistics file the demo cannot read (here a link to nothing, under the plugin's file
    // name) hid its reason: the loss table said "no statistics files were written".
    let dir = fresh_dir("demo-unreadable-stats");
    let ghost = dir.join("lossy-stats-rank7-ghost-1.json");
    std::os::unix::fs::symlink(dir.join("gone"), &ghost).expect("link");
    let mut cmd = Command::new(lossy_exe());
    cmd.args(["demo", "--ranks", "2", "--sizes", "4K"])
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("NCCL_LOSSY_STATS", &dir)
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE");
    let out = common::output_within_10s(&mut cmd, "lossy demo with an unreadable statistics file");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("no statistics files were written"),
        "{stdout}"
    );
    assert!(
        stdout.contains("lossy-stats-rank7-ghost-1.json") && stdout.contains("cannot"),
        "{stdout}"
    );
}

#[test]
fn messages_into_a_closed_stderr_pipe_do_not_turn_a_refusal_into_a_panic() {
    // `lossy validate P 2>&1 | head -1`: Rust ignores SIGPIPE, so a message written into a
    // pipe nobody reads any more failed, and `eprintln!` panicked: exit 101 (a crash, its
    // message written nowhere) instead of the command's own exit code. (Output on stdout was
    // already ended quietly.)
    let args = [OsStr::new("validate"), OsStr::new("/no/such/profile.toml")];
    let open = lossy(&args);
    assert!(
        !open.status.success() && !open.stderr.is_empty(),
        "{open:?}"
    );
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut child = Command::new(lossy_exe())
        .args(args)
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .stdout(std::process::Stdio::null())
        .stderr(writer)
        .spawn()
        .expect("spawn lossy");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "lossy {args:?} did not end within 10 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!(
        status.code(),
        open.status.code(),
        "{status:?} (101: a panic)"
    );
}

#[test]
fn a_world_size_beyond_what_the_rendezvous_holds_is_refused_not_aborting() {
    // `--world 99999999999` (or a launcher's WORLD_SIZE) aborted rank 0 ("memory allocation
    // of 399999999996 bytes failed", exit 134) and 2^64-1 panicked ("capacity overflow"):
    // the rendezvous made a slot per rank before any arrived.
    for world in ["99999999999", "18446744073709551615", "65537"] {
        for command in ["demo", "bench"] {
            let out = lossy_str(&[
                command,
                "--rank",
                "0",
                "--world",
                world,
                "--rendezvous",
                "127.0.0.1:1",
                "--rendezvous-timeout",
                "1",
            ]);
            assert_refused(&out, 1, &["--world", world, "65536"]);
        }
    }
    let out = Command::new(lossy_exe())
        .args(["demo", "--rendezvous-timeout", "1"])
        .env("RUST_BACKTRACE", "0")
        .env("RANK", "0")
        .env("WORLD_SIZE", "99999999999")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "1")
        .output()
        .expect("run lossy");
    assert_refused(&out, 1, &["WORLD_SIZE", "99999999999", "65536"]);
}

#[test]
fn ranks_that_never_reached_the_rendezvous_are_listed_cut() {
    // Rank 0 of a 5000-rank job that nobody joined listed all 4999 missing ranks in one
    // line of 29 KB (700 KB for 100,000 ranks).
    let out = lossy_str(&[
        "demo",
        "--rank",
        "0",
        "--world",
        "5000",
        "--rendezvous",
        "127.0.0.1:0",
        "--rendezvous-timeout",
        "0.5",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.len() < 2_000
            && stderr.contains("rank(s) 1, 2, 3")
            && stderr.contains("4999 of 5000")
            && stderr.contains("did not reach the rendezvous"),
        "{} bytes: {}",
        stderr.len(),
        &stderr[..stderr.len().min(400)]
    );
}

#[test]
fn a_rendezvous_address_or_launcher_variable_of_kilobytes_is_echoed_cut() {
    // Every rank printed the whole 100 KB address back in its error.
    let long = format!("{}:1", "a".repeat(100_000));
    let out = lossy_str(&[
        "demo",
        "--rank",
        "1",
        "--world",
        "2",
        "--rendezvous",
        &long,
        "--rendezvous-timeout",
        "0.2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        &stderr[..stderr.len().min(300)]
    );
    assert!(
        stderr.len() < 2_000
            && stderr.contains("rendezvous address")
            && stderr.contains("bytes in all"),
        "{} bytes: {}",
        stderr.len(),
        &stderr[..stderr.len().min(300)]
    );
    let digits = "9".repeat(100_000);
    let out = Command::new(lossy_exe())
        .args(["demo", "--rendezvous-timeout", "0.2"])
        .env("RUST_BACKTRACE", "0")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &digits)
        .output()
        .expect("run lossy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.len() < 2_000
            && stderr.contains("MASTER_PORT=999")
            && stderr.contains("bytes in all"),
        "{} bytes: {}",
        stderr.len(),
        &stderr[..stderr.len().min(300)]
    );
}
