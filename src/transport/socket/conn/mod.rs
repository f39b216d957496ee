//! The data path of one connection: a fixed table of request slots, a queue of posted
//! messages, and one non-blocking state machine per socket that moves its share of every message.
//!
//! Every message is cut into `k` contiguous chunks (see [`chunk_count`]); chunk `j` of message
//! `seq` travels on socket `(seq + j) mod n`, right after its own header (size, tag, chunk
//! index, the loss plan's runs that touch the chunk). Each socket's chunks come in stream
//! order, and every chunk describes itself, so a receiving thread never waits for another
//! socket to learn where its bytes go: sockets run independently, which matters when one of
//! them is briefly slower (measured: waiting for another socket's header cost 10-25% of the
//! receive time when only one socket carried the message header).
//!
//! Nothing blocks: the owner's calls (`isend`/`irecv`/`test`) move whatever bytes each socket
//! can move now (inline progress), and the process-wide I/O pool moves them on readiness for
//! connections nobody is polling, or at a retransmit deadline. Each socket's state machine
//! has its own lock, taken with `try_lock`, so a caller and a pool thread never both move one
//! socket's bytes and never wait for each other. `test` on a finished request reads one atomic.
//!
//! - [`shared`]: what callers and pool threads of a connection share (the lock, the request
//!   slot states, the progress clock, the socket state machines) and non-blocking socket I/O;
//! - [`pool`]: the I/O threads (`NCCL_LOSSY_IO_THREADS`), one epoll instance each;
//! - [`send`]: the sending half, which cuts each message into chunks and sends them;
//! - [`recv`]: the receiving half, which matches chunk headers to posted buffers and applies
//!   the loss plan to the bytes that land;
//! - [`grouped`]: a posted receive's buffers and the matching of its messages by tag;
//! - [`stage`]: a receiving socket's read-ahead (one system call per small message) and its
//!   acknowledgement mode.

mod grouped;
mod pool;
#[cfg(test)]
mod probe;
mod recv;
mod send;
mod shared;
mod stage;

use std::io;
use std::ops::Range;

use socket2::Socket;

pub(crate) use pool::Pool;
pub use pool::{io_threads, DEFAULT_IO_THREADS, MAX_IO_THREADS};
#[cfg(test)]
pub(super) use probe::epoll_watched;
pub use recv::SocketRecvConn;
#[cfg(test)]
pub(super) use recv::AFTER_DONE_READ;
pub use send::SocketSendConn;
#[cfg(test)]
pub(super) use shared::reads;
#[cfg(test)]
pub(super) use shared::tcp_info;

/// Smallest chunk a message is cut into, so small messages use few sockets.
pub const MIN_CHUNK: usize = 64 << 10;

/// Number of chunks a `size`-byte message is cut into over `sockets` sockets (at least 1).
pub fn chunk_count(size: usize, sockets: usize) -> usize {
    (size / MIN_CHUNK).clamp(1, sockets.max(1))
}

/// Byte range of chunk `j` of `chunks` in a `size`-byte message: near-equal contiguous parts.
pub fn chunk_span(size: usize, chunks: usize, j: usize) -> Range<usize> {
    if chunks == 1 && j == 0 {
        // Every message under 128 KiB, or on one socket: no division on the per-message path.
        return 0..size;
    }
    let (base, extra) = (size / chunks, size % chunks);
    let start = j * base + j.min(extra);
    start..start + base + usize::from(j < extra)
}

/// The socket of chunk 0 of message `seq`, and the chunk index socket `s` carries for it.
fn roles(seq: u64, s: usize, n: usize) -> (usize, usize) {
    if n == 1 {
        return (0, 0);
    }
    let h = (seq % n as u64) as usize;
    (h, (s + n - h) % n)
}

/// The sockets that carry chunks `0..chunks` of message `seq`, in chunk order.
fn chunk_sockets(seq: u64, chunks: usize, n: usize) -> impl Iterator<Item = usize> {
    let first = roles(seq, 0, n).0;
    (0..chunks).map(move |j| (first + j) % n)
}

/// Puts a connected socket in the mode the state machines expect.
pub(crate) fn prepare(sock: &Socket) -> io::Result<()> {
    sock.set_nonblocking(true)?;
    sock.set_nodelay(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_message_contiguously() {
        assert_eq!(chunk_count(0, 4), 1);
        assert_eq!(chunk_count(MIN_CHUNK - 1, 4), 1);
        assert_eq!(chunk_count(2 * MIN_CHUNK + 5, 4), 2);
        assert_eq!(chunk_count(1 << 30, 4), 4);
        assert_eq!(chunk_count(1 << 30, 1), 1);
        for (size, k) in [(0, 1), (7, 1), (1 << 20, 3), ((1 << 20) + 3, 4)] {
            let mut next = 0;
            for j in 0..k {
                let r = chunk_span(size, k, j);
                assert_eq!(r.start, next);
                assert!(r.len() + 1 >= size / k);
                next = r.end;
            }
            assert_eq!(next, size);
        }
    }

    #[test]
    fn roles_rotate_the_header_socket() {
        assert_eq!(roles(0, 0, 4), (0, 0));
        assert_eq!(roles(5, 1, 4), (1, 0));
        assert_eq!(roles(5, 0, 4), (1, 3));
        assert_eq!(roles(7, 2, 1), (0, 0));
    }
}
