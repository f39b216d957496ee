//! A tiny rendezvous over loopback TCP, standing in for NCCL's bootstrap: ranks all-gather
//! small blobs (the 128-byte connection handles) and barrier.
//!
//! The server runs on a thread of whoever starts the ranks (the launcher, or a test that is a
//! rank itself). Every rank connects and says who it is; then, round after round, each rank
//! sends one blob and receives all of them in rank order. A rank that disconnects ends the
//! server, which makes every other rank's next call fail instead of hang.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nccl_net_lossy::{Error, Result};

/// Identifies the bootstrap protocol on the first bytes of a connection.
const MAGIC: u32 = 0x4c42_5331; // "LBS1"

/// Largest blob a rank may contribute to one round.
pub const MAX_BLOB: usize = 1 << 20;

fn read_u32(stream: &mut TcpStream) -> Result<u32> {
    let mut b = [0u8; 4];
    stream.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_blob(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len) as usize;
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

/// The rendezvous point of one run.
pub struct BootstrapServer {
    addr: SocketAddr,
    thread: Option<JoinHandle<Result<()>>>,
}

impl BootstrapServer {
    /// Starts serving `nranks` ranks on a loopback port; every wait (for ranks to connect,
    /// for a round to fill) gives up after `timeout`.
    pub fn start(nranks: usize, timeout: Duration) -> Result<BootstrapServer> {
        if nranks == 0 {
            return Err(Error::invalid_argument(
                "a bootstrap needs at least one rank",
            ));
        }
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let thread = std::thread::Builder::new()
            .name("lossy-bootstrap".into())
            .spawn(move || serve(listener, nranks, timeout))?;
        Ok(BootstrapServer {
            addr,
            thread: Some(thread),
        })
    }

    /// Where ranks connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
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

/// Accepts every rank, then serves rounds until a rank leaves.
fn serve(listener: TcpListener, nranks: usize, timeout: Duration) -> Result<()> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    let mut ranks: Vec<Option<TcpStream>> = (0..nranks).map(|_| None).collect();
    let mut joined = 0;
    while joined < nranks {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(timeout))?;
                stream.set_nodelay(true)?;
                let (magic, rank, n) = (
                    read_u32(&mut stream)?,
                    read_u32(&mut stream)?,
                    read_u32(&mut stream)?,
                );
                let slot = ranks.get_mut(rank as usize);
                match slot {
                    Some(slot @ None) if magic == MAGIC && n as usize == nranks => {
                        *slot = Some(stream);
                        joined += 1;
                    }
                    _ => {
                        return Err(Error::remote(format!(
                            "bad bootstrap hello: magic {magic:#x}, rank {rank} of {n} (expected {nranks} ranks)"
                        )))
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(Error::remote(format!(
                        "only {joined} of {nranks} ranks reached the bootstrap within {timeout:?}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let mut streams: Vec<TcpStream> = ranks.into_iter().flatten().collect();
    loop {
        let mut blobs = Vec::with_capacity(nranks);
        for (rank, stream) in streams.iter_mut().enumerate() {
            match read_blob(stream) {
                Ok(blob) => blobs.push(blob),
                // A rank that leaves between rounds is the normal end of a run.
                Err(_) if rank == 0 && blobs.is_empty() => return Ok(()),
                Err(err) => return Err(err.context(format!("bootstrap round, rank {rank}"))),
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

/// One rank's connection to the bootstrap server.
pub struct Bootstrap {
    stream: TcpStream,
    rank: usize,
    nranks: usize,
}

impl Bootstrap {
    /// Joins the run at `addr` as `rank` of `nranks`; every later wait gives up after
    /// `timeout`.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        nranks: usize,
        timeout: Duration,
    ) -> Result<Bootstrap> {
        if rank >= nranks {
            return Err(Error::invalid_argument(format!(
                "rank {rank} of {nranks} ranks"
            )));
        }
        let mut stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| Error::from(e).context(format!("bootstrap connect to {addr}")))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        let mut hello = Vec::with_capacity(12);
        for word in [MAGIC, rank as u32, nranks as u32] {
            hello.extend_from_slice(&word.to_le_bytes());
        }
        stream.write_all(&hello)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_gather_blobs_in_rank_order_and_the_server_ends_with_them() {
        let server = BootstrapServer::start(3, Duration::from_secs(10)).expect("server");
        let addr = server.addr();
        let threads: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    let mut b =
                        Bootstrap::connect(addr, rank, 3, Duration::from_secs(10)).expect("join");
                    let all = b.all_gather(&[rank as u8; 5][..rank + 1]).expect("gather");
                    b.barrier().expect("barrier");
                    all
                })
            })
            .collect();
        for t in threads {
            let all = t.join().expect("rank thread");
            assert_eq!(all, vec![vec![0u8], vec![1, 1], vec![2, 2, 2]]);
        }
        server.join().expect("server ends cleanly");
    }

    #[test]
    fn a_rank_that_never_comes_fails_the_server_in_time() {
        let server = BootstrapServer::start(2, Duration::from_millis(300)).expect("server");
        let _only = Bootstrap::connect(server.addr(), 0, 2, Duration::from_secs(5)).expect("join");
        let err = server.join().expect_err("missing rank");
        assert!(err.message.contains("1 of 2"), "{err}");
    }
}
