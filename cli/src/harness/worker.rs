//! What one rank does: a [`Job`] in, a [`WorkerReport`] out. `lossy worker` runs this in its
//! own process; tests may run it in theirs. The point-to-point exchanges (grouped receives,
//! classified messages, many communicators at once) are in [`exchanges`].

mod exchanges;

use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use exchanges::{grouped, messages, stress, GroupShape, MessageShape, StressShape};

use super::bootstrap::Bootstrap;
use super::collectives::{
    self, output_len, Collective, CollectiveSpec, DataType, Staging, DEFAULT_CHUNK,
};
use super::net::{PluginLink, RawTcpLink, RingLink, MAX_IN_FLIGHT};
use super::plugin_client::PluginLibrary;
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
    /// Another net plugin library (entry `i` of [`Job::peer_libraries`], e.g. NCCL's own
    /// Socket transport built as a plugin, or another build of this one) on its own
    /// connections: a rival timed in the same processes and moments as the plugin, so the
    /// machine's noise cannot favour either. With this project's control API it runs under
    /// the job's `lossless`.
    Peer(usize),
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
    /// Grouped receives: each rank sends `depth` groups of `count` tagged messages to the next
    /// rank, interleaved by tag in reverse tag order, and receives them from the previous one
    /// with one `irecv` of `count` buffers per group when the plugin's `maxRecvs` allows it
    /// (as NCCL's proxy does), one `irecv` per message otherwise.
    Grouped {
        /// Messages per group (at most 8).
        count: usize,
        /// Groups in flight at once (0 counts as 1).
        #[serde(default)]
        depth: usize,
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
    /// The libraries of the [`LinkKind::Peer`] links, in their order.
    #[serde(default)]
    pub peer_libraries: Vec<PathBuf>,
    /// `ncclNetPlugin_vN` version to use.
    pub version: u32,
    /// Largest message, bytes.
    pub chunk: usize,
    /// Requests in flight per connection and direction.
    pub in_flight: usize,
    /// Streams of the raw TCP baseline, per comm and direction.
    pub raw_streams: usize,
    /// Ring channels per collective (NCCL's channels): each link kind opens this many send
    /// and receive comms per rank, every one carrying a contiguous slice of the buffer.
    #[serde(default = "one")]
    pub comms: usize,
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
            peer_libraries: Vec::new(),
            version: super::plugin_client::MAX_VERSION,
            chunk: DEFAULT_CHUNK,
            in_flight: MAX_IN_FLIGHT,
            raw_streams: raw_streams_default(),
            comms: 1,
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

fn one() -> usize {
    1
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
    /// Seconds of every timed repetition on this rank, in order.
    #[serde(default)]
    pub samples: Vec<f64>,
    /// Send comms (ring channels) the link opened on this rank.
    #[serde(default)]
    pub comms: usize,
    /// Sockets per comm and direction of a raw TCP link (0 for the plugin, whose sockets
    /// are its own).
    #[serde(default)]
    pub streams: usize,
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
    /// Names the peer libraries report, in [`Job::peer_libraries`]' order.
    #[serde(default)]
    pub peers: Vec<String>,
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

/// What every rank of a job must be given alike, each with the options that set it.
fn agreed(job: &Job) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    match &job.task {
        Task::Collectives { links, runs } => {
            let list =
                |f: &dyn Fn(&RunSpec) -> String| runs.iter().map(f).collect::<Vec<_>>().join(", ");
            out.push((
                "--sizes, --dtype",
                list(&|r| format!("{} {} B {}", r.collective, r.bytes, r.dtype)),
            ));
            out.push((
                "--iters, --warmup",
                list(&|r| format!("{}+{}", r.iters, r.warmup)),
            ));
            out.push((
                "the links (--vs-lossless, --vs-library)",
                format!("{links:?}"),
            ));
        }
        other => out.push(("the task", serde_json::to_string(other).unwrap_or_default())),
    }
    out.push(("--chunk", job.chunk.to_string()));
    out.push(("--comms", job.comms.to_string()));
    out.push((
        "--raw-streams (else NCCL_LOSSY_NSOCKS)",
        job.raw_streams.to_string(),
    ));
    out.push(("--lossless", job.lossless.to_string()));
    out.push(("requests in flight", job.in_flight.to_string()));
    out
}

/// Fails, on every rank alike, unless every rank of a multi-process job was given the same
/// work: each reads its own command line, and ranks that ran different collectives met in
/// the ring anyway, the result reading as data that was not bit-exact on rank 0 and as a
/// success on the others. The error names the first rank and the options that differ.
pub fn check_same_work(job: &Job, boot: &mut Bootstrap) -> Result<()> {
    let mine = agreed(job);
    let values: Vec<&String> = mine.iter().map(|(_, v)| v).collect();
    let blob = serde_json::to_vec(&values)
        .map_err(|e| Error::internal(format!("cannot encode the job: {e}")))?;
    let all = boot.all_gather(&blob)?;
    let decode = |b: &[u8]| serde_json::from_slice::<Vec<String>>(b).unwrap_or_default();
    let first = decode(&all[0]);
    for (rank, blob) in all.iter().enumerate().skip(1) {
        let theirs = decode(blob);
        if theirs == first {
            continue;
        }
        let (what, a, b) = mine
            .iter()
            .zip(first.iter().zip(&theirs))
            .find(|(_, (a, b))| a != b)
            .map_or(("the job", "?", "?"), |((what, _), (a, b))| {
                (*what, a.as_str(), b.as_str())
            });
        return Err(Error::invalid_argument(format!(
            "rank {rank} was given other work than rank 0 (every rank needs the same \
             options): {what}: rank 0 `{a}`, rank {rank} `{b}`"
        )));
    }
    Ok(())
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
        peers: Vec::new(),
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
        Task::Grouped {
            count,
            depth,
            rounds,
        } => {
            let shape = GroupShape {
                count: *count,
                depth: *depth,
                rounds: *rounds,
            };
            report.groups_checked = grouped(job, &lib, boot, &shape, &mut report)?
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

/// One link kind's ring channels, one per comm.
type Channels = Vec<Box<dyn RingLink>>;

/// The library a plugin link drives and its comm id (each plugin link is a context of its
/// own; a peer's is in another library); `None` for the raw TCP link.
fn link_library(
    kind: LinkKind,
    lib: &Rc<PluginLibrary>,
    job: &Job,
) -> Result<Option<(Rc<PluginLibrary>, u64)>> {
    Ok(Some(match kind {
        LinkKind::RawTcp => return Ok(None),
        LinkKind::Plugin => (Rc::clone(lib), 0x10551),
        LinkKind::PluginLossless => (Rc::clone(lib), 0x10552),
        LinkKind::Peer(i) => {
            let path = job.peer_libraries.get(i).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "peer link {i} has no library ({} given)",
                    job.peer_libraries.len()
                ))
            })?;
            let peer = PluginLibrary::open(path)?;
            // Another build of this plugin (an A/B of two builds) runs under the same
            // `--lossless` as ours; a library without our control API is left as it is.
            if peer.switches_loss() {
                peer.set_loss_enabled(!job.lossless)?;
            }
            (peer, 0x10553 + i as u64)
        }
    }))
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
    let channels = job.comms.max(1);
    let mut opened: Vec<(LinkKind, Channels, usize)> = Vec::new();
    for &kind in links {
        let (set, streams): (Channels, usize) = match link_library(kind, lib, job)? {
            Some((library, comm_id)) => {
                let set = PluginLink::connect_channels(
                    &library,
                    job.version,
                    comm_id,
                    boot,
                    job.timeout(),
                    channels,
                )?;
                if let Some(first) = set.first() {
                    let name = first.client().name();
                    if let LinkKind::Peer(i) = kind {
                        if report.peers.len() <= i {
                            report.peers.resize(i + 1, String::new());
                        }
                        report.peers[i] = name;
                    } else {
                        report.plugin = name;
                        report.version = first.client().version();
                    }
                }
                let set = set
                    .into_iter()
                    .map(|l| Box::new(l) as Box<dyn RingLink>)
                    .collect();
                (set, 0)
            }
            None => {
                let set = (0..channels)
                    .map(|_| {
                        RawTcpLink::connect_ring(boot, job.raw_streams, channels, job.timeout())
                    })
                    .collect::<Result<Vec<_>>>()?;
                // The sockets the links really opened, for the table's header.
                let streams = set.first().map_or(0, RawTcpLink::streams);
                let set = set
                    .into_iter()
                    .map(|l| Box::new(l) as Box<dyn RingLink>)
                    .collect();
                (set, streams)
            }
        };
        opened.push((kind, set, streams));
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
        let (in_len, out_len) = (
            collectives::input_len(&spec, rank, n),
            output_len(&spec, rank, n),
        );
        let too_big = || buffers_error(&spec, in_len, out_len);
        let input = collectives::make_input(&spec, rank, n).ok_or_else(too_big)?;
        let mut output = collectives::try_zeroed(out_len).ok_or_else(too_big)?;
        let mut run_once = |set: &mut Channels, output: &mut [u8]| {
            let mut refs: Vec<&mut dyn RingLink> = set
                .iter_mut()
                .map(|l| &mut **l as &mut dyn RingLink)
                .collect();
            collectives::run_channels(&mut refs, &mut staging, &spec, rank, n, &input, output)
        };
        // The worst iteration's verdict is the link's, warm-up iterations included: their
        // result is the plugin's as much as a timed one's.
        let mut verdicts = vec![collectives::Verdict::default(); opened.len()];
        let worst = |verdict: &mut collectives::Verdict, v: collectives::Verdict| {
            if !v.ok() && v.mismatches >= verdict.mismatches {
                *verdict = v;
            }
        };
        for (i, (kind, set, _)) in opened.iter_mut().enumerate() {
            lib.set_loss_enabled(loss_on(job, *kind))?;
            for _ in 0..run.warmup {
                output.fill(0);
                run_once(set, &mut output)?;
                if job.verify {
                    let v = collectives::verify_channels(&spec, set.len(), rank, n, &output);
                    worst(&mut verdicts[i], v);
                }
            }
        }
        // Iterations alternate between the links, each after a barrier, so a noisy neighbour
        // on a shared machine slows both alike and the ratio stays meaningful.
        let iters = run.iters.max(1);
        let mut samples = vec![Vec::with_capacity(iters); opened.len()];
        let nlinks = opened.len();
        // Every timed iteration is checked (only the last was: a result that came out wrong
        // in an earlier one passed): the first in full, the others by comparing them with
        // the first output that checked out (cheap beside the run; outside the timing), and
        // in full when they differ from it. Without memory for the copy, each in full.
        let mut reference: Option<(usize, Vec<u8>)> = None;
        for iter in 0..iters {
            // Which link goes first alternates too: the first after the barrier pays for the
            // ranks waking from it at different times.
            for k in 0..nlinks {
                let i = if iter % 2 == 0 { k } else { nlinks - 1 - k };
                let (kind, set, _) = &mut opened[i];
                output.fill(0);
                // Senders decide drops, so every rank switches before the barrier.
                lib.set_loss_enabled(loss_on(job, *kind))?;
                boot.barrier()?;
                let start = Instant::now();
                run_once(set, &mut output)?;
                samples[i].push(start.elapsed().as_secs_f64());
                if job.verify {
                    let channels = set.len();
                    let same = reference
                        .as_ref()
                        .is_some_and(|(c, r)| *c == channels && r[..] == output[..]);
                    if !same {
                        let v = collectives::verify_channels(&spec, channels, rank, n, &output);
                        if v.ok() && reference.is_none() {
                            reference = collectives::try_zeroed(output.len()).map(|mut copy| {
                                copy.copy_from_slice(&output);
                                (channels, copy)
                            });
                        }
                        worst(&mut verdicts[i], v);
                    }
                }
            }
        }
        for (i, (kind, set, streams)) in opened.iter().enumerate() {
            let samples = std::mem::take(&mut samples[i]);
            report.results.push(RunResult {
                link: *kind,
                collective: run.collective,
                dtype: run.dtype,
                bytes: spec.count * run.dtype.size(),
                iters,
                seconds: samples.iter().sum::<f64>() / iters as f64,
                samples,
                comms: set.len(),
                streams: *streams,
                ok: verdicts[i].ok(),
                mismatches: verdicts[i].mismatches,
                first_mismatch: verdicts[i].first_mismatch,
            });
        }
    }
    // No barrier before closing: a sender's last requests may complete before the next rank
    // has read everything, and the transport delivers those bytes after the close
    // (docs/harness.md, "Teardown"; tests/faults.rs checks it).
    for (_, set, _) in opened {
        for link in set {
            link.close()?;
        }
    }
    Ok(())
}

/// The error for a run whose input and output buffers (`input` and `output` bytes) cannot be
/// allocated: the size, about how much memory a rank needs, and what to change.
fn buffers_error(spec: &CollectiveSpec, input: usize, output: usize) -> Error {
    let mib = |bytes: usize| format!("{} MiB", bytes.div_ceil(1 << 20));
    let size = spec.count * spec.dtype.size();
    Error::system(format!(
        "cannot allocate the buffers of the {} {} run: each rank needs about {} for them ({} \
         input, {} output) and this process's address space (`ulimit -v`: {}) or the \
         machine's free memory does not have it: raise `ulimit -v` or choose smaller --sizes",
        mib(size),
        spec.collective,
        mib(input + output),
        mib(input),
        mib(output),
        address_space_limit(),
    ))
}

/// The soft `RLIMIT_AS`, for messages: KiB as `ulimit -v` shows it, or "unlimited".
fn address_space_limit() -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct we pass, which lives across the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) };
    match rc {
        0 if lim.rlim_cur != libc::RLIM_INFINITY => format!("{} KiB", lim.rlim_cur / 1024),
        0 => "unlimited".to_string(),
        _ => "unknown".to_string(),
    }
}
