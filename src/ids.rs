//! Names that loss rules and statistics share: NCCL's collective functions (as profile rules
//! match them and as statistics count them, one slot each) and the training phases.
//!
//! A leaf: it imports nothing of the crate, so `loss` and `stats` can both use it without
//! importing each other.

/// Number of collective slots: "unknown" plus NCCL's function codes 0..=14.
pub const OP_SLOTS: usize = 16;

/// Number of training phases tracked: any (unset), forward, backward.
pub const PHASE_SLOTS: usize = 3;

/// NCCL's collective function names, indexed by `ncclFunc_t` (stable since NCCL 2.27).
const NCCL_FUNC_NAMES: [&str; OP_SLOTS - 1] = [
    "Broadcast",
    "Reduce",
    "AllGather",
    "ReduceScatter",
    "AllReduce",
    "SendRecv",
    "Send",
    "Recv",
    "AllToAll",
    "Scatter",
    "Gather",
    "AllGatherV",
    "PutSignal",
    "Signal",
    "WaitSignal",
];

/// Name of the collective in op slot `slot` (0 is "Unknown").
pub fn op_name(slot: usize) -> &'static str {
    match slot {
        0 => "Unknown",
        s => NCCL_FUNC_NAMES.get(s - 1).copied().unwrap_or("Unknown"),
    }
}

/// Op slot of the `op` bitmask NCCL passes to `setNetAttr`: one bit set (`1 << ncclFunc`)
/// names a collective, as NCCL sets it per transfer; no bit or several (what NCCL sets when a
/// connection is made: every bit, or the point-to-point functions together) name none.
pub fn op_slot(op_bits: u32) -> usize {
    if op_bits.count_ones() != 1 {
        return 0;
    }
    let func = op_bits.trailing_zeros() as usize;
    if func + 1 < OP_SLOTS {
        func + 1
    } else {
        0
    }
}

/// Phase of the training step, as set by the training script.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not set, or between phases.
    Any = 0,
    /// Forward pass.
    Forward = 1,
    /// Backward pass (gradient traffic).
    Backward = 2,
}

impl Phase {
    /// The phase for a numeric code from the C API (also its phase slot), if valid.
    pub fn from_code(code: i32) -> Option<Phase> {
        match code {
            0 => Some(Phase::Any),
            1 => Some(Phase::Forward),
            2 => Some(Phase::Backward),
            _ => None,
        }
    }

    /// Lower-case name, as in profiles and statistics files.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Any => "any",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
        }
    }
}

/// Name of phase slot `slot`.
pub fn phase_name(slot: usize) -> &'static str {
    i32::try_from(slot)
        .ok()
        .and_then(Phase::from_code)
        .map_or(Phase::Any.name(), Phase::name)
}

/// An NCCL collective a profile rule can match on: one per op slot, `Unknown` (0) and then
/// every `ncclFunc_t` the statistics name (so a rule can pick whatever a report shows, and a
/// rule on `Unknown` takes only what NCCL did not name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum CollectiveId {
    /// Not known (old NCCL, or no single function named).
    Unknown = 0,
    /// ncclFunc 0.
    Broadcast = 1,
    /// ncclFunc 1.
    Reduce = 2,
    /// ncclFunc 2.
    AllGather = 3,
    /// ncclFunc 3.
    ReduceScatter = 4,
    /// ncclFunc 4.
    AllReduce = 5,
    /// ncclFunc 5.
    SendRecv = 6,
    /// ncclFunc 6.
    Send = 7,
    /// ncclFunc 7.
    Recv = 8,
    /// ncclFunc 8.
    AllToAll = 9,
    /// ncclFunc 9.
    Scatter = 10,
    /// ncclFunc 10.
    Gather = 11,
    /// ncclFunc 11.
    AllGatherV = 12,
    /// ncclFunc 12.
    PutSignal = 13,
    /// ncclFunc 13.
    Signal = 14,
    /// ncclFunc 14.
    WaitSignal = 15,
}

impl CollectiveId {
    /// Every collective, `Unknown` first, then in `ncclFunc_t` order (index = op slot).
    pub const ALL: [CollectiveId; OP_SLOTS] = [
        CollectiveId::Unknown,
        CollectiveId::Broadcast,
        CollectiveId::Reduce,
        CollectiveId::AllGather,
        CollectiveId::ReduceScatter,
        CollectiveId::AllReduce,
        CollectiveId::SendRecv,
        CollectiveId::Send,
        CollectiveId::Recv,
        CollectiveId::AllToAll,
        CollectiveId::Scatter,
        CollectiveId::Gather,
        CollectiveId::AllGatherV,
        CollectiveId::PutSignal,
        CollectiveId::Signal,
        CollectiveId::WaitSignal,
    ];

    /// The collective of an op slot (see [`op_slot`]); a slot past the last is `Unknown`.
    pub fn from_op_slot(slot: usize) -> CollectiveId {
        CollectiveId::ALL
            .get(slot)
            .copied()
            .unwrap_or(CollectiveId::Unknown)
    }

    /// The collective for an `ncclFunc_t` value.
    pub fn from_func_index(i: u32) -> CollectiveId {
        usize::try_from(i)
            .ok()
            .and_then(|i| i.checked_add(1))
            .map_or(CollectiveId::Unknown, CollectiveId::from_op_slot)
    }

    /// The collective of NCCL's op bitmask (`1 << ncclFunc`; no bit or several: `Unknown`).
    pub fn from_op_mask(bits: u32) -> CollectiveId {
        CollectiveId::from_op_slot(op_slot(bits))
    }

    /// The op slot of this collective.
    pub fn op_slot(self) -> usize {
        self as usize
    }

    /// The name as NCCL and the profiles write it.
    pub fn name(self) -> &'static str {
        op_name(self.op_slot())
    }

    /// Parses a name, ignoring case.
    pub fn parse(name: &str) -> Option<CollectiveId> {
        CollectiveId::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for CollectiveId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_bits_map_to_nccl_function_names() {
        assert_eq!(op_name(op_slot(0)), "Unknown");
        assert_eq!(op_name(op_slot(1 << 0)), "Broadcast");
        assert_eq!(op_name(op_slot(1 << 2)), "AllGather");
        assert_eq!(op_name(op_slot(1 << 3)), "ReduceScatter");
        assert_eq!(op_name(op_slot(1 << 4)), "AllReduce");
        assert_eq!(op_name(op_slot(1 << 5)), "SendRecv");
        assert_eq!(op_name(op_slot(1 << 31)), "Unknown");
        // What NCCL sets when a connection is made (src/transport/net.cc,
        // populateCommNetAttrs): every bit (the undefined op) for collective connections, and
        // Send | Recv | AllToAll | Scatter | Gather for point-to-point ones. Neither names one
        // collective, and a message posted under them must not be counted as the lowest bit's.
        assert_eq!(op_name(op_slot(u32::MAX)), "Unknown");
        assert_eq!(
            op_name(op_slot(
                (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10)
            )),
            "Unknown"
        );
        assert_eq!(op_name(OP_SLOTS + 3), "Unknown");
    }

    #[test]
    fn collective_ids_are_op_slots() {
        for (slot, c) in CollectiveId::ALL.iter().enumerate() {
            assert_eq!(c.op_slot(), slot);
            assert_eq!(CollectiveId::from_op_slot(slot), *c);
            assert_eq!(CollectiveId::parse(&c.name().to_lowercase()), Some(*c));
        }
        assert_eq!(CollectiveId::AllReduce.name(), "AllReduce");
        assert_eq!(CollectiveId::from_func_index(4), CollectiveId::AllReduce);
        assert_eq!(CollectiveId::from_func_index(8), CollectiveId::AllToAll);
        assert_eq!(CollectiveId::from_func_index(14), CollectiveId::WaitSignal);
        assert_eq!(CollectiveId::from_func_index(15), CollectiveId::Unknown);
        // Every name the statistics give an op slot is one a rule can match.
        for slot in 0..OP_SLOTS {
            assert_eq!(
                CollectiveId::parse(op_name(slot)).map(|c| c.op_slot()),
                Some(slot)
            );
        }
        assert_eq!(
            CollectiveId::from_func_index(u32::MAX),
            CollectiveId::Unknown
        );
        assert_eq!(
            CollectiveId::from_op_mask(1 << 3),
            CollectiveId::ReduceScatter
        );
        assert_eq!(CollectiveId::from_op_mask(0), CollectiveId::Unknown);
        // Several bits name no one collective.
        assert_eq!(
            CollectiveId::from_op_mask((1 << 4) | (1 << 6)),
            CollectiveId::Unknown
        );
        assert_eq!(CollectiveId::parse("AllReduse"), None);
    }

    #[test]
    fn phase_slots_name_the_phases() {
        assert_eq!(
            (0..PHASE_SLOTS).map(phase_name).collect::<Vec<_>>(),
            ["any", "forward", "backward"]
        );
        assert_eq!(phase_name(7), "any");
        assert_eq!(Phase::from_code(2), Some(Phase::Backward));
        assert_eq!(Phase::from_code(3), None);
    }
}
