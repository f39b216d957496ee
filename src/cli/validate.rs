//! `lossy validate`: check profiles and print a one-line summary of each.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::profile::Profile;

/// Arguments of `lossy validate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Profile files (TOML) to check.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Override a dotted key, as NCCL_LOSSY_SET does (repeatable): --set model.rate=0.02
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// Runs `lossy validate`: exit 0 when every file is valid, 2 (with the errors) otherwise.
pub fn run(args: Args) -> ExitCode {
    let overrides = args.set.join(";");
    let mut failed = false;
    for file in &args.files {
        match Profile::load(Some(file), &overrides) {
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
