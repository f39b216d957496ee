//! Throughput of the socket transport over loopback, against plain TCP with the same number
//! of streams, both ends in this process.
//!
//! `cargo run --release --example transport_throughput -- [MiB per message] [messages] [sockets,...] [in flight]`
//! (defaults: 64 MiB, 24 messages, 1,2,4 sockets, 2 in flight).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use nccl_net_lossy::loss::plan::LossPlan;
use nccl_net_lossy::transport::socket::{IfaceAddr, SocketConfig, SocketTransport};
use nccl_net_lossy::transport::{HostBuf, Transport, HANDLE_WIRE_SIZE};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn gbps(bytes: usize, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

/// Plain TCP: stream `i` carries bytes `i/n .. (i+1)/n` of every message, one thread per end.
fn raw_tcp(streams: usize, size: usize, messages: usize) -> Res<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let part = size / streams;
    let start = Instant::now();
    std::thread::scope(|scope| -> Res<()> {
        let mut joins = Vec::new();
        for _ in 0..streams {
            let mut tx = TcpStream::connect(addr)?;
            tx.set_nodelay(true)?;
            let (mut rx, _) = listener.accept()?;
            joins.push(scope.spawn(move || -> std::io::Result<()> {
                let buf = vec![1u8; part];
                for _ in 0..messages {
                    tx.write_all(&buf)?;
                }
                Ok(())
            }));
            joins.push(scope.spawn(move || -> std::io::Result<()> {
                let mut buf = vec![0u8; part];
                for _ in 0..messages {
                    rx.read_exact(&mut buf)?;
                }
                Ok(())
            }));
        }
        for j in joins {
            j.join().map_err(|_| "a stream thread panicked")??;
        }
        Ok(())
    })?;
    Ok(gbps(part * streams * messages, start.elapsed()))
}

/// What the polling thread does when nothing completed: NCCL's proxy yields; on a machine
/// with few cores a short sleep leaves more time to the I/O threads (`POLL_SLEEP_US`).
fn idle() {
    match std::env::var("POLL_SLEEP_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        Some(us) if us > 0 => std::thread::sleep(Duration::from_micros(us)),
        _ => std::thread::yield_now(),
    }
}

/// The plugin's transport, polled the way NCCL's proxy thread does.
fn plugin(sockets: usize, size: usize, messages: usize, in_flight: usize) -> Res<f64> {
    let lo = IfaceAddr {
        name: "lo".into(),
        ip: "127.0.0.1".parse()?,
        scope_id: 0,
        is_loopback: true,
        running: true,
    };
    let config = SocketConfig {
        nsocks: sockets,
        ..SocketConfig::from_env()?
    };
    let t = SocketTransport::with_interfaces(config, vec![lo]);
    // Declared before the connections, so they outlive every request lent them.
    let mut data = vec![1u8; size];
    let mut into: Vec<Vec<u8>> = (0..in_flight).map(|_| vec![0u8; size]).collect();
    let mut handle = [0u8; HANDLE_WIRE_SIZE];
    let mut listener = t.listen(0, None, &mut handle)?;
    let mut connector = t.connect(0, None, &handle)?;
    let (mut send, mut recv) = (None, None);
    while send.is_none() || recv.is_none() {
        if send.is_none() {
            send = connector.poll()?;
        }
        if recv.is_none() {
            recv = listener.poll_accept()?;
        }
    }
    let (send, recv) = (send.ok_or("no send")?, recv.ok_or("no recv")?);
    let plan = LossPlan::lossless();
    // SAFETY: `data` outlives the connections (declared before them) and is only read, by
    // the sends, until the function returns.
    let src = unsafe { HostBuf::from_slice(&mut data) };
    // SAFETY: each buffer of `into` outlives the connections and is lent to one receive at a
    // time (a slot is reused only after its receive completed); nothing else touches it.
    let dst: Vec<HostBuf> = into
        .iter_mut()
        .map(|b| unsafe { HostBuf::from_slice(b) })
        .collect();
    let (mut posted, mut done) = (0, 0);
    // (send, receive, buffer); a request leaves its slot (None) once it tested done.
    let mut pending: Vec<(Option<u32>, Option<u32>, usize)> = Vec::new();
    let start = Instant::now();
    while done < messages {
        while posted < messages && pending.len() < in_flight {
            let slot = (0..in_flight)
                .find(|i| pending.iter().all(|p| p.2 != *i))
                .ok_or("no free buffer")?;
            let r = recv.irecv(&[dst[slot]], &[0])?.ok_or("no recv slot")?;
            let s = send.isend(src, 0, &plan)?.ok_or("no send slot")?;
            pending.push((Some(s), Some(r), slot));
            posted += 1;
        }
        // Every request in flight is tested each round, as NCCL's proxy does: with no pool
        // thread the transport moves bytes only inside these calls, so a receive left
        // untested would stall its send.
        let mut progressed = false;
        let mut i = 0;
        while i < pending.len() {
            let (s, r, _) = &mut pending[i];
            if let Some(id) = *s {
                if send.test(id)?.is_some() {
                    *s = None;
                }
            }
            if let Some(id) = *r {
                if recv.test(id)?.is_some() {
                    *r = None;
                }
            }
            if s.is_none() && r.is_none() {
                pending.remove(i);
                done += 1;
                progressed = true;
            } else {
                i += 1;
            }
        }
        if !progressed {
            idle();
        }
    }
    Ok(gbps(size * messages, start.elapsed()))
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.first().map_or(Ok(64), |a| a.parse())?;
    let messages: usize = args.get(1).map_or(Ok(24), |a| a.parse())?;
    let socks: Vec<usize> = args
        .get(2)
        .map_or("1,2,4", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let in_flight: usize = args.get(3).map_or(Ok(2), |a| a.parse())?;
    let size = mib << 20;
    println!("{mib} MiB messages, {messages} per run, {in_flight} in flight");
    println!("sockets  plugin GB/s  raw TCP GB/s  plugin/raw");
    for n in socks {
        let raw = raw_tcp(n, size, messages)?;
        let ours = plugin(n, size, messages, in_flight)?;
        println!(
            "{n:7}  {ours:11.2}  {raw:12.2}  {:9.0}%",
            100.0 * ours / raw
        );
    }
    Ok(())
}
