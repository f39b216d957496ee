//! The `lossy` command line: one module per subcommand.

pub mod bench;
pub mod bench_runs;
pub mod demo;
pub mod install;
pub mod report;
pub mod report_steps;
pub mod run;
pub mod simulate;
pub mod sizes;
pub mod validate;
pub mod worker;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// `value` as one word of a POSIX shell command line: as it is when it holds nothing a shell
/// reads specially, else in single quotes (a `'` inside written `'\''`).
pub(crate) fn shell_quote(value: &str) -> String {
    if value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-=:,+@".contains(c))
    {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', "'\\''"))
    }
}

/// `value`'s bytes as one word of a POSIX shell command line, as [`shell_quote`] writes a
/// string: bytes that are not UTF-8 are kept as they are (inside the quotes), so the shell
/// reads back the very path given.
pub(crate) fn shell_quote_bytes(value: &[u8]) -> Vec<u8> {
    match std::str::from_utf8(value) {
        Ok(text) => shell_quote(text).into_bytes(),
        Err(_) => {
            let mut out = vec![b'\''];
            for &b in value {
                if b == b'\'' {
                    out.extend_from_slice(b"'\\''");
                } else {
                    out.push(b);
                }
            }
            out.push(b'\'');
            out
        }
    }
}

/// Writes `text` to stdout; a reader that closed the pipe early (`lossy report RUN | head`,
/// `lossy demo | head`) is not an error: what it did not read is simply not written.
pub(crate) fn write_stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Command-line interface of `lossy`.
#[derive(Parser, Debug)]
#[command(
    name = "lossy",
    version,
    about = "Simulated packet loss for NCCL: validate profiles, preview models, demo and benchmark the plugin"
)]
pub struct Cli {
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands of `lossy`.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Check a profile and print a one-line summary (exit 2 on error).
    Validate(validate::Args),
    /// Run a profile's loss models offline and compare them with their closed forms.
    Simulate(simulate::Args),
    /// Run collectives across local ranks through the plugin and print a short table.
    Demo(demo::Args),
    /// nccl-tests-style bandwidth table for the plugin next to raw loopback TCP.
    Bench(bench::Args),
    /// Sum the statistics of one or more runs into a table (and a plot).
    Report(report::Args),
    /// Run a command (e.g. torchrun) with NCCL set up to use this plugin and a profile.
    Run(run::Args),
    /// Install the plugin library under the file name NCCL looks for, and this command.
    Install(install::Args),
    /// One rank of the CPU harness (started by `demo`, `bench` and the tests).
    #[command(hide = true)]
    Worker(worker::Args),
}

/// Runs the parsed command line and returns the process exit code.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Validate(args) => validate::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Install(args) => install::run(args),
        Command::Report(args) => report::run(args),
        Command::Run(args) => run::run(args),
        Command::Worker(args) => worker::run(args),
    }
}
