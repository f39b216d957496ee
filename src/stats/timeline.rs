//! The loss timeline: a fixed-size, process-wide ring of per-message events and the Chrome
//! trace (format version 1, see docs/timeline.md) written from it.
//!
//! Recording costs the data path no allocation and no lock: a relaxed `fetch_add` picks the
//! slot, a per-slot sequence number (a seqlock over plain atomic words) tells the reader a
//! finished record from one being written or overwritten. The oldest records are
//! overwritten; the file says how many were recorded and how many it no longer holds.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::writer::{host_name, launcher_rank, sanitize, write_atomically_with};
use crate::ids::{op_name, phase_name};
use crate::{Error, Result};

/// Environment variable naming the directory trace files go to (tracing is off without it).
pub const TRACE_DIR_ENV: &str = "NCCL_LOSSY_TRACE";
/// Environment variable setting the ring's capacity, in messages.
pub const TRACE_EVENTS_ENV: &str = "NCCL_LOSSY_TRACE_EVENTS";
/// Ring capacity when neither the environment nor the profile sets one.
pub const DEFAULT_CAPACITY: usize = 65_536;
/// Version of the trace file layout.
pub const TRACE_FORMAT_VERSION: u32 = 1;

/// Atomic words of one record.
const WORDS: usize = 12;
/// Memory one record of the ring takes: its words and its sequence number.
pub const BYTES_PER_EVENT: usize = (WORDS + 1) * 8;
/// `peer` when the connection's peer is unknown.
const NO_PEER: u64 = u32::MAX as u64;

/// Which side of a connection an event was recorded on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The sender: from `isend` to the `test` that saw the message done.
    Send,
    /// The receiver: from `irecv` to the `test` that saw it done.
    Recv,
}

impl Side {
    /// The name the trace file uses.
    pub fn name(self) -> &'static str {
        match self {
            Side::Send => "send",
            Side::Recv => "recv",
        }
    }
}

/// One message on the timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimelineEvent {
    /// `CLOCK_MONOTONIC` nanoseconds when the message was accepted.
    pub start_ns: u64,
    /// `CLOCK_MONOTONIC` nanoseconds when a `test` saw it done.
    pub end_ns: u64,
    /// Communicator id.
    pub comm_id: u64,
    /// Connection index within the communicator.
    pub connection: u32,
    /// Peer rank, when known.
    pub peer: Option<u32>,
    /// Side of the connection.
    pub side: Side,
    /// Collective slot (see [`crate::ids::op_slot`]).
    pub op: usize,
    /// Phase slot (see [`phase_name`]).
    pub phase: usize,
    /// Training step.
    pub step: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// Packets the message was cut into.
    pub packets: u64,
    /// Packets lost.
    pub lost_packets: u64,
    /// Runs of consecutive lost packets.
    pub loss_events: u64,
    /// Code of the loss effect (the caller names codes when writing).
    pub effect: u8,
    /// Delay `retransmit` added, in nanoseconds.
    pub retransmit_delay_ns: u64,
}

#[derive(Default)]
struct Slot {
    /// 0: empty; odd: being written; `2 * (index + 1)`: holds record `index`.
    seq: AtomicU64,
    words: [AtomicU64; WORDS],
}

/// The ring of the process's last `capacity` messages.
pub struct Timeline {
    slots: Box<[Slot]>,
    head: AtomicU64,
    lost_so_far: AtomicU64,
    /// Records given up because another writer held their slot.
    collided: AtomicU64,
    base_instant: Instant,
    base_monotonic_ns: u64,
}

/// A consistent read of the ring.
pub struct TimelineSnapshot {
    /// The events still held, oldest first, each with the process's lost packets so far.
    pub events: Vec<(TimelineEvent, u64)>,
    /// Ring capacity in messages.
    pub capacity: usize,
    /// Messages recorded since the ring was made.
    pub recorded: u64,
    /// Recorded messages the ring no longer holds.
    pub dropped: u64,
    /// Recorded messages whose records were still being written (counted in `recorded`, in
    /// neither `events` nor `dropped`): a later read holds them.
    pub unsettled: u64,
}

impl Timeline {
    /// Bytes a ring of `capacity` messages takes.
    pub fn bytes_for(capacity: usize) -> usize {
        capacity.max(1).saturating_mul(std::mem::size_of::<Slot>())
    }

    /// A ring of `capacity` messages (at least 1), allocated here once; None when the memory
    /// cannot be had (a large ring under a memory limit), rather than an abort.
    pub fn new(capacity: usize) -> Option<Timeline> {
        let capacity = capacity.max(1);
        let mut slots = Vec::new();
        slots.try_reserve_exact(capacity).ok()?;
        slots.extend((0..capacity).map(|_| Slot::default()));
        Some(Timeline {
            slots: slots.into_boxed_slice(),
            head: AtomicU64::new(0),
            lost_so_far: AtomicU64::new(0),
            collided: AtomicU64::new(0),
            base_instant: Instant::now(),
            base_monotonic_ns: monotonic_ns(),
        })
    }

    /// `CLOCK_MONOTONIC` nanoseconds of `at` (an [`Instant`] reads the same clock).
    pub fn monotonic_of(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.base_instant).as_nanos() as u64;
        let before = self.base_instant.saturating_duration_since(at).as_nanos() as u64;
        (self.base_monotonic_ns + since).saturating_sub(before)
    }

    /// Records one message; never allocates, never blocks.
    pub fn record(&self, event: &TimelineEvent) {
        let lost = if event.lost_packets > 0 {
            self.lost_so_far
                .fetch_add(event.lost_packets, Ordering::Relaxed)
                + event.lost_packets
        } else {
            self.lost_so_far.load(Ordering::Relaxed)
        };
        let index = self.head.fetch_add(1, Ordering::Relaxed);
        let slot = &self.slots[(index % self.slots.len() as u64) as usize];
        let current = slot.seq.load(Ordering::Relaxed);
        if current % 2 == 1
            || slot
                .seq
                .compare_exchange(current, 2 * index + 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            // Another writer is in this slot (the ring wrapped during its write).
            self.collided.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let peer = event.peer.map_or(NO_PEER, u64::from);
        let side = match event.side {
            Side::Send => 0,
            Side::Recv => 1,
        };
        let codes = (event.op as u64 & 0xffff)
            | ((event.phase as u64 & 0xff) << 16)
            | (side << 24)
            | (u64::from(event.effect) << 32);
        let words = [
            event.start_ns,
            event.end_ns,
            event.comm_id,
            (u64::from(event.connection) << 32) | peer,
            codes,
            event.step,
            event.bytes,
            event.packets,
            event.lost_packets,
            event.loss_events,
            event.retransmit_delay_ns,
            lost,
        ];
        for (cell, word) in slot.words.iter().zip(words) {
            cell.store(word, Ordering::Relaxed);
        }
        slot.seq.store(2 * index + 2, Ordering::Release);
    }

    /// Messages recorded since the ring was made (one atomic read).
    pub fn recorded(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// Reads every complete record the ring holds, oldest first.
    /// The copy takes about as much memory as the ring; when that cannot be had (a ring that
    /// just fit under a memory limit), the read fails rather than abort the process.
    pub fn snapshot(&self) -> Result<TimelineSnapshot> {
        let recorded = self.head.load(Ordering::Acquire);
        let capacity = self.slots.len() as u64;
        let held = recorded.min(capacity) as usize;
        let mut events = Vec::new();
        if events.try_reserve_exact(held).is_err() {
            return Err(Error::system(format!(
                "cannot read the trace ring: a copy of its {held} messages needs {} MiB, which \
                 this process cannot allocate (a memory limit, `ulimit -v`?)",
                (held * std::mem::size_of::<(TimelineEvent, u64)>()).div_ceil(1 << 20)
            )));
        }
        let mut unsettled = 0;
        for index in recorded.saturating_sub(capacity)..recorded {
            let slot = &self.slots[(index % capacity) as usize];
            let before = slot.seq.load(Ordering::Acquire);
            if before != 2 * index + 2 {
                // Below: its writer took the index but has not finished (or not begun) the
                // record; above: a later lap's writer took the slot (the record is dropped).
                unsettled += u64::from(before < 2 * index + 2);
                continue;
            }
            let mut words = [0u64; WORDS];
            for (word, cell) in words.iter_mut().zip(&slot.words) {
                *word = cell.load(Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            if slot.seq.load(Ordering::Relaxed) != before {
                continue;
            }
            let peer = words[3] & 0xffff_ffff;
            let codes = words[4];
            events.push((
                TimelineEvent {
                    start_ns: words[0],
                    end_ns: words[1],
                    comm_id: words[2],
                    connection: (words[3] >> 32) as u32,
                    peer: (peer != NO_PEER).then_some(peer as u32),
                    side: if (codes >> 24) & 0xff == 0 {
                        Side::Send
                    } else {
                        Side::Recv
                    },
                    op: (codes & 0xffff) as usize,
                    phase: ((codes >> 16) & 0xff) as usize,
                    step: words[5],
                    bytes: words[6],
                    packets: words[7],
                    lost_packets: words[8],
                    loss_events: words[9],
                    effect: ((codes >> 32) & 0xff) as u8,
                    retransmit_delay_ns: words[10],
                },
                words[11],
            ));
        }
        let dropped = recorded - events.len() as u64 - unsettled;
        Ok(TimelineSnapshot {
            events,
            capacity: self.slots.len(),
            recorded,
            dropped,
            unsettled,
        })
    }
}

static RING: OnceLock<Timeline> = OnceLock::new();

/// Turns the process's ring on with `capacity` messages (the first call decides the size).
pub fn enable(capacity: usize) -> Option<&'static Timeline> {
    if let Some(ring) = RING.get() {
        return Some(ring);
    }
    let ring = Timeline::new(capacity)?;
    Some(RING.get_or_init(|| ring))
}

/// The process's ring, when tracing is on.
pub fn ring() -> Option<&'static Timeline> {
    RING.get()
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec on this stack frame for the whole call, and
    // both clock ids passed here exist on every Linux.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// `(CLOCK_MONOTONIC, CLOCK_REALTIME)` read back to back, in nanoseconds.
pub fn clock_sample() -> (u64, u64) {
    let monotonic = monotonic_ns();
    let epoch = clock_ns(libc::CLOCK_REALTIME);
    (monotonic, epoch)
}

/// The trace file's name for this process.
pub fn trace_file_name() -> String {
    let rank = launcher_rank().map_or_else(|| "x".to_string(), |r| r.to_string());
    format!(
        "lossy-trace-rank{rank}-{}-{}.json",
        sanitize(&host_name()),
        std::process::id()
    )
}

/// Track (thread id) of each event and the tracks' names.
struct TrackIds {
    /// Thread id of each event of the snapshot, in its order.
    of_event: Vec<u64>,
    /// Each track, in thread-id order: (index of its first event, lane), thread id.
    names: Vec<((usize, usize), u64)>,
}

/// One track per connection, plus one more for each message still in flight when another of
/// the same connection began (NCCL keeps several in flight): complete events on one thread
/// must not overlap (Perfetto and chrome://tracing draw only events that nest), so a message
/// takes the connection's first track whose last message ended before it started. The tracks
/// of one connection get consecutive ids, in the order connections first appear.
fn track_ids(events: &[(TimelineEvent, u64)]) -> TrackIds {
    type Connection = (u64, u32, Side, Option<u32>);
    let mut connections: Vec<Connection> = Vec::new();
    let mut of_connection: HashMap<Connection, usize> = HashMap::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (index, (event, _)) in events.iter().enumerate() {
        let key = (event.comm_id, event.connection, event.side, event.peer);
        let slot = *of_connection.entry(key).or_insert_with(|| {
            connections.push(key);
            members.push(Vec::new());
            connections.len() - 1
        });
        members[slot].push(index);
    }
    let mut of_event = vec![0u64; events.len()];
    let mut names = Vec::new();
    let mut next_tid = 0u64;
    for mut indices in members {
        indices.sort_by_key(|&i| (events[i].0.start_ns, i));
        // Per lane: (when its last message ended, index of its first event).
        let mut lanes: Vec<(u64, usize)> = Vec::new();
        let mut lane_of = Vec::with_capacity(indices.len());
        for &i in &indices {
            let event = &events[i].0;
            let end = event.end_ns.max(event.start_ns);
            let lane = match lanes.iter().position(|&(busy, _)| busy <= event.start_ns) {
                Some(lane) => {
                    lanes[lane].0 = end;
                    lane
                }
                None => {
                    lanes.push((end, i));
                    lanes.len() - 1
                }
            };
            lane_of.push((i, lane));
        }
        for (i, lane) in lane_of {
            of_event[i] = next_tid + lane as u64;
        }
        for (lane, &(_, first)) in lanes.iter().enumerate() {
            names.push(((first, lane), next_tid + lane as u64));
        }
        next_tid += lanes.len() as u64;
    }
    TrackIds { of_event, names }
}

/// Writes the Chrome trace of `snapshot` (format version 1) to `out`, `effect_name` naming
/// effect codes. Each event is encoded and written on its own, so the write holds a few events
/// at a time whatever the ring holds (as one JSON value tree, a trace took some 3.6 KB per
/// event: gigabytes for a ring of millions, and an abort under a memory limit).
pub fn encode_trace(
    out: &mut dyn Write,
    snapshot: &TimelineSnapshot,
    effect_name: &dyn Fn(u8) -> &'static str,
) -> io::Result<()> {
    let pid = std::process::id();
    let rank = launcher_rank();
    let (monotonic, epoch) = clock_sample();
    let about = json!({
        "format_version": TRACE_FORMAT_VERSION, "rank": rank, "host": host_name(), "pid": pid,
        "clock": "CLOCK_MONOTONIC",
        "monotonic_to_epoch_ns": epoch as i64 - monotonic as i64,
        "clock_sample": {"monotonic_ns": monotonic, "epoch_ns": epoch},
        "ring_capacity": snapshot.capacity, "recorded": snapshot.recorded,
        "dropped": snapshot.dropped,
        "written_at_unix_ms": SystemTime::now().duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64).unwrap_or(0),
    });
    out.write_all(br#"{"displayTimeUnit":"ns","lossy_trace":"#)?;
    serde_json::to_writer(&mut *out, &about)?;
    out.write_all(br#","traceEvents":["#)?;
    let mut first = true;
    let mut item = |out: &mut dyn Write, value: Value| -> io::Result<()> {
        if !std::mem::take(&mut first) {
            out.write_all(b",")?;
        }
        serde_json::to_writer(out, &value).map_err(io::Error::from)
    };
    let process = match rank {
        Some(rank) => format!("nccl-net-lossy rank {rank}"),
        None => format!("nccl-net-lossy pid {pid}"),
    };
    item(
        out,
        json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}}),
    )?;
    let tids = track_ids(&snapshot.events);
    for (track, tid) in &tids.names {
        let (event, lane) = (&snapshot.events[track.0].0, track.1);
        let peer = event
            .peer
            .map_or_else(|| "?".to_string(), |p| p.to_string());
        let arrow = match event.side {
            Side::Send => "->",
            Side::Recv => "<-",
        };
        let mut name = format!(
            "comm {:#x} conn {} {} {arrow} peer {peer}",
            event.comm_id,
            event.connection,
            event.side.name()
        );
        if lane > 0 {
            name.push_str(&format!(" #{}", lane + 1));
        }
        item(
            out,
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": name}}),
        )?;
    }
    for (index, (event, lost_so_far)) in snapshot.events.iter().enumerate() {
        let tid = tids.of_event[index];
        let collective = op_name(event.op);
        let end_ns = event.end_ns.max(event.start_ns);
        item(
            out,
            json!({
                "ph": "X", "cat": "lossy", "name": collective, "pid": pid, "tid": tid,
                "ts": event.start_ns as f64 / 1000.0,
                "dur": (end_ns - event.start_ns) as f64 / 1000.0,
                "args": {
                    "collective": collective, "comm_id": event.comm_id,
                    "connection": event.connection, "peer": event.peer,
                    "direction": event.side.name(), "phase": phase_name(event.phase),
                    "step": event.step, "bytes": event.bytes, "packets": event.packets,
                    "lost_packets": event.lost_packets, "loss_events": event.loss_events,
                    "effect": effect_name(event.effect),
                    "retransmit_delay_ns": event.retransmit_delay_ns,
                }
            }),
        )?;
        if event.lost_packets > 0 {
            item(
                out,
                json!({"ph": "C", "name": "lost_packets", "pid": pid,
                       "ts": end_ns as f64 / 1000.0, "args": {"lost_packets": lost_so_far}}),
            )?;
        }
    }
    out.write_all(b"]}")
}

/// Writes the trace of `snapshot` into `dir` atomically (a temporary file of its own, then
/// rename), as it is encoded; returns its path.
pub fn write_trace(
    dir: &Path,
    snapshot: &TimelineSnapshot,
    effect_name: &dyn Fn(u8) -> &'static str,
) -> Result<PathBuf> {
    fs::create_dir_all(dir).map_err(|e| {
        Error::system(format!(
            "cannot create trace directory {}: {e}",
            dir.display()
        ))
    })?;
    write_atomically_with(dir, &trace_file_name(), |out| {
        encode_trace(out, snapshot, effect_name)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(i: u64, lost: u64) -> TimelineEvent {
        TimelineEvent {
            start_ns: 1_000 * i,
            end_ns: 1_000 * i + 500,
            comm_id: 0x7f3a,
            connection: 1,
            peer: Some(1),
            side: Side::Send,
            op: 2,
            phase: 1,
            step: i,
            bytes: 4096,
            packets: 1,
            lost_packets: lost,
            loss_events: lost.min(1),
            effect: 2,
            retransmit_delay_ns: 7,
        }
    }

    /// The trace of `snapshot` as [`encode_trace`] writes it, read back.
    fn trace_of(snapshot: &TimelineSnapshot, effect_name: &dyn Fn(u8) -> &'static str) -> Value {
        let mut bytes = Vec::new();
        encode_trace(&mut bytes, snapshot, effect_name).expect("encoded");
        serde_json::from_slice(&bytes).expect("a JSON document")
    }

    #[test]
    fn a_full_ring_keeps_the_newest_and_counts_the_dropped() {
        let ring = Timeline::new(16).expect("a small ring");
        for i in 0..100 {
            ring.record(&event(i, i % 2));
        }
        let snap = ring.snapshot().expect("a snapshot");
        assert_eq!(snap.events.len(), 16);
        assert_eq!((snap.recorded, snap.dropped, snap.capacity), (100, 84, 16));
        let steps: Vec<u64> = snap.events.iter().map(|(e, _)| e.step).collect();
        assert_eq!(steps, (84..100).collect::<Vec<_>>());
        assert_eq!(snap.events[15].0, event(99, 1));
        assert_eq!(snap.events[15].1, 50, "lost packets so far");
    }

    #[test]
    fn a_record_still_being_written_is_unsettled_not_dropped() {
        let ring = Timeline::new(4).expect("a small ring");
        ring.record(&event(0, 0));
        // A writer that took its index and has not written its record yet.
        ring.head.fetch_add(1, Ordering::Relaxed);
        let snap = ring.snapshot().expect("a snapshot");
        assert_eq!(
            (
                snap.recorded,
                snap.events.len(),
                snap.unsettled,
                snap.dropped
            ),
            (2, 1, 1, 0)
        );
    }

    #[test]
    fn the_trace_has_the_documented_shape() {
        let ring = Timeline::new(8).expect("a small ring");
        ring.record(&event(3, 2));
        let trace = trace_of(&ring.snapshot().expect("a snapshot"), &|code| {
            ["a", "b", "c"][code as usize]
        });
        let events = trace["traceEvents"].as_array().expect("events");
        let x = events.iter().find(|e| e["ph"] == "X").expect("an X event");
        assert_eq!(x["ts"], 3.0);
        assert_eq!(x["dur"], 0.5);
        assert_eq!(x["args"]["effect"], "c");
        assert_eq!(x["args"]["lost_packets"], 2);
        assert_eq!(x["args"]["direction"], "send");
        let c = events.iter().find(|e| e["ph"] == "C").expect("a counter");
        assert_eq!(c["args"]["lost_packets"], 2);
        // The track names the communicator in hex, marked as hex (`comm 7f3a` read as decimal).
        let track = events
            .iter()
            .find(|e| e["name"] == "thread_name")
            .expect("a track name");
        assert_eq!(track["args"]["name"], "comm 0x7f3a conn 1 send -> peer 1");
        let meta = &trace["lossy_trace"];
        assert_eq!(meta["ring_capacity"], 8);
        assert_eq!(meta["recorded"], 1);
        assert_eq!(meta["dropped"], 0);
        let sample = &meta["clock_sample"];
        let offset = meta["monotonic_to_epoch_ns"].as_i64().expect("offset");
        assert_eq!(
            sample["epoch_ns"].as_i64().expect("epoch")
                - sample["monotonic_ns"].as_i64().expect("mono"),
            offset
        );
    }

    /// Perfetto and chrome://tracing draw complete events of one thread only when they nest:
    /// messages of one connection in flight at once must not share a track.
    #[test]
    fn overlapping_messages_of_one_connection_never_share_a_track() {
        let ring = Timeline::new(16).expect("a small ring");
        // Four messages posted back to back, each done after the next one was posted (as NCCL
        // pipelines sends), then one that starts after all of them ended.
        for (start, end) in [(0, 150), (100, 250), (200, 350), (300, 450), (1_000, 1_100)] {
            let mut e = event(0, 0);
            e.start_ns = start;
            e.end_ns = end;
            ring.record(&e);
        }
        let trace = trace_of(&ring.snapshot().expect("a snapshot"), &|_| "zero");
        let events = trace["traceEvents"].as_array().expect("events");
        let mut by_tid: HashMap<u64, Vec<(f64, f64)>> = HashMap::new();
        for x in events.iter().filter(|e| e["ph"] == "X") {
            let ts = x["ts"].as_f64().expect("ts");
            let dur = x["dur"].as_f64().expect("dur");
            by_tid
                .entry(x["tid"].as_u64().expect("tid"))
                .or_default()
                .push((ts, ts + dur));
        }
        for (tid, mut spans) in by_tid.clone() {
            spans.sort_by(|a, b| a.0.total_cmp(&b.0));
            for pair in spans.windows(2) {
                assert!(pair[1].0 >= pair[0].1, "track {tid} overlaps: {spans:?}");
            }
        }
        // Two messages at most were in flight at once: two tracks, each named.
        assert_eq!(by_tid.len(), 2, "{by_tid:?}");
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().expect("a name"))
            .collect();
        assert_eq!(
            names,
            [
                "comm 0x7f3a conn 1 send -> peer 1",
                "comm 0x7f3a conn 1 send -> peer 1 #2"
            ]
        );
    }

    const TRACE_MEMORY_CHILD: &str = "LOSSY_TRACE_MEMORY_CHILD";
    const MEMORY_CHILD_EVENTS: u64 = 200_000;

    #[test]
    fn writing_a_full_ring_takes_memory_of_the_rings_order_not_kilobytes_per_event() {
        // Built as one JSON value tree, the trace took about 3.6 KB per event while the file
        // was written: 200,000 events, some 720 MB, which under a 384 MiB limit aborted the
        // process (at NCCL's last close, the write that close waits for). Written as it is
        // encoded, it needs the ring's snapshot (112 bytes an event: some 22 MB) and a buffer.
        let said = crate::test_child::run(
            "stats::timeline::tests::trace_memory_child",
            TRACE_MEMORY_CHILD,
            &[],
            "written:",
        );
        // Every third message lost nothing, and only the others add to the lost-packets counter.
        let counters = MEMORY_CHILD_EVENTS - MEMORY_CHILD_EVENTS.div_ceil(3);
        assert!(
            said.contains(&format!(
                "written: {MEMORY_CHILD_EVENTS} messages, {counters} counters"
            )),
            "{said}"
        );
    }

    #[test]
    #[ignore = "run under a memory limit of its own by the test above"]
    fn trace_memory_child() {
        if std::env::var_os(TRACE_MEMORY_CHILD).is_none() {
            return;
        }
        crate::test_child::limit_address_space(384 << 20);
        let ring = Timeline::new(MEMORY_CHILD_EVENTS as usize).expect("a ring of 21 MB");
        for i in 0..MEMORY_CHILD_EVENTS {
            ring.record(&event(i, i % 3));
        }
        let dir = std::env::temp_dir().join(format!("lossy-trace-memory-{}", std::process::id()));
        let path = write_trace(&dir, &ring.snapshot().expect("a snapshot"), &|_| "zero")
            .expect("the trace written");
        let text = fs::read_to_string(&path).expect("the trace read back");
        std::fs::remove_dir_all(&dir).ok();
        println!(
            "written: {} messages, {} counters",
            text.matches(r#""ph":"X""#).count(),
            text.matches(r#""ph":"C""#).count()
        );
    }

    #[test]
    fn instants_convert_to_the_monotonic_clock() {
        let ring = Timeline::new(1).expect("a small ring");
        let before = monotonic_ns();
        let at = ring.monotonic_of(Instant::now());
        let after = monotonic_ns();
        assert!(
            before <= at + 1_000 && at <= after + 1_000,
            "{before} {at} {after}"
        );
    }

    /// What one record costs: `cargo test --release --lib timeline::tests::record_cost --
    /// --ignored --nocapture` (docs/performance.md quotes it).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn record_cost() {
        let ring = Timeline::new(DEFAULT_CAPACITY).expect("the default ring");
        let n = 10_000_000u64;
        let started = Instant::now();
        for i in 0..n {
            let mut e = event(i, i & 1);
            e.end_ns = ring.monotonic_of(Instant::now());
            ring.record(std::hint::black_box(&e));
        }
        let ns = started.elapsed().as_nanos() as f64 / n as f64;
        println!("{ns:.1} ns per message (Instant::now + record)");
        assert_eq!(ring.snapshot().expect("a snapshot").recorded, n);
    }
}
