//! `lossy worker`.

use std::process::ExitCode;

/// Arguments of `lossy worker`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `lossy worker`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("lossy worker: not built yet");
    ExitCode::FAILURE
}
