//! What the environment and the profile decide before a runtime is built: which plugin to
//! wrap, whether a forced NCCL protocol is safe, and the profile as statistics files show it.

use crate::profile::{Profile, TransportKind};
use crate::{Error, Result};

/// Environment variable naming the net plugin to wrap; overrides the profile's `inner`.
pub const INNER_ENV: &str = "NCCL_LOSSY_INNER";

/// The plugin to wrap, if any: `NCCL_LOSSY_INNER` (`inner_env`) wins over the profile's
/// `inner`; `transport = "wrap"` without either, or `transport = "socket"` with
/// `NCCL_LOSSY_INNER`, is an error.
pub fn wrap_target(profile: &Profile, inner_env: Option<String>) -> Result<Option<String>> {
    match (profile.transport, inner_env) {
        (Some(TransportKind::Socket), Some(inner)) => Err(Error::invalid_argument(format!(
            "{INNER_ENV}={inner} asks to wrap a net plugin, but the profile ({}) says \
             transport = \"socket\"; unset one of them",
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
/// `lossy report` draws the measured bursts against.
pub(super) fn profile_with_expectation(profile: &Profile) -> serde_json::Value {
    let mut json = profile.to_json();
    let lossy = profile
        .actions()
        .map(|action| &action.model)
        .find(|model| model.expected_loss_rate() > 0.0);
    if let (Some(model), Some(object)) = (lossy, json.as_object_mut()) {
        object.insert(
            "expected".into(),
            serde_json::json!({
                "loss_rate": model.expected_loss_rate(),
                "mean_burst": model.expected_mean_burst(),
            }),
        );
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
        nccl_proto.unwrap_or_default(),
        profile.origin
    )))
}

/// The LL-family protocol an `NCCL_PROTO` value explicitly allows, if any. NCCL 2.24+ reads
/// the value as `list` or `list;func:list;...` (`parseList` in src/graph/tuning.cc), each list
/// naming the protocols to allow, or with a leading `^` those to exclude, which forces nothing.
pub fn forced_ll_protocol(nccl_proto: &str) -> Option<&'static str> {
    nccl_proto.split(';').find_map(|entry| {
        let list = entry.split_once(':').map_or(entry, |(_, list)| list).trim();
        if list.is_empty() || list.starts_with('^') {
            return None;
        }
        let names: Vec<String> = list
            .split(',')
            .map(|name| name.trim().to_ascii_lowercase())
            .collect();
        if names.iter().any(|n| n == "ll128") {
            Some("LL128")
        } else if names.iter().any(|n| n == "ll") {
            Some("LL")
        } else {
            None
        }
    })
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
