//! Ring links: one connection to rank + 1 (sends) and one from rank - 1 (receives), as a
//! ring channel of NCCL's proxy sees them. [`PluginLink`] goes through the plugin library;
//! [`RawTcpLink`] is plain TCP over loopback with the same number of streams, non-blocking
//! and progressed inline by the caller, the baseline `lossy bench` compares against. Both
//! keep their requests in FIFO order and only ever test the oldest one, as the proxy does.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::time::Duration;

use super::bootstrap::Bootstrap;
use super::plugin_client::{
    establish, CommShape, HostBuffer, MrHandle, PluginClient, PluginLibrary, Posted, RecvComm,
    RecvItem, Request, SendComm, HANDLE_BYTES,
};
use nccl_net_lossy::{Error, Result};

/// Most requests in flight per connection (NCCL's `NCCL_STEPS`).
pub const MAX_IN_FLIGHT: usize = 8;

/// One rank's two ring connections, driven without blocking.
pub trait RingLink {
    /// A short name for tables ("plugin", "raw-tcp").
    fn name(&self) -> &'static str;

    /// Posts a send of `buf[..len]` to the next rank; `Ok(Some(buf))` gives the buffer back
    /// when the transport asks to retry later.
    fn post_send(&mut self, buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>>;

    /// Posts a receive from the previous rank into the whole of `buf`, as NCCL posts its
    /// whole step (`stepSize * sliceSteps`, `recvProxyProgress` in src/transport/net.cc)
    /// whatever the sender puts in it: [`RingLink::test_recv`] says how much arrived.
    fn post_recv(&mut self, buf: HostBuffer) -> Result<Option<HostBuffer>>;

    /// Sends posted and not yet completed.
    fn sends_in_flight(&self) -> usize;

    /// Receives posted and not yet completed.
    fn recvs_in_flight(&self) -> usize;

    /// Tests the oldest send: its buffer once done.
    fn test_send(&mut self) -> Result<Option<HostBuffer>>;

    /// Tests the oldest receive: its buffer and the bytes it got once done.
    fn test_recv(&mut self) -> Result<Option<(HostBuffer, usize)>>;

    /// Says which collective is posted next (`setNetAttr` for the plugin at v11+).
    fn set_op(&mut self, op_bits: u32) -> Result<()>;

    /// Closes both connections.
    fn close(self: Box<Self>) -> Result<()>;
}

// ---- the plugin ---------------------------------------------------------------------------------

/// A ring channel through the plugin: `connect` to the next rank's handle, `accept` from the
/// previous rank, buffers registered with each comm on first use. The channels of one rank
/// share one plugin context ([`PluginLink::connect_channels`]), as NCCL's channels share the
/// plugin NCCL initialised once.
pub struct PluginLink {
    client: Rc<PluginClient>,
    send: SendComm,
    recv: RecvComm,
    send_mrs: MrTable,
    recv_mrs: MrTable,
    sends: VecDeque<Request>,
    recvs: VecDeque<Request>,
    /// The tags NCCL's proxy gives: a send carries the sender's rank, a receive is posted
    /// with the peer's (src/transport/net.cc: `isend(..., tpRank, ...)`, `tpRemoteRank`).
    send_tag: i32,
    recv_tag: i32,
}

impl PluginLink {
    /// Builds the ring channel: listen, all-gather handles, connect and accept together.
    pub fn connect_ring(
        lib: &Rc<PluginLibrary>,
        version: u32,
        comm_id: u64,
        boot: &mut Bootstrap,
        timeout: Duration,
    ) -> Result<PluginLink> {
        let mut links = PluginLink::connect_channels(lib, version, comm_id, boot, timeout, 1)?;
        links
            .pop()
            .ok_or_else(|| Error::internal("no ring channel was built"))
    }

    /// Builds `channels` ring channels over one plugin context: each its own send comm to
    /// the next rank and receive comm from the previous one.
    pub fn connect_channels(
        lib: &Rc<PluginLibrary>,
        version: u32,
        comm_id: u64,
        boot: &mut Bootstrap,
        timeout: Duration,
        channels: usize,
    ) -> Result<Vec<PluginLink>> {
        let client = Rc::new(PluginClient::init(lib, version, comm_id)?);
        if client.devices()? < 1 {
            return Err(Error::system("the plugin reports no devices"));
        }
        let (rank, nranks) = (boot.rank(), boot.nranks());
        client.set_shape(CommShape {
            ranks: nranks,
            channels: channels.max(1),
        });
        let tag = |r: usize| {
            i32::try_from(r).map_err(|_| Error::invalid_argument(format!("rank {r} as a tag")))
        };
        let (send_tag, recv_tag) = (tag(rank)?, tag((rank + nranks - 1) % nranks)?);
        (0..channels.max(1))
            .map(|_| {
                let (send, recv) = ring_comms(&client, boot, timeout)?;
                Ok(PluginLink {
                    send_tag,
                    recv_tag,
                    client: Rc::clone(&client),
                    send,
                    recv,
                    send_mrs: MrTable::default(),
                    recv_mrs: MrTable::default(),
                    sends: VecDeque::new(),
                    recvs: VecDeque::new(),
                })
            })
            .collect()
    }

    /// The client, e.g. to read properties.
    pub fn client(&self) -> &PluginClient {
        &self.client
    }
}

/// Connects `client` into the ring on device 0: listens, all-gathers the handles, connects
/// to the next rank's while accepting from the previous rank.
pub(crate) fn ring_comms(
    client: &PluginClient,
    boot: &mut Bootstrap,
    timeout: Duration,
) -> Result<(SendComm, RecvComm)> {
    let (handle, mut listen) = client.listen(0)?;
    let handles = boot.all_gather(&handle)?;
    let next: [u8; HANDLE_BYTES] = handles[(boot.rank() + 1) % boot.nranks()]
        .as_slice()
        .try_into()
        .map_err(|_| Error::remote("a rank sent a handle of the wrong size"))?;
    let (send, recv) = establish(client.connect(0, &next), &mut listen, timeout)?;
    listen.close()?;
    Ok((send, recv))
}

/// Takes the oldest request of `fifo` once it is done: its buffer and the bytes it got.
fn pop_done(fifo: &mut VecDeque<Request>) -> Result<Option<(HostBuffer, usize)>> {
    let Some(head) = fifo.front_mut() else {
        return Ok(None);
    };
    if head.test()?.is_none() {
        return Ok(None);
    }
    match fifo.pop_front() {
        Some(req) => req.finish_one().map(Some),
        None => Ok(None),
    }
}

/// A comm's registrations by buffer address, looked up at every post: a multiply and a fold
/// hash the address (its low bits are zero, aligned; the fold brings the product's high bits
/// down to where the table looks), where the default hasher's SipHash would cost more than the
/// rest of the lookup, a harness cost timed as the plugin's next to raw TCP.
type MrTable = HashMap<usize, MrHandle, BuildHasherDefault<AddrHasher>>;

#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 << 8 | u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let h = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 29);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// The registration of `buf` with a comm, made on first use (NCCL registers its buffers
/// once per connection).
fn mr_for(
    mrs: &mut MrTable,
    buf: &mut HostBuffer,
    reg: impl FnOnce(&mut [u8]) -> Result<MrHandle>,
) -> Result<MrHandle> {
    let key = buf.as_ptr() as usize;
    if let Some(mr) = mrs.get(&key) {
        return Ok(*mr);
    }
    let mr = reg(buf)?;
    mrs.insert(key, mr);
    Ok(mr)
}

impl RingLink for PluginLink {
    fn name(&self) -> &'static str {
        "plugin"
    }

    fn post_send(&mut self, mut buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>> {
        let send = &self.send;
        let mr = mr_for(&mut self.send_mrs, &mut buf, |b| send.reg_mr(b))?;
        match self.send.isend(buf, len, self.send_tag, mr)? {
            Posted::Started(req) => {
                self.sends.push_back(req);
                Ok(None)
            }
            Posted::Busy(mut back) => Ok(back.pop()),
        }
    }

    fn post_recv(&mut self, mut buf: HostBuffer) -> Result<Option<HostBuffer>> {
        let recv = &self.recv;
        let mr = mr_for(&mut self.recv_mrs, &mut buf, |b| recv.reg_mr(b))?;
        let size = buf.len();
        let item = RecvItem {
            buf,
            size,
            tag: self.recv_tag,
            mr,
        };
        match self.recv.irecv([item])? {
            Posted::Started(req) => {
                self.recvs.push_back(req);
                Ok(None)
            }
            Posted::Busy(mut back) => Ok(back.pop()),
        }
    }

    fn sends_in_flight(&self) -> usize {
        self.sends.len()
    }

    fn recvs_in_flight(&self) -> usize {
        self.recvs.len()
    }

    fn test_send(&mut self) -> Result<Option<HostBuffer>> {
        Ok(pop_done(&mut self.sends)?.map(|(buf, _)| buf))
    }

    fn test_recv(&mut self) -> Result<Option<(HostBuffer, usize)>> {
        pop_done(&mut self.recvs)
    }

    fn set_op(&mut self, op_bits: u32) -> Result<()> {
        self.client.set_net_attr(op_bits).map(|_| ())
    }

    fn close(self: Box<Self>) -> Result<()> {
        let link = *self;
        for mr in link.send_mrs.values() {
            link.send.dereg_mr(*mr)?;
        }
        for mr in link.recv_mrs.values() {
            link.recv.dereg_mr(*mr)?;
        }
        // Unfinished requests (after a failure) keep their buffers; the comms close anyway.
        drop(link.sends);
        drop(link.recvs);
        link.send.close()?;
        link.recv.close()?;
        // The last channel of the context finalizes it.
        match Rc::try_unwrap(link.client) {
            Ok(client) => client.finalize(),
            Err(_) => Ok(()),
        }
    }
}

// ---- raw TCP ------------------------------------------------------------------------------------

/// Bytes of the length header in front of every raw TCP message.
const HEADER: usize = 8;

/// A send queued on one stream: header and payload, and how much of both has left.
struct TxMsg {
    buf: HostBuffer,
    len: usize,
    header: [u8; HEADER],
    done: usize,
}

/// A receive queued on one stream: the header as it arrives, then the payload.
struct RxMsg {
    buf: HostBuffer,
    cap: usize,
    header: [u8; HEADER],
    len: Option<usize>,
    done: usize,
}

/// One non-blocking socket and its queue of messages in order; the first `finished` are
/// complete and wait for `test`.
struct RawStream<M> {
    socket: TcpStream,
    queue: VecDeque<M>,
    finished: usize,
}

impl<M> RawStream<M> {
    fn new(socket: TcpStream) -> Result<RawStream<M>> {
        socket.set_nonblocking(true)?;
        Ok(RawStream {
            socket,
            queue: VecDeque::new(),
            finished: 0,
        })
    }

    /// The oldest message, once complete.
    fn pop_finished(&mut self) -> Option<M> {
        if self.finished == 0 {
            return None;
        }
        self.finished -= 1;
        self.queue.pop_front()
    }
}

/// What one non-blocking read or write did.
enum Moved {
    Bytes(usize),
    WouldBlock,
}

fn moved(outcome: std::io::Result<usize>) -> Result<Moved> {
    match outcome {
        Ok(0) => Err(Error::remote("raw TCP peer closed the connection")),
        Ok(k) => Ok(Moved::Bytes(k)),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(Moved::WouldBlock),
        Err(e) if e.kind() == ErrorKind::Interrupted => Ok(Moved::Bytes(0)),
        Err(e) => Err(e.into()),
    }
}

impl RawStream<TxMsg> {
    /// Writes as much of the queued messages as the socket takes now.
    fn progress(&mut self) -> Result<()> {
        while let Some(m) = self.queue.get_mut(self.finished) {
            while m.done < HEADER + m.len {
                let outcome = if m.done < HEADER {
                    // Header and payload in one call, so a small message is one segment.
                    let parts = [
                        IoSlice::new(&m.header[m.done..]),
                        IoSlice::new(&m.buf[..m.len]),
                    ];
                    self.socket.write_vectored(&parts)
                } else {
                    self.socket.write(&m.buf[m.done - HEADER..m.len])
                };
                match moved(outcome)? {
                    Moved::Bytes(k) => m.done += k,
                    Moved::WouldBlock => return Ok(()),
                }
            }
            self.finished += 1;
        }
        Ok(())
    }
}

impl RawStream<RxMsg> {
    /// Reads as much of the queued messages as the socket has now.
    fn progress(&mut self) -> Result<()> {
        while let Some(m) = self.queue.get_mut(self.finished) {
            loop {
                let outcome = match m.len {
                    None if m.done == HEADER => {
                        let len = u64::from_le_bytes(m.header) as usize;
                        if len > m.cap {
                            return Err(Error::invalid_usage(format!(
                                "raw TCP message of {len} bytes for a {}-byte receive",
                                m.cap
                            )));
                        }
                        m.len = Some(len);
                        continue;
                    }
                    None => self.socket.read(&mut m.header[m.done..]),
                    Some(len) if m.done == HEADER + len => break,
                    Some(len) => self.socket.read(&mut m.buf[m.done - HEADER..len]),
                };
                match moved(outcome)? {
                    Moved::Bytes(k) => m.done += k,
                    Moved::WouldBlock => return Ok(()),
                }
            }
            self.finished += 1;
        }
        Ok(())
    }
}

/// A socket step of the raw TCP baseline that failed. Out of descriptors, the error says
/// how many sockets the baseline needs and what to change.
fn raw_tcp_error(step: &str, e: std::io::Error, channels: usize, nstreams: usize) -> Error {
    if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
        let sockets = channels * (2 * nstreams + 1);
        return Error::system(format!(
            "the raw TCP baseline link cannot {step}: {e}; it needs {sockets} sockets per rank \
             ({channels} channel(s), --comms, each with {nstreams} stream(s) each way and a \
             listener), besides the plugin's, under an open-file limit of {}: raise the limit \
             (`ulimit -n`) or run fewer --comms (or fewer --raw-streams)",
            nccl_net_lossy::transport::socket::fd_limit_text()
        ));
    }
    let mut err = Error::from(e);
    err.message = format!("the raw TCP baseline link cannot {step}: {}", err.message);
    err
}

/// Plain TCP ring channel with `nstreams` non-blocking sockets each way, progressed inline
/// by the caller's `test_send`/`test_recv` (no thread), as a minimal net plugin would:
/// message `m` travels whole, behind an 8-byte length, on stream `m mod nstreams`.
pub struct RawTcpLink {
    tx: Vec<RawStream<TxMsg>>,
    rx: Vec<RawStream<RxMsg>>,
    sends: VecDeque<usize>,
    recvs: VecDeque<usize>,
    next_send: usize,
    next_recv: usize,
}

impl RawTcpLink {
    /// Builds the ring channel: listen on loopback, all-gather addresses, connect `nstreams`
    /// sockets to the next rank and accept as many from the previous one. `channels` is how
    /// many such channels the rank opens in all (`--comms`), for the error that says how many
    /// sockets they need.
    pub fn connect_ring(
        boot: &mut Bootstrap,
        nstreams: usize,
        channels: usize,
        timeout: Duration,
    ) -> Result<RawTcpLink> {
        if nstreams == 0 {
            return Err(Error::invalid_argument("raw TCP needs at least one stream"));
        }
        let fail = |step: &str, e: std::io::Error| raw_tcp_error(step, e, channels, nstreams);
        let (rank, n) = (boot.rank(), boot.nranks());
        // Where the rank reaches the rendezvous: loopback locally, the real interface across
        // machines or network namespaces.
        let listener = TcpListener::bind((boot.local_ip()?, 0)).map_err(|e| fail("listen", e))?;
        let me = listener.local_addr().map_err(|e| fail("listen", e))?;
        let addrs = boot.all_gather(me.to_string().as_bytes())?;
        let next: SocketAddr = String::from_utf8_lossy(&addrs[(rank + 1) % n])
            .parse()
            .map_err(|_| Error::remote("a rank sent a bad raw TCP address"))?;
        let mut tx = Vec::with_capacity(nstreams);
        for i in 0..nstreams {
            let connect = || -> std::io::Result<TcpStream> {
                let mut s = TcpStream::connect_timeout(&next, timeout)?;
                s.set_nodelay(true)?;
                s.write_all(&(i as u32).to_le_bytes())?;
                Ok(s)
            };
            tx.push(connect().map_err(|e| fail(&format!("connect to {next}"), e))?);
        }
        let mut rx: Vec<Option<TcpStream>> = (0..nstreams).map(|_| None).collect();
        for _ in 0..nstreams {
            let accept = || -> std::io::Result<(TcpStream, [u8; 4])> {
                let (mut s, _) = listener.accept()?;
                s.set_read_timeout(Some(timeout))?;
                let mut idx = [0u8; 4];
                s.read_exact(&mut idx)?;
                s.set_read_timeout(None)?;
                s.set_nodelay(true)?;
                Ok((s, idx))
            };
            let (s, idx) = accept().map_err(|e| fail("accept", e))?;
            let slot = rx
                .get_mut(u32::from_le_bytes(idx) as usize)
                .filter(|slot| slot.is_none())
                .ok_or_else(|| Error::remote("bad raw TCP stream index"))?;
            *slot = Some(s);
        }
        Ok(RawTcpLink {
            tx: tx.into_iter().map(RawStream::new).collect::<Result<_>>()?,
            rx: rx
                .into_iter()
                .flatten()
                .map(RawStream::new)
                .collect::<Result<_>>()?,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            next_send: 0,
            next_recv: 0,
        })
    }

    /// Sockets per direction.
    pub fn streams(&self) -> usize {
        self.tx.len()
    }
}

impl RingLink for RawTcpLink {
    fn name(&self) -> &'static str {
        "raw-tcp"
    }

    fn post_send(&mut self, buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>> {
        let s = self.next_send % self.tx.len();
        self.tx[s].queue.push_back(TxMsg {
            buf,
            len,
            header: (len as u64).to_le_bytes(),
            done: 0,
        });
        self.sends.push_back(s);
        self.next_send += 1;
        Ok(None)
    }

    fn post_recv(&mut self, buf: HostBuffer) -> Result<Option<HostBuffer>> {
        let s = self.next_recv % self.rx.len();
        self.rx[s].queue.push_back(RxMsg {
            cap: buf.len(),
            buf,
            header: [0; HEADER],
            len: None,
            done: 0,
        });
        self.recvs.push_back(s);
        self.next_recv += 1;
        Ok(None)
    }

    fn sends_in_flight(&self) -> usize {
        self.sends.len()
    }

    fn recvs_in_flight(&self) -> usize {
        self.recvs.len()
    }

    fn test_send(&mut self) -> Result<Option<HostBuffer>> {
        for stream in &mut self.tx {
            stream.progress()?;
        }
        let Some(&s) = self.sends.front() else {
            return Ok(None);
        };
        let done = self.tx[s].pop_finished();
        if done.is_some() {
            self.sends.pop_front();
        }
        Ok(done.map(|m| m.buf))
    }

    fn test_recv(&mut self) -> Result<Option<(HostBuffer, usize)>> {
        for stream in &mut self.rx {
            stream.progress()?;
        }
        let Some(&s) = self.recvs.front() else {
            return Ok(None);
        };
        let done = self.rx[s].pop_finished();
        if done.is_some() {
            self.recvs.pop_front();
        }
        Ok(done.map(|m| (m.buf, m.len.unwrap_or(0))))
    }

    fn set_op(&mut self, _op_bits: u32) -> Result<()> {
        Ok(())
    }

    fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}
