//! Damaged data streams from a raw peer that then closes every socket: whatever the damage,
//! every posted receive must end (complete or fail at `test`), never hang, never panic.

use std::net::Shutdown;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::transport::RequestId;

/// The bytes a sender of ours writes on each of `n` sockets for `msgs` (payload and plan).
fn streams(msgs: &[(Vec<u8>, LossPlan)], n: usize) -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new(); n];
    for (seq, (data, plan)) in msgs.iter().enumerate() {
        let size = data.len();
        let k = chunk_count(size, n);
        for j in 0..k {
            let s = (seq % n + j) % n;
            let span = chunk_span(size, k, j);
            let runs = effect::runs_in_span(&plan.lost, plan.mtu, span.clone());
            let h = Header {
                seq: seq as u64,
                chunk: j as u8,
                size: size as u64,
                tag: 0,
                effect: plan.effect,
                mtu: plan.mtu,
                runs: runs.len() as u32,
                retransmit_ns: 0,
                flip_seed: plan.flip_seed,
            };
            let w = &mut out[s];
            w.extend_from_slice(&h.encode());
            wire::encode_runs(runs, w);
            let segs: Vec<_> = match plan.effect {
                Effect::Zero | Effect::Stale => {
                    effect::kept_ranges(runs, plan.mtu, size, span).collect()
                }
                Effect::Retransmit => std::iter::once(span.clone())
                    .chain(effect::lost_ranges(runs, plan.mtu, size, span))
                    .collect(),
                Effect::Bitflip => vec![span],
            };
            for r in segs {
                w.extend_from_slice(&data[r]);
            }
        }
    }
    out
}

/// One kind of damage to the streams, chosen by `rng`; `None` for none.
fn damage(rng: &mut StdRng, streams: &mut [Vec<u8>]) -> Option<String> {
    let s = rng.gen_range(0..streams.len());
    let n = streams.len();
    if n > 1 && rng.gen_bool(0.15) {
        let o = (s + 1) % n;
        streams.swap(s, o);
        return Some(format!("sockets {s} and {o} swapped"));
    }
    let w = &mut streams[s];
    match rng.gen_range(0..5) {
        0 if !w.is_empty() => {
            let at = rng.gen_range(0..w.len());
            let bit = 1u8 << rng.gen_range(0..8);
            w[at] ^= bit;
            Some(format!("socket {s}: byte {at} ^= {bit:#x}"))
        }
        1 if !w.is_empty() => {
            let at = rng.gen_range(0..w.len());
            w.truncate(at);
            Some(format!("socket {s}: cut at {at}"))
        }
        2 => {
            let at = rng.gen_range(0..=w.len());
            let len = rng.gen_range(1..100);
            let junk: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            w.splice(at..at, junk);
            Some(format!("socket {s}: {len} random bytes at {at}"))
        }
        3 if w.len() >= wire::HEADER_SIZE => {
            // A field of the first header set to a random value.
            let at = rng.gen_range(0..wire::HEADER_SIZE);
            w[at] = rng.gen();
            Some(format!("socket {s}: header byte {at} random"))
        }
        _ => None,
    }
}

#[test]
fn damaged_streams_then_a_close_end_every_receive() {
    let t = loopback(3);
    let mut failed = 0;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for case in 0..300 {
        let n = rng.gen_range(1..=3u16);
        let count = rng.gen_range(1..=4);
        let msgs: Vec<(Vec<u8>, LossPlan)> = (0..count)
            .map(|i| {
                let size =
                    [0, 1, 1000, MIN_CHUNK, 2 * MIN_CHUNK + 7, 3 * MIN_CHUNK][rng.gen_range(0..6)];
                let data = pattern(size, case * 10 + i);
                let plan = if rng.gen_bool(0.5) {
                    LossPlan::lossless()
                } else {
                    random_plan(&mut rng, size)
                };
                (data, plan)
            })
            .collect();
        let mut bytes = streams(&msgs, usize::from(n));
        let damaged = if rng.gen_bool(0.8) {
            damage(&mut rng, &mut bytes)
        } else {
            None
        };
        let (recv, socks) = raw_peer(&t, n);
        let mut bufs: Vec<Vec<u8>> = msgs
            .iter()
            .map(|(d, _)| vec![0u8; d.len() + rng.gen_range(0..2)])
            .collect();
        let ids: Vec<RequestId> = bufs
            .iter_mut()
            .map(|b| {
                recv
                    // SAFETY: `bufs` outlives the receives: they all end (checked) before
                    // `bufs` is dropped.
                    .irecv(&[unsafe { HostBuf::from_slice(b) }], &[0])
                    .expect("irecv")
                    .expect("slot")
            })
            .collect();
        let writers: Vec<_> = socks
            .into_iter()
            .zip(bytes)
            .map(|(mut sock, w)| {
                std::thread::spawn(move || {
                    let _ = sock.write_all(&w);
                    let _ = sock.shutdown(Shutdown::Write);
                    sock
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut outcomes: Vec<Option<crate::Result<Completion>>> =
            ids.iter().map(|_| None).collect();
        while outcomes.iter().any(Option::is_none) {
            for (i, &id) in ids.iter().enumerate() {
                if outcomes[i].is_none() {
                    outcomes[i] = recv.test(id).transpose();
                }
            }
            assert!(
                Instant::now() < deadline,
                "case {case}: {n} sockets, damage {damaged:?}: receives still pending: {:?}",
                outcomes.iter().map(Option::is_some).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        for o in &outcomes {
            if let Some(Err(e)) = o {
                assert!(
                    !e.message.contains("panicked"),
                    "case {case}: damage {damaged:?}: {e}"
                );
                failed += 1;
            }
        }
        if damaged.is_none() {
            for (i, o) in outcomes.iter().enumerate() {
                assert!(
                    matches!(o, Some(Ok(c)) if c.sizes[0] == msgs[i].0.len()),
                    "case {case}: an undamaged stream failed: {o:?}"
                );
            }
        }
        // The peer closed every socket: one more receive can only fail, and must.
        let mut extra = vec![0u8; 8];
        let id = recv
            // SAFETY: `extra` outlives the receive, which ends (checked) before it is dropped.
            .irecv(&[unsafe { HostBuf::from_slice(&mut extra) }], &[0])
            .expect("irecv")
            .expect("slot");
        let end = wait("the receive after the close", || match recv.test(id) {
            Ok(None) => Ok(None),
            other => Ok(Some(other)),
        })
        .expect("wait");
        assert!(
            end.is_err(),
            "case {case}: a receive after the peer closed: {end:?}"
        );
        drop(recv);
        for w in writers {
            drop(w.join().expect("writer"));
        }
    }
    println!("damaged streams: {failed} receives failed, the rest completed");
}
