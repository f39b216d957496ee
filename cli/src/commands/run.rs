//! `lossy run`: launches a command (torchrun, a training script) with the environment that
//! makes NCCL load this plugin, use it, and fail rather than fall back to a lossless network.

use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use super::shell_quote_bytes;
use nccl_net_lossy::profile::{Profile, PROFILE_ENV, SET_ENV};
use nccl_net_lossy::stats::report::stats_files;
use nccl_net_lossy::stats::writer::STATS_DIR_ENV;
use nccl_net_lossy::transport::socket::SocketConfig;
use nccl_net_lossy::transport::wrap::inner::{check_loadable, InnerCheck};
use nccl_net_lossy::{
    check_forced_protocol, check_p2p_ll, check_stats_dir, trace_setting, unguarded_ll_warning,
    wrap_target, INTRA_NODE_THROUGH_NET, PLUGIN_NAME,
};

use super::validate::InitEnv;

/// Arguments of `lossy run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Loss profile (TOML); without it the embedded default applies.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Override a profile key, e.g. `--set model.rate=0.02` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Directory for the per-rank statistics files.
    #[arg(long)]
    pub stats: Option<PathBuf>,
    /// The plugin library to load (default: the one installed or built with this command).
    #[arg(long)]
    pub library: Option<PathBuf>,
    /// Traffic between GPUs of one node: `net` sends it through the plugin too
    /// (NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1, NCCL_NVLS_ENABLE=0), so a job on one node meets
    /// the loss; `native` leaves it on NVLink, PCIe and shared memory, which the loss never
    /// touches (only the network between nodes drops packets). A value set in the environment
    /// for one of these variables is kept.
    #[arg(long, value_enum, default_value_t = IntraNode::Net)]
    pub intra_node: IntraNode,
    /// Print the environment as `export` lines instead of running anything.
    #[arg(long)]
    pub print_env: bool,
    /// The command to run, after `--`.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Where NCCL moves the traffic between GPUs of one node.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntraNode {
    /// Through the network plugin, and so through the loss.
    Net,
    /// NCCL's own choice: P2P (NVLink, PCIe), shared memory, NVLS; no loss there.
    Native,
}

/// Runs `lossy run`.
pub fn run(args: Args) -> ExitCode {
    match prepare(&args) {
        Ok(env) => launch(&args, &env),
        Err(message) => {
            eprintln!("lossy run: {message}");
            ExitCode::from(2)
        }
    }
}

/// The variables `lossy run` sets, in the order it prints them.
fn prepare(args: &Args) -> Result<Vec<(String, OsString)>, String> {
    if args.command.is_empty() && !args.print_env {
        return Err("no command given: lossy run [OPTIONS] -- CMD ARGS...".into());
    }
    // Both asked: the command was dropped without a word and the exit status was 0.
    if args.print_env && !args.command.is_empty() {
        let words: Vec<String> = args
            .command
            .iter()
            .map(|w| w.to_string_lossy().into_owned())
            .collect();
        return Err(format!(
            "--print-env prints the environment instead of running a command, and {} was \
             given too: drop --print-env to run it, or the command to print the environment",
            nccl_net_lossy::error::echo(&words.join(" "), |w| format!("`{w}`"))
        ));
    }
    // A misspelt variable of ours (NCCL_LOSSY_PROFIL) is ignored by the plugin: said here,
    // as init says it.
    for warning in nccl_net_lossy::env::unknown_var_warnings() {
        eprintln!("lossy run: warning: {warning}");
    }
    // A variable that is not UTF-8 is an error, as in the plugin's init, not unset.
    let utf8 = |name: &str| nccl_net_lossy::env::var(name).map_err(|e| e.to_string());
    // NCCL_LOSSY_SET, then each --set, as `lossy validate` takes them.
    let applied = super::validate::overrides(&args.overrides)?;
    let overrides = applied
        .iter()
        .map(|(_, set)| set.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let profile_path = match &args.profile {
        Some(path) => Some(absolute(path)?),
        None => Profile::path_from_env().map_err(|e| e.to_string())?,
    };
    // Check the profile here, before any rank starts: a plugin that fails inside NCCL is
    // far harder to notice. Each override on its own first, as `lossy validate` does, so an
    // error names where it came from (a bad --set was blamed on NCCL_LOSSY_SET), and two
    // --sets refused alone cannot pass as one (`description="a` and `b"` joined by `;`).
    let layers: Vec<(&str, &str)> = applied
        .iter()
        .map(|(from, set)| (from.as_str(), set.as_str()))
        .collect();
    // Overrides each valid alone join into the NCCL_LOSSY_SET below, which the plugin cuts
    // at the same `;` into the same overrides: this is the profile it will load.
    let profile =
        Profile::load_layers(profile_path.as_deref(), &layers).map_err(|err| err.to_string())?;
    for warning in profile.warnings() {
        eprintln!("lossy run: warning: {warning}");
    }
    // What the plugin's init reads around the profile; the job's statistics go where
    // --stats says, else where the shell's NCCL_LOSSY_STATS does.
    let mut init = InitEnv::from_env()?;
    if let Some(dir) = &args.stats {
        init.stats_dir = Some(dir.clone().into_os_string());
    }
    // Wrap mode: a plugin to wrap that is here but does not load would fail every rank at
    // init, after the launch; one that is not here may be where the job runs.
    if let Some(inner) = wrap_target(&profile, init.inner.clone()).map_err(|err| err.to_string())? {
        match check_loadable(&inner).map_err(|err| format!("wrap mode (inner {inner:?}): {err}"))? {
            InnerCheck::Loads(_) => {}
            InnerCheck::NotHere(why) => eprintln!(
                "lossy run: warning: wrap mode: the plugin to wrap is not on this machine \
                 ({why}); the job's ranks fail at init unless it is where they run"
            ),
        }
    } else {
        // The socket transport's settings (NCCL_LOSSY_NSOCKS, NCCL_LOSSY_TIMEOUT, ...), read
        // as init reads them; which interfaces qualify is the ranks' machines' business.
        SocketConfig::from_env().map_err(|err| err.to_string())?;
    }
    // The trace directory (NCCL_LOSSY_TRACE, or the profile's `trace`) and the ring's size,
    // as the plugin's init checks them: a job whose every rank would fail there never starts.
    trace_setting(&profile, init.trace_dir.clone(), init.trace_events.clone())
        .map_err(|err| err.to_string())?;
    for warning in init.warnings(&profile) {
        eprintln!("lossy run: warning: {warning}");
    }
    let user_proto = init.proto.clone().filter(|p| !p.is_empty());
    check_forced_protocol(&profile, user_proto.as_deref()).map_err(|err| err.to_string())?;
    check_p2p_ll(&profile, &init.p2p_ll).map_err(|err| err.to_string())?;
    // Unset, NCCL_PROTO becomes Simple below; a user's value stays, so say what it leaves.
    if user_proto.is_some() {
        if let Some(warning) =
            unguarded_ll_warning(&profile, user_proto.as_deref(), init.tuner.as_deref())
        {
            eprintln!("lossy run: warning: {warning}");
        }
    }
    let library = match &args.library {
        Some(path) => absolute(path)?,
        None => find_library()?,
    };
    if !library.is_file() {
        return Err(format!(
            "plugin library {} {}",
            shown(&library),
            nccl_net_lossy::files::why_not_a_file(&library)
        ));
    }
    check_plugin_path(&library)?;

    let mut env: Vec<(String, OsString)> = vec![
        ("NCCL_NET_PLUGIN".into(), library.into_os_string()),
        // Without this NCCL quietly uses another network when our plugin fails to load.
        ("NCCL_NET".into(), PLUGIN_NAME.into()),
    ];
    if let Some(path) = profile_path {
        env.push((PROFILE_ENV.into(), path.into_os_string()));
    }
    if !overrides.is_empty() {
        env.push((SET_ENV.into(), overrides.into()));
    }
    if let Some(dir) = &args.stats {
        // As the plugin checks it at init: created, and a file can be written in it.
        // A path too long is said once, cut ("--stats aaa… (N bytes in all): ..."), not
        // under the option and again in the check's own words.
        nccl_net_lossy::files::check_path_length(dir).map_err(|e| format!("--stats {e}"))?;
        nccl_net_lossy::stats::writer::check_output_dir(dir, "stats")
            .map_err(|e| format!("--stats {}: {}", shown(dir), e.message))?;
        env.push((STATS_DIR_ENV.into(), absolute(dir)?.into_os_string()));
    } else {
        // The job inherits the shell's NCCL_LOSSY_STATS: one the plugin's init refuses failed
        // every rank after the launch.
        check_stats_dir().map_err(|e| e.to_string())?;
    }
    let stats_dir = init
        .stats_dir
        .as_ref()
        .filter(|d| !d.to_string_lossy().trim().is_empty());
    if let Some(dir) = stats_dir.map(PathBuf::from) {
        // Said before the run, while the earlier files can still be moved: after it, the
        // report only finds both runs' files summed.
        let earlier = stats_files(&dir).map(|files| files.len()).unwrap_or(0);
        if earlier > 0 {
            eprintln!(
                "lossy run: note: {} already holds {earlier} statistics file{} (an earlier \
                 run's?): this run's files go beside them and `lossy report` sums every file \
                 in the directory; give each run its own",
                dir.display(),
                if earlier == 1 { "" } else { "s" }
            );
        }
    }
    if args.intra_node == IntraNode::Net {
        for (key, value, kept_on) in INTRA_NODE_THROUGH_NET {
            // The user's own choice stands (as NCCL_PROTO's below); one that leaves NCCL's
            // own transport on is said, since that traffic never meets the loss.
            match utf8(key)?.filter(|v| !v.is_empty()) {
                None => env.push((key.into(), value.into())),
                Some(kept) if kept.trim() != value => eprintln!(
                    "lossy run: note: {key}={kept} is kept (--intra-node net sets {value}): \
                     NCCL may move the traffic between GPUs of one node over {}, which the \
                     loss never touches; unset it to send that traffic through the plugin",
                    kept_on
                ),
                Some(_) => {}
            }
        }
    }
    // The tuner in our library already rules LL/LL128 out, but only when NCCL loads it
    // (a user's NCCL_TUNER_PLUGIN wins): pin Simple as well unless the user chose.
    if profile.corrupts_data() && user_proto.is_none() {
        env.push(("NCCL_PROTO".into(), "Simple".into()));
    }
    say_replaced(&env);
    Ok(env)
}

/// Names on stderr each of the user's settings that `env` replaces (`NCCL_NET=IB`, another
/// plugin, profile or statistics directory): the job runs with ours, and the shell's value
/// must not be taken for the condition that ran. `NCCL_LOSSY_SET` is extended, not replaced.
fn say_replaced(env: &[(String, OsString)]) {
    for (key, value) in env {
        if key == SET_ENV {
            continue;
        }
        // A relative path naming the place `env` names (made absolute) is no change.
        let same = |old: &OsString| {
            old == value || std::path::absolute(old).is_ok_and(|p| p.as_os_str() == value)
        };
        if let Some(old) = std::env::var_os(key).filter(|old| !same(old)) {
            eprintln!(
                "lossy run: note: {key}={} replaced by {}",
                old.to_string_lossy(),
                value.to_string_lossy()
            );
        }
    }
}

fn launch(args: &Args, env: &[(String, OsString)]) -> ExitCode {
    if args.print_env {
        // The value's own bytes, quoted: a path that is not UTF-8 printed lossily named
        // another place (`st\xffx` as `st\u{fffd}x`) once the shell read it back.
        let mut text = Vec::new();
        for (key, value) in env {
            text.extend_from_slice(format!("export {key}=").as_bytes());
            text.extend_from_slice(&shell_quote_bytes(value.as_bytes()));
            text.push(b'\n');
        }
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        return match out.write_all(&text).and_then(|()| out.flush()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("lossy run: cannot write the environment: {err}");
                ExitCode::FAILURE
            }
        };
    }
    let (program, rest) = match args.command.split_first() {
        Some(split) => split,
        None => return ExitCode::from(2),
    };
    if program.is_empty() {
        eprintln!(
            "lossy run: the command is empty (an empty word after `--`): name the program to run"
        );
        return ExitCode::from(127);
    }
    let mut command = Command::new(program);
    command.args(rest);
    for (key, value) in env {
        command.env(key, value);
    }
    // exec: the command takes this process's place, so signals and the exit status are its own.
    let err = command.exec();
    eprintln!(
        "lossy run: cannot run the command {}: {}",
        shown(Path::new(program)),
        why_not_run(program, &err)
    );
    // As a shell answers: 127 for a program not found, 126 for one found but not executable.
    ExitCode::from(if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}

/// Why `program` did not run, in more words than `err` (exec's errno) where those mislead:
/// a directory or a FIFO is EACCES ("Permission denied"), and a script whose `#!` interpreter is
/// missing is ENOENT ("No such file or directory") although the script is there.
fn why_not_run(program: &OsString, err: &std::io::Error) -> String {
    let Some(path) = resolve(program) else {
        return format!("no such program in any directory of PATH ({err})");
    };
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => return format!("it is a directory ({err})"),
        Ok(meta) if !meta.is_file() => {
            let kind = nccl_net_lossy::files::file_kind(&meta.file_type());
            return format!("it is not a regular file ({kind}) ({err})");
        }
        _ => {}
    }
    if err.kind() == std::io::ErrorKind::NotFound {
        if let Some(interpreter) = shebang_interpreter(&path) {
            return format!("its interpreter {interpreter} (its `#!` line) was not found ({err})");
        }
    }
    err.to_string()
}

/// The file exec ran for `program`: itself when it holds a `/`, else the first entry of
/// `PATH` that holds it, as `execvp` looks it up.
fn resolve(program: &OsString) -> Option<PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return Some(PathBuf::from(program));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.exists())
}

/// The interpreter a script's `#!` line names (its first word), if it has one.
fn shebang_interpreter(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = line.split(|&b| b == b'\n').next()?;
    let text = String::from_utf8_lossy(line);
    text.split_whitespace().next().map(str::to_string)
}

/// Longest name NCCL takes from `NCCL_NET_PLUGIN`: it skips a longer one (`MAX_STR_LEN` 255,
/// the name and its terminating NUL, in src/plugin/net.cc).
const MAX_PLUGIN_NAME: usize = 254;

/// Why NCCL cannot load `library` from `NCCL_NET_PLUGIN`, if it cannot: NCCL cuts the value at
/// commas (a list of plugins) and skips a name over [`MAX_PLUGIN_NAME`] bytes
/// (src/plugin/net.cc).
pub(crate) fn plugin_path_problem(library: &Path) -> Option<String> {
    let bytes = library.as_os_str().as_bytes();
    if bytes.contains(&b',') {
        Some("holds a comma, where NCCL cuts NCCL_NET_PLUGIN into a list of plugins".to_string())
    } else if bytes.len() > MAX_PLUGIN_NAME {
        Some(format!(
            "is {} bytes long, and NCCL skips an NCCL_NET_PLUGIN name over {MAX_PLUGIN_NAME}",
            bytes.len()
        ))
    } else {
        None
    }
}

/// Refuses a library path NCCL cannot load from `NCCL_NET_PLUGIN` ([`plugin_path_problem`]):
/// every rank then failed at init after the launch.
fn check_plugin_path(library: &Path) -> Result<(), String> {
    match plugin_path_problem(library) {
        None => Ok(()),
        Some(why) => Err(format!(
            "plugin library {} {why}: NCCL could not load it; install it elsewhere (`lossy \
             install --prefix DIR`) or give --library a link to it from a shorter path without \
             commas",
            library.display()
        )),
    }
}

fn absolute(path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{}: {e}", shown(path)))
}

/// A path as an error names it, cut past [`nccl_net_lossy::error::ECHO_CHARS`] characters.
fn shown(path: &Path) -> String {
    nccl_net_lossy::error::echo(&path.display().to_string(), str::to_string)
}

/// The plugin library that belongs to this `lossy` binary: `../lib/libnccl-net-lossy.so`
/// after `lossy install`, or the library Cargo built next to it.
fn find_library() -> Result<PathBuf, String> {
    crate::harness::plugin_client::default_library_path().map_err(|err| err.to_string())
}

#[cfg(test)]
mod tests {
    use super::super::{shell_quote, shell_quote_bytes};

    #[test]
    fn shell_quote_leaves_plain_values_and_quotes_the_rest() {
        assert_eq!(shell_quote("/a/b.so"), "/a/b.so");
        assert_eq!(
            shell_quote("model.rate=0.01;seed=7"),
            "'model.rate=0.01;seed=7'"
        );
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote_bytes(b"/a/st\xffx"), b"'/a/st\xffx'");
    }
}
