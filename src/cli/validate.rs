//! `lossy validate`.

use std::process::ExitCode;

/// Arguments of `lossy validate`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `lossy validate`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("lossy validate: not built yet");
    ExitCode::FAILURE
}
