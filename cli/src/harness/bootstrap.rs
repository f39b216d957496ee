//! A tiny TCP rendezvous standing in for NCCL's bootstrap: ranks all-gather small blobs (the
//! 128-byte connection handles) and barrier.
//!
//! The server runs on a thread of whoever starts the ranks (the launcher, a test that is a
//! rank itself, or rank 0 of a multi-process job), on loopback or on the address asked for.
//! Every rank connects and says who it is: protocol version, rank, world size and job id; a
//! hello that differs is answered with an error frame and fails the run for everyone; a
//! connection that does not speak the rendezvous at all is dropped and the run goes on. Then,
//! round after round, each rank sends one blob and receives all of them in rank order. A rank
//! that disconnects ends the server, which makes every other rank's next call fail instead of
//! hang; with watch connections ([`Watch`]) the others hear at once which rank left.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nccl_net_lossy::{Error, Result};

/// Identifies the bootstrap protocol on the first bytes of a connection.
const MAGIC: u32 = 0x4c42_5331; // "LBS1"

/// Version of the hello and of the frames after it; a peer with another one is refused.
pub const PROTOCOL_VERSION: u32 = 2;

/// Largest blob a rank may contribute to one round.
pub const MAX_BLOB: usize = 1 << 20;

/// Longest job id a hello may carry.
pub const MAX_JOB_ID: usize = 256;

/// The job id of a local launch (every rank is a child of the same launcher).
pub const LOCAL_JOB: &str = "local";

/// A frame length that announces an error message instead of a blob.
const ERROR_FRAME: u64 = u64::MAX;

/// A rank's data connection (all-gathers) or its watch connection (liveness).
const KIND_DATA: u32 = 0;
const KIND_WATCH: u32 = 1;

/// What a watch connection sends when its rank finished normally.
const WATCH_DONE: u8 = 1;

fn read_u32(stream: &mut impl Read) -> Result<u32> {
    let mut b = [0u8; 4];
    stream.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_blob(stream: &mut TcpStream) -> Result<Vec<u8>> {
    read_frame(stream)?.map_err(Error::remote)
}

/// Most characters of the server's error message a rank shows: the server's own are a few
/// hundred; a peer that is not our server may send a megabyte.
const MAX_ERROR_SHOWN: usize = 1024;

/// Reads one frame: a blob, or (inner `Err`) the server's word on why the run ended.
fn read_frame(stream: &mut TcpStream) -> Result<std::result::Result<Vec<u8>, String>> {
    let len = read_len(stream)?;
    if len == ERROR_FRAME {
        // The message's own length is read as a plain blob's: an error marker there is
        // malformed, not another error frame (a peer sending 0xff bytes made the reader
        // recurse once per 8 bytes until the stack overflowed).
        let len = read_len(stream)?;
        if len == ERROR_FRAME {
            return Err(Error::remote(
                "malformed bootstrap frame: an error message whose length is the error marker",
            ));
        }
        let text = read_body(stream, len)?;
        let text = String::from_utf8_lossy(&text);
        return Ok(Err(nccl_net_lossy::error::echo_at_most(
            &text,
            MAX_ERROR_SHOWN,
            str::to_string,
        )));
    }
    read_body(stream, len).map(Ok)
}

/// Reads a frame's 8-byte length.
fn read_len(stream: &mut TcpStream) -> Result<u64> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    Ok(u64::from_le_bytes(len))
}

/// Reads a frame's body of `len` bytes, at most [`MAX_BLOB`].
fn read_body(stream: &mut TcpStream, len: u64) -> Result<Vec<u8>> {
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len > MAX_BLOB {
        return Err(Error::remote(format!(
            "bootstrap blob of {len} bytes (at most {MAX_BLOB})"
        )));
    }
    let mut blob = vec![0u8; len];
    stream.read_exact(&mut blob)?;
    Ok(blob)
}

fn write_blob(out: &mut Vec<u8>, blob: &[u8]) {
    out.extend_from_slice(&(blob.len() as u64).to_le_bytes());
    out.extend_from_slice(blob);
}

/// Tells `stream`'s rank why the run ended (best effort: it may be gone).
fn send_error(stream: &mut TcpStream, message: &str) {
    let mut out = ERROR_FRAME.to_le_bytes().to_vec();
    write_blob(&mut out, message.as_bytes());
    let _ = stream.write_all(&out);
}

/// Closes connections without losing what was last written to them: a socket closed with
/// unread input sends a reset, which can discard data its peer has not read yet. Stops
/// writing, then reads until each peer closes (at most half a second in all).
fn close_gently(mut streams: Vec<TcpStream>) {
    let deadline = Instant::now() + Duration::from_millis(500);
    for stream in &mut streams {
        let _ = stream.shutdown(Shutdown::Write);
    }
    let mut sink = [0u8; 4096];
    for stream in &mut streams {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
                break;
            }
            match stream.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }
}

/// Where the server listens, how long it waits and which job it serves.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Address to bind (port 0: any free port).
    pub bind: SocketAddr,
    /// Number of ranks.
    pub nranks: usize,
    /// How long ranks have to arrive.
    pub connect_timeout: Duration,
    /// How long a round may wait for its slowest rank.
    pub round_timeout: Duration,
    /// The job id every hello must carry.
    pub job_id: String,
    /// Whether every rank also opens a watch connection (see [`Watch`]).
    pub watch: bool,
}

/// The rendezvous point of one run.
pub struct BootstrapServer {
    addr: SocketAddr,
    thread: Option<JoinHandle<Result<()>>>,
}

impl BootstrapServer {
    /// Starts serving `nranks` local ranks on a loopback port; every wait (for ranks to
    /// connect, for a round to fill) gives up after `timeout`.
    pub fn start(nranks: usize, timeout: Duration) -> Result<BootstrapServer> {
        BootstrapServer::start_with(ServerOptions {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            nranks,
            connect_timeout: timeout,
            round_timeout: timeout,
            job_id: LOCAL_JOB.into(),
            watch: false,
        })
    }

    /// Starts serving as `options` say.
    pub fn start_with(options: ServerOptions) -> Result<BootstrapServer> {
        if options.nranks == 0 {
            return Err(Error::invalid_argument(
                "a bootstrap needs at least one rank",
            ));
        }
        let listener = TcpListener::bind(options.bind).map_err(|e| {
            Error::from(e).context(format!("cannot listen for ranks on {}", options.bind))
        })?;
        let addr = listener.local_addr()?;
        let thread = std::thread::Builder::new()
            .name("lossy-bootstrap".into())
            .spawn(move || serve(listener, addr, options))?;
        Ok(BootstrapServer {
            addr,
            thread: Some(thread),
        })
    }

    /// Where ranks connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Like [`join`](Self::join), but gives up after `wait` (`None`: still serving).
    pub fn join_within(self, wait: Duration) -> Option<Result<()>> {
        let deadline = Instant::now() + wait;
        while self.thread.as_ref().is_some_and(|t| !t.is_finished()) {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(self.join())
    }

    /// Waits for the server to end (every rank gone, or a failure) and returns how it ended.
    pub fn join(mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| Error::internal("bootstrap server panicked"))?,
            None => Ok(()),
        }
    }
}

/// A hello, as the server reads it.
struct RankHello {
    kind: u32,
    rank: usize,
    job_id: String,
}

/// Reads a hello and checks it against the server's job; the error says what differs.
fn read_hello(
    stream: &mut impl Read,
    options: &ServerOptions,
    from: SocketAddr,
) -> Result<RankHello> {
    let magic = read_u32(stream)?;
    if magic != MAGIC {
        return Err(Error::remote(format!(
            "a peer at {from} does not speak the lossy rendezvous (magic {magic:#x})"
        )));
    }
    let version = read_u32(stream)?;
    if version != PROTOCOL_VERSION {
        return Err(Error::remote(format!(
            "a peer at {from} speaks rendezvous protocol version {version}, this one speaks \
             {PROTOCOL_VERSION} (mixed lossy versions?)"
        )));
    }
    let (kind, rank, nranks, len) = (
        read_u32(stream)?,
        read_u32(stream)? as usize,
        read_u32(stream)? as usize,
        read_u32(stream)? as usize,
    );
    if len > MAX_JOB_ID {
        return Err(Error::remote(format!(
            "a peer at {from} sent a job id of {len} bytes"
        )));
    }
    let mut id = vec![0u8; len];
    stream.read_exact(&mut id)?;
    let hello = RankHello {
        kind,
        rank,
        job_id: String::from_utf8_lossy(&id).into_owned(),
    };
    if hello.job_id != options.job_id {
        return Err(Error::remote(format!(
            "rank {rank} (from {from}) belongs to job id `{}`, but the rendezvous at {} serves \
             job id `{}`",
            hello.job_id, options.bind, options.job_id
        )));
    }
    if nranks != options.nranks || rank >= nranks || kind > KIND_WATCH {
        return Err(Error::remote(format!(
            "rank {rank} of {nranks} (from {from}) joined a rendezvous for {} ranks",
            options.nranks
        )));
    }
    Ok(hello)
}

/// Bytes of a hello before its job id: magic, version, kind, rank, world size, id length.
const HELLO_HEAD: usize = 24;

/// Connections whose hello has not arrived that the server keeps; beyond them the oldest is
/// dropped. A rank's hello follows its connect at once, so only silent peers are dropped, and
/// a flood of them cannot take the server's file descriptors.
const MAX_PENDING: usize = 128;

/// A connection whose hello is still arriving. Hellos are read without blocking, so a peer
/// that connects and says nothing (a port scanner) holds up no rank.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    hello: Vec<u8>,
}

impl Pending {
    /// Bytes of the whole hello, as far as what arrived tells.
    fn wanted(&self) -> usize {
        match self.hello.get(20..HELLO_HEAD) {
            Some(len) => {
                let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
                // A job id too long is refused by `read_hello` before it reads the id.
                HELLO_HEAD + if len > MAX_JOB_ID { 0 } else { len }
            }
            None => HELLO_HEAD,
        }
    }

    /// Reads what has arrived: `Some(true)` once the hello is whole, `Some(false)` while
    /// more is to come, `None` for a peer that is no rank (it closed before its hello was
    /// whole, or its first bytes are not the rendezvous' magic: another protocol).
    fn poll(&mut self) -> Option<bool> {
        let mut buf = [0u8; 64];
        loop {
            let want = self.wanted();
            if self.hello.len() >= want {
                return Some(true);
            }
            let take = (want - self.hello.len()).min(buf.len());
            match self.stream.read(&mut buf[..take]) {
                Ok(0) => return None,
                Ok(k) => {
                    self.hello.extend_from_slice(&buf[..k]);
                    let magic = MAGIC.to_le_bytes();
                    let seen = self.hello.len().min(magic.len());
                    if self.hello[..seen] != magic[..seen] {
                        return None;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
    }
}

/// The connections of every rank.
struct Joined {
    data: Vec<Option<TcpStream>>,
    watch: Vec<Option<TcpStream>>,
}

impl Joined {
    /// Tells every connected rank, every connection whose hello was still arriving
    /// (`refused` holds them and the refused one), and every connection still waiting in
    /// `listener`'s queue (a rank's second connection), why the run ends, then closes them
    /// gently.
    fn fail(&mut self, listener: &TcpListener, refused: Vec<TcpStream>, err: Error) -> Error {
        let text = err.to_string();
        let mut all = refused;
        for stream in &all {
            let _ = stream.set_nonblocking(false);
        }
        // Rank 0 last: in a multi-process job its process hosts this server.
        for slots in [&mut self.data, &mut self.watch] {
            all.extend(slots.iter_mut().skip(1).filter_map(Option::take));
        }
        for slots in [&mut self.data, &mut self.watch] {
            all.extend(slots.first_mut().and_then(Option::take));
        }
        for stream in &mut all {
            send_error(stream, &text);
        }
        let grace = Instant::now() + Duration::from_millis(200);
        while Instant::now() < grace {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    send_error(&mut stream, &text);
                    all.push(stream);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        close_gently(all);
        err
    }

    fn missing(&self, want_watch: bool) -> Vec<usize> {
        (0..self.data.len())
            .filter(|&r| self.data[r].is_none() || (want_watch && self.watch[r].is_none()))
            .collect()
    }
}

/// Accepts every rank, then serves rounds until a rank leaves.
fn serve(listener: TcpListener, addr: SocketAddr, options: ServerOptions) -> Result<()> {
    let nranks = options.nranks;
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + options.connect_timeout;
    let mut joined = Joined {
        data: (0..nranks).map(|_| None).collect(),
        watch: (0..nranks).map(|_| None).collect(),
    };
    // Connections whose hello is still arriving, oldest first, and how many were no rank
    // (dropped).
    let mut pending: Vec<Pending> = Vec::new();
    let mut strangers = 0usize;
    let pending_streams = |pending: Vec<Pending>| pending.into_iter().map(|p| p.stream);
    loop {
        let missing = joined.missing(options.watch);
        if missing.is_empty() {
            break;
        }
        let mut progressed = false;
        match listener.accept() {
            Ok((stream, from)) => {
                stream.set_nonblocking(true)?;
                stream.set_nodelay(true)?;
                if pending.len() >= MAX_PENDING {
                    // The oldest has been silent the longest: not a rank.
                    pending.remove(0);
                    strangers += 1;
                }
                pending.push(Pending {
                    stream,
                    from,
                    hello: Vec::with_capacity(HELLO_HEAD),
                });
                progressed = true;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                let streams = pending_streams(pending).collect();
                return Err(joined.fail(&listener, streams, e.into()));
            }
        }
        let mut i = 0;
        while i < pending.len() {
            match pending[i].poll() {
                Some(false) => i += 1,
                None => {
                    // Not a rank of any lossy job: the job goes on without it.
                    pending.remove(i);
                    strangers += 1;
                    progressed = true;
                }
                Some(true) => {
                    progressed = true;
                    let Pending {
                        mut stream,
                        from,
                        hello,
                    } = pending.remove(i);
                    stream.set_nonblocking(false)?;
                    let hello = match read_hello(&mut &hello[..], &options, from) {
                        Ok(hello) => hello,
                        Err(err) => {
                            let mut streams: Vec<TcpStream> = pending_streams(pending).collect();
                            streams.insert(0, stream);
                            return Err(joined.fail(&listener, streams, err));
                        }
                    };
                    stream.set_read_timeout(Some(options.round_timeout))?;
                    let slots = if hello.kind == KIND_DATA {
                        &mut joined.data
                    } else {
                        &mut joined.watch
                    };
                    match &mut slots[hello.rank] {
                        slot @ None => {
                            // The welcome: an empty frame (a refused hello gets an error frame).
                            stream.write_all(&0u64.to_le_bytes())?;
                            *slot = Some(stream);
                        }
                        Some(_) => {
                            let err = Error::remote(format!(
                                "two processes (the second from {from}) claim rank {} of job `{}`",
                                hello.rank, hello.job_id
                            ));
                            let mut streams: Vec<TcpStream> = pending_streams(pending).collect();
                            streams.insert(0, stream);
                            return Err(joined.fail(&listener, streams, err));
                        }
                    }
                }
            }
        }
        if Instant::now() > deadline {
            let ignored = match strangers {
                0 => String::new(),
                k => format!(
                    " ({k} connection(s) that did not speak the lossy rendezvous were ignored)"
                ),
            };
            // The first ranks, then a count: a line per rank, not a line of every rank.
            let shown: Vec<String> = missing.iter().take(32).map(|r| r.to_string()).collect();
            let ranks = match missing.len() - shown.len() {
                0 => format!("{} of {nranks}", shown.join(", ")),
                more => format!(
                    "{} and {more} more ({} of {nranks})",
                    shown.join(", "),
                    missing.len()
                ),
            };
            let err = Error::remote(format!(
                "rank(s) {ranks} did not reach the rendezvous at {addr} within {:?}{ignored}",
                options.connect_timeout
            ));
            let streams = pending_streams(pending).collect();
            return Err(joined.fail(&listener, streams, err));
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    drop(pending);
    let watchers = if options.watch {
        watch_ranks(joined.watch.drain(..).flatten().collect())?
    } else {
        Vec::new()
    };
    let outcome = serve_rounds(joined, nranks);
    // A normal end waits for every rank to say it finished: a server gone earlier would
    // look, to a rank still reading the last round, like rank 0 gone.
    if outcome.is_ok() {
        for watcher in watchers {
            let _ = watcher.join();
        }
    }
    outcome
}

/// Serves rounds until rank 0 leaves between rounds (the end) or a rank fails.
fn serve_rounds(joined: Joined, nranks: usize) -> Result<()> {
    let mut streams: Vec<TcpStream> = joined.data.into_iter().flatten().collect();
    loop {
        let mut blobs = Vec::with_capacity(nranks);
        for rank in 0..nranks {
            match read_blob(&mut streams[rank]) {
                Ok(blob) => blobs.push(blob),
                // A rank that leaves between rounds is the normal end of a run.
                Err(_) if rank == 0 && blobs.is_empty() => return Ok(()),
                Err(err) => {
                    let err = err.context(format!("bootstrap round, rank {rank}"));
                    for stream in &mut streams {
                        send_error(stream, &err.to_string());
                    }
                    close_gently(streams);
                    return Err(err);
                }
            }
        }
        let mut reply = Vec::new();
        for blob in &blobs {
            write_blob(&mut reply, blob);
        }
        for stream in &mut streams {
            stream.write_all(&reply)?;
        }
    }
}

/// Watches every rank's watch connection on a thread of its own: a rank whose connection
/// closes before it said it finished is gone, and every other rank hears which one.
fn watch_ranks(streams: Vec<TcpStream>) -> Result<Vec<JoinHandle<()>>> {
    let writers: Vec<TcpStream> = streams
        .iter()
        .map(TcpStream::try_clone)
        .collect::<std::io::Result<_>>()?;
    let writers = Arc::new(Mutex::new(writers));
    let mut watchers = Vec::with_capacity(streams.len());
    for (rank, mut stream) in streams.into_iter().enumerate() {
        let writers = Arc::clone(&writers);
        let watcher = std::thread::Builder::new()
            .name("lossy-watch".into())
            .spawn(move || {
                let _ = stream.set_read_timeout(None);
                let peer = stream
                    .peer_addr()
                    .map_or_else(|_| "?".to_string(), |a| a.to_string());
                let mut byte = [0u8; 1];
                if matches!(stream.read(&mut byte), Ok(1) if byte[0] == WATCH_DONE) {
                    return;
                }
                let text = format!(
                    "rank {rank} (at {peer}) left the job before it finished (killed or crashed?)"
                );
                if let Ok(mut all) = writers.lock() {
                    // Rank 0 last: its process hosts this server and ends when it hears.
                    let n = all.len();
                    for other in (1..n).chain(std::iter::once(0)) {
                        if other != rank {
                            send_error(&mut all[other], &text);
                        }
                    }
                }
            })?;
        watchers.push(watcher);
    }
    Ok(watchers)
}

/// Connects to `addr`, trying again while nothing listens there yet (rank 0 may start
/// last), and sends a hello.
fn join(
    addr: SocketAddr,
    kind: u32,
    rank: usize,
    nranks: usize,
    job_id: &str,
    timeout: Duration,
) -> Result<TcpStream> {
    if rank >= nranks {
        return Err(Error::invalid_argument(format!(
            "rank {rank} of {nranks} ranks"
        )));
    }
    if job_id.len() > MAX_JOB_ID {
        return Err(Error::invalid_argument(format!(
            "job id of {} bytes (at most {MAX_JOB_ID})",
            job_id.len()
        )));
    }
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10))) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() < deadline && e.kind() != std::io::ErrorKind::TimedOut => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(Error::from(e).context(format!(
                    "no rendezvous at {addr} within {timeout:?} (is rank 0 running there?)"
                )))
            }
        }
    };
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    let mut hello = Vec::with_capacity(24 + job_id.len());
    for word in [
        MAGIC,
        PROTOCOL_VERSION,
        kind,
        rank as u32,
        nranks as u32,
        job_id.len() as u32,
    ] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    hello.extend_from_slice(job_id.as_bytes());
    stream.write_all(&hello)?;
    match read_frame(&mut stream) {
        Ok(Ok(_)) => Ok(stream),
        Ok(Err(text)) => Err(Error::remote(text)),
        Err(err) => Err(err.context(format!("rendezvous at {addr} did not welcome rank {rank}"))),
    }
}

/// One rank's connection to the bootstrap server.
pub struct Bootstrap {
    stream: TcpStream,
    rank: usize,
    nranks: usize,
}

impl Bootstrap {
    /// Joins the local run at `addr` as `rank` of `nranks`; every later wait gives up after
    /// `timeout`.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        nranks: usize,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        Bootstrap::connect_job(addr, rank, nranks, LOCAL_JOB, timeout)
    }

    /// Joins job `job_id` at `addr` as `rank` of `nranks`, waiting up to `timeout` for the
    /// server to listen; every later wait gives up after `timeout` too.
    pub fn connect_job(
        addr: SocketAddr,
        rank: usize,
        nranks: usize,
        job_id: &str,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        let stream = join(addr, KIND_DATA, rank, nranks, job_id, timeout)?;
        Ok(Bootstrap {
            stream,
            rank,
            nranks,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The local address this rank reaches the rendezvous from: the interface other ranks
    /// can reach it on (loopback in a local run).
    pub fn local_ip(&self) -> Result<IpAddr> {
        Ok(self.stream.local_addr()?.ip())
    }

    /// Sets how long a later round may wait.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.stream.set_read_timeout(Some(timeout))?;
        self.stream.set_write_timeout(Some(timeout))?;
        Ok(())
    }

    /// Sends `blob` and returns every rank's blob, in rank order.
    pub fn all_gather(&mut self, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::with_capacity(blob.len() + 8);
        write_blob(&mut out, blob);
        self.stream
            .write_all(&out)
            .map_err(|e| Error::from(e).context("bootstrap send"))?;
        (0..self.nranks)
            .map(|_| read_blob(&mut self.stream).map_err(|e| e.context("bootstrap receive")))
            .collect()
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

/// A rank's watch connection: while the rank runs, a thread waits on it and hands
/// `on_failure` the server's word that another rank is gone (or that the server is).
pub struct Watch {
    stream: TcpStream,
    finished: Arc<AtomicBool>,
}

impl Watch {
    /// Opens the watch connection of `rank` in job `job_id` at `addr`.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        nranks: usize,
        job_id: &str,
        timeout: Duration,
        on_failure: impl FnOnce(Error) + Send + 'static,
    ) -> Result<Watch> {
        let stream = join(addr, KIND_WATCH, rank, nranks, job_id, timeout)?;
        let mut reader = stream.try_clone()?;
        reader.set_read_timeout(None)?;
        let finished = Arc::new(AtomicBool::new(false));
        let seen = Arc::clone(&finished);
        std::thread::Builder::new()
            .name("lossy-watched".into())
            .spawn(move || {
                let frame = read_frame(&mut reader);
                // After `done` the server closing this connection is the normal end.
                if seen.load(Ordering::SeqCst) {
                    return;
                }
                let err = match frame {
                    Ok(Err(text)) => Error::remote(text),
                    _ => Error::remote(format!(
                        "lost the rendezvous at {addr} (rank 0, which hosts it, is gone)"
                    )),
                };
                on_failure(err);
            })?;
        Ok(Watch { stream, finished })
    }

    /// Says this rank finished normally; the thread then hears nothing more.
    pub fn done(mut self) -> Result<()> {
        self.finished.store(true, Ordering::SeqCst);
        self.stream.write_all(&[WATCH_DONE])?;
        Ok(())
    }
}

#[cfg(test)]
#[path = "bootstrap_tests.rs"]
mod tests;
