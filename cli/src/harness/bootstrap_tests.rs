//! Tests of the rendezvous (`bootstrap.rs`).

use super::*;

#[test]
fn ranks_gather_blobs_in_rank_order_and_the_server_ends_with_them() {
    let server = BootstrapServer::start(3, Duration::from_secs(10)).expect("server");
    let addr = server.addr();
    let threads: Vec<_> = (0..3)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut b =
                    Bootstrap::connect(addr, rank, 3, Duration::from_secs(10)).expect("join");
                let all = b.all_gather(&[rank as u8; 5][..rank + 1]).expect("gather");
                b.barrier().expect("barrier");
                all
            })
        })
        .collect();
    for t in threads {
        let all = t.join().expect("rank thread");
        assert_eq!(all, vec![vec![0u8], vec![1, 1], vec![2, 2, 2]]);
    }
    server.join().expect("server ends cleanly");
}

#[test]
fn a_rank_that_never_comes_fails_the_server_in_time() {
    let server = BootstrapServer::start(2, Duration::from_millis(300)).expect("server");
    let _only = Bootstrap::connect(server.addr(), 0, 2, Duration::from_secs(5)).expect("join");
    let err = server.join().expect_err("missing rank");
    assert!(err.message.contains("1 of 2"), "{err}");
}

#[test]
fn a_rank_of_another_job_is_refused_on_both_sides() {
    let server = BootstrapServer::start_with(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        nranks: 2,
        connect_timeout: Duration::from_secs(5),
        round_timeout: Duration::from_secs(5),
        job_id: "job-a".into(),
        watch: false,
    })
    .expect("server");
    let t = Duration::from_secs(5);
    let mut first = Bootstrap::connect_job(server.addr(), 0, 2, "job-a", t).expect("join");
    let err = Bootstrap::connect_job(server.addr(), 1, 2, "job-b", t)
        .err()
        .expect("refused");
    assert!(
        err.message.contains("job-a") && err.message.contains("job-b"),
        "{err}"
    );
    let err = first.barrier().expect_err("the run is over");
    assert!(err.message.contains("job-b"), "{err}");
    assert!(server.join().is_err());
}

#[test]
fn idle_connections_hold_no_more_than_a_bounded_number_of_the_servers_fds() {
    // Connections that never say a word (a port scanner, a half-open flood) each held one of
    // the server's descriptors until the ranks all came: enough of them ran it out of fds and
    // failed the job at `accept`. Beyond MAX_PENDING the oldest is dropped, the job goes on.
    let server = BootstrapServer::start(2, Duration::from_secs(20)).expect("server");
    let addr = server.addr();
    let extra = 40;
    let idle: Vec<TcpStream> = (0..MAX_PENDING + extra)
        .map(|_| TcpStream::connect(addr).expect("idle connection"))
        .collect();
    // The server sees them all while the ranks are still away; the first `extra` must be
    // closed by it (read returns 0) well before the ranks come.
    let mut closed = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    for stream in &idle[..extra] {
        let left = deadline.saturating_duration_since(Instant::now());
        stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .expect("timeout");
        let mut byte = [0u8; 1];
        if matches!((&*stream).read(&mut byte), Ok(0)) {
            closed += 1;
        }
    }
    assert_eq!(closed, extra, "the oldest idle connections were kept");
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut b =
                    Bootstrap::connect(addr, rank, 2, Duration::from_secs(10)).expect("join");
                b.barrier().expect("barrier");
            })
        })
        .collect();
    for rank in ranks {
        rank.join().expect("rank");
    }
    server.join().expect("the job goes on");
}
