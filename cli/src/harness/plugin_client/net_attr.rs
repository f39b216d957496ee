//! The hints NCCL's proxy hands a v11+ plugin's `setNetAttr`, built as NCCL builds them
//! (src/transport/net.cc): before each `connect` and `accept` call, the connection's
//! (`populateCommNetAttrs`: for a collective connection the op is `NCCL_NET_ATTR_UNDEF`,
//! every bit, and each side has 1 to min(nRanks, 4) peers and 1 to nChannels flows per
//! peer); before a collective's transfers, its op with the peers and channels of the
//! operation (`setXferNetAttrs`: a ring has one peer each way, over the collective's
//! channels), only when those differ from the hints it gave last (`proxyState->netAttr`).
//! No NCCL run passes zero peers or flows.

use std::io::Write;

use nccl_net_lossy::ffi::{ncclNetAttr_v11_t, ncclNetCommAttr_v11_t};
use nccl_net_lossy::Result;

use super::{with_ctx, ClientInner, ALGO_RING_BIT, PROTO_SIMPLE_BIT};

/// `NCCL_NET_ATTR_UNDEF` as NCCL stores it in the unsigned fields.
const UNDEF: u32 = u32::MAX;

/// `NCCL_MAX_TREE_ARITY` (src/include/device.h): a collective connection's most peers are
/// `(NCCL_MAX_TREE_ARITY - 1) * 2`.
const MAX_TREE_ARITY: usize = 3;

/// What NCCL's hints describe of a communicator: its ranks and its channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommShape {
    /// Ranks of the communicator.
    pub ranks: usize,
    /// Channels (connections to each peer) it uses.
    pub channels: usize,
}

impl Default for CommShape {
    /// A pair of ranks over one channel (a client that was told nothing else).
    fn default() -> CommShape {
        CommShape {
            ranks: 2,
            channels: 1,
        }
    }
}

fn int(n: usize) -> i32 {
    i32::try_from(n.max(1)).unwrap_or(i32::MAX)
}

fn side(
    min_peers: usize,
    max_peers: usize,
    min_flows: usize,
    max_flows: usize,
) -> ncclNetCommAttr_v11_t {
    ncclNetCommAttr_v11_t {
        minConcurrentPeers: int(min_peers),
        maxConcurrentPeers: int(max_peers),
        minFlowsPerPeer: int(min_flows),
        maxFlowsPerPeer: int(max_flows),
    }
}

/// The hints of a collective connection of `shape` (`populateCommNetAttrs`).
pub(super) fn connection(shape: CommShape) -> ncclNetAttr_v11_t {
    let peers = shape.ranks.min((MAX_TREE_ARITY - 1) * 2);
    let hints = side(1, peers, 1, shape.channels);
    ncclNetAttr_v11_t {
        sendCommAttr: hints,
        recvCommAttr: hints,
        op: UNDEF,
        algo: UNDEF,
        proto: UNDEF,
    }
}

/// The hints before the transfers of ring operation `op` (`1 << ncclFunc_t`) over `shape`'s
/// channels (`setXferNetAttrs`, which sets the side it posts on; the harness posts both).
pub(super) fn transfer(shape: CommShape, op: u32) -> ncclNetAttr_v11_t {
    let ring = side(1, 1, shape.channels, shape.channels);
    ncclNetAttr_v11_t {
        sendCommAttr: ring,
        recvCommAttr: ring,
        op,
        algo: ALGO_RING_BIT,
        proto: PROTO_SIMPLE_BIT,
    }
}

/// Gives the plugin the connection's `setNetAttr` hints (v11+), as NCCL's proxy does at the
/// start of every `connect` and `accept` call (`sendProxyConnect`/`recvProxyConnect`,
/// src/transport/net.cc); fails after `finalize`.
pub(super) fn hint_connection(inner: &ClientInner) -> Result<()> {
    hint(inner, &connection(inner.shape.get())).map(|_| ())
}

/// Gives the plugin the hints of ring operation `op` before its transfers, unless they are
/// the ones it was given last: NCCL's `setXferNetAttrs` compares them with
/// `proxyState->netAttr` and calls `setNetAttr` only when they differ, so a collective run
/// again and again is hinted once. `Ok(false)` when the plugin has no `setNetAttr`.
pub(super) fn hint_transfer(inner: &ClientInner, op: u32) -> Result<bool> {
    let attr = transfer(inner.shape.get(), op);
    match inner.given.get() {
        // Still checked as a call would be: no hint after `finalize`.
        Some((last, has)) if same(&last, &attr) => with_ctx(inner, |_| Ok(has)),
        _ => hint(inner, &attr),
    }
}

/// Field by field, what NCCL's `memcmp` of two hints finds equal (the struct has no padding).
fn same(a: &ncclNetAttr_v11_t, b: &ncclNetAttr_v11_t) -> bool {
    let side = |x: &ncclNetCommAttr_v11_t| {
        (
            x.minConcurrentPeers,
            x.maxConcurrentPeers,
            x.minFlowsPerPeer,
            x.maxFlowsPerPeer,
        )
    };
    side(&a.sendCommAttr) == side(&b.sendCommAttr)
        && side(&a.recvCommAttr) == side(&b.recvCommAttr)
        && (a.op, a.algo, a.proto) == (b.op, b.algo, b.proto)
}

/// Calls `setNetAttr(ctx, attr)` (v11+): whether the plugin has it. What it returns is
/// printed as a warning and otherwise ignored, as NCCL's proxy ignores it (`setNetAttrs`,
/// src/transport/net.cc), which records the hints as given either way; fails only after
/// `finalize`.
pub(super) fn hint(inner: &ClientInner, attr: &ncclNetAttr_v11_t) -> Result<bool> {
    let has = with_ctx(inner, |ctx| {
        match inner.plugin.set_net_attributes(ctx, attr) {
            Ok(has) => Ok(has),
            Err(err) => {
                // Not `eprintln!`, which panics when stderr cannot be written.
                let _ = writeln!(
                    std::io::stderr(),
                    "[pid {}] WARN {err} (ignored, as NCCL does)",
                    std::process::id()
                );
                Ok(true)
            }
        }
    })?;
    inner.given.set(Some((*attr, has)));
    Ok(has)
}
