//! Model-based property test of the pool state (`pool_state::PoolState`): random pool views,
//! KV-event batches, resyncs, learned capacities, staleness, routed requests and time run
//! against the real pool and a plain reference model, compared after every step: who is a
//! member and in what state, which blocks each endpoint is credited with (by prefix lookups
//! over every document), whose load is kept, and whether its version moved; and, for the
//! `Pool` around it, in-flight counts (a request sent to a non-member counted nowhere),
//! session pins and calibration's pool, with departed endpoints forgotten by every table.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use kvroute_routing::block_keys::{BlockHasher, BlockKey, ChainRoot};
use kvroute_routing::config::RoutingConfig;
use kvroute_routing::endpoint::{Endpoint, EndpointId, EndpointState, ModelConfig};
use kvroute_routing::index::{IndexConfig, PrefixMatch};
use kvroute_routing::inflight::InflightGuard;
use kvroute_routing::kv_events::ingest::IngestKeys;
use kvroute_routing::kv_events::resequence::ResyncReason;
use kvroute_routing::kv_events::{EventBatch, KvEvent};
use kvroute_routing::load::EndpointLoad;
use kvroute_routing::place::{Pool, PoolSettings};
use kvroute_routing::pool_state::{ClearCause, IndexBudget, Membership, PoolMember, Resynced};
use kvroute_routing::router::Router;
use proptest::prelude::*;

const ENDPOINTS: u8 = 4;
/// Fewer than `ENDPOINTS`, so that some views are refused.
const MAX_ENDPOINTS: usize = 3;
const DOCS: u8 = 3;
const SESSIONS: u8 = 3;
const BLOCKS: u8 = 6;
const BLOCK_SIZE: u32 = 4;
const MODEL: &str = "m";
const BUDGET: IndexBudget = IndexBudget {
    default_kv_capacity_blocks: 5,
    precise_slack: 2,
    approximate_ttl_ms: 50,
    // the model's precise endpoints hold exactly what their events say (provisional credit
    // has its own tests in `place.rs` and `index.rs`)
    provisional_ttl_ms: 0,
    // below the default's 5 × 2: precise endpoints are often clamped
    max_blocks_per_endpoint: 8,
};

fn session_key(s: u8) -> u64 {
    Router::session_key(None, Some(&format!("s{s}"))).expect("a session")
}

fn id(n: u8) -> EndpointId {
    EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
}

fn number(id: &EndpointId) -> u8 {
    match id.address {
        IpAddr::V4(a) => a.octets()[3],
        IpAddr::V6(_) => unreachable!("the test uses IPv4"),
    }
}

/// The engine hash of block `i` of document `d`.
fn engine_hash(d: u8, i: u8) -> u64 {
    1 + u64::from(d) * 16 + u64::from(i)
}

fn tokens(d: u8, from: u8, to: u8) -> Vec<u32> {
    (u32::from(from) * BLOCK_SIZE..u32::from(to) * BLOCK_SIZE)
        .map(|t| 1000 * (u32::from(d) + 1) + t)
        .collect()
}

/// The keys of document `d`'s blocks, as a request for it is hashed.
fn doc_keys(d: u8) -> Vec<BlockKey> {
    BlockHasher::new(BLOCK_SIZE).keys(ChainRoot::new(MODEL, None, None), &tokens(d, 0, BLOCKS))
}

#[derive(Debug, Clone)]
enum Ev {
    Store { doc: u8, from: u8, len: u8 },
    Remove { doc: u8, block: u8 },
    ClearAll,
}

#[derive(Debug, Clone)]
struct Member {
    n: u8,
    serving: bool,
    precise: bool,
    configured: Option<u64>,
}

#[derive(Debug, Clone)]
enum Op {
    View(Vec<Member>),
    Batch(u8, Vec<Ev>),
    Clear(u8, ClearCause),
    /// The endpoint's event stream could not be kept whole: its engine lost batches and goes
    /// on (`true`), or restarted (`false`).
    Resync(u8, bool),
    Learn(u8, Option<u64>),
    Stale(u8, bool),
    Routed(u8, u8, u8),
    Advance(u64),
    /// A request sent to an endpoint (member or not) begins.
    Begin(u8),
    /// The `k`-th oldest request still in flight ends.
    End(usize),
    /// Session `s` is served by endpoint `n`.
    Pin(u8, u8),
}

fn member() -> impl Strategy<Value = Member> {
    (
        0..ENDPOINTS,
        prop::bool::weighted(0.85),
        any::<bool>(),
        prop_oneof![Just(None), Just(Some(2u64)), Just(Some(4u64))],
    )
        .prop_map(|(n, serving, precise, configured)| Member {
            n,
            serving,
            precise,
            configured,
        })
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        4 => (0..DOCS, 0..BLOCKS, 1..4u8).prop_map(|(doc, from, len)| Ev::Store { doc, from, len }),
        2 => (0..DOCS, 0..BLOCKS).prop_map(|(doc, block)| Ev::Remove { doc, block }),
        1 => Just(Ev::ClearAll),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let cause = prop_oneof![
        Just(ClearCause::Stale),
        Just(ClearCause::Resync),
        Just(ClearCause::RateLimited),
        Just(ClearCause::Subscribed),
    ];
    prop_oneof![
        2 => prop::collection::vec(member(), 0..5).prop_map(Op::View),
        6 => (0..ENDPOINTS, prop::collection::vec(ev(), 1..4)).prop_map(|(n, e)| Op::Batch(n, e)),
        1 => (0..ENDPOINTS, cause).prop_map(|(n, c)| Op::Clear(n, c)),
        1 => (0..ENDPOINTS, any::<bool>()).prop_map(|(n, survived)| Op::Resync(n, survived)),
        2 => (0..ENDPOINTS, prop_oneof![Just(None), Just(Some(1u64)), Just(Some(3u64)), Just(Some(6u64)), Just(Some(1_000_000_000_000u64))])
            .prop_map(|(n, c)| Op::Learn(n, c)),
        2 => (0..ENDPOINTS, any::<bool>()).prop_map(|(n, s)| Op::Stale(n, s)),
        4 => (0..ENDPOINTS, 0..DOCS, 1..=BLOCKS).prop_map(|(n, d, len)| Op::Routed(n, d, len)),
        1 => (0u64..40).prop_map(Op::Advance),
        2 => (0..ENDPOINTS).prop_map(Op::Begin),
        1 => (0usize..8).prop_map(Op::End),
        2 => (0..SESSIONS, 0..ENDPOINTS).prop_map(|(s, n)| Op::Pin(s, n)),
    ]
}

/// One member as the reference sees it.
#[derive(Debug, Clone)]
struct Ref {
    state: EndpointState,
    precise: bool,
    configured: Option<u64>,
    /// Precise blocks held: engine hash → (document, block).
    stored: BTreeMap<u64, (u8, u8)>,
    /// Extra physical copies the engine reported of a held block (at most the budget's
    /// worth of hashes): each removal takes one before the block goes.
    copies: BTreeMap<u64, u32>,
    /// Approximate blocks, least recently used first: ((document, block), touched at).
    lru: Vec<((u8, u8), u64)>,
}

impl Ref {
    fn holds(&self, block: (u8, u8)) -> bool {
        self.stored.values().any(|&b| b == block) || self.lru.iter().any(|&(b, _)| b == block)
    }

    fn len(&self) -> usize {
        self.stored.len() + self.lru.len()
    }

    fn clear(&mut self) {
        self.stored.clear();
        self.copies.clear();
        self.lru.clear();
    }
}

#[derive(Debug, Default)]
struct Model {
    members: BTreeMap<u8, Ref>,
    /// Members with a load sample: the capacity it reported.
    loads: BTreeMap<u8, Option<u64>>,
    now: u64,
}

impl Model {
    /// The rule: what the engine reported, else the model config's, else the default; a
    /// precise endpoint may hold `precise_slack` times that.
    fn budget(&self, n: u8) -> usize {
        let m = &self.members[&n];
        let cap = self
            .loads
            .get(&n)
            .copied()
            .flatten()
            .or(m.configured)
            .unwrap_or(BUDGET.default_kv_capacity_blocks);
        let factor = if m.precise { BUDGET.precise_slack } else { 1 };
        (cap * factor).min(BUDGET.max_blocks_per_endpoint) as usize
    }

    /// A smaller budget holds at once: approximate blocks go least recently used first, a
    /// precise view over it is dropped.
    fn rebudget(&mut self, n: u8) {
        let budget = self.budget(n);
        let m = self.members.get_mut(&n).expect("a member");
        if m.stored.len() > budget {
            m.stored.clear();
            m.copies.clear();
        }
        while m.lru.len() > budget {
            m.lru.remove(0);
        }
    }

    fn expire(lru: &mut Vec<((u8, u8), u64)>, now: u64) {
        lru.retain(|&(_, t)| now - t < BUDGET.approximate_ttl_ms);
    }

    /// Returns the change, or `None` when the view is refused.
    fn view(&mut self, view: &[Member]) -> Option<Membership> {
        let new = view
            .iter()
            .filter(|m| !self.members.contains_key(&m.n))
            .count();
        if self.members.len() + new > MAX_ENDPOINTS {
            return None;
        }
        let mut next = BTreeMap::new();
        let mut added = Vec::new();
        for m in view {
            let mut r = match self.members.get(&m.n) {
                Some(old) => {
                    let mut r = old.clone();
                    if r.precise != m.precise {
                        r.clear();
                    }
                    r
                }
                None => {
                    added.push(id(m.n));
                    Ref {
                        state: EndpointState::Ready,
                        precise: m.precise,
                        configured: None,
                        stored: BTreeMap::new(),
                        copies: BTreeMap::new(),
                        lru: Vec::new(),
                    }
                }
            };
            r.precise = m.precise;
            r.configured = m.configured;
            r.state = if !m.serving {
                EndpointState::Draining
            } else if r.state == EndpointState::Stale {
                EndpointState::Stale
            } else {
                EndpointState::Ready
            };
            next.insert(m.n, r);
        }
        let removed = self
            .members
            .keys()
            .filter(|n| !next.contains_key(n))
            .map(|&n| id(n))
            .collect();
        self.members = next;
        self.loads.retain(|n, _| self.members.contains_key(n));
        for n in self.members.keys().copied().collect::<Vec<_>>() {
            self.rebudget(n);
        }
        Some(Membership { added, removed })
    }

    fn batch(&mut self, n: u8, events: &[Ev]) {
        let Some(budget) = self
            .members
            .get(&n)
            .filter(|m| m.precise)
            .map(|_| self.budget(n))
        else {
            return;
        };
        let m = self.members.get_mut(&n).expect("a member");
        for e in events {
            match *e {
                Ev::Store { doc, from, len } => {
                    let to = (from + len).min(BLOCKS);
                    if from > 0 && !m.stored.contains_key(&engine_hash(doc, from - 1)) {
                        continue; // an orphan: its parent is not known here
                    }
                    for i in from..to {
                        let h = engine_hash(doc, i);
                        if m.stored.insert(h, (doc, i)).is_some()
                            && (m.copies.len() < budget || m.copies.contains_key(&h))
                        {
                            *m.copies.entry(h).or_insert(0) += 1;
                        }
                    }
                    if m.stored.len() > budget {
                        m.clear();
                        return; // the rest of the batch belongs to the dropped view
                    }
                }
                Ev::Remove { doc, block } => {
                    let h = engine_hash(doc, block);
                    match m.copies.get_mut(&h) {
                        Some(n) => {
                            *n -= 1;
                            if *n == 0 {
                                m.copies.remove(&h);
                            }
                        }
                        None => {
                            m.stored.remove(&h);
                        }
                    }
                }
                Ev::ClearAll => m.clear(),
            }
        }
    }

    fn routed(&mut self, n: u8, d: u8, len: u8) {
        let Some(budget) = self
            .members
            .get(&n)
            .filter(|m| !m.precise)
            .map(|_| self.budget(n))
        else {
            return;
        };
        let now = self.now;
        let m = self.members.get_mut(&n).expect("a member");
        let keep = usize::from(len).min(budget) as u8;
        for i in (0..keep).rev() {
            m.lru.retain(|&(b, _)| b != (d, i));
            m.lru.push(((d, i), now));
        }
        while m.lru.len() > budget {
            m.lru.remove(0);
        }
        Model::expire(&mut m.lru, now);
    }

    /// How many leading blocks of document `d` each member is credited with.
    fn prefix(&self, d: u8) -> BTreeMap<u8, u32> {
        let mut out = BTreeMap::new();
        for (&n, m) in &self.members {
            let run = (0..BLOCKS).take_while(|&i| m.holds((d, i))).count() as u32;
            if run > 0 {
                out.insert(n, run);
            }
        }
        out
    }
}

fn batch(events: &[Ev]) -> EventBatch {
    let events = events
        .iter()
        .map(|e| match *e {
            Ev::Store { doc, from, len } => {
                let to = (from + len).min(BLOCKS);
                KvEvent::plain_stored(
                    (from..to).map(|i| engine_hash(doc, i)).collect(),
                    (from > 0).then(|| engine_hash(doc, from - 1)),
                    tokens(doc, from, to),
                    BLOCK_SIZE,
                )
            }
            Ev::Remove { doc, block } => KvEvent::BlockRemoved {
                block_hashes: vec![engine_hash(doc, block)],
                medium: None,
                place: Default::default(),
            },
            Ev::ClearAll => KvEvent::AllBlocksCleared,
        })
        .collect();
    EventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: None,
        skipped_unknown: 0,
    }
}

fn members(view: &[Member], config: &Arc<ModelConfig>) -> Vec<PoolMember> {
    view.iter()
        .map(|m| {
            let mut endpoint = Endpoint::new(id(m.n), config.clone());
            if !m.serving {
                endpoint.state = EndpointState::Draining;
            }
            PoolMember {
                endpoint,
                precise: m.precise,
                kv_capacity_blocks: m.configured,
            }
        })
        .collect()
}

/// A view names each endpoint once (the service refuses duplicates before this point).
fn dedup(view: Vec<Member>) -> Vec<Member> {
    let mut seen = BTreeSet::new();
    view.into_iter().filter(|m| seen.insert(m.n)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_pool_state_matches_its_reference_model(ops in prop::collection::vec(op(), 1..60)) {
        let settings = PoolSettings {
            index: IndexConfig {
                max_endpoints: MAX_ENDPOINTS,
                ..Default::default()
            },
            budget: BUDGET,
            ..PoolSettings::default()
        };
        let whole = Pool::new(settings, Router::new(RoutingConfig::default()));
        let pool = whole.state();
        let mut version = pool.version();
        // requests in flight: (endpoint, the endpoint's membership epoch then, guard); an
        // endpoint that leaves starts a new epoch, and what began before it counts no more
        let mut inflight: Vec<(u8, u32, InflightGuard)> = Vec::new();
        let mut epochs: BTreeMap<u8, u32> = BTreeMap::new();
        let mut pins: BTreeMap<u8, u8> = BTreeMap::new();
        let config = Arc::new(ModelConfig::new("c", MODEL));
        let keys = IngestKeys { hasher: BlockHasher::new(BLOCK_SIZE), model: MODEL };
        let docs: Vec<Vec<BlockKey>> = (0..DOCS).map(doc_keys).collect();
        let mut model = Model::default();
        for op in ops {
            let mut wakes = false;
            match op {
                Op::View(view) => {
                    let view = dedup(view);
                    let published = std::cell::Cell::new(false);
                    let got = whole
                        .apply_view(members(&view, &config), || published.set(true))
                        .ok();
                    let want = model.view(&view);
                    prop_assert_eq!(published.get(), want.is_some(), "publish runs once a view is accepted");
                    wakes = want.is_some();
                    // a departed endpoint is forgotten by every table
                    for gone in want.iter().flat_map(|m| &m.removed) {
                        *epochs.entry(number(gone)).or_default() += 1;
                        pins.retain(|_, n| *n != number(gone));
                    }
                    prop_assert_eq!(got, want);
                }
                Op::Batch(n, events) => {
                    let applied = pool.apply_batch(&id(n), keys, &batch(&events));
                    let precise = model.members.get(&n).is_some_and(|m| m.precise);
                    prop_assert_eq!(applied.is_some(), precise, "only a precise member takes events");
                    model.batch(n, &events);
                }
                Op::Clear(n, cause) => {
                    let want = model.members.get_mut(&n).map_or(0, |m| {
                        let held = m.len();
                        m.clear();
                        held
                    });
                    prop_assert_eq!(pool.clear(&id(n), cause), want);
                }
                Op::Resync(n, survived) => {
                    let reason = if survived {
                        ResyncReason::ReplayShort { requested: 7, first: Some(9) }
                    } else {
                        ResyncReason::PublisherRestarted { expected: 7, got: 0 }
                    };
                    // lost batches keep what the view holds; a restart drops it
                    let want = if survived {
                        Resynced::Kept
                    } else {
                        Resynced::Cleared(model.members.get_mut(&n).map_or(0, |m| {
                            let held = m.len();
                            m.clear();
                            held
                        }))
                    };
                    prop_assert_eq!(pool.resync(&id(n), &reason), want);
                }
                Op::Learn(n, capacity) => {
                    let load = EndpointLoad {
                        kv_capacity_blocks: capacity,
                        sampled_at_ms: model.now,
                        ..EndpointLoad::default()
                    };
                    pool.learn_loads([(id(n), load)]);
                    if model.members.contains_key(&n) {
                        model.loads.insert(n, capacity);
                        model.rebudget(n);
                    }
                }
                Op::Stale(n, stale) => {
                    let changes = pool.set_stale(&[(id(n), stale)]);
                    let mut want = Vec::new();
                    if let Some(m) = model.members.get_mut(&n) {
                        let next = match (m.state, stale) {
                            (EndpointState::Ready, true) => Some(EndpointState::Stale),
                            (EndpointState::Stale, false) => Some(EndpointState::Ready),
                            _ => None,
                        };
                        if let Some(next) = next {
                            m.state = next;
                            // a precise view is the feed's to clear (its sequence shows a
                            // restart or a loss); staleness clears only an approximate one
                            let clears = stale && !m.precise;
                            let dropped = if clears { m.len() } else { 0 };
                            if clears {
                                m.clear();
                            }
                            want.push((n, stale, dropped));
                        }
                    }
                    wakes = !want.is_empty();
                    let got: Vec<_> = changes
                        .iter()
                        .map(|c| (number(&c.endpoint), c.stale, c.dropped))
                        .collect();
                    prop_assert_eq!(got, want);
                }
                Op::Routed(n, d, len) => {
                    pool.record_routed(&id(n), &docs[usize::from(d)][..usize::from(len)], model.now);
                    model.routed(n, d, len);
                }
                Op::Begin(n) => {
                    // a non-member's request is counted nowhere (no entry outlives an endpoint)
                    let epoch = if model.members.contains_key(&n) {
                        epochs.get(&n).copied().unwrap_or_default()
                    } else {
                        u32::MAX
                    };
                    inflight.push((n, epoch, whole.begin(id(n), 4, 4, true)));
                }
                Op::End(k) => {
                    if !inflight.is_empty() {
                        drop(inflight.remove(k % inflight.len()));
                    }
                }
                Op::Pin(s, n) => {
                    whole.pin(session_key(s), id(n), 8, model.now);
                    pins.insert(s, n);
                }
                Op::Advance(dt) => {
                    model.now += dt;
                    pool.expire(model.now);
                    for m in model.members.values_mut() {
                        Model::expire(&mut m.lru, model.now);
                    }
                }
            }
            let now_version = pool.version();
            prop_assert_eq!(now_version != version, wakes, "the version moves exactly on a change");
            version = now_version;

            // after every step: in-flight counts, pins, calibration's pool
            for n in 0..ENDPOINTS {
                let epoch = epochs.get(&n).copied().unwrap_or_default();
                let want = inflight.iter().filter(|(m, e, _)| *m == n && *e == epoch).count() as u64;
                prop_assert_eq!(whole.inflight().get(&id(n)).requests, want, "in flight on {}", n);
            }
            for s in 0..SESSIONS {
                prop_assert_eq!(whole.pinned(session_key(s)), pins.get(&s).map(|&n| id(n)), "session {}", s);
            }
            let calibrated: BTreeSet<u8> = whole
                .calibration()
                .read()
                .statuses()
                .map(|(e, _)| number(&e))
                .collect();
            let members_now: BTreeSet<u8> = model.members.keys().copied().collect();
            prop_assert_eq!(calibrated, members_now, "calibration follows the pool");

            // members and states, credited blocks, loads
            let read = pool.read();
            let states: BTreeMap<u8, EndpointState> = read
                .endpoints
                .endpoints()
                .iter()
                .map(|e| (number(&e.id), e.state))
                .collect();
            let want: BTreeMap<u8, EndpointState> =
                model.members.iter().map(|(&n, m)| (n, m.state)).collect();
            prop_assert_eq!(states, want);
            let index = read.index();
            let tracked: BTreeSet<u8> = index.endpoints().map(|(_, id)| number(&id)).collect();
            prop_assert_eq!(&tracked, &model.members.keys().copied().collect::<BTreeSet<_>>());
            for (&n, m) in &model.members {
                let slot = index.slot(&id(n)).expect("a member is tracked");
                prop_assert_eq!(index.endpoint_blocks(slot), m.len(), "blocks of endpoint {}", n);
            }
            for (d, keys) in docs.iter().enumerate() {
                let mut matches: Vec<PrefixMatch> = Vec::new();
                index.longest_prefix(keys, &mut matches);
                let got: BTreeMap<u8, u32> = matches
                    .iter()
                    .map(|pm| (number(&index.endpoint_id(pm.slot).expect("live slot")), pm.blocks))
                    .collect();
                prop_assert_eq!(got, model.prefix(d as u8), "prefix of document {}", d);
            }
            for n in 0..ENDPOINTS {
                prop_assert_eq!(
                    read.loads().get(&id(n)).map(|l| l.kv_capacity_blocks),
                    model.loads.get(&n).copied(),
                    "load of endpoint {}", n
                );
            }
            let live: usize = model.members.values().map(Ref::len).sum();
            prop_assert_eq!(index.live_blocks(), live);
        }
    }
}
