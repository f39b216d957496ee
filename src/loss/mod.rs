//! Loss models and effects: pure, seeded and unit-tested; the only I/O is reading a trace
//! file when a profile loads.

pub mod effect;
pub mod engine;
pub mod model;
pub mod plan;
pub mod rng;
pub mod rules;
pub mod trace;
