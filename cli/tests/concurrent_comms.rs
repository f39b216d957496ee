//! Several communicators of one process at once, as NCCL drives them on a multi-GPU node (one
//! communicator per GPU, made from threads of their own): each has a service thread that
//! calls `init`, `listen`, `connect`, `accept` and, once its connections are closed,
//! `finalize`, and a progress thread that posts and tests messages on the connections the
//! service thread made (NCCL's proxy: src/proxy.cc, src/transport/net.cc). The communicators'
//! lives overlap and are staggered, so one finalizes while others carry traffic; a training
//! thread sets the step, the phase and injection through the control API and asks for the
//! statistics (file and JSON) all along, while the periodic writer writes them too.
//!
//! Every byte is checked (each message's content names its communicator, context, connection
//! and number, so a byte delivered to the wrong comm or request shows), every size reported,
//! and at the end the statistics must count every message exactly once. The pool threads and
//! several sockets per connection are on, as on a big node. A hang aborts the child with a
//! message instead of stalling the suite.
//!
//! The run is process-wide (the runtime, the statistics registry, the switches), so it runs in
//! a fresh process: this binary again, with the ignored test `concurrent_child`.

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    library, message_bytes, raw_connected, raw_context, say, LoadedControl, Peer, ROLE_ENV,
};
use nccl_net_lossy::ffi::{ncclNetAttr_v11_t, ncclNet_v12_t, ncclResult_t, NCCL_PTR_HOST};

const CHILD: &str = "concurrent_child";
const OK: ncclResult_t = ncclResult_t::ncclSuccess;

/// Communicators, each with a service and a progress thread.
const COMMS: usize = 4;
/// Contexts each communicator thread makes, one after the other (init .. finalize).
const ROUNDS: usize = 3;
/// Connections per context.
const PAIRS: usize = 3;
/// Messages per connection.
const MESSAGES: usize = 20;
/// Messages a progress thread keeps in flight on one connection.
const IN_FLIGHT: usize = 4;
/// Message sizes, in turn: empty, tiny, odd, one chunk, several chunks.
const SIZES: [usize; 5] = [0, 1, 4093, 65_537, 300_001];
/// A run longer than this is a hang.
const HANG: Duration = Duration::from_secs(120);

#[test]
fn communicators_on_threads_of_their_own_deliver_every_byte_and_count_every_message() {
    run("concurrent-comms", false);
}

#[test]
fn so_they_do_in_wrap_mode_over_another_plugin() {
    // The inner plugin's comms and contexts are shared by the communicators' threads too.
    run("concurrent-comms-wrap", true);
}

/// Runs the child in a fresh process, wrapping a copy of the library when `wrap` is set.
fn run(name: &str, wrap: bool) {
    let dir = common::fresh_dir(name);
    let profile = dir.join("profile.toml");
    // 1% of packets lost and repaired (bytes stay checkable), statistics written every 100 ms.
    std::fs::write(
        &profile,
        "stats_interval = 0.1\nmtu = 4096\neffect = \"retransmit\"\n\
         retransmit_timeout_us = 50\nmodel = { kind = \"uniform\", rate = 0.01 }\n",
    )
    .expect("write the profile");
    let stats = dir.join("stats");
    let trace = dir.join("trace");
    let inner = dir.join("libnccl-net-innercopy.so");
    let mut env = vec![
        ("NCCL_SOCKET_IFNAME", "lo".to_string()),
        ("NCCL_LOSSY_PROFILE", profile.display().to_string()),
        ("NCCL_LOSSY_STATS", stats.display().to_string()),
        ("NCCL_LOSSY_TRACE", trace.display().to_string()),
        // As on a big node: pool threads, and several sockets per connection.
        ("NCCL_LOSSY_IO_THREADS", "2".to_string()),
        ("NCCL_LOSSY_NSOCKS", "3".to_string()),
    ];
    if wrap {
        std::fs::copy(library(), &inner).expect("copy the plugin library");
        env.push(("NCCL_LOSSY_INNER", inner.display().to_string()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut peer = Peer::spawn(CHILD, "threads", &env);
    let said = peer.expect_line("OK");
    let status = peer.wait();
    assert!(status.success(), "the child failed: {status}");
    println!("{said}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The process the tests above start: acts on [`ROLE_ENV`].
#[test]
#[ignore = "run by the tests above in a process of its own"]
fn concurrent_child() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    match role.as_str() {
        "threads" => threads(),
        other => panic!("unknown role {other}"),
    }
}

// ---- the control API, as a training script calls it ------------------------------------------

/// Messages, bytes and packets over every connection of a statistics document, and the
/// packets of its per-step series.
fn totals(doc: &serde_json::Value) -> (u64, u64, u64, u64) {
    let (mut messages, mut bytes, mut packets) = (0, 0, 0);
    for conn in doc["connections"].as_array().expect("connections") {
        let total = &conn["total"];
        messages += total["messages"].as_u64().expect("messages");
        bytes += total["bytes"].as_u64().expect("bytes");
        packets += total["packets"].as_u64().expect("packets");
    }
    let by_step = doc["by_step"].as_array().expect("by_step");
    let step_packets = by_step
        .iter()
        .map(|s| s["packets"].as_u64().expect("packets"));
    (messages, bytes, packets, step_packets.sum())
}

// ---- the communicators ------------------------------------------------------------------------

/// A plugin pointer handed from one thread to another, as NCCL's threads share them.
#[derive(Clone, Copy)]
struct Ptr(usize);

impl Ptr {
    fn of(p: *mut c_void) -> Ptr {
        Ptr(p as usize)
    }
    fn get(self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

/// What the service thread hands its progress thread: a context and a connection in it.
struct Conn {
    ctx: Ptr,
    send: Ptr,
    recv: Ptr,
    /// Distinguishes this connection's messages from every other's.
    id: u64,
}

/// What one progress thread moved.
#[derive(Default)]
struct Moved {
    messages: AtomicU64,
    bytes: AtomicU64,
}

fn threads() {
    // A hang is a failure with a message, not a stuck suite.
    std::thread::spawn(|| {
        std::thread::sleep(HANG);
        eprintln!("concurrent_child: still running after {HANG:?}: a hang; aborting");
        std::process::abort();
    });
    // Loads the library, as NCCL does before its first communicator.
    common::table_v12();
    let control = Arc::new(LoadedControl::of_loaded_library());
    // Steps start at 1, so every message lands in the per-step series.
    assert_eq!((control.set_step)(1), 0);

    let stop = Arc::new(AtomicBool::new(false));
    let trainer = {
        let (control, stop) = (Arc::clone(&control), Arc::clone(&stop));
        std::thread::spawn(move || train(&control, &stop))
    };
    let moved = Arc::new(Moved::default());
    let started = Instant::now();
    let comms: Vec<_> = (0..COMMS)
        .map(|c| {
            let moved = Arc::clone(&moved);
            std::thread::Builder::new()
                .name(format!("service{c}"))
                .spawn(move || service(c, &moved))
                .expect("spawn a service thread")
        })
        .collect();
    for comm in comms {
        comm.join().expect("a communicator failed");
    }
    stop.store(true, Ordering::Relaxed);
    let writes = trainer.join().expect("the training thread failed");

    let sent = moved.messages.load(Ordering::Relaxed);
    let sent_bytes = moved.bytes.load(Ordering::Relaxed);
    assert_eq!(sent, (COMMS * ROUNDS * PAIRS * MESSAGES) as u64);
    let (messages, bytes, packets, step_packets) = totals(&control.stats());
    assert_eq!(
        (messages, bytes),
        (sent, sent_bytes),
        "the statistics count each message exactly once"
    );
    assert_eq!(
        step_packets, packets,
        "the per-step series has every packet"
    );
    // The last finalize wrote the file: the same numbers.
    let files: Vec<_> = std::fs::read_dir(std::env::var("NCCL_LOSSY_STATS").expect("stats dir"))
        .expect("statistics directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    assert_eq!(files.len(), 1, "one statistics file: {files:?}");
    let text = std::fs::read_to_string(&files[0]).expect("read the statistics file");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("statistics file JSON");
    assert_eq!(totals(&doc), (messages, bytes, packets, step_packets));
    say(&format!(
        "OK {sent} messages ({sent_bytes} bytes, {packets} packets) on {} connections of {} \
         contexts in {:.1} s, {writes} statistics writes asked for meanwhile",
        COMMS * ROUNDS * PAIRS,
        COMMS * ROUNDS,
        started.elapsed().as_secs_f64()
    ));
}

/// The training thread: steps, phases and injection change all along, and the statistics are
/// written and read while the communicators run. Returns the writes it asked for.
fn train(control: &LoadedControl, stop: &AtomicBool) -> u64 {
    let mut step = 1u64;
    let mut seen = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        step += 1;
        assert_eq!((control.set_step)(step), 0);
        assert_eq!((control.set_phase)((step % 3) as c_int), 0);
        assert_eq!((control.set_enabled)(c_int::from(step % 4 != 0)), 0);
        assert_eq!((control.write_stats)(), 0, "ncclLossyWriteStats");
        // Read while messages are recorded and connections close: the counts only grow
        // (a closing connection's numbers are frozen, never dropped or counted twice).
        let (messages, _, packets, _) = totals(&control.stats());
        assert!(
            messages >= seen.0 && packets >= seen.1,
            "the statistics went back from {seen:?} to {:?}",
            (messages, packets)
        );
        seen = (messages, packets);
        std::thread::sleep(Duration::from_millis(2));
    }
    // Injection back on for whatever runs next in this process.
    assert_eq!((control.set_enabled)(1), 0);
    step - 1
}

/// One communicator's service thread: `ROUNDS` contexts one after the other, each with
/// `PAIRS` connections handed to the progress thread as they are made, finalized once the
/// progress thread has closed them all.
fn service(c: usize, moved: &Arc<Moved>) {
    let t = common::table_v12();
    let (to_progress, conns) = mpsc::channel::<Conn>();
    let (closed_tx, closed) = mpsc::channel::<()>();
    let progress = {
        let moved = Arc::clone(moved);
        std::thread::Builder::new()
            .name(format!("progress{c}"))
            .spawn(move || {
                let t = common::table_v12();
                for conn in conns {
                    carry(t, &conn, &moved);
                    closed_tx.send(()).expect("the service thread is gone");
                }
            })
            .expect("spawn a progress thread")
    };
    for round in 0..ROUNDS {
        // Staggered: communicators start and end at different times.
        std::thread::sleep(Duration::from_millis((c * 7 + round * 3) as u64));
        let comm_id = 0x1000 * (c as u64 + 1) + round as u64;
        let ctx = raw_context(t, comm_id, None);
        for pair in 0..PAIRS {
            // Made while the progress thread carries the previous connection's traffic.
            let (sc, rc, lc) = raw_connected(t, ctx);
            // SAFETY: the listenComm listen returned, no longer needed.
            assert_eq!(unsafe { t.closeListen.expect("closeListen")(lc) }, OK);
            let id = ((c as u64) << 32) | ((round as u64) << 16) | pair as u64;
            let conn = Conn {
                ctx: Ptr::of(ctx),
                send: Ptr::of(sc),
                recv: Ptr::of(rc),
                id,
            };
            to_progress.send(conn).expect("the progress thread is gone");
        }
        for _ in 0..PAIRS {
            closed.recv().expect("the progress thread failed");
        }
        // SAFETY: the context init returned; its comms are closed.
        assert_eq!(unsafe { t.finalize.expect("finalize")(ctx) }, OK);
    }
    drop(to_progress);
    progress.join().expect("a progress thread failed");
}

/// A message in flight: its receive, its send, and what it must deliver.
struct InFlight {
    send: Ptr,
    recv: Ptr,
    sent: Vec<u8>,
    into: Vec<u8>,
    mrs: (Ptr, Ptr),
    send_done: bool,
    recv_done: bool,
    got: c_int,
}

/// The progress thread's work on one connection: `MESSAGES` messages, `IN_FLIGHT` at a time,
/// each checked, then both halves closed.
fn carry(t: &ncclNet_v12_t, conn: &Conn, moved: &Moved) {
    let (sc, rc) = (conn.send.get(), conn.recv.get());
    // SAFETY: a plain C struct of integers, for which all zeroes is a valid value.
    let mut attr: ncclNetAttr_v11_t = unsafe { std::mem::zeroed() };
    // AllReduce or AllGather, as the proxy says before it posts; ring, Simple.
    attr.op = if conn.id % 2 == 0 { 1 << 4 } else { 1 << 2 };
    attr.algo = 1 << 1;
    attr.proto = 1 << 2;
    // SAFETY: the connection's context, alive until the service thread finalizes it after
    // this connection is closed; a valid attribute struct.
    assert_eq!(
        unsafe { t.setNetAttr.expect("setNetAttr")(conn.ctx.get(), &mut attr) },
        OK
    );
    let mut next = 0usize;
    let mut flying: Vec<InFlight> = Vec::new();
    while next < MESSAGES || !flying.is_empty() {
        while next < MESSAGES && flying.len() < IN_FLIGHT {
            let size = SIZES[(next + conn.id as usize) % SIZES.len()];
            let seed = conn.id.wrapping_mul(1000) + next as u64;
            flying.push(post(t, sc, rc, message_bytes(size, seed), next as c_int));
            next += 1;
        }
        // Tested in posting order, as the proxy does; the finished ones are checked.
        for m in &mut flying {
            test(t, m);
        }
        while flying.first().is_some_and(|m| m.send_done && m.recv_done) {
            let m = flying.remove(0);
            assert_eq!(
                m.got as usize,
                m.sent.len(),
                "connection {:#x}: size reported",
                conn.id
            );
            assert!(
                m.into == m.sent,
                "connection {:#x}: a message of {} bytes arrived with other bytes (another \
                 comm's or request's?)",
                conn.id,
                m.sent.len()
            );
            // SAFETY: registrations of these comms, their requests done.
            unsafe {
                assert_eq!(t.deregMr.expect("deregMr")(sc, m.mrs.0.get()), OK);
                assert_eq!(t.deregMr.expect("deregMr")(rc, m.mrs.1.get()), OK);
            }
            moved.messages.fetch_add(1, Ordering::Relaxed);
            moved
                .bytes
                .fetch_add(m.sent.len() as u64, Ordering::Relaxed);
        }
        std::thread::yield_now();
    }
    // SAFETY: comms connect/accept returned, no request in flight.
    unsafe {
        assert_eq!(t.closeSend.expect("closeSend")(sc), OK);
        assert_eq!(t.closeRecv.expect("closeRecv")(rc), OK);
    }
}

/// Registers and posts one message's receive and send (each retried while the plugin hands
/// back no request, as NCCL does).
fn post(
    t: &ncclNet_v12_t,
    sc: *mut c_void,
    rc: *mut c_void,
    mut sent: Vec<u8>,
    tag: c_int,
) -> InFlight {
    // A receive posted larger than the message, as NCCL may.
    let mut into = vec![0xeeu8; sent.len() + 16];
    let (mut smr, mut rmr) = (null_mut(), null_mut());
    let reg = t.regMr.expect("regMr");
    // SAFETY: host buffers that live in the returned InFlight until both requests are done
    // (the Vec's heap memory does not move with it).
    unsafe {
        assert_eq!(
            reg(
                sc,
                sent.as_mut_ptr().cast(),
                sent.len(),
                NCCL_PTR_HOST as c_int,
                &mut smr
            ),
            OK
        );
        assert_eq!(
            reg(
                rc,
                into.as_mut_ptr().cast(),
                into.len(),
                NCCL_PTR_HOST as c_int,
                &mut rmr
            ),
            OK
        );
    }
    let (mut sreq, mut rreq): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    while rreq.is_null() {
        // SAFETY: a live receive comm of `t` and its registration; the buffer is lent until
        // the request is done.
        rreq = unsafe { common::raw_irecv(t, rc, &mut into, tag, rmr) };
    }
    while sreq.is_null() {
        // SAFETY: the buffer is lent until the request is done.
        let code = unsafe {
            t.isend.expect("isend")(
                sc,
                sent.as_mut_ptr().cast(),
                sent.len(),
                tag,
                smr,
                null_mut(),
                &mut sreq,
            )
        };
        assert_eq!(code, OK, "isend");
    }
    into.truncate(sent.len());
    InFlight {
        send: Ptr::of(sreq),
        recv: Ptr::of(rreq),
        sent,
        into,
        mrs: (Ptr::of(smr), Ptr::of(rmr)),
        send_done: false,
        recv_done: false,
        got: -1,
    }
}

/// Tests what is not done yet of `m`'s two requests.
fn test(t: &ncclNet_v12_t, m: &mut InFlight) {
    let test = t.test.expect("test");
    if !m.send_done {
        let mut done = 0;
        // SAFETY: a request the plugin handed out and not yet reported done.
        assert_eq!(
            unsafe { test(m.send.get(), &mut done, null_mut()) },
            OK,
            "test (send)"
        );
        m.send_done = done != 0;
    }
    if !m.recv_done {
        let (mut done, mut size) = (0, -1 as c_int);
        // SAFETY: as above; one size for the request's one buffer.
        assert_eq!(
            unsafe { test(m.recv.get(), &mut done, &mut size) },
            OK,
            "test (recv)"
        );
        if done != 0 {
            m.recv_done = true;
            m.got = size;
        }
    }
}
