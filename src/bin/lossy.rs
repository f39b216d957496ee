//! `lossy`: the command-line front end of nccl-net-lossy.

use clap::Parser;
use nccl_net_lossy::cli::{run, Cli};
use std::process::ExitCode;

fn main() -> ExitCode {
    run(Cli::parse())
}
