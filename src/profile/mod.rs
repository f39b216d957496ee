//! Loss profiles: the TOML schema, environment overrides and the embedded default.
//!
//! A profile is read in three steps: the TOML text is parsed into a small tree that remembers
//! each value's line; `NCCL_LOSSY_SET` overrides are written into that tree (marked as coming
//! from the override); the tree is then checked against the schema. So every error, whether
//! from the file or from an override, can say where the bad value came from, its dotted key
//! and what is allowed. The schema is documented in docs/loss-models.md.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value as Json};

use crate::error::{echo, echo_at_most, Error, Result, SHOWN_CHARS};
use crate::files::read_regular_file;
use crate::loss::engine::LossEngine;
use crate::loss::model::{binary_size, short};
use crate::loss::plan::Effect;
use crate::loss::rules::{Action, Direction, Rule};

#[cfg(test)]
mod bounds_tests;
mod check;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trace_tests;
mod tree;

/// Environment variable naming the profile file.
pub const PROFILE_ENV: &str = "NCCL_LOSSY_PROFILE";
/// Environment variable with `;`-separated `dotted.key=value` overrides.
pub const SET_ENV: &str = "NCCL_LOSSY_SET";
/// The origin of the embedded default profile.
pub const EMBEDDED_ORIGIN: &str = "embedded default";
/// The profile used when `NCCL_LOSSY_PROFILE` is not set.
pub const DEFAULT_PROFILE: &str = include_str!("../../configs/default.toml");
/// Largest profile file read, in bytes (profiles are a few KiB; a FIFO or `/dev/zero` is
/// refused before any read, a huge file before it fills memory). Parsing holds about 35
/// bytes per byte of text: at most about 150 MB here, where 64 MiB took 2.3 GB.
pub const MAX_PROFILE_BYTES: u64 = 4 << 20;
/// Seed used when a profile sets none.
pub const DEFAULT_SEED: u64 = 1;
/// Most segments in an override's dotted key. The deepest key of the schema has four
/// (`rules.0.model.rate`); the limit keeps a hostile key from nesting the tree without end.
pub const MAX_KEY_SEGMENTS: usize = 16;
/// Most rules in a profile. Every connection keeps one loss state per rule, every message
/// looks for its rule in order, and statistics files list every rule: a handful is typical,
/// and a thousand covers one rule per peer of a large job.
pub const MAX_RULES: usize = 1024;
/// Longest one-line summary (`lossy validate`, the plugin's init log), in bytes: rules past it
/// are counted, not listed.
pub const MAX_SUMMARY_BYTES: usize = 4096;
/// Most bytes of [`Profile::warnings`] listed (`lossy validate`, `lossy run`, every rank's
/// init log): warnings past it are counted, not listed.
pub const MAX_WARNINGS_BYTES: usize = 4096;
/// Shortest `stats_interval`: each write rewrites the whole statistics file.
pub const MIN_STATS_INTERVAL: Duration = Duration::from_millis(100);

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
/// Largest trace ring a profile or `NCCL_LOSSY_TRACE_EVENTS` may ask for: 2^24 messages.
pub const MAX_TRACE_EVENTS: i64 = 1 << 24;

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
    /// The same, each layer under where it came from, for the summary:
    /// "NCCL_LOSSY_SET: a=1; --set: b=2".
    pub overrides_shown: String,
    /// The profile's own description, if it has one.
    pub description: Option<String>,
    /// The transport the profile asks for (`None`: not set, which means sockets).
    pub transport: Option<TransportKind>,
    /// The net plugin to wrap under `transport = "wrap"` (a path or a name like "ib").
    pub inner: Option<String>,
    /// Directory for the loss timeline's trace files (`NCCL_LOSSY_TRACE` wins).
    pub trace: Option<String>,
    /// Capacity of the trace ring in messages (`NCCL_LOSSY_TRACE_EVENTS` wins).
    pub trace_events: Option<usize>,
}

/// "model, effect E[, mtu M], expected loss X% (mean burst B)"; the mtu is named when it is
/// not the profile's `mtu` (a rule's own), since it decides which bytes a loss takes.
fn describe_action(action: &Action, profile_mtu: u32) -> String {
    let loss = action.model.expected_loss_rate();
    let mtu = if action.mtu == profile_mtu {
        String::new()
    } else {
        format!(", mtu {}", action.mtu)
    };
    let mut s = format!(
        "{}, effect {}{mtu}, expected loss {}%",
        action.model.describe(),
        action.effect.name(),
        short(loss * 100.0)
    );
    if loss > 0.0 {
        let burst = action.model.expected_mean_burst();
        s.push_str(&format!(" (mean burst {})", short(burst)));
        s.push_str(&burst_spacing(loss, burst, action.mtu));
    }
    if let Some((events, wait_us)) = expected_wait(action) {
        s.push_str(&format!(
            ", a 512 KiB message waits {} us on average ({} loss events x {} us)",
            short(wait_us),
            short(events),
            short(action.retransmit_timeout.as_secs_f64() * 1e6)
        ));
    }
    s
}

/// For a model that loses in bursts (a mean burst of 2 packets or more): how far apart the
/// bursts begin, `mean burst / rate` packets, in packets and bytes at `mtu`. A stream sees
/// its model's loss rate only over many of those (a Gilbert-Elliott or 4-state stream starts
/// in its good state), so a connection that carries a few of them shows 0% or several times
/// the mean; "expected loss 1%" alone let a short run's rate pass for the model's.
fn burst_spacing(rate: f64, burst: f64, mtu: u32) -> String {
    if !(burst >= 2.0 && burst.is_finite() && rate > 0.0) {
        return String::new();
    }
    let packets = burst / rate;
    let bytes = (packets * f64::from(mtu)).min(u64::MAX as f64) as u64;
    format!(
        ", a burst begins every {} packets ({} at mtu {mtu}) on average",
        short(packets.round()),
        binary_size(bytes)
    )
}

/// Reference message of [`expected_wait`]: NCCL's 512 KiB slices of a large transfer.
const WAIT_REFERENCE_BYTES: u64 = 512 << 10;

/// The first of `warnings` (each with what it is about) that fit in [`MAX_WARNINGS_BYTES`]
/// together, in order, and, when some were left out, what the first of those was about and
/// how many they were: once one is left out so are those after it, so the list is the first.
fn within_budget<T>(
    warnings: impl Iterator<Item = (T, String)>,
) -> (Vec<String>, Option<(T, usize)>) {
    let (mut listed, mut bytes, mut left_out) = (Vec::new(), 0, None);
    for (about, warning) in warnings {
        match &mut left_out {
            Some((_, count)) => *count += 1,
            None if bytes + warning.len() > MAX_WARNINGS_BYTES => left_out = Some((about, 1)),
            None => {
                bytes += warning.len();
                listed.push(warning);
            }
        }
    }
    (listed, left_out)
}

/// Seconds of retransmit wait per [`WAIT_REFERENCE_BYTES`] message from which a profile is
/// warned about: a step of a training run posts hundreds of such messages.
const LONG_WAIT_S: f64 = 1.0;

/// For a `retransmit` action that can lose: the loss events a 512 KiB message has on average
/// and the time they add (one timeout each, docs/loss-models.md). Each run of losses within
/// a message is one event: its first packet is lost with probability `rate`, and a run
/// starts at each later packet with probability `rate / mean burst` (a stationary model's
/// runs begin at that rate).
fn expected_wait(action: &Action) -> Option<(f64, f64)> {
    let rate = action.model.expected_loss_rate();
    if action.effect != Effect::Retransmit || rate.is_nan() || rate <= 0.0 {
        return None;
    }
    let packets = WAIT_REFERENCE_BYTES.div_ceil(u64::from(action.mtu.max(1))) as f64;
    let burst = action.model.expected_mean_burst();
    let starts = if burst.is_finite() && burst >= 1.0 {
        rate / burst
    } else {
        0.0
    };
    let events = rate + (packets - 1.0) * starts;
    Some((
        events,
        events * action.retransmit_timeout.as_secs_f64() * 1e6,
    ))
}

fn action_json(action: &Action) -> Json {
    let mut json = json!({
        "effect": action.effect,
        "model": serde_json::to_value(&action.model).unwrap_or(Json::Null),
        "expected_loss_rate": finite(action.model.expected_loss_rate()),
        "expected_mean_burst": finite(action.model.expected_mean_burst()),
        "retransmit_timeout_us": action.retransmit_timeout.as_secs_f64() * 1e6,
        "mtu": action.mtu,
    });
    if let (Some((_, wait_us)), Some(map)) = (expected_wait(action), json.as_object_mut()) {
        map.insert("expected_wait_us_per_512kib".into(), finite(wait_us));
    }
    json
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
        let path = Profile::path_from_env()?;
        let overrides = crate::env::var(SET_ENV)?.unwrap_or_default();
        Profile::load(path.as_deref(), &overrides)
    }

    /// The file `NCCL_LOSSY_PROFILE` names; `None` when it is unset or empty (the embedded
    /// default). A value of blanks names no file, and is an error saying so.
    pub fn path_from_env() -> Result<Option<PathBuf>> {
        let Some(value) = std::env::var_os(PROFILE_ENV).filter(|p| !p.is_empty()) else {
            return Ok(None);
        };
        if value.to_str().is_some_and(|v| v.trim().is_empty()) {
            return Err(Error::invalid_argument(format!(
                "{PROFILE_ENV} = {}: must name a profile file (unset it for the embedded \
                 default)",
                echo(&value.to_string_lossy(), |v| format!("{v:?}"))
            )));
        }
        Ok(Some(PathBuf::from(value)))
    }

    /// The profile at `path` (the embedded default for `None`) with `overrides` (from
    /// `NCCL_LOSSY_SET`) applied.
    pub fn load(path: Option<&Path>, overrides: &str) -> Result<Profile> {
        Profile::load_layers(path, &[(SET_ENV, overrides)])
    }

    /// The profile at `path` (the embedded default for `None`) with each layer of overrides
    /// applied in order (later ones win); a layer is (where it came from, its `a.b=v;c=w`
    /// text), and errors about its values name where it came from (`--set`).
    pub fn load_layers(path: Option<&Path>, layers: &[(&str, &str)]) -> Result<Profile> {
        match path {
            None => Profile::parse_layers(DEFAULT_PROFILE, EMBEDDED_ORIGIN, None, layers),
            Some(path) => {
                let text = read_regular_file(path, MAX_PROFILE_BYTES, "profile")
                    .map_err(Error::invalid_argument)?;
                Profile::parse_layers(&text, &path.display().to_string(), path.parent(), layers)
            }
        }
    }

    /// Parses profile text; `origin` labels errors, and when it is a path, trace files are
    /// found relative to its directory.
    pub fn parse(text: &str, origin: &str, overrides: &str) -> Result<Profile> {
        let base = (origin != EMBEDDED_ORIGIN)
            .then(|| Path::new(origin).parent())
            .flatten();
        Profile::parse_layers(text, origin, base, &[(SET_ENV, overrides)])
    }

    fn parse_layers(
        text: &str,
        origin: &str,
        base: Option<&Path>,
        layers: &[(&str, &str)],
    ) -> Result<Profile> {
        let mut root = tree::parse(text, origin)?;
        for (layer, (source, overrides)) in layers.iter().enumerate() {
            tree::apply_overrides(&mut root, overrides, layer, source)?;
        }
        let sources: Vec<&str> = layers.iter().map(|(source, _)| *source).collect();
        let overrides_shown = layers
            .iter()
            .map(|(source, overrides)| (source, overrides.trim()))
            .filter(|(_, overrides)| !overrides.is_empty())
            .map(|(source, overrides)| {
                let shown = echo_at_most(overrides, SHOWN_CHARS, str::to_string);
                format!("{source}: {shown}")
            })
            .collect::<Vec<_>>()
            .join("; ");
        let checked = check::Checker {
            origin,
            sources: &sources,
            traces: Default::default(),
        }
        .profile(&root, base);
        let mut profile = match checked {
            // An error placed in the file may come of what an override changed (a model kind
            // that now needs other keys, a window bound moved past the other): say which
            // overrides the file was read with.
            Err(e)
                if !overrides_shown.is_empty() && e.message.starts_with(&format!("{origin}:")) =>
            {
                return Err(Error::new(
                    e.kind,
                    format!("{} (with the overrides of {overrides_shown})", e.message),
                ))
            }
            checked => checked?,
        };
        profile.overrides = layers
            .iter()
            .map(|(_, overrides)| overrides.trim())
            .filter(|overrides| !overrides.is_empty())
            .collect::<Vec<_>>()
            .join(";");
        profile.overrides_shown = overrides_shown;
        Ok(profile)
    }

    /// The loss engine that runs this profile's rules and defaults.
    pub fn loss_engine(&self) -> LossEngine {
        LossEngine::new(self.seed, self.rules.clone(), self.defaults.clone())
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

    /// What is valid but likely not what the author meant, one sentence each: a rule that
    /// never decides a message because an earlier rule matches every message it matches (the
    /// first matching rule decides). `lossy validate` and `lossy run` print these, and the
    /// plugin logs them at init. They are listed up to [`MAX_WARNINGS_BYTES`] (rule names cut,
    /// [`echo`]), and one last sentence counts the rest.
    pub fn warnings(&self) -> Vec<String> {
        let named = |i: usize, rule: &Rule| match &rule.name {
            Some(name) => format!(
                "rules.{i} {} ({})",
                echo(name, |n| format!("\"{n}\"")),
                rule.when.describe()
            ),
            None => format!("rules.{i} ({})", rule.when.describe()),
        };
        let covered = self.rules.iter().enumerate().filter_map(|(j, later)| {
            let (i, earlier) = self.rules[..j]
                .iter()
                .enumerate()
                .find(|(_, earlier)| earlier.when.covers(&later.when))?;
            let warning = format!(
                "{}: {} never decides a message: {} comes first and matches every message it \
                 matches (the first rule that matches decides; put the narrower rule first)",
                self.origin,
                named(j, later),
                named(i, earlier)
            );
            Some((j, warning))
        });
        let (mut warnings, left_out) = within_budget(covered);
        if let Some((first, count)) = left_out {
            let which = if count == 1 {
                format!("1 more rule never decides a message, rules.{first}: it matches")
            } else {
                format!(
                    "{count} more rules never decide a message, the first of them \
                     rules.{first}: each matches"
                )
            };
            warnings.push(format!(
                "{}: … {which} only messages an earlier rule matches (the first rule that \
                 matches decides; put the narrower rule first)",
                self.origin
            ));
        }
        warnings.extend(self.long_wait_warnings(&named));
        warnings
    }

    /// A warning for each action (the defaults, then each rule) whose retransmissions make a
    /// 512 KiB message wait [`LONG_WAIT_S`] or more on average, up to [`MAX_WARNINGS_BYTES`],
    /// then a count of the rest: every value may be in range while together they stall a job
    /// for hours (mtu 64, a 10 s timeout, half the packets lost: 5.7 hours a message).
    fn long_wait_warnings(&self, named: &dyn Fn(usize, &Rule) -> String) -> Vec<String> {
        let actions = std::iter::once((None, &self.defaults)).chain(
            self.rules
                .iter()
                .enumerate()
                .map(|(i, rule)| (Some(i), &rule.action)),
        );
        let long = actions.filter_map(|(rule, action)| {
            let (events, wait_us) = expected_wait(action)?;
            if wait_us < LONG_WAIT_S * 1e6 {
                return None;
            }
            let which = rule.map_or("default".to_string(), |i| named(i, &self.rules[i]));
            let warning = format!(
                "{}: {which}: a 512 KiB message waits {} s on average for its retransmissions \
                 ({} loss events x {} us): collectives crawl, and a watchdog (PyTorch's NCCL \
                 timeout) may end the job; lower retransmit_timeout_us or the loss, or raise \
                 mtu",
                self.origin,
                short(wait_us / 1e6),
                short(events),
                short(action.retransmit_timeout.as_secs_f64() * 1e6)
            );
            Some(((), warning))
        });
        let (mut warnings, left_out) = within_budget(long);
        if let Some(((), count)) = left_out {
            warnings.push(format!(
                "{}: … {count} more rule(s) make a 512 KiB message wait {LONG_WAIT_S} s or \
                 more on average for its retransmissions",
                self.origin
            ));
        }
        warnings
    }

    /// One line: origin, seed, mtu, the defaults with their expected loss, then each rule.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "{}: seed {}, mtu {}; default: {}",
            self.origin,
            self.seed,
            self.mtu,
            describe_action(&self.defaults, self.mtu)
        );
        line.push_str(&format!(
            "; {} rule{}",
            self.rules.len(),
            if self.rules.len() == 1 { "" } else { "s" }
        ));
        for (i, rule) in self.rules.iter().enumerate() {
            let part = format!(
                " [{} -> {}]",
                rule.when.describe(),
                describe_action(&rule.action, self.mtu)
            );
            if line.len() + part.len() > MAX_SUMMARY_BYTES {
                let left = self.rules.len() - i;
                line.push_str(&format!(
                    " … {left} more rule{} (the statistics files list every rule)",
                    if left == 1 { "" } else { "s" }
                ));
                break;
            }
            line.push_str(&part);
        }
        if let Some(TransportKind::Wrap) = self.transport {
            line.push_str(&format!(
                "; transport wrap (inner {})",
                self.inner.as_deref().unwrap_or("from NCCL_LOSSY_INNER")
            ));
        }
        if !self.overrides_shown.is_empty() {
            line.push_str(&format!(" ({})", self.overrides_shown));
        }
        line
    }
}
