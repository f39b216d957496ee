//! `lossy`: the command-line front end of nccl-net-lossy.

use clap::Parser;
use lossy_cli::commands::{run, Cli};
use std::process::ExitCode;

fn main() -> ExitCode {
    run(Cli::parse())
}
