//! Shared helpers of the integration tests: the built `lossy` binary and plugin library.

#![allow(dead_code)]

pub mod busy;
pub mod census;
pub mod forged;
pub mod init_child;
mod transfer;

#[allow(unused_imports)] // each test binary uses some of them
pub use transfer::{move_messages, post_recv, post_send, registered_round_trip, wait_request};

use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use lossy_cli::harness::collectives::{Collective, DataType};
use lossy_cli::harness::launch::{self, Launch};
use lossy_cli::harness::plugin_client::library_near;
use lossy_cli::harness::worker::{Job, LinkKind, PacketCensus, RunSpec, WorkerReport};
use nccl_net_lossy::ffi::{ncclNetCommConfig_v10_t, ncclNet_v12_t, ncclResult_t, NCCL_PTR_HOST};

/// The `lossy` binary Cargo built for these tests.
pub fn lossy_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_lossy"))
}

/// Runs `lossy args` from the repository's top with `env` added (and none of the variables
/// a developer's shell may carry: no statistics, profile, overrides or `NCCL_NET_PLUGIN`
/// unless `env` gives them); asserts it succeeded and returns its stdout.
pub fn lossy_stdout(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = std::process::Command::new(lossy_exe())
        .args(args)
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("NCCL_LOSSY_STATS")
        .env_remove("NCCL_LOSSY_SET")
        .env_remove("NCCL_LOSSY_PROFILE")
        .env_remove("NCCL_NET_PLUGIN")
        .envs(env.iter().copied())
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run lossy");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "lossy {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Statistics of a short `lossy demo` (two ranks, 64 KiB collectives, the embedded default
/// profile), written into `dir/run`, which it returns.
pub fn demo_stats(dir: &Path) -> PathBuf {
    let stats = dir.join("run");
    lossy_stdout(
        &[
            "demo",
            "--ranks",
            "2",
            "--sizes",
            "64K",
            "--stats-dir",
            stats.to_str().expect("utf-8 path"),
        ],
        &[],
    );
    stats
}

/// Runs the finished `cmd` (its stdout and stderr piped here, read as they come, so a child
/// that writes more than a pipe holds is not blocked) and gives up after 10 s: a hang is a
/// failure, not a stuck test.
pub fn output_within_10s(cmd: &mut std::process::Command, what: &str) -> std::process::Output {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the command");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("stdout")));
    let stderr = drain(Box::new(child.stderr.take().expect("stderr")));
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(10) {
            child.kill().ok();
            child.wait().ok();
            panic!("{what} did not finish within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

/// Makes a FIFO at `path` (a file that never ends and blocks its reader: hostile input).
pub fn make_fifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().expect("utf-8")).expect("path");
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {}",
        path.display()
    );
}

/// Builds the C plugin `cli/tests/fixtures/{source}` (a small plugin, with the system C
/// compiler) into a fresh folder of its own for test `test`: tests run in parallel, and a
/// shared folder would be wiped under another test's ranks.
pub fn build_fixture(test: &str, source: &str) -> PathBuf {
    build_fixture_with(test, source, &[])
}

/// As [`build_fixture`], with `defines` (`NAME` or `NAME=VALUE`) given to the compiler.
pub fn build_fixture_with(test: &str, source: &str, defines: &[&str]) -> PathBuf {
    let out = fresh_dir(&format!("fixture-plugin-{test}")).join("libnccl-net-fixture.so");
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = std::process::Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I"])
        .arg(repo_file("nccl_headers"))
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg(repo_file(&format!("cli/tests/fixtures/{source}")))
        .arg("-o")
        .arg(&out)
        .arg("-ldl")
        .status()
        .unwrap_or_else(|e| panic!("run the C compiler {compiler}: {e}"));
    assert!(status.success(), "building the plugin {source} failed");
    out
}

/// The exported table `symbol` (`ncclNetPlugin_v12`, `ncclTunerPlugin_v6`, ...) of the
/// plugin library, as NCCL finds it with `dlsym`; the library stays loaded for the process.
///
/// # Safety
/// `T` must be the C type of that table in our headers.
pub unsafe fn library_table<T>(symbol: &str) -> &'static T {
    use nccl_net_lossy::ffi::net::NetLibrary;
    // SAFETY: our own plugin library, whose initialisers are sound.
    let lib = unsafe { NetLibrary::open(&library()) }
        .expect("dlopen")
        .keep_loaded();
    let sym = lib.symbol(symbol).unwrap_or_else(|| panic!("no {symbol}"));
    // Never unloaded (kept loaded above), so the table lives as long as the process.
    std::mem::forget(lib);
    // SAFETY: per this function's contract, static data of a library never unloaded.
    unsafe { &*(sym as *const T) }
}

/// The plugin library next to it.
pub fn library() -> PathBuf {
    let exe = lossy_exe();
    let dir = exe.parent().expect("binary directory");
    library_near(dir).expect("the plugin library is built next to the lossy binary")
}

/// A copy of the plugin library as `dir/name`, its path as text: a second, independent
/// `dlopen` beside the plugin's (a library opened twice from one path is one instance), to
/// drive as another plugin (`--vs-library`).
pub fn library_copy(dir: &Path, name: &str) -> String {
    let copy = dir.join(name);
    std::fs::copy(library(), &copy).expect("copy the plugin library");
    copy.display().to_string()
}

/// Runs `runs` on `nranks` worker processes through the plugin (version `version`).
pub fn run_ranks(nranks: usize, version: u32, runs: Vec<RunSpec>) -> Vec<WorkerReport> {
    let mut job = Job::collectives(library(), vec![LinkKind::Plugin], runs);
    job.version = version;
    job.timeout_s = 60.0;
    launch_job(nranks, job)
}

/// Launches `job` on `nranks` worker processes and returns the reports.
pub fn launch_job(nranks: usize, job: Job) -> Vec<WorkerReport> {
    launch_env(nranks, job, Vec::new()).unwrap_or_else(|e| panic!("run failed: {e}"))
}

/// Launches `job` on `nranks` worker processes over loopback, with `env` added to their
/// environment.
pub fn launch_env(
    nranks: usize,
    job: Job,
    env: Vec<(String, String)>,
) -> nccl_net_lossy::Result<Vec<WorkerReport>> {
    let mut all = vec![("NCCL_SOCKET_IFNAME".to_string(), "lo".to_string())];
    all.extend(env);
    launch::run(&Launch {
        exe: lossy_exe(),
        nranks,
        job,
        env: all,
        timeout: Duration::from_secs(120),
    })
}

/// The census of every rank added up.
pub fn total_census(reports: &[WorkerReport]) -> PacketCensus {
    let mut sum = PacketCensus::default();
    for r in reports {
        sum.add(&r.census);
    }
    sum
}

/// A file of this repository, by its path from the top.
pub fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// An empty scratch directory `lossy-{name}-{pid}` in the system's temporary directory.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lossy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    removed_at_exit(&dir);
    dir
}

/// The folders this test process made for itself, removed when it exits.
static MADE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

extern "C" fn remove_made() {
    let dirs = MADE.lock().map(|d| d.clone()).unwrap_or_default();
    for dir in dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Removes `dir` when this test process exits, whether its tests passed or failed (the test
/// harness returns from `main` or calls `exit`, and both run the exit handlers), so runs of
/// the suite do not pile up plugin copies and fixtures in the temporary folder.
pub fn removed_at_exit(dir: &Path) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        // SAFETY: `remove_made` is an `extern "C"` function with no arguments that never
        // unwinds (it ignores every error), as `atexit` requires.
        unsafe { libc::atexit(remove_made) };
    });
    if let Ok(mut made) = MADE.lock() {
        made.push(dir.to_path_buf());
    }
}

/// One run of each collective at each size, in both element types.
pub fn every(sizes: &[usize], dtypes: &[DataType]) -> Vec<RunSpec> {
    let mut runs = Vec::new();
    for &bytes in sizes {
        for collective in Collective::ALL {
            for &dtype in dtypes {
                runs.push(RunSpec {
                    collective,
                    dtype,
                    bytes,
                    iters: 1,
                    warmup: 0,
                });
            }
        }
    }
    runs
}

/// Asserts every result of every rank was bit-exact and every rank reported each run.
pub fn assert_all_exact(reports: &[WorkerReport], runs: usize) {
    for report in reports {
        assert_eq!(report.results.len(), runs, "rank {}", report.rank);
        for r in &report.results {
            assert!(
                r.ok,
                "rank {}: {} {} of {} bytes: {} mismatches, first at {:?}",
                report.rank, r.collective, r.dtype, r.bytes, r.mismatches, r.first_mismatch
            );
        }
    }
}

// ---- peer processes and single requests, for the fault and hostile-input tests ----------------

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use lossy_cli::harness::plugin_client::{ConnHandle, HANDLE_BYTES};

/// Environment variable that tells a re-executed test binary which peer role to play.
pub const ROLE_ENV: &str = "LOSSY_TEST_PEER_ROLE";

/// A peer process: this test binary run again with only the test `child_test` (an ignored
/// test that acts on [`ROLE_ENV`]). Dropping it resumes (SIGCONT), kills and reaps it, so a
/// failed test never leaves a stopped process behind.
pub struct Peer {
    child: Child,
    out: BufReader<ChildStdout>,
    stdin: Option<ChildStdin>,
}

impl Peer {
    /// Starts the peer playing `role`, with `env` added to its environment.
    pub fn spawn(child_test: &str, role: &str, env: &[(&str, &str)]) -> Peer {
        Peer::spawn_with_stderr(child_test, role, env, Stdio::inherit())
    }

    /// As [`Peer::spawn`], with the peer's stderr (the plugin's log) going to `stderr`.
    pub fn spawn_with_stderr(
        child_test: &str,
        role: &str,
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Peer {
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            child_test,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn the peer");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let stdin = child.stdin.take();
        Peer { child, out, stdin }
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Reads the peer's stdout until a line starting with `prefix`; returns the rest.
    pub fn expect_line(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.out.read_line(&mut line).expect("read the peer");
            assert!(n > 0, "the peer exited before saying {prefix}");
            // libtest may print "test NAME ... " on the same line first.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].trim().to_string();
            }
        }
    }

    /// The connection handle the peer printed (`HANDLE <hex>`).
    pub fn read_handle(&mut self) -> ConnHandle {
        parse_handle(&self.expect_line("HANDLE"))
    }

    /// Gives the peer a handle to connect to.
    pub fn send_handle(&mut self, h: &ConnHandle) {
        let stdin = self.stdin.as_mut().expect("stdin");
        writeln!(stdin, "HANDLE {}", hex(h)).expect("write the handle");
        stdin.flush().expect("flush");
    }

    /// Sends `sig` to the peer.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) takes two integers and touches no memory of ours; the pid is our
        // own unreaped child, so it cannot name another process.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.pid());
    }

    /// SIGKILLs the peer and reaps it; returns when it is gone.
    pub fn kill(&mut self) -> Instant {
        self.child.kill().expect("kill the peer");
        self.child.wait().expect("reap the peer");
        Instant::now()
    }

    /// Waits for the peer to exit on its own.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        self.child.wait().expect("wait for the peer")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // SAFETY: as in `signal`; a peer already reaped makes this fail harmlessly (ESRCH).
        unsafe { libc::kill(self.pid(), libc::SIGCONT) };
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A handle from its hex form.
pub fn parse_handle(text: &str) -> ConnHandle {
    let mut h = [0u8; HANDLE_BYTES];
    assert_eq!(text.len(), 2 * HANDLE_BYTES, "handle {text}");
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex");
    }
    h
}

/// Reads `HANDLE <hex>` from stdin (the peer side of [`Peer::send_handle`]).
pub fn handle_from_stdin() -> ConnHandle {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("stdin");
    parse_handle(
        line.trim()
            .strip_prefix("HANDLE")
            .expect("HANDLE line")
            .trim(),
    )
}

/// Prints one line for the parent and flushes it.
pub fn say(line: &str) {
    let mut out = std::io::stdout();
    writeln!(out, "{line}").expect("stdout");
    out.flush().expect("flush");
}

/// Sleeps until killed.
pub fn park() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Deterministic bytes for message `seed`.
pub fn message_bytes(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed * 97) as u8
                ^ (i >> 11) as u8
        })
        .collect()
}

/// The environment that makes [`heap_in_use`] exact in a process started with it: one malloc
/// arena and no per-thread cache of freed chunks, so every live chunk is counted and nothing
/// else (observed jitter between two calls: under 100 bytes).
pub const EXACT_HEAP_ENV: (&str, &str) = (
    "GLIBC_TUNABLES",
    "glibc.malloc.arena_max=1:glibc.malloc.tcache_count=0",
);

/// Bytes of heap in use in the whole process, every arena and mmapped chunk included (freed
/// chunks in a thread's cache count as in use: run the process with [`EXACT_HEAP_ENV`]).
pub fn heap_in_use() -> usize {
    // SAFETY: mallinfo2 takes no argument and only reads the allocator's counters.
    let info = unsafe { libc::mallinfo2() };
    info.uordblks + info.hblkhd
}

/// Sends `data` from `sc` to `rc` through the raw v12 table, posting and testing as NCCL's
/// proxy does (the receive at the message's size): the bytes that arrived, in a buffer that
/// starts as 0xee bytes, so bytes never written show.
pub fn raw_transfer(
    t: &ncclNet_v12_t,
    sc: *mut c_void,
    rc: *mut c_void,
    data: &mut [u8],
) -> Vec<u8> {
    let mut into = vec![0xeeu8; data.len()];
    let (mut smr, mut rmr) = (null_mut(), null_mut());
    // SAFETY: host buffers that outlive their registrations and requests.
    unsafe {
        let reg = t.regMr.expect("regMr");
        assert_eq!(
            reg(
                sc,
                data.as_mut_ptr().cast(),
                data.len(),
                NCCL_PTR_HOST as c_int,
                &mut smr
            ),
            ncclResult_t::ncclSuccess
        );
        assert_eq!(
            reg(
                rc,
                into.as_mut_ptr().cast(),
                into.len(),
                NCCL_PTR_HOST as c_int,
                &mut rmr
            ),
            ncclResult_t::ncclSuccess
        );
    }
    let (mut sreq, mut rreq): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = Instant::now();
    while sreq.is_null() || rreq.is_null() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "posting never succeeded"
        );
        // SAFETY: a live comm pair of `t`, and buffers lent until the requests end.
        unsafe {
            if rreq.is_null() {
                rreq = raw_irecv(t, rc, &mut into, 9, rmr);
            }
            if sreq.is_null() {
                let isend = t.isend.expect("isend");
                let rc_ = isend(
                    sc,
                    data.as_mut_ptr().cast(),
                    data.len(),
                    9,
                    smr,
                    null_mut(),
                    &mut sreq,
                );
                assert_eq!(rc_, ncclResult_t::ncclSuccess, "isend");
            }
        }
    }
    let (mut sdone, mut rdone) = (0, 0);
    while sdone == 0 || rdone == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the transfer never ended"
        );
        let mut sizes = [0 as c_int; 1];
        // SAFETY: requests the plugin handed out, tested until done.
        unsafe {
            if sdone == 0 {
                assert_eq!(
                    t.test.expect("test")(sreq, &mut sdone, null_mut()),
                    ncclResult_t::ncclSuccess
                );
            }
            if rdone == 0 {
                assert_eq!(
                    t.test.expect("test")(rreq, &mut rdone, sizes.as_mut_ptr()),
                    ncclResult_t::ncclSuccess
                );
            }
        }
    }
    // SAFETY: registrations of these comms, no request in flight.
    unsafe {
        assert_eq!(
            t.deregMr.expect("deregMr")(sc, smr),
            ncclResult_t::ncclSuccess
        );
        assert_eq!(
            t.deregMr.expect("deregMr")(rc, rmr),
            ncclResult_t::ncclSuccess
        );
    }
    into
}

/// A v12 context from `t`'s `init` for communicator `comm_id` of traffic class `class`
/// (`None`: no config, as NCCL passes when the communicator has none).
/// Posts a receive of all of `into` with `tag` on receive comm `rc` through the raw v12
/// table, as NCCL's proxy does, asserting the call succeeded: the request, NULL while the
/// plugin answers "not yet".
///
/// # Safety
/// `rc` is a live receive comm of `t`, `mr` its registration of `into` (or NULL), and `into`
/// stays lent, untouched, until the request tests done.
pub unsafe fn raw_irecv(
    t: &ncclNet_v12_t,
    rc: *mut c_void,
    into: &mut [u8],
    tag: c_int,
    mr: *mut c_void,
) -> *mut c_void {
    // SAFETY: the caller's contract is this one's.
    unsafe { raw_irecv_preset(t, rc, into, tag, mr, null_mut()) }
}

/// [`raw_irecv`] with `*request` set to `preset` before the call, as NCCL presets it to
/// `NCCL_NET_OPTIONAL_RECV_COMPLETION` (0x1) for an LL/LL128 receive.
///
/// # Safety
/// As [`raw_irecv`].
pub unsafe fn raw_irecv_preset(
    t: &ncclNet_v12_t,
    rc: *mut c_void,
    into: &mut [u8],
    tag: c_int,
    mr: *mut c_void,
    preset: *mut c_void,
) -> *mut c_void {
    let mut ptr: *mut c_void = into.as_mut_ptr().cast();
    let (mut size, mut tag, mut mr) = (into.len(), tag, mr);
    let mut request: *mut c_void = preset;
    // SAFETY: arrays of one entry each and a valid out-pointer; the rest is the caller's.
    let code = unsafe {
        t.irecv.expect("irecv")(
            rc,
            1,
            &mut ptr,
            &mut size,
            &mut tag,
            &mut mr,
            null_mut(),
            &mut request,
        )
    };
    assert_eq!(code, ncclResult_t::ncclSuccess, "irecv");
    request
}

/// Closes a connected pair, its listen comm and their context through the raw v12 table, in
/// NCCL's order (comms, then the context), asserting each call succeeded.
///
/// # Safety
/// Live comms and context of `t`, none used again.
pub unsafe fn raw_close_all(
    t: &ncclNet_v12_t,
    sc: *mut c_void,
    rc: *mut c_void,
    lc: *mut c_void,
    ctx: *mut c_void,
) {
    // SAFETY: per this function's contract, each closed or finalized once.
    unsafe {
        let ok = ncclResult_t::ncclSuccess;
        assert_eq!(t.closeSend.expect("closeSend")(sc), ok, "closeSend");
        assert_eq!(t.closeRecv.expect("closeRecv")(rc), ok, "closeRecv");
        assert_eq!(t.closeListen.expect("closeListen")(lc), ok, "closeListen");
        assert_eq!(t.finalize.expect("finalize")(ctx), ok, "finalize");
    }
}

/// Sockets this process holds.
pub fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("socket:"))
        .count()
}

/// The plugin's v12 table, with the library kept loaded for the process's life.
pub fn table_v12() -> &'static ncclNet_v12_t {
    // SAFETY: ncclNetPlugin_v12 is a ncclNet_v12_t in our headers.
    unsafe { library_table::<ncclNet_v12_t>("ncclNetPlugin_v12") }
}

/// A context from `t`'s `init` for communicator `comm_id` (with traffic class `class`),
/// checked to be made.
pub fn raw_context(t: &ncclNet_v12_t, comm_id: u64, class: Option<i32>) -> *mut c_void {
    let mut config = class.map(|c| ncclNetCommConfig_v10_t { trafficClass: c });
    let config_ptr = config.as_mut().map_or(null_mut(), |c| c as *mut _);
    let mut ctx: *mut c_void = null_mut();
    // SAFETY: a valid out-pointer and config (or NULL); NULL logger and profiler are allowed.
    let rc = unsafe { t.init.expect("init")(&mut ctx, comm_id, config_ptr, None, None) };
    assert_eq!(rc, ncclResult_t::ncclSuccess, "init");
    assert!(!ctx.is_null(), "init returned no context");
    ctx
}

/// A connected (sendComm, recvComm, listenComm) on device 0 of `ctx`, through `t`'s listen,
/// connect and accept, as NCCL calls them.
pub fn raw_connected(
    t: &ncclNet_v12_t,
    ctx: *mut c_void,
) -> (*mut c_void, *mut c_void, *mut c_void) {
    let mut handle = [0u8; 128];
    let mut lc = null_mut();
    // SAFETY: a 128-byte handle buffer and valid out-pointers, as NCCL passes them.
    let rc = unsafe { t.listen.expect("listen")(ctx, 0, handle.as_mut_ptr().cast(), &mut lc) };
    assert_eq!(rc, ncclResult_t::ncclSuccess, "listen");
    let (sc, rc) = raw_connect_pair(t, lc, |sc| {
        let mut dev = null_mut();
        // SAFETY: the same handle memory every call, as NCCL does; valid out-pointers.
        unsafe { t.connect.expect("connect")(ctx, 0, handle.as_mut_ptr().cast(), sc, &mut dev) }
    });
    (sc, rc, lc)
}

/// Connects with `connect` (one call of some table's `connect`, returning its code) and
/// accepts on `listen_comm` until both ends are up: (sendComm, recvComm).
pub fn raw_connect_pair(
    t: &ncclNet_v12_t,
    listen_comm: *mut c_void,
    mut connect: impl FnMut(&mut *mut c_void) -> ncclResult_t,
) -> (*mut c_void, *mut c_void) {
    let (mut sc, mut rc): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = Instant::now();
    while sc.is_null() || rc.is_null() {
        assert!(start.elapsed() < Duration::from_secs(30), "no connection");
        if sc.is_null() {
            assert_eq!(connect(&mut sc), ncclResult_t::ncclSuccess, "connect");
        }
        if rc.is_null() {
            let mut dev = null_mut();
            // SAFETY: the listenComm listen returned; valid out-pointers.
            assert_eq!(
                unsafe { t.accept.expect("accept")(listen_comm, &mut rc, &mut dev) },
                ncclResult_t::ncclSuccess
            );
        }
    }
    (sc, rc)
}

/// The control API (`nccl_headers/nccl_lossy_control.h`) of the copy of the plugin library
/// this process already loaded (through the harness's client), for tests that drive the
/// training side beside NCCL's calls.
pub struct LoadedControl {
    pub set_enabled: extern "C" fn(c_int) -> c_int,
    pub set_phase: extern "C" fn(c_int) -> c_int,
    pub set_step: extern "C" fn(u64) -> c_int,
    pub write_stats: extern "C" fn() -> c_int,
    stats_json: extern "C" fn(*mut std::ffi::c_char, usize) -> i64,
}

impl LoadedControl {
    /// Binds the control API of [`library`], which must be loaded already (the handle is
    /// never closed, so the copy stays loaded).
    pub fn of_loaded_library() -> LoadedControl {
        let path = std::ffi::CString::new(library().to_str().expect("utf-8 path")).expect("no NUL");
        // SAFETY: a valid C string; RTLD_NOLOAD only hands back the copy already loaded.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(!handle.is_null(), "the plugin is not loaded");
        let sym = |name: &str| {
            let c_name = std::ffi::CString::new(name).expect("no NUL");
            // SAFETY: a live handle and a valid C string.
            let sym = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
            assert!(!sym.is_null(), "no {name}");
            sym
        };
        // SAFETY: each symbol has the signature the control header declares for it.
        unsafe {
            LoadedControl {
                set_enabled: std::mem::transmute::<*mut c_void, extern "C" fn(c_int) -> c_int>(
                    sym("ncclLossySetEnabled"),
                ),
                set_phase: std::mem::transmute::<*mut c_void, extern "C" fn(c_int) -> c_int>(sym(
                    "ncclLossySetPhase",
                )),
                set_step: std::mem::transmute::<*mut c_void, extern "C" fn(u64) -> c_int>(sym(
                    "ncclLossySetStep",
                )),
                write_stats: std::mem::transmute::<*mut c_void, extern "C" fn() -> c_int>(sym(
                    "ncclLossyWriteStats",
                )),
                stats_json: std::mem::transmute::<
                    *mut c_void,
                    extern "C" fn(*mut std::ffi::c_char, usize) -> i64,
                >(sym("ncclLossyStatsJson")),
            }
        }
    }

    /// The process's statistics now (`ncclLossyStatsJson`).
    pub fn stats(&self) -> serde_json::Value {
        let mut buf = vec![0u8; 4 << 20];
        let n = (self.stats_json)(buf.as_mut_ptr().cast(), buf.len());
        assert!(
            n > 0 && (n as usize) < buf.len(),
            "ncclLossyStatsJson returned {n}"
        );
        serde_json::from_slice(&buf[..n as usize]).expect("statistics JSON")
    }
}

/// A child process's `init` of [`library`] and nothing else: says `INIT ok` or
/// `INIT failed: why` on stdout, for the parent to read.
pub fn say_init_outcome() {
    let lib = lossy_cli::harness::plugin_client::PluginLibrary::open(&library()).expect("dlopen");
    match lossy_cli::harness::plugin_client::PluginClient::init(&lib, 12, 900) {
        Ok(_) => say("INIT ok"),
        Err(e) => say(&format!("INIT failed: {e}")),
    }
}
