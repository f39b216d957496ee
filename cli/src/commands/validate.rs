//! `lossy validate`: check profiles and print a one-line summary of each.

use std::path::PathBuf;
use std::process::ExitCode;

use nccl_net_lossy::profile::Profile;

/// Arguments of `lossy validate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Profile files (TOML) to check; none: the embedded default profile.
    pub files: Vec<PathBuf>,
    /// Override a dotted key, as NCCL_LOSSY_SET does (repeatable): --set model.rate=0.02
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// Runs `lossy validate`: exit 0 when every file is valid, 2 (with the errors) otherwise.
pub fn run(args: Args) -> ExitCode {
    let overrides = args.set.join(";");
    let mut failed = false;
    // No file names the embedded default, so that `lossy validate --set ...` previews what a
    // run without NCCL_LOSSY_PROFILE would do.
    let files: Vec<Option<&PathBuf>> = if args.files.is_empty() {
        vec![None]
    } else {
        args.files.iter().map(Some).collect()
    };
    for file in files {
        match Profile::load(file.map(PathBuf::as_path), &overrides) {
            Ok(profile) => println!("{}", profile.summary()),
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
