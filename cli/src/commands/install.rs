//! `lossy install`: puts the plugin library under the file name NCCL opens for
//! `NCCL_NET_PLUGIN=lossy` (`libnccl-net-lossy.so`; Cargo names it `libnccl_net_lossy.so`)
//! and this command next to it.

use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::shell_quote_bytes;
use crate::harness::plugin_client::{default_library_path, PluginLibrary, NCCL_LIBRARY_NAME};
use nccl_net_lossy::stats::writer::check_output_dir;
use nccl_net_lossy::{Error, Result};

/// Arguments of `lossy install`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Installation prefix: the library goes to PREFIX/lib, the command to PREFIX/bin
    /// (default: $HOME/.local).
    #[arg(long)]
    pub prefix: Option<PathBuf>,
    /// The library to install (default: the one built next to this command).
    #[arg(long)]
    pub library: Option<PathBuf>,
}

/// Runs `lossy install`.
pub fn run(args: Args) -> ExitCode {
    match install(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lossy install: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Copies `from` to `to` through a temporary name, so a running process that has the old
/// file open (or mapped) keeps it intact.
fn copy_atomically(from: &Path, to: &Path) -> Result<()> {
    let dir = to
        .parent()
        .ok_or_else(|| Error::invalid_argument(format!("{} has no directory", to.display())))?;
    fs::create_dir_all(dir)
        .map_err(|e| Error::system(format!("cannot create {}: {e}", dir.display())))?;
    let name = to
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    fs::copy(from, &tmp)
        .and_then(|_| fs::rename(&tmp, to))
        .map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::system(format!(
                "cannot copy {} to {}: {e}",
                from.display(),
                to.display()
            ))
        })
}

fn install(args: &Args) -> Result<()> {
    let prefix = match &args.prefix {
        // Absolute, so that the commands printed below work from any directory.
        Some(p) => {
            // Named under the option, the path cut: the directories below it said only
            // "PATH: a path has at most 4095 bytes".
            nccl_net_lossy::files::check_path_length(p)
                .map_err(|e| Error::invalid_argument(format!("--prefix {e}")))?;
            std::path::absolute(p)
                .map_err(|e| Error::invalid_argument(format!("--prefix {}: {e}", shown(p))))?
        }
        None => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".local"))
            .ok_or_else(|| Error::invalid_argument("no --prefix and no HOME"))?,
    };
    let library = match &args.library {
        Some(p) => p.clone(),
        None => default_library_path()?,
    };
    // dlopen of a FIFO would block until a writer comes: only a regular file is opened.
    if !library.is_file() {
        return Err(Error::invalid_argument(format!(
            "--library {} {}; allowed: a built plugin library (libnccl_net_lossy.so)",
            shown(&library),
            nccl_net_lossy::files::why_not_a_file(&library)
        )));
    }
    // Absolute: dlopen looks a name without a slash up on the loader's search path, and would
    // check another file than the one copied below (or none).
    let library = std::path::absolute(&library)
        .map_err(|e| Error::invalid_argument(format!("--library {}: {e}", shown(&library))))?;
    // Refuse to install something NCCL could not use.
    let versions = PluginLibrary::open(&library)?.net_versions();
    if versions.is_empty() {
        return Err(Error::invalid_argument(format!(
            "{} exports no ncclNetPlugin_v* table",
            library.display()
        )));
    }
    let lib_dest = prefix.join("lib").join(NCCL_LIBRARY_NAME);
    let exe = std::env::current_exe()
        .map_err(|e| Error::system(format!("cannot find this command: {e}")))?;
    let bin_dest = prefix.join("bin").join("lossy");
    // Both directories first: one that cannot take its file (a file in its place, no
    // permission) stops the install before anything is copied, not after the library, which
    // left a new library beside an older `lossy`.
    for (dir, what) in [
        (prefix.join("lib"), "library"),
        (prefix.join("bin"), "command"),
    ] {
        check_output_dir(&dir, what)?;
    }
    copy_atomically(&library, &lib_dest)?;
    if fs::canonicalize(&exe).ok() != fs::canonicalize(&bin_dest).ok() {
        copy_atomically(&exe, &bin_dest)?;
    }
    let lib_dir = prefix.join("lib");
    println!(
        "installed {} (net plugin v{})",
        lib_dest.display(),
        join(&versions)
    );
    println!("installed {}", bin_dest.display());
    // Quoted for a shell byte for byte: the lines are meant to be pasted, whatever the prefix
    // holds (a prefix that is not UTF-8 was printed with U+FFFD, naming another directory).
    // A way that cannot work with this prefix is left out, saying why: the loader cuts
    // LD_LIBRARY_PATH at ':', and NCCL cuts NCCL_NET_PLUGIN at ',' and skips a long name.
    let not_here =
        |why: &str| format!("  (not with this prefix: {}: {why})\n", prefix.display()).into_bytes();
    let mut text = b"\nUse it with NCCL, either by name (library on the loader path):\n".to_vec();
    if lib_dir.as_os_str().as_bytes().contains(&b':') {
        text.extend_from_slice(&not_here(
            "it holds a ':', where the loader cuts LD_LIBRARY_PATH into a list of directories",
        ));
    } else {
        text.extend_from_slice(b"  export LD_LIBRARY_PATH=");
        text.extend_from_slice(&shell_quote_bytes(lib_dir.as_os_str().as_bytes()));
        text.extend_from_slice(
            b"\"${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\" NCCL_NET_PLUGIN=lossy NCCL_NET=lossy\n",
        );
    }
    text.extend_from_slice(b"or by full path:\n");
    match super::run::plugin_path_problem(&lib_dest) {
        None => {
            text.extend_from_slice(b"  export NCCL_NET_PLUGIN=");
            text.extend_from_slice(&shell_quote_bytes(lib_dest.as_os_str().as_bytes()));
            text.extend_from_slice(b" NCCL_NET=lossy\n");
        }
        Some(why) => text.extend_from_slice(&not_here(&format!("the library's path {why}"))),
    }
    let mut out = std::io::stdout().lock();
    out.write_all(&text)
        .and_then(|()| out.flush())
        .map_err(|e| Error::system(format!("cannot print the commands to use it: {e}")))
}

/// A path as an error names it, cut past [`nccl_net_lossy::error::ECHO_CHARS`] characters.
fn shown(path: &Path) -> String {
    nccl_net_lossy::error::echo(&path.display().to_string(), str::to_string)
}

fn join(versions: &[u32]) -> String {
    versions
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", v")
}
