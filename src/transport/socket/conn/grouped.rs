//! A posted (possibly grouped) receive: its buffers and tags, the messages its chunk headers
//! describe, and the matching of messages to buffers by tag, in NCCL's order.

use crate::loss::plan::Effect;
use crate::transport::{HostBuf, MAX_RECVS};
use crate::{Error, Result};

/// A message of a grouped receive, as its chunk headers describe it.
#[derive(Clone, Copy)]
pub(super) struct RecvMsg {
    /// A chunk header of this message has arrived: the fields below are set.
    pub(super) known: bool,
    /// The buffer the message lands in, once matched by tag.
    pub(super) buf_index: Option<usize>,
    pub(super) size: usize,
    pub(super) tag: i32,
    pub(super) effect: Effect,
    pub(super) mtu: u32,
    pub(super) flip_seed: u64,
    pub(super) chunks_left: usize,
    /// Sockets whose chunk header for this message has arrived (bit `s`).
    pub(super) got: u16,
}

pub(super) const UNKNOWN_MSG: RecvMsg = RecvMsg {
    known: false,
    buf_index: None,
    size: 0,
    tag: 0,
    effect: Effect::Zero,
    mtu: 0,
    flip_seed: 0,
    chunks_left: 0,
    got: 0,
};

/// A posted receive of up to [`MAX_RECVS`] buffers, and the messages that land in them.
pub(super) struct RecvSlot {
    pub(super) n: usize,
    pub(super) first_seq: u64,
    pub(super) bufs: [HostBuf; MAX_RECVS],
    pub(super) tags: [i32; MAX_RECVS],
    pub(super) taken: [bool; MAX_RECVS],
    pub(super) sizes: [usize; MAX_RECVS],
    /// Messages in stream order (message `first_seq + i` is `msgs[i]`).
    pub(super) msgs: [RecvMsg; MAX_RECVS],
    pub(super) msgs_left: usize,
}

impl RecvSlot {
    /// Matches message `i` to the first buffer with its tag not taken by an earlier message
    /// of this receive. `Ok(None)`: that depends on earlier messages whose headers are still
    /// on their way (only when several buffers share the tag).
    pub(super) fn match_buffer(&mut self, i: usize) -> Result<Option<usize>> {
        if let Some(b) = self.msgs[i].buf_index {
            return Ok(Some(b));
        }
        let tag = self.msgs[i].tag;
        let with_tag = |b: &usize| self.tags[*b] == tag;
        let rank = match (0..self.n).filter(with_tag).count() {
            0 => {
                return Err(Error::invalid_usage(format!(
                    "a message with tag {tag} arrived, but the posted receive has tags {:?}",
                    &self.tags[..self.n]
                )))
            }
            // One buffer with this tag: it is this message's, whatever came before.
            1 => 0,
            _ => {
                if self.msgs[..i].iter().any(|m| !m.known) {
                    return Ok(None);
                }
                self.msgs[..i].iter().filter(|m| m.tag == tag).count()
            }
        };
        let found = (0..self.n).filter(with_tag).nth(rank);
        match found {
            Some(b) if !self.taken[b] => {
                self.taken[b] = true;
                self.msgs[i].buf_index = Some(b);
                Ok(Some(b))
            }
            _ => Err(Error::invalid_usage(format!(
                "more messages with tag {tag} than buffers with that tag in the posted receive"
            ))),
        }
    }
}
