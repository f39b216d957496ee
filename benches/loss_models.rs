//! Packets per second each loss model decides, at 0.1%, 1% and 10% loss, and the engine's
//! `plan()` on 1 MiB messages. A plain timing table (no harness): `cargo bench --bench loss_models`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use nccl_net_lossy::loss::engine::StreamKey;
use nccl_net_lossy::loss::model::{ModelSpec, ModelState};
use nccl_net_lossy::loss::plan::LossPlan;
use nccl_net_lossy::loss::rng::stream_rng;
use nccl_net_lossy::loss::rules::{Direction, MatchContext};
use nccl_net_lossy::profile::Profile;

/// Runs `f` (which handles `per_call` packets) for about `budget`; returns packets per second.
fn rate(budget: Duration, per_call: u64, mut f: impl FnMut()) -> f64 {
    for _ in 0..100 {
        f();
    }
    let start = Instant::now();
    let mut calls = 0u64;
    while start.elapsed() < budget {
        for _ in 0..64 {
            f();
        }
        calls += 64;
    }
    (calls * per_call) as f64 / start.elapsed().as_secs_f64()
}

fn models(loss: f64) -> Vec<(&'static str, ModelSpec)> {
    // markov4 with p32 = p14 = 0: loss p13/(p13+p31), bursts of 1/p31 = 4 packets.
    let p31 = 0.25;
    vec![
        ("uniform", ModelSpec::Uniform { rate: loss }),
        (
            "gilbert_elliott (burst 8)",
            ModelSpec::gilbert_elliott_from_rate(loss, 8.0).expect("valid"),
        ),
        (
            "gilbert_elliott (h_loss 0.5, k_loss 0)",
            // Half the Bad packets lost, bursts of Bad of 1/r = 16: p = 2·loss·r/(1-2·loss).
            ModelSpec::GilbertElliott {
                p: 2.0 * loss * (1.0 / 16.0) / (1.0 - 2.0 * loss),
                r: 1.0 / 16.0,
                h_loss: 0.5,
                k_loss: 0.0,
            },
        ),
        (
            "markov4 (burst 4)",
            ModelSpec::Markov4 {
                p13: loss * p31 / (1.0 - loss),
                p31,
                p32: 0.0,
                p23: 1.0,
                p14: 0.0,
            },
        ),
    ]
}

fn main() {
    let budget = Duration::from_millis(400);
    println!(
        "model                                   loss   expected   Mpackets/s (64Ki-packet calls)"
    );
    for &loss in &[0.001, 0.01, 0.1] {
        for (name, spec) in models(loss) {
            let mut state = ModelState::new(&spec, stream_rng(1));
            let mut runs = Vec::with_capacity(1 << 16);
            let packets = 1u64 << 16;
            let r = rate(budget, packets, || {
                runs.clear();
                state.fill(packets, &mut runs);
                black_box(&runs);
            });
            println!(
                "{name:<38} {:>5}%  {:>8.4}%  {:>10.0}",
                loss * 100.0,
                spec.expected_loss_rate() * 100.0,
                r / 1e6
            );
        }
    }
    println!();
    println!("engine plan(), 1 MiB messages (256 packets at mtu 4096)");
    println!("profile                                 loss   ns/message   Mpackets/s");
    for &loss in &[0.0, 0.001, 0.01, 0.1] {
        for (name, model) in [
            (
                "uniform",
                format!("{{ kind = \"uniform\", rate = {loss} }}"),
            ),
            (
                "gilbert_elliott (burst 8)",
                format!("{{ kind = \"gilbert_elliott\", rate = {loss}, mean_burst = 8 }}"),
            ),
        ] {
            let text = format!(
                "seed = 1\nmtu = 4096\neffect = \"zero\"\nmodel = {model}\n[[rules]]\ncollective = \"AllGather\"\nmodel = \"none\"\n"
            );
            let profile = Profile::parse(&text, "bench", "").expect("profile");
            let engine = profile.loss_engine();
            let mut stream = engine.stream(StreamKey {
                rank: 0,
                comm: 1,
                peer: 1,
                direction: Direction::Send,
                conn: 0,
            });
            let ctx = MatchContext::default();
            let mut plan = LossPlan::default();
            let r = rate(budget, 256, || {
                black_box(stream.plan(&ctx, 1 << 20, &mut plan));
            });
            println!(
                "{name:<38} {:>5}%  {:>10.1}   {:>10.0}",
                loss * 100.0,
                256.0 / r * 1e9,
                r / 1e6
            );
        }
    }
}
