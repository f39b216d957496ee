//! Checks a profile tree against the schema (docs/loss-models.md) and resolves it into a
//! [`Profile`]; every error says where the value came from, its dotted key and what is allowed.

use std::cell::RefCell;
use std::path::Path;
use std::time::Duration;

use crate::error::{echo, Error, Result};
use crate::ids::{CollectiveId, Phase};
use crate::loss::effect::MIN_MTU;
use crate::loss::model::params::{param_type, ParamType, ParamValue};
use crate::loss::model::{kind_names, model_keys, LoadedTraces, ModelSpec, RawModel};
use crate::loss::plan::{Effect, DEFAULT_MTU, DEFAULT_RETRANSMIT_TIMEOUT, MAX_RETRANSMIT_TIMEOUT};
use crate::loss::rules::{Action, Direction, Match, Rule};
use crate::profile::tree::{At, Node, Val};
use crate::profile::{
    Profile, TransportKind, DEFAULT_SEED, MAX_RULES, MAX_TRACE_EVENTS, MIN_STATS_INTERVAL, SET_ENV,
};

/// The keys of a profile's top level.
pub(super) const TOP_KEYS: &[&str] = &[
    "description",
    "seed",
    "mtu",
    "stats_interval",
    "effect",
    "model",
    "retransmit_timeout_us",
    "rules",
    "transport",
    "inner",
    "trace",
    "trace_events",
];
const RULE_KEYS: &[&str] = &[
    "name",
    "collective",
    "traffic_class",
    "comm_size",
    "direction",
    "peer",
    "phase",
    "steps",
    "effect",
    "model",
    "retransmit_timeout_us",
    "mtu",
];
const EFFECTS: &str = "\"zero\", \"stale\", \"retransmit\", \"bitflip\"";
/// Longest interval we accept: keeps `Duration` conversions in range.
const MAX_INTERVAL: Duration = Duration::from_secs(1_000_000);
/// Units per second of keys in seconds and of keys in microseconds (`_us`).
const SECONDS: f64 = 1.0;
const MICROSECONDS: f64 = 1e6;

/// Checks the tree against the schema; errors say where each value came from.
pub(super) struct Checker<'a> {
    pub(super) origin: &'a str,
    /// Where each layer of overrides came from (`NCCL_LOSSY_SET`, `--set`), by layer.
    pub(super) sources: &'a [&'a str],
    /// The traces read so far, shared by every rule that names the same one.
    pub(super) traces: RefCell<LoadedTraces>,
}

impl Checker<'_> {
    fn place(&self, at: At) -> String {
        match at {
            At::Line(line) => format!("{}:{line}", self.origin),
            At::Set(layer) => self
                .sources
                .get(layer)
                .copied()
                .unwrap_or(SET_ENV)
                .to_string(),
        }
    }

    /// An error about a value: `where: key = value: why`.
    fn bad(&self, node: &Node, key: &str, why: impl std::fmt::Display) -> Error {
        Error::invalid_argument(format!(
            "{}: {key} = {}: {why}",
            self.place(node.at),
            node.show()
        ))
    }

    /// An error about a key: `where: key: why`.
    fn bad_key(&self, at: At, key: &str, why: impl std::fmt::Display) -> Error {
        Error::invalid_argument(format!("{}: {key}: {why}", self.place(at)))
    }

    fn known_keys(&self, table: &Node, path: &str, allowed: &[&str]) -> Result<()> {
        if !matches!(table.val, Val::Table(_)) {
            return Err(self.bad(table, path, "must be a table"));
        }
        for (key, node) in table.entries() {
            if !allowed.contains(&key.as_str()) {
                // Quoted when plain it would read as nothing, or as a dotted path.
                let plain = !key.is_empty()
                    && key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                let shown = if plain {
                    echo(key, str::to_string)
                } else {
                    echo(key, |k| format!("{k:?}"))
                };
                let full = if path.is_empty() {
                    shown
                } else {
                    format!("{path}.{shown}")
                };
                return Err(self.bad_key(
                    node.at,
                    &full,
                    format!("unknown key; allowed: {}", allowed.join(", ")),
                ));
            }
        }
        Ok(())
    }

    fn string(&self, node: &Node, key: &str) -> Result<String> {
        match &node.val {
            Val::Str(s) => Ok(s.clone()),
            _ => Err(self.bad(node, key, "must be a string")),
        }
    }

    fn integer(&self, node: &Node, key: &str, lo: i64, hi: i64) -> Result<i64> {
        match node.val {
            Val::Int(i) if (lo..=hi).contains(&i) => Ok(i),
            Val::Int(_) | Val::BigInt(..) => Err(self.bad(
                node,
                key,
                format!("must be an integer in [{lo}, {hi}]: out of range"),
            )),
            // 1e10 is a TOML float: say what is wrong with it, not only that it has a point.
            Val::Float(f) if !(lo as f64..=hi as f64).contains(&f) => Err(self.bad(
                node,
                key,
                format!("must be an integer in [{lo}, {hi}]: out of range"),
            )),
            Val::Float(_) => {
                Err(self.bad(node, key, format!("must be an integer in [{lo}, {hi}]")))
            }
            _ => Err(self.bad(node, key, "must be an integer")),
        }
    }

    fn number(&self, node: &Node, key: &str) -> Result<f64> {
        match node.val {
            Val::Int(i) => Ok(i as f64),
            // Beyond every number key's range, which its check names.
            Val::BigInt(_, approx) => Ok(approx),
            Val::Float(f) => Ok(f),
            _ => Err(self.bad(node, key, "must be a number")),
        }
    }

    /// A duration from `min` to `max`, written in units of which `scale` make a second; the
    /// error gives the range in seconds (and in the key's unit when that is not seconds).
    fn duration(
        &self,
        node: &Node,
        key: &str,
        scale: f64,
        min: Duration,
        max: Duration,
    ) -> Result<Duration> {
        let x = self.number(node, key)?;
        let secs = x / scale;
        if !(x.is_finite() && secs >= min.as_secs_f64() && secs <= max.as_secs_f64()) {
            let show = |d: Duration| {
                let secs = d.as_secs_f64();
                if scale == SECONDS {
                    format!("{secs} s")
                } else {
                    format!("{secs} s ({} us)", secs * scale)
                }
            };
            let lower = if min.is_zero() {
                ">= 0".to_string()
            } else {
                format!("at least {}", show(min))
            };
            return Err(self.bad(
                node,
                key,
                format!("must be a number {lower} and at most {}", show(max)),
            ));
        }
        Ok(Duration::from_secs_f64(secs))
    }

    fn effect(&self, node: &Node, key: &str) -> Result<Effect> {
        let s = self
            .string(node, key)
            .map_err(|_| self.bad(node, key, format!("must be one of {EFFECTS}")))?;
        match s.to_ascii_lowercase().as_str() {
            "zero" => Ok(Effect::Zero),
            "stale" => Ok(Effect::Stale),
            "retransmit" => Ok(Effect::Retransmit),
            "bitflip" => Ok(Effect::Bitflip),
            _ => Err(self.bad(node, key, format!("unknown effect; allowed: {EFFECTS}"))),
        }
    }

    fn mtu(&self, node: &Node, key: &str) -> Result<u32> {
        self.int_in(node, key, MIN_MTU, u32::MAX)
    }

    /// An integer in `[lo, hi]`, as `T`.
    fn int_in<T>(&self, node: &Node, key: &str, lo: T, hi: T) -> Result<T>
    where
        T: Into<i64> + TryFrom<i64>,
    {
        let v = self.integer(node, key, lo.into(), hi.into())?;
        // In [lo, hi], so always in T's range.
        T::try_from(v).map_err(|_| self.bad(node, key, "out of range"))
    }

    /// A one-or-many criterion: a scalar or a non-empty list of them.
    fn list<T>(
        &self,
        node: &Node,
        key: &str,
        one: impl Fn(&Node, &str) -> Result<T>,
    ) -> Result<Vec<T>> {
        match &node.val {
            Val::Array(items) if items.is_empty() => {
                Err(self.bad(node, key, "must list at least one value"))
            }
            Val::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| one(item, &format!("{key}.{i}")))
                .collect(),
            _ => Ok(vec![one(node, key)?]),
        }
    }

    /// A one-or-many integer criterion, each value in `[lo, hi]`.
    fn int_list<T>(&self, node: &Node, key: &str, lo: T, hi: T) -> Result<Vec<T>>
    where
        T: Copy + Into<i64> + TryFrom<i64>,
    {
        self.list(node, key, |n, key| self.int_in(n, key, lo, hi))
    }

    fn model(&self, node: &Node, path: &str, base: Option<&Path>) -> Result<ModelSpec> {
        // A bare string names a kind without parameters: model = "none".
        if let Val::Str(kind) = &node.val {
            let raw = RawModel {
                kind: kind.clone(),
                ..RawModel::default()
            };
            return ModelSpec::from_raw(&raw).map_err(|e| self.bad(node, path, e.message));
        }
        self.known_keys(node, path, &model_keys())?;
        let mut raw = RawModel::default();
        let mut kind = None;
        for (key, value) in node.entries() {
            let k = join(path, key);
            if key == "kind" {
                kind = Some(self.string(value, &k)?);
                continue;
            }
            let value = match param_type(key) {
                Some(ParamType::Number) => ParamValue::Number(self.number(value, &k)?),
                Some(ParamType::Text) => ParamValue::Text(self.string(value, &k)?),
                Some(ParamType::Count) => {
                    ParamValue::Count(self.integer(value, &k, 1, i64::MAX)? as u64)
                }
                None => continue,
            };
            raw.set(key, value);
        }
        raw.kind = kind.ok_or_else(|| {
            self.bad_key(
                node.at,
                &join(path, "kind"),
                format!("missing; allowed kinds: {}", kind_names()),
            )
        })?;
        let locate = |key: &str, message: String| match node.get(key) {
            Some(value) => self.bad(value, &join(path, key), message),
            None => self.bad_key(node.at, &join(path, key), message),
        };
        let mut spec = ModelSpec::from_raw(&raw).map_err(|e| locate(e.key, e.message))?;
        spec.load_trace(base, &mut self.traces.borrow_mut())
            .map_err(|e| locate(e.key, e.message))?;
        Ok(spec)
    }

    fn action(
        &self,
        table: &Node,
        path: &str,
        inherit: &Action,
        base: Option<&Path>,
    ) -> Result<Action> {
        let mut action = inherit.clone();
        if let Some(n) = table.get("effect") {
            action.effect = self.effect(n, &join(path, "effect"))?;
        }
        if let Some(n) = table.get("model") {
            action.model = self.model(n, &join(path, "model"), base)?;
        }
        if let Some(n) = table.get("retransmit_timeout_us") {
            // The transport refuses a longer one at every send: refuse it here, at init.
            action.retransmit_timeout = self.duration(
                n,
                &join(path, "retransmit_timeout_us"),
                MICROSECONDS,
                Duration::ZERO,
                MAX_RETRANSMIT_TIMEOUT,
            )?;
        }
        if let Some(n) = table.get("mtu") {
            action.mtu = self.mtu(n, &join(path, "mtu"))?;
        }
        Ok(action)
    }

    fn rule(
        &self,
        node: &Node,
        path: &str,
        defaults: &Action,
        base: Option<&Path>,
    ) -> Result<Rule> {
        self.known_keys(node, path, RULE_KEYS)?;
        let key = |k: &str| join(path, k);
        let mut when = Match::default();
        let mut name = None;
        for (k, value) in node.entries() {
            let full = key(k);
            match k.as_str() {
                "name" => name = Some(self.string(value, &full)?),
                "collective" => {
                    when.collectives = Some(self.list(value, &full, |n, key| {
                        let s = self.string(n, key)?;
                        CollectiveId::parse(&s).ok_or_else(|| {
                            let names: Vec<_> =
                                CollectiveId::ALL.iter().map(|c| c.name()).collect();
                            self.bad(
                                n,
                                key,
                                format!("unknown collective; allowed: {}", names.join(", ")),
                            )
                        })
                    })?)
                }
                "traffic_class" => {
                    when.traffic_classes = Some(self.list(value, &full, |n, key| {
                        let class = self.int_in(n, key, i32::MIN, i32::MAX)?;
                        // NCCL passes -1 (NCCL_NET_TRAFFIC_CLASS_UNDEF) for a communicator
                        // without a class, INT_MIN (NCCL_CONFIG_UNDEF_INT) included
                        // (src/plugin/net.cc): no message ever has either class.
                        if class == -1 || class == i32::MIN {
                            return Err(self.bad(
                                n,
                                key,
                                "means \"no traffic class\" to NCCL (-1 is \
                                 NCCL_NET_TRAFFIC_CLASS_UNDEF; INT_MIN, NCCL_CONFIG_UNDEF_INT, \
                                 reaches the plugin as -1), and a message without a class \
                                 matches no traffic_class criterion, so the rule would never \
                                 match; name the classes communicators set \
                                 (ncclConfig_t.trafficClass), or leave traffic_class out to \
                                 match every message",
                            ));
                        }
                        Ok(class)
                    })?)
                }
                "comm_size" => when.comm_sizes = Some(self.int_list(value, &full, 1, u32::MAX)?),
                "peer" => when.peers = Some(self.int_list(value, &full, 0, u32::MAX)?),
                "direction" => {
                    let s = self.string(value, &full)?;
                    when.direction = Some(match s.to_ascii_lowercase().as_str() {
                        "send" => Direction::Send,
                        "recv" => Direction::Recv,
                        _ => return Err(self.bad(value, &full, "allowed: \"send\", \"recv\"")),
                    });
                }
                "phase" => {
                    let s = self.string(value, &full)?;
                    when.phase = match s.to_ascii_lowercase().as_str() {
                        "any" => Phase::Any,
                        "forward" => Phase::Forward,
                        "backward" => Phase::Backward,
                        _ => {
                            return Err(self.bad(
                                value,
                                &full,
                                "allowed: \"forward\", \"backward\", \"any\"",
                            ))
                        }
                    };
                }
                "steps" => {
                    self.known_keys(value, &full, &["from", "until"])?;
                    let from = match value.get("from") {
                        Some(n) => self.integer(n, &join(&full, "from"), 0, i64::MAX)? as u64,
                        None => 0,
                    };
                    let until = match value.get("until") {
                        Some(n) => {
                            Some(self.integer(n, &join(&full, "until"), 0, i64::MAX)? as u64)
                        }
                        None => None,
                    };
                    if let Some(u) = until {
                        if from > u {
                            return Err(self.bad(
                                value,
                                &full,
                                format!("from = {from} is after until = {u}; the window is [from, until)"),
                            ));
                        }
                        // [u, u) holds no step: the rule would never match, silently.
                        if let Some(n) = value.get("until").filter(|_| from == u) {
                            // until = from + 1 takes step `from`, unless that is past what
                            // `until` takes: then leaving it out does.
                            let fix = if from < i64::MAX as u64 {
                                format!("until = {} takes step {from}", from + 1)
                            } else {
                                format!("leave until out to take step {from} and those after")
                            };
                            return Err(self.bad(
                                n,
                                &join(&full, "until"),
                                format!(
                                    "[{from}, {u}) holds no step, so the rule would never match; \
                                     the window is [from, until): {fix}"
                                ),
                            ));
                        }
                    }
                    when.steps = Some((from, until));
                }
                _ => {}
            }
        }
        let action = self.action(node, path, defaults, base)?;
        Ok(Rule { name, when, action })
    }

    pub(super) fn profile(&self, root: &Node, base: Option<&Path>) -> Result<Profile> {
        self.known_keys(root, "", TOP_KEYS)?;
        let seed = match root.get("seed") {
            Some(n) => self.integer(n, "seed", 0, i64::MAX)? as u64,
            None => DEFAULT_SEED,
        };
        let mtu = match root.get("mtu") {
            Some(n) => self.mtu(n, "mtu")?,
            None => DEFAULT_MTU,
        };
        let stats_interval = match root.get("stats_interval") {
            Some(n) => Some(self.duration(
                n,
                "stats_interval",
                SECONDS,
                MIN_STATS_INTERVAL,
                MAX_INTERVAL,
            )?),
            None => None,
        };
        let description = match root.get("description") {
            Some(n) => Some(self.string(n, "description")?),
            None => None,
        };
        let transport = match root.get("transport") {
            Some(n) => match self.string(n, "transport")?.to_ascii_lowercase().as_str() {
                "socket" => Some(TransportKind::Socket),
                "wrap" => Some(TransportKind::Wrap),
                _ => return Err(self.bad(n, "transport", "allowed: \"socket\", \"wrap\"")),
            },
            None => None,
        };
        let inner = match root.get("inner") {
            Some(n) => {
                let inner = self.string(n, "inner")?;
                if inner.trim().is_empty() {
                    return Err(self.bad(
                        n,
                        "inner",
                        "must name a net plugin library (a path, or a name like \"ib\")",
                    ));
                }
                if transport != Some(TransportKind::Wrap) {
                    return Err(self.bad(n, "inner", "only used with transport = \"wrap\""));
                }
                Some(inner)
            }
            None => None,
        };
        let trace = match root.get("trace") {
            Some(n) => {
                let dir = self.string(n, "trace")?;
                if dir.trim().is_empty() {
                    return Err(self.bad(n, "trace", "must name a directory for trace files"));
                }
                Some(dir)
            }
            None => None,
        };
        let trace_events = match root.get("trace_events") {
            Some(n) => Some(self.integer(n, "trace_events", 1, MAX_TRACE_EVENTS)? as usize),
            None => None,
        };
        let base_action = Action {
            effect: Effect::Retransmit,
            model: ModelSpec::None,
            retransmit_timeout: DEFAULT_RETRANSMIT_TIMEOUT,
            mtu,
        };
        let defaults = self.action(root, "", &base_action, base)?;
        let mut rules = Vec::new();
        if let Some(list) = root.get("rules") {
            let Val::Array(items) = &list.val else {
                return Err(self.bad(list, "rules", "must be a list of tables ([[rules]])"));
            };
            if items.len() > MAX_RULES {
                return Err(self.bad_key(
                    list.at,
                    "rules",
                    format!(
                        "{} rules; a profile has at most {MAX_RULES} (docs/loss-models.md)",
                        items.len()
                    ),
                ));
            }
            for (i, item) in items.iter().enumerate() {
                rules.push(self.rule(item, &format!("rules.{i}"), &defaults, base)?);
            }
        }
        Ok(Profile {
            seed,
            mtu,
            defaults,
            rules,
            stats_interval,
            origin: self.origin.to_string(),
            overrides: String::new(),
            overrides_shown: String::new(),
            description,
            transport,
            inner,
            trace,
            trace_events,
        })
    }
}

/// The dotted key `path.key` as errors name it (a long `key` cut, [`echo`]).
fn join(path: &str, key: &str) -> String {
    // A key holding a control character (a NUL, a terminal escape) or a byte-order mark is
    // shown quoted and escaped: printed raw it hides what is wrong, or drives the terminal.
    let shown = if key.chars().any(|c| c.is_control() || c == '\u{feff}') {
        echo(key, |k| format!("{k:?}"))
    } else {
        echo(key, str::to_string)
    };
    if path.is_empty() {
        shown
    } else {
        format!("{path}.{shown}")
    }
}
