//! Starts N local ranks as `lossy worker` processes, hosts their bootstrap, and collects the
//! JSON report each prints. A rank that fails or a run that overstays its time ends every
//! process; the error carries the failing ranks' stderr.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::bootstrap::BootstrapServer;
use super::worker::{Job, WorkerReport};
use nccl_net_lossy::{Error, Result};

/// How to start a run.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The `lossy` executable to run as `lossy worker`.
    pub exe: PathBuf,
    /// Number of ranks (processes).
    pub nranks: usize,
    /// What every rank does.
    pub job: Job,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Kill everything after this long.
    pub timeout: Duration,
}

impl Launch {
    /// A launch of `nranks` copies of the running executable.
    pub fn new(nranks: usize, job: Job) -> Result<Launch> {
        let exe = std::env::current_exe()
            .map_err(|e| Error::system(format!("cannot find the running executable: {e}")))?;
        Ok(Launch {
            exe,
            nranks,
            job,
            env: Vec::new(),
            timeout: Duration::from_secs(300),
        })
    }
}

/// Reads a pipe to its end on a thread, so a chatty child never blocks on a full pipe.
fn drain(pipe: Option<impl Read + Send + 'static>) -> Option<JoinHandle<String>> {
    let mut pipe = pipe?;
    std::thread::Builder::new()
        .name("lossy-drain".into())
        .spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
        .ok()
}

struct Rank {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
    status: Option<std::process::ExitStatus>,
}

fn collect(handle: Option<JoinHandle<String>>) -> String {
    handle.and_then(|h| h.join().ok()).unwrap_or_default()
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs `launch` and returns every rank's report, in rank order.
pub fn run(launch: &Launch) -> Result<Vec<WorkerReport>> {
    let n = launch.nranks;
    if n < 2 {
        return Err(Error::invalid_argument("a run needs at least 2 ranks"));
    }
    let server = BootstrapServer::start(n, launch.timeout)?;
    let job = serde_json::to_string(&launch.job)
        .map_err(|e| Error::internal(format!("cannot encode the job: {e}")))?;
    let mut ranks: Vec<Rank> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(&launch.exe);
        cmd.arg("worker")
            .arg("--rank")
            .arg(rank.to_string())
            .arg("--nranks")
            .arg(n.to_string())
            .arg("--bootstrap")
            .arg(server.addr().to_string())
            .arg("--job")
            .arg(&job)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &launch.env {
            cmd.env(k, v);
        }
        match cmd.spawn() {
            Ok(mut child) => ranks.push(Rank {
                stdout: drain(child.stdout.take()),
                stderr: drain(child.stderr.take()),
                child,
                status: None,
            }),
            Err(e) => {
                kill_all(&mut ranks);
                return Err(Error::system(format!(
                    "cannot start {} worker: {e}",
                    launch.exe.display()
                )));
            }
        }
    }
    let deadline = Instant::now() + launch.timeout;
    let mut failed_early = false;
    loop {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            r.status = r.child.try_wait()?;
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        // One rank failing dooms the run: stop the others rather than wait for their timeouts.
        if ranks.iter().any(|r| r.status.is_some_and(|s| !s.success())) {
            failed_early = true;
            std::thread::sleep(Duration::from_millis(200));
            kill_all(&mut ranks);
            break;
        }
        if Instant::now() > deadline {
            kill_all(&mut ranks);
            let stderr: Vec<String> = ranks
                .iter_mut()
                .enumerate()
                .map(|(i, r)| format!("rank {i}: {}", tail(&collect(r.stderr.take()), 5)))
                .collect();
            return Err(Error::remote(format!(
                "the run did not finish within {:?}; stderr:\n{}",
                launch.timeout,
                stderr.join("\n")
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = server.join();
    let mut reports = Vec::with_capacity(n);
    let mut failures = Vec::new();
    for (i, r) in ranks.iter_mut().enumerate() {
        let out = collect(r.stdout.take());
        let err = collect(r.stderr.take());
        let status = r.status;
        let report = out
            .lines()
            .rev()
            .find(|l| l.starts_with('{'))
            .and_then(|l| serde_json::from_str::<WorkerReport>(l).ok());
        match (status, report) {
            (Some(s), Some(report)) if s.success() => {
                show_warnings(i, &err);
                reports.push(report);
            }
            (s, _) => failures.push(format!(
                "rank {i} ({}):\n{}",
                s.map_or_else(|| "killed".to_string(), |s| s.to_string()),
                tail(&err, 20)
            )),
        }
    }
    if !failures.is_empty() {
        return Err(Error::remote(format!(
            "{} of {n} ranks failed{}:\n{}",
            failures.len(),
            if failed_early {
                " (the others were stopped)"
            } else {
                ""
            },
            failures.join("\n")
        )));
    }
    Ok(reports)
}

/// Warnings a rank that succeeded wrote on stderr (the plugin's, through the harness's
/// logger: a statistics file not written, say), shown on ours with the rank's number; the rest
/// of its stderr is dropped. A flood is cut after a few lines.
fn show_warnings(rank: usize, stderr: &str) {
    const SHOWN: usize = 10;
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("WARN")).collect();
    for line in warnings.iter().take(SHOWN) {
        eprintln!("rank {rank}: {line}");
    }
    if warnings.len() > SHOWN {
        eprintln!(
            "rank {rank}: ... and {} more warnings",
            warnings.len() - SHOWN
        );
    }
}

/// Kills every rank still running and reaps it.
fn kill_all(ranks: &mut [Rank]) {
    for r in ranks.iter_mut() {
        if r.status.is_none() {
            let _ = r.child.kill();
            r.status = r.child.wait().ok();
        }
    }
}
