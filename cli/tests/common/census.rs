//! What receivers saw of lost packets, checked against what the senders counted.

use lossy_cli::harness::worker::PacketCensus;

/// Every packet the senders counted as lost (`lost`) arrived damaged in the effect's way
/// (`damaged` of them), every other packet intact, and none damaged any other way; `what`
/// names the case in a failure.
pub fn assert_exact_damage(census: &PacketCensus, damaged: u64, lost: u64, what: &str) {
    assert_eq!(damaged, lost, "{what}: receivers saw {census:?}");
    assert_eq!(
        census.intact + damaged,
        census.packets,
        "{what}: {census:?}"
    );
    assert_eq!(census.other, 0, "{what}: {census:?}");
}
