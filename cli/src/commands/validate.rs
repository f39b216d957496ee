//! `lossy validate`: check profiles and print a one-line summary of each.
//!
//! It checks what the plugin will load: the profile (the files given, or else the one
//! `NCCL_LOSSY_PROFILE` names, or else the embedded default) with `NCCL_LOSSY_SET` applied,
//! then each `--set` on top (later overrides win, as they do within `NCCL_LOSSY_SET`). The
//! overrides it applied are printed below each summary with where they came from. What the
//! plugin's init refuses of the environment around the profile (wrap mode against
//! `NCCL_LOSSY_INNER`, a data-loss effect under a forced LL protocol, a bad
//! `NCCL_LOSSY_TRACE_EVENTS`, a malformed socket setting (`NCCL_LOSSY_NSOCKS`, ...), a file
//! where an output directory goes) it refuses too, and what init warns of it warns of.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use nccl_net_lossy::error::{echo, echo_at_most, SHOWN_CHARS};
use nccl_net_lossy::profile::{Profile, SET_ENV};
use nccl_net_lossy::stats::timeline::{TRACE_DIR_ENV, TRACE_EVENTS_ENV};
use nccl_net_lossy::stats::writer::STATS_DIR_ENV;
use nccl_net_lossy::transport::socket::SocketConfig;
use nccl_net_lossy::transport::wrap::inner::check_loadable;
use nccl_net_lossy::{
    check_forced_protocol, check_output_dirs_in_place, check_p2p_ll, trace_capacity,
    unknown_comm_size_warning, unused_stats_interval_warning, wrap_target, P2pLlSettings,
    INNER_ENV,
};

/// Arguments of `lossy validate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Profile files (TOML) to check; none: the profile NCCL_LOSSY_PROFILE names, or the
    /// embedded default when it is not set (what the plugin would load).
    pub files: Vec<PathBuf>,
    /// Override a dotted key on top of NCCL_LOSSY_SET (repeatable): --set model.rate=0.02
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// The overrides a profile gets where the plugin would load it (`lossy validate`, `lossy
/// simulate`), in order, each with where it came from: the environment's `NCCL_LOSSY_SET`,
/// then each `--set`.
pub(crate) fn overrides(set: &[String]) -> Result<Vec<(String, String)>, String> {
    let mut all = Vec::new();
    match nccl_net_lossy::env::var(SET_ENV).map_err(|e| e.to_string())? {
        Some(env) if !env.trim().is_empty() => all.push((SET_ENV.to_string(), env)),
        _ => {}
    }
    all.extend(set.iter().map(|s| ("--set".to_string(), s.clone())));
    Ok(all)
}

/// What the plugin's `init` reads from the environment besides the profile and its
/// overrides, and refuses when it does not fit the profile.
#[derive(Clone, Debug, Default)]
pub(crate) struct InitEnv {
    /// `NCCL_LOSSY_INNER` (blank is unset, as at init).
    pub(crate) inner: Option<String>,
    /// `NCCL_PROTO`.
    pub(crate) proto: Option<String>,
    /// `NCCL_LOSSY_TRACE_EVENTS`.
    pub(crate) trace_events: Option<String>,
    /// `NCCL_LOSSY_TRACE`.
    pub(crate) trace_dir: Option<String>,
    /// `NCCL_LOSSY_STATS`.
    pub(crate) stats_dir: Option<std::ffi::OsString>,
    /// `NCCL_TUNER_PLUGIN`.
    pub(crate) tuner: Option<String>,
    /// The settings that let NCCL send point-to-point transfers with LL.
    pub(crate) p2p_ll: P2pLlSettings,
}

impl InitEnv {
    /// The variables as the plugin reads them (one that is not UTF-8 is an error).
    pub(crate) fn from_env() -> Result<InitEnv, String> {
        let var = |name: &str| nccl_net_lossy::env::var(name).map_err(|e| e.to_string());
        Ok(InitEnv {
            inner: var(INNER_ENV)?.filter(|v| !v.trim().is_empty()),
            proto: var("NCCL_PROTO")?,
            trace_events: var(TRACE_EVENTS_ENV)?,
            trace_dir: var(TRACE_DIR_ENV)?,
            stats_dir: std::env::var_os(STATS_DIR_ENV),
            tuner: var("NCCL_TUNER_PLUGIN")?,
            p2p_ll: P2pLlSettings::from_env(),
        })
    }
}

impl InitEnv {
    /// What the plugin's `init` warns of under this environment besides the profile's own
    /// warnings: a `comm_size` rule no tuner serves, a `stats_interval` with nowhere to write.
    pub(crate) fn warnings(&self, profile: &Profile) -> Vec<String> {
        let tuner = unknown_comm_size_warning(profile, self.tuner.as_deref());
        let interval =
            unused_stats_interval_warning(profile, self.stats_dir.clone(), self.trace_dir.clone());
        tuner.into_iter().chain(interval).collect()
    }
}

/// The profile at `file` (`None`: the embedded default) with `layers` of overrides, refused
/// for what the plugin's `init` refuses of it under `env` besides the profile itself: wrap
/// mode without a plugin to wrap, `NCCL_LOSSY_INNER` under `transport = "socket"`, a plugin
/// to wrap that is here but does not load as a net plugin (as `lossy run`), a malformed
/// socket setting of the environment (`NCCL_LOSSY_NSOCKS`, ...) outside wrap mode, a trace ring
/// size out of range, a file where a statistics or trace directory goes or a place where it
/// cannot be written, or a data-loss effect under an `NCCL_PROTO` that forces LL or LL128 (no
/// directory is created to check; a probe file is created and removed).
/// `lossy validate` and `lossy simulate` both load through here, so they give init's verdict.
pub(crate) fn load_checked(
    file: Option<&Path>,
    layers: &[(&str, &str)],
    env: &InitEnv,
) -> nccl_net_lossy::Result<Profile> {
    let profile = Profile::load_layers(file, layers)?;
    match wrap_target(&profile, env.inner.clone())? {
        // A plugin to wrap that is here but is no net plugin (a device, a library without a
        // net table) fails init, and `lossy run` refuses it in the same words; one that is
        // not here may be where the job runs.
        Some(inner) => {
            check_loadable(&inner).map_err(|err| {
                nccl_net_lossy::Error::new(
                    err.kind,
                    format!(
                        "wrap mode (inner {}): {}",
                        echo(&inner, |i| format!("{i:?}")),
                        err.message
                    ),
                )
            })?;
        }
        // The socket transport's settings (NCCL_LOSSY_NSOCKS, NCCL_LOSSY_TIMEOUT, ...), which
        // init reads unless it wraps another plugin, and refuses when one is malformed.
        None => {
            SocketConfig::from_env()?;
        }
    }
    trace_capacity(&profile, env.trace_events.clone())?;
    check_output_dirs_in_place(&profile, env.stats_dir.clone(), env.trace_dir.clone())?;
    check_forced_protocol(&profile, env.proto.as_deref())?;
    check_p2p_ll(&profile, &env.p2p_ll)?;
    Ok(profile)
}

/// Runs `lossy validate`: exit 0 when every file is valid, 2 (with the errors) otherwise.
pub fn run(args: Args) -> ExitCode {
    let applied = match overrides(&args.set) {
        Ok(applied) => applied,
        Err(err) => {
            eprintln!("lossy validate: {err}");
            return ExitCode::from(2);
        }
    };
    // Each override is a layer of its own, so an error names where it came from.
    let layers: Vec<(&str, &str)> = applied
        .iter()
        .map(|(from, set)| (from.as_str(), set.as_str()))
        .collect();
    // A misspelt variable of ours (NCCL_LOSSY_PROFIL) is ignored by the plugin: said here,
    // as init says it.
    for warning in nccl_net_lossy::env::unknown_var_warnings() {
        eprintln!("lossy validate: warning: {warning}");
    }
    let mut failed = false;
    // No file: what a run would load, the profile NCCL_LOSSY_PROFILE names or the embedded
    // default, so `lossy validate --set ...` previews the run.
    let env_profile = if args.files.is_empty() {
        match Profile::path_from_env() {
            Ok(path) => path,
            Err(err) => {
                eprintln!("lossy validate: {err}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let files: Vec<Option<&PathBuf>> = if args.files.is_empty() {
        vec![env_profile.as_ref()]
    } else {
        args.files.iter().map(Some).collect()
    };
    // Wrap mode takes the plugin to wrap from the profile or NCCL_LOSSY_INNER, as at init.
    let init_env = match InitEnv::from_env() {
        Ok(env) => env,
        Err(err) => {
            eprintln!("lossy validate: {err}");
            return ExitCode::from(2);
        }
    };
    for file in files {
        match load_checked(file.map(PathBuf::as_path), &layers, &init_env) {
            Ok(profile) => {
                // A reader that closed the pipe (`lossy validate P | head -1`) ends the
                // output quietly; the exit status still says whether every file is valid.
                let mut out = format!("{}\n", profile.summary());
                for (from, set) in &applied {
                    let set = echo_at_most(set.trim(), SHOWN_CHARS, str::to_string);
                    out += &format!("  override from {from}: {set}\n");
                }
                // NCCL_LOSSY_INNER puts the run in wrap mode over its plugin whatever the
                // profile says of it (a `transport = "socket"` was refused above).
                if let Some(inner) = &init_env.inner {
                    let inner = echo_at_most(inner, SHOWN_CHARS, str::to_string);
                    out += &format!("  wrap mode: inner {inner} (from {INNER_ENV})\n");
                }
                if let Err(err) = super::write_stdout(&out) {
                    eprintln!("lossy validate: cannot write the summary: {err}");
                    failed = true;
                }
                // What init warns of: the profile's own, and of it under this environment.
                for warning in profile
                    .warnings()
                    .into_iter()
                    .chain(init_env.warnings(&profile))
                {
                    eprintln!("lossy validate: warning: {warning}");
                }
            }
            Err(err) => {
                eprintln!("lossy validate: {err}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}
