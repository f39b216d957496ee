//! `lossy worker`: one rank of the CPU harness, started by `demo`, `bench` and the tests.

use std::net::SocketAddr;
use std::process::ExitCode;

use crate::harness::bootstrap::Bootstrap;
use crate::harness::worker::{run_job, Job};

/// Arguments of `lossy worker`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// This process's rank.
    #[arg(long)]
    pub rank: usize,
    /// Number of ranks.
    #[arg(long)]
    pub nranks: usize,
    /// Address of the bootstrap server.
    #[arg(long)]
    pub bootstrap: SocketAddr,
    /// The job, as JSON.
    #[arg(long)]
    pub job: String,
}

/// Runs `lossy worker`: prints the report as one JSON line on stdout.
pub fn run(args: Args) -> ExitCode {
    let outcome = serde_json::from_str::<Job>(&args.job)
        .map_err(|e| nccl_net_lossy::Error::invalid_argument(format!("bad job: {e}")))
        .and_then(|job| {
            let mut boot =
                Bootstrap::connect(args.bootstrap, args.rank, args.nranks, job.timeout())?;
            run_job(&job, &mut boot)
        })
        .and_then(|report| {
            serde_json::to_string(&report).map_err(|e| {
                nccl_net_lossy::Error::internal(format!("cannot encode the report: {e}"))
            })
        });
    match outcome {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("lossy worker rank {}: {err}", args.rank);
            ExitCode::FAILURE
        }
    }
}
