//! One rank of a multi-process job started by a cluster launcher (torchrun, Open MPI's
//! `mpirun`, Slurm's `srun`) or by hand (`--rank/--world/--rendezvous`).
//!
//! [`detect`] reads the launcher's variables (explicit options first, then torchrun, Open MPI,
//! Slurm); without any, `bench` and `demo` launch their local ranks as before. [`run_member`]
//! runs the job in this process as one rank: rank 0 hosts the rendezvous where it was asked
//! to, every rank reports the interface and address its plugin chose and the loss it saw, and
//! rank 0 gets every rank's report.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::bootstrap::{Bootstrap, BootstrapServer, ServerOptions, Watch};
use super::launch::{self, Launch};
use super::library::PluginLibrary;
use super::plugin_client::PluginClient;
use super::scratch::ScratchDir;
use super::worker::{check_same_work, run_job, Job, WorkerReport};
use nccl_net_lossy::error::echo;
use nccl_net_lossy::stats::report::load_run;
use nccl_net_lossy::stats::writer::{dir_setting, STATS_DIR_ENV};
use nccl_net_lossy::transport::socket::Handle;
use nccl_net_lossy::transport::{WireHandle, HANDLE_WIRE_SIZE};
use nccl_net_lossy::{Error, Result};

/// The rendezvous `host:port` for launchers that give none (Open MPI, and Slurm with another
/// port than the default).
pub const RENDEZVOUS_ENV: &str = "NCCL_LOSSY_RENDEZVOUS";

/// The rendezvous port on the first Slurm node when neither an option nor
/// [`RENDEZVOUS_ENV`] names one.
pub const RENDEZVOUS_PORT_ENV: &str = "NCCL_LOSSY_RENDEZVOUS_PORT";

/// Default port of the rendezvous on the first node of a Slurm job.
pub const DEFAULT_PORT: u16 = 29500;

/// Default time ranks have to reach the rendezvous, in seconds.
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;

/// Most ranks of a multi-process job: rank 0's rendezvous keeps a slot and a connection per
/// rank (a world of 10^11 aborted it on the allocation of its slots).
pub const MAX_WORLD: usize = 65536;

/// Options of `bench` and `demo` for running as one rank of a multi-process job.
#[derive(clap::Args, Debug, Clone)]
pub struct ClusterArgs {
    /// This process's rank in a multi-process job (with --world; overrides a launcher's).
    #[arg(long, requires = "world")]
    pub rank: Option<usize>,
    /// Number of ranks of the multi-process job (with --rank).
    #[arg(long, requires = "rank")]
    pub world: Option<usize>,
    /// host:port of the rendezvous, hosted by rank 0 (default: NCCL_LOSSY_RENDEZVOUS, else
    /// the launcher's: MASTER_ADDR and MASTER_PORT + 1 under torchrun, the first Slurm node).
    #[arg(long, value_name = "HOST:PORT")]
    pub rendezvous: Option<String>,
    /// Port of the rendezvous on the first Slurm node (default: NCCL_LOSSY_RENDEZVOUS_PORT,
    /// else 29500).
    #[arg(long)]
    pub rendezvous_port: Option<u16>,
    /// Job id every rank must share (default: the launcher's job id, else derived from the
    /// rendezvous address).
    #[arg(long)]
    pub job_id: Option<String>,
    /// Seconds ranks have to reach the rendezvous, and after which a silent rank fails the
    /// job (0.1 to 3600).
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_S, value_parser = parse_rendezvous_timeout)]
    pub rendezvous_timeout: f64,
    /// Every rank prints its own line (not only rank 0 its table).
    #[arg(long, alias = "verbose")]
    pub all_ranks: bool,
}

impl Default for ClusterArgs {
    /// No option given: the command line's defaults (a derived one had a timeout of 0 s).
    fn default() -> Self {
        ClusterArgs {
            rank: None,
            world: None,
            rendezvous: None,
            rendezvous_port: None,
            job_id: None,
            rendezvous_timeout: DEFAULT_TIMEOUT_S,
            all_ranks: false,
        }
    }
}

/// Fewest and most seconds `--rendezvous-timeout` takes.
pub const RENDEZVOUS_TIMEOUT_RANGE_S: (f64, f64) = (0.1, 3600.0);

/// Parses `--rendezvous-timeout`: a number of seconds within [`RENDEZVOUS_TIMEOUT_RANGE_S`].
/// Anything else is refused rather than clamped (a negative value waited 0.1 s, `1e9` an
/// hour) or left to panic (`nan` made no `Duration`).
pub fn parse_rendezvous_timeout(text: &str) -> std::result::Result<f64, String> {
    text.trim()
        .parse::<f64>()
        .ok()
        .and_then(rendezvous_timeout)
        .map(|d| d.as_secs_f64())
        .ok_or_else(|| {
            let (lo, hi) = RENDEZVOUS_TIMEOUT_RANGE_S;
            format!("allowed: a number of seconds from {lo} to {hi} (e.g. 60 or 2.5)")
        })
}

/// `seconds` as a rendezvous timeout, when within [`RENDEZVOUS_TIMEOUT_RANGE_S`].
fn rendezvous_timeout(seconds: f64) -> Option<Duration> {
    let (lo, hi) = RENDEZVOUS_TIMEOUT_RANGE_S;
    (lo..=hi)
        .contains(&seconds)
        .then(|| Duration::from_secs_f64(seconds))
}

/// Who this process is in a multi-process job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Which launcher's variables said so (`options`, `torchrun`, `Open MPI`, `Slurm`).
    pub launcher: &'static str,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// host:port of the rendezvous.
    pub rendezvous: String,
    /// The job id every rank shares.
    pub job_id: String,
}

/// First host of a Slurm node list: `node[01-04,07],gpu5` gives `node01`.
pub fn first_host(nodelist: &str) -> Option<String> {
    let text = nodelist.trim();
    let mut host = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let inner: String = chars.by_ref().take_while(|&c| c != ']').collect();
                let first = inner.split(',').next()?.split('-').next()?.trim();
                if first.is_empty() {
                    return None;
                }
                host.push_str(first);
            }
            c => host.push(c),
        }
    }
    (!host.is_empty()).then_some(host)
}

/// Finds out whether this process is one rank of a multi-process job; `None`: launch local
/// ranks as always. `env` reads the environment (a parameter so tests can give their own).
pub fn detect(args: &ClusterArgs, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Member>> {
    let get = |name: &str| env(name).filter(|v| !v.is_empty());
    let number = |name: &str| -> Result<Option<usize>> {
        get(name)
            .map(|v| {
                v.trim().parse::<usize>().map_err(|_| {
                    Error::invalid_argument(format!("{name}={v} is not a rank or a count"))
                })
            })
            .transpose()
    };
    let rendezvous_option = || args.rendezvous.clone().or_else(|| get(RENDEZVOUS_ENV));
    let (launcher, rank, world, rendezvous, launcher_job) =
        if let (Some(rank), Some(world)) = (args.rank, args.world) {
            let rendezvous = rendezvous_option().ok_or_else(|| {
                Error::invalid_argument(format!(
                    "--rank/--world need --rendezvous host:port (or {RENDEZVOUS_ENV})"
                ))
            })?;
            ("options", rank, world, rendezvous, None)
        } else if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let names = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];
            let missing: Vec<&str> = names.into_iter().filter(|n| get(n).is_none()).collect();
            if !missing.is_empty() {
                return Err(Error::invalid_argument(format!(
                    "torchrun-style launch: {} set but {} missing",
                    names
                        .iter()
                        .filter(|n| !missing.contains(n))
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", "),
                    missing.join(", ")
                )));
            }
            let host = get("MASTER_ADDR").unwrap_or_default();
            let port = get("MASTER_PORT").unwrap_or_default();
            // torchrun's agent holds MASTER_PORT for its own store: the next port is ours.
            let port = port
                .trim()
                .parse::<u16>()
                .ok()
                .and_then(|p| p.checked_add(1))
                .ok_or_else(|| {
                    Error::invalid_argument(format!(
                        "MASTER_PORT={} is not a port below 65535",
                        echo(&port, str::to_string)
                    ))
                })?;
            let rendezvous = match rendezvous_option() {
                Some(r) => r,
                None => join_host_port(&host, &port.to_string()),
            };
            (
                "torchrun",
                number("RANK")?.unwrap_or(0),
                number("WORLD_SIZE")?.unwrap_or(0),
                rendezvous,
                get("TORCHELASTIC_RUN_ID"),
            )
        } else if get("OMPI_COMM_WORLD_RANK").is_some() || get("OMPI_COMM_WORLD_SIZE").is_some() {
            let (Some(rank), Some(world)) = (
                number("OMPI_COMM_WORLD_RANK")?,
                number("OMPI_COMM_WORLD_SIZE")?,
            ) else {
                return Err(Error::invalid_argument(
                "Open MPI launch: OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE must both be set",
            ));
            };
            let rendezvous = rendezvous_option().ok_or_else(|| {
                Error::invalid_argument(format!(
                    "Open MPI gives no rendezvous address: pass --rendezvous host:port (the host \
                 of rank 0) or set {RENDEZVOUS_ENV}"
                ))
            })?;
            let job = get("OMPI_MCA_ess_base_jobid").or_else(|| get("PMIX_NAMESPACE"));
            ("Open MPI", rank, world, rendezvous, job)
        } else if get("SLURM_PROCID").is_some() {
            let Some(world) = number("SLURM_NTASKS")?.or(number("SLURM_NPROCS")?) else {
                return Err(Error::invalid_argument(
                    "Slurm launch: SLURM_PROCID is set but SLURM_NTASKS is missing",
                ));
            };
            let rank = number("SLURM_PROCID")?.unwrap_or(0);
            let rendezvous = match rendezvous_option() {
                Some(r) => r,
                None => {
                    let list = get("SLURM_JOB_NODELIST")
                        .or_else(|| get("SLURM_NODELIST"))
                        .ok_or_else(|| {
                            Error::invalid_argument(
                                "Slurm launch: no SLURM_JOB_NODELIST to find rank 0's host; pass \
                             --rendezvous host:port",
                            )
                        })?;
                    let host = first_host(&list).ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "SLURM_JOB_NODELIST={} names no host",
                            echo(&list, str::to_string)
                        ))
                    })?;
                    let port = match args.rendezvous_port {
                        Some(p) => p,
                        None => match get(RENDEZVOUS_PORT_ENV) {
                            Some(p) => p.trim().parse().map_err(|_| {
                                Error::invalid_argument(format!(
                                    "{RENDEZVOUS_PORT_ENV}={} is not a port",
                                    echo(&p, str::to_string)
                                ))
                            })?,
                            None => DEFAULT_PORT,
                        },
                    };
                    join_host_port(&host, &port.to_string())
                }
            };
            let job = get("SLURM_JOB_ID").map(|id| match get("SLURM_STEP_ID") {
                Some(step) => format!("{id}.{step}"),
                None => id,
            });
            ("Slurm", rank, world, rendezvous, job)
        } else if args.rendezvous.is_some() || args.job_id.is_some() {
            return Err(Error::invalid_argument(
                "--rendezvous/--job-id need --rank and --world (or a launcher's variables)",
            ));
        } else {
            return Ok(None);
        };
    let names = match launcher {
        "options" => "--rank, --world",
        "torchrun" => "RANK, WORLD_SIZE",
        "Open MPI" => "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE",
        _ => "SLURM_PROCID, SLURM_NTASKS",
    };
    if world > MAX_WORLD {
        return Err(Error::invalid_argument(format!(
            "{launcher} launch: world size {world} ({names}): allowed: 1 to {MAX_WORLD} ranks"
        )));
    }
    if world == 0 || rank >= world {
        return Err(Error::invalid_argument(format!(
            "{launcher} launch: rank {rank} is not below the world size {world} ({names})"
        )));
    }
    let job_id = args
        .job_id
        .clone()
        .or(launcher_job)
        .unwrap_or_else(|| format!("rendezvous-{rendezvous}"));
    Ok(Some(Member {
        launcher,
        rank,
        world,
        rendezvous,
        job_id,
    }))
}

/// `host:port`, with brackets around an IPv6 host.
fn join_host_port(host: &str, port: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// What one rank of a multi-process job tells rank 0.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankReport {
    /// The worker's report (results, plugin name).
    pub report: WorkerReport,
    /// Host name of the rank's machine.
    pub host: String,
    /// The interface the plugin chose (its device 0's name).
    pub interface: String,
    /// The address the plugin listens on, from its connection handle, when readable.
    pub address: String,
    /// Packets the plugin sent through its loss models, from its statistics.
    pub packets: Option<u64>,
    /// Of those, packets lost.
    pub lost_packets: Option<u64>,
}

/// Runs `job` as `member`'s rank: rank 0 hosts the rendezvous, and gets `Some` report of
/// every rank in rank order; the others get `None`. A rank that dies ends every other
/// rank's process with a message naming it (`on_abort` prints it and exits).
pub fn run_member(
    member: &Member,
    job: &Job,
    timeout: Duration,
    on_abort: impl FnOnce(Error) + Send + 'static,
) -> Result<Option<Vec<RankReport>>> {
    // The statistics this rank reports (set before any thread of ours starts).
    // A blank value is unset, as the plugin reads it.
    let temporary = dir_setting(std::env::var_os(STATS_DIR_ENV))
        .is_none()
        .then(|| ScratchDir::new("lossy-rank"))
        .transpose()?;
    if let Some(dir) = &temporary {
        std::env::set_var(STATS_DIR_ENV, dir.path());
    }
    // A rank told to abort ends its process (its plugin calls may be blocked on the rank that
    // is gone), after removing the directory; unless this rank failed on its own meanwhile:
    // then it returns its own error, which the abort must not hide.
    let fate = Arc::new(Fate::default());
    let watched = Arc::clone(&fate);
    let abandoned = temporary.as_ref().map(|d| d.path().to_path_buf());
    let on_abort = move |err: Error| {
        if watched.wait_for_own_error(err.clone(), OWN_ERROR_GRACE) {
            return;
        }
        if let Some(dir) = abandoned {
            // Else the plugin's statistics at exit would bring the directory back.
            std::env::remove_var(STATS_DIR_ENV);
            let _ = std::fs::remove_dir_all(dir);
        }
        on_abort(err)
    };
    let _temporary = temporary;
    let asked = resolve(&member.rendezvous, timeout)?;
    let server = if member.rank == 0 {
        Some(host_rendezvous(asked, member, timeout, job.timeout())?)
    } else {
        None
    };
    let addr = match &server {
        // Rank 0 reaches its own server on the address it bound (loopback when it bound all).
        Some(s) if s.addr().ip().is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), s.addr().port())
        }
        Some(s) => s.addr(),
        None => asked,
    };
    let (rank, world, id) = (member.rank, member.world, member.job_id.as_str());
    let outcome = (|| -> Result<Vec<Vec<u8>>> {
        let mut boot = Bootstrap::connect_job(addr, rank, world, id, timeout)?;
        let watch = Watch::connect(addr, rank, world, id, timeout, on_abort)?;
        // The first round waits for every rank to arrive; later ones for the slowest rank's work.
        // The server decides when arrival has taken too long (and says who is missing): this
        // rank waits a little longer than it, so as to hear why.
        boot.set_timeout(timeout + Duration::from_secs(5))?;
        boot.barrier()?;
        boot.set_timeout(job.timeout())?;
        check_same_work(job, &mut boot)?;
        let outcome = run_job(job, &mut boot).and_then(|report| rank_report(job, report));
        let stats_dir = std::env::var_os(STATS_DIR_ENV).map(PathBuf::from);
        let mine = outcome.map(|mut mine| {
            if let Some(total) = stats_dir.and_then(|d| load_run(&d).ok()) {
                mine.packets = Some(total.total.counts.packets);
                mine.lost_packets = Some(total.total.counts.lost_packets);
            }
            mine
        });
        let mine = mine?;
        let blob = serde_json::to_vec(&mine)
            .map_err(|e| Error::internal(format!("cannot encode the rank report: {e}")))?;
        let all = boot.all_gather(&blob)?;
        watch.done()?;
        Ok(all)
    })();
    // A rank that failed on its own reports that, with what the rendezvous said if it did
    // (which rank left: this rank's own error, a reset connection, may not name it).
    let outcome = outcome.map_err(|err| match fate.own_error(REASON_WAIT) {
        // Said once: this rank's error often carries the rendezvous's reason already.
        Some(why) if !err.to_string().contains(&why.to_string()) => {
            Error::new(err.kind, format!("{err} (the rendezvous says: {why})"))
        }
        _ => err,
    });
    let Some(server) = server else {
        return outcome.map(|_| None);
    };
    let all = match outcome {
        Ok(all) => {
            server.join()?;
            all
        }
        // This process hosts the rendezvous: it lets the server finish telling the other
        // ranks why the job ends, and reports the server's reason (which names the rank).
        Err(err) => {
            return Err(match server.join_within(Duration::from_secs(2)) {
                // Said once: this rank's own error already holds the server's reason (and
                // may say more, such as which rank left).
                Some(Err(why)) if err.to_string().contains(&why.to_string()) => err,
                Some(Err(why)) => Error::remote(format!("{why} (rank 0: {err})")),
                _ => err,
            });
        }
    };
    let reports = all
        .iter()
        .map(|b| serde_json::from_slice::<RankReport>(b))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::remote(format!("a rank sent a bad report: {e}")))?;
    Ok(Some(reports))
}

/// How long a rank told to abort waits for its own work to fail on its own (the rank that
/// left is often one this rank was talking to) before it ends the process.
const OWN_ERROR_GRACE: Duration = Duration::from_secs(2);

/// How long a rank whose own work failed waits for the rendezvous to say why the job ends
/// (it often hears of the other rank's end at the same time as its own error).
const REASON_WAIT: Duration = Duration::from_secs(1);

/// Whether a rank's own work failed, and why the rendezvous told it to abort: the thread
/// that watches the rendezvous and the rank's own thread meet here, so that whichever
/// error came first, the rank's own is reported.
#[derive(Default)]
struct Fate {
    state: Mutex<FateState>,
    changed: Condvar,
}

#[derive(Default)]
struct FateState {
    /// The rank's own work failed: it reports the error itself.
    own_error: bool,
    /// Why the rendezvous told the rank to abort.
    abort: Option<Error>,
}

impl Fate {
    /// Records the abort `why`; true when the rank's own work failed within `grace` (it
    /// reports then, with `why`), false when the watcher must end the process.
    fn wait_for_own_error(&self, why: Error, grace: Duration) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        state.abort = Some(why);
        self.changed.notify_all();
        let deadline = Instant::now() + grace;
        while !state.own_error {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            match self.changed.wait_timeout(state, left) {
                Ok((next, _)) => state = next,
                Err(_) => return false,
            }
        }
        true
    }

    /// Says the rank's own work failed (the watcher no longer ends the process) and returns
    /// why the rendezvous told it to abort, if it does within `wait`.
    fn own_error(&self, wait: Duration) -> Option<Error> {
        let mut state = self.state.lock().ok()?;
        state.own_error = true;
        self.changed.notify_all();
        let deadline = Instant::now() + wait;
        while state.abort.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self.changed.wait_timeout(state, left).ok()?.0;
        }
        state.abort.clone()
    }
}

/// Every rank's report, and in a multi-process job what each rank's plugin used.
pub struct Ranks {
    /// The worker reports, in rank order.
    pub reports: Vec<WorkerReport>,
    /// Interface, address and loss of each rank (multi-process jobs only).
    pub members: Option<Vec<RankReport>>,
}

/// Runs `launch` (its local ranks), or as one rank of the multi-process job `cluster`
/// detects; `None` on a rank other than 0 (it prints nothing unless `--all-ranks`).
pub fn run_ranks(
    cluster: &ClusterArgs,
    command: &'static str,
    launch: &Launch,
) -> Result<Option<Ranks>> {
    let Some(member) = detect(cluster, &|k| std::env::var(k).ok())? else {
        let reports = launch::run(launch)?;
        return Ok(Some(Ranks {
            reports,
            members: None,
        }));
    };
    // Checked by `parse_rendezvous_timeout`; a value set in code stays within it too.
    let seconds = cluster.rendezvous_timeout;
    let timeout = rendezvous_timeout(seconds).ok_or_else(|| {
        let (lo, hi) = RENDEZVOUS_TIMEOUT_RANGE_S;
        Error::invalid_argument(format!(
            "--rendezvous-timeout {seconds}: allowed: a number of seconds from {lo} to {hi}"
        ))
    })?;
    // This process is the rank: it takes the environment the launch would give its ranks.
    for (key, value) in &launch.env {
        std::env::set_var(key, value);
    }
    let all = run_member(
        &member,
        &launch.job,
        timeout,
        exit_on_abort(command, member.rank),
    )?;
    if cluster.all_ranks {
        println!(
            "lossy {command}: rank {} of {} ({} launch, job `{}`, rendezvous {}) done",
            member.rank, member.world, member.launcher, member.job_id, member.rendezvous
        );
    }
    Ok(all.map(|all| Ranks {
        reports: all.iter().map(|r| r.report.clone()).collect(),
        members: Some(all),
    }))
}

/// What `run_member` does when the rendezvous says another rank is gone: print why and end
/// this process (its plugin calls may be blocked on that rank).
pub fn exit_on_abort(command: &'static str, rank: usize) -> impl FnOnce(Error) + Send + 'static {
    move |err| {
        eprintln!("lossy {command} rank {rank}: {err}");
        if rank == 0 {
            // Rank 0's process hosts the rendezvous: give it time to tell the other ranks.
            std::thread::sleep(Duration::from_millis(800));
        }
        std::process::exit(1)
    }
}

/// The first address `text` (`host:port`) resolves to, retrying while the name does not
/// resolve yet (a node that is still starting).
fn resolve(text: &str, timeout: Duration) -> Result<SocketAddr> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match text.to_socket_addrs() {
            Ok(mut addrs) => {
                if let Some(addr) = addrs.next() {
                    return Ok(addr);
                }
            }
            Err(e) if std::time::Instant::now() > deadline => {
                return Err(Error::invalid_argument(format!(
                    "rendezvous address {} (want host:port): {e}",
                    echo(text, |t| format!("`{t}`"))
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                return Err(Error::invalid_argument(format!(
                    "rendezvous address {} (want host:port): {e}",
                    echo(text, |t| format!("`{t}`"))
                )))
            }
            Err(_) => {}
        }
        if std::time::Instant::now() > deadline {
            return Err(Error::invalid_argument(format!(
                "rendezvous address {} resolves to nothing",
                echo(text, |t| format!("`{t}`"))
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Starts rank 0's rendezvous on the asked address, or on every interface at the asked
/// port when that address is not one of this machine's (behind NAT, or a name for the node).
fn host_rendezvous(
    asked: SocketAddr,
    member: &Member,
    connect_timeout: Duration,
    round_timeout: Duration,
) -> Result<BootstrapServer> {
    let options = |bind| ServerOptions {
        bind,
        nranks: member.world,
        connect_timeout,
        round_timeout,
        job_id: member.job_id.clone(),
        watch: true,
    };
    match BootstrapServer::start_with(options(asked)) {
        Ok(server) => Ok(server),
        Err(first) => {
            let any = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), asked.port());
            BootstrapServer::start_with(options(any)).map_err(|e| {
                Error::system(format!("rank 0 cannot host the rendezvous: {first}; {e}"))
            })
        }
    }
}

/// This rank's report plus the interface and address its plugin chose.
fn rank_report(job: &Job, report: WorkerReport) -> Result<RankReport> {
    let lib = PluginLibrary::open(&job.library)?;
    let _ = lib.write_stats()?;
    let (interface, address) =
        plugin_endpoint(&lib, job.version).unwrap_or_else(|e| (format!("? ({e})"), "?".into()));
    Ok(RankReport {
        report,
        host: hostname(),
        interface,
        address,
        packets: None,
        lost_packets: None,
    })
}

/// The name of the plugin's device 0 and the address of a listener on it.
fn plugin_endpoint(lib: &std::rc::Rc<PluginLibrary>, version: u32) -> Result<(String, String)> {
    let client = PluginClient::init(lib, version, 0x10553)?;
    let name = client.properties(0)?.name;
    let (handle, listen) = client.listen(0)?;
    listen.close()?;
    Ok((name, handle_address(&handle).unwrap_or_else(|| "?".into())))
}

/// The listening address in a connection handle of this project's socket transport (read
/// by the transport's own decoder); `None` for another plugin's handle.
fn handle_address(handle: &[u8]) -> Option<String> {
    let wire: &WireHandle = handle.get(..HANDLE_WIRE_SIZE)?.try_into().ok()?;
    Handle::decode(wire).ok().map(|h| h.addr.to_string())
}

/// This machine's host name (`?` when unknown).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The per-rank lines of rank 0's table: host, interface, address, loss.
pub fn rank_lines(reports: &[RankReport]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# {:>4} {:<16} {:<10} {:<24} {:>12} {:>12} {:>8}",
        "rank", "host", "interface", "plugin address", "packets", "lost", "loss"
    );
    for (rank, r) in reports.iter().enumerate() {
        let count = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        let rate = match (r.packets, r.lost_packets) {
            (Some(p), Some(l)) if p > 0 => format!("{:.3}%", 100.0 * l as f64 / p as f64),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "# {:>4} {:<16} {:<10} {:<24} {:>12} {:>12} {:>8}",
            rank,
            r.host,
            r.interface,
            r.address,
            count(r.packets),
            count(r.lost_packets),
            rate
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn slurm_node_lists_give_their_first_host() {
        assert_eq!(first_host("node[01-04,07]").as_deref(), Some("node01"));
        assert_eq!(first_host("gpu7,gpu8").as_deref(), Some("gpu7"));
        assert_eq!(first_host("a[3,5]-ib,b1").as_deref(), Some("a3-ib"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
    }

    #[test]
    fn launchers_are_read_in_order_and_options_win() {
        let none = ClusterArgs::default();
        assert_eq!(detect(&none, &with(&[])).expect("local"), None);
        let torch = with(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("SLURM_PROCID", "5"),
        ]);
        let m = detect(&none, &torch).expect("ok").expect("member");
        assert_eq!(
            (
                m.launcher,
                m.rank,
                m.world,
                m.rendezvous.as_str(),
                m.job_id.as_str()
            ),
            ("torchrun", 1, 2, "10.0.0.1:29401", "abc")
        );
        let explicit = ClusterArgs {
            rank: Some(0),
            world: Some(4),
            rendezvous: Some("h:1".into()),
            ..ClusterArgs::default()
        };
        let m = detect(&explicit, &torch).expect("ok").expect("member");
        assert_eq!((m.launcher, m.rank, m.world), ("options", 0, 4));
        let slurm = with(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "node[07-09]"),
            ("SLURM_JOB_ID", "42"),
        ]);
        let m = detect(&none, &slurm).expect("ok").expect("member");
        assert_eq!(
            (m.rank, m.rendezvous.as_str(), m.job_id.as_str()),
            (3, "node07:29500", "42")
        );
        let mpi = with(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]);
        let err = detect(&none, &mpi).expect_err("no rendezvous");
        assert!(err.message.contains(RENDEZVOUS_ENV), "{err}");
    }

    #[test]
    fn partial_or_inconsistent_variables_are_named() {
        let none = ClusterArgs::default();
        let err = detect(&none, &with(&[("RANK", "0")])).expect_err("partial");
        assert!(err.message.contains("WORLD_SIZE"), "{err}");
        let err = detect(
            &none,
            &with(&[
                ("RANK", "2"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "1"),
            ]),
        )
        .expect_err("rank >= world");
        assert!(err.message.contains("RANK, WORLD_SIZE"), "{err}");
    }

    #[test]
    fn the_handle_address_is_read_from_the_transport_handle() {
        let mut wire: WireHandle = [0u8; HANDLE_WIRE_SIZE];
        let handle = Handle {
            addr: "10.1.2.3:4242".parse().expect("address"),
            nonce: [7; 16],
        };
        handle.encode(&mut wire);
        let mut conn = [0u8; 128];
        conn[..HANDLE_WIRE_SIZE].copy_from_slice(&wire);
        assert_eq!(handle_address(&conn).as_deref(), Some("10.1.2.3:4242"));
        conn[0] ^= 1;
        assert_eq!(handle_address(&conn), None);
    }
}
