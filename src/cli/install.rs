//! `lossy install`.

use std::process::ExitCode;

/// Arguments of `lossy install`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `lossy install`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("lossy install: not built yet");
    ExitCode::FAILURE
}
