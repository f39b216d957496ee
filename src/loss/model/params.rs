//! A model table as a profile writes it: the one table of model kinds and their parameter
//! keys ([`MODEL_KINDS`], [`MODEL_PARAMS`]), the raw values ([`RawModel`]) and the checks that
//! turn them into a [`ModelSpec`]. The profile parser, its "allowed: ..." messages and the
//! documentation test all read the kinds and keys from here.

use crate::error::echo;
use crate::loss::model::{short, ModelError, ModelSpec, TraceSpec};
use crate::loss::trace::{TraceEnd, TraceFormat, TraceStart};

/// How a parameter's value is written in a profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamType {
    /// A number (integer or float).
    Number,
    /// A string.
    Text,
    /// A positive integer.
    Count,
}

/// One parameter value, as read from a profile.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamValue {
    /// For [`ParamType::Number`].
    Number(f64),
    /// For [`ParamType::Text`].
    Text(String),
    /// For [`ParamType::Count`].
    Count(u64),
}

/// A model kind and the parameters it takes, one list per form (gilbert_elliott has two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelKind {
    /// The kind as written in profiles.
    pub name: &'static str,
    /// The parameter keys of each form.
    pub forms: &'static [&'static [&'static str]],
}

impl ModelKind {
    /// The keys of form `i` (none for a form the kind does not have).
    fn form(&self, i: usize) -> &'static [&'static str] {
        self.forms.get(i).copied().unwrap_or(&[])
    }
}

/// A Rust type a parameter is held in.
trait Param: Sized {
    const TYPE: ParamType;
    fn from_value(value: ParamValue) -> Option<Self>;
}

impl Param for f64 {
    const TYPE: ParamType = ParamType::Number;
    fn from_value(value: ParamValue) -> Option<f64> {
        match value {
            ParamValue::Number(x) => Some(x),
            _ => None,
        }
    }
}

impl Param for u64 {
    const TYPE: ParamType = ParamType::Count;
    fn from_value(value: ParamValue) -> Option<u64> {
        match value {
            ParamValue::Count(n) => Some(n),
            _ => None,
        }
    }
}

impl Param for String {
    const TYPE: ParamType = ParamType::Text;
    fn from_value(value: ParamValue) -> Option<String> {
        match value {
            ParamValue::Text(s) => Some(s),
            _ => None,
        }
    }
}

/// Defines [`RawModel`] (one field per parameter), [`MODEL_PARAMS`] and [`MODEL_KINDS`] from
/// one list, so a key is written once.
macro_rules! model_table {
    (
        params { $( #[doc = $doc:literal] $key:ident: $ty:ty, )* }
        kinds { $( $kind:literal: [ $( [ $( $p:ident ),* ] ),* ], )* }
    ) => {
        /// A model table as written, before checks: the kind and every key any kind accepts.
        #[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct RawModel {
            /// The kind, one of [`MODEL_KINDS`].
            pub kind: String,
            $( #[doc = $doc] pub $key: Option<$ty>, )*
        }

        /// Every parameter key, in the order messages list them, with how it is written.
        pub const MODEL_PARAMS: &[(&str, ParamType)] =
            &[ $( (stringify!($key), <$ty as Param>::TYPE), )* ];

        /// Every model kind, in the order messages list them, with the keys it takes.
        pub const MODEL_KINDS: &[ModelKind] = &[ $(
            ModelKind { name: $kind, forms: &[ $( &[ $( stringify!($p) ),* ] ),* ] },
        )* ];

        impl RawModel {
            /// The parameters present, in [`MODEL_PARAMS`] order.
            fn present(&self) -> Vec<&'static str> {
                let mut keys = Vec::new();
                $( if self.$key.is_some() { keys.push(stringify!($key)); } )*
                keys
            }

            /// Sets parameter `key`; false when no kind takes `key` or `value` is not of its
            /// [`ParamType`].
            pub fn set(&mut self, key: &str, value: ParamValue) -> bool {
                match key {
                    $( stringify!($key) => match <$ty as Param>::from_value(value) {
                        Some(v) => {
                            self.$key = Some(v);
                            true
                        }
                        None => false,
                    }, )*
                    _ => false,
                }
            }
        }

        // The kinds name parameters that exist (checked at compile time).
        const _: fn(&RawModel) = |raw| { $( $( $( let _ = &raw.$p; )* )* )* };
    };
}

model_table! {
    params {
        /// Loss rate (uniform; the rate form of gilbert_elliott).
        rate: f64,
        /// Mean loss burst in packets (the rate form of gilbert_elliott).
        mean_burst: f64,
        /// Gilbert-Elliott P(Good -> Bad).
        p: f64,
        /// Gilbert-Elliott P(Bad -> Good).
        r: f64,
        /// Gilbert-Elliott loss probability in Bad.
        h_loss: f64,
        /// Gilbert-Elliott loss probability in Good.
        k_loss: f64,
        /// 4-state P(1 -> 3).
        p13: f64,
        /// 4-state P(3 -> 1).
        p31: f64,
        /// 4-state P(3 -> 2).
        p32: f64,
        /// 4-state P(2 -> 3).
        p23: f64,
        /// 4-state P(1 -> 4).
        p14: f64,
        /// Trace file.
        file: String,
        /// Trace format.
        format: String,
        /// Trace length in packets.
        length: u64,
        /// Trace end behaviour.
        at_end: String,
        /// Trace start position.
        start: String,
    }
    kinds {
        "none": [[]],
        "uniform": [[rate]],
        "gilbert_elliott": [[rate, mean_burst], [p, r, h_loss, k_loss]],
        "markov4": [[p13, p31, p32, p23, p14]],
        "trace": [[file, format, length, at_end, start]],
    }
}

/// The kinds as messages list them: "none, uniform, ...".
pub fn kind_names() -> String {
    MODEL_KINDS
        .iter()
        .map(|k| k.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every key of a model table, as messages list them: `kind`, then [`MODEL_PARAMS`].
pub fn model_keys() -> Vec<&'static str> {
    std::iter::once("kind")
        .chain(MODEL_PARAMS.iter().map(|(key, _)| *key))
        .collect()
}

/// How parameter `key` is written, if some kind takes it.
pub fn param_type(key: &str) -> Option<ParamType> {
    MODEL_PARAMS
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, ty)| *ty)
}

impl TryFrom<RawModel> for ModelSpec {
    type Error = String;
    fn try_from(raw: RawModel) -> Result<ModelSpec, String> {
        ModelSpec::from_raw(&raw).map_err(|e| e.to_string())
    }
}

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

impl ModelSpec {
    /// Checks a model table and resolves defaults (netem's, for the Markov models).
    pub fn from_raw(raw: &RawModel) -> Result<ModelSpec, ModelError> {
        let present = raw.present();
        let unknown = || {
            err(
                "kind",
                format!(
                    "unknown model kind {}; allowed: {}",
                    echo(&raw.kind, |k| format!("\"{k}\"")),
                    kind_names()
                ),
            )
        };
        let name = raw.kind.to_ascii_lowercase();
        let kind = MODEL_KINDS
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(unknown)?;
        let only = |allowed: &[&str], label: &str| -> Result<(), ModelError> {
            match present.iter().find(|k| !allowed.contains(k)) {
                Some(k) => Err(err(
                    k,
                    format!(
                        "not a parameter of kind {label}; it takes {}",
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
        match kind.name {
            "none" => {
                only(kind.form(0), "none")?;
                Ok(ModelSpec::None)
            }
            "uniform" => {
                only(kind.form(0), "uniform")?;
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
                    only(kind.form(0), "gilbert_elliott (rate form)")?;
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
                    only(kind.form(1), "gilbert_elliott")?;
                    let p = prob(
                        "p",
                        raw.p.ok_or_else(|| err("p", "missing; gilbert_elliott needs p (and optionally r, h_loss, k_loss) or rate and mean_burst"))?,
                    )?;
                    // netem's defaults: r = 1 - p, 1-h = 1, 1-k = 0.
                    let r = opt_prob("r", raw.r)?.unwrap_or(1.0 - p);
                    let h_loss = opt_prob("h_loss", raw.h_loss)?.unwrap_or(1.0);
                    let k_loss = opt_prob("k_loss", raw.k_loss)?.unwrap_or(0.0);
                    if p > 0.0 && r == 0.0 {
                        // r left out is netem's 1 - p: name the key written, and the default.
                        return Err(match raw.r {
                            Some(_) => err(
                                "r",
                                "r must be > 0 when p > 0, or the first burst would never end",
                            ),
                            None => err(
                                "p",
                                "r defaults to 1 - p = 0, and r must be > 0 when p > 0, or the \
                                 first burst would never end; set r (for total loss, use uniform \
                                 with rate = 1)",
                            ),
                        });
                    }
                    Ok(ModelSpec::GilbertElliott {
                        p,
                        r,
                        h_loss,
                        k_loss,
                    })
                }
            }
            "markov4" => {
                only(kind.form(0), "markov4")?;
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
                    // p31 left out is netem's 1 - p13: name the key written, and the default.
                    return Err(match raw.p31 {
                        None => err(
                            "p13",
                            "p31 defaults to 1 - p13 = 0, and p31 + p32 must be > 0 when \
                             p13 > 0, or the first burst would never end; set p31",
                        ),
                        Some(_) => err(
                            "p31",
                            "p31 + p32 must be > 0 when p13 > 0, or the first burst would never end",
                        ),
                    });
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
                only(kind.form(0), "trace")?;
                let file = raw
                    .file
                    .clone()
                    .ok_or_else(|| err("file", "missing; trace needs file"))?;
                if file.trim().is_empty() {
                    return Err(err("file", "must name a trace file"));
                }
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
            _ => Err(unknown()),
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
        // rate = B/(B+1) exactly needs p = 1, which rounding may make 1 + a few ulps: the
        // bound itself is allowed (the same 1e-12 slack as markov4's sums of probabilities).
        if p > 1.0 + 1e-12 {
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
            p: p.min(1.0),
            r,
            h_loss: 1.0,
            k_loss: 0.0,
        })
    }
}
