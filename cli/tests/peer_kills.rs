//! A peer process SIGKILLed while several communicators carry traffic both ways, through the
//! loaded library, with `NCCL_LOSSY_TIMEOUT` off (the default): the kernel's reset or end of
//! stream is all the survivor gets, as with NCCL's Socket transport. Every request in flight
//! must end at `test` (done, or an error NCCL's Socket plugin would give: `ncclRemoteError` or
//! `ncclSystemError`), none may stay pending, and the I/O pool must not spin on the dead
//! sockets afterwards. Closing the failed comms succeeds.

mod common;

use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{
    handle_from_stdin, library, message_bytes, post_recv, post_send, say, wait_request, Peer,
    ROLE_ENV,
};
use lossy_cli::harness::plugin_client::{PluginClient, PluginLibrary, RecvComm, Request, SendComm};
use nccl_net_lossy::ErrorKind;

const CHILD: &str = "killed_peer";
/// Communicators each way between the two processes.
const COMMS: usize = 3;
/// Requests each comm keeps in flight.
const IN_FLIGHT: usize = 4;
const SIZE: usize = 4 << 20;
/// A request still pending this long after the kill is a hang.
const HANG: Duration = Duration::from_secs(60);

fn env() -> [(&'static str, &'static str); 3] {
    [
        ("NCCL_SOCKET_IFNAME", "lo"),
        ("NCCL_LOSSY_NSOCKS", "2"),
        ("NCCL_LOSSY_IO_THREADS", "2"),
    ]
}

fn lib() -> Rc<PluginLibrary> {
    for (k, v) in env() {
        std::env::set_var(k, v);
    }
    std::env::remove_var("NCCL_LOSSY_TIMEOUT");
    PluginLibrary::open(&library()).expect("dlopen")
}

/// The comms of one process: it sends on `sends` and receives on `recvs`.
struct Mesh {
    sends: Vec<SendComm>,
    recvs: Vec<RecvComm>,
}

/// Posts until `IN_FLIGHT` requests are in flight on every comm.
fn top_up(mesh: &Mesh, flying: &mut [Vec<Request>], seed: u64) {
    let comms = mesh.sends.len();
    for (i, reqs) in flying.iter_mut().enumerate() {
        while reqs.len() < IN_FLIGHT {
            let r = if i < comms {
                post_send(&mesh.sends[i], message_bytes(SIZE, seed), 0)
            } else {
                post_recv(&mesh.recvs[i - comms], SIZE, 0)
            };
            reqs.push(r.expect("a post never reports the peer's failure"));
        }
    }
}

/// CPU time (user + system, in clock ticks) of this process's I/O pool threads.
fn pool_cpu_ticks() -> u64 {
    let tasks = std::fs::read_dir("/proc/self/task").expect("list this process's threads");
    let mut ticks = 0;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("lossy-io") {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // After the command name's closing parenthesis: fields 3 on; utime and stime are
        // fields 14 and 15.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let fields: Vec<&str> = rest.split_whitespace().collect();
        for f in fields.get(11..13).unwrap_or(&[]) {
            ticks += f.parse::<u64>().unwrap_or(0);
        }
    }
    ticks
}

#[test]
fn a_killed_peer_ends_every_request_of_every_comm_at_test_with_the_timeout_off() {
    let lib = lib();
    let client = PluginClient::init(&lib, 12, 301).expect("init");
    let mut listens = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..COMMS {
        let (h, l) = client.listen(0).expect("listen");
        handles.push(h);
        listens.push(l);
    }
    let mut p = Peer::spawn(CHILD, "mesh", &env());
    let theirs: Vec<_> = (0..COMMS).map(|_| p.read_handle()).collect();
    for h in &handles {
        p.send_handle(h);
    }
    let sends: Vec<SendComm> = theirs
        .iter()
        .map(|h| {
            client
                .connect(0, h)
                .wait(Duration::from_secs(30))
                .expect("connect")
        })
        .collect();
    let recvs: Vec<RecvComm> = listens
        .iter_mut()
        .map(|l| l.accept(Duration::from_secs(30)).expect("accept"))
        .collect();
    p.expect_line("READY");
    let mesh = Mesh { sends, recvs };
    let mut flying: Vec<Vec<Request>> = (0..2 * COMMS).map(|_| Vec::new()).collect();
    let mut completed = [0usize; 2 * COMMS];
    top_up(&mesh, &mut flying, 1);
    // Traffic flows on every comm both ways before the kill.
    let start = Instant::now();
    while completed.iter().any(|&c| c < 2) {
        for (i, reqs) in flying.iter_mut().enumerate() {
            let mut k = 0;
            while k < reqs.len() {
                if reqs[k].test().expect("before the kill").is_some() {
                    reqs.remove(k);
                    completed[i] += 1;
                } else {
                    k += 1;
                }
            }
        }
        top_up(&mesh, &mut flying, 2);
        assert!(start.elapsed() < HANG, "no traffic before the kill");
    }
    let killed = p.kill();
    // Every request ends: done (its bytes were taken before the kill) or failed.
    let mut errors = vec![Vec::new(); 2 * COMMS];
    while flying.iter().any(|r| !r.is_empty()) {
        for (i, reqs) in flying.iter_mut().enumerate() {
            let mut k = 0;
            while k < reqs.len() {
                match reqs[k].test() {
                    Ok(Some(_)) => {
                        reqs.remove(k);
                    }
                    Ok(None) => k += 1,
                    Err(e) => {
                        errors[i].push(e);
                        reqs.remove(k);
                    }
                }
            }
        }
        let pending: usize = flying.iter().map(Vec::len).sum();
        assert!(
            killed.elapsed() < HANG,
            "{pending} request(s) still pending {HANG:?} after the peer was killed"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    // Requests whose bytes the kernels took before the kill may complete; every other one,
    // and every later post, fails with the peer's error. A post after the failure still gets
    // a request (a post never reports the peer's failure), whose test fails.
    for (i, errs) in errors.iter_mut().enumerate() {
        let mut tries = 0;
        while errs.is_empty() {
            tries += 1;
            // The peer's last messages may all be in this side's kernel already.
            assert!(
                tries <= IN_FLIGHT + 2,
                "comm {i}: {tries} posts after the kill, none failed"
            );
            let mut r = if i < COMMS {
                post_send(&mesh.sends[i], vec![1; 100], 0).expect("isend after the kill")
            } else {
                post_recv(&mesh.recvs[i - COMMS], SIZE, 0).expect("irecv after the kill")
            };
            if let Err(e) = wait_request(&mut r, HANG) {
                errs.push(e);
            }
        }
    }
    for (i, errs) in errors.iter().enumerate() {
        for e in errs {
            assert!(
                matches!(e.kind, ErrorKind::Remote | ErrorKind::System),
                "comm {i}: {e}"
            );
        }
    }
    // The dead sockets keep no pool thread busy (a spin would take about 100 ticks a second).
    let before = pool_cpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let spent = pool_cpu_ticks() - before;
    assert!(
        spent < 20,
        "the I/O pool spent {spent} ticks in 1 s on dead comms"
    );
    for s in mesh.sends {
        s.close().expect("closeSend of a failed comm");
    }
    for r in mesh.recvs {
        r.close().expect("closeRecv of a failed comm");
    }
    for l in listens {
        l.close().expect("closeListen");
    }
    client.finalize().expect("finalize");
}

/// The peer process: its role comes from [`ROLE_ENV`].
#[test]
#[ignore = "the peer process of the kill tests, started by them"]
fn killed_peer() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    assert_eq!(role, "mesh", "unknown role");
    let lib = PluginLibrary::open(&library()).expect("dlopen");
    let client = PluginClient::init(&lib, 12, 900).expect("init");
    let mut listens = Vec::new();
    for _ in 0..COMMS {
        let (h, l) = client.listen(0).expect("listen");
        say(&format!("HANDLE {}", common::hex(&h)));
        listens.push(l);
    }
    let theirs: Vec<_> = (0..COMMS).map(|_| handle_from_stdin()).collect();
    let wait = Duration::from_secs(30);
    let sends: Vec<SendComm> = theirs
        .iter()
        .map(|h| client.connect(0, h).wait(wait).expect("connect"))
        .collect();
    let recvs: Vec<RecvComm> = listens
        .iter_mut()
        .map(|l| l.accept(wait).expect("accept"))
        .collect();
    say("READY");
    let mesh = Mesh { sends, recvs };
    let mut flying: Vec<Vec<Request>> = (0..2 * COMMS).map(|_| Vec::new()).collect();
    loop {
        top_up(&mesh, &mut flying, 3);
        for reqs in &mut flying {
            reqs.retain_mut(|r| r.test().expect("the survivor never fails first").is_none());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}
