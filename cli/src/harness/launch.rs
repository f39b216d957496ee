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

/// Most local ranks a run starts: each is a process with two reader threads and three
/// descriptors here, so far more would exhaust the machine (or this process's descriptor
/// limit) before any collective ran; a typo such as `--ranks 100000` is refused instead.
pub const MAX_LOCAL_RANKS: usize = 256;

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

/// What a reader thread runs: reads one pipe of a rank to its end.
pub type PipeReader = Box<dyn FnOnce() -> String + Send + 'static>;

/// Starts the thread that runs a [`PipeReader`]: [`reader_thread`] in a run; tests hand
/// [`run_with`] one that fails, as thread creation does at the user's process limit.
pub type SpawnReader<'a> = dyn Fn(PipeReader) -> std::io::Result<JoinHandle<String>> + 'a;

/// Starts `read` on a thread of its own.
pub fn reader_thread(read: PipeReader) -> std::io::Result<JoinHandle<String>> {
    std::thread::Builder::new()
        .name("lossy-drain".into())
        .spawn(read)
}

/// Reads a pipe of rank `rank` to its end on a thread, so a chatty child never blocks on a
/// full pipe. A rank without its reader must not run: its writes would meet a broken pipe.
fn drain(
    pipe: Option<impl Read + Send + 'static>,
    spawn: &SpawnReader<'_>,
    rank: usize,
    which: &str,
) -> Result<Option<JoinHandle<String>>> {
    let Some(mut pipe) = pipe else {
        return Ok(None);
    };
    let reader = spawn(Box::new(move || {
        let mut text = Vec::new();
        let _ = pipe.read_to_end(&mut text);
        String::from_utf8_lossy(&text).into_owned()
    }));
    reader.map(Some).map_err(|e| {
        Error::system(format!(
            "cannot start a thread to read rank {rank}'s {which}: {e}; this user is likely at \
             its limit of processes and threads (`ulimit -u`, RLIMIT_NPROC): raise it, or run \
             fewer ranks, fewer --comms or fewer NCCL_LOSSY_IO_THREADS"
        ))
    })
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
    run_with(launch, &reader_thread)
}

/// As [`run`], with `spawn` starting the threads that read the ranks' output.
pub fn run_with(launch: &Launch, spawn: &SpawnReader<'_>) -> Result<Vec<WorkerReport>> {
    let n = launch.nranks;
    if !(2..=MAX_LOCAL_RANKS).contains(&n) {
        return Err(Error::invalid_argument(format!(
            "--ranks {n}: allowed: 2 to {MAX_LOCAL_RANKS} local ranks (processes on this machine)"
        )));
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
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut ranks);
                let hint = if e.raw_os_error() == Some(libc::EAGAIN) {
                    "; this user is likely at its limit of processes and threads (`ulimit -u`, \
                     RLIMIT_NPROC): raise it, or run fewer ranks"
                } else {
                    ""
                };
                return Err(Error::system(format!(
                    "cannot start {} worker for rank {rank}: {e}{hint}",
                    launch.exe.display()
                )));
            }
        };
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        ranks.push(Rank {
            child,
            stdout: None,
            stderr: None,
            status: None,
        });
        let readers = (|| -> Result<()> {
            ranks[rank].stdout = drain(stdout, spawn, rank, "stdout")?;
            ranks[rank].stderr = drain(stderr, spawn, rank, "stderr")?;
            Ok(())
        })();
        if let Err(e) = readers {
            stop_all(&mut ranks);
            return Err(e);
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
/// of its stderr is dropped. A flood is cut after a few lines. With `LOSSY_HARNESS_DEBUG` set
/// past WARN (the harness's `NCCL_DEBUG=INFO`), every line is shown, uncut: the user asked
/// for the plugin's whole log.
fn show_warnings(rank: usize, stderr: &str) {
    if super::plugin_client::log_verbose() {
        for line in stderr.lines() {
            eprintln!("rank {rank}: {line}");
        }
        return;
    }
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

/// Kills every rank started and ends the threads reading them, before the launch gives up.
fn stop_all(ranks: &mut [Rank]) {
    kill_all(ranks);
    for r in ranks.iter_mut() {
        // The rank is reaped and its pipes closed: each reader ends at once.
        collect(r.stdout.take());
        collect(r.stderr.take());
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
