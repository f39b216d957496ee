//! What one message costs the CPU through the plugin, next to plain TCP: one thread posts a
//! receive, sends a message to itself over loopback and tests both until done, through the
//! plugin library (loss switched off, driven by the harness's plugin client as NCCL's proxy
//! drives it) and through a non-blocking TCP socket pair (an 8-byte length, then the
//! payload, as the harness's raw link sends). Receives are posted at the message's size on
//! every path (the harness posts whole steps; this measures a message, not the harness's
//! ring). Nothing waits for another process, so the
//! difference is the work of the layers, with little of the machine's noise in it.
//! `cargo bench -p lossy-cli --bench message_cost [-- [LIBRARY.so] [--vs-library PEER.so]]`
//! (default: this build's library); the peer, NCCL's Socket transport built as a plugin, say,
//! is timed in the same rounds. The last row, `idle test`, is what a `test` of a posted receive
//! costs while nothing has arrived (a bare non-blocking `read` on the raw path).

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lossy_cli::harness::plugin_client::{
    MrHandle, PluginClient, PluginLibrary, Posted, RecvComm, RecvItem, SendComm,
};

const SIZES: [usize; 6] = [8, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20];
const ROUNDS: usize = 5;

/// One end of each path, and the buffers they reuse (registered once, as NCCL's are).
struct Plugin {
    send: SendComm,
    recv: RecvComm,
    sbuf: Option<Box<[u8]>>,
    rbuf: Option<Box<[u8]>>,
    smr: MrHandle,
    rmr: MrHandle,
}

impl Plugin {
    fn message(&mut self, size: usize) {
        let buf = self.rbuf.take().expect("receive buffer");
        let item = RecvItem {
            buf,
            size,
            tag: 1,
            mr: self.rmr,
        };
        let Posted::Started(mut r) = self.recv.irecv([item]).expect("irecv") else {
            panic!("irecv found no free request");
        };
        let buf = self.sbuf.take().expect("send buffer");
        let Posted::Started(mut s) = self.send.isend(buf, size, 1, self.smr).expect("isend") else {
            panic!("isend found no free request");
        };
        // Both tested in turn, as NCCL's proxy progresses its sends and receives: a message
        // larger than the socket buffers moves only while the send is tested too.
        let (mut received, mut sent) = (false, false);
        while !(received && sent) {
            received = received || r.test().expect("test receive").is_some();
            sent = sent || s.test().expect("test send").is_some();
        }
        let (rbuf, got) = r.finish_one().expect("receive");
        assert_eq!(got, size, "the receive got another size");
        self.rbuf = Some(rbuf);
        self.sbuf = Some(s.finish_one().expect("send").0);
    }

    /// Nanoseconds per `test` of a posted receive while nothing has arrived (what a proxy's
    /// poll costs while it waits for its peer), over `polls` calls; the message then comes
    /// and completes the receive.
    fn empty_test(&mut self, polls: usize) -> f64 {
        let buf = self.rbuf.take().expect("receive buffer");
        let item = RecvItem {
            buf,
            size: 8,
            tag: 1,
            mr: self.rmr,
        };
        let Posted::Started(mut r) = self.recv.irecv([item]).expect("irecv") else {
            panic!("irecv found no free request");
        };
        let ns = time(polls, || {
            assert!(
                r.test().expect("test receive").is_none(),
                "nothing was sent"
            );
        });
        let buf = self.sbuf.take().expect("send buffer");
        let Posted::Started(mut s) = self.send.isend(buf, 8, 1, self.smr).expect("isend") else {
            panic!("isend found no free request");
        };
        let (mut received, mut sent) = (false, false);
        while !(received && sent) {
            received = received || r.test().expect("test receive").is_some();
            sent = sent || s.test().expect("test send").is_some();
        }
        self.rbuf = Some(r.finish_one().expect("receive").0);
        self.sbuf = Some(s.finish_one().expect("send").0);
        ns
    }
}

struct Raw {
    tx: TcpStream,
    rx: TcpStream,
    data: Vec<u8>,
    into: Vec<u8>,
}

impl Raw {
    /// Nanoseconds per non-blocking read that finds nothing, over `polls` calls.
    fn empty_read(&mut self, polls: usize) -> f64 {
        let mut head = [0u8; 8];
        time(polls, || assert_eq!(moved(self.rx.read(&mut head)), 0))
    }

    fn message(&mut self, size: usize) {
        let header = (size as u64).to_le_bytes();
        let total = header.len() + size;
        let (mut sent, mut got) = (0, 0);
        let mut head = [0u8; 8];
        while sent < total || got < total {
            if sent < total {
                let wrote = if sent < header.len() {
                    self.tx.write_vectored(&[
                        IoSlice::new(&header[sent..]),
                        IoSlice::new(&self.data[..size]),
                    ])
                } else {
                    self.tx.write(&self.data[sent - header.len()..size])
                };
                sent += moved(wrote);
            }
            let read = if got < head.len() {
                self.rx.read(&mut head[got..])
            } else {
                self.rx.read(&mut self.into[got - head.len()..size])
            };
            got += moved(read);
        }
        assert_eq!(u64::from_le_bytes(head), size as u64);
    }
}

/// Bytes one non-blocking call moved (none when it would block).
fn moved(outcome: std::io::Result<usize>) -> usize {
    match outcome {
        Ok(0) => panic!("the loopback peer closed"),
        Ok(k) => k,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        Err(e) => panic!("loopback I/O failed: {e}"),
    }
}

/// Nanoseconds per call of `f` (one message), over `iters` calls.
fn time(iters: usize, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_nanos() as f64 / iters as f64
}

/// Prints one row: the medians of the rounds of each path (the peer's when it ran).
fn print_row(label: &str, iters: usize, p: Vec<f64>, r: Vec<f64>, q: Vec<f64>) {
    let (p, r) = (median(p), median(r));
    print!(
        "{label:>10} {iters:>7} | {p:>10.0} {r:>10.0} | {:>9.0} {:>6.0}%",
        p - r,
        100.0 * r / p
    );
    if q.is_empty() {
        println!();
    } else {
        let q = median(q);
        println!(" | {q:>7.0} {:>6.0}%", 100.0 * q / p);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A connected pair of `lib` on device 0, its buffers registered; loss switched off when the
/// library has this project's control API (NCCL's own transports have no loss to switch).
fn open(lib: &std::rc::Rc<PluginLibrary>, id: u64, largest: usize) -> (PluginClient, Plugin) {
    if lib.switches_loss() {
        lib.set_loss_enabled(false).expect("switch loss off");
    }
    let client = PluginClient::init(lib, 12, id).expect("init");
    let (send, recv) = client
        .local_pair(0, Duration::from_secs(10))
        .expect("connect and accept");
    let mut sbuf = vec![0x5au8; largest].into_boxed_slice();
    let mut rbuf = vec![0u8; largest].into_boxed_slice();
    let smr = send.reg_mr(&mut sbuf).expect("regMr");
    let rmr = recv.reg_mr(&mut rbuf).expect("regMr");
    let plugin = Plugin {
        send,
        recv,
        sbuf: Some(sbuf),
        rbuf: Some(rbuf),
        smr,
        rmr,
    };
    (client, plugin)
}

fn main() {
    // Cargo passes `--bench`. A path is the library to drive instead of this build's;
    // `--vs-library PATH` adds another net plugin (NCCL's Socket transport built as one), timed
    // in the same rounds.
    let (mut library, mut peer) = (None, None);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--vs-library" => peer = Some(args.next().expect("a path after --vs-library")),
            a if a.starts_with("--") => {}
            _ => library = Some(arg),
        }
    }
    let lib = match library {
        Some(path) => PluginLibrary::open(std::path::Path::new(&path)),
        None => PluginLibrary::open_default(),
    }
    .expect("the plugin library");
    let largest = SIZES[SIZES.len() - 1];
    let (client, mut plugin) = open(&lib, 0x6d73, largest);
    let peer_lib = peer.map(|p| PluginLibrary::open(std::path::Path::new(&p)).expect("the peer"));
    let mut peer = peer_lib.as_ref().map(|l| open(l, 0x6d74, largest));
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let tx = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
    let (rx, _) = listener.accept().expect("accept");
    for s in [&tx, &rx] {
        s.set_nodelay(true).expect("TCP_NODELAY");
        s.set_nonblocking(true).expect("non-blocking");
    }
    let mut raw = Raw {
        tx,
        rx,
        data: vec![0x5a; largest],
        into: vec![0; largest],
    };
    println!("# one thread sends to itself over loopback: ns per message (send and receive),");
    println!(
        "# median of {ROUNDS} interleaved rounds; plugin {} from {}",
        client.name(),
        lib.path().display()
    );
    if let (Some((c, _)), Some(l)) = (&peer, &peer_lib) {
        println!("# peer {} from {}", c.name(), l.path().display());
    }
    print!(
        "{:>10} {:>7} | {:>10} {:>10} | {:>9} {:>7}",
        "size (B)", "iters", "plugin ns", "raw ns", "extra ns", "raw/plg"
    );
    println!(
        "{}",
        if peer.is_some() {
            " | peer ns peer/plg"
        } else {
            ""
        }
    );
    for size in SIZES {
        let iters = ((256usize << 20) / size.max(4096)).clamp(200, 20_000);
        // Warm-up: connection buffers grow, pages fault in.
        time(iters / 10 + 1, || plugin.message(size));
        time(iters / 10 + 1, || raw.message(size));
        if let Some((_, q)) = peer.as_mut() {
            time(iters / 10 + 1, || q.message(size));
        }
        let (mut p, mut r, mut q) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            p.push(time(iters, || plugin.message(size)));
            r.push(time(iters, || raw.message(size)));
            if let Some((_, other)) = peer.as_mut() {
                q.push(time(iters, || other.message(size)));
            }
        }
        print_row(&size.to_string(), iters, p, r, q);
    }
    // A poll that finds nothing: what each pass of a waiting proxy costs, and so how soon it
    // sees bytes that arrive.
    let polls = 100_000;
    let (mut p, mut r, mut q) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        p.push(plugin.empty_test(polls));
        r.push(raw.empty_read(polls));
        if let Some((_, other)) = peer.as_mut() {
            q.push(other.empty_test(polls));
        }
    }
    print_row("idle test", polls, p, r, q);
    for (c, p) in [Some((client, plugin)), peer].into_iter().flatten() {
        p.send.close().expect("closeSend");
        p.recv.close().expect("closeRecv");
        c.finalize().expect("finalize");
    }
}
