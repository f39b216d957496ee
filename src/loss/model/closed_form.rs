//! What each model does in the long run: closed forms of the loss rate and the mean burst
//! (DESIGN §2), from the chain's stationary distribution.

use crate::loss::model::ModelSpec;

impl ModelSpec {
    /// Long-run fraction of packets lost (closed forms, see DESIGN §2); for a trace, one
    /// pass's fraction (NaN if its file is not loaded).
    pub fn expected_loss_rate(&self) -> f64 {
        match *self {
            ModelSpec::None => 0.0,
            ModelSpec::Uniform { rate } => rate,
            ModelSpec::GilbertElliott {
                p,
                r,
                h_loss,
                k_loss,
            } => {
                if p + r == 0.0 {
                    k_loss
                } else {
                    (k_loss * r + h_loss * p) / (p + r)
                }
            }
            ModelSpec::Markov4 { .. } => {
                let pi = self.stationary();
                pi[2] + pi[3]
            }
            ModelSpec::Trace(ref t) => t.data.as_ref().map_or(f64::NAN, |d| d.loss_rate()),
        }
    }

    /// Long-run mean length of a loss burst (consecutive lost packets): the loss rate divided
    /// by the rate at which bursts start, P(previous packet kept, this one lost). 0 when
    /// nothing is lost, infinite when nothing is ever kept again.
    pub fn expected_mean_burst(&self) -> f64 {
        let (lost, starts) = match *self {
            ModelSpec::None => (0.0, 0.0),
            ModelSpec::Uniform { rate } => (rate, (1.0 - rate) * rate),
            ModelSpec::GilbertElliott { .. } | ModelSpec::Markov4 { .. } => {
                let (pi, t, l) = (self.stationary(), self.transitions(), self.state_loss());
                let mut starts = 0.0;
                for s in 0..4 {
                    for u in 0..4 {
                        starts += pi[s] * (1.0 - l[s]) * t[s][u] * l[u];
                    }
                }
                (self.expected_loss_rate(), starts)
            }
            ModelSpec::Trace(ref t) => {
                return t.data.as_ref().map_or(f64::NAN, |d| d.mean_burst(t.at_end));
            }
        };
        if lost <= 0.0 {
            0.0
        } else if starts <= 0.0 {
            f64::INFINITY
        } else {
            lost / starts
        }
    }

    /// Stationary distribution over the chain's states (Good, Bad for Gilbert-Elliott;
    /// 1..4 for markov4), as reached from the start state.
    fn stationary(&self) -> [f64; 4] {
        let w = match *self {
            ModelSpec::GilbertElliott { p, r, .. } => {
                if p + r == 0.0 {
                    [1.0, 0.0, 0.0, 0.0]
                } else {
                    [r, p, 0.0, 0.0]
                }
            }
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => {
                // Balance: p13·π1 = p31·π3, p23·π2 = p32·π3, π4 = p14·π1.
                if p13 == 0.0 {
                    [1.0, 0.0, 0.0, p14]
                } else if p31 > 0.0 {
                    let w3 = p13 / p31;
                    let w2 = if p32 > 0.0 { p32 * w3 / p23 } else { 0.0 };
                    [1.0, w2, w3, p14]
                } else {
                    // State 1 is left for good: the chain ends up alternating 3 and 2.
                    [0.0, p32 / p23, 1.0, 0.0]
                }
            }
            _ => [1.0, 0.0, 0.0, 0.0],
        };
        let sum: f64 = w.iter().sum();
        w.map(|x| x / sum)
    }

    /// Per-packet transition matrix in the state order of [`Self::stationary`].
    fn transitions(&self) -> [[f64; 4]; 4] {
        match *self {
            ModelSpec::GilbertElliott { p, r, .. } => [
                [1.0 - p, p, 0.0, 0.0],
                [r, 1.0 - r, 0.0, 0.0],
                [0.0; 4],
                [0.0; 4],
            ],
            ModelSpec::Markov4 {
                p13,
                p31,
                p32,
                p23,
                p14,
            } => [
                [1.0 - p13 - p14, 0.0, p13, p14],
                [0.0, 1.0 - p23, p23, 0.0],
                [p31, p32, 1.0 - p31 - p32, 0.0],
                [1.0, 0.0, 0.0, 0.0],
            ],
            _ => [[0.0; 4]; 4],
        }
    }

    /// Loss probability of a packet in each state.
    fn state_loss(&self) -> [f64; 4] {
        match *self {
            ModelSpec::GilbertElliott { h_loss, k_loss, .. } => [k_loss, h_loss, 0.0, 0.0],
            ModelSpec::Markov4 { .. } => [0.0, 0.0, 1.0, 1.0],
            _ => [0.0; 4],
        }
    }
}
