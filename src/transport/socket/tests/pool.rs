//! The I/O pool threads (`NCCL_LOSSY_IO_THREADS`): what they cost while connections sit idle,
//! fail, or are polled by their owner, and what they move that nobody tests. Each test runs in
//! a process of its own: the pool's threads are the process's, and other tests' traffic would
//! run beside them.

use std::time::{Duration, Instant};

use super::{
    connect_pair, loopback, one_socket_pair, pattern, run_child, send_recv, wait, wait_for_bytes,
    PATIENCE,
};
use crate::loss::plan::LossPlan;
use crate::transport::{HostBuf, SendConn};

/// Runs this module's ignored test `child` in a process of its own with one pool thread
/// (the pool's threads are the process's: other tests' traffic would run beside them), with
/// `flag` set; it must print `passed`.
fn with_one_pool_thread(child: &str, flag: &str, passed: &str) {
    run_child(
        &format!("transport::socket::tests::pool::{child}"),
        flag,
        &[("NCCL_LOSSY_IO_THREADS", "1")],
        passed,
    );
}

const IDLE_CHILD_ENV: &str = "LOSSY_SOCKET_IDLE_CHILD";

/// The file `name` of /proc/self/task/<tid>/ of each of this process's I/O pool threads.
fn pool_thread_files(name: &str) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("lossy-io"))
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join(name)).ok())
        .collect()
}

/// CPU time (user + system, clock ticks) of this process's I/O pool threads.
fn pool_cpu_ticks() -> u64 {
    pool_thread_files("stat")
        .iter()
        .map(|stat| {
            // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
            let rest = stat.rsplit(')').next().unwrap_or("");
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            num(11) + num(12)
        })
        .sum()
}

#[test]
fn idle_connections_cost_their_pool_thread_no_cpu() {
    // The pool's CPU time needs a process of its own: other tests' traffic runs beside us.
    with_one_pool_thread("idle_child", IDLE_CHILD_ENV, "idle check passed");
}

#[test]
#[ignore = "run in a process of its own by idle_connections_cost_their_pool_thread_no_cpu"]
fn idle_child() {
    if std::env::var_os(IDLE_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(4);
    let pairs: Vec<_> = (0..8).map(|_| connect_pair(&t)).collect();
    // Every connection moves a message, then all of them sit idle, as between training steps.
    for (i, (send, recv)) in pairs.iter().enumerate() {
        let mut d = pattern(1 << 20, i as u64);
        let mut into = vec![0u8; 1 << 20];
        let (a, b) = send_recv(&**send, &**recv, &mut d, &mut into, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok() && into == d, "pair {i}");
    }
    // Past the owner-active window, so the pool thread is the one watching the sockets.
    std::thread::sleep(Duration::from_millis(50));
    let before = pool_cpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let used = pool_cpu_ticks() - before;
    // A thread that re-arms an always-writable idle socket spins: about 100 ticks (one core,
    // 100 Hz) in this second. Waiting in epoll costs none; 10 ticks leaves room for the wake-ups
    // of a loaded machine and still catches a spin ten times over.
    assert!(
        used <= 10,
        "the I/O pool thread used {used} ticks of CPU in 1 s of idle connections"
    );
    drop(pairs);
    println!("idle check passed: {used} ticks");
}

/// Times this process's I/O pool threads went to sleep (voluntary context switches): one per
/// wake-up, whatever woke them.
fn pool_wakeups() -> u64 {
    pool_thread_files("status")
        .iter()
        .filter_map(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

const BUSY_CHILD_ENV: &str = "LOSSY_SOCKET_BUSY_CHILD";

#[test]
fn a_polling_owner_keeps_its_pool_thread_asleep() {
    // As above: the pool's wake-ups need a process of its own.
    with_one_pool_thread("busy_child", BUSY_CHILD_ENV, "busy check passed");
}

#[test]
#[ignore = "run in a process of its own by a_polling_owner_keeps_its_pool_thread_asleep"]
fn busy_child() {
    if std::env::var_os(BUSY_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(1);
    let (send, recv) = connect_pair(&t);
    let (mut data, mut into) = (pattern(8, 9), vec![0u8; 8]);
    let mut message = || {
        let (a, b) = send_recv(&*send, &*recv, &mut data, &mut into, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    };
    for _ in 0..20 {
        message();
    }
    // The owner tests both requests until they end, as NCCL's proxy does, so the pool thread
    // has nothing to do. A receiving socket re-armed at every pass woke it for every message
    // that arrived (about MESSAGES wake-ups), to hear that the owner was polling. Left to the
    // owner, the thread looks again once per DEFER (5 ms) of the run, and once more for a
    // deadline on either side of it: the bound below is what that allows, however slow the
    // machine, and a tenth of the messages when the run is fast. The property holds only
    // while the owner polls: a run in which the host took the owner's CPU away for half of
    // OWNER_ACTIVE between two messages (a loaded machine, tests in parallel) let the thread
    // take over, as it must, and proves nothing either way; such runs are measured again.
    let mut clean = None;
    for _ in 0..ATTEMPTS {
        let before = pool_wakeups();
        let started = Instant::now();
        let (mut last, mut longest) = (started, Duration::ZERO);
        for _ in 0..MESSAGES {
            message();
            let now = Instant::now();
            longest = longest.max(now - last);
            last = now;
        }
        let (woke, took) = (pool_wakeups() - before, started.elapsed());
        if longest < Duration::from_micros(2_500) {
            clean = Some((woke, took));
            break;
        }
        println!("owner paused {longest:?} between two messages: measured again");
    }
    let Some((woke, took)) = clean else {
        panic!("the owner was paused for 2.5 ms or more in each of {ATTEMPTS} runs");
    };
    let allowed = (took.as_millis() as u64 / 5 + 4).clamp(8, MESSAGES / 10);
    assert!(
        woke <= allowed,
        "the pool thread woke {woke} times for {MESSAGES} messages in {took:?} (allowed {allowed})"
    );
    drop((send, recv));
    println!("busy check passed: {woke} wake-ups in {took:?}");
}

/// Messages the busy check sends per run, and its most runs.
const MESSAGES: u64 = 500;
const ATTEMPTS: usize = 10;

/// Posts a receive into `into` and a lossless send of `data` (tag 7): (send, receive) ids.
///
/// # Safety
/// `data` and `into` must outlive both connections (or the requests' completion).
unsafe fn post_one(
    send: &dyn SendConn,
    recv: &dyn crate::transport::RecvConn,
    data: &mut [u8],
    into: &mut [u8],
) -> (crate::transport::RequestId, crate::transport::RequestId) {
    let r = wait("irecv slot", || {
        // SAFETY: the caller lends `into` for as long as the receive may run.
        recv.irecv(&[unsafe { HostBuf::from_slice(into) }], &[7])
    })
    .expect("irecv");
    let s = wait("isend slot", || {
        // SAFETY: the caller lends `data` for as long as the send may run.
        send.isend(
            unsafe { HostBuf::from_slice(data) },
            7,
            &LossPlan::lossless(),
        )
    })
    .expect("isend");
    (s, r)
}

const FAILED_CHILD_ENV: &str = "LOSSY_SOCKET_FAILED_CHILD";

#[test]
fn a_failed_connection_costs_its_pool_thread_no_cpu() {
    // As above: the pool's CPU time needs a process of its own.
    with_one_pool_thread("failed_child", FAILED_CHILD_ENV, "failed check passed");
}

#[test]
#[ignore = "run in a process of its own by a_failed_connection_costs_its_pool_thread_no_cpu"]
fn failed_child() {
    if std::env::var_os(FAILED_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(1);
    let (send, recv) = connect_pair(&t);
    let size = 64 << 20;
    let mut data = pattern(size, 3);
    let mut into = vec![0u8; size];
    // The sender goes away in the middle of the message: the receiver reads part of the chunk,
    // then EOF, and its connection fails (as when a peer process is killed).
    // SAFETY: `data` and `into` outlive both connections, dropped explicitly below.
    let (s, r) = unsafe { post_one(&*send, &*recv, &mut data, &mut into) };
    let _ = send.test(s);
    drop(send);
    let failed = wait("the receive's failure", || match recv.test(r) {
        Ok(None) => Ok(None),
        Ok(Some(_)) => Ok(Some(false)),
        Err(_) => Ok(Some(true)),
    })
    .expect("test");
    assert!(failed, "a receive cut off by the peer's exit completed");
    // The failed connection stays open, as NCCL keeps a comm until it tears down: its shut
    // down socket is always readable, and a pool thread that armed it again spun on it.
    std::thread::sleep(Duration::from_millis(50));
    let before = pool_cpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let used = pool_cpu_ticks() - before;
    // A spin is about 100 ticks (one core, 100 Hz) in this second; see the idle test above.
    assert!(
        used <= 10,
        "the I/O pool thread used {used} ticks of CPU in 1 s beside a failed connection"
    );
    drop(recv);
    println!("failed check passed: {used} ticks");
}

const UNTESTED_CHILD_ENV: &str = "LOSSY_SOCKET_UNTESTED_CHILD";

#[test]
fn with_a_pool_thread_a_posted_receive_moves_before_anyone_tests_it() {
    with_one_pool_thread(
        "untested_child",
        UNTESTED_CHILD_ENV,
        "untested check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by with_a_pool_thread_a_posted_receive_moves_before_anyone_tests_it"]
fn untested_child() {
    if std::env::var_os(UNTESTED_CHILD_ENV).is_none() {
        return;
    }
    let t = loopback(2);
    let (send, recv) = connect_pair(&t);
    // More than the sockets' buffers hold: the send completes only if the receiving side
    // drains them, and only the pool thread can (nobody tests the receive until the send is
    // done). That is what the pool is for: connections nobody is polling keep moving.
    let size = 16 << 20;
    let mut data = pattern(size, 5);
    let mut into = vec![0u8; size];
    // SAFETY: `data` and `into` outlive both connections, dropped explicitly below.
    let (s, r) = unsafe { post_one(&*send, &*recv, &mut data, &mut into) };
    wait("the send, its receive untested", || {
        send.test(s).map(|c| c.map(|_| ()))
    })
    .expect("the send completes");
    wait("the receive", || recv.test(r).map(|c| c.map(|_| ()))).expect("receive");
    assert!(into == data, "the message arrived changed");
    drop((send, recv));
    println!("untested check passed");
}

const SEND_START_CHILD_ENV: &str = "LOSSY_SOCKET_SEND_START_CHILD";

#[test]
fn without_a_pool_thread_a_send_on_an_idle_connection_leaves_at_its_test_and_one_behind_it_at_once()
{
    run_child(
        "transport::socket::tests::pool::send_start_child",
        SEND_START_CHILD_ENV,
        &[("NCCL_LOSSY_IO_THREADS", "0")],
        "send start check passed (inline)",
    );
}

#[test]
fn with_a_pool_thread_a_send_nobody_tests_leaves_at_once() {
    with_one_pool_thread(
        "send_start_child",
        SEND_START_CHILD_ENV,
        "send start check passed (pool)",
    );
}

#[test]
#[ignore = "run in a process of its own by the two send start tests above"]
fn send_start_child() {
    if std::env::var_os(SEND_START_CHILD_ENV).is_none() {
        return;
    }
    use super::wire::HEADER_SIZE;
    use crate::transport::RecvConn;
    let pooled = std::env::var("NCCL_LOSSY_IO_THREADS").as_deref() == Ok("1");
    let (send, recv) = one_socket_pair(true);
    // Three 8-byte messages; each travels as its header with the bytes behind it.
    let wire = HEADER_SIZE + 8;
    let mut data: Vec<Vec<u8>> = (1..=3).map(|i| pattern(8, i)).collect();
    let mut into = vec![vec![0u8; 8]; 3];
    let arrives = |want: usize| {
        wait_for_bytes(&recv, want);
        assert_eq!(
            recv.bytes_waiting(),
            want,
            "more than the messages posted arrived"
        );
    };
    let quiet = |want: usize| {
        // Long enough for loopback to deliver what was sent (it does so within the send).
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(recv.bytes_waiting(), want, "bytes left before their test");
    };
    let mut post = |i: usize| {
        // SAFETY: `data` outlives both connections, dropped at the end of this function.
        let buf = unsafe { HostBuf::from_slice(&mut data[i]) };
        send.isend(buf, 7, &LossPlan::lossless())
            .expect("isend")
            .expect("slot")
    };
    let first = post(0);
    if pooled {
        // Nobody tests the send: the pool thread sends it.
        arrives(wire);
    } else {
        // As NCCL's Socket transport: the bytes leave at the `test` that follows `isend`.
        quiet(0);
        assert!(
            send.test(first).expect("test").is_some(),
            "8 bytes did not go at once"
        );
        arrives(wire);
    }
    // The connection is idle again: a send waits for its test, unless a pool thread serves it.
    let second = post(1);
    if pooled {
        arrives(2 * wire);
    } else {
        quiet(wire);
    }
    // A send posted behind one still under way goes at once, and takes that one along.
    let third = post(2);
    arrives(3 * wire);
    for (i, s) in [(0, first), (1, second), (2, third)] {
        let r = wait("irecv slot", || {
            // SAFETY: `into` outlives the receive, waited for right here.
            let buf = unsafe { HostBuf::from_slice(&mut into[i]) };
            recv.irecv(&[buf], &[7])
        })
        .expect("irecv");
        wait("receive", || recv.test(r)).expect("receive");
        if i > 0 || pooled {
            wait("send", || send.test(s)).expect("send");
        }
    }
    assert_eq!(into, data[..]);
    drop((send, recv));
    println!(
        "send start check passed ({})",
        if pooled { "pool" } else { "inline" }
    );
}

const POLLED_SEND_CHILD_ENV: &str = "LOSSY_SOCKET_POLLED_SEND_CHILD";

#[test]
fn with_a_pool_thread_a_send_its_owner_polls_leaves_at_its_test_and_one_left_untested_still_goes() {
    with_one_pool_thread(
        "polled_send_child",
        POLLED_SEND_CHILD_ENV,
        "polled send check passed",
    );
}

#[test]
#[ignore = "run in a process of its own by with_a_pool_thread_a_send_its_owner_polls_leaves_at_its_test_and_one_left_untested_still_goes"]
fn polled_send_child() {
    if std::env::var_os(POLLED_SEND_CHILD_ENV).is_none() {
        return;
    }
    use crate::transport::RecvConn;
    // The buffers first, so they outlive the connections even when an assertion unwinds.
    let (mut data, mut into) = (pattern(8, 4), vec![0u8; 8]);
    let (send, recv) = one_socket_pair(true);
    // The owner polls, as NCCL's proxy does: every request is tested until it ends, so the
    // pool thread hears of both sockets and leaves them to the owner.
    for _ in 0..20 {
        let (a, b) = send_recv(&*send, &recv, &mut data, &mut into, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    }
    let post = |data: &mut [u8]| {
        // SAFETY: `data` outlives the send, tested to its end before it is touched again.
        let buf = unsafe { HostBuf::from_slice(data) };
        send.isend(buf, 7, &LossPlan::lossless())
            .expect("isend")
            .expect("slot")
    };
    let receive = |into: &mut [u8]| {
        let r = wait("irecv slot", || {
            // SAFETY: `into` outlives the receive, waited for right here.
            recv.irecv(&[unsafe { HostBuf::from_slice(into) }], &[7])
        })
        .expect("irecv");
        wait("receive", || recv.test(r)).expect("receive");
    };
    // A message posted on the idle connection right after the owner's last test: its bytes
    // leave at the `test` that follows, as with no pool thread (NCCL's Socket transport sends
    // only from `test`), not inside `isend` nor from the pool thread meanwhile. Loopback
    // delivers within the send, so bytes that left are in the receiving kernel's count at
    // once; half a millisecond gives a pool thread that sent on being told of the message
    // the time to have done so. Nothing is posted on the receiving side meanwhile, so its
    // pool thread reads nothing either. The pool thread may take a socket over only once
    // the owner has not polled for 5 ms (OWNER_ACTIVE, in coarse clock ticks): a trial whose
    // look came 1 ms or more after the send connection's last test, the process preempted,
    // says nothing and is not counted.
    let trials = |data: &mut [u8], into: &mut [u8]| {
        let (mut counted, mut early) = (0, 0);
        let mut last_test = Instant::now();
        for _ in 0..40 {
            let before = recv.segments_received();
            let id = post(data);
            let posted = Instant::now();
            while posted.elapsed() < Duration::from_micros(500) {
                std::hint::spin_loop();
            }
            let arrived = recv.segments_received() - before;
            if last_test.elapsed() < Duration::from_millis(1) {
                counted += 1;
                early += usize::from(arrived > 0);
            }
            wait("send", || send.test(id)).expect("send");
            last_test = Instant::now();
            receive(into);
        }
        assert!(counted >= 10, "only {counted} of 40 trials ran undisturbed");
        (counted, early)
    };
    let (counted, early) = trials(&mut data, &mut into);
    assert_eq!(
        early, 0,
        "{early} of {counted} sends on an idle connection left before their test while the \
         owner polled"
    );
    // Now the owner stops polling: a message nobody tests is the pool thread's to send once
    // it sees the owner gone (it looks every 5 ms).
    let before = recv.segments_received();
    let id = post(&mut data);
    let deadline = Instant::now() + PATIENCE;
    while recv.segments_received() == before {
        assert!(Instant::now() < deadline, "a send nobody tests never left");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The owner's `test` finds that message done at once: the owner polls again, and the
    // pool thread leaves the next ones to it. (It went on sending them: only a `test` that
    // ran progress told the pool thread the owner was there, and one that found its message
    // done did not, so the owner looked gone for good.)
    wait("send", || send.test(id)).expect("send");
    receive(&mut into);
    assert_eq!(into, data);
    let (again, early) = trials(&mut data, &mut into);
    assert_eq!(
        early, 0,
        "{early} of {again} sends left before their test once the owner polled again after \
         the pool thread had sent for it"
    );
    drop((send, recv));
    println!("polled send check passed: {counted} and {again} trials");
}

const LEFT_CHILD_ENV: &str = "LOSSY_SOCKET_LEFT_CHILD";

#[test]
fn a_socket_left_to_its_polling_owner_leaves_the_pool_threads_watch_until_the_owner_stops() {
    with_one_pool_thread("left_child", LEFT_CHILD_ENV, "left check passed");
}

#[test]
#[ignore = "run in a process of its own by a_socket_left_to_its_polling_owner_leaves_the_pool_threads_watch_until_the_owner_stops"]
fn left_child() {
    if std::env::var_os(LEFT_CHILD_ENV).is_none() {
        return;
    }
    use crate::transport::socket::conn::epoll_watched;
    // The buffers first, so they outlive the connections even when an assertion unwinds.
    let (mut data, mut into) = (pattern(8, 6), vec![0u8; 8]);
    let (send, recv) = one_socket_pair(true);
    let fds = recv.socket_fds();
    let watched = || fds.iter().any(|fd| epoll_watched().contains(fd));
    let mut message = || {
        let (a, b) = send_recv(&*send, &recv, &mut data, &mut into, &LossPlan::lossless());
        assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    };
    // Registered, the socket is on the wait list of its pool thread's epoll instance even
    // while disarmed: every segment that arrives runs the kernel's epoll callback, only to
    // find it disarmed. Left to the owner, who polls it, it comes off that list.
    let deadline = Instant::now() + PATIENCE;
    loop {
        message();
        if !watched() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the receiving socket stayed in the pool thread's epoll set while its owner polled"
        );
    }
    // The owner stops, a receive waits for bytes: the pool thread, looking again, watches
    // the socket once more and moves the message when it comes.
    // SAFETY: `into` outlives the receive, waited for below.
    let r = unsafe {
        crate::transport::RecvConn::irecv(&recv, &[HostBuf::from_slice(&mut into)], &[7])
    }
    .expect("irecv")
    .expect("slot");
    let deadline = Instant::now() + PATIENCE;
    while !watched() {
        assert!(
            Instant::now() < deadline,
            "the pool thread never watched the socket again"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = wait("isend slot", || {
        // SAFETY: `data` outlives the send, waited for below.
        send.isend(
            unsafe { HostBuf::from_slice(&mut data) },
            7,
            &LossPlan::lossless(),
        )
    })
    .expect("isend");
    wait("send", || send.test(s)).expect("send");
    // Sent, the message is in the receiving kernel (loopback delivers within the send), and
    // nobody tests the receive yet: only the pool thread can read it.
    let deadline = Instant::now() + PATIENCE;
    while recv.bytes_waiting() > 0 {
        assert!(
            Instant::now() < deadline,
            "the pool thread never read the message"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    wait("receive", || crate::transport::RecvConn::test(&recv, r)).expect("receive");
    assert_eq!(into, data);
    drop((send, recv));
    println!("left check passed");
}
