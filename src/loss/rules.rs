//! Which messages a profile rule applies to: the match criteria, what a message looks like to
//! the matcher ([`MatchContext`]), and what a matching rule does ([`Action`]).
//! Rules form an ordered list and the first one that matches decides; a criterion a rule
//! leaves out matches everything, and a rule's criteria must all hold.

use std::time::Duration;

use crate::loss::model::ModelSpec;
use crate::loss::plan::Effect;

use crate::ids::{CollectiveId, Phase};

/// Which side of a connection a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// The sending side.
    Send,
    /// The receiving side.
    Recv,
}

impl Direction {
    /// Lower-case name, as in profiles.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Send => "send",
            Direction::Recv => "recv",
        }
    }
}

/// What the matcher knows about a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatchContext {
    /// The collective the message belongs to, if NCCL told us.
    pub collective: CollectiveId,
    /// The communicator's traffic class, if set.
    pub traffic_class: Option<i32>,
    /// Number of ranks in the communicator, if known.
    pub comm_size: Option<u32>,
    /// Which side is deciding (the plugin's sender: always `Send` there).
    pub direction: Direction,
    /// The rank at the other end of the connection (for a sender: the receiver), if known.
    pub peer: Option<u32>,
    /// This process's rank (for a sender: the message's source), if known.
    pub local_rank: Option<u32>,
    /// The training phase the script set.
    pub phase: Phase,
    /// The training step the script set.
    pub step: u64,
}

impl Default for MatchContext {
    fn default() -> Self {
        MatchContext {
            collective: CollectiveId::Unknown,
            traffic_class: None,
            comm_size: None,
            direction: Direction::Send,
            peer: None,
            local_rank: None,
            phase: Phase::Any,
            step: 0,
        }
    }
}

/// What happens to a matched message's packets.
#[derive(Clone, Debug, PartialEq)]
pub struct Action {
    /// What a lost packet does.
    pub effect: Effect,
    /// Which packets are lost.
    pub model: ModelSpec,
    /// Delay per loss event under `retransmit`.
    pub retransmit_timeout: Duration,
    /// Packet size in bytes.
    pub mtu: u32,
}

/// A rule's criteria; `None` matches anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Match {
    /// Collectives the rule applies to.
    pub collectives: Option<Vec<CollectiveId>>,
    /// Traffic classes the rule applies to.
    pub traffic_classes: Option<Vec<i32>>,
    /// Communicator sizes the rule applies to.
    pub comm_sizes: Option<Vec<u32>>,
    /// The side the rule applies to.
    pub direction: Option<Direction>,
    /// Peer ranks the rule applies to.
    pub peers: Option<Vec<u32>>,
    /// Phase the rule applies in; `Phase::Any` matches every phase.
    pub phase: Phase,
    /// Steps `[from, until)` the rule applies in (`until` open when `None`).
    pub steps: Option<(u64, Option<u64>)>,
}

impl Default for Match {
    fn default() -> Self {
        Match {
            collectives: None,
            traffic_classes: None,
            comm_sizes: None,
            direction: None,
            peers: None,
            phase: Phase::Any,
            steps: None,
        }
    }
}

fn listed<T: PartialEq>(list: &Option<Vec<T>>, value: Option<T>) -> bool {
    match list {
        None => true,
        Some(list) => value.is_some_and(|v| list.contains(&v)),
    }
}

impl Match {
    /// True when every criterion holds for `ctx`. A criterion on something the context does
    /// not know (no traffic class, no peer) does not hold.
    pub fn matches(&self, ctx: &MatchContext) -> bool {
        listed(&self.collectives, Some(ctx.collective))
            && listed(&self.traffic_classes, ctx.traffic_class)
            && listed(&self.comm_sizes, ctx.comm_size)
            && self.side_holds(ctx)
            && (self.phase == Phase::Any || self.phase == ctx.phase)
            && self.steps.map_or(true, |(from, until)| {
                ctx.step >= from && until.map_or(true, |u| ctx.step < u)
            })
    }

    /// The `direction` and `peer` criteria. The sender decides every loss, on behalf of both
    /// ends: a `recv` rule describes the message as its receiver sees it, so its `peer` is
    /// the message's source (the deciding rank itself); a `send` rule's `peer` is the
    /// destination.
    fn side_holds(&self, ctx: &MatchContext) -> bool {
        let (side_holds, peer) = match self.direction {
            None => (true, ctx.peer),
            Some(Direction::Send) => (ctx.direction == Direction::Send, ctx.peer),
            Some(Direction::Recv) if ctx.direction == Direction::Send => (true, ctx.local_rank),
            // A receiver deciding for itself: its peer is the source.
            Some(Direction::Recv) => (true, ctx.peer),
        };
        side_holds && listed(&self.peers, peer)
    }

    /// True when every message `other` matches is matched by `self` too, so that `other`,
    /// after `self` in a profile, could never decide a message. Over the contexts the plugin
    /// decides in (the sender's, [`Direction::Send`]), where `direction` only says which rank
    /// a `peer` names. Sure, not exhaustive: a `false` may still hide such a pair (a list
    /// naming every collective is not taken for "all").
    pub fn covers(&self, other: &Match) -> bool {
        /// A list criterion: `inner`'s values are all in `outer`'s (no list: every value).
        fn within<T: PartialEq>(outer: &Option<Vec<T>>, inner: &Option<Vec<T>>) -> bool {
            match (outer, inner) {
                (None, _) => true,
                (Some(_), None) => false,
                (Some(outer), Some(inner)) => inner.iter().all(|v| outer.contains(v)),
            }
        }
        // At the sender, a `recv` rule's peer is the deciding rank itself, any other's the
        // destination: two rules' peer lists compare only when they name the same end.
        let names_source = |m: &Match| m.direction == Some(Direction::Recv);
        let side = self.peers.is_none()
            || (names_source(self) == names_source(other) && within(&self.peers, &other.peers));
        let steps = match (self.steps, other.steps) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some((from, until)), Some((other_from, other_until))) => {
                other_from >= from
                    && match (until, other_until) {
                        (None, _) => true,
                        (Some(_), None) => false,
                        (Some(u), Some(other_u)) => other_u <= u,
                    }
            }
        };
        within(&self.collectives, &other.collectives)
            && within(&self.traffic_classes, &other.traffic_classes)
            && within(&self.comm_sizes, &other.comm_sizes)
            && side
            && (self.phase == Phase::Any || self.phase == other.phase)
            && steps
    }

    /// Short description of the criteria, for summaries ("all" when there are none).
    pub fn describe(&self) -> String {
        /// `key=a|b|c` for a criterion that is set.
        fn one_of<T: std::fmt::Display>(key: &str, values: Option<&[T]>) -> Option<String> {
            let values: Vec<String> = values?.iter().map(T::to_string).collect();
            Some(format!("{key}={}", values.join("|")))
        }
        let mut parts: Vec<String> = [
            one_of("collective", self.collectives.as_deref()),
            one_of("traffic_class", self.traffic_classes.as_deref()),
            one_of("comm_size", self.comm_sizes.as_deref()),
            self.direction.map(|d| format!("direction={}", d.name())),
            one_of("peer", self.peers.as_deref()),
        ]
        .into_iter()
        .flatten()
        .collect();
        if self.phase != Phase::Any {
            parts.push(format!("phase={}", self.phase.name()));
        }
        if let Some((from, until)) = self.steps {
            parts.push(match until {
                Some(u) => format!("steps=[{from},{u})"),
                None => format!("steps=[{from},∞)"),
            });
        }
        if parts.is_empty() {
            "all".into()
        } else {
            parts.join(" ")
        }
    }
}

/// One profile rule: criteria and the action taken on matching messages.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    /// Optional name, for summaries and statistics.
    pub name: Option<String>,
    /// When the rule applies.
    pub when: Match,
    /// What it does.
    pub action: Action,
}

/// Index of the first rule in `rules` that matches `ctx`.
pub fn first_match(rules: &[Rule], ctx: &MatchContext) -> Option<usize> {
    rules.iter().position(|rule| rule.when.matches(ctx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::plan::DEFAULT_RETRANSMIT_TIMEOUT;

    fn rule(when: Match) -> Rule {
        Rule {
            name: None,
            when,
            action: Action {
                effect: Effect::Zero,
                model: ModelSpec::None,
                retransmit_timeout: DEFAULT_RETRANSMIT_TIMEOUT,
                mtu: 4096,
            },
        }
    }

    #[test]
    fn first_match_decides() {
        let rules = vec![
            rule(Match {
                collectives: Some(vec![CollectiveId::AllReduce]),
                phase: Phase::Backward,
                steps: Some((100, Some(200))),
                ..Match::default()
            }),
            rule(Match {
                collectives: Some(vec![CollectiveId::AllReduce, CollectiveId::AllGather]),
                ..Match::default()
            }),
            rule(Match {
                peers: Some(vec![3]),
                direction: Some(Direction::Recv),
                ..Match::default()
            }),
        ];
        let ctx = |collective, phase, step| MatchContext {
            collective,
            phase,
            step,
            ..MatchContext::default()
        };
        use CollectiveId::{AllGather, AllReduce, Broadcast};
        use Phase::{Any, Backward, Forward};
        let cases = [
            (AllReduce, Backward, 100, Some(0)),
            (AllReduce, Backward, 199, Some(0)),
            // The window is half-open, and outside it the next rule decides.
            (AllReduce, Backward, 200, Some(1)),
            (AllReduce, Backward, 99, Some(1)),
            (AllReduce, Forward, 150, Some(1)),
            // A phase the script never set is not "backward".
            (AllReduce, Any, 150, Some(1)),
            (AllGather, Backward, 150, Some(1)),
            (Broadcast, Backward, 150, None),
        ];
        for (collective, phase, step, want) in cases {
            assert_eq!(
                first_match(&rules, &ctx(collective, phase, step)),
                want,
                "{collective} {phase:?} step {step}"
            );
        }
        // A peer criterion needs a known peer. Rule 2 is "messages received from rank 3":
        // deciding at the sender, that is a message whose source (this rank) is 3, whatever
        // its destination.
        let mut c = ctx(CollectiveId::Unknown, Phase::Any, 0);
        assert_eq!(first_match(&rules, &c), None);
        c.peer = Some(3);
        assert_eq!(first_match(&rules, &c), None);
        c.local_rank = Some(3);
        c.peer = Some(0);
        assert_eq!(first_match(&rules, &c), Some(2));
        c.local_rank = Some(2);
        assert_eq!(first_match(&rules, &c), None);
        // A `send` rule's peer is the destination.
        let to_three = Match {
            peers: Some(vec![3]),
            direction: Some(Direction::Send),
            ..Match::default()
        };
        c.peer = Some(3);
        assert!(to_three.matches(&c));
        c.peer = Some(1);
        assert!(!to_three.matches(&c));
        // A rule with no criteria matches everything.
        assert!(Match::default().matches(&c));
    }

    #[test]
    fn open_windows_and_comm_criteria() {
        let m = Match {
            steps: Some((10, None)),
            traffic_classes: Some(vec![2]),
            comm_sizes: Some(vec![8, 16]),
            ..Match::default()
        };
        let mut c = MatchContext {
            step: 1_000_000,
            traffic_class: Some(2),
            comm_size: Some(16),
            ..MatchContext::default()
        };
        assert!(m.matches(&c));
        c.comm_size = Some(4);
        assert!(!m.matches(&c));
        c.comm_size = None;
        assert!(!m.matches(&c));
        c.comm_size = Some(8);
        c.step = 9;
        assert!(!m.matches(&c));
        c.step = 10;
        c.traffic_class = None;
        assert!(!m.matches(&c));
        assert!(m.describe().contains("steps=[10,∞)"));
        let every = Match {
            collectives: Some(vec![CollectiveId::AllReduce, CollectiveId::Broadcast]),
            direction: Some(Direction::Recv),
            peers: Some(vec![1, 2]),
            phase: Phase::Forward,
            steps: Some((3, Some(5))),
            ..m
        };
        assert_eq!(
            every.describe(),
            "collective=AllReduce|Broadcast traffic_class=2 comm_size=8|16 direction=recv \
             peer=1|2 phase=forward steps=[3,5)"
        );
        assert_eq!(Match::default().describe(), "all");
    }

    #[test]
    fn a_rule_covers_another_when_it_matches_everything_the_other_does() {
        use CollectiveId::{AllGather, AllReduce};
        let all = Match::default();
        let all_reduce = Match {
            collectives: Some(vec![AllReduce]),
            ..Match::default()
        };
        let all_reduce_backward = Match {
            phase: Phase::Backward,
            ..all_reduce.clone()
        };
        let two = Match {
            collectives: Some(vec![AllReduce, AllGather]),
            ..Match::default()
        };
        let window = |from, until| Match {
            steps: Some((from, until)),
            ..Match::default()
        };
        let to_peer = |direction, peers: Vec<u32>| Match {
            direction,
            peers: Some(peers),
            ..Match::default()
        };
        let cases = [
            (&all, &all_reduce_backward, true),
            (&all_reduce, &all_reduce_backward, true),
            (&all_reduce_backward, &all_reduce, false),
            (&all_reduce, &all, false),
            (&two, &all_reduce, true),
            (&all_reduce, &two, false),
            (&all_reduce_backward, &all_reduce_backward, true),
        ];
        for (i, (a, b, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                a.covers(b),
                want,
                "case {i}: {} over {}",
                a.describe(),
                b.describe()
            );
        }
        assert!(window(0, Some(100)).covers(&window(10, Some(100))));
        assert!(window(0, None).covers(&window(10, None)));
        assert!(!window(0, Some(100)).covers(&window(10, None)));
        assert!(!window(0, Some(100)).covers(&window(50, Some(101))));
        assert!(!window(10, None).covers(&all));
        let send = Some(Direction::Send);
        assert!(to_peer(send, vec![1, 2]).covers(&to_peer(send, vec![2])));
        assert!(!to_peer(send, vec![2]).covers(&to_peer(send, vec![1, 2])));
        assert!(!to_peer(send, vec![2]).covers(&to_peer(Some(Direction::Recv), vec![2])));
        assert!(!to_peer(send, vec![2]).covers(&all));
        // Without `direction` a `peer` is the destination, as for `send`; a rule that sets no
        // `peer` selects nothing by its `direction` alone.
        let recv = Some(Direction::Recv);
        assert!(to_peer(None, vec![1, 2]).covers(&to_peer(send, vec![2])));
        assert!(to_peer(send, vec![2]).covers(&to_peer(None, vec![2])));
        assert!(!to_peer(None, vec![2]).covers(&to_peer(recv, vec![2])));
        assert!(to_peer(recv, vec![2, 3]).covers(&to_peer(recv, vec![3])));
        let side_only = |direction| Match {
            direction,
            ..Match::default()
        };
        assert!(side_only(recv).covers(&to_peer(send, vec![2])));
        assert!(side_only(send).covers(&side_only(recv)));
        assert!(side_only(recv).covers(&all));
    }

    /// Soundness of [`Match::covers`] over every context of a small domain: whenever it says
    /// one rule covers another, no context matches the other without matching it. 20,000
    /// random pairs (fixed seed) of criteria drawn from that domain, each against all of its
    /// 3 x 3 x 3 x 3 x 3 x 3 x 7 = 15,309 contexts whenever `covers` holds. The contexts are
    /// the sender's, the only ones the plugin decides in (`runtime`'s `isend`).
    #[test]
    fn covers_never_claims_a_rule_that_matches_less() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        use CollectiveId::{AllGather, AllReduce, Broadcast};
        let mut rng = SmallRng::seed_from_u64(0x5eed);
        fn some_of<T: Copy>(rng: &mut SmallRng, values: &[T]) -> Option<Vec<T>> {
            rng.gen_bool(0.5).then(|| {
                let picked: Vec<T> = values
                    .iter()
                    .copied()
                    .filter(|_| rng.gen_bool(0.6))
                    .collect();
                if picked.is_empty() {
                    vec![values[0]]
                } else {
                    picked
                }
            })
        }
        let draw = |rng: &mut SmallRng| Match {
            collectives: some_of(rng, &[AllReduce, AllGather, Broadcast]),
            traffic_classes: some_of(rng, &[1, 2]),
            comm_sizes: some_of(rng, &[4, 8]),
            direction: [None, Some(Direction::Send), Some(Direction::Recv)][rng.gen_range(0..3)],
            peers: some_of(rng, &[0, 1]),
            phase: [Phase::Any, Phase::Forward, Phase::Backward][rng.gen_range(0..3)],
            steps: rng.gen_bool(0.5).then(|| {
                let from = rng.gen_range(0..4);
                (from, rng.gen_bool(0.5).then(|| from + rng.gen_range(1..4)))
            }),
        };
        let mut contexts = Vec::new();
        for collective in [AllReduce, AllGather, Broadcast] {
            for traffic_class in [None, Some(1), Some(2)] {
                for comm_size in [None, Some(4), Some(8)] {
                    for peer in [None, Some(0), Some(1)] {
                        for local_rank in [None, Some(0), Some(1)] {
                            for phase in [Phase::Any, Phase::Forward, Phase::Backward] {
                                for step in 0..7 {
                                    contexts.push(MatchContext {
                                        collective,
                                        traffic_class,
                                        comm_size,
                                        direction: Direction::Send,
                                        peer,
                                        local_rank,
                                        phase,
                                        step,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        let mut covered = 0;
        for _ in 0..20_000 {
            let (a, b) = (draw(&mut rng), draw(&mut rng));
            if !a.covers(&b) {
                continue;
            }
            covered += 1;
            for ctx in &contexts {
                assert!(
                    !b.matches(ctx) || a.matches(ctx),
                    "{} claimed to cover {}, not at {ctx:?}",
                    a.describe(),
                    b.describe()
                );
            }
        }
        // The draw must give the check something to hold: pairs where covering is claimed.
        assert!(covered > 100, "only {covered} covering pairs drawn");
    }
}
