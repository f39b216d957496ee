//! The loss engine: a profile's rules and defaults turned into per-connection deciders. Each
//! connection gets one [`ConnectionLoss`] with its own model state per rule (and one for the
//! defaults), seeded from the profile's seed and the connection's identity, so runs repeat exactly while no two
//! streams (or two rules of one stream) share a drop pattern. Nothing is re-seeded per message.

use std::sync::Arc;

use crate::loss::effect::packet_count;
use crate::loss::model::ModelState;
use crate::loss::plan::LossPlan;
use crate::loss::rng::{derive_seed, splitmix64, stream_rng};
use crate::loss::rules::{first_match, Action, Direction, MatchContext, Rule};

/// Shared, immutable: the rules every connection of a process draws its deciders from.
#[derive(Clone, Debug)]
pub struct LossEngine {
    rules: Arc<Rules>,
}

/// What an engine decides with: the seed, the rules in order, and the defaults.
#[derive(Debug)]
struct Rules {
    seed: u64,
    rules: Vec<Rule>,
    defaults: Action,
}

impl Rules {
    /// The action of a slot: a rule's, or the defaults' for `rules.len()`.
    fn action(&self, slot: usize) -> &Action {
        self.rules
            .get(slot)
            .map_or(&self.defaults, |rule| &rule.action)
    }
}

/// Identity of one stream of messages: the seed of its generators derives from all of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamKey {
    /// This process's rank in the communicator.
    pub rank: u32,
    /// The communicator: its number in this process (the order of its `init`), which repeats
    /// from run to run (NCCL's commHash does not: it hashes a random unique id).
    pub comm: u64,
    /// The peer rank at the other end.
    pub peer: u32,
    /// Which side of the connection this is.
    pub direction: Direction,
    /// Index of the connection between the same two ranks (channels open several).
    pub conn: u32,
}

impl StreamKey {
    /// The key's parts in a fixed order, each widened to 64 bits, then the slot (rule index,
    /// or the number of rules for the defaults).
    fn seed_for(&self, seed: u64, slot: usize) -> u64 {
        let direction = match self.direction {
            Direction::Send => 0,
            Direction::Recv => 1,
        };
        derive_seed(
            seed,
            &[
                u64::from(self.rank),
                self.comm,
                u64::from(self.peer),
                direction,
                u64::from(self.conn),
                slot as u64,
            ],
        )
    }
}

impl LossEngine {
    /// An engine for `rules` (in order; the first match decides) and the `defaults` that
    /// apply when none matches; every stream's generators derive from `seed`.
    pub fn new(seed: u64, rules: Vec<Rule>, defaults: Action) -> LossEngine {
        LossEngine {
            rules: Arc::new(Rules {
                seed,
                rules,
                defaults,
            }),
        }
    }

    /// The decider for one connection: build it once when the connection opens.
    pub fn stream(&self, key: StreamKey) -> ConnectionLoss {
        let rules = Arc::clone(&self.rules);
        let slots = rules.rules.len() + 1;
        let models = (0..slots)
            .map(|slot| {
                let action = rules.action(slot);
                ModelState::new(&action.model, stream_rng(key.seed_for(rules.seed, slot)))
            })
            .collect();
        // The flip seeds come from their own sequence so the loss pattern does not depend on
        // the effect: switching `zero` to `bitflip` flips bits in the very packets `zero` lost.
        let flip_base = key.seed_for(rules.seed ^ 0x666c_6970, slots);
        ConnectionLoss {
            rules,
            models,
            flip_base,
            messages: 0,
        }
    }
}

/// One connection's decider: model states that persist across its messages.
#[derive(Clone, Debug)]
pub struct ConnectionLoss {
    rules: Arc<Rules>,
    /// One per rule, then one for the defaults.
    models: Vec<ModelState>,
    flip_base: u64,
    messages: u64,
}

impl ConnectionLoss {
    /// Decides the fate of a message of `len` bytes into `out` (its run list is cleared and
    /// reused, so the steady state does not allocate). Returns the index of the rule that
    /// matched, or `None` when the profile's defaults applied.
    pub fn plan(&mut self, ctx: &MatchContext, len: usize, out: &mut LossPlan) -> Option<usize> {
        let (matched, slot) = self.act(ctx, out);
        out.flip_seed = splitmix64(self.flip_base ^ splitmix64(self.messages));
        self.messages = self.messages.wrapping_add(1);
        // Models keep one state per slot; `models` has one per slot by construction.
        if let Some(model) = self.models.get_mut(slot) {
            model.fill(packet_count(len, out.mtu), &mut out.lost);
        }
        matched
    }

    /// What [`ConnectionLoss::plan`] would decide for a message with loss switched off: the
    /// matching rule's effect, packet size and timeout, and no lost packet; returns the rule,
    /// as `plan` does. The models do not move, so switching loss on again goes on where it
    /// stopped.
    pub fn lossless_plan(&self, ctx: &MatchContext, out: &mut LossPlan) -> Option<usize> {
        self.act(ctx, out).0
    }

    /// How many rules the profile has (rule indices run below it).
    pub fn rule_count(&self) -> usize {
        self.rules.rules.len()
    }

    /// Writes the action of the first rule matching `ctx` (or the defaults) into `out`, with
    /// no lost packet: the rule's index, and its slot among the actions and models.
    fn act(&self, ctx: &MatchContext, out: &mut LossPlan) -> (Option<usize>, usize) {
        let matched = first_match(&self.rules.rules, ctx);
        let slot = matched.unwrap_or(self.rules.rules.len());
        let action = self.rules.action(slot);
        out.effect = action.effect;
        out.mtu = action.mtu;
        out.retransmit_timeout = action.retransmit_timeout;
        out.lost.clear();
        (matched, slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{CollectiveId, Phase};
    use crate::loss::model::ModelSpec;
    use crate::loss::plan::{Effect, PacketRun, DEFAULT_RETRANSMIT_TIMEOUT};
    use crate::loss::rules::Match;

    /// Seed 5, mtu 1024, effect zero, uniform 5% loss.
    fn uniform() -> Action {
        Action {
            effect: Effect::Zero,
            model: ModelSpec::Uniform { rate: 0.05 },
            retransmit_timeout: DEFAULT_RETRANSMIT_TIMEOUT,
            mtu: 1024,
        }
    }

    fn engine(rules: Vec<Rule>) -> LossEngine {
        LossEngine::new(5, rules, uniform())
    }

    fn key(peer: u32, conn: u32) -> StreamKey {
        StreamKey {
            rank: 0,
            comm: 7,
            peer,
            direction: Direction::Send,
            conn,
        }
    }

    fn plans(
        stream: &mut ConnectionLoss,
        ctx: &MatchContext,
        n: usize,
        len: usize,
    ) -> Vec<Vec<PacketRun>> {
        let mut plan = LossPlan::default();
        (0..n)
            .map(|_| {
                stream.plan(ctx, len, &mut plan);
                plan.lost.clone()
            })
            .collect()
    }

    #[test]
    fn a_lossless_plan_has_the_rules_packets_and_leaves_the_model_where_it_was() {
        let e = engine(Vec::new());
        let ctx = MatchContext::default();
        let mut stream = e.stream(key(1, 0));
        let mut plan = LossPlan::lossless();
        plan.lost.push(PacketRun { start: 0, len: 1 });
        stream.lossless_plan(&ctx, &mut plan);
        assert_eq!((plan.mtu, plan.effect), (1024, Effect::Zero));
        assert!(plan.lost.is_empty());
        // Switching loss back on goes on where the stream stopped: as if nothing happened.
        let after = plans(&mut stream, &ctx, 20, 1 << 20);
        assert_eq!(after, plans(&mut e.stream(key(1, 0)), &ctx, 20, 1 << 20));
    }

    #[test]
    fn same_key_same_plans_other_keys_differ() {
        let e = engine(Vec::new());
        let ctx = MatchContext::default();
        let a = plans(&mut e.stream(key(1, 0)), &ctx, 50, 1 << 20);
        let b = plans(&mut e.stream(key(1, 0)), &ctx, 50, 1 << 20);
        assert_eq!(a, b);
        assert_ne!(a, plans(&mut e.stream(key(2, 0)), &ctx, 50, 1 << 20));
        assert_ne!(a, plans(&mut e.stream(key(1, 1)), &ctx, 50, 1 << 20));
        let mut other = key(1, 0);
        other.direction = Direction::Recv;
        assert_ne!(a, plans(&mut e.stream(other), &ctx, 50, 1 << 20));
        other = key(1, 0);
        other.comm += 1;
        assert_ne!(a, plans(&mut e.stream(other), &ctx, 50, 1 << 20));
        // Another seed, another pattern.
        let e2 = LossEngine::new(6, Vec::new(), uniform());
        assert_ne!(a, plans(&mut e2.stream(key(1, 0)), &ctx, 50, 1 << 20));
        // Not re-seeded per message: consecutive messages of one stream differ.
        assert!(a.windows(2).all(|w| w[0] != w[1]));
    }

    #[test]
    fn each_rule_has_its_own_stream() {
        let e = engine(vec![Rule {
            name: None,
            when: Match {
                collectives: Some(vec![CollectiveId::AllReduce]),
                ..Match::default()
            },
            action: uniform(),
        }]);
        let mut s = e.stream(key(1, 0));
        let all_reduce = MatchContext {
            collective: CollectiveId::AllReduce,
            ..MatchContext::default()
        };
        let mut plan = LossPlan::default();
        assert_eq!(s.plan(&all_reduce, 1 << 20, &mut plan), Some(0));
        assert_eq!(s.plan(&MatchContext::default(), 1 << 20, &mut plan), None);
        // Same model, same key, different rule: different drops.
        let mut a = e.stream(key(1, 0));
        let mut b = e.stream(key(1, 0));
        assert_ne!(
            plans(&mut a, &all_reduce, 20, 1 << 20),
            plans(&mut b, &MatchContext::default(), 20, 1 << 20)
        );
        // Interleaving another rule's messages does not disturb a rule's sequence.
        let mut c = e.stream(key(1, 0));
        let mut seq = Vec::new();
        for _ in 0..20 {
            c.plan(&MatchContext::default(), 1 << 20, &mut plan);
            c.plan(&all_reduce, 1 << 20, &mut plan);
            seq.push(plan.lost.clone());
        }
        assert_eq!(
            seq,
            plans(&mut e.stream(key(1, 0)), &all_reduce, 20, 1 << 20)
        );
    }

    #[test]
    fn plan_carries_the_action_and_reuses_its_buffer() {
        let defaults = Action {
            retransmit_timeout: std::time::Duration::from_micros(50),
            ..uniform()
        };
        let rule = Rule {
            name: None,
            when: Match {
                phase: Phase::Backward,
                ..Match::default()
            },
            action: Action {
                effect: Effect::Bitflip,
                mtu: 256,
                ..defaults.clone()
            },
        };
        let e = LossEngine::new(5, vec![rule], defaults);
        let mut s = e.stream(key(1, 0));
        let mut plan = LossPlan::default();
        let ctx = MatchContext {
            phase: Phase::Backward,
            ..MatchContext::default()
        };
        assert_eq!(s.plan(&ctx, 100_000, &mut plan), Some(0));
        assert_eq!((plan.effect, plan.mtu), (Effect::Bitflip, 256));
        assert_eq!(
            plan.retransmit_timeout,
            std::time::Duration::from_micros(50)
        );
        let first_seed = plan.flip_seed;
        assert!(crate::loss::effect::check_runs(&plan.lost, plan.packets_in(100_000), 0).is_ok());
        s.plan(&ctx, 100_000, &mut plan);
        assert_ne!(first_seed, plan.flip_seed);
        assert_eq!(s.plan(&MatchContext::default(), 10_000, &mut plan), None);
        assert_eq!((plan.effect, plan.mtu), (Effect::Zero, 1024));
        // Grow the buffer once, then steady state keeps its capacity.
        s.plan(&MatchContext::default(), 1 << 22, &mut plan);
        let cap = plan.lost.capacity();
        let ptr = plan.lost.as_ptr();
        for _ in 0..10 {
            s.plan(&MatchContext::default(), 1 << 16, &mut plan);
        }
        assert_eq!((plan.lost.capacity(), plan.lost.as_ptr()), (cap, ptr));
        // Empty messages lose nothing.
        s.plan(&MatchContext::default(), 0, &mut plan);
        assert!(plan.lost.is_empty());
    }

    #[test]
    fn deciders_move_between_threads() {
        fn send<T: Send>() {}
        fn shared<T: Send + Sync>() {}
        send::<ConnectionLoss>();
        shared::<LossEngine>();
    }

    #[test]
    fn loss_rate_through_the_engine() {
        // 2000 messages of 1 MiB at mtu 1024 = 2,048,000 packets at 5%:
        // σ = sqrt(0.05·0.95/2.048e6) ≈ 1.5e-4; allow 5σ.
        let e = engine(Vec::new());
        let mut s = e.stream(key(4, 2));
        let mut plan = LossPlan::default();
        let (mut lost, mut total) = (0u64, 0u64);
        for _ in 0..2000 {
            s.plan(&MatchContext::default(), 1 << 20, &mut plan);
            lost += plan.lost_packets();
            total += plan.packets_in(1 << 20);
        }
        let rate = lost as f64 / total as f64;
        assert!(
            (rate - 0.05).abs() < 5.0 * (0.05 * 0.95 / total as f64).sqrt(),
            "{rate}"
        );
    }
}
