//! Ring links: one connection to rank + 1 (sends) and one from rank - 1 (receives), as a
//! ring channel of NCCL's proxy sees them. [`PluginLink`] goes through the plugin library;
//! [`RawTcpLink`] is plain TCP over loopback with the same number of streams, the baseline
//! `lossy bench` compares against. Both keep their requests in FIFO order and only ever test
//! the oldest one, as the proxy does.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::bootstrap::Bootstrap;
use super::plugin_client::{
    establish, HostBuffer, MrHandle, PluginClient, PluginLibrary, Posted, RecvComm, RecvItem,
    Request, SendComm, HANDLE_BYTES,
};
use nccl_net_lossy::{Error, Result};

/// Most requests in flight per connection (NCCL's `NCCL_STEPS`).
pub const MAX_IN_FLIGHT: usize = 8;

/// Tag the ring's messages carry.
const RING_TAG: i32 = 0x52;

/// One rank's two ring connections, driven without blocking.
pub trait RingLink {
    /// A short name for tables ("plugin", "raw-tcp").
    fn name(&self) -> &'static str;

    /// Posts a send of `buf[..len]` to the next rank; `Ok(Some(buf))` gives the buffer back
    /// when the transport asks to retry later.
    fn post_send(&mut self, buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>>;

    /// Posts a receive of up to `len` bytes from the previous rank into `buf`.
    fn post_recv(&mut self, buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>>;

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
/// previous rank, buffers registered with each comm on first use.
pub struct PluginLink {
    client: PluginClient,
    send: SendComm,
    recv: RecvComm,
    send_mrs: HashMap<usize, MrHandle>,
    recv_mrs: HashMap<usize, MrHandle>,
    sends: VecDeque<Request>,
    recvs: VecDeque<Request>,
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
        let client = PluginClient::init(lib, version, comm_id)?;
        if client.devices()? < 1 {
            return Err(Error::system("the plugin reports no devices"));
        }
        let (send, recv) = ring_comms(&client, boot, timeout)?;
        Ok(PluginLink {
            client,
            send,
            recv,
            send_mrs: HashMap::new(),
            recv_mrs: HashMap::new(),
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
        })
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

/// Takes the oldest request of `fifo` once it is done: its buffers and received sizes.
fn pop_done(fifo: &mut VecDeque<Request>) -> Result<Option<(Vec<HostBuffer>, Vec<usize>)>> {
    let Some(head) = fifo.front_mut() else {
        return Ok(None);
    };
    if head.test()?.is_none() {
        return Ok(None);
    }
    match fifo.pop_front() {
        Some(req) => req.finish().map(Some),
        None => Ok(None),
    }
}

/// The registration of `buf` with a comm, made on first use (NCCL registers its buffers
/// once per connection).
fn mr_for(
    mrs: &mut HashMap<usize, MrHandle>,
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
        match self.send.isend(buf, len, RING_TAG, mr)? {
            Posted::Started(req) => {
                self.sends.push_back(req);
                Ok(None)
            }
            Posted::Busy(mut back) => Ok(back.pop()),
        }
    }

    fn post_recv(&mut self, mut buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>> {
        let recv = &self.recv;
        let mr = mr_for(&mut self.recv_mrs, &mut buf, |b| recv.reg_mr(b))?;
        let item = RecvItem {
            buf,
            size: len,
            tag: RING_TAG,
            mr,
        };
        match self.recv.irecv(vec![item])? {
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
        Ok(pop_done(&mut self.sends)?.and_then(|(mut bufs, _)| bufs.pop()))
    }

    fn test_recv(&mut self) -> Result<Option<(HostBuffer, usize)>> {
        let Some((mut bufs, sizes)) = pop_done(&mut self.recvs)? else {
            return Ok(None);
        };
        match (bufs.pop(), sizes.first()) {
            (Some(buf), Some(&size)) => Ok(Some((buf, size))),
            _ => Err(Error::internal("a finished receive without its buffer")),
        }
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
        link.client.finalize()
    }
}

// ---- raw TCP ------------------------------------------------------------------------------------

/// A message handed to a stream thread, or back from it.
type Job = (HostBuffer, usize);

/// One direction of one TCP stream, served by its own thread.
struct Stream {
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<Job>>,
    socket: TcpStream,
    thread: Option<JoinHandle<()>>,
}

impl Stream {
    fn start(socket: TcpStream, sending: bool) -> Result<Stream> {
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Result<Job>>();
        let mut io = socket.try_clone()?;
        let thread = std::thread::Builder::new()
            .name(if sending { "raw-tx" } else { "raw-rx" }.into())
            .stack_size(256 << 10)
            .spawn(move || {
                for (mut buf, len) in job_rx {
                    let outcome = if sending {
                        raw_send(&mut io, &buf[..len]).map(|()| (buf, len))
                    } else {
                        raw_recv(&mut io, &mut buf[..len]).map(|got| (buf, got))
                    };
                    let failed = outcome.is_err();
                    if done_tx.send(outcome).is_err() || failed {
                        return;
                    }
                }
            })?;
        Ok(Stream {
            jobs: Some(job_tx),
            done: done_rx,
            socket,
            thread: Some(thread),
        })
    }

    fn post(&self, job: Job) -> Result<()> {
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(job).ok())
            .ok_or_else(|| Error::remote("raw TCP stream thread ended"))
    }

    fn poll(&self) -> Result<Option<Job>> {
        match self.done.try_recv() {
            Ok(outcome) => outcome.map(Some),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(Error::remote("raw TCP stream thread ended")),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.jobs = None;
        let _ = self.socket.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Writes a length header, then the payload.
fn raw_send(io: &mut TcpStream, data: &[u8]) -> Result<()> {
    io.write_all(&(data.len() as u64).to_le_bytes())?;
    io.write_all(data)?;
    Ok(())
}

/// Reads a length header and the payload into `buf`; a message longer than `buf` is an error.
fn raw_recv(io: &mut TcpStream, buf: &mut [u8]) -> Result<usize> {
    let mut len = [0u8; 8];
    io.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len) as usize;
    let cap = buf.len();
    let dst = buf.get_mut(..len).ok_or_else(|| {
        Error::invalid_usage(format!(
            "raw TCP message of {len} bytes for a {cap}-byte receive"
        ))
    })?;
    io.read_exact(dst)?;
    Ok(len)
}

/// Plain TCP ring channel with `nstreams` sockets each way; message `m` travels whole on
/// stream `m mod nstreams`, one blocking thread per stream and direction.
pub struct RawTcpLink {
    tx: Vec<Stream>,
    rx: Vec<Stream>,
    sends: VecDeque<usize>,
    recvs: VecDeque<usize>,
    next_send: usize,
    next_recv: usize,
}

impl RawTcpLink {
    /// Builds the ring channel: listen on loopback, all-gather addresses, connect `nstreams`
    /// sockets to the next rank and accept as many from the previous one.
    pub fn connect_ring(
        boot: &mut Bootstrap,
        nstreams: usize,
        timeout: Duration,
    ) -> Result<RawTcpLink> {
        if nstreams == 0 {
            return Err(Error::invalid_argument("raw TCP needs at least one stream"));
        }
        let (rank, n) = (boot.rank(), boot.nranks());
        // Where the rank reaches the rendezvous: loopback locally, the real interface across
        // machines or network namespaces.
        let listener = TcpListener::bind((boot.local_ip()?, 0))?;
        let me = listener.local_addr()?.to_string();
        let addrs = boot.all_gather(me.as_bytes())?;
        let next: SocketAddr = String::from_utf8_lossy(&addrs[(rank + 1) % n])
            .parse()
            .map_err(|_| Error::remote("a rank sent a bad raw TCP address"))?;
        let mut tx = Vec::with_capacity(nstreams);
        for i in 0..nstreams {
            let mut s = TcpStream::connect_timeout(&next, timeout)?;
            s.set_nodelay(true)?;
            s.write_all(&(i as u32).to_le_bytes())?;
            tx.push(s);
        }
        let mut rx: Vec<Option<TcpStream>> = (0..nstreams).map(|_| None).collect();
        for _ in 0..nstreams {
            let (mut s, _) = listener.accept()?;
            s.set_read_timeout(Some(timeout))?;
            let mut idx = [0u8; 4];
            s.read_exact(&mut idx)?;
            s.set_read_timeout(None)?;
            s.set_nodelay(true)?;
            let slot = rx
                .get_mut(u32::from_le_bytes(idx) as usize)
                .filter(|slot| slot.is_none())
                .ok_or_else(|| Error::remote("bad raw TCP stream index"))?;
            *slot = Some(s);
        }
        Ok(RawTcpLink {
            tx: tx
                .into_iter()
                .map(|s| Stream::start(s, true))
                .collect::<Result<_>>()?,
            rx: rx
                .into_iter()
                .flatten()
                .map(|s| Stream::start(s, false))
                .collect::<Result<_>>()?,
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            next_send: 0,
            next_recv: 0,
        })
    }
}

impl RingLink for RawTcpLink {
    fn name(&self) -> &'static str {
        "raw-tcp"
    }

    fn post_send(&mut self, buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>> {
        let s = self.next_send % self.tx.len();
        self.tx[s].post((buf, len))?;
        self.sends.push_back(s);
        self.next_send += 1;
        Ok(None)
    }

    fn post_recv(&mut self, buf: HostBuffer, len: usize) -> Result<Option<HostBuffer>> {
        let s = self.next_recv % self.rx.len();
        self.rx[s].post((buf, len))?;
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
        let Some(&s) = self.sends.front() else {
            return Ok(None);
        };
        let done = self.tx[s].poll()?;
        if done.is_some() {
            self.sends.pop_front();
        }
        Ok(done.map(|(buf, _)| buf))
    }

    fn test_recv(&mut self) -> Result<Option<(HostBuffer, usize)>> {
        let Some(&s) = self.recvs.front() else {
            return Ok(None);
        };
        let done = self.rx[s].poll()?;
        if done.is_some() {
            self.recvs.pop_front();
        }
        Ok(done)
    }

    fn set_op(&mut self, _op_bits: u32) -> Result<()> {
        Ok(())
    }

    fn close(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}
