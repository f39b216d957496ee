//! `lossy bench` as one rank of a multi-process job: separate `lossy bench` processes with
//! torchrun-, Open MPI- and Slurm-style variables set by hand, the failures a cluster job
//! meets (wrong job id, a rank that never comes, a rank killed mid-run, strangers at the
//! rendezvous port, ranks given other work), and, as root with `ip`, ranks in network
//! namespaces of their own joined by a veth pair.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::lossy_exe;

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The launcher variables of every test are set by hand: none may leak in from outside.
const LAUNCHER_VARS: [&str; 14] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "NCCL_LOSSY_RENDEZVOUS",
    "NCCL_LOSSY_RENDEZVOUS_PORT",
];

/// `lossy bench` with `args` and `env`, over loopback, as a child process.
fn bench(prefix: &[&str], args: &[&str], env: &[(String, String)]) -> Child {
    lossy("bench", prefix, args, env)
}

/// `lossy command` with `args` and `env`, over loopback, as a child process (`prefix`: the
/// command that starts it, e.g. `ip netns exec NS`).
fn lossy(command: &str, prefix: &[&str], args: &[&str], env: &[(String, String)]) -> Child {
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(lossy_exe());
            c
        }
        None => Command::new(lossy_exe()),
    };
    cmd.arg(command).args(args);
    for var in LAUNCHER_VARS {
        cmd.env_remove(var);
    }
    cmd.env_remove("NCCL_LOSSY_STATS")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("start lossy bench")
}

fn vars(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// Waits for every child, at most `limit` in all, and returns their outputs and how long
/// the slowest took.
fn wait_all(children: Vec<Child>, limit: Duration) -> (Vec<Output>, Duration) {
    let start = Instant::now();
    let mut children: Vec<Option<Child>> = children.into_iter().map(Some).collect();
    loop {
        let running = children
            .iter_mut()
            .flatten()
            .map(|c| c.try_wait().ok().flatten().is_none())
            .filter(|&alive| alive)
            .count();
        if running == 0 || start.elapsed() > limit {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = start.elapsed();
    let outputs = children
        .iter_mut()
        .map(|c| {
            let mut c = c.take().expect("child");
            let _ = c.kill();
            c.wait_with_output().expect("output")
        })
        .collect();
    (outputs, took)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks a good run: rank 0 printed the table with a line per rank, the others nothing.
fn assert_table(outputs: &[Output], world: usize) {
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} failed: {}\n{}",
            out.status,
            text(&out.stderr)
        );
    }
    let table = text(&outputs[0].stdout);
    assert!(
        table.contains(&format!("all_reduce, {world} ranks")),
        "{table}"
    );
    for rank in 0..world {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(&format!("# {rank:>4} ")) && l.contains(" lo ")),
            "no line for rank {rank} on lo:\n{table}"
        );
    }
    for (rank, out) in outputs.iter().enumerate().skip(1) {
        assert!(
            out.stdout.is_empty(),
            "rank {rank} printed:\n{}",
            text(&out.stdout)
        );
    }
}

const SMALL: [&str; 4] = ["--sizes", "64K", "--iters", "2"];

/// A port whose next port is free too (torchrun-style ranks meet on MASTER_PORT + 1).
fn free_port_below_a_free_one() -> u16 {
    loop {
        let port = free_port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

#[test]
fn two_ranks_launched_torchrun_style_print_one_table() {
    let port = free_port_below_a_free_one().to_string();
    let children = (0..2)
        .map(|rank| {
            let env = vars(&[
                ("RANK", rank.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.clone()),
            ]);
            bench(&[], &SMALL, &env)
        })
        .collect();
    let (outputs, _) = wait_all(children, Duration::from_secs(120));
    assert_table(&outputs, 2);
}

#[test]
fn four_ranks_launched_mpi_style_print_one_table() {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    // Rank 0 last: the others wait for its rendezvous.
    let mut children: Vec<(usize, Child)> = (0..4)
        .rev()
        .map(|rank| {
            let env = vars(&[
                ("OMPI_COMM_WORLD_RANK", rank.to_string()),
                ("OMPI_COMM_WORLD_SIZE", "4".into()),
                ("NCCL_LOSSY_RENDEZVOUS", rendezvous.clone()),
            ]);
            (rank, bench(&[], &SMALL, &env))
        })
        .collect();
    children.sort_by_key(|(rank, _)| *rank);
    let (outputs, _) = wait_all(
        children.into_iter().map(|(_, c)| c).collect(),
        Duration::from_secs(180),
    );
    assert_table(&outputs, 4);
}

#[test]
fn two_ranks_launched_slurm_style_find_the_first_node() {
    let port = free_port().to_string();
    let children = (0..2)
        .map(|rank| {
            let env = vars(&[
                ("SLURM_PROCID", rank.to_string()),
                ("SLURM_NTASKS", "2".into()),
                ("SLURM_JOB_NODELIST", "127.0.0.1,otherhost".into()),
                ("SLURM_JOB_ID", "4242".into()),
                ("NCCL_LOSSY_RENDEZVOUS_PORT", port.clone()),
            ]);
            bench(&[], &SMALL, &env)
        })
        .collect();
    let (outputs, _) = wait_all(children, Duration::from_secs(120));
    assert_table(&outputs, 2);
}

#[test]
fn two_demo_ranks_print_one_table_with_a_line_per_rank() {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let children = (0..2)
        .map(|rank| {
            let rank = rank.to_string();
            let args = [
                "--rank",
                &rank,
                "--world",
                "2",
                "--rendezvous",
                &rendezvous,
                "--sizes",
                "64K",
            ];
            lossy("demo", &[], &args, &[])
        })
        .collect();
    let (outputs, _) = wait_all(children, Duration::from_secs(120));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}: {}", text(&out.stderr));
    }
    let table = text(&outputs[0].stdout);
    assert!(table.contains("lossy demo: 2 ranks"), "{table}");
    assert_eq!(
        table.lines().filter(|l| l.ends_with("bit-exact")).count(),
        3,
        "{table}"
    );
    for rank in 0..2 {
        let head = format!("# {rank:>4} ");
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(&head) && l.contains(" lo ")),
            "{table}"
        );
    }
    assert!(outputs[1].stdout.is_empty(), "{}", text(&outputs[1].stdout));
}

/// Two explicit ranks at one rendezvous, each with its own extra options.
fn explicit(world: usize, ranks: &[(usize, Vec<&str>)], rendezvous: &str) -> Vec<Child> {
    ranks
        .iter()
        .map(|(rank, extra)| {
            let (rank, world) = (rank.to_string(), world.to_string());
            let mut args = vec![
                "--rank",
                &rank,
                "--world",
                &world,
                "--rendezvous",
                rendezvous,
            ];
            if !extra.contains(&"--sizes") {
                args.extend(SMALL);
            }
            args.extend(extra.iter().copied());
            bench(&[], &args, &[])
        })
        .collect()
}

#[test]
fn a_rank_of_another_job_is_refused_on_both_sides() {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let children = explicit(
        2,
        &[
            (0, vec!["--job-id", "train-a", "--rendezvous-timeout", "20"]),
            (1, vec!["--job-id", "train-b", "--rendezvous-timeout", "20"]),
        ],
        &rendezvous,
    );
    let (outputs, took) = wait_all(children, Duration::from_secs(60));
    assert!(took < Duration::from_secs(15), "took {took:?}");
    for (rank, out) in outputs.iter().enumerate() {
        let err = text(&out.stderr);
        assert!(!out.status.success(), "rank {rank} succeeded");
        assert!(
            err.contains("train-a") && err.contains("train-b") && err.contains("job id"),
            "rank {rank}: {err}"
        );
        // Said once: rank 0 hosts the rendezvous, whose reason its own error already holds.
        assert_eq!(
            err.matches("belongs to job id").count(),
            1,
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn a_rank_that_never_comes_is_named_within_the_timeout() {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let children = explicit(
        3,
        &[
            (0, vec!["--rendezvous-timeout", "2"]),
            (1, vec!["--rendezvous-timeout", "2"]),
        ],
        &rendezvous,
    );
    let (outputs, took) = wait_all(children, Duration::from_secs(60));
    assert!(took < Duration::from_secs(15), "took {took:?}");
    for (rank, out) in outputs.iter().enumerate() {
        let err = text(&out.stderr);
        assert!(!out.status.success(), "rank {rank} succeeded");
        assert!(
            err.contains("rank(s) 2 of 3") && err.contains(&rendezvous),
            "rank {rank}: {err}"
        );
    }
}

/// Connects to `addr`, retrying until something listens there (at most `limit`).
fn connect_within(addr: &str, limit: Duration) -> std::net::TcpStream {
    let start = Instant::now();
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(stream) => return stream,
            Err(e) if start.elapsed() > limit => panic!("nothing listens at {addr}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn strangers_at_the_rendezvous_port_neither_stall_nor_fail_the_job() {
    use std::io::Write;
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let opts = vec!["--rendezvous-timeout", "20"];
    let mut children = explicit(2, &[(0, opts.clone())], &rendezvous);
    // Before rank 1 starts: a port scanner that connects and says nothing, and a client
    // of another protocol (an HTTP health check). Neither is a rank of the job.
    let silent = connect_within(&rendezvous, Duration::from_secs(10));
    let mut http = connect_within(&rendezvous, Duration::from_secs(10));
    let _ = http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    children.extend(explicit(2, &[(1, opts)], &rendezvous));
    let (outputs, took) = wait_all(children, Duration::from_secs(60));
    drop((silent, http));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} failed: {}",
            text(&out.stderr)
        );
    }
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert_table(&outputs, 2);
}

#[test]
fn ranks_given_different_work_fail_naming_what_differs() {
    // Each rank reads its own command line: one given other sizes ran another all-reduce
    // than its peers, which rank 0 reported as data that was not bit-exact (and the other
    // rank as a success).
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let children = explicit(
        2,
        &[
            (0, vec!["--sizes", "64K", "--iters", "2"]),
            (1, vec!["--sizes", "1M", "--iters", "2"]),
        ],
        &rendezvous,
    );
    let (outputs, took) = wait_all(children, Duration::from_secs(60));
    assert!(took < Duration::from_secs(15), "took {took:?}");
    for (rank, out) in outputs.iter().enumerate() {
        let err = text(&out.stderr);
        assert!(!out.status.success(), "rank {rank} succeeded: {err}");
        assert!(
            err.contains("rank 1") && err.contains("--sizes") && !err.contains("bit-exact"),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn a_rank_killed_mid_run_fails_the_others_naming_it() {
    let rendezvous = format!("127.0.0.1:{}", free_port());
    let long = vec![
        "--sizes",
        "16M",
        "--iters",
        "400",
        "--rendezvous-timeout",
        "10",
    ];
    let mut children = explicit(2, &[(0, long.clone()), (1, long)], &rendezvous);
    // Let the ranks meet and start the timed loop, then kill rank 1 as a crash would.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        children[0].try_wait().expect("poll").is_none(),
        "rank 0 ended before the kill"
    );
    let pid = children[1].id().to_string();
    let killed = Command::new("kill").args(["-KILL", &pid]).status();
    assert!(killed.is_ok_and(|s| s.success()), "kill rank 1");
    // A killed rank cannot remove the statistics folder it made for itself
    // (`lossy-rank-<pid>` in the temporary folder, see `cluster::run_member`): this test does.
    common::removed_at_exit(&std::env::temp_dir().join(format!("lossy-rank-{pid}")));
    let (outputs, took) = wait_all(children, Duration::from_secs(60));
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let err = text(&outputs[0].stderr);
    assert!(!outputs[0].status.success(), "rank 0 succeeded");
    assert!(
        err.contains("rank 1") && err.contains("left the job"),
        "rank 0: {err}"
    );
}

/// Two network namespaces joined by a veth pair, deleted (with the pair) when dropped.
struct NetnsPair {
    names: [String; 2],
    ifaces: [String; 2],
    addrs: [&'static str; 2],
}

/// Why the namespace tests cannot run here; only these two reasons skip them.
fn netns_unavailable() -> Option<&'static str> {
    let uid = Command::new("id").arg("-u").output().ok()?;
    if text(&uid.stdout).trim() != "0" {
        return Some("not root");
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("no ip binary");
    }
    None
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        text(&out.stderr)
    );
}

impl NetnsPair {
    fn create(tag: &str) -> NetnsPair {
        let id = format!("{}{tag}", std::process::id());
        // Made before the first `ip` call: a step that fails (panics) still deletes the rest.
        let pair = NetnsPair {
            names: [format!("lossy{id}a"), format!("lossy{id}b")],
            // Interface names have at most 15 bytes.
            ifaces: [format!("lv{id}a"), format!("lv{id}b")],
            addrs: ["10.231.0.1", "10.231.0.2"],
        };
        for ns in &pair.names {
            ip(&["netns", "add", ns]);
        }
        let [a, b] = &pair.ifaces;
        ip(&["link", "add", a, "type", "veth", "peer", "name", b]);
        for i in 0..2 {
            let (ns, iface) = (&pair.names[i], &pair.ifaces[i]);
            ip(&["link", "set", iface, "netns", ns]);
            let cidr = format!("{}/24", pair.addrs[i]);
            ip(&["-n", ns, "addr", "add", &cidr, "dev", iface]);
            ip(&["-n", ns, "link", "set", iface, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        pair
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and with it the pair; a pair that
        // never left this namespace (a step failed) is deleted by name.
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.ifaces[0]])
            .output();
    }
}

/// Runs a 2-rank bench across the veth pair and returns rank 0's table.
fn bench_across_veth(tag: &str, extra: &[&str]) -> Option<String> {
    if let Some(why) = netns_unavailable() {
        println!("skipped: {why} (network namespaces need root and the ip binary)");
        return None;
    }
    let pair = NetnsPair::create(tag);
    let rendezvous = format!("{}:29533", pair.addrs[0]);
    let children: Vec<Child> = (0..2)
        .map(|rank| {
            let (r, ns) = (rank.to_string(), pair.names[rank].as_str());
            let mut args = vec![
                "--rank",
                &r,
                "--world",
                "2",
                "--rendezvous",
                &rendezvous,
                "--rendezvous-timeout",
                "30",
                "--sizes",
                "1M",
                "--iters",
                "5",
            ];
            args.extend(extra);
            let env = vars(&[("NCCL_SOCKET_IFNAME", pair.ifaces[rank].clone())]);
            bench(&["ip", "netns", "exec", ns], &args, &env)
        })
        .collect();
    let (outputs, _) = wait_all(children, Duration::from_secs(180));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} failed: {}\n{}",
            out.status,
            text(&out.stderr)
        );
    }
    assert!(outputs[1].stdout.is_empty(), "{}", text(&outputs[1].stdout));
    let table = text(&outputs[0].stdout);
    println!("{table}");
    for rank in 0..2 {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("# {rank:>4} ")))
            .unwrap_or_else(|| panic!("no line for rank {rank}:\n{table}"));
        assert!(
            line.contains(&pair.ifaces[rank]) && line.contains(pair.addrs[rank]),
            "rank {rank} did not use its veth end:\n{table}"
        );
    }
    Some(table)
}

/// Lost packets summed over rank 0's table.
fn lost_packets(table: &str) -> u64 {
    table
        .lines()
        .filter(|l| l.starts_with("# ") && l.ends_with('%'))
        .filter_map(|l| l.split_whitespace().nth(6)?.parse::<u64>().ok())
        .sum()
}

#[test]
fn across_a_veth_pair_the_profile_loses_packets() {
    if let Some(table) = bench_across_veth("l", &[]) {
        assert!(lost_packets(&table) > 0, "no loss:\n{table}");
    }
}

#[test]
fn across_a_veth_pair_lossless_loses_nothing() {
    if let Some(table) = bench_across_veth("n", &["--lossless"]) {
        assert!(table.contains("loss off"), "{table}");
        assert_eq!(lost_packets(&table), 0, "{table}");
    }
}
