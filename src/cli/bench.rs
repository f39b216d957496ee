//! `lossy bench`.

use std::process::ExitCode;

/// Arguments of `lossy bench`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `lossy bench`.
pub fn run(_args: Args) -> ExitCode {
    eprintln!("lossy bench: not built yet");
    ExitCode::FAILURE
}
