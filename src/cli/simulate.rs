//! `lossy simulate`.

use std::process::ExitCode;

/// Arguments of `lossy simulate`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `lossy simulate`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("lossy simulate: not built yet");
    ExitCode::FAILURE
}
