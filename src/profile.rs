//! Loss profiles: the TOML schema, environment overrides and the embedded default.
//!
//! A profile is read in three steps: the TOML text is parsed into a small tree that remembers
//! each value's line; `NCCL_LOSSY_SET` overrides are written into that tree (marked as coming
//! from the override); the tree is then checked against the schema. So every error, whether
//! from the file or from an override, can say where the bad value came from, its dotted key
//! and what is allowed. The schema is documented in docs/loss-models.md.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value as Json};

use crate::error::{Error, Result};
use crate::loss::effect::MIN_MTU;
use crate::loss::model::{short, ModelSpec, RawModel, MODEL_KINDS};
use crate::loss::plan::{Effect, DEFAULT_MTU, DEFAULT_RETRANSMIT_TIMEOUT};
use crate::loss::rules::{Action, Collective, Direction, Match, Phase, Rule};

/// Environment variable naming the profile file.
pub const PROFILE_ENV: &str = "NCCL_LOSSY_PROFILE";
/// Environment variable with `;`-separated `dotted.key=value` overrides.
pub const SET_ENV: &str = "NCCL_LOSSY_SET";
/// The origin of the embedded default profile.
pub const EMBEDDED_ORIGIN: &str = "embedded default";
/// The profile used when `NCCL_LOSSY_PROFILE` is not set.
pub const DEFAULT_PROFILE: &str = include_str!("../configs/default.toml");
/// Seed used when a profile sets none.
pub const DEFAULT_SEED: u64 = 1;

const TOP_KEYS: &[&str] = &[
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
const MODEL_KEYS: &[&str] = &[
    "kind",
    "rate",
    "mean_burst",
    "p",
    "r",
    "h_loss",
    "k_loss",
    "p13",
    "p31",
    "p32",
    "p23",
    "p14",
    "file",
    "format",
    "length",
    "at_end",
    "start",
];
const EFFECTS: &str = "\"zero\", \"stale\", \"retransmit\", \"bitflip\"";
/// Longest timeout or interval we accept, in seconds: keeps `Duration` conversions in range.
const MAX_SECONDS: f64 = 1e6;

/// Which transport carries the bytes (profile key `transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// The plugin's own TCP sockets (the default).
    Socket,
    /// Another NCCL net plugin, named by `inner`, with loss injected on top.
    Wrap,
}

impl TransportKind {
    /// The name used in profiles.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Socket => "socket",
            TransportKind::Wrap => "wrap",
        }
    }
}

/// A resolved loss profile.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// Seed every stream's generators derive from.
    pub seed: u64,
    /// Default packet size in bytes.
    pub mtu: u32,
    /// What messages no rule matches get.
    pub defaults: Action,
    /// Rules, in order; the first match decides.
    pub rules: Vec<Rule>,
    /// How often the plugin writes statistics, if at all.
    pub stats_interval: Option<Duration>,
    /// The file the profile came from, or "embedded default".
    pub origin: String,
    /// The overrides applied on top of the file (as given).
    pub overrides: String,
    /// The profile's own description, if it has one.
    pub description: Option<String>,
    /// The transport the profile asks for (`None`: not set, which means sockets).
    pub transport: Option<TransportKind>,
    /// The net plugin to wrap under `transport = "wrap"` (a path or a name like "ib").
    pub inner: Option<String>,
}

/// Where a value came from: a line of the profile, or an override.
#[derive(Clone, Copy, Debug, PartialEq)]
enum At {
    Line(usize),
    Set,
}

#[derive(Clone, Debug, PartialEq)]
enum Val {
    Table(Vec<(String, Node)>),
    Array(Vec<Node>),
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    /// Dates and times: valid TOML, never valid here.
    Other,
}

#[derive(Clone, Debug, PartialEq)]
struct Node {
    val: Val,
    at: At,
}

impl Node {
    fn table(at: At) -> Node {
        Node {
            val: Val::Table(Vec::new()),
            at,
        }
    }

    fn get(&self, key: &str) -> Option<&Node> {
        match &self.val {
            Val::Table(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, n)| n),
            _ => None,
        }
    }

    fn entries(&self) -> &[(String, Node)] {
        match &self.val {
            Val::Table(entries) => entries,
            _ => &[],
        }
    }

    /// The value as written in errors.
    fn show(&self) -> String {
        match &self.val {
            Val::Table(_) => "{…}".into(),
            Val::Array(_) => "[…]".into(),
            Val::Str(s) => format!("{s:?}"),
            Val::Int(i) => i.to_string(),
            Val::Float(f) => f.to_string(),
            Val::Bool(b) => b.to_string(),
            Val::Other => "(date/time)".into(),
        }
    }
}

/// Turns toml_edit's document into the tree, with line numbers from spans.
struct Lines {
    starts: Vec<usize>,
}

impl Lines {
    fn new(text: &str) -> Lines {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines { starts }
    }

    fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset).max(1)
    }
}

/// Converts toml_edit values; `lines` is `None` for override values.
struct Convert<'a> {
    lines: Option<&'a Lines>,
}

impl Convert<'_> {
    fn at(&self, span: Option<std::ops::Range<usize>>, fallback: At) -> At {
        match (self.lines, span) {
            (Some(lines), Some(span)) => At::Line(lines.line(span.start)),
            (Some(_), None) => fallback,
            (None, _) => At::Set,
        }
    }

    fn table_entries<'t>(
        &self,
        iter: impl Iterator<Item = (&'t toml_edit::Key, &'t toml_edit::Item)>,
        parent: At,
    ) -> Vec<(String, Node)> {
        iter.map(|(key, item)| {
            let key_at = self.at(key.span(), parent);
            (key.get().to_string(), self.item(item, key_at))
        })
        .collect()
    }

    fn item(&self, item: &toml_edit::Item, fallback: At) -> Node {
        use toml_edit::Item;
        match item {
            Item::Value(v) => self.value(v, fallback),
            Item::Table(t) => {
                let at = self.at(t.span(), fallback);
                Node {
                    val: Val::Table(self.table_entries(t.get_values_keys(), at)),
                    at,
                }
            }
            Item::ArrayOfTables(a) => {
                let at = self.at(a.span(), fallback);
                let items = a
                    .iter()
                    .map(|t| {
                        let t_at = self.at(t.span(), at);
                        Node {
                            val: Val::Table(self.table_entries(t.get_values_keys(), t_at)),
                            at: t_at,
                        }
                    })
                    .collect();
                Node {
                    val: Val::Array(items),
                    at,
                }
            }
            Item::None => Node {
                val: Val::Other,
                at: fallback,
            },
        }
    }

    fn value(&self, v: &toml_edit::Value, fallback: At) -> Node {
        use toml_edit::Value;
        let at = self.at(v.span(), fallback);
        let val = match v {
            Value::String(s) => Val::Str(s.value().clone()),
            Value::Integer(i) => Val::Int(*i.value()),
            Value::Float(f) => Val::Float(*f.value()),
            Value::Boolean(b) => Val::Bool(*b.value()),
            Value::Datetime(_) => Val::Other,
            Value::Array(a) => Val::Array(a.iter().map(|x| self.value(x, at)).collect()),
            Value::InlineTable(t) => Val::Table(
                t.iter()
                    .filter_map(|(k, _)| t.get_key_value(k))
                    .map(|(key, item)| {
                        let key_at = self.at(key.span(), at);
                        (key.get().to_string(), self.item(item, key_at))
                    })
                    .collect(),
            ),
        };
        Node { val, at }
    }
}

/// Extension: iterate a table's entries with their keys (toml_edit yields `&str` by default).
trait ValuesKeys {
    fn get_values_keys(&self)
        -> Box<dyn Iterator<Item = (&toml_edit::Key, &toml_edit::Item)> + '_>;
}

impl ValuesKeys for toml_edit::Table {
    fn get_values_keys(
        &self,
    ) -> Box<dyn Iterator<Item = (&toml_edit::Key, &toml_edit::Item)> + '_> {
        Box::new(self.iter().filter_map(|(k, _)| self.get_key_value(k)))
    }
}

/// Writes `overrides` (`a.b=v;c=w`) into the tree.
fn apply_overrides(root: &mut Node, overrides: &str) -> Result<()> {
    for item in overrides.split(';') {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let Some((key, raw)) = item.split_once('=') else {
            return Err(Error::invalid_argument(format!(
                "{SET_ENV}: `{item}`: expected key=value, e.g. model.rate=0.01"
            )));
        };
        let key = key.trim();
        let path: Vec<&str> = key.split('.').map(str::trim).collect();
        if path.iter().any(|p| p.is_empty()) {
            return Err(Error::invalid_argument(format!(
                "{SET_ENV}: `{key}`: not a dotted key (like model.rate or rules.0.effect)"
            )));
        }
        let raw = raw.trim();
        // A bare word that is not TOML (effect=zero) is taken as a string.
        let value = match raw.parse::<toml_edit::Value>() {
            Ok(v) => Convert { lines: None }.value(&v, At::Set),
            Err(_) => Node {
                val: Val::Str(raw.to_string()),
                at: At::Set,
            },
        };
        set_path(root, &path, 0, value)
            .map_err(|msg| Error::invalid_argument(format!("{SET_ENV}: {key}: {msg}")))?;
    }
    Ok(())
}

fn set_path(
    node: &mut Node,
    path: &[&str],
    depth: usize,
    value: Node,
) -> std::result::Result<(), String> {
    let head = path[depth];
    let last = depth + 1 == path.len();
    let prefix = path[..=depth].join(".");
    match &mut node.val {
        Val::Table(entries) => {
            let pos = entries.iter().position(|(k, _)| k == head);
            if last {
                match pos {
                    Some(i) => entries[i].1 = value,
                    None => entries.push((head.to_string(), value)),
                }
                return Ok(());
            }
            let i = match pos {
                Some(i) => i,
                None => {
                    if path[depth + 1].parse::<usize>().is_ok() {
                        return Err(format!(
                            "{prefix} is not in the profile, so it has no entry {}",
                            path[depth + 1]
                        ));
                    }
                    entries.push((head.to_string(), Node::table(At::Set)));
                    entries.len() - 1
                }
            };
            set_path(&mut entries[i].1, path, depth + 1, value)
        }
        Val::Array(items) => {
            let parent = path[..depth].join(".");
            let index: usize = head.parse().map_err(|_| {
                format!("{parent} is a list: address its entries by number, like {parent}.0")
            })?;
            let len = items.len();
            let item = items
                .get_mut(index)
                .ok_or_else(|| format!("{parent} has no entry {index} (it has {len})"))?;
            if last {
                *item = value;
                Ok(())
            } else {
                set_path(item, path, depth + 1, value)
            }
        }
        _ => Err(format!(
            "{} is a value, not a table",
            path[..depth].join(".")
        )),
    }
}

/// Checks the tree against the schema; errors say where each value came from.
struct Checker<'a> {
    origin: &'a str,
}

impl Checker<'_> {
    fn place(&self, at: At) -> String {
        match at {
            At::Line(line) => format!("{}:{line}", self.origin),
            At::Set => SET_ENV.to_string(),
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
                return Err(self.bad_key(
                    node.at,
                    &join(path, key),
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
            Val::Int(_) => Err(self.bad(node, key, format!("must be an integer in [{lo}, {hi}]"))),
            _ => Err(self.bad(node, key, "must be an integer")),
        }
    }

    fn number(&self, node: &Node, key: &str) -> Result<f64> {
        match node.val {
            Val::Int(i) => Ok(i as f64),
            Val::Float(f) => Ok(f),
            _ => Err(self.bad(node, key, "must be a number")),
        }
    }

    fn seconds(&self, node: &Node, key: &str, scale: f64, positive: bool) -> Result<Duration> {
        let x = self.number(node, key)?;
        let ok = x.is_finite()
            && (if positive { x > 0.0 } else { x >= 0.0 })
            && x / scale <= MAX_SECONDS;
        if !ok {
            let lower = if positive { "> 0" } else { ">= 0" };
            return Err(self.bad(
                node,
                key,
                format!("must be a number {lower} and at most {MAX_SECONDS} s"),
            ));
        }
        Ok(Duration::from_secs_f64(x / scale))
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
        self.known_keys(node, path, MODEL_KEYS)?;
        let mut raw = RawModel::default();
        let mut kind = None;
        for (key, value) in node.entries() {
            let k = join(path, key);
            let num = || self.number(value, &k).map(Some);
            let text = || self.string(value, &k).map(Some);
            match key.as_str() {
                "kind" => kind = Some(self.string(value, &k)?),
                "rate" => raw.rate = num()?,
                "mean_burst" => raw.mean_burst = num()?,
                "p" => raw.p = num()?,
                "r" => raw.r = num()?,
                "h_loss" => raw.h_loss = num()?,
                "k_loss" => raw.k_loss = num()?,
                "p13" => raw.p13 = num()?,
                "p31" => raw.p31 = num()?,
                "p32" => raw.p32 = num()?,
                "p23" => raw.p23 = num()?,
                "p14" => raw.p14 = num()?,
                "file" => raw.file = text()?,
                "format" => raw.format = text()?,
                "at_end" => raw.at_end = text()?,
                "start" => raw.start = text()?,
                "length" => raw.length = Some(self.integer(value, &k, 1, i64::MAX)? as u64),
                _ => {}
            }
        }
        raw.kind = kind.ok_or_else(|| {
            self.bad_key(
                node.at,
                &join(path, "kind"),
                format!("missing; allowed kinds: {MODEL_KINDS}"),
            )
        })?;
        let locate = |key: &str, message: String| match node.get(key) {
            Some(value) => self.bad(value, &join(path, key), message),
            None => self.bad_key(node.at, &join(path, key), message),
        };
        let mut spec = ModelSpec::from_raw(&raw).map_err(|e| locate(e.key, e.message))?;
        spec.load_trace(base)
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
            action.retransmit_timeout =
                self.seconds(n, &join(path, "retransmit_timeout_us"), 1e6, false)?;
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
                        Collective::parse(&s).ok_or_else(|| {
                            let names: Vec<_> = Collective::ALL.iter().map(|c| c.name()).collect();
                            self.bad(
                                n,
                                key,
                                format!("unknown collective; allowed: {}", names.join(", ")),
                            )
                        })
                    })?)
                }
                "traffic_class" => {
                    when.traffic_classes = Some(self.int_list(value, &full, i32::MIN, i32::MAX)?)
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
                    }
                    when.steps = Some((from, until));
                }
                _ => {}
            }
        }
        let action = self.action(node, path, defaults, base)?;
        Ok(Rule { name, when, action })
    }

    fn profile(&self, root: &Node, base: Option<&Path>) -> Result<Profile> {
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
            Some(n) => Some(self.seconds(n, "stats_interval", 1.0, true)?),
            None => None,
        };
        let description = match root.get("description") {
            Some(n) => Some(self.string(n, "description")?),
            None => None,
        };
        let transport = match root.get("transport") {
            Some(n) => match self.string(n, "transport")?.as_str() {
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
            description,
            transport,
            inner,
        })
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// "model, effect E, expected loss X% (mean burst B)".
fn describe_action(action: &Action) -> String {
    let loss = action.model.expected_loss_rate();
    let mut s = format!(
        "{}, effect {}, expected loss {}%",
        action.model.describe(),
        action.effect.name(),
        short(loss * 100.0)
    );
    if loss > 0.0 {
        s.push_str(&format!(
            " (mean burst {})",
            short(action.model.expected_mean_burst())
        ));
    }
    s
}

fn action_json(action: &Action) -> Json {
    json!({
        "effect": action.effect,
        "model": serde_json::to_value(&action.model).unwrap_or(Json::Null),
        "expected_loss_rate": finite(action.model.expected_loss_rate()),
        "expected_mean_burst": finite(action.model.expected_mean_burst()),
        "retransmit_timeout_us": action.retransmit_timeout.as_secs_f64() * 1e6,
        "mtu": action.mtu,
    })
}

/// JSON has no infinities or NaN: write them as null.
fn finite(x: f64) -> Json {
    if x.is_finite() {
        json!(x)
    } else {
        Json::Null
    }
}

impl Profile {
    /// The profile named by `NCCL_LOSSY_PROFILE` (or the embedded default), with
    /// `NCCL_LOSSY_SET` applied on top.
    pub fn from_env() -> Result<Profile> {
        let path = std::env::var_os(PROFILE_ENV).filter(|p| !p.is_empty());
        let overrides = match std::env::var(SET_ENV) {
            Ok(s) => s,
            Err(std::env::VarError::NotPresent) => String::new(),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(Error::invalid_argument(format!(
                    "{SET_ENV} is not valid UTF-8"
                )))
            }
        };
        Profile::load(path.as_deref().map(Path::new), &overrides)
    }

    /// The profile at `path` (the embedded default for `None`) with `overrides` applied.
    pub fn load(path: Option<&Path>, overrides: &str) -> Result<Profile> {
        match path {
            None => Profile::parse_in(DEFAULT_PROFILE, EMBEDDED_ORIGIN, None, overrides),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|err| {
                    Error::invalid_argument(format!(
                        "{}: cannot read profile: {err}",
                        path.display()
                    ))
                })?;
                Profile::parse_in(&text, &path.display().to_string(), path.parent(), overrides)
            }
        }
    }

    /// Parses profile text; `origin` labels errors, and when it is a path, trace files are
    /// found relative to its directory.
    pub fn parse(text: &str, origin: &str, overrides: &str) -> Result<Profile> {
        let base = (origin != EMBEDDED_ORIGIN)
            .then(|| Path::new(origin).parent())
            .flatten();
        Profile::parse_in(text, origin, base, overrides)
    }

    fn parse_in(text: &str, origin: &str, base: Option<&Path>, overrides: &str) -> Result<Profile> {
        let doc = toml_edit::ImDocument::parse(text).map_err(|err| {
            let lines = Lines::new(text);
            let line = err.span().map_or(1, |s| lines.line(s.start));
            Error::invalid_argument(format!(
                "{origin}:{line}: not valid TOML: {}",
                err.message()
            ))
        })?;
        let lines = Lines::new(text);
        let convert = Convert {
            lines: Some(&lines),
        };
        let table = doc.as_table();
        let mut root = Node {
            val: Val::Table(convert.table_entries(table.get_values_keys(), At::Line(1))),
            at: At::Line(1),
        };
        apply_overrides(&mut root, overrides)?;
        let mut profile = Checker { origin }.profile(&root, base)?;
        profile.overrides = overrides.trim().to_string();
        Ok(profile)
    }

    /// The fully resolved profile, for statistics files: every default filled in.
    pub fn to_json(&self) -> Json {
        let rules: Vec<Json> = self
            .rules
            .iter()
            .map(|rule| {
                let w = &rule.when;
                json!({
                    "name": rule.name,
                    "match": {
                        "collective": w.collectives.as_ref().map(|c| c.iter().map(|c| c.name()).collect::<Vec<_>>()),
                        "traffic_class": w.traffic_classes,
                        "comm_size": w.comm_sizes,
                        "direction": w.direction.map(Direction::name),
                        "peer": w.peers,
                        "phase": w.phase.name(),
                        "steps": w.steps.map(|(from, until)| json!({"from": from, "until": until})),
                    },
                    "action": action_json(&rule.action),
                })
            })
            .collect();
        json!({
            "origin": self.origin,
            "overrides": self.overrides,
            "description": self.description,
            "seed": self.seed,
            "mtu": self.mtu,
            "stats_interval_s": self.stats_interval.map(|d| d.as_secs_f64()),
            "defaults": action_json(&self.defaults),
            "rules": rules,
            "transport": self.transport.unwrap_or(TransportKind::Socket).name(),
            "inner": self.inner,
        })
    }

    /// Every action: the defaults', then each rule's in order.
    pub fn actions(&self) -> impl Iterator<Item = &Action> {
        std::iter::once(&self.defaults).chain(self.rules.iter().map(|r| &r.action))
    }

    /// True when some message may arrive with wrong data (a zero, stale or bitflip effect
    /// together with a model that can lose packets).
    pub fn corrupts_data(&self) -> bool {
        self.actions()
            .any(|a| a.effect.corrupts_data() && a.model.can_lose())
    }

    /// True when some action has `effect` (with a model that can lose packets).
    pub fn uses_effect(&self, effect: Effect) -> bool {
        self.actions()
            .any(|a| a.effect == effect && a.model.can_lose())
    }

    /// True when a rule matches on the collective (which old NCCL versions do not report).
    pub fn matches_on_collective(&self) -> bool {
        self.rules.iter().any(|r| r.when.collectives.is_some())
    }

    /// True when nothing can ever be lost.
    pub fn is_lossless(&self) -> bool {
        !self.actions().any(|a| a.model.can_lose())
    }

    /// One line: origin, seed, mtu, the defaults with their expected loss, then each rule.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "{}: seed {}, mtu {}; default: {}",
            self.origin,
            self.seed,
            self.mtu,
            describe_action(&self.defaults)
        );
        line.push_str(&format!(
            "; {} rule{}",
            self.rules.len(),
            if self.rules.len() == 1 { "" } else { "s" }
        ));
        for rule in &self.rules {
            line.push_str(&format!(
                " [{} -> {}]",
                rule.when.describe(),
                describe_action(&rule.action)
            ));
        }
        if let Some(TransportKind::Wrap) = self.transport {
            line.push_str(&format!(
                "; transport wrap (inner {})",
                self.inner.as_deref().unwrap_or("from NCCL_LOSSY_INNER")
            ));
        }
        if !self.overrides.is_empty() {
            line.push_str(&format!(" ({SET_ENV}: {})", self.overrides));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Profile> {
        Profile::parse(text, "configs/x.toml", "")
    }

    fn err(text: &str, overrides: &str) -> String {
        match Profile::parse(text, "configs/x.toml", overrides) {
            Ok(p) => panic!("expected an error, got {p:?}"),
            Err(e) => e.message,
        }
    }

    const FULL: &str = r#"
seed = 7
mtu = 2048
stats_interval = 2.5
effect = "zero"
retransmit_timeout_us = 150
model = { kind = "uniform", rate = 0.01 }

[[rules]]
name = "grads"
collective = ["AllReduce", "reducescatter"]
phase = "backward"
steps = { from = 100, until = 200 }
model = { kind = "gilbert_elliott", rate = 0.01, mean_burst = 8 }

[[rules]]
peer = [1, 2]
direction = "recv"
traffic_class = 3
comm_size = 8
effect = "bitflip"
mtu = 512

[[rules]]
collective = "Broadcast"
[rules.model]
kind = "none"
"#;

    #[test]
    fn full_profile_resolves_defaults_and_inheritance() {
        let p = parse(FULL).unwrap();
        assert_eq!((p.seed, p.mtu), (7, 2048));
        assert_eq!(p.stats_interval, Some(Duration::from_millis(2500)));
        assert_eq!(p.defaults.effect, Effect::Zero);
        assert_eq!(p.defaults.retransmit_timeout, Duration::from_micros(150));
        assert_eq!(p.rules.len(), 3);
        let r0 = &p.rules[0];
        assert_eq!(r0.name.as_deref(), Some("grads"));
        assert_eq!(
            r0.when.collectives,
            Some(vec![Collective::AllReduce, Collective::ReduceScatter])
        );
        assert_eq!(r0.when.phase, Phase::Backward);
        assert_eq!(r0.when.steps, Some((100, Some(200))));
        // Rules inherit what they leave out from the defaults.
        assert_eq!((r0.action.effect, r0.action.mtu), (Effect::Zero, 2048));
        assert_eq!(
            r0.action.model,
            ModelSpec::gilbert_elliott_from_rate(0.01, 8.0).unwrap()
        );
        let r1 = &p.rules[1];
        assert_eq!(r1.action.model, ModelSpec::Uniform { rate: 0.01 });
        assert_eq!((r1.action.effect, r1.action.mtu), (Effect::Bitflip, 512));
        assert_eq!(r1.when.peers, Some(vec![1, 2]));
        assert_eq!(r1.when.direction, Some(Direction::Recv));
        assert_eq!(r1.when.traffic_classes, Some(vec![3]));
        assert_eq!(r1.when.comm_sizes, Some(vec![8]));
        assert_eq!(p.rules[2].action.model, ModelSpec::None);
        assert!(p.corrupts_data() && p.matches_on_collective() && !p.is_lossless());
        let json = p.to_json();
        assert_eq!(json["seed"], 7);
        assert_eq!(json["origin"], "configs/x.toml");
        assert_eq!(json["rules"][0]["match"]["collective"][1], "ReduceScatter");
        assert_eq!(
            json["rules"][0]["action"]["model"]["kind"],
            "gilbert_elliott"
        );
        assert_eq!(json["defaults"]["expected_loss_rate"], 0.01);
        let s = p.summary();
        assert!(s.starts_with("configs/x.toml: seed 7, mtu 2048; default: uniform(rate=0.01), effect zero, expected loss 1% (mean burst 1.0101); 3 rules [collective=AllReduce|ReduceScatter phase=backward steps=[100,200) -> gilbert_elliott("), "{s}");
        assert!(
            s.contains("[collective=Broadcast -> none, effect zero, expected loss 0%]"),
            "{s}"
        );
    }

    #[test]
    fn transport_and_inner_are_read_and_shown() {
        let p = parse("transport = \"wrap\"\ninner = \"ib\"\n").unwrap();
        assert_eq!(p.transport, Some(TransportKind::Wrap));
        assert_eq!(p.inner.as_deref(), Some("ib"));
        assert!(
            p.summary().contains("; transport wrap (inner ib)"),
            "{}",
            p.summary()
        );
        assert_eq!(p.to_json()["transport"], "wrap");
        assert_eq!(p.to_json()["inner"], "ib");
        let p = parse("transport = \"socket\"\n").unwrap();
        assert_eq!((p.transport, p.inner), (Some(TransportKind::Socket), None));
        let p = parse("").unwrap();
        assert_eq!((p.transport, p.inner.clone()), (None, None));
        assert_eq!(p.to_json()["transport"], "socket");
        let p = Profile::parse("", "configs/x.toml", "transport=\"wrap\"").unwrap();
        assert!(p.summary().contains("inner from NCCL_LOSSY_INNER"));
    }

    #[test]
    fn omitted_keys_take_the_documented_defaults() {
        let p = parse("").unwrap();
        assert_eq!(
            (p.seed, p.mtu, p.stats_interval),
            (DEFAULT_SEED, DEFAULT_MTU, None)
        );
        assert_eq!(p.defaults.effect, Effect::Retransmit);
        assert_eq!(p.defaults.model, ModelSpec::None);
        assert_eq!(p.defaults.retransmit_timeout, DEFAULT_RETRANSMIT_TIMEOUT);
        assert!(p.is_lossless() && !p.corrupts_data() && !p.matches_on_collective());
        // Retransmit loses packets but never corrupts data.
        let p = parse("model = { kind = \"uniform\", rate = 0.5 }").unwrap();
        assert!(!p.is_lossless() && !p.corrupts_data());
        assert!(parse("model = \"none\"").unwrap().is_lossless());
    }

    #[test]
    fn embedded_default_is_uniform_one_percent_retransmit() {
        let p = Profile::load(None, "").unwrap();
        assert_eq!(p.origin, EMBEDDED_ORIGIN);
        assert_eq!(p.defaults.model, ModelSpec::Uniform { rate: 0.01 });
        assert_eq!(p.defaults.effect, Effect::Retransmit);
        assert!(!p.corrupts_data());
    }

    #[test]
    fn errors_name_file_line_key_and_what_is_allowed() {
        let cases: &[(&str, &str)] = &[
            ("seed = 1\nmodel = { kind = \"uniform\", rate = 1.5 }\n", "configs/x.toml:2: model.rate = 1.5: must be a probability in [0, 1]"),
            ("seed = 1\n\n[[rules]]\nphase = \"backward\"\nmodel = { kind = \"uniform\", rate = -0.1 }\n", "configs/x.toml:5: rules.0.model.rate = -0.1: must be a probability in [0, 1]"),
            ("sed = 1\n", "configs/x.toml:1: sed: unknown key; allowed: description, seed"),
            ("[[rules]]\ncolective = \"AllReduce\"\n", "configs/x.toml:2: rules.0.colective: unknown key; allowed: name, collective"),
            ("mtu = \"big\"\n", "configs/x.toml:1: mtu = \"big\": must be an integer"),
            ("mtu = 32\n", "configs/x.toml:1: mtu = 32: must be an integer in [64, 4294967295]"),
            ("\n\nmodel = { kind = \"gilbert_elliott\", rate = 0.01, mean_burst = 0.5 }\n", "configs/x.toml:3: model.mean_burst = 0.5: must be a number >= 1"),
            ("model = { kind = \"gilbert_elliott\", rate = 1, mean_burst = 4 }\n", "configs/x.toml:1: model.rate = 1: must be < 1 with bursts"),
            ("model = { kind = \"gilbert_elliott\", p = 0.1, rate = 0.01 }\n", "configs/x.toml:1: model.rate = 0.01: gilbert_elliott takes either netem's p, r, h_loss, k_loss or rate and mean_burst, not both"),
            ("model = { kind = \"bursty\" }\n", "configs/x.toml:1: model.kind = \"bursty\": unknown model kind \"bursty\"; allowed: none, uniform, gilbert_elliott, markov4, trace"),
            ("model = { rate = 0.1 }\n", "configs/x.toml:1: model.kind: missing; allowed kinds"),
            ("model = { kind = \"uniform\", rate = \"high\" }\n", "configs/x.toml:1: model.rate = \"high\": must be a number"),
            ("model = { kind = \"uniform\", rate = 0.1, wobble = 2 }\n", "configs/x.toml:1: model.wobble: unknown key; allowed: kind, rate"),
            ("[[rules]]\nsteps = { from = 300, until = 200 }\n", "configs/x.toml:2: rules.0.steps = {…}: from = 300 is after until = 200"),
            ("[[rules]]\ncollective = [\"AllReduce\", \"AllReduse\"]\n", "configs/x.toml:2: rules.0.collective.1 = \"AllReduse\": unknown collective; allowed: Unknown, Broadcast, Reduce"),
            ("[[rules]]\ncollective = []\n", "configs/x.toml:2: rules.0.collective = […]: must list at least one value"),
            ("effect = \"drop\"\n", "configs/x.toml:1: effect = \"drop\": unknown effect; allowed: \"zero\", \"stale\", \"retransmit\", \"bitflip\""),
            ("[[rules]]\nphase = \"sideways\"\n", "configs/x.toml:2: rules.0.phase = \"sideways\": allowed: \"forward\", \"backward\", \"any\""),
            ("[[rules]]\ndirection = \"up\"\n", "configs/x.toml:2: rules.0.direction = \"up\": allowed: \"send\", \"recv\""),
            ("[[rules]]\npeer = -1\n", "configs/x.toml:2: rules.0.peer = -1: must be an integer in [0, 4294967295]"),
            ("stats_interval = 0\n", "configs/x.toml:1: stats_interval = 0: must be a number > 0"),
            ("transport = \"ib\"\n", "configs/x.toml:1: transport = \"ib\": allowed: \"socket\", \"wrap\""),
            ("inner = \"ib\"\n", "configs/x.toml:1: inner = \"ib\": only used with transport = \"wrap\""),
            ("transport = \"wrap\"\ninner = \" \"\n", "configs/x.toml:2: inner = \" \": must name a net plugin library"),
            ("retransmit_timeout_us = -5\n", "configs/x.toml:1: retransmit_timeout_us = -5: must be a number >= 0"),
            ("rules = 3\n", "configs/x.toml:1: rules = 3: must be a list of tables"),
            ("model = { kind = \"markov4\", p13 = 0.6, p14 = 0.6 }\n", "configs/x.toml:1: model.p14 = 0.6: p13 + p14 = 1.2 must be at most 1"),
            ("model = { kind = \"trace\", file = \"missing-trace.txt\" }\n", "configs/x.toml:1: model.file = \"missing-trace.txt\": cannot read trace"),
            ("seed = 1\nmtu = [\n", "configs/x.toml:3: not valid TOML"),
        ];
        for (text, want) in cases {
            let got = err(text, "");
            assert!(
                got.starts_with(want),
                "for {text:?}\n got: {got}\nwant: {want}"
            );
        }
    }

    #[test]
    fn overrides_apply_on_top_and_name_the_variable() {
        let p = Profile::parse(FULL, "x.toml", "model.rate=0.02; seed=9 ;effect=retransmit;rules.0.model.mean_burst=4;rules.1.peer=[5]").unwrap();
        assert_eq!(p.seed, 9);
        assert_eq!(p.defaults.model, ModelSpec::Uniform { rate: 0.02 });
        assert_eq!(p.defaults.effect, Effect::Retransmit);
        assert_eq!(
            p.rules[0].action.model,
            ModelSpec::gilbert_elliott_from_rate(0.01, 4.0).unwrap()
        );
        assert_eq!(p.rules[1].when.peers, Some(vec![5]));
        assert_eq!(p.overrides, "model.rate=0.02; seed=9 ;effect=retransmit;rules.0.model.mean_burst=4;rules.1.peer=[5]");
        assert!(p.summary().contains("(NCCL_LOSSY_SET: model.rate=0.02"));
        // A whole model at once, and keys the file did not have.
        let p = Profile::parse(
            "",
            "x.toml",
            "model={kind=\"gilbert_elliott\",rate=0.05,mean_burst=2};stats_interval=1",
        )
        .unwrap();
        assert!((p.defaults.model.expected_loss_rate() - 0.05).abs() < 1e-12);
        assert_eq!(p.stats_interval, Some(Duration::from_secs(1)));
        let p = Profile::parse("", "x.toml", "model.kind=uniform;model.rate=0.1").unwrap();
        assert_eq!(p.defaults.model, ModelSpec::Uniform { rate: 0.1 });
        let cases: &[(&str, &str)] = &[
            (
                "model.rate=1.5",
                "NCCL_LOSSY_SET: model.rate = 1.5: must be a probability in [0, 1]",
            ),
            (
                "rules.5.effect=zero",
                "NCCL_LOSSY_SET: rules.5.effect: rules has no entry 5 (it has 3)",
            ),
            (
                "rules.x.effect=zero",
                "NCCL_LOSSY_SET: rules.x.effect: rules is a list",
            ),
            ("seed", "NCCL_LOSSY_SET: `seed`: expected key=value"),
            (
                "model..rate=1",
                "NCCL_LOSSY_SET: `model..rate`: not a dotted key",
            ),
            (
                "mtu.x=1",
                "NCCL_LOSSY_SET: mtu.x: mtu is a value, not a table",
            ),
            ("modle.rate=0.1", "NCCL_LOSSY_SET: modle: unknown key"),
            (
                "effect=drop",
                "NCCL_LOSSY_SET: effect = \"drop\": unknown effect",
            ),
        ];
        for (set, want) in cases {
            let got = err(FULL, set);
            assert!(
                got.starts_with(want),
                "for {set:?}\n got: {got}\nwant: {want}"
            );
        }
        let got = err("", "rules.0.effect=zero");
        assert!(got.contains("rules is not in the profile"), "{got}");
    }

    #[test]
    fn trace_files_resolve_next_to_the_profile() {
        let dir = std::env::temp_dir().join(format!("lossy-profile-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("drops.txt"), "# lost packets\n1\n2\n7\n").unwrap();
        let path = dir.join("p.toml");
        std::fs::write(
            &path,
            "model = { kind = \"trace\", file = \"drops.txt\", length = 10 }\n",
        )
        .unwrap();
        let p = Profile::load(Some(&path), "").unwrap();
        assert!((p.defaults.model.expected_loss_rate() - 0.3).abs() < 1e-12);
        assert!(
            p.summary().contains("trace(drops.txt, 10 packets, 3 lost)"),
            "{}",
            p.summary()
        );
        std::fs::write(dir.join("bad.txt"), "1\nseven\n").unwrap();
        let e = Profile::load(Some(&path), "model.file=bad.txt")
            .unwrap_err()
            .message;
        assert!(
            e.starts_with("NCCL_LOSSY_SET: model.file = \"bad.txt\": ") && e.contains("bad.txt:2:"),
            "{e}"
        );
        let e = Profile::load(Some(&dir.join("nope.toml")), "")
            .unwrap_err()
            .message;
        assert!(e.contains("nope.toml: cannot read profile"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
