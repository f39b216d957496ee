//! Loss effects on real sockets: each effect on chosen packets, and random traffic with every effect.

use super::*;

#[test]
fn zero_effect_zeroes_exactly_the_lost_packets() {
    for nsocks in [1, 3] {
        let (data, into, _) = run_lossy(Effect::Zero, nsocks);
        for (i, (&d, &g)) in data.iter().zip(&into).enumerate() {
            let want = if in_lost_packet(i, 4096) { 0 } else { d };
            assert_eq!(g, want, "byte {i} with {nsocks} sockets");
        }
    }
}

#[test]
fn stale_effect_keeps_old_contents_in_lost_packets() {
    for nsocks in [1, 3] {
        let (data, into, _) = run_lossy(Effect::Stale, nsocks);
        for (i, (&d, &g)) in data.iter().zip(&into).enumerate() {
            let want = if in_lost_packet(i, 4096) { 0x3c } else { d };
            assert_eq!(g, want, "byte {i} with {nsocks} sockets");
        }
    }
}

#[test]
fn retransmit_effect_is_bit_exact_and_slower() {
    for nsocks in [1, 3] {
        let (data, into, elapsed) = run_lossy(Effect::Retransmit, nsocks);
        assert!(into == data, "{nsocks} sockets");
        // Four loss events at 20 ms each.
        assert!(
            elapsed >= Duration::from_millis(80),
            "took only {elapsed:?}"
        );
    }
}

#[test]
fn bitflip_effect_flips_one_bit_in_each_lost_packet() {
    for nsocks in [1, 3] {
        let (data, into, _) = run_lossy(Effect::Bitflip, nsocks);
        let packets = effect::packet_count(LOSSY_SIZE, 4096) as usize;
        for p in 0..packets {
            let r = p * 4096..((p + 1) * 4096).min(LOSSY_SIZE);
            let diff: u32 = data[r.clone()]
                .iter()
                .zip(&into[r.clone()])
                .map(|(a, b)| (a ^ b).count_ones())
                .sum();
            let want = u32::from(in_lost_packet(r.start, 4096));
            assert_eq!(diff, want, "packet {p} with {nsocks} sockets");
        }
    }
}

#[test]
fn random_traffic_with_grouped_receives_and_every_effect() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for nsocks in [1, 2, 3, 4] {
        let t = loopback(nsocks);
        let (send, recv) = connect_pair(&t);
        for round in 0..25 {
            let n = rng.gen_range(1..=4);
            let buf_tags: Vec<i32> = (0..n).map(|_| rng.gen_range(0..3)).collect();
            // Messages carry the same tags in a shuffled order.
            let mut msg_tags = buf_tags.clone();
            for i in (1..n).rev() {
                msg_tags.swap(i, rng.gen_range(0..=i));
            }
            // Message i goes to the rank-th buffer with its tag, rank = earlier messages with it.
            let target: Vec<usize> = (0..n)
                .map(|i| {
                    let rank = msg_tags[..i].iter().filter(|&&t| t == msg_tags[i]).count();
                    (0..n)
                        .filter(|&b| buf_tags[b] == msg_tags[i])
                        .nth(rank)
                        .expect("buffer")
                })
                .collect();
            let sizes: Vec<usize> = (0..n)
                .map(|_| match rng.gen_range(0..4) {
                    0 => rng.gen_range(0..100),
                    1 => rng.gen_range(60_000..140_000),
                    _ => rng.gen_range(0..(1 << 20)),
                })
                .collect();
            let mut data: Vec<Vec<u8>> = sizes.iter().map(|&len| pattern(len, rng.gen())).collect();
            let plans: Vec<LossPlan> = sizes
                .iter()
                .map(|&len| random_plan(&mut rng, len))
                .collect();
            let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); n];
            for i in 0..n {
                bufs[target[i]] = pattern(sizes[i] + rng.gen_range(0..100), rng.gen());
            }
            let before = bufs.clone();
            // SAFETY: the buffer outlives the request and is touched again only after it ended.
            let hb: Vec<HostBuf> = bufs
                .iter_mut()
                .map(|b| unsafe { HostBuf::from_slice(b) })
                .collect();
            let r = recv.irecv(&hb, &buf_tags).expect("irecv").expect("slot");
            let ids: Vec<_> = (0..n)
                .map(|i| {
                    // SAFETY: the buffer outlives the request and is touched again only after it
                    // ended.
                    send.isend(
                        unsafe { HostBuf::from_slice(&mut data[i]) },
                        msg_tags[i],
                        &plans[i],
                    )
                    .expect("isend")
                    .expect("slot")
                })
                .collect();
            for (i, id) in ids.into_iter().enumerate() {
                let c = wait("send", || send.test(id)).expect("send");
                assert_eq!(c.sizes(), &[sizes[i]]);
            }
            let c = wait("recv", || recv.test(r)).expect("recv");
            for i in 0..n {
                let b = target[i];
                assert_eq!(c.sizes[b], sizes[i], "{nsocks} sockets, round {round}");
                let want = expected_after(&data[i], &before[b], &plans[i]);
                assert!(
                    bufs[b][..sizes[i]] == want[..],
                    "{nsocks} sockets, round {round}, message {i}: {:?}",
                    plans[i].effect
                );
                assert!(
                    bufs[b][sizes[i]..] == before[b][sizes[i]..],
                    "past the message"
                );
            }
        }
    }
}
