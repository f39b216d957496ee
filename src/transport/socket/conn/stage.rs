//! A receiving socket's stage: the bytes one read brought past what its state machine asked
//! for, served to the next reads, and the socket's acknowledgement mode.

use std::io;

use socket2::Socket;

use super::shared::recv_some;

/// Size of a socket's stage, allocated at its first read: a header, its runs and a small
/// payload, little enough that copying it a second time costs less than a system call.
const STAGE_SIZE: usize = 4 << 10;

/// Chunks of at least this size are bulk transfers: the socket goes back to TCP's usual
/// acknowledgements. Smaller ones are one segment each on loopback (whose MSS is just under
/// 64 KiB), acknowledged one by one as they are read like the smallest messages: they delay
/// acknowledgements too. (Chunks of 4-64 KiB kept whichever mode the socket was in, so a
/// connection that never carried a message under 4 KiB kept TCP's prompt one: 8 channels at
/// 64-256 KiB ran 14-16% slower, docs/transport.md.)
const BULK_CHUNK: usize = 64 << 10;

/// Small chunks between two requests for delayed acknowledgements. Linux acknowledges every
/// small segment as soon as it is read (`tcp_cleanup_rbuf`), and on loopback the receiver's
/// read pays for sending that acknowledgement and the sender's stack for taking it: with
/// `TCP_QUICKACK` off the socket acknowledges every second small segment, and a message of
/// a few bytes answers sooner. The kernel leaves that mode by itself when its delayed-ACK
/// timer fires (an idle stream), so the request is repeated, at the cost of one `setsockopt`
/// per this many small chunks. Bulk chunks put the socket back in the usual mode, which
/// measured faster for them (acknowledgements as the data is taken, not on a timer).
const ACK_REARM: u32 = 16;

/// Bytes a socket read past what its state machine asked for (the next header, a small
/// payload, the runs), kept in order for the next reads. A read of less than the stage's size
/// fills the stage with one plain `recv` and is served from it, so a small message (header,
/// runs and payload) costs one system call, and a poll that finds nothing costs the cheapest
/// one; a larger read goes straight into the caller's buffer and offers the stage for what
/// follows (the next header), in the same call. After a chunk of at least the stage's size
/// the socket carries bulk traffic, where a copy through the stage costs more than the
/// system call it saves: it reads exactly what is asked (header, then payload straight into
/// the caller's buffer) until a smaller chunk comes.
pub(super) struct Stage {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Ask TCP to delay acknowledgements of small messages (see [`ACK_REARM`]), and the
    /// small chunks since the last bulk one (0: acknowledgements are not delayed).
    delayed_acks: bool,
    small_chunks: u32,
    /// The socket's last chunk was at least the stage's size: read exactly what is asked.
    bulk: bool,
}

/// What one [`Stage::read`] did.
pub(super) enum Read {
    /// Bytes came from the stage (no system call).
    Staged(usize),
    /// Bytes came from the socket.
    Arrived(usize),
    /// The peer closed its end, and nothing is staged.
    Closed,
    /// Nothing has arrived.
    Nothing,
}

impl Stage {
    pub(super) fn new(delayed_acks: bool) -> Self {
        Stage {
            buf: Vec::new(),
            start: 0,
            end: 0,
            delayed_acks,
            small_chunks: 0,
            bulk: false,
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Bytes staged, not read yet.
    pub(super) fn staged(&self) -> usize {
        self.end - self.start
    }

    /// Moves `buf.len()` staged bytes into `buf` (at most [`Stage::staged`]).
    pub(super) fn take_staged(&mut self, buf: &mut [u8]) {
        let k = self.take(buf);
        debug_assert_eq!(k, buf.len());
    }

    /// Moves staged bytes into `buf`: how many.
    fn take(&mut self, buf: &mut [u8]) -> usize {
        let k = buf.len().min(self.end - self.start);
        buf[..k].copy_from_slice(&self.buf[self.start..self.start + k]);
        self.start += k;
        k
    }

    /// Fills a prefix of `buf` from the stage, or else with what has arrived on `sock`
    /// (one system call, never waiting).
    pub(super) fn read(&mut self, sock: &Socket, buf: &mut [u8]) -> io::Result<Read> {
        if !self.is_empty() {
            return Ok(Read::Staged(self.take(buf)));
        }
        if self.bulk {
            return Ok(match recv_some(sock, buf, &mut [])? {
                None => Read::Nothing,
                Some(0) => Read::Closed,
                Some(n) => Read::Arrived(n),
            });
        }
        if self.buf.is_empty() {
            self.buf = vec![0; STAGE_SIZE];
        }
        let small = buf.len() < STAGE_SIZE;
        let got = if small {
            recv_some(sock, &mut self.buf, &mut [])?
        } else {
            recv_some(sock, buf, &mut self.buf)?
        };
        Ok(match got {
            None => Read::Nothing,
            Some(0) => Read::Closed,
            Some(n) if small => {
                (self.start, self.end) = (0, n);
                Read::Arrived(self.take(buf))
            }
            Some(n) => {
                let k = n.min(buf.len());
                (self.start, self.end) = (0, n - k);
                Read::Arrived(k)
            }
        })
    }

    /// Notes that a chunk of `len` bytes arrived whole on `sock`, and suits the socket's
    /// acknowledgements to its traffic: delayed for small messages, the usual for bulk.
    pub(super) fn chunk_received(&mut self, sock: &Socket, len: usize) {
        self.bulk = len >= STAGE_SIZE;
        if !self.delayed_acks {
            return;
        }
        // Best effort: a socket that refuses keeps acknowledging as it did.
        if len < BULK_CHUNK {
            if self.small_chunks % ACK_REARM == 0 {
                let _ = sock.set_quickack(false);
            }
            self.small_chunks = self.small_chunks.wrapping_add(1).max(1);
        } else if self.small_chunks != 0 {
            let _ = sock.set_quickack(true);
            self.small_chunks = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use socket2::Socket;

    use super::{Read, Stage, STAGE_SIZE};
    use crate::transport::socket::conn::shared::peek_arrived;

    /// A loopback pair: the writing end, and the non-blocking reading end as the transport
    /// holds it.
    fn pair() -> (TcpStream, Socket) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let tx = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (rx, _) = listener.accept().expect("accept");
        rx.set_nonblocking(true).expect("non-blocking");
        (tx, Socket::from(rx))
    }

    /// Waits until `n` bytes wait in `sock` (loopback delivers within the writer's call, but
    /// the test must not rely on it).
    fn arrived(sock: &Socket, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut buf = vec![0u8; n];
        while peek_arrived(sock, &mut buf).unwrap_or(0) < n {
            assert!(Instant::now() < deadline, "{n} bytes never arrived");
            std::thread::yield_now();
        }
    }

    /// Reads `want` bytes through the stage, one call per arrival.
    fn read_exactly(stage: &mut Stage, sock: &Socket, want: usize) -> Vec<u8> {
        let mut out = vec![0u8; want];
        let mut got = 0;
        while got < want {
            match stage.read(sock, &mut out[got..]).expect("read") {
                Read::Staged(k) | Read::Arrived(k) => got += k,
                Read::Nothing => std::thread::yield_now(),
                Read::Closed => panic!("closed after {got} bytes"),
            }
        }
        out
    }

    /// Bytes still in the socket, not read by anyone.
    fn unread(sock: &Socket) -> usize {
        let mut buf = vec![0u8; 2 * STAGE_SIZE];
        peek_arrived(sock, &mut buf).unwrap_or(0)
    }

    #[test]
    fn small_reads_take_what_follows_into_the_stage() {
        let (mut tx, rx) = pair();
        let mut stage = Stage::new(false);
        let bytes: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        tx.write_all(&bytes).expect("write");
        arrived(&rx, bytes.len());
        // A 56-byte read (a header) brings everything that arrived: one system call.
        assert_eq!(read_exactly(&mut stage, &rx, 56), bytes[..56]);
        assert_eq!(unread(&rx), 0, "the rest should be in the stage");
        assert!(!stage.is_empty());
        assert_eq!(read_exactly(&mut stage, &rx, 244), bytes[56..]);
        assert!(stage.is_empty());
    }

    #[test]
    fn after_a_bulk_chunk_reads_take_only_what_is_asked_and_a_small_one_stages_again() {
        let (mut tx, rx) = pair();
        let mut stage = Stage::new(false);
        let bytes: Vec<u8> = (0..600u32).map(|i| (i * 7) as u8).collect();
        tx.write_all(&bytes).expect("write");
        arrived(&rx, bytes.len());
        // A bulk chunk came whole: the next header is read exactly, with no copy through
        // the stage, and what follows stays in the socket for the next read.
        stage.chunk_received(&rx, STAGE_SIZE);
        assert_eq!(read_exactly(&mut stage, &rx, 56), bytes[..56]);
        assert!(stage.is_empty(), "a bulk socket read ahead into the stage");
        assert_eq!(unread(&rx), 544);
        assert_eq!(read_exactly(&mut stage, &rx, 200), bytes[56..256]);
        assert_eq!(unread(&rx), 344);
        // A small chunk puts the socket back to reading ahead.
        stage.chunk_received(&rx, 200);
        assert_eq!(read_exactly(&mut stage, &rx, 56), bytes[256..312]);
        assert_eq!(unread(&rx), 0);
        assert_eq!(read_exactly(&mut stage, &rx, 288), bytes[312..]);
    }
}
