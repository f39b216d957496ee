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

use crate::loss::plan::PacketRun;
use crate::loss::rng::{Geometric, StreamRng, NEVER};
use crate::loss::trace::{TraceCursor, TraceData, TraceEnd, TraceFormat, TraceStart};
use rand::Rng;

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

/// A model table as written, before checks: every key any kind accepts.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    /// `none`, `uniform`, `gilbert_elliott`, `markov4` or `trace`.
    pub kind: String,
    /// Loss rate (uniform; intuitive Gilbert-Elliott).
    pub rate: Option<f64>,
    /// Mean loss burst in packets (intuitive Gilbert-Elliott).
    pub mean_burst: Option<f64>,
    /// Gilbert-Elliott P(Good -> Bad).
    pub p: Option<f64>,
    /// Gilbert-Elliott P(Bad -> Good).
    pub r: Option<f64>,
    /// Gilbert-Elliott loss probability in Bad.
    pub h_loss: Option<f64>,
    /// Gilbert-Elliott loss probability in Good.
    pub k_loss: Option<f64>,
    /// 4-state P(1 -> 3).
    pub p13: Option<f64>,
    /// 4-state P(3 -> 1).
    pub p31: Option<f64>,
    /// 4-state P(3 -> 2).
    pub p32: Option<f64>,
    /// 4-state P(2 -> 3).
    pub p23: Option<f64>,
    /// 4-state P(1 -> 4).
    pub p14: Option<f64>,
    /// Trace file.
    pub file: Option<String>,
    /// Trace format.
    pub format: Option<String>,
    /// Trace length in packets.
    pub length: Option<u64>,
    /// Trace end behaviour.
    pub at_end: Option<String>,
    /// Trace start position.
    pub start: Option<String>,
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

impl TryFrom<RawModel> for ModelSpec {
    type Error = String;
    fn try_from(raw: RawModel) -> Result<ModelSpec, String> {
        ModelSpec::from_raw(&raw).map_err(|e| e.to_string())
    }
}

/// The model kinds, as written in profiles.
pub const MODEL_KINDS: &str = "none, uniform, gilbert_elliott, markov4, trace";

fn err(key: &'static str, message: impl Into<String>) -> ModelError {
    ModelError {
        key,
        message: message.into(),
    }
}

fn prob(key: &'static str, value: f64) -> Result<f64, ModelError> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(err(key, "must be a probability in [0, 1]"))
    }
}

fn opt_prob(key: &'static str, value: Option<f64>) -> Result<Option<f64>, ModelError> {
    value.map(|v| prob(key, v)).transpose()
}

/// Short decimal form for summaries: up to 6 significant digits, no trailing zeros.
pub fn short(x: f64) -> String {
    if x.is_infinite() {
        return "inf".into();
    }
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
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
    /// Checks a model table and resolves defaults (netem's, for the Markov models).
    pub fn from_raw(raw: &RawModel) -> Result<ModelSpec, ModelError> {
        let present: Vec<&'static str> = [
            ("rate", raw.rate.is_some()),
            ("mean_burst", raw.mean_burst.is_some()),
            ("p", raw.p.is_some()),
            ("r", raw.r.is_some()),
            ("h_loss", raw.h_loss.is_some()),
            ("k_loss", raw.k_loss.is_some()),
            ("p13", raw.p13.is_some()),
            ("p31", raw.p31.is_some()),
            ("p32", raw.p32.is_some()),
            ("p23", raw.p23.is_some()),
            ("p14", raw.p14.is_some()),
            ("file", raw.file.is_some()),
            ("format", raw.format.is_some()),
            ("length", raw.length.is_some()),
            ("at_end", raw.at_end.is_some()),
            ("start", raw.start.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, p)| p.then_some(k))
        .collect();
        let only = |allowed: &[&str], kind: &str| -> Result<(), ModelError> {
            match present.iter().find(|k| !allowed.contains(k)) {
                Some(k) => Err(err(
                    k,
                    format!(
                        "not a parameter of kind {kind}; it takes {}",
                        if allowed.is_empty() {
                            "no parameters".to_string()
                        } else {
                            allowed.join(", ")
                        }
                    ),
                )),
                None => Ok(()),
            }
        };
        match raw.kind.to_ascii_lowercase().as_str() {
            "none" => {
                only(&[], "none")?;
                Ok(ModelSpec::None)
            }
            "uniform" => {
                only(&["rate"], "uniform")?;
                let rate = raw
                    .rate
                    .ok_or_else(|| err("rate", "missing; uniform needs rate in [0, 1]"))?;
                Ok(ModelSpec::Uniform {
                    rate: prob("rate", rate)?,
                })
            }
            "gilbert_elliott" => {
                let netem = raw.p.is_some()
                    || raw.r.is_some()
                    || raw.h_loss.is_some()
                    || raw.k_loss.is_some();
                let intuitive = raw.rate.is_some() || raw.mean_burst.is_some();
                if netem && intuitive {
                    let which = if raw.rate.is_some() {
                        "rate"
                    } else {
                        "mean_burst"
                    };
                    return Err(err(
                        which,
                        "gilbert_elliott takes either netem's p, r, h_loss, k_loss or rate and mean_burst, not both",
                    ));
                }
                if intuitive {
                    only(&["rate", "mean_burst"], "gilbert_elliott (rate form)")?;
                    let rate = prob(
                        "rate",
                        raw.rate.ok_or_else(|| {
                            err("rate", "missing; the rate form needs rate and mean_burst")
                        })?,
                    )?;
                    let burst = raw.mean_burst.ok_or_else(|| {
                        err(
                            "mean_burst",
                            "missing; the rate form needs rate and mean_burst",
                        )
                    })?;
                    ModelSpec::gilbert_elliott_from_rate(rate, burst)
                } else {
                    only(&["p", "r", "h_loss", "k_loss"], "gilbert_elliott")?;
                    let p = prob(
                        "p",
                        raw.p.ok_or_else(|| err("p", "missing; gilbert_elliott needs p (and optionally r, h_loss, k_loss) or rate and mean_burst"))?,
                    )?;
                    // netem's defaults: r = 1 - p, 1-h = 1, 1-k = 0.
                    let r = opt_prob("r", raw.r)?.unwrap_or(1.0 - p);
                    let h_loss = opt_prob("h_loss", raw.h_loss)?.unwrap_or(1.0);
                    let k_loss = opt_prob("k_loss", raw.k_loss)?.unwrap_or(0.0);
                    Ok(ModelSpec::GilbertElliott {
                        p,
                        r,
                        h_loss,
                        k_loss,
                    })
                }
            }
            "markov4" => {
                only(&["p13", "p31", "p32", "p23", "p14"], "markov4")?;
                let p13 = prob(
                    "p13",
                    raw.p13.ok_or_else(|| {
                        err(
                            "p13",
                            "missing; markov4 needs p13 (others default as in netem)",
                        )
                    })?,
                )?;
                // netem's defaults: p31 = 1 - p13, p32 = 0, p23 = 1, p14 = 0.
                let p31 = opt_prob("p31", raw.p31)?.unwrap_or(1.0 - p13);
                let p32 = opt_prob("p32", raw.p32)?.unwrap_or(0.0);
                let p23 = opt_prob("p23", raw.p23)?.unwrap_or(1.0);
                let p14 = opt_prob("p14", raw.p14)?.unwrap_or(0.0);
                if p13 + p14 > 1.0 + 1e-12 {
                    return Err(err(
                        "p14",
                        format!(
                            "p13 + p14 = {} must be at most 1 (both leave state 1)",
                            short(p13 + p14)
                        ),
                    ));
                }
                if p31 + p32 > 1.0 + 1e-12 {
                    return Err(err(
                        "p32",
                        format!(
                            "p31 + p32 = {} must be at most 1 (both leave state 3)",
                            short(p31 + p32)
                        ),
                    ));
                }
                if p13 > 0.0 && p31 + p32 == 0.0 {
                    return Err(err(
                        "p31",
                        "p31 + p32 must be > 0 when p13 > 0, or the first burst would never end",
                    ));
                }
                if p13 > 0.0 && p32 > 0.0 && p23 == 0.0 {
                    return Err(err(
                        "p23",
                        "p23 must be > 0 when p32 > 0, or state 2 would never be left",
                    ));
                }
                Ok(ModelSpec::Markov4 {
                    p13,
                    p31,
                    p32,
                    p23,
                    p14,
                })
            }
            "trace" => {
                only(&["file", "format", "length", "at_end", "start"], "trace")?;
                let file = raw
                    .file
                    .clone()
                    .ok_or_else(|| err("file", "missing; trace needs file"))?;
                let format = match raw
                    .format
                    .as_deref()
                    .map(str::to_ascii_lowercase)
                    .as_deref()
                {
                    None | Some("indices") => TraceFormat::Indices,
                    Some("bitmap") => TraceFormat::Bitmap,
                    Some(_) => return Err(err("format", "must be \"indices\" or \"bitmap\"")),
                };
                if format == TraceFormat::Bitmap && raw.length.is_some() {
                    return Err(err("length", "applies to format = \"indices\" only"));
                }
                let at_end = match raw
                    .at_end
                    .as_deref()
                    .map(str::to_ascii_lowercase)
                    .as_deref()
                {
                    None | Some("wrap") => TraceEnd::Wrap,
                    Some("stop") => TraceEnd::Stop,
                    Some(_) => return Err(err("at_end", "must be \"wrap\" or \"stop\"")),
                };
                let start = match raw.start.as_deref().map(str::to_ascii_lowercase).as_deref() {
                    None | Some("random") => TraceStart::Random,
                    Some("beginning") => TraceStart::Beginning,
                    Some(_) => return Err(err("start", "must be \"random\" or \"beginning\"")),
                };
                Ok(ModelSpec::Trace(TraceSpec {
                    file,
                    format,
                    length: raw.length,
                    at_end,
                    start,
                    data: None,
                }))
            }
            _ => Err(err(
                "kind",
                format!(
                    "unknown model kind \"{}\"; allowed: {MODEL_KINDS}",
                    raw.kind
                ),
            )),
        }
    }

    /// Gilbert-Elliott from a loss rate and a mean burst length: with h_loss = 1 and
    /// k_loss = 0 (every Bad packet lost, no Good packet lost) a burst is a Bad sojourn, so
    /// mean_burst = 1/r, and the stationary loss p/(p+r) = rate gives p = rate·r/(1-rate).
    pub fn gilbert_elliott_from_rate(rate: f64, mean_burst: f64) -> Result<ModelSpec, ModelError> {
        let rate = prob("rate", rate)?;
        if !mean_burst.is_finite() || mean_burst < 1.0 {
            return Err(err(
                "mean_burst",
                "must be a number >= 1 (packets per loss burst)",
            ));
        }
        if rate >= 1.0 {
            return Err(err("rate", "must be < 1 with bursts (a burst has to end); use uniform with rate = 1 for total loss"));
        }
        let r = 1.0 / mean_burst;
        let p = rate * r / (1.0 - rate);
        if p > 1.0 {
            return Err(err(
                "rate",
                format!(
                    "rate = {} with mean_burst = {} needs p = {} > 1: with bursts of B packets on average, rate must be at most B/(B+1) = {}",
                    short(rate),
                    short(mean_burst),
                    short(p),
                    short(mean_burst / (mean_burst + 1.0))
                ),
            ));
        }
        Ok(ModelSpec::GilbertElliott {
            p,
            r,
            h_loss: 1.0,
            k_loss: 0.0,
        })
    }

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
    pub fn load_trace(&mut self, base: Option<&Path>) -> Result<(), ModelError> {
        if let ModelSpec::Trace(spec) = self {
            let path = Path::new(&spec.file);
            let path = match base {
                Some(dir) if path.is_relative() => dir.join(path),
                _ => path.to_path_buf(),
            };
            let data =
                TraceData::load(&path, spec.format, spec.length).map_err(|m| err("file", m))?;
            spec.data = Some(Arc::new(data));
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

    /// Long-run fraction of packets lost (closed forms, see DESIGN §2); for a trace, one
    /// pass's fraction (NaN if its file is not loaded).
    pub fn expected_loss_rate(&self) -> f64 {
        match *self {
            ModelSpec::None => 0.0,
            ModelSpec::Uniform { rate } => rate,
            ModelSpec::GilbertElliott {
                p,
                r,
                h_loss,
                k_loss,
            } => {
                if p + r == 0.0 {
                    k_loss
                } else {
                    (k_loss * r + h_loss * p) / (p + r)
                }
            }
            ModelSpec::Markov4 { .. } => {
                let pi = self.stationary();
                pi[2] + pi[3]
            }
            ModelSpec::Trace(ref t) => t.data.as_ref().map_or(f64::NAN, |d| d.loss_rate()),
        }
    }

    /// Long-run mean length of a loss burst (consecutive lost packets): the loss rate divided
    /// by the rate at which bursts start, P(previous packet kept, this one lost). 0 when
    /// nothing is lost, infinite when nothing is ever kept again.
    pub fn expected_mean_burst(&self) -> f64 {
        let (lost, starts) = match *self {
            ModelSpec::None => (0.0, 0.0),
            ModelSpec::Uniform { rate } => (rate, (1.0 - rate) * rate),
            ModelSpec::GilbertElliott { .. } | ModelSpec::Markov4 { .. } => {
                let (pi, t, l) = (self.stationary(), self.transitions(), self.state_loss());
                let mut starts = 0.0;
                for s in 0..4 {
                    for u in 0..4 {
                        starts += pi[s] * (1.0 - l[s]) * t[s][u] * l[u];
                    }
                }
                (self.expected_loss_rate(), starts)
            }
            ModelSpec::Trace(ref t) => {
                return t.data.as_ref().map_or(f64::NAN, |d| d.mean_burst(t.at_end));
            }
        };
        if lost <= 0.0 {
            0.0
        } else if starts <= 0.0 {
            f64::INFINITY
        } else {
            lost / starts
        }
    }

    /// Stationary distribution over the chain's states (Good, Bad for Gilbert-Elliott;
    /// 1..4 for markov4), as reached from the start state.
    fn stationary(&self) -> [f64; 4] {
        let w = match *self {
            ModelSpec::GilbertElliott { p, r, .. } => {
                if p + r == 0.0 {
                    [1.0, 0.0, 0.0, 0.0]
                } else {
                    [r, p, 0.0, 0.0]
                }
            }
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => {
                // Balance: p13·π1 = p31·π3, p23·π2 = p32·π3, π4 = p14·π1.
                if p13 == 0.0 {
                    [1.0, 0.0, 0.0, p14]
                } else if p31 > 0.0 {
                    let w3 = p13 / p31;
                    let w2 = if p32 > 0.0 { p32 * w3 / p23 } else { 0.0 };
                    [1.0, w2, w3, p14]
                } else {
                    // State 1 is left for good: the chain ends up alternating 3 and 2.
                    [0.0, p32 / p23, 1.0, 0.0]
                }
            }
            _ => [1.0, 0.0, 0.0, 0.0],
        };
        let sum: f64 = w.iter().sum();
        w.map(|x| x / sum)
    }

    /// Per-packet transition matrix in the state order of [`Self::stationary`].
    fn transitions(&self) -> [[f64; 4]; 4] {
        match *self {
            ModelSpec::GilbertElliott { p, r, .. } => [
                [1.0 - p, p, 0.0, 0.0],
                [r, 1.0 - r, 0.0, 0.0],
                [0.0; 4],
                [0.0; 4],
            ],
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => [
                [1.0 - p13 - p14, 0.0, p13, p14],
                [0.0, 1.0 - p23, p23, 0.0],
                [p31, p32, 1.0 - p31 - p32, 0.0],
                [1.0, 0.0, 0.0, 0.0],
            ],
            _ => [[0.0; 4]; 4],
        }
    }

    /// Loss probability of a packet in each state.
    fn state_loss(&self) -> [f64; 4] {
        match *self {
            ModelSpec::GilbertElliott { h_loss, k_loss, .. } => [k_loss, h_loss, 0.0, 0.0],
            ModelSpec::Markov4 { .. } => [0.0, 0.0, 1.0, 1.0],
            _ => [0.0; 4],
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

/// One state of a compiled chain.
#[derive(Clone, Copy, Debug)]
struct State {
    /// Loss probability of a packet in this state.
    loss: f64,
    /// Packets kept before the next loss, for 0 < loss < 1.
    gap: Geometric,
    /// Extra packets spent in the state after the first (exit probability per packet).
    stay: Geometric,
    /// Where the chain goes on leaving: `to[0]` with probability `p_first`, else `to[1]`.
    to: [u8; 2],
    p_first: f64,
}

impl State {
    fn new(loss: f64, exit: f64, to: [u8; 2], p_first: f64) -> State {
        State {
            loss,
            gap: Geometric::new(loss),
            stay: Geometric::new(exit),
            to,
            p_first,
        }
    }
}

/// What produces the segments. The chain is kept inline (not boxed) on purpose: it is read
/// on every segment, and one model state per rule per connection is a few hundred bytes.
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
enum Source {
    /// Nothing is ever lost.
    Lossless,
    /// A Markov chain of up to four states.
    Chain {
        states: [State; 4],
        cur: u8,
        /// Packets left in the current state's sojourn.
        left: u64,
        /// The next packet is lost (a sampled gap has just been emitted).
        pending_loss: bool,
    },
    /// A trace replay.
    Trace {
        data: Arc<TraceData>,
        end: TraceEnd,
        cursor: TraceCursor,
    },
}

/// One stream's model: the chain state and generator, kept for the life of a connection.
#[derive(Clone, Debug)]
pub struct ModelState {
    rng: StreamRng,
    source: Source,
    /// Packets left in the current segment, and whether they are lost.
    seg_left: u64,
    seg_lost: bool,
}

impl ModelState {
    /// A fresh stream of `spec` driven by `rng` (an unloaded trace loses nothing).
    pub fn new(spec: &ModelSpec, mut rng: StreamRng) -> ModelState {
        let idle = State::new(0.0, 0.0, [0, 0], 1.0);
        let source = match *spec {
            ModelSpec::None => Source::Lossless,
            ModelSpec::Uniform { rate } if rate <= 0.0 => Source::Lossless,
            ModelSpec::Uniform { rate } => Source::Chain {
                states: [State::new(rate, 0.0, [0, 0], 1.0), idle, idle, idle],
                cur: 0,
                left: NEVER,
                pending_loss: false,
            },
            ModelSpec::GilbertElliott {
                p,
                r,
                h_loss,
                k_loss,
            } => {
                let good = State::new(k_loss, p, [1, 1], 1.0);
                let bad = State::new(h_loss, r, [0, 0], 1.0);
                // The first packet is in Good; it and each later Good packet leave with p.
                let left = 1 + good.stay.sample(&mut rng);
                Source::Chain {
                    states: [good, bad, idle, idle],
                    cur: 0,
                    left,
                    pending_loss: false,
                }
            }
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => {
                let exit1 = p13 + p14;
                let exit3 = p31 + p32;
                let s1 = State::new(
                    0.0,
                    exit1,
                    [2, 3],
                    if exit1 > 0.0 { p13 / exit1 } else { 1.0 },
                );
                let s2 = State::new(0.0, p23, [2, 2], 1.0);
                let s3 = State::new(
                    1.0,
                    exit3,
                    [0, 1],
                    if exit3 > 0.0 { p31 / exit3 } else { 1.0 },
                );
                let s4 = State::new(1.0, 1.0, [0, 0], 1.0);
                // The chain starts in 1 and the first packet already takes a transition, so
                // the first sojourn in 1 may be empty.
                let left = s1.stay.sample(&mut rng);
                Source::Chain {
                    states: [s1, s2, s3, s4],
                    cur: 0,
                    left,
                    pending_loss: false,
                }
            }
            ModelSpec::Trace(ref t) => match &t.data {
                Some(data) if !data.runs.is_empty() => {
                    let pos = match t.start {
                        TraceStart::Beginning => 0,
                        TraceStart::Random => rng.gen_range(0..data.length.max(1)),
                    };
                    Source::Trace {
                        data: Arc::clone(data),
                        end: t.at_end,
                        cursor: TraceCursor::at(data, pos),
                    }
                }
                _ => Source::Lossless,
            },
        };
        ModelState {
            rng,
            source,
            seg_left: 0,
            seg_lost: false,
        }
    }

    /// The next segment of the packet stream: (packets, lost?).
    #[inline]
    fn next_segment(&mut self) -> (u64, bool) {
        match &mut self.source {
            Source::Lossless => (NEVER, false),
            Source::Trace { data, end, cursor } => cursor.next_segment(data, *end),
            Source::Chain {
                states,
                cur,
                left,
                pending_loss,
            } => {
                if *left == 0 {
                    let s = &states[usize::from(*cur)];
                    let next = if s.p_first >= 1.0 || self.rng.gen::<f64>() < s.p_first {
                        s.to[0]
                    } else {
                        s.to[1]
                    };
                    *cur = next;
                    *left = 1 + states[usize::from(next)].stay.sample(&mut self.rng);
                }
                let s = &states[usize::from(*cur)];
                if s.loss <= 0.0 || s.loss >= 1.0 {
                    let n = *left;
                    *left = 0;
                    return (n, s.loss >= 1.0);
                }
                if *pending_loss {
                    *pending_loss = false;
                    *left -= 1;
                    return (1, true);
                }
                let gap = s.gap.sample(&mut self.rng);
                if gap >= *left {
                    let n = *left;
                    *left = 0;
                    (n, false)
                } else if gap == 0 {
                    *left -= 1;
                    (1, true)
                } else {
                    *left -= gap;
                    *pending_loss = true;
                    (gap, false)
                }
            }
        }
    }

    /// Decides the next `packets` packets of the stream and appends their lost runs (packet
    /// indices from 0) to `out`, merging adjacent losses. `packets` must fit in `u32`.
    pub fn fill(&mut self, packets: u64, out: &mut Vec<PacketRun>) {
        let packets = packets.min(u64::from(u32::MAX));
        let mut pos = 0u64;
        while pos < packets {
            if self.seg_left == 0 {
                let (n, lost) = self.next_segment();
                self.seg_left = n;
                self.seg_lost = lost;
                continue;
            }
            let take = self.seg_left.min(packets - pos);
            if self.seg_lost {
                // pos and take are below 2^32 by the clamp above.
                let start = pos as u32;
                match out.last_mut() {
                    Some(last) if last.end() == start => last.len += take as u32,
                    _ => out.push(PacketRun {
                        start,
                        len: take as u32,
                    }),
                }
            }
            pos += take;
            self.seg_left -= take;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::loss::rng::stream_rng;

    /// Loss statistics of `packets` packets of a stream, cut into messages of `chunk` packets
    /// so bursts that cross message boundaries are joined: (loss rate, mean burst, bursts).
    pub(crate) fn measure(
        spec: &ModelSpec,
        seed: u64,
        packets: u64,
        chunk: u64,
    ) -> (f64, f64, u64) {
        let mut state = ModelState::new(spec, stream_rng(seed));
        let mut runs = Vec::new();
        let (mut lost, mut bursts, mut done) = (0u64, 0u64, 0u64);
        let mut prev_lost_last = false;
        while done < packets {
            let n = chunk.min(packets - done);
            runs.clear();
            state.fill(n, &mut runs);
            for (i, run) in runs.iter().enumerate() {
                lost += u64::from(run.len);
                if !(i == 0 && run.start == 0 && prev_lost_last) {
                    bursts += 1;
                }
            }
            prev_lost_last = runs.last().is_some_and(|r| u64::from(r.end()) == n);
            done += n;
        }
        let burst = if bursts == 0 {
            0.0
        } else {
            lost as f64 / bursts as f64
        };
        (lost as f64 / packets as f64, burst, bursts)
    }

    /// Per-packet reference of netem's processes, one draw per decision: Gilbert-Elliott
    /// draws the transition, then the loss from the state the packet started in; markov4
    /// moves first and loses when it lands in 3 or 4. Returns (loss rate, mean burst).
    fn reference(spec: &ModelSpec, seed: u64, packets: u64) -> (f64, f64) {
        let mut rng = stream_rng(seed);
        let mut state = 0usize;
        let (mut lost, mut bursts, mut prev) = (0u64, 0u64, false);
        for _ in 0..packets {
            let is_lost = match *spec {
                ModelSpec::GilbertElliott {
                    p,
                    r,
                    h_loss,
                    k_loss,
                } => {
                    let start = state;
                    let u: f64 = rng.gen();
                    state = match state {
                        0 if u < p => 1,
                        1 if u < r => 0,
                        s => s,
                    };
                    rng.gen::<f64>() < if start == 0 { k_loss } else { h_loss }
                }
                ModelSpec::Markov4 {
                    p13,
                    p31,
                    p32,
                    p23,
                    p14,
                } => {
                    let u: f64 = rng.gen();
                    state = match state {
                        0 if u < p13 => 2,
                        0 if u < p13 + p14 => 3,
                        1 if u < p23 => 2,
                        2 if u < p31 => 0,
                        2 if u < p31 + p32 => 1,
                        3 => 0,
                        s => s,
                    };
                    state >= 2
                }
                _ => unreachable!("reference covers the Markov models only"),
            };
            if is_lost {
                lost += 1;
                if !prev {
                    bursts += 1;
                }
            }
            prev = is_lost;
        }
        (
            lost as f64 / packets as f64,
            lost as f64 / bursts.max(1) as f64,
        )
    }

    /// Tolerances, 5 standard deviations of the estimators over n packets.
    /// Loss rate: a Markov-modulated process is a renewal process of (kept, lost) cycles;
    /// by the ratio (delta) method the rate's variance is about
    /// ((1-ρ)²·Var(B) + ρ²·Var(G)) / (m·E[cycle]²) with m cycles (= bursts). Sojourns are
    /// geometric (CV ≤ 1), which bounds that by 2ρ²/m; Bernoulli losses inside a state add at
    /// most the binomial term ρ(1-ρ)/n. So σ_rate ≤ sqrt(2ρ²/m + ρ(1-ρ)/n), m = n·ρ/burst.
    /// Mean burst: a mean of m burst lengths, each with CV ≤ 1 (geometric, or for markov4 a
    /// mixture of 1 and a geometric, CV² ≤ 2): σ_burst ≤ burst·sqrt(2/m).
    pub(crate) fn tolerances(rate: f64, burst: f64, n: u64) -> (f64, f64) {
        let n = n as f64;
        let m = (n * rate / burst).max(1.0);
        let rate_tol = 5.0 * (2.0 * rate * rate / m + rate * (1.0 - rate) / n).sqrt();
        let burst_tol = 5.0 * burst * (2.0 / m).sqrt();
        (rate_tol, burst_tol)
    }

    fn check(spec: &ModelSpec, seed: u64, n: u64) {
        let (rate, burst) = (spec.expected_loss_rate(), spec.expected_mean_burst());
        let (rate_tol, burst_tol) = tolerances(rate, burst, n);
        let (got_rate, got_burst, _) = measure(spec, seed, n, 1000);
        assert!(
            (got_rate - rate).abs() < rate_tol,
            "{}: loss {got_rate} vs {rate} ± {rate_tol}",
            spec.describe()
        );
        assert!(
            (got_burst - burst).abs() < burst_tol,
            "{}: burst {got_burst} vs {burst} ± {burst_tol}",
            spec.describe()
        );
    }

    /// The per-packet reference over `n` packets meets the closed forms within the same
    /// tolerances as the generator: the closed forms describe netem's process, not ours.
    fn check_reference(spec: &ModelSpec, seed: u64, n: u64) {
        let (rate, burst) = (spec.expected_loss_rate(), spec.expected_mean_burst());
        let (rate_tol, burst_tol) = tolerances(rate, burst, n);
        let (ref_rate, ref_burst) = reference(spec, seed, n);
        assert!(
            (ref_rate - rate).abs() < rate_tol,
            "{}: reference loss {ref_rate} vs {rate} ± {rate_tol}",
            spec.describe()
        );
        assert!(
            (ref_burst - burst).abs() < burst_tol,
            "{}: reference burst {ref_burst} vs {burst} ± {burst_tol}",
            spec.describe()
        );
    }

    fn raw(kind: &str) -> RawModel {
        RawModel {
            kind: kind.into(),
            ..RawModel::default()
        }
    }

    #[test]
    fn uniform_matches_closed_form() {
        // Binomial: σ = sqrt(p(1-p)/n); the delta-method bound above is looser and also holds.
        for (i, &rate) in [0.001, 0.01, 0.1, 0.5].iter().enumerate() {
            let spec = ModelSpec::Uniform { rate };
            assert!((spec.expected_mean_burst() - 1.0 / (1.0 - rate)).abs() < 1e-12);
            check(&spec, 11 + i as u64, 4_000_000);
        }
        assert_eq!(
            measure(&ModelSpec::Uniform { rate: 1.0 }, 1, 5000, 100).0,
            1.0
        );
        assert_eq!(
            measure(&ModelSpec::Uniform { rate: 0.0 }, 1, 5000, 100).0,
            0.0
        );
        assert_eq!(measure(&ModelSpec::None, 1, 5000, 100).0, 0.0);
    }

    #[test]
    fn gilbert_elliott_matches_closed_form_and_reference() {
        let cases = [
            ModelSpec::GilbertElliott {
                p: 0.00126,
                r: 0.125,
                h_loss: 1.0,
                k_loss: 0.0,
            },
            ModelSpec::GilbertElliott {
                p: 0.01,
                r: 0.3,
                h_loss: 0.6,
                k_loss: 0.0,
            },
            ModelSpec::GilbertElliott {
                p: 0.02,
                r: 0.2,
                h_loss: 0.5,
                k_loss: 0.01,
            },
            ModelSpec::GilbertElliott {
                p: 0.1,
                r: 0.9,
                h_loss: 1.0,
                k_loss: 0.0,
            },
        ];
        for (i, spec) in cases.iter().enumerate() {
            check(spec, 100 + i as u64, 4_000_000);
            check_reference(spec, 200 + i as u64, 2_000_000);
        }
        // Simple Gilbert: loss p/(p+r), burst 1/r; with 1-k = 0, burst 1/(1-(1-r)·h_loss).
        let simple = &cases[0];
        assert!((simple.expected_loss_rate() - 0.00126 / 0.12626).abs() < 1e-12);
        assert!((simple.expected_mean_burst() - 8.0).abs() < 1e-9);
        assert!((cases[1].expected_mean_burst() - 1.0 / (1.0 - 0.7 * 0.6)).abs() < 1e-9);
    }

    #[test]
    fn markov4_matches_closed_form_and_reference() {
        let cases = [
            ModelSpec::Markov4 {
                p13: 0.001,
                p31: 0.2,
                p32: 0.3,
                p23: 0.4,
                p14: 0.005,
            },
            ModelSpec::Markov4 {
                p13: 0.01,
                p31: 0.99,
                p32: 0.0,
                p23: 1.0,
                p14: 0.0,
            },
            ModelSpec::Markov4 {
                p13: 0.05,
                p31: 0.5,
                p32: 0.1,
                p23: 0.2,
                p14: 0.02,
            },
        ];
        for (i, spec) in cases.iter().enumerate() {
            let ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } = *spec
            else {
                unreachable!()
            };
            // DESIGN §2's closed form for the loss.
            let design = (p13 * p23 + p14 * p31 * p23)
                / (p31 * p23 + p14 * p31 * p23 + p13 * p23 + p13 * p32);
            assert!((spec.expected_loss_rate() - design).abs() < 1e-12);
            check(spec, 300 + i as u64, 4_000_000);
            check_reference(spec, 400 + i as u64, 2_000_000);
        }
    }

    #[test]
    fn netem_defaults() {
        let mut m = raw("gilbert_elliott");
        m.p = Some(0.05);
        let spec = ModelSpec::from_raw(&m).unwrap();
        assert_eq!(
            spec,
            ModelSpec::GilbertElliott {
                p: 0.05,
                r: 0.95,
                h_loss: 1.0,
                k_loss: 0.0
            }
        );
        // With the defaults the chain is Bernoulli(p): same rate and bursts as uniform p.
        assert!((spec.expected_loss_rate() - 0.05).abs() < 1e-12);
        assert!((spec.expected_mean_burst() - 1.0 / 0.95).abs() < 1e-12);
        let mut m = raw("markov4");
        m.p13 = Some(0.1);
        let spec = ModelSpec::from_raw(&m).unwrap();
        assert_eq!(
            spec,
            ModelSpec::Markov4 {
                p13: 0.1,
                p31: 0.9,
                p32: 0.0,
                p23: 1.0,
                p14: 0.0
            }
        );
        // p31 = 1 - p13 makes state 3 a Bernoulli(p13) loss too.
        assert!((spec.expected_loss_rate() - 0.1).abs() < 1e-12);
    }

    #[test]
    fn intuitive_gilbert_elliott_converts() {
        let spec = ModelSpec::gilbert_elliott_from_rate(0.01, 8.0).unwrap();
        let ModelSpec::GilbertElliott {
            p,
            r,
            h_loss,
            k_loss,
        } = spec
        else {
            panic!("{spec:?}")
        };
        assert_eq!((h_loss, k_loss), (1.0, 0.0));
        assert!((r - 0.125).abs() < 1e-15);
        assert!((p - 0.01 * 0.125 / 0.99).abs() < 1e-15);
        assert!((spec.expected_loss_rate() - 0.01).abs() < 1e-12);
        assert!((spec.expected_mean_burst() - 8.0).abs() < 1e-9);
        check(&spec, 7, 8_000_000);
        // The same through a model table.
        let mut m = raw("gilbert_elliott");
        m.rate = Some(0.01);
        m.mean_burst = Some(8.0);
        assert_eq!(ModelSpec::from_raw(&m).unwrap(), spec);
        // mean_burst = 1 is Bernoulli again: r = 1, p = rate/(1-rate).
        let b = ModelSpec::gilbert_elliott_from_rate(0.2, 1.0).unwrap();
        assert!((b.expected_loss_rate() - 0.2).abs() < 1e-12);
    }

    #[test]
    fn invalid_models_name_the_key() {
        let e = ModelSpec::gilbert_elliott_from_rate(0.01, 0.5).unwrap_err();
        assert_eq!(e.key, "mean_burst");
        let e = ModelSpec::gilbert_elliott_from_rate(1.0, 4.0).unwrap_err();
        assert_eq!(e.key, "rate");
        let e = ModelSpec::gilbert_elliott_from_rate(0.6, 1.0).unwrap_err();
        assert!(e.message.contains("B/(B+1)"), "{e}");
        let mut m = raw("gilbert_elliott");
        m.p = Some(0.1);
        m.rate = Some(0.1);
        assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "rate");
        let mut m = raw("uniform");
        m.rate = Some(1.5);
        assert_eq!(
            ModelSpec::from_raw(&m).unwrap_err().message,
            "must be a probability in [0, 1]"
        );
        m.rate = Some(f64::NAN);
        assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "rate");
        let mut m = raw("uniform");
        m.p13 = Some(0.1);
        assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "p13");
        assert_eq!(
            ModelSpec::from_raw(&raw("uniform")).unwrap_err().key,
            "rate"
        );
        let e = ModelSpec::from_raw(&raw("bursty")).unwrap_err();
        assert!(e.key == "kind" && e.message.contains("markov4"), "{e}");
        let mut m = raw("markov4");
        m.p13 = Some(0.7);
        m.p14 = Some(0.5);
        assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "p14");
        let mut m = raw("markov4");
        m.p13 = Some(0.1);
        m.p31 = Some(0.0);
        assert_eq!(ModelSpec::from_raw(&m).unwrap_err().key, "p31");
        assert!(ModelSpec::from_raw(&raw("NONE")).is_ok());
    }

    #[test]
    fn serde_round_trip_uses_the_same_checks() {
        let spec: ModelSpec =
            serde_json::from_str(r#"{"kind":"gilbert_elliott","rate":0.01,"mean_burst":8}"#)
                .unwrap();
        assert_eq!(
            spec,
            ModelSpec::gilbert_elliott_from_rate(0.01, 8.0).unwrap()
        );
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["kind"], "gilbert_elliott");
        let back: ModelSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, spec);
        assert!(serde_json::from_str::<ModelSpec>(r#"{"kind":"uniform","rate":2}"#).is_err());
    }

    #[test]
    fn trace_replay_follows_the_file() {
        let data = TraceData::parse("0011000001", TraceFormat::Bitmap, None, "t").unwrap();
        let spec = |at_end, start| {
            ModelSpec::Trace(TraceSpec {
                file: "t".into(),
                format: TraceFormat::Bitmap,
                length: None,
                at_end,
                start,
                data: Some(Arc::new(data.clone())),
            })
        };
        let wrap = spec(TraceEnd::Wrap, TraceStart::Beginning);
        let mut s = ModelState::new(&wrap, stream_rng(1));
        let mut out = Vec::new();
        s.fill(7, &mut out);
        assert_eq!(out, vec![PacketRun { start: 2, len: 2 }]);
        out.clear();
        // Packets 7..20 of the stream are trace packets 7, 8, 9, then (wrapped) 0..=9: losses
        // at trace 9, 2-3 and 9 again, i.e. message packets 2, 5-6 and 12.
        s.fill(13, &mut out);
        let runs = [(2, 1), (5, 2), (12, 1)].map(|(start, len)| PacketRun { start, len });
        assert_eq!(out, runs.to_vec());
        // Wrapping, one pass is 3 of 10 lost; the run at 9 does not touch 0, so 2 bursts.
        assert!((wrap.expected_loss_rate() - 0.3).abs() < 1e-12);
        assert!((wrap.expected_mean_burst() - 1.5).abs() < 1e-12);
        let stop = spec(TraceEnd::Stop, TraceStart::Beginning);
        let mut s = ModelState::new(&stop, stream_rng(1));
        out.clear();
        s.fill(100, &mut out);
        assert_eq!(
            out,
            vec![
                PacketRun { start: 2, len: 2 },
                PacketRun { start: 9, len: 1 }
            ]
        );
        // Random starts: different streams start at different places, same long-run rate.
        let random = spec(TraceEnd::Wrap, TraceStart::Random);
        let firsts: std::collections::HashSet<Vec<(u32, u32)>> = (0..20)
            .map(|seed| {
                let mut s = ModelState::new(&random, stream_rng(seed));
                let mut out = Vec::new();
                s.fill(10, &mut out);
                out.iter().map(|r| (r.start, r.len)).collect()
            })
            .collect();
        assert!(firsts.len() > 3, "random starts should differ: {firsts:?}");
        let (rate, _, _) = measure(&random, 5, 10_000, 7);
        assert!((rate - 0.3).abs() < 1e-3 + 3.0 / 10_000.0);
    }

    #[test]
    fn bursts_span_message_boundaries() {
        // Mean burst 500 packets, messages of 10: inside a burst a message boundary must not
        // end it, so P(first packet lost | previous message's last lost) ≈ 1 - r = 0.998.
        let spec = ModelSpec::gilbert_elliott_from_rate(0.2, 500.0).unwrap();
        let mut s = ModelState::new(&spec, stream_rng(9));
        let mut out = Vec::new();
        let (mut both, mut prev_last) = (0u32, 0u32);
        let mut prev = false;
        for _ in 0..100_000 {
            out.clear();
            s.fill(10, &mut out);
            let first = out.first().is_some_and(|r| r.start == 0);
            if prev {
                prev_last += 1;
                both += u32::from(first);
            }
            prev = out.last().is_some_and(|r| r.end() == 10);
        }
        assert!(prev_last > 1000);
        assert!(
            f64::from(both) / f64::from(prev_last) > 0.98,
            "{both}/{prev_last}"
        );
    }

    #[test]
    fn runs_are_sorted_disjoint_and_inside() {
        let spec = ModelSpec::Uniform { rate: 0.3 };
        let mut s = ModelState::new(&spec, stream_rng(2));
        let mut out = Vec::new();
        for len in [1u64, 2, 3, 64, 1000] {
            out.clear();
            s.fill(len, &mut out);
            assert!(crate::loss::effect::check_runs(&out, len, 0).is_ok());
            // Adjacent losses merge into one run.
            assert!(out.windows(2).all(|w| w[0].end() < w[1].start));
        }
    }

    #[test]
    fn short_formats() {
        assert_eq!(short(0.01), "0.01");
        assert_eq!(short(8.0), "8");
        assert_eq!(short(0.0012626262), "0.00126263");
        assert_eq!(short(f64::INFINITY), "inf");
    }
}
