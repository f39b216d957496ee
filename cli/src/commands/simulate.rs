//! `lossy simulate`: run a profile's models offline and set what they did next to what their
//! closed forms say they should do in the long run.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

use nccl_net_lossy::error::{echo_at_most, SHOWN_CHARS};
use nccl_net_lossy::loss::model::{short, ModelState};
use nccl_net_lossy::loss::rng::{derive_seed, stream_rng};
use nccl_net_lossy::loss::rules::Action;

/// Arguments of `lossy simulate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Profile file (TOML).
    pub file: PathBuf,
    /// Packets to simulate per model (default: 10,000,000, fewer when the profile has so many
    /// rules that all of them together would pass 1,000,000,000).
    #[arg(long)]
    pub packets: Option<u64>,
    /// Override a dotted key on top of NCCL_LOSSY_SET (repeatable), as `lossy validate` does.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Packets simulated per model unless `--packets` says otherwise.
const DEFAULT_PACKETS: u64 = 10_000_000;

/// Most packets one run simulates over all its models, so that no profile or `--packets`
/// keeps it busy for hours (about a few seconds per 10^8 at high loss rates).
const MAX_PACKETS: u64 = 1_000_000_000;

/// Upper bounds of the burst-length histogram's bins (the last bin is open).
const BINS: [u64; 7] = [1, 2, 4, 8, 16, 32, 64];

/// What one model did over the simulated packets.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Measured {
    /// Packets simulated.
    pub packets: u64,
    /// Packets lost.
    pub lost: u64,
    /// Loss bursts (runs of consecutive losses, joined across chunk boundaries).
    pub bursts: u64,
    /// Burst counts per bin of [`BINS`], plus one open bin.
    pub histogram: [u64; BINS.len() + 1],
}

impl Measured {
    fn add_burst(&mut self, len: u64) {
        self.bursts += 1;
        let bin = BINS.iter().position(|&hi| len <= hi).unwrap_or(BINS.len());
        self.histogram[bin] += 1;
    }

    /// Fraction of packets lost.
    pub fn loss_rate(&self) -> f64 {
        self.lost as f64 / self.packets.max(1) as f64
    }

    /// Mean burst length (0 when nothing was lost).
    pub fn mean_burst(&self) -> f64 {
        if self.bursts == 0 {
            0.0
        } else {
            self.lost as f64 / self.bursts as f64
        }
    }
}

fn bin_label(i: usize) -> String {
    let lo = if i == 0 { 1 } else { BINS[i - 1] + 1 };
    match BINS.get(i) {
        Some(&hi) if hi == lo => format!("{lo}"),
        Some(&hi) => format!("{lo}-{hi}"),
        None => format!("{lo}+"),
    }
}

/// Runs `action`'s model for `packets` packets from `seed`, in chunks the size of a large
/// message, so the state carries across chunk boundaries as it does across messages.
pub fn simulate(action: &Action, seed: u64, packets: u64) -> Measured {
    const CHUNK: u64 = 1 << 16;
    let mut state = ModelState::new(&action.model, stream_rng(seed));
    let mut m = Measured {
        packets,
        ..Measured::default()
    };
    let mut runs = Vec::new();
    // A burst that reaches the end of a chunk may go on in the next.
    let mut open = 0u64;
    let mut done = 0u64;
    while done < packets {
        let n = CHUNK.min(packets - done);
        runs.clear();
        state.fill(n, &mut runs);
        for run in &runs {
            let (start, len) = (u64::from(run.start), u64::from(run.len));
            m.lost += len;
            if start == 0 && open > 0 {
                open += len;
            } else {
                if open > 0 {
                    m.add_burst(open);
                }
                open = len;
            }
            if start + len != n {
                m.add_burst(open);
                open = 0;
            }
        }
        if runs.last().map_or(true, |r| u64::from(r.end()) != n) && open > 0 {
            m.add_burst(open);
            open = 0;
        }
        done += n;
    }
    if open > 0 {
        m.add_burst(open);
    }
    m
}

/// Runs `lossy simulate`.
pub fn run(args: Args) -> ExitCode {
    let fail = |err: String| {
        eprintln!("lossy simulate: {err}");
        ExitCode::from(2)
    };
    // What the plugin would load: NCCL_LOSSY_SET first, then each --set.
    let applied = match super::validate::overrides(&args.set) {
        Ok(applied) => applied,
        Err(err) => return fail(err),
    };
    let layers: Vec<(&str, &str)> = applied
        .iter()
        .map(|(from, set)| (from.as_str(), set.as_str()))
        .collect();
    // What the plugin refuses at init, validate refuses and so does simulate: one verdict.
    let init_env = match super::validate::InitEnv::from_env() {
        Ok(env) => env,
        Err(err) => return fail(err),
    };
    let profile = match super::validate::load_checked(Some(&args.file), &layers, &init_env) {
        Ok(p) => p,
        Err(err) => return fail(err.to_string()),
    };
    let slots: Vec<(String, Option<String>, &Action)> =
        std::iter::once(("defaults".to_string(), None, &profile.defaults))
            .chain(
                profile
                    .rules
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (format!("rules.{i}"), r.name.clone(), &r.action)),
            )
            .collect();
    let models = slots.len() as u64;
    let packets = match args.packets {
        Some(0) => {
            return fail(format!(
                "--packets 0: nothing to measure; allowed: at least 1 and at most {} packets \
                 per model for this profile's {models} models",
                MAX_PACKETS / models
            ));
        }
        Some(n) if n.saturating_mul(models) > MAX_PACKETS => {
            return fail(format!(
                "--packets {n} for each of the profile's {models} models: at most {MAX_PACKETS} \
                 packets are simulated in all, so at most {} each",
                MAX_PACKETS / models
            ));
        }
        Some(n) => n,
        None => DEFAULT_PACKETS.min(MAX_PACKETS / models),
    };
    let mut results = Vec::new();
    for (slot, (label, name, action)) in slots.iter().enumerate() {
        // Its own generator per slot, as each rule has its own stream in the plugin.
        let m = simulate(action, derive_seed(profile.seed, &[slot as u64]), packets);
        results.push((label, name, action, m));
    }
    if args.json {
        let finite = |x: f64| {
            if x.is_finite() {
                json!(x)
            } else {
                serde_json::Value::Null
            }
        };
        let rules: Vec<_> = results
            .iter()
            .map(|(label, name, action, m)| {
                let histogram: Vec<_> = m
                    .histogram
                    .iter()
                    .enumerate()
                    .map(|(i, &count)| json!({"bursts": bin_label(i), "count": count}))
                    .collect();
                json!({
                    "rule": label,
                    "name": name,
                    "model": action.model.describe(),
                    "effect": action.effect,
                    "packets": m.packets,
                    "lost": m.lost,
                    "bursts": m.bursts,
                    "loss_rate": m.loss_rate(),
                    "mean_burst": m.mean_burst(),
                    "expected_loss_rate": finite(action.model.expected_loss_rate()),
                    "expected_mean_burst": finite(action.model.expected_mean_burst()),
                    "histogram": histogram,
                })
            })
            .collect();
        // The profile's JSON names the overrides it was read with.
        let out = json!({"profile": profile.to_json(), "packets": packets, "rules": rules});
        return finish(format!("{out}\n"));
    }
    let mut out = String::new();
    let _ = writeln!(out, "{}", profile.summary());
    for (from, set) in &applied {
        let set = echo_at_most(set.trim(), SHOWN_CHARS, str::to_string);
        let _ = writeln!(out, "  override from {from}: {set}");
    }
    for (label, name, action, m) in &results {
        let name = name
            .as_ref()
            .map(|n| format!(" \"{n}\""))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{label}{name}: {} packets of {}",
            m.packets,
            action.model.describe()
        );
        let _ = writeln!(
            out,
            "  loss rate  {:>10}   expected {}",
            short(m.loss_rate()),
            short(action.model.expected_loss_rate())
        );
        let _ = writeln!(
            out,
            "  mean burst {:>10}   expected {}",
            short(m.mean_burst()),
            short(action.model.expected_mean_burst())
        );
        if m.bursts > 0 {
            let bins: Vec<String> = m
                .histogram
                .iter()
                .enumerate()
                .filter(|(_, &c)| c > 0)
                .map(|(i, &c)| format!("{}: {}", bin_label(i), c))
                .collect();
            let _ = writeln!(out, "  bursts     {} ({})", m.bursts, bins.join(", "));
        }
    }
    finish(out)
}

/// Writes the result; a reader that closed the pipe (`lossy simulate P | head`) ends it
/// quietly.
fn finish(out: String) -> ExitCode {
    match super::write_stdout(&out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("lossy simulate: cannot write the result: {err}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nccl_net_lossy::loss::model::ModelSpec;
    use nccl_net_lossy::loss::plan::Effect;
    use std::time::Duration;

    fn action(model: ModelSpec) -> Action {
        Action {
            effect: Effect::Zero,
            model,
            retransmit_timeout: Duration::ZERO,
            mtu: 4096,
        }
    }

    #[test]
    fn bursts_are_joined_across_chunks_and_binned() {
        // Everything lost: one burst as long as the whole simulation, across many chunks.
        let m = simulate(&action(ModelSpec::Uniform { rate: 1.0 }), 1, 200_000);
        assert_eq!((m.lost, m.bursts), (200_000, 1));
        assert_eq!(m.histogram[BINS.len()], 1);
        let m = simulate(&action(ModelSpec::None), 1, 1000);
        assert_eq!((m.lost, m.bursts, m.mean_burst()), (0, 0, 0.0));
        // Uniform 30%: bursts are geometric, P(len = 1) = 0.7 of bursts. n ≈ 0.3·0.7·1e6
        // = 210k bursts; σ of the fraction = sqrt(0.21/210k) ≈ 0.001; allow 5σ.
        let m = simulate(&action(ModelSpec::Uniform { rate: 0.3 }), 2, 1_000_000);
        assert_eq!(m.histogram.iter().sum::<u64>(), m.bursts);
        let ones = m.histogram[0] as f64 / m.bursts as f64;
        assert!((ones - 0.7).abs() < 0.005, "{ones}");
        assert_eq!(bin_label(0), "1");
        assert_eq!(bin_label(2), "3-4");
        assert_eq!(bin_label(BINS.len()), "65+");
    }
}
