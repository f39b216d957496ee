//! A rank of `lossy demo`/`bench` joining a rendezvous that is not ours, or that lies: a rank
//! given the wrong `--rendezvous` (another program's port) must fail with an error naming the
//! rendezvous, never crash or print what the other end sent whole.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use std::time::Duration;

use common::lossy_exe;

/// A server on loopback that answers every connection with what `answer` writes (after
/// reading the rank's hello), for as long as the test runs.
fn hostile_rendezvous(answer: fn(&mut TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut stream = stream;
                // The whole hello (24 bytes and the job id): unread input would reset the
                // connection at the close, losing the answer.
                let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
                let mut hello = [0u8; 4096];
                while matches!(stream.read(&mut hello), Ok(n) if n > 0) {}
                answer(&mut stream);
                let _ = stream.shutdown(std::net::Shutdown::Write);
                std::thread::sleep(Duration::from_secs(5));
            });
        }
    });
    addr
}

/// Rank 1 of 2 of `command`, joining the rendezvous at `addr`.
fn rank_one(command: &str, addr: &str) -> Output {
    let mut cmd = Command::new(lossy_exe());
    cmd.args([
        command,
        "--rank",
        "1",
        "--world",
        "2",
        "--rendezvous",
        addr,
        "--rendezvous-timeout",
        "2",
    ])
    .env("NCCL_SOCKET_IFNAME", "lo")
    .env("RUST_BACKTRACE", "0")
    .env_remove("NCCL_LOSSY_STATS")
    .env_remove("NCCL_LOSSY_SET")
    .env_remove("NCCL_LOSSY_PROFILE");
    common::output_within_10s(&mut cmd, &format!("lossy {command} --rank 1"))
}

#[test]
fn a_rendezvous_answering_with_endless_error_markers_fails_the_rank_without_crashing() {
    // Every frame length of all ones announces an error message, whose own length was read
    // as a frame again: a peer sending 0xff bytes made the rank recurse once per 8 bytes
    // until its stack overflowed (SIGABRT, "has overflowed its stack").
    let addr = hostile_rendezvous(|stream| {
        let ones = vec![0xffu8; 1 << 16];
        for _ in 0..256 {
            if stream.write_all(&ones).is_err() {
                return;
            }
        }
    });
    for command in ["demo", "bench"] {
        let out = rank_one(command, &addr);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{command}: {:?}: {}",
            out.status,
            &stderr[..stderr.len().min(600)]
        );
        assert!(
            stderr.contains(&addr) && !stderr.contains("overflow") && stderr.len() < 2_000,
            "{command}: {}",
            &stderr[..stderr.len().min(600)]
        );
    }
}

#[test]
fn a_rendezvous_error_message_of_a_megabyte_is_echoed_cut() {
    // An error frame may carry 1 MiB of text, and the rank printed it whole.
    let addr = hostile_rendezvous(|stream| {
        let text = vec![b'x'; 1 << 20];
        let mut frame = u64::MAX.to_le_bytes().to_vec();
        frame.extend_from_slice(&(text.len() as u64).to_le_bytes());
        frame.extend_from_slice(&text);
        let _ = stream.write_all(&frame);
    });
    let out = rank_one("demo", &addr);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        &stderr[..stderr.len().min(600)]
    );
    assert!(
        stderr.len() < 2_000 && stderr.contains("xxx") && stderr.contains("bytes in all"),
        "{} bytes: {}",
        stderr.len(),
        &stderr[..stderr.len().min(600)]
    );
}
