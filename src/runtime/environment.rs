//! What the environment and the profile decide before a runtime is built: which plugin to
//! wrap, whether a forced NCCL protocol is safe, and the profile as statistics files show it.

use super::{CARGO_LIBRARY_NAME, NCCL_LIBRARY_NAME, PLUGIN_NAME};
use crate::profile::{Profile, TransportKind};
use crate::stats::writer::LAUNCHER_RANK_VARS;
use crate::{Error, Result};

/// Environment variable naming the net plugin to wrap; overrides the profile's `inner`.
pub const INNER_ENV: &str = "NCCL_LOSSY_INNER";

/// The settings that make NCCL send the traffic between GPUs of one node through the network
/// plugin: without P2P, shared-memory and NVLS transports, NCCL connects local ranks over its
/// network as it does remote ones. Each is (variable, value, NCCL's own transport another
/// value leaves on). Launchers set each one the user has not and say when a user's value keeps
/// a transport on (`lossy run`, and the Python helper, which reads them from
/// `ncclLossyCheckProfile`'s answer).
pub const INTRA_NODE_THROUGH_NET: [(&str, &str, &str); 3] = [
    ("NCCL_P2P_DISABLE", "1", "P2P (NVLink, PCIe)"),
    ("NCCL_SHM_DISABLE", "1", "shared memory"),
    ("NCCL_NVLS_ENABLE", "0", "NVLS"),
];

/// The plugin to wrap, if any: `NCCL_LOSSY_INNER` (`inner_env`) wins over the profile's
/// `inner`; `transport = "wrap"` without either, or `transport = "socket"` with
/// `NCCL_LOSSY_INNER`, is an error.
pub fn wrap_target(profile: &Profile, inner_env: Option<String>) -> Result<Option<String>> {
    let target = wrap_target_unchecked(profile, inner_env)?;
    if let Some(inner) = &target {
        crate::files::check_path_length(std::path::Path::new(inner)).map_err(|why| {
            Error::invalid_argument(format!(
                "the net plugin to wrap ({INNER_ENV} or `inner`): {why}"
            ))
        })?;
    }
    Ok(target)
}

fn wrap_target_unchecked(profile: &Profile, inner_env: Option<String>) -> Result<Option<String>> {
    match (profile.transport, inner_env) {
        (Some(TransportKind::Socket), Some(inner)) => Err(Error::invalid_argument(format!(
            "{INNER_ENV}={} asks to wrap a net plugin, but the profile ({}) says \
             transport = \"socket\"; unset one of them",
            crate::error::echo(&inner, str::to_string),
            profile.origin
        ))),
        (_, Some(inner)) => Ok(Some(inner)),
        (Some(TransportKind::Wrap), None) => match &profile.inner {
            Some(inner) => Ok(Some(inner.clone())),
            None => Err(Error::invalid_argument(format!(
                "the profile ({}) says transport = \"wrap\" but names no plugin to wrap: set \
                 `inner` in the profile or {INNER_ENV} (a path, or a name like \"ib\")",
                profile.origin
            ))),
        },
        _ => Ok(None),
    }
}

/// The resolved profile as JSON, with the closed-form loss rate and mean burst length of its
/// first lossy model (the defaults', else the first rule's) under `expected`, which
/// `lossy report` draws the measured bursts against, and of every rule's model and the
/// defaults' under `expected_by_rule` (rule `null`: the defaults), which it sets each rule's
/// counts against.
pub(super) fn profile_with_expectation(profile: &Profile) -> serde_json::Value {
    let mut json = profile.to_json();
    let closed_form = |model: &crate::loss::model::ModelSpec| {
        serde_json::json!({
            "loss_rate": model.expected_loss_rate(),
            "mean_burst": model.expected_mean_burst(),
        })
    };
    let lossy = profile
        .actions()
        .map(|action| &action.model)
        .find(|model| model.expected_loss_rate() > 0.0);
    let by_rule = profile
        .rules
        .iter()
        .enumerate()
        .map(|(i, rule)| (Some(i), rule.name.as_deref(), &rule.action.model))
        .chain(std::iter::once((None, None, &profile.defaults.model)))
        .map(|(rule, name, model)| {
            let mut entry = closed_form(model);
            entry["rule"] = serde_json::json!(rule);
            entry["name"] = serde_json::json!(name);
            entry
        })
        .collect::<Vec<_>>();
    if let Some(object) = json.as_object_mut() {
        if let Some(model) = lossy {
            object.insert("expected".into(), closed_form(model));
        }
        object.insert("expected_by_rule".into(), serde_json::Value::Array(by_rule));
    }
    json
}

/// Fails when the user forces LL or LL128 through `NCCL_PROTO` while the profile corrupts
/// data: those protocols carry flags in the payload, and a lost flag hangs the receiving GPU.
pub fn check_forced_protocol(profile: &Profile, nccl_proto: Option<&str>) -> Result<()> {
    let Some(forced) = nccl_proto.and_then(forced_ll_protocol) else {
        return Ok(());
    };
    if !profile.corrupts_data() {
        return Ok(());
    }
    Err(Error::invalid_usage(format!(
        "NCCL_PROTO={} allows {forced}, but the loss profile ({}) has a data-loss effect \
         (zero, stale or bitflip): LL and LL128 carry flags inside the payload and a lost \
         packet would hang the receiving GPU. Use NCCL_PROTO=Simple (or unset it: this \
         library's tuner then rules LL/LL128 out), or the `retransmit` effect",
        crate::error::echo(nccl_proto.unwrap_or_default(), str::to_string),
        profile.origin
    )))
}

/// NCCL's settings that give network point-to-point connections LL buffers, and the size
/// up to which NCCL then sends point-to-point transfers with LL.
#[derive(Clone, Debug, Default)]
pub struct P2pLlSettings {
    /// `NCCL_NET_SHARED_BUFFERS`.
    pub shared_buffers: Option<String>,
    /// `NCCL_ALLOC_P2P_NET_LL_BUFFERS`.
    pub alloc_ll_buffers: Option<String>,
    /// `NCCL_P2P_LL_THRESHOLD`.
    pub ll_threshold: Option<String>,
}

impl P2pLlSettings {
    /// The three variables as this process has them (bytes that are not UTF-8 read lossily:
    /// NCCL reads them as bytes, and no digit is lost that way).
    pub fn from_env() -> P2pLlSettings {
        let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        P2pLlSettings {
            shared_buffers: var("NCCL_NET_SHARED_BUFFERS"),
            alloc_ll_buffers: var("NCCL_ALLOC_P2P_NET_LL_BUFFERS"),
            ll_threshold: var("NCCL_P2P_LL_THRESHOLD"),
        }
    }
}

/// An integer setting as NCCL reads it (`ncclLoadParam`, src/misc/param.cc): unset or empty
/// is the default (`None`); anything else goes through `strtoll` in base 0: C blanks, a
/// sign, then decimal, `0x` hexadecimal or `0` octal digits, as many as there are (none is
/// 0, blanks alone too); a value out of range (ERANGE) is the default again.
fn nccl_integer(value: Option<&str>) -> Option<i64> {
    let text = value.filter(|v| !v.is_empty())?;
    let text = text.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
    let (negative, text) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let (radix, digits) = if let Some(hex) = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()))
    {
        (16, hex)
    } else if text.len() > 1 && text.starts_with('0') {
        (8, &text[1..])
    } else {
        (10, text)
    };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    if end == 0 {
        return Some(0);
    }
    let magnitude = i128::from_str_radix(&digits[..end], radix).ok()?;
    i64::try_from(if negative { -magnitude } else { magnitude }).ok()
}

/// Refuses a data-loss profile when NCCL may send point-to-point transfers over the network
/// with LL, which neither `NCCL_PROTO` nor this library's tuner can rule out: NCCL picks LL
/// for a send or receive of up to `NCCL_P2P_LL_THRESHOLD` bytes (16 KiB) per channel whenever
/// the connection has LL buffers (`src/enqueue.cc`), and a network connection has them with
/// `NCCL_NET_SHARED_BUFFERS=0` (kept in an `int`: dedicated buffers) or
/// `NCCL_ALLOC_P2P_NET_LL_BUFFERS=1` (`src/transport/net.cc`, src/init.cc; by default
/// point-to-point connections share Simple buffers only). A lost packet of an LL transfer
/// hangs the receiving GPU. A threshold of 0 or less keeps point-to-point on Simple.
pub fn check_p2p_ll(profile: &Profile, settings: &P2pLlSettings) -> Result<()> {
    if !profile.corrupts_data()
        || nccl_integer(settings.ll_threshold.as_deref()).is_some_and(|t| t <= 0)
    {
        return Ok(());
    }
    let shared = settings.shared_buffers.as_deref();
    let alloc = settings.alloc_ll_buffers.as_deref();
    let (var, value) = if nccl_integer(shared).is_some_and(|n| n as i32 == 0) {
        ("NCCL_NET_SHARED_BUFFERS", shared)
    } else if nccl_integer(alloc) == Some(1) {
        ("NCCL_ALLOC_P2P_NET_LL_BUFFERS", alloc)
    } else {
        return Ok(());
    };
    let value = crate::error::echo(value.unwrap_or_default(), str::to_string);
    Err(Error::invalid_usage(format!(
        "{var}={value} gives network point-to-point connections LL buffers, and NCCL then \
         sends transfers of up to NCCL_P2P_LL_THRESHOLD bytes per channel (16 KiB unless set) \
         with LL whatever NCCL_PROTO or the tuner say; the loss profile ({}) has a data-loss \
         effect (zero, stale or bitflip), and a lost packet of an LL transfer hangs the \
         receiving GPU. Set NCCL_P2P_LL_THRESHOLD=0 (point-to-point on Simple), unset {var}, \
         or use the `retransmit` effect",
        profile.origin
    )))
}

/// The tuner `NCCL_TUNER_PLUGIN` (`tuner_plugin`) names when it is not this library: NCCL
/// then loads that one (or none, for "none") instead of ours, unless it fails to open
/// (`src/plugin/tuner.cc`).
fn other_tuner(tuner_plugin: Option<&str>) -> Option<&str> {
    let tuner = tuner_plugin.map(str::trim).filter(|t| !t.is_empty())?;
    let ours = tuner == PLUGIN_NAME
        || std::path::Path::new(tuner)
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n == NCCL_LIBRARY_NAME || n == CARGO_LIBRARY_NAME);
    (!ours).then_some(tuner)
}

/// A warning when rules match on `comm_size` while NCCL will not load this library's tuner,
/// which is how the plugin learns each communicator's size (the tuner's `init` gets it; the
/// net API never says): under another tuner, or none (`NCCL_TUNER_PLUGIN=none`), such a rule
/// never matches a message (`src/plugin/tuner.cc`).
pub fn unknown_comm_size_warning(profile: &Profile, tuner_plugin: Option<&str>) -> Option<String> {
    let tuner = other_tuner(tuner_plugin)?;
    let rules = rules_where(profile, |rule| rule.when.comm_sizes.is_some());
    if rules.is_empty() {
        return None;
    }
    // "none" loads no tuner at all; a tuner that fails to open leaves NCCL to ours.
    let (loads, unless) = if tuner.eq_ignore_ascii_case("none") {
        ("no tuner", "")
    } else {
        ("that tuner instead", "unless it fails to load, ")
    };
    let tuner = crate::error::echo(tuner, str::to_string);
    Some(format!(
        "NCCL_TUNER_PLUGIN={tuner}: {} of profile {} {} on comm_size, which the plugin learns \
         from this library's tuner, and NCCL loads {loads}: {unless}{}. Unset \
         NCCL_TUNER_PLUGIN, or match without comm_size",
        rules.join(", "),
        profile.origin,
        match_verbs(rules.len()).0,
        match_verbs(rules.len()).1
    ))
}

/// The rules of `profile` (as `rules.N`) that `pick` picks.
fn rules_where(profile: &Profile, pick: impl Fn(&crate::loss::rules::Rule) -> bool) -> Vec<String> {
    let picked = profile
        .rules
        .iter()
        .enumerate()
        .filter(|(_, rule)| pick(rule));
    picked.map(|(i, _)| format!("rules.{i}")).collect()
}

/// "match(es)" and the consequence, for a warning about `n` rules that can never match.
fn match_verbs(n: usize) -> (&'static str, &'static str) {
    if n == 1 {
        ("matches", "that rule never matches a message")
    } else {
        ("match", "those rules never match a message")
    }
}

/// A warning when this process has no launcher rank (`rank`, from [`LAUNCHER_RANK_VARS`])
/// and that changes what runs. Rules that match on `peer` never match: peers are the
/// launcher's ranks, carried in the connection handle, so without one no message has a peer.
/// And a profile that can lose seeds every loss stream as rank 0's toward an unknown peer
/// (`StreamKey`): every such process draws the same streams, so the ranks' k-th connections
/// lose the same packets of the same messages instead of independently. `set` is what the
/// rank variables hold that are set but are not a rank (`RANK=rank-one`).
pub fn unknown_rank_warning(
    profile: &Profile,
    rank: Option<u64>,
    set: &[(&str, String)],
) -> Option<String> {
    if rank.is_some() {
        return None;
    }
    let rules = rules_where(profile, |rule| rule.when.peers.is_some());
    let loses = profile.actions().any(|action| action.model.can_lose());
    if rules.is_empty() && !loses {
        return None;
    }
    let held = if set.is_empty() {
        "none is set".to_string()
    } else {
        let values: Vec<String> = set
            .iter()
            .map(|(var, value)| format!("{var}={}", crate::error::echo(value, str::to_string)))
            .collect();
        format!("{} is not a rank (a number)", values.join(", "))
    };
    let mut consequences = Vec::new();
    if !rules.is_empty() {
        consequences.push(format!(
            "{} of profile {} {} on peer, a launcher's rank: {}",
            rules.join(", "),
            profile.origin,
            match_verbs(rules.len()).0,
            match_verbs(rules.len()).1
        ));
    }
    if loses {
        consequences.push(format!(
            "the loss streams of profile {} are seeded from the rank, so every process without \
             one seeds them alike: the ranks' connections lose the same packets of the same \
             messages, not independently",
            profile.origin
        ));
    }
    Some(format!(
        "this process has no launcher rank ({}: {held}): {}. Launch with torchrun, mpirun or \
         srun, or set RANK",
        LAUNCHER_RANK_VARS.join(", "),
        consequences.join("; ")
    ))
}

/// A warning when NCCL will use another tuner than this library's and may still pick LL or
/// LL128 under a profile that corrupts data. NCCL opens `NCCL_TUNER_PLUGIN` first and falls
/// back to the net plugin's library (ours, whose tuner rules LL/LL128 out) only when that
/// fails (`src/plugin/tuner.cc`), so with another tuner only `NCCL_PROTO` keeps them off.
pub fn unguarded_ll_warning(
    profile: &Profile,
    nccl_proto: Option<&str>,
    tuner_plugin: Option<&str>,
) -> Option<String> {
    let tuner = other_tuner(tuner_plugin)?;
    if !profile.corrupts_data() || !ll_may_run(nccl_proto.unwrap_or("")) {
        return None;
    }
    let tuner = crate::error::echo(tuner, str::to_string);
    Some(format!(
        "NCCL_TUNER_PLUGIN={tuner}: NCCL loads that tuner instead of this library's, which \
         keeps LL and LL128 off under a data-loss effect (profile {}), and NCCL_PROTO={} \
         leaves them allowed: a lost packet of an LL or LL128 message hangs the receiving GPU. \
         Set NCCL_PROTO=Simple",
        profile.origin,
        crate::error::echo(
            nccl_proto
                .filter(|p| !p.trim().is_empty())
                .unwrap_or("(unset)"),
            str::to_string
        )
    ))
}

/// Whether NCCL may still pick LL or LL128 for some collective under an `NCCL_PROTO` value,
/// read as NCCL 2.24+ reads it (`parseList` in src/graph/tuning.cc): every collective starts
/// with every protocol; a first entry without a `func:` prefix sets them all, each `func:`
/// entry its own collective. So an unset value, a first entry that allows LL or LL128, any
/// `func:` entry that does, or a value without a first entry (`allreduce:Simple`: the other
/// collectives keep every protocol) leaves them to NCCL.
fn ll_may_run(nccl_proto: &str) -> bool {
    let allows_ll = |list: &str| {
        let (excluding, names) = protocol_list(list);
        let has = |p: &str| names.iter().any(|n| n == p);
        if excluding {
            !(has("ll") && has("ll128"))
        } else {
            has("ll") || has("ll128")
        }
    };
    let mut others_allow = true;
    let mut some_collective_allows = false;
    for (i, entry) in nccl_proto
        .split(';')
        .filter(|e| !e.trim().is_empty())
        .enumerate()
    {
        match entry.split_once(':') {
            Some((_, list)) => some_collective_allows |= allows_ll(list),
            None if i == 0 => others_allow = allows_ll(entry),
            // NCCL refuses a prefix-less entry after the first; judge it as it would apply.
            None => others_allow |= allows_ll(entry),
        }
    }
    others_allow || some_collective_allows
}

/// One protocol list of an `NCCL_PROTO` entry (the part after any `func:`): whether it
/// excludes (a leading `^`), and the protocols it names, lower-case.
fn protocol_list(list: &str) -> (bool, Vec<String>) {
    let list = list.trim();
    let (excluding, names) = match list.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, list),
    };
    let names = names
        .split(',')
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    (excluding, names)
}

/// The LL-family protocol an `NCCL_PROTO` value explicitly allows, if any. NCCL 2.24+ reads
/// the value as `list` or `list;func:list;...` (`parseList` in src/graph/tuning.cc), each list
/// naming the protocols to allow, or with a leading `^` those to exclude, which forces nothing.
pub fn forced_ll_protocol(nccl_proto: &str) -> Option<&'static str> {
    nccl_proto.split(';').find_map(|entry| {
        let list = entry.split_once(':').map_or(entry, |(_, list)| list);
        let (excluding, names) = protocol_list(list);
        if excluding {
            None
        } else if names.iter().any(|n| n == "ll128") {
            Some("LL128")
        } else if names.iter().any(|n| n == "ll") {
            Some("LL")
        } else {
            None
        }
    })
}

/// The launcher rank variables that are set but hold no rank, for [`unknown_rank_warning`].
pub(super) fn rank_values() -> Vec<(&'static str, String)> {
    LAUNCHER_RANK_VARS
        .iter()
        .filter_map(|&var| {
            let value = crate::env::var(var).ok()??;
            let blank_or_rank = value.trim().is_empty() || value.trim().parse::<u64>().is_ok();
            (!blank_or_rank).then_some((var, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_proto_values_that_force_an_ll_protocol() {
        assert_eq!(forced_ll_protocol("LL"), Some("LL"));
        assert_eq!(forced_ll_protocol("simple,ll128"), Some("LL128"));
        assert_eq!(forced_ll_protocol(" LL , Simple"), Some("LL"));
        assert_eq!(forced_ll_protocol("Simple"), None);
        assert_eq!(forced_ll_protocol("^LL,LL128"), None);
        assert_eq!(forced_ll_protocol("^LL128"), None);
        assert_eq!(forced_ll_protocol(""), None);
        // NCCL 2.24+ also reads `list;func:list;...`, each list plain or `^` (excluding).
        assert_eq!(forced_ll_protocol("Simple;allreduce:LL"), Some("LL"));
        assert_eq!(forced_ll_protocol("^LL128;allreduce:LL128"), Some("LL128"));
        assert_eq!(forced_ll_protocol("Simple;AllGather:simple,ll"), Some("LL"));
        assert_eq!(forced_ll_protocol("Simple;allreduce:^LL,LL128"), None);
        assert_eq!(forced_ll_protocol("^LL;broadcast:Simple"), None);
    }

    #[test]
    fn another_tuner_with_ll_left_allowed_under_a_data_loss_profile_is_warned_about() {
        let p = |text: &str| Profile::parse(text, "p.toml", "").unwrap();
        let zero = p("effect = \"zero\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n");
        let retransmit = p("model = { kind = \"uniform\", rate = 0.01 }\n");
        let other = Some("/opt/tuners/libnccl-tuner-other.so");
        // Our tuner is the one that keeps LL/LL128 off; another one loaded instead leaves
        // NCCL free to pick them unless NCCL_PROTO excludes both.
        // NCCL 2.24+ starts every collective with all protocols and a `func:` entry changes
        // that collective alone: `allreduce:Simple` leaves LL to the others.
        for proto in [
            None,
            Some(""),
            Some("^LL"),
            Some("^LL128"),
            Some("Simple;allreduce:^LL"),
            Some("allreduce:Simple"),
            Some("allreduce:^LL,LL128"),
        ] {
            let warning = unguarded_ll_warning(&zero, proto, other)
                .unwrap_or_else(|| panic!("no warning for NCCL_PROTO={proto:?}"));
            assert!(
                warning.contains("NCCL_TUNER_PLUGIN=/opt/tuners/libnccl-tuner-other.so")
                    && warning.contains("NCCL_PROTO=Simple"),
                "{warning}"
            );
        }
        for proto in [
            Some("Simple"),
            Some("^LL,LL128"),
            Some("^ll128,ll;allreduce:Simple"),
            Some("Simple;allreduce:Simple"),
        ] {
            assert_eq!(unguarded_ll_warning(&zero, proto, other), None, "{proto:?}");
        }
        // Our own tuner, no other tuner, or a profile that does not corrupt data: nothing.
        for ours in [
            None,
            Some(""),
            Some("lossy"),
            Some("/x/libnccl-net-lossy.so"),
        ] {
            assert_eq!(
                unguarded_ll_warning(&zero, Some("^LL"), ours),
                None,
                "{ours:?}"
            );
        }
        assert_eq!(unguarded_ll_warning(&retransmit, None, other), None);
    }

    #[test]
    fn network_point_to_point_ll_under_a_data_loss_effect_is_refused_unless_its_threshold_is_0() {
        // NCCL picks LL for a send/receive of up to NCCL_P2P_LL_THRESHOLD bytes per channel
        // when the connection has LL buffers, whatever NCCL_PROTO or the tuner say
        // (src/enqueue.cc); a network connection has them with NCCL_NET_SHARED_BUFFERS=0 or
        // NCCL_ALLOC_P2P_NET_LL_BUFFERS=1 (src/transport/net.cc), not by default.
        let p = |text: &str| Profile::parse(text, "p.toml", "").unwrap();
        let zero = p("effect = \"zero\"\nmodel = { kind = \"uniform\", rate = 0.01 }\n");
        let retransmit = p("model = { kind = \"uniform\", rate = 0.01 }\n");
        let settings =
            |shared: Option<&str>, alloc: Option<&str>, threshold: Option<&str>| P2pLlSettings {
                shared_buffers: shared.map(str::to_string),
                alloc_ll_buffers: alloc.map(str::to_string),
                ll_threshold: threshold.map(str::to_string),
            };
        for fine in [
            settings(None, None, None),
            settings(Some("1"), Some("0"), None),
            settings(Some("-2"), None, None),
            settings(Some(""), Some(""), None),
            // Only 1 turns the LL buffers on (`== 1`, src/init.cc).
            settings(None, Some("2"), None),
            // Out of range: NCCL keeps the default (ERANGE).
            settings(Some("99999999999999999999"), None, None),
            settings(Some("0"), None, Some("0")),
            settings(None, Some("1"), Some("0x0")),
            settings(Some("0"), None, Some("-1")),
        ] {
            assert_eq!(check_p2p_ll(&zero, &fine), Ok(()), "{fine:?}");
        }
        for (bad, var) in [
            (settings(Some("0"), None, None), "NCCL_NET_SHARED_BUFFERS=0"),
            (
                settings(None, Some("1"), None),
                "NCCL_ALLOC_P2P_NET_LL_BUFFERS=1",
            ),
            (
                settings(Some("0"), None, Some("16384")),
                "NCCL_NET_SHARED_BUFFERS=0",
            ),
            // Read as NCCL reads numbers (strtoll, base 0): no digits is 0, blanks alone too,
            // and the value is kept in an `int`.
            (
                settings(Some("none"), None, None),
                "NCCL_NET_SHARED_BUFFERS=none",
            ),
            (settings(Some(" "), None, None), "NCCL_NET_SHARED_BUFFERS= "),
            (
                settings(Some("4294967296"), None, None),
                "NCCL_NET_SHARED_BUFFERS=4294967296",
            ),
            (
                settings(Some("0x"), None, None),
                "NCCL_NET_SHARED_BUFFERS=0x",
            ),
            // A threshold out of range is NCCL's default (16 KiB: LL), not the most negative.
            (
                settings(Some("0"), None, Some("-99999999999999999999")),
                "NCCL_NET_SHARED_BUFFERS=0",
            ),
        ] {
            let err = check_p2p_ll(&zero, &bad).expect_err(var);
            assert!(
                err.message.contains(var)
                    && err.message.contains("NCCL_P2P_LL_THRESHOLD=0")
                    && err.message.contains("p.toml"),
                "{err}"
            );
        }
        assert_eq!(
            check_p2p_ll(&retransmit, &settings(Some("0"), Some("1"), None)),
            Ok(())
        );
    }

    #[test]
    fn a_lossy_profile_without_a_launcher_rank_warns_that_every_rank_loses_the_same_packets() {
        // Loss streams are seeded from (seed, rank, communicator, peer, connection, rule):
        // without a launcher rank every process seeds as rank 0 with an unknown peer, so
        // the ranks' k-th connections drew the very same drop pattern, without a word.
        let p = |text: &str| Profile::parse(text, "p.toml", "").unwrap();
        let lossy = p("model = { kind = \"uniform\", rate = 0.01 }\n");
        let warning = unknown_rank_warning(&lossy, None, &[])
            .expect("a lossy profile without a rank is warned about");
        assert!(
            warning.contains("same packets") && warning.contains("RANK"),
            "{warning}"
        );
        // A rule that loses while the defaults do not counts too.
        let rule = p(
            "[[rules]]\ncollective = \"AllReduce\"\nmodel = { kind = \"uniform\", rate = 0.1 }\n",
        );
        assert!(unknown_rank_warning(&rule, None, &[]).is_some());
        // With a rank, or with nothing to lose, there is nothing to say.
        assert_eq!(unknown_rank_warning(&lossy, Some(3), &[]), None);
        assert_eq!(unknown_rank_warning(&p(""), None, &[]), None);
        // Peer rules and loss together: one warning says both.
        let both = p("model = { kind = \"uniform\", rate = 0.01 }\n[[rules]]\npeer = 1\n");
        let warning = unknown_rank_warning(&both, None, &[("RANK", "x".into())]).unwrap();
        assert!(
            warning.contains("rules.0") && warning.contains("same packets"),
            "{warning}"
        );
    }

    #[test]
    fn the_plugin_to_wrap_comes_from_the_environment_or_the_profile() {
        let p = |text: &str| Profile::parse(text, "p.toml", "").unwrap();
        let none = p("");
        assert_eq!(wrap_target(&none, None), Ok(None));
        assert_eq!(wrap_target(&none, Some("ib".into())), Ok(Some("ib".into())));
        let wrap = p("transport = \"wrap\"\ninner = \"ib\"\n");
        assert_eq!(wrap_target(&wrap, None), Ok(Some("ib".into())));
        assert_eq!(
            wrap_target(&wrap, Some("/x/ofi.so".into())),
            Ok(Some("/x/ofi.so".into()))
        );
        let bare = p("transport = \"wrap\"\n");
        let err = wrap_target(&bare, None).unwrap_err();
        assert!(err.message.contains("names no plugin to wrap") && err.message.contains("p.toml"));
        let socket = p("transport = \"socket\"\n");
        assert_eq!(wrap_target(&socket, None), Ok(None));
        let err = wrap_target(&socket, Some("ib".into())).unwrap_err();
        assert!(err.message.contains("NCCL_LOSSY_INNER=ib"), "{err}");
    }
}
