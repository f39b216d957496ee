//! The point-to-point exchanges a worker runs besides collectives, each checking every byte
//! it receives: grouped receives ([`Grouped`]), classified messages ([`Messages`]) and many
//! communicators driven at once ([`Stress`]).
//!
//! [`Grouped`]: super::Task::Grouped
//! [`Messages`]: super::Task::Messages
//! [`Stress`]: super::Task::Stress

use std::rc::Rc;
use std::time::Instant;

use super::{Job, PacketCensus, StressCounts, WorkerReport};
use crate::harness::bootstrap::Bootstrap;
use crate::harness::net::ring_comms;
use crate::harness::plugin_client::{
    establish, op, CommShape, HostBuffer, MrHandle, PluginClient, PluginLibrary, Posted, RecvComm,
    RecvItem, Request, SendComm, HANDLE_BYTES,
};
use nccl_net_lossy::{Error, Result};

/// Posts a receive of `items` as NCCL's proxy does (`src/transport/net.cc`,
/// `recvProxyProgress`): while the plugin answers "not yet" (a NULL request), the same
/// buffers are posted again, after `progress` (tests of the requests already in flight),
/// until `deadline`.
fn irecv_until_started(
    recv: &RecvComm,
    mut items: Vec<RecvItem>,
    deadline: Instant,
    mut progress: impl FnMut() -> Result<()>,
) -> Result<Request> {
    let shape: Vec<(usize, i32, MrHandle)> = items.iter().map(|i| (i.size, i.tag, i.mr)).collect();
    loop {
        match recv.irecv(items)? {
            Posted::Started(r) => return Ok(r),
            Posted::Busy(back) => {
                if Instant::now() > deadline {
                    return Err(Error::remote("the plugin answered every receive with NULL"));
                }
                progress()?;
                std::thread::yield_now();
                items = back
                    .into_iter()
                    .zip(&shape)
                    .map(|(buf, &(size, tag, mr))| RecvItem { buf, size, tag, mr })
                    .collect();
            }
        }
    }
}

/// Posts a send of `buf[..size]` as [`irecv_until_started`] posts a receive (NCCL's
/// `sendProxyProgress` posts a refused send again).
fn isend_until_started(
    send: &SendComm,
    mut buf: HostBuffer,
    (size, tag, mr): (usize, i32, MrHandle),
    deadline: Instant,
    mut progress: impl FnMut() -> Result<()>,
) -> Result<Request> {
    loop {
        match send.isend(buf, size, tag, mr)? {
            Posted::Started(r) => return Ok(r),
            Posted::Busy(mut back) => {
                if Instant::now() > deadline {
                    return Err(Error::remote("the plugin answered every send with NULL"));
                }
                progress()?;
                std::thread::yield_now();
                buf = back
                    .pop()
                    .ok_or_else(|| Error::internal("a refused send gave no buffer back"))?;
            }
        }
    }
}

/// Tests `reqs` (one connection's requests of one direction, in posting order) as NCCL's
/// proxy does: only the oldest not yet done, then the next once it is
/// (`recvProxyProgress`/`sendProxyProgress`, src/transport/net.cc). NCCL's Socket plugin
/// takes a message off the connection when a request is first tested, so testing a later
/// request first would hand it another message's bytes.
fn test_in_order(reqs: &mut [Request]) -> Result<()> {
    for r in reqs.iter_mut().filter(|r| !r.is_done()) {
        if r.test()?.is_none() {
            break;
        }
    }
    Ok(())
}

/// Size of the message with `tag` of `step` from `rank`: distinct per tag (so a mix-up
/// shows), mostly small, every fourth one over 128 KiB so it is cut into chunks on several
/// sockets.
fn grouped_size(rank: usize, tag: usize, step: usize) -> usize {
    let big = if (tag + step) % 4 == 0 { 150_000 } else { 0 };
    (tag * 4099 + rank * 17 + step * 3) % 20_000 + tag + big
}

fn grouped_byte(rank: usize, tag: usize, step: usize, i: usize) -> u8 {
    (rank * 31 + tag * 7 + step * 13 + i) as u8
}

/// How many messages one grouped exchange takes (sends and receives in flight at once).
pub(super) struct GroupShape {
    /// Tags per group (1 to 8).
    pub(super) count: usize,
    /// Groups posted at once (at least 1).
    pub(super) depth: usize,
    /// Times the whole exchange is repeated.
    pub(super) rounds: usize,
}

/// The grouped-receive exchange of [`Task::Grouped`](super::Task::Grouped); returns the
/// groups checked.
///
/// Each round the receiver expects `depth` groups of `count` tagged messages, and the sender
/// posts them interleaved by tag (tag-major, last tag first: `b1 b2 a1 a2` for groups
/// `{a, b}, {a, b}`). As NCCL's proxy does, the receives of a group are one `irecv` only when
/// the plugin advertises `maxRecvs >= count`; otherwise each message has its own `irecv`,
/// posted in the order of the sends.
pub(super) fn grouped(
    job: &Job,
    lib: &Rc<PluginLibrary>,
    boot: &mut Bootstrap,
    shape: &GroupShape,
    report: &mut WorkerReport,
) -> Result<usize> {
    let (rank, n) = (boot.rank(), boot.nranks());
    let prev = (rank + n - 1) % n;
    let (count, depth) = (shape.count, shape.depth.max(1));
    if !(1..=8).contains(&count) {
        return Err(Error::invalid_argument(format!(
            "groups of {count} messages (allowed 1 to 8)"
        )));
    }
    let client = PluginClient::init(lib, job.version, 0x6209)?;
    client.set_shape(CommShape {
        ranks: n,
        channels: 1,
    });
    report.plugin = client.name();
    let max_recvs = client.properties(0)?.max_recvs;
    let group = count > 1 && usize::try_from(max_recvs).is_ok_and(|m| m >= count);
    let (send, recv) = ring_comms(&client, boot, job.timeout())?;
    client.set_net_attr(op::SEND_RECV)?;
    let deadline = Instant::now() + job.timeout();
    let cap = 170_000 + count;
    // (group, tag) of every message of a round, in the order the sender posts them.
    let order: Vec<(usize, usize)> = (0..count)
        .rev()
        .flat_map(|tag| (0..depth).map(move |d| (d, tag)))
        .collect();
    let posts: Vec<Vec<(usize, usize)>> = if group {
        (0..depth)
            .map(|d| (0..count).map(|tag| (d, tag)).collect())
            .collect()
    } else {
        order.iter().map(|&m| vec![m]).collect()
    };
    let mut checked = 0;
    for round in 0..shape.rounds {
        let step = |d: usize| round * depth + d;
        let mut rreqs = Vec::with_capacity(posts.len());
        for post in &posts {
            let items = post
                .iter()
                .map(|&(_, tag)| {
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
            let r = irecv_until_started(&recv, items, deadline, || test_in_order(&mut rreqs))?;
            rreqs.push(r);
        }
        let mut sreqs = Vec::with_capacity(order.len());
        for &(d, tag) in &order {
            let size = grouped_size(rank, tag, step(d));
            let mut buf: Vec<u8> = (0..size)
                .map(|i| grouped_byte(rank, tag, step(d), i))
                .collect();
            let mr = send.reg_mr(&mut buf)?;
            let r = isend_until_started(
                &send,
                buf.into_boxed_slice(),
                (size, tag as i32, mr),
                deadline,
                || test_in_order(&mut rreqs).and_then(|()| test_in_order(&mut sreqs)),
            )?;
            sreqs.push(r);
        }
        while !(rreqs.iter().all(|r| r.is_done()) && sreqs.iter().all(|r| r.is_done())) {
            test_in_order(&mut rreqs)?;
            test_in_order(&mut sreqs)?;
            if Instant::now() > deadline {
                return Err(Error::remote("grouped exchange timed out"));
            }
            std::thread::yield_now();
        }
        for r in sreqs {
            r.finish()?;
        }
        for (post, r) in posts.iter().zip(rreqs) {
            let (bufs, sizes) = r.finish()?;
            for (&(d, tag), (buf, size)) in post.iter().zip(bufs.iter().zip(&sizes)) {
                let want = grouped_size(prev, tag, step(d));
                if *size != want {
                    return Err(Error::remote(format!(
                        "round {round} group {d}: buffer with tag {tag} got {size} bytes, \
                         expected {want}"
                    )));
                }
                if let Some(i) = (0..want).find(|&i| buf[i] != grouped_byte(prev, tag, step(d), i))
                {
                    return Err(Error::remote(format!(
                        "round {round} group {d}: buffer with tag {tag} differs at byte {i}"
                    )));
                }
            }
        }
        checked += depth;
    }
    send.close()?;
    recv.close()?;
    client.finalize()?;
    Ok(checked)
}

/// What [`Task::Messages`](super::Task::Messages) sends.
pub(super) struct MessageShape {
    pub(super) bytes: usize,
    pub(super) count: usize,
    pub(super) mtu: usize,
    pub(super) op_bits: u32,
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

/// The exchange of [`Task::Messages`](super::Task::Messages): one message in flight each
/// way at a time.
pub(super) fn messages(
    job: &Job,
    lib: &Rc<PluginLibrary>,
    boot: &mut Bootstrap,
    shape: &MessageShape,
    report: &mut WorkerReport,
) -> Result<PacketCensus> {
    let (rank, n) = (boot.rank(), boot.nranks());
    let prev = (rank + n - 1) % n;
    let client = PluginClient::init(lib, job.version, 0x3e55)?;
    client.set_shape(CommShape {
        ranks: n,
        channels: 1,
    });
    report.plugin = client.name();
    let (send, recv) = ring_comms(&client, boot, job.timeout())?;
    client.set_net_attr(shape.op_bits)?;
    let mut census = PacketCensus::default();
    for msg in 0..shape.count {
        let mut rbuf = vec![STALE_BYTE; shape.bytes].into_boxed_slice();
        let rmr = recv.reg_mr(&mut rbuf)?;
        let deadline = Instant::now() + job.timeout();
        let item = RecvItem {
            buf: rbuf,
            size: shape.bytes,
            tag: 0,
            mr: rmr,
        };
        let mut rreq = irecv_until_started(&recv, vec![item], deadline, || Ok(()))?;
        let mut sbuf: Vec<u8> = (0..shape.bytes)
            .map(|i| message_byte(rank, msg, i))
            .collect();
        let smr = send.reg_mr(&mut sbuf)?;
        let mut sreq = isend_until_started(
            &send,
            sbuf.into_boxed_slice(),
            (shape.bytes, 0, smr),
            deadline,
            || rreq.test().map(|_| ()),
        )?;
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

/// What [`Task::Stress`](super::Task::Stress) runs.
pub(super) struct StressShape {
    pub(super) comms: usize,
    pub(super) groups: usize,
    pub(super) in_flight: usize,
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

/// Messages in group `g` of communicator `c` (the same on both ends): 1 to 8, and at most
/// the plugin's `maxRecvs` (NCCL groups no more receives than that).
fn stress_group_len(c: usize, g: usize, max_recvs: usize) -> usize {
    1 + (mix(c as u64, g as u64, 1, 0) % max_recvs.clamp(1, 8) as u64) as usize
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
    send: crate::harness::plugin_client::SendComm,
    recv: crate::harness::plugin_client::RecvComm,
    sends: std::collections::VecDeque<crate::harness::plugin_client::Request>,
    recvs: std::collections::VecDeque<(crate::harness::plugin_client::Request, usize)>,
    next_send: (usize, usize),
    next_recv: usize,
}

/// The exchange of [`Task::Stress`](super::Task::Stress).
pub(super) fn stress(
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
    for client in &clients {
        client.set_shape(CommShape {
            ranks: n,
            channels: 1,
        });
    }
    let mut max_recvs = 1;
    if let Some(first) = clients.first() {
        report.plugin = first.name();
        max_recvs = usize::try_from(first.properties(0)?.max_recvs).unwrap_or(1);
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
                let k = stress_group_len(c, g, max_recvs);
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
                        comm.next_send = if m + 1 == stress_group_len(c, g, max_recvs) {
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
