//! Loss models: what each one is (a [`ModelSpec`], parsed from a profile), what it should do
//! in the long run (closed forms), and a seeded generator ([`ModelState`]) that decides which
//! packets of a stream are lost.
//!
//! Every model is a Markov chain over a few states, each with its own loss probability
//! (`uniform` has one state, `gilbert_elliott` two, `markov4` four); `trace` replays a file.
//! The generator never draws once per packet: it samples how long the chain stays in a state
//! and, inside a state that loses only some packets, how many packets pass before the next
//! loss (both geometric), so a message costs a few draws per loss event, not per packet.
//! The chain's state survives from one message to the next, so bursts span message boundaries.
//!
//! Conventions follow netem (tc-netem(8)): Gilbert-Elliott draws the transition first and
//! decides the loss from the state the packet started in, starting in Good; the 4-state model
//! decides the loss from the state it moves to, starting in state 1. The run-length sampler
//! reproduces those per-packet processes in distribution (tests check it against a per-packet
//! reference), not draw for draw.

use std::path::Path;
use std::sync::Arc;

use crate::loss::trace::{TraceData, TraceEnd, TraceFormat, TraceStart};

mod closed_form;
mod loaded;
pub mod params;
mod state;
#[cfg(test)]
pub(crate) mod tests;

pub use loaded::{LoadedTraces, MAX_LOADED_TRACE_BYTES};
pub use params::{kind_names, model_keys, RawModel, MODEL_KINDS, MODEL_PARAMS};
pub use state::ModelState;

/// A model's parameters, resolved: Gilbert-Elliott is always held in netem's form.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", try_from = "RawModel")]
pub enum ModelSpec {
    /// Nothing is lost.
    None,
    /// Each packet lost independently with probability `rate`.
    Uniform {
        /// Loss probability per packet.
        rate: f64,
    },
    /// Two states, Good and Bad (netem `gemodel p r 1-h 1-k`).
    GilbertElliott {
        /// P(Good -> Bad) per packet.
        p: f64,
        /// P(Bad -> Good) per packet.
        r: f64,
        /// Loss probability in Bad (netem's 1-h).
        h_loss: f64,
        /// Loss probability in Good (netem's 1-k).
        k_loss: f64,
    },
    /// netem's 4-state model: 1 gap-received, 2 burst-received, 3 burst-lost, 4 isolated-lost.
    Markov4 {
        /// P(1 -> 3).
        p13: f64,
        /// P(3 -> 1).
        p31: f64,
        /// P(3 -> 2).
        p32: f64,
        /// P(2 -> 3).
        p23: f64,
        /// P(1 -> 4).
        p14: f64,
    },
    /// A recorded drop pattern replayed from a file.
    Trace(TraceSpec),
}

/// Where a trace comes from and how it is replayed.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TraceSpec {
    /// The trace file, relative to the profile's directory unless absolute.
    pub file: String,
    /// How the file lists drops.
    pub format: TraceFormat,
    /// Trace length in packets for the indices format (default: largest index + 1).
    pub length: Option<u64>,
    /// What follows the last packet.
    pub at_end: TraceEnd,
    /// Where each stream starts.
    pub start: TraceStart,
    /// The loaded drops (filled by [`ModelSpec::load_trace`]; absent, the trace loses nothing).
    #[serde(skip)]
    pub data: Option<Arc<TraceData>>,
}

/// Why a model table is not valid: the key at fault (relative to the model table) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelError {
    /// The offending key (`kind` for kind-level problems).
    pub key: &'static str,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// A byte count in binary units with one decimal ("3.1 MiB"), whole bytes below 1 KiB.
pub fn binary_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Short decimal form for summaries: up to 6 significant digits, no trailing zeros; below
/// 1e-6 and from 1e9 up in exponent form (`1e-13`, not `0`; `1e300`, not 300 digits).
pub fn short(x: f64) -> String {
    if x.is_infinite() {
        return "inf".into();
    }
    if x == 0.0 {
        // -0 too.
        return "0".into();
    }
    if !x.is_finite() {
        return format!("{x}");
    }
    if !(1e-6..1e9).contains(&x.abs()) {
        let s = format!("{x:.5e}");
        return match s.split_once('e') {
            Some((mantissa, exp)) if mantissa.contains('.') => format!(
                "{}e{exp}",
                mantissa.trim_end_matches('0').trim_end_matches('.')
            ),
            _ => s,
        };
    }
    let digits = (5 - x.abs().log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{x:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

impl ModelSpec {
    /// The kind's name as written in profiles.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelSpec::None => "none",
            ModelSpec::Uniform { .. } => "uniform",
            ModelSpec::GilbertElliott { .. } => "gilbert_elliott",
            ModelSpec::Markov4 { .. } => "markov4",
            ModelSpec::Trace(_) => "trace",
        }
    }

    /// Reads a trace model's file (relative paths from `base`); other kinds: nothing to do.
    /// A file `loaded` already holds (the same file, by any path: another rule naming it) is
    /// shared, not read again: each copy holds 16 bytes per lost run, so rules naming one
    /// trace would multiply the memory by their number; and all the profile's traces together
    /// keep at most [`MAX_LOADED_TRACE_BYTES`].
    pub fn load_trace(
        &mut self,
        base: Option<&Path>,
        loaded: &mut LoadedTraces,
    ) -> Result<(), ModelError> {
        if let ModelSpec::Trace(spec) = self {
            let path = Path::new(&spec.file);
            let path = match base {
                Some(dir) if path.is_relative() => dir.join(path),
                _ => path.to_path_buf(),
            };
            let data = loaded
                .load(&path, spec.format, spec.length)
                .map_err(|message| ModelError {
                    key: "file",
                    message,
                })?;
            spec.data = Some(data);
        }
        Ok(())
    }

    /// True when the model can lose any packet at all.
    pub fn can_lose(&self) -> bool {
        match *self {
            ModelSpec::None => false,
            ModelSpec::Uniform { rate } => rate > 0.0,
            ModelSpec::GilbertElliott {
                p, h_loss, k_loss, ..
            } => k_loss > 0.0 || (p > 0.0 && h_loss > 0.0),
            ModelSpec::Markov4 { p13, p14, .. } => p13 > 0.0 || p14 > 0.0,
            ModelSpec::Trace(ref t) => t.data.as_ref().is_some_and(|d| !d.runs.is_empty()),
        }
    }

    /// One-line description with the parameters, for summaries.
    pub fn describe(&self) -> String {
        match self {
            ModelSpec::None => "none".into(),
            ModelSpec::Uniform { rate } => format!("uniform(rate={})", short(*rate)),
            ModelSpec::GilbertElliott {
                p,
                r,
                h_loss,
                k_loss,
            } => format!(
                "gilbert_elliott(p={}, r={}, h_loss={}, k_loss={})",
                short(*p),
                short(*r),
                short(*h_loss),
                short(*k_loss)
            ),
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => format!(
                "markov4(p13={}, p31={}, p32={}, p23={}, p14={})",
                short(*p13),
                short(*p31),
                short(*p32),
                short(*p23),
                short(*p14)
            ),
            ModelSpec::Trace(t) => match &t.data {
                Some(d) => format!(
                    "trace({}, {} packets, {} lost)",
                    t.file,
                    d.length,
                    d.lost_packets()
                ),
                None => format!("trace({}, not loaded)", t.file),
            },
        }
    }
}
