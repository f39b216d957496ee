//! A receiving socket's stage: the bytes one read brought past what its state machine asked
//! for, served to the next reads, and the socket's acknowledgement mode.

use std::io;

use socket2::Socket;

use super::shared::recv_some;

/// Size of a socket's stage, allocated at its first read: a header, its runs and a small
/// payload, little enough that copying it a second time costs less than a system call.
const STAGE_SIZE: usize = 4 << 10;

/// Chunks below this size count as small messages for the acknowledgement mode.
const SMALL_CHUNK: usize = STAGE_SIZE;

/// Chunks of at least this size are bulk transfers: the socket goes back to TCP's usual
/// acknowledgements.
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
/// follows (the next header), in the same call.
pub(super) struct Stage {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Ask TCP to delay acknowledgements of small messages (see [`ACK_REARM`]), and the
    /// small chunks since the last bulk one (0: acknowledgements are not delayed).
    delayed_acks: bool,
    small_chunks: u32,
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
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
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
        if !self.delayed_acks {
            return;
        }
        // Best effort: a socket that refuses keeps acknowledging as it did.
        if len < SMALL_CHUNK {
            if self.small_chunks % ACK_REARM == 0 {
                let _ = sock.set_quickack(false);
            }
            self.small_chunks = self.small_chunks.wrapping_add(1).max(1);
        } else if len >= BULK_CHUNK && self.small_chunks != 0 {
            let _ = sock.set_quickack(true);
            self.small_chunks = 0;
        }
    }
}
