//! What one rank does: a [`Job`] in, a [`WorkerReport`] out. `lossy worker` runs this in its
//! own process; tests may run it in theirs.

use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::bootstrap::Bootstrap;
use super::collectives::{
    self, output_len, Collective, CollectiveSpec, DataType, Staging, DEFAULT_CHUNK,
};
use super::net::{ring_comms, PluginLink, RawTcpLink, RingLink, MAX_IN_FLIGHT};
use super::plugin_client::{
    establish, op, PluginClient, PluginLibrary, Posted, RecvItem, HANDLE_BYTES,
};
use nccl_net_lossy::transport::socket::{SocketConfig, DEFAULT_NSOCKS};
use nccl_net_lossy::{Error, Result};

/// Which ring channel a run goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// The plugin library.
    Plugin,
    /// Plain TCP over loopback, the baseline.
    RawTcp,
    /// The plugin library again, on its own connections, with loss injection switched off
    /// for its iterations: the lossless baseline measured in the same run, interleaved.
    PluginLossless,
}

/// One collective at one size, repeated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Which collective.
    pub collective: Collective,
    /// Element type.
    pub dtype: DataType,
    /// Bytes of the full buffer (rounded down to whole elements).
    pub bytes: usize,
    /// Timed repetitions.
    pub iters: usize,
    /// Untimed repetitions first.
    pub warmup: usize,
}

/// What a worker does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Ring collectives, every run on every link kind listed.
    Collectives {
        /// Link kinds, each set up once and used for every run.
        links: Vec<LinkKind>,
        /// The runs, in order.
        runs: Vec<RunSpec>,
    },
    /// Grouped receives: each rank sends `count` tagged messages to the next rank in reverse
    /// tag order and receives them from the previous one with one `irecv` of `count` buffers.
    Grouped {
        /// Messages per group (at most 8).
        count: usize,
        /// Groups exchanged.
        rounds: usize,
    },
    /// Point-to-point messages around the ring, posted as collective `op_bits`, with every
    /// received packet classified (intact, zeroed, stale, one bit flipped), so what the
    /// receiver got can be compared with the sender's statistics.
    Messages {
        /// Bytes per message.
        bytes: usize,
        /// Messages each rank sends.
        count: usize,
        /// Packet size to classify by (the profile's `mtu`).
        mtu: usize,
        /// `setNetAttr` op bits announced before sending (`1 << ncclFunc`).
        op_bits: u32,
    },
    /// Many communicators at once, driven from one thread as NCCL's proxy drives them: each
    /// has its own context and ring connection, up to `in_flight` requests per direction,
    /// grouped receives of 1 to 8 buffers (some sharing a tag), message sizes from 0 to
    /// 256 KiB + 3 (odd ones included), every byte checked.
    Stress {
        /// Communicators per rank.
        comms: usize,
        /// Groups each communicator sends to the next rank.
        groups: usize,
        /// Requests in flight per connection and direction (at most 8).
        in_flight: usize,
    },
}

/// What a [`Task::Stress`] rank received, all verified bit-exact.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StressCounts {
    /// Communicators driven at once.
    pub comms: u64,
    /// Grouped receives completed.
    pub groups: u64,
    /// Messages received.
    pub messages: u64,
    /// Of which zero-byte messages.
    pub zero_byte: u64,
    /// Bytes received.
    pub bytes: u64,
    /// Most requests that were in flight at once on this rank.
    pub peak_in_flight: u64,
    /// Seconds from the first post to the last completion.
    pub seconds: f64,
}

/// How the packets a rank received arrived (see [`Task::Messages`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PacketCensus {
    /// Packets received.
    pub packets: u64,
    /// Packets exactly as sent.
    pub intact: u64,
    /// Packets that arrived as zeros.
    pub zeroed: u64,
    /// Packets whose bytes were never written (the receive buffer's previous content).
    pub stale: u64,
    /// Packets with exactly one bit flipped.
    pub flipped: u64,
    /// Packets damaged in any other way (must stay 0).
    pub other: u64,
}

impl PacketCensus {
    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &PacketCensus) {
        self.packets += other.packets;
        self.intact += other.intact;
        self.zeroed += other.zeroed;
        self.stale += other.stale;
        self.flipped += other.flipped;
        self.other += other.other;
    }
}

/// Everything a worker needs besides its rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    /// The plugin library to `dlopen`.
    pub library: PathBuf,
    /// `ncclNetPlugin_vN` version to use.
    pub version: u32,
    /// Largest message, bytes.
    pub chunk: usize,
    /// Requests in flight per connection and direction.
    pub in_flight: usize,
    /// Streams of the raw TCP baseline.
    pub raw_streams: usize,
    /// Check every result bit by bit.
    pub verify: bool,
    /// Turn loss injection off through the control API.
    pub lossless: bool,
    /// Seconds before any single wait gives up.
    pub timeout_s: f64,
    /// The work.
    pub task: Task,
}

impl Job {
    /// A collectives job with the harness defaults for `library`.
    pub fn collectives(library: PathBuf, links: Vec<LinkKind>, runs: Vec<RunSpec>) -> Job {
        Job {
            library,
            version: super::plugin_client::MAX_VERSION,
            chunk: DEFAULT_CHUNK,
            in_flight: MAX_IN_FLIGHT,
            raw_streams: raw_streams_default(),
            verify: true,
            lossless: false,
            timeout_s: 60.0,
            task: Task::Collectives { links, runs },
        }
    }

    /// How long any single wait may take: `timeout_s`, within 0.1 s to an hour.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_s.clamp(0.1, 3600.0))
    }
}

/// Streams per connection the plugin uses (`NCCL_LOSSY_NSOCKS`, else its default), read as
/// the plugin reads it, so the baseline matches it. Settings the plugin would refuse give
/// the default here (the plugin's init then fails loudly).
pub fn raw_streams_default() -> usize {
    SocketConfig::from_env().map_or(DEFAULT_NSOCKS, |config| config.nsocks)
}

/// One run's outcome on one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// Link kind.
    pub link: LinkKind,
    /// Collective.
    pub collective: Collective,
    /// Element type.
    pub dtype: DataType,
    /// Bytes of the full buffer.
    pub bytes: usize,
    /// Timed repetitions.
    pub iters: usize,
    /// Mean seconds per repetition on this rank.
    pub seconds: f64,
    /// Bit-exact (true when not verified).
    pub ok: bool,
    /// Elements that differed.
    pub mismatches: usize,
    /// First differing element.
    pub first_mismatch: Option<usize>,
}

/// What a worker prints, as one JSON line on stdout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The rank.
    pub rank: usize,
    /// Plugin name as the library reports it.
    pub plugin: String,
    /// ABI version used.
    pub version: u32,
    /// Collective runs, in job order (plugin first, then raw, per run).
    pub results: Vec<RunResult>,
    /// Grouped-receive groups checked.
    pub groups_checked: usize,
    /// What the received packets of a [`Task::Messages`] job looked like.
    #[serde(default)]
    pub census: PacketCensus,
    /// What a [`Task::Stress`] job moved.
    #[serde(default)]
    pub stress: StressCounts,
}

/// Runs `job` as `rank` of the run whose bootstrap is `boot`.
pub fn run_job(job: &Job, boot: &mut Bootstrap) -> Result<WorkerReport> {
    let lib = PluginLibrary::open(&job.library)?;
    if job.lossless {
        lib.set_loss_enabled(false)?;
    }
    let mut report = WorkerReport {
        rank: boot.rank(),
        plugin: String::new(),
        version: job.version,
        results: Vec::new(),
        groups_checked: 0,
        census: PacketCensus::default(),
        stress: StressCounts::default(),
    };
    match &job.task {
        Task::Collectives { links, runs } => {
            run_collectives(job, &lib, boot, links, runs, &mut report)?
        }
        Task::Grouped { count, rounds } => {
            report.groups_checked = grouped(job, &lib, boot, *count, *rounds, &mut report)?
        }
        Task::Messages {
            bytes,
            count,
            mtu,
            op_bits,
        } => {
            let shape = MessageShape {
                bytes: *bytes,
                count: *count,
                mtu: (*mtu).max(1),
                op_bits: *op_bits,
            };
            report.census = messages(job, &lib, boot, &shape, &mut report)?
        }
        Task::Stress {
            comms,
            groups,
            in_flight,
        } => {
            let shape = StressShape {
                comms: *comms,
                groups: *groups,
                in_flight: (*in_flight).clamp(1, MAX_IN_FLIGHT),
            };
            report.stress = stress(job, &lib, boot, &shape, &mut report)?
        }
    }
    boot.barrier()?;
    Ok(report)
}

/// Whether loss injection is on while `kind` runs.
fn loss_on(job: &Job, kind: LinkKind) -> bool {
    !job.lossless && kind != LinkKind::PluginLossless
}

fn run_collectives(
    job: &Job,
    lib: &Rc<PluginLibrary>,
    boot: &mut Bootstrap,
    links: &[LinkKind],
    runs: &[RunSpec],
    report: &mut WorkerReport,
) -> Result<()> {
    let (rank, n) = (boot.rank(), boot.nranks());
    let mut opened: Vec<(LinkKind, Box<dyn RingLink>)> = Vec::new();
    for &kind in links {
        let link: Box<dyn RingLink> = match kind {
            LinkKind::Plugin | LinkKind::PluginLossless => {
                let comm_id = if kind == LinkKind::Plugin {
                    0x10551
                } else {
                    0x10552
                };
                let link =
                    PluginLink::connect_ring(lib, job.version, comm_id, boot, job.timeout())?;
                report.plugin = link.client().name();
                Box::new(link)
            }
            LinkKind::RawTcp => Box::new(RawTcpLink::connect_ring(
                boot,
                job.raw_streams,
                job.timeout(),
            )?),
        };
        opened.push((kind, link));
    }
    let mut staging = Staging::new(job.chunk);
    for run in runs {
        let spec = CollectiveSpec {
            collective: run.collective,
            dtype: run.dtype,
            count: run.bytes / run.dtype.size(),
            chunk: job.chunk,
            in_flight: job.in_flight,
            timeout: job.timeout(),
        };
        let input = collectives::make_input(&spec, rank, n);
        let mut output = vec![0u8; output_len(&spec, rank, n)];
        let mut run_once = |link: &mut Box<dyn RingLink>, output: &mut [u8]| {
            collectives::run(link.as_mut(), &mut staging, &spec, rank, n, &input, output)
        };
        for (kind, link) in opened.iter_mut() {
            lib.set_loss_enabled(loss_on(job, *kind))?;
            for _ in 0..run.warmup {
                run_once(link, &mut output)?;
            }
        }
        // Iterations alternate between the links, each after a barrier, so a noisy neighbour
        // on a shared machine slows both alike and the ratio stays meaningful.
        let iters = run.iters.max(1);
        let mut seconds = vec![0.0f64; opened.len()];
        let mut verdicts = vec![collectives::Verdict::default(); opened.len()];
        for iter in 0..iters {
            for (i, (kind, link)) in opened.iter_mut().enumerate() {
                output.fill(0);
                // Senders decide drops, so every rank switches before the barrier.
                lib.set_loss_enabled(loss_on(job, *kind))?;
                boot.barrier()?;
                let start = Instant::now();
                run_once(link, &mut output)?;
                seconds[i] += start.elapsed().as_secs_f64();
                if job.verify && iter + 1 == iters {
                    verdicts[i] = collectives::verify(&spec, rank, n, &output);
                }
            }
        }
        for (i, (kind, _)) in opened.iter().enumerate() {
            report.results.push(RunResult {
                link: *kind,
                collective: run.collective,
                dtype: run.dtype,
                bytes: spec.count * run.dtype.size(),
                iters,
                seconds: seconds[i] / iters as f64,
                ok: verdicts[i].ok(),
                mismatches: verdicts[i].mismatches,
                first_mismatch: verdicts[i].first_mismatch,
            });
        }
    }
    // No barrier before closing: a sender's last requests may complete before the next rank
    // has read everything, and the transport delivers those bytes after the close
    // (docs/harness.md, "Teardown"; tests/faults.rs checks it).
    for (_, link) in opened {
        link.close()?;
    }
    Ok(())
}

/// Size of the message with `tag` from `rank` (distinct per tag, so a mix-up shows).
fn grouped_size(rank: usize, tag: usize, round: usize) -> usize {
    (tag * 4099 + rank * 17 + round * 3) % 20_000 + tag
}

fn grouped_byte(rank: usize, tag: usize, round: usize, i: usize) -> u8 {
    (rank * 31 + tag * 7 + round * 13 + i) as u8
}

/// The grouped-receive exchange of [`Task::Grouped`]; returns the groups checked.
fn grouped(
    job: &Job,
    lib: &Rc<PluginLibrary>,
    boot: &mut Bootstrap,
    count: usize,
    rounds: usize,
    report: &mut WorkerReport,
) -> Result<usize> {
    let (rank, n) = (boot.rank(), boot.nranks());
    let prev = (rank + n - 1) % n;
    let client = PluginClient::init(lib, job.version, 0x6209)?;
    report.plugin = client.name();
    let max_recvs = client.properties(0)?.max_recvs;
    if count < 1 || count > max_recvs.max(1) as usize {
        return Err(Error::invalid_argument(format!(
            "groups of {count} but the plugin's maxRecvs is {max_recvs}"
        )));
    }
    let (send, recv) = ring_comms(&client, boot, job.timeout())?;
    client.set_net_attr(op::SEND_RECV)?;
    let deadline = Instant::now() + job.timeout();
    let cap = 20_000 + count;
    let mut checked = 0;
    for round in 0..rounds {
        let items = (0..count)
            .map(|tag| {
                let mut buf = vec![0u8; cap].into_boxed_slice();
                let mr = recv.reg_mr(&mut buf)?;
                Ok(RecvItem {
                    buf,
                    size: cap,
                    tag: tag as i32,
                    mr,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut rreq = match recv.irecv(items)? {
            Posted::Started(r) => r,
            Posted::Busy(_) => return Err(Error::internal("no receive slot for one request")),
        };
        let mut sreqs = Vec::new();
        for tag in (0..count).rev() {
            let size = grouped_size(rank, tag, round);
            let mut buf: Vec<u8> = (0..size)
                .map(|i| grouped_byte(rank, tag, round, i))
                .collect();
            let mr = send.reg_mr(&mut buf)?;
            match send.isend(buf.into_boxed_slice(), size, tag as i32, mr)? {
                Posted::Started(r) => sreqs.push(r),
                Posted::Busy(_) => return Err(Error::internal("no send slot")),
            }
        }
        while !(rreq.is_done() && sreqs.iter().all(|r| r.is_done())) {
            rreq.test()?;
            for r in sreqs.iter_mut() {
                r.test()?;
            }
            if Instant::now() > deadline {
                return Err(Error::remote("grouped exchange timed out"));
            }
            std::thread::yield_now();
        }
        for r in sreqs {
            r.finish()?;
        }
        let (bufs, sizes) = rreq.finish()?;
        for (tag, (buf, size)) in bufs.iter().zip(&sizes).enumerate() {
            let want = grouped_size(prev, tag, round);
            if *size != want {
                return Err(Error::remote(format!(
                    "round {round}: buffer with tag {tag} got {size} bytes, expected {want}"
                )));
            }
            if let Some(i) = (0..want).find(|&i| buf[i] != grouped_byte(prev, tag, round, i)) {
                return Err(Error::remote(format!(
                    "round {round}: buffer with tag {tag} differs at byte {i}"
                )));
            }
        }
        checked += 1;
    }
    send.close()?;
    recv.close()?;
    client.finalize()?;
    Ok(checked)
}

/// What [`Task::Messages`] sends.
struct MessageShape {
    bytes: usize,
    count: usize,
    mtu: usize,
    op_bits: u32,
}

/// Payload byte `i` of message `msg` from `rank`: never 0 and never [`STALE_BYTE`], so a
/// zeroed or unwritten packet cannot look intact.
fn message_byte(rank: usize, msg: usize, i: usize) -> u8 {
    (1 + (rank * 131 + msg * 31 + i * 7) % 250) as u8
}

/// What a receive buffer holds before the message lands.
const STALE_BYTE: u8 = 0xFF;

fn classify(got: &[u8], want: impl Fn(usize) -> u8, offset: usize) -> Classification {
    if got.iter().enumerate().all(|(i, &b)| b == want(offset + i)) {
        return Classification::Intact;
    }
    if got.iter().all(|&b| b == 0) {
        return Classification::Zeroed;
    }
    if got.iter().all(|&b| b == STALE_BYTE) {
        return Classification::Stale;
    }
    let flipped_bits: u32 = got
        .iter()
        .enumerate()
        .map(|(i, &b)| (b ^ want(offset + i)).count_ones())
        .sum();
    if flipped_bits == 1 {
        Classification::Flipped
    } else {
        Classification::Other
    }
}

enum Classification {
    Intact,
    Zeroed,
    Stale,
    Flipped,
    Other,
}

/// The exchange of [`Task::Messages`]: one message in flight each way at a time.
fn messages(
    job: &Job,
    lib: &Rc<PluginLibrary>,
    boot: &mut Bootstrap,
    shape: &MessageShape,
    report: &mut WorkerReport,
) -> Result<PacketCensus> {
    let (rank, n) = (boot.rank(), boot.nranks());
    let prev = (rank + n - 1) % n;
    let client = PluginClient::init(lib, job.version, 0x3e55)?;
    report.plugin = client.name();
    let (send, recv) = ring_comms(&client, boot, job.timeout())?;
    client.set_net_attr(shape.op_bits)?;
    let mut census = PacketCensus::default();
    for msg in 0..shape.count {
        let mut rbuf = vec![STALE_BYTE; shape.bytes].into_boxed_slice();
        let rmr = recv.reg_mr(&mut rbuf)?;
        let mut rreq = match recv.irecv(vec![RecvItem {
            buf: rbuf,
            size: shape.bytes,
            tag: 0,
            mr: rmr,
        }])? {
            Posted::Started(r) => r,
            Posted::Busy(_) => return Err(Error::internal("no receive slot")),
        };
        let mut sbuf: Vec<u8> = (0..shape.bytes)
            .map(|i| message_byte(rank, msg, i))
            .collect();
        let smr = send.reg_mr(&mut sbuf)?;
        let mut sreq = match send.isend(sbuf.into_boxed_slice(), shape.bytes, 0, smr)? {
            Posted::Started(r) => r,
            Posted::Busy(_) => return Err(Error::internal("no send slot")),
        };
        let deadline = Instant::now() + job.timeout();
        while !(rreq.is_done() && sreq.is_done()) {
            rreq.test()?;
            sreq.test()?;
            if Instant::now() > deadline {
                return Err(Error::remote(format!("message {msg} timed out")));
            }
            std::thread::yield_now();
        }
        sreq.finish()?;
        let (bufs, sizes) = rreq.finish()?;
        let (buf, size) = (&bufs[0], sizes[0]);
        if size != shape.bytes {
            return Err(Error::remote(format!(
                "message {msg}: got {size} bytes, expected {}",
                shape.bytes
            )));
        }
        for (p, packet) in buf[..size].chunks(shape.mtu).enumerate() {
            census.packets += 1;
            let want = |i: usize| message_byte(prev, msg, i);
            match classify(packet, want, p * shape.mtu) {
                Classification::Intact => census.intact += 1,
                Classification::Zeroed => census.zeroed += 1,
                Classification::Stale => census.stale += 1,
                Classification::Flipped => census.flipped += 1,
                Classification::Other => census.other += 1,
            }
        }
    }
    send.close()?;
    recv.close()?;
    client.finalize()?;
    Ok(census)
}

/// What [`Task::Stress`] runs.
struct StressShape {
    comms: usize,
    groups: usize,
    in_flight: usize,
}

fn mix(a: u64, b: u64, c: u64, d: u64) -> u64 {
    let mut x = a
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        .wrapping_add(c.wrapping_mul(0x1656_67b1_9e37_79f9))
        .wrapping_add(d);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

/// Messages in group `g` of communicator `c` (the same on both ends): 1 to 8.
fn stress_group_len(c: usize, g: usize) -> usize {
    1 + (mix(c as u64, g as u64, 1, 0) % 8) as usize
}

/// Tag of message `m` of a group: every third group reuses tags, so several buffers of one
/// grouped receive share a tag.
fn stress_tag(g: usize, m: usize) -> i32 {
    if g % 3 == 0 {
        (m % 2) as i32
    } else {
        m as i32
    }
}

/// Size of message `m` of group `g` of communicator `c` from `rank`: 0, small odd and even
/// sizes, sizes around the 64 KiB chunk boundary, and a few of 256 KiB + 3.
fn stress_size(rank: usize, c: usize, g: usize, m: usize) -> usize {
    const SIZES: [usize; 16] = [
        0, 1, 3, 17, 255, 1000, 4095, 4096, 4097, 65_535, 65_536, 65_537, 100_001, 131_073,
        199_999, 262_147,
    ];
    SIZES[(mix(rank as u64, c as u64, g as u64, m as u64) % 16) as usize]
}

fn stress_byte(seed: u64, i: usize) -> u8 {
    (seed.wrapping_add((i as u64).wrapping_mul(0x2545_f491)) >> 13) as u8 ^ i as u8
}

fn stress_seed(rank: usize, c: usize, g: usize, m: usize) -> u64 {
    mix(rank as u64 + 7, c as u64, g as u64, m as u64 + 11)
}

/// For buffer `b` of a group of `k`: the message that lands in it. Buffers are posted with
/// the messages' tags in reverse order; the `j`-th buffer with a tag gets the `j`-th message
/// with that tag.
fn stress_message_for_buffer(g: usize, k: usize, b: usize) -> usize {
    let tag = stress_tag(g, k - 1 - b);
    let j = (0..b).filter(|&x| stress_tag(g, k - 1 - x) == tag).count();
    (0..k)
        .filter(|&m| stress_tag(g, m) == tag)
        .nth(j)
        .unwrap_or(k - 1 - b)
}

struct StressComm {
    send: super::plugin_client::SendComm,
    recv: super::plugin_client::RecvComm,
    sends: std::collections::VecDeque<super::plugin_client::Request>,
    recvs: std::collections::VecDeque<(super::plugin_client::Request, usize)>,
    next_send: (usize, usize),
    next_recv: usize,
}

/// The exchange of [`Task::Stress`].
fn stress(
    job: &Job,
    lib: &Rc<PluginLibrary>,
    boot: &mut Bootstrap,
    shape: &StressShape,
    report: &mut WorkerReport,
) -> Result<StressCounts> {
    let (rank, n) = (boot.rank(), boot.nranks());
    let prev = (rank + n - 1) % n;
    let clients = (0..shape.comms)
        .map(|c| PluginClient::init(lib, job.version, 0x5700 + c as u64))
        .collect::<Result<Vec<_>>>()?;
    if let Some(first) = clients.first() {
        report.plugin = first.name();
    }
    let mut handles = Vec::with_capacity(shape.comms * HANDLE_BYTES);
    let mut listens = Vec::with_capacity(shape.comms);
    for client in &clients {
        let (handle, listen) = client.listen(0)?;
        handles.extend_from_slice(&handle);
        listens.push(listen);
    }
    let all = boot.all_gather(&handles)?;
    let next = &all[(rank + 1) % n];
    if next.len() != handles.len() {
        return Err(Error::remote("the next rank has another number of comms"));
    }
    let mut comms = Vec::with_capacity(shape.comms);
    for (c, (client, mut listen)) in clients.iter().zip(listens).enumerate() {
        let h: [u8; HANDLE_BYTES] = next[c * HANDLE_BYTES..(c + 1) * HANDLE_BYTES]
            .try_into()
            .map_err(|_| Error::remote("bad handle size"))?;
        let (send, recv) = establish(client.connect(0, &h), &mut listen, job.timeout())?;
        listen.close()?;
        client.set_net_attr(op::SEND_RECV)?;
        comms.push(StressComm {
            send,
            recv,
            sends: Default::default(),
            recvs: Default::default(),
            next_send: (0, 0),
            next_recv: 0,
        });
    }
    let mut counts = StressCounts {
        comms: shape.comms as u64,
        ..StressCounts::default()
    };
    let start = Instant::now();
    let deadline = start + job.timeout();
    let mut idle_since = Instant::now();
    loop {
        let mut progress = false;
        let mut busy = false;
        let mut in_flight = 0;
        for (c, comm) in comms.iter_mut().enumerate() {
            // Receives: one grouped irecv per group.
            while comm.recvs.len() < shape.in_flight && comm.next_recv < shape.groups {
                let g = comm.next_recv;
                let k = stress_group_len(c, g);
                let items = (0..k)
                    .map(|b| {
                        let m = stress_message_for_buffer(g, k, b);
                        let cap = stress_size(prev, c, g, m) + b % 5;
                        let mut buf = vec![0xa5u8; cap].into_boxed_slice();
                        let mr = comm.recv.reg_mr(&mut buf)?;
                        Ok(RecvItem {
                            buf,
                            size: cap,
                            tag: stress_tag(g, k - 1 - b),
                            mr,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                match comm.recv.irecv(items)? {
                    Posted::Started(r) => {
                        comm.recvs.push_back((r, g));
                        comm.next_recv += 1;
                        progress = true;
                    }
                    Posted::Busy(_) => break,
                }
            }
            // Sends: one request per message.
            while comm.sends.len() < shape.in_flight && comm.next_send.0 < shape.groups {
                let (g, m) = comm.next_send;
                let size = stress_size(rank, c, g, m);
                let seed = stress_seed(rank, c, g, m);
                let mut buf: Vec<u8> = (0..size).map(|i| stress_byte(seed, i)).collect();
                let mr = comm.send.reg_mr(&mut buf)?;
                match comm
                    .send
                    .isend(buf.into_boxed_slice(), size, stress_tag(g, m), mr)?
                {
                    Posted::Started(r) => {
                        comm.sends.push_back(r);
                        comm.next_send = if m + 1 == stress_group_len(c, g) {
                            (g + 1, 0)
                        } else {
                            (g, m + 1)
                        };
                        progress = true;
                    }
                    Posted::Busy(_) => break,
                }
            }
            in_flight += comm.sends.len() + comm.recvs.len();
            // Only the oldest request of each queue is tested, as NCCL's proxy does.
            while let Some(r) = comm.sends.front_mut() {
                if r.test()?.is_none() {
                    break;
                }
                if let Some(r) = comm.sends.pop_front() {
                    r.finish()?;
                }
                progress = true;
            }
            while let Some((r, _)) = comm.recvs.front_mut() {
                if r.test()?.is_none() {
                    break;
                }
                let Some((r, g)) = comm.recvs.pop_front() else {
                    break;
                };
                let (bufs, sizes) = r.finish()?;
                let k = bufs.len();
                for (b, (buf, &size)) in bufs.iter().zip(&sizes).enumerate() {
                    let m = stress_message_for_buffer(g, k, b);
                    let want = stress_size(prev, c, g, m);
                    if size != want {
                        return Err(Error::remote(format!(
                            "comm {c} group {g} buffer {b}: {size} bytes, expected {want}"
                        )));
                    }
                    let seed = stress_seed(prev, c, g, m);
                    if let Some(i) = (0..size).find(|&i| buf[i] != stress_byte(seed, i)) {
                        return Err(Error::remote(format!(
                            "comm {c} group {g} buffer {b}: byte {i} differs"
                        )));
                    }
                    counts.messages += 1;
                    counts.zero_byte += u64::from(size == 0);
                    counts.bytes += size as u64;
                }
                counts.groups += 1;
                progress = true;
            }
            busy |= comm.next_recv < shape.groups
                || comm.next_send.0 < shape.groups
                || !comm.sends.is_empty()
                || !comm.recvs.is_empty();
        }
        counts.peak_in_flight = counts.peak_in_flight.max(in_flight as u64);
        if !busy {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::remote(format!(
                "stress run not done within {:?} (idle for {:?})",
                job.timeout(),
                idle_since.elapsed()
            )));
        }
        if progress {
            idle_since = Instant::now();
        } else {
            std::thread::yield_now();
        }
    }
    counts.seconds = start.elapsed().as_secs_f64();
    // Closed at once, no barrier: the next rank may still be reading our last messages.
    for comm in comms {
        comm.send.close()?;
        comm.recv.close()?;
    }
    for client in clients {
        client.finalize()?;
    }
    Ok(counts)
}
