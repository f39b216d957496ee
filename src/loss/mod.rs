//! Loss models and effects: pure, seeded, and unit-tested; no I/O.

pub mod effect;
pub mod plan;
