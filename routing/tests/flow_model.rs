//! Model-based property test of flow control's queue: random pushes, pops, disconnects and
//! expiries against a naive reference scheduler (a flat list scanned on every step), compared
//! after every operation.

use std::collections::{HashMap, VecDeque};

use kvroute_routing::flow::{Fairness, FlowQueue, FlowSettings, Order, Refused, Waiting};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Push {
        band: i32,
        flow: u64,
        tokens: u64,
        bytes: u64,
        deadline: Option<u64>,
    },
    Pop,
    Remove(usize),
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (-1i32..3, 0u64..4, 1u64..500, 1u64..20, prop::option::of(0u64..300)).prop_map(
            |(band, flow, tokens, bytes, deadline)| Op::Push { band, flow, tokens, bytes, deadline }
        ),
        4 => Just(Op::Pop),
        1 => (0usize..64).prop_map(Op::Remove),
        2 => (0u64..80).prop_map(Op::Advance),
    ]
}

/// The reference: every waiting request in a list, each decision a scan.
#[derive(Default)]
struct Reference {
    settings: Option<FlowSettings>,
    entries: Vec<(Waiting, u64)>,
    seq: u64,
    /// Per band: active flows in round-robin order, and their attained service.
    active: HashMap<i32, VecDeque<u64>>,
    attained: HashMap<(i32, u64), u64>,
}

impl Reference {
    fn s(&self) -> FlowSettings {
        self.settings.unwrap_or_default()
    }

    fn bytes(&self) -> u64 {
        self.entries.iter().map(|(w, _)| w.bytes).sum()
    }

    fn flow_len(&self, band: i32, flow: u64) -> usize {
        self.entries
            .iter()
            .filter(|(w, _)| w.band == band && w.flow == flow)
            .count()
    }

    fn push(&mut self, w: Waiting) -> Result<Vec<u64>, Refused> {
        let s = self.s();
        if self.entries.iter().any(|(e, _)| e.id == w.id) {
            return Err(Refused::Duplicate);
        }
        if w.bytes > s.max_bytes {
            return Err(Refused::TooLarge);
        }
        let mut lower: Vec<Waiting> = self
            .entries
            .iter()
            .map(|(e, _)| *e)
            .filter(|e| e.band < w.band)
            .collect();
        lower.sort_by_key(|e| (e.band, std::cmp::Reverse((e.arrival_ms, e.id))));
        let (mut count, mut bytes) = (self.entries.len(), self.bytes());
        let fits = |c: usize, b: u64| c < s.max_requests.max(1) && b + w.bytes <= s.max_bytes;
        let mut victims = Vec::new();
        for e in lower {
            if fits(count, bytes) {
                break;
            }
            victims.push(e.id);
            count -= 1;
            bytes -= e.bytes;
        }
        // then, in its own band, the newest of the flow holding the most, while it holds
        // more than the newcomer's flow would
        let mine = self.flow_len(w.band, w.flow);
        while !fits(count, bytes) {
            let held = |f: u64| {
                self.entries
                    .iter()
                    .filter(|(e, _)| e.band == w.band && e.flow == f && !victims.contains(&e.id))
                    .count()
            };
            let mut flows: Vec<u64> = self
                .entries
                .iter()
                .filter(|(e, _)| e.band == w.band && e.flow != w.flow)
                .map(|(e, _)| e.flow)
                .collect();
            flows.sort_unstable();
            flows.dedup();
            let Some(big) = flows
                .into_iter()
                .max_by_key(|&f| (held(f), std::cmp::Reverse(f)))
            else {
                break;
            };
            if held(big) <= mine + 1 {
                break;
            }
            let newest = self
                .entries
                .iter()
                .map(|(e, _)| *e)
                .filter(|e| e.band == w.band && e.flow == big && !victims.contains(&e.id))
                .max_by_key(|e| (e.arrival_ms, e.id));
            let Some(e) = newest else { break };
            victims.push(e.id);
            count -= 1;
            bytes -= e.bytes;
        }
        if !fits(count, bytes) {
            return Err(Refused::QueueFull);
        }
        for &v in &victims {
            self.remove(v);
        }
        if self.flow_len(w.band, w.flow) == 0 {
            let active = self.active.entry(w.band).or_default();
            let floor = active
                .iter()
                .filter_map(|f| self.attained.get(&(w.band, *f)))
                .copied()
                .min()
                .unwrap_or(0);
            active.push_back(w.flow);
            self.attained.insert((w.band, w.flow), floor);
        }
        self.seq += 1;
        self.entries.push((w, self.seq));
        Ok(victims)
    }

    fn remove(&mut self, id: u64) -> Option<Waiting> {
        let i = self.entries.iter().position(|(e, _)| e.id == id)?;
        let (w, _) = self.entries.remove(i);
        if self.flow_len(w.band, w.flow) == 0 {
            if let Some(a) = self.active.get_mut(&w.band) {
                a.retain(|&f| f != w.flow);
            }
            self.attained.remove(&(w.band, w.flow));
        }
        Some(w)
    }

    fn pop(&mut self) -> Option<u64> {
        let s = self.s();
        let band = self.entries.iter().map(|(e, _)| e.band).max()?;
        let active = self.active.get(&band)?;
        let flow = match s.fairness {
            Fairness::RoundRobin => *active.front()?,
            Fairness::LeastAttainedService => *active
                .iter()
                .min_by_key(|f| self.attained.get(&(band, **f)).copied().unwrap_or(0))?,
        };
        let order = |(e, seq): &(Waiting, u64)| match (s.order, e.deadline_ms) {
            (Order::EarliestDeadline, Some(d)) => (d, *seq),
            (Order::EarliestDeadline, None) => (u64::MAX, *seq),
            (Order::Fcfs, _) => (0, *seq),
        };
        let (w, _) = *self
            .entries
            .iter()
            .filter(|(e, _)| e.band == band && e.flow == flow)
            .min_by_key(|x| order(x))?;
        self.remove(w.id);
        if let Some(a) = self.attained.get_mut(&(band, flow)) {
            *a += w.tokens;
        }
        if let Some(active) = self.active.get_mut(&band)
            && active.front() == Some(&flow)
        {
            active.rotate_left(1);
        }
        Some(w.id)
    }

    fn expire(&mut self, now: u64) -> Vec<u64> {
        let ttl = self.s().ttl_ms;
        let mut due: Vec<(u64, u64)> = self
            .entries
            .iter()
            .map(|(e, _)| (e.arrival_ms + ttl, e.id))
            .filter(|&(until, _)| until <= now)
            .collect();
        due.sort_unstable();
        due.into_iter()
            .filter_map(|(_, id)| self.remove(id).map(|w| w.id))
            .collect()
    }

    fn band_lengths(&self) -> Vec<(i32, usize)> {
        let mut bands: Vec<i32> = self.entries.iter().map(|(e, _)| e.band).collect();
        bands.sort_unstable_by(|a, b| b.cmp(a));
        bands.dedup();
        bands
            .into_iter()
            .map(|b| (b, self.entries.iter().filter(|(e, _)| e.band == b).count()))
            .collect()
    }
}

fn settings() -> impl Strategy<Value = FlowSettings> {
    (
        1usize..12,
        20u64..120,
        50u64..200,
        prop_oneof![
            Just(Fairness::RoundRobin),
            Just(Fairness::LeastAttainedService)
        ],
        prop_oneof![Just(Order::Fcfs), Just(Order::EarliestDeadline)],
    )
        .prop_map(
            |(max_requests, max_bytes, ttl_ms, fairness, order)| FlowSettings {
                max_requests,
                max_bytes,
                ttl_ms,
                fairness,
                order,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn flow_queue_matches_reference_scheduler(s in settings(), ops in prop::collection::vec(op(), 1..120)) {
        let mut q = FlowQueue::new(s);
        let mut r = Reference { settings: Some(s), ..Reference::default() };
        let mut now = 0u64;
        let mut next_id = 0u64;
        let mut ids: Vec<u64> = Vec::new();
        for op in ops {
            match op {
                Op::Push { band, flow, tokens, bytes, deadline } => {
                    next_id += 1;
                    let w = Waiting {
                        id: next_id,
                        band,
                        flow,
                        tokens,
                        bytes,
                        arrival_ms: now,
                        deadline_ms: deadline.map(|d| now + d),
                    };
                    ids.push(next_id);
                    let got = q.push(w).map(|p| p.shed.iter().map(|w| w.id).collect::<Vec<_>>());
                    prop_assert_eq!(got, r.push(w));
                }
                Op::Pop => {
                    prop_assert_eq!(q.pop().map(|w| w.id), r.pop());
                }
                Op::Remove(i) => {
                    if let Some(&id) = ids.get(i % ids.len().max(1)) {
                        prop_assert_eq!(q.remove(id).map(|w| w.id), r.remove(id).map(|w| w.id));
                    }
                }
                Op::Advance(dt) => {
                    now += dt;
                    let got: Vec<u64> = q.expire(now).iter().map(|w| w.id).collect();
                    prop_assert_eq!(got, r.expire(now));
                }
            }
            prop_assert_eq!(q.len(), r.entries.len());
            prop_assert_eq!(q.bytes(), r.bytes());
            prop_assert_eq!(q.band_lengths(), r.band_lengths());
            prop_assert_eq!(q.peek().map(|w| w.id), {
                // what the reference would pop, without popping
                let mut copy = Reference {
                    settings: r.settings,
                    entries: r.entries.clone(),
                    seq: r.seq,
                    active: r.active.clone(),
                    attained: r.attained.clone(),
                };
                copy.pop()
            });
            // nothing waits past its TTL once expired
            prop_assert!(q.next_deadline().is_none_or(|d| d > now));
        }
    }
}
