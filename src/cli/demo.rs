//! `lossy demo`.

use std::process::ExitCode;

/// Arguments of `lossy demo`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `lossy demo`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("lossy demo: not built yet");
    ExitCode::FAILURE
}
