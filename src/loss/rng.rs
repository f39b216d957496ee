//! Seeding and sampling: how each stream gets its own generator from the profile's one seed,
//! and the geometric sampler that lets models skip over runs of packets with one draw.

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

/// The generator every stream uses: small state, a few nanoseconds per draw, `Send`.
pub type StreamRng = SmallRng;

/// A run length that stands for "never ends": large enough that no message reaches it, small
/// enough that adding a message's packet count cannot overflow.
pub const NEVER: u64 = 1 << 62;

/// SplitMix64's output function: a bijection with full avalanche, used to combine seed parts.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce5_e4b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Folds `parts` into `seed` one at a time; every part passes through the mixer, so streams
/// whose keys differ in any one part (even by one bit) get unrelated seeds.
pub fn derive_seed(seed: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(splitmix64(seed), |h, &part| {
        splitmix64(h ^ splitmix64(part))
    })
}

/// A generator for `seed` (expanded by the generator's own seeding, so nearby seeds are fine).
pub fn stream_rng(seed: u64) -> StreamRng {
    StreamRng::seed_from_u64(seed)
}

/// A uniform draw in (0, 1]: never 0, so its logarithm is finite.
#[inline]
pub fn unit_open0(rng: &mut StreamRng) -> f64 {
    ((rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Bernoulli(`q`) failures before the first success, by inversion: one draw and one logarithm
/// per sample instead of one draw per trial.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Geometric {
    q: f64,
    /// 1 / ln(1 - q), precomputed so a sample costs one `ln` and one multiply.
    inv_ln_fail: f64,
}

impl Geometric {
    /// Sampler for success probability `q` (clamped into [0, 1]).
    pub fn new(q: f64) -> Geometric {
        let q = if q.is_nan() { 0.0 } else { q.clamp(0.0, 1.0) };
        let ln_fail = (-q).ln_1p();
        let inv_ln_fail = if q > 0.0 && q < 1.0 {
            1.0 / ln_fail
        } else {
            0.0
        };
        Geometric { q, inv_ln_fail }
    }

    /// The success probability.
    pub fn q(&self) -> f64 {
        self.q
    }

    /// Number of failures before the first success; [`NEVER`] when `q` is 0.
    #[inline]
    pub fn sample(&self, rng: &mut StreamRng) -> u64 {
        if self.q >= 1.0 {
            return 0;
        }
        if self.q <= 0.0 {
            return NEVER;
        }
        let x = unit_open0(rng).ln() * self.inv_ln_fail;
        if x < NEVER as f64 {
            x as u64
        } else {
            NEVER
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_seeds_differ_in_every_part() {
        let base = derive_seed(1, &[0, 0, 0]);
        assert_ne!(base, derive_seed(2, &[0, 0, 0]));
        assert_ne!(base, derive_seed(1, &[1, 0, 0]));
        assert_ne!(base, derive_seed(1, &[0, 0, 1]));
        // Swapping parts must change the seed too: position matters.
        assert_ne!(derive_seed(1, &[1, 2]), derive_seed(1, &[2, 1]));
        assert_eq!(base, derive_seed(1, &[0, 0, 0]));
    }

    #[test]
    fn geometric_edges() {
        let mut rng = stream_rng(3);
        assert_eq!(Geometric::new(1.0).sample(&mut rng), 0);
        assert_eq!(Geometric::new(0.0).sample(&mut rng), NEVER);
        assert_eq!(Geometric::new(f64::NAN).sample(&mut rng), NEVER);
        assert!(Geometric::new(1e-300).sample(&mut rng) <= NEVER);
    }

    #[test]
    fn geometric_mean_matches() {
        // Mean of failures before success is (1-q)/q, variance (1-q)/q². With n = 200k samples
        // the mean's std is sqrt((1-q)/q² / n); allow 5 of them.
        for &q in &[0.5, 0.1, 0.01] {
            let g = Geometric::new(q);
            let mut rng = stream_rng(42);
            let n = 200_000u64;
            let sum: u64 = (0..n).map(|_| g.sample(&mut rng)).sum();
            let mean = sum as f64 / n as f64;
            let expect = (1.0 - q) / q;
            let tol = 5.0 * ((1.0 - q) / (q * q) / n as f64).sqrt();
            assert!(
                (mean - expect).abs() < tol,
                "q={q}: {mean} vs {expect} ± {tol}"
            );
        }
    }
}
